"""Caller 4-D attention masks (a sliding window, a hidden pair, a block-diagonal or bidirectional overlay) on every
path of an MLR model: uncached, the cache a plain eval forward builds, a passed dynamic or static cache in chunks
and decode steps, left padding. The oracle is transformers' own model: an MLR model with one level (mlr_ranks =
[head_dim]) is the dense model, so its outputs under a mask must equal the stock model's under the same mask; with
several levels, the cached paths must equal the uncached and the materialised (eager) ones, and differ from the
causal output. Masks the hierarchical cache cannot apply are refused. All in float64."""

import pytest
import torch
import transformers
from transformers import DynamicCache, StaticCache

import hf_structattn
from hf_structattn.decoder_patching import tiny_decoder

from conftest import tiny_lm

EXACT = dict(rtol=0, atol=1e-12)
LENGTH = 14


def _masks(length: int, batch: int = 2) -> dict:
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None]
    causal = key <= query
    masks = {"causal": causal, "window": causal & (key > query - 4),
             "hidden pair": causal & ~((query == length - 2) & (key == 3)),
             "block-diagonal": causal & ((key >= 7) == (query >= 7))}
    return {name: mask[None, None].expand(batch, 1, length, length) for name, mask in masks.items()}


def _bidirectional(length: int, batch: int = 2) -> torch.Tensor:
    return torch.ones(batch, 1, length, length, dtype=torch.bool)


def _in_pieces(model, ids, mask, cache, positions=None, prefill=5, chunk=4):
    """Logits of ``ids`` fed as a prefill, one chunk and single tokens into ``cache``, each with its rows of the
    4-D ``mask`` (over the static cache's slots when the mask is wider than the tokens)."""
    bounds = [(0, prefill), (prefill, prefill + chunk)] + [(i, i + 1) for i in range(prefill + chunk, ids.shape[1])]
    logits = []
    for start, end in bounds:
        rows = mask[:, :, start:end]
        rows = rows if rows.shape[-1] > ids.shape[1] else rows[..., :end]
        extra = {} if positions is None else {"position_ids": positions[:, start:end]}
        logits.append(model(ids[:, start:end], attention_mask=rows, cache=cache, **extra).logits)
    return torch.cat(logits, dim=1)


