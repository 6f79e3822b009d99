"""Input contracts of the attention ops (docs/contracts.md): positions, masks, bias broadcasting, scales, dtypes,
and clear errors for bad input. Exactness checks run in float64; low-precision checks compare against float32 on
the same (rounded) inputs with tolerances scaled to the dtype's epsilon."""

import math

import pytest
import torch

from hf_structattn import mlr_attention, mlr_attention_reference
from hf_structattn.modeling.structattn_ops import fused_attention
from hf_structattn.modeling.structattn_reference import dense_attention_reference

RANKS = (8, 4, 2, 2)
BLOCKS = (16, 8, 4)
EXACT = dict(atol=1e-12, rtol=1e-12)
IMPLEMENTATIONS = ["fused", "math", "reference"]


def _inputs(batch=2, heads=2, length=20, dtype=torch.float64, seed=0, value_dim=16):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)  # noqa: E731
    return (make(batch, heads, length, sum(RANKS)).requires_grad_(), make(batch, heads, length, sum(RANKS))
            .requires_grad_(), make(batch, heads, length, value_dim).requires_grad_())


def _output_and_grads(function, q, k, v, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = function(*leaves, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _assert_fast_equals_reference(implementation, q, k, v, rows=None, **kwargs):
    fast, fast_grads = _output_and_grads(mlr_attention, q, k, v, implementation=implementation, **kwargs)
    ref, ref_grads = _output_and_grads(mlr_attention_reference, q, k, v, **kwargs)
    keep = 1.0 if rows is None else rows[:, None, :, None].to(fast.dtype)
    torch.testing.assert_close(fast * keep, ref * keep, **EXACT)
    if rows is None:
        for name, a, b in zip("qkv", fast_grads, ref_grads):
            torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"grad {name}: {m}")


# -------------------------------------------------------------------------------------------- positions (item 2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal", [True, False])
def test_per_row_position_offsets_without_mask(implementation, causal):
    """Each row starts at its own position and there is no padding mask (a batch of continuations)."""
    q, k, v = _inputs(batch=3)
    positions = torch.stack([torch.arange(0, 20), torch.arange(3, 23), torch.arange(13, 33)])
    _assert_fast_equals_reference(implementation, q, k, v, ranks=RANKS, block_sizes=BLOCKS, causal=causal,
                                  positions=positions)
    # each row equals that row computed alone: blocks follow the row's own positions
    out = mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, causal=causal, positions=positions,
                        implementation=implementation)
    for row in range(3):
        alone = mlr_attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], ranks=RANKS, block_sizes=BLOCKS,
                              causal=causal, positions=positions[row], implementation=implementation)
        torch.testing.assert_close(out[row:row + 1], alone, **EXACT)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("start", [5, 21, 37])
def test_positions_not_starting_at_zero_without_mask(implementation, start):
    q, k, v = _inputs()
    positions = torch.arange(start, start + 20)[None]
    _assert_fast_equals_reference(implementation, q, k, v, ranks=RANKS, block_sizes=BLOCKS, positions=positions)
    # the shift matters: a start that is not a multiple of the finest block moves the boundaries
    shifted = mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, positions=positions)
    from_zero = mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS)
    assert (shifted - from_zero).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------- bias broadcast (item 5)


@pytest.mark.parametrize("implementation", ["fused", "math", "auto"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 4, 9, 20])
def test_bias_broadcasts_over_the_batch(implementation, causal, length):
    """The documented (1, H, T, T) bias with B = 2 and no padding mask (T5's relative bias)."""
    q, k, v = _inputs(length=length)
    bias = torch.randn(1, 2, length, length, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    expected = mlr_attention_reference(q, k, v, ranks=RANKS, block_sizes=BLOCKS, causal=causal,
                                       bias=bias.expand(2, -1, -1, -1))
    for shaped in (bias, bias[0], bias.expand(2, -1, -1, -1)):
        got = mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, causal=causal, bias=shaped,
                            implementation=implementation)
        torch.testing.assert_close(got, expected, **EXACT)


