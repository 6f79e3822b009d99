"""Table, FLOPs, plot and verdicts of ``scripts/icl_rank_experiment.py`` (the decision rules of docs/results.md).

    python scripts/icl_rank_experiment.py report --out outputs/icl_rank_v3 --d 4 [--figures docs/results/icl_rank_v3]

Error = last-query MSE on 1024 fresh prompts / Var(y) of those prompts ("predict 0" = 1). An arm's score for a seed
is its best-LR error.

Rank rule (the paper's Fig. 2 / 3a claim; scores = final errors): YES when the full-rank controls (ii) 1-head dense,
(iii) bilinear BTT and (v) the same-width r = 2d dense arm each end below 0.1 in every seed while (i), r = d/2, ends
above 0.5 in every seed; NO when (i) ends below 0.1 in any seed; UNDECIDED otherwise, with the reasons. (iv) bilinear
MLR and (vi) the wider r = 2d arm are reported as observations: the paper does not claim that bilinear MLR solves the
task at a given width, only its advantage at equal compute.

Equal-compute rule (the paper's Fig. 3b claim: at a fixed width the bilinear scores reach a lower error than dense
attention with 1 or many heads for the same training FLOPs; FLOPs of the transformer blocks, read-in and read-out
excluded as in the paper). The budget F* is the smallest planned-run FLOPs of the four arms compared (the cheapest
arm's whole run); a run's error at F* is its last evaluation at or below F* FLOPs, and an arm's score for a seed is
the best over LRs. "Lower" means lower by at least 10 % of the larger error and 0.01. YES when (iii) bilinear BTT and
(iv) bilinear MLR are each lower than both (i) 12-head and (ii) 1-head dense in every seed; NO when in every seed the
better of (i) and (ii) is lower than both bilinear arms; UNDECIDED otherwise.

Unfinished runs are read from their ``progress.jsonl`` and marked "running" (their last evaluation counts as the
current value; the verdicts say "PARTIAL" until every run has its ``result.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from icl_rank_arms import FAILED, LABELS, SOLVED, arms

EQUAL_COMPUTE_BILINEAR = ("iii_btt8", "iv_mlr8")
EQUAL_COMPUTE_DENSE = ("i_dense12_half", "ii_dense1")
MARGIN_RELATIVE, MARGIN_ABSOLUTE = 0.10, 0.01  # "lower" in the equal-compute rule

LOW_RANK = "i_dense12_half"
CONTROLS = ("ii_dense1", "iii_btt8", "v_dense3_rank")
COLOURS = {"i_dense12_half": "#d62728", "ii_dense1": "#1f77b4", "iii_btt8": "#2ca02c", "iv_mlr8": "#9467bd",
           "v_dense3_rank": "#ff7f0e", "vi_dense8_wide": "#8c564b"}


def load_runs(root: Path) -> list[dict]:
    runs = []
    for folder in sorted(root.iterdir()):
        progress = folder / "progress.jsonl"
        if not progress.exists():
            continue
        evals = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
        if not evals:
            continue
        result_file = folder / "result.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else None
        arm, rest = folder.name.rsplit("_lr", 1)
        lr, seed = rest.split("_s")
        rank = result["rank_final"] if result else (json.loads((folder / "rank_init.json").read_text())
                                                    if (folder / "rank_init.json").exists() else None)
        runs.append({"name": folder.name, "arm": arm, "lr": float(lr), "seed": int(seed), "evals": evals,
                     "finished": result is not None, "final": evals[-1]["error_last"], "step": evals[-1]["step"],
                     "solved_at": result["solved_at"] if result else None, "rank": rank,
                     "rank_init": json.loads((folder / "rank_init.json").read_text())
                     if (folder / "rank_init.json").exists() else None,
                     "wall": result["wall_s"] if result else evals[-1]["wall"]})
    return runs


def scores(runs: list[dict], arm_names, seeds) -> dict:
    """(arm, seed) -> (best-LR error, the run) over the runs present."""
    table = {}
    for arm in arm_names:
        for seed in seeds:
            candidates = [run for run in runs if run["arm"] == arm and run["seed"] == seed]
            if candidates:
                best = min(candidates, key=lambda run: run["final"])
                table[arm, seed] = (best["final"], best)
    return table


def verdict(table: dict, seeds, complete: bool) -> str:
    """The rank rule (module docstring) on ``table`` ((arm, seed) -> (best-LR final error, run))."""
    def all_below(arm, threshold):
        return all((arm, s) in table and table[arm, s][0] < threshold for s in seeds)

    if any(((LOW_RANK, s) in table and table[LOW_RANK, s][0] < SOLVED) for s in seeds):
        return "NO: dense attention with r = d/2 solves the task (error < 0.1) in at least one seed"
    if not complete:
        return "PARTIAL: not every run has finished"
    controls = all(all_below(arm, SOLVED) for arm in CONTROLS)
    low_fails = all((LOW_RANK, s) in table and table[LOW_RANK, s][0] > FAILED for s in seeds)
    if controls and low_fails:
        return "YES: (ii), (iii), (v) solve the task in every seed while (i) stays above 0.5"
    reasons = []
    for arm in CONTROLS:
        if not all_below(arm, SOLVED):
            reasons.append(f"{LABELS[arm]} does not reach < 0.1 in every seed")
    if not low_fails:
        reasons.append("(i) ends between 0.1 and 0.5 in a seed")
    return "UNDECIDED: " + "; ".join(reasons)


def observations(table: dict, seeds) -> list[str]:
    """What the arms outside the rank rule did: (iv) bilinear MLR and (vi) the width control."""
    lines = []
    for arm in ("iv_mlr8", "vi_dense8_wide"):
        values = [table[arm, s][0] for s in seeds if (arm, s) in table]
        if not values:
            continue
        solved = sum(value < SOLVED for value in values)
        lines.append(f"{LABELS[arm]}: best-LR error {', '.join(f'{v:.3f}' for v in values)} "
                     f"(seeds {', '.join(str(s) for s in seeds if (arm, s) in table)}); below 0.1 in {solved} of "
                     f"{len(values)} seeds")
    return lines


def lower(first: float, second: float) -> bool:
    """``first`` lower than ``second`` by the equal-compute rule's margin."""
    return second - first >= max(MARGIN_ABSOLUTE, MARGIN_RELATIVE * max(first, second))


