"""Compare CLM recipe runs (the README main job trains the same model with dense and with MLR attention).

    python scripts/compare_runs.py OUT_DENSE OUT_MLR [--decode_tokens 200] [--rounds 11] [--plot outputs/dense_vs_mlr.png]

For each output folder: validation bits per byte and training tokens/s from its ``final_metrics.json`` (written by
``recipes/train_clm.py``; training tokens per CPU second of its main thread, one intra-op thread, evaluation
excluded), and, measured here:

* decode milliseconds per token: the model's default generation cache (the hierarchical MLR key cache for MLR
  layers, full keys for dense ones) is built and prefilled by ``model.generate(prompt, max_new_tokens=1,
  return_dict_in_generate=True)`` on a one-token prompt, then ``--decode_tokens`` greedy steps
  ``model(token, cache=cache)`` + argmax (the step generate runs; the tokens are checked against
  ``model.generate``) are timed one by one, batch 1, one intra-op thread, CPU time of this thread
  (``time.thread_time``: the machine may be shared). The runs' steps alternate (the order flips every step), so
  a busy moment of the machine slows them alike; ``--rounds`` rounds after one untimed warm-up round; cells are
  the median [min-max] over rounds of the round's time per step, and the ratio to the first run is taken within
  each round (median [min-max] of those per-round ratios). The cache then holds ``1 + --decode_tokens`` tokens;
* key/value cache bytes of that cache after the last round: **allocated** (the unique storages of every tensor it
  holds, ``hf_structattn.cache_memory.allocated_cache_bytes``) beside the **formula** (keys, and keys + values, in use for
  the tokens the cache holds: ``hf_structattn.flops.attention_cost_report``).

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
from hf_structattn.cache_memory import allocated_cache_bytes, returned_cache
from hf_structattn.flops import attention_cost_report


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()



def load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model, tokenizer


def prompt_ids(tokenizer) -> torch.Tensor:
    return tokenizer("\n", return_tensors="pt").input_ids


@torch.no_grad()
def start_decode(model, tokenizer):
    """(cache, first new token) from ``generate`` on the prompt: the model's default cache, filled by prefill."""
    out = model.generate(prompt_ids(tokenizer), max_new_tokens=1, min_new_tokens=1, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
    return returned_cache(out), out.sequences[:, -1:]


@torch.no_grad()
def measure_decode(models: list, steps: int, rounds: int, progress=None) -> tuple:
    """Per model, the thread seconds of ``steps`` greedy decode steps (``model(token, cache=cache)``, the step
    generate runs, plus the argmax) in each timed round, after one warm-up round; in every round the models'
    steps alternate (the order flips every step), so a slow moment of the machine hits all of them alike.
    Also returns each model's cache after the last round and the tokens it decoded. ``progress(text)`` is called
    after every round (wall seconds so far)."""
    seconds = [[] for _ in models]
    wall_start = time.perf_counter()
    for round_index in range(rounds + 1):  # round 0 warms up
        states = [list(start_decode(model, tokenizer)) for model, tokenizer in models]
        decoded = [[token] for _, token in states]
        totals = [0.0 for _ in models]
        for step in range(steps):
            for index in (range(len(models)) if step % 2 == 0 else reversed(range(len(models)))):
                model, cache, token = models[index][0], states[index][0], states[index][1]
                started = time.thread_time()  # CPU time of this thread: the machine may be shared
                token = model(token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                totals[index] += time.thread_time() - started
                states[index][1] = token
                decoded[index].append(token)
        if round_index:
            for index, total in enumerate(totals):
                seconds[index].append(total)
        if progress is not None:
            what = "warm-up round" if round_index == 0 else f"round {round_index}/{rounds}"
            progress(f"decode timing: {what} done ({steps} steps per model, "
                     f"{time.perf_counter() - wall_start:.0f} s so far)")
    return seconds, [state[0] for state in states], [torch.cat(tokens, dim=1) for tokens in decoded]


@torch.no_grad()
def check_same_as_generate(model, tokenizer, decoded: torch.Tensor) -> None:
    """The timed loop must decode what ``generate`` decodes (greedy), or it did not measure generation."""
    ids = prompt_ids(tokenizer)
    new = decoded.shape[1]
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    if not torch.equal(out[:, ids.shape[1]:], decoded):
        raise RuntimeError("the timed decode loop produced other tokens than model.generate")


def cache_bytes(model, cache) -> dict:
    """Allocated and formula bytes of a filled generation cache."""
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
             f"{threads} thread, batch 1, greedy, {args.decode_tokens} steps `model(token, cache=cache)` after a "
             "1-token prompt prefilled by `generate` into the model's default cache (it then holds "
             f"{tokens} tokens), CPU time of the thread per step; the runs' steps alternate, median [min-max] over "
             f"{args.rounds} rounds; ratio to {base['run']} taken within each round. Cache: bytes allocated (unique "
             f"storages of the cache's tensors) and the formula (bytes in use) at {tokens} tokens.", "",
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
            "path, not memory traffic. Cache bytes allocated include slots reserved ahead of the tokens written, two "
            "positions per row and layer and the geometry's index constants, and can exceed the formula.")
    return "\n".join(lines + [""] + notes)


def plot(args, rows: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import AutoMinorLocator, MaxNLocator

    # left: the whole curves; right: from the second evaluation on, where the runs differ (the step-0 value,
    # ~8 bits/byte, would squeeze them together); both linear, with enough ticks to read values off
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for panel, ax in enumerate(axes):
        for path, row in zip(args.runs, rows):
            curve = eval_curve(path)
            steps, values = zip(*(curve[1:] if panel and len(curve) > 2 else curve))
            ax.plot(steps, values, "o-", label=f"{row['attention']} ({row['bits_per_byte']:.3f} at the end)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation bits per byte")
        ax.set_title("all evaluations" if panel == 0 else "from the second evaluation on", fontsize=10)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(nbins=10, steps=[1, 2, 2.5, 5, 10]))
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
    parser.add_argument("--rounds", type=int, default=11, help="timed decode rounds (after one warm-up round)")
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
    print(f"decode timing: {', '.join(row['run'] for row in rows)}, {args.decode_tokens} greedy steps each, one "
          f"warm-up and {args.rounds} timed rounds ...", flush=True)
    seconds, caches, decoded = measure_decode(models, args.decode_tokens, args.rounds,
                                              progress=lambda text: print(text, flush=True))
    for row, (model, tokenizer), run_seconds, cache, tokens in zip(rows, models, seconds, caches, decoded):
        check_same_as_generate(model, tokenizer, tokens)
        row["decode_seconds"] = run_seconds
        row.update(cache_bytes(model, cache))
    text = table(rows, args, torch.get_num_threads())
    print(text)
    if args.plot is not None:
        plot(args, rows)
        args.plot.with_suffix(".md").write_text(text + "\n")
        print(f"plot: {args.plot}, table: {args.plot.with_suffix('.md')}")
    return text


if __name__ == "__main__":
    main()
