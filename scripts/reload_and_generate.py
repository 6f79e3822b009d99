"""Reload a checkpoint written by recipes/train_clm.py in a fresh interpreter that CANNOT import hf_structattn
(only the payload code saved next to the weights, via trust_remote_code), generate a code sample with the
hierarchical MLR key cache, and print the key-cache bytes next to a dense cache's for the same tokens.

    python scripts/reload_and_generate.py OUTPUT_DIR [--prompt "def "] [--max_new_tokens 200]
"""

import argparse
import importlib.abc
import json
import sys
import time
from pathlib import Path


class _BlockHFStructattn(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hf_structattn" or name.startswith("hf_structattn."):
            raise ImportError("hf_structattn is deliberately not importable here")


sys.meta_path.insert(0, _BlockHFStructattn())
if "" in sys.path:
    sys.path.remove("")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        import hf_structattn  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hf_structattn was importable: the reload test would prove nothing")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.path, trust_remote_code=True).eval()
    print(f"reloaded {type(model).__name__} from {type(model).__module__} (hf_structattn not importable)")
    config = model.config
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    sample = dict(max_new_tokens=args.max_new_tokens, do_sample=True, top_k=20, temperature=0.8,
                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    generated = model.generate(ids, return_dict_in_generate=True, **sample)  # the hierarchical key cache
    seconds = time.perf_counter() - started
    out, hierarchical = generated.sequences, generated.cache
    torch.manual_seed(args.seed)
    out_uncached = model.generate(ids, use_cache=False, **sample)
    same = torch.equal(out, out_uncached)
    cached_tokens = int(hierarchical.get_seq_length())
    head_dim = config.n_embd // config.n_head
    dense_bytes = out.shape[0] * config.n_layer * config.n_head * cached_tokens * head_dim * out.new_empty(
        0, dtype=model.dtype).element_size()  # every key at full head dim
    mlr_bytes = sum(layer.key_cache_bytes() if hasattr(layer, "key_cache_bytes") else
                    layer.keys.numel() * layer.keys.element_size() for layer in hierarchical.layers)
    print("-" * 30, "generated code sample (hierarchical key cache)", "-" * 30)
    print(tokenizer.decode(out[0]))
    print("-" * 100)
    metrics_file = Path(args.path) / "final_metrics.json"
    if metrics_file.exists():
        metrics = json.loads(metrics_file.read_text())
        print(f"validation bits per byte (from training): {metrics.get('eval_bits_per_byte', float('nan')):.4f}")
    print(f"attention: {config.attention}, ranks {config.mlr_ranks}, block sizes "
          f"{getattr(config, 'resolved_mlr_block_sizes', config.mlr_block_sizes)}, {config.n_layer} layers x "
          f"{config.n_head} heads, head dim {config.n_embd // config.n_head}")
    print(f"tokens in cache: {cached_tokens} ({seconds:.2f} s to generate)")
    print(f"key cache bytes: hierarchical MLR {mlr_bytes:,} vs full-width keys {dense_bytes:,} "
          f"-> {mlr_bytes / dense_bytes:.3f}x ({100 * (1 - mlr_bytes / dense_bytes):.1f}% saved)")
    print(f"same tokens without a cache: {same}")
    if not same:
        raise SystemExit("generation with the hierarchical cache and without a cache gave different tokens")


if __name__ == "__main__":
    main()
