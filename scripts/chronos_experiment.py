"""The time-series claim (Kuang et al. 2025 §5.2, Fig. 5) as one decisive design: a Chronos-T5 whose encoder and
decoder self-attention is MLR reaches a lower validation loss than the same model with dense (stock T5) attention,
with fewer training FLOPs, at every width; and an ablation of the logit-scale confound.

The confound: T5 attention has no 1/sqrt(d) and MLR scores distant pairs with fewer dims (32 of 64 at the coarsest
depth), so at init MLR's distant logits are smaller than dense's (a lower temperature for them) as well as lower
rank. The ablation arm ``mlr_flat`` keeps MLR's ranks and blocks but averages over the shared levels with per-level
scales ``alpha_l = sqrt((2l - 1) r / r_l)``: the logit of a pair sharing levels 1..k then has the init variance of
a dense logit, ``(1/k^2) sum_{l<=k} alpha_l^2 r_l = r``, at every depth (:func:`flat_scales`; checked on the
patched model in tests/test_chronos_experiment.py). If MLR's advantage is the rank structure it survives in
``mlr_flat``; if it is the temperature it does not.

Design (fixed here, before any run):

* Chronos-T5's head layout: 8 heads x d_kv 64 (inner width 512) at widths D in {128, 256, 512}, 4 encoder + 4
  decoder layers, d_ff = 4D, ReLU, no dropout (Chronos uses 0.1; 0 keeps the stacked runs exact and equal);
  Chronos tokenizer (mean scaling, 4096 uniform bins on [-15, 15]), context 512, horizon 64; built from a config and
  trained from scratch (no weights are downloaded);
* arms: ``dense`` (stock T5 attention), ``mlr`` (the paper's 6 levels 32|10|8|8|4|2, dyadic blocks 256|...|16 from
  the context, T5's scale 1 per level), ``mlr_flat`` (the ablation above);
* data (built on the machine, nothing downloaded): per seed 1024 KernelSynth-style GP series of 1152 points plus the
  training parts of the real series statsmodels ships (sunspots, co2, nile, elnino, macrodata); held out: 64 GP
  series never trained on and the last 4 x 64 points of each real series (``hf_structattn.training.timeseries``);
* 2,000 steps x 32 windows (the co-author's Chronos fork's budget), AdamW (0.9, 0.95), clip 1, warm-up 5 % then
  cosine to 0.1x, learning rates {3e-4, 1e-3, 3e-3} (stacked in one model), seeds {0, 1, 2} (init, data and held-out
  series); equal steps, so MLR spends fewer FLOPs (``hf_structattn.flops.encoder_decoder_flops``);
* evaluation: teacher-forced cross-entropy (nats per target token) on the held-out windows whose history fills the
  context, 8 times per run.

Shards (:func:`shards`): a unit is one (arm, width, seed) with its LRs stacked in one model (T5 has no muP, so
every width keeps its own LR grid); units pack into shards of at most 8 minutes on one H100 at the pilot's measured
FLOP rate (else an assumed 3e13 FLOP/s): first ``dense`` and ``mlr`` (the claim), then ``x`` (the triggered edge
LRs), then ``a`` shards: ``mlr_flat`` (the ablation, needed only if the claim is YES). Each finished run writes
``results/chronos/<run>.json`` (a few KB, committed); a shard skips runs that have one.

Rule (coded in :func:`verdict` and :func:`ablation_verdict`, tested in tests/test_chronos_experiment.py): a
(arm, width, seed) scores its best final validation loss over its LRs: the grid, plus the edge extension -- when a
seed's best grid LR is 3e-4 or 3e-3, that arm and width runs one more LR in that direction (9e-5 or 9e-3,
``edge_extensions``) in every seed. A is *lower* than B at a width when it is lower by at least 0.01 nats in all
three seeds. Claim: YES when ``mlr`` is lower than ``dense`` at every width; NO when ``dense`` is lower than ``mlr``
at 2 or more widths; UNDECIDED otherwise; PARTIAL until every run it reads (edge runs included) has its results
file. Ablation (only when the claim is YES): SURVIVES when ``mlr_flat`` is also lower than ``dense`` at every width;
CONFOUNDED when ``mlr_flat`` is not lower than ``dense`` at 2 or more widths; MIXED otherwise.

    python scripts/chronos_experiment.py plan [--shards]                      # arms, FLOPs; shards and minutes
    python scripts/chronos_experiment.py shard s1 --device cuda               # one shard (resumable, idempotent)
    python scripts/chronos_experiment.py report                               # table, verdicts, shards left
    python scripts/chronos_experiment.py pilot --device cuda --budget-s 170 --out outputs/chronos_pilot
    python scripts/chronos_experiment.py pilot --tiny --out DIR                # the CPU rehearsal of the pilot
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
import torch

from hf_structattn.flops import encoder_decoder_flops
from hf_structattn.training.sweep import (SHARD_MINUTES, run_table, ArmSpec, StackedArm, design_arguments, device_name,
                                          edge_extensions, finish_pilot, pack_shards, probe_markdown, read_run_jsons,
                                          run_name, run_unit, shard_rate, shard_table)

ARMS = ("dense", "mlr", "mlr_flat")
WIDTHS, HEADS, D_KV, LAYERS = (128, 256, 512), 8, 64, 4
CONTEXT, HORIZON, N_TOKENS = 512, 64, 4096
RANKS = (32, 10, 8, 8, 4, 2)
STEPS, BATCH, EVALS_PER_RUN = 2000, 32, 8
LRS, SEEDS = (3e-4, 1e-3, 3e-3), (0, 1, 2)
SYNTHETIC_SERIES, HELD_OUT_SERIES, REAL_EVAL_WINDOWS = 1024, 64, 4
MARGIN = 0.01  # nats per target token
ASSUMED_H100_FLOPS_PER_S = 3e13  # as for the LM design: eager attention, TF32 matmuls (an estimate)
RESULTS = Path("results/chronos")
CLAIM_ARMS = ("dense", "mlr")
# the pilot trains dense and MLR at D = 128 within 75 % of its budget, then takes 2 steps of every arm at the widest
# width (3 LRs stacked) to measure its memory and step time before the design runs
PILOT = dict(width=128, arms=("dense", "mlr"), steps=200, train_share=0.75)
TINY = dict(width=32, heads=2, d_kv=16, layers=1, context=64, horizon=16, n_tokens=256, ranks=(8, 4, 4), steps=4,
            batch=4, synthetic_series=16, held_out_series=4, real_datasets=(), probe_width=48)


def flat_scales(ranks) -> list[float]:
    """Per-level scales that, with averaging over the shared levels, give a pair at every depth the init logit
    variance of a dense logit with T5's scale 1: ``alpha_l = sqrt((2l - 1) r / r_l)``."""
    total = sum(ranks)
    return [((2 * level - 1) * total / rank) ** 0.5 for level, rank in enumerate(ranks, start=1)]