def error_at_flops(run: dict, flops: list[float], budget: float):
    """The run's error at its last evaluation whose cumulative training FLOPs (``flops[step]``) are at most
    ``budget``; None while an unfinished run has not reached the budget yet."""
    def spent(step):
        return flops[min(step, len(flops) - 1)]

    reached = run["finished"] or spent(run["step"]) >= budget
    inside = [e for e in run["evals"] if spent(e["step"]) <= budget]
    return inside[-1]["error_last"] if reached and inside else None


def equal_compute_table(runs: list[dict], flops: dict, budget: float, arm_names, seeds) -> dict:
    """(arm, seed) -> best-LR error at ``budget`` FLOPs (``flops[arm]``: cumulative FLOPs per step of one run)."""
    table = {}
    for arm in arm_names:
        for seed in seeds:
            values = [error_at_flops(run, flops[arm], budget) for run in runs
                      if run["arm"] == arm and run["seed"] == seed]
            values = [v for v in values if v is not None]
            if values:
                table[arm, seed] = min(values)
    return table


def equal_compute_verdict(table: dict, seeds, complete: bool) -> str:
    """The equal-compute rule (module docstring) on ``table`` ((arm, seed) -> best-LR error at F*)."""
    needed = [(arm, s) for arm in EQUAL_COMPUTE_BILINEAR + EQUAL_COMPUTE_DENSE for s in seeds]
    if not complete or any(key not in table for key in needed):
        return "PARTIAL: not every run has reached the budget F*"
    bilinear_win = all(lower(table[b, s], table[dense, s]) for b in EQUAL_COMPUTE_BILINEAR
                       for dense in EQUAL_COMPUTE_DENSE for s in seeds)
    if bilinear_win:
        return "YES: bilinear BTT and bilinear MLR each end lower than 12-head and 1-head dense in every seed at F*"
    dense_win = all(lower(min(table[dense, s] for dense in EQUAL_COMPUTE_DENSE), table[b, s])
                    for b in EQUAL_COMPUTE_BILINEAR for s in seeds)
    if dense_win:
        return "NO: in every seed the better dense arm ends lower than both bilinear arms at F*"
    losses = sorted({f"{LABELS[b]} vs {LABELS[dense]}" for b in EQUAL_COMPUTE_BILINEAR
                     for dense in EQUAL_COMPUTE_DENSE for s in seeds if not lower(table[b, s], table[dense, s])})
    return "UNDECIDED: not lower in every seed: " + "; ".join(losses)


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
    """The verdicts, tables and figure of ``args.out``; ``training_flops(d, arm, steps, layers=...)`` gives a run's
    cumulative FLOPs (scripts/icl_rank_experiment.py passes its own, so that this module needs no torch)."""

    root = Path(args.out) / f"d{args.d}"
    arm_names = list(args.arms)
    runs = [run for run in load_runs(root) if run["arm"] in arm_names and run["lr"] in args.lrs
            and run["seed"] in args.seeds]  # only the design's runs count
    expected = len(arm_names) * len(args.lrs) * len(args.seeds)
    complete = sum(run["finished"] for run in runs) == expected
    table = scores(runs, arm_names, args.seeds)
    print("| arm | D | heads | effective rank span (local) | seed | "
          + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " | best-LR error | solved at step |")
    print("|---|---|---|---|---|" + "---|" * len(args.lrs) + "---|---|")
    fields = arms(args.d)
    for arm in arm_names:
        for seed in args.seeds:
            cells = []
            for lr in args.lrs:
                run = next((r for r in runs if r["arm"] == arm and r["seed"] == seed and r["lr"] == lr), None)
                cells.append("-" if run is None else f"{run['final']:.3f}" + ("" if run["finished"] else
                                                                                 f" (running, step {run['step']})"))
            best = table.get((arm, seed))
            rank = best[1]["rank"] if best else None
            rank_text = "-" if rank is None else (f"{rank['span_min']}" if rank["span_min"] == rank["span_max"]
                                                  else f"{rank['span_min']}-{rank['span_max']}") + \
                f" ({rank['local_min']})"
            solved = best[1]["solved_at"] if best and best[1]["solved_at"] is not None else "-"
            print(f"| {LABELS[arm]} | {fields[arm]['n_embd']} | {fields[arm]['n_head']} | {rank_text} | {seed} | "
                  f"{' | '.join(cells)} | {'-' if best is None else f'{best[0]:.3f}'} | {solved} |")
    total_wall = sum(run["wall"] for run in runs)
    print(f"\nruns finished: {sum(r['finished'] for r in runs)}/{expected}; summed run wall time {total_wall:.0f} s "
          "(runs of one arm train stacked, so each shares its arm's wall time)")
    print("VERDICT (rank, Fig. 2/3a):", verdict(table, args.seeds, complete))
    for line in observations(table, args.seeds):
        print("OBSERVATION:", line)

    flops = {arm: training_flops(args.d, arm, args.steps, layers=args.layers) for arm in arm_names}
    print(f"\n| arm | training FLOPs per step (full prompt) | FLOPs of a {args.steps:,}-step run |")
    print("|---|---|---|")
    for arm in arm_names:
        print(f"| {LABELS[arm]} | {flops[arm][-1] - flops[arm][-2]:.3g} | {flops[arm][-1]:.3g} |")
    compared = [arm for arm in EQUAL_COMPUTE_BILINEAR + EQUAL_COMPUTE_DENSE if arm in arm_names]
    if compared:
        budget = min(flops[arm][-1] for arm in compared)
        levels = [budget / 4, budget / 2, budget]
        print(f"\nEqual compute (Fig. 3b): best-LR error at F*/4, F*/2 and F* = {budget:.3g} FLOPs (the cheapest "
              "compared arm's whole run), read from each run's evaluations")
        print("| arm | seed | " + " | ".join(f"{level:.3g}" for level in levels) + " |")
        print("|---|---|" + "---|" * len(levels))
        at_levels = [equal_compute_table(runs, flops, level, arm_names, args.seeds) for level in levels]
        for arm in arm_names:
            for seed in args.seeds:
                cells = [f"{t[arm, seed]:.3f}" if (arm, seed) in t else "-" for t in at_levels]
                print(f"| {LABELS[arm]} | {seed} | {' | '.join(cells)} |")
        print("VERDICT (equal compute, Fig. 3b):", equal_compute_verdict(at_levels[-1], args.seeds, complete))
    print("plot:", plot(runs, args.d, list(args.seeds), Path(args.figures)))