@pytest.fixture(scope="module")
def llama():
    stock = tiny_decoder("llama")
    one_level = hf_structattn.patch(stock, mlr_ranks=[16], mlr_block_sizes=[])
    mlr = hf_structattn.patch(stock, mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
    eager = hf_structattn.patch(stock, mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
    eager.set_attn_implementation("eager")
    return stock, one_level, mlr, eager


@pytest.mark.parametrize("name", list(_masks(LENGTH)))
def test_a_custom_4d_mask_is_applied_exactly_with_and_without_a_cache(llama, name):
    stock, one_level, mlr, eager = llama
    ids = torch.randint(3, 61, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = _masks(LENGTH)[name]
    expected = stock(ids, attention_mask=mask, use_cache=False).logits
    assert name == "causal" or (expected - stock(ids, use_cache=False).logits).abs().max() > 1e-3
    static = torch.zeros(2, 1, LENGTH, 20, dtype=torch.bool)
    static[..., :LENGTH] = mask
    for model, reference in ((one_level, expected), (mlr, mlr(ids, attention_mask=mask, use_cache=False).logits)):
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference, **EXACT)  # eval: a cache
        torch.testing.assert_close(_in_pieces(model, ids, mask, DynamicCache(config=model.config)), reference, **EXACT)
        torch.testing.assert_close(_in_pieces(model, ids, static, StaticCache(config=model.config, max_cache_len=20)),
                                   reference, **EXACT)
    materialised = eager(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(mlr(ids, attention_mask=mask, use_cache=False).logits, materialised, **EXACT)
    torch.testing.assert_close(_in_pieces(eager, ids, mask, DynamicCache(config=eager.config)), materialised, **EXACT)
    if name != "causal":  # never the causal output
        assert (materialised - mlr(ids, use_cache=False).logits).abs().max() > 1e-3


def test_a_custom_4d_mask_with_left_padding_is_applied_over_the_cached_real_tokens(llama):
    stock, one_level, mlr, _ = llama
    ids = torch.randint(3, 61, (2, LENGTH), generator=torch.Generator().manual_seed(2))
    keep = torch.ones(2, LENGTH, dtype=torch.bool)
    keep[1, :3] = False
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
    window = _masks(LENGTH)["window"] & keep[:, None, None, :] & keep[:, None, :, None]
    for model, oracle in ((one_level, stock), (mlr, mlr)):
        expected = oracle(ids, attention_mask=window, position_ids=positions, use_cache=False).logits
        cached = _in_pieces(model, ids, window, DynamicCache(config=model.config), positions)
        torch.testing.assert_close(cached[keep], expected[keep], **EXACT)


def test_gpt2_mlr_applies_a_custom_4d_mask_as_its_dense_twin_does():
    """GPT-2 MLR with one level is GPT-2 dense attention (the dense layer applies 4-D masks through SDPA)."""
    dense = tiny_lm("dense").double()
    one_level = tiny_lm("mlr", mlr_ranks=[16]).double()
    one_level.load_state_dict(dense.state_dict())
    ids = torch.randint(2, 61, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    for name, mask in _masks(LENGTH).items():
        expected = dense(ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(one_level(ids, attention_mask=mask, use_cache=False).logits, expected, **EXACT)
        torch.testing.assert_close(one_level(ids, attention_mask=mask).logits, expected, **EXACT)
        cache = DynamicCache(config=one_level.config)
        torch.testing.assert_close(_in_pieces(one_level, ids, mask, cache), expected, **EXACT, msg=name)
    mlr = tiny_lm("mlr").double()
    window = _masks(LENGTH)["window"]
    uncached = mlr(ids, attention_mask=window, use_cache=False).logits
    assert (uncached - mlr(ids, use_cache=False).logits).abs().max() > 1e-3
    torch.testing.assert_close(_in_pieces(mlr, ids, window, DynamicCache(config=mlr.config)), uncached, **EXACT)


def test_a_4d_mask_the_cache_cannot_apply_is_refused(llama):
    """With cached tokens, keys a mask may allow but the MLR cache does not hold: a future key (bidirectional over
    a chunk), a padding token (never stored), an empty static slot. Each is refused in one line; without a cache
    the same masks are applied."""
    _, _, mlr, _ = llama
    ids = torch.randint(3, 61, (2, LENGTH), generator=torch.Generator().manual_seed(4))
    message = "4-D attention mask that allows keys the MLR key cache does not hold"
    bidirectional = _bidirectional(LENGTH)
    with pytest.raises(ValueError, match=message) as raised:
        _in_pieces(mlr, ids, bidirectional, DynamicCache(config=mlr.config))
    assert "\n" not in str(raised.value)
    mlr(ids, attention_mask=bidirectional, use_cache=False)  # applied uncached (and as the first chunk of a cache)
    mlr(ids, attention_mask=bidirectional)
    keep = torch.ones(2, LENGTH, dtype=torch.bool)
    keep[1, :3] = False
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
    sees_padding = _masks(LENGTH)["causal"] & keep[:, None, :, None]  # real queries see the padding keys too
    with pytest.raises(ValueError, match=message):
        _in_pieces(mlr, ids, sees_padding, DynamicCache(config=mlr.config), positions)
    static = torch.zeros(2, 1, LENGTH, 20, dtype=torch.bool)
    static[..., :LENGTH] = _masks(LENGTH)["causal"]
    static[..., 0, -1] = True  # the first token may see an empty slot
    with pytest.raises(ValueError, match=message):
        _in_pieces(mlr, ids, static, StaticCache(config=mlr.config, max_cache_len=20))


# ------------------------------------------------------------------------------------ 2-D masks and bad input


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_patched_decoders_refuse_additive_2d_masks_and_read_float_keep_masks(arch):
    """An additive 2-D mask (0 / -inf, 0 / finfo.min) read as a keep-mask would be inverted: refused in one line
    naming attention_mask, with and without a cache, as GPT-2 MLR models and T5 refuse it. A 0/1 float keep-mask
    is what a long one is."""
    model = hf_structattn.patch(tiny_decoder(arch), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4],
                                **({"layers": [2]} if arch == "gemma3" else {}))
    ids = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(5))
    keep = torch.ones(2, 12, dtype=torch.long)
    keep[1, :4] = 0
    positions = (keep.cumsum(-1) - 1).clamp(min=0)
    message = "attention_mask must be a keep-mask holding only 0 and 1"
    for low in (float("-inf"), torch.finfo(torch.float64).min, -1e4):
        additive = torch.zeros(2, 12, dtype=torch.float64).masked_fill(keep == 0, low)
        for use_cache in (True, False):
            with pytest.raises(ValueError, match=message) as raised:
                model(ids, attention_mask=additive, position_ids=positions, use_cache=use_cache)
            assert "\n" not in str(raised.value)
        # after a prefill the same rule, not a complaint about hidden cached tokens
        cache = DynamicCache(config=model.config)
        model(ids[:, :8], attention_mask=keep[:, :8], position_ids=positions[:, :8], cache=cache)
        for end in (9, 12):  # a decode step, a chunk
            with pytest.raises(ValueError, match=message) as raised:
                model(ids[:, 8:end], attention_mask=additive[:, :end], position_ids=positions[:, 8:end], cache=cache)
            assert "\n" not in str(raised.value) and "hides a cached" not in str(raised.value)
    expected = model(ids, attention_mask=keep, position_ids=positions).logits
    torch.testing.assert_close(model(ids, attention_mask=keep.double(), position_ids=positions).logits, expected,
                               **EXACT)


def test_patched_decoder_bad_input_is_one_line_naming_the_argument():
    model = hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(6))
    cases = [
        (dict(input_ids=ids[:, :0]), "input_ids of shape \\(2, 0\\) is empty"),
        (dict(input_ids=ids[:0]), "input_ids of shape \\(0, 6\\) is empty"),
        (dict(inputs_embeds=torch.zeros(2, 0, 64, dtype=torch.float64)), "inputs_embeds of shape \\(2, 0, 64\\)"),
        (dict(input_ids=ids.double()), "input_ids must be an integer tensor"),
        (dict(input_ids=ids, position_ids=torch.arange(5)[None]), "position_ids must have shape \\(2, 6\\)"),
        (dict(input_ids=ids, position_ids=torch.arange(6.0)[None]), "position_ids must be an integer tensor"),
        (dict(input_ids=ids, attention_mask=torch.ones(2, 5, dtype=torch.long)), "attention_mask must have shape"),
        (dict(input_ids=ids, attention_mask=torch.ones(3, 6, dtype=torch.long)), "attention_mask must have shape"),
        (dict(input_ids=ids, attention_mask=torch.ones(2, 1, 6, 5, dtype=torch.bool)), "a 4-D attention_mask must"),
        (dict(input_ids=ids, attention_mask=torch.ones(2, 6, 6, dtype=torch.bool)), "attention_mask must be a"),
    ]
    for use_cache in (True, False):
        for inputs, message in cases:
            with pytest.raises(ValueError, match=message) as raised:
                model(**inputs, use_cache=use_cache)
            assert "\n" not in str(raised.value), inputs
    cache = DynamicCache(config=model.config)
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="attention_mask must have shape \\(2, 7\\)"):  # cached + new tokens
        model(ids[:, :1], attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache)
    gpt2 = tiny_lm("mlr")
    with pytest.raises(ValueError, match="is empty \\(batch 0"):
        gpt2(torch.zeros(0, 4, dtype=torch.long))


# ------------------------------------------------------------------------------------ positions with a cache


@pytest.mark.parametrize("family", ["gpt2_mlr", "llama"])
def test_positions_that_restart_after_cached_real_tokens_are_refused(family):
    """With a cache, new positions that restart or go back after the row's newest cached real token (``[0, 1]``
    after position 9, with or without an all-ones mask) are a packed sequence: a one-line ValueError, not the
    right-padding continuation (which needs padding after a real token in the caller's mask: right-padded
    ``generate`` still continues, tests/test_model_contracts.py)."""
    model = tiny_lm("mlr").double() if family == "gpt2_mlr" else \
        hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
    ids = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(7))
    for mask in (None, torch.ones(2, 12, dtype=torch.long)):
        for restart in ([0, 1], [9, 10], [5]):
            cache = DynamicCache(config=model.config)
            model(ids[:, :10], attention_mask=None if mask is None else mask[:, :10], cache=cache)
            count = len(restart)
            with pytest.raises(ValueError, match="consecutive increasing positions continuing the row") as raised:
                model(ids[:, 10:10 + count], position_ids=torch.tensor([restart] * 2), cache=cache,
                      attention_mask=None if mask is None else mask[:, :10 + count])
            assert "\n" not in str(raised.value)
    cache = DynamicCache(config=model.config)  # the continuation itself is fine
    model(ids[:, :10], cache=cache)
    model(ids[:, 10:12], position_ids=torch.tensor([[10, 11]] * 2), cache=cache)


