"""The in-context-regression test of the paper's rank claim (Kuang et al. 2025 §2.2, §4; issues 15 and 23).

Claim: multi-head dense attention whose head dim r is well below the input dim d cannot solve in-context linear
regression, while at the same width full-rank scores (1-head dense, bilinear BTT, bilinear MLR with
sum p_l r_l >= d) can. Arms at d (divisible by 4), width D = 6d unless noted (d = 4: D = 24), 6 layers, q/k RMSNorm:

  (i)   dense, 12 heads, r = d/2                     the failing arm (the paper: r must be "nearly" d)
  (ii)  dense, 1 head, r = D
  (iii) bilinear BTT, 8 heads (full-rank score, D)
  (iv)  bilinear MLR, 8 heads, ranks d/4 | d/2 (sum p_l r_l = 5d/4 >= d)
  (v)   dense, 3 heads, r = 2d                       rank control: same width as (i), only the head split differs
  (vi)  dense, 8 heads, r = 2d at D = 16d            width control (the earlier design's capacity control)

Every arm starts with the same logit scale: each score is divided by the square root of its width (1/sqrt(r)
dense, 1/sqrt(D) BTT, 1/sqrt(p_l r_l) per bilinear-MLR level times 1/sqrt(L) for its L summed levels), so the
row-centred logits have RMS ~1 at init in every arm (``describe`` measures it with
``hf_structattn.mup.attention_logit_rms``). The decision rule is in docs/results.md §1d.

    python scripts/icl_rank_experiment.py describe --d 4          # arms: score rank, init logit RMS, parameters
    python scripts/icl_rank_experiment.py time --d 4              # ms per step per arm and the sweep's cost
    python scripts/icl_rank_experiment.py run --d 4 --device cuda --jobs 8 --out outputs/icl_rank_v2   # the sweep
    python scripts/icl_rank_experiment.py report --d 4 --out outputs/icl_rank_v2   # table + plot + verdict
    python scripts/icl_rank_experiment.py earlier-ranks      # score rank of the models of docs/results.md §1, §1b

``run``'s defaults are the budget docs/results.md §1d says would decide the claim (40,000 steps, 3 LRs, 3 seeds).
Each run (arm, lr, seed) trains in its own process, evaluates every ``--eval_every`` steps on 1024 fresh prompts
(a random stream training never draws from), stops early when solved (last-query error < 0.05), writes its
evaluations to ``<out>/d<d>/<run>/progress.jsonl`` as it goes and a resumable checkpoint every 1000 steps, and
``result.json`` at the end; a rerun skips finished runs and resumes interrupted ones. Task, curriculum and warm-up
follow the authors' ICL scripts (x ~ N(0, I/d), w ~ N(0, I), N = 2d points, a curriculum over the first 6 % of the
steps, linear warm-up then constant LR, AdamW beta (0.9, 0.95), batch 64, 6 layers), scaled to ``--steps``.
The §1c runs (the earlier five arms, 2,500 steps) used this script as of commit 8bc2f46.
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
from hf_structattn.mup import attention_logit_rms
from hf_structattn.training.icl import sample_prompts
from icl_rank_arms import FAILED, LABELS, SOLVED, arms  # noqa: F401  (scripts/icl_rank_arms.py)

EARLY_STOP = 0.05
BATCH, EVAL_PROMPTS, LAYERS, CHECKPOINT_EVERY = 64, 1024, 6, 1000
DECIDING_STEPS, DECIDING_LRS, DECIDING_SEEDS = 40_000, [3e-4, 1e-3, 3e-3], [0, 1, 2]

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


def build(d: int, arm: str, earlier: bool = False) -> StructAttnGPT2ForInContextRegression:
    fields = dict(vocab_size=1, n_positions=4 * d, n_layer=LAYERS, icl_input_dim=d, qk_layernorm=True,
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


@torch.no_grad()
def evaluate(model, d: int, seed: int) -> dict:
    device = next(model.parameters()).device
    xs, ys = (t.to(device) for t in eval_prompts(d, seed))
    model.eval()
    predictions = torch.cat([model(xs=x, ys=y).predictions for x, y in zip(xs.split(256), ys.split(256))])
    model.train()
    last = float(((predictions[:, -1] - ys[:, -1]) ** 2).mean() / (ys[:, -1] ** 2).mean())
    return {"error_last": last, "mse_all": float(((predictions - ys) ** 2).mean())}


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


def train_run(d: int, arm: str, lr: float, seed: int, steps: int, eval_every: int, folder: Path,
              device: str = "cpu") -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = build(d, arm).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, wall_before = 0, 0.0
    checkpoint = folder / "checkpoint.pt"
    config = {"d": d, "arm": arm, "lr": lr, "seed": seed, "steps": steps, "eval_every": eval_every,
              "layers": LAYERS, "batch": BATCH}
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location=device)
        if state["config"] != config:
            raise ValueError(f"{checkpoint} was written by another configuration: {state['config']} vs {config}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, wall_before = state["step"], state["wall"]
    else:
        (folder / "progress.jsonl").write_text("")
        (folder / "rank_init.json").write_text(json.dumps(rank_summary(model, d, seed)))
    t0 = time.time()
    log = (folder / "progress.jsonl").open("a")
    step, solved_at = start, None
    for step in range(start, steps + 1):
        if step % eval_every == 0 or step == steps:
            record = {"step": step, **evaluate(model, d, seed), "wall": wall_before + time.time() - t0}
            log.write(json.dumps(record) + "\n")
            log.flush()
            if record["error_last"] < EARLY_STOP:
                solved_at = step
                break
        if step == steps:
            break
        rate, dims, points = schedule(step, steps, d, lr)
        for group in optimizer.param_groups:
            group["lr"] = rate
        xs, ys, _ = sample_prompts(generator(seed, 2, step), BATCH, points, d, dims)
        loss = model(xs=xs.to(device), ys=ys.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % CHECKPOINT_EVERY == 0:
            tmp = folder / "checkpoint.tmp"
            torch.save({"config": config, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1, "wall": wall_before + time.time() - t0}, tmp)
            os.replace(tmp, checkpoint)
    evals = [json.loads(line) for line in (folder / "progress.jsonl").read_text().splitlines() if line]
    result = {**config, "final_step": step, "solved_at": solved_at, "final": evals[-1],
              "best_error_last": min(e["error_last"] for e in evals), "rank_init": json.loads(
                  (folder / "rank_init.json").read_text()), "rank_final": rank_summary(model, d, seed),
              "wall_s": wall_before + time.time() - t0, "params": sum(p.numel() for p in model.parameters())}
    (folder / "result.json").write_text(json.dumps(result, indent=1))
    checkpoint.unlink(missing_ok=True)
    return result


def claim(folder: Path) -> bool:
    """Mark ``folder`` as trained by this process (two launchers may share an output folder); False if a live
    process already holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "running.pid"
    if marker.exists():
        try:
            os.kill(int(marker.read_text()), 0)
            return False
        except (ProcessLookupError, ValueError):
            pass  # a dead run: resume it
    marker.write_text(str(os.getpid()))
    return True


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}_lr{lr:g}_s{seed}"


