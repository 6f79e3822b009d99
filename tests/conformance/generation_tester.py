"""Our ``GenerationTesterMixin``: what transformers' ``tests/generation/test_utils.py`` checks (that file is not in
the transformers sdist), kept to the behaviours issue 26 names and sized for CPU.

Modelled on transformers' mixin (greedy / sample / beam search with ``return_dict_in_generate`` outputs with and
without the cache, left padding, continuing from a returned cache, ``inputs_embeds``, the static cache, compilation,
assisted and prompt-lookup decoding, ``num_return_sequences``, attention and hidden-state outputs) and written for
the transformers 5.x API: the cache argument and output field are called ``cache``, cache layers hold ``keys`` /
``values``. Deliberate differences from upstream, each because upstream would skip where we want an answer:

* the compile tests do not skip models whose ``_can_compile_fullgraph`` is False; the fullgraph test asserts it is
  True (issue 26: every family must say truthfully whether ``generate`` can compile it, and be compilable);
* no test skips on ``_supports_static_cache`` (gone in 5.x) or on model names.

The class is exported to transformers' ``test_modeling_common.py`` as ``.generation.test_utils.GenerationTesterMixin``
(``upstream_support/generation/test_utils.py``), so ``test_generation_tester_mixin_inheritance`` sees it.
"""

import copy
import inspect

import pytest
import torch
from parameterized import parameterized
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache, StaticLayer
from transformers.generation import (
    CompileConfig,
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
)

DEVICE = "cpu"


def _text_config(config):
    return config.get_text_config(decoder=True)


def _head_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    if getattr(config, "d_kv", None):
        return config.d_kv
    return config.hidden_size // config.num_attention_heads


def _num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _structattn_cache_layout(config, index: int):
    """(key width, [(block size, rank) of each level ring]) that decoder cache layer ``index`` holds.

    Harness adaptation, as transformers' own testers override their cache checks for models whose cache is not
    (B, H, T, head dim) keys (Mamba, Gemma-3n, ...): an MLR layer keeps level 1's keys (``r_1`` wide) for every token
    and one ring per finer level (``r_l`` wide, at most ``b_l`` entries); a bilinear MLR layer keeps its structured
    keys (``sum_l 2^(l-1) r_l`` wide), a bilinear BTT layer ``x`` itself (model width); any other layer, and every
    stock model, the head dim with no rings."""
    if hasattr(config, "mlr_layer_geometries"):  # our GPT-2 and T5 families
        geometries = config.mlr_layer_geometries()
    elif getattr(config, "mlr_ranks", None) is not None:  # a patched decoder
        from hf_structattn.modeling.structattn_decoder_spec import decoder_geometries
        geometries = decoder_geometries(config)
    else:
        geometries = {}
    if index in geometries:
        geometry = geometries[index]
        return geometry.ranks[0], list(zip(geometry.block_sizes, geometry.ranks[1:]))
    layer_types = getattr(config, "layer_types", None) or []
    kind = layer_types[index] if index < len(layer_types) else None
    if kind == "bilinear_mlr_attention":
        return sum(2 ** level * rank for level, rank in enumerate(config.bilinear_mlr_ranks)), []
    if kind == "bilinear_btt_attention":
        return config.n_embd, []
    return _head_dim(config), []


def _decoder_cache(cache):
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def _upstream_splits_cross_attention_heads() -> bool:
    """Whether the installed transformers' assisted decoding splits cross attentions along the head dim (5.25 calls
    ``_split_model_outputs`` on (batch, heads, new, encoder) maps without an input shape, so it narrows dim 1, the
    heads): probed on a tensor, not keyed on a version, so a fixed release is held to the right shape again."""
    from transformers.generation.utils import _split_model_outputs

    maps = torch.zeros(1, 4, 3, 5)
    split = _split_model_outputs((), (maps,), 1, 3)
    return tuple(split[-1][0].shape) != (1, 4, 1, 5)


