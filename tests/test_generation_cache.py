"""The hierarchical MLR key cache: storage (position-aligned slots, rings), the decode and chunk math over it against
the naive reference, rollback for speculative decoding, what it allocates, static == dynamic, half precision and
torch.compile."""

import collections
import copy
import dataclasses

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import Cache

import hf_structattn

from hf_structattn.modeling.structattn_cache import MLRKeyCacheLayer, MLRStaticKeyCacheLayer
from hf_structattn.modeling.structattn_geometry import MLRGeometry
from hf_structattn.modeling.structattn_lane import (MAX_RUNS, TEMPLATE_SLOTS, lane_runs, mlr_lane_attention,
                                                    plan_step_lanes)
from hf_structattn.modeling.structattn_mlr_decode import DecodeReadPlan, mlr_cached_attention
from hf_structattn.modeling.structattn_plan import STEP_KEY, build_step
from hf_structattn.modeling.structattn_prepare import key_cache_bytes
from hf_structattn.modeling.structattn_reference import mlr_attention_reference

from conftest import tiny_lm

RANKS, BLOCKS = [4, 2, 1, 1], [16, 8, 4]
EXACT = dict(atol=1e-12, rtol=1e-12)


def _geometry(average_levels=False):
    return MLRGeometry.build(RANKS, BLOCKS, [0.5, 0.7, 0.9, 1.1], average_levels=average_levels)


def _layer(static, geometry, capacity=48):
    return MLRStaticKeyCacheLayer(capacity, geometry) if static else MLRKeyCacheLayer(geometry)


def _write(layer, keys, values, positions, valid):
    """The model's flow for one chunk: the step plan (one host read), ``update`` (the chunk's keys in level order,
    nothing stored), ``store`` (the write, returning the layer's view). Returns (view, step, level-order keys)."""
    step = build_step(cache=Cache(layers=[layer]), positions=positions, valid=valid, batch=keys.shape[0],
                      length=keys.shape[2], device=keys.device, geometries=(tuple(layer.geometry.block_sizes),))
    level_keys, level_values = layer.update(keys, values, kwargs={STEP_KEY: step})
    return layer.store(level_keys, level_values, step), step, level_keys


def _attend(query, written, geometry, **kwargs):
    """The one op over the view of a write (``_write``'s result): query (B, Hk, n, r), n = g * c group-major."""
    view, step, keys = written
    return mlr_cached_attention(query, keys, view, step, geometry, geometry.level_scales, **kwargs)


def _traced(written):
    """The view and step as a traced step sees them: the whole storage, no host facts (plans made in the trace);
    the dynamic layer's token count (a Python int the op does not read) left out, so that it is no guard."""
    view, step, keys = written
    whole = [tensor._base if tensor._base is not None else tensor for tensor in (view.keys, view.values)]
    return dataclasses.replace(view, keys=whole[0], values=whole[1], tokens=None), \
        dataclasses.replace(step, facts=None, memo={}), keys


def _rows(batch=3, length=40, pads=(0, 5, 13), offsets=(0, 0, 3), seed=0, heads=2, dtype=torch.float64):
    """q (B, Hk, g=2, T, r), k, v (B, Hk, T, r) and per-row padding / positions: row b has ``pads[b]`` padding tokens
    first and real positions starting at ``offsets[b]``."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 2, length, 8, generator=generator, dtype=dtype)
    k = torch.randn(batch, heads, length, 8, generator=generator, dtype=dtype)
    v = torch.randn(batch, heads, length, 5, generator=generator, dtype=dtype)
    valid = torch.ones(batch, length, dtype=torch.bool)
    for row, pad in enumerate(pads):
        valid[row, :pad] = False
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0) + torch.tensor(offsets)[:, None]
    positions = positions.masked_fill(~valid, 1)  # what generate gives padding
    return q, k, v, positions, valid


def _reference_rows(q, k, v, positions, valid, geometry, query_index):
    """Reference MLR output of query index ``query_index`` over all keys up to it: (B, Hk, g, dv)."""
    batch, heads, groups, _, width = q.shape
    end = query_index + 1
    outs = []
    for group in range(groups):
        out = mlr_attention_reference(q[:, :, group, :end], k[:, :, :end], v[:, :, :end], ranks=geometry.ranks,
                                      block_sizes=geometry.block_sizes, scales=list(geometry.level_scales),
                                      positions=positions[:, :end], attention_mask=valid[:, :end],
                                      average_levels=geometry.average_levels)
        outs.append(out[:, :, -1])
    return torch.stack(outs, dim=2)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
def test_decode_step_equals_the_reference(static, average_levels):
    """Prefill 9 tokens, then one token at a time across every block boundary, rows padded and offset differently
    (their blocks differ), two query rows per cached head (grouped-query attention); and with every row in step."""
    geometry = _geometry(average_levels)
    for pads, offsets in (((0, 5, 13), (0, 0, 3)), ((0, 0, 0), (0, 0, 0))):
        q, k, v, positions, valid = _rows(pads=pads, offsets=offsets)
        layer = _layer(static, geometry)
        _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
        for index in range(9, 40):
            written = _write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                             valid[:, index:index + 1])
            got = _attend(q[:, :, :, index], written, geometry)
            expected = _reference_rows(q, k, v, positions, valid, geometry, index)
            real = valid[:, index][:, None, None, None]
            torch.testing.assert_close(got * real, expected * real, **EXACT, msg=f"step {index}, pads {pads}")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decode_step_with_levels_covering_the_whole_cache_equals_the_reference(static, dtype):
    """Blocks 64 and 32 wider than a 30-slot cache: levels 2 and 3 both hold every slot from slot 0, so the eager
    step scores them with one ``baddbmm_`` over their adjacent dim-major rows (level 4, blocks of 4, on its own);
    rows in step, every step up to the cache's last slot, float64 exactly and float32 within rounding."""
    geometry = MLRGeometry.build(RANKS, [64, 32, 4], [0.5, 0.7, 0.9, 1.1])
    q, k, v, positions, valid = _rows(length=30, pads=(0, 0, 0), offsets=(0, 0, 0), dtype=dtype)
    layer = _layer(static, geometry, capacity=30)
    if not static:
        layer.reserve(30)  # generate's exact allocation: 30 slots, below both blocks
    _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    tolerance = EXACT if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-5)
    for index in range(9, 30):
        written = _write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                         valid[:, index:index + 1])
        widths = layer.ring_widths
        assert widths[0] == widths[1] == layer.keys_storage().shape[2] and widths[2] == 4
        got = _attend(q[:, :, :, index], written, geometry)
        plan = next(value for value in written[1].memo.values() if isinstance(value, DecodeReadPlan))
        assert len(plan.shared_groups) == 2  # levels 2 and 3 in one baddbmm_, level 4 on its own
        expected = _reference_rows(q.double(), k.double(), v.double(), positions, valid, geometry, index)
        torch.testing.assert_close(got.double(), expected, **tolerance, msg=f"step {index}")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