# ------------------------------------------------------------------------------------ mask shapes: per head, broadcast


def _per_head(length: int, heads: int, batch: int = 2) -> torch.Tensor:
    """(B, H, T, T) bool masks whose heads differ: head h sees a window of h + 2 keys, and the last head also hides
    one pair inside its window."""
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None]
    causal = key <= query
    masks = torch.stack([causal & (key > query - 2 - head) for head in range(heads)])
    masks[-1] &= ~((query == length - 1) & (key == length - 2))
    return masks[None].expand(batch, heads, length, length)


def _static(mask: torch.Tensor, slots: int = 20) -> torch.Tensor:
    wide = torch.zeros(*mask.shape[:-1], slots, dtype=torch.bool)
    wide[..., :mask.shape[-1]] = mask
    return wide


def _every_path(model, ids, mask) -> dict:
    """Logits of ``ids`` under ``mask`` on every path: uncached, the cache of an eval forward, a dynamic and a static
    cache fed in a prefill, a chunk and single tokens."""
    return {"uncached": model(ids, attention_mask=mask, use_cache=False).logits,
            "eval cache": model(ids, attention_mask=mask).logits,
            "dynamic": _in_pieces(model, ids, mask, DynamicCache(config=model.config)),
            "static": _in_pieces(model, ids, _static(mask), StaticCache(config=model.config, max_cache_len=20))}


