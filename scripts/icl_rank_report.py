"""Verdicts, tables, shards and plot of ``scripts/icl_rank_experiment.py`` (the rules of docs/results.md).

    python scripts/icl_rank_experiment.py report --d 4        # reads results/icl_rank/d4/*.json (one per run)

Error = last-query MSE on 1024 fresh prompts / Var(y) of those prompts ("predict 0" = 1). A run is frozen after
its first evaluation below 0.05 (its last evaluation then stands). Only finished runs (a results file) count.

Rank rule (the paper's Fig. 2 / 3a claim). An arm's score for a seed is its best final error over the planned LRs
{3e-4, 1e-3, 3e-3}. NO as soon as any finished run of (i), r = d/2, ends below 0.1. Edge clause: when (i)'s best
planned LR in a seed is 3e-4 or 3e-3, one more run of (i) in that seed at 9e-5 or 9e-3 (``edge_extensions``).
Once every planned run of (i), (ii), (iii), (v) and every triggered edge run has finished: YES when (ii) 1-head
dense, (iii) bilinear BTT and (v) the same-width r = 2d dense arm each score below 0.1 in every seed while every
run of (i) (planned and edge) ends above 0.5; UNDECIDED otherwise, with the reasons. (iv) bilinear MLR and (vi)
the wider r = 2d arm are reported as observations.

Equal-compute rule (the paper's Fig. 3b claim: at a fixed width the bilinear scores reach a lower error than dense
attention with 1 or many heads for the same training FLOPs; FLOPs of the transformer blocks, read-in and read-out
excluded as in the paper). A run's cost is its cumulative training FLOPs at its first evaluation with error below
0.1 (every 250 steps; infinite if it never gets there; 0.1 is above the freezing threshold 0.05, so freezing never
hides it); an arm's cost for a seed is the least over the planned LRs. A is cheaper than B when A's cost is finite
and at most 0.8x B's. Once every planned run of (i), (ii), (iii), (iv) has finished: YES when (iii) and (iv) are
each cheaper than both (i) and (ii) in every seed; NO when in every seed the cheaper of (i) and (ii) is cheaper
than both (iii) and (iv); UNDECIDED otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path

from icl_rank_arms import DECIDING_LRS, FAILED, LABELS, SOLVED, arms, shards

from hf_structattn.training.sweep import edge_extensions, read_run_jsons

EQUAL_COMPUTE_BILINEAR = ("iii_btt8", "iv_mlr8")
EQUAL_COMPUTE_DENSE = ("i_dense12_half", "ii_dense1")
THRESHOLD = SOLVED  # the equal-compute reading's error threshold (>= the freezing threshold 0.05)
CHEAPER = 0.8  # A cheaper than B: cost(A) <= 0.8 cost(B)

LOW_RANK = "i_dense12_half"
CONTROLS = ("ii_dense1", "iii_btt8", "v_dense3_rank")
COLOURS = {"i_dense12_half": "#d62728", "ii_dense1": "#1f77b4", "iii_btt8": "#2ca02c", "iv_mlr8": "#9467bd",
           "v_dense3_rank": "#ff7f0e", "vi_dense8_wide": "#8c564b"}


def load_runs(folder: Path, steps: int | None = None) -> list[dict]:
    """The finished runs' results files under ``folder`` (of ``steps`` steps when given): arm, lr, seed, final
    error, evaluations."""
    runs = []
    for record in read_run_jsons(folder):
        if steps is not None and record["steps"] != steps:
            continue
        runs.append({**record, "final": record["final"]["error_last"]})
    return runs


def _run(runs, arm, lr, seed):
    return next((r for r in runs if r["arm"] == arm and r["lr"] == lr and r["seed"] == seed), None)


def scores(runs: list[dict], arm_names, seeds, lrs=DECIDING_LRS) -> dict:
    """(arm, seed) -> (best final error over the planned ``lrs``, its run), where every planned run has finished."""
    table = {}
    for arm in arm_names:
        for seed in seeds:
            planned = [_run(runs, arm, lr, seed) for lr in lrs]
            if all(planned):
                best = min(planned, key=lambda run: run["final"])
                table[arm, seed] = (best["final"], best)
    return table


def edge_runs(runs: list[dict], seeds, lrs=DECIDING_LRS) -> list[tuple[str, float, int]]:
    """The edge clause's extra runs of (i) that the finished planned runs trigger: (arm, lr, seed)."""
    table = scores(runs, [LOW_RANK], seeds, lrs)
    return [(LOW_RANK, lr, seed) for seed in seeds if (LOW_RANK, seed) in table
            for lr in edge_extensions([table[LOW_RANK, seed][1]["lr"]], lrs)]


