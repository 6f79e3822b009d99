"""T5-style structured-attention models: parity with transformers' T5, MLR key cache and generation, left
padding, config validation, Auto registration and save/load."""

import pytest
import torch
import transformers

from hf_structattn import StructAttnT5Config, StructAttnT5EncoderModel, StructAttnT5ForConditionalGeneration

from model_helpers import T5_BASE, T5_MLR, tiny_structattn_t5

EXACT = dict(atol=1e-12, rtol=1e-12)  # float64 exactness


def _padded_batch():
    torch.manual_seed(1)
    ids = torch.randint(2, 50, (2, 21))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding, as Chronos does
    return ids, mask


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("feed_forward_proj", ["relu", "gated-gelu"])
@pytest.mark.parametrize("attention", ["dense", "mlr_one_level", "mlr_long_blocks"])
def test_logits_equal_t5_with_its_weights(attention, feed_forward_proj, attn_implementation):
    torch.manual_seed(0)
    config = transformers.T5Config(**T5_BASE, feed_forward_proj=feed_forward_proj,
                                   attn_implementation=attn_implementation)
    # float64: parity must be exact on any CPU (num_decoder_layers (3) != num_layers (2))
    t5 = transformers.T5ForConditionalGeneration(config).double().eval()
    fields = {"dense": {},
              "mlr_one_level": dict(encoder_attention="mlr", decoder_attention="mlr", mlr_ranks=[8],
                                    mlr_block_sizes=[]),
              # every block covers the whole (<= 32 tokens) sequence: must be dense attention
              "mlr_long_blocks": dict(encoder_attention="mlr", decoder_attention="mlr", mlr_ranks=[4, 2, 2],
                                      mlr_block_sizes=[64, 32])}[attention]
    ours = StructAttnT5ForConditionalGeneration(StructAttnT5Config(
        **T5_BASE, feed_forward_proj=feed_forward_proj, attn_implementation=attn_implementation, **fields))
    ours = ours.double().eval()
    assert list(ours.state_dict()) == list(t5.state_dict())
    ours.load_state_dict(t5.state_dict(), strict=True)
    ids, mask = _padded_batch()
    decoder_ids = torch.randint(2, 50, (2, 9))
    expected = t5(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    got = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, expected, **EXACT)
    encoder = StructAttnT5EncoderModel(StructAttnT5Config(**T5_BASE, feed_forward_proj=feed_forward_proj, **fields))
    encoder = encoder.double()
    encoder.load_state_dict({k: v for k, v in t5.state_dict().items() if not k.startswith(("decoder", "lm_head"))})
    torch.testing.assert_close(encoder.eval()(input_ids=ids, attention_mask=mask).last_hidden_state[0],
                               t5.encoder(input_ids=ids, attention_mask=mask).last_hidden_state[0], **EXACT)


def test_mlr_changes_the_function_and_follows_real_token_positions():
    model = tiny_structattn_t5(**T5_MLR).double()
    dense = tiny_structattn_t5().double()  # same seed: same weights, dense attention
    ids, mask = _padded_batch()
    decoder_ids = torch.randint(2, 50, (2, 12))
    batched = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    assert not torch.allclose(batched, dense(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits,
                              atol=1e-3)
    # a left-padded row is computed exactly as the row alone (blocks follow cumsum(mask) - 1)
    alone = model(input_ids=ids[1:, 6:], decoder_input_ids=decoder_ids[1:]).logits
    torch.testing.assert_close(batched[1:], alone, **EXACT)


@pytest.mark.parametrize("average_levels", [False, True])
def test_cached_decoding_logits_equal_uncached_across_block_boundaries(average_levels):
    """float64: the cached path is exact (softmax in promote_types(dtype, float32)), not only float32-close."""
    model = tiny_structattn_t5(**T5_MLR, mlr_average_levels=average_levels).double()
    ids, mask = _padded_batch()
    decoder_ids = torch.randint(2, 50, (2, 19))  # crosses the 4- and 8-blocks several times
    reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, use_cache=False).logits
    encoder_out = model.encoder(input_ids=ids, attention_mask=mask)
    cache = model.new_cache()
    steps, start = [], 0
    for size in [5, 6] + [1] * 8:  # chunked prefill (5 tokens, then 6 across the 8-boundary), then decode
        out = model(encoder_outputs=encoder_out, attention_mask=mask, decoder_input_ids=decoder_ids[:, start:start + size],
                    cache=cache, use_cache=True)
        steps.append(out.logits)
        start += size
    # measured 2.4e-15 on logits of size ~4 (also under ATEN_CPU_CAPABILITY=default); a float32 softmax anywhere in
    # the cached path would give ~1e-7
    torch.testing.assert_close(torch.cat(steps, 1), reference, **EXACT)
    layers = cache.self_attention_cache.layers
    assert [type(layer).__name__ for layer in layers] == ["MLRKeyCacheLayer"] * T5_BASE["num_decoder_layers"]
    # level 3 (block 4) holds one block of keys (position p at entry p % 4); level 1 holds all 19 positions
    assert layers[0].rings[1].shape[-2] == 4 and layers[0].keys.shape[-2] == 19