def test_decode_step_over_the_slots_in_use_with_host_positions_equals_the_reference(static, average_levels):
    """What an eager model step runs: rows in step, keys and values narrowed to the slots up to the newest position,
    the step's plan made from host integers (no additive mask when every row holds every slot). Every step across
    every block boundary, float64 exactly; without padding, and with padding that keeps the rows in step but starts
    them later (then the mask is kept)."""
    geometry = _geometry(average_levels)
    for pads in ((0, 0, 0), (0, 2, 4)):
        q, k, v, positions, valid = _rows(pads=pads, offsets=(0, 0, 0))
        positions = torch.arange(40).expand(3, 40)  # padding first, then real tokens at the same positions per row
        layer = _layer(static, geometry)
        _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
        for index in range(9, 40):
            written = _write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1],
                             positions[:, index:index + 1], valid[:, index:index + 1])
            assert written[0].keys.shape[2] == index - layer.base + 1  # the slots in use
            assert written[1].facts.shared_newest == index
            got = _attend(q[:, :, :, index], written, geometry)
            expected = _reference_rows(q, k, v, positions, valid, geometry, index)
            torch.testing.assert_close(got, expected, **EXACT, msg=f"step {index}, pads {pads}")
            plan = next(value for value in written[1].memo.values() if isinstance(value, DecodeReadPlan))
            assert plan.shared_groups is not None
            assert (plan.additive_mask is None) == (pads == (0, 0, 0))  # every row holds every slot


