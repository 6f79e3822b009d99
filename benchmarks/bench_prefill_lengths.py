"""Prefill time by prompt length: MLR against dense attention at lengths on and just past block edges.

A patched model's blocks come from ``mlr_max_length``, not from the prompt, so a prompt of 4,098 tokens with
4,096-token blocks cuts every coarse block. Two tables, one torch thread, thread clock, variants interleaved
(a co-running process slows both alike), the median of ``--repeats``:

* **op**: one attention call at SmolLM2-135M's geometry (9 heads of dim 64, ranks 32|16|8|8, causal, float32,
  queries in a model's (B, T, H, E) memory), ``mlr_attention`` with the blocks of ``mlr_max_length`` 2,048 and
  8,192 (``default_block_sizes``), and with the nearest-keys rule (``level_rule="nearest"``) and the sizes of 2,048,
  against ``F.scaled_dot_product_attention``;
* **model** (when the real-weights tier is installed, ``hf_structattn.real_weights``; skipped with the reason
  otherwise): one prefill of SmolLM2-135M-Instruct into a fresh ``DynamicCache``, stock against the default patch
  (``hf_structattn.patch(model, mlr_ranks=[32, 16, 8, 8], mlr_max_length=...)``) and the patch of 2,048 with
  ``mlr_level_rule="nearest"``, token ids from the held-out text.

    python benchmarks/bench_prefill_lengths.py                       # both tables into outputs/prefill_lengths.md
    python benchmarks/bench_prefill_lengths.py --update-committed    # rewrites benchmarks/results/prefill_lengths.md
    python benchmarks/bench_prefill_lengths.py --op-lengths 4096 4098 --model-lengths   # a quick op-only look
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_structattn import default_block_sizes, mlr_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import header_line  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RANKS = [32, 16, 8, 8]
MAX_LENGTHS = (2048, 8192)
NEAREST = "nearest"  # the column of the nearest-keys rule, sizes of mlr_max_length 2,048
COLUMNS = MAX_LENGTHS + (NEAREST,)
OP_LENGTHS = [512, 1024, 1025, 2047, 2048, 2049, 2050, 2304, 3000, 4095, 4096, 4097, 4098, 5000, 6000, 8191, 8192]
MODEL_LENGTHS = [2048, 2050, 4096, 4098]


def interleaved(calls: dict, repeats: int) -> dict:
    """Median thread seconds per named call, the calls run round-robin after one warm-up each."""
    for call in calls.values():
        call()
    seconds = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.thread_time()
            call()
            seconds[name].append(time.thread_time() - started)
    return {name: statistics.median(values) for name, values in seconds.items()}


@torch.no_grad()
def op_rows(lengths: list, repeats: int) -> list:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        # (B, T, H, E) memory viewed as (B, H, T, E), as a model's projections give them
        q, k, v = (torch.randn(1, length, 9, 64, generator=generator).transpose(1, 2) for _ in range(3))
        calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        for max_length in MAX_LENGTHS:
            blocks = default_block_sizes(max_length, len(RANKS))
            calls[max_length] = lambda blocks=blocks: mlr_attention(q, k, v, ranks=RANKS, block_sizes=blocks)
        nearest_sizes = default_block_sizes(MAX_LENGTHS[0], len(RANKS))
        calls[NEAREST] = lambda: mlr_attention(q, k, v, ranks=RANKS, block_sizes=nearest_sizes, level_rule="nearest")
        median = interleaved(calls, repeats)
        rows.append((length, median["sdpa"], *(median[m] / median["sdpa"] for m in COLUMNS)))
        print(f"op T={length}: sdpa {1e3 * median['sdpa']:.1f} ms, MLR/sdpa "
              + ", ".join(f"{median[m] / median['sdpa']:.2f} (blocks of {m})" for m in MAX_LENGTHS)
              + f", {median[NEAREST] / median['sdpa']:.2f} (nearest-keys rule)", flush=True)
    return rows


@torch.no_grad()
def model_rows(lengths: list, repeats: int) -> tuple:
    """(rows, note): one prefill per model and length, or ([], why the tier is unavailable)."""
    import transformers

    import hf_structattn
    from hf_structattn.real_weights import RealWeightsUnavailable, load_smollm2, token_windows

    try:
        stock, tokenizer = load_smollm2(torch.float32)
    except RealWeightsUnavailable as error:
        return [], f"model table skipped: {error}"
    ids = token_windows(tokenizer, "heldout", max(lengths), 1)
    models = {"stock": stock}
    for max_length in MAX_LENGTHS:
        models[max_length] = hf_structattn.patch(stock, mlr_ranks=RANKS, mlr_max_length=max_length).eval()
    models[NEAREST] = hf_structattn.patch(stock, mlr_ranks=RANKS, mlr_max_length=MAX_LENGTHS[0],
                                          mlr_level_rule="nearest").eval()
    rows = []
    for length in lengths:
        prompt = ids[:, :length]
        calls = {name: (lambda model=model: model(prompt, cache=transformers.DynamicCache(config=model.config)))
                 for name, model in models.items()}
        median = interleaved(calls, repeats)
        rows.append((length, median["stock"], *(median[m] / median["stock"] for m in COLUMNS)))
        print(f"model T={length}: stock {median['stock']:.2f} s, patched/stock "
              + ", ".join(f"{median[m] / median['stock']:.2f} (mlr_max_length {m})" for m in MAX_LENGTHS)
              + f", {median[NEAREST] / median['stock']:.2f} (nearest-keys rule)", flush=True)
    return rows, "SmolLM2-135M-Instruct (real-weights tier, float32), held-out text"


def table(rows: list, first: str, unit: str, scale: float) -> str:
    heads = " | ".join(f"MLR / dense, blocks of {m}" if first == "SDPA" else f"patched / stock, mlr_max_length {m}"
                       for m in MAX_LENGTHS)
    heads += f" | nearest-keys rule / {'dense' if first == 'SDPA' else 'stock'}, sizes of {MAX_LENGTHS[0]}"
    lines = [f"| T | {first} ({unit}) | {heads} |", "|---:|---:|" + "---:|" * len(COLUMNS)]
    for length, base, *ratios in rows:
        lines.append(f"| {length:,} | {base * scale:,.1f} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op-lengths", type=int, nargs="*", default=OP_LENGTHS)
    parser.add_argument("--model-lengths", type=int, nargs="*", default=MODEL_LENGTHS,
                        help="prompt lengths of the model table (none: skip it)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant and length (op table)")
    parser.add_argument("--model-repeats", type=int, default=2, help="timed prefills per model and length")
    parser.add_argument("--output", default="outputs/prefill_lengths.md")
    parser.add_argument("--update-committed", action="store_true",
                        help="write benchmarks/results/prefill_lengths.md (the table docs/benchmarks.md quotes)")
    args = parser.parse_args(argv)
    bad = [length for length in args.op_lengths + args.model_lengths if length < 1]
    if bad:
        parser.error(f"lengths must be positive, got {bad[0]}")
    torch.set_num_threads(1)
    header = header_line(f"Python {platform.python_version()}, float32, ranks {'|'.join(map(str, RANKS))}, "
                         f"thread clock, medians")
    print(header, flush=True)
    parts = [f"# Prefill time by prompt length\n\n{header}\n\nMade by `python benchmarks/bench_prefill_lengths.py"
             f"{' --update-committed' if args.update_committed else ''}`.\n"]
    if args.op_lengths:
        rows = op_rows(args.op_lengths, args.repeats)
        parts.append("## One attention call (9 heads of dim 64, batch 1)\n\n" + table(rows, "SDPA", "ms", 1e3))
    if args.model_lengths:
        rows, note = model_rows(args.model_lengths, args.model_repeats)
        parts.append(f"## One prefill into a DynamicCache: {note}\n\n"
                     + (table(rows, "stock", "s", 1.0) if rows else ""))
    output = ROOT / "benchmarks/results/prefill_lengths.md" if args.update_committed else Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n\n".join(parts).rstrip() + "\n")
    print(f"written: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
