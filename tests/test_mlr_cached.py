"""The cached MLR op (``structattn_mlr_cached.mlr_cached_attention``) over what a cache layer's ``update`` wrote:
each of its three formulations (in-step, general, traced) against the naive reference, across every block
boundary, with padding, offsets, grouped-query heads, averaged levels, chunks, gradients and half precision; and
which formulation each kind of step is planned to take (the type of its read record)."""

import pytest
import torch

from hf_structattn.modeling.structattn_mlr_plan import GeneralRead, InStepRead, TracedRead
from hf_structattn.modeling.structattn_reference import mlr_attention_reference

from cache_helpers import EXACT, attend, cache_layer, make_rows, reference_rows, small_geometry, write

FORMULATIONS = {InStepRead: "in_step", GeneralRead: "general", TracedRead: "traced"}


def formulation(view) -> str:
    """The formulation the layer's read record names (the type of ``view.plan.read``)."""
    return FORMULATIONS[type(view.plan.read)]


DECODE_CASES = {  # rows' padding and offsets -> the formulation an eager one-token step takes
    "rows in different blocks": (((0, 5, 13), (0, 0, 3)), "general"),
    "rows in step": (((0, 0, 0), (0, 0, 0)), "in_step"),
    "rows in step, left padded": (((0, 2, 4), None), "in_step"),
}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_step_equals_the_reference(static, average_levels, case):
    """Prefill 9 tokens, then one token at a time across every block boundary, two query rows per cached head
    (grouped-query attention): rows padded and offset differently (their blocks differ: the general formulation),
    rows in step (the in-step formulation), and rows in step whose padding starts them later (a mask)."""
    geometry = small_geometry(average_levels)
    (pads, offsets), expected_formulation = DECODE_CASES[case]
    q, k, v, positions, valid = make_rows(pads=pads, offsets=offsets or (0, 0, 0))
    if offsets is None:
        positions = torch.arange(40).expand(3, 40)  # padding first, then real tokens at the same positions per row
    layer = cache_layer(static, geometry)
    write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    formulations = set()
    for index in range(9, 40):
        view = write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                     valid[:, index:index + 1])
        formulations.add(formulation(view))
        got = attend(q[:, :, :, index:index + 1], view)[:, :, :, 0]
        expected = reference_rows(q, k, v, positions, valid, geometry, index)
        real = valid[:, index][:, None, None, None]
        torch.testing.assert_close(got * real, expected * real, **EXACT, msg=f"step {index}, {case}")
    assert formulations == {expected_formulation}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_levels_covering_the_whole_cache_merge_into_one_product(static, dtype):
    """Blocks 64 and 32 wider than a 30-slot cache: levels 2 and 3 both hold every slot from slot 0, so the in-step
    read scores them with one ``baddbmm_`` over their adjacent dim-major rows (level 4 on its own); rows in step,
    every step up to the cache's last slot, float64 exactly and float32 within rounding."""
    geometry = small_geometry(blocks=[64, 32, 4])
    q, k, v, positions, valid = make_rows(length=30, pads=(0, 0, 0), offsets=(0, 0, 0), dtype=dtype)
    layer = cache_layer(static, geometry, capacity=30)
    if not static:
        layer.reserve(30)  # generate's exact allocation: 30 slots, below both blocks
    write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    tolerance = EXACT if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-5)
    for index in range(9, 30):
        view = write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                     valid[:, index:index + 1])
        assert layer.ring_widths[0] == layer.ring_widths[1] == layer.keys_storage().shape[2]
        got = attend(q[:, :, :, index:index + 1], view)[:, :, :, 0]
        assert formulation(view) == "in_step"
        assert len(view.plan.read.groups) == 2  # levels 2 and 3 in one product, level 4 on its own
        expected = reference_rows(q.double(), k.double(), v.double(), positions, valid, geometry, index)
        torch.testing.assert_close(got.double(), expected, **tolerance, msg=f"step {index}")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("rows_in_step", [False, True])
