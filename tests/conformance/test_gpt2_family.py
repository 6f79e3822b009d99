"""Conformance of the GPT-2 family (dense, MLR, SWA, bilinear MLR, bilinear BTT) with transformers' ModelTesterMixin,
ConfigTester and our GenerationTesterMixin; stock GPT-2 through the same harness as the control (marked ``slow``:
``-m slow`` runs it).

One variant: ``python -m pytest tests/conformance/test_gpt2_family.py -k MLR``."""

import unittest

import pytest
import transformers

import hf_structattn

from .generation_tester import GenerationTesterMixin
from .skips import apply_skips
from .testers import GPT2_ATTENTION_FIELDS, CausalLMModelTest, ModelTesterMixin, gpt2_tester

CLASSES = (hf_structattn.StructAttnGPT2Model, hf_structattn.StructAttnGPT2LMHeadModel)
# upstream's ConfigTester field hidden_size=37 is GPT-2's n_embd; with GPT-2's default 12 heads it is not a valid
# geometry (37 % 12), which our config refuses at construction (a clear error on bad input, by design) and stock
# GPT-2 accepts; one head makes the same check valid for both
GPT2_CONFIG_TESTER_KWARGS = {"n_embd": 37, "n_head": 1}


def variant_test(variant):
    return type(f"StructAttnGPT2{variant.title().replace('_', '')}Test",
                (CausalLMModelTest, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase), {
                    "model_tester_class": gpt2_tester(GPT2_ATTENTION_FIELDS[variant], *CLASSES),
                    "config_class": hf_structattn.StructAttnGPT2Config,
                    "config_tester_kwargs": GPT2_CONFIG_TESTER_KWARGS,
                    "all_model_classes": CLASSES,
                    "__module__": __name__})


@apply_skips("gpt2")
class StructAttnGPT2DenseTest(variant_test("dense")):
    pass


@apply_skips("gpt2")
class StructAttnGPT2MLRTest(variant_test("mlr")):
    pass


@apply_skips("gpt2")
class StructAttnGPT2SWATest(variant_test("swa")):
    pass


@apply_skips("gpt2")
class StructAttnGPT2BilinearMLRTest(variant_test("bilinear_mlr")):
    pass


@apply_skips("gpt2")
class StructAttnGPT2BilinearBTTTest(variant_test("bilinear_btt")):
    pass


@pytest.mark.slow
@apply_skips("gpt2")
class StockGPT2ControlTest(CausalLMModelTest, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    """The control: transformers' GPT-2 through the same harness."""

    model_tester_class = gpt2_tester(None, transformers.GPT2Model, transformers.GPT2LMHeadModel)
    config_class = transformers.GPT2Config
    config_tester_kwargs = GPT2_CONFIG_TESTER_KWARGS
    all_model_classes = (transformers.GPT2Model, transformers.GPT2LMHeadModel)
