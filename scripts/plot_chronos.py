"""Plot experiment 3 (time series, dense vs MLR Chronos-T5) of scripts/reproduce.sh.

Reads ROOT/D<D>_C<C>/{dense,mlr}/final_metrics.json and metrics.jsonl and writes
  * OUT/chronos_loss_vs_flops.png: validation loss (teacher-forced token cross-entropy on the held-out windows)
    against training FLOPs (``hf_structattn.flops.encoder_decoder_flops``), one panel per context length;
  * OUT/chronos_mlr_gain_vs_context.png: relative improvement of MLR over dense, ``(dense - mlr) / dense``, of the
    final validation loss, MASE and WQL against the context length, per width (> 0: MLR better);
  * ROOT/chronos_results.csv, and prints a markdown table;
  * with ``--rescore-samples N``: re-forecasts the held-out set with every saved model and prints MASE (geometric mean
    and median over series) and WQL for the GP and the real series apart (ROOT/chronos_rescored.csv).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"dense": dict(ls="--", marker="o"), "mlr": dict(ls="-", marker="D")}
LABEL = {"dense": "dense T5 attention", "mlr": "MLR 8|2|2|2|1|1"}
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]


def collect(root: Path) -> list[dict]:
    rows = []
    for path in sorted(root.glob("D*_C*/*/final_metrics.json")):
        match = re.fullmatch(r"D(\d+)_C(\d+)", path.parent.parent.name)
        metrics = json.loads(path.read_text())
        evals = []
        for line in (path.parent / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "eval/loss" in record:
                evals.append((record["flops"], record["eval/loss"]))
        rows.append(dict(D=int(match.group(1)), C=int(match.group(2)), attention=path.parent.name,
                         steps=metrics["step"], train_flops=metrics["training_flops"],
                         flops_per_window=metrics["flops_per_window"], train_seconds=metrics["train_seconds"],
                         loss=metrics["eval_loss"], mase=metrics["eval_mase"], wql=metrics["eval_wql"],
                         curve=evals))
    return rows


def rescore(rows: list[dict], root: Path, num_samples: int, seed: int = 0) -> None:
    """Re-forecast the held-out set with every saved model (``num_samples`` sample paths, fixed seed) and add
    per-source aggregates to ``rows``: MASE as geometric mean and median over series (the recipe's MASE is an
    arithmetic mean that a few near-constant contexts dominate), WQL pooled, for GP and real series apart."""
    import numpy as np
    import torch
    from chronos import ChronosPipeline

    from hf_structattn.training import timeseries
    from hf_structattn.training.metrics import load_metric

    mase, wql = load_metric("mase"), load_metric("wql")
    levels = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    tasks = {}
    for row in rows:
        run = root / f"D{row['D']}_C{row['C']}" / row["attention"]
        config = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["config"]
        chronos = config["model"]["chronos_config"]
        key = (config["synthetic_series"], config["synthetic_eval_series"], config["eval_context_length"],
               chronos["prediction_length"], config["real_eval_windows"], config["seed"])
        if key not in tasks:  # held-out targets do not depend on the context length (eval_context_length)
            tasks[key] = timeseries.build_task(chronos["context_length"], chronos["prediction_length"],
                                               config["synthetic_series"], config["synthetic_eval_series"],
                                               config["real_datasets"], config["seed"],
                                               series_length=config["series_length"],
                                               eval_context_length=config["eval_context_length"],
                                               real_eval_windows=config["real_eval_windows"])
        task = tasks[key]
        pipe = ChronosPipeline.from_pretrained(str(run), trust_remote_code=True, dtype=torch.float32)
        torch.manual_seed(seed)
        quantiles, _ = pipe.predict_quantiles([torch.from_numpy(c) for c in task.eval_contexts],
                                              prediction_length=chronos["prediction_length"],
                                              quantile_levels=levels, num_samples=num_samples)
        median = quantiles[..., levels.index(0.5)]
        for source, keep in (("gp", lambda n: n.startswith("kernelsynth/")),
                             ("real", lambda n: not n.startswith("kernelsynth/"))):
            index = [i for i, name in enumerate(task.eval_names) if keep(name)]
            scores = np.array([mase.compute(predictions=[median[i].tolist()], references=[task.eval_targets[i].tolist()],
                                            contexts=[task.eval_contexts[i].tolist()])["mase"] for i in index])
            scores = scores[np.isfinite(scores)]
            row[f"{source}_mase_gmean"] = float(np.exp(np.log(scores).mean()))
            row[f"{source}_mase_median"] = float(np.median(scores))
            row[f"{source}_wql"] = wql.compute(predictions=quantiles[index].tolist(),
                                               references=[task.eval_targets[i].tolist() for i in index],
                                               quantile_levels=levels)["wql"]
            row[f"{source}_series"] = len(index)


def plot(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    contexts = sorted({r["C"] for r in rows})
    widths = sorted({r["D"] for r in rows})
    color = {D: COLORS[i % len(COLORS)] for i, D in enumerate(widths)}
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, C in zip(axes[0], contexts):
        for r in sorted((r for r in rows if r["C"] == C), key=lambda r: (r["D"], r["attention"])):
            points = [(f, loss) for f, loss in r["curve"] if f > 0]
            if points:
                ax.plot(*zip(*points), color=color[r["D"]], label=f"D = {r['D']}, {LABEL.get(r['attention'])}",
                        **STYLE.get(r["attention"], {}))
        steps = sorted({r["steps"] for r in rows if r["C"] == C})
        ax.set(xscale="log", xlabel="training FLOPs", ylabel="validation loss (token cross-entropy)",
               title=f"Chronos-T5 from scratch, context {C}, {'/'.join(map(str, steps))} steps")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "chronos_loss_vs_flops.png", dpi=130)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, name) in zip(axes, (("loss", "validation loss"), ("mase", "MASE"), ("wql", "WQL"))):
        for D in widths:
            points = []
            for C in contexts:
                pair = {r["attention"]: r for r in rows if r["D"] == D and r["C"] == C}
                if {"dense", "mlr"} <= pair.keys():
                    points.append((C, 100 * (pair["dense"][key] - pair["mlr"][key]) / pair["dense"][key]))
            if points:
                ax.plot(*zip(*points), marker="o", color=color[D], label=f"D = {D}")
        ax.axhline(0, color="gray", lw=1)
        ax.set(xscale="log", xlabel="context length", ylabel="MLR improvement over dense (%)", title=name)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "chronos_mlr_gain_vs_context.png", dpi=130)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="outputs/reproduce/chronos")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--rescore-samples", type=int, default=0,
                        help="re-forecast the held-out set with N samples per series and print per-source MASE/WQL")
    args = parser.parse_args()
    rows = collect(Path(args.root))
    if not rows:
        raise SystemExit(f"no final_metrics.json under {args.root}")
    rows.sort(key=lambda r: (-r["C"], -r["D"], r["attention"]))
    plot(rows, Path(args.out))
    fields = [k for k in rows[0] if k != "curve"]
    with open(Path(args.root) / "chronos_results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print("| context | D | attention | steps | training FLOPs | FLOPs / window | train s | val. loss | MASE | WQL |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['C']} | {r['D']} | {r['attention']} | {r['steps']} | {r['train_flops']:.3g} | "
              f"{r['flops_per_window']:.3g} | {r['train_seconds']:.0f} | {r['loss']:.4f} | {r['mase']:.3f} | "
              f"{r['wql']:.4f} |")
    if args.rescore_samples:
        rescore(rows, Path(args.root), args.rescore_samples)
        print(f"\nRe-forecast with {args.rescore_samples} samples per series (seed 0); MASE: geometric mean [median] "
              f"over series, WQL pooled:\n")
        print("| context | D | attention | GP MASE | GP WQL | real MASE | real WQL |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['C']} | {r['D']} | {r['attention']} | {r['gp_mase_gmean']:.3f} [{r['gp_mase_median']:.3f}] | "
                  f"{r['gp_wql']:.4f} | {r['real_mase_gmean']:.3f} [{r['real_mase_median']:.3f}] | "
                  f"{r['real_wql']:.4f} |")
        print(f"({rows[0]['gp_series']} GP series, {rows[0]['real_series']} real windows)")
        with open(Path(args.root) / "chronos_rescored.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=[k for k in rows[0] if k != "curve"], extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    print(f"wrote {args.out}/chronos_loss_vs_flops.png, {args.out}/chronos_mlr_gain_vs_context.png, "
          f"{args.root}/chronos_results.csv")


if __name__ == "__main__":
    main()
