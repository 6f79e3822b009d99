"""How much Python one eager decode step runs: GPT-2 MLR, a patched Llama and stock Llama (DynamicCache, SDPA) in the
same run, and optionally the GPT-2 MLR model of another commit's payload.

One decode step (batch 1, the second after a 39-token prompt) of each model runs under ``sys.setprofile`` three
times, each time counting the events inside one call, torch's module plumbing included (from that module's
``Module._wrapped_call_impl`` to its return):

* the first attention module (layer 0: the first MLR layer of every model here) and a later one (layer 1), which
  tell what a forward's first MLR layer costs beyond a steady one;
* the whole forward (the model's own call): everything the model runs before, between and after its layers.

What is counted:

* calls: Python function calls (``call`` events; C functions are not counted);
* package calls: those into the payload's files (``hf_structattn/modeling``, or the old payload's folder);
* package runs: maximal sequences of consecutive package calls into one file (calls outside the package do not
  break a run);
* re-entries: package runs into a file that an earlier run went into (the number of times the step comes back to a
  payload file it already left).

    python benchmarks/bench_trace_calls.py [--layers 8] [--against COMMIT]

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

PAYLOAD = os.path.dirname(os.path.abspath(new_attention.__file__))
STOCK = "stock Llama (DynamicCache, SDPA)"


def _tiny_llama(layers: int):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def models(against=None, folder=None, layers: int = 8) -> dict:
    """{name: (model, [attention module of layer 0, of layer 1], cache module, payload folder)}."""
    from bench_decode_ab import model_shape, old_mlr_model, payload_at
    from bench_generation import gpt2_models

    gpt2 = gpt2_models(**model_shape("main-job"))["MLR"]
    attention = [block.attn for block in gpt2.transformer.h[:2]]
    result = {"GPT-2 MLR (main job's model)": (gpt2, attention, new_cache, PAYLOAD)}
    if against is not None:
        package, module = payload_at(against, folder)
        old, old_cache = old_mlr_model(package, gpt2)
        # importing the old payload registered its functions under the shared names: the new ones again
        ALL_ATTENTION_FUNCTIONS.register(new_attention.MLR_ATTENTION, new_attention.mlr_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(new_attention.MLR_ATTENTION, new_attention._mlr_mask)
        result[f"GPT-2 MLR at {against}"] = (old, [block.attn for block in old.transformer.h[:2]], old_cache,
                                             os.path.dirname(os.path.abspath(module.__file__)))
    patched = hf_structattn.patch(_tiny_llama(layers), mlr_ranks=[8, 4, 2, 2], mlr_block_sizes=[128, 64, 32])
    result[f"patched Llama, {layers} layers (MLR 8|4|2|2)"] = (
        patched, [layer.self_attn for layer in patched.model.layers[:2]], new_cache, PAYLOAD)
    stock = _tiny_llama(layers)
    result[STOCK] = (stock, [layer.self_attn for layer in stock.model.layers[:2]], new_cache, PAYLOAD)
    return result


def _trace(run, target) -> list:
    """The file of every Python call made inside the call of module ``target`` while ``run()`` runs."""
    files = []
    state = {"frame": None}
    wrapped = torch.nn.Module._wrapped_call_impl.__code__

    def profile(frame, event, arg):
        if state["frame"] is False:  # the module's call returned: nothing more is recorded
            return
        if event == "call":
            if state["frame"] is None:
                if frame.f_code is wrapped and frame.f_locals.get("self") is target:
                    state["frame"] = frame
                else:
                    return
            files.append(frame.f_code.co_filename)
        elif event == "return" and frame is state["frame"]:
            state["frame"] = False

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return files


def counts(files: list, payload: str) -> dict:
    """calls, package calls, package runs and re-entries of a traced call (see the module docstring)."""
    package = [file for file in files if file.startswith(payload + os.sep)]
    runs = [file for index, file in enumerate(package) if index == 0 or package[index - 1] != file]
    reentries = sum(1 for index, file in enumerate(runs) if file in runs[:index])
    return {"calls": len(files), "package calls": len(package), "package runs": len(runs), "re-entries": reentries,
            "package files": len(set(package))}


def trace_step(model, modules, cache_module, payload: str) -> dict:
    """Counts of one decode step of ``model``: {"first layer", "later layer", "forward"} (see the module docstring);
    its cache layers are those of ``cache_module`` (the payload the model comes from)."""
    from bench_decode_ab import use_cache_layers

    use_cache_layers(cache_module)
    ids = torch.randint(2, 60, (1, 44), generator=torch.Generator().manual_seed(0))
    result = {}
    with torch.no_grad():
        cache = model(ids[:, :39], use_cache=True).cache
        model(ids[:, 39:40], cache=cache, use_cache=True)  # the first step of a cache (first-use memos): untraced
        for index, (name, target) in enumerate((("first layer", modules[0]), ("later layer", modules[1]),
                                                ("forward", model))):
            token = ids[:, 40 + index:41 + index]
            files = _trace(lambda: model(token, cache=cache, use_cache=True), target)
            result[name] = counts(files, payload)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="also trace the GPT-2 MLR model of this commit's payload")
    parser.add_argument("--layers", type=int, default=8, help="layers of the two Llama models (default 8)")
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error(f"--layers must be at least 2 (a first and a later layer), got {args.layers}")
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, (model, modules, cache_module, payload) in models(args.against, folder, args.layers).items():
            results[name] = trace_step(model, modules, cache_module, payload)
    stock = results[STOCK]["forward"]["calls"]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; one eager decode step, batch 1, "
          f"positions 40-42; the attention modules of layer 0 (first) and layer 1 (later), module plumbing "
          f"included, and the whole forward")
    print()
    print("| model | first layer: calls / package calls / runs / re-entries | later layer: calls / package calls / "
          "runs / re-entries | first - later package calls | forward: calls | forward / stock Llama |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, result in results.items():
        first, later, forward = result["first layer"], result["later layer"], result["forward"]

        def cell(entry):
            return f"{entry['calls']} / {entry['package calls']} / {entry['package runs']} / {entry['re-entries']}"

        label = name.replace("|", "\\|")  # (a bare bar would split the markdown cell)
        print(f"| {label} | {cell(first)} | {cell(later)} | {first['package calls'] - later['package calls']} | "
              f"{forward['calls']} | {forward['calls'] / stock:.2f} |")
    return results


if __name__ == "__main__":
    main()
