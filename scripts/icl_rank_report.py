"""Verdicts, tables, shards and plot of ``scripts/icl_rank_experiment.py``: the registered decisive d = 4 design
(docs/results.md, "ICL rank: the decisive design").

    python scripts/icl_rank_experiment.py report     # reads results/icl_rank/decisive_d4/*.json (one per run)

Error = last-query MSE on 1024 fresh prompts / Var(y) of those prompts ("predict 0" = 1). A run is frozen at its
first evaluation below 0.05 (its last evaluation then stands). Only finished runs (a results file) count. Seeds 1-3
are ruled on; seed 0 (results/icl_rank/d4/) is the calibration, reported only.

Rank rule (the paper's Fig. 2 / 3a claim: multi-head dense attention with head dim r well below d cannot solve
in-context regression while full-rank scores can). Inputs: (i) dense, 12 heads, r = d/2, at lr 1e-3 in seeds 1-3
and at 3e-4 in seeds 1-2, 40,000 steps; (iii) bilinear BTT and (v) dense, 3 heads, r = 2d (same width as (i), only
the head split differs), at lr 1e-3 in seeds 1-3, 20,000 steps.

* NO as soon as any finished run of (i) ends below 0.1.
* YES once every input has finished, when (iii) and (v) end below 0.1 in every seed and every run of (i) ends above
  0.5.
* UNDECIDED otherwise, with the reasons; PARTIAL before the inputs are complete (unless NO).

(ii), dense with 1 head (r = D), is an observation: the paper's own Fig. 3a needs it at twice BTT's width.

Equal-compute reading (the paper's Fig. 3b, for bilinear BTT only: this design does not run bilinear MLR). A run's
cost is its cumulative training FLOPs at its first evaluation with error below 0.1 (transformer blocks, read-in and
read-out excluded as in the paper; backward = 2x forward); a run that never gets there is censored at its total
FLOPs. An arm's cost in a seed is the least over its runs there. A is cheaper than B when A's cost is finite and at
most 0.8x B's: B's cost if finite, else B's censored total (B never reached 0.1 within it); if A's cost is more
than 0.8x a censored B's total, the pair cannot be compared. YES when (iii) is cheaper than both (i) and (ii) in
every seed; NO when in every seed the cheaper of (i) and (ii) is cheaper than (iii); UNDECIDED otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional

from icl_rank_arms import (CALIBRATION_SEED, DESIGN_D, DESIGN_SEEDS, FAILED, LABELS, LOW_RANK, OBSERVED, RULED,
                           SHARDS, SOLVED, arms, cap, design_runs)

from sweep import read_run_jsons

CONTROLS = tuple(arm for arm in RULED if arm != LOW_RANK)  # (iii), (v): must solve for a YES
EQUAL_COMPUTE_BILINEAR = "iii_btt8"
EQUAL_COMPUTE_DENSE = (LOW_RANK, "ii_dense1")
THRESHOLD = SOLVED  # the equal-compute reading's error threshold (>= the freezing threshold 0.05)
CHEAPER = 0.8  # A cheaper than B: cost(A) <= 0.8 cost(B)
COLOURS = {"i_dense12_half": "#d62728", "ii_dense1": "#1f77b4", "iii_btt8": "#2ca02c", "iv_mlr8": "#9467bd",
           "v_dense3_rank": "#ff7f0e", "vi_dense8_wide": "#8c564b"}


def load_runs(folder: Path) -> list[dict]:
    """The finished runs' results files under ``folder``: arm, lr, seed, ``final`` (last error), evaluations."""
    return [{**record, "final": record["final"]["error_last"]} for record in read_run_jsons(folder)]


def stack_key(run: dict) -> tuple:
    """The stack a run trained in: its arm, LR, stack size and device (the design trains each (arm, LR)'s seeds as one
    stacked model in one shard)."""
    return run["arm"], run["lr"], run["batched_with"], str(run.get("device", ""))


def stack_ms_per_step(runs: list[dict]) -> dict:
    """:func:`stack_key` -> ms of wall per step of that stack: its wall (the largest ``wall_s`` of its runs, each
    written as the stack finished) over the steps the stack ran, the most any of its runs ran (a frozen run stops at
    the step it froze while the stack trains on, so its own ``final_step`` would overstate the cost of a step)."""
    walls: dict = {}
    for run in runs:
        wall, steps = walls.get(stack_key(run), (0.0, 0))
        walls[stack_key(run)] = (max(wall, run["wall_s"]), max(steps, run["final_step"]))
    return {key: 1000 * wall / max(1, steps) for key, (wall, steps) in walls.items()}


