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
file. A run *diverged* when its final loss is NaN (or infinite) or above its step-0 evaluation's; it scores as
worse than any run that did not (``sweep.run_score``, shared with the LM design: ``inf``), in the LR choice and in
the comparison: never an arm's best LR unless all of them diverged, an arm whose run diverged is the higher in that
seed by any margin, and two diverged runs are not lower than each other. Ablation (only when the claim is YES):
SURVIVES when ``mlr_flat`` is also lower than ``dense`` at every width; CONFOUNDED when ``mlr_flat`` is not lower
than ``dense`` at 2 or more widths; MIXED otherwise.

CPU design (``--design cpu``, registered before any of its runs; what differs from the design above, which stays the
default, ``--design gpu``):

* one width, D = 128 (8 heads x 64, 4 + 4 layers, context 512, horizon 64, as above), arms ``dense`` and ``mlr``
  only (no ablation), seeds {0, 1, 2}; 1,000 steps x 32 windows (half the steps above), the same schedule shape;
* learning rate: the grid {3e-4, 1e-3, 3e-3} in seed 0 only, each grid run 250 steps (a quarter of a scored run,
  its own warm-up and cosine), plus the edge extension (9e-5 or 9e-3, one run) when the arm's best grid LR is an
  edge; each arm's best LR there (lowest final validation loss) is the LR of its three scored runs;
* a unit is one run; shards of at most ``CPU_SHARD_MINUTES`` CPU-minutes of one thread at the committed CPU
  pilot's rates (``results/chronos_cpu/pilot.json``), a longer run cut into segments (g grid, x edge, s scored);
* rule: at the one width, YES when ``mlr``'s final validation loss is lower than ``dense``'s by >= 0.01 nats in all
  three seeds; NO when ``dense``'s is lower by >= 0.01 in all three; UNDECIDED otherwise; PARTIAL until the six
  scored runs exist (:func:`verdict` with ``widths=(128,)``). Equal steps, so MLR spends 0.919x dense's FLOPs: a
  YES is "lower loss with fewer FLOPs"; a NO says dense is lower at equal steps, with 1.09x MLR's FLOPs. One
  width: no claim about widths or scaling, and nothing about the logit-scale confound (no ``mlr_flat``).

    python scripts/chronos_experiment.py plan [--shards] [--design cpu]       # arms, FLOPs; shards and minutes
    python scripts/chronos_experiment.py shard s1 --device cuda               # one shard (resumable, idempotent)
    python scripts/chronos_experiment.py report                               # table, verdicts, shards left
    python scripts/chronos_experiment.py pilot --device cuda --budget-s 170 --out outputs/chronos_pilot
    python scripts/chronos_experiment.py pilot --tiny --out DIR                # the CPU rehearsal of the pilot
    python scripts/chronos_experiment.py shard g1 --design cpu                # a CPU shard (one thread, resumable)
    python scripts/chronos_experiment.py pilot --design cpu                   # the CPU pilot: rates of both arms
    python scripts/chronos_experiment.py time --design cpu                    # eager vs compiled step, thread clock
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
import torch

from hf_structattn.flops import encoder_decoder_flops
from sweep import (SHARD_MINUTES, run_table, ArmSpec, StackedArm, cpu_model, cpu_pilot, cpu_progress, cpu_rates,
                   cpu_shard_lines, cpu_shards, design_arguments, device_name, edge_extensions, finish_pilot,
                   lower_in_every_seed, majority, pack_shards, probe_markdown, read_run_jsons, read_shard_records,
                   run_cpu_shard, run_name, run_score, run_unit, runnable_shards, shard_rate, shard_table, step_timing,
                   merge_timing)

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
# the CPU design (module docstring)
CPU_WIDTH, CPU_SEEDS, CPU_GRID_SEEDS, CPU_STEPS, CPU_GRID_STEPS = 128, (0, 1, 2), (0,), 1000, 250
CPU_RESULTS = Path("results/chronos_cpu")
# the arms whose training step the CPU design compiles: those whose measured saving is >= 25 % (`time --design cpu`,
# results/chronos_cpu/step_timing.json: dense 29 %, MLR 63 % of the thread time per step)
CPU_COMPILED = ("dense_D128", "mlr_D128")
# a CPU shard's rates until the CPU pilot's results/chronos_cpu/pilot.json measures them (thread seconds, one
# thread): 32 windows at the measured 3.37 (dense) and 2.86 (MLR) windows a second; an evaluation of the ~90
# held-out windows at 3x the training rate; setup: the seed's 1,024 GP series and the model
ASSUMED_CPU_RATES = {f"{arm}_D{CPU_WIDTH}": {"step_s": 32 / rate, "eval_s": 90 / rate / 3, "setup_s": 120.0}
                     for arm, rate in (("dense", 3.37), ("mlr", 2.86))}


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


