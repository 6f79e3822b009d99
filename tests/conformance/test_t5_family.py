"""Conformance of the T5 family (MLR encoder and decoder self-attention) with transformers' ModelTesterMixin,
ConfigTester and our GenerationTesterMixin; stock T5 through the same harness as the control (marked ``slow``:
``-m slow`` runs it).

One class: ``python -m pytest tests/conformance/test_t5_family.py -k StructAttnT5MLRTest``."""

import unittest

import pytest
import transformers

import hf_structattn

from .generation_tester import GenerationTesterMixin
from .skips import apply_skips
from .testers import (
    T5_MLR_FIELDS,
    ConfigTester,
    ModelTesterMixin,
    T5EncoderOnlyModelTester,
    T5ModelTester,
    converted_model_class,
    t5_tester,
)


class T5ModelTestBase:
    """transformers' ``T5ModelTest`` (without the pipeline mixin and the classification heads we do not ship)."""

    model_tester_class = None
    config_class = None
    is_encoder_decoder = True
    model_split_percents = [0.5, 0.8, 0.9]

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        self.config_tester = ConfigTester(self, config_class=self.config_class, d_model=37)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        config, input_ids, decoder_input_ids, attention_mask, decoder_attention_mask, _ = \
            self.model_tester.prepare_config_and_inputs()
        model = self.all_model_classes[0](config).eval()
        result = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, attention_mask=attention_mask,
                       decoder_attention_mask=decoder_attention_mask)
        result = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids)
        tester = self.model_tester
        self.assertEqual(tuple(result.encoder_last_hidden_state.shape),
                         (tester.batch_size, tester.encoder_seq_length, tester.hidden_size))
        self.assertEqual(tuple(result.last_hidden_state.shape),
                         (tester.batch_size, tester.decoder_seq_length, tester.hidden_size))

    def test_with_lm_head(self):
        config, input_ids, decoder_input_ids, _, decoder_attention_mask, lm_labels = \
            self.model_tester.prepare_config_and_inputs()
        model = self.all_model_classes[1](config).eval()
        outputs = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                        decoder_attention_mask=decoder_attention_mask, labels=lm_labels)
        tester = self.model_tester
        self.assertEqual(tuple(outputs.logits.shape),
                         (tester.batch_size, tester.decoder_seq_length, tester.vocab_size))
        self.assertEqual(tuple(outputs.loss.shape), ())


class T5EncoderOnlyModelTestBase:
    """transformers' ``T5EncoderOnlyModelTest`` (the encoder alone; it cannot generate)."""

    model_tester_class = None
    config_class = None
    test_resize_embeddings = False

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        self.config_tester = ConfigTester(self, config_class=self.config_class, d_model=37)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        config, input_ids, attention_mask = self.model_tester.prepare_config_and_inputs()
        model = self.all_model_classes[0](config).eval()
        model(input_ids=input_ids, attention_mask=attention_mask)
        result = model(input_ids=input_ids)
        tester = self.model_tester
        self.assertEqual(tuple(result.last_hidden_state.shape),
                         (tester.batch_size, tester.encoder_seq_length, tester.hidden_size))


@apply_skips("t5")
class StructAttnT5MLRTest(T5ModelTestBase, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    model_tester_class = t5_tester(T5ModelTester, T5_MLR_FIELDS["mlr"])
    config_class = hf_structattn.StructAttnT5Config
    all_model_classes = (hf_structattn.StructAttnT5Model, hf_structattn.StructAttnT5ForConditionalGeneration)


@apply_skips("t5_encoder")
class StructAttnT5EncoderOnlyMLRTest(T5EncoderOnlyModelTestBase, ModelTesterMixin, unittest.TestCase):
    model_tester_class = t5_tester(T5EncoderOnlyModelTester, T5_MLR_FIELDS["mlr"])
    config_class = hf_structattn.StructAttnT5Config
    all_model_classes = (hf_structattn.StructAttnT5EncoderModel,)


@apply_skips("t5")
class PatchedT5Test(T5ModelTestBase, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    """transformers' T5 converted by ``patch`` (MLR encoder and decoder self-attention): the T5 tester's stock
    config, every model ``hf_structattn.patch(T5ForConditionalGeneration(config), ...)``. ``patch`` converts the
    head model only, so the tests of the base class run on it."""

    model_tester_class = T5ModelTester
    config_class = hf_structattn.StructAttnT5Config
    all_model_classes = (converted_model_class(transformers.T5ForConditionalGeneration,
                                               {key: value for key, value in T5_MLR_FIELDS["mlr"].items()
                                                if key.startswith("mlr_")}),)

    def test_model(self):
        config, input_ids, decoder_input_ids, attention_mask, decoder_attention_mask, _ = \
            self.model_tester.prepare_config_and_inputs()
        model = self.all_model_classes[0](config).eval()
        self.assertIsInstance(model, hf_structattn.StructAttnT5ForConditionalGeneration)
        model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, attention_mask=attention_mask,
              decoder_attention_mask=decoder_attention_mask)
        result = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids)
        tester = self.model_tester
        self.assertEqual(tuple(result.encoder_last_hidden_state.shape),
                         (tester.batch_size, tester.encoder_seq_length, tester.hidden_size))
        self.assertEqual(tuple(result.logits.shape), (tester.batch_size, tester.decoder_seq_length, tester.vocab_size))

    def test_with_lm_head(self):
        config, input_ids, decoder_input_ids, _, decoder_attention_mask, lm_labels = \
            self.model_tester.prepare_config_and_inputs()
        model = self.all_model_classes[0](config).eval()
        outputs = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                        decoder_attention_mask=decoder_attention_mask, labels=lm_labels)
        self.assertEqual(tuple(outputs.logits.shape), (self.model_tester.batch_size,
                                                       self.model_tester.decoder_seq_length,
                                                       self.model_tester.vocab_size))
        self.assertEqual(tuple(outputs.loss.shape), ())


@pytest.mark.slow
@apply_skips("t5")
class StockT5ControlTest(T5ModelTestBase, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    """The control: transformers' T5 through the same harness."""

    model_tester_class = T5ModelTester
    config_class = transformers.T5Config
    all_model_classes = (transformers.T5Model, transformers.T5ForConditionalGeneration)


@pytest.mark.slow
@apply_skips("t5_encoder")
class StockT5EncoderOnlyControlTest(T5EncoderOnlyModelTestBase, ModelTesterMixin, unittest.TestCase):
    model_tester_class = T5EncoderOnlyModelTester
    config_class = transformers.T5Config
    all_model_classes = (transformers.T5EncoderModel,)