def launch_all(args) -> None:
    """Every (seed, lr, arm) run not finished yet, ``--jobs`` processes at a time, seed 0 first (stages)."""
    root = Path(args.out) / f"d{args.d}"
    pending = [(arm, lr, seed) for seed in args.seeds for lr in args.lrs for arm in args.arms
               if not (root / run_name(arm, lr, seed) / "result.json").exists()]
    running: list[tuple[subprocess.Popen, str]] = []
    t0 = time.time()
    while pending or running:
        while pending and len(running) < args.jobs:
            arm, lr, seed = pending.pop(0)
            name = run_name(arm, lr, seed)
            command = [sys.executable, __file__, "one", "--d", str(args.d), "--out", args.out, "--arm", arm,
                       "--lr", str(lr), "--seed", str(seed), "--steps", str(args.steps), "--eval_every",
                       str(args.eval_every), "--device", args.device]
            (root / name).mkdir(parents=True, exist_ok=True)
            log = (root / name / "stdout.log").open("a")
            running.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), name))
            print(f"[{time.time() - t0:7.0f} s] start {name}", flush=True)
        time.sleep(2)
        for process, name in list(running):
            if process.poll() is not None:
                running.remove((process, name))
                print(f"[{time.time() - t0:7.0f} s] {'done' if process.returncode == 0 else 'FAILED'} {name}",
                      flush=True)
    print(f"all runs finished, wall {time.time() - t0:.0f} s", flush=True)


def step_timing(d: int, arm_names, device: str = "cpu", repeats: int = 11) -> dict[str, float]:
    """Seconds per training step of each arm at the full prompt size: thread time on CPU (one thread, the arms
    interleaved), synchronised wall time on CUDA. The first step of each arm is a warm-up and not counted."""
    models = {arm: build(d, arm).to(device) for arm in arm_names}
    optimizers = {arm: torch.optim.AdamW(m.parameters(), lr=1e-3) for arm, m in models.items()}
    clock = time.thread_time if device == "cpu" else time.perf_counter
    totals = {arm: 0.0 for arm in models}
    for repeat in range(repeats):
        for arm, model in models.items():
            xs, ys, _ = sample_prompts(generator(0, 2, repeat), BATCH, 2 * d, d)
            xs, ys = xs.to(device), ys.to(device)
            if device != "cpu":
                torch.cuda.synchronize()
            begin = clock()
            loss = model(xs=xs, ys=ys).loss
            optimizers[arm].zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizers[arm].step()
            if device != "cpu":
                torch.cuda.synchronize()
            if repeat:
                totals[arm] += clock() - begin
    return {arm: total / (repeats - 1) for arm, total in totals.items()}


