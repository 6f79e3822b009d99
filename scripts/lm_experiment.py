"""The language-modelling claim (Kuang et al. 2025 §5.1, Fig. 4) as decisive designs: MLR attention reaches a
lower validation loss than dense attention, sliding-window attention (SWA) and global + SWA at equal training FLOPs,
at every width. Bilinear MLR and bilinear BTT are defined (the GPU pilot probes them) but not trained: the paper
makes no LM claim for them.

Two registered forms share the code below: the GPU design (``--design gpu``, the default; three widths, 8-minute
H100 shards) and the CPU design (``--design cpu``; the paper's smallest width only, one-thread shards of at most
about two CPU-hours; its differences are listed after the GPU design's).

GPU design (fixed here, before any run):

* byte-level LM (vocabulary 257) on the Python standard library's ``*.py`` sources of the interpreter that runs it
  (built on the machine, nothing downloaded; 5 % of the files, chosen by a hash of their path, are held out, except
  held-out files that are near-copies of a training file, which train: ``NEAR_COPY_JACCARD``,
  ``hf_structattn.training.data.near_copy_flags``), all ~30 MB of training bytes (Python 3.11);
* 6 layers, T = 1024, head dim 64, widths D in {128, 256, 384} (2, 4, 6 heads), q/k LayerNorm, no dropout;
* muP (``hf_structattn.mup``: 1/r logits, 1/r_l per MLR level, zero read-outs, per-matrix LR multipliers at base
  width 128, untied LM head), AdamW (0.9, 0.95), clip 1, warm-up 5 % then cosine to 0.1x; seeds {0, 1} (a seed fixes
  the init and the data order);
* learning rates, tuned at D = 128 only and transferred (muP): at D = 128 every variant runs the grid
  {1e-3, 3e-3, 1e-2} in both seeds; when a seed's best LR is an edge of that grid, the variant runs one more LR in
  that direction (3.3e-4 or 3.3e-2, ``edge_extensions``) in both seeds; the variant's transferred LR is the one with
  the lowest mean bits/byte over the two seeds; at D = 256 and 384 it runs only that LR. Traded for the shorter
  budget: the LR is not re-tuned at the larger widths (muP's transfer is assumed, not checked);
* variants: dense; SWA with window 129 (the paper's T' = 128); global + SWA (layers 1 and 4 dense); MLR 8 levels
  32|8|6|4|4|4|4|2 with level averaging (the paper's). Bilinear MLR (16|8|4|4) and bilinear BTT (rank 1) are
  defined (the pilot probes them) but not in the shards: the paper makes no LM claim for them;
* **equal FLOPs**: at width D dense trains ``DENSE_STEPS`` steps of 16 x 1024 tokens; every other variant trains
  ``round(DENSE_STEPS * F_dense / F_variant)`` steps, F = training FLOPs per token
  (``hf_structattn.flops.flops_per_token``, the paper's measure: non-embedding matmuls + attention scores and
  values, backward = 2x forward), so every run of a width ends at the same compute;
* evaluation: bits per byte on 128 windows of 1024 tokens spread over the held-out files, 8 times per run.

Shards (:func:`shards`): a unit is one (variant, width) with its LRs and both seeds stacked in one model; units
pack into shards of at most 8 minutes on one H100 at the pilot's measured FLOP rate (else an assumed 3e13 FLOP/s):
s1-s2 the D = 128 grid, x the triggered edge LRs, s3-s8 the transferred runs at D = 256 and 384. Each finished run
writes ``results/lm/<run>.json`` (a few KB, committed); a shard skips runs that have one.

Rule (coded in :func:`verdict`, tested in tests/test_lm_experiment.py): a run's score is its final validation
bits/byte; a (variant, seed) scores at D = 128 its best LR (planned and edge runs), at D = 256 and 384 its run at
the transferred LR. MLR is *better* than a baseline (dense, SWA, global + SWA) at a width when it is lower by at
least 0.01 bits/byte in both seeds; the baseline is better when it is lower by at least 0.01 in both seeds. YES:
MLR is better than every baseline at every width. NO: at 2 or more of the 3 widths some baseline is better than
MLR. UNDECIDED otherwise. PARTIAL until every run of the design (edge runs included) has its results file.
A run *diverged* when its final bits/byte is NaN (or infinite) or above its step-0 evaluation's; it scores as worse
than any run that did not (``sweep.run_score``: ``inf``), in the LR choice and in the comparison: it is never a
variant's best LR unless all of them diverged, a variant whose scored run diverged is the higher in that seed by
any margin, and two diverged runs are not lower than each other (``sweep.lower_in_every_seed``). A NO names the
baselines that are lower.

CPU design (``--design cpu``, registered before any of its runs; what differs from the GPU design):

* one scored width, D = 256 (4 heads of 64), seeds {0, 1}; batch 4 x 1024 tokens (the paper's batch); dense trains
  2,440 steps (10.0M tokens), the others ``round(2440 * F_dense / F_variant)`` (equal FLOPs);
* the LR grid {1e-3, 3e-3, 1e-2} at D = 128 in seed 0 only, each run 488 dense-equivalent steps (2.0M tokens for
  dense, the others at equal FLOPs), plus the edge extension (one more LR, one run) when its best LR is an edge;
  the variant's best LR there transfers to D = 256 (muP); the grid is not scored;
* a unit is one run (stacking saves little on a CPU); shards of at most ``CPU_SHARD_MINUTES`` CPU-minutes of one
  thread at the committed CPU pilot's rates (``results/lm_cpu/pilot.json``), a longer run cut into segments that
  continue each other's checkpoint (``sweep.cpu_shards``): g (grid), x (edge), s (scored);
  a training step is compiled (``torch.compile`` of the whole step) where the measured saving was >= 25 %
  (``CPU.compiled``: every variant at D = 128, MLR at D = 256);
* rule: the same comparison at the one width -- YES when MLR is lower than dense, SWA and global + SWA by >= 0.01
  bits/byte in both seeds; NO when some baseline is lower than MLR by >= 0.01 in both seeds; UNDECIDED otherwise;
  PARTIAL until the 8 scored runs exist (:func:`verdict` with ``widths=(256,)``: NO needs a majority of the widths,
  here the one). One width: it cannot say anything about scaling with width.
* readout (:func:`readout`, printed by ``report --design cpu`` after the verdict; not part of the rule): per baseline
  and seed, MLR's final gap to it (MLR minus baseline, bits/byte, at equal FLOPs) and, for MLR and for the
  baseline, the training FLOPs and CPU-seconds (thread clock, evaluations excluded: ``thread - eval_thread`` of the
  evaluation record, ``sweep.StackedArm.log_evaluation``; "n/a" for a record without them) at the first evaluation
  at or below the baseline's final bits/byte ("not reached" when none is).

    python scripts/lm_experiment.py plan [--shards] [--design cpu]        # arms, FLOPs; the shards and minutes
    python scripts/lm_experiment.py shard s1 --device cuda                # one shard (resumable, idempotent)
    python scripts/lm_experiment.py report                                # table, verdict, shards left
    python scripts/lm_experiment.py pilot --device cuda --budget-s 170 --out outputs/lm_pilot   # <= 3 min
    python scripts/lm_experiment.py pilot --tiny --out DIR                 # the CPU rehearsal of the pilot
    python scripts/lm_experiment.py shard g1 --design cpu                 # a CPU shard (one thread, resumable)
    python scripts/lm_experiment.py pilot --design cpu                    # the CPU pilot: rates of every arm
    python scripts/lm_experiment.py time --design cpu                     # eager vs compiled step, thread clock
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
from hf_structattn.flops import flops_per_token
from hf_structattn.mup import mup_config_overrides, mup_init_, mup_param_groups
from hf_structattn.training.data import NEAR_COPY_JACCARD
from sweep import (SHARD_MINUTES, run_table, ArmSpec, StackedArm, cpu_model, cpu_pilot, cpu_progress, cpu_rates,
                   cpu_shard_lines, cpu_shards, design_arguments, device_name, edge_extensions, finish_pilot,
                   lower_in_every_seed, majority, pack_shards, probe_markdown, read_run_jsons, read_shard_records,
                   run_cpu_shard, run_name, run_score, run_unit, runnable_shards, shard_rate, shard_table, step_timing,
                   merge_timing)

WIDTHS, LAYERS, SEQ_LEN, HEAD_DIM, BATCH = (128, 256, 384), 6, 1024, 64, 16
DENSE_STEPS, EVALS_PER_RUN, EVAL_WINDOWS = 4000, 8, 128
LRS, SEEDS, MUP_BASE_WIDTH = (1e-3, 3e-3, 1e-2), (0, 1), 128
BASELINES = ("dense", "swa", "gswa")
COMPARED = BASELINES + ("mlr",)
OBSERVED = ("bilinear_mlr", "bilinear_btt")
MARGIN = 0.01  # bits per byte
TUNE_WIDTH = 128  # the width whose LR grid the others inherit (muP)
RESULTS = Path("results/lm")
# the assumed effective training throughput of one H100 for these eager fp32/TF32 models with materialised T x T
# attention, until a GPU pilot's pilot.json in results/lm measures it (below the 4e13 first assumed: the D = 128
# runs are host-bound)
ASSUMED_H100_FLOPS_PER_S = 3e13
# the pilot trains dense and MLR at D = 128 within 75 % of its budget, then takes 2 steps of every variant at the
# widest width (3 LRs stacked) to measure its memory and step time before the design runs
PILOT = dict(width=128, variants=("dense", "mlr"), steps=300, eval_windows=16, train_share=0.75)
TINY = dict(width=32, head_dim=16, seq_len=64, layers=2, batch=4, steps=6, eval_windows=4, variants=("dense", "mlr"),
            max_train_bytes=300_000, max_validation_bytes=50_000, probe_width=48)


@dataclass(frozen=True)
class Design:
    """A registered form of the design (module docstring): the widths its rule reads, the seeds of its scored runs
    and of its D = 128 LR grid, the batch, dense steps per width (``dense_steps``: (width, steps) pairs, the grid
    width's included), the arms (``<variant>_D<width>``) whose training step is compiled, the committed results and
    the working folder."""

    name: str
    widths: tuple
    seeds: tuple
    grid_seeds: tuple
    batch: int
    dense_steps: tuple
    compiled: tuple
    results: Path
    out: str

    @property
    def all_widths(self) -> tuple:
        return tuple(sorted({TUNE_WIDTH, *self.widths}))

    def dense_steps_at(self, width: int) -> int:
        return dict(self.dense_steps)[width]


GPU = Design("gpu", WIDTHS, SEEDS, SEEDS, BATCH, tuple((w, DENSE_STEPS) for w in WIDTHS), (), RESULTS,
             "outputs/lm_equal_flops")
# compiled: the arms whose measured saving was >= 25 % of the thread time per step (`time --design cpu`,
# results/lm_cpu/step_timing.json): every variant at D = 128 (25-68 %), MLR at D = 256 (65 %; dense 23 %, SWA 22 %,
# global + SWA 17 % stay eager)
CPU = Design("cpu", (256,), (0, 1), (0,), 4, ((128, 488), (256, 2440)),
             tuple(f"{variant}_D128" for variant in COMPARED) + ("mlr_D256",), Path("results/lm_cpu"), "outputs/lm_cpu")
DESIGNS = {"gpu": GPU, "cpu": CPU}
# a CPU shard's rates until the CPU pilot's results/lm_cpu/pilot.json measures them (thread seconds, one thread):
# D = 256 from the measured tokens/s (dense 1,440, MLR 1,455, SWA 1,141 at batch 4 x 1024; global + SWA their
# 2:4 mix), an evaluation of 128 windows at 3x the training rate; D = 128 at 2.5x the D = 256 rate (a guess)
_D256_STEP_S = {"dense": 4096 / 1440, "mlr": 4096 / 1455, "swa": 4096 / 1141,
                "gswa": (2 * 4096 / 1440 + 4 * 4096 / 1141) / 6}
ASSUMED_CPU_RATES = {f"{variant}_D{width}": {"step_s": step / (1 if width == 256 else 2.5),
                                               "eval_s": 32 * step / 3 / (1 if width == 256 else 2.5),
                                               "setup_s": 60.0}
                     for variant, step in _D256_STEP_S.items() for width in (128, 256)}


def variant_fields(variant: str, seq_len: int = SEQ_LEN, layers: int = LAYERS, head_dim: int = HEAD_DIM) -> dict:
    """Config fields of a variant (the module docstring's list), for head dim 64 or the tiny rehearsal's 16."""
    small = head_dim < 64
    if variant == "dense":
        return dict(attention="dense")
    if variant == "swa":
        return dict(attention="swa", sliding_window=min(129, seq_len // 4 + 1))
    if variant == "gswa":
        kinds = ["full_attention" if layer % 3 == 0 else "sliding_attention" for layer in range(layers)]
        return dict(attention="swa", sliding_window=min(129, seq_len // 4 + 1), layer_types=kinds)
    if variant == "mlr":
        return dict(attention="mlr", mlr_ranks=[8, 4, 2, 2] if small else [32, 8, 6, 4, 4, 4, 4, 2],
                    mlr_average_levels=True)
    if variant == "bilinear_mlr":
        return dict(attention="bilinear_mlr", bilinear_mlr_ranks=[4, 2] if small else [16, 8, 4, 4])
    if variant == "bilinear_btt":
        return dict(attention="bilinear_btt", btt_rank=1)
    raise ValueError(f"variant must be one of {', '.join(BASELINES + ('mlr',) + OBSERVED)}, got {variant!r}")


VARIANTS = ("dense", "swa", "gswa", "mlr", "bilinear_mlr", "bilinear_btt")


def model_config(variant: str, width: int, seq_len: int = SEQ_LEN, layers: int = LAYERS,
                 head_dim: int = HEAD_DIM) -> StructAttnGPT2Config:
    if width % head_dim:
        raise ValueError(f"width must be a multiple of the head dim {head_dim}, got {width}")
    fields = dict(vocab_size=257, n_positions=seq_len, n_embd=width, n_layer=layers, n_head=width // head_dim,
                  qk_layernorm=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=256,
                  eos_token_id=256, pad_token_id=256, **variant_fields(variant, seq_len, layers, head_dim))
    fields.update(mup_config_overrides())
    return StructAttnGPT2Config(**fields)


def flops_per_step(variant: str, width: int, seq_len: int = SEQ_LEN, layers: int = LAYERS, head_dim: int = HEAD_DIM,
                   batch: int = BATCH) -> float:
    """Training FLOPs of one run's step (``flops_per_token`` x tokens per step)."""
    config = model_config(variant, width, seq_len, layers, head_dim)
    return flops_per_token(config, seq_len, training=True) * batch * seq_len


def equal_flops_steps(variant: str, width: int, dense_steps: int = DENSE_STEPS, **size) -> int:
    """Steps that spend what ``dense_steps`` dense steps spend at this width."""
    return max(1, round(dense_steps * flops_per_step("dense", width, **size) / flops_per_step(variant, width, **size)))


def build_model(variant: str, width: int, **size) -> StructAttnGPT2LMHeadModel:
    model = StructAttnGPT2LMHeadModel(model_config(variant, width, **size))
    mup_init_(model)
    return model


def mup_multipliers(model) -> dict:
    return {name: group["lr_multiplier"] for group in mup_param_groups(model, lr=1.0, base_width=MUP_BASE_WIDTH)
            for name in group["names"]}


def lm_loss(forward, batch) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of one run's (B, T) token batch, in at least float32."""
    ids = batch[0]
    logits = forward(input_ids=ids, use_cache=False).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def window_nll_sum(forward, batch) -> torch.Tensor:
    """Summed next-token NLL (nats) of (W, T) windows."""
    ids = batch[0]
    logits = forward(input_ids=ids, use_cache=False).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def make_evaluate(windows: torch.Tensor, chunk: int = 8):
    """evaluate(stack) -> {"bits_per_byte", "loss"} (R,) on ``windows`` (W, T), the same windows for every run."""
    byte_count = int((windows[:, 1:] < 256).sum())
    token_count = windows[:, 1:].numel()

    def evaluate(stack) -> dict:
        total = torch.zeros(stack.runs, dtype=torch.float64, device=stack.device)
        for part in windows.split(chunk):
            part = part.to(stack.device)[None].expand(stack.runs, *part.shape)
            total += stack.evaluate(window_nll_sum, (part,)).double()
        return {"bits_per_byte": total / math.log(2) / byte_count, "loss": total / token_count}

    return evaluate


def arm_spec(variant: str, width: int, corpus, windows, seq_len=SEQ_LEN, layers=LAYERS, head_dim=HEAD_DIM,
             batch=BATCH) -> ArmSpec:
    from hf_structattn.training.data import lm_micro_batch

    size = dict(seq_len=seq_len, layers=layers, head_dim=head_dim)
    return ArmSpec(
        name=f"{variant}_D{width}", build=lambda seed: build_model(variant, width, **size),
        batch=lambda seed, step: (lm_micro_batch(corpus.train, seq_len, step, 0, 0, 1, batch, 1, seed),),
        loss=lm_loss, evaluate=make_evaluate(windows), flops_per_step=flops_per_step(variant, width, batch=batch,
                                                                                      **size),
        lr_multipliers=mup_multipliers,
        config={"variant": variant, "width": width, "seq_len": seq_len, "layers": layers, "head_dim": head_dim,
                "batch": batch, "corpus": corpus.description})


def load_data(max_train_bytes=None, max_validation_bytes=None, seq_len=SEQ_LEN, eval_windows=EVAL_WINDOWS):
    """The design's corpus (held-out files without near-copies of training files) and its evaluation windows."""
    from hf_structattn.training.data import eval_windows as spread_windows, load_stdlib_corpus

    corpus = load_stdlib_corpus(max_train_bytes=max_train_bytes, max_validation_bytes=max_validation_bytes,
                                near_copy_jaccard=NEAR_COPY_JACCARD)
    return corpus, spread_windows(corpus.validation, seq_len, eval_windows)


def design_rows(design: Design = GPU, variants=VARIANTS) -> list[dict]:
    """Per (width, variant) of ``design``: steps (equal FLOPs), FLOPs per step and per run."""
    rows = []
    for width in design.all_widths:
        for variant in variants:
            steps = equal_flops_steps(variant, width, design.dense_steps_at(width))
            per_step = flops_per_step(variant, width, batch=design.batch)
            rows.append({"variant": variant, "width": width, "steps": steps, "flops_per_step": per_step,
                         "run_flops": steps * per_step})
    return rows


def _row(variant: str, width: int, design: Design = GPU) -> dict:
    return next(row for row in design_rows(design, (variant,)) if row["width"] == width)


def plan(args) -> None:
    design = DESIGNS[args.design]
    rows = design_rows(design, COMPARED)
    tokens = design.batch * SEQ_LEN
    print(f"design {design.name}: batch {design.batch} x {SEQ_LEN} tokens\n")
    print("| variant | D | FLOPs/token (train) | steps (equal FLOPs) | tokens per run | FLOPs per run | runs |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        per_token = row["flops_per_step"] / tokens
        grid = len(LRS) * len(design.grid_seeds) if row["width"] == TUNE_WIDTH else 0
        runs = grid + (len(design.seeds) if row["width"] in design.widths and row["width"] != TUNE_WIDTH else 0)
        print(f"| {row['variant']} | {row['width']} | {per_token / 1e6:.1f} M | {row['steps']:,} | "
              f"{row['steps'] * tokens / 1e6:.1f} M | {row['run_flops']:.3g} | {runs} |")
    if design is CPU:
        units = [unit for _, stage in cpu_stages([], design) for unit in stage]
        total = sum(_row(u["variant"], u["width"], design)["run_flops"] for u in units)
        print(f"\nplanned: {len(units)} runs, {total:.3g} training FLOPs (edge runs, if triggered, add at most "
              f"{len(COMPARED) * len(design.grid_seeds)} runs at D = {TUNE_WIDTH}); `plan --shards --design cpu` "
              "sizes the shards")
        return
    units = [unit for members in shards(Path(args.results)).values() for unit in members]
    total = sum(unit["flops"] for unit in units)
    print(f"\nplanned: {sum(u['runs'] for u in units)} runs, {total:.3g} training FLOPs (edge runs, if triggered, "
          f"add at most {len(COMPARED) * 2 * len(SEEDS)} runs at D = {TUNE_WIDTH}); `plan --shards` sizes the shards")


# ------------------------------------------------------------------------------------------------- shards and rule


def planned_lrs(runs: list[dict], variant: str, design: Design = GPU) -> list[float] | None:
    """The D = 128 LRs of ``variant``: the grid plus the edge LRs its finished grid runs (the design's grid seeds)
    trigger; None until every grid run has finished."""
    grid = {(r["lr"], r["seed"]): r for r in runs if r["arm"] == f"{variant}_D{TUNE_WIDTH}"}
    if any((lr, seed) not in grid for lr in LRS for seed in design.grid_seeds):
        return None
    best = [min(LRS, key=lambda lr: run_score(grid[lr, seed], "bits_per_byte")) for seed in design.grid_seeds]
    return list(LRS) + edge_extensions(best, LRS)


def transfer_lr(runs: list[dict], variant: str, design: Design = GPU) -> float | None:
    """The LR ``variant`` runs at the widths above D = 128: the lowest mean bits/byte over the grid seeds at
    D = 128, over the grid and its edge runs; None until all of those have finished."""
    lrs = planned_lrs(runs, variant, design)
    grid = {(r["lr"], r["seed"]): run_score(r, "bits_per_byte") for r in runs if r["arm"] == f"{variant}_D{TUNE_WIDTH}"}
    if lrs is None or any((lr, seed) not in grid for lr in lrs for seed in design.grid_seeds):
        return None
    return min(lrs, key=lambda lr: sum(grid[lr, seed] for seed in design.grid_seeds))


def shards(results: Path = RESULTS, limit: float | None = None) -> dict[str, list[dict]]:
    """Shard id -> units ({name, variant, width, lrs ("grid", "edge" or "transfer"), runs, flops}): s1.. the D = 128
    grid, then the transferred widths; ``x``: the edge LRs the finished grid runs trigger (empty until they do)."""
    limit = limit or SHARD_MINUTES * 60 * shard_rate(results, ASSUMED_H100_FLOPS_PER_S)[0]
    runs = read_run_jsons(results)
    out, index = {}, 0
    stages = [[dict(variant=v, width=TUNE_WIDTH, lrs=list(LRS), seeds=list(SEEDS), runs=len(LRS) * len(SEEDS))
               for v in COMPARED]]
    stages += [[dict(variant=v, width=w, lrs=None, seeds=list(SEEDS), runs=len(SEEDS)) for v in COMPARED]
               for w in WIDTHS if w != TUNE_WIDTH]  # lrs None: the variant's transferred LR
    for number, stage in enumerate(stages):
        for unit in stage:
            unit.update(name=f"{unit['variant']}_D{unit['width']}",
                        flops=unit["runs"] * _row(unit["variant"], unit["width"])["run_flops"])
        for members in pack_shards(stage, limit):
            index += 1
            out[f"s{index}"] = members
        if number == 0:
            out.update(edge_shards(runs, limit))  # the edge runs right after the grid they extend
    return out


def edge_shards(runs: list[dict], limit: float) -> dict[str, list[dict]]:
    edges = []
    for variant in COMPARED:
        lrs = planned_lrs(runs, variant) or []
        for lr in lrs[len(LRS):]:
            edges.append(dict(variant=variant, width=TUNE_WIDTH, lrs=[lr], seeds=list(SEEDS), runs=len(SEEDS),
                              name=f"{variant}_D{TUNE_WIDTH} lr {lr:g}",
                              flops=len(SEEDS) * _row(variant, TUNE_WIDTH)["run_flops"]))
    return {f"x{number}": members for number, members in enumerate(pack_shards(edges, limit), start=1)}


def unit_lrs(unit: dict, runs: list[dict]) -> list[float] | None:
    """A unit's LRs: its own, or (lrs None) its variant's transferred LR, None until that is known."""
    if unit["lrs"] is not None:
        return list(unit["lrs"])
    lr = transfer_lr(runs, unit["variant"])
    return None if lr is None else [lr]


def unit_done(unit: dict, runs: list[dict]) -> int:
    lrs = unit_lrs(unit, runs)
    names = {r["name"] for r in runs}
    arm = f"{unit['variant']}_D{unit['width']}"
    return 0 if lrs is None else sum(run_name(arm, lr, s) in names for lr in lrs for s in unit["seeds"])


def scores(runs: list[dict], design: Design = GPU) -> dict:
    """(variant, width, seed) -> score (module docstring's rule), for the (variant, width)s of ``design``'s rule
    whose inputs are all finished; a diverged run scores ``inf`` (``sweep.run_score``)."""
    best = {}
    for variant in COMPARED:
        lrs, lr = planned_lrs(runs, variant, design), transfer_lr(runs, variant, design)
        for width in design.widths:
            values = {(r["lr"], r["seed"]): run_score(r, "bits_per_byte") for r in runs
                      if r["arm"] == f"{variant}_D{width}"}
            for seed in design.seeds:
                if width == TUNE_WIDTH and lrs and all((x, seed) in values for x in lrs):
                    best[variant, width, seed] = min(values[x, seed] for x in lrs)
                elif width != TUNE_WIDTH and lr is not None and (lr, seed) in values:
                    best[variant, width, seed] = values[lr, seed]
    return best


def verdict(best: dict, widths=WIDTHS, seeds=SEEDS) -> str:
    """The rule of the module docstring on ``best`` ((variant, width, seed) -> score): YES, NO at a majority of
    ``widths`` (2 of the GPU design's 3, the CPU design's one), UNDECIDED, PARTIAL."""
    needed = [(v, w, s) for v in COMPARED for w in widths for s in seeds]
    missing = [key for key in needed if key not in best]
    if missing:
        return f"PARTIAL: {len(missing)} of {len(needed)} (variant, width, seed) scores still missing"

    def better(first, second, width):  # `first` lower than `second` by the margin in every seed
        return lower_in_every_seed(best, first, second, width, seeds, MARGIN)

    if all(better("mlr", base, w) for base in BASELINES for w in widths):
        return "YES: MLR is lower than dense, SWA and global+SWA by >= 0.01 bits/byte in both seeds at every width"
    lost_widths = [w for w in widths if any(better(base, "mlr", w) for base in BASELINES)]
    if majority(len(lost_widths), widths):
        winners = "; ".join(f"D = {w}: {', '.join(base for base in BASELINES if better(base, 'mlr', w))}"
                            for w in lost_widths)
        return (f"NO: a baseline is lower than MLR by >= 0.01 bits/byte in both seeds at D = {lost_widths} "
                f"({winners})")
    reasons = [f"D = {w}: MLR vs {base}" for w in widths for base in BASELINES if not better("mlr", base, w)]
    return "UNDECIDED: no consistent 0.01 bits/byte gap at " + "; ".join(reasons)


def scored_run(runs: list[dict], variant: str, width: int, seed: int, design: Design = GPU) -> dict | None:
    """The run whose final value is the rule's score of (variant, width, seed) (:func:`scores`): at D = 128 the
    best of its planned LRs, above it the run at the transferred LR; None until the score exists."""
    if width == TUNE_WIDTH:
        lrs = planned_lrs(runs, variant, design) or []
        mine = [r for r in runs if r["arm"] == f"{variant}_D{width}" and r["seed"] == seed and r["lr"] in lrs]
        if not lrs or len(mine) < len(lrs):
            return None
        return min(mine, key=lambda r: run_score(r, "bits_per_byte"))
    lr = transfer_lr(runs, variant, design)
    return next((r for r in runs if r["arm"] == f"{variant}_D{width}" and r["seed"] == seed and lr is not None
                 and r["lr"] == lr), None)


def first_reach(run: dict, target: float, metric: str = "bits_per_byte") -> dict | None:
    """The first evaluation of ``run`` whose ``metric`` is at or below ``target``, as {"step", "flops", "cpu_s"}
    (``cpu_s``: the thread seconds the run had spent outside evaluations by then, ``thread - eval_thread`` of the
    record; None for a record without them); None when no evaluation gets there."""
    for record in run.get("evals") or []:
        value = record.get(metric)
        if value is not None and math.isfinite(value) and value <= target:
            thread, evals = record.get("thread"), record.get("eval_thread")
            return {"step": record["step"], "flops": record["flops"],
                    "cpu_s": None if thread is None or evals is None else thread - evals}
    return None


def readout(runs: list[dict], design: Design = CPU) -> list[dict]:
    """Per width of ``design``, baseline and seed, MLR against that baseline's scored runs (module docstring,
    "Readout"): ``gap`` (MLR's score minus the baseline's, bits/byte; None while a run is missing, ``nan`` when
    either diverged), and for the baseline and for MLR the first evaluation at or below the baseline's final
    bits/byte (:func:`first_reach`; None: not reached). Not part of the rule."""
    rows = []
    for width in design.widths:
        for base in BASELINES:
            for seed in design.seeds:
                mine, theirs = (scored_run(runs, v, width, seed, design) for v in ("mlr", base))
                row = {"width": width, "baseline": base, "seed": seed, "mlr": mine, "base": theirs, "gap": None,
                       "target": None, "reach": {}}
                if mine is not None and theirs is not None:
                    a, b = run_score(mine, "bits_per_byte"), run_score(theirs, "bits_per_byte")
                    row["gap"] = a - b if math.isfinite(a) and math.isfinite(b) else math.nan
                    if math.isfinite(b):
                        row["target"] = b
                        row["reach"] = {"mlr": first_reach(mine, b), "base": first_reach(theirs, b)}
                rows.append(row)
    return rows


def readout_lines(rows: list[dict]) -> list[str]:
    """:func:`readout` as the markdown table ``report --design cpu`` prints."""
    def run_cell(run):
        if run is None:
            return "not yet"
        if not math.isfinite(run_score(run, "bits_per_byte")):
            return "diverged"
        return f"{run['final']['bits_per_byte']:.4f}"

    def reach_cell(row, key):
        if row["target"] is None:
            return "-"
        hit = row["reach"][key]
        if hit is None:
            return "not reached"
        cpu = "n/a" if hit["cpu_s"] is None else f"{hit['cpu_s']:,.0f}"
        return f"{hit['flops']:.3g}, {cpu} (step {hit['step']:,})"

    lines = ["READOUT (not part of the rule): MLR's final gap to each baseline at equal FLOPs (MLR minus baseline, "
             "bits/byte), and the training FLOPs and CPU-seconds (thread clock, evaluations excluded) each arm "
             "needed to first reach the baseline's final bits/byte (at its evaluations, 8 a run)", "",
             "| D | baseline | seed | baseline final | MLR final | gap (MLR - baseline) | baseline to its final: "
             "FLOPs, CPU-s | MLR to it: FLOPs, CPU-s |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        gap = "-" if row["gap"] is None else ("diverged" if math.isnan(row["gap"]) else f"{row['gap']:+.4f}")
        lines.append(f"| {row['width']} | {row['baseline']} | {row['seed']} | {run_cell(row['base'])} | "
                     f"{run_cell(row['mlr'])} | {gap} | {reach_cell(row, 'base')} | {reach_cell(row, 'mlr')} |")
    return lines


def report(args) -> None:
    results = Path(args.results)
    runs = read_run_jsons(results)
    best = scores(runs)
    print("\n".join(run_table(runs, best, COMPARED, WIDTHS, SEEDS, "bits_per_byte", "variant")))
    for variant in COMPARED:
        lr = transfer_lr(runs, variant)
        print(f"transferred LR of {variant}: {'not yet (D = 128 runs missing)' if lr is None else f'{lr:g}'}")
    print("VERDICT (MLR vs dense, SWA, global+SWA at equal FLOPs):", verdict(best))
    table = shards(results)
    left = [sid for sid, units in table.items() if sum(unit_done(u, runs) for u in units) <
            sum(u["runs"] for u in units)]
    print(f"shards left: {', '.join(left) or 'none'}" +
          (f"; continue: python scripts/lm_experiment.py shard {left[0]} --device cuda" if left else ""))


def run_shard(args, shard_id: str) -> None:
    """Train a shard's units (one stacked model each), skipping runs with a results file; ``--budget-s`` stops
    with a checkpoint that a rerun resumes."""
    results = Path(args.results)
    table = shards(results)
    if shard_id not in table:
        raise SystemExit(f"shard: unknown id {shard_id!r}; the shards now are {', '.join(table)}")
    runs = read_run_jsons(results)
    started = time.perf_counter()
    corpus, windows = None, None
    for unit in table[shard_id]:
        lrs = unit_lrs(unit, runs)
        if lrs is None:
            raise SystemExit(f"shard {shard_id}: {unit['name']} runs at {unit['variant']}'s transferred LR, which "
                             f"needs every D = {TUNE_WIDTH} run of {unit['variant']} (its grid shard and edge "
                             "runs) first; `report` lists what is left")
        if corpus is None:
            corpus, windows = load_data()
        row = _row(unit["variant"], unit["width"])
        spec = arm_spec(unit["variant"], unit["width"], corpus, windows)
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - started)
        if left is not None and left <= 0 or not run_unit(spec, lrs, unit["seeds"], row["steps"],
                                                          max(1, row["steps"] // EVALS_PER_RUN), Path(args.out),
                                                          results, args.device, left):
            print(f"stopped by --budget-s in {unit['name']}; rerun the command to resume", flush=True)
            return
        print(f"done {unit['name']} (lrs {lrs}) at {time.perf_counter() - started:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------------ the CPU design


def cpu_stages(runs: list[dict], design: Design = CPU) -> list[tuple[str, list[dict]]]:
    """The CPU design's run units by stage (:func:`sweep.cpu_shards`): ``g`` the D = 128
    grid (seed 0), ``x`` the edge LRs its finished runs trigger, ``s`` the scored D = 256 runs (seed 0 of every
    variant, then seed 1) at their variant's transferred LR (None until the grid has picked it)."""
    def unit(variant, width, lr, seed, label):
        steps = equal_flops_steps(variant, width, design.dense_steps_at(width))
        return dict(name=label, variant=variant, width=width, arm=f"{variant}_D{width}", lr=lr, seed=seed,
                    steps=steps, eval_every=max(1, steps // EVALS_PER_RUN), rate=f"{variant}_D{width}")

    grid = [unit(v, TUNE_WIDTH, lr, seed, f"{v}_D{TUNE_WIDTH} lr {lr:g} s{seed}")
            for v in COMPARED for seed in design.grid_seeds for lr in LRS]
    edges = [unit(v, TUNE_WIDTH, lr, seed, f"{v}_D{TUNE_WIDTH} lr {lr:g} s{seed}")
             for v in COMPARED for lr in (planned_lrs(runs, v, design) or [])[len(LRS):] for seed in design.grid_seeds]
    scored = [unit(v, width, transfer_lr(runs, v, design), seed, f"{v}_D{width} s{seed}")
              for width in design.widths for seed in design.seeds for v in COMPARED]
    return [("g", grid), ("x", edges), ("s", scored)]


def cpu_shard_map(results: Path, design: Design = CPU) -> tuple[dict, str]:
    """Shard id -> segments of the CPU design at the committed pilot's rates; and where the rates came from."""
    rates, source = cpu_rates(results, ASSUMED_CPU_RATES)
    return cpu_shards(cpu_stages(read_run_jsons(results), design), rates), source


def cpu_report(args, design: Design = CPU) -> None:
    results = Path(args.results)
    runs = read_run_jsons(results)
    best = scores(runs, design)
    print("\n".join(run_table(runs, best, COMPARED, design.all_widths, design.seeds, "bits_per_byte", "variant")))
    for variant in COMPARED:
        lr = transfer_lr(runs, variant, design)
        print(f"LR of {variant} at D = {', '.join(map(str, design.widths))} (its best at D = {TUNE_WIDTH}): "
              f"{'not yet (grid runs missing)' if lr is None else f'{lr:g}'}")
    print(f"VERDICT (CPU design, D = {', '.join(map(str, design.widths))}: MLR vs dense, SWA, global+SWA at equal "
          "FLOPs):", verdict(best, design.widths, design.seeds))
    print("\n".join(readout_lines(readout(runs, design))))
    table, _ = cpu_shard_map(results, design)
    names, records = {r["name"] for r in runs}, read_shard_records(results)
    print(cpu_progress(table, names, records, "python scripts/lm_experiment.py shard {id} --design cpu"))


def cpu_spec(segment: dict, corpus, windows, design: Design = CPU) -> ArmSpec:
    return arm_spec(segment["variant"], segment["width"], corpus, windows, batch=design.batch)


def run_cpu(args, shard_id: str, design: Design = CPU) -> bool:
    results = Path(args.results)
    table, _ = cpu_shard_map(results, design)
    data = {}

    def spec_of(segment):
        if not data:
            data["corpus"], data["windows"] = load_data()
        return cpu_spec(segment, data["corpus"], data["windows"], design)

    compiled = all(s["rate"] in design.compiled for s in table.get(shard_id, [])) and not args.eager
    return run_cpu_shard(shard_id, table, spec_of, Path(args.out), results, args.budget_s, compile_step=compiled)


def cpu_pilot_command(args, design: Design = CPU) -> dict:
    """The CPU design's pilot: every variant at D = 256 then D = 128, in the step mode its shards use (module
    docstring), rates on one thread (``sweep.cpu_pilot``); ``--tiny``: the rehearsal at
    the tiny size (nothing is written to the results folder)."""
    started = time.perf_counter()
    thread = time.thread_time()
    if args.tiny:
        size = dict(seq_len=TINY["seq_len"], layers=TINY["layers"], head_dim=TINY["head_dim"])
        corpus, windows = load_data(TINY["max_train_bytes"], TINY["max_validation_bytes"], TINY["seq_len"],
                                    TINY["eval_windows"])
        widths, batch = (TINY["width"],), TINY["batch"]
    else:
        size = dict(seq_len=SEQ_LEN, layers=LAYERS, head_dim=HEAD_DIM)
        corpus, windows = load_data()
        widths, batch = tuple(sorted(design.all_widths, reverse=True)), design.batch
    setup_s = time.thread_time() - thread
    arms = [(f"{variant}_D{width}",
             (lambda variant=variant, width=width: arm_spec(variant, width, corpus, windows, batch=batch, **size)),
             f"{variant}_D{width}" in design.compiled and not args.eager and not args.tiny, batch * size["seq_len"])
            for width in widths for variant in COMPARED]
    assumed = {key: ASSUMED_CPU_RATES.get(key, {"step_s": 1.0, "eval_s": 1.0, "setup_s": 1.0}) for key, *_ in arms}
    summary = {"command": "pilot --design cpu", "tiny": args.tiny, "batch": batch, "seq_len": size["seq_len"],
               "units": "tokens", "corpus": corpus.description}
    return cpu_pilot(arms, setup_s, Path(args.out), None if args.tiny else Path(args.results), args.budget_s,
                     started, assumed, steps=2 if args.tiny else 5, summary=summary)


def time_command(args, design: Design = CPU) -> list[dict]:
    """Eager against compiled training steps of the design's arms (``--arms``: variants, at D = 256, or
    ``<variant>_D<width>``; default the four variants at D = 256), by ``step_timing`` (one thread, thread clock,
    interleaved after warm-up, the compile apart); the rows are merged into ``results/step_timing.json``."""
    corpus, windows = load_data(max_train_bytes=2_000_000, max_validation_bytes=200_000, eval_windows=4)
    keys = [arm if "_D" in arm else f"{arm}_D{max(design.widths)}" for arm in (args.arms or COMPARED)]
    specs = [arm_spec(key.split("_D")[0], int(key.split("_D")[1]), corpus, windows, batch=design.batch)
             for key in keys]
    rows = step_timing(specs, repeats=5)
    print("| arm | eager s/step | compiled s/step | saving | compile s (thread / wall) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {row['eager_ms'] / 1000:.2f} | {row['compiled_ms'] / 1000:.2f} | "
              f"{100 * row['saving']:.0f} % | {row['compile_thread_s']:.0f} / {row['compile_s']:.0f} |")
    out = Path(args.results) / "step_timing.json"
    merge_timing(out, rows, {"batch": design.batch, "seq_len": SEQ_LEN})
    return rows


# ------------------------------------------------------------------------------------------------------- run, pilot


def pilot(args) -> dict:
    """Dense and MLR at D = 128, 3 LRs x seed 0 stacked, 300 steps each within ``--budget-s``: ms per step, the
    measured FLOP rate, and the full design's projected time on this device; writes pilot.md / pilot.json."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()  # the budget covers loading the corpus too
    if args.tiny:
        size = dict(seq_len=TINY["seq_len"], layers=TINY["layers"], head_dim=TINY["head_dim"])
        corpus, windows = load_data(TINY["max_train_bytes"], TINY["max_validation_bytes"], TINY["seq_len"],
                                    TINY["eval_windows"])
        width, steps, batch, variants = TINY["width"], TINY["steps"], TINY["batch"], TINY["variants"]
    else:
        size = dict(seq_len=SEQ_LEN, layers=LAYERS, head_dim=HEAD_DIM)
        corpus, windows = load_data(eval_windows=PILOT["eval_windows"])
        width, steps, batch, variants = PILOT["width"], PILOT["steps"], BATCH, PILOT["variants"]
    summary = {"command": "pilot", "device": device_name(args.device), "tiny": args.tiny, "width": width,
               "steps_planned": steps, "lrs": list(LRS), "seed": 0, "budget_s": args.budget_s, "arms": {}}
    training_budget = PILOT["train_share"] * args.budget_s
    for index, variant in enumerate(variants):
        spec = arm_spec(variant, width, corpus, windows, batch=batch, **size)
        arm = StackedArm(spec, LRS, [0], steps, max(1, steps // 2), out, args.device, chunk=10)
        left = (training_budget - (time.perf_counter() - started)) / (len(variants) - index)
        begin, step_before = time.perf_counter(), arm.step
        done = arm.run_until(max(1.0, left))
        seconds = time.perf_counter() - begin
        evaluations = len((arm.folders()[0] / "progress.jsonl").read_text().splitlines())
        firsts = [json.loads((f / "progress.jsonl").read_text().splitlines()[0])["bits_per_byte"]
                  for f in arm.folders()]
        lasts = [json.loads((f / "progress.jsonl").read_text().splitlines()[-1])["bits_per_byte"]
                 for f in arm.folders()]
        if done:
            arm.finish()
        ran = arm.step - step_before
        summary["arms"][variant] = {
            "steps_done": arm.step, "finished": done, "ms_per_step": round(1000 * seconds / max(1, ran), 2),
            "flops_per_s": arm.spec.flops_per_step * len(LRS) * ran / seconds,
            "bits_per_byte_start": firsts, "bits_per_byte_end": lasts, "evaluations": evaluations}
    probe_width = TINY["probe_width"] if args.tiny else max(WIDTHS)
    summary["probe"] = {"width": probe_width, "arms": {}}
    total = sum(unit["flops"] for units in shards(RESULTS).values() for unit in units)
    return finish_pilot(summary, VARIANTS,
                        lambda name: arm_spec(name, probe_width, corpus, windows[:1], batch=batch, **size), LRS,
                        args.device, started, args.budget_s, total, out, pilot_markdown, Path(args.results))


def pilot_markdown(summary: dict) -> str:
    size = "tiny CPU rehearsal (D = 32, T = 64, 2 layers), not a measurement" if summary["tiny"] else \
        f"D = {summary['width']}, T = {SEQ_LEN}, {LAYERS} layers, {summary['steps_planned']} steps planned"
    lines = [f"### LM pilot: dense and MLR, 3 LRs stacked, seed {summary['seed']}", "",
             f"Device: {summary['device']}; {size}; budget {summary['budget_s']:g} s, wall {summary['wall_s']:.1f} s.",
             "", "| variant | steps done | ms/step (3 runs stacked) | FLOP/s | bits/byte at step 0 -> end, per LR |",
             "|---|---|---|---|---|"]
    for variant, arm in summary["arms"].items():
        change = ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in zip(arm["bits_per_byte_start"],
                                                                  arm["bits_per_byte_end"]))
        lines.append(f"| {variant} | {arm['steps_done']} | {arm['ms_per_step']:.1f} | {arm['flops_per_s']:.3g} | "
                     f"{change} |")
    lines += probe_markdown(summary, "variant")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = design_arguments(argv, __doc__.split("\n\n")[0], "outputs/lm_equal_flops", "outputs/lm_pilot",
                            str(RESULTS), designs={"gpu": (str(GPU.results), GPU.out, "outputs/lm_pilot"),
                                                   "cpu": (str(CPU.results), CPU.out, "outputs/lm_cpu_pilot")})
    if args.design == "cpu":
        return cpu_main(args)
    if args.command == "time":
        raise SystemExit("time: the eager / compiled comparison is the CPU design's (--design cpu)")
    if args.command == "plan" and args.shards:
        results = Path(args.results)
        print("\n".join(shard_table(results, shards(results), unit_done, ASSUMED_H100_FLOPS_PER_S,
                                    "python scripts/lm_experiment.py shard {id} --device cuda")))
    elif args.command == "plan":
        plan(args)
    elif args.command == "shard":
        run_shard(args, args.shard_id)
    elif args.command == "run":  # every shard in order, the edge runs as soon as the grid triggers them
        while True:
            runs = read_run_jsons(Path(args.results))
            left = [sid for sid, units in shards(Path(args.results)).items()
                    if sum(unit_done(u, runs) for u in units) < sum(u["runs"] for u in units)]
            if not left:
                break
            before = len(runs)
            run_shard(args, left[0])
            if len(read_run_jsons(Path(args.results))) == before:
                break  # stopped by --budget-s
    elif args.command == "report":
        report(args)
    else:
        pilot(args)


def cpu_main(args) -> None:
    command = "python scripts/lm_experiment.py shard {id} --design cpu"
    results = Path(args.results)
    if args.command == "plan" and args.shards:
        table, source = cpu_shard_map(results, CPU)
        runs = read_run_jsons(results)
        print("\n".join(cpu_shard_lines(table, source, {r["name"] for r in runs}, read_shard_records(results),
                                         command)))
    elif args.command == "plan":
        plan(args)
    elif args.command == "shard":
        run_cpu(args, args.shard_id)
    elif args.command == "run":  # the shards one after another, each as soon as what it needs is done
        while True:
            runs = read_run_jsons(results)
            ready = runnable_shards(cpu_shard_map(results, CPU)[0], {r["name"] for r in runs},
                                    read_shard_records(results))
            if not ready or not run_cpu(args, ready[0]):
                break
    elif args.command == "report":
        cpu_report(args)
    elif args.command == "time":
        time_command(args)
    else:
        cpu_pilot_command(args)


if __name__ == "__main__":
    sys.exit(main())