def arm_spec(arm: str, width: int, seed: int, tiny: bool = False, batch: int = BATCH,
             name: str | None = None) -> ArmSpec:
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
    return ArmSpec(name=name or f"{arm}_D{width}", build=lambda _seed: build_model(arm, width, ranks, **size),
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


def arm_lrs(runs: list[dict], arm: str, width: int, seeds=SEEDS, name: str | None = None) -> list[float] | None:
    """The LRs of (arm, width): the grid plus the edge LRs its finished grid runs (``seeds``; their results arm
    ``name``, default ``<arm>_D<width>``) trigger; None until every grid run has finished."""
    grid = {(r["lr"], r["seed"]): run_score(r, "loss") for r in runs if r["arm"] == (name or f"{arm}_D{width}")}
    if any((lr, seed) not in grid for lr in LRS for seed in seeds):
        return None
    best = [min(LRS, key=lambda lr: grid[lr, seed]) for seed in seeds]
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
            values = {(r["lr"], r["seed"]): run_score(r, "loss") for r in runs if r["arm"] == f"{arm}_D{width}"}
            for seed in SEEDS:
                if lrs and all((lr, seed) in values for lr in lrs):
                    best[arm, width, seed] = min(values[lr, seed] for lr in lrs)
    return best


def _lower(best, first, second, width, seeds) -> bool:
    return lower_in_every_seed(best, first, second, width, seeds, MARGIN)


def verdict(best: dict, widths=WIDTHS, seeds=SEEDS) -> str:
    """The claim's rule (module docstring): YES, NO at a majority of ``widths`` (2 of the GPU design's 3, the CPU
    design's one), UNDECIDED, PARTIAL."""
    needed = [(arm, w, s) for arm in CLAIM_ARMS for w in widths for s in seeds]
    missing = [key for key in needed if key not in best]
    if missing:
        return f"PARTIAL: {len(missing)} of {len(needed)} (arm, width, seed) scores still missing"
    if all(_lower(best, "mlr", "dense", w, seeds) for w in widths):
        return "YES: MLR's validation loss is lower than dense's by >= 0.01 nats in every seed at every width"
    lost = [w for w in widths if _lower(best, "dense", "mlr", w, seeds)]
    if majority(len(lost), widths):
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


# ------------------------------------------------------------------------------------------------------ the CPU design


def grid_arm(arm: str) -> str:
    """The results arm of the CPU design's LR grid runs (shorter than its scored runs, so named apart)."""
    return f"{arm}_D{CPU_WIDTH}_grid"


def cpu_lr(runs: list[dict], arm: str) -> float | None:
    """The CPU design's LR of ``arm``: the lowest mean final validation loss over the grid seeds among the grid and
    its edge LRs; None until all of those have finished."""
    lrs = arm_lrs(runs, arm, CPU_WIDTH, CPU_GRID_SEEDS, grid_arm(arm))
    values = {(r["lr"], r["seed"]): run_score(r, "loss") for r in runs if r["arm"] == grid_arm(arm)}
    if lrs is None or any((lr, seed) not in values for lr in lrs for seed in CPU_GRID_SEEDS):
        return None
    return min(lrs, key=lambda lr: sum(values[lr, seed] for seed in CPU_GRID_SEEDS))


def cpu_stages(runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """The CPU design's run units by stage (``sweep.cpu_shards``): ``g`` the seed-0 LR grid,
    ``x`` the edge LRs it triggers, ``s`` the scored runs (seed by seed, dense then MLR) at the arm's grid LR."""
    def unit(arm, lr, seed, steps, grid):
        name = grid_arm(arm) if grid else f"{arm}_D{CPU_WIDTH}"
        return dict(name=f"{name} s{seed}" + (f" lr {lr:g}" if grid else ""), arm=name, chronos_arm=arm, lr=lr,
                    seed=seed, steps=steps, eval_every=max(1, steps // EVALS_PER_RUN), rate=f"{arm}_D{CPU_WIDTH}")

    grid = [unit(arm, lr, seed, CPU_GRID_STEPS, True) for arm in CLAIM_ARMS for seed in CPU_GRID_SEEDS for lr in LRS]
    edges = [unit(arm, lr, seed, CPU_GRID_STEPS, True) for arm in CLAIM_ARMS
             for lr in (arm_lrs(runs, arm, CPU_WIDTH, CPU_GRID_SEEDS, grid_arm(arm)) or [])[len(LRS):]
             for seed in CPU_GRID_SEEDS]
    scored = [unit(arm, cpu_lr(runs, arm), seed, CPU_STEPS, False) for seed in CPU_SEEDS for arm in CLAIM_ARMS]
    return [("g", grid), ("x", edges), ("s", scored)]


def cpu_shard_map(results: Path) -> tuple[dict, str]:
    rates, source = cpu_rates(results, ASSUMED_CPU_RATES)
    return cpu_shards(cpu_stages(read_run_jsons(results)), rates), source


def cpu_scores(runs: list[dict]) -> dict:
    """(arm, 128, seed) -> the final validation loss of the arm's scored run in that seed (at its grid LR)."""
    best = {}
    for arm in CLAIM_ARMS:
        lr = cpu_lr(runs, arm)
        for r in runs:
            if lr is not None and r["arm"] == f"{arm}_D{CPU_WIDTH}" and r["lr"] == lr:
                best[arm, CPU_WIDTH, r["seed"]] = run_score(r, "loss")
    return best


def cpu_report(args) -> None:
    results = Path(args.results)
    runs = read_run_jsons(results)
    best = cpu_scores(runs)
    grid = [dict(r, arm=f"{r['arm'][:-len('_grid')]} (grid)") for r in runs if r["arm"].endswith("_grid")]
    print("\n".join(run_table([r for r in runs if not r["arm"].endswith("_grid")], best, CLAIM_ARMS, (CPU_WIDTH,),
                              CPU_SEEDS, "loss", "arm")))
    for r in sorted(grid, key=lambda r: (r["arm"], r["lr"])):
        print(f"grid {r['arm']} lr {r['lr']:g} s{r['seed']}: {r['final']['loss']:.4f} after {r['steps']} steps")
    for arm in CLAIM_ARMS:
        lr = cpu_lr(runs, arm)
        picked = "not yet (grid runs missing)" if lr is None else f"{lr:g}"
        print(f"LR of {arm} (its best on the seed-0 grid): {picked}")
    print(f"VERDICT (CPU design, D = {CPU_WIDTH}: MLR vs dense, Fig. 5):", verdict(best, (CPU_WIDTH,), CPU_SEEDS))
    table, _ = cpu_shard_map(results)
    print(cpu_progress(table, {r["name"] for r in runs}, read_shard_records(results),
                       "python scripts/chronos_experiment.py shard {id} --design cpu"))


def run_cpu(args, shard_id: str) -> bool:
    results = Path(args.results)
    table, _ = cpu_shard_map(results)
    compiled = all(s["rate"] in CPU_COMPILED for s in table.get(shard_id, [])) and not args.eager
    return run_cpu_shard(shard_id, table,
                         lambda segment: arm_spec(segment["chronos_arm"], CPU_WIDTH, segment["seed"],
                                                  name=segment["arm"]),
                         Path(args.out), results, args.budget_s, compile_step=compiled)


def cpu_pilot_command(args) -> dict:
    """The CPU design's pilot: dense and MLR at D = 128 (seed 0's data), in the step mode the shards use, rates on
    one thread (``sweep.cpu_pilot``); ``--tiny``: the rehearsal at tiny size."""
    started, thread = time.perf_counter(), time.thread_time()
    width, batch = (TINY["width"], TINY["batch"]) if args.tiny else (CPU_WIDTH, BATCH)
    arm_spec("dense", width, 0, tiny=args.tiny, batch=batch)  # builds seed 0's task (cached): the data setup
    setup_s = time.thread_time() - thread
    arms = [(f"{arm}_D{width}", (lambda arm=arm: arm_spec(arm, width, 0, tiny=args.tiny, batch=batch)),
             f"{arm}_D{width}" in CPU_COMPILED and not args.eager and not args.tiny, batch) for arm in CLAIM_ARMS]
    assumed = {key: ASSUMED_CPU_RATES.get(key, {"step_s": 1.0, "eval_s": 1.0, "setup_s": 1.0}) for key, *_ in arms}
    summary = {"command": "pilot --design cpu", "tiny": args.tiny, "batch": batch, "units": "windows"}
    return cpu_pilot(arms, setup_s, Path(args.out), None if args.tiny else Path(args.results), args.budget_s,
                     started, assumed, steps=2 if args.tiny else 5, summary=summary)


def time_command(args) -> list[dict]:
    """Eager against compiled training steps of the CPU design's arms (``step_timing``: one thread, thread clock,
    interleaved after warm-up, the compile apart); merged into ``results/step_timing.json``."""
    arms = args.arms or list(CLAIM_ARMS)
    rows = step_timing([arm_spec(arm, CPU_WIDTH, 0) for arm in arms], repeats=5)
    print("| arm | D | eager s/step | compiled s/step | saving | compile s (thread / wall) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {CPU_WIDTH} | {row['eager_ms'] / 1000:.2f} | {row['compiled_ms'] / 1000:.2f} | "
              f"{100 * row['saving']:.0f} % | {row['compile_thread_s']:.0f} / {row['compile_s']:.0f} |")
    merge_timing(Path(args.results) / "step_timing.json", rows, {"batch": BATCH, "context": CONTEXT})
    return rows


def cpu_main(args) -> None:
    results = Path(args.results)
    if args.command == "plan" and args.shards:
        table, source = cpu_shard_map(results)
        print("\n".join(cpu_shard_lines(table, source, {r["name"] for r in read_run_jsons(results)},
                                         read_shard_records(results),
                                         "python scripts/chronos_experiment.py shard {id} --design cpu")))
    elif args.command == "plan":
        rows = {row["arm"]: row for row in design_rows() if row["width"] == CPU_WIDTH}
        for arm in CLAIM_ARMS:
            per_step = rows[arm]["flops_per_step"]
            print(f"{arm} D = {CPU_WIDTH}: {per_step / BATCH:.3g} training FLOPs per window; grid {len(LRS)} x "
                  f"{CPU_GRID_STEPS} steps (seed {', '.join(map(str, CPU_GRID_SEEDS))}), scored {len(CPU_SEEDS)} x "
                  f"{CPU_STEPS:,} steps: {per_step * (len(LRS) * CPU_GRID_STEPS + len(CPU_SEEDS) * CPU_STEPS):.3g} "
                  f"FLOPs ({rows[arm]['run_flops'] / rows['dense']['run_flops']:.3f}x dense's)")
    elif args.command == "shard":
        run_cpu(args, args.shard_id)
    elif args.command == "run":
        while True:
            runs = read_run_jsons(results)
            ready = runnable_shards(cpu_shard_map(results)[0], {r["name"] for r in runs},
                                    read_shard_records(results))
            if not ready or not run_cpu(args, ready[0]):
                break
    elif args.command == "report":
        cpu_report(args)
    elif args.command == "time":
        time_command(args)
    else:
        cpu_pilot_command(args)


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
                            str(RESULTS), designs={"gpu": (str(RESULTS), "outputs/chronos_design",
                                                           "outputs/chronos_pilot"),
                                                   "cpu": (str(CPU_RESULTS), "outputs/chronos_cpu",
                                                           "outputs/chronos_cpu_pilot")})
    if args.design == "cpu":
        return cpu_main(args)
    if args.command == "time":
        raise SystemExit("time: the eager / compiled comparison is the CPU design's (--design cpu)")
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
