"""Plot experiment 1 (in-context regression) of scripts/reproduce.sh.

Reads ROOT/d<d>/<variant>_D<D>/final_metrics.json (+ config.json) and writes
OUT/icl_error_vs_width.png, OUT/icl_error_vs_flops.png, OUT/icl_curves.png (error against step, every run) and
ROOT/icl_results.csv, and prints a markdown table.

Error = ``eval_mse_last``: MSE at the last query (position N = 2d) on fresh prompts never trained on. With
x ~ N(0, I/d) and w ~ N(0, I) the variance of y is E|x|^2 = 1, so the raw MSE is already the error normalised by
Var(y) (the "predict 0" baseline is ~1). (The recipe's ``eval_normalized_mse_last`` divides by d once more, which
is the normalisation for Garg et al.'s x ~ N(0, I); it is not used here.)
Training FLOPs = flops_per_token (training, from hf_structattn.flops) x tokens_per_step x steps.
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

LABELS = {"dense8": "dense attention, 8 heads", "dense1": "dense attention, 1 head",
          "btt8": "bilinear BTT, 8 heads", "mlr8": "bilinear MLR, 8 heads"}
STYLES = {"dense8": ("tab:red", "o"), "dense1": ("tab:blue", "s"), "btt8": ("tab:green", "^"),
          "mlr8": ("tab:purple", "D")}


def step0_last_error(run: Path):
    """Last-query error at step 0: the zero-initialised read-out predicts 0, so this is the "predict 0" level of
    the y-axis quantity (the recipe's ``eval_baseline_zero_mse`` is over all positions)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return None
    for record in map(json.loads, path.read_text().splitlines()):
        if record.get("step") == 0 and "eval/mse_last" in record:
            return record["eval/mse_last"]
    return None


def collect(root: Path) -> list[dict]:
    rows = []
    for path in sorted(root.glob("d*/*_D*/final_metrics.json")):
        m = re.fullmatch(r"(\w+?)_D(\d+)", path.parent.name)
        d = int(path.parent.parent.name[1:])
        metrics = json.loads(path.read_text())
        config = json.loads((path.parent / "config.json").read_text())
        heads = config["n_head"]
        width = config["n_embd"]
        rows.append(dict(
            d=d, variant=m.group(1), D=width, heads=heads, head_dim=width // heads, layers=config["n_layer"],
            ranks="|".join(map(str, config.get("bilinear_mlr_ranks") or [])) if config["attention"] == "bilinear_mlr"
            else "",
            steps=metrics["step"], mse_last=metrics["eval_mse_last"], mse_all=metrics["eval_mse"],
            baseline=metrics["eval_baseline_zero_mse"], baseline_last=step0_last_error(path.parent),
            train_flops=metrics["flops_per_token"] * metrics["tokens_per_step"] * metrics["step"],
            train_seconds=metrics["train_seconds"]))
    return rows


def plot(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dims = sorted({r["d"] for r in rows})
    for xkey, fname, xlabel in (("D", "icl_error_vs_width.png", "model width D (embedding dimension)"),
                                ("train_flops", "icl_error_vs_flops.png", "training FLOPs")):
        fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims), 4.5), squeeze=False)
        for ax, d in zip(axes[0], dims):
            for variant in LABELS:
                pts = sorted((r[xkey], r["mse_last"]) for r in rows if r["d"] == d and r["variant"] == variant)
                if not pts:
                    continue
                color, marker = STYLES[variant]
                ax.plot(*zip(*pts), marker=marker, color=color, label=LABELS[variant])
            base = [r["baseline_last"] for r in rows if r["d"] == d and r["baseline_last"] is not None]
            if base:  # the y-axis is the last-query error, so the baseline is the last-query "predict 0" level
                ax.axhline(sum(base) / len(base), color="gray", ls="--", lw=1,
                           label='"predict 0" at the last query (step-0 error)')
            if xkey == "D":
                ax.axvline(8 * d, color="tab:red", ls=":", lw=1, label=f"8 heads: r = D/8 = d at D = {8 * d}")
            steps = sorted({r["steps"] for r in rows if r["d"] == d})
            layers = sorted({r["layers"] for r in rows if r["d"] == d})
            ax.set(xscale="log", xlabel=xlabel, ylabel="MSE at last query (N = 2d), fresh prompts",
                   title=f"in-context regression, d = {d}, {'/'.join(map(str, layers))} layers, "
                         f"{'/'.join(map(str, steps))} steps")
            if xkey == "D":
                ws = sorted({r["D"] for r in rows if r["d"] == d})
                ax.set_xticks(ws, [str(w) for w in ws])
                ax.minorticks_off()
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=130)
        plt.close(fig)


def plot_curves(root: Path, out: Path) -> Path:
    """OUT/icl_curves.png: last-query MSE on fresh prompts against the training step, one line per run."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    paths = sorted(root.glob("d*/*_D*/metrics.jsonl"))
    palette = plt.get_cmap("tab20" if len(paths) > 10 else "tab10")
    for index, path in enumerate(paths):  # one colour per run (variant colours repeat across widths otherwise)
        variant, width = re.fullmatch(r"(\w+?)_D(\d+)", path.parent.name).groups()
        points = [(r["step"], r["eval/mse_last"]) for r in map(json.loads, path.read_text().splitlines())
                  if "eval/mse_last" in r]
        _, marker = STYLES.get(variant, ("gray", "."))
        color = palette(index % palette.N)
        ax.plot(*zip(*points), color=color, marker=marker, label=f"{LABELS.get(variant, variant)}, D = {width}, "
                                                                 f"{path.parent.parent.name.replace('d', 'd = ')}")
    ax.set(xlabel="training step", ylabel="MSE at last query (N = 2d), fresh prompts",
           title="in-context regression: error during training")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "icl_curves.png", dpi=130)
    plt.close(fig)
    return out / "icl_curves.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="outputs/reproduce/icl")
    parser.add_argument("--out", default="docs/results")
    args = parser.parse_args()
    rows = collect(Path(args.root))
    if not rows:
        raise SystemExit(f"no final_metrics.json under {args.root}")
    order = {v: i for i, v in enumerate(LABELS)}
    rows.sort(key=lambda r: (r["d"], order.get(r["variant"], 99), r["D"]))
    plot(rows, Path(args.out))
    plot_curves(Path(args.root), Path(args.out))
    with open(Path(args.root) / "icl_results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("| d | variant | D | heads | head dim r | MLR ranks | steps | MSE last (fresh) | MSE all pos. | "
          "training FLOPs | train s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['d']} | {LABELS.get(r['variant'], r['variant'])} | {r['D']} | {r['heads']} | {r['head_dim']} | "
              f"{r['ranks'].replace('|', '/') or '-'} | {r['steps']} | {r['mse_last']:.4f} | {r['mse_all']:.4f} | "
              f"{r['train_flops']:.3g} | {r['train_seconds']:.0f} |")
    print(f"wrote {args.out}/icl_error_vs_width.png, {args.out}/icl_error_vs_flops.png, {args.out}/icl_curves.png, "
          f"{args.root}/icl_results.csv")


if __name__ == "__main__":
    main()
