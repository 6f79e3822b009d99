"""Key/value cache memory: what the cache returned by ``generate`` allocates, against the formula.

Models (float32, batch 1, random weights, greedy):
* ``MLR GPT-2``: ``StructAttnGPT2LMHeadModel``, 2 layers, n_embd 256, 4 heads of 64, n_positions 2048, MLR ranks
  32|8|6|4|4|4|4|2 (dyadic blocks 1024 .. 16); ``dense GPT-2 (ours)`` is the same model with dense attention and the
  project's cache; ``stock GPT-2`` is ``transformers.GPT2LMHeadModel`` of the same size;
* ``patched Llama``: ``transformers.LlamaForCausalLM`` (2 layers, hidden 256, 4 heads of 64, 2 KV heads) patched
  with ``hf_structattn.patch(..., mlr_ranks=[32, 16, 8, 8], mlr_max_length=1024)`` (blocks 512, 256, 128);
  ``stock Llama`` is the unpatched model.

For each prompt length: ``model.generate(ids, max_new_tokens=N, return_dict_in_generate=True)`` (the model's own
default cache, or ``cache_implementation="static"`` with ``--cache static``), then
* allocated: ``hf_structattn.cache_memory.allocated_cache_bytes(out.cache)``, the unique storage bytes of every tensor
  the returned cache holds (reserved slots, positions, flags and scratch included);
* formula: keys + values in use for the tokens the cache holds (``cache.get_seq_length()``, i.e. prompt + N - 1):
  ``attention_cost_report(config, context_len=T).kv_cache_bytes`` for the GPT-2 family and
  ``decoder_cache_report(config, T)["kv_cache_bytes"]`` for the patched Llama, 4 bytes per element.
Ratios divide by the stock model's allocated bytes (stock transformers allocates exactly what it holds).

    python benchmarks/bench_cache_memory.py [--prompts 64 512 2000] [--new_tokens 8] [--cache dynamic static]
"""

import argparse
import os
import sys

import torch
import transformers

import hf_structattn
from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
from hf_structattn.cache_memory import allocated_cache_bytes, returned_cache
from hf_structattn.flops import attention_cost_report, decoder_cache_report

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import header_line  # noqa: E402

GPT2_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]
LLAMA_RANKS = [32, 16, 8, 8]


def gpt2_models(n_layer=2, n_embd=256, n_head=4, n_positions=2048) -> dict:
    shape = dict(vocab_size=257, n_positions=n_positions, n_embd=n_embd, n_head=n_head, n_layer=n_layer,
                 bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return {"MLR GPT-2": StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**shape, attention="mlr",
                                                                       mlr_ranks=GPT2_RANKS)).eval(),
            "dense GPT-2 (ours)": StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**shape, attention="dense")).eval(),
            "stock GPT-2": transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).eval()}


def llama_models(layers=2, hidden=256, heads=4, kv_heads=2, mlr_max_length=1024) -> dict:
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=4096,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).eval()
    patched = hf_structattn.patch(stock, mlr_ranks=LLAMA_RANKS, mlr_max_length=mlr_max_length).eval()
    return {"patched Llama": patched, "stock Llama": stock}



@torch.no_grad()
def measure(model, prompt: int, new_tokens: int, cache_implementation: str, vocab: int) -> tuple[int, int]:
    """(allocated bytes of the returned cache, tokens it holds) after a greedy generation."""
    torch.manual_seed(prompt)
    ids = torch.randint(3, vocab, (1, prompt))
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  return_dict_in_generate=True, disable_compile=True)
    if cache_implementation == "static":
        kwargs["cache_implementation"] = "static"
    cache = returned_cache(model.generate(ids, **kwargs))
    return allocated_cache_bytes(cache), int(cache.get_seq_length())


def formula_bytes(model, tokens: int) -> int:
    config = model.config
    if isinstance(config, StructAttnGPT2Config):
        return attention_cost_report(config, dtype_bytes=4, context_len=tokens).kv_cache_bytes
    return decoder_cache_report(config, tokens, dtype_bytes=4)["kv_cache_bytes"]


def family_rows(models: dict, mlr: str, stock: str, prompts, new_tokens: int, cache: str, vocab: int,
                others=()) -> list:
    """Markdown rows: allocated and formula bytes of the MLR model against the stock one, per prompt."""
    rows = []
    for prompt in prompts:
        allocated, tokens = {}, {}
        try:
            for name in (mlr, stock, *others):
                allocated[name], tokens[name] = measure(models[name], prompt, new_tokens, cache, vocab)
        except ValueError as error:  # e.g. a cache_implementation the model refuses: say so, measure the rest
            rows.append(f"| {mlr} | {cache} | {prompt} | not measured: {str(error).splitlines()[0]} |" + " |" * 7)
            print(rows[-1], flush=True)
            continue
        formula = formula_bytes(models[mlr], tokens[mlr])
        base = allocated[stock]
        extra = "".join(f" {allocated[name]:,} ({allocated[name] / base:.2f}x) |" for name in others)
        rows.append(f"| {mlr} | {cache} | {prompt} | {tokens[mlr]} | {allocated[mlr]:,} | {formula:,} | {base:,} |"
                    f"{extra if others else ' – |'} **{allocated[mlr] / base:.2f}x** | {formula / base:.2f}x | "
                    f"{allocated[mlr] / formula:.2f}x |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 512, 2000])
    parser.add_argument("--new_tokens", type=int, default=8)
    parser.add_argument("--cache", nargs="+", choices=["dynamic", "static"], default=["dynamic"],
                        help="generate's default cache, and/or cache_implementation='static'")
    parser.add_argument("--output", default=None, help="also write the markdown to this file")
    args = parser.parse_args(argv)
    if min(args.prompts) < 1 or args.new_tokens < 1:
        parser.error(f"--prompts and --new_tokens must be >= 1, got {args.prompts} and {args.new_tokens}")
    torch.set_num_threads(1)
    lines = [header_line("float32, batch 1, greedy, "
                         f"{args.new_tokens} new tokens; bytes = unique storages of the returned cache's tensors"),
             "", "| model | cache | prompt | tokens held | MLR allocated B | formula B (K+V in use) | stock allocated B "
             "| ours dense allocated (/ stock) | MLR allocated / stock | formula / stock | MLR allocated / formula |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    gpt2, llama = gpt2_models(), llama_models()
    for cache in args.cache:
        lines += family_rows(gpt2, "MLR GPT-2", "stock GPT-2", args.prompts, args.new_tokens, cache, 256,
                             others=("dense GPT-2 (ours)",))
        lines += family_rows(llama, "patched Llama", "stock Llama", args.prompts, args.new_tokens, cache, 1000)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