# -------------------------------------------------------------------------------------------- masks (item 6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_additive_float_mask_is_refused_not_inverted(implementation):
    q, k, v = _inputs()
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1, :5] = False
    additive = torch.zeros(2, 20).masked_fill(~keep, -math.inf)
    with pytest.raises(ValueError, match=r"attention_mask.*additive"):
        mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, attention_mask=additive,
                      implementation=implementation)
    finite_additive = torch.zeros(2, 20).masked_fill(~keep, torch.finfo(torch.float32).min)
    with pytest.raises(ValueError, match=r"attention_mask.*additive"):
        mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, attention_mask=finite_additive,
                      implementation=implementation)
    # the same mask as bool, int64 and 0/1 float gives one answer
    outputs = [mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, attention_mask=mask,
                             implementation=implementation) for mask in (keep, keep.long(), keep.float())]
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], **EXACT)
    # and the additive form is accepted where additive scores belong: bias
    via_bias = mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, bias=finite_additive.double()[:, None, None],
                             implementation=implementation)
    torch.testing.assert_close(via_bias[1, :, 5:], outputs[0][1, :, 5:], **EXACT)


# -------------------------------------------------------------------------------------------- scales (item 7)


@pytest.mark.parametrize("scales", [-1.0, 0.0, math.nan, math.inf, [0.5, -0.5, 0.5, 0.5], [1, 1, 1, math.nan]])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scales_must_be_finite_and_positive(scales, implementation):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"scales=.*finite number > 0"):
        mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, scales=scales, implementation=implementation)


# ------------------------------------------------------------------------------------- bad input (items 12, 13)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_shapes_and_dtypes_name_the_argument(implementation):
    q, k, v = (t.detach() for t in _inputs())
    call = lambda *args, **kwargs: mlr_attention(*args, ranks=RANKS, block_sizes=BLOCKS,  # noqa: E731
                                                 implementation=implementation, **kwargs)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(2, 20\).*got \(2, 19\)"):
        call(q, k, v, attention_mask=torch.ones(2, 19))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(2, 20\).*got \(3, 20\)"):
        call(q, k, v, attention_mask=torch.ones(3, 20))
    with pytest.raises(ValueError, match=r"positions must have shape \(2, 20\).*got \(2, 21\)"):
        call(q, k, v, positions=torch.arange(21).expand(2, 21))
    with pytest.raises(ValueError, match=r"positions must be an integer tensor.*float32"):
        call(q, k, v, positions=torch.arange(20.0)[None])
    with pytest.raises(ValueError, match=r"bias must be broadcastable to \(2, 2, 20, 20\).*got \(1, 2, 19, 19\)"):
        call(q, k, v, bias=torch.zeros(1, 2, 19, 19, dtype=q.dtype))
    with pytest.raises(ValueError, match=r"bias must be a floating tensor"):
        call(q, k, v, bias=torch.zeros(1, 2, 20, 20, dtype=torch.long))
    with pytest.raises(ValueError, match=r"q, k, v must share one floating dtype.*float64.*float32"):
        call(q, k.float(), v)
    with pytest.raises(ValueError, match=r"q, k, v must share one floating dtype.*int64"):
        call(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match=r"sequence length 0"):
        call(q[:, :, :0], k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match=r"positions must be non-negative"):
        call(q, k, v, positions=torch.arange(20)[None] - 3)


def test_reference_ops_validate_too():
    q, k, v = (t.detach() for t in _inputs())
    with pytest.raises(ValueError, match=r"attention_mask must have shape"):
        dense_attention_reference(q, k, v, attention_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match=r"key_positions must have shape"):
        mlr_attention_reference(q, k, v, ranks=RANKS, block_sizes=BLOCKS, key_positions=torch.arange(3)[None])


# --------------------------------------------------------------------------------------- low precision (item 3)

