"""Triton MLR kernel vs the naive reference: outputs and q/k/v gradients.

On a machine without CUDA the kernels run under the Triton interpreter (numpy speed), so the CPU cases use
tiny shapes and 16-wide tiles (several tiles per sequence, tiles smaller and larger than the finest block).
The CUDA cases run real sizes in bf16/fp16/fp32.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # must precede the first `import triton` of the process, or kernels need a GPU driver
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = triton.language

from hf_structattn.modeling import structattn_triton  # noqa: E402
from hf_structattn.modeling.structattn_reference import mlr_attention_reference  # noqa: E402
from hf_structattn.modeling.structattn_triton import mlr_attention_triton  # noqa: E402

CUDA = torch.cuda.is_available()
INTERPRETED = type(structattn_triton._mlr_fwd_kernel).__name__ == "InterpretedFunction"

pytestmark = pytest.mark.skipif(
    not CUDA and not INTERPRETED,
    reason="no CUDA, and triton was imported before TRITON_INTERPRET=1 was set (run this file on its own)",
)

DEVICE = "cuda" if CUDA else "cpu"


def _allowed(seq_len, causal, key_padding_mask, batch):
    """(B, 1, T, T) bool: pairs that survive causal + padding masks."""
    allowed = torch.ones(batch, 1, seq_len, seq_len, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.cpu()[:, None, None, :]
    return allowed


def _run_case(*, seq_len, ranks, block_sizes, causal, scales, batch=1, heads=2, v_dim=None, average=False,
              padding=None, bias_shape=None, dtype=torch.float32, block_m=16, block_n=16, seed=0,
              atol=1e-4, rtol=1e-4, grad_atol=None):
    """Compare forward and q/k/v gradients against the reference; returns (max fwd err, max grad err)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = sum(ranks)
    v_dim = v_dim or head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    q, k = rand(batch, heads, seq_len, head_dim), rand(batch, heads, seq_len, head_dim)
    v = rand(batch, heads, seq_len, v_dim)
    key_padding_mask = None
    if padding is not None:
        key_padding_mask = torch.ones(batch, seq_len, dtype=torch.bool)
        for row, (left, right) in enumerate(padding):
            key_padding_mask[row, :left] = False
            key_padding_mask[row, seq_len - right:] = False
        key_padding_mask = key_padding_mask.to(DEVICE)
    bias = None
    if bias_shape is not None:
        bias = (2.0 * torch.randn(*bias_shape, generator=gen)).to(DEVICE)

    allowed = _allowed(seq_len, causal, key_padding_mask, batch)
    live_rows = allowed.any(-1, keepdim=True).to(DEVICE)  # (B, 1, T, 1)
    grad_out = rand(batch, heads, seq_len, v_dim) * live_rows  # dead rows carry no gradient

    def attempt(fn, upcast):
        inputs = [t.detach().clone().double() if upcast else t.detach().clone() for t in (q, k, v)]
        for t in inputs:
            t.requires_grad_(True)
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
        return out.detach(), grads

    ours, our_grads = attempt(lambda a, b, c: mlr_attention_triton(
        a, b, c, ranks=ranks, block_sizes=block_sizes, causal=causal, level_scales=scales,
        average_levels=average, key_padding_mask=key_padding_mask, bias=bias, block_m=block_m, block_n=block_n),
        upcast=False)
    ref, ref_grads = attempt(lambda a, b, c: mlr_attention_reference(
        a, b, c, ranks=ranks, block_sizes=block_sizes, causal=causal, scales=scales,
        attention_mask=key_padding_mask, bias=None if bias is None else bias.double(), average_levels=average),
        upcast=True)

    assert ours.dtype == dtype and ours.shape == (batch, heads, seq_len, v_dim)
    assert torch.isfinite(ours).all()
    # rows without any allowed key: the kernel returns exactly 0 (the reference's softmax is uniform there)
    assert (ours * ~live_rows == 0).all()
    live = live_rows.expand_as(ours)
    torch.testing.assert_close(ours[live].double(), ref[live], atol=atol, rtol=rtol)
    grad_atol = atol if grad_atol is None else grad_atol
    grad_err = 0.0
    for name, mine, theirs in zip("qkv", our_grads, ref_grads):
        assert mine.dtype == dtype and torch.isfinite(mine).all(), name
        torch.testing.assert_close(mine.double(), theirs, atol=grad_atol, rtol=rtol, msg=lambda m: f"d{name}: {m}")
        grad_err = max(grad_err, (mine.double() - theirs).abs().max().item())
    return (ours[live].double() - ref[live]).abs().max().item(), grad_err