def chronos_config(context=CONTEXT, horizon=HORIZON, n_tokens=N_TOKENS) -> dict:
    return dict(tokenizer_class="MeanScaleUniformBins", tokenizer_kwargs=dict(low_limit=-15.0, high_limit=15.0),
                context_length=context, prediction_length=horizon, n_tokens=n_tokens, n_special_tokens=2,
                pad_token_id=0, eos_token_id=1, use_eos_token=True, model_type="seq2seq", num_samples=20,
                temperature=1.0, top_k=50, top_p=1.0)


def t5_config(width, heads=HEADS, d_kv=D_KV, layers=LAYERS, context=CONTEXT, horizon=HORIZON, n_tokens=N_TOKENS):
    from transformers import T5Config

    return T5Config(vocab_size=n_tokens, d_model=width, d_kv=d_kv, d_ff=4 * width, num_layers=layers,
                    num_decoder_layers=layers, num_heads=heads, feed_forward_proj="relu", dropout_rate=0.0,
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                    chronos_config=chronos_config(context, horizon, n_tokens))


def build_model(arm: str, width: int, ranks=RANKS, **size):
    """The arm's model, freshly initialised from the current torch seed (dense: stock ``T5ForConditionalGeneration``;
    MLR arms: the same weights patched by ``hf_structattn.patch``)."""
    from transformers import T5ForConditionalGeneration

    from hf_structattn import patch

    model = T5ForConditionalGeneration(t5_config(width, **size))
    if arm == "dense":
        return model
    fields = dict(mlr_ranks=list(ranks), mlr_max_length=size.get("context", CONTEXT))
    if arm == "mlr_flat":
        fields.update(mlr_scaling=flat_scales(ranks), mlr_average_levels=True)
    elif arm != "mlr":
        raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {arm!r}")
    return patch(model, attention="mlr", targets=("encoder_self", "decoder_self"), **fields)


def model_config(arm: str, width: int, ranks=RANKS, **size):
    """The arm's model config (built on the meta device: no weights are allocated)."""
    with torch.device("meta"):
        return build_model(arm, width, ranks, **size).config


