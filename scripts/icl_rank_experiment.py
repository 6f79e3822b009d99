"""The in-context-regression test of the paper's rank claim (Kuang et al. 2025 §2.2, §4, Fig. 2, 3a) and its
equal-compute comparison (Fig. 3b), as the registered decisive d = 4 design (docs/results.md).

Claim: multi-head dense attention whose head dim r is well below the input dim d cannot solve in-context linear
regression, while at the same width full-rank scores (bilinear BTT, or dense with fewer, wider heads) can. Arms at
d = 4, width D = 6d = 24, 6 layers, q/k RMSNorm (``icl_rank_arms.arms``):

  (i)   dense, 12 heads, r = d/2                     the failing arm (the paper: r must be "nearly" d)
  (ii)  dense, 1 head, r = D                         an observation
  (iii) bilinear BTT, 8 heads (full-rank score, D)
  (v)   dense, 3 heads, r = 2d                       rank control: same width as (i), only the head split differs
  ((iv) bilinear MLR and (vi) a wider dense arm are defined for ``describe``; the design does not run them.)

Every arm starts with the same logit scale: each score is divided by the square root of its width (1/sqrt(r)
dense, 1/sqrt(D) BTT, 1/sqrt(p_l r_l) per bilinear-MLR level times 1/sqrt(L) for its L summed levels), so the
row-centred logits have RMS ~1 at init in every arm (``describe`` measures it with
``hf_structattn.mup.attention_logit_rms``). The runs, caps and shards are in scripts/icl_rank_arms.py, the rules in
scripts/icl_rank_report.py and docs/results.md.

    python scripts/icl_rank_experiment.py shard r1            # one shard: its runs, resumable (plan --shards lists them)
    python scripts/icl_rank_experiment.py report              # the runs, the verdicts, the shards left, the plot
    python scripts/icl_rank_experiment.py plan --shards       # the shards: runs, FLOPs, minutes measured or estimated
    python scripts/icl_rank_experiment.py time                # CPU ms/step of each shard's stack: eager vs compiled
    python scripts/icl_rank_experiment.py describe            # arms: score rank, init logit RMS, parameters
    python scripts/icl_rank_experiment.py run                 # every shard, one after another (--jobs N: N at a time)
    python scripts/icl_rank_experiment.py pilot --device cuda --budget-s 170 --out outputs/icl_pilot
    python scripts/icl_rank_experiment.py earlier-ranks       # score rank of the models of docs/results.md's toy runs

**Batched and compiled.** The runs of one arm in a shard train as ONE stacked model
(``stacked_runs.StackedRuns``: ``torch.func.functional_call`` + ``vmap`` over stacked parameters,
AdamW over stacked moments, per-run learning rates, clipping and data streams); on a CPU the whole step is compiled
with ``torch.compile`` (``--eager`` turns it off; on CUDA the step is a CUDA graph). Each run evaluates every
``--eval_every`` (250) steps on 1024 fresh prompts (a stream no training step draws from: ``generator``), is frozen
once solved (last-query error < 0.05; its parameters stop changing, as a separate run that stopped would), writes
its evaluations to ``<out>/<run>/progress.jsonl`` as it goes and, at the end, ``result.json`` there and its
committed record ``results/icl_rank/decisive_d4/<run>.json`` (result and evaluations, a few KB); runs that have the
latter are skipped. A stack writes a resumable checkpoint every 1000 steps and when ``--budget-s`` (on a CPU 6,600 s
by default, so that a shard's process stays within about two hours) stops it; a rerun resumes it. Task, curriculum
and warm-up follow the authors' ICL scripts (x ~ N(0, I/d), w ~ N(0, I), N = 2d points, a curriculum over the first
6 % of the steps, linear warm-up then constant LR, AdamW beta (0.9, 0.95), batch 64, 6 layers), on a fixed schedule
of ``SCHEDULE_STEPS`` whatever a run's cap.

**Pilot.** ``pilot`` trains (ii) and (v) at lr 1e-3, seed 0, for 20,000 steps, both arms interleaved in one process,
within ``--budget-s`` seconds of wall time, and writes ``pilot.md`` and ``pilot.json`` to ``--out``: whether the
controls solve within the steps, the measured ms per step and the design's projected time on this device (on a GPU
also ``results/icl_rank/decisive_d4/pilot.json``). ``--tiny`` (2 layers, 30 steps, 128 evaluation prompts) is the CPU
rehearsal the tests run.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
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
from stacked_runs import StackedRuns
from sweep import CarriedState, device_name, write_run_json
from hf_structattn.training.icl import sample_prompts
from icl_rank_arms import (DESIGN_D, LABELS, SCHEDULE_STEPS, SHARDS, arms, cap,  # scripts/icl_rank_arms.py
                           design_runs)

EARLY_STOP = 0.05
BATCH, EVAL_PROMPTS, LAYERS, CHECKPOINT_EVERY, EVAL_EVERY = 64, 1024, 6, 1000, 250
RESULTS = Path("results/icl_rank/decisive_d4")  # one small JSON per finished run of the design, committed
CALIBRATION = Path("results/icl_rank/d4")  # seed 0's runs of the earlier design: reported, not ruled on
# shard estimates before a run of the arm has measured its own rate: ms per step of a stack of 3 runs, one CPU thread,
# compiled (scripts/icl_rank_experiment.py time, Intel Xeon VM); a GPU stack's step with CUDA graphs (an estimate)
CPU_MS_PER_STEP = {"i_dense12_half": 60.0, "ii_dense1": 45.0, "iii_btt8": 90.0, "v_dense3_rank": 45.0}
GPU_MS_PER_STEP_GRAPHS = 18.0
CPU_SHARD_BUDGET_S, GPU_SHARD_BUDGET_S = 6_600, 420  # a shard process's default --budget-s
PILOT_ARMS, PILOT_LR, PILOT_SEED = ("ii_dense1", "v_dense3_rank"), 1e-3, 0
TINY = dict(layers=2, steps=30, eval_every=10, eval_count=128)  # the pilot's CPU rehearsal
CHUNK = 250  # steps whose data is drawn and moved to the device at once


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
    """(learning rate, active dims, points) at ``step`` of a schedule of ``steps`` (the design: SCHEDULE_STEPS,
    whatever a run's cap): warm-up over 1 % of the steps, then constant; curriculum dims d/2 -> d and points
    d -> 2d in two equal stages ending at 6 % of the steps (authors: 15 stages over the first 6 % of 500k steps,
    warm-up 1000 steps)."""
    warmup = max(1, steps // 100)
    rate = lr * min(1.0, (step + 1) / warmup)
    stage = min(2, step // max(1, round(0.03 * steps)))
    start_dims, start_points = max(1, d // 2), d
    dims = min(d, start_dims + math.ceil(stage * (d - start_dims) / 2))
    points = min(2 * d, start_points + stage * (d // 2))
    return rate, dims, points


TRAIN_STREAM, EVAL_STREAM = 2, 3


def generator_seed(seed: int, stream: int, step: int) -> int:
    """The torch seed of (run seed, stream, step): 63 bits of a hash of the triple, so two triples share a seed
    only by a hash collision (~1e-9 over the design's 3e5 draws). (The earlier ``seed * 1_000_003 + stream * 7_919 +
    step`` made training step 7,919 of every seed draw its evaluation prompts.)"""
    digest = hashlib.sha256(f"icl-rank/{seed}/{stream}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(seed: int, stream: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(generator_seed(seed, stream, step))


def eval_prompts(d: int, seed: int, count: int = EVAL_PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed fresh evaluation prompts of a seed (xs (count, 2d, d), ys (count, 2d)), at the full d and N."""
    xs, ys, _ = sample_prompts(generator(seed, EVAL_STREAM, 0), count, 2 * d, d)
    return xs, ys


def train_batch(d: int, seed: int, step: int, steps: int = SCHEDULE_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The training prompts of (seed, step) on a schedule of ``steps``: xs (64, points, d), ys (64, points); the
    same for every LR and arm."""
    _, dims, points = schedule(step, steps, d, 1.0)
    xs, ys, _ = sample_prompts(generator(seed, TRAIN_STREAM, step), BATCH, points, d, dims)
    return xs, ys


def training_flops(d: int, arm: str, steps: int, layers: int = LAYERS,
                   schedule_steps: int = SCHEDULE_STEPS) -> list[float]:
    """Cumulative training FLOPs after each step 0..steps of one run (``flops_per_token``: matmuls of the transformer
    blocks and the attention terms, read-in and read-out excluded as in the paper's Fig. 3b, backward = 2x forward),
    following the curriculum's prompt length on a schedule of ``schedule_steps``. Returns steps + 1 values, the
    first 0."""
    config = build(d, arm, layers=layers).config
    per_length = {}
    total, out = 0.0, [0.0]
    for step in range(steps):
        _, _, points = schedule(step, schedule_steps, d, 1.0)
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

    ``root``: ``<out>``; each run writes ``root/<run>/progress.jsonl``, ``rank_init.json`` and, from
    :meth:`finish`, ``result.json`` (and ``results/<run>.json`` when ``results`` is given); the stack's checkpoint
    is ``root/<arm>_<runs>.stack/checkpoint.pt``. ``steps``: the cap; ``schedule_steps``: the schedule's length
    (default ``steps``). ``compile_step``: compile the step (``StackedRuns``). ``dtype`` float64 is for tests;
    ``layers`` / ``eval_count`` shrink the model and the evaluation for the CPU rehearsal."""

    def __init__(self, d: int, arm: str, lrs, seeds, steps: int, eval_every: int, root: Path, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, layers: int = LAYERS, eval_count: int = EVAL_PROMPTS,
                 results: Path | None = None, runs=None, schedule_steps: int | None = None,
                 compile_step: bool = False):
        self.d, self.arm, self.steps, self.eval_every, self.root = d, arm, steps, eval_every, Path(root)
        self.schedule_steps = steps if schedule_steps is None else schedule_steps
        self.results = None if results is None else Path(results)
        # ``runs``: explicit (lr, seed) pairs (a shard's); else every lr x seed
        self.runs = [(float(lr), int(seed)) for lr, seed in runs] if runs is not None else \
            [(float(lr), int(seed)) for seed in seeds for lr in lrs]
        self.seeds = sorted({seed for _, seed in self.runs})
        self.device, self.layers = torch.device(device), layers
        self.config = {"d": d, "arm": arm, "runs": [list(run) for run in self.runs],
                       "steps": steps, "schedule_steps": self.schedule_steps, "eval_every": eval_every,
                       "layers": layers, "batch": BATCH, "eval_count": eval_count, "dtype": str(dtype)}
        initial = {}
        for seed in self.seeds:  # a separate run seeds torch, then builds its model
            torch.manual_seed(seed)
            initial[seed] = build(d, arm, layers=layers).to(dtype)
        self.params = sum(p.numel() for p in initial[self.seeds[0]].parameters())
        self.stack = StackedRuns(copy.deepcopy(initial[self.seeds[0]]),
                                 [initial[seed].state_dict() for _, seed in self.runs],
                                 [lr for lr, _ in self.runs], betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0,
                                 device=self.device, dtype=dtype, cuda_graphs=self.device.type == "cuda",
                                 compile_step=compile_step)
        self.run_seed = torch.tensor([self.seeds.index(seed) for _, seed in self.runs], device=self.device)
        evals = [eval_prompts(d, seed, eval_count) for seed in self.seeds]
        self.eval_xs = torch.stack([xs for xs, _ in evals]).to(self.device, dtype).index_select(0, self.run_seed)
        self.eval_ys = torch.stack([ys for _, ys in evals]).to(self.device, dtype).index_select(0, self.run_seed)
        self.step, self.wall_before, self.started = 0, 0.0, time.perf_counter()
        self.solved_at: list = [None] * len(self.runs)
        self.last_eval: list = [None] * len(self.runs)
        self.stack_folder = self.state_folders(self.root, arm, self.runs)[0]
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
        return self.state_folders(self.root, self.arm, self.runs)[1:]

    @staticmethod
    def state_folders(root: Path, arm: str, runs) -> list[Path]:
        """The stack's checkpoint folder, then each (lr, seed) run's folder, under ``root``."""
        runs = [(float(lr), int(seed)) for lr, seed in runs]
        return [Path(root) / f"{arm}_{'_'.join(f'{lr:g}s{seed}' for lr, seed in runs)}.stack"] + \
            [Path(root) / run_name(arm, lr, seed) for lr, seed in runs]

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
        shape = schedule(self.step, self.schedule_steps, self.d, 1.0)[1:]
        for step in range(self.step + 1, end):
            if schedule(step, self.schedule_steps, self.d, 1.0)[1:] != shape:
                return step
        return end

    def advance(self) -> None:
        """Train up to :meth:`next_stop` (one transfer of the chunk's prompts to the device), then evaluate and
        checkpoint when due."""
        end = self.next_stop()
        steps = range(self.step, end)
        prompts = [[train_batch(self.d, seed, step, self.schedule_steps) for seed in self.seeds] for step in steps]
        xs = torch.stack([torch.stack([x for x, _ in per_seed]) for per_seed in prompts])  # (K, seeds, B, N, d)
        ys = torch.stack([torch.stack([y for _, y in per_seed]) for per_seed in prompts])  # (K, seeds, B, N)
        if self.device.type == "cuda":  # pinned + non_blocking: no stream sync, the host prepares the next chunk
            xs, ys = xs.pin_memory(), ys.pin_memory()
        xs = xs.to(self.device, self.stack.dtype, non_blocking=True)
        ys = ys.to(self.device, self.stack.dtype, non_blocking=True)
        for index, step in enumerate(steps):
            factor = schedule(step, self.schedule_steps, self.d, 1.0)[0]  # warm-up factor; peak LRs in the stack
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
                      "schedule_steps": self.schedule_steps, "eval_every": self.eval_every, "layers": self.layers, "batch": BATCH,
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
    return Path(args.results) / f"{run_name(arm, lr, seed)}.json"


def run_steps(args, arm: str) -> tuple[int, int]:
    """(cap, schedule length) of ``arm``'s runs: the design's, or ``--steps`` for both."""
    return (args.steps, args.steps) if args.steps is not None else (cap(arm), SCHEDULE_STEPS)


def train_arm(args, arm: str, runs, budget_s: float | None = None) -> list[dict]:
    """The (lr, seed) ``runs`` of ``arm`` without a results file, as one stacked model, resumable, until done or
    ``budget_s`` seconds of this arm's training (default ``--budget-s``)."""
    budget_s = args.budget_s if budget_s is None else budget_s
    todo = [(lr, seed) for lr, seed in runs if not results_file(args, arm, lr, seed).exists()]
    if not todo:
        print(f"{arm}: every run has its results file already; nothing to train", flush=True)
        return []
    steps, schedule_steps = run_steps(args, arm)
    # an unfinished stack's state travels in the committed results (``sweep.CarriedState``): a new machine resumes it
    carried = CarriedState(ArmRunner.state_folders(Path(args.out), arm, todo), args.results) \
        if args.results is not None else None
    if carried is not None:
        carried.restore()
    runner = ArmRunner(args.d, arm, None, None, steps, args.eval_every, Path(args.out), args.device,
                       layers=args.layers, results=args.results, runs=todo, schedule_steps=schedule_steps,
                       compile_step=not args.eager)
    while not runner.finished:
        runner.advance()
        if budget_s is not None and runner.wall - runner.wall_before > budget_s and not runner.finished:
            runner.save_checkpoint()
            if carried is not None:
                carried.keep()
            print(f"{arm}: stopped by --budget-s at step {runner.step}; rerun the command to resume", flush=True)
            return []
    finished = runner.finish()
    if carried is not None:
        carried.drop()
    return finished


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
    if args.jobs == 1:  # --budget-s covers the whole command: the arms one after another share it
        finished = True
        for arm in pending:
            left = None if args.budget_s is None else args.budget_s - (time.time() - t0)
            if left is not None and left <= 0:
                print(f"[{time.time() - t0:7.0f} s] --budget-s spent: {arm} not started", flush=True)
                finished = False
                break
            print(f"[{time.time() - t0:7.0f} s] start {arm} ({len(by_arm[arm])} runs stacked)", flush=True)
            done = train_arm(args, arm, by_arm[arm], budget_s=left)
            finished = finished and bool(done)
            print(f"[{time.time() - t0:7.0f} s] {'done' if done else 'stopped'} {arm}", flush=True)
        print(f"all arms finished, wall {time.time() - t0:.0f} s" if finished else
              f"stopped by --budget-s after {time.time() - t0:.0f} s of wall; rerun the command to resume", flush=True)
        return
    running: list[tuple[subprocess.Popen, str]] = []
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            arm = pending.pop(0)
            command = [sys.executable, __file__, "arm", "--d", str(args.d), "--out", args.out, "--arm", arm,
                       "--runs", *(f"{lr:g}:{seed}" for lr, seed in by_arm[arm]), "--eval_every",
                       str(args.eval_every), "--device", args.device, "--layers", str(args.layers),
                       "--results", args.results]
            command += ["--steps", str(args.steps)] if args.steps is not None else []
            command += ["--budget-s", str(args.budget_s)] if args.budget_s is not None else []
            command += ["--eager"] if args.eager else []
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


def measured_cpu_ms(results: Path) -> dict:
    """Arm -> ms of wall per step of its stack on one CPU thread, from the design's CPU results files: the stack's
    wall over the steps the stack ran (``icl_rank_report.stack_ms_per_step``; a run frozen early does not divide the
    whole stack's wall by its own steps), the slowest of the arm's stacks."""
    from icl_rank_report import load_runs, stack_ms_per_step

    rates: dict[str, list] = {}
    for (arm, _, _, device), ms in stack_ms_per_step(load_runs(results)).items():
        if device.startswith("cpu"):
            rates.setdefault(arm, []).append(ms)
    return {arm: max(values) for arm, values in rates.items()}


def shard_runs(shard_id: str) -> list[tuple[str, float, int]]:
    """The (arm, lr, seed) runs of a shard (icl_rank_arms.SHARDS)."""
    if shard_id not in SHARDS:
        raise SystemExit(f"shard: unknown id {shard_id!r}; the shards are {', '.join(SHARDS)}")
    return SHARDS[shard_id]


def plan_shards(args) -> None:
    """Every shard: its runs, training FLOPs, minutes on one CPU core (measured by its results files, else
    estimated from CPU_MS_PER_STEP) and on one GPU (estimated), done or not."""
    from icl_rank_report import load_runs

    done = {(r["arm"], r["lr"], r["seed"]) for r in load_runs(Path(args.results))}
    measured = measured_cpu_ms(Path(args.results))
    caps = ", ".join(f"{LABELS[arm].split(' ')[0]} {cap(arm):,}" for arm in CPU_MS_PER_STEP)
    print(f"d = {DESIGN_D}; caps: {caps} "
          f"steps on a {SCHEDULE_STEPS:,}-step schedule. CPU: one process, one thread, an arm's stack at a time, "
          "compiled; the rate is measured by the arm's results files where they exist, else the estimate in "
          "CPU_MS_PER_STEP (time command). GPU: CUDA graphs, "
          f"{GPU_MS_PER_STEP_GRAPHS:g} ms a step (an estimate). Runs solved early (< 0.05) end sooner: upper bounds."
          "\n")
    print("| shard | runs | done | training FLOPs | CPU, one core (min) | GPU (min) | command |")
    print("|---|---|---|---|---|---|---|")
    for shard_id, runs in SHARDS.items():
        arms_in = list(dict.fromkeys(arm for arm, _, _ in runs))
        cpu = sum(cap(arm) * measured.get(arm, CPU_MS_PER_STEP[arm]) for arm in arms_in) / 60_000
        gpu = sum(cap(arm) for arm in arms_in) * GPU_MS_PER_STEP_GRAPHS / 60_000
        total = sum(training_flops(DESIGN_D, arm, cap(arm))[-1] for arm, _, _ in runs)
        names = ", ".join(f"({a.split('_')[0]}) {lr:g} s{seed}" for a, lr, seed in runs)
        print(f"| {shard_id} | {names} | {sum(run in done for run in runs)}/{len(runs)} | {total:.3g} | {cpu:.0f} | "
              f"{gpu:.0f} | `python scripts/icl_rank_experiment.py shard {shard_id}` |")


# ------------------------------------------------------------------------------------------------------- the pilot


def pilot(args) -> dict:
    """(ii) and (v) at one LR and one seed, interleaved chunk by chunk in one process, within ``--budget-s``; writes
    ``pilot.md`` and ``pilot.json`` to ``--out`` (module docstring)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = TINY if args.tiny else dict(layers=LAYERS, steps=args.steps or SCHEDULE_STEPS,
                                       eval_every=args.eval_every, eval_count=EVAL_PROMPTS)
    started = time.perf_counter()
    root = out / f"d{args.d}"
    runners = [ArmRunner(args.d, arm, [PILOT_LR], [PILOT_SEED], size["steps"], size["eval_every"], root,
                         args.device, layers=size["layers"], eval_count=size["eval_count"],
                         compile_step=not args.eager and not args.tiny) for arm in PILOT_ARMS]
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
    summary = {"command": "pilot", "device": device_name(args.device), "d": args.d, "lr": PILOT_LR,
               "seed": PILOT_SEED, "steps_planned": size["steps"], "layers": size["layers"], "tiny": args.tiny,
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
    # The design: each shard's arms one after another, an arm's runs one stacked model. On a GPU these steps are
    # launch-bound, so a stacked step costs about what the pilot's 1-run step costs; on a CPU the work grows with the
    # runs. An assumption: the shards' results files measure it.
    stacks = [(arm, len([run for run in runs if run[0] == arm])) for runs in SHARDS.values()
              for arm in dict.fromkeys(a for a, _, _ in runs)]
    runs_factor = {arm: 1 if args.device.startswith("cuda") else count for arm, count in stacks}
    summary["projection"] = ("mean measured ms/step x the stack's runs on a CPU (1 on a GPU) x the arm's cap, "
                             "every stack of the design one after another")
    summary["projected_sweep_h"] = round(sum(mean_ms * runs_factor[arm] * cap(arm) for arm, _ in stacks) / 1000
                                         / 3600, 2)
    (out / "pilot.json").write_text(json.dumps(summary, indent=1))
    from sweep import keep_pilot

    keep_pilot(summary, args.device, Path(args.results))
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


def step_timing(stacks, repeats: int = 20, layers: int = LAYERS) -> list[dict]:
    """Thread time (one thread) of one training step of each (arm, runs) stack, eager against compiled
    (``StackedRuns(compile_step=True)``), at the curriculum's full prompt size, the two interleaved step by step in
    one process after their warm-up (the compile's own time is reported apart)."""
    rows = []
    for arm, runs in stacks:
        torch.manual_seed(0)
        template = build(DESIGN_D, arm, layers=layers)
        states = [template.state_dict()] * runs
        eager = StackedRuns(copy.deepcopy(template), states, [1e-3] * runs)
        compiled = StackedRuns(copy.deepcopy(template), states, [1e-3] * runs, compile_step=True)
        xs, ys = train_batch(DESIGN_D, 1, SCHEDULE_STEPS // 2)
        batch = (xs.expand(runs, *xs.shape).contiguous(), ys.expand(runs, *ys.shape).contiguous())
        eager.train_step(loss_of, batch, 1.0)
        begin = time.perf_counter()
        compiled.train_step(loss_of, batch, 1.0)
        compile_s = time.perf_counter() - begin
        totals = {"eager": 0.0, "compiled": 0.0}
        for _ in range(repeats):
            for name, stack in (("eager", eager), ("compiled", compiled)):
                begin = time.thread_time()
                stack.train_step(loss_of, batch, 1.0)
                totals[name] += time.thread_time() - begin
        rows.append({"arm": arm, "runs": runs, "eager_ms": 1000 * totals["eager"] / repeats,
                     "compiled_ms": 1000 * totals["compiled"] / repeats, "compile_s": compile_s})
    return rows


def time_arms(args) -> None:
    """Eager vs compiled CPU step time of each shard's stacks (one thread, thread clock)."""
    stacks = list(dict.fromkeys((arm, sum(1 for run in runs if run[0] == arm)) for runs in SHARDS.values()
                                for arm, _, _ in runs))
    stacks = [(arm, runs) for arm, runs in stacks if arm in args.arms]
    print(f"{device_name('cpu')}; one step of the arm's stack at the full prompt size (64 prompts of 16 tokens), "
          "thread time, eager and compiled interleaved, 20 steps each after a warm-up\n")
    print("| arm | runs stacked | eager ms/step | compiled ms/step | compiled / eager | compile s (first step) |")
    print("|---|---|---|---|---|---|")
    for row in step_timing(stacks):
        print(f"| {LABELS[row['arm']]} | {row['runs']} | {row['eager_ms']:.1f} | {row['compiled_ms']:.1f} | "
              f"{row['compiled_ms'] / row['eager_ms']:.2f} | {row['compile_s']:.0f} |", flush=True)


def plan(args) -> None:
    """The design's size: per arm its parameters, cap, runs and a run's training FLOPs; the total."""
    print("| arm | params | cap (steps) | FLOPs per run at the cap | runs |")
    print("|---|---|---|---|---|")
    total = 0.0
    for arm in dict.fromkeys(arm for arm, _, _ in design_runs()):
        flops = training_flops(DESIGN_D, arm, cap(arm))[-1]
        runs = sum(run[0] == arm for run in design_runs())
        total += flops * runs
        print(f"| {LABELS[arm]} | {sum(p.numel() for p in build(DESIGN_D, arm).parameters()):,} | {cap(arm):,} | "
              f"{flops:.3g} | {runs} |")
    print(f"\n{len(design_runs())} runs, {total:.3g} training FLOPs at the caps")


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
    parser.add_argument("shard_id", nargs="?", help=f"shard: one of {', '.join(SHARDS)} (plan --shards lists them)")
    parser.add_argument("--shards", action="store_true", help="plan: the shards, their FLOPs and minutes")
    parser.add_argument("--runs", nargs="+", help="arm: explicit lr:seed runs (default every --lrs x --seeds)")
    parser.add_argument("--d", type=int, default=DESIGN_D, help="input dim, a multiple of 4 (the design: 4)")
    parser.add_argument("--out", help="output folder (default: outputs/icl_rank; a custom grid: "
                        "outputs/icl_grid_d<d>; pilot: outputs/icl_pilot)")
    parser.add_argument("--steps", type=int, help="cap and schedule length of every run (default: the design's "
                        f"caps per arm on a {SCHEDULE_STEPS:,}-step schedule)")
    parser.add_argument("--eval_every", type=int, default=EVAL_EVERY)
    parser.add_argument("--results", help=f"where each finished run's small JSON goes (the design: {RESULTS}; a "
                        "custom grid: OUT/results, so that it never mixes with the design's runs)")
    parser.add_argument("--calibration", default=str(CALIBRATION), help="report: seed 0's calibration runs")
    parser.add_argument("--lrs", type=float, nargs="+", help="run: a custom grid (with --seeds) instead of the design")
    parser.add_argument("--seeds", type=int, nargs="+", help="run: a custom grid (with --lrs) instead of the design")
    parser.add_argument("--layers", type=int, default=LAYERS, help="run / arm: transformer blocks (the design: 6)")
    parser.add_argument("--jobs", type=int, default=1, help="run / shard: arms at a time (one process each)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<index>")
    parser.add_argument("--arms", nargs="+", help="run / time: only these arms")
    parser.add_argument("--arm", help="arm: the arm to train")
    parser.add_argument("--eager", action="store_true", help="do not compile the training step (CPU)")
    parser.add_argument("--budget-s", dest="budget_s", type=float,
                        help=f"wall seconds after which training stops and keeps a checkpoint (shard on a CPU: "
                             f"{CPU_SHARD_BUDGET_S}, on a GPU: {GPU_SHARD_BUDGET_S}; pilot: 170); a rerun resumes")
    parser.add_argument("--tiny", action="store_true", help="pilot: the CPU rehearsal (2 layers, 30 steps)")
    parser.add_argument("--figures", default="docs/results/icl_rank_decisive")
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
    custom_grid = args.command == "run" and args.lrs is not None
    args.out = args.out or ("outputs/icl_pilot" if pilot_command else
                            f"outputs/icl_grid_d{args.d}" if custom_grid else "outputs/icl_rank")
    args.results = args.results or str(Path(args.out) / "results" if custom_grid else RESULTS)
    if pilot_command and args.budget_s is None:
        args.budget_s = 170.0
    if args.command == "shard" and args.budget_s is None:
        args.budget_s = GPU_SHARD_BUDGET_S if args.device.startswith("cuda") else CPU_SHARD_BUDGET_S
    for name in ("steps", "eval_every", "jobs", "layers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if any(not lr > 0 for lr in args.lrs or []):
        parser.error(f"--lrs must be positive, got {args.lrs}")
    if len(set(args.seeds or [])) != len(args.seeds or []) or len(set(args.lrs or [])) != len(args.lrs or []):
        parser.error(f"--lrs and --seeds must not repeat, got {args.lrs} and {args.seeds}")
    if (args.lrs is None) != (args.seeds is None) and args.command == "run":
        parser.error("run: --lrs and --seeds come together (a custom grid) or not at all (the design)")
    if args.d != DESIGN_D and args.command in ("shard", "report", "plan", "time") or \
            args.d != DESIGN_D and args.command == "run" and args.lrs is None:
        parser.error(f"--d {args.d}: the registered design is at d = {DESIGN_D}; other d run only as a custom grid "
                     "(run --lrs ... --seeds ... --steps ...)")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda[:index], got {args.device!r}")
    if args.device.startswith("cuda") and args.command in ("run", "arm", "pilot") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    if pilot_command and Path(args.out).exists() and any(Path(args.out).iterdir()):
        parser.error(f"--out {args.out} is not empty: a pilot starts from scratch in a new folder")
    if args.command == "shard" and not args.shard_id:
        parser.error(f"shard needs an id: {', '.join(SHARDS)} (plan --shards lists them)")
    if args.runs:
        for text in args.runs:
            parts = text.split(":")
            if len(parts) != 2 or not parts[1].isdigit():
                parser.error(f"--runs: each run is lr:seed, got {text!r}")
    if args.command == "arm" and args.arm not in arm_names:
        parser.error(f"arm needs --arm, one of {', '.join(arm_names)}; got {args.arm!r}")
    if args.command == "arm" and not args.runs:
        parser.error("arm needs --runs lr:seed ...")
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
        runs = [(float(text.split(":")[0]), int(text.split(":")[1])) for text in args.runs]
        for result in train_arm(args, args.arm, runs):
            print(json.dumps({k: result[k] for k in ("arm", "lr", "seed", "final_step", "solved_at")}))
    elif args.command == "run":
        runs = design_runs() if args.lrs is None else \
            [(arm, lr, seed) for arm in args.arms for seed in args.seeds for lr in args.lrs]
        launch_all(args, [run for run in runs if run[0] in args.arms])
    elif args.command == "shard":
        launch_all(args, [run for run in shard_runs(args.shard_id) if run[0] in args.arms])
    elif args.command == "pilot":
        pilot(args)
    else:
        from icl_rank_report import report  # scripts/icl_rank_report.py

        report(args, training_flops)


if __name__ == "__main__":
    main()