def _lane_step(layer, keys, values, positions, query, geometry):
    """What the ``"mlr"`` function runs for a forward of rows in step: the step plan, ``update``, the forward's
    ``StepLane``s (one per run inside a block), each run's write and read. keys, values (B, Hk, c, ·); query
    (B, Hq, c, r). Returns (output (B, c, Hq, dv), or None when the lane does not apply; step)."""
    step = build_step(cache=Cache(layers=[layer]), positions=positions, valid=None, batch=keys.shape[0],
                      length=keys.shape[2], device=keys.device, geometries=(tuple(geometry.block_sizes),))
    level_keys, level_values = layer.update(keys, values, kwargs={STEP_KEY: step})
    needed = step.facts.newest - layer.base + 1
    if not isinstance(layer, MLRStaticKeyCacheLayer):
        needed = max(needed, step.facts.tokens_before + keys.shape[2])
    lanes = plan_step_lanes(geometry, step, layer.base, layer.capacity, layer.ring_widths, values.shape[-1], needed,
                            query.dtype, query.device, geometry.level_scales)
    if lanes is None:
        return None, step
    outputs, start = [], 0
    for lane in lanes:
        run = slice(start, start + lane.tokens)
        storages = layer.write_in_step(level_keys[:, :, run], level_values[:, :, run], lane)
        if storages is None:
            assert start == 0
            return None, step
        outputs.append(mlr_lane_attention(query[:, :, run], *storages, lane))
        start += lane.tokens
    return torch.cat(outputs, dim=1), step


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3])
def test_lane_writes_what_store_writes_and_reads_the_reference(static, average_levels, dtype, tokens):
    """The eager lane of rows in step (writes from host integers, strided reads of the whole storage) against the
    general path on a twin layer (the same slots, rings and positions) and the reference: one token or chunks of
    three (runs split where a block ends) at every position across every block boundary, two query heads per
    cached head; without padding, with left padding (rows in step, later first positions: the lane keeps a mask),
    and rows at an offset (``base`` > 0). float64 exactly, float32 within rounding."""
    geometry = _geometry(average_levels)
    tolerance = EXACT if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-5)
    for pads, offset in (((0, 0, 0), 0), ((0, 2, 4), 0), ((0, 0, 0), 17)):
        q, k, v, _, valid = _rows(pads=pads, offsets=(0, 0, 0), dtype=dtype)
        positions = torch.arange(40).expand(3, 40) + offset  # padding first, then real tokens in step
        lane_layer, general = _layer(static, geometry, capacity=64), _layer(static, geometry, capacity=64)
        for layer in (lane_layer, general):
            _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
        taken = 0
        for index in range(9, 39, tokens):
            chunk = slice(index, index + tokens)
            query = q[:, :, :, chunk].reshape(3, 4, tokens, 8)  # query head h * 2 + g reads cached head h
            got, step = _lane_step(lane_layer, k[:, :, chunk], v[:, :, chunk], positions[:, chunk], query, geometry)
            if got is None:  # a dynamic layer that must grow takes the general path for this step
                assert not static
                written = _write(lane_layer, k[:, :, chunk], v[:, :, chunk], positions[:, chunk], valid[:, chunk])
                got = _attend(q[:, :, :, chunk].reshape(3, 2, 2 * tokens, 8), written, geometry)
                got = got.reshape(3, 4, tokens, 5).transpose(1, 2)
            else:
                taken += 1
            _write(general, k[:, :, chunk], v[:, :, chunk], positions[:, chunk], valid[:, chunk])
            for i in range(tokens):
                expected = _reference_rows(q.double(), k.double(), v.double(), positions, valid, geometry, index + i)
                torch.testing.assert_close(got[:, i].double(), expected.reshape(3, 4, 5), **tolerance,
                                           msg=f"token {index + i}, pads {pads}, offset {offset}")
            assert lane_layer.get_seq_length() == general.get_seq_length()
        assert taken >= 28 // tokens
        used = 39 + offset - lane_layer.base
        for got, expected in ((lane_layer.keys_storage()[:, :, :used], general.keys_storage()[:, :, :used]),
                              (lane_layer.values_storage()[:, :, :used], general.values_storage()[:, :, :used]),
                              (lane_layer.fine_storage, general.fine_storage),
                              (lane_layer.last_positions, general.last_positions),
                              (lane_layer.first_positions, general.first_positions)):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("tokens", [1, 7])
def test_lanes_over_blocks_wider_than_a_template_window_equal_the_reference(average_levels, tokens):
    """A lane is made from a template of ``TEMPLATE_SLOTS`` slots of its run's finest block (or one starting at the
    run, when the run crosses the window's end): with finest blocks of 2.5 windows (160 slots) every step from slot
    1 to 330, one token or chunks of 7 (runs split where a block ends) -- across template windows, the finer block
    boundary at 160 and the coarser one at 320 -- equals the reference in float64, and writes exactly what the
    general path writes on a twin layer (slots, rings, positions)."""
    geometry = MLRGeometry.build([4, 2, 2], [320, 160], [0.5, 0.7, 0.9], average_levels=average_levels)
    assert geometry.block_sizes[-1] > 2 * TEMPLATE_SLOTS
    q, k, v, positions, valid = _rows(batch=1, length=331, pads=(0,), offsets=(0,))
    lane_layer, general = _layer(True, geometry, capacity=336), _layer(True, geometry, capacity=336)
    for layer in (lane_layer, general):
        _write(layer, k[:, :, :1], v[:, :, :1], positions[:, :1], valid[:, :1])
    checked = (63, 64, 65, 127, 128, 159, 160, 161, 319, 320, 321, 330)
    for index in range(1, 331, tokens):
        chunk = slice(index, min(index + tokens, 331))
        count = chunk.stop - chunk.start
        got, _ = _lane_step(lane_layer, k[:, :, chunk], v[:, :, chunk], positions[:, chunk],
                            q[:, :, :, chunk].reshape(1, 4, count, 8), geometry)
        assert got is not None, f"step {index} left the lane"
        _write(general, k[:, :, chunk], v[:, :, chunk], positions[:, chunk], valid[:, chunk])
        for i in range(count):
            if (index + i) % 7 == 0 or index + i in checked:
                expected = _reference_rows(q, k, v, positions, valid, geometry, index + i)
                torch.testing.assert_close(got[:, i], expected.reshape(1, 4, 5), **EXACT, msg=f"token {index + i}")
    for got, expected in ((lane_layer.keys_storage(), general.keys_storage()),
                          (lane_layer.values_storage(), general.values_storage()),
                          (lane_layer.fine_storage, general.fine_storage),
                          (lane_layer.last_positions, general.last_positions)):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("draft", [1, 3, 7])
