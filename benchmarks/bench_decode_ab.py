"""Decode speed of two versions of the checkpoint payload in one process: MLR at ``--against COMMIT`` vs MLR at the
working tree vs dense, interleaved step by step (one thread, thread clock).

Between processes the same decode step moves by 5-10 % on a shared VM (memory placement, neighbours), which hides a
change of a few percent; inside one process the three variants share those conditions. The payload
(``hf_structattn/modeling``, flat with relative imports) of ``COMMIT`` is extracted with ``git archive`` into a
temporary folder and imported as its own package; its MLR attention function is registered under its own name, so
both versions run side by side (eagerly, or each compiled, with ``--mode compiled``). Both MLR models carry the same
weights (the GPT-2 family model of ``bench_generation``: 6 layers, n_embd 512, 8 heads, ranks 32|8|6|4|4|4|4|2).

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_ab.py --against 0b59f53 --batch 1 --prompt 512 --steps 150
    OMP_NUM_THREADS=1 python benchmarks/bench_decode_ab.py --against 0b59f53 --mode compiled --prompt 3584 --steps 12

Prints one line: the median ms/token of each variant and the medians of the per-step ratios (new / old, new /
dense, old / dense; a ratio taken within each step pairs steps that ran under the same conditions), and the largest
difference between the two MLR versions' logits at the first step (the same weights and input: 0 up to rounding
unless the math changed).
"""

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
import transformers.cache_utils as cache_utils
import yaml
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import GPT2_SHAPE, gpt2_models, prefilled_cache  # noqa: E402

import hf_structattn.modeling.structattn_attention as new_attention  # noqa: E402
import hf_structattn.modeling.structattn_cache as new_cache  # noqa: E402

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def payload_at(commit: str, folder: str):
    """Import ``hf_structattn/modeling`` as of ``commit`` as the package ``payload_at_<commit>`` (from ``folder``)."""
    name = "payload_at_" + "".join(c if c.isalnum() else "_" for c in commit)
    archive = os.path.join(folder, "payload.tar")
    with open(archive, "wb") as handle:
        subprocess.run(["git", "archive", commit, "hf_structattn/modeling"], cwd=REPOSITORY, stdout=handle,
                       check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    os.rename(os.path.join(folder, "hf_structattn", "modeling"), os.path.join(folder, name))
    sys.path.insert(0, folder)
    return name, importlib.import_module(name)


def old_mlr_model(package: str, new_model):
    """The MLR model of the table built from the old payload, with the new model's weights; its MLR layers call the
    old attention function under a name of their own."""
    attention = importlib.import_module(f"{package}.structattn_attention")
    modeling = importlib.import_module(f"{package}.modeling_structattn_gpt2")
    configuration = importlib.import_module(f"{package}.configuration_structattn_gpt2")
    # read by the old payload's mlr_implementation at call time (in structattn_install since it has one)
    try:
        importlib.import_module(f"{package}.structattn_install").MLR_ATTENTION = package
    except ImportError:
        attention.MLR_ATTENTION = package
    ALL_ATTENTION_FUNCTIONS.register(package, attention.mlr_attention_forward)
    fields = {name: getattr(new_model.config, name) for name in MODEL_FIELDS if hasattr(new_model.config, name)}
    config = configuration.StructAttnGPT2Config(**fields)
    model = modeling.StructAttnGPT2LMHeadModel(config).eval()
    model.load_state_dict(new_model.state_dict())
    return model, importlib.import_module(f"{package}.structattn_cache")


MODEL_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "bos_token_id", "eos_token_id", "pad_token_id", "attention", "mlr_ranks", "mlr_block_sizes",
                "mlr_average_levels", "mlr_scaling", "qk_layernorm")


def model_shape(name: str) -> dict:
    """The models' fields: ``gpt2-6x512`` (bench_generation's table) or ``main-job`` (the README main job's model,
    configs/clm_mlr_stdlib.yaml)."""
    if name == "gpt2-6x512":
        return {}
    with open(os.path.join(REPOSITORY, "configs", "clm_mlr_stdlib.yaml")) as handle:
        fields = yaml.safe_load(handle)["model"]
    fields.pop("attention")
    return fields


