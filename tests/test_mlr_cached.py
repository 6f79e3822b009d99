"""The cached MLR op (``structattn_mlr_cached.mlr_cached_attention``) over what a cache layer's ``update`` wrote:
each of its three formulations (in-step, general, traced) against the naive reference, across every block
boundary, with padding, offsets, grouped-query heads, averaged levels, chunks, gradients and half precision; and
which formulation each kind of step takes."""

import dataclasses

import pytest
import torch
from transformers.cache_utils import Cache

from hf_structattn.modeling import structattn_mlr_cached
from hf_structattn.modeling.structattn_cache import MLRKeyCacheLayer, MLRStaticKeyCacheLayer
from hf_structattn.modeling.structattn_geometry import MLRGeometry
from hf_structattn.modeling.structattn_mlr_cached import mlr_cached_attention
from hf_structattn.modeling.structattn_reference import mlr_attention_reference
from hf_structattn.modeling.structattn_step import STEP_KEY, build_step

RANKS, BLOCKS = [4, 2, 1, 1], [16, 8, 4]
EXACT = dict(atol=1e-12, rtol=1e-12)


def _geometry(average_levels=False, blocks=BLOCKS):
    return MLRGeometry.build(RANKS, blocks, [0.5, 0.7, 0.9, 1.1], average_levels=average_levels)


def _layer(static, geometry, capacity=48):
    return MLRStaticKeyCacheLayer(capacity, geometry) if static else MLRKeyCacheLayer(geometry)


def _write(layer, keys, values, positions, valid, traced=False):
    """The model's flow for one chunk: the step (one host read), then ``update``, the one write, which returns the
    layer's view. ``traced``: the step as torch.compile sees it (no host facts: fixed shapes, the whole storage)."""
    step = build_step(cache=Cache(layers=[layer]), positions=positions, valid=valid, batch=keys.shape[0],
                      length=keys.shape[2], device=keys.device)
    if traced:
        step = dataclasses.replace(step, facts=None)
    _, view = layer.update(keys, values, kwargs={STEP_KEY: step})
    return view


def _attend(query, view, **kwargs):
    """query (B, Hk, g, c, r) -> (B, Hk, g, c, dv) [, probabilities (B, Hk, g c, S) in slot order]."""
    batch, heads, groups, chunk, width = query.shape
    out, weights = mlr_cached_attention(query.reshape(batch, heads * groups, chunk, width), view, view.plan,
                                        view.plan.geometry.level_scales, **kwargs)
    out = out.transpose(1, 2).reshape(batch, heads, groups, chunk, -1)
    return (out, weights) if kwargs.get("return_weights") else out


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
    end = query_index + 1
    outs = []
    for group in range(q.shape[2]):
        out = mlr_attention_reference(q[:, :, group, :end], k[:, :, :end], v[:, :, :end], ranks=geometry.ranks,
                                      block_sizes=geometry.block_sizes, scales=list(geometry.level_scales),
                                      positions=positions[:, :end], attention_mask=valid[:, :end],
                                      average_levels=geometry.average_levels)
        outs.append(out[:, :, -1])
    return torch.stack(outs, dim=2)


@pytest.fixture
def formulations(monkeypatch):
    """The formulations the op picked, in call order."""
    picked = []
    pick = structattn_mlr_cached._formulation

    def spy(*args, **kwargs):
        picked.append(pick(*args, **kwargs))
        return picked[-1]

    monkeypatch.setattr(structattn_mlr_cached, "_formulation", spy)
    return picked


