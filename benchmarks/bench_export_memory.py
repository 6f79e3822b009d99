"""Cache memory of an exported on-device decoder: the static cache ``hf_structattn.mlr_exportable_decoder`` registers
in the program (transformers' ExecuTorch recipe) for an MLR-patched Llama of on-device size, against the stock
model's static cache in the same recipe.

Model: the shape of Llama-3.2-1B (16 layers, hidden 2048, 32 query heads, 8 KV heads of 64 dims), no weights (only
its config is built: the bytes follow from the shapes). MLR patch: ``mlr_ranks`` 32|8|8|8|4|4 on every layer with
dyadic blocks of ``mlr_max_length`` 2048 (1024 .. 64), what ``hf_structattn.patch(model, mlr_ranks=...,
mlr_max_length=2048)`` gives. A static cache of ``max_cache_len`` S holds, per layer and KV head, the values of S
slots and the keys of the formula ``S r_1 + sum_l min(b_l, S) r_l`` (``hf_structattn.flops.decoder_cache_report``
at T = S; ``tests/test_export.py`` checks that an exported program's cache buffers are exactly these bytes) plus two
int64 positions per row; the stock recipe's cache holds S full keys and values.

    python benchmarks/bench_export_memory.py [--lengths 1024 2048 4096 8192] [--dtype-bytes 2]
"""

import argparse

import transformers

from hf_structattn.decoder_patching import mlr_config_class
from hf_structattn.flops import decoder_cache_report
from hf_structattn.modeling.structattn_config_rules import default_block_sizes

RANKS = [32, 8, 8, 8, 4, 4]
SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072)


def mib(value: int) -> str:
    return f"{value / 2 ** 20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per cached element (2: bf16 / fp16)")
    args = parser.parse_args()
    config = mlr_config_class(transformers.LlamaConfig)(**SHAPE, mlr_ranks=RANKS,
                                                          mlr_block_sizes=default_block_sizes(2048, len(RANKS)))
    positions = config.num_hidden_layers * 2 * 8  # first / newest position per row and layer (int64)
    print(f"Llama-3.2-1B shape (16 layers, 8 KV heads of 64), MLR ranks {'|'.join(map(str, RANKS))}, blocks "
          f"{'/'.join(map(str, config.mlr_block_sizes))}, {args.dtype_bytes} bytes per element, batch 1\n")
    print("| max_cache_len | stock static K+V MiB | MLR static K+V MiB | MLR / stock | stock keys MiB | MLR keys MiB "
          "| MLR keys / stock keys |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        report = decoder_cache_report(config, length, dtype_bytes=args.dtype_bytes)
        mlr = report["kv_cache_bytes"] + positions
        stock = report["dense_kv_cache_bytes"]
        print(f"| {length} | {mib(stock)} | {mib(mlr)} | {mlr / stock:.2f}x | {mib(report['dense_key_cache_bytes'])} | "
              f"{mib(report['key_cache_bytes'])} | {report['key_cache_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
