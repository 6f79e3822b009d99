"""Patched transformers decoders: exactness per architecture, and prefill / decode speed and key-cache bytes of a
tiny Llama, MLR-patched vs stock SDPA.

Exactness (float64, tiny random models of ``hf_structattn.decoder_patching.TINY_DECODERS``, ranks 8|4|4, blocks
16, 8; Gemma-3 converts its global layer and keeps its sliding layers): max |logit difference| of merged levels
(``mlr_ranks=[head_dim]``) vs the stock model, of chunked prefill across block boundaries + token-by-token decode
vs the uncached forward, and of left-padded rows vs the rows alone; key-cache ratio from
``hf_structattn.flops.decoder_cache_report`` at 49 tokens.

Speed (float32, one thread, ``time.thread_time``, variants interleaved in one process, decode steps one by one):
prefill ms per prompt token and decode ms per generated token (``model(token, cache=...)``, the step generate runs)
with the ratio to stock taken within each step, and the bytes of keys the cache holds after the prompt (measured
from the cache object, and the formula).

    python benchmarks/bench_decoder_patching.py --output /tmp/decoder_patching.md
    python benchmarks/bench_decoder_patching.py --skip_exactness --compiled --prompts 512 2048 --steps 24

``--compiled`` adds compiled static-cache decode (``cache_implementation="static"``, the forward compiled with
``torch.compile``; the static cache prefilled by ``generate``), stock vs MLR interleaved step by step.
"""

import argparse
import statistics
import time

import torch
import transformers
from transformers import DynamicCache

import hf_structattn
from hf_structattn.decoder_patching import TINY_DECODERS, tiny_decoder
from hf_structattn.flops import decoder_cache_report
from hf_structattn.modeling.structattn_prepare import key_cache_bytes

from bench_generation import Clock, cpu_name, decode_cell, decode_variants  # benchmarks/ is on sys.path


@torch.no_grad()
def exactness_row(arch: str) -> dict:
    stock = tiny_decoder(arch)
    extra = {"layers": [2]} if arch == "gemma3" else {}
    merged = hf_structattn.patch(stock, mlr_ranks=[16], mlr_block_sizes=[], **extra)
    mlr = hf_structattn.patch(stock, mlr_ranks=[8, 4, 4], mlr_block_sizes=[16, 8], **extra)
    torch.manual_seed(1)
    ids = torch.randint(3, 61, (3, 49))
    merged_diff = (merged(ids).logits - stock(ids).logits).abs().max()
    uncached = mlr(ids).logits
    cache = DynamicCache(config=mlr.config)
    bounds = [(0, 13), (13, 30), (30, 31)] + [(i, i + 1) for i in range(31, 49)]
    chunked = torch.cat([mlr(ids[:, a:b], cache=cache, use_cache=True).logits for a, b in bounds], dim=1)
    pads = [0, 5, 11]
    batch = torch.zeros(3, 49, dtype=torch.long)
    mask = torch.zeros(3, 49, dtype=torch.long)
    for row, pad in enumerate(pads):
        batch[row, pad:], mask[row, pad:] = ids[row, :49 - pad], 1
    padded = mlr(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    padding_diff = max(float((padded[row, pad:] - mlr(ids[row:row + 1, :49 - pad]).logits[0]).abs().max())
                       for row, pad in enumerate(pads))
    report = decoder_cache_report(mlr.config, 49, dtype_bytes=2)
    return {"arch": type(stock).__name__, "merged": float(merged_diff),
            "decode": float((chunked - uncached).abs().max()), "padding": padding_diff,
            "drift": float((uncached - stock(ids).logits).abs().max()), "key_ratio": report["key_cache_ratio"],
            "kv_ratio": report["kv_cache_ratio"]}


def key_bytes(cache) -> int:
    """Key bytes the cache holds: MLR layers count level 1 and their rings (``structattn_prepare.key_cache_bytes``)."""
    return key_cache_bytes(cache)


def new_cache(model):
    """What generate() would build for this model (before the first forward)."""
    new = getattr(model, "new_cache", None)
    return new() if new is not None else DynamicCache(config=model.config)


@torch.no_grad()
def speed(models: dict, prompt: int, steps: int, repeats: int) -> dict:
    """Per model: (prefill ms per prompt token, decode ms per step, key bytes held after the prompt, decode time / the
    first model's within each step, median). Each repeat prefills a fresh cache per model, then runs ``steps`` decode
    steps with the models interleaved step by step (the order flips every step): a busy moment of the shared machine
    slows both alike, and the ratio is taken within each step."""
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, prompt))
    token = torch.randint(0, 1000, (1, 1))
    names = list(models)
    prefill = {name: [] for name in models}
    decode = {name: [] for name in models}
    held = {}
    for _ in range(repeats):
        caches = {}
        for name, model in models.items():
            cache = caches[name] = new_cache(model)
            start = time.thread_time()
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            prefill[name].append((time.thread_time() - start) / prompt)
            held[name] = key_bytes(cache)
        for step in range(steps):
            for name in (names if step % 2 == 0 else names[::-1]):
                start = time.thread_time()
                models[name](token, cache=caches[name], use_cache=True)
                decode[name].append(time.thread_time() - start)
    baseline = decode[names[0]]
    return {name: (1e3 * statistics.median(prefill[name]), 1e3 * statistics.median(decode[name]), held[name],
                   statistics.median([mine / base for mine, base in zip(decode[name], baseline)]))
            for name in models}


