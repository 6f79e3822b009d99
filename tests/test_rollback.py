"""Rollback of the hierarchical MLR key cache for speculative decoding (``structattn_rollback``): the log's fixed
buffers, crops that restore the state of the shorter prefix exactly across block boundaries, the rollback window
generate sets, and speculative decoding (prompt lookup, assisted) giving the greedy tokens."""

import copy

import pytest
import torch

from hf_structattn.modeling.structattn_rollback import RollbackLog

from conftest import tiny_lm
from cache_helpers import BLOCKS, cache_layer, make_rows, small_geometry, write


def test_the_log_keeps_the_last_writes_in_fixed_buffers_and_grows_outside_compiled_code():
    """``RollbackLog``: tokens appended in order, the last n read back oldest first; with a window only the last
    ``window`` tokens are kept (a chunk longer than the window keeps its own last tokens); without one the buffers
    double when full, keeping what they held."""
    like = torch.zeros(2, 3, 1, 4)
    log = RollbackLog()
    log.start(2, 3, 4, 4, like)

    def chunk(first, count):
        positions = torch.arange(first, first + count).expand(2, count)
        fine = positions[:, None, :, None].expand(2, 3, count, 4).to(like.dtype)
        return fine, positions, torch.ones(2, count, dtype=torch.bool)

    log.append(*chunk(0, 3), window=None)
    log.append(*chunk(3, 3), window=None)  # 6 tokens in buffers of 4: doubled
    assert log.tokens == 6 and log.buffers[0].shape[1] == 8
    assert log.padded  # (writes without host facts: two tokens may share an entry, the crop takes the general path)
    valid, positions, fine = log.last(4)
    assert positions[0].tolist() == [2, 3, 4, 5] and fine[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    log.clear()
    log.append(*chunk(10, 2), window=3, all_real=True)
    log.append(*chunk(12, 2), window=3, all_real=True)  # 4 tokens, window 3: the oldest is forgotten
    assert not log.padded
    assert log.tokens == 3 and log.last(3)[1][1].tolist() == [11, 12, 13]
    log.append(*chunk(20, 5), window=3)  # longer than the window: its own last 3
    assert log.tokens == 3 and log.last(3)[1][0].tolist() == [22, 23, 24]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("chunks", [[1] * 7, [7], [3, 1, 5], [4]])
def test_crop_restores_the_state_of_the_shorter_prefix(static, chunks):
    """Recording, then a draft written as decode steps or one verification chunk (longer than the finest block),
    crossing block boundaries at every level, then crop: the layer equals one that never saw the draft. A crop of
    at most the finest block's length after writes without padding ([4]: 2 tokens) restores every ring with one
    indexed assignment."""
    geometry = small_geometry()
    _, k, v, positions, valid = make_rows(length=40, pads=(0, 5, 13), offsets=(0, 0, 3))
    for prefix in (14, 29):  # the draft crosses the 16-block of rows 0 and 1; 29 + 7 crosses the 32 boundary
        layer, clean = cache_layer(static, geometry), cache_layer(static, geometry)
        for target in (layer, clean):
            write(target, k[:, :, :prefix], v[:, :, :prefix], positions[:, :prefix], valid[:, :prefix])
        layer.activate_past_recording()
        start = prefix
        for size in chunks:
            write(layer, k[:, :, start:start + size], v[:, :, start:start + size], positions[:, start:start + size],
                   valid[:, start:start + size])
            start += size
        keep = 2
        layer.crop(-(start - prefix - keep))
        write(clean, k[:, :, prefix:prefix + keep], v[:, :, prefix:prefix + keep], positions[:, prefix:prefix + keep],
               valid[:, prefix:prefix + keep])
        assert int(layer.get_seq_length()) == int(clean.get_seq_length()) == prefix + keep
        assert torch.equal(layer.last_positions, clean.last_positions)
        for ours, theirs, size in zip(layer.rings, clean.rings, BLOCKS):
            for row in range(3):  # entries of each row's current block (the others are stale and never read)
                last, first = int(clean.last_positions[row]), int(clean.first_positions[row])
                entries = [(p - clean.base) % size for p in range(max(last // size * size, first), last + 1)]
                torch.testing.assert_close(ours[row][:, entries], theirs[row][:, entries], atol=0, rtol=0)
        for row in range(3):  # each row's slots up to its newest position (later slots are future, never read)
            slots = int(clean.last_positions[row]) - clean.base + 1
            torch.testing.assert_close(layer.keys[row, :, :slots], clean.keys[row, :, :slots], atol=0, rtol=0)
            torch.testing.assert_close(layer.values[row, :, :slots], clean.values[row, :, :slots], atol=0, rtol=0)


def test_crop_beyond_what_was_recorded_is_refused():
    layer = cache_layer(False, small_geometry())
    _, k, v, positions, valid = make_rows(length=20, pads=(0, 0, 0), offsets=(0, 0, 0))
    write(layer, k[:, :, :10], v[:, :, :10], positions[:, :10], valid[:, :10])
    with pytest.raises(ValueError, match="activate_past_recording"):
        layer.crop(-1)
    layer.crop(0)
    layer.activate_past_recording()
    write(layer, k[:, :, 10:13], v[:, :, 10:13], positions[:, 10:13], valid[:, 10:13])
    with pytest.raises(ValueError, match=r"only the 3 tokens written since the last crop"):
        layer.crop(-4)
    layer.crop(-3)
    assert layer.get_seq_length() == 10 and layer.last_positions.tolist() == [9, 9, 9]


@pytest.mark.parametrize("static", [False, True])
def test_rollback_window_bounds_the_log_and_crops_within_it_exactly(static):
    """With a rollback window of 5 tokens, a 30-token recorded prefill logs only its last 5 writes (the log does
    not grow with the context); crop(-5) then restores the 25-token state exactly, crop(-6) is refused."""
    geometry = small_geometry()
    _, k, v, positions, valid = make_rows(length=40, pads=(0, 5, 13), offsets=(0, 0, 3))
    layer, clean = cache_layer(static, geometry), cache_layer(static, geometry)
    layer.rollback_window = 5
    layer.activate_past_recording()
    write(layer, k[:, :, :30], v[:, :, :30], positions[:, :30], valid[:, :30])
    write(clean, k[:, :, :25], v[:, :, :25], positions[:, :25], valid[:, :25])
    log_tokens = {tensor.shape[-2] if tensor.dim() == 4 else tensor.shape[-1]
                  for tensor in layer.rollback_log.tensors()}
    assert max(log_tokens) <= 5  # the log's fixed buffers are 5 tokens long
    assert layer.rollback_log.tokens == 5
    with pytest.raises(ValueError, match=r"only the 5 tokens"):
        layer.crop(-6)
    layer.crop(-5)
    for target in (layer, clean):  # the next decode steps see the same state
        write(target, k[:, :, 25:28], v[:, :, 25:28], positions[:, 25:28], valid[:, 25:28])
    assert torch.equal(layer.last_positions, clean.last_positions)
    for ours, theirs, size in zip(layer.rings, clean.rings, BLOCKS):
        for row in range(3):
            last, first = int(clean.last_positions[row]), int(clean.first_positions[row])
            entries = [(p - clean.base) % size for p in range(max(last // size * size, first), last + 1)]
            torch.testing.assert_close(ours[row][:, entries], theirs[row][:, entries], atol=0, rtol=0)


def test_generate_sets_the_rollback_window_from_the_draft_length():
    model = tiny_lm("mlr", n_positions=128)
    prompt = torch.randint(2, 61, (1, 40), generator=torch.Generator().manual_seed(1))
    common = dict(max_new_tokens=6, do_sample=False, pad_token_id=1, return_dict_in_generate=True)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=4, **common)
    plain = model.generate(prompt, **common)
    assert [layer.rollback_window for layer in lookup.cache.layers] == [6, 6]  # the draft and one token, + 1
    assert [layer.rollback_window for layer in plain.cache.layers] == [None, None]


@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup", "mixed"])
def test_speculative_decoding_equals_greedy(variant):
    """Prompt lookup and assisted decoding (an MLR assistant, whose own cache is rolled back too) give the greedy
    tokens, with the dynamic and the static cache; drafts cross block boundaries at every level ("mixed" adds dense,
    sliding-window and bilinear layers, whose transformers cache layers are cropped beside the MLR ones -- dynamic only:
    transformers' StaticSlidingWindowLayer cannot be cropped once a cache is longer than its window, for any model)."""
    model = tiny_lm(variant, n_positions=128).double()
    with torch.no_grad():  # sharper than the tiny init, so that drafts are both accepted and rejected
        for param in model.parameters():
            param.mul_(4.0)
    prompt = torch.randint(2, 61, (1, 30), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([prompt, prompt[:, :12]], dim=1)  # repeats itself: prompt lookup finds candidates
    common = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=1)
    greedy = model.generate(prompt, **common)
    assistant = copy.deepcopy(model)
    with torch.no_grad():
        for param in assistant.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    caches = ({},) if variant == "mixed" else ({}, dict(cache_implementation="static"))
    for cache in caches:
        lookup = model.generate(prompt, prompt_lookup_num_tokens=6, **common, **cache)
        assisted = model.generate(prompt, assistant_model=assistant, **common, **cache)
        assert torch.equal(lookup, greedy) and torch.equal(assisted, greedy), cache
