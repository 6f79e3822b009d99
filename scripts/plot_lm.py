"""Plots and table for scripts/reproduce_lm.sh (paper §5.1 / Fig. 4 at CPU scale).

python scripts/plot_lm.py [--root outputs/reproduce/lm] [--out docs/results] [--reeval N]
--reeval N: also re-evaluate every finished run's saved model on N validation windows of 1024 bytes spread evenly
over the whole validation split (the in-training evaluation uses the first eval_windows windows, i.e. only the
first few files), cached in ROOT/<run>/reeval_<N>.json and added as a table column.
Reads ROOT/<variant>_d<D>/metrics.jsonl (+ final_metrics.json, config.json, model.safetensors when present) and writes
OUT/lm_bpb_vs_flops.png, OUT/lm_bpb_vs_steps.png, and prints a markdown table (also ROOT/summary.md, ROOT/summary.json).
"""
import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"mlr": "MLR 32\\|8\\|6\\|4\\|4\\|4\\|4\\|2", "dense": "dense", "swa": "SWA (all layers, w=128)",
          "gswa": "global+SWA (layers 1,4 dense, w=128)"}
COLORS = {"mlr": "tab:red", "dense": "tab:blue", "swa": "tab:green", "gswa": "tab:orange"}
ORDER = ["mlr", "dense", "gswa", "swa"]


def _tokens_per_step(run: Path):
    for line in open(run / "metrics.jsonl"):
        rec = json.loads(line)
        if rec.get("event") == "config":
            c = rec["config"]
            return c["per_device_batch_size"] * c["gradient_accumulation_steps"] * c["model"].get("n_positions", 1024)
    return 1


