"""Checkpoints saved by the previous release (main at 759f20a, before the architecture rework) load with today's
classes and give the logits that release computed: a GPT-2 family model with per-layer variants in the old
``attention_layers`` field, a T5 family model with MLR encoder and decoder, a Llama patched to MLR.

The checkpoints and their expected logits (float64, computed by that release's code, not by the code under test) were
written by ``scripts/make_legacy_checkpoints.py`` run in a checkout of 759f20a, with the payload code that release
saved next to them (byte for byte the files of 759f20a): loaded after ``import hf_structattn`` they run today's classes;
loaded with ``trust_remote_code=True`` where the package is not importable they run that old code, and must still give
its logits."""

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hf_structattn  # noqa: F401  (registers the Auto classes)

DATA = os.path.join(os.path.dirname(__file__), "data", "legacy_759f20a")
EXPECTED = load_file(os.path.join(DATA, "expected.safetensors"))


def _load(name, auto_class):
    return auto_class.from_pretrained(os.path.join(DATA, name)).double().eval()


@pytest.mark.parametrize("name", ["gpt2_mixed", "llama_mlr"])
def test_decoder_checkpoints_of_the_previous_release_give_its_logits(name):
    model = _load(name, transformers.AutoModelForCausalLM)
    with torch.no_grad():
        logits = model(EXPECTED[f"{name}.input_ids"]).logits
    torch.testing.assert_close(logits, EXPECTED[f"{name}.logits"], atol=1e-10, rtol=1e-10)


def test_gpt2_attention_layers_field_migrates_to_layer_types():
    model = _load("gpt2_mixed", transformers.AutoModelForCausalLM)
    assert model.config.layer_types == ["mlr_attention", "full_attention", "bilinear_mlr_attention"]
    assert "attention_layers" not in model.config.to_dict() or model.config.to_dict()["attention_layers"] is None


def test_t5_checkpoint_of_the_previous_release_gives_its_logits():
    model = _load("t5_mlr", transformers.AutoModelForSeq2SeqLM)
    with torch.no_grad():
        logits = model(input_ids=EXPECTED["t5_mlr.input_ids"],
                       decoder_input_ids=EXPECTED["t5_mlr.decoder_input_ids"]).logits
    torch.testing.assert_close(logits, EXPECTED["t5_mlr.logits"], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", ["gpt2_mixed", "llama_mlr"])
def test_previous_release_checkpoints_generate_with_the_hierarchical_cache(name):
    model = _load(name, transformers.AutoModelForCausalLM)
    ids = EXPECTED[f"{name}.input_ids"][:1, :20]
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=1)
    cached = model.generate(ids, return_dict_in_generate=True, **kwargs)
    assert any(type(layer).__name__ == "MLRKeyCacheLayer" for layer in cached.cache.layers)
    assert torch.equal(cached.sequences, model.generate(ids, use_cache=False, **kwargs))


def test_previous_release_checkpoints_reload_bare_with_the_code_saved_beside_them(tmp_path):
    """Where hf_structattn is not importable, ``trust_remote_code=True`` loads each checkpoint with the payload code
    it carries (the release's own), as a user without the package does, and gives the release's logits."""
    from model_helpers import run_isolated

    out = run_isolated(f"""
        import torch, transformers
        from safetensors.torch import load_file
        data = {DATA!r}
        expected = load_file(data + "/expected.safetensors")
        for name, auto in (("gpt2_mixed", "AutoModelForCausalLM"), ("llama_mlr", "AutoModelForCausalLM"),
                           ("t5_mlr", "AutoModelForSeq2SeqLM")):
            model = getattr(transformers, auto).from_pretrained(data + "/" + name, trust_remote_code=True,
                                                                dtype=torch.float64).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                if name == "t5_mlr":
                    logits = model(input_ids=expected[name + ".input_ids"],
                                   decoder_input_ids=expected[name + ".decoder_input_ids"]).logits
                else:
                    logits = model(expected[name + ".input_ids"]).logits
            print(name, "max_diff", float((logits - expected[name + ".logits"]).abs().max()))
    """, tmp_path)
    for name in ("gpt2_mixed", "llama_mlr", "t5_mlr"):
        assert float(out.split(f"{name} max_diff")[1].split()[0]) <= 1e-10, out
