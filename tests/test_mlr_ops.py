"""Fast exact MLR attention against the naive reference (outputs and gradients), and the reference against
the paper's definition evaluated pair by pair."""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_structattn import default_block_sizes, mlr_attention, mlr_attention_reference
from hf_structattn.modeling.structattn_config_rules import resolve_level_scales, validate_mlr_geometry

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-4)}


def _inputs(batch, heads, length, head_dim, value_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()  # noqa: E731
    return make(batch, heads, length, head_dim), make(batch, heads, length, head_dim), make(
        batch, heads, length, value_dim)


def _compare(q, k, v, *, implementation, rows=None, **kwargs):
    """Assert fast == reference on the rows that have real tokens; returns nothing."""
    fast = mlr_attention(q, k, v, implementation=implementation, **kwargs)
    ref = mlr_attention_reference(q, k, v, **kwargs)
    keep = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if rows is None else rows.bool()
    keep4 = keep[:, None, :, None]
    tol = TOL[q.dtype]
    torch.testing.assert_close(fast * keep4, ref * keep4, **tol)
    grad = torch.randn(fast.shape, dtype=fast.dtype, generator=torch.Generator().manual_seed(1)) * keep4
    fast_grads = torch.autograd.grad(fast, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", fast_grads, ref_grads):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"grad {name}: {m}")


def _pairwise_loop(q, k, v, ranks, block_sizes, causal, scales, average_levels):
    """The paper's score function evaluated one pair at a time (independent of the reference's tensor code)."""
    batch, heads, length, _ = q.shape
    out = torch.zeros(batch, heads, length, v.shape[-1], dtype=q.dtype)
    starts = [sum(ranks[:level]) for level in range(len(ranks))]
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                scores = []
                for j in range(length):
                    if causal and j > i:
                        scores.append(-math.inf)
                        continue
                    shared = [0] + [level for level, size in enumerate(block_sizes, start=1) if i // size == j // size]
                    total = sum(scales[level] * float(q[b, h, i, starts[level]:starts[level] + ranks[level]]
                                                      @ k[b, h, j, starts[level]:starts[level] + ranks[level]])
                                for level in shared)
                    scores.append(total / len(shared) if average_levels else total)
                weights = torch.softmax(torch.tensor(scores, dtype=q.dtype), dim=0)
                out[b, h, i] = weights @ v[b, h]
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("ranks,block_sizes", [((3, 2, 1), (8, 4)), ((2, 2, 1, 1), (8, 4, 2)), ((4, 2), (6,))])
def test_reference_matches_pairwise_definition(ranks, block_sizes, causal, average_levels):
    q, k, v = _inputs(1, 2, 13, sum(ranks), 3, torch.float64)
    scales = resolve_level_scales(ranks, "mup")
    expected = _pairwise_loop(q.detach(), k.detach(), v.detach(), ranks, block_sizes, causal, scales, average_levels)
    got = mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=block_sizes, causal=causal, scales="mup",
                                  average_levels=average_levels)
    torch.testing.assert_close(got.detach(), expected, atol=1e-12, rtol=1e-12)


N_POSITIONS = 128
RANKS_4 = (8, 4, 2, 2)
BLOCKS_4 = tuple(default_block_sizes(N_POSITIONS, 4))  # (64, 32, 16)


@pytest.mark.parametrize("implementation", ["fused", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 7, 63, 64, 2 * 64 + 5, 1000])
def test_fast_matches_reference_odd_lengths(length, causal, dtype, implementation):
    q, k, v = _inputs(2, 2, length, sum(RANKS_4), sum(RANKS_4), dtype)
    _compare(q, k, v, implementation=implementation, ranks=RANKS_4, block_sizes=BLOCKS_4, causal=causal)


@pytest.mark.parametrize("implementation", ["fused", "math"])
@pytest.mark.parametrize("num_levels", range(1, 9))
def test_fast_matches_reference_every_depth(num_levels, implementation):
    ranks = [2] * num_levels
    block_sizes = default_block_sizes(256, num_levels)
    q, k, v = _inputs(1, 3, 300, sum(ranks), 5, torch.float64)
    for causal in (True, False):
        _compare(q, k, v, implementation=implementation, ranks=ranks, block_sizes=block_sizes, causal=causal,
                 scales="mup", average_levels=num_levels % 2 == 0)


@pytest.mark.parametrize("implementation", ["fused", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_left_padding_offsets_and_bias(causal, dtype, implementation):
    length = 90
    mask = torch.ones(3, length)
    mask[1, :17] = 0  # left padding
    mask[2, 70:] = 0  # right padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0).long()
    bias = torch.randn(1, 2, length, length, dtype=dtype)
    q, k, v = _inputs(3, 2, length, sum(RANKS_4), sum(RANKS_4), dtype)
    common = dict(ranks=RANKS_4, block_sizes=BLOCKS_4, causal=causal, attention_mask=mask, rows=mask)
    _compare(q, k, v, implementation=implementation, positions=positions, **common)
    _compare(q, k, v, implementation=implementation, positions=positions, bias=bias, **common)
    # a common offset (e.g. a continuation at position 40) shifts the block boundaries
    offset = (torch.arange(length) + 40).expand(3, length)
    _compare(q, k, v, implementation=implementation, positions=offset, **common)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal,average_levels,left_pad", [(False, False, 0), (True, True, 11), (False, True, 7)])
def test_bias_gradient_flows_through_auto_path(causal, average_levels, left_pad, dtype):
    """A learned bias (T5) routes to the materialised-score path: outputs and q/k/v/bias gradients exact."""
    length = 50
    q, k, v = _inputs(2, 2, length, sum(RANKS_4), 8, dtype)
    mask = torch.ones(2, length)
    mask[1, :left_pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0).long()
    bias_fast = torch.randn(2, 2, length, length, dtype=dtype, requires_grad=True)
    bias_ref = bias_fast.detach().clone().requires_grad_()
    leaves_fast = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    leaves_ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kwargs = dict(ranks=RANKS_4, block_sizes=BLOCKS_4, causal=causal, scales=1.0, average_levels=average_levels,
                  attention_mask=mask, positions=positions)
    fast = mlr_attention(*leaves_fast, bias=bias_fast, **kwargs)
    ref = mlr_attention_reference(*leaves_ref, bias=bias_ref, **kwargs)
    rows = mask.bool()[:, None, :, None]
    torch.testing.assert_close(fast * rows, ref * rows, **TOL[dtype])
    grad = torch.randn_like(fast) * rows
    fast.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(bias_fast.grad, bias_ref.grad, **TOL[dtype])
    for name, a, b in zip("qkv", leaves_fast, leaves_ref):
        torch.testing.assert_close(a.grad, b.grad, **TOL[dtype], msg=name)
    with pytest.raises(ValueError, match="bias"):
        mlr_attention(q, k, v, bias=bias_fast, implementation="fused", **kwargs)


def test_non_contiguous_positions_fall_back_to_exact_reference():
    # packed sequences: positions restart inside a row
    positions = torch.cat([torch.arange(20), torch.arange(30)])[None]
    q, k, v = _inputs(1, 2, 50, sum(RANKS_4), 4, torch.float64)
    _compare(q, k, v, implementation="auto", ranks=RANKS_4, block_sizes=BLOCKS_4, positions=positions)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_degenerate_configs_equal_sdpa(dtype, causal):
    q, k, v = _inputs(2, 3, 77, 16, 16, dtype)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    one_level = mlr_attention(q, k, v, ranks=[16], block_sizes=[], causal=causal)
    long_blocks = mlr_attention(q, k, v, ranks=[8, 4, 4], block_sizes=[256, 128], causal=causal)
    torch.testing.assert_close(one_level, expected, **TOL[dtype])
    torch.testing.assert_close(long_blocks, expected, **TOL[dtype])


def test_bfloat16_close_to_float32():
    q, k, v = _inputs(1, 2, 128, 16, 16, torch.float32)
    kwargs = dict(ranks=[8, 4, 4], block_sizes=[64, 32])
    exact = mlr_attention(q, k, v, **kwargs)
    low = mlr_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kwargs)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), exact, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("ranks,block_sizes,head_dim,match", [
    ((8, 4), (16,), 16, "sums to 12"),
    ((8, 8), (16, 8), 16, "one block size per level"),
    ((8, 4, 4), (16, 12), 16, "not nested"),
    ((8, 4, 4), (16, 32), 16, "not nested"),
    ((8, 4, 4), (16, 0), 16, "positive"),
    ((8, -4, 12), (16, 8), 16, "positive"),
    ((), (), 16, "must not be empty"),
])
def test_invalid_geometry_names_the_field(ranks, block_sizes, head_dim, match):
    with pytest.raises(ValueError, match=match):
        validate_mlr_geometry(ranks, block_sizes, head_dim)
    q = torch.randn(1, 1, 4, head_dim)
    with pytest.raises(ValueError, match="ranks|block_sizes"):
        mlr_attention(q, q, q, ranks=ranks, block_sizes=block_sizes)


def test_invalid_scales_and_positions():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="scales"):
        mlr_attention(q, q, q, ranks=[4, 4], block_sizes=[2], scales="fancy")
    with pytest.raises(ValueError, match="scales"):
        mlr_attention(q, q, q, ranks=[4, 4], block_sizes=[2], scales=[1.0])
    with pytest.raises(ValueError, match="positions"):
        mlr_attention(q, q, q, ranks=[4, 4], block_sizes=[2], positions=torch.arange(4)[None] - 2)
    with pytest.raises(ValueError, match="n_positions"):
        default_block_sizes(100, 4)


class _ViewOutput(torch.autograd.Function):
    """Returns a view of a tensor made inside forward (as the fused MLR path's merged output is), optionally
    re-pointed with ``Tensor.set_`` at the same storage as ``_FusedMLRFunction.forward`` does; saves its output."""

    @staticmethod
    def forward(ctx, x, alias):
        doubled = torch.cat([x * 2, x.new_zeros(1)])
        out = doubled[:x.numel()]
        if alias:
            out = torch.empty(0, dtype=out.dtype).set_(out.untyped_storage(), out.storage_offset(), out.size(),
                                                       out.stride())
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # raises when the saved output was modified in place after forward
        return grad * 2, None


def test_set_alias_autograd_behaviour_the_fused_output_relies_on():
    """The torch behaviour behind the ``set_`` in ``_FusedMLRFunction.forward``: a view output of a custom Function
    refuses in-place ops; a ``set_`` alias of the same storage is no view, shares the memory, accepts in-place ops,
    gives the right gradient, and its own version counter still guards the saved output."""
    x = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64, requires_grad=True)
    view = _ViewOutput.apply(x, False)
    assert view._is_view()
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        view.add_(1)

    alias = _ViewOutput.apply(x, True)
    assert not alias._is_view() and alias._base is None
    torch.testing.assert_close(alias, 2 * x.detach(), atol=0, rtol=0)
    (grad,) = torch.autograd.grad((alias * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum(), x)
    torch.testing.assert_close(grad, torch.tensor([2.0, 4.0, 6.0], dtype=torch.float64), atol=0, rtol=0)

    alias = _ViewOutput.apply(x, True)
    storage = alias.untyped_storage().data_ptr()
    version = alias._version
    alias.add_(1)  # allowed: no view+inplace error
    assert alias._version == version + 1 and alias.untyped_storage().data_ptr() == storage
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        alias.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_set_alias_fused_output_accepts_in_place_ops_and_guards_backward(dtype):
    """The fused path's output (an alias of a kernel result's storage when the accumulation dtype is the input
    dtype) is no view: in-place ops on it work, and backward after one raises instead of using the changed output."""
    ranks, block_sizes = [4, 2, 2], default_block_sizes(16, 3)
    q, k, v = _inputs(2, 2, 16, 8, 8, dtype)
    out = mlr_attention(q, k, v, ranks=ranks, block_sizes=block_sizes, implementation="fused")
    assert not out._is_view()
    ref = mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=block_sizes)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(torch.autograd.grad(out.sum(), q, retain_graph=True)[0],
                               torch.autograd.grad(ref.sum(), q)[0], **TOL[dtype])
    out.mul_(0.5)
    torch.testing.assert_close(out, ref.detach() * 0.5, **TOL[dtype])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("length, start", [(37, 0), (40, 0), (29, 13), (9, 5), (64, 0)])
