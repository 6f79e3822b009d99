"""The quantised hierarchical MLR cache (``MLRQuantizedCache``, ``MLRQuantizedKeyCacheLayer``): the codec by hand,
cached == uncached with the same rounding (chunks across block boundaries, decode steps, left padding, greedy,
sampling, beam, speculative rollback) under both level rules, the bytes it holds against the formula, transformers'
``QuantizedCache`` composed with MLR layers, and bad settings named."""

import contextlib

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, EncoderDecoderCache, QuantizedCache

import hf_structattn
from hf_structattn.decoder_patching import tiny_decoder
from hf_structattn.modeling.structattn_attention import mlr_attention_forward
from hf_structattn.modeling.structattn_cache_quantized import (
    EntryCodec,
    MLRQuantizedCache,
    MLRQuantizedKeyCacheLayer,
    SlotCodecs,
)
from hf_structattn.modeling.structattn_install import MLR_ATTENTION, mlr_geometry_of
from hf_structattn.modeling.structattn_mlr_plan import GeneralRead
from hf_structattn.modeling.structattn_prepare import key_cache_bytes

from conftest import tiny_lm
from model_helpers import T5_MLR, left_padded, tiny_structattn_t5

VOCAB = 61
RANKS = [8, 4, 4]
BLOCKS = [16, 8]
ARCH_PATCH_KWARGS = {"gemma3": dict(layers=[2])}  # its first two layers slide


def patched(arch="llama", rule="blocks", **kwargs):
    return hf_structattn.patch(tiny_decoder(arch), mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, mlr_level_rule=rule,
                               **{**ARCH_PATCH_KWARGS.get(arch, {}), **kwargs})