def ops_per_step(d: int, arm: str) -> int:
    """PyTorch operators one training step dispatches (forward, backward, clipping, AdamW; foreach kernels as on
    CUDA), counted by ``torch.profiler`` as the ``aten::`` calls not made inside another one: at these sizes a GPU
    step costs about one kernel launch per operator, so this count sets its launch-bound time."""
    from torch.profiler import ProfilerActivity, profile

    model = build(d, arm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    xs, ys, _ = sample_prompts(generator(0, 2, 0), BATCH, 2 * d, d)

    def step():
        loss = model(xs=xs, ys=ys).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()

    step()  # AdamW creates its state on the first step
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    return sum(1 for event in profiler.events() if event.name.startswith("aten::")
               and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")))


def sweep_cost(seconds_per_step: dict[str, float], steps: int, lrs, seeds, jobs: int) -> float:
    """Wall seconds of the whole sweep with ``jobs`` runs at a time at these step times (no early stop; the
    evaluations, ~1 % of the steps' work at ``--eval_every`` 500, not counted)."""
    return sum(seconds_per_step.values()) * steps * len(lrs) * len(seeds) / jobs


def time_arms(args) -> None:
    """Seconds per step of each arm on ``--device`` and what the sweep of ``--steps``/``--lrs``/``--seeds`` costs."""
    seconds = step_timing(args.d, args.arms, args.device)
    for arm, value in seconds.items():
        print(f"{arm}: {value * 1000:.1f} ms/step ({'thread time, one thread' if args.device == 'cpu' else 'wall'}), "
              f"{ops_per_step(args.d, arm):,} operators/step, "
              f"params {sum(p.numel() for p in build(args.d, arm).parameters()):,}")
    runs = len(seconds) * len(args.lrs) * len(args.seeds)
    cost = sweep_cost(seconds, args.steps, args.lrs, args.seeds, args.jobs)
    print(f"sweep: {len(seconds)} arms x {len(args.lrs)} LRs x {len(args.seeds)} seeds = {runs} runs of "
          f"{args.steps:,} steps; {cost / 3600:.1f} h wall with {args.jobs} runs at a time at these step times")


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
    parser.add_argument("command", choices=["run", "one", "time", "describe", "report", "earlier-ranks"])
    parser.add_argument("--d", type=int, default=4, help="input dim, a multiple of 4")
    parser.add_argument("--out", default="outputs/icl_rank_v2")
    parser.add_argument("--steps", type=int, default=DECIDING_STEPS)
    parser.add_argument("--eval_every", type=int, default=500)
    parser.add_argument("--lrs", type=float, nargs="+", default=DECIDING_LRS)
    parser.add_argument("--seeds", type=int, nargs="+", default=DECIDING_SEEDS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one process each)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (each run on this device)")
    parser.add_argument("--arms", nargs="+", help="run / report only these arms (default: all six)")
    parser.add_argument("--arm")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--figures", default="docs/results/icl_rank_v2")
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
    for name in ("steps", "eval_every", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(not lr > 0 for lr in args.lrs):
        parser.error(f"--lrs must be positive, got {args.lrs}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda[:index], got {args.device!r}")
    if args.command == "one" and (args.arm not in arm_names or args.lr is None or args.seed is None):
        parser.error(f"one needs --arm (one of {', '.join(arm_names)}), --lr and --seed; got --arm {args.arm!r}")
    torch.set_num_threads(1)
    if args.command == "time":
        time_arms(args)
    elif args.command == "earlier-ranks":
        ranks_of_earlier_runs()
    elif args.command == "describe":
        describe(args)
    elif args.command == "one":
        folder = Path(args.out) / f"d{args.d}" / run_name(args.arm, args.lr, args.seed)
        if (folder / "result.json").exists() or not claim(folder):
            print(f"skip {folder}: finished or running in another process")
            return
        try:
            result = train_run(args.d, args.arm, args.lr, args.seed, args.steps, args.eval_every, folder,
                               args.device)
        finally:
            (folder / "running.pid").unlink(missing_ok=True)
        print(json.dumps(result))
    elif args.command == "run":
        launch_all(args)
    else:
        from icl_rank_report import report  # scripts/icl_rank_report.py

        report(args)


if __name__ == "__main__":
    main()