def test_per_head_4d_masks_are_applied_per_head_on_every_path(llama):
    """A (B, H, T, T) mask whose heads differ is applied per query head (grouped-query heads included) on every path,
    as stock Llama applies it: never head 0's mask for every head."""
    stock, one_level, mlr, eager = llama
    heads = stock.config.num_attention_heads
    assert heads > stock.config.num_key_value_heads  # grouped-query: the mask is per query head
    ids = torch.randint(3, 61, (2, LENGTH), generator=torch.Generator().manual_seed(11))
    mask = _per_head(LENGTH, heads)
    expected = stock(ids, attention_mask=mask, use_cache=False).logits
    head_zero = stock(ids, attention_mask=mask[:, :1], use_cache=False).logits
    assert (expected - head_zero).abs().max() > 1e-3  # the heads' masks matter
    for path, logits in _every_path(one_level, ids, mask).items():
        torch.testing.assert_close(logits, expected, **EXACT, msg=path)
    reference = eager(ids, attention_mask=mask, use_cache=False).logits  # materialised, uncached
    assert (reference - mlr(ids, attention_mask=mask[:, :1], use_cache=False).logits).abs().max() > 1e-3
    for path, logits in _every_path(mlr, ids, mask).items():
        torch.testing.assert_close(logits, reference, **EXACT, msg=path)
    torch.testing.assert_close(_in_pieces(eager, ids, mask, DynamicCache(config=eager.config)), reference, **EXACT)


