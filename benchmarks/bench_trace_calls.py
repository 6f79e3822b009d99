"""How much Python one eager decode step of one attention module runs: GPT-2 MLR, a patched Llama and stock Llama
(DynamicCache, SDPA) in the same run, and optionally the GPT-2 MLR model of another commit's payload.

One decode step (batch 1, the second after a 39-token prompt) of each model runs under ``sys.setprofile``; the
events inside the call of one attention module (layer 1), torch's module plumbing included (from that module's
``Module._wrapped_call_impl`` to its return), are counted:

* calls: Python function calls (``call`` events; C functions are not counted);
* files: the distinct files those functions live in;
* file changes: consecutive calls whose functions live in different files;
* re-entries: calls into a file that an earlier call went into, after calls into other files in between (the
  number of times the step comes back to a file it already left).

    python benchmarks/bench_trace_calls.py [--against COMMIT]

Prints a markdown table (the one in docs/benchmarks.md). Counts are deterministic for one version of the code,
torch and transformers; they do not depend on the machine.
"""

import argparse
import os
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import hf_structattn  # noqa: E402
import hf_structattn.modeling.structattn_attention as new_attention  # noqa: E402
import hf_structattn.modeling.structattn_cache as new_cache  # noqa: E402


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def models(against=None, folder=None) -> dict:
    """{name: (model, its attention module of layer 1)}."""
    from bench_decode_ab import model_shape
    from bench_generation import gpt2_models

    gpt2 = gpt2_models(**model_shape("main-job"))["MLR"]
    result = {"GPT-2 MLR (main job's model)": (gpt2, gpt2.transformer.h[1].attn, new_cache)}
    if against is not None:
        from bench_decode_ab import old_mlr_model, payload_at

        package, _ = payload_at(against, folder)
        old, old_cache = old_mlr_model(package, gpt2)
        # importing the old payload registered its functions under the shared names: the new ones again
        ALL_ATTENTION_FUNCTIONS.register(new_attention.MLR_ATTENTION, new_attention.mlr_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(new_attention.MLR_ATTENTION, new_attention._mlr_mask)
        result[f"GPT-2 MLR at {against}"] = (old, old.transformer.h[1].attn, old_cache)
    patched = hf_structattn.patch(_tiny_llama(), mlr_ranks=[8, 4, 2, 2], mlr_block_sizes=[128, 64, 32])
    result["patched Llama (MLR 8|4|2|2)"] = (patched, patched.model.layers[1].self_attn, new_cache)
    stock = _tiny_llama()
    result["stock Llama (DynamicCache, SDPA)"] = (stock, stock.model.layers[1].self_attn, new_cache)
    return result


def trace_step(model, module, cache_module) -> dict:
    """Counts of one decode step of ``model`` inside the call of ``module`` (see the module docstring); its cache
    layers are those of ``cache_module`` (the payload the model comes from)."""
    from bench_decode_ab import use_cache_layers

    use_cache_layers(cache_module)
    ids = torch.randint(2, 60, (1, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids[:, :39], use_cache=True).cache
        model(ids[:, 39:40], cache=cache, use_cache=True)  # the first step of a cache (first-use memos): untraced
        files = []
        state = {"frame": None}
        wrapped = torch.nn.Module._wrapped_call_impl.__code__

        def profile(frame, event, arg):
            if state["frame"] is False:  # the module's call returned: nothing more is recorded
                return
            if event == "call":
                if state["frame"] is None:
                    if frame.f_code is wrapped and frame.f_locals.get("self") is module:
                        state["frame"] = frame
                    else:
                        return
                files.append(frame.f_code.co_filename)
            elif event == "return" and frame is state["frame"]:
                state["frame"] = False

        sys.setprofile(profile)
        try:
            model(ids[:, 40:41], cache=cache, use_cache=True)
        finally:
            sys.setprofile(None)
    changes = sum(1 for before, after in zip(files, files[1:]) if before != after)
    segments = [file for index, file in enumerate(files) if index == 0 or files[index - 1] != file]
    reentries = sum(1 for index, file in enumerate(segments) if file in segments[:index])
    return {"calls": len(files), "files": len(set(files)), "file changes": changes, "re-entries": reentries}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="also trace the GPT-2 MLR model of this commit's payload")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, (model, module, cache_module) in models(args.against, folder).items():
            results[name] = trace_step(model, module, cache_module)
    stock = results["stock Llama (DynamicCache, SDPA)"]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; one eager decode step, batch 1, "
          f"position 40, layer 1's attention module, module plumbing included")
    print()
    print("| model | Python calls | files | file changes | re-entries | calls / stock Llama |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, counts in results.items():
        print(f"| {name} | {counts['calls']} | {counts['files']} | {counts['file changes']} | {counts['re-entries']} "
              f"| {counts['calls'] / stock['calls']:.2f} |")
    return results


if __name__ == "__main__":
    main()
