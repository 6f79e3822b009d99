"""Plot experiment 3 (time series, dense vs MLR Chronos-T5) of scripts/reproduce.sh.

Reads ROOT/D<D>_C<C>/{dense,mlr}/final_metrics.json and metrics.jsonl and writes
  * OUT/chronos_loss_vs_flops.png: validation loss (teacher-forced token cross-entropy on the held-out windows)
    against training FLOPs (``hf_structattn.flops.encoder_decoder_flops``), one panel per context length;
  * OUT/chronos_mlr_gain_vs_context.png: relative improvement of MLR over dense, ``(dense - mlr) / dense``, of the
    final validation loss, MASE and WQL against the context length, per width (> 0: MLR better);
  * ROOT/chronos_results.csv, and prints a markdown table.
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
    print(f"wrote {args.out}/chronos_loss_vs_flops.png, {args.out}/chronos_mlr_gain_vs_context.png, "
          f"{args.root}/chronos_results.csv")


if __name__ == "__main__":
    main()
