"""Triton flash-attention kernel for sequence MLR attention (paper §3.4, App. D), forward and backward.

Part of the checkpoint payload: only torch at top level; Triton is optional (``TRITON_AVAILABLE``). Kernels
run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before ``import triton``.

Tiling. Each program owns one query tile (forward, dq) or one key tile (dk/dv) and walks the other axis in
tiles, as in FlashAttention-2. For every (query tile, key tile) pair the block geometry gives two scalars:

  * ``d_min``: levels shared by *every* pair of the tile (all four tile corners in one level-l block);
  * ``d_max``: levels shared by *some* pair (the tiles' level-l block ranges overlap).

Because blocks are nested, a pair of depth d scores with the prefix ``[0, c_d)`` of the head dim
(``c_d = r_1 + ... + r_d``). So the score of a tile pair is one prefix product over ``[0, c_{d_min})`` plus,
for each level l in ``(d_min, d_max]``, a level-l product ``[c_{l-1}, c_l)`` added where the pair shares the
level-l block (per-element test ``i // b_l == j // b_l``). Products are computed in chunks of ``BLOCK_K``
(16) dims with masked loads, so a tile pair in different level-2 blocks only reads and multiplies the first
``ceil(r_1 / 16) * 16`` dims of q and k. With power-of-two tiles and dyadic blocks, tiles and blocks are
nested or disjoint, so every off-diagonal tile pair has ``d_min == d_max`` and only diagonal tiles pay for the
per-level terms (causal, T=4096, r=64 split 32|8|6|4|4|4|4|2, 64x64 tiles: 0.67x the score work of dense).

Backward (FlashAttention-2): P is recomputed from the saved LSE; one kernel per key tile accumulates dk, dv,
one per query tile accumulates dq. The score recompute uses the same truncated products; dq and dk accumulate
in full-width register tiles (a register tile cannot be updated in slices), so there the truncation only
saves loads: q/k tiles are read masked to the needed dims, and diagonal tiles add one masked product per level.

Level scales ``alpha_l`` are folded into q (one multiply per dim) before the kernels; the dq kernel's result
is multiplied by the same per-dim scale. Softmax runs in base 2 (``exp2``) with the LSE stored in base 2.
"""

import contextlib
from typing import Optional, Sequence

import torch

from .structattn_config_rules import validate_mlr_geometry

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # the module must import (and report unavailability) without triton
    triton = None
    tl = None
    TRITON_AVAILABLE = False

_UNBOUNDED_BLOCK = 2 ** 30  # level 1 is global: one block wider than any sequence


def _next_pow2(value: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(1, value) - 1).bit_length())


