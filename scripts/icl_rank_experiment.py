"""The in-context-regression test of the paper's rank claim (Kuang et al. 2025 §2.2, §4, Fig. 2, 3a) and its
equal-compute comparison (Fig. 3b).

Claim: multi-head dense attention whose head dim r is well below the input dim d cannot solve in-context linear
regression, while at the same width full-rank scores (1-head dense, bilinear BTT) can; and (Fig. 3b) at a fixed width
the bilinear scores reach a lower error than dense attention for the same training FLOPs. Arms at d (divisible by 4),
width D = 6d unless noted (d = 4: D = 24), 6 layers, q/k RMSNorm:

  (i)   dense, 12 heads, r = d/2                     the failing arm (the paper: r must be "nearly" d)
  (ii)  dense, 1 head, r = D
  (iii) bilinear BTT, 8 heads (full-rank score, D)
  (iv)  bilinear MLR, 8 heads, ranks d/4 | d/2 (sum p_l r_l = 5d/4 >= d)   reported, not ruled on (module below)
  (v)   dense, 3 heads, r = 2d                       rank control: same width as (i), only the head split differs
  (vi)  dense, 8 heads, r = 2d at D = 16d            width control (reported, not ruled on)

Every arm starts with the same logit scale: each score is divided by the square root of its width (1/sqrt(r)
dense, 1/sqrt(D) BTT, 1/sqrt(p_l r_l) per bilinear-MLR level times 1/sqrt(L) for its L summed levels), so the
row-centred logits have RMS ~1 at init in every arm (``describe`` measures it with
``hf_structattn.mup.attention_logit_rms``). The decision rules are in scripts/icl_rank_report.py and docs/results.md.

    python scripts/icl_rank_experiment.py describe --d 4          # arms: score rank, init logit RMS, parameters
    python scripts/icl_rank_experiment.py plan --d 4 [--shards]   # runs and FLOPs; the shards and their minutes
    python scripts/icl_rank_experiment.py time --d 4              # CPU ms/step per arm: batched vs separate runs
    python scripts/icl_rank_experiment.py pilot --device cuda --budget-s 170 --out outputs/icl_pilot
    python scripts/icl_rank_experiment.py shard c1 --d 4 --device cpu --jobs 2    # a CPU shard (2 runs)
    python scripts/icl_rank_experiment.py shard g1 --d 4 --device cuda --jobs 3   # a GPU shard (3 arms x 9 runs)
    python scripts/icl_rank_experiment.py run --d 4 --device cuda --jobs 6        # the whole d = 4 sweep at once
    python scripts/icl_rank_experiment.py report --d 4            # table, FLOPs to error 0.1, plot, verdicts, left
    python scripts/icl_rank_experiment.py run --d 8 --device cuda --jobs 6        # the d = 8 stage
    python scripts/icl_rank_experiment.py earlier-ranks      # score rank of the models of docs/results.md §1, §1b

**Batched.** The runs of one arm (its LRs x seeds) train as ONE stacked model
(``hf_structattn.training.batched.StackedRuns``: ``torch.func.functional_call`` + ``vmap`` over stacked parameters,
AdamW over stacked moments, per-run learning rates, clipping and data streams), so one step launches one set of
kernels for all of the arm's runs; ``run`` and ``shard`` train ``--jobs`` arms at a time (one process each). Each
run evaluates every ``--eval_every`` (250) steps on 1024 fresh prompts (a random stream training never draws from),
is frozen once solved (last-query error < 0.05; its parameters stop changing, as a separate run that stopped would),
writes its evaluations to ``<out>/d<d>/<run>/progress.jsonl`` as it goes and, at the end, ``result.json`` there and
its committed record ``results/icl_rank/d<d>/<run>.json`` (result and evaluations, a few KB); runs that have the
latter are skipped. The arm writes a resumable checkpoint every 1000 steps under ``<out>/d<d>/`` and a rerun resumes
it. Shards (``scripts/icl_rank_arms.py``): c1-c27, two runs each, for the CPU cores here; g1, g2, three arms each,
for a GPU (``--budget-s`` 420 by default there; a rerun resumes). Task, curriculum and warm-up
follow the authors' ICL scripts (x ~ N(0, I/d), w ~ N(0, I), N = 2d points, a curriculum over the first 6 % of the
steps, linear warm-up then constant LR, AdamW beta (0.9, 0.95), batch 64, 6 layers), scaled to ``--steps``.

**Pilot.** ``pilot`` trains (ii) and (v) at one LR and one seed for the deciding step count (20,000 at d = 4), both
arms interleaved in one process, within ``--budget-s`` seconds of wall time, and writes ``pilot.md`` (a short summary
to paste into a report) and ``pilot.json`` to ``--out``: whether the controls solve the task within the deciding
steps, the
measured ms per step and the full sweep's projected time on this device (on a GPU also into
``results/icl_rank/d<d>/pilot.json``, which ``plan --shards`` sizes the GPU shards by). ``--tiny`` (2 layers, 30
steps, 128 evaluation prompts) is the CPU rehearsal the tests run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_structattn import StructAttnGPT2Config, StructAttnGPT2ForInContextRegression
from hf_structattn.diagnostics import effective_rank
from hf_structattn.flops import flops_per_token
from hf_structattn.mup import attention_logit_rms
from hf_structattn.training.batched import StackedRuns
from hf_structattn.training.sweep import device_name, write_run_json
from hf_structattn.training.icl import sample_prompts
from icl_rank_arms import DECIDING_LRS, DECIDING_SEEDS, LABELS, arms, shards  # scripts/icl_rank_arms.py

EARLY_STOP = 0.05
BATCH, EVAL_PROMPTS, LAYERS, CHECKPOINT_EVERY, EVAL_EVERY = 64, 1024, 6, 1000, 250
RESULTS = Path("results/icl_rank")  # one small JSON per finished run, committed: results/icl_rank/d<d>/<run>.json
# d -> deciding steps. d = 4: the two controls measured at lr 1e-3, seed 0 (40k-step schedule, CPU) froze below 0.05
# at steps 13,000 and 13,500; 20,000 is that times 1.5 (the stated margin). d = 8 doubles it (twice the points and
# dimensions to learn), to be revised by the d = 4 runs' solved-at steps.
DECIDING_STEPS = {4: 20_000, 8: 40_000}
DECIDING_LRS, DECIDING_SEEDS = list(DECIDING_LRS), list(DECIDING_SEEDS)
# shard time estimates: ms per step of ONE run. CPU: one thread, the slowest separate-run step measured on this
# machine (44-125 ms) until a results file of the arm gives its own; GPU: an arm's stacked step with CUDA graphs
# (upper end of the 7.5-18 ms a step the design's launch-bound estimate gives), eager about 3x that
CPU_MS_PER_STEP, GPU_MS_PER_STEP_GRAPHS, GPU_EAGER_FACTOR = 125.0, 18.0, 3.0
SHARD_BUDGET_S = 420  # a GPU shard's default --budget-s: within the 8 minutes a shard may take, imports included
PILOT_ARMS, PILOT_LR, PILOT_SEED = ("ii_dense1", "v_dense3_rank"), 1e-3, 0
TINY = dict(layers=2, steps=30, eval_every=10, eval_count=128)  # the pilot's CPU rehearsal
CHUNK = 250  # steps whose data is drawn and moved to the device at once


def deciding_steps(d: int) -> int:
    return DECIDING_STEPS.get(d, 20_000 * d // 2)


def earlier_arms(d: int) -> dict[str, dict]:
    """The five arms of the §1c runs (script as of 8bc2f46), for ``describe --earlier``: r = d - 1 < d at 8 heads,
    the capacity control wider, and the authors' logit scales (8/r for 8-head dense)."""
    width, low = 8 * (d - 1), d - 1
    return {
        "i_dense8_low": dict(n_embd=width, n_head=8, attention="dense", dense_scaling=8.0 / low),
        "ii_dense1": dict(n_embd=width, n_head=1, attention="dense"),
        "iii_btt8": dict(n_embd=width, n_head=8, attention="bilinear_btt", btt_rank=1),
        "iv_mlr8": dict(n_embd=width, n_head=8, attention="bilinear_mlr", bilinear_mlr_ranks=[1, 2]),
        "v_dense8_high": dict(n_embd=16 * d, n_head=8, attention="dense", dense_scaling=8.0 / (2 * d)),
    }


