"""Where a patched pretrained model loses: the loss the patch adds by a token's place in its block.

MLR scores a query against the keys of its own finest block with every dim, and against older keys with fewer: the
first tokens of a block see even their nearest neighbours through the coarse dims only. A model trained with MLR
learns that structure; a pretrained one, patched without training, was not. This measures it on SmolLM2-135M-Instruct
(the real-weights tier, ``hf_structattn.real_weights``; float32; no training), the default patch
(``hf_structattn.patch(model, mlr_ranks=ranks, mlr_max_length=2048)``: blocks 1024, 512, 256), on held-out windows
of 2,048 tokens: the next-token loss of the patched model minus the stock model's, per predicted token, averaged
over tokens grouped by

* **phase**: the predicting token's index inside its finest block (0 = the block's first token), in ranges;
* **edge**: the coarsest level whose block starts at the predicting token (its position is a multiple of that
  level's block: 1,024 for level 2, 512 for level 3, 256 for level 4; "none" inside a block);

with a 95 % interval over windows (mean +- 1.96 standard errors of the per-window means). Tokens 0-255 of a window
lie in one block at every level, where the patch is exact; they are left out.

    python benchmarks/bench_block_phase.py                     # into outputs/block_phase.md
    python benchmarks/bench_block_phase.py --update-committed  # rewrites benchmarks/results/block_phase.md
"""

import argparse
import math
import os
import platform
import sys
from pathlib import Path

import torch

import hf_structattn
from hf_structattn.real_weights import token_windows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import header_line  # noqa: E402
from bench_real_weights import load_stock_or_exit, rank_list, window_scores  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PHASES = ((0, 0), (1, 3), (4, 15), (16, 63), (64, 255))


def interval(per_window: torch.Tensor) -> str:
    """'mean [low, high]' over windows (95 %, normal approximation)."""
    mean = float(per_window.mean())
    half = 1.96 * float(per_window.std(unbiased=True)) / math.sqrt(per_window.numel()) if per_window.numel() > 1 else 0
    return f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"


def rows(gaps: torch.Tensor, blocks: list) -> list:
    """(group, tokens per window, interval) rows from ``gaps`` (N, T-1): the loss added at each predicted token,
    indexed by the predicting token's position."""
    positions = torch.arange(gaps.shape[1])
    beyond_first = positions >= blocks[-1]  # tokens of the first finest block see every key with every dim
    phase = positions % blocks[-1]
    out = []
    for low, high in PHASES:
        chosen = beyond_first & (phase >= low) & (phase <= high)
        out.append((f"phase {low}-{high}" if high > low else f"phase {low}", int(chosen.sum()),
                    interval(gaps[:, chosen].mean(1))))
    edge = torch.full_like(positions, len(blocks) + 2)  # "none"
    for level in range(len(blocks) + 1, 1, -1):  # finest first, so the coarsest level that starts here wins
        edge[(positions % blocks[level - 2] == 0) & beyond_first] = level
    for level in range(2, len(blocks) + 2):
        chosen = edge == level
        out.append((f"edge: a level-{level} block ({blocks[level - 2]:,}) starts here", int(chosen.sum()),
                    interval(gaps[:, chosen].mean(1))))
    chosen = beyond_first & (edge == len(blocks) + 2)
    out.append(("inside every block", int(chosen.sum()), interval(gaps[:, chosen].mean(1))))
    out.append(("every token past the first block", int(beyond_first.sum()), interval(gaps[:, beyond_first].mean(1))))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=rank_list, nargs="+", default=[rank_list("32,16,8,8")])
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of 2,048 tokens (16 exist)")
    parser.add_argument("--output", default="outputs/block_phase.md")
    parser.add_argument("--update-committed", action="store_true",
                        help="write benchmarks/results/block_phase.md (the table docs/patching.md quotes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    stock, tokenizer = load_stock_or_exit()
    windows = token_windows(tokenizer, "heldout", 2048, args.windows)
    header = header_line(f"Python {platform.python_version()}, float32, SmolLM2-135M-Instruct (real-weights tier), "
                         f"{args.windows} held-out windows of 2,048 tokens, mlr_max_length=2048, no training")
    print(header, flush=True)
    stock_losses = window_scores(stock, windows)["losses"]
    parts = [f"# Loss added by the patch, by place in the block\n\n{header}\n\nMade by `python "
             f"benchmarks/bench_block_phase.py{' --update-committed' if args.update_committed else ''}`. Added nats "
             f"per predicted token (patched minus stock), mean [95 % interval over windows]."]
    for ranks in args.ranks:
        patched = hf_structattn.patch(stock, mlr_ranks=ranks, mlr_max_length=2048).eval()
        gaps = window_scores(patched, windows)["losses"] - stock_losses
        blocks = list(patched.config.mlr_block_sizes)
        lines = [f"## ranks {'|'.join(map(str, ranks))}, blocks {', '.join(map(str, blocks))}", "",
                 "| predicting token | tokens per window | added nats |", "|---|---:|---|"]
        lines += [f"| {name} | {count:,} | {value} |" for name, count, value in rows(gaps, blocks)]
        parts.append("\n".join(lines))
        print(parts[-1], flush=True)
        del patched
    output = ROOT / "benchmarks/results/block_phase.md" if args.update_committed else Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n\n".join(parts) + "\n")
    print(f"written: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
