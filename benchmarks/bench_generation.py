"""Decode speed and cache size: dense vs MLR GPT-2-style models of the same size.

For each context length and batch size: prefill the context, then time single-token decode steps
(``model(next_token, cache=...)``, the step generate() runs) and read the bytes the cache holds. "dense" uses
``StructAttnCache`` (reserved-storage appends, like the MLR layers); "dense + stock DynamicCache" is the same model
with transformers' ``DynamicCache``, which re-concatenates the whole cache every step.

    python benchmarks/bench_generation.py --contexts 512 1024 2048 4096 --batches 1 16 --output docs/bench_generation.md
"""

import argparse
import platform
import statistics
import time

import torch
import transformers

from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
from hf_structattn.flops import kv_cache_bytes


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build(attention: str, args) -> StructAttnGPT2LMHeadModel:
    fields = dict(vocab_size=257, n_positions=args.n_positions, n_embd=args.n_embd, n_head=args.n_head,
                  n_layer=args.n_layer, attention=attention, resid_pdrop=0.0, embd_pdrop=0.0)
    if attention == "mlr":
        fields["mlr_ranks"] = args.mlr_ranks
    torch.manual_seed(0)
    return StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**fields)).eval()


def cache_bytes(cache):
    if not hasattr(cache, "key_cache_bytes"):
        return 0, 0
    keys = cache.key_cache_bytes()
    values = sum(layer.values.numel() * layer.values.element_size() for layer in cache.layers if layer.is_initialized)
    return keys, values


@torch.no_grad()
def measure(model, batch: int, context: int, steps: int, stock_cache: bool = False):
    ids = torch.randint(0, 256, (batch, context))
    cache = transformers.DynamicCache() if stock_cache else model.transformer.new_cache()
    model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    token = torch.randint(0, 256, (batch, 1))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(token, cache=cache, use_cache=True)
        times.append(time.perf_counter() - start)
    keys, values = cache_bytes(cache)
    return statistics.median(times), min(times), keys, values


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--n_embd", type=int, default=512)
    parser.add_argument("--n_head", type=int, default=8)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_positions", type=int, default=8192)
    parser.add_argument("--mlr_ranks", type=int, nargs="+", default=[32, 8, 6, 4, 4, 4, 4, 2])
    parser.add_argument("--output", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    models = {name: build(name, args) for name in ("dense", "mlr")}
    config = models["mlr"].config
    header = (f"# Decode benchmark\n\nMachine: {cpu_name()}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, float32. Model: {args.n_layer} layers, n_embd {args.n_embd}, {args.n_head} heads "
              f"(head dim {args.n_embd // args.n_head}), n_positions {config.n_positions}; MLR ranks "
              f"{'|'.join(map(str, args.mlr_ranks))}, blocks {config.resolved_mlr_block_sizes}. Step time = median "
              f"[min] of {args.steps} single-token steps after prefilling the context.\n")
    rows = ["| batch | context | dense step ms | MLR step ms | MLR/dense time | dense + stock DynamicCache ms | "
            "dense tok/s | MLR tok/s | key bytes MLR/dense | KV bytes MLR/dense | KV formula |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    print(header)
    print("\n".join(rows))
    for batch in args.batches:
        for context in args.contexts:
            result = {name: measure(model, batch, context, args.steps) for name, model in models.items()}
            stock_med, stock_min, _, _ = measure(models["dense"], batch, context, args.steps, stock_cache=True)
            (d_med, d_min, d_keys, d_vals), (m_med, m_min, m_keys, m_vals) = result["dense"], result["mlr"]
            held = context + 1
            formula = kv_cache_bytes("mlr", held, args.mlr_ranks, config.resolved_mlr_block_sizes,
                                     config.head_dim, dtype_bytes=4) / kv_cache_bytes(
                "dense", held, head_dim=config.head_dim, dtype_bytes=4)
            row = (f"| {batch} | {context} | {d_med * 1e3:.1f} [{d_min * 1e3:.1f}] | {m_med * 1e3:.1f} "
                   f"[{m_min * 1e3:.1f}] | {m_med / d_med:.2f} | {stock_med * 1e3:.1f} [{stock_min * 1e3:.1f}] | "
                   f"{batch / d_med:.0f} | {batch / m_med:.0f} | "
                   f"{m_keys / d_keys:.3f} | {(m_keys + m_vals) / (d_keys + d_vals):.3f} | {formula:.3f} |")
            rows.append(row)
            print(row, flush=True)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(header + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