def test_lane_writes_while_recording_crop_back_exactly(static, draft):
    """Speculative decoding over lanes: verification chunks of ``draft`` tokens written by the lane while the cache
    records, then cropped back by 0..draft-1 tokens (the restore from host positions, one indexed assignment),
    leave the state a layer that only ever wrote the accepted tokens holds -- slots, rings and positions -- and the
    next chunk's outputs equal the reference, across block boundaries (blocks of 16, 8 and 4)."""
    geometry = _geometry(average_levels=True)
    q, k, v, positions, valid = _rows(length=64, pads=(0, 0, 0), offsets=(0, 0, 0))
    speculative, plain = _layer(static, geometry, capacity=80), _layer(static, geometry, capacity=80)
    for layer in (speculative, plain):
        if not static:
            layer.reserve(80)  # generate's exact allocation: the lane never waits for growth here
        _write(layer, k[:, :, :5], v[:, :, :5], positions[:, :5], valid[:, :5])
    speculative.activate_past_recording()
    generator = torch.Generator().manual_seed(draft)
    index = 5
    while index + draft <= 60:
        chunk = slice(index, index + draft)
        query = q[:, :, :, chunk].reshape(3, 4, draft, 8)
        got, _ = _lane_step(speculative, k[:, :, chunk], v[:, :, chunk], positions[:, chunk], query, geometry)
        assert got is not None
        for i in range(draft):
            expected = _reference_rows(q, k, v, positions, valid, geometry, index + i)
            torch.testing.assert_close(got[:, i], expected.reshape(3, 4, 5), **EXACT, msg=f"token {index + i}")
        accepted = int(torch.randint(1, draft + 1, (1,), generator=generator))
        speculative.crop(accepted - draft)
        # what the rejected tokens' rows would hold had they never been written: the accepted ones only
        _write(plain, k[:, :, index:index + accepted], v[:, :, index:index + accepted],
               positions[:, index:index + accepted], valid[:, index:index + accepted])
        used = index + accepted
        assert torch.equal(speculative.last_positions, plain.last_positions)
        torch.testing.assert_close(speculative.keys_storage()[:, :, :used], plain.keys_storage()[:, :, :used],
                                   atol=0, rtol=0)
        for ring_got, ring_expected, size in zip(speculative.rings, plain.rings, geometry.block_sizes):
            block = (used - 1) // size * size  # the entries of the newest position's block that are held
            held = (used - 1) % size + 1
            torch.testing.assert_close(ring_got[:, :, :held], ring_expected[:, :, :held], atol=0, rtol=0,
                                       msg=f"level of block {size} at {used} (block {block})")
        index += accepted


def test_lane_refusals_leave_the_step_to_the_general_path():
    """Rows at different newest positions and a layer of another capacity get no lane write (nothing is written),
    so that the general path runs; a half-precision step gets lanes its op does not read (the softmax runs wider);
    a chunk crossing more block boundaries than ``MAX_RUNS`` takes the general chunk op."""
    geometry = _geometry()
    q, k, v, positions, valid = _rows(pads=(0, 0, 0), offsets=(0, 0, 3))
    layer = _layer(True, geometry)
    _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    token = slice(9, 10)
    got, step = _lane_step(layer, k[:, :, token], v[:, :, token], positions[:, token],
                           q[:, :, :, 9].reshape(3, 4, 1, 8), geometry)
    assert got is None and step.facts.shared_newest is None
    q, k, v, positions, valid = _rows(pads=(0, 0, 0), offsets=(0, 0, 0))
    layer = _layer(True, geometry)
    _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    step = build_step(cache=Cache(layers=[layer]), positions=positions[:, token], valid=None, batch=3, length=1,
                      device=k.device, geometries=(tuple(geometry.block_sizes),))
    assert not plan_step_lanes(geometry, step, layer.base, 48, layer.ring_widths, 5, 10, torch.bfloat16, k.device,
                               geometry.level_scales)[0].readable
    lanes = plan_step_lanes(geometry, step, layer.base, 50, layer.ring_widths, 5, 10, torch.float64, k.device,
                            geometry.level_scales)
    before = layer.keys_storage().clone()
    keys, values = layer.update(k[:, :, token], v[:, :, token], kwargs={STEP_KEY: step})
    assert layer.write_in_step(keys, values, lanes[0]) is None  # planned for 50 slots, the layer has 48
    assert torch.equal(layer.keys_storage(), before)
    runs = lane_runs(geometry, first=9, tokens=4 * (MAX_RUNS + 1))
    assert len(runs) > MAX_RUNS and sum(length for _, length in runs) == 4 * (MAX_RUNS + 1)
    assert all(start // 4 == (start + length - 1) // 4 for start, length in runs)  # each run inside one block
    step = build_step(cache=Cache(layers=[layer]), positions=torch.arange(9, 29).expand(3, 20), valid=None, batch=3,
                      length=20, device=k.device, geometries=(tuple(geometry.block_sizes),))
    assert plan_step_lanes(geometry, step, layer.base, 48, layer.ring_widths, 5, 29, torch.float64, k.device,
                           geometry.level_scales) is None


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["gpt2", "gpt2_averaged", "llama"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("read", ["lane", "maps", "grad"])
def test_model_decode_steps_of_rows_in_step_take_the_lane(family, static, read):
    """A model's eager decode step of rows in step (batch 3, no padding) writes each MLR layer's token with three
    ``index_copy_`` and none of the general path's copies or indexed assignments -- also when the general op reads
    it (``output_attentions`` of the eager implementation, or gradients enabled) -- and its logits equal the
    uncached forward's (float64). Block boundaries are crossed on the way (10 steps over blocks of 4 and 8)."""
    eager = dict(attn_implementation="mlr_eager" if family == "llama" else "eager") if read == "maps" else {}
    if family.startswith("gpt2"):  # levels summed (scales applied by the matmuls), or averaged (one multiplier)
        model = tiny_lm("mlr" if family == "gpt2" else "mlr_avg_mup", n_layer=3, **eager).double()
        layers = 3
    else:
        config = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        torch.manual_seed(0)
        model = hf_structattn.patch(transformers.LlamaForCausalLM(config).double().eval(), mlr_ranks=[8, 4, 4],
                                    mlr_block_sizes=[8, 4])
        if eager:
            model.set_attn_implementation(eager["attn_implementation"])
        layers = 2
    ids = torch.randint(2, 61, (3, 18), generator=torch.Generator().manual_seed(5))
    cache = transformers.StaticCache(config=model.config, max_cache_len=24) if static else \
        transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], cache=cache)
    for index in range(8, 18):
        with torch.set_grad_enabled(read == "grad"), _OpCounter() as counter:
            out = model(ids[:, index:index + 1], cache=cache, output_attentions=read == "maps")
        assert counter.ops["index_copy_"] == 3 * layers, (index, counter.ops)
        assert not any(counter.ops[name] for name in ("copy_", "index_put_", "scatter_add_", "narrow_copy"))
        if read == "maps":
            width = 24 if static else index + 1  # a static cache's maps span its slots, as transformers' do
            assert all(maps.shape[-1] == width for maps in out.attentions)
        with torch.no_grad():
            expected = model(ids[:, :index + 1], use_cache=False).logits[:, -1]
        torch.testing.assert_close(out.logits[:, -1].detach(), expected, **EXACT, msg=f"step {index}")


