"""The decisive in-context-regression test of the paper's rank claim (Kuang et al. 2025 §2.2, §4; issue 15).

Claim: 8-head dense attention with head dim r < d (input dim) cannot solve in-context linear regression, while at
the same width 1-head dense (r = D), bilinear BTT and bilinear MLR (full-rank scores) can; 8-head dense with r >= d
is the capacity control. The decision rule is written in docs/results.md (§1c) before these runs.

    OMP_NUM_THREADS=1 nohup nice -n 10 python scripts/icl_rank_experiment.py run --d 4 --out outputs/icl_rank \
        --steps 2500 --jobs 2 > outputs/icl_rank/d4.log 2>&1 &
    python scripts/icl_rank_experiment.py report --out outputs/icl_rank --d 4   # table + plot + verdict
    python scripts/icl_rank_experiment.py time --d 4                            # seconds per step per arm
    python scripts/icl_rank_experiment.py earlier-ranks      # score rank of the models of docs/results.md §1, §1b

Each run (arm, lr, seed) trains in its own process, evaluates every ``--eval_every`` steps on 1024 fresh prompts
(a random stream training never draws from), stops early when solved (last-query error < 0.05), writes its
evaluations to ``<out>/d<d>/<run>/progress.jsonl`` as it goes and a resumable checkpoint every 250 steps, and
``result.json`` at the end; a rerun skips finished runs and resumes interrupted ones. Task, curriculum and warm-up
follow the authors' ICL setup (x ~ N(0, I/d), w ~ N(0, I), N = 2d points, a curriculum over the first 6 % of the
steps, linear warm-up then constant LR, AdamW beta (0.9, 0.95), batch 64, 6 layers), scaled to ``--steps``.
"""

from __future__ import annotations

import argparse
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
from hf_structattn.training.icl import sample_prompts

SOLVED, FAILED = 0.1, 0.5  # the decision rule's thresholds on the normalised last-query error
EARLY_STOP = 0.05
BATCH, EVAL_PROMPTS, LAYERS, CHECKPOINT_EVERY = 64, 1024, 6, 250


def arms(d: int) -> dict[str, dict]:
    """Model fields of the five arms at input dim d. Width D = 8 * (d - 1): 8-head dense has r = d - 1 < d."""
    width = 8 * (d - 1)
    low = d - 1
    return {
        "i_dense8_low": dict(n_embd=width, n_head=8, attention="dense", dense_scaling=8.0 / low),
        "ii_dense1": dict(n_embd=width, n_head=1, attention="dense"),
        "iii_btt8": dict(n_embd=width, n_head=8, attention="bilinear_btt", btt_rank=1),
        # the paper's ICL ranks put the most rank on the finest level (8|4|4|16); with r = d - 1 = 3 the only
        # split over 2^(L-1)-chunk levels that keeps that shape is 1|2 (sum p_l r_l = 1 + 2*2 = 5 >= d)
        "iv_mlr8": dict(n_embd=width, n_head=8, attention="bilinear_mlr", bilinear_mlr_ranks=[1, 2]),
        "v_dense8_high": dict(n_embd=16 * d, n_head=8, attention="dense", dense_scaling=8.0 / (2 * d)),
    }


def build(d: int, arm: str) -> StructAttnGPT2ForInContextRegression:
    fields = dict(vocab_size=1, n_positions=4 * d, n_layer=LAYERS, icl_input_dim=d, qk_layernorm=True,
                  qk_norm="rms", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0, **arms(d)[arm])
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


@torch.no_grad()
def evaluate(model, d: int, seed: int) -> dict:
    xs, ys, _ = sample_prompts(generator(seed, 3, 0), EVAL_PROMPTS, 2 * d, d)
    model.eval()
    predictions = torch.cat([model(xs=x, ys=y).predictions for x, y in zip(xs.split(256), ys.split(256))])
    model.train()
    last = float(((predictions[:, -1] - ys[:, -1]) ** 2).mean() / (ys[:, -1] ** 2).mean())
    return {"error_last": last, "mse_all": float(((predictions - ys) ** 2).mean())}


def rank_summary(model) -> dict:
    heads = effective_rank(model, num_pairs=6)
    return {"span_min": min(h.span for h in heads), "span_max": max(h.span for h in heads),
            "local_min": min(h.local for h in heads), "local_max": max(h.local for h in heads)}


def train_run(d: int, arm: str, lr: float, seed: int, steps: int, eval_every: int, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = build(d, arm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, wall_before = 0, 0.0
    checkpoint = folder / "checkpoint.pt"
    config = {"d": d, "arm": arm, "lr": lr, "seed": seed, "steps": steps, "eval_every": eval_every,
              "layers": LAYERS, "batch": BATCH}
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] != config:
            raise ValueError(f"{checkpoint} was written by another configuration: {state['config']} vs {config}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, wall_before = state["step"], state["wall"]
    else:
        (folder / "progress.jsonl").write_text("")
        (folder / "rank_init.json").write_text(json.dumps(rank_summary(model)))
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
        loss = model(xs=xs, ys=ys).loss
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
                  (folder / "rank_init.json").read_text()), "rank_final": rank_summary(model),
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
    pending = [(arm, lr, seed) for seed in args.seeds for lr in args.lrs for arm in arms(args.d)
               if not (root / run_name(arm, lr, seed) / "result.json").exists()]
    running: list[tuple[subprocess.Popen, str]] = []
    t0 = time.time()
    while pending or running:
        while pending and len(running) < args.jobs:
            arm, lr, seed = pending.pop(0)
            name = run_name(arm, lr, seed)
            command = [sys.executable, __file__, "one", "--d", str(args.d), "--out", args.out, "--arm", arm,
                       "--lr", str(lr), "--seed", str(seed), "--steps", str(args.steps), "--eval_every",
                       str(args.eval_every)]
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


def time_arms(args) -> None:
    """Seconds per training step of each arm (one thread, thread time, interleaved)."""
    torch.set_num_threads(1)
    models = {arm: build(args.d, arm) for arm in arms(args.d)}
    optimizers = {arm: torch.optim.AdamW(m.parameters(), lr=1e-3) for arm, m in models.items()}
    totals = {arm: 0.0 for arm in models}
    for repeat in range(6):
        for arm, model in models.items():
            xs, ys, _ = sample_prompts(generator(0, 2, repeat), BATCH, 2 * args.d, args.d)
            begin = time.thread_time()
            loss = model(xs=xs, ys=ys).loss
            optimizers[arm].zero_grad()
            loss.backward()
            optimizers[arm].step()
            if repeat:
                totals[arm] += time.thread_time() - begin
    for arm, total in totals.items():
        print(f"{arm}: {total / 5 * 1000:.1f} ms/step (thread time), params "
              f"{sum(p.numel() for p in models[arm].parameters())}")


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
    parser.add_argument("command", choices=["run", "one", "time", "report", "earlier-ranks"])
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--out", default="outputs/icl_rank")
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--arm")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--figures", default="docs/results/icl_rank")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "time":
        time_arms(args)
    elif args.command == "earlier-ranks":
        ranks_of_earlier_runs()
    elif args.command == "one":
        folder = Path(args.out) / f"d{args.d}" / run_name(args.arm, args.lr, args.seed)
        if (folder / "result.json").exists() or not claim(folder):
            print(f"skip {folder}: finished or running in another process")
            return
        try:
            result = train_run(args.d, args.arm, args.lr, args.seed, args.steps, args.eval_every, folder)
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