def test_materialised_mlr_on_diagonal_blocks_equals_the_general_path_in_outputs_and_gradients(
        dtype, average_levels, length, start):
    """``mlr_attention_full_keys(aligned_start=...)`` (queries and keys at ``start + index`` in every row: the finer
    levels formed on their diagonal blocks, whole and cut ones) against the same function without it (every level
    over all T x T pairs, masked by block): outputs, attention maps and gradients of q, k, v, at odd lengths and
    offsets that cut blocks at both ends; float64 to ~1e-12, float32 to its rounding of the score magnitude."""
    from hf_structattn.modeling.structattn_geometry import MLRGeometry
    from hf_structattn.modeling.structattn_mlr_math import mlr_attention_full_keys

    geometry = MLRGeometry.build([6, 4, 2, 2], [32, 8, 4], [0.5, 0.7, 0.9, 1.1], average_levels=average_levels)
    generator = torch.Generator().manual_seed(length + start)
    q, k, v = (torch.randn(2, 3, length, 14, dtype=dtype, generator=generator).requires_grad_() for _ in range(3))
    positions = torch.arange(start, start + length).expand(2, length)
    valid = torch.ones(2, length, dtype=torch.bool)
    common = dict(geometry=geometry, scales=[0.5, 0.7, 0.9, 1.1], query_positions=positions, key_positions=positions,
                  key_valid=valid, return_weights=True)
    results = []
    for aligned in (start, None):
        out, weights = mlr_attention_full_keys(q, k, v, aligned_start=aligned, **common)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum(),
                                    (q, k, v))
        results.append((out, weights, *grads))
    tolerance = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for fast, general in zip(*results):
        torch.testing.assert_close(fast, general, **tolerance)


