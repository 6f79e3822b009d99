"""The level order on real weights: SmolLM2-135M-Instruct patched to MLR, before any training.

For each rank setting (``--ranks``, blocks dyadic from ``--mlr_max_length``) and each level order
(``--orders``: ``hf_structattn.patch(..., level_order=...)``), on the held-out windows of the real-weights tier
(``hf_structattn.real_weights``: CPython's pydoc topics, text no calibration or fine-tuning sees), float32:

* key cache / stock: ``flops.decoder_cache_report(config, T)["key_cache_ratio"]``, i.e.
  ``(T r_1 + sum_{l>=2} b_l r_l) / (T d)`` per KV head and layer at T = the window length (``kv`` the same with the
  values, which keep every position);
* perplexity: exp of the mean next-token loss over every predicted token of every window; the ratio to the stock
  model's on the same windows;
* top-1 agreement: the fraction of positions whose argmax next token equals the stock model's;
* the loss added by the patch (nats) by distance from the window start (tokens 1-256 lie in one block at every level
  with the default blocks, where the patch is exact).

``level_order="contribution"`` measures the pairs on ``--calibration_windows`` windows of the calibration split. Rows
are appended to ``--results`` (JSON lines) as they finish and printed; a rerun skips the rows already there for the
same windows and versions (resumable). One torch thread by default.

    python benchmarks/bench_real_weights.py [--ranks 32,16,8,8 16,16,16,16 16,8,8,8,8,8,8] [--orders frequency index
        contribution] [--windows 16] [--results benchmarks/results/real_weights.jsonl]
"""

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import hf_structattn
from hf_structattn.flops import decoder_cache_report
from hf_structattn.modeling.structattn_decoder_spec import LEVEL_ORDERS
from hf_structattn.real_weights import (SOURCE_RECORD, RealWeightsUnavailable, load_smollm2, smollm2_folder,
                                        splits_digest, token_windows)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import header_line  # noqa: E402

DEFAULT_RANKS = ["32,16,8,8", "16,16,16,16", "16,8,8,8,8,8,8"]
BUCKETS = ((1, 256), (257, 512), (513, 1024), (1025, 2048))  # predicted-token positions (1 = the second token)


def load_stock_or_exit():
    """SmolLM2-135M-Instruct in float32 and its tokenizer, or exit 1 saying why the real-weights tier is unavailable."""
    try:
        return load_smollm2(torch.float32)
    except RealWeightsUnavailable as error:
        sys.exit(f"real weights unavailable: {error}")


def rank_list(text: str) -> list:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks: expected comma-separated integers, got {text!r}") from None
    if not ranks:
        raise argparse.ArgumentTypeError(f"--ranks: {text!r} names no level")
    return ranks


@torch.no_grad()
@torch.no_grad()
def window_scores(model, windows: torch.Tensor, chunk: int = 512, new_cache=None) -> dict:
    """Per window: the next-token losses (T-1,) float64 and argmax tokens (T-1,) of ``model`` on ``windows`` (N, T),
    without a cache, or through a fresh ``new_cache()`` per window. The output layer runs ``chunk`` positions at a
    time (Gemma-3's 262,144-word logits of 8,192 positions would take 8.6 GB)."""
    head, softcap = model.get_output_embeddings(), getattr(model.config, "final_logit_softcapping", None)
    losses, argmax = [], []
    for window in windows:
        if new_cache is None:
            hidden = model.get_decoder()(window[None], use_cache=False).last_hidden_state[0, :-1]
        else:  # the whole model's forward prepares the cache (the decoder alone would keep plain layers)
            hidden = model(window[None], cache=new_cache(), use_cache=True, logits_to_keep=1,
                           output_hidden_states=True).hidden_states[-1][0, :-1]
        row_losses, row_argmax = [], []
        for start in range(0, hidden.shape[0], chunk):
            logits = head(hidden[start:start + chunk]).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            row_losses.append(torch.nn.functional.cross_entropy(logits, window[1 + start:1 + start + chunk],
                                                                reduction="none").double())
            row_argmax.append(logits.argmax(-1))
        losses.append(torch.cat(row_losses))
        argmax.append(torch.cat(row_argmax))
    return {"losses": torch.stack(losses), "argmax": torch.stack(argmax)}


def bucket_gaps(patched_losses: torch.Tensor, stock_losses: torch.Tensor) -> dict:
    """{"a-b": mean loss added by the patch at predicted positions a..b} (positions counted from 1)."""
    gaps = {}
    length = stock_losses.shape[1]
    for first, last in BUCKETS:
        if first <= length:
            part = slice(first - 1, min(last, length))
            gaps[f"{first}-{min(last, length)}"] = float((patched_losses[:, part] - stock_losses[:, part]).mean())
    return gaps


def run_key(args, windows: torch.Tensor, source: dict) -> dict:
    """What a stored row must share with this run to be reused."""
    return {"model_sha256": source["gguf_sha256"], "text_sha1": splits_digest(), "windows": int(windows.shape[0]),
            "length": int(windows.shape[1]),
            "mlr_max_length": args.mlr_max_length, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "calibration_windows": args.calibration_windows}


