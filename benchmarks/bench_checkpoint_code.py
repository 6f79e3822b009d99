"""What a saved checkpoint of each family ships as remote code: the Python files ``save_pretrained`` copies next to
the weights (transformers copies the modeling and configuration files and every file they import with ``from
.sibling import``, function-level imports included) and their lines -- what a user reviews before loading it with
``trust_remote_code=True``.

Families: the GPT-2 family (a mixed stack: MLR, dense, SWA and bilinear MLR layers), the T5 family (MLR encoder and
decoder self-attention), a patched decoder (``MLRLlamaForCausalLM``) and, when chronos-forecasting is installed, a
patched Chronos-Bolt.

    python benchmarks/bench_checkpoint_code.py

Prints a markdown table (the one in docs/models.md) and each family's file list. The counts depend only on the
payload's source.
"""

import os
import sys
import tempfile

import torch
import transformers

import hf_structattn
from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel, StructAttnT5Config
from hf_structattn import StructAttnT5ForConditionalGeneration


def _gpt2():
    return StructAttnGPT2LMHeadModel(StructAttnGPT2Config(
        vocab_size=61, n_positions=64, n_embd=32, n_layer=4, n_head=2, attention="mlr", mlr_ranks=[8, 4, 2, 2],
        sliding_window=8, bilinear_mlr_ranks=[4, 4],
        layer_types=["mlr_attention", "full_attention", "sliding_attention", "bilinear_mlr_attention"]))


def _t5():
    return StructAttnT5ForConditionalGeneration(StructAttnT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, encoder_attention="mlr",
        decoder_attention="mlr", mlr_ranks=[4, 2, 2], mlr_max_length=64))


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return hf_structattn.patch(transformers.LlamaForCausalLM(config), mlr_ranks=[8, 4, 2, 2],
                               mlr_block_sizes=[128, 64, 32])


def _bolt():
    """A patched Chronos-Bolt model, or None without chronos-forecasting."""
    try:
        from chronos.chronos_bolt import ChronosBoltModelForForecasting
    except ImportError:
        return None
    config = transformers.T5Config(vocab_size=2, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   feed_forward_proj="relu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                                   chronos_pipeline_class="ChronosBoltPipeline",
                                   chronos_config=dict(context_length=64, prediction_length=8, input_patch_size=4,
                                                       input_patch_stride=4, quantiles=[0.1, 0.5, 0.9],
                                                       use_reg_token=True))
    config.architectures = ["ChronosBoltModelForForecasting"]
    torch.manual_seed(0)
    return hf_structattn.patch(ChronosBoltModelForForecasting(config), attention="mlr", mlr_ranks=[4, 2, 2],
                               mlr_block_sizes=[8, 4])


FAMILIES = {"GPT-2 family": _gpt2, "T5 family": _t5, "patched decoder (MLRLlama)": _llama,
            "patched Chronos-Bolt": _bolt}


def shipped_code(model, folder: str) -> dict:
    """{file name: lines} of the Python files ``model.save_pretrained`` writes into ``folder``."""
    model.save_pretrained(folder)
    files = sorted(name for name in os.listdir(folder) if name.endswith(".py"))
    counts = {}
    for name in files:
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            counts[name] = sum(1 for _ in handle)
    return counts


def main(argv=None) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for index, (name, build) in enumerate(FAMILIES.items()):
            model = build()
            if model is not None:
                results[name] = shipped_code(model, os.path.join(root, str(index)))
    print("| checkpoint | Python files | lines |")
    print("|---|---:|---:|")
    for name, counts in results.items():
        print(f"| {name} | {len(counts)} | {sum(counts.values())} |")
    for name, counts in results.items():
        print(f"\n{name}: " + ", ".join(counts))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
