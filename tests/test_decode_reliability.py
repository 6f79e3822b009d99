"""No silent wrong answer on the decode path: additive masks with any fill, two threads decoding two caches, a
static cache reused after ``reset``, long drafts over static caches of one capacity, a cache written by another
geometry, dropout of cached training steps. Each case against an independent reference (the uncached forward or
the stock model)."""

import threading

import pytest
import torch
import transformers

import hf_structattn

from conftest import tiny_lm

EXACT = dict(atol=1e-12, rtol=1e-12)


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.mark.parametrize("fill", [-1e4, -1e9, float("-inf"), torch.finfo(torch.float32).min, "bert"])
def test_additive_4d_masks_with_any_fill_equal_the_bool_mask(fill):
    """A caller's float 4-D mask with 0 = attend and a finite or infinite fill is read as the bool mask it encodes
    (future keys stay hidden), in float64 -- also float32's lowest value stored in a float64 mask -- as stock Llama
    reads it."""
    model = tiny_lm("mlr").double()
    ids = torch.randint(2, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    keep = torch.ones(12, 12, dtype=torch.bool).tril()[None, None].expand(2, 1, 12, 12)
    if fill == "bert":
        additive = (1.0 - keep.double()) * -10000.0
    else:
        additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, fill)
    expected = _logits(model, ids)
    torch.testing.assert_close(_logits(model, ids, attention_mask=keep), expected, **EXACT)
    torch.testing.assert_close(_logits(model, ids, attention_mask=additive), expected, **EXACT)


