"""Compare CLM recipe runs (the README main job trains the same model with dense and with MLR attention).

    python scripts/compare_runs.py OUT_DENSE OUT_MLR [--decode_tokens 200] [--plot outputs/dense_vs_mlr.png]

For each output folder: validation bits per byte and training tokens/s from its ``final_metrics.json`` (written by
``recipes/train_clm.py``); key-cache bytes and decode milliseconds per token measured here by greedy generation of
``--decode_tokens`` tokens after a one-token prompt with the model's own cache (``model.transformer.new_cache()``:
the hierarchical MLR key cache for MLR layers, full keys for dense ones), one intra-op thread, CPU time of that
thread (``time.thread_time``: the machine may be shared), the median of ``--repeats`` runs. Training throughput is
the recipe's training tokens per CPU second of its main thread (runs use one intra-op thread), evaluation excluded. Prints a markdown table with the machine and versions, saves the validation curves of all runs
in one plot and the table next to it (``.md``).
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import hf_structattn  # noqa: F401  (registers the Auto classes of the saved model type)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@torch.no_grad()
def measure_decode(path: Path, new_tokens: int, repeats: int) -> dict:
    """Key-cache bytes after ``new_tokens`` greedy tokens and the median decode time per token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer("\n", return_tensors="pt").input_ids
    seconds, cache = [], None
    for _ in range(repeats + 1):  # the first run warms up
        cache = model.transformer.new_cache()
        started = time.thread_time()  # CPU time of this thread: the machine may be shared
        out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
        seconds.append(time.thread_time() - started)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return {"key_cache_bytes": cache.key_cache_bytes(), "cached_tokens": cache.get_seq_length(),
            "decode_ms_per_token": 1000 * statistics.median(seconds[1:]) / new_tokens}


def eval_curve(path: Path) -> list[tuple[int, float]]:
    curve = []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/bits_per_byte" in record:
            curve.append((record["step"], record["eval/bits_per_byte"]))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--decode_tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the validation curves (and a .md table)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for path in args.runs:
        metrics = json.loads((path / "final_metrics.json").read_text())
        config = json.loads((path / "config.json").read_text())
        rows.append({"run": path.name, "attention": config["attention"], "steps": metrics["step"],
                     "bits_per_byte": metrics["eval_bits_per_byte"],
                     "train_tokens_per_second": metrics["train_tokens_per_cpu_second"],
                     **measure_decode(path, args.decode_tokens, args.repeats)})
    import transformers

    header = (f"Machine: {cpu_name()}, torch {torch.__version__}, transformers {transformers.__version__}. Training "
              "tokens per CPU second of the training thread (one intra-op thread, evaluation excluded); decode: 1 "
              f"thread, batch 1, {args.decode_tokens} greedy tokens, CPU ms per token, median of {args.repeats}.")
    lines = ["| run | attention | steps | validation bits/byte | training tokens/CPU-s | key-cache bytes "
             f"({args.decode_tokens + 1} tokens) | decode ms/token |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['run']} | {row['attention']} | {row['steps']} | {row['bits_per_byte']:.3f} | "
                     f"{row['train_tokens_per_second']:,.0f} | {row['key_cache_bytes']:,} | "
                     f"{row['decode_ms_per_token']:.2f} |")
    table = "\n".join([header, "", *lines])
    print(table)
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for path, row in zip(args.runs, rows):
            steps, values = zip(*eval_curve(path))
            ax.plot(steps, values, "o-", label=f"{row['attention']} ({row['bits_per_byte']:.3f} at the end)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation bits per byte")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=100)
        args.plot.with_suffix(".md").write_text(table + "\n")
        print(f"plot: {args.plot}, table: {args.plot.with_suffix('.md')}")


if __name__ == "__main__":
    main()