DECODE_CASES = {  # rows' padding and offsets -> the formulation an eager one-token step takes
    "rows in different blocks": (((0, 5, 13), (0, 0, 3)), "general"),
    "rows in step": (((0, 0, 0), (0, 0, 0)), "in_step"),
    "rows in step, left padded": (((0, 2, 4), None), "in_step"),
}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_step_equals_the_reference(static, average_levels, case, formulations):
    """Prefill 9 tokens, then one token at a time across every block boundary, two query rows per cached head
    (grouped-query attention): rows padded and offset differently (their blocks differ: the general formulation),
    rows in step (the in-step formulation), and rows in step whose padding starts them later (a mask)."""
    geometry = _geometry(average_levels)
    (pads, offsets), expected_formulation = DECODE_CASES[case]
    q, k, v, positions, valid = _rows(pads=pads, offsets=offsets or (0, 0, 0))
    if offsets is None:
        positions = torch.arange(40).expand(3, 40)  # padding first, then real tokens at the same positions per row
    layer = _layer(static, geometry)
    _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    for index in range(9, 40):
        view = _write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                      valid[:, index:index + 1])
        got = _attend(q[:, :, :, index:index + 1], view)[:, :, :, 0]
        expected = _reference_rows(q, k, v, positions, valid, geometry, index)
        real = valid[:, index][:, None, None, None]
        torch.testing.assert_close(got * real, expected * real, **EXACT, msg=f"step {index}, {case}")
    assert set(formulations) == {expected_formulation}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_levels_covering_the_whole_cache_merge_into_one_product(static, dtype, formulations):
    """Blocks 64 and 32 wider than a 30-slot cache: levels 2 and 3 both hold every slot from slot 0, so the in-step
    read scores them with one ``baddbmm_`` over their adjacent dim-major rows (level 4 on its own); rows in step,
    every step up to the cache's last slot, float64 exactly and float32 within rounding."""
    geometry = _geometry(blocks=[64, 32, 4])
    q, k, v, positions, valid = _rows(length=30, pads=(0, 0, 0), offsets=(0, 0, 0), dtype=dtype)
    layer = _layer(static, geometry, capacity=30)
    if not static:
        layer.reserve(30)  # generate's exact allocation: 30 slots, below both blocks
    _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    tolerance = EXACT if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-5)
    for index in range(9, 30):
        view = _write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                      valid[:, index:index + 1])
        assert layer.ring_widths[0] == layer.ring_widths[1] == layer.keys_storage().shape[2]
        got = _attend(q[:, :, :, index:index + 1], view)[:, :, :, 0]
        read = view.layout.read(("in_step", 2, geometry.level_scales))
        assert len(read.groups) == 2  # levels 2 and 3 in one product, level 4 on its own
        expected = _reference_rows(q.double(), k.double(), v.double(), positions, valid, geometry, index)
        torch.testing.assert_close(got.double(), expected, **tolerance, msg=f"step {index}")
    assert set(formulations) == {"in_step"}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("rows_in_step", [False, True])
def test_chunks_equal_the_reference(static, average_levels, rows_in_step, formulations):
    """Chunks of 7, 6, 11, 9, 3 and 2 tokens: longer than the finest block and crossing every level's boundary
    (their writes overwrite ring entries their own first queries still read: the general formulation with the
    replaced entries), and chunks inside one block of rows in step (the in-step formulation)."""
    geometry = _geometry(average_levels)
    pads, offsets = ((0, 0, 0), (0, 0, 0)) if rows_in_step else ((0, 5, 13), (0, 0, 3))
    q, k, v, positions, valid = _rows(pads=pads, offsets=offsets)
    layer = _layer(static, geometry)
    start = 0
    for size in (7, 6, 11, 9, 1, 2):  # the last chunk (37, 38) stays in its finest block
        end = start + size
        view = _write(layer, k[:, :, start:end], v[:, :, start:end], positions[:, start:end], valid[:, start:end])
        assert view.held == bool(start)
        if start:
            got = _attend(q[:, :, :, start:end], view)
            for index in range(start, end):
                expected = _reference_rows(q, k, v, positions, valid, geometry, index)
                real = valid[:, index][:, None, None, None]
                torch.testing.assert_close(got[:, :, :, index - start] * real, expected * real, **EXACT)
        start = end
    assert formulations[-1] == ("in_step" if rows_in_step else "general")
    assert formulations[:3] == ["general"] * 3


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("query_rows", [1, 2])
def test_traced_formulation_equals_the_reference(static, average_levels, query_rows):
    """What torch.compile / torch.export trace (no host facts: the general write, the whole storage read through the
    tiled formulation), compiled with dynamo (fullgraph) and run eagerly, on left-padded rows with offsets whose
    current blocks start at different slots, at every step across block boundaries; with one query row per cached
    head and with a grouped-query pair."""
    geometry = _geometry(average_levels)
    q, k, v, positions, valid = _rows(length=40, pads=(0, 5, 13), offsets=(0, 0, 3))
    q = q[:, :, :query_rows]
    layer = _layer(static, geometry)
    if not static:
        layer.reserve(48)  # a traced write cannot grow the storage
    _write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9], traced=True)
    torch._dynamo.reset()
    attend = torch.compile(_attend, backend="eager", fullgraph=True)
    for index in range(9, 40):
        view = _write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                      valid[:, index:index + 1], traced=True)
        assert view.key_storage.shape[2] == 48 and view.layout.slots == 48
        eager = _attend(q[:, :, :, index:index + 1], view)
        compiled = attend(q[:, :, :, index:index + 1], view)
        torch.testing.assert_close(compiled, eager, **EXACT)
        real = valid[:, index]  # a padding query's output is arbitrary
        reference = _reference_rows(q, k, v, positions, valid, geometry, index)
        torch.testing.assert_close(eager[:, :, :, 0][real], reference[real], **EXACT)
        assert structattn_mlr_cached._formulation(q, view, view.plan, None, False, 0.0) == "traced"