# (T, ranks, block_sizes, scales): L in {1, 2, 4}; rank splits not multiples of 16 so chunk masks matter;
# T=50 and T=64 exceed 2 * b_2 (level 1 global, finer levels keep tiling).
GEOMETRIES = {
    "T1_L1": (1, [8], [], [0.35]),
    "T7_L2": (7, [8, 8], [4], [0.25, 0.5]),
    "T33_L4": (33, [6, 4, 3, 3], [16, 8, 4], [0.3, 0.5, 0.7, 0.9]),
    "T64_L4": (64, [6, 4, 3, 3], [16, 8, 4], [0.25, 0.25, 0.25, 0.25]),
    "T50_L2": (50, [5, 11], [8], [0.4, 0.3]),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_matches_reference(name, causal):
    seq_len, ranks, block_sizes, scales = GEOMETRIES[name]
    _run_case(seq_len=seq_len, ranks=ranks, block_sizes=block_sizes, causal=causal, scales=scales)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_key_padding_and_empty_rows(causal):
    # left padding of 5 makes the first causal rows fully masked; right padding is the usual batch case
    _run_case(seq_len=40, ranks=[6, 4, 3, 3], block_sizes=[16, 8, 4], causal=causal, scales=[0.3, 0.4, 0.5, 0.6],
              batch=2, padding=[(5, 0), (0, 7)])


@pytest.mark.parametrize("bias_shape", [(2, 2, 37, 37), (1, 2, 1, 37)], ids=["full", "broadcast"])
def test_bias(bias_shape):
    _run_case(seq_len=37, ranks=[6, 4, 3, 3], block_sizes=[16, 8, 4], causal=True, scales=[0.3, 0.4, 0.5, 0.6],
              batch=2, bias_shape=bias_shape, padding=[(0, 0), (3, 2)])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_average_levels(causal):
    _run_case(seq_len=48, ranks=[6, 4, 3, 3], block_sizes=[16, 8, 4], causal=causal, scales=[0.5, 0.5, 0.5, 0.5],
              average=True, bias_shape=(1, 1, 48, 48))


def test_wide_levels_uneven_tiles():
    # a level wider than the 16-dim chunk, value width not a power of two, rectangular tiles 32 x 16
    _run_case(seq_len=45, ranks=[20, 8, 4], block_sizes=[16, 4], causal=True, scales=[0.2, 0.3, 0.4], v_dim=24,
              block_m=32, block_n=16)


def test_default_tiles_larger_than_blocks():
    # 64-wide tiles over 4/2-position blocks: every diagonal tile pair has mixed depths
    _run_case(seq_len=70, ranks=[4, 4, 4, 4], block_sizes=[8, 4, 2], causal=True, scales=[0.3, 0.3, 0.3, 0.3],
              heads=1, block_m=None, block_n=None)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_paper_rank_split(causal):
    # r=64 split 32|8|6|4|4|4|4|2, dyadic blocks 128..2, default 64x64 tiles
    _run_case(seq_len=256, ranks=[32, 8, 6, 4, 4, 4, 4, 2], block_sizes=[128, 64, 32, 16, 8, 4, 2], causal=causal,
              scales=[64 ** -0.5] * 8, heads=1, block_m=None, block_n=None)


def test_blocks_not_powers_of_two():
    # blocks from a training length of 24: 16-wide tiles straddle block boundaries everywhere
    _run_case(seq_len=41, ranks=[6, 4, 3, 3], block_sizes=[12, 6, 3], causal=True, scales=[0.3, 0.4, 0.5, 0.6])


def test_single_level_is_dense_attention():
    seq_len, heads, dim = 33, 2, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, heads, seq_len, dim, generator=gen).to(DEVICE) for _ in range(3))
    ours = mlr_attention_triton(q, k, v, ranks=[dim], block_sizes=[], causal=True, level_scales=[dim ** -0.5])
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, dense, atol=1e-5, rtol=1e-5)


if INTERPRETED or CUDA:
    @triton.jit
    def _depth_range_probe(box_ptr, blk_ptr, out_ptr, num_levels):
        box = box_ptr + 4 * tl.program_id(0)
        d_min, d_max = structattn_triton._tile_depth_range(tl.load(box), tl.load(box + 1), tl.load(box + 2),
                                                           tl.load(box + 3), blk_ptr, num_levels)
        tl.store(out_ptr + 2 * tl.program_id(0), d_min)
        tl.store(out_ptr + 2 * tl.program_id(0) + 1, d_max)