def score_rank(d: int, arm: str) -> int:
    """The nominal rank of the arm's score form (what ``effective_rank`` should measure)."""
    fields = arms(d)[arm]
    if fields["attention"] == "dense":
        return fields["n_embd"] // fields["n_head"]
    if fields["attention"] == "bilinear_btt":
        return fields["n_embd"]
    return min(fields["n_embd"], sum(2 ** level * rank for level, rank in enumerate(fields["bilinear_mlr_ranks"])))


def build(d: int, arm: str, earlier: bool = False, layers: int = LAYERS) -> StructAttnGPT2ForInContextRegression:
    fields = dict(vocab_size=1, n_positions=4 * d, n_layer=layers, icl_input_dim=d, qk_layernorm=True,
                  qk_norm="rms", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0, **(earlier_arms(d) if earlier else arms(d))[arm])
    return StructAttnGPT2ForInContextRegression(StructAttnGPT2Config(**fields))


def schedule(step: int, steps: int, d: int, lr: float) -> tuple[float, int, int]:
    """(learning rate, active dims, points) at ``step``: warm-up over 1 % of the steps, then constant; curriculum
    dims d/2 -> d and points d -> 2d in two equal stages ending at 6 % of the steps (authors: 15 stages over the
    first 6 % of 500k steps, warm-up 1000 steps)."""
    warmup = max(1, steps // 100)
    rate = lr * min(1.0, (step + 1) / warmup)
    stage = min(2, step // max(1, round(0.03 * steps)))
    start_dims, start_points = max(1, d // 2), d
    dims = min(d, start_dims + math.ceil(stage * (d - start_dims) / 2))
    points = min(2 * d, start_points + stage * (d // 2))
    return rate, dims, points


def generator(seed: int, stream: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + stream * 7_919 + step)


def eval_prompts(d: int, seed: int, count: int = EVAL_PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed fresh evaluation prompts of a seed (xs (count, 2d, d), ys (count, 2d)), at the full d and N."""
    xs, ys, _ = sample_prompts(generator(seed, 3, 0), count, 2 * d, d)
    return xs, ys


def train_batch(d: int, seed: int, step: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training prompts of (seed, step): xs (64, points, d), ys (64, points); the same for every LR."""
    _, dims, points = schedule(step, steps, d, 1.0)
    xs, ys, _ = sample_prompts(generator(seed, 2, step), BATCH, points, d, dims)
    return xs, ys


def training_flops(d: int, arm: str, steps: int, layers: int = LAYERS) -> list[float]:
    """Cumulative training FLOPs after each step 0..steps of one run (``flops_per_token``: matmuls of the transformer
    blocks and the attention terms, read-in and read-out excluded as in the paper's Fig. 3b, backward = 2x forward),
    following the curriculum's prompt length. Returns steps + 1 values, the first 0."""
    config = build(d, arm, layers=layers).config
    per_length = {}
    total, out = 0.0, [0.0]
    for step in range(steps):
        _, _, points = schedule(step, steps, d, 1.0)
        if points not in per_length:
            per_length[points] = flops_per_token(config, 2 * points, training=True) * BATCH * 2 * points
        total += per_length[points]
        out.append(total)
    return out


def loss_of(forward, batch) -> torch.Tensor:
    """The ICL training loss of one run: batch = (xs (B, N, d), ys (B, N))."""
    return forward(xs=batch[0], ys=batch[1]).loss


def predictions_of(forward, batch) -> torch.Tensor:
    return forward(xs=batch[0], ys=batch[1]).predictions


def rank_summary(model, d: int, seed: int) -> dict:
    """Score rank of every head (``effective_rank``) and the RMS of each layer's row-centred attention logits on 64
    evaluation prompts (``attention_logit_rms``), measured on a CPU copy."""
    model = copy.deepcopy(model).cpu()
    heads = effective_rank(model, num_pairs=6)
    xs, ys = eval_prompts(d, seed, 64)
    logit_rms = attention_logit_rms(model, xs=xs, ys=ys)
    return {"span_min": min(h.span for h in heads), "span_max": max(h.span for h in heads),
            "local_min": min(h.local for h in heads), "local_max": max(h.local for h in heads),
            "logit_rms": [round(float(v), 4) for v in logit_rms]}


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}_lr{lr:g}_s{seed}"


def atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


class ArmRunner:
    """The runs (lr, seed) of one arm trained as one stacked model, a chunk of steps at a time (module docstring).

    ``root``: ``<out>/d<d>``; each run writes ``root/<run>/progress.jsonl``, ``rank_init.json`` and, from
    :meth:`finish`, ``result.json``; the stack's checkpoint is ``root/<arm>.stack/checkpoint.pt``. ``dtype`` float64
    is for tests; ``layers`` / ``eval_count`` shrink the model and the evaluation for the CPU rehearsal."""

    def __init__(self, d: int, arm: str, lrs, seeds, steps: int, eval_every: int, root: Path, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, layers: int = LAYERS, eval_count: int = EVAL_PROMPTS,
                 results: Path | None = None, runs=None):
        self.d, self.arm, self.steps, self.eval_every, self.root = d, arm, steps, eval_every, Path(root)
        self.results = None if results is None else Path(results) / f"d{d}"
        # ``runs``: explicit (lr, seed) pairs (a shard's); else every lr x seed
        self.runs = [(float(lr), int(seed)) for lr, seed in runs] if runs is not None else \
            [(float(lr), int(seed)) for seed in seeds for lr in lrs]
        self.seeds = sorted({seed for _, seed in self.runs})
        self.device, self.layers = torch.device(device), layers
        self.config = {"d": d, "arm": arm, "runs": [list(run) for run in self.runs],
                       "steps": steps, "eval_every": eval_every, "layers": layers, "batch": BATCH,
                       "eval_count": eval_count, "dtype": str(dtype)}
        initial = {}
        for seed in self.seeds:  # a separate run seeds torch, then builds its model
            torch.manual_seed(seed)
            initial[seed] = build(d, arm, layers=layers).to(dtype)
        self.params = sum(p.numel() for p in initial[self.seeds[0]].parameters())
        self.stack = StackedRuns(copy.deepcopy(initial[self.seeds[0]]),
                                 [initial[seed].state_dict() for _, seed in self.runs],
                                 [lr for lr, _ in self.runs], betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0,
                                 device=self.device, dtype=dtype, cuda_graphs=self.device.type == "cuda")
        self.run_seed = torch.tensor([self.seeds.index(seed) for _, seed in self.runs], device=self.device)
        evals = [eval_prompts(d, seed, eval_count) for seed in self.seeds]
        self.eval_xs = torch.stack([xs for xs, _ in evals]).to(self.device, dtype).index_select(0, self.run_seed)
        self.eval_ys = torch.stack([ys for _, ys in evals]).to(self.device, dtype).index_select(0, self.run_seed)
        self.step, self.wall_before, self.started = 0, 0.0, time.perf_counter()
        self.solved_at: list = [None] * len(self.runs)
        self.last_eval: list = [None] * len(self.runs)
        self.stack_folder = self.root / f"{arm}_{'_'.join(f'{lr:g}s{seed}' for lr, seed in self.runs)}.stack"
        self.checkpoint = self.stack_folder / "checkpoint.pt"
        self.stack_folder.mkdir(parents=True, exist_ok=True)
        if self.checkpoint.exists():
            state = torch.load(self.checkpoint, map_location=self.device, weights_only=True)
            if state["config"] != self.config:
                raise ValueError(f"{self.checkpoint} was written by another configuration: {state['config']} vs "
                                 f"{self.config}")
            self.stack.load_state_dict(state["stack"])
            self.step, self.wall_before = state["step"], state["wall"]
            self.solved_at, self.last_eval = state["solved_at"], state["last_eval"]
            for folder in self.folders():  # drop evaluations written after the checkpoint
                lines = [line for line in (folder / "progress.jsonl").read_text().splitlines()
                         if line and json.loads(line)["step"] <= self.step]
                (folder / "progress.jsonl").write_text("".join(f"{line}\n" for line in lines))
        else:
            for run, folder in enumerate(self.folders()):
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "progress.jsonl").write_text("")
                (folder / "rank_init.json").write_text(json.dumps(
                    rank_summary(self.stack.run_model(run), d, self.runs[run][1])))
            self.evaluate()

    def folders(self) -> list[Path]:
        return [self.root / run_name(self.arm, lr, seed) for lr, seed in self.runs]

    @property
    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    @property
    def finished(self) -> bool:
        return self.step >= self.steps or all(solved is not None for solved in self.solved_at)

    def evaluate(self) -> None:
        """Evaluate every active run at ``self.step`` on its seed's fixed prompts; freeze the runs that are solved."""
        predictions = torch.cat([self.stack.evaluate(predictions_of, (xs, ys)) for xs, ys in
                                 zip(self.eval_xs.split(256, 1), self.eval_ys.split(256, 1))], 1)
        last = ((predictions[..., -1] - self.eval_ys[..., -1]) ** 2).mean(1) / (self.eval_ys[..., -1] ** 2).mean(1)
        mse_all = ((predictions - self.eval_ys) ** 2).mean((1, 2))
        last, mse_all, wall = last.tolist(), mse_all.tolist(), self.wall  # one host sync per evaluation
        solved = torch.zeros(len(self.runs), dtype=torch.bool)
        for run, folder in enumerate(self.folders()):
            if self.solved_at[run] is not None:
                continue  # frozen: its last evaluation stands
            record = {"step": self.step, "error_last": last[run], "mse_all": mse_all[run], "wall": wall}
            with (folder / "progress.jsonl").open("a") as log:
                log.write(json.dumps(record) + "\n")
            self.last_eval[run] = record
            if record["error_last"] < EARLY_STOP:
                self.solved_at[run] = self.step
                solved[run] = True
        if solved.any():
            self.stack.freeze(solved)

    def next_stop(self) -> int:
        """The end of the next chunk: the next evaluation, checkpoint or curriculum stage, at most CHUNK steps."""
        end = min(self.steps, (self.step // self.eval_every + 1) * self.eval_every,
                  (self.step // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY, self.step + CHUNK)
        shape = schedule(self.step, self.steps, self.d, 1.0)[1:]
        for step in range(self.step + 1, end):
            if schedule(step, self.steps, self.d, 1.0)[1:] != shape:
                return step
        return end

    def advance(self) -> None:
        """Train up to :meth:`next_stop` (one transfer of the chunk's prompts to the device), then evaluate and
        checkpoint when due."""
        end = self.next_stop()
        steps = range(self.step, end)
        prompts = [[train_batch(self.d, seed, step, self.steps) for seed in self.seeds] for step in steps]
        xs = torch.stack([torch.stack([x for x, _ in per_seed]) for per_seed in prompts])  # (K, seeds, B, N, d)
        ys = torch.stack([torch.stack([y for _, y in per_seed]) for per_seed in prompts])  # (K, seeds, B, N)
        if self.device.type == "cuda":  # pinned + non_blocking: no stream sync, the host prepares the next chunk
            xs, ys = xs.pin_memory(), ys.pin_memory()
        xs = xs.to(self.device, self.stack.dtype, non_blocking=True)
        ys = ys.to(self.device, self.stack.dtype, non_blocking=True)
        for index, step in enumerate(steps):
            factor = schedule(step, self.steps, self.d, 1.0)[0]  # warm-up factor; peak LRs live in the stack
            self.stack.train_step(loss_of, (xs[index].index_select(0, self.run_seed),
                                            ys[index].index_select(0, self.run_seed)), factor)
        self.step = end
        if self.step % self.eval_every == 0 or self.step == self.steps:
            self.evaluate()
        if self.step % CHECKPOINT_EVERY == 0 and not self.finished:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        temporary = self.checkpoint.with_name("checkpoint.tmp")
        torch.save({"config": self.config, "stack": self.stack.state_dict(), "step": self.step, "wall": self.wall,
                    "solved_at": self.solved_at, "last_eval": self.last_eval}, temporary)
        os.replace(temporary, self.checkpoint)

    def finish(self) -> list[dict]:
        """Write every run's ``result.json`` (the report reads them) and remove the checkpoint."""
        results = []
        for run, folder in enumerate(self.folders()):
            lr, seed = self.runs[run]
            evals = [json.loads(line) for line in (folder / "progress.jsonl").read_text().splitlines() if line]
            result = {"d": self.d, "arm": self.arm, "lr": lr, "seed": seed, "steps": self.steps,
                      "eval_every": self.eval_every, "layers": self.layers, "batch": BATCH,
                      "final_step": evals[-1]["step"], "solved_at": self.solved_at[run], "final": evals[-1],
                      "best_error_last": min(e["error_last"] for e in evals),
                      "rank_init": json.loads((folder / "rank_init.json").read_text()),
                      "rank_final": rank_summary(self.stack.run_model(run), self.d, seed),
                      "wall_s": self.wall, "params": self.params, "batched_with": len(self.runs),
                      "step_mode": self.stack.graph_status, "device": device_name(str(self.device))}
            atomic_write(folder / "result.json", json.dumps(result, indent=1))
            if self.results is not None:  # the committed copy: the result and every evaluation, a few KB
                write_run_json(self.results / f"{run_name(self.arm, lr, seed)}.json", result, evals)
            results.append(result)
        self.checkpoint.unlink(missing_ok=True)
        return results


def results_file(args, arm: str, lr: float, seed: int) -> Path:
    return Path(args.results) / f"d{args.d}" / f"{run_name(arm, lr, seed)}.json"


def train_arm(args, arm: str, runs) -> list[dict]:
    """The (lr, seed) ``runs`` of ``arm`` without a results file, as one stacked model, resumable, until done or
    ``--budget-s``."""
    todo = [(lr, seed) for lr, seed in runs if not results_file(args, arm, lr, seed).exists()]
    if not todo:
        print(f"{arm}: every run has its results file already; nothing to train", flush=True)
        return []
    runner = ArmRunner(args.d, arm, None, None, args.steps, args.eval_every, Path(args.out) / f"d{args.d}",
                       args.device, layers=args.layers, results=args.results, runs=todo)
    while not runner.finished:
        runner.advance()
        if args.budget_s is not None and runner.wall - runner.wall_before > args.budget_s and not runner.finished:
            runner.save_checkpoint()
            print(f"{arm}: stopped by --budget-s at step {runner.step}; rerun the command to resume", flush=True)
            return []
    return runner.finish()


def launch_all(args, runs) -> None:
    """``runs`` ((arm, lr, seed)), an arm's runs stacked in one model: ``--jobs 1`` trains the arms one after
    another in this process; more jobs run that many arms at a time, one process each (the ``arm`` command). Runs
    with a results file are skipped, so a rerun continues where an interrupted one stopped."""
    by_arm: dict[str, list] = {}
    for arm, lr, seed in runs:
        if not results_file(args, arm, lr, seed).exists():
            by_arm.setdefault(arm, []).append((lr, seed))
    pending = list(by_arm)
    t0 = time.time()
    if args.jobs == 1:
        for arm in pending:
            print(f"[{time.time() - t0:7.0f} s] start {arm} ({len(by_arm[arm])} runs stacked)", flush=True)
            done = train_arm(args, arm, by_arm[arm])
            print(f"[{time.time() - t0:7.0f} s] {'done' if done else 'stopped'} {arm}", flush=True)
        print(f"all arms finished, wall {time.time() - t0:.0f} s", flush=True)
        return
    running: list[tuple[subprocess.Popen, str]] = []
    root = Path(args.out) / f"d{args.d}"
    root.mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            arm = pending.pop(0)
            command = [sys.executable, __file__, "arm", "--d", str(args.d), "--out", args.out, "--arm", arm,
                       "--runs", *(f"{lr:g}:{seed}" for lr, seed in by_arm[arm]), "--steps", str(args.steps),
                       "--eval_every", str(args.eval_every), "--device", args.device, "--layers", str(args.layers),
                       "--results", args.results]
            if args.budget_s is not None:
                command += ["--budget-s", str(args.budget_s)]
            log = (root / f"{arm}.log").open("a")
            running.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), arm))
            print(f"[{time.time() - t0:7.0f} s] start {arm} ({len(by_arm[arm])} runs stacked)", flush=True)
        time.sleep(0.5)
        for process, arm in list(running):
            if process.poll() is not None:
                running.remove((process, arm))
                print(f"[{time.time() - t0:7.0f} s] {'done' if process.returncode == 0 else 'FAILED'} {arm}",
                      flush=True)
    print(f"all arms finished, wall {time.time() - t0:.0f} s", flush=True)


def measured_cpu_ms(args) -> dict:
    """Arm -> ms per step of one run on one CPU thread, from the results files of CPU runs (their wall / steps)."""
    from icl_rank_report import load_runs

    rates: dict[str, list] = {}
    for run in load_runs(Path(args.results) / f"d{args.d}"):
        if str(run.get("device", "")).startswith("cpu") and run["batched_with"] == 1:
            rates.setdefault(run["arm"], []).append(1000 * run["wall_s"] / max(1, run["final_step"]))
    return {arm: max(values) for arm, values in rates.items()}


def cpu_ms(measured: dict, arm: str) -> float:
    """An arm's CPU ms per step: its own measurement, else the slowest measured arm's, else CPU_MS_PER_STEP."""
    return measured.get(arm, max(measured.values(), default=CPU_MS_PER_STEP))


def shard_runs(args, shard_id: str) -> list[tuple[str, float, int]]:
    """The (arm, lr, seed) runs of a shard: ``c<k>``, ``g1``, ``g2`` (icl_rank_arms.shards), or ``x``: the edge
    runs the finished planned runs trigger (scripts/icl_rank_report.py)."""
    if shard_id == "x":
        from icl_rank_report import edge_runs, load_runs

        return edge_runs(load_runs(Path(args.results) / f"d{args.d}", args.steps), DECIDING_SEEDS)
    table = shards(args.d)
    if shard_id not in table:
        raise SystemExit(f"shard: unknown id {shard_id!r}; the shards are {', '.join(table)} and x")
    return table[shard_id]


def plan_shards(args) -> None:
    """Every shard: its runs, training FLOPs, estimated minutes on the 2 CPU cores here and on one H100, done or
    not."""
    from icl_rank_report import load_runs

    done = {(r["arm"], r["lr"], r["seed"]) for r in load_runs(Path(args.results) / f"d{args.d}", args.steps)}
    measured = measured_cpu_ms(args)
    flops = {arm: training_flops(args.d, arm, args.steps)[-1] for arm in arms(args.d)}
    gpu_ms, gpu_source = GPU_MS_PER_STEP_GRAPHS, "estimated"
    pilot_file = Path(args.results) / f"d{args.d}" / "pilot.json"
    if pilot_file.exists():  # a GPU pilot's one-run step; a stacked step of launch-bound kernels costs about that
        pilot_arms = json.loads(pilot_file.read_text())["arms"].values()
        gpu_ms, gpu_source = max(arm["ms_per_step"] for arm in pilot_arms), "measured by the GPU pilot"
    print(f"d = {args.d}, {args.steps:,} steps a run. CPU: one thread per arm process, 2 at a time, at the "
          f"arm's ms/step measured by its CPU results files (else the slowest measured, else {CPU_MS_PER_STEP:g}); "
          "H100: an arm's runs stacked, one process per arm, "
          f"{gpu_ms:g} ms a stacked step ({gpu_source}; eager without CUDA graphs: {GPU_EAGER_FACTOR:g}x); runs "
          "solved early (< 0.05) end sooner, so these are upper bounds.\n")
    print("| shard | runs | done | training FLOPs | CPU, 2 cores (min) | H100, graphs / eager (min) | command |")
    print("|---|---|---|---|---|---|---|")
    for shard_id, runs in shards(args.d).items():
        by_arm: dict[str, int] = {}
        for arm, _, _ in runs:
            by_arm[arm] = by_arm.get(arm, 0) + 1
        cores = [0.0, 0.0]  # arms to the least loaded of two cores, in order
        for arm, count in by_arm.items():
            cores[cores.index(min(cores))] += count * args.steps * cpu_ms(measured, arm) / 60_000
        gpu = args.steps * gpu_ms / 60_000  # the arms run side by side, one process each
        total = sum(flops[arm] for arm, _, _ in runs)
        finished = sum(run in done for run in runs)
        device = "cuda --jobs 3" if shard_id.startswith("g") else "cpu --jobs 2"
        names = ", ".join(f"({a.split('_')[0]}) {lr:g} s{seed}" for a, lr, seed in runs) if len(runs) <= 4 else \
            f"{len(runs)}: arms ({'), ('.join(a.split('_')[0] for a in by_arm)}), every LR and seed"
        print(f"| {shard_id} | {names} | "
              f"{finished}/{len(runs)} | {total:.3g} | {max(cores):.0f} | {gpu:.1f} / {gpu * GPU_EAGER_FACTOR:.0f} | "
              f"`python scripts/icl_rank_experiment.py shard {shard_id} --d {args.d} --device {device}` |")
    print("\nA run is in one c-shard and one g-shard; whichever runs first writes results/icl_rank/d<d>/<run>.json "
          "and the other skips it. Shard x: the edge runs of (i) that the finished runs trigger (report lists them).")


# ------------------------------------------------------------------------------------------------------- the pilot


def pilot(args) -> dict:
    """(ii) and (v) at one LR and one seed, interleaved chunk by chunk in one process, within ``--budget-s``; writes
    ``pilot.md`` and ``pilot.json`` to ``--out`` (module docstring)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = TINY if args.tiny else dict(layers=LAYERS, steps=args.steps, eval_every=args.eval_every,
                                       eval_count=EVAL_PROMPTS)
    started = time.perf_counter()
    root = out / f"d{args.d}"
    runners = [ArmRunner(args.d, arm, [args.lrs[0]], [args.seeds[0]], size["steps"], size["eval_every"], root,
                         args.device, layers=size["layers"], eval_count=size["eval_count"]) for arm in PILOT_ARMS]
    setup = time.perf_counter() - started
    training = {runner.arm: 0.0 for runner in runners}
    stopped_by_budget = False
    while not all(runner.finished for runner in runners):
        for runner in runners:
            if runner.finished:
                continue
            begin = time.perf_counter()
            runner.advance()  # its evaluation syncs the device, so the time is the chunk's real time
            training[runner.arm] += time.perf_counter() - begin
        if time.perf_counter() - started > args.budget_s and not all(runner.finished for runner in runners):
            stopped_by_budget = True
            break
    for runner in runners:
        if runner.finished:
            runner.finish()
    summary = {"command": "pilot", "device": device_name(args.device), "d": args.d, "lr": args.lrs[0],
               "seed": args.seeds[0], "steps_planned": size["steps"], "layers": size["layers"], "tiny": args.tiny,
               "budget_s": args.budget_s, "stopped_by_budget": stopped_by_budget,
               "wall_s": round(time.perf_counter() - started, 2), "setup_s": round(setup, 2), "arms": {}}
    for runner in runners:
        last = runner.last_eval[0]
        summary["arms"][runner.arm] = {
            "label": LABELS[runner.arm], "steps_done": runner.step, "solved_at": runner.solved_at[0],
            "error_last": last["error_last"], "ms_per_step": round(1000 * training[runner.arm] / max(1, runner.step),
                                                                   3),
            "step_mode": runner.stack.graph_status, "params": runner.params}
    mean_ms = sum(arm["ms_per_step"] for arm in summary["arms"].values()) / len(summary["arms"])
    # The sweep: 6 arms, each one stacked model of 9 runs. On a GPU these steps are launch-bound, so a 9-run step
    # costs about what the pilot's 1-run step costs; on a CPU the work grows with the runs (9x). An assumption: the
    # sweep's own log measures it.
    runs_factor = 1 if args.device.startswith("cuda") else len(DECIDING_LRS) * len(DECIDING_SEEDS)
    summary["projection"] = (f"mean measured ms/step x {runs_factor} (a 9-run stacked step "
                             f"{'costs about one run' if runs_factor == 1 else 'costs 9 runs on a CPU'}) x "
                             f"{deciding_steps(args.d):,} steps x 6 arms, one arm at a time")
    summary["projected_sweep_h"] = round(mean_ms * runs_factor / 1000 * deciding_steps(args.d) * len(arms(args.d))
                                         / 3600, 2)
    (out / "pilot.json").write_text(json.dumps(summary, indent=1))
    from hf_structattn.training.sweep import keep_pilot

    keep_pilot(summary, args.device, Path(args.results) / f"d{args.d}")
    (out / "pilot.md").write_text(pilot_markdown(summary))
    print((out / "pilot.md").read_text(), flush=True)
    return summary


def pilot_markdown(summary: dict) -> str:
    """The pilot's summary as a short markdown section (another script pastes it into a report)."""
    size = "tiny CPU rehearsal (2 layers, 30 steps), not a measurement" if summary["tiny"] else \
        f"{summary['layers']} layers, {summary['steps_planned']:,} steps planned"
    stopped = "; **stopped by the budget**" if summary["stopped_by_budget"] else ""
    lines = [f"### ICL rank pilot: (ii) and (v), d = {summary['d']}, lr {summary['lr']:g}, seed {summary['seed']}",
             "", f"Device: {summary['device']}; {size}; budget {summary['budget_s']:g} s, wall "
                 f"{summary['wall_s']:.1f} s (setup {summary['setup_s']:.1f} s){stopped}.",
             "", "| arm | steps done | ms/step | step mode | last-query error | solved at |",
             "|---|---|---|---|---|---|"]
    for arm in summary["arms"].values():
        lines.append(f"| {arm['label']} | {arm['steps_done']:,} | {arm['ms_per_step']:.2f} | {arm['step_mode']} | "
                     f"{arm['error_last']:.3f} | {arm['solved_at'] if arm['solved_at'] is not None else '-'} |")
    solved = [arm["solved_at"] is not None for arm in summary["arms"].values()]
    if summary["tiny"]:
        answer = "not asked: a rehearsal of the command at tiny size"
    elif all(solved):
        answer = "yes: both controls solve the task (error < 0.05) within the planned steps"
    elif summary["stopped_by_budget"]:
        answer = "not known: the budget ended first"
    else:
        answer = "no: a control did not reach 0.05 within the planned steps (the sweep would be UNDECIDED)"
    lines += ["", f"Do the planned steps suffice for the controls at this LR and seed? {answer}.",
              f"Projected d = {summary['d']} sweep on this device: {summary['projected_sweep_h']:.2f} h "
              f"({summary['projection']}).", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- timing


def step_timing(d: int, arm_names, lrs, seeds, repeats: int = 6) -> dict[str, dict]:
    """CPU thread time (one thread) of one training step of each arm's runs, separate (R models, torch AdamW, SDPA,
    as §1d's one-process-per-run runner) against batched (one ``StackedRuns`` step), the two interleaved in one
    process; the first repeat is a warm-up and not counted. Also the operators each dispatches per step."""
    results = {}
    runs = [(lr, seed) for seed in seeds for lr in lrs]
    for arm in arm_names:
        separate, optimizers = [], []
        for lr, seed in runs:
            torch.manual_seed(seed)
            separate.append(build(d, arm))
            optimizers.append(torch.optim.AdamW(separate[-1].parameters(), lr=lr, betas=(0.9, 0.95),
                                                weight_decay=0.0))
        stack = StackedRuns(build(d, arm), [m.state_dict() for m in separate], [lr for lr, _ in runs])
        seed_index = torch.tensor([seeds.index(seed) for _, seed in runs])
        totals = {"separate": 0.0, "batched": 0.0}
        for repeat in range(repeats):
            batches = [train_batch(d, seed, 10_000 + repeat, 40_000) for seed in seeds]
            xs = torch.stack([x for x, _ in batches]).index_select(0, seed_index)
            ys = torch.stack([y for _, y in batches]).index_select(0, seed_index)
            begin = time.thread_time()
            for run, (model, optimizer) in enumerate(zip(separate, optimizers)):
                loss = model(xs=xs[run], ys=ys[run]).loss
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            middle = time.thread_time()
            stack.train_step(loss_of, (xs, ys), 1.0)
            end = time.thread_time()
            if repeat:
                totals["separate"] += middle - begin
                totals["batched"] += end - middle
        results[arm] = {"runs": len(runs), **{k: v / (repeats - 1) for k, v in totals.items()},
                        "ops_separate_run": ops_per_step(lambda: separate_step(separate[0], optimizers[0], xs[0],
                                                                               ys[0])),
                        "ops_batched": ops_per_step(lambda: stack.train_step(loss_of, (xs, ys), 1.0)),
                        "kernels_batched": ops_per_step(lambda: stack.train_step(loss_of, (xs, ys), 1.0), True)}
        results[arm].update(host_cost_per_operator(d, arm))
    return results


def host_cost_per_operator(d: int, arm: str, repeats: int = 10) -> dict:
    """Thread time per dispatched operator of one step with ONE prompt and one run, where the arithmetic is
    negligible: what PyTorch's dispatch costs the host per operator, separate (plain autograd) and batched (vmap +
    grad transforms). On a GPU the host pays about this per operator while the kernels are this small."""
    torch.manual_seed(0)
    model = build(d, arm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stack = StackedRuns(build(d, arm), [model.state_dict()], [1e-3])
    xs, ys = (t[:1] for t in train_batch(d, 0, 10_000, 40_000))

    def separate():
        separate_step(model, optimizer, xs, ys)

    def batched():
        stack.train_step(loss_of, (xs[None], ys[None]), 1.0)

    out = {}
    for name, step in (("separate", separate), ("batched", batched)):
        step()
        begin = time.thread_time()
        for _ in range(repeats):
            step()
        out[f"host_us_per_op_{name}"] = (time.thread_time() - begin) / repeats / ops_per_step(step) * 1e6
    return out


def separate_step(model, optimizer, xs, ys) -> None:
    loss = model(xs=xs, ys=ys).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


# operators that only re-describe memory (views, shape queries): no kernel runs for them on a GPU
VIEW_OPERATORS = {"aten::view", "aten::_unsafe_view", "aten::alias", "aten::detach", "aten::expand", "aten::t",
                  "aten::transpose", "aten::permute", "aten::slice", "aten::select", "aten::unsqueeze",
                  "aten::squeeze", "aten::reshape", "aten::as_strided", "aten::split", "aten::unbind",
                  "aten::split_with_sizes", "aten::_reshape_alias", "aten::unflatten", "aten::flatten",
                  "aten::movedim", "aten::narrow", "aten::chunk", "aten::view_as", "aten::expand_as",
                  "aten::result_type", "aten::empty", "aten::empty_like", "aten::to", "aten::lift_fresh",
                  "aten::promote_types", "aten::is_same_size", "aten::size", "aten::stride", "aten::dim"}


def ops_per_step(step, computing: bool = False) -> int:
    """PyTorch operators one call of ``step`` dispatches, counted by ``torch.profiler`` as the ``aten::`` calls not
    made inside another one (``computing``: only those that are not views, i.e. about one kernel each on a GPU).
    At these sizes a GPU step costs about one host dispatch per operator and one short kernel per computing one."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    return sum(1 for event in profiler.events() if event.name.startswith("aten::")
               and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))
               and not (computing and event.name in VIEW_OPERATORS))


def time_arms(args) -> None:
    """Batched vs separate CPU step time of each arm, and the sweep's cost on this CPU from them."""
    results = step_timing(args.d, args.arms, args.lrs, args.seeds)
    print("| arm | runs | separate runs, ms/step (sum over runs) | batched, ms/step | speed-up | operators/step, one "
          "separate run | operators/step, batched (computing) | host us/operator, separate / batched (1 prompt) |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, row in results.items():
        print(f"| {LABELS[arm]} | {row['runs']} | {row['separate'] * 1000:.1f} | {row['batched'] * 1000:.1f} | "
              f"{row['separate'] / row['batched']:.2f}x | {row['ops_separate_run']:,} | {row['ops_batched']:,} "
              f"({row['kernels_batched']:,}) | "
              f"{row['host_us_per_op_separate']:.1f} / {row['host_us_per_op_batched']:.1f} |")
    for mode in ("separate", "batched"):
        hours = sum(row[mode] for row in results.values()) * args.steps / args.jobs / 3600
        print(f"sweep {mode}: {len(results)} arms x {len(args.lrs)} LRs x {len(args.seeds)} seeds x {args.steps:,} "
              f"steps: {hours:.1f} h of wall with {args.jobs} cores at these thread times")


def plan(args) -> None:
    """The sweep's size: per arm its parameters and a run's training FLOPs at ``--steps``; the total."""
    print(f"| arm | params | FLOPs per run ({args.steps:,} steps) | runs |")
    print("|---|---|---|---|")
    total = 0.0
    for arm in args.arms:
        flops = training_flops(args.d, arm, args.steps)[-1]
        runs = len(args.lrs) * len(args.seeds)
        total += flops * runs
        print(f"| {LABELS[arm]} | {sum(p.numel() for p in build(args.d, arm).parameters()):,} | {flops:.3g} | "
              f"{runs} |")
    print(f"\nd = {args.d}: {len(args.arms)} arms x {len(args.lrs)} LRs x {len(args.seeds)} seeds = "
          f"{len(args.arms) * len(args.lrs) * len(args.seeds)} runs of {args.steps:,} steps, {total:.3g} training "
          "FLOPs (launch-bound on a GPU: the time follows the operators per step, see the time command)")


def describe(args) -> None:
    """The arms: width, heads, head dim, nominal and measured score rank, init logit RMS, parameters
    (``--earlier``: the five arms of the §1c runs)."""
    print("| arm | D | heads | r = D/heads | score rank (nominal) | span rank measured (local) | init logit RMS, "
          "layers 1..6 | params |")
    print("|---|---|---|---|---|---|---|---|")
    table = earlier_arms(args.d) if args.earlier else {arm: arms(args.d)[arm] for arm in args.arms}
    for arm, fields in table.items():
        torch.manual_seed(0)
        model = build(args.d, arm, earlier=args.earlier)
        summary = rank_summary(model, args.d, 0)
        nominal = "-" if args.earlier else score_rank(args.d, arm)
        print(f"| {arm if args.earlier else LABELS[arm]} | {fields['n_embd']} | {fields['n_head']} | "
              f"{fields['n_embd'] // fields['n_head']} | {nominal} | {summary['span_min']} ({summary['local_min']}) | "
              f"{' '.join(f'{v:.2f}' for v in summary['logit_rms'])} | "
              f"{sum(p.numel() for p in model.parameters()):,} |")


def ranks_of_earlier_runs() -> None:
    """Effective score rank of the models of docs/results.md §1 and §1b (q/k LayerNorm, as run) and with RMSNorm."""
    variants = {"dense8": dict(attention="dense", n_head=8), "dense1": dict(attention="dense", n_head=1),
                "btt8": dict(attention="bilinear_btt", n_head=8, btt_rank=1)}
    mlr_ranks = {16: [1, 1], 32: [2, 1, 1], 64: [4, 2, 1, 1], 128: [8, 4, 2, 2]}
    print("| d | variant | D | nominal r | span rank, LayerNorm (as run) | span rank, RMSNorm | r >= d as run? |")
    print("|---|---|---|---|---|---|---|")
    for d, widths in ((8, (32, 64, 128)), (16, (64, 128))):
        for name in ("dense8", "dense1", "btt8", "mlr8"):
            for width in widths:
                if width == 128 and name != "dense8":
                    continue
                fields = variants.get(name) or dict(attention="bilinear_mlr", n_head=8,
                                                    bilinear_mlr_ranks=mlr_ranks[width])
                spans = []
                for norm in ("layernorm", "rms"):
                    torch.manual_seed(0)
                    model = StructAttnGPT2ForInContextRegression(StructAttnGPT2Config(
                        vocab_size=1, n_positions=4 * d, n_layer=1, n_embd=width, icl_input_dim=d,
                        qk_layernorm=True, qk_norm=norm, **fields))
                    spans.append(min(head.span for head in effective_rank(model, num_pairs=4)))
                nominal = width if name in ("dense1", "btt8") else width // 8
                if name == "mlr8":
                    nominal = sum(2 ** level * rank for level, rank in enumerate(mlr_ranks[width]))
                print(f"| {d} | {name} | {width} | {nominal} | {spans[0]} | {spans[1]} | "
                      f"{'yes' if spans[0] >= d else '**no**'} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "shard", "arm", "pilot", "plan", "time", "describe", "report",
                                            "earlier-ranks"])
    parser.add_argument("shard_id", nargs="?", help="shard: c1, c2, ..., g1, g2 or x (plan --shards lists them)")
    parser.add_argument("--shards", action="store_true", help="plan: the shards, their FLOPs and minutes")
    parser.add_argument("--runs", nargs="+", help="arm: explicit lr:seed runs (default every --lrs x --seeds)")
    parser.add_argument("--d", type=int, default=4, help="input dim, a multiple of 4")
    parser.add_argument("--out", help="output folder (default: outputs/icl_rank; pilot: outputs/icl_pilot)")
    parser.add_argument("--steps", type=int, help=f"training steps (default: the deciding budget, {DECIDING_STEPS})")
    parser.add_argument("--eval_every", type=int, default=EVAL_EVERY)
    parser.add_argument("--results", default=str(RESULTS), help="run / arm: where each finished run's small JSON "
                        "goes (<results>/d<d>/<run>.json)")
    parser.add_argument("--lrs", type=float, nargs="+", help=f"default {DECIDING_LRS}; pilot {PILOT_LR}")
    parser.add_argument("--seeds", type=int, nargs="+", help=f"default {DECIDING_SEEDS}; pilot {PILOT_SEED}")
    parser.add_argument("--layers", type=int, default=LAYERS, help="run / arm: transformer blocks (the design: 6)")
    parser.add_argument("--jobs", type=int, default=1, help="run: arms at a time (one process each)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<index>")
    parser.add_argument("--arms", nargs="+", help="run / report / time only these arms (default: all six)")
    parser.add_argument("--arm", help="arm: the arm to train")
    parser.add_argument("--budget-s", dest="budget_s", type=float,
                        help="wall seconds after which training stops (pilot default 170; arm/run: a checkpoint "
                             "is kept and a rerun resumes)")
    parser.add_argument("--tiny", action="store_true", help="pilot: the CPU rehearsal (2 layers, 30 steps)")
    parser.add_argument("--figures", default="docs/results/icl_rank_v3")
    parser.add_argument("--earlier", action="store_true", help="describe: the five arms of the §1c runs")
    args = parser.parse_args(argv)
    try:
        arm_names = list(arms(args.d))
    except ValueError as error:
        parser.error(str(error))
    unknown = sorted(set(args.arms or []) - set(arm_names))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; the arms are {', '.join(arm_names)}")
    args.arms = [arm for arm in arm_names if not args.arms or arm in args.arms]
    pilot_command = args.command == "pilot"
    args.out = args.out or ("outputs/icl_pilot" if pilot_command else "outputs/icl_rank")
    args.steps = args.steps if args.steps is not None else deciding_steps(args.d)
    args.lrs = args.lrs or ([PILOT_LR] if pilot_command else DECIDING_LRS)
    args.seeds = args.seeds or ([PILOT_SEED] if pilot_command else DECIDING_SEEDS)
    if pilot_command and args.budget_s is None:
        args.budget_s = 170.0
    if args.command == "shard" and args.device.startswith("cuda") and args.budget_s is None:
        args.budget_s = SHARD_BUDGET_S  # one GPU command; a rerun resumes from the arms' checkpoints
    for name in ("steps", "eval_every", "jobs", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if any(not lr > 0 for lr in args.lrs):
        parser.error(f"--lrs must be positive, got {args.lrs}")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.lrs)) != len(args.lrs):
        parser.error(f"--lrs and --seeds must not repeat, got {args.lrs} and {args.seeds}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda[:index], got {args.device!r}")
    if args.device.startswith("cuda") and args.command in ("run", "arm", "pilot") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    if pilot_command and Path(args.out).exists() and any(Path(args.out).iterdir()):
        parser.error(f"--out {args.out} is not empty: a pilot starts from scratch in a new folder")
    if args.command == "shard" and not args.shard_id:
        parser.error("shard needs an id: c1, c2, ..., g1, g2 or x (plan --shards lists them)")
    if args.runs:
        for text in args.runs:
            parts = text.split(":")
            if len(parts) != 2 or not parts[1].isdigit():
                parser.error(f"--runs: each run is lr:seed, got {text!r}")
    if args.command == "arm" and args.arm not in arm_names:
        parser.error(f"arm needs --arm, one of {', '.join(arm_names)}; got {args.arm!r}")
    torch.set_num_threads(1)
    if args.command == "time":
        time_arms(args)
    elif args.command == "plan":
        plan_shards(args) if args.shards else plan(args)
    elif args.command == "earlier-ranks":
        ranks_of_earlier_runs()
    elif args.command == "describe":
        describe(args)
    elif args.command == "arm":
        runs = [(float(text.split(":")[0]), int(text.split(":")[1])) for text in args.runs] if args.runs else \
            [(lr, seed) for seed in args.seeds for lr in args.lrs]
        for result in train_arm(args, args.arm, runs):
            print(json.dumps({k: result[k] for k in ("arm", "lr", "seed", "final_step", "solved_at")}))
    elif args.command == "run":
        launch_all(args, [(arm, lr, seed) for arm in args.arms for seed in args.seeds for lr in args.lrs])
    elif args.command == "shard":
        launch_all(args, [run for run in shard_runs(args, args.shard_id) if run[0] in args.arms])
    elif args.command == "pilot":
        pilot(args)
    else:
        from icl_rank_report import report  # scripts/icl_rank_report.py

        report(args, training_flops)


if __name__ == "__main__":
    main()
