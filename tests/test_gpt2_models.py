"""GPT-2-style structured-attention models: parity with transformers' GPT-2, the hierarchical key cache and
generation ("logits with cache == logits without cache"), config validation."""

import pytest
import torch
import transformers

from hf_structattn import (
    StructAttnGPT2Config,
    StructAttnGPT2ForInContextRegression,
    StructAttnGPT2LMHeadModel,
    StructAttnGPT2Model,
)
from hf_structattn.flops import key_cache_elements
from hf_structattn.modeling.structattn_prepare import key_cache_bytes

from conftest import VARIANT_FIELDS, tiny_gpt2_config, tiny_lm

ALL_VARIANTS = list(VARIANT_FIELDS)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("attention", ["dense", "mlr_one_level", "mlr_long_blocks"])
def test_logits_equal_gpt2_with_its_weights(attention, attn_implementation):
    torch.manual_seed(0)
    gpt2_config = transformers.GPT2Config(vocab_size=61, n_positions=64, n_embd=32, n_layer=3, n_head=2,
                                          attn_pdrop=0.0, attn_implementation=attn_implementation)
    gpt2 = transformers.GPT2LMHeadModel(gpt2_config).double().eval()  # float64: exact parity, any CPU
    fields = dict(attention="dense")
    if attention == "mlr_one_level":
        fields = dict(attention="mlr", mlr_ranks=[16], mlr_block_sizes=[])
    elif attention == "mlr_long_blocks":  # every block covers the whole sequence: must be dense attention
        fields = dict(attention="mlr", mlr_ranks=[8, 4, 4], mlr_block_sizes=[64, 32])
    config = StructAttnGPT2Config(vocab_size=61, n_positions=64, n_embd=32, n_layer=3, n_head=2, **fields,
                                  attn_implementation=attn_implementation)
    model = StructAttnGPT2LMHeadModel(config).double().eval()
    result = model.load_state_dict(gpt2.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ids = torch.randint(0, 61, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :4] = 0
    length = 30  # < 32: with mlr_long_blocks every token shares every block
    torch.testing.assert_close(model(ids[:, :length]).logits, gpt2(ids[:, :length]).logits, **EXACT)
    if attention == "dense":
        ours = model(ids, attention_mask=mask).logits
        theirs = gpt2(ids, attention_mask=mask).logits
        torch.testing.assert_close(ours[0], theirs[0], **EXACT)
        torch.testing.assert_close(ours[1, 4:], theirs[1, 4:], **EXACT)


def _chunked_logits(model, ids, attention_mask, chunks):
    """Prefill in chunks of the given sizes, then token by token; returns logits for every position."""
    cache = model.transformer.new_cache()
    logits, start = [], 0
    for size in chunks + [1] * (ids.shape[1] - sum(chunks)):
        end = start + size
        mask = attention_mask[:, :end] if attention_mask is not None else None
        positions = None
        if attention_mask is not None:
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, start:end]
        out = model(ids[:, start:end], cache=cache, attention_mask=mask, position_ids=positions, use_cache=True)
        logits.append(out.logits)
        start = end
    return torch.cat(logits, dim=1), cache


EXACT = dict(atol=1e-12, rtol=1e-12)  # float64 exactness tests (cached vs uncached)


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_chunked_prefill_and_decode_match_uncached_forward(variant):
    model = tiny_lm(variant).double()
    ids = torch.randint(2, 61, (2, 60))
    reference = model(ids).logits
    # prefill 11 (inside the first 16-block), a chunk of 13 that crosses the 16 and 32 boundaries, then decode
    # across the 8/16/32 block boundaries one token at a time
    cached, _ = _chunked_logits(model, ids, None, [11, 13])
    torch.testing.assert_close(cached, reference, **EXACT)


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_left_padded_batch_matches_each_row_alone(variant):
    model = tiny_lm(variant).double()
    torch.manual_seed(1)
    lengths = [37, 29, 40]
    rows = [torch.randint(2, 61, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.full((3, width), 1)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batched = model(ids, attention_mask=mask, position_ids=positions).logits
    cached, _ = _chunked_logits(model, ids, mask, [width - 9])
    for i, row in enumerate(rows):
        alone = model(row[None]).logits[0]
        torch.testing.assert_close(batched[i, width - len(row):], alone, **EXACT)
        torch.testing.assert_close(cached[i, width - len(row):], alone, **EXACT)


@pytest.mark.parametrize("variant", ["mlr", "mixed", "bilinear_btt", "mlr_avg_mup"])
def test_generate_same_tokens_with_and_without_cache(variant):
    model = tiny_lm(variant)
    prompt = torch.randint(2, 61, (2, 6))
    mask = torch.ones_like(prompt)
    common = dict(max_new_tokens=40, min_new_tokens=40, attention_mask=mask, pad_token_id=1)
    greedy = model.generate(prompt, do_sample=False, **common)
    assert greedy.shape == (2, 46)
    torch.testing.assert_close(greedy, model.generate(prompt, do_sample=False, use_cache=False, **common))
    beams = model.generate(prompt, do_sample=False, num_beams=3, num_return_sequences=2, **common)
    torch.testing.assert_close(beams, model.generate(prompt, do_sample=False, num_beams=3, num_return_sequences=2,
                                                     use_cache=False, **common))
    torch.manual_seed(7)
    sampled = model.generate(prompt, do_sample=True, top_k=20, num_return_sequences=2, **common)
    torch.manual_seed(7)
    torch.testing.assert_close(sampled, model.generate(prompt, do_sample=True, top_k=20, num_return_sequences=2,
                                                       use_cache=False, **common))


def test_generate_left_padded_batch_matches_rows_alone():
    model = tiny_lm("mlr")
    short, long = torch.randint(2, 61, (5,)), torch.randint(2, 61, (12,))
    ids = torch.full((2, 12), 1)
    ids[0, 7:], ids[1] = short, long
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 7:], mask[1] = 1, 1
    common = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=1)
    batched = model.generate(ids, attention_mask=mask, **common)
    torch.testing.assert_close(batched[0, 7:], model.generate(short[None], **common)[0])
    torch.testing.assert_close(batched[1], model.generate(long[None], **common)[0])