@pytest.mark.parametrize("argument, message", [
    ({"softcap": 30.0}, "soft-capping"), ({"cu_seq_lens_q": torch.tensor([0, 1])}, "packed sequences"),
    ({"sliding_window": 4}, "sliding-window layer")])
def test_decode_steps_of_rows_in_step_still_refuse_what_mlr_refuses(argument, message):
    """The attention function tries the lane first for rows in step; an argument MLR refuses still fails there with
    its error (the lane leaves such a step to the general path, which checks it), and the cache is left as it was."""
    model = tiny_lm("mlr", n_layer=2).double()
    ids = torch.randint(2, 61, (1, 9), generator=torch.Generator().manual_seed(3))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], cache=cache)
        with pytest.raises(ValueError, match=message):
            model(ids[:, 8:], cache=cache, **argument)
        assert cache.get_seq_length() == 8
        torch.testing.assert_close(model(ids[:, 8:], cache=cache).logits[:, -1], model(ids).logits[:, -1], **EXACT)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("offsets", [(0, 0, 0), (0, 2, 5)])
def test_token_by_token_writes_store_what_one_chunk_write_stores(static, offsets):
    """The eager decode write (every row's token in one slot: narrowed copies and one ``index_copy_``; rows at
    different positions: indexed assignments) leaves the slots and rings a single 40-token write leaves."""
    geometry = _geometry()
    _, k, v, positions, valid = _rows(pads=(0, 0, 0), offsets=offsets)
    stepwise, chunked = _layer(static, geometry), _layer(static, geometry)
    _write(stepwise, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    for index in range(9, 40):
        _write(stepwise, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
               valid[:, index:index + 1])
    _write(chunked, k, v, positions, valid)
    used = 40 + max(offsets)
    for got, expected in ((stepwise.keys_storage(), chunked.keys_storage()),
                          (stepwise.values_storage(), chunked.values_storage())):
        torch.testing.assert_close(got[:, :, :used], expected[:, :, :used], atol=0, rtol=0)
    for got, expected in zip(stepwise.rings, chunked.rings):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert torch.equal(stepwise.last_positions, chunked.last_positions)
    assert torch.equal(stepwise.first_positions, chunked.first_positions)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
def test_chunks_equal_the_reference(static, average_levels):
    """Chunks of 7, 6, 11 and 9 tokens, longer than the finest block and crossing every level's boundary, whose
    writes overwrite ring entries their own first queries still read."""
    geometry = _geometry(average_levels)
    q, k, v, positions, valid = _rows()
    layer = _layer(static, geometry)
    start = 0
    for size in (7, 6, 11, 9):
        end = start + size
        written = _write(layer, k[:, :, start:end], v[:, :, start:end], positions[:, start:end], valid[:, start:end])
        view = written[0]
        assert view.held == bool(start)
        if start:
            assert view.replaced is not None and view.replaced.shape[:3] == (3, 2, size)
            rows = q[:, :, :, start:end].reshape(3, 2, 2 * size, 8)
            got = _attend(rows, written, geometry).reshape(3, 2, 2, size, 5)
            for index in range(start, end):
                expected = _reference_rows(q, k, v, positions, valid, geometry, index)
                real = valid[:, index][:, None, None, None]
                torch.testing.assert_close(got[:, :, :, index - start] * real, expected * real, **EXACT)
        start = end


def test_padding_is_not_stored_and_rows_are_position_aligned():
    geometry = _geometry()
    _, k, v, positions, valid = _rows(length=20)
    layer = MLRKeyCacheLayer(geometry)
    _write(layer, k, v, positions, valid)
    assert layer.base == 0 and layer.first_positions.tolist() == [0, 0, 3]
    assert layer.last_positions.tolist() == [19, 14, 9]
    assert layer.keys.shape[-2] == 20  # slots in use: the longest row
    row = 1  # 5 padding tokens: its real token k (position k) sits in slot k
    torch.testing.assert_close(layer.keys[row, :, :15], k[row, :, 5:, :4], atol=0, rtol=0)
    assert layer.get_seq_length() == 20  # transformers' sequence length counts padding


def test_non_contiguous_positions_in_a_cache_are_refused():
    layer = MLRKeyCacheLayer(_geometry())
    _, k, v, positions, valid = _rows(length=12, pads=(0, 0, 0), offsets=(0, 0, 0))
    _write(layer, k[:, :, :6], v[:, :, :6], positions[:, :6], valid[:, :6])
    with pytest.raises(ValueError, match="consecutive increasing positions"):
        _write(layer, k[:, :, 6:8], v[:, :, 6:8], positions[:, 6:8] + 2, valid[:, 6:8])


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("chunks", [[1] * 7, [7], [3, 1, 5], [4]])
def test_crop_restores_the_state_of_the_shorter_prefix(static, chunks):
    """Recording, then a draft written as decode steps or one verification chunk (longer than the finest block),
    crossing block boundaries at every level, then crop: the layer equals one that never saw the draft. A crop of
    at most the finest block's length after writes without padding ([4]: 2 tokens) restores every ring with one
    indexed assignment."""
    geometry = _geometry()
    _, k, v, positions, valid = _rows(length=40, pads=(0, 5, 13), offsets=(0, 0, 3))
    for prefix in (14, 29):  # the draft crosses the 16-block of rows 0 and 1; 29 + 7 crosses the 32 boundary
        layer, clean = _layer(static, geometry), _layer(static, geometry)
        for target in (layer, clean):
            _write(target, k[:, :, :prefix], v[:, :, :prefix], positions[:, :prefix], valid[:, :prefix])
        layer.activate_past_recording()
        start = prefix
        for size in chunks:
            _write(layer, k[:, :, start:start + size], v[:, :, start:start + size], positions[:, start:start + size],
                   valid[:, start:start + size])
            start += size
        keep = 2
        layer.crop(-(start - prefix - keep))
        _write(clean, k[:, :, prefix:prefix + keep], v[:, :, prefix:prefix + keep], positions[:, prefix:prefix + keep],
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
    layer = _layer(False, _geometry())
    _, k, v, positions, valid = _rows(length=20, pads=(0, 0, 0), offsets=(0, 0, 0))
    _write(layer, k[:, :, :10], v[:, :, :10], positions[:, :10], valid[:, :10])
    with pytest.raises(ValueError, match="activate_past_recording"):
        layer.crop(-1)
    layer.crop(0)
    layer.activate_past_recording()
    _write(layer, k[:, :, 10:13], v[:, :, 10:13], positions[:, 10:13], valid[:, 10:13])
    with pytest.raises(ValueError, match=r"only the 3 tokens written since the last crop"):
        layer.crop(-4)
    layer.crop(-3)
    assert layer.get_seq_length() == 10 and layer.last_positions.tolist() == [9, 9, 9]


@pytest.mark.parametrize("static", [False, True])
def test_rollback_window_bounds_the_log_and_crops_within_it_exactly(static):
    """With a rollback window of 5 tokens, a 30-token recorded prefill logs only its last 5 writes (the log does
    not grow with the context); crop(-5) then restores the 25-token state exactly, crop(-6) is refused."""
    geometry = _geometry()
    _, k, v, positions, valid = _rows(length=40, pads=(0, 5, 13), offsets=(0, 0, 3))
    layer, clean = _layer(static, geometry), _layer(static, geometry)
    layer.rollback_window = 5
    layer.activate_past_recording()
    _write(layer, k[:, :, :30], v[:, :, :30], positions[:, :30], valid[:, :30])
    _write(clean, k[:, :, :25], v[:, :, :25], positions[:, :25], valid[:, :25])
    log_tokens = {tensor.shape[-2] if tensor.dim() == 4 else tensor.shape[-1]
                  for tensor in layer.rollback_log.tensors()}
    assert max(log_tokens) <= 5  # the log's fixed buffers are 5 tokens long
    assert layer.rollback_log.tokens == 5
    with pytest.raises(ValueError, match=r"only the 5 tokens"):
        layer.crop(-6)
    layer.crop(-5)
    for target in (layer, clean):  # the next decode steps see the same state
        _write(target, k[:, :, 25:28], v[:, :, 25:28], positions[:, 25:28], valid[:, 25:28])
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


@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup"])
def test_offset_and_per_row_positions_cached_equal_uncached(variant):
    model = tiny_lm(variant).double()
    ids = torch.randint(2, 61, (2, 24))
    positions = torch.arange(5, 29)[None]
    reference = model(ids, position_ids=positions, use_cache=False).logits
    for cache in (model.transformer.new_cache(), transformers.DynamicCache(),
                  model.transformer.new_cache(max_cache_len=30)):
        steps = [model(ids[:, :9], position_ids=positions[:, :9], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, t:t + 1], position_ids=positions[:, t:t + 1], cache=cache, use_cache=True).logits
                  for t in range(9, 24)]
        torch.testing.assert_close(torch.cat(steps, 1), reference, **EXACT)


@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup", "mixed"])
def test_static_cache_generates_what_the_dynamic_cache_generates(variant):
    model = tiny_lm(variant)
    prompt = torch.randint(2, 61, (2, 7))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0  # left padding
    common = dict(max_new_tokens=30, min_new_tokens=30, attention_mask=mask, pad_token_id=1)
    for kwargs in (dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=2)):
        dynamic = model.generate(prompt, **common, **kwargs)
        static = model.generate(prompt, cache_implementation="static", **common, **kwargs)
        torch.testing.assert_close(static, dynamic)
    torch.manual_seed(5)
    dynamic = model.generate(prompt, do_sample=True, top_k=20, num_return_sequences=2, **common)
    torch.manual_seed(5)
    static = model.generate(prompt, do_sample=True, top_k=20, num_return_sequences=2, cache_implementation="static",
                            **common)
    torch.testing.assert_close(static, dynamic)