@contextlib.contextmanager
def rounded_uncached(bits, group_size=64, key_bits=None):
    """MLR attention whose level-1 key dims and values are rounded as the quantised cache holds them (the same
    ``EntryCodec``; decoder self-attention only, as only it is cached), run without a cache: the reference the
    cached model must equal."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if not getattr(module, "is_decoder", True):  # a T5 encoder's attention: no cache, nothing rounded
            return mlr_attention_forward(module, query, key, value, attention_mask, **kwargs)
        geometry = mlr_geometry_of(module)
        order = geometry.dim_order_index(key.device)
        first = order[:geometry.ranks[0]] if order is not None else torch.arange(geometry.ranks[0])
        codecs = SlotCodecs.build(geometry, value.shape[-1], key_bits or bits, bits, group_size, value.dtype)
        key = key.index_copy(-1, first, codecs.keys.round(key.index_select(-1, first)))
        return mlr_attention_forward(module, query, key, codecs.values.round(value), attention_mask, **kwargs)

    AttentionInterface.register(MLR_ATTENTION, attention)
    try:
        yield
    finally:
        AttentionInterface.register(MLR_ATTENTION, mlr_attention_forward)


def test_the_codec_by_hand():
    codec = EntryCodec.build(4, 2, 64, torch.float64, "keys")
    assert (codec.group, codec.code_bytes, codec.row_bytes) == (4, 8, 8 + 2 * 8)  # 1 byte of codes, padded to 8
    entries = torch.tensor([[0.0, 1.0, 2.9, 3.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    rows, rounded = codec.encode(entries)
    # 4 levels between the minimum and the maximum: step 1.0 and 0 (a constant group keeps its value)
    torch.testing.assert_close(rounded, torch.tensor([[0.0, 1.0, 3.0, 3.0], [5.0] * 4], dtype=torch.float64))
    assert rows[0, 0].item() == 0 | 1 << 2 | 3 << 4 | 3 << 6  # codes 0, 1, 3, 3, low bits first
    torch.testing.assert_close(codec.decode(rows, torch.float64), rounded, rtol=0, atol=0)
    torch.testing.assert_close(rows[0, 8:].view(torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64))
    planar = EntryCodec.build(4, 4, 64, torch.float32, "values")  # byte j: code j, and code j + 2 in the high bits
    rows, rounded = planar.encode(torch.tensor([0.0, 1.0, 14.0, 15.0]))
    assert rows[:2].tolist() == [0 | 14 << 4, 1 | 15 << 4]
    torch.testing.assert_close(planar.decode(rows, torch.float32), rounded, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_decode_gives_what_encode_rounded_within_the_step(bits, dtype):
    codec = EntryCodec.build(12, bits, 4, dtype, "values")  # 3 groups, an odd code count for 2 and 4 bits
    entries = torch.randn(2, 3, 5, 12, dtype=torch.float64).to(dtype) * 3
    rows, rounded = codec.encode(entries)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == codec.row_bytes
    torch.testing.assert_close(codec.decode(rows, dtype), rounded, rtol=0, atol=0)
    grouped = entries.double().unflatten(-1, (3, 4))
    step = (grouped.amax(-1) - grouped.amin(-1)) / ((1 << bits) - 1)
    error = (rounded.double() - entries.double()).unflatten(-1, (3, 4)).abs().amax(-1)
    assert (error <= step / 2 + 0.02 * grouped.abs().amax(-1)).all()  # half a step, plus the dtype's rounding


@pytest.mark.parametrize("rule", ["blocks", "nearest"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "gemma3"])
def test_chunked_prefill_and_decode_equal_uncached_with_the_same_rounding(arch, rule):
    mlr = patched(arch, rule)
    ids = torch.randint(1, VOCAB, (3, 37))
    with rounded_uncached(4):
        uncached = mlr(ids, use_cache=False).logits
    assert (uncached - mlr(ids, use_cache=False).logits).abs().max() > 1e-3  # the rounding is seen
    cache = MLRQuantizedCache(config=mlr.config, bits=4)
    bounds = [(0, 13), (13, 30), (30, 31)] + [(i, i + 1) for i in range(31, 37)]
    chunked = torch.cat([mlr(ids[:, a:b], cache=cache, use_cache=True).logits for a, b in bounds], dim=1)
    torch.testing.assert_close(chunked, uncached, rtol=0, atol=1e-12)
    layers = [layer for layer in cache.layers if isinstance(layer, MLRQuantizedKeyCacheLayer)]
    assert layers and all(layer.keys.dtype == torch.uint8 for layer in layers)


@pytest.mark.parametrize("key_bits, bits", [(2, 4), (8, 2)])
def test_several_groups_per_entry_equal_uncached_with_the_same_rounding(key_bits, bits):
    mlr = patched("qwen3", "nearest")  # level-1 keys of 8 dims and values of 16 in groups of 4
    ids = torch.randint(1, VOCAB, (2, 30))
    with rounded_uncached(bits, group_size=4, key_bits=key_bits):
        uncached = mlr(ids, use_cache=False).logits
    cache = MLRQuantizedCache(config=mlr.config, bits=bits, key_bits=key_bits, group_size=4)
    steps = [mlr(ids[:, :17], cache=cache).logits] + [mlr(ids[:, i:i + 1], cache=cache).logits for i in range(17, 30)]
    torch.testing.assert_close(torch.cat(steps, 1), uncached, rtol=0, atol=1e-12)


def test_the_gpt2_and_t5_families_quantise_what_their_configs_build():
    """The GPT-2 family's config names its MLR layers, so ``DynamicCache(config=...)`` builds plain MLR layers: an
    ``MLRQuantizedCache`` quantises them all the same. T5: the self-attention part of an ``EncoderDecoderCache``."""
    lm = tiny_lm("mlr", n_layer=2).double()
    ids = torch.randint(2, 61, (2, 40))
    with rounded_uncached(4, key_bits=8):
        uncached = lm(ids, use_cache=False).logits
    assert (uncached - lm(ids, use_cache=False).logits).abs().max() > 1e-3  # the rounding is seen
    cache = MLRQuantizedCache(config=lm.config, bits=4, key_bits=8)
    steps = [lm(ids[:, :33], cache=cache).logits] + [lm(ids[:, i:i + 1], cache=cache).logits for i in range(33, 40)]
    assert all(type(layer) is MLRQuantizedKeyCacheLayer for layer in cache.layers)
    torch.testing.assert_close(torch.cat(steps, 1), uncached, rtol=0, atol=1e-12)
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    prompt = ids[:1, :8].repeat(1, 3)  # repeated n-grams: prompt lookup drafts, and the model rejects some
    greedy = lm.generate(prompt, cache=MLRQuantizedCache(config=lm.config, bits=4, key_bits=8), **kwargs)
    looked_up = lm.generate(prompt, cache=MLRQuantizedCache(config=lm.config, bits=4, key_bits=8),
                            prompt_lookup_num_tokens=3, **kwargs)  # the rollback log carried to the quantised layers
    assert torch.equal(looked_up, greedy)
    t5 = tiny_structattn_t5(**T5_MLR).double()
    inputs = torch.randint(2, 50, (2, 9))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
    self_attention = MLRQuantizedCache(config=t5.config, bits=4, key_bits=8)
    cached = t5.generate(inputs, cache=EncoderDecoderCache(self_attention, DynamicCache()), **kwargs)
    assert any(type(layer) is MLRQuantizedKeyCacheLayer for layer in self_attention.layers)
    with rounded_uncached(4, key_bits=8):
        uncached = t5.generate(inputs, use_cache=False, **kwargs)
    plain = torch.stack(t5.generate(inputs, use_cache=False, **kwargs).scores)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), rtol=0, atol=1e-12)
    seen = (plain - torch.stack(uncached.scores)).nan_to_num()  # (-inf - -inf at the suppressed end token)
    assert seen.abs().max() > 1e-4  # the rounding is seen


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_low_precision_decode_steps_equal_uncached_within_the_dtype(dtype, tolerance):
    mlr = patched("llama", "nearest").to(dtype)
    ids = torch.randint(1, VOCAB, (2, 30))
    with rounded_uncached(4, key_bits=8):
        uncached = mlr(ids, use_cache=False).logits.float()
    cache = MLRQuantizedCache(config=mlr.config, bits=4, key_bits=8)
    steps = [mlr(ids[:, :20], cache=cache).logits] + [mlr(ids[:, i:i + 1], cache=cache).logits for i in range(20, 30)]
    assert cache.layers[0].codecs.values.dtype == dtype  # scales and minimums in the model's dtype
    scale = uncached.abs().max().item()
    torch.testing.assert_close(torch.cat(steps, 1).float(), uncached, rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize("rule", ["blocks", "nearest"])
def test_left_padded_greedy_sampling_and_beam_equal_uncached_with_the_same_rounding(rule):
    mlr = patched("llama", rule)
    ids = torch.randint(3, VOCAB, (3, 20))
    batch, mask, _ = left_padded(ids, [0, 3, 7], 20)
    cases = [dict(do_sample=False), dict(do_sample=True, top_k=0, num_return_sequences=2),
             dict(num_beams=3, do_sample=False)]
    for kwargs in cases:
        kwargs = dict(attention_mask=mask, max_new_tokens=14, min_new_tokens=14, **kwargs)  # past both block sizes
        torch.manual_seed(7)
        cached = mlr.generate(batch, cache=MLRQuantizedCache(config=mlr.config, bits=4, key_bits=8), **kwargs)
        with rounded_uncached(4, key_bits=8):
            torch.manual_seed(7)
            uncached = mlr.generate(batch, use_cache=False, **kwargs)
        assert torch.equal(cached, uncached), kwargs


def test_assisted_decoding_and_prompt_lookup_roll_the_quantised_cache_back_exactly():
    mlr, assistant = patched("llama", "nearest"), patched("llama", "nearest")
    with torch.no_grad():
        for param in assistant.parameters():
            param.add_(torch.randn_like(param) * 0.5)  # some drafts are rejected
    mlr.generation_config.num_assistant_tokens = 3
    mlr.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.randint(3, VOCAB, (1, 24))
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    greedy = mlr.generate(ids, cache=MLRQuantizedCache(config=mlr.config, bits=4), **kwargs)
    for extra in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=3)):
        got = mlr.generate(ids, cache=MLRQuantizedCache(config=mlr.config, bits=4), **kwargs, **extra)
        assert torch.equal(got, greedy), extra.keys()


@pytest.mark.parametrize("key_bits, bits", [(4, 4), (8, 4), (8, 8)])
def test_the_cache_holds_the_bytes_of_the_formula(key_bits, bits):
    mlr = patched("llama", "nearest")
    ids = torch.randint(3, VOCAB, (2, 30))
    cache = MLRQuantizedCache(config=mlr.config, bits=bits, key_bits=key_bits)
    mlr(ids, cache=cache)
    config = mlr.config
    heads, head_dim = config.num_key_value_heads, config.head_dim
    slots, item = 30, 8  # float64 scales, minimums and ring entries
    # one group per level-1 key (8 dims) and per value (head_dim <= 64): codes padded to 8 bytes, a scale and a minimum
    key_row = -(-(-(-RANKS[0] * key_bits // 8)) // item) * item + 2 * item
    value_row = -(-(-(-head_dim * bits // 8)) // item) * item + 2 * item
    rings = sum(min(size, slots) * rank for size, rank in zip(BLOCKS, RANKS[1:])) * item
    layers = [layer for layer in cache.layers if isinstance(layer, MLRQuantizedKeyCacheLayer)]
    assert len(layers) == config.num_hidden_layers
    assert key_cache_bytes(cache) == len(layers) * 2 * heads * (slots * key_row + rings)
    for layer in layers:
        assert layer.value_cache_bytes() == 2 * heads * slots * value_row
        assert layer.keys.shape[-1] == key_row and layer.values.shape[-1] == value_row
    plain = DynamicCache(config=config)
    mlr(ids, cache=plain)
    assert key_cache_bytes(cache) < key_cache_bytes(plain)


def test_the_quantised_layer_reads_by_the_general_read():
    mlr = patched("llama", "nearest")
    cache = MLRQuantizedCache(config=mlr.config, bits=4)
    ids = torch.randint(3, VOCAB, (1, 12))
    mlr(ids, cache=cache)
    seen = []
    original = cache.layers[0].update

    def update(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(type(out[1].plan.read))
        return out

    cache.layers[0].update = update
    mlr(ids[:, :1], cache=cache)
    assert seen == [GeneralRead]


def test_transformers_quantized_cache_gives_the_mlr_layers_codes_of_its_width():
    pytest.importorskip("optimum.quanto")
    # every layer MLR: no quanto kernel runs (its CPU extension is compiled on first use, about a minute)
    mlr = patched("llama", "nearest")
    ids = torch.randint(3, VOCAB, (1, 20))
    cache = QuantizedCache(backend="quanto", config=mlr.config, nbits=4, q_group_size=64)
    greedy = mlr.generate(ids, cache=cache, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert all(type(layer) is MLRQuantizedKeyCacheLayer and layer.bits == layer.key_bits == 4 for layer in cache.layers)
    assert cache.layers[1].keys.dtype == torch.uint8
    assert torch.equal(greedy, mlr.generate(ids, cache=MLRQuantizedCache(config=mlr.config, bits=4),
                                            max_new_tokens=10, min_new_tokens=10, do_sample=False))
    assert torch.equal(greedy, mlr.generate(ids, cache_implementation="quantized",
                                            cache_config={"backend": "quanto", "nbits": 4},
                                            max_new_tokens=10, min_new_tokens=10, do_sample=False))


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="bits must be one of .* got 3"):
        MLRQuantizedCache(bits=3)
    with pytest.raises(ValueError, match="group_size must be a positive int .* got 0"):
        MLRQuantizedKeyCacheLayer(group_size=0)
    with pytest.raises(ValueError, match="key_bits must be one of .* got 16"):
        MLRQuantizedCache(bits=4, key_bits=16)
    mlr = patched("llama", "nearest")
    with pytest.raises(ValueError, match="group_size 3 does not divide the 8 dims of the level-1 keys"):
        mlr(torch.randint(3, VOCAB, (1, 5)), cache=MLRQuantizedCache(config=mlr.config, bits=4, group_size=3))