def test_tile_depth_range_is_tight():
    """d_min / d_max of a tile pair are exactly the min / max pair depth over the box, so no dims are
    multiplied that no pair needs and no per-level mask is applied where the whole tile agrees."""
    block_sizes = [32, 16, 8, 4]
    gen = torch.Generator().manual_seed(5)
    boxes = []
    for _ in range(64):
        m_lo, n_lo = torch.randint(0, 100, (2,), generator=gen).tolist()
        m_len, n_len = torch.randint(1, 40, (2,), generator=gen).tolist()
        boxes.append([m_lo, m_lo + m_len - 1, n_lo, n_lo + n_len - 1])
    blk = torch.tensor([2 ** 30] + block_sizes, dtype=torch.int32, device=DEVICE)
    box_t = torch.tensor(boxes, dtype=torch.int32, device=DEVICE)
    out = torch.zeros(len(boxes), 2, dtype=torch.int32, device=DEVICE)
    _depth_range_probe[(len(boxes),)](box_t, blk, out, len(block_sizes) + 1)
    for (m_lo, m_hi, n_lo, n_hi), (d_min, d_max) in zip(boxes, out.tolist()):
        i = torch.arange(m_lo, m_hi + 1)[:, None]
        j = torch.arange(n_lo, n_hi + 1)[None, :]
        depth = 1 + sum((i // size == j // size).long() for size in block_sizes)
        assert (d_min, d_max) == (depth.min().item(), depth.max().item()), (m_lo, m_hi, n_lo, n_hi)


def test_double_backward_is_refused():
    q = torch.randn(1, 1, 8, 16, device=DEVICE, requires_grad=True)
    out = mlr_attention_triton(q, q, q, ranks=[8, 8], block_sizes=[4], level_scales=[0.25, 0.25])
    (grad,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


def test_bias_gradient_is_refused():
    q = torch.randn(1, 1, 8, 16, device=DEVICE)
    bias = torch.zeros(1, 1, 8, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(NotImplementedError, match="bias"):
        mlr_attention_triton(q, q, q, ranks=[16], block_sizes=[], level_scales=[0.25], bias=bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(dtype):
    # on CPU bf16 is computed in fp32 (the interpreter's tl.dot mishandles bf16); the result is still bf16
    _run_case(seq_len=20, ranks=[8, 8], block_sizes=[8], causal=True, scales=[0.25, 0.25], dtype=dtype,
              atol=3e-2, rtol=3e-2, grad_atol=6e-2)


# Real sizes on the GPU: T=1024, H=4, r=64, 8 levels, dyadic blocks 512..8, default 64x64 tiles.
CUDA_TOL = {torch.bfloat16: (3e-2, 8e-2), torch.float16: (5e-3, 1.5e-2), torch.float32: (2e-4, 5e-4)}


@pytest.mark.skipif(not CUDA, reason="real-size check needs CUDA")
@pytest.mark.parametrize("dtype", list(CUDA_TOL), ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_cuda_real_sizes(dtype, causal):
    atol, grad_atol = CUDA_TOL[dtype]
    ranks = [32, 8, 6, 4, 4, 4, 4, 2]
    _run_case(seq_len=1024, ranks=ranks, block_sizes=[512, 256, 128, 64, 32, 16, 8], causal=causal,
              scales=[64 ** -0.5] * 8, heads=4, dtype=dtype, block_m=None, block_n=None,
              atol=atol, rtol=atol, grad_atol=grad_atol, padding=[(0, 100)])


@pytest.mark.skipif(CUDA, reason="the CPU dispatcher case runs under the interpreter")
@pytest.mark.parametrize("causal", [True, False])
def test_dispatcher_routes_shifted_and_padded_inputs_to_the_kernel(causal):
    """mlr_attention(implementation="triton") canonicalises positions (offsets, left padding) before the kernel."""
    from hf_structattn import mlr_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=gen) for _ in range(3))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0) + 16  # a continuation: shared coarse levels, shifted blocks
    kwargs = dict(ranks=[4, 2, 2], block_sizes=[16, 8], causal=causal, positions=positions, attention_mask=mask)
    got = mlr_attention(q, k, v, implementation="triton", **kwargs)
    expected = mlr_attention_reference(q, k, v, **kwargs)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, :, 5:], expected[1, :, 5:], atol=1e-5, rtol=1e-5)