def test_gpt2_mlr_applies_per_head_4d_masks_as_its_dense_twin_does():
    dense = tiny_lm("dense").double()
    one_level = tiny_lm("mlr", mlr_ranks=[16]).double()
    one_level.load_state_dict(dense.state_dict())
    ids = torch.randint(2, 61, (2, LENGTH), generator=torch.Generator().manual_seed(12))
    mask = _per_head(LENGTH, dense.config.n_head)
    expected = dense(ids, attention_mask=mask, use_cache=False).logits
    assert (expected - dense(ids, attention_mask=mask[:, :1], use_cache=False).logits).abs().max() > 1e-3
    for path, logits in _every_path(one_level, ids, mask).items():
        torch.testing.assert_close(logits, expected, **EXACT, msg=path)
    mlr = tiny_lm("mlr").double()
    reference = mlr(ids, attention_mask=mask, use_cache=False).logits
    for path, logits in _every_path(mlr, ids, mask).items():
        torch.testing.assert_close(logits, reference, **EXACT, msg=path)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_mask_of_batch_or_heads_one_is_broadcast(llama, family):
    """A (1, 1, T, K), (1, H, T, K) or (B, 1, T, K) mask is broadcast over the batch and the heads, as SDPA and stock
    models broadcast it: equal to the mask expanded to (B, H, T, K), on every path."""
    model = tiny_lm("mlr").double() if family == "gpt2" else llama[2]
    heads = model.config.num_attention_heads
    ids = torch.randint(3, 61, (2, LENGTH), generator=torch.Generator().manual_seed(13))
    window = _masks(LENGTH, batch=1)["window"]
    for mask in (window, _per_head(LENGTH, heads, batch=1)):
        full = mask.expand(2, heads, LENGTH, LENGTH)
        expected = model(ids, attention_mask=full, use_cache=False).logits
        for path, logits in _every_path(model, ids, mask).items():
            torch.testing.assert_close(logits, expected, **EXACT, msg=f"{tuple(mask.shape)} {path}")
    if family == "llama":
        stock = llama[0]
        torch.testing.assert_close(stock(ids, attention_mask=window, use_cache=False).logits,
                                   stock(ids, attention_mask=window.expand(2, 1, -1, -1), use_cache=False).logits,
                                   **EXACT)


def stock_run_as_mlr():
    """A stock Llama whose config carries MLR fields, run with ``attn_implementation="mlr"``: no plan checks its
    mask before layer 0, the attention function does."""
    hf_structattn.register_attention()
    model = tiny_decoder("llama")
    model.config.mlr_ranks, model.config.mlr_block_sizes = [8, 4, 4], [8, 4]
    model.set_attn_implementation("mlr")
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama", "stock llama run as mlr"])
def test_mask_shapes_outside_the_rule_are_one_line_naming_attention_mask(llama, family):
    model = {"gpt2": lambda: tiny_lm("mlr").double(), "llama": lambda: llama[2], "stock llama run as mlr":
             stock_run_as_mlr}[family]()
    heads = model.config.num_attention_heads
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(14))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    cases = [causal.expand(3, 1, 6, 6), causal.expand(2, heads + 1, 6, 6), causal[:5].expand(2, 1, 5, 6),
             causal[:, :5].expand(2, 1, 6, 5)]
    # 3-D and 2-D masks of a stock model are transformers' to refuse (its mask functions run first)
    cases += [] if family.startswith("stock") else [causal.expand(2, 6, 6), torch.ones(3, 6, dtype=torch.long)]
    for mask in cases:
        for use_cache in (True, False):
            with pytest.raises(ValueError, match="attention_mask") as raised:
                model(ids, attention_mask=mask, use_cache=use_cache)
            message = str(raised.value)
            assert "\n" not in message and str(tuple(mask.shape)) in message, message