def test_formula_bytes_and_layer_types():
    model = tiny_lm("mlr")
    geometry = model.config.mlr_geometry()
    ids = torch.randint(2, 61, (3, 40))
    for max_cache_len in (None, 20, 48):
        cache = model.transformer.new_cache(max_cache_len=max_cache_len)
        assert {type(layer) for layer in cache.layers} == {MLRKeyCacheLayer if max_cache_len is None
                                                           else MLRStaticKeyCacheLayer}
        length = 20 if max_cache_len == 20 else 40
        model(ids[:, :length], cache=cache, use_cache=True)
        held = length if max_cache_len is None else max_cache_len  # a static cache holds its whole allocation
        layer = cache.layers[0]
        assert layer.key_cache_elements() == geometry.key_cache_elements(held)
        itemsize = layer.keys.element_size()
        assert key_cache_bytes(cache) == model.config.n_layer * 3 * model.config.n_head * \
            geometry.key_cache_elements(held) * itemsize


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_half_precision_decode_is_finite_and_close_to_float32(dtype, compiled):
    """Masked fills and the softmax run in promote_types(dtype, float32): padded and unwritten slots never overflow;
    eagerly and in the formulation torch.compile traces (level-1 scores accumulated in float32 there too)."""
    geometry = _geometry()
    q, k, v, positions, valid = _rows(length=18, dtype=torch.float32)
    torch._dynamo.reset()  # the traced ``_attend`` of other tests does not count against this one's recompile budget
    attend = torch.compile(_attend, backend="eager", fullgraph=True) if compiled else _attend
    results = {}
    for run_dtype in (torch.float32, dtype):
        layer, outputs = MLRStaticKeyCacheLayer(24, geometry), []
        cast = (lambda t: t.to(run_dtype))
        _write(layer, cast(k[:, :, :6]), cast(v[:, :, :6]), positions[:, :6], valid[:, :6])
        for index in range(6, 18):
            written = _write(layer, cast(k[:, :, index:index + 1]), cast(v[:, :, index:index + 1]),
                             positions[:, index:index + 1], valid[:, index:index + 1])
            outputs.append(attend(cast(q[:, :, :, index]), _traced(written) if compiled else written, geometry))
        results[run_dtype] = torch.stack(outputs)
    assert results[dtype].dtype == dtype and torch.isfinite(results[dtype]).all()
    eps = torch.finfo(dtype).eps
    scale = float(results[torch.float32].abs().max())
    torch.testing.assert_close(results[dtype].float(), results[torch.float32], atol=40 * eps * scale, rtol=40 * eps)