def verdict(runs: list[dict], seeds, lrs=DECIDING_LRS) -> str:
    """The rank rule (module docstring) on the finished runs."""
    solved = sorted(f"lr {r['lr']:g} seed {r['seed']} ({r['final']:.3f})" for r in runs
                    if r["arm"] == LOW_RANK and r["final"] < SOLVED)
    if solved:
        return "NO: dense attention with r = d/2 ends below 0.1: " + ", ".join(solved)
    needed = [(arm, lr, s) for arm in (LOW_RANK,) + CONTROLS for lr in lrs for s in seeds]
    missing = [key for key in needed if not _run(runs, *key)]
    missing += [key for key in edge_runs(runs, seeds, lrs) if not _run(runs, *key)]
    if missing:
        return f"PARTIAL: {len(missing)} run(s) of the rule still to finish"
    table = scores(runs, (LOW_RANK,) + CONTROLS, seeds, lrs)
    low = [r for r in runs if r["arm"] == LOW_RANK and r["seed"] in seeds]
    controls = [arm for arm in CONTROLS if all(table[arm, s][0] < SOLVED for s in seeds)]
    low_fails = all(r["final"] > FAILED for r in low)
    if len(controls) == len(CONTROLS) and low_fails:
        return "YES: (ii), (iii), (v) end below 0.1 in every seed while every run of (i) ends above 0.5"
    reasons = [f"{LABELS[arm]} does not end below 0.1 in every seed" for arm in CONTROLS if arm not in controls]
    if not low_fails:
        reasons.append("a run of (i) ends between 0.1 and 0.5")
    return "UNDECIDED: " + "; ".join(reasons)


def observations(runs: list[dict], seeds, lrs=DECIDING_LRS) -> list[str]:
    """What the arms outside the rank rule did: (iv) bilinear MLR and (vi) the width control."""
    table = scores(runs, ("iv_mlr8", "vi_dense8_wide"), seeds, lrs)
    lines = []
    for arm in ("iv_mlr8", "vi_dense8_wide"):
        present = [s for s in seeds if (arm, s) in table]
        if present:
            values = [table[arm, s][0] for s in present]
            lines.append(f"{LABELS[arm]}: best-LR error {', '.join(f'{v:.3f}' for v in values)} (seeds "
                         f"{', '.join(map(str, present))}); below 0.1 in {sum(v < SOLVED for v in values)} of "
                         f"{len(values)}")
    return lines


def flops_to_threshold(run: dict, flops: list[float]) -> float:
    """Cumulative training FLOPs (``flops[step]``) at the run's first evaluation below THRESHOLD; inf if none."""
    for record in run["evals"]:
        if record["error_last"] < THRESHOLD:
            return flops[min(record["step"], len(flops) - 1)]
    return math.inf


def cheaper(first: float, second: float) -> bool:
    return first < math.inf and first <= CHEAPER * second


def cost_table(runs: list[dict], flops: dict, arm_names, seeds, lrs=DECIDING_LRS) -> dict:
    """(arm, seed) -> least FLOPs-to-threshold over the planned LRs, where every planned run has finished."""
    table = {}
    for arm in arm_names:
        for seed in seeds:
            planned = [_run(runs, arm, lr, seed) for lr in lrs]
            if all(planned):
                table[arm, seed] = min(flops_to_threshold(run, flops[arm]) for run in planned)
    return table


def equal_compute_verdict(table: dict, seeds) -> str:
    """The equal-compute rule (module docstring) on ``table`` ((arm, seed) -> FLOPs to error 0.1)."""
    needed = [(arm, s) for arm in EQUAL_COMPUTE_BILINEAR + EQUAL_COMPUTE_DENSE for s in seeds]
    missing = [key for key in needed if key not in table]
    if missing:
        return f"PARTIAL: {len(missing)} (arm, seed) of the rule without all their runs"
    if all(table[key] == math.inf for key in needed):
        return "UNDECIDED: no compared arm reached error 0.1"
    if all(cheaper(table[b, s], table[dense, s]) for b in EQUAL_COMPUTE_BILINEAR for dense in EQUAL_COMPUTE_DENSE
           for s in seeds):
        return "YES: bilinear BTT and bilinear MLR each reach error 0.1 with <= 0.8x the FLOPs of 12-head and " \
               "1-head dense, in every seed"
    if all(cheaper(min(table[dense, s] for dense in EQUAL_COMPUTE_DENSE), table[b, s])
           for b in EQUAL_COMPUTE_BILINEAR for s in seeds):
        return "NO: in every seed the cheaper dense arm reaches error 0.1 with <= 0.8x the FLOPs of both bilinear arms"
    losses = sorted({f"{LABELS[b]} vs {LABELS[dense]}" for b in EQUAL_COMPUTE_BILINEAR
                     for dense in EQUAL_COMPUTE_DENSE for s in seeds if not cheaper(table[b, s], table[dense, s])})
    return "UNDECIDED: not cheaper in every seed: " + "; ".join(losses)