def test_decoder_masks_follow_the_mask_shape_rule_and_encoder_masks_are_2d():
    """The mask-shape rule in T5's decoder: a (B, 1, T, T), a (1, 1, T, T) (broadcast over the batch) and a per-head
    (B, H, T, T) decoder_attention_mask give, cached (chunks and steps) and uncached, what the mask expanded to
    (B, H, T, T) gives uncached; heads that differ are applied per head. The encoder's attention_mask, which T5
    applies to the cross-attention too, must be 2-D: a 4-D one is one line (stock T5 fails with a raw error)."""
    model = tiny_structattn_t5(**T5_MLR).double()
    ids, mask = _padded_batch()
    decoder_ids = torch.randint(2, 50, (2, 12), generator=torch.Generator().manual_seed(4))
    query, key = torch.arange(12)[:, None], torch.arange(12)[None]
    windows = torch.stack([(key <= query) & (key > query - 2 - head) for head in range(T5_BASE["num_heads"])])
    encoder_out = model.encoder(input_ids=ids, attention_mask=mask)

    def logits(decoder_mask, use_cache):
        if not use_cache:
            return model(encoder_outputs=encoder_out, attention_mask=mask, decoder_input_ids=decoder_ids,
                         decoder_attention_mask=decoder_mask, use_cache=False).logits
        cache, steps = model.new_cache(), []
        for start, end in [(0, 5), (5, 9), (9, 10), (10, 11), (11, 12)]:
            steps.append(model(encoder_outputs=encoder_out, attention_mask=mask,
                               decoder_input_ids=decoder_ids[:, start:end], cache=cache, use_cache=True,
                               decoder_attention_mask=decoder_mask[:, :, start:end, :end]).logits)
        return torch.cat(steps, 1)

    for decoder_mask in (windows[:1][None], windows[None]):  # one window for every head, one per head
        expected = logits(decoder_mask.expand(2, T5_BASE["num_heads"], 12, 12), use_cache=False)
        for given in (decoder_mask, decoder_mask.expand(2, -1, -1, -1)):
            for use_cache in (False, True):
                torch.testing.assert_close(logits(given, use_cache), expected, **EXACT)
    per_head = logits(windows[None], use_cache=False)
    assert (per_head - logits(windows[:1][None], use_cache=False)).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"attention_mask of a T5 encoder-decoder must be the encoder's \(2, 21\) "
                                         r"keep-mask") as raised:
        model(input_ids=ids, attention_mask=torch.ones(2, 1, 21, 21, dtype=torch.bool), decoder_input_ids=decoder_ids)
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=r"a 4-D attention_mask must have shape \(2 or 1, 1 or 4, 12, >= 12\)"):
        model(encoder_outputs=encoder_out, attention_mask=mask, decoder_input_ids=decoder_ids,
              decoder_attention_mask=windows[None, :3], use_cache=False)


@pytest.mark.parametrize("fields", [T5_MLR, dict(decoder_attention="bilinear_mlr", cross_attention="bilinear_btt",
                                               encoder_attention="bilinear_mlr", bilinear_mlr_ranks=[4, 2])])
def test_generate_same_with_and_without_cache(fields):
    model = tiny_structattn_t5(**fields)
    ids, mask = _padded_batch()
    common = dict(attention_mask=mask, max_new_tokens=18, min_new_tokens=18, do_sample=False)
    greedy = model.generate(ids, **common)
    assert greedy.shape == (2, 19)
    torch.testing.assert_close(greedy, model.generate(ids, use_cache=False, **common))
    beams = model.generate(ids, num_beams=3, num_return_sequences=2, **common)
    torch.testing.assert_close(beams, model.generate(ids, num_beams=3, num_return_sequences=2, use_cache=False,
                                                     **common))
    # the left-padded row generates what it generates alone
    alone = model.generate(ids[1:, 6:], max_new_tokens=18, min_new_tokens=18, do_sample=False)
    torch.testing.assert_close(greedy[1:], alone)