def _run(runs, arm, lr, seed) -> Optional[dict]:
    return next((r for r in runs if r["arm"] == arm and r["lr"] == lr and r["seed"] == seed), None)


def _name(run: dict) -> str:
    return f"{LABELS[run['arm']].split(' ')[0]} lr {run['lr']:g} seed {run['seed']} ({run['final']:.3f})"


def verdict(runs: list[dict]) -> str:
    """The rank rule (module docstring) on the finished runs of the design."""
    low = sorted((r for r in runs if r["arm"] == LOW_RANK and r["seed"] in DESIGN_SEEDS),
                 key=lambda r: (r["seed"], r["lr"]))
    solved = [r for r in low if r["final"] < SOLVED]
    if solved:
        return "NO: dense attention with r = d/2 ends below 0.1: " + ", ".join(map(_name, solved))
    missing = [key for key in design_runs() if key[0] in RULED and not _run(runs, *key)]
    if missing:
        return f"PARTIAL: {len(missing)} of the rule's {len([k for k in design_runs() if k[0] in RULED])} runs " \
               "still to finish"
    reasons = [f"{_name(_run(runs, *key))} does not end below 0.1" for key in design_runs()
               if key[0] in CONTROLS and _run(runs, *key)["final"] >= SOLVED]
    reasons += [f"{_name(r)} ends between 0.1 and 0.5" for r in low if r["final"] <= FAILED]
    if not reasons:
        return "YES: (iii) and (v) end below 0.1 in every seed while every run of (i) ends above 0.5"
    return "UNDECIDED: " + "; ".join(reasons)


class Cost(NamedTuple):
    """FLOPs to error 0.1 (``inf`` if never) and the total FLOPs the run(s) were given (the censoring budget)."""
    flops: float
    budget: float


def flops_to_threshold(run: dict, flops: list[float]) -> Cost:
    """``run``'s Cost: cumulative training FLOPs (``flops[step]``) at its first evaluation below THRESHOLD (inf if
    none), and its total FLOPs ``flops[final_step]``."""
    budget = flops[min(run["final_step"], len(flops) - 1)]
    for record in run["evals"]:
        if record["error_last"] < THRESHOLD:
            return Cost(flops[min(record["step"], len(flops) - 1)], budget)
    return Cost(math.inf, budget)


def cheaper(first: Cost, second: Cost) -> Optional[bool]:
    """Is ``first`` cheaper than ``second`` (module docstring)? None when a censored ``second`` cannot tell."""
    if first.flops == math.inf:
        return False
    if second.flops < math.inf:
        return first.flops <= CHEAPER * second.flops
    return True if first.flops <= CHEAPER * second.budget else None


def cost_table(runs: list[dict], flops: dict, arm_names, seeds=DESIGN_SEEDS) -> dict:
    """(arm, seed) -> that arm's least Cost over its registered runs in the seed, where all of them finished."""
    table = {}
    for arm in arm_names:
        for seed in seeds:
            planned = [key for key in design_runs() if key[0] == arm and key[2] == seed]
            found = [_run(runs, *key) for key in planned]
            if planned and all(found):
                costs = [flops_to_threshold(run, flops[arm]) for run in found]
                table[arm, seed] = Cost(min(c.flops for c in costs), max(c.budget for c in costs))
    return table


def equal_compute_verdict(table: dict, seeds=DESIGN_SEEDS) -> str:
    """The equal-compute reading (module docstring) on ``table`` ((arm, seed) -> Cost)."""
    needed = [(arm, s) for arm in (EQUAL_COMPUTE_BILINEAR,) + EQUAL_COMPUTE_DENSE for s in seeds]
    missing = [key for key in needed if key not in table]
    if missing:
        return f"PARTIAL: {len(missing)} (arm, seed) of the reading without all their runs"
    bilinear = EQUAL_COMPUTE_BILINEAR
    wins = {(dense, s): cheaper(table[bilinear, s], table[dense, s]) for dense in EQUAL_COMPUTE_DENSE for s in seeds}
    if all(wins.values()):
        return "YES: bilinear BTT reaches error 0.1 with <= 0.8x the FLOPs of 12-head and of 1-head dense, in every " \
               "seed"
    dense_wins = {s: cheaper(min((table[dense, s] for dense in EQUAL_COMPUTE_DENSE), key=lambda c: c.flops),
                             table[bilinear, s]) for s in seeds}
    if all(dense_wins.values()):
        return "NO: in every seed the cheaper dense arm reaches error 0.1 with <= 0.8x bilinear BTT's FLOPs"
    reasons = [f"seed {s}: {LABELS[dense].split(' ')[0]} stopped (never below 0.1) at {table[dense, s].budget:.3g} "
               f"FLOPs, less than 1.25x (iii)'s {table[bilinear, s].flops:.3g}: cannot be compared"
               for (dense, s), won in wins.items() if won is None]
    reasons += [f"seed {s}: (iii) is not cheaper than {LABELS[dense].split(' ')[0]}" for (dense, s), won in
                wins.items() if won is False]
    return "UNDECIDED: " + "; ".join(reasons)