def test_key_cache_holds_the_formula_bytes():
    model = tiny_lm("mlr")
    config = model.config
    ranks, blocks, head_dim = config.resolved_mlr_ranks, config.resolved_mlr_block_sizes, config.head_dim
    for total in (5, 16, 33, 64):
        _, cache = _chunked_logits(model, torch.randint(2, 61, (3, total)), None, [min(total, 9)])
        layer = cache.layers[0]
        assert type(layer).__name__ == "MLRKeyCacheLayer"
        expected = key_cache_elements("mlr", total, ranks, blocks, head_dim)
        assert layer.key_cache_elements() == expected
        itemsize = layer.keys.element_size()
        assert key_cache_bytes(cache) == config.n_layer * 3 * config.n_head * expected * itemsize
        assert layer.values.shape == (3, config.n_head, total, head_dim)
    # at the training length the keys are 0.625x of dense keys for ranks 8|4|2|2 and blocks 32|16|8
    assert expected / (64 * head_dim) == pytest.approx((64 * 8 + 32 * 4 + 16 * 2 + 8 * 2) / (64 * 16))


def test_positions_beyond_n_positions_fail_clearly():
    model = tiny_lm("mlr")
    with pytest.raises(ValueError, match="n_positions=64"):
        model(torch.randint(2, 61, (1, 65)))
    with pytest.raises(ValueError, match="n_positions"):
        model.generate(torch.randint(2, 61, (1, 60)), max_new_tokens=10, do_sample=False, pad_token_id=1)


@pytest.mark.parametrize("embeds", [False, True])
@pytest.mark.parametrize("request_kwargs,asked", [(dict(max_new_tokens=10), "max_new_tokens=10"),
                                                   (dict(max_length=70), "max_length=70")])
def test_generate_refuses_a_request_beyond_n_positions_before_any_forward(request_kwargs, asked, embeds):
    model = tiny_lm("mlr")
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    ids = torch.randint(2, 61, (2, 60))
    prompt = dict(inputs_embeds=model.transformer.wte(ids).detach()) if embeds else dict(input_ids=ids)
    with pytest.raises(ValueError, match=rf"^generate: a 60-token prompt \+ 10 new tokens \({asked}\) needs 70 "
                                         rf"positions, beyond n_positions=64 .*ask for at most 4 new tokens$"):
        model.generate(**prompt, do_sample=False, **request_kwargs)
    assert forwards == []  # refused up front, not at position 64 in the middle of decoding
    # the largest request that fits runs to the last learned position
    out = model.generate(**prompt, do_sample=False, max_new_tokens=4, min_new_tokens=4)
    assert out.shape == ((2, 4) if embeds else (2, 64)) and forwards
    if embeds:  # transformers caps its default length at n_positions for input_ids, not for an embeds-only prompt
        with pytest.raises(ValueError, match=r"^generate: a 60-token prompt \+ 20 new tokens \(transformers' "
                                             r"default length\) needs 80 positions"):
            model.generate(**prompt, do_sample=False)


def test_mlr_cache_crops_only_what_it_recorded():
    model = tiny_lm("mlr")
    _, cache = _chunked_logits(model, torch.randint(2, 61, (1, 20)), None, [20])
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-2)
    cache.crop(0)  # drops nothing: always allowed
    cache.activate_past_recording()
    model(torch.randint(2, 61, (1, 3)), cache=cache)
    with pytest.raises(ValueError, match=r"crop\(-4\): only the 3 tokens written since the last crop"):
        cache.crop(-4)