def test_chunks_equal_the_reference(static, average_levels, rows_in_step):
    """Chunks of 7, 6, 11, 9, 3 and 2 tokens: longer than the finest block and crossing every level's boundary
    (their writes overwrite ring entries their own first queries still read: the general formulation with the
    replaced entries), and chunks inside one block of rows in step (the in-step formulation). The first chunk has no
    read record: it attends to itself with the uncached op."""
    geometry = small_geometry(average_levels)
    pads, offsets = ((0, 0, 0), (0, 0, 0)) if rows_in_step else ((0, 5, 13), (0, 0, 3))
    q, k, v, positions, valid = make_rows(pads=pads, offsets=offsets)
    layer = cache_layer(static, geometry)
    start, formulations = 0, []
    for size in (7, 6, 11, 9, 1, 2):  # the last chunk (37, 38) stays in its finest block
        end = start + size
        view = write(layer, k[:, :, start:end], v[:, :, start:end], positions[:, start:end], valid[:, start:end])
        assert (view.plan.read is not None) == bool(start)
        if start:
            formulations.append(formulation(view))
            got = attend(q[:, :, :, start:end], view)
            for index in range(start, end):
                expected = reference_rows(q, k, v, positions, valid, geometry, index)
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
    geometry = small_geometry(average_levels)
    q, k, v, positions, valid = make_rows(length=40, pads=(0, 5, 13), offsets=(0, 0, 3))
    q = q[:, :, :query_rows]
    layer = cache_layer(static, geometry)
    if not static:
        layer.reserve(48)  # a traced write cannot grow the storage
    write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9], traced=True, groups=query_rows)
    torch._dynamo.reset()
    compiled_attend = torch.compile(attend, backend="eager", fullgraph=True)
    for index in range(9, 40):
        view = write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                     valid[:, index:index + 1], traced=True, groups=query_rows)
        assert view.key_storage.shape[2] == 48 and view.plan.layout.slots == 48
        assert formulation(view) == "traced"
        eager = attend(q[:, :, :, index:index + 1], view)
        compiled = compiled_attend(q[:, :, :, index:index + 1], view)
        torch.testing.assert_close(compiled, eager, **EXACT)
        real = valid[:, index]  # a padding query's output is arbitrary
        reference = reference_rows(q, k, v, positions, valid, geometry, index)
        torch.testing.assert_close(eager[:, :, :, 0][real], reference[real], **EXACT)


@pytest.mark.parametrize("rows_in_step", [False, True])
def test_query_gradients_through_a_cached_read_equal_the_reference(rows_in_step):
    """A read planned with gradients enabled (cached training steps) takes the general formulation, whatever the
    rows: the queries' gradients equal the reference's (float64), one token and a chunk of 3 after a 20-token
    prefill. (The cache holds detached states, as transformers' layers do under ``no_grad`` decoding.)"""
    geometry = small_geometry(True)
    pads, offsets = ((0, 0, 0), (0, 0, 0)) if rows_in_step else ((0, 5, 13), (0, 0, 3))
    q, k, v, positions, valid = make_rows(pads=pads, offsets=offsets)
    for chunk in (1, 3):
        layer = cache_layer(False, geometry)
        write(layer, k[:, :, :20], v[:, :, :20], positions[:, :20], valid[:, :20])
        new = slice(20, 20 + chunk)
        query = q[:, :, :, new].clone().requires_grad_(True)
        view = write(layer, k[:, :, new], v[:, :, new], positions[:, new], valid[:, new], gradients=True)
        assert formulation(view) == "general"
        weights = torch.randn(3, 2, 2, chunk, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        (attend(query, view) * weights).sum().backward()
        reference_query = q[:, :, :, :20 + chunk].clone().requires_grad_(True)
        expected = torch.stack([mlr_attention_reference(
            reference_query[:, :, group], k[:, :, :20 + chunk], v[:, :, :20 + chunk], ranks=geometry.ranks,
            block_sizes=geometry.block_sizes, scales=list(geometry.level_scales), positions=positions[:, :20 + chunk],
            attention_mask=valid[:, :20 + chunk], average_levels=True)[:, :, 20:] for group in range(2)], 2)
        (expected * weights).sum().backward()
        real = valid[:, new][:, None, None, :, None]
        torch.testing.assert_close(query.grad * real, reference_query.grad[:, :, :, 20:] * real, **EXACT)


@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_in_step_reads_accumulate_in_float32(dtype, average_levels):
    """Half-precision storage of rows in step takes the in-step read: each product in the storage dtype, added onto
    float32 scores, the level weights, mask and softmax in float32. It is as close to the float64 reference as the
    general read of the same half-precision cache (which computes the same products), across block boundaries."""
    geometry = small_geometry(average_levels)
    q, k, v, positions, valid = make_rows(pads=(0, 0, 0), offsets=(0, 0, 0))
    in_step, general = cache_layer(False, geometry), cache_layer(False, geometry)
    for layer in (in_step, general):
        write(layer, k[:, :, :9].to(dtype), v[:, :, :9].to(dtype), positions[:, :9], valid[:, :9])
    for index in range(9, 40):
        new = slice(index, index + 1)
        query = q[:, :, :, new].to(dtype)
        fast = write(in_step, k[:, :, new].to(dtype), v[:, :, new].to(dtype), positions[:, new], valid[:, new])
        slow = write(general, k[:, :, new].to(dtype), v[:, :, new].to(dtype), positions[:, new], valid[:, new],
                     implementation="eager")  # (the eager implementation's reads are general)
        assert formulation(fast) == "in_step" and formulation(slow) == "general"
        # the reference of the half-precision inputs, in float64
        expected = reference_rows(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), positions, valid,
                                  geometry, index)[:, :, :, None]
        fast_error = (attend(query, fast).double() - expected).abs().max()
        slow_error = (attend(query, slow, return_weights=True)[0].double() - expected).abs().max()
        resolution = torch.finfo(dtype).eps * expected.abs().max()
        assert fast_error <= 2 * resolution and fast_error <= 2 * slow_error + resolution, (index, fast_error,
                                                                                             slow_error)