@pytest.mark.parametrize("fields,match", [
    (dict(cross_attention="mlr", mlr_ranks=[4, 4]), "cross_attention='mlr'"),
    (dict(encoder_attention="mlx"), "encoder_attention='mlx'"),
    (dict(decoder_attention="mlr"), "mlr_ranks is required"),
    (dict(encoder_attention="mlr", mlr_ranks=[4, 2]), "mlr_ranks"),
    (dict(encoder_attention="mlr", mlr_ranks=[4, 2, 2], mlr_block_sizes=[8, 3]), "mlr_block_sizes"),
    (dict(encoder_attention="mlr", mlr_ranks=[4, 4], mlr_scaling="fancy"), "mlr_scaling"),
    (dict(encoder_attention="bilinear_mlr"), "bilinear_mlr_ranks"),
    (dict(cross_attention="bilinear_btt", btt_factors=[3, 4, 4, 8]), "btt_factors"),
])
def test_invalid_config_names_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        StructAttnT5Config(**T5_BASE, **fields)


def test_auto_classes_and_save_load_keep_extra_keys(tmp_path):
    model = tiny_structattn_t5(**T5_MLR, chronos_config={"context_length": 64, "prediction_length": 8})
    model.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(config) is StructAttnT5Config and config.chronos_config["prediction_length"] == 8
    assert config.auto_map["AutoModelForSeq2SeqLM"] == "modeling_structattn_t5.StructAttnT5ForConditionalGeneration"
    loaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is StructAttnT5ForConditionalGeneration
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    assert type(transformers.AutoModel.from_pretrained(tmp_path)).__name__ == "StructAttnT5Model"
    assert type(transformers.AutoModelForTextEncoding.from_pretrained(tmp_path)) is StructAttnT5EncoderModel
    for name in ("modeling_structattn_t5.py", "structattn_cache.py", "structattn_qk.py", "structattn_pretrained.py"):
        assert (tmp_path / name).exists(), name


@pytest.mark.parametrize("average_levels", [False, True])
def test_static_cache_generates_what_the_dynamic_cache_generates(average_levels):
    model = tiny_structattn_t5(**T5_MLR, mlr_average_levels=average_levels)
    ids, mask = _padded_batch()
    common = dict(attention_mask=mask, max_new_tokens=18, min_new_tokens=18, do_sample=False)
    for kwargs in ({}, dict(num_beams=3, num_return_sequences=2)):
        torch.testing.assert_close(model.generate(ids, cache_implementation="static", **common, **kwargs),
                                   model.generate(ids, **common, **kwargs))
    cache = model.new_cache(max_cache_len=24)
    assert type(cache.self_attention_cache.layers[0]).__name__ == "MLRStaticKeyCacheLayer"


def test_speculative_decoding_of_t5_equals_greedy():
    """transformers runs assisted and prompt-lookup decoding for encoder-decoders too: the MLR decoder cache is
    rolled back over drafts that cross its 8- and 4-token blocks, and the tokens are the greedy ones (float64); an MLR
    assistant's cache is rolled back too.
    (With a static cache transformers 5.24 refuses to crop any ``EncoderDecoderCache``:
    ``EncoderDecoderCache.check_dynamic_cache`` raises a TypeError, for stock T5 too.)"""
    cache_implementation = None
    model = tiny_structattn_t5(**T5_MLR).double()
    with torch.no_grad():  # sharper than the tiny init, so that drafts are both accepted and rejected
        for param in model.parameters():
            param.mul_(3.0)
    assistant = tiny_structattn_t5(seed=1, **T5_MLR).double()
    ids = torch.randint(2, 50, (1, 21), generator=torch.Generator().manual_seed(2))
    # 60 tokens: the unrelated assistant's drafts are mostly rejected, so its own cache is cropped by more than
    # one draft length (the main model's corrections come on top) -- its rollback log must not be bounded by it
    common = dict(max_new_tokens=60, min_new_tokens=60, do_sample=False, cache_implementation=cache_implementation)
    greedy = model.generate(ids, **common)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=4, **common), greedy)
    assert torch.equal(model.generate(ids, assistant_model=assistant, **common), greedy)

