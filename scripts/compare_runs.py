"""Compare CLM recipe runs (the README main job trains the same model with dense and with MLR attention).

    python scripts/compare_runs.py OUT_DENSE OUT_MLR [--decode_tokens 200] [--rounds 7] [--plot outputs/dense_vs_mlr.png]

For each output folder: validation bits per byte and training tokens/s from its ``final_metrics.json`` (written by
``recipes/train_clm.py``; training tokens per CPU second of its main thread, one intra-op thread, evaluation
excluded), and, measured here:

* decode milliseconds per token: ``model.generate`` with the model's default cache (the hierarchical MLR key cache
  for MLR layers, full keys for dense ones), greedy, ``--decode_tokens`` new tokens after a one-token prompt, batch
  1, one intra-op thread, CPU time of this thread (``time.thread_time``: the machine may be shared) for the whole
  call divided by the new tokens. The runs are timed interleaved, one call each per round (the order alternates
  between rounds), ``--rounds`` rounds after one untimed warm-up round; cells are the median [min-max] over rounds,
  and the ratio to the first run is taken within each round (median [min-max] of those per-round ratios);
* key/value cache bytes of the cache ``generate(..., return_dict_in_generate=True)`` returned: **allocated** (the
  unique storages of every tensor it holds, ``hf_structattn.flops.allocated_cache_bytes``) beside the **formula**
  (keys, and keys + values, in use for the tokens the cache holds: ``hf_structattn.flops.attention_cost_report``).

Prints a markdown table with the machine and versions and a note on what the decode ratio means, saves the
validation curves of all runs in one plot (linear axes) and the table next to it (``.md``).
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import hf_structattn  # noqa: F401  (registers the Auto classes of the saved model type)
from hf_structattn.flops import allocated_cache_bytes, attention_cost_report


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def returned_cache(output):
    """The cache ``generate(..., return_dict_in_generate=True)`` returned (``cache`` in transformers 5.x)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model, tokenizer


@torch.no_grad()
def generate_once(model, tokenizer, new_tokens: int):
    """(thread seconds, returned cache) of one greedy generation of ``new_tokens`` after a one-token prompt."""
    ids = tokenizer("\n", return_tensors="pt").input_ids
    started = time.thread_time()  # CPU time of this thread: the machine may be shared
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
    seconds = time.thread_time() - started
    if out.sequences.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate returned {out.sequences.shape[1] - ids.shape[1]} new tokens, not {new_tokens}")
    return seconds, returned_cache(out)


def measure_decode(models: list, new_tokens: int, rounds: int) -> list:
    """Per model: seconds of each timed round, interleaved across models (order alternating), after a warm-up."""
    seconds = [[] for _ in models]
    order = list(range(len(models)))
    for round_index in range(rounds + 1):  # round 0 warms up
        for index in (order if round_index % 2 else order[::-1]):
            model, tokenizer = models[index]
            elapsed, _ = generate_once(model, tokenizer, new_tokens)
            if round_index:
                seconds[index].append(elapsed)
    return seconds


def cache_bytes(model, tokenizer, new_tokens: int) -> dict:
    """Allocated and formula bytes of the cache generate returns after ``new_tokens`` greedy tokens."""
    _, cache = generate_once(model, tokenizer, new_tokens)
    held = int(cache.get_seq_length())
    item = next(model.parameters()).element_size()
    report = attention_cost_report(model.config, dtype_bytes=item, context_len=held)
    return {"cached_tokens": held, "allocated_cache_bytes": allocated_cache_bytes(cache),
            "formula_key_bytes": report.key_cache_bytes, "formula_kv_bytes": report.kv_cache_bytes,
            "dense_formula_key_bytes": report.dense_key_cache_bytes}


def spread(values: list, scale: float = 1.0, digits: int = 2) -> str:
    """``median [min-max]`` of ``values`` times ``scale``."""
    return (f"{statistics.median(values) * scale:.{digits}f} [{min(values) * scale:.{digits}f}-"
            f"{max(values) * scale:.{digits}f}]")


def eval_curve(path: Path) -> list:
    curve = []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/bits_per_byte" in record:
            curve.append((record["step"], record["eval/bits_per_byte"]))
    return curve