RANK_CONTROL = "v_dense3_rank"


def cost_ratios(runs: list[dict], flops: dict, slow: str = LOW_RANK, fast: str = RANK_CONTROL) -> dict:
    """(lr of ``slow``, seed) -> the training FLOPs ``slow``'s run needed to reach error 0.1 over those of ``fast``'s
    run in the seed (:func:`flops_to_threshold`; ``inf`` when ``slow``'s never got there, None when ``fast``'s did
    not or a run is missing). An observation (by default (i) against the rank control (v)), not a rule."""
    out = {}
    for arm, lr, seed in design_runs():
        if arm != slow:
            continue
        mine = _run(runs, arm, lr, seed)
        theirs = next((r for r in runs if r["arm"] == fast and r["seed"] == seed), None)
        if mine is None or theirs is None:
            continue
        a, b = flops_to_threshold(mine, flops[slow]).flops, flops_to_threshold(theirs, flops[fast]).flops
        out[lr, seed] = None if b == math.inf else a / b
    return out


def cost_ratio_line(ratios: dict) -> Optional[str]:
    """:func:`cost_ratios` as the report's observation line (None when there is nothing to say)."""
    if not ratios:
        return None
    parts = []
    for lr in sorted({lr for lr, _ in ratios}, reverse=True):
        cells = [f"seed {seed} " + ("-" if r is None else "never" if r == math.inf else f"{r:.2g}x")
                 for (x, seed), r in sorted(ratios.items()) if x == lr]
        parts.append(f"lr {lr:g}: " + ", ".join(cells))
    return (f"{LABELS[LOW_RANK].split(' ')[0]} against {LABELS[RANK_CONTROL].split(' ')[0]}, training FLOPs to error "
            "0.1, (i)'s over (v)'s: " + "; ".join(parts))


def observations(runs: list[dict], calibration: list[dict]) -> list[str]:
    """What (ii) did in the design's seeds, and what seed 0's calibration runs did (not ruled on)."""
    lines = []
    for arm in OBSERVED:
        found = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        if found:
            lines.append(f"{LABELS[arm]}: " + ", ".join(f"seed {r['seed']} {r['final']:.3f}"
                                                        + (f" (solved at {r['solved_at']:,})" if r["solved_at"]
                                                           is not None else "") for r in found)
                         + f"; below 0.1 in {sum(r['final'] < SOLVED for r in found)} of {len(found)}")
    if calibration:
        lines.append(f"seed {CALIBRATION_SEED} calibration (an earlier design, 20,000 steps for every arm; not ruled "
                     "on): " + ", ".join(f"{_name(r)}" + (f" solved at {r['solved_at']:,}" if r["solved_at"] is not None
                                                           else "") for r in sorted(calibration, key=lambda r: (
                                                               r["arm"], r["lr"]))))
    return lines


def shard_table(runs: list[dict]) -> list[str]:
    """The shard bookkeeping as markdown rows: id, runs, done, measured CPU minutes, the command."""
    lines = ["| shard | runs (arm, lr, seeds; cap) | done | CPU minutes (measured: the runs' wall) | command |",
             "|---|---|---|---|---|"]
    for shard_id, members in SHARDS.items():
        found = [_run(runs, *key) for key in members]
        by_arm: dict = {}
        for arm, lr, seed in members:
            by_arm.setdefault((arm, lr), []).append(seed)
        names = "; ".join(f"{LABELS[arm].split(' ')[0]} {lr:g} s{','.join(map(str, seeds))}; {cap(arm):,}"
                          for (arm, lr), seeds in by_arm.items())
        walls = {}
        for run in found:  # a stacked model's runs share one wall
            if run is not None:
                walls[run["arm"], run["lr"]] = run["wall_s"]
        minutes = f"{sum(walls.values()) / 60:.0f}" if walls else "-"
        lines.append(f"| {shard_id} | {names} | {sum(r is not None for r in found)}/{len(members)} | {minutes} | "
                     f"`python scripts/icl_rank_experiment.py shard {shard_id}` |")
    return lines