@functools.lru_cache(maxsize=8)
def forecast_task(seed: int, context: int, horizon: int, synthetic_series: int, held_out_series: int,
                  real_datasets: tuple):
    from hf_structattn.training.timeseries import build_task

    return build_task(context, horizon, synthetic_series, held_out_series, list(real_datasets), seed,
                      real_eval_windows=REAL_EVAL_WINDOWS)


def tokenizer_for(context=CONTEXT, horizon=HORIZON, n_tokens=N_TOKENS):
    from chronos import ChronosConfig

    return ChronosConfig(**chronos_config(context, horizon, n_tokens)).create_tokenizer()


def tokenize_windows(tokenizer, windows: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, context + horizon) windows -> input_ids (B, context + 1), labels (B, horizon + 1). Stacked runs take no
    attention mask, so windows must be complete (no NaN)."""
    past, future = windows[:, :context], windows[:, context:]
    input_ids, mask, scale = tokenizer.context_input_transform(past)
    labels, labels_mask = tokenizer.label_input_transform(future, scale)
    if not bool(mask.all()) or not bool(labels_mask.all()):
        raise ValueError("windows: a window has missing values; the stacked runner needs complete windows")
    return input_ids, labels


def seq2seq_loss(forward, batch) -> torch.Tensor:
    input_ids, labels = batch
    return forward(input_ids=input_ids, labels=labels, use_cache=False).loss


def make_evaluate(input_ids: torch.Tensor, labels: torch.Tensor, chunk: int = 32):
    """evaluate(stack) -> {"loss"} (R,): teacher-forced cross-entropy over the held-out windows (token-weighted)."""
    def evaluate(stack) -> dict:
        total = torch.zeros(stack.runs, dtype=torch.float64, device=stack.device)
        for ids, target in zip(input_ids.split(chunk), labels.split(chunk)):
            ids = ids.to(stack.device)[None].expand(stack.runs, *ids.shape)
            target = target.to(stack.device)[None].expand(stack.runs, *target.shape)
            total += stack.evaluate(seq2seq_loss, (ids, target)).double() * target.shape[1]
        return {"loss": total / labels.shape[0]}

    return evaluate


def size_fields(tiny: bool) -> dict:
    if tiny:
        return dict(heads=TINY["heads"], d_kv=TINY["d_kv"], layers=TINY["layers"], context=TINY["context"],
                    horizon=TINY["horizon"], n_tokens=TINY["n_tokens"])
    return dict(heads=HEADS, d_kv=D_KV, layers=LAYERS, context=CONTEXT, horizon=HORIZON, n_tokens=N_TOKENS)


def arm_spec(arm: str, width: int, seed: int, tiny: bool = False, batch: int = BATCH) -> ArmSpec:
    from hf_structattn.training.data import step_generator
    from hf_structattn.training.timeseries import sample_windows

    size = size_fields(tiny)
    ranks = TINY["ranks"] if tiny else RANKS
    counts = (TINY["synthetic_series"], TINY["held_out_series"], TINY["real_datasets"]) if tiny else \
        (SYNTHETIC_SERIES, HELD_OUT_SERIES, ("sunspots", "co2", "nile", "elnino", "macrodata"))
    task = forecast_task(seed, size["context"], size["horizon"], *counts)
    tokenizer = tokenizer_for(size["context"], size["horizon"], size["n_tokens"])
    window = size["context"] + size["horizon"]
    held_out = torch.tensor(np.stack([np.concatenate([c[-size["context"]:], t]) for c, t in
                                      zip(task.eval_contexts, task.eval_targets) if c.size >= size["context"]]))
    eval_ids, eval_labels = tokenize_windows(tokenizer, held_out, size["context"])

    def batch_of(run_seed: int, step: int) -> tuple:
        rng = np.random.default_rng(int(step_generator(run_seed, 4, step).initial_seed()))
        windows = torch.from_numpy(sample_windows(task.train_pool, batch, window, rng))
        return tokenize_windows(tokenizer, windows, size["context"])

    flops = encoder_decoder_flops(model_config(arm, width, ranks, **size), eval_ids.shape[1],
                                  eval_labels.shape[1]) * batch
    return ArmSpec(name=f"{arm}_D{width}", build=lambda _seed: build_model(arm, width, ranks, **size),
                   batch=batch_of, loss=seq2seq_loss, evaluate=make_evaluate(eval_ids, eval_labels),
                   flops_per_step=flops,
                   config={"arm": arm, "width": width, "ranks": list(ranks), "batch": batch, **size,
                           "held_out_windows": int(eval_ids.shape[0]), "data": task.description})


@functools.lru_cache(maxsize=2)
def design_rows(tiny: bool = False) -> tuple[dict, ...]:
    """Per (arm, width): steps, FLOPs per step and per run, runs (cached: each builds a model on the meta device;
    read-only)."""
    rows = []
    size = size_fields(tiny)
    for width in (TINY["width"],) if tiny else WIDTHS:
        for arm in ARMS:
            config = model_config(arm, width, TINY["ranks"] if tiny else RANKS, **size)
            per_window = encoder_decoder_flops(config, size["context"] + 1, size["horizon"] + 1)
            rows.append({"arm": arm, "width": width, "steps": STEPS, "flops_per_step": per_window * BATCH,
                         "run_flops": per_window * BATCH * STEPS, "runs": len(LRS) * len(SEEDS)})
    return tuple(rows)


def plan(args) -> None:
    rows = design_rows()
    print("| arm | D | heads x d_kv | FLOPs per window (train) | steps | FLOPs per run | x dense | runs |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        dense = next(r for r in rows if r["arm"] == "dense" and r["width"] == row["width"])
        print(f"| {row['arm']} | {row['width']} | {HEADS} x {D_KV} | {row['flops_per_step'] / BATCH:.3g} | "
              f"{row['steps']:,} | {row['run_flops']:.3g} | {row['run_flops'] / dense['run_flops']:.3f} | "
              f"{row['runs']} |")
    total = sum(row["run_flops"] * row["runs"] for row in rows)
    claim = sum(row["run_flops"] * row["runs"] for row in rows if row["arm"] in CLAIM_ARMS)
    print(f"\ntotal: {sum(r['runs'] for r in rows)} runs, {total:.3g} training FLOPs, of which the claim's arms "
          f"{claim:.3g} (the ablation runs only if the claim is YES); `plan --shards` sizes the shards")


# ------------------------------------------------------------------------------------------------------- the rules


def _row(arm: str, width: int) -> dict:
    return next(row for row in design_rows() if row["arm"] == arm and row["width"] == width)


def arm_lrs(runs: list[dict], arm: str, width: int) -> list[float] | None:
    """The LRs of (arm, width): the grid plus the edge LRs its finished grid runs trigger; None until every grid
    run (all seeds) has finished."""
    grid = {(r["lr"], r["seed"]): r["final"]["loss"] for r in runs if r["arm"] == f"{arm}_D{width}"}
    if any((lr, seed) not in grid for lr in LRS for seed in SEEDS):
        return None
    best = [min(LRS, key=lambda lr: grid[lr, seed]) for seed in SEEDS]
    return list(LRS) + edge_extensions(best, LRS)


def shards(results: Path = RESULTS, limit: float | None = None) -> dict[str, list[dict]]:
    """Shard id -> units ({name, arm, width, seed, lrs, runs, flops}): the claim's arms, the triggered edge LRs
    (``x``), the ablation (module docstring)."""
    limit = limit or SHARD_MINUTES * 60 * shard_rate(results, ASSUMED_H100_FLOPS_PER_S)[0]
    runs = read_run_jsons(results)

    def units(arms, lrs_of):
        out = []
        for width in WIDTHS:
            for arm in arms:
                lrs = lrs_of(arm, width)
                for seed in SEEDS if lrs else ():
                    out.append(dict(name=f"{arm}_D{width} s{seed}" + ("" if lrs == list(LRS) else
                                                                       f" lr {'/'.join(f'{x:g}' for x in lrs)}"),
                                    arm=arm, width=width, seed=seed, seeds=[seed], lrs=lrs, runs=len(lrs),
                                    flops=len(lrs) * _row(arm, width)["run_flops"]))
        return out

    out = {}
    for kind, members in (("s", units(CLAIM_ARMS, lambda a, w: list(LRS))),
                          ("x", units(ARMS, lambda a, w: (arm_lrs(runs, a, w) or [])[len(LRS):])),
                          ("a", units(("mlr_flat",), lambda a, w: list(LRS)))):
        for index, group in enumerate(pack_shards(members, limit) if members else [], start=1):
            out[f"{kind}{index}"] = group
    return out


def unit_done(unit: dict, runs: list[dict]) -> int:
    names = {r["name"] for r in runs}
    return sum(run_name(f"{unit['arm']}_D{unit['width']}", lr, unit["seed"]) in names for lr in unit["lrs"])


def scores(runs: list[dict]) -> dict:
    """(arm, width, seed) -> best final validation loss over the grid and its edge LRs, where all have finished."""
    best = {}
    for arm in ARMS:
        for width in WIDTHS:
            lrs = arm_lrs(runs, arm, width)
            values = {(r["lr"], r["seed"]): r["final"]["loss"] for r in runs if r["arm"] == f"{arm}_D{width}"}
            for seed in SEEDS:
                if lrs and all((lr, seed) in values for lr in lrs):
                    best[arm, width, seed] = min(values[lr, seed] for lr in lrs)
    return best


def _lower(best, first, second, width, seeds) -> bool:
    return all(best[second, width, s] - best[first, width, s] >= MARGIN for s in seeds)


def verdict(best: dict, widths=WIDTHS, seeds=SEEDS) -> str:
    """The claim's rule (module docstring)."""
    needed = [(arm, w, s) for arm in CLAIM_ARMS for w in widths for s in seeds]
    missing = [key for key in needed if key not in best]
    if missing:
        return f"PARTIAL: {len(missing)} of {len(needed)} (arm, width, seed) scores still missing"
    if all(_lower(best, "mlr", "dense", w, seeds) for w in widths):
        return "YES: MLR's validation loss is lower than dense's by >= 0.01 nats in every seed at every width"
    lost = [w for w in widths if _lower(best, "dense", "mlr", w, seeds)]
    if len(lost) >= 2:
        return f"NO: dense is lower than MLR by >= 0.01 nats in every seed at D = {lost}"
    unclear = [w for w in widths if not _lower(best, "mlr", "dense", w, seeds)]
    return f"UNDECIDED: MLR is not lower than dense in every seed at D = {unclear}"