def count_params(run: Path):
    path = run / "model.safetensors"
    if not path.exists():
        return None
    from safetensors import safe_open
    total = 0
    with safe_open(str(path), "pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            n = 1
            for s in shape:
                n *= s
            total += n
    return total  # lm_head is tied to wte and not stored


def corrected_flops_per_token(run: Path, logged):
    """Runs made before ``flops_per_token`` counted ``attention_layers`` logged a global+SWA stack as SWA in every
    layer. Recount them with the current count, which follows ``attention_layers`` layer by layer; for newer runs
    this equals the logged value."""
    cfg_path = run / "config.json"
    if logged is None or not cfg_path.exists():
        return logged
    cfg = json.loads(cfg_path.read_text())
    layers = cfg.get("attention_layers")
    if not layers:
        return logged
    from hf_structattn import StructAttnGPT2Config
    from hf_structattn.flops import flops_per_token
    return flops_per_token(StructAttnGPT2Config.from_dict(cfg), cfg["n_positions"], training=True)


def reeval(run: Path, n_windows: int):
    cache = run / f"reeval_{n_windows}.json"
    if cache.exists():
        return json.loads(cache.read_text())["bits_per_byte"]
    import math

    import torch

    from hf_structattn import StructAttnGPT2LMHeadModel
    from hf_structattn.training.clm import window_nll
    from hf_structattn.training.data import load_stdlib_corpus

    cfg = next(json.loads(l)["config"] for l in open(run / "metrics.jsonl") if '"event": "config"' in l)
    corpus = load_stdlib_corpus(cfg["validation_percent"], cfg["max_train_bytes"], cfg["max_validation_bytes"])
    model = StructAttnGPT2LMHeadModel.from_pretrained(str(run)).eval()
    seq_len = model.config.n_positions
    val = corpus.validation
    stride = max(seq_len, val.numel() // n_windows)
    windows = torch.stack([val[i * stride:i * stride + seq_len] for i in range(min(n_windows, val.numel() // stride))])
    nll, nbytes = window_nll(model, windows, 4)
    bpb = float(nll.sum()) / math.log(2) / float(nbytes.sum())
    cache.write_text(json.dumps({"bits_per_byte": bpb, "windows": int(windows.shape[0]), "stride": stride}))
    return bpb


def load(root: Path):
    runs = []
    for run in sorted(root.iterdir()):
        m = re.fullmatch(r"([a-z]+)_d(\d+)", run.name)
        if not m or not (run / "metrics.jsonl").exists():
            continue
        evals = []
        for line in open(run / "metrics.jsonl"):
            rec = json.loads(line)
            if "eval/bits_per_byte" in rec:
                evals.append((rec["step"], rec["flops"], rec["eval/bits_per_byte"], rec["eval/loss"]))
        if not evals:
            continue
        final = json.loads((run / "final_metrics.json").read_text()) if (run / "final_metrics.json").exists() else {}
        done = bool(final)
        logged_fpt = final.get("flops_per_token") or (evals[-1][1] / max(1, evals[-1][0]) / _tokens_per_step(run))
        fpt = corrected_flops_per_token(run, logged_fpt)
        if fpt != logged_fpt:  # rescale the logged FLOPs axis to the per-layer count
            evals = [(s_, f * fpt / logged_fpt, b, l) for s_, f, b, l in evals]
        final = dict(final, flops_per_token_logged=logged_fpt, flops_per_token=fpt)
        runs.append(dict(variant=m.group(1), width=int(m.group(2)), evals=evals, final=final,
                         params=count_params(run), done=done))
    return runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="outputs/reproduce/lm")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--reeval", type=int, default=0)
    args = ap.parse_args()
    root, out = Path(args.root), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = load(root)
    widths = sorted({r["width"] for r in runs})
    styles = {w: s for w, s in zip(widths, ["--", "-", ":", "-."])}
    for xkey, fname, xlabel in [(1, "lm_bpb_vs_flops.png", "training FLOPs (recipe count, 2 x MACs x 3 for fwd+bwd)"),
                                (0, "lm_bpb_vs_steps.png", "optimizer step")]:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        for r in sorted(runs, key=lambda r: (r["width"], ORDER.index(r["variant"]) if r["variant"] in ORDER else 9)):
            pts = [e for e in r["evals"] if e[0] > 0]  # step 0 (~8 bits/byte) squashes the axis
            ax.plot([p[xkey] for p in pts], [p[2] for p in pts], styles[r["width"]], marker="o", ms=3,
                    color=COLORS.get(r["variant"]), label=f"{LABELS.get(r['variant'], r['variant'])}, D={r['width']}".replace("\\|", "|"))
        if xkey == 1:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation bits per byte")
        ax.set_title("Byte-level LM on the Python stdlib, T=1024, 6 layers, head dim 64")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=130)
        plt.close(fig)
    rows = []
    lines = ["| variant | D | heads | params | steps | final val bits/byte | final val loss (nats) | training FLOPs | FLOPs/token (train) |"
             + (f" val bits/byte, {args.reeval} spread windows |" if args.reeval else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if args.reeval else "")]
    for r in sorted(runs, key=lambda r: (r["width"], r["evals"][-1][2])):
        step, flops, bpb, loss = r["evals"][-1]
        fpt = r["final"].get("flops_per_token")
        logged = r["final"].get("flops_per_token_logged")
        rb = reeval(root / f"{r['variant']}_d{r['width']}", args.reeval) if args.reeval and r["done"] else None
        rows.append(dict(variant=r["variant"], width=r["width"], params=r["params"], steps=step, bpb=bpb, loss=loss,
                         flops=flops, flops_per_token=fpt, done=r["done"], reeval_bpb=rb))
        lines.append(f"| {LABELS.get(r['variant'], r['variant'])} | {r['width']} | {r['width'] // 64} | "
                     f"{r['params'] if r['params'] is None else format(r['params'], ',')} | {step}"
                     f"{'' if r['done'] else ' (running)'} | {bpb:.4f} | {loss:.4f} | {flops:.3e} | "
                     f"{'' if fpt is None else format(fpt / 1e6, '.2f') + ' M'}"
                     f"{'' if fpt == logged or logged is None else ' (recipe logged ' + format(logged / 1e6, '.2f') + ' M)'} |"
                     + ((f" {rb:.4f} |" if rb is not None else " |") if args.reeval else ""))
    table = "\n".join(lines)
    print(table)
    (root / "summary.md").write_text(table + "\n")
    (root / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