def plot(runs: list[dict], seeds, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(seeds), figsize=(6 * len(seeds) + 3.5, 4.2), sharey=True, squeeze=False)
    styles = {}
    for run in runs:
        if run["seed"] not in seeds:
            continue
        axis = axes[0][seeds.index(run["seed"])]
        style = styles.setdefault(run["lr"], ["-", "--", ":"][len(styles) % 3])
        steps = [e["step"] for e in run["evals"]]
        errors = [e["error_last"] for e in run["evals"]]
        axis.plot(steps, errors, style, color=COLOURS[run["arm"]], label=f"{LABELS[run['arm']]}, lr {run['lr']:g}")
    for index, seed in enumerate(seeds):
        axis = axes[0][index]
        axis.axhline(1.0, color="grey", lw=0.8)
        axis.axhline(SOLVED, color="black", lw=0.6, ls=":")
        axis.axhline(FAILED, color="black", lw=0.6, ls="-.")
        axis.set_yscale("log")
        axis.set_xlabel("step")
        axis.set_title(f"d = {DESIGN_D}, seed {seed}")
    axes[0][0].set_ylabel("last-query error / Var(y)  (predict 0 = 1, grey)")
    labelled = {}
    for axis in axes[0]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            labelled.setdefault(label, handle)
    order = sorted(labelled, key=lambda label: (label.split(")")[0], label))
    figure.legend([labelled[label] for label in order], order, fontsize=7, loc="center left",
                  bbox_to_anchor=(0.79, 0.5))
    figure.tight_layout(rect=(0, 0, 0.78, 1))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"icl_rank_decisive_d{DESIGN_D}.png"
    figure.savefig(path, dpi=110)
    return path


def report(args, training_flops) -> None:
    """The verdicts, the runs' table, the shards and the figure of ``args.results`` (``training_flops(d, arm,
    steps, layers=...)``: a run's cumulative FLOPs, from scripts/icl_rank_experiment.py)."""
    runs = load_runs(Path(args.results))
    calibration = load_runs(Path(args.calibration)) if args.calibration and Path(args.calibration).exists() else []
    flops = {arm: training_flops(DESIGN_D, arm, cap(arm), layers=args.layers) for arm in RULED + OBSERVED}
    fields = arms(DESIGN_D)
    stack_rates = stack_ms_per_step(runs)
    print("| arm | D | heads | lr | seed | final error | best error | solved (< 0.05) at step | steps run | "
          "FLOPs to error 0.1 | ms/step (one run of the stack) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, lr, seed in design_runs():
        run = _run(runs, arm, lr, seed)
        if run is None:
            continue
        cost = flops_to_threshold(run, flops[arm])
        rate = stack_rates[stack_key(run)] / run["batched_with"]
        print(f"| {LABELS[arm]} | {fields[arm]['n_embd']} | {fields[arm]['n_head']} | {lr:g} | {seed} | "
              f"{run['final']:.3f} | {run['best_error_last']:.3f} | {run['solved_at'] or '-'} | "
              f"{run['final_step']:,} | {'never' if cost.flops == math.inf else f'{cost.flops:.3g}'} | "
              f"{rate:.1f} ({run['device']}, {run.get('step_mode', 'eager')}) |")
    print(f"\nruns finished: {sum(_run(runs, *key) is not None for key in design_runs())} of {len(design_runs())} "
          "registered")
    print("VERDICT (rank, Fig. 2/3a):", verdict(runs))
    for line in observations(runs, calibration) + [cost_ratio_line(cost_ratios(runs, flops))]:
        if line:
            print("OBSERVATION:", line)
    print("VERDICT (equal compute, Fig. 3b, bilinear BTT only):",
          equal_compute_verdict(cost_table(runs, flops, (EQUAL_COMPUTE_BILINEAR,) + EQUAL_COMPUTE_DENSE)))
    print()
    print("\n".join(shard_table(runs)))
    left = [sid for sid, members in SHARDS.items() if any(_run(runs, *key) is None for key in members)]
    if left:
        print(f"\ncontinue: python scripts/icl_rank_experiment.py shard {left[0]}   (shards left: {', '.join(left)})")
    if runs and args.figures:
        print("plot:", plot(runs, list(DESIGN_SEEDS), Path(args.figures)))