if TRITON_AVAILABLE:

    @triton.jit
    def _tile_depth_range(m_lo, m_hi, n_lo, n_hi, blk_ptr, num_levels):
        """(d_min, d_max) over the box [m_lo, m_hi] x [n_lo, n_hi] of (query, key) positions."""
        # int32 tensors from the start: a loop-carried value may not change type from a Python int
        d_min = tl.full((), 1, tl.int32)
        d_max = tl.full((), 1, tl.int32)
        for level in range(1, num_levels):
            size = tl.load(blk_ptr + level)
            lo = tl.minimum(m_lo, n_lo) // size
            hi = tl.maximum(m_hi, n_hi) // size
            d_min += (lo == hi).to(tl.int32)
            overlap = tl.maximum(m_lo // size, n_lo // size) <= tl.minimum(m_hi // size, n_hi // size)
            d_max += overlap.to(tl.int32)
        return d_min, d_max

    @triton.jit
    def _prefix_dot(acc, q_base, k_base, offs_m, offs_n, offs_k, seq_len, head_dim, lo, hi,
                    BLOCK_K: tl.constexpr, PREC: tl.constexpr):
        """acc + q[offs_m, lo:hi] @ k[offs_n, lo:hi]^T, in BLOCK_K-wide masked chunks (dims >= hi not read)."""
        for start in range(lo, hi, BLOCK_K):
            dims = start + offs_k
            dim_ok = (dims < hi) & (dims < head_dim)
            qc = tl.load(q_base + offs_m[:, None] * head_dim + dims[None, :],
                         mask=(offs_m[:, None] < seq_len) & dim_ok[None, :], other=0.0)
            kc = tl.load(k_base + offs_n[:, None] * head_dim + dims[None, :],
                         mask=(offs_n[:, None] < seq_len) & dim_ok[None, :], other=0.0)
            acc = tl.dot(qc, tl.trans(kc), acc, input_precision=PREC)
        return acc

    @triton.jit
    def _tile_scores(q_base, k_base, bias_base, kpm_base, blk_ptr, cum_ptr, num_levels, offs_m, offs_n, offs_k,
                     m_lo, m_hi, n_lo, n_hi, seq_len, head_dim, stride_bias_m, stride_bias_n,
                     CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr,
                     AVERAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PREC: tl.constexpr):
        """Natural-log MLR scores of one tile pair, -inf where masked, and the per-pair depth divisor.

        Returns (s, dep, d_min, d_max): s (BLOCK_M, BLOCK_N) fp32; dep the fp32 number of shared levels (only
        meaningful when AVERAGE).
        """
        if CAUSAL:
            # pairs with key > query are discarded anyway, so the geometry only needs the causal box
            m_lo = tl.maximum(m_lo, n_lo)
            n_hi = tl.minimum(n_hi, m_hi)
        d_min, d_max = _tile_depth_range(m_lo, m_hi, n_lo, n_hi, blk_ptr, num_levels)
        s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        s = _prefix_dot(s, q_base, k_base, offs_m, offs_n, offs_k, seq_len, head_dim, 0,
                        tl.load(cum_ptr + d_min), BLOCK_K, PREC)
        dep = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + d_min.to(tl.float32)
        for level in range(d_min + 1, d_max + 1):
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part = _prefix_dot(part, q_base, k_base, offs_m, offs_n, offs_k, seq_len, head_dim,
                               tl.load(cum_ptr + level - 1), tl.load(cum_ptr + level), BLOCK_K, PREC)
            size = tl.load(blk_ptr + level - 1)
            same = (offs_m // size)[:, None] == (offs_n // size)[None, :]
            s += tl.where(same, part, 0.0)
            dep += same.to(tl.float32)
        if AVERAGE:  # the level rule of structattn_mlr_levels.depth_weight, in Triton (forward and both backwards)
            s = s / dep
        if HAS_BIAS:
            bias = tl.load(bias_base + offs_m[:, None] * stride_bias_m + offs_n[None, :] * stride_bias_n,
                           mask=(offs_m[:, None] < seq_len) & (offs_n[None, :] < seq_len), other=0.0)
            s += bias.to(tl.float32)
        keep = (offs_m[:, None] < seq_len) & (offs_n[None, :] < seq_len)
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if HAS_KPM:
            kpm = tl.load(kpm_base + offs_n, mask=offs_n < seq_len, other=0)
            keep = keep & (kpm != 0)[None, :]
        s = tl.where(keep, s, float("-inf"))
        return s, dep, d_min, d_max

    @triton.jit
    def _accumulate_grad(acc, grad, other_base, offs_other, offs_d, offs_rows, offs_cols, seq_len, head_dim,
                         blk_ptr, cum_ptr, d_min, d_max, TRANSPOSE: tl.constexpr, PREC: tl.constexpr):
        """acc += G_eff @ X where G_eff[a, b] = grad[a, b] * [pair shares the level of the dim] (X = other[offs_other]).

        With TRANSPOSE the roles are swapped (acc += G_eff^T @ X): used for dk, where grad is (queries, keys).
        offs_rows / offs_cols are the query / key positions of grad's rows / columns.
        """
        rows_ok = offs_other[:, None] < seq_len
        c_min = tl.load(cum_ptr + d_min)
        x = tl.load(other_base + offs_other[:, None] * head_dim + offs_d[None, :],
                    mask=rows_ok & (offs_d[None, :] < c_min), other=0.0)
        g = grad.to(x.dtype)
        if TRANSPOSE:
            acc = tl.dot(tl.trans(g), x, acc, input_precision=PREC)
        else:
            acc = tl.dot(g, x, acc, input_precision=PREC)
        for level in range(d_min + 1, d_max + 1):
            lo = tl.load(cum_ptr + level - 1)
            hi = tl.load(cum_ptr + level)
            x = tl.load(other_base + offs_other[:, None] * head_dim + offs_d[None, :],
                        mask=rows_ok & (offs_d[None, :] >= lo) & (offs_d[None, :] < hi), other=0.0)
            size = tl.load(blk_ptr + level - 1)
            same = (offs_rows // size)[:, None] == (offs_cols // size)[None, :]
            g = tl.where(same, grad, 0.0).to(x.dtype)
            if TRANSPOSE:
                acc = tl.dot(tl.trans(g), x, acc, input_precision=PREC)
            else:
                acc = tl.dot(g, x, acc, input_precision=PREC)
        return acc

    @triton.jit
    def _mlr_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bias_ptr, kpm_ptr, blk_ptr, cum_ptr,
                        num_heads, seq_len, head_dim, v_dim, num_levels,
                        stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, stride_kpm_b,
                        CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr,
                        AVERAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        batch = pid_bh // num_heads
        head = pid_bh % num_heads
        q_base = q_ptr + pid_bh.to(tl.int64) * seq_len * head_dim
        k_base = k_ptr + pid_bh.to(tl.int64) * seq_len * head_dim
        v_base = v_ptr + pid_bh.to(tl.int64) * seq_len * v_dim
        bias_base = bias_ptr + batch.to(tl.int64) * stride_bias_b + head.to(tl.int64) * stride_bias_h
        kpm_base = kpm_ptr + batch.to(tl.int64) * stride_kpm_b

        m_start = pid_m * BLOCK_M
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_hi = tl.minimum(m_start + BLOCK_M, seq_len) - 1

        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) - float("inf")
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
        n_end = seq_len
        if CAUSAL:
            n_end = tl.minimum(seq_len, m_start + BLOCK_M)
        for n_start in range(0, n_end, BLOCK_N):
            offs_n = n_start + offs_n0
            n_hi = tl.minimum(n_start + BLOCK_N, seq_len) - 1
            s, dep, d_min, d_max = _tile_scores(
                q_base, k_base, bias_base, kpm_base, blk_ptr, cum_ptr, num_levels, offs_m, offs_n, offs_k,
                m_start, m_hi, n_start, n_hi, seq_len, head_dim, stride_bias_m, stride_bias_n,
                CAUSAL, HAS_BIAS, HAS_KPM, AVERAGE, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
            s = s * 1.4426950408889634  # log2(e): the online softmax runs on exp2
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # rows with no allowed key so far keep m = -inf; subtracting 0 instead avoids inf - inf = NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * v_dim + offs_dv[None, :],
                        mask=(offs_n[:, None] < seq_len) & (offs_dv[None, :] < v_dim), other=0.0)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
            m_i = m_new
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        # +inf LSE makes the backward's exp2(s - lse) exactly 0 on rows without any allowed key
        lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row_ok = offs_m < seq_len
        tl.store(o_ptr + pid_bh.to(tl.int64) * seq_len * v_dim + offs_m[:, None] * v_dim + offs_dv[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < v_dim))
        tl.store(lse_ptr + pid_bh.to(tl.int64) * seq_len + offs_m, lse, mask=row_ok)

    @triton.jit
    def _mlr_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                             bias_ptr, kpm_ptr, blk_ptr, cum_ptr,
                             num_heads, seq_len, head_dim, v_dim, num_levels,
                             stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, stride_kpm_b,
                             CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr,
                             AVERAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                             PREC: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        batch = pid_bh // num_heads
        head = pid_bh % num_heads
        q_base = q_ptr + pid_bh.to(tl.int64) * seq_len * head_dim
        k_base = k_ptr + pid_bh.to(tl.int64) * seq_len * head_dim
        v_base = v_ptr + pid_bh.to(tl.int64) * seq_len * v_dim
        do_base = do_ptr + pid_bh.to(tl.int64) * seq_len * v_dim
        lse_base = lse_ptr + pid_bh.to(tl.int64) * seq_len
        delta_base = delta_ptr + pid_bh.to(tl.int64) * seq_len
        bias_base = bias_ptr + batch.to(tl.int64) * stride_bias_b + head.to(tl.int64) * stride_bias_h
        kpm_base = kpm_ptr + batch.to(tl.int64) * stride_kpm_b

        n_start = pid_n * BLOCK_N
        offs_n = n_start + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        n_hi = tl.minimum(n_start + BLOCK_N, seq_len) - 1
        col_ok = offs_n < seq_len
        v = tl.load(v_base + offs_n[:, None] * v_dim + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
        m_begin = 0
        if CAUSAL:
            m_begin = (n_start // BLOCK_M) * BLOCK_M
        for m_start in range(m_begin, seq_len, BLOCK_M):
            offs_m = m_start + offs_m0
            row_ok = offs_m < seq_len
            m_hi = tl.minimum(m_start + BLOCK_M, seq_len) - 1
            s, dep, d_min, d_max = _tile_scores(
                q_base, k_base, bias_base, kpm_base, blk_ptr, cum_ptr, num_levels, offs_m, offs_n, offs_k,
                m_start, m_hi, n_start, n_hi, seq_len, head_dim, stride_bias_m, stride_bias_n,
                CAUSAL, HAS_BIAS, HAS_KPM, AVERAGE, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            p = tl.exp2(s * 1.4426950408889634 - lse[:, None])
            do = tl.load(do_base + offs_m[:, None] * v_dim + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
            ds = p * (dp - delta[:, None])
            if AVERAGE:
                ds = ds / dep
            dk = _accumulate_grad(dk, ds, q_base, offs_m, offs_d, offs_m, offs_n, seq_len, head_dim,
                                  blk_ptr, cum_ptr, d_min, d_max, True, PREC)
        tl.store(dk_ptr + pid_bh.to(tl.int64) * seq_len * head_dim + offs_n[:, None] * head_dim + offs_d[None, :],
                 dk, mask=col_ok[:, None] & (offs_d[None, :] < head_dim))
        tl.store(dv_ptr + pid_bh.to(tl.int64) * seq_len * v_dim + offs_n[:, None] * v_dim + offs_dv[None, :],
                 dv, mask=col_ok[:, None] & (offs_dv[None, :] < v_dim))

    @triton.jit
    def _mlr_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                           bias_ptr, kpm_ptr, blk_ptr, cum_ptr,
                           num_heads, seq_len, head_dim, v_dim, num_levels,
                           stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, stride_kpm_b,
                           CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr,
                           AVERAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                           PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        batch = pid_bh // num_heads
        head = pid_bh % num_heads
        q_base = q_ptr + pid_bh.to(tl.int64) * seq_len * head_dim
        k_base = k_ptr + pid_bh.to(tl.int64) * seq_len * head_dim
        v_base = v_ptr + pid_bh.to(tl.int64) * seq_len * v_dim
        do_base = do_ptr + pid_bh.to(tl.int64) * seq_len * v_dim
        bias_base = bias_ptr + batch.to(tl.int64) * stride_bias_b + head.to(tl.int64) * stride_bias_h
        kpm_base = kpm_ptr + batch.to(tl.int64) * stride_kpm_b

        m_start = pid_m * BLOCK_M
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_hi = tl.minimum(m_start + BLOCK_M, seq_len) - 1
        row_ok = offs_m < seq_len
        do = tl.load(do_base + offs_m[:, None] * v_dim + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
        lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        n_end = seq_len
        if CAUSAL:
            n_end = tl.minimum(seq_len, m_start + BLOCK_M)
        for n_start in range(0, n_end, BLOCK_N):
            offs_n = n_start + offs_n0
            n_hi = tl.minimum(n_start + BLOCK_N, seq_len) - 1
            s, dep, d_min, d_max = _tile_scores(
                q_base, k_base, bias_base, kpm_base, blk_ptr, cum_ptr, num_levels, offs_m, offs_n, offs_k,
                m_start, m_hi, n_start, n_hi, seq_len, head_dim, stride_bias_m, stride_bias_n,
                CAUSAL, HAS_BIAS, HAS_KPM, AVERAGE, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
            p = tl.exp2(s * 1.4426950408889634 - lse[:, None])
            v = tl.load(v_base + offs_n[:, None] * v_dim + offs_dv[None, :],
                        mask=(offs_n[:, None] < seq_len) & (offs_dv[None, :] < v_dim), other=0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            if AVERAGE:
                ds = ds / dep
            dq = _accumulate_grad(dq, ds, k_base, offs_n, offs_d, offs_m, offs_n, seq_len, head_dim,
                                  blk_ptr, cum_ptr, d_min, d_max, False, PREC)
        tl.store(dq_ptr + pid_bh.to(tl.int64) * seq_len * head_dim + offs_m[:, None] * head_dim + offs_d[None, :],
                 dq, mask=row_ok[:, None] & (offs_d[None, :] < head_dim))


def _geometry_tensors(ranks: Sequence[int], block_sizes: Sequence[int], device) -> tuple:
    """(blk, cum): int32 (L,) block size per level (level 1 unbounded) and (L+1,) prefix widths c_0..c_L."""
    blocks = [_UNBOUNDED_BLOCK] + [int(size) for size in block_sizes]
    cum = [0]
    for rank in ranks:
        cum.append(cum[-1] + int(rank))
    return (torch.tensor(blocks, dtype=torch.int32, device=device),
            torch.tensor(cum, dtype=torch.int32, device=device))


def _launch_config(q: torch.Tensor, v: torch.Tensor, block_m: Optional[int], block_n: Optional[int]) -> dict:
    # fp32 inputs must not silently drop to tf32 on GPU: the tests compare at ~1e-5
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    return dict(BLOCK_M=block_m or 64, BLOCK_N=block_n or 64, BLOCK_K=16,
                BLOCK_D=_next_pow2(q.shape[-1]), BLOCK_DV=_next_pow2(v.shape[-1]), PREC=prec)


def _bias_args(bias: Optional[torch.Tensor], shape: tuple, dummy: torch.Tensor) -> tuple:
    if bias is None:
        return dummy, (0, 0, 0, 0)
    expanded = bias.expand(shape)  # broadcast dims get stride 0, so no copy
    return expanded, tuple(expanded.stride())


class _MLRTritonFunction(torch.autograd.Function):
    """Autograd wrapper: q, k (B, H, T, r), v (B, H, T, dv) -> (B, H, T, dv)."""

    @staticmethod
    def forward(ctx, q, k, v, scale_vec, bias, kpm, blk, cum, causal, average, block_m, block_n):
        batch, heads, seq_len, head_dim = q.shape
        v_dim = v.shape[-1]
        q_scaled = (q.float() * scale_vec).to(q.dtype).contiguous()
        k = k.contiguous()
        v = v.contiguous()
        out = torch.empty(batch, heads, seq_len, v_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(batch, heads, seq_len, dtype=torch.float32, device=q.device)
        cfg = _launch_config(q, v, block_m, block_n)
        bias_t, bias_strides = _bias_args(bias, (batch, heads, seq_len, seq_len), q_scaled)
        kpm_t = kpm if kpm is not None else lse
        kpm_stride = kpm.stride(0) if kpm is not None else 0
        if seq_len > 0:
            grid = (triton.cdiv(seq_len, cfg["BLOCK_M"]), batch * heads)
            _mlr_fwd_kernel[grid](
                q_scaled, k, v, out, lse, bias_t, kpm_t, blk, cum,
                heads, seq_len, head_dim, v_dim, blk.numel(), *bias_strides, kpm_stride,
                CAUSAL=causal, HAS_BIAS=bias is not None, HAS_KPM=kpm is not None, AVERAGE=average,
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                BLOCK_DV=cfg["BLOCK_DV"], PREC=cfg["PREC"])
        ctx.save_for_backward(q_scaled, k, v, out, lse, scale_vec, bias, kpm, blk, cum)
        ctx.flags = (causal, average, block_m, block_n)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q_scaled, k, v, out, lse, scale_vec, bias, kpm, blk, cum = ctx.saved_tensors
        causal, average, block_m, block_n = ctx.flags
        batch, heads, seq_len, head_dim = q_scaled.shape
        v_dim = v.shape[-1]
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # rowsum(dO * O), (B, H, T)
        dq = torch.zeros(batch, heads, seq_len, head_dim, dtype=torch.float32, device=q_scaled.device)
        dk = torch.zeros_like(dq)
        dv = torch.zeros(batch, heads, seq_len, v_dim, dtype=torch.float32, device=q_scaled.device)
        cfg = _launch_config(q_scaled, v, block_m, block_n)
        bias_t, bias_strides = _bias_args(bias, (batch, heads, seq_len, seq_len), q_scaled)
        kpm_t = kpm if kpm is not None else lse
        kpm_stride = kpm.stride(0) if kpm is not None else 0
        if seq_len > 0:
            common = dict(CAUSAL=causal, HAS_BIAS=bias is not None, HAS_KPM=kpm is not None, AVERAGE=average,
                          BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                          BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"], PREC=cfg["PREC"])
            geometry = (heads, seq_len, head_dim, v_dim, blk.numel(), *bias_strides, kpm_stride)
            grid_n = (triton.cdiv(seq_len, cfg["BLOCK_N"]), batch * heads)
            _mlr_bwd_dkdv_kernel[grid_n](q_scaled, k, v, grad_out, lse, delta, dk, dv,
                                         bias_t, kpm_t, blk, cum, *geometry, **common)
            grid_m = (triton.cdiv(seq_len, cfg["BLOCK_M"]), batch * heads)
            _mlr_bwd_dq_kernel[grid_m](q_scaled, k, v, grad_out, lse, delta, dq,
                                       bias_t, kpm_t, blk, cum, *geometry, **common)
        dq = dq * scale_vec  # the kernel differentiated w.r.t. the pre-scaled q
        return (dq.to(q_scaled.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None, None, None, None, None)


def mlr_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ranks: Sequence[int],
                         block_sizes: Sequence[int], causal: bool = True, level_scales: Sequence[float],
                         average_levels: bool = False, key_padding_mask: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, block_m: Optional[int] = None,
                         block_n: Optional[int] = None) -> torch.Tensor:
    """Exact MLR attention with a fused Triton kernel (forward and backward).

    q, k: (B, H, T, r); v: (B, H, T, dv) -> (B, H, T, dv), in the input dtype (fp32 / fp16 / bf16; fp32
    accumulation). Token index == absolute position. ``ranks`` (r_1..r_L) split r into contiguous prefixes,
    ``block_sizes`` (b_2..b_L) are nested, ``level_scales`` gives alpha_l per level. key_padding_mask: (B, T)
    bool, True = keep. bias: additive, broadcastable to (B, H, T, T) (not differentiable). Rows with no
    allowed key return 0. block_m / block_n override the tile sizes (powers of two >= 16).
    """
    if not TRITON_AVAILABLE:
        raise RuntimeError("mlr_attention_triton needs the `triton` package (pip install triton)")
    head_dim = q.shape[-1]
    ranks = [int(rank) for rank in ranks]
    block_sizes = [int(size) for size in block_sizes]
    validate_mlr_geometry(ranks, block_sizes, head_dim)
    level_scales = [float(scale) for scale in level_scales]
    if len(level_scales) != len(ranks):
        raise ValueError(f"level_scales={level_scales} must have one value per level ({len(ranks)} levels)")
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k (B, H, T, r) and v (B, H, T, dv); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q, k, v must share one dtype among float32/float16/bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    for size in (block_m, block_n):
        if size is not None and (size < 16 or size & (size - 1)):
            raise ValueError(f"block_m / block_n must be powers of two >= 16, got {size}")
    batch, heads, seq_len, _ = q.shape
    if bias is not None:
        if bias.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("mlr_attention_triton does not compute the gradient of `bias`; "
                                      "detach it or use the reference / fused CPU path")
        if bias.dtype not in (torch.float32, q.dtype):
            bias = bias.to(torch.float32)
        try:
            bias.expand(batch, heads, seq_len, seq_len)
        except RuntimeError as error:
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to "
                             f"{(batch, heads, seq_len, seq_len)}") from error
    kpm = None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, seq_len):
            raise ValueError(f"key_padding_mask must be (B, T) = {(batch, seq_len)}, "
                             f"got {tuple(key_padding_mask.shape)}")
        kpm = key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
    scale_vec = torch.repeat_interleave(torch.tensor(level_scales, dtype=torch.float32, device=q.device),
                                        torch.tensor(ranks, device=q.device))
    blk, cum = _geometry_tensors(ranks, block_sizes, q.device)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        # CPU means the Triton interpreter, whose tl.dot returns garbage for bf16 (numpy has no bfloat16)
        out = _MLRTritonFunction.apply(q.float(), k.float(), v.float(), scale_vec, bias, kpm, blk, cum,
                                       bool(causal), bool(average_levels), block_m, block_n)
        return out.to(q.dtype)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return _MLRTritonFunction.apply(q, k, v, scale_vec, bias, kpm, blk, cum, bool(causal),
                                        bool(average_levels), block_m, block_n)