def compiled_decode(models: dict, prompt: int, steps: int, warmup: int = 3, backend="inductor") -> dict:
    """Median ms per decode step of each model with ``cache_implementation="static"`` and
    ``torch.compile(model.forward, backend=backend)`` (transformers' fast decoding path), batch 1, interleaved step by
    step (thread clock): ``bench_generation.decode_cell``'s compiled mode, whose static caches ``generate`` prefills."""
    variants = decode_variants(list(models), ["compiled"])
    times = decode_cell(models, variants, 1, prompt, steps, warmup, Clock("thread"), {}, compile_backend=backend)
    return {name: 1e3 * statistics.median(times[label][0]) for label, name, _ in variants}

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--mlr_ranks", type=int, nargs="+", default=[16, 8, 8])
    parser.add_argument("--mlr_block_sizes", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--skip_exactness", action="store_true")
    parser.add_argument("--compiled", action="store_true",
                        help="also time compiled static-cache decode steps (torch.compile, inductor; minutes)")
    parser.add_argument("--output", default=None, help="also write the markdown to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = ["# Patched decoders: exactness and speed\n",
             f"Machine: {cpu_name()}, {torch.get_num_threads()} thread, torch {torch.__version__}, transformers "
             f"{transformers.__version__}. Script: `benchmarks/bench_decoder_patching.py`.\n"]
    if not args.skip_exactness:
        lines += ["## Exactness (float64, max |logit difference|)\n",
                  "| model | merged levels vs stock | chunked prefill + decode vs uncached | left padding vs rows "
                  "alone | drift of 8\\|4\\|4 vs stock | key cache / dense (49 tokens) | KV cache / dense |",
                  "|---|---|---|---|---|---|---|"]
        for arch in TINY_DECODERS:
            row = exactness_row(arch)
            lines.append(f"| {row['arch']} | {row['merged']:.1e} | {row['decode']:.1e} | {row['padding']:.1e} | "
                         f"{row['drift']:.3f} | {row['key_ratio']:.3f} | {row['kv_ratio']:.3f} |")
            print(lines[-1], flush=True)
        lines.append("")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=args.hidden_size, intermediate_size=
                                      2 * args.hidden_size, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=8192)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).eval()
    mlr = hf_structattn.patch(stock, mlr_ranks=args.mlr_ranks, mlr_block_sizes=args.mlr_block_sizes)
    head_dim = args.hidden_size // args.heads
    lines += [f"## Speed: Llama, {args.layers} layers, hidden {args.hidden_size}, {args.heads} heads x {head_dim} "
              f"({args.kv_heads} KV heads), float32, batch 1; MLR ranks {args.mlr_ranks}, blocks "
              f"{args.mlr_block_sizes}\n",
              "| prompt | model | prefill ms/token | decode ms/token | decode / stock (per step, median) | key cache "
              "bytes held | key cache formula |",
              "|---|---|---|---|---|---|---|"]
    for prompt in args.prompts:
        results = speed({"stock sdpa": stock, "MLR": mlr}, prompt, args.steps, args.repeats)
        formula = decoder_cache_report(mlr.config, prompt, dtype_bytes=4)
        for name, (prefill_ms, decode_ms, held, ratio) in results.items():
            expected = formula["dense_key_cache_bytes"] if name == "stock sdpa" else formula["key_cache_bytes"]
            lines.append(f"| {prompt} | {name} | {prefill_ms:.3f} | {decode_ms:.2f} | {ratio:.2f}x | {held} | "
                         f"{expected} |")
            print(lines[-1], flush=True)
    if args.compiled:
        lines += ["", "## Compiled decode: `cache_implementation=\"static\"` + `torch.compile(model.forward)`, "
                  "batch 1\n",
                  "| prompt | stock sdpa ms/token | MLR ms/token | MLR / stock |", "|---|---|---|---|"]
        for prompt in args.prompts:
            times = compiled_decode({"stock sdpa": stock, "MLR": mlr}, prompt, args.steps)
            lines.append(f"| {prompt} | {times['stock sdpa']:.2f} | {times['MLR']:.2f} | "
                         f"{times['MLR'] / times['stock sdpa']:.2f}x |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
