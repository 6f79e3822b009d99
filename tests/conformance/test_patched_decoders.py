"""Conformance of transformers decoders passed through ``hf_structattn.patch`` with transformers' ModelTesterMixin,
ConfigTester and our GenerationTesterMixin: every model the mixins build is ``hf_structattn.patch(stock(config))``
(``testers.converted_model_class``), for Llama, Qwen2 with a sliding window (an MLR layer beside a stock sliding
layer), Mistral with ``sliding_window_layers="replace"``, Gemma-3 with both layer types converted and transformers'
GPT-2; the stock decoders of the same configs through the same harness as controls (marked ``slow``: they double the
run time; ``-m slow`` runs them). T5 converted by ``patch``: ``test_t5_family.py``.

One architecture: ``python -m pytest tests/conformance/test_patched_decoders.py -k PatchedLlama``."""

import unittest

import pytest
import transformers

from hf_structattn.modeling.structattn_decoder import mlr_config_class

from .generation_tester import GenerationTesterMixin
from .skips import apply_skips
from .test_gpt2_family import GPT2_CONFIG_TESTER_KWARGS, GPT2TokenTypeIdsTests
from .testers import PATCH_KWARGS, CausalLMModelTest, ModelTesterMixin, converted_model_class, decoder_tester, \
    gpt2_tester

# Gemma-3 alternates sliding-window and global layers: the tester has one of each (a window of 4 tokens, shorter
# than the 7-token inputs); patch converts both (``sliding_window_layers="replace"``)
GEMMA3_CONFIG = dict(head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
# Qwen2 with its sliding window from layer 1 on: layer 0 becomes MLR, the sliding layer 1 stays stock
QWEN2_SLIDING_CONFIG = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
# Mistral's window applies to every layer: patch replaces them all by global MLR layers
MISTRAL_SLIDING_CONFIG = dict(sliding_window=4)
# upstream's ConfigTester field hidden_size=37 is refused by transformers 5.24's own Llama and Gemma-3 configs
# (37 is not a multiple of their default 32 / 8 heads, and one head would give an odd RoPE dimension); 36 with two
# heads is a valid non-default geometry for every architecture here, stock or patched
DECODER_CONFIG_TESTER_KWARGS = {"hidden_size": 36, "num_attention_heads": 2}
REPLACE = dict(sliding_window_layers="replace")
ARCHITECTURES = {
    # name: (config class, causal-LM class, tester config fields, patch keywords besides PATCH_KWARGS)
    "Llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}, {}),
    "Qwen2Sliding": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, QWEN2_SLIDING_CONFIG, dict(layers=[0])),
    "MistralReplace": (transformers.MistralConfig, transformers.MistralForCausalLM, MISTRAL_SLIDING_CONFIG, REPLACE),
    "Gemma3Both": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3_CONFIG, REPLACE),
}


def decoder_test(arch, patched):
    """``patched``: the model class converts a stock model of the tester's config (``converted_model_class``);
    else the stock class (the control)."""
    config_class, causal_lm_class, extra_config, extra_patch = ARCHITECTURES[arch]
    patch_kwargs = {key: value for key, value in {**PATCH_KWARGS, **extra_patch}.items() if key != "attention"}
    model_class = converted_model_class(causal_lm_class, patch_kwargs) if patched else causal_lm_class
    return type(f"{'Patched' if patched else 'Stock'}{arch}Base",
                (CausalLMModelTest, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase), {
                    "model_tester_class": decoder_tester(config_class, model_class, extra_config),
                    "config_class": mlr_config_class(config_class) if patched else config_class,
                    "config_tester_kwargs": DECODER_CONFIG_TESTER_KWARGS,
                    "all_model_classes": (model_class,),
                    "__module__": __name__})


@apply_skips("patched")
class PatchedLlamaTest(decoder_test("Llama", patched=True)):
    pass


@apply_skips("patched", "qwen2_sliding")
class PatchedQwen2SlidingTest(decoder_test("Qwen2Sliding", patched=True)):
    pass


@apply_skips("patched")
class PatchedMistralReplaceTest(decoder_test("MistralReplace", patched=True)):
    pass


@apply_skips("patched")  # no sliding layer is left: right-padded assisted decoding runs (stock Gemma-3 skips it)
class PatchedGemma3BothTest(decoder_test("Gemma3Both", patched=True)):
    pass


@apply_skips("gpt2")
class PatchedGPT2Test(GPT2TokenTypeIdsTests, CausalLMModelTest, ModelTesterMixin, GenerationTesterMixin,
                      unittest.TestCase):
    """transformers' GPT-2 converted by ``patch``: the GPT-2 tester's stock config, every model patched."""

    model_tester_class = gpt2_tester(None, None, converted_model_class(
        transformers.GPT2LMHeadModel, {key: value for key, value in PATCH_KWARGS.items() if key != "attention"}))
    config_class = mlr_config_class(transformers.GPT2Config)
    config_tester_kwargs = GPT2_CONFIG_TESTER_KWARGS
    all_model_classes = (model_tester_class.causal_lm_class,)


@pytest.mark.slow
@apply_skips("patched")
class StockLlamaControlTest(decoder_test("Llama", patched=False)):
    pass


@pytest.mark.slow
@apply_skips("patched", "qwen2_sliding")
class StockQwen2SlidingControlTest(decoder_test("Qwen2Sliding", patched=False)):
    pass


@pytest.mark.slow
@apply_skips("patched", "mistral_sliding")
class StockMistralSlidingControlTest(decoder_test("MistralReplace", patched=False)):
    pass


@pytest.mark.slow
@apply_skips("patched", "gemma3")
class StockGemma3ControlTest(decoder_test("Gemma3Both", patched=False)):
    pass
