"""Conformance of transformers decoders passed through ``hf_structattn.patch`` (Llama, Qwen2, Gemma-3 text) with
transformers' ModelTesterMixin, ConfigTester and our GenerationTesterMixin; the stock decoders through the same
harness as controls (marked ``slow``: they double the run time; ``-m slow`` runs them).

One architecture: ``python -m pytest tests/conformance/test_patched_decoders.py -k PatchedLlama``."""

import unittest

import pytest
import transformers

from hf_structattn.modeling.structattn_decoder import mlr_config_class, mlr_model_class

from .generation_tester import GenerationTesterMixin
from .skips import apply_skips
from .testers import PATCH_KWARGS, CausalLMModelTest, ModelTesterMixin, decoder_tester

# Gemma-3 alternates sliding-window and global layers: the tester has one of each (a window of 4 tokens, shorter
# than the 7-token inputs) and patches the global one, as one would patch a real Gemma-3 checkpoint
GEMMA3_CONFIG = dict(head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
# upstream's ConfigTester field hidden_size=37 is refused by transformers 5.24's own Llama and Gemma-3 configs
# (37 is not a multiple of their default 32 / 8 heads, and one head would give an odd RoPE dimension); 36 with two
# heads is a valid non-default geometry for every architecture here, stock or patched
DECODER_CONFIG_TESTER_KWARGS = {"hidden_size": 36, "num_attention_heads": 2}
ARCHITECTURES = {
    "Llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}, {}),
    "Qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}, {}),
    "Gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3_CONFIG, dict(layers=[1])),
}


def decoder_test(arch, patched):
    config_class, causal_lm_class, extra_config, extra_patch = ARCHITECTURES[arch]
    patch_kwargs = {**PATCH_KWARGS, **extra_patch} if patched else None
    model_class = mlr_model_class(causal_lm_class) if patched else causal_lm_class
    return type(f"{'Patched' if patched else 'Stock'}{arch}Base",
                (CausalLMModelTest, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase), {
                    "model_tester_class": decoder_tester(config_class, causal_lm_class, extra_config, patch_kwargs),
                    "config_class": mlr_config_class(config_class) if patched else config_class,
                    "config_tester_kwargs": DECODER_CONFIG_TESTER_KWARGS,
                    "all_model_classes": (model_class,),
                    "__module__": __name__})


@apply_skips("patched")
class PatchedLlamaTest(decoder_test("Llama", patched=True)):
    pass


@apply_skips("patched")
class PatchedQwen2Test(decoder_test("Qwen2", patched=True)):
    pass


@apply_skips("patched", "gemma3")
class PatchedGemma3Test(decoder_test("Gemma3", patched=True)):
    pass


@pytest.mark.slow
@apply_skips("patched")
class StockLlamaControlTest(decoder_test("Llama", patched=False)):
    pass


@pytest.mark.slow
@apply_skips("patched")
class StockQwen2ControlTest(decoder_test("Qwen2", patched=False)):
    pass


@pytest.mark.slow
@apply_skips("patched", "gemma3")
class StockGemma3ControlTest(decoder_test("Gemma3", patched=False)):
    pass
