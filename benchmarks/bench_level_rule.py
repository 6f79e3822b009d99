"""Which keys a patched pretrained model should score with its finer dims: the paper's blocks, or the nearest keys.

The paper's MLR gives a pair level l's dims when both tokens lie in one level-l block (blocks aligned to position 0):
a token at a block's start sees even its nearest neighbours through the coarse dims only, and on SmolLM2 that is
where most of the patch's added loss sits (``benchmarks/bench_block_phase.py``). The alternative measured here gives
level l's dims to the ``w_l`` nearest keys (``0 <= i - j < w_l``: a sliding window per finer level, the way a cache
that keeps each level's last ``w_l`` keys would read). With ``w_l = b_l`` a hierarchical cache allocates the same
key bytes as the block rule (``T r_1 + sum_l b_l r_l``; the block rule holds between 0 and ``b_l`` keys of level l,
the window rule always ``w_l``); ``w_l = b_l / 2`` holds the block rule's average.

SmolLM2-135M-Instruct (the real-weights tier, ``hf_structattn.real_weights``), float32, no training, the default patch
(``hf_structattn.patch(model, mlr_ranks=ranks, mlr_max_length=2048)``: blocks 1024, 512, 256, level order
"frequency") beside the same patch with ``mlr_level_rule="nearest"`` (the package's rule and op), and with half the
sizes, held-out windows of 2,048 tokens: perplexity against the stock model's, top-1 agreement, and the added loss by
place in the finest block (``bench_block_phase.rows``).

    python benchmarks/bench_level_rule.py                      # into outputs/level_rule.md
    python benchmarks/bench_level_rule.py --update-committed   # rewrites benchmarks/results/level_rule.md
"""

import argparse
import math
import os
import platform
import sys
from pathlib import Path

import torch

import hf_structattn
from hf_structattn.modeling.structattn_geometry import MLRGeometry
from hf_structattn.real_weights import token_windows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_block_phase import rows  # noqa: E402
from bench_generation import header_line  # noqa: E402
from bench_real_weights import load_stock_or_exit, rank_list, window_scores  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def summary(name: str, scores: dict, stock: dict, key_ratio: float, blocks: list) -> tuple:
    gaps = scores["losses"] - stock["losses"]
    line = (f"| {name} | {key_ratio:.3f} | {math.exp(float(gaps.mean())):.4f} | "
            f"{float((scores['argmax'] == stock['argmax']).double().mean()):.3f} | "
            + " | ".join(value for _, _, value in rows(gaps, blocks)[:5]) + " |")
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=rank_list, default=rank_list("32,16,8,8"))
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of 2,048 tokens (16 exist)")
    parser.add_argument("--output", default="outputs/level_rule.md")
    parser.add_argument("--update-committed", action="store_true",
                        help="write benchmarks/results/level_rule.md (the table docs/patching.md quotes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    stock_model, tokenizer = load_stock_or_exit()
    windows = token_windows(tokenizer, "heldout", 2048, args.windows)
    header = header_line(f"Python {platform.python_version()}, float32, SmolLM2-135M-Instruct (real-weights tier), "
                         f"{args.windows} held-out windows of 2,048 tokens, ranks {'|'.join(map(str, args.ranks))}, "
                         f"mlr_max_length=2048, no training")
    print(header, flush=True)
    stock = window_scores(stock_model, windows)
    patched = hf_structattn.patch(stock_model, mlr_ranks=args.ranks, mlr_max_length=2048).eval()
    blocks = list(patched.config.mlr_block_sizes)
    head_dim, ranks = sum(args.ranks), args.ranks

    def key_ratio(sizes):  # key entries per (row, head) at T = 2,048 against the stock cache's
        return MLRGeometry.build(ranks, sizes).key_cache_elements(2048) / (2048 * head_dim)

    lines = ["| rule | keys / stock (allocated, T = 2,048) | ppl / stock | top-1 = stock | "
             + " | ".join(name for name, _, _ in rows(torch.zeros(1, 2047), blocks)[:5]) + " |",
             "|---|---:|---:|---:|" + "---|" * 5]
    lines.append(summary(f"blocks {', '.join(map(str, blocks))} (the paper's, the default)",
                         window_scores(patched, windows), stock, key_ratio(blocks), blocks))
    print(lines[-1], flush=True)
    for sizes in (blocks, [size // 2 for size in blocks]):
        nearest = hf_structattn.patch(stock_model, mlr_ranks=args.ranks, mlr_block_sizes=sizes,
                                      mlr_level_rule="nearest").eval()
        lines.append(summary(f"nearest keys (`mlr_level_rule=\"nearest\"`), sizes {', '.join(map(str, sizes))}",
                             window_scores(nearest, windows), stock, key_ratio(sizes), blocks))
        print(lines[-1], flush=True)
    parts = [f"# Which keys get the finer dims: blocks or the nearest keys\n\n{header}\n\nMade by `python "
             f"benchmarks/bench_level_rule.py{' --update-committed' if args.update_committed else ''}`. Added nats per "
             f"predicted token by place in the finest block ({blocks[-1]} tokens): mean [95 % interval over windows].",
             "\n".join(lines)]
    output = ROOT / "benchmarks/results/level_rule.md" if args.update_committed else Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n\n".join(parts) + "\n")
    print(f"written: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