def test_a_float_mask_holding_a_score_bias_is_refused():
    model = tiny_lm("mlr").double()
    ids = torch.randint(2, 61, (1, 6))
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.float64).masked_fill(
        ~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    mask[0, 0, 3, 1] = -0.5
    with pytest.raises(ValueError, match=r"attention_mask is a float \(additive\) mask holding -0.5"):
        _logits(model, ids, attention_mask=mask)


@pytest.mark.parametrize("family", ["gpt2", "llama", "stock llama run as mlr"])
def test_a_nan_in_a_float_mask_is_refused(family):
    """A NaN in a float 4-D mask is neither 0 (attend) nor <= -1e4 (masked): refused in one line, on a pair the rest
    of the mask allows and on a masked one, with and without a cache and after a prefill (stock Llama would return NaN
    logits; reading it as "masked" would be a silent answer)."""
    from hf_structattn.decoder_patching import tiny_decoder

    from test_mask_paths import stock_run_as_mlr

    model = {"gpt2": lambda: tiny_lm("mlr").double(), "stock llama run as mlr": stock_run_as_mlr,
             "llama": lambda: hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
             }[family]()
    ids = torch.randint(2, 61, (2, 8), generator=torch.Generator().manual_seed(3))
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    for pair in ((5, 2), (5, 7)):  # allowed, masked (a future key)
        mask = torch.zeros(2, 1, 8, 8, dtype=torch.float64).masked_fill(~causal, float("-inf"))
        mask[1, 0, pair[0], pair[1]] = float("nan")
        for use_cache in (True, False):
            with pytest.raises(ValueError, match=r"attention_mask is a float \(additive\) mask holding nan") as raised:
                _logits(model, ids, attention_mask=mask, use_cache=use_cache)
            assert "\n" not in str(raised.value)
        cache = transformers.DynamicCache(config=model.config)
        _logits(model, ids[:, :5], attention_mask=mask[:, :, :5, :5].nan_to_num(nan=0.0), cache=cache)
        with pytest.raises(ValueError, match=r"holding nan"):
            _logits(model, ids[:, 5:], attention_mask=mask[:, :, 5:], cache=cache)


def _prompt_lookup(model, prompt, rounds):
    return model.generate(prompt, max_new_tokens=rounds, do_sample=False, prompt_lookup_num_tokens=4,
                          pad_token_id=1)


def test_speculative_decoding_in_threads_equals_alone():
    """Two threads decoding with prompt lookup (crops every round) on two models and on one shared model give the
    tokens each gives alone: no state is shared across calls (a bounded loop: 3 threads x 2 runs)."""
    torch.manual_seed(0)
    models = [tiny_lm("mlr", seed=seed, n_positions=128) for seed in (0, 1)]
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 20, (1, 24), generator=generator).repeat(1, 2) for _ in range(3)]
    jobs = [(models[0], prompts[0]), (models[1], prompts[1]), (models[0], prompts[2])]
    with torch.no_grad():
        alone = [_prompt_lookup(model, prompt, 40) for model, prompt in jobs]
    results, errors = {}, []

    def run(index, model, prompt):
        try:
            with torch.no_grad():
                for attempt in range(2):
                    results[index, attempt] = _prompt_lookup(model, prompt, 40)
        except Exception as error:  # reported below with the thread's index
            errors.append((index, error))

    threads = [threading.Thread(target=run, args=(index, *job)) for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for (index, _), tokens in results.items():
        assert torch.equal(tokens, alone[index]), index
    assert len(results) == 6


@pytest.mark.parametrize("first_use, restart", [(40, 0), (0, 40)])
def test_a_reset_static_cache_is_placed_afresh(first_use, restart):
    """A static cache of 32 slots used from position 40 (or 0), reset, then used again from position 0 (or 40),
    lower or higher than its first use, gives the uncached logits: ``reset`` forgets where its slots start."""
    model = tiny_lm("mlr", n_positions=64).double()
    ids = torch.randint(2, 61, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    positions = torch.arange(first_use, first_use + 12)[None]
    with torch.no_grad():
        model(ids[:, :12], cache=cache, position_ids=positions)
    cache.reset()
    positions = torch.arange(restart, restart + 12)[None]
    got = _logits(model, ids[:, :12], cache=cache, position_ids=positions)
    expected = _logits(model, ids[:, :12], position_ids=positions)
    torch.testing.assert_close(got, expected, **EXACT)
    step = _logits(model, ids[:, 12:13], cache=cache, position_ids=positions[:, -1:] + 1)
    expected = _logits(model, ids[:, :13], position_ids=torch.arange(restart, restart + 13)[None])
    torch.testing.assert_close(step[:, -1], expected[:, -1], **EXACT)


def test_long_drafts_over_two_static_caches_of_one_capacity():
    """Two static caches of the same capacity: verify-and-crop rounds with 96-token drafts on one of them between
    decode steps of the other; each equals its uncached forward (nothing is memoised across caches)."""
    model = tiny_lm("mlr", n_positions=256).double()
    ids = torch.randint(2, 61, (1, 250), generator=torch.Generator().manual_seed(4))
    first, second = (transformers.StaticCache(config=model.config, max_cache_len=256) for _ in range(2))
    held_first = held_second = 10
    with torch.no_grad():
        model(ids[:, :10], cache=first)
        model(ids[:, :10], cache=second)
        for _ in range(2):
            for layer in second.layers:
                layer.activate_past_recording()
            end = held_second + 96
            draft = model(ids[:, held_second:end], cache=second).logits
            torch.testing.assert_close(draft[:, -1], _logits(model, ids[:, :end])[:, -1], **EXACT)
            for layer in second.layers:
                layer.crop(-66)
            held_second = end - 66
            step = model(ids[:, held_first:held_first + 1], cache=first).logits
            torch.testing.assert_close(step[:, -1], _logits(model, ids[:, :held_first + 1])[:, -1], **EXACT)
            held_first += 1
        step = model(ids[:, held_second:held_second + 1], cache=second).logits
        torch.testing.assert_close(step[:, -1], _logits(model, ids[:, :held_second + 1])[:, -1], **EXACT)


def test_a_cache_written_by_another_geometry_is_refused():
    """A cache filled by a model with other block sizes (or ranks) is refused in one line at the next forward."""
    writer = tiny_lm("mlr", n_positions=64)
    reader = tiny_lm("mlr", n_positions=64, mlr_block_sizes=[16, 8, 4])
    ids = torch.randint(2, 61, (1, 10))
    cache = transformers.DynamicCache(config=writer.config)
    with torch.no_grad():
        writer(ids, cache=cache)
        with pytest.raises(ValueError, match=r"holds MLR keys of ranks \[8, 4, 2, 2\], blocks \[32, 16, 8\]; the "
                                             r"model's layer is MLR with ranks \[8, 4, 2, 2\], blocks \[16, 8, 4\]"):
            reader(ids[:, :1], cache=cache)


@pytest.mark.parametrize("fields, differing, held, wanted", [
    (dict(mlr_scaling="mup"), "level scales", "[0.25, 0.25, 0.25, 0.25]", "[0.125, 0.25, 0.5, 0.5]"),
    (dict(mlr_average_levels=True), "level averaging", "level averaging off", "level averaging on"),
])
def test_a_cache_written_with_other_level_weights_names_the_differing_field(fields, differing, held, wanted):
    """Same ranks and blocks, other level scales or level averaging: the refusal names the field that differs and
    both values (not the identical ranks and blocks alone)."""
    writer = tiny_lm("mlr", n_positions=64)
    reader = tiny_lm("mlr", n_positions=64, **fields)
    ids = torch.randint(2, 61, (1, 10))
    cache = transformers.DynamicCache(config=writer.config)
    with torch.no_grad():
        writer(ids, cache=cache)
        with pytest.raises(ValueError, match=f"differ in {differing}") as raised:
            reader(ids[:, :1], cache=cache)
    message = str(raised.value)
    assert "\n" not in message and held in message and wanted in message, message
    assert message.index(held) < message.index("the model's layer") < message.index(wanted), message


def test_a_model_without_mlr_layers_refuses_a_cache_an_mlr_model_wrote():
    """The dense twin given a cache the MLR model wrote: one line naming the layer, before anything is written (the
    cache still holds the MLR model's tokens, and the MLR model continues it exactly)."""
    mlr = tiny_lm("mlr").double()
    dense = tiny_lm("dense").double()
    ids = torch.randint(2, 61, (2, 10), generator=torch.Generator().manual_seed(8))
    cache = transformers.DynamicCache(config=mlr.config)
    with torch.no_grad():
        mlr(ids[:, :8], cache=cache)
        for chunk in (ids[:, 8:9], ids[:, 8:10]):
            with pytest.raises(ValueError, match=r"cache layer 0 holds MLR keys of ranks \[8, 4, 2, 2\]") as raised:
                dense(chunk, cache=cache)
            assert "\n" not in str(raised.value) and "not MLR" in str(raised.value)
        assert cache.get_seq_length() == 8
        got = mlr(ids[:, 8:], cache=cache).logits
    torch.testing.assert_close(got, _logits(mlr, ids)[:, 8:], **EXACT)


def test_cached_training_steps_under_eager_attention_apply_dropout():
    """With attention dropout in training, a cached step of a patched Llama under the eager implementation drops
    weights (two calls differ, and differ from the dropout-free step), as its uncached eager forward does."""
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = hf_structattn.patch(transformers.LlamaForCausalLM(config).double().eval(), mlr_ranks=[8, 4, 4],
                                mlr_block_sizes=[8, 4])
    model.set_attn_implementation("eager")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids = torch.randint(2, 61, (1, 12), generator=torch.Generator().manual_seed(3))

    def cached_step(train):
        cache = transformers.DynamicCache(config=model.config)
        model.eval()
        with torch.no_grad():
            model(ids[:, :8], cache=cache)
        model.train(train)
        return model(ids[:, 8:], cache=cache).logits

    first, second, plain = cached_step(True), cached_step(True), cached_step(False)
    model.eval()
    assert not torch.allclose(first, second)
    assert not torch.allclose(first, plain)
    torch.testing.assert_close(plain, _logits(model, ids)[:, 8:], **EXACT)


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_2d_mask_that_hides_a_cached_token_is_refused(chunk):
    """A 2-D mask that hides a real token the cache already holds (the dense twin would apply it) is refused in one
    line, on the decode step's path and on a chunk's; masks that hide only padding keep working (left padding)."""
    model = tiny_lm("mlr").double()
    ids = torch.randint(2, 61, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0  # left padding of row 1
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], attention_mask=mask, cache=cache)
        hiding = torch.cat([mask, torch.ones(2, chunk, dtype=torch.long)], 1)
        hiding[0, 4] = 0
        with pytest.raises(ValueError, match=r"attention_mask hides a cached real token of row 0: the MLR cache holds "
                                             r"its 8 real tokens, the mask keeps 7"):
            model(ids[:, 8:8 + chunk], attention_mask=hiding, cache=cache)
        keeping = torch.cat([mask, torch.ones(2, chunk, dtype=torch.long)], 1)
        got = model(ids[:, 8:8 + chunk], attention_mask=keeping, cache=cache).logits
        expected = model(ids[:, :8 + chunk], attention_mask=keeping).logits[:, 8:]
    torch.testing.assert_close(got, expected, **EXACT)