def read_rows(path: Path, key: dict) -> dict:
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("key") == key:
                    rows[(row["ranks"], row["level_order"])] = row
    return rows


def table(rows: list, stock_ppl: float) -> str:
    lines = ["| ranks | level_order | keys / stock | K+V / stock | perplexity | ppl / stock | top-1 = stock | "
             "added nats by position |",
             "|---|---|---:|---:|---:|---:|---:|---|",
             f"| stock (dense) | - | 1.000 | 1.000 | {stock_ppl:.3f} | 1.000 | 1.000 | - |"]
    for row in rows:
        gaps = ", ".join(f"{span}: {gap:+.3f}" for span, gap in row["added_nats_by_position"].items())
        ranks = row["ranks"].replace(",", "\\|")  # a literal | inside a markdown cell
        lines.append(f"| {ranks} | {row['level_order']} | {row['key_cache_ratio']:.3f} | "
                     f"{row['kv_cache_ratio']:.3f} | {row['perplexity']:.3f} | {row['perplexity_ratio']:.4f} | "
                     f"{row['top1_agreement']:.3f} | {gaps} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=rank_list, nargs="+", default=[rank_list(r) for r in DEFAULT_RANKS])
    parser.add_argument("--orders", nargs="+", default=list(LEVEL_ORDERS), choices=LEVEL_ORDERS)
    parser.add_argument("--windows", type=int, default=16, help="held-out windows (16 of 2,048 tokens exist)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per window")
    parser.add_argument("--mlr_max_length", type=int, default=2048, help="the context the blocks derive from")
    parser.add_argument("--calibration_windows", type=int, default=2,
                        help="calibration-split windows of --length tokens for level_order=contribution")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", default="benchmarks/results/real_weights.jsonl",
                        help="JSON lines, one per finished row (appended; rows of the same run are reused)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        folder = smollm2_folder()
    except RealWeightsUnavailable as error:
        print(f"real weights unavailable: {error}", file=sys.stderr)
        return 1
    source = json.loads((folder / SOURCE_RECORD).read_text())
    model, tokenizer = load_smollm2(torch.float32)
    for ranks in args.ranks:  # every setting checked before the first forward (ranks, pairs, blocks)
        try:
            hf_structattn.decoder_patching.plan_decoder_patch(model, mlr_ranks=ranks,
                                                              mlr_max_length=args.mlr_max_length)
        except ValueError as error:
            parser.error(f"--ranks {','.join(map(str, ranks))}: {error}")
    windows = token_windows(tokenizer, "heldout", args.length, args.windows)
    calibration = token_windows(tokenizer, "calibration", args.length, args.calibration_windows)
    key = run_key(args, windows, source)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    stored = read_rows(results, key)

    print(header_line(f"Python {platform.python_version()}, float32, SmolLM2-135M-Instruct ({source['package']}, "
                      f"GGUF sha256 {source['gguf_sha256'][:12]}, de-quantised), {args.windows} held-out windows of "
                      f"{args.length} tokens ({windows.numel():,} tokens), mlr_max_length={args.mlr_max_length}, "
                      f"contribution calibrated on {calibration.numel():,} calibration-split tokens"))
    started = time.perf_counter()
    stock = window_scores(model, windows)
    stock_ppl = math.exp(float(stock["losses"].mean()))
    print(f"stock perplexity {stock_ppl:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = []
    for ranks in args.ranks:
        for order in args.orders:
            name = ",".join(map(str, ranks))
            if (name, order) in stored:
                row = stored[(name, order)]
                print(f"reused: {name} {order}: ppl/stock {row['perplexity_ratio']:.4f}", flush=True)
                rows.append(row)
                continue
            began = time.perf_counter()
            extra = {"calibration_ids": calibration} if order == "contribution" else {}
            patched = hf_structattn.patch(model, mlr_ranks=ranks, mlr_max_length=args.mlr_max_length,
                                          level_order=order, **extra).eval()
            scores = window_scores(patched, windows)
            report = decoder_cache_report(patched.config, args.length)
            row = {"key": key, "ranks": name, "level_order": order, "mlr_block_sizes": patched.config.mlr_block_sizes,
                   "mlr_dim_order": patched.config.mlr_dim_order, "key_cache_ratio": report["key_cache_ratio"],
                   "kv_cache_ratio": report["kv_cache_ratio"],
                   "perplexity": math.exp(float(scores["losses"].mean())), "stock_perplexity": stock_ppl,
                   "perplexity_ratio": math.exp(float(scores["losses"].mean() - stock["losses"].mean())),
                   "top1_agreement": float((scores["argmax"] == stock["argmax"]).double().mean()),
                   "added_nats_by_position": bucket_gaps(scores["losses"], stock["losses"]),
                   "seconds": round(time.perf_counter() - began, 1)}
            with open(results, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            rows.append(row)
            print(table([row], stock_ppl).splitlines()[-1], f"({row['seconds']:.0f} s)", flush=True)
            del patched
    print()
    print(table(rows, stock_ppl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