def test_materialised_mlr_on_diagonal_blocks_runs_under_vmap():
    """The stacked runs of the science designs call the model under ``torch.func.vmap``: the in-place block adds
    trace there and give each run what it gives alone."""
    from hf_structattn.modeling.structattn_geometry import MLRGeometry
    from hf_structattn.modeling.structattn_mlr_math import mlr_attention_full_keys

    geometry = MLRGeometry.build([6, 4, 2, 2], [32, 8, 4], [0.5, 0.7, 0.9, 1.1], average_levels=True)
    q, k, v = (torch.randn(3, 2, 2, 40, 14, dtype=torch.float64) for _ in range(3))
    positions, valid = torch.arange(40).expand(2, 40), torch.ones(2, 40, dtype=torch.bool)

    def attend(q, k, v):
        return mlr_attention_full_keys(q, k, v, geometry=geometry, scales=[0.5, 0.7, 0.9, 1.1],
                                       query_positions=positions, key_positions=positions, key_valid=valid,
                                       aligned_start=0)

    stacked = torch.func.vmap(attend)(q, k, v)
    for run in range(3):
        torch.testing.assert_close(stacked[run], attend(q[run], k[run], v[run]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [17, 33, 65, 66, 97, 113, 129, 191])
def test_fused_op_cuts_blocks_where_the_range_ends(length, causal, dtype):
    """Lengths just past each block edge of (64, 32, 16) (the range's end cuts a finest block, a child inside a
    parent, the global level's last child): the fused path's span groups against the reference, outputs and
    gradients, plain, with a T5-style bias, with right padding, and at an offset that cuts blocks at both ends."""
    q, k, v = _inputs(2, 3, length, sum(RANKS_4), 5, dtype, seed=length)
    common = dict(ranks=RANKS_4, block_sizes=BLOCKS_4, causal=causal, scales=[0.5, 0.7, 0.9, 1.1],
                  average_levels=length % 2 == 1)
    _compare(q, k, v, implementation="fused", **common)
    bias = torch.randn(1, 3, length, length, dtype=dtype, generator=torch.Generator().manual_seed(2))
    _compare(q, k, v, implementation="fused", bias=bias, **common)
    mask = torch.ones(2, length)
    mask[1, length - length // 3:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0).long()
    _compare(q, k, v, implementation="fused", attention_mask=mask, positions=positions, rows=mask, **common)
    offset = torch.arange(length).expand(2, length) + 23
    _compare(q, k, v, implementation="fused", positions=offset, **common)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_plan_covers_each_pair_once_at_every_length(causal):
    """The fused plan's kernel calls together cover exactly the T (T + 1) / 2 causal pairs (T^2 not causal) at
    every length from 1 to 300, block edges or not: no pair twice (outputs would be wrong) and no padding (a
    length just past a block edge would cost up to 4x the work at the edge, as a padded range did)."""
    from hf_structattn.modeling.structattn_mlr import _canonical_span
    from hf_structattn.modeling.structattn_mlr_fused import _Plan

    for length in range(1, 301):
        first_depth, base, extent = _canonical_span(None, None, 0, length, BLOCKS_4, len(RANKS_4))
        assert (base, extent) == (0, length)
        plan = _Plan(RANKS_4, BLOCKS_4, first_depth, length, causal)
        probe = torch.empty(1, 1, length, 1)
        pairs = 0
        for group in plan.groups:
            queries, keys = group.select(probe, keys=False), group.select(probe, keys=True)
            calls, rows, key_rows = queries.shape[2] * queries.shape[3], queries.shape[4], keys.shape[4]
            assert keys.shape[2] * keys.shape[3] == calls
            own_causal = causal and group.is_own_block
            pairs += calls * (rows * (rows + 1) // 2 if own_causal else rows * key_rows)
        assert pairs == (length * (length + 1) // 2 if causal else length * length), length