def test_compiled_decode_steps_do_not_recompile_per_step():
    """A compiled decode step must not specialise on the step: after the first steps further steps, crossing block
    boundaries, compile nothing."""
    model = tiny_lm("mlr")
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend=counting_backend, fullgraph=True)
    cache = model.transformer.new_cache(max_cache_len=40)
    prompt = torch.randint(2, 61, (2, 6))
    token = torch.randint(2, 61, (2, 1))
    settled = None
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        for step in range(20):  # positions 6 .. 25: across the 8- and 16-blocks of the tiny model
            if step == 4:
                settled = len(graphs)
            forward(token, cache=cache, use_cache=True, position_ids=torch.full((2, 1), 6 + step))
    assert settled > 0 and len(graphs) == settled


def test_compiled_decode_equals_eager():
    """``model.forward = torch.compile(model.forward)`` with the static cache (transformers' recipe) gives the eager
    tokens; the decode step traces the fixed-shape path (flat finer levels, indexed writes) with no graph break."""
    model = tiny_lm("mlr")
    prompt = torch.randint(2, 61, (2, 6))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    common = dict(max_new_tokens=16, min_new_tokens=16, pad_token_id=1, do_sample=False, attention_mask=mask,
                  cache_implementation="static")
    eager = model.generate(prompt, **common)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        torch.testing.assert_close(model.generate(prompt, **common), eager)
    finally:
        del model.forward