@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup"])
def test_user_supplied_dynamic_cache_is_exact(variant):
    model = tiny_lm(variant).double()
    ids = torch.randint(2, 61, (2, 40))
    cache = transformers.DynamicCache()
    first = model(ids[:, :21], cache=cache, use_cache=True).logits
    rest = [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(21, 40)]
    torch.testing.assert_close(torch.cat([first] + rest, 1), model(ids).logits, **EXACT)


@pytest.mark.parametrize("fields,match", [
    (dict(attention="mlx"), "attention='mlx'"),
    (dict(attention="mlr", mlr_ranks=[8, 4]), "mlr_ranks"),
    (dict(attention="mlr", mlr_ranks=[8, 4, 4], mlr_block_sizes=[32, 12]), "mlr_block_sizes"),
    (dict(attention="mlr", mlr_ranks=[8, 8], attn_pdrop=0.1), "attn_pdrop"),
    (dict(attention="mlr", mlr_ranks=[8, 8], mlr_scaling="fancy"), "mlr_scaling"),
    (dict(attention="mlr", mlr_ranks=[8, 2, 2, 2, 2], n_positions=20), "n_positions"),
    (dict(attention="bilinear_mlr"), "bilinear_mlr_ranks"),
    (dict(attention="bilinear_mlr", bilinear_mlr_ranks=[1] * 7), "n_embd"),
    (dict(attention="bilinear_btt", btt_factors=[3, 4, 4, 8]), "btt_factors"),
    (dict(attention="swa"), "sliding_window"),
    (dict(attention="dense", attention_layers=["dense"]), "attention_layers"),
    (dict(attention="dense", attention_layers=["dense", "global"]), "attention_layers"),
    (dict(attention="dense", n_head=3), "n_head"),
])
def test_invalid_config_names_the_field(fields, match):
    base = dict(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    base.update(fields)
    with pytest.raises(ValueError, match=match):
        StructAttnGPT2Config(**base)


def test_in_context_regression_model_predicts_y_at_x_positions():
    config = tiny_gpt2_config("bilinear_btt", icl_input_dim=4, vocab_size=1)
    torch.manual_seed(0)
    model = StructAttnGPT2ForInContextRegression(config)
    xs = torch.randn(3, 8, 4) / 2
    ys = (xs * torch.randn(3, 1, 4)).sum(-1)
    out = model(xs, ys)
    assert out.predictions.shape == (3, 8)
    assert torch.count_nonzero(out.predictions) == 0  # zero-initialised read-out
    torch.testing.assert_close(out.loss, (ys ** 2).mean())
    # causality: a prediction at x_i does not depend on y_i or anything later
    out.loss.backward()
    changed = ys.clone()
    changed[:, 5:] += 1.0
    with torch.no_grad():
        model.read_out.weight.normal_()
        before, after = model(xs, ys).predictions, model(xs, changed).predictions
    torch.testing.assert_close(before[:, :6], after[:, :6])
    assert not torch.allclose(before[:, 6:], after[:, 6:])
    with pytest.raises(ValueError, match="icl_input_dim"):
        model(torch.randn(1, 4, 5), torch.randn(1, 4))


def test_save_and_load_keep_every_tensor(tmp_path):
    model = tiny_lm("mixed")
    model.save_pretrained(tmp_path)
    loaded = StructAttnGPT2LMHeadModel.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    base = StructAttnGPT2Model.from_pretrained(tmp_path)
    torch.testing.assert_close(base.wte.weight, model.transformer.wte.weight)
    # the ICL read-out is zero-initialised for new models only, never on load
    config = tiny_gpt2_config("dense", icl_input_dim=3, vocab_size=1)
    icl = StructAttnGPT2ForInContextRegression(config)
    with torch.no_grad():
        icl.read_out.weight.fill_(0.5)
    icl.save_pretrained(tmp_path / "icl")
    again = StructAttnGPT2ForInContextRegression.from_pretrained(tmp_path / "icl")
    torch.testing.assert_close(again.read_out.weight, icl.read_out.weight)


def test_training_steps_build_no_cache_unless_given_one():
    """A grad-enabled training forward skips the (costly) MLR key cache; eval and explicit caches keep it, and the
    logits do not depend on it."""
    model = tiny_lm("mlr")
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    eval_out = model(ids)
    assert eval_out.cache is not None and eval_out.cache.get_seq_length() == 21
    model.train()
    train_out = model(ids, labels=ids)
    assert train_out.cache is None
    torch.testing.assert_close(train_out.logits, eval_out.logits)  # dropout-free tiny config
    given = model.transformer.new_cache()
    assert model(ids, cache=given).cache is given and given.get_seq_length() == 21
    with torch.no_grad():
        assert model(ids).cache is not None