def ablation_verdict(best: dict, claim: str, widths=WIDTHS, seeds=SEEDS) -> str:
    """The logit-scale ablation's rule (module docstring); applies only when the claim is YES."""
    if not claim.startswith("YES"):
        return "NOT APPLICABLE: the claim is not YES"
    if any(("mlr_flat", w, s) not in best for w in widths for s in seeds):
        return "PARTIAL: not every mlr_flat run has finished"
    kept = [w for w in widths if _lower(best, "mlr_flat", "dense", w, seeds)]
    if len(kept) == len(widths):
        return "SURVIVES: with dense's init logit scale at every depth, MLR is still lower than dense at every width"
    if len(widths) - len(kept) >= 2:
        return (f"CONFOUNDED: with dense's init logit scale, MLR is lower than dense only at D = {kept}: the "
                "advantage goes with the logit scale")
    return f"MIXED: with dense's init logit scale, MLR is lower than dense at D = {kept} only"


def report(args) -> None:
    results = Path(args.results)
    runs = read_run_jsons(results)
    best = scores(runs)
    print("\n".join(run_table(runs, best, ARMS, WIDTHS, SEEDS, "loss", "arm")))
    claim = verdict(best)
    print("VERDICT (MLR vs dense, Fig. 5):", claim)
    print("VERDICT (logit-scale ablation):", ablation_verdict(best, claim))
    left = [sid for sid, units in shards(results).items()
            if sum(unit_done(u, runs) for u in units) < sum(u["runs"] for u in units)]
    claim_left = [sid for sid in left if not sid.startswith("a")]
    print(f"shards left for the claim: {', '.join(claim_left) or 'none'}; for the ablation (needed only if the claim "
          f"is YES): {', '.join(sid for sid in left if sid.startswith('a')) or 'none'}")
    if left:
        print(f"continue: python scripts/chronos_experiment.py shard {(claim_left or left)[0]} --device cuda")