class GenerationTesterMixin:
    """Mixed into a ``unittest.TestCase`` next to ``ModelTesterMixin``; needs ``model_tester`` and
    ``all_generative_model_classes`` (from ``all_model_classes``)."""

    input_name = "input_ids"
    model_tester = None
    max_new_tokens = 3

    # ------------------------------------------------------------------------------------------------ helpers

    def prepare_config_and_inputs_for_generate(self, batch_size=2):
        """The common inputs cut to ``batch_size`` rows, without inputs that generate builds itself; EOS disabled
        so that every call generates the same number of tokens."""
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        ignored = {"head_mask", "decoder_head_mask", "cross_attn_head_mask", "decoder_input_ids",
                   "decoder_attention_mask", "use_cache", "labels"}
        inputs = {key: value[:batch_size, ...] if isinstance(value, torch.Tensor) else value
                  for key, value in inputs_dict.items() if key not in ignored}
        text_config = _text_config(config)
        if text_config.eos_token_id is not None and text_config.pad_token_id is None:
            eos = text_config.eos_token_id
            text_config.pad_token_id = eos if isinstance(eos, int) else eos[0]
        text_config.eos_token_id = None
        text_config.forced_eos_token_id = None
        return config, inputs

    def _new_model(self, model_class, config):
        return model_class(config).to(DEVICE).eval()

    def _eager_for_attention_maps(self, config):
        """transformers' mixin asks for eager attention wherever it checks attention maps (SDPA returns none)."""
        if self.has_attentions:
            config._attn_implementation = "eager"
        return config

    def _logits_processor_kwargs(self, do_sample=False):
        kwargs = {"bad_words_ids": [[1, 0]], "repetition_penalty": 1.2, "remove_invalid_values": True}
        if do_sample:
            kwargs.update(top_k=10, top_p=0.7, temperature=0.7)
        return kwargs

    @staticmethod
    def _beam_kwargs(num_return_sequences=1):
        return {"early_stopping": False, "length_penalty": 2.0, "num_beams": 2,
                "num_return_sequences": num_return_sequences}

    def _generate(self, model, inputs, *, do_sample=False, num_beams=1, num_return_sequences=1, output_scores=False,
                  output_logits=False, output_attentions=False, output_hidden_states=False,
                  return_dict_in_generate=False, use_cache=True, **extra):
        if do_sample:
            torch.manual_seed(0)
        kwargs = dict(do_sample=do_sample, num_beams=num_beams, max_new_tokens=self.max_new_tokens,
                      num_return_sequences=num_return_sequences, output_scores=output_scores,
                      output_logits=output_logits, output_attentions=output_attentions,
                      output_hidden_states=output_hidden_states, return_dict_in_generate=return_dict_in_generate,
                      use_cache=use_cache)
        if num_beams > 1:
            kwargs.update(early_stopping=False, length_penalty=2.0)
        kwargs.update(self._logits_processor_kwargs(do_sample=do_sample))
        kwargs.update(extra)
        return model.generate(**kwargs, **inputs)

    def _dict_output_kwargs(self, use_cache):
        return dict(output_scores=True, output_logits=True, output_hidden_states=True,
                    output_attentions=self.has_attentions, return_dict_in_generate=True, use_cache=use_cache)

    def _prompt_length(self):
        length = getattr(self.model_tester, "seq_length", None)
        length = getattr(self.model_tester, "encoder_seq_length", length)
        return length

    def _check_sequence_length(self, model, sequences, inputs):
        expected = self.max_new_tokens + (1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[-1])
        self.assertEqual(sequences.shape[-1], expected)

    def _check_similar_generate_outputs(self, output_1, output_2, atol=1e-5, rtol=1e-5):
        """Same sequences, or the scores up to (and including) the first mismatch nearly identical."""
        prompt_length = output_1.sequences.shape[1] - len(output_1.scores)
        matches = output_1.sequences == output_2.sequences
        if bool(matches.all()):
            return
        for row in range(output_1.sequences.shape[0]):
            if bool(matches[row].all()):
                continue
            step = int(matches[row].int().argmin()) - prompt_length
            torch.testing.assert_close(output_1.scores[step][row], output_2.scores[step][row], atol=atol, rtol=rtol,
                                       msg=f"row {row} differs at generated token {step} with different scores")

    def _check_caches_are_equal(self, cache_1, cache_2):
        """Used by transformers' ``test_bc_cache_name_forward`` too."""
        cache_1, cache_2 = _decoder_cache(cache_1), _decoder_cache(cache_2)
        self.assertEqual(type(cache_1), type(cache_2))
        self.assertEqual(cache_1.get_seq_length(), cache_2.get_seq_length())
        self.assertEqual(len(cache_1.layers), len(cache_2.layers))
        for layer_1, layer_2 in zip(cache_1.layers, cache_2.layers):
            for name in ("keys", "values"):
                tensor_1, tensor_2 = getattr(layer_1, name, None), getattr(layer_2, name, None)
                if tensor_1 is None or tensor_2 is None:
                    self.assertIs(tensor_1, tensor_2)
                else:
                    torch.testing.assert_close(tensor_1, tensor_2)

    # ------------------------------------------------------------------ output structure (scores, maps, cache)

    def _described(self, config):
        """The config of the model the tested class builds from the tester's ``config``. Harness adaptation for the
        conversion testers, whose class turns a stock config into the patched model (``testers.converted_model_class``:
        its config carries the MLR fields, and replaced sliding layers are global): the output checks read the model
        it built, found by building it on the meta device (nothing allocated). Any other class: ``config`` itself."""
        model_class = self.all_model_classes[0]
        if getattr(model_class, "converted_from", None) is None or getattr(config, "mlr_ranks", None) is not None:
            return config
        with torch.device("meta"):
            built = model_class(copy.deepcopy(config)).config
        return built if config.is_encoder_decoder or built.get_text_config(decoder=True) is built else \
            built.get_text_config(decoder=True)

    def _check_generate_outputs(self, output, config, use_cache=False, num_return_sequences=1, num_beams=1,
                                recording=False):
        config = self._described(config)
        input_batch = output.sequences.shape[0] // num_return_sequences
        internal_batch = input_batch * num_beams if num_beams > 1 else input_batch * num_return_sequences
        prompt_length = self._prompt_length()
        config = _text_config(config) if not config.is_encoder_decoder else config
        generated = output.sequences.shape[1] - (1 if config.is_encoder_decoder else prompt_length)
        cache = getattr(output, "cache", None)

        vocab_size = _text_config(config).vocab_size
        self.assertIsInstance(output.scores, tuple)
        self.assertEqual(len(output.scores), generated)
        self.assertEqual([tuple(s.shape) for s in output.scores], [(internal_batch, vocab_size)] * generated)
        self.assertIsInstance(output.logits, tuple)
        self.assertEqual([tuple(s.shape) for s in output.logits], [(internal_batch, vocab_size)] * generated)

        if config.is_encoder_decoder:
            if self.has_attentions:
                self._check_encoder_attentions(output.encoder_attentions, input_batch, config, prompt_length)
                self._check_step_attentions(output.decoder_attentions, internal_batch, 1,
                                            output.sequences.shape[1], config, use_cache, cache, recording)
                self._check_cross_attentions(output.cross_attentions, internal_batch, 1, output.sequences.shape[1],
                                             config, use_cache, prompt_length,
                                             heads_split=recording and _upstream_splits_cross_attention_heads())
            self._check_encoder_hidden_states(output.encoder_hidden_states, input_batch, config, prompt_length)
            self._check_step_hidden_states(output.decoder_hidden_states, internal_batch, 1,
                                           output.sequences.shape[1], config, use_cache)
        else:
            if self.has_attentions:
                self._check_step_attentions(output.attentions, internal_batch, prompt_length,
                                            output.sequences.shape[1], config, use_cache, cache, recording)
            self._check_step_hidden_states(output.hidden_states, internal_batch, prompt_length,
                                           output.sequences.shape[1], config, use_cache)

        if use_cache:
            self._check_cache_for_generate(internal_batch, cache, output.sequences.shape[1] - 1, config)
        else:
            self.assertIsNone(cache, "generate(use_cache=False) returned a cache")

    def _layer_types(self, config):
        """The decoder layers' attention types; a config without ``layer_types`` whose ``sliding_window`` is set
        (Mistral: one window for every layer) has only sliding layers."""
        types = getattr(config, "layer_types", None)
        if types is not None:
            return list(types)
        sliding = getattr(config, "sliding_window", None) and not getattr(config, "is_encoder_decoder", False)
        return ["sliding_attention" if sliding else None] * self._num_decoder_layers(config)

    @staticmethod
    def _num_decoder_layers(config):
        return getattr(config, "num_decoder_layers", None) or config.num_hidden_layers

    def _visible_keys(self, config, layer_type, past, new, use_cache):
        """Keys an attention map covers: sliding layers with a cache keep the last window - 1 past keys."""
        window = getattr(config, "sliding_window", None)
        if use_cache and layer_type == "sliding_attention" and window:
            return min(past, window - 1) + new
        return past + new

    def _check_step_attentions(self, attentions, batch, prompt_length, output_length, config, use_cache,
                               cache=None, recording=False):
        """One tuple per generated token (the last token is never fed back); each holds one (batch, heads, new,
        keys) map per decoder layer. A preallocated (static) cache attends over all its slots."""
        static_lengths = None
        if use_cache and cache is not None and _decoder_cache(cache).is_compileable:
            static_lengths = [layer.max_cache_len for layer in _decoder_cache(cache).layers]
        self.assertIsInstance(attentions, tuple)
        self.assertEqual(len(attentions), output_length - prompt_length)
        layer_types = self._layer_types(config)
        for step, step_attentions in enumerate(attentions):
            self.assertIsInstance(step_attentions, tuple)
            self.assertEqual(len(step_attentions), len(layer_types))
            past = 0 if (step == 0 or not use_cache) else prompt_length + step - 1
            new = prompt_length + step - past
            for index, (layer_type, attention) in enumerate(zip(layer_types, step_attentions)):
                # a static layer attends over all its slots; a sliding one over the new tokens when they outnumber
                # its window (prefill)
                keys = self._visible_keys(config, layer_type, past, new, use_cache) if static_lengths is None \
                    else max(static_lengths[index], new)
                if recording and static_lengths is None and keys < past + new:
                    # speculative decoding records the past for rollback: transformers' sliding layer then keeps
                    # every key until the next crop, so its maps are between the window and everything (the
                    # keys outside the window get probability 0)
                    self.assertEqual(tuple(attention.shape[:3]), (batch, config.num_attention_heads, new))
                    self.assertTrue(keys <= attention.shape[3] <= past + new,
                                    f"attention map of generation step {step}: {attention.shape[3]} keys")
                    continue
                self.assertEqual(tuple(attention.shape), (batch, config.num_attention_heads, new, keys),
                                 f"attention map of generation step {step}")

    def _check_cross_attentions(self, attentions, batch, prompt_length, output_length, config, use_cache,
                                encoder_length, heads_split=False):
        """``heads_split``: the installed transformers slices assisted decoding's cross attentions by head instead of
        by step (see ``_upstream_splits_cross_attention_heads``), so each step's map has one head of the step's
        whole chunk: the shape stock T5 gets too (the control class checks it)."""
        self.assertIsInstance(attentions, tuple)
        self.assertEqual(len(attentions), output_length - prompt_length)
        for step, step_attentions in enumerate(attentions):
            new = 1 if (use_cache and step > 0) else prompt_length + step
            for attention in step_attentions:
                if heads_split:
                    self.assertEqual((attention.shape[0], attention.shape[1], attention.shape[3]),
                                     (batch, 1, encoder_length))
                    continue
                self.assertEqual(tuple(attention.shape), (batch, config.num_attention_heads, new, encoder_length))

    def _check_encoder_attentions(self, attentions, batch, config, length):
        self.assertIsInstance(attentions, tuple)
        self.assertEqual(len(attentions), config.num_hidden_layers)
        for attention in attentions:
            self.assertEqual(tuple(attention.shape), (batch, config.num_attention_heads, length, length))

    def _check_step_hidden_states(self, hidden_states, batch, prompt_length, output_length, config, use_cache):
        self.assertIsInstance(hidden_states, tuple)
        self.assertEqual(len(hidden_states), output_length - prompt_length)
        for step, step_states in enumerate(hidden_states):
            self.assertIsInstance(step_states, tuple)
            self.assertEqual(len(step_states), self._num_decoder_layers(config) + 1)
            length = 1 if (use_cache and step > 0) else prompt_length + step
            for state in step_states:
                self.assertEqual(tuple(state.shape), (batch, length, config.hidden_size))

    def _check_encoder_hidden_states(self, hidden_states, batch, config, length):
        self.assertIsInstance(hidden_states, tuple)
        self.assertEqual(len(hidden_states), config.num_hidden_layers + 1)
        for state in hidden_states:
            self.assertEqual(tuple(state.shape), (batch, length, config.hidden_size))

    def _check_cache_for_generate(self, batch, cache, seq_length, config):
        """A ``Cache`` whose decoder layers hold (batch, kv heads, tokens, head dim) keys and values; ``seq_length`` is
        the number of tokens fed (for a static cache: the number of slots it was built for)."""
        self.assertIsInstance(cache, Cache)
        cache = _decoder_cache(cache)
        config = self._described(config)
        layer_types = self._layer_types(config)
        self.assertEqual(len(cache.layers), len(layer_types))
        self.assertEqual(cache.get_seq_length(), seq_length)
        static = cache.is_compileable
        window = getattr(config, "sliding_window", None)
        for index, (layer_type, layer) in enumerate(zip(layer_types, cache.layers)):
            sliding = bool(getattr(layer, "is_sliding", False)) and bool(window)
            if static:  # preallocated for the whole generation (``seq_length`` slots); a sliding layer for its window
                held = min(window, seq_length) if sliding else seq_length
            elif sliding:  # keeps the last window - 1 keys
                held = self._visible_keys(config, layer_type, seq_length, 0, True)
            else:
                held = seq_length
            key_width, rings = _structattn_cache_layout(config, index)
            heads = _num_kv_heads(config)
            self.assertEqual(tuple(layer.keys.shape), (batch, heads, held, key_width), f"keys of cache layer {index}")
            self.assertEqual(tuple(layer.values.shape), (batch, heads, held, _head_dim(config)),
                             f"values of cache layer {index}")
            held_rings = [tuple(ring.shape) for ring in getattr(layer, "rings", None) or []]
            self.assertEqual(len(held_rings), len(rings), f"level rings of cache layer {index}")
            for (block, rank), shape in zip(rings, held_rings):
                self.assertEqual((shape[0], shape[1], shape[3]), (batch, heads, rank), f"ring of cache layer {index}")
                self.assertLessEqual(shape[2], block, f"ring of cache layer {index} longer than its block")

    # ----------------------------------------------------------------------------------- greedy / sample / beam

    @pytest.mark.generate
    def test_greedy_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs)
            self._check_sequence_length(model, output, inputs)

    @pytest.mark.generate
    def test_greedy_generate_dict_outputs(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, **self._dict_output_kwargs(use_cache=False))
            self._check_sequence_length(model, output.sequences, inputs)
            expected = GenerateEncoderDecoderOutput if model.config.is_encoder_decoder else GenerateDecoderOnlyOutput
            self.assertIsInstance(output, expected)
            self._check_generate_outputs(output, model.config)

    @pytest.mark.generate
    def test_greedy_generate_dict_outputs_use_cache(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, **self._dict_output_kwargs(use_cache=True))
            self._check_sequence_length(model, output.sequences, inputs)
            self._check_generate_outputs(output, model.config, use_cache=True)

    @pytest.mark.generate
    def test_sample_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, do_sample=True)
            self._check_sequence_length(model, output, inputs)

    @pytest.mark.generate
    def test_sample_generate_dict_output(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, do_sample=True, num_return_sequences=2,
                                    **self._dict_output_kwargs(use_cache=False))
            self._check_sequence_length(model, output.sequences, inputs)
            expected = GenerateEncoderDecoderOutput if model.config.is_encoder_decoder else GenerateDecoderOnlyOutput
            self.assertIsInstance(output, expected)
            self._check_generate_outputs(output, model.config, num_return_sequences=2)

    @pytest.mark.generate
    def test_sample_generate_dict_output_use_cache(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, do_sample=True, num_return_sequences=2,
                                    **self._dict_output_kwargs(use_cache=True))
            self._check_generate_outputs(output, model.config, use_cache=True, num_return_sequences=2)

    @pytest.mark.generate
    def test_beam_search_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, num_beams=2)
            self._check_sequence_length(model, output, inputs)

    @pytest.mark.generate
    def test_beam_search_generate_dict_output(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, num_beams=2, **self._dict_output_kwargs(use_cache=False))
            self._check_sequence_length(model, output.sequences, inputs)
            expected = GenerateBeamEncoderDecoderOutput if model.config.is_encoder_decoder \
                else GenerateBeamDecoderOnlyOutput
            self.assertIsInstance(output, expected)
            self._check_generate_outputs(output, model.config, num_beams=2)

    @pytest.mark.generate
    def test_beam_search_generate_dict_outputs_use_cache(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, num_beams=2, **self._dict_output_kwargs(use_cache=True))
            self._check_sequence_length(model, output.sequences, inputs)
            self._check_generate_outputs(output, model.config, use_cache=True, num_beams=2)

    @pytest.mark.generate
    def test_beam_sample_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            output = self._generate(model, inputs, num_beams=2, do_sample=True)
            self._check_sequence_length(model, output, inputs)

    @pytest.mark.generate
    def test_generate_num_return_sequences(self):
        """Sampling and beam search return ``num_return_sequences`` rows per prompt, grouped by prompt."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            batch = inputs["input_ids"].shape[0]
            for kwargs in (dict(do_sample=True), dict(num_beams=3)):
                output = self._generate(model, inputs, num_return_sequences=3, **kwargs)
                self.assertEqual(output.shape[0], 3 * batch, kwargs)
                self._check_sequence_length(model, output, inputs)
                if not model.config.is_encoder_decoder:
                    prompt = inputs["input_ids"].repeat_interleave(3, dim=0)
                    self.assertTrue(torch.equal(output[:, :prompt.shape[1]], prompt), kwargs)

    @pytest.mark.generate
    def test_greedy_generate_cached_equals_uncached(self):
        """The cache is an optimisation: greedy tokens with and without it agree (scores to float32 tolerance)."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            kwargs = dict(return_dict_in_generate=True, output_scores=True)
            cached = self._generate(model, inputs, use_cache=True, **kwargs)
            uncached = self._generate(model, inputs, use_cache=False, **kwargs)
            self._check_similar_generate_outputs(cached, uncached)

    @pytest.mark.generate
    def test_generate_without_input_ids(self):
        config, _ = self.prepare_config_and_inputs_for_generate()
        if config.bos_token_id is None:
            self.skipTest(reason="bos_token_id is None: nothing to start from")
        if config.bos_token_id == config.pad_token_id:
            config.pad_token_id = None
        for model_class in self.all_generative_model_classes:
            model = self._new_model(model_class, config)
            output = model.generate(do_sample=False, max_new_tokens=self.max_new_tokens, remove_invalid_values=True)
            self.assertIsNotNone(output)

    @pytest.mark.generate
    def test_inherits_generation_mixin(self):
        for model_class in self.all_generative_model_classes:
            self.assertTrue(issubclass(model_class, GenerationMixin))

    # --------------------------------------------------------------------------------------------- left padding

    @pytest.mark.generate
    def test_left_padding_compatibility(self):
        """Adding 32 left-padding tokens (mask 0) leaves the next-token logits unchanged (transformers' test:
        positions ``cumsum(mask) - 1`` with padded slots set to 1, when the model takes ``position_ids``)."""
        if not self.has_attentions:
            self.skipTest(reason="the model takes no attention mask")
        decoder_only = [cls for cls in self.all_generative_model_classes
                        if not self.prepare_config_and_inputs_for_generate()[0].is_encoder_decoder]
        if not decoder_only:
            self.skipTest(reason="encoder-decoder: encoder inputs are right-padded, the decoder starts from BOS")

        def model_kwargs(inputs, signature):
            kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
            if "position_ids" in signature:
                position_ids = torch.cumsum(inputs["attention_mask"], dim=-1) - 1
                position_ids.masked_fill_(inputs["attention_mask"] == 0, 1)
                kwargs["position_ids"] = position_ids
            kwargs.update({k: v for k, v in inputs.items() if k not in kwargs and k in signature})
            return kwargs

        for model_class in decoder_only:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            signature = inspect.signature(model.forward).parameters.keys()
            model.generation_config.use_cache = False
            if inputs.get("attention_mask") is None:
                inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            with torch.no_grad():
                unpadded = model(**model_kwargs(inputs, signature)).logits[:, -1, :]
            input_ids = inputs["input_ids"]
            pad_token_id = _text_config(config).pad_token_id or 0
            pad_shape = (input_ids.shape[0], 32)
            padded = copy.deepcopy(inputs)
            padded["input_ids"] = torch.cat([torch.full(pad_shape, pad_token_id, dtype=input_ids.dtype), input_ids], 1)
            padded["attention_mask"] = torch.cat(
                [torch.zeros(pad_shape, dtype=inputs["attention_mask"].dtype), inputs["attention_mask"]], 1)
            if inputs.get("token_type_ids") is not None:
                padded["token_type_ids"] = torch.cat(
                    [torch.zeros(pad_shape, dtype=input_ids.dtype), inputs["token_type_ids"]], 1)
            with torch.no_grad():
                with_padding = model(**model_kwargs(padded, signature)).logits[:, -1, :]
            torch.testing.assert_close(unpadded, with_padding, rtol=1e-5, atol=1e-5)

    @pytest.mark.generate
    def test_left_padded_generate_equals_rows_alone(self):
        """``generate`` on a left-padded batch gives each row the tokens it gets alone (greedy, with the cache)."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            if config.is_encoder_decoder:
                self.skipTest(reason="encoder-decoder: the decoder starts from BOS, its prompt is never padded")
            model = self._new_model(model_class, config)
            prompt = inputs["input_ids"]
            pads = [0, 3]
            length = prompt.shape[1]
            pad_token_id = _text_config(config).pad_token_id or 0
            batch = torch.full((2, length), pad_token_id, dtype=prompt.dtype)
            mask = torch.zeros((2, length), dtype=torch.long)
            for row, pad in enumerate(pads):
                batch[row, pad:] = prompt[row, :length - pad]
                mask[row, pad:] = 1
            kwargs = dict(do_sample=False, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True,
                          output_scores=True)
            together = model.generate(batch, attention_mask=mask, **kwargs)
            for row, pad in enumerate(pads):
                alone = model.generate(prompt[row:row + 1, :length - pad],
                                       attention_mask=torch.ones((1, length - pad), dtype=torch.long), **kwargs)
                self.assertEqual(together.sequences[row, pad:].tolist(), alone.sequences[0].tolist(), f"row {row}")

    # ------------------------------------------------------------------------------------------ cache format

    @pytest.mark.generate
    def test_past_key_values_format(self):
        """A forward with ``use_cache=True`` returns a ``Cache`` with one layer per decoder layer holding
        (batch, kv heads, tokens, head dim) keys and values."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            model = model_class(config).to(DEVICE).eval()
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
            inputs["use_cache"] = True
            with torch.no_grad():
                outputs = model(**inputs)
            self.assertIn("cache", outputs, "forward(use_cache=True) returned no cache")
            text_config = _text_config(config)
            key = "decoder_input_ids" if config.is_encoder_decoder else "input_ids"
            batch, length = inputs[key].shape
            self._check_cache_for_generate(batch, outputs.cache, length, text_config)

    @pytest.mark.generate
    def test_generate_continue_from_past_key_values(self):
        """Generating 3 tokens, then 1 more from the returned cache, equals generating 4 at once (tokens and
        cache).

        Harness difference from transformers' test: a decoder-only prompt's mask is left-padded (the tester's
        ``tril`` mask reversed: same number of real tokens per row). With the tester's right-padded mask, stock
        transformers 5.24 itself gives the continued call other positions than the single call (generated tokens
        follow padding), so that input tests nothing about the cache."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            inputs = {k: v for k, v in inputs.items() if k not in ("labels", "token_type_ids", "use_cache")}
            if not config.is_encoder_decoder and inputs.get("attention_mask") is not None:
                inputs["attention_mask"] = inputs["attention_mask"].flip(-1)
            model = model_class(config).to(DEVICE).eval()
            kwargs = dict(pad_token_id=-1, eos_token_id=-1, forced_eos_token_id=None, encoder_no_repeat_ngram_size=0,
                          use_cache=True, do_sample=False, return_dict_in_generate=True, output_scores=True)
            outputs = model.generate(**inputs, **kwargs, max_new_tokens=4)
            cached = model.generate(**inputs, **kwargs, max_new_tokens=3)
            inputs["cache"] = cached.cache
            new_length = cached.sequences.shape[-1]
            ids_key = "decoder_input_ids" if config.is_encoder_decoder else "input_ids"
            mask_key = "decoder_attention_mask" if config.is_encoder_decoder else "attention_mask"
            inputs[ids_key] = cached.sequences
            if inputs.get(mask_key) is not None:
                inputs[mask_key] = torch.nn.functional.pad(inputs[mask_key],
                                                           (0, new_length - inputs[mask_key].shape[1]), value=1)
            first_scores = cached.scores
            continued = model.generate(**inputs, **kwargs, max_new_tokens=1)
            continued.scores = first_scores + continued.scores
            self._check_similar_generate_outputs(outputs, continued)
            self._check_caches_are_equal(outputs.cache, continued.cache)

    # ------------------------------------------------------------------------------------------ inputs_embeds

    @parameterized.expand([("greedy", 1), ("beam_search", 2)])
    @pytest.mark.generate
    def test_generate_from_inputs_embeds(self, _, num_beams):
        """Decoder-only: generating from ``inputs_embeds`` equals generating from the ids they embed; other
        embeddings give other scores."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            if config.is_encoder_decoder:
                self.skipTest(reason="encoder-decoder: the decoder starts from BOS, inputs_embeds feed the encoder")
            model = self._new_model(model_class, config)
            if "inputs_embeds" not in inspect.signature(model.prepare_inputs_for_generation).parameters:
                self.fail(f"{model_class.__name__}.prepare_inputs_for_generation takes no inputs_embeds")
            input_ids = inputs.pop("input_ids")
            inputs.pop("token_type_ids", None)
            kwargs = dict(return_dict_in_generate=True, output_scores=True, num_beams=num_beams, do_sample=False,
                          max_new_tokens=5, min_new_tokens=5)
            from_ids = model.generate(input_ids, **kwargs, **inputs)
            self.assertEqual(tuple(from_ids.sequences.shape), (input_ids.shape[0], input_ids.shape[1] + 5))
            embeds = model.get_input_embeddings()(input_ids)
            from_embeds = model.generate(input_ids, inputs_embeds=embeds, **kwargs, **inputs)
            self._check_similar_generate_outputs(from_ids, from_embeds)
            random_embeds = torch.rand_like(embeds)
            from_random = model.generate(input_ids, inputs_embeds=random_embeds, **kwargs, **inputs)
            for step in range(len(from_random.scores)):
                self.assertFalse(torch.allclose(from_embeds.scores[step], from_random.scores[step]))
            without_ids = model.generate(inputs_embeds=embeds, **kwargs, **inputs)
            from_embeds.sequences = from_embeds.sequences[:, embeds.shape[1]:]
            self._check_similar_generate_outputs(without_ids, from_embeds)

    @pytest.mark.generate
    def test_generate_from_inputs_embeds_with_static_cache(self):
        """``inputs_embeds`` with ``cache_implementation="static"``: the cache is sized for the embedded prompt plus the
        new tokens, and generation runs to the end without overflowing it."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            if config.is_encoder_decoder:
                self.skipTest(reason="encoder-decoder: covered by test_generate_with_static_cache")
            model = self._new_model(model_class, config)
            input_ids = inputs.pop("input_ids")
            inputs.pop("token_type_ids", None)
            model.generation_config.eos_token_id = -1
            max_new_tokens = 5
            embeds = model.get_input_embeddings()(input_ids)
            outputs = model.generate(inputs_embeds=embeds, max_new_tokens=max_new_tokens,
                                     min_new_tokens=max_new_tokens, cache_implementation="static",
                                     return_dict_in_generate=True, **inputs)
            text_config = _text_config(config)
            self._assert_preallocated(outputs.cache)
            self.assertEqual(outputs.sequences.shape[1], max_new_tokens)
            # prompt embeddings + new tokens - 1 slots (the last token is never fed back)
            self._check_cache_for_generate(input_ids.shape[0], outputs.cache, embeds.shape[1] + max_new_tokens - 1,
                                           text_config)

    # ----------------------------------------------------------------------------------- static cache, compile

    @pytest.mark.generate
    def test_generate_with_static_cache(self):
        """``cache_implementation="static"`` gives the dynamic cache's tokens, in a preallocated ``StaticCache``
        (for encoder-decoders its self-attention half)."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            max_new_tokens = 10
            kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, return_dict_in_generate=True,
                          output_scores=True, do_sample=False)
            static = model.generate(**inputs, cache_implementation="static", **kwargs)
            dynamic = model.generate(**inputs, **kwargs)
            self._check_similar_generate_outputs(dynamic, static)
            self._assert_preallocated(static.cache)
            prompt = 1 if config.is_encoder_decoder else inputs["input_ids"].shape[-1]
            # the last generated token is never fed back: the cache has prompt + new - 1 slots
            self._check_cache_for_generate(inputs["input_ids"].shape[0], static.cache, prompt + max_new_tokens - 1,
                                           _text_config(config))

    def _assert_preallocated(self, cache):
        """What ``cache_implementation="static"`` promises: a compileable cache whose layers are preallocated
        (transformers' ``StaticLayer`` or a subclass). Upstream asserts the class ``StaticCache``; a plugin may bring
        its own cache class with static layers."""
        cache = _decoder_cache(cache)
        self.assertTrue(cache.is_compileable, f"{type(cache).__name__} is not compileable")
        for index, layer in enumerate(cache.layers):
            self.assertIsInstance(layer, StaticLayer, f"cache layer {index} is not preallocated")

    def _two_input_sets(self, model_class):
        config, inputs = self.prepare_config_and_inputs_for_generate(batch_size=4)
        halves = []
        for part in (slice(0, 2), slice(2, 4)):
            halves.append({k: v[part] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        return config, halves

    @pytest.mark.slow  # 10-110 s per model on CPU; test_generate_compile_model_forward_fullgraph runs by default
    @pytest.mark.generate
    @pytest.mark.torch_compile_test
    def test_generate_compile_model_forward(self):
        """``generate`` with a static cache compiles the forward (forced on CPU) and gives the eager dynamic-cache
        tokens; run twice with different inputs so that a stale compiled cache would show."""
        for model_class in self.all_generative_model_classes:
            config, input_sets = self._two_input_sets(model_class)
            model = self._new_model(model_class, config)
            torch.compiler.reset()
            model.generation_config.compile_config = CompileConfig()
            model.generation_config.compile_config._compile_all_devices = True
            kwargs = dict(do_sample=False, max_new_tokens=5, min_new_tokens=5, return_dict_in_generate=True,
                          output_scores=True)
            dynamic = [model.generate(**inputs, **kwargs) for inputs in input_sets]
            for output in dynamic:
                self.assertIsInstance(_decoder_cache(output.cache), DynamicCache)
                self.assertFalse(_decoder_cache(output.cache).is_compileable)
            self.assertFalse(hasattr(model, "_compiled_call"), "generate compiled with the dynamic cache")
            compiled = [model.generate(**inputs, cache_implementation="static", **kwargs) for inputs in input_sets]
            self.assertTrue(hasattr(model, "_compiled_call"), "generate did not compile the forward")
            for output in compiled:
                self.assertTrue(_decoder_cache(output.cache).is_compileable)
            for eager, fast in zip(dynamic, compiled):
                self._check_similar_generate_outputs(eager, fast)

    @pytest.mark.generate
    @pytest.mark.torch_compile_test
    def test_generate_compile_model_forward_fullgraph(self):
        """The class says ``_can_compile_fullgraph = True`` and ``generate`` compiles its forward with
        ``fullgraph=True`` (no graph break) over a static cache, giving the eager tokens."""
        for model_class in self.all_generative_model_classes:
            self.assertTrue(model_class._can_compile_fullgraph,
                            f"{model_class.__name__}._can_compile_fullgraph is False")
            config, input_sets = self._two_input_sets(model_class)
            model = self._new_model(model_class, config)
            torch.compiler.reset()
            model.generation_config.compile_config = CompileConfig(fullgraph=True)
            model.generation_config.compile_config._compile_all_devices = True
            kwargs = dict(do_sample=False, max_new_tokens=5, min_new_tokens=5, return_dict_in_generate=True,
                          output_scores=True)
            for inputs in input_sets:
                eager = model.generate(**inputs, **kwargs)
                compiled = model.generate(**inputs, cache_implementation="static", **kwargs)
                self._check_similar_generate_outputs(eager, compiled)
            self.assertTrue(hasattr(model, "_compiled_call"), "generate did not compile the forward")

    @pytest.mark.slow  # 10-40 s per model on CPU
    @pytest.mark.generate
    @pytest.mark.torch_compile_test
    def test_generate_compilation_all_outputs(self):
        """Scores, logits, attention maps and hidden states are well formed when ``generate`` compiles the
        forward (transformers' test of the same name, without its ``_can_compile_fullgraph`` skip)."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            torch.compiler.reset()
            model.generation_config.compile_config = CompileConfig()
            model.generation_config.compile_config._compile_all_devices = True
            model.generation_config.cache_implementation = "static"
            output = self._generate(model, inputs, min_new_tokens=self.max_new_tokens,
                                    **self._dict_output_kwargs(use_cache=True))
            self.assertTrue(hasattr(model, "_compiled_call"), "generate did not compile the forward")
            self._check_sequence_length(model, output.sequences, inputs)
            self._check_generate_outputs(output, model.config, use_cache=True)

    @pytest.mark.generate
    def test_generate_methods_with_logits_to_keep(self):
        for model_class in self.all_generative_model_classes:
            if "logits_to_keep" not in inspect.signature(model_class.forward).parameters:
                self.skipTest(reason=f"{model_class.__name__}.forward takes no logits_to_keep")
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._new_model(model_class, config)
            kwargs = dict(max_new_tokens=10, do_sample=False)
            with_all = model.generate(**kwargs, **inputs, logits_to_keep=0)
            default = model.generate(**kwargs, **inputs)
            self.assertEqual(with_all.tolist(), default.tolist())

    # ------------------------------------------------------------------------- assisted / prompt-lookup decoding

    def _assisted_kwargs(self):
        return {"eos_token_id": -1, "max_new_tokens": 4, "num_beams": 1, "do_sample": False,
                "output_scores": True, "output_logits": True, "output_hidden_states": True,
                "output_attentions": self.has_attentions, "return_dict_in_generate": True, "use_cache": True}

    @parameterized.expand([("random",), ("same",)])
    @pytest.mark.generate
    def test_assisted_decoding_matches_greedy_search(self, assistant_type):
        """Assisted decoding with the model itself (every candidate accepted) or a random model (none accepted)
        gives the greedy tokens and well-formed outputs."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate(batch_size=1)
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            kwargs = self._assisted_kwargs()
            processors = self._logits_processor_kwargs()
            greedy = model.generate(**kwargs, **inputs, **processors)
            assistant = self._new_model(model_class, config) if assistant_type == "random" else model
            assistant.generation_config.num_assistant_tokens = 2
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assisted = model.generate(**kwargs, assistant_model=assistant, **inputs, **processors)
            self._check_similar_generate_outputs(greedy, assisted)
            self._check_generate_outputs(greedy, model.config, use_cache=True)
            self._check_generate_outputs(assisted, model.config, use_cache=True, recording=True)

    @pytest.mark.generate
    def test_prompt_lookup_decoding_matches_greedy_search(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate(batch_size=1)
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            kwargs = self._assisted_kwargs()
            greedy = model.generate(**kwargs, **inputs)
            lookup = model.generate(**kwargs, prompt_lookup_num_tokens=2, **inputs)
            self._check_similar_generate_outputs(greedy, lookup)
            self._check_generate_outputs(greedy, model.config, use_cache=True)
            self._check_generate_outputs(lookup, model.config, use_cache=True, recording=True)

    @pytest.mark.generate
    def test_assisted_decoding_sample(self):
        """Sampling with an assistant runs and returns well-formed outputs (seeded sampling need not match)."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate(batch_size=1)
            self._eager_for_attention_maps(config)
            model = self._new_model(model_class, config)
            model.generation_config.num_assistant_tokens = 2
            model.generation_config.num_assistant_tokens_schedule = "constant"
            kwargs = {**self._assisted_kwargs(), "do_sample": True, "assistant_model": model}
            output = model.generate(**kwargs, **inputs)
            self._check_generate_outputs(output, model.config, use_cache=True, recording=True)


__all__ = ["GenerationTesterMixin"]