# Tolerances: outputs and gradients of a softmax average of O(1) values; fp16/bf16 round q, k, v and the scores
# (|score| ~ a few units), so the error is a small multiple of the dtype's epsilon times the values' magnitude.
LOW_PRECISION = {torch.float16: 8, torch.bfloat16: 8}


def _low_precision_tolerance(dtype, reference):
    return dict(atol=LOW_PRECISION[dtype] * torch.finfo(dtype).eps * max(1.0, float(reference.abs().max())), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_mlr_low_precision_matches_float32(dtype, implementation):
    q, k, v = _inputs(batch=2, length=40, dtype=dtype)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :9] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    bias = torch.randn(1, 2, 40, 40, generator=torch.Generator().manual_seed(5)).to(dtype)
    kwargs = dict(ranks=RANKS, block_sizes=BLOCKS, attention_mask=mask, positions=positions, bias=bias,
                  implementation=implementation)
    low, low_grads = _output_and_grads(mlr_attention, q, k, v, **kwargs)
    kwargs["bias"] = bias.float()
    exact, exact_grads = _output_and_grads(mlr_attention, q.float(), k.float(), v.float(), **kwargs)
    assert low.dtype == dtype and all(g.dtype == dtype for g in low_grads)
    rows = mask[:, None, :, None]
    torch.testing.assert_close((low.float() * rows), exact * rows, **_low_precision_tolerance(dtype, exact))
    for name, a, b in zip("qkv", low_grads, exact_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b, **_low_precision_tolerance(dtype, b), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_attention_masks_are_finite_in_low_precision(dtype):
    q, k, v = (t.detach() for t in _inputs(length=12, dtype=dtype))
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()
    low = fused_attention(q, k, v, scale=0.25, causal=True, allowed=allowed)
    exact = fused_attention(q.float(), k.float(), v.float(), scale=0.25, causal=True, allowed=allowed)
    torch.testing.assert_close(low.float(), exact, **_low_precision_tolerance(dtype, exact))
    ref = dense_attention_reference(q, k, v, scale=0.25, attention_mask=torch.ones(2, 12, dtype=torch.bool))
    torch.testing.assert_close(ref.float(), exact, **_low_precision_tolerance(dtype, exact))


@pytest.mark.parametrize("implementation", ["fused", "math", "reference"])
def test_uniform_left_padding_at_negative_positions(implementation):
    """Every row left-padded by the same amount, positions counted over real tokens (padding at negative
    positions, or any value): each path equals the rows without their padding, and agrees with the reference."""
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 20, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[:, :4] = False
    positions = torch.arange(20).expand(2, 20) - 4  # -4 .. 15: the padding sits at negative positions
    kwargs = dict(ranks=[4, 2, 1, 1], block_sizes=[8, 4, 2], scales=[0.5] * 4, causal=True)
    out = mlr_attention(q, k, v, positions=positions, attention_mask=valid, implementation=implementation, **kwargs)
    alone = mlr_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], implementation=implementation, **kwargs)
    torch.testing.assert_close(out[:, :, 4:], alone, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="non-negative"):
        mlr_attention(q, k, v, positions=positions, implementation=implementation, **kwargs)  # real, negative


def test_scales_as_tensors():
    generator = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    kwargs = dict(ranks=[4, 2, 2], block_sizes=[4, 2])
    expected = mlr_attention(q, k, v, scales=0.5, **kwargs)
    torch.testing.assert_close(mlr_attention(q, k, v, scales=torch.tensor(0.5), **kwargs), expected)
    torch.testing.assert_close(mlr_attention(q, k, v, scales=torch.tensor([0.5, 0.5, 0.5]), **kwargs), expected)
    with pytest.raises(ValueError, match="scales must be a number or one number per level"):
        mlr_attention(q, k, v, scales=torch.ones(3, 1), **kwargs)
    with pytest.raises(ValueError, match="finite number > 0"):
        mlr_attention(q, k, v, scales=torch.tensor(-1.0), **kwargs)