def remaining(runs: list[dict], d: int, seeds) -> tuple[dict, list]:
    """Shard id -> its runs without a results file; and the edge runs still to do."""
    done = {(r["arm"], r["lr"], r["seed"]) for r in runs}
    left = {sid: [run for run in members if run not in done] for sid, members in shards(d).items()}
    return left, [key for key in edge_runs(runs, seeds) if key not in done]


def plot(runs: list[dict], d: int, seeds, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(seeds), figsize=(6 * len(seeds) + 3.5, 4.2), sharey=True, squeeze=False)
    styles = {}
    for run in runs:
        axis = axes[0][seeds.index(run["seed"])] if run["seed"] in seeds else None
        if axis is None:
            continue
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
        axis.set_title(f"d = {d}, seed {seed}")
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
    path = out / f"icl_rank_d{d}.png"
    figure.savefig(path, dpi=110)
    return path


def report(args, training_flops) -> None:
    """The verdicts, tables, remaining shards and figure of ``args.results`` (``training_flops(d, arm, steps,
    layers=...)``: a run's cumulative FLOPs, from scripts/icl_rank_experiment.py)."""
    runs = [run for run in load_runs(Path(args.results) / f"d{args.d}", args.steps) if run["arm"] in args.arms]
    seeds, lrs = list(args.seeds), list(args.lrs)
    flops = {arm: training_flops(args.d, arm, args.steps, layers=args.layers) for arm in args.arms}
    fields = arms(args.d)
    print("| arm | D | heads | seed | " + " | ".join(f"lr {lr:g}" for lr in lrs) +
          " | best | solved (< 0.05) at step | FLOPs to error 0.1 (best LR) | ms/step (1 run) |")
    print("|---|---|---|---|" + "---|" * len(lrs) + "---|---|---|---|")
    for arm in args.arms:
        for seed in seeds:
            cells, present = [], []
            for lr in lrs:
                run = _run(runs, arm, lr, seed)
                cells.append("-" if run is None else f"{run['final']:.3f}")
                present += [run] if run else []
            if not present:
                continue
            best = min(present, key=lambda r: r["final"])
            cost = min(flops_to_threshold(r, flops[arm]) for r in present)
            rate = 1000 * best["wall_s"] / max(1, best["final_step"])
            print(f"| {LABELS[arm]} | {fields[arm]['n_embd']} | {fields[arm]['n_head']} | {seed} | "
                  f"{' | '.join(cells)} | {best['final']:.3f} | {best['solved_at'] or '-'} | "
                  f"{'never' if cost == math.inf else f'{cost:.3g}'} | {rate:.0f} ({best['device']}) |")
    extra = [r for r in runs if r["lr"] not in lrs]
    for run in extra:
        print(f"edge run: {LABELS[run['arm']]}, lr {run['lr']:g}, seed {run['seed']}: {run['final']:.3f}")
    print(f"\nruns finished: {len(runs)} of {len(shards(args.d)['g1']) + len(shards(args.d)['g2'])} planned")
    print("VERDICT (rank, Fig. 2/3a):", verdict(runs, seeds, lrs))
    for line in observations(runs, seeds, lrs):
        print("OBSERVATION:", line)
    table = cost_table(runs, flops, args.arms, seeds, lrs)
    print("VERDICT (equal compute, Fig. 3b):", equal_compute_verdict(table, seeds))
    left, edges = remaining(runs, args.d, seeds)
    todo = [sid for sid, members in left.items() if members and sid.startswith("c")]
    print(f"\nCPU shards left: {', '.join(todo) or 'none'}; GPU shards left: "
          f"{', '.join(sid for sid in ('g1', 'g2') if left[sid]) or 'none'}")
    if edges:
        print("edge runs triggered, not run yet (shard x):", ", ".join(f"{a} lr {lr:g} seed {s}" for a, lr, s in edges))
    if todo or edges:
        first = todo[0] if todo else "x"
        print(f"continue: python scripts/icl_rank_experiment.py shard {first} --d {args.d} --device cpu --jobs 2")
    if runs and args.figures:
        print("plot:", plot(runs, args.d, seeds, Path(args.figures)))