@pytest.mark.parametrize("rows_in_step", [False, True])
def test_query_gradients_through_a_cached_read_equal_the_reference(rows_in_step, formulations):
    """A read with gradients enabled (cached training steps) takes the general formulation, whatever the rows: the
    queries' gradients equal the reference's (float64), one token and a chunk of 3 after a 20-token prefill. (The
    cache holds detached states, as transformers' layers do under ``no_grad`` decoding.)"""
    geometry = _geometry(True)
    pads, offsets = ((0, 0, 0), (0, 0, 0)) if rows_in_step else ((0, 5, 13), (0, 0, 3))
    q, k, v, positions, valid = _rows(pads=pads, offsets=offsets)
    for chunk in (1, 3):
        layer = _layer(False, geometry)
        _write(layer, k[:, :, :20], v[:, :, :20], positions[:, :20], valid[:, :20])
        new = slice(20, 20 + chunk)
        query = q[:, :, :, new].clone().requires_grad_(True)
        view = _write(layer, k[:, :, new], v[:, :, new], positions[:, new], valid[:, new])
        weights = torch.randn(3, 2, 2, chunk, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        (_attend(query, view) * weights).sum().backward()
        reference_query = q[:, :, :, :20 + chunk].clone().requires_grad_(True)
        expected = torch.stack([mlr_attention_reference(
            reference_query[:, :, group], k[:, :, :20 + chunk], v[:, :, :20 + chunk], ranks=geometry.ranks,
            block_sizes=geometry.block_sizes, scales=list(geometry.level_scales), positions=positions[:, :20 + chunk],
            attention_mask=valid[:, :20 + chunk], average_levels=True)[:, :, 20:] for group in range(2)], 2)
        (expected * weights).sum().backward()
        real = valid[:, new][:, None, None, :, None]
        torch.testing.assert_close(query.grad * real, reference_query.grad[:, :, :, 20:] * real, **EXACT)
    assert set(formulations) == {"general"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_reads_take_the_general_formulation_and_match_float32(dtype, formulations):
    """Half-precision storage: products in the storage dtype, the softmax in float32 (the in-step read would run
    it in half precision), close to the float32 read at the dtype's precision."""
    geometry = _geometry()
    q, k, v, positions, valid = _rows(pads=(0, 0, 0), offsets=(0, 0, 0), dtype=torch.float32)
    outputs = {}
    for work in (torch.float32, dtype):
        layer = _layer(False, geometry)
        _write(layer, k[:, :, :25].to(work), v[:, :, :25].to(work), positions[:, :25], valid[:, :25])
        view = _write(layer, k[:, :, 25:26].to(work), v[:, :, 25:26].to(work), positions[:, 25:26], valid[:, 25:26])
        outputs[work] = _attend(q[:, :, :, 25:26].to(work), view).float()
    torch.testing.assert_close(outputs[dtype], outputs[torch.float32], atol=3e-2, rtol=3e-2)
    assert formulations == ["in_step", "general"]
