"""Table, plot and verdict of ``scripts/icl_rank_experiment.py`` (the decision rule of docs/results.md §1d).

    python scripts/icl_rank_experiment.py report --out outputs/icl_rank_v2 --d 4 [--figures docs/results/icl_rank_v2]

Rule: YES when the full-rank controls (ii) 1-head dense, (iii) bilinear BTT and (v) the same-width r = 2d dense
arm each end below 0.1 in every seed while (i), r = d/2, ends above 0.5 in every seed (bilinear MLR's part: (iv)
below 0.1 in every seed too); NO when (i) ends below 0.1 in any seed; UNDECIDED otherwise, with the reasons. An
arm's score for a seed is its best-LR final error. (vi), the wider r = 2d arm, is reported, not ruled on.

Unfinished runs are read from their ``progress.jsonl`` and marked "running" (their last evaluation counts as the
current value; the verdict says "partial" until every run has its ``result.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from icl_rank_arms import FAILED, LABELS, SOLVED, arms

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
    def all_below(arm, threshold):
        return all((arm, s) in table and table[arm, s][0] < threshold for s in seeds)

    if any(((LOW_RANK, s) in table and table[LOW_RANK, s][0] < SOLVED) for s in seeds):
        return "NO: dense attention with r = d/2 solves the task (error < 0.1) in at least one seed"
    if not complete:
        return "PARTIAL: not every run has finished"
    controls = all(all_below(arm, SOLVED) for arm in CONTROLS)
    low_fails = all((LOW_RANK, s) in table and table[LOW_RANK, s][0] > FAILED for s in seeds)
    if controls and low_fails:
        mlr = "and bilinear MLR too" if all_below("iv_mlr8", SOLVED) else "but bilinear MLR does not solve it"
        return f"YES: (ii), (iii), (v) solve the task in every seed while (i) stays above 0.5 ({mlr})"
    reasons = []
    for arm in CONTROLS:
        if not all_below(arm, SOLVED):
            reasons.append(f"{LABELS[arm]} does not reach < 0.1 in every seed")
    if not low_fails:
        reasons.append("(i) ends between 0.1 and 0.5 in a seed")
    return "UNDECIDED: " + "; ".join(reasons)


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


def report(args) -> None:
    root = Path(args.out) / f"d{args.d}"
    arm_names = list(args.arms)
    runs = [run for run in load_runs(root) if run["arm"] in arm_names]
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
    print(f"\nruns finished: {sum(r['finished'] for r in runs)}/{expected}; summed run wall time {total_wall:.0f} s")
    print("VERDICT:", verdict(table, args.seeds, complete))
    print("plot:", plot(runs, args.d, list(args.seeds), Path(args.figures)))