def use_cache_layers(module) -> None:
    """Make transformers build ``module``'s MLR cache layers for the "mlr_attention" layer type (both payloads
    register that name; the cache is built at prefill, so this matters only then)."""
    for layer in (module.MLRKeyCacheLayer, module.MLRStaticKeyCacheLayer):
        mapping = cache_utils.STATIC_LAYER_TYPE_MAPPING if layer is module.MLRStaticKeyCacheLayer else \
            cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
        mapping[layer._layer_type] = layer


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the commit whose payload is the old variant")
    parser.add_argument("--mode", choices=["eager", "compiled"], default="eager",
                        help="eager: dynamic caches as generate builds them; compiled: static caches, each model's "
                             "forward compiled with torch.compile (inductor)")
    parser.add_argument("--model", choices=["gpt2-6x512", "main-job"], default="gpt2-6x512",
                        help="gpt2-6x512: 6 layers, n_embd 512, ranks 32|8|6|4|4|4|4|2; main-job: the README main "
                             "job's model (configs/clm_mlr_stdlib.yaml)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the result (medians, ratios, checks) to this JSON file")
    args = parser.parse_args(argv)
    for name in ("batch", "prompt", "steps", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    limit = model_shape(args.model).get("n_positions", GPT2_SHAPE["n_positions"])
    if args.prompt + args.warmup + args.steps + 1 > limit:
        parser.error(f"--prompt {args.prompt} + warmup + steps exceeds n_positions={limit}")
    return args


def registries() -> list:
    """The transformers registries importing a payload writes to (attention and mask functions by name, cache layer
    classes by layer type)."""
    return [ALL_ATTENTION_FUNCTIONS._global_mapping, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping,
            cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, cache_utils.STATIC_LAYER_TYPE_MAPPING]


@torch.no_grad()
def main(argv=None) -> dict:
    """Run the comparison; the registries and ``sys.path`` / ``sys.modules`` are restored afterwards, so that a
    process that goes on (a test) sees only this payload's functions again."""
    saved = [dict(mapping) for mapping in registries()]
    path, modules = list(sys.path), set(sys.modules)
    try:
        return _compare(parse_args(argv))
    finally:
        for mapping, copy in zip(registries(), saved):
            mapping.clear()
            mapping.update(copy)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.startswith("payload_at_"):
                del sys.modules[name]


def _compare(args) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        package, _ = payload_at(args.against, folder)
        shape = model_shape(args.model)
        models = gpt2_models(**shape)
        vocab = shape.get("vocab_size", GPT2_SHAPE["vocab_size"])
        old_model, old_cache = old_mlr_model(package, models["MLR"])
        # importing the old payload registered its functions under the shared names: the new ones again
        ALL_ATTENTION_FUNCTIONS.register(new_attention.MLR_ATTENTION, new_attention.mlr_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(new_attention.MLR_ATTENTION, new_attention._mlr_mask)
        variants = {"dense": (models["dense"], new_cache), "old": (old_model, old_cache),
                    "new": (models["MLR"], new_cache)}
        torch.manual_seed(1)
        ids = torch.randint(2, vocab - 1, (args.batch, args.prompt))
        token = torch.randint(2, vocab - 1, (args.batch, 1))
        new_tokens = args.warmup + args.steps + 1
        state = {}
        for name, (model, cache_module) in variants.items():
            use_cache_layers(cache_module)
            cache = prefilled_cache(model, ids, static_len=args.prompt + new_tokens if args.mode == "compiled"
                                    else None, new_tokens=new_tokens)
            forward = torch.compile(model.forward) if args.mode == "compiled" else model.forward
            state[name] = {"forward": forward, "cache": cache, "position": args.prompt, "times": []}

        def step(name) -> float:
            entry = state[name]
            positions = torch.full((args.batch, 1), entry["position"])
            start = time.thread_time()
            entry["logits"] = entry["forward"](token, cache=entry["cache"], use_cache=True,
                                               position_ids=positions).logits
            entry["position"] += 1
            return time.thread_time() - start

        for name in state:  # the first step (compiles in compiled mode), compared across the two payloads
            step(name)
        difference = float((state["new"]["logits"] - state["old"]["logits"]).abs().max())
        for _ in range(args.warmup):
            for name in state:
                step(name)
        for index in range(args.steps):
            for name in (list(state) if index % 2 == 0 else list(reversed(list(state)))):
                state[name]["times"].append(step(name))
    medians = {name: statistics.median(entry["times"]) * 1e3 for name, entry in state.items()}
    ratios = {f"{a} / {b}": statistics.median(x / y for x, y in zip(state[a]["times"], state[b]["times"]))
              for a, b in (("new", "old"), ("new", "dense"), ("old", "dense"))}
    print(f"{args.model}, {args.mode}, batch {args.batch}, prompt {args.prompt}, {args.steps} steps, old = {args.against}: "
          + ", ".join(f"{name} {value:.2f} ms" for name, value in medians.items()) + "; "
          + ", ".join(f"{name} {value:.3f}" for name, value in ratios.items())
          + f"; max |logits new - old| at the first step {difference:.2e}")
    # each MLR model's attention consumed what its own cache layers wrote (an attention function that did not know
    # the layers' class would have left it and read full keys)
    layers = {name: [type(layer).__module__ for layer in state[name]["cache"].layers
                     if getattr(layer, "pending", None) is not None or hasattr(layer, "geometry")]
              for name in ("old", "new")}
    # (payloads before the explicit state flow stashed the written chunk on the layer until the attention took it)
    consumed = all(getattr(layer, "pending", None) is None for name in ("old", "new")
                   for layer in state[name]["cache"].layers)
    result = {"medians": medians, "ratios": ratios, "logit difference": difference, "layer modules": layers,
              "pending consumed": consumed}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