def table(rows: list, args, threads: int) -> str:
    import transformers

    base = rows[0]
    tokens = base["cached_tokens"]
    lines = [f"Machine: {cpu_name()}, torch {torch.__version__}, transformers {transformers.__version__}. Training: "
             "tokens per CPU second of the training thread (one intra-op thread, evaluation excluded). Decode: "
             f"{threads} thread, batch 1, greedy `generate` of {args.decode_tokens} tokens after a 1-token prompt "
             f"with the model's default cache (it then holds {tokens} tokens), CPU time of the thread per token; "
             f"runs interleaved, median [min-max] over {args.rounds} rounds; ratio to {base['run']} taken within "
             "each round. Cache: bytes allocated (unique storages of the returned cache's tensors) and the formula "
             f"(bytes in use) at {tokens} tokens.", "",
             f"| run | attention | steps | validation bits/byte | training tokens/CPU-s | decode ms/token | decode "
             f"/ {base['run']} | cache bytes allocated | formula K+V bytes | formula key bytes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratios = [mine / theirs for mine, theirs in zip(row["decode_seconds"], base["decode_seconds"])]
        lines.append(f"| {row['run']} | {row['attention']} | {row['steps']} | {row['bits_per_byte']:.3f} | "
                     f"{row['train_tokens_per_second']:,.0f} | "
                     f"{spread(row['decode_seconds'], 1000 / args.decode_tokens)} | {spread(ratios)}x | "
                     f"{row['allocated_cache_bytes']:,} | {row['formula_kv_bytes']:,} | "
                     f"{row['formula_key_bytes']:,} |")
    notes = []
    for row in rows[1:]:
        key_saving = 1 - row["formula_key_bytes"] / row["dense_formula_key_bytes"]
        ratio = statistics.median(m / t for m, t in zip(row["decode_seconds"], base["decode_seconds"]))
        step_ms = statistics.median(base["decode_seconds"]) * 1000 / args.decode_tokens
        notes.append(
            f"What the decode ratio means ({row['run']} / {base['run']} = {ratio:.2f}x): at {row['cached_tokens']} "
            f"cached tokens the {row['attention']} cache holds {key_saving:.0%} fewer key bytes than dense keys by "
            f"the formula, but the whole K+V cache is {base['formula_kv_bytes'] / 1024:.0f} KiB, which a core "
            f"reads in microseconds, against {step_ms:.2f} ms per step: a decode step of this small model is bound "
            "by per-op dispatch (a few hundred small ops), so the ratio measures the per-op overhead of the decode "
            "path, not memory traffic. Cache bytes allocated include reserved slots, positions and flags, and can "
            "exceed the formula.")
    return "\n".join(lines + [""] + notes)


def plot(args, rows: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import AutoMinorLocator, MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path, row in zip(args.runs, rows):
        steps, values = zip(*eval_curve(path))
        ax.plot(steps, values, "o-", label=f"{row['attention']} ({row['bits_per_byte']:.3f} at the end)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation bits per byte")
    for axis in (ax.xaxis, ax.yaxis):  # a linear axis with enough ticks to read values off
        axis.set_major_locator(MaxNLocator(nbins=10))
        axis.set_minor_locator(AutoMinorLocator())
    ax.grid(which="major", alpha=0.4)
    ax.grid(which="minor", alpha=0.15)
    ax.legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="output folders of recipes/train_clm.py; the first is "
                        "the baseline of the ratios")
    parser.add_argument("--decode_tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7, help="timed decode rounds (after one warm-up round)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the validation curves (and a .md table)")
    args = parser.parse_args(argv)
    if args.decode_tokens < 1:
        parser.error(f"--decode_tokens must be >= 1, got {args.decode_tokens}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    for path in args.runs:
        if not (path / "final_metrics.json").is_file():
            parser.error(f"runs: {path} has no final_metrics.json (not a finished recipes/train_clm.py run)")
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows, models = [], []
    for path in args.runs:
        metrics = json.loads((path / "final_metrics.json").read_text())
        config = json.loads((path / "config.json").read_text())
        rows.append({"run": path.name, "attention": config["attention"], "steps": metrics["step"],
                     "bits_per_byte": metrics["eval_bits_per_byte"],
                     "train_tokens_per_second": metrics["train_tokens_per_cpu_second"]})
        models.append(load(path))
    for row, seconds, (model, tokenizer) in zip(rows, measure_decode(models, args.decode_tokens, args.rounds), models):
        row["decode_seconds"] = seconds
        row.update(cache_bytes(model, tokenizer, args.decode_tokens))
    text = table(rows, args, torch.get_num_threads())
    print(text)
    if args.plot is not None:
        plot(args, rows)
        args.plot.with_suffix(".md").write_text(text + "\n")
        print(f"plot: {args.plot}, table: {args.plot.with_suffix('.md')}")
    return text


if __name__ == "__main__":
    main()