def test_compiled_forward_over_the_dynamic_cache_falls_back_quietly_and_fullgraph_names_the_static_cache():
    """A dynamic MLR cache cannot be filled inside a compiled region: ``torch.compile(model.forward)`` over it gives
    the eager tokens (torch.compile runs that frame eagerly), and ``fullgraph=True`` stops with dynamo's report,
    which quotes our message naming the static cache."""
    model = tiny_lm("mlr")
    prompt = torch.randint(2, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    common = dict(max_new_tokens=5, pad_token_id=1, do_sample=False)
    eager = model.generate(prompt, **common)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        assert torch.equal(model.generate(prompt, **common), eager)
    finally:
        del model.forward
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    try:
        with pytest.raises(Exception, match="cache_implementation='static'"):
            model.generate(prompt, **common)
    finally:
        del model.forward
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_compiled_decode_equals_eager_for_t5_and_patched_decoders(family):
    """The same recipe, traced as one graph per step (``fullgraph=True``), for a T5 MLR decoder and a patched Llama
    (grouped-query attention): the compiled tokens and scores are the eager ones, with a left-padded row."""
    torch.manual_seed(0)
    if family == "t5":
        model = transformers.AutoModelForSeq2SeqLM.from_config(hf_structattn.StructAttnT5Config(
            vocab_size=61, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_attention="mlr",
            mlr_ranks=[4, 2, 2], mlr_block_sizes=[8, 4], decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1)).eval()
    else:
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=1))
        model = hf_structattn.patch(llama.eval(), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4]).eval()
    prompt = torch.randint(2, 61, (2, 7))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    common = dict(max_new_tokens=14, min_new_tokens=14, do_sample=False, attention_mask=mask,
                  cache_implementation="static", return_dict_in_generate=True, output_scores=True)
    eager = model.generate(prompt, **common)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    try:
        compiled = model.generate(prompt, **common)
    finally:
        del model.forward
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.scores), torch.stack(eager.scores), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup"])
def test_inductor_generate_equals_eager(variant):
    """The same with inductor (minutes on CPU), at two batch sizes through one compiled forward."""
    model = tiny_lm(variant)
    common = dict(max_new_tokens=6, min_new_tokens=6, pad_token_id=1, do_sample=False, cache_implementation="static")
    prompts = [torch.randint(2, 61, (batch, 20)) for batch in (1, 3)]
    eager = [model.generate(prompt, **common) for prompt in prompts]
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward)
    try:
        for prompt, tokens in zip(prompts, eager):
            torch.testing.assert_close(model.generate(prompt, **common), tokens)
    finally:
        del model.forward


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("query_rows", [1, 2])
def test_compiled_decode_step_formulation_equals_eager_on_rows_in_different_blocks(static, average_levels,
                                                                                   query_rows):
    """The formulation ``mlr_decode_step`` traces under torch.compile (tiled finer levels and the mask in one tensor,
    level-1 scores and the values by ``baddbmm``) equals the eager formulations (shared block starts where rows are
    in step, the flat scatter where they are not) and the reference in float64, on left-padded rows with offsets
    whose current blocks start at different slots, at every step across block boundaries; with one query row per
    cached head (what inductor would lower to its own loops) and with a grouped-query pair."""
    geometry = _geometry(average_levels)
    q, k, v, positions, valid = _rows(length=40, pads=(0, 5, 13), offsets=(0, 0, 3))
    q = q[:, :, :query_rows]
    layer = _layer(static, geometry)
    _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    torch._dynamo.reset()  # the traced ``_attend`` of other tests does not count against this one's recompile budget
    attend = torch.compile(_attend, backend="eager", fullgraph=True)
    for index in range(9, 40):
        written = _write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                         valid[:, index:index + 1])
        eager = _attend(q[:, :, :, index], written, geometry)
        compiled, weights = attend(q[:, :, :, index], _traced(written), geometry, return_weights=True)
        torch.testing.assert_close(compiled, eager, **EXACT)
        real = valid[:, index]  # a padding query's output is arbitrary
        reference = _reference_rows(q, k, v, positions, valid, geometry, index)
        torch.testing.assert_close(compiled[real], reference[real], **EXACT)
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights[..., 0]), **EXACT)