def run_shard(args, shard_id: str) -> None:
    """Train a shard's units (one stacked model each), skipping runs with a results file; ``--budget-s`` stops
    with a checkpoint that a rerun resumes."""
    results = Path(args.results)
    table = shards(results)
    if shard_id not in table:
        raise SystemExit(f"shard: unknown id {shard_id!r}; the shards now are {', '.join(table)}")
    started = time.perf_counter()
    for unit in table[shard_id]:
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - started)
        spec = arm_spec(unit["arm"], unit["width"], unit["seed"])
        if left is not None and left <= 0 or not run_unit(spec, unit["lrs"], [unit["seed"]], STEPS,
                                                          STEPS // EVALS_PER_RUN, Path(args.out), results,
                                                          args.device, left):
            print(f"stopped by --budget-s in {unit['name']}; rerun the command to resume", flush=True)
            return
        print(f"done {unit['name']} at {time.perf_counter() - started:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------------- run, pilot


def pilot(args) -> dict:
    """Dense and MLR at D = 128, 3 LRs x seed 0 stacked, 200 steps each within ``--budget-s``: ms per step, the
    measured FLOP rate and the design's projected time on this device; writes pilot.md / pilot.json."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    width = TINY["width"] if args.tiny else PILOT["width"]
    steps = TINY["steps"] if args.tiny else PILOT["steps"]
    summary = {"command": "pilot", "device": device_name(args.device), "tiny": args.tiny, "width": width,
               "steps_planned": steps, "lrs": list(LRS), "seed": 0, "budget_s": args.budget_s, "arms": {}}
    arm_names = PILOT["arms"]
    batch = TINY["batch"] if args.tiny else BATCH
    for index, arm_name in enumerate(arm_names):
        spec = arm_spec(arm_name, width, 0, tiny=args.tiny, batch=batch)
        arm = StackedArm(spec, LRS, [0], steps, max(1, steps // 2), out, args.device, chunk=10)
        left = (PILOT["train_share"] * args.budget_s - (time.perf_counter() - started)) / (len(arm_names) - index)
        begin = time.perf_counter()
        done = arm.run_until(max(1.0, left))
        seconds = time.perf_counter() - begin
        losses = [[json.loads(line)["loss"] for line in (f / "progress.jsonl").read_text().splitlines()]
                  for f in arm.folders()]
        if done:
            arm.finish()
        summary["arms"][arm_name] = {"steps_done": arm.step, "finished": done,
                                     "ms_per_step": round(1000 * seconds / max(1, arm.step), 2),
                                     "flops_per_s": spec.flops_per_step * len(LRS) * arm.step / seconds,
                                     "loss_start": [values[0] for values in losses],
                                     "loss_end": [values[-1] for values in losses]}
    probe_width = TINY["probe_width"] if args.tiny else max(WIDTHS)
    summary["probe"] = {"width": probe_width, "arms": {}}
    total = sum(row["run_flops"] * row["runs"] for row in design_rows())
    return finish_pilot(summary, ARMS, lambda name: arm_spec(name, probe_width, 0, tiny=args.tiny, batch=batch), LRS,
                        args.device, started, args.budget_s, total, out, pilot_markdown, Path(args.results))


def pilot_markdown(summary: dict) -> str:
    size = "tiny CPU rehearsal (D = 32, 2 x 16 heads, context 64), not a measurement" if summary["tiny"] else \
        f"D = {summary['width']}, {HEADS} x {D_KV} heads, context {CONTEXT}, {summary['steps_planned']} steps planned"
    lines = [f"### Chronos pilot: dense and MLR, 3 LRs stacked, seed {summary['seed']}", "",
             f"Device: {summary['device']}; {size}; budget {summary['budget_s']:g} s, wall {summary['wall_s']:.1f} s.",
             "", "| arm | steps done | ms/step (3 runs stacked) | FLOP/s | validation loss at step 0 -> end, per LR |",
             "|---|---|---|---|---|"]
    for name, arm in summary["arms"].items():
        change = ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in zip(arm["loss_start"], arm["loss_end"]))
        lines.append(f"| {name} | {arm['steps_done']} | {arm['ms_per_step']:.1f} | {arm['flops_per_s']:.3g} | "
                     f"{change} |")
    lines += probe_markdown(summary, "arm")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = design_arguments(argv, __doc__.split("\n\n")[0], "outputs/chronos_design", "outputs/chronos_pilot",
                            str(RESULTS))
    if args.command == "plan" and args.shards:
        results = Path(args.results)
        print("\n".join(shard_table(results, shards(results), unit_done, ASSUMED_H100_FLOPS_PER_S,
                                    "python scripts/chronos_experiment.py shard {id} --device cuda")))
    elif args.command == "shard":
        run_shard(args, args.shard_id)
    elif args.command == "run":  # every shard in order; the edge shards appear as the grid runs trigger them
        done = set()
        while True:
            runs = read_run_jsons(Path(args.results))
            left = [sid for sid, units in shards(Path(args.results)).items() if sid not in done and
                    sum(unit_done(u, runs) for u in units) < sum(u["runs"] for u in units)]
            if not left:
                break
            done.add(left[0])
            run_shard(args, left[0])
    else:
        {"plan": plan, "report": report, "pilot": pilot}[args.command](args)


if __name__ == "__main__":
    main()
