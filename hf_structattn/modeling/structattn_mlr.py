"""Exact fast MLR attention: one fused attention call per level group, merged by log-sum-exp.

For a query in finest block F the keys split into at most L contiguous groups: its own
finest block (all r dims), and for each coarser depth d the part of its level-d block outside its
level-(d+1) block (the first ``c_d = r_1 + ... + r_d`` dims). Each group is an ordinary attention problem,
so the op is a handful of fused attention calls whose (output, log-sum-exp) pairs are merged. The fused and
Triton backends never materialise the T x T score matrix; the math backend does.

Three backends share the same group plan:
  * ``fused`` (CPU): ``aten._scaled_dot_product_flash_attention_for_cpu`` per group, with a custom
    backward that calls the fused backward once per group with the *global* output and LSE (that is exactly
    flash backward with ``P = exp(S_g - LSE)``). The op needs equal q/k/v widths, so truncated q is
    zero-padded (scales folded into q, ``scale=1``).
  * ``math`` (any device): the T x T scores materialised like eager attention (global dims in one matmul,
    finer levels added on the diagonal blocks), plain autograd around them. Used when the additive bias needs
    a gradient (T5's learned relative bias) and on devices without a fused op.
  * ``triton`` (CUDA): the kernel in ``structattn_triton`` when Triton is installed.
"""

import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .structattn_geometry import (
    check_bias,
    check_positions,
    check_qkv,
    depth_scale_vector,
    keep_mask,
    level_prefix_widths,
    mask_value,
    resolve_level_scales,
    softmax_dtype,
    validate_mlr_geometry,
)
from .structattn_reference import mlr_attention_reference


def _triton_kernel():
    """``mlr_attention_triton``, or None without Triton. Imported on the first call (a CUDA tensor under "auto",
    or implementation="triton"), not at module import: defining the kernels costs import time on machines that
    never run them. The import is cached by Python, so later calls cost a dict lookup."""
    try:
        from .structattn_triton import TRITON_AVAILABLE, mlr_attention_triton
    except ImportError:  # the kernel file is optional in the payload
        return None
    return mlr_attention_triton if TRITON_AVAILABLE else None

IMPLEMENTATIONS = ("auto", "fused", "math", "triton", "reference")

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _Group:
    """One level group on the canonical layout (token index == position - base, length Tc).

    The sequence is viewed as ``n_parents`` parents of ``n_children`` children of ``child`` tokens;
    queries in child i attend keys in child ``i - offset`` of the same parent. The finest group is
    ``n_children == 1, offset == 0`` (own block, causal inside when causal).
    """

    def __init__(self, depth: int, parent: int, child: int, offset: int, length: int):
        self.depth = depth
        self.parent = parent
        self.child = child
        self.offset = offset
        self.n_parents = length // parent
        self.n_children = parent // child
        self.count = self.n_children - abs(offset)
        self.query_children = slice(max(offset, 0), self.n_children + min(offset, 0))
        self.key_children = slice(max(-offset, 0), self.n_children - max(offset, 0))

    @property
    def is_own_block(self) -> bool:
        return self.offset == 0

    def view(self, x: torch.Tensor, children: slice) -> torch.Tensor:
        """x (B, H, Tc, E) -> (B, H, n_parents, count, child, E) view of the selected children."""
        batch, heads, _, width = x.shape
        return x.view(batch, heads, self.n_parents, self.n_children, self.child, width)[:, :, :, children]

    def rows(self, lse: torch.Tensor) -> torch.Tensor:
        """lse (B, H, Tc) -> (B, H, n_parents, count, child) view of the query rows."""
        return self.view(lse[..., None], self.query_children)[..., 0]

    def additive_mask(self, key_valid: Optional[torch.Tensor], bias: Optional[torch.Tensor], batch: int, heads: int,
                      dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Additive mask (B, H*N, 1|child, child) for this group from the canonical key validity (B, Tc) and
        bias (Bb, Hb, Tc, Tc) with Bb in (1, B), Hb in (1, H), or None."""
        result = None
        if key_valid is not None:
            valid = key_valid.view(batch, 1, self.n_parents, self.n_children, 1, self.child)[:, :, :, self.key_children]
            valid = valid.expand(batch, heads, self.n_parents, self.count, 1, self.child)
            valid = valid.reshape(batch, heads * self.n_parents * self.count, 1, self.child)
            result = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, mask_value(dtype))
        if bias is not None:
            bias_batch, bias_heads, length, _ = bias.shape
            blocks = bias.view(bias_batch, bias_heads, self.n_parents, self.parent, self.n_parents, self.parent)
            blocks = blocks.diagonal(dim1=2, dim2=4).permute(0, 1, 4, 2, 3)  # (Bb, Hb, nP, P, P)
            blocks = blocks.reshape(bias_batch, bias_heads, self.n_parents, self.n_children, self.child,
                                    self.n_children, self.child)
            blocks = blocks.diagonal(offset=-self.offset, dim1=3, dim2=5).permute(0, 1, 2, 5, 3, 4)
            blocks = blocks.expand(batch, heads, self.n_parents, self.count, self.child, self.child)
            blocks = blocks.reshape(batch, heads * self.n_parents * self.count, self.child, self.child).to(dtype)
            result = blocks if result is None else result + blocks
        return result

    # Fused path: (B, n_parents, count) fold into the kernel's batch dim. The kernel returns gradients (and
    # wants the output gradient) with (batch, length, heads, width) memory, so the fold follows the inputs'
    # layout: for (B, T, H, E) memory (what a model's ``view(B, T, H, E).transpose(1, 2)`` gives) H stays the
    # kernel's head dim; for (B, H, T, E) memory H joins the batch too and the kernel sees one head. Either
    # way every group is a strided view of the inputs, and the own-block group's results are whole-sequence
    # tensors in the inputs' layout without a copy.
    def fold(self, x: torch.Tensor, children: slice, heads_in_batch: bool) -> torch.Tensor:
        """x (B, H, Tc, ...) -> (B * n_parents * count, H, child, ...), or (B * H * n_parents * count, 1,
        child, ...) when ``heads_in_batch`` (a view when the strides allow)."""
        batch, heads = x.shape[:2]
        rest = x.shape[3:]
        picked = x.reshape(batch, heads, self.n_parents, self.n_children, self.child, *rest)[:, :, :, children]
        if heads_in_batch:
            return picked.reshape(batch * heads * self.n_parents * self.count, 1, self.child, *rest)
        picked = picked.movedim(1, 3)  # (B, nP, count, H, child, ...)
        return picked.reshape(batch * self.n_parents * self.count, heads, self.child, *rest)

    def unfold(self, t: torch.Tensor, batch: int, heads: int, heads_in_batch: bool) -> torch.Tensor:
        """Inverse of ``fold`` as a view: kernel-side tensor -> (B, H, n_parents, count, child, ...)."""
        if heads_in_batch:
            return t.squeeze(1).unflatten(0, (batch, heads, self.n_parents, self.count))
        return t.unflatten(0, (batch, self.n_parents, self.count)).movedim(3, 1)

    def fold_mask(self, key_valid: Optional[torch.Tensor], bias: Optional[torch.Tensor], batch: int, heads: int,
                  dtype: torch.dtype, heads_in_batch: bool) -> Optional[torch.Tensor]:
        """``additive_mask`` in the fused path's fold, or None."""
        mask = self.additive_mask(key_valid, bias, batch, heads, dtype)
        if mask is None:
            return None
        mask = mask.view(batch, heads, self.n_parents, self.count, *mask.shape[2:])
        if heads_in_batch:
            return mask.reshape(batch * heads * self.n_parents * self.count, 1, *mask.shape[-2:])
        return mask.movedim(1, 3).reshape(batch * self.n_parents * self.count, heads, *mask.shape[-2:])


class _Plan:
    """Groups of one call: built from the canonical length and the levels that are not shared by all tokens."""

    def __init__(self, ranks: Sequence[int], block_sizes: Sequence[int], first_depth: int, length: int, causal: bool):
        self.groups = []
        num_levels = len(ranks)
        finest = block_sizes[-1] if first_depth < num_levels else length  # first_depth == L: one dense group
        self.groups.append(_Group(num_levels, finest, finest, 0, length))
        for depth in range(num_levels - 1, first_depth - 1, -1):
            parent = length if depth == first_depth else block_sizes[depth - 2]
            child = block_sizes[depth - 1]
            n_children = parent // child
            offsets = list(range(1, n_children)) + ([] if causal else list(range(-(n_children - 1), 0)))
            for offset in offsets:
                self.groups.append(_Group(depth, parent, child, offset, length))
        self.prefix_widths = level_prefix_widths(ranks)


def _uniform_scale(vector: torch.Tensor, width: int) -> Optional[float]:
    """The common value of ``vector[:width]`` when all entries are equal and non-zero, else None."""
    head = vector[:width]
    low, high = float(head.min()), float(head.max())
    return low if low == high and low != 0.0 else None


def _heads_in_batch(q: torch.Tensor) -> bool:
    """Fold heads into the kernel batch for (B, H, T, E) memory, keep them as kernel heads otherwise."""
    return q.is_contiguous()


def _fold_layout(t: torch.Tensor, heads_in_batch: bool) -> torch.Tensor:
    """``t`` in a layout whose group folds are views: (B, H, T, E) memory for the heads-in-batch fold, else
    (B, T, H, E) memory (any layout works when B == 1). One up-front copy when needed replaces a copy of
    every group's rows."""
    if heads_in_batch:
        return t.contiguous()
    if t.shape[0] == 1 or t.transpose(1, 2).is_contiguous():
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _scratch_view(inputs, attr: str, like: torch.Tensor) -> torch.Tensor:
    """A reused buffer shaped like the kernel-side ``like`` (B', H, L, E) with (B', L, H, E) memory."""
    buffer = getattr(inputs, attr)
    if buffer is None or buffer.numel() < like.numel():
        buffer = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        setattr(inputs, attr, buffer)
    rows, heads, length, width = like.shape
    return buffer[:like.numel()].view(rows, length, heads, width).transpose(1, 2)


class _GroupInputs:
    """Per-call constants of the fused path: padded inputs, per-depth scale vectors and reused scratch.

    The kernel wants equal q/k/v widths and one scalar scale, so every coarse group runs on a copy of its
    query rows, scaled and zero-masked beyond the group's prefix width; writing that copy into one reused
    buffer (instead of a fresh tensor per group) saves an allocation and its page faults per group. The
    own-block group uses every dim, so with uniform scales it runs on q itself with the kernel's ``scale``.
    """

    def __init__(self, q, k, v, plan, scale_vectors):
        self.head_dim, self.value_dim = q.shape[-1], v.shape[-1]
        self.width = width = max(self.head_dim, self.value_dim)
        self.heads_in_batch = fold = _heads_in_batch(q)
        padded = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
        self.q, self.k, self.v = (_fold_layout(t, fold) for t in padded)
        self.plan = plan
        self.vectors = {depth: F.pad(vec, (0, width - vec.shape[0])) for depth, vec in scale_vectors.items()}
        self.own_scale = _uniform_scale(self.vectors[plan.groups[0].depth], self.head_dim)
        self.q_scratch = self.grad_scratch = None

    def prefix(self, group: _Group) -> int:
        """Number of leading dims the group's scores use (later dims of its scaled q are zero)."""
        if group.depth >= len(self.plan.prefix_widths):
            return self.head_dim
        return self.plan.prefix_widths[group.depth - 1]

    def queries(self, group: _Group):
        """(kernel q, kernel scale, multiplier of the kernel's dq or None) for one group."""
        rows = group.fold(self.q, group.query_children, self.heads_in_batch)
        if group is self.plan.groups[0] and self.own_scale is not None:
            return rows, self.own_scale, None
        vector = self.vectors[group.depth]
        return torch.mul(rows, vector, out=_scratch_view(self, "q_scratch", rows)), 1.0, vector

    def keys(self, group: _Group):
        fold = self.heads_in_batch
        return group.fold(self.k, group.key_children, fold), group.fold(self.v, group.key_children, fold)

    def fold(self, group: _Group, x: torch.Tensor) -> torch.Tensor:
        """The group's query rows of x (B, H, Tc, ...) as the kernel sees them."""
        return group.fold(x, group.query_children, self.heads_in_batch)

    def unfold(self, group: _Group, t: torch.Tensor) -> torch.Tensor:
        return group.unfold(t, self.q.shape[0], self.q.shape[1], self.heads_in_batch)

    def mask(self, group: _Group, key_valid, bias, dtype):
        return group.fold_mask(key_valid, bias, self.q.shape[0], self.q.shape[1], dtype, self.heads_in_batch)

    def kernel_grad(self, group: _Group, grad: torch.Tensor) -> torch.Tensor:
        """The group's output-gradient rows with (B', L, H, E) memory: the fused backward reads that layout
        and copies anything else into a fresh tensor per call; this reuses one buffer."""
        rows = self.fold(group, grad)
        if rows.transpose(1, 2).is_contiguous():
            return rows
        return _scratch_view(self, "grad_scratch", rows).copy_(rows)


class _FusedMLRFunction(torch.autograd.Function):
    """Exact MLR attention on the canonical layout using the fused CPU flash kernel per group."""

    @staticmethod
    def forward(ctx, q, k, v, key_valid, bias, plan, scale_vectors, causal):
        batch, heads, length, _ = q.shape
        inputs = _GroupInputs(q, k, v, plan, scale_vectors)
        value_dim = inputs.value_dim
        acc_dtype = softmax_dtype(q.dtype)
        out = lse = None
        for group in plan.groups:
            mask = inputs.mask(group, key_valid, bias, q.dtype)
            group_q, kernel_scale, _ = inputs.queries(group)
            group_k, group_v = inputs.keys(group)
            group_out, group_lse = _cpu_flash(group_q, group_k, group_v, 0.0, causal and group.is_own_block,
                                              attn_mask=mask, scale=kernel_scale)
            group_out = inputs.unfold(group, group_out[..., :value_dim])
            group_lse = inputs.unfold(group, group_lse)
            if out is None:  # the own-block group covers every query row: its result (a view) starts the merge
                out = group_out.to(acc_dtype).reshape(batch, heads, length, value_dim)
                lse = group_lse.to(acc_dtype).reshape(batch, heads, length)
                continue
            # Merge weights sum to one, so the merge is one in-place lerp over the group's rows.
            running = group.rows(lse)
            group_lse = group_lse.to(acc_dtype)
            merged = torch.logaddexp(running, group_lse)
            weight = torch.sub(group_lse, merged, out=group_lse if group_lse.dtype == acc_dtype else None).exp_()
            out_rows = group.view(out, group.query_children)
            out_rows.lerp_(group_out.to(acc_dtype), weight[..., None])
            running.copy_(merged)
            del group_out
        inputs.q_scratch = None
        result = out.to(q.dtype)
        if result._is_view():
            # Autograd refuses in-place ops on a custom Function output that is a view (``out`` views a kernel
            # result); a plain alias of the same storage behaves like SDPA's output instead.
            result = torch.empty(0, dtype=result.dtype, device=result.device).set_(
                result.untyped_storage(), result.storage_offset(), result.size(), result.stride())
        ctx.save_for_backward(q, k, v, key_valid, bias, result, lse)
        ctx.plan, ctx.scale_vectors, ctx.causal = plan, scale_vectors, causal
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, key_valid, bias, out, lse = ctx.saved_tensors
        plan, causal = ctx.plan, ctx.causal
        batch, heads, length, head_dim = q.shape
        inputs = _GroupInputs(q, k, v, plan, ctx.scale_vectors)
        value_dim, width = inputs.value_dim, inputs.width
        out_pad, grad_pad = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t
                             for t in (out, grad_out))
        acc_dtype = softmax_dtype(q.dtype)
        lse = lse.to(acc_dtype)
        grad_q = grad_k = grad_v = None
        for group in plan.groups:
            mask = inputs.mask(group, key_valid, bias, q.dtype)
            group_q, kernel_scale, dq_scale = inputs.queries(group)
            group_k, group_v = inputs.keys(group)
            group_lse = inputs.fold(group, lse[..., None])[..., 0]
            dq, dk, dv = _cpu_flash_backward(
                inputs.kernel_grad(group, grad_pad), group_q, group_k, group_v,
                inputs.fold(group, out_pad), group_lse, 0.0, causal and group.is_own_block,
                attn_mask=mask, scale=kernel_scale)
            dq, dk, dv = (inputs.unfold(group, t) for t in (dq, dk, dv))
            if grad_q is None:
                # The own-block group touches every query and key row, and its gradients come back in the
                # inputs' layout (see ``_Group.fold``): whole-sequence views of them start the sums.
                if dq_scale is not None:
                    dq.mul_(dq_scale)
                grad_q, grad_k, grad_v = (t.to(acc_dtype).reshape(batch, heads, length, width) for t in (dq, dk, dv))
                continue
            # dq beyond the prefix is discarded and dk beyond it is exactly zero (q was zero-masked there).
            prefix = inputs.prefix(group)
            query_rows = group.view(grad_q, group.query_children)[..., :prefix]
            if dq_scale is None:
                query_rows.add_(dq[..., :prefix])
            else:
                query_rows.addcmul_(dq[..., :prefix], dq_scale[:prefix])
            group.view(grad_k, group.key_children)[..., :prefix].add_(dk[..., :prefix])
            group.view(grad_v, group.key_children).add_(dv)
            del dq, dk, dv
        inputs.q_scratch = inputs.grad_scratch = None
        return (grad_q[..., :head_dim].to(q.dtype), grad_k[..., :head_dim].to(k.dtype),
                grad_v[..., :value_dim].to(v.dtype), None, None, None, None, None)


@torch.compiler.disable
def _fused_mlr(q, k, v, key_valid, bias, plan, scale_vectors, causal):
    """The fused CPU path runs eagerly under torch.compile: it writes through strided views and `out=` buffers
    that Dynamo cannot trace, and the fused kernel is already the whole cost."""
    return _FusedMLRFunction.apply(q, k, v, key_valid, bias, plan, scale_vectors, causal)


class _BlockScores(torch.autograd.Function):
    """Materialised MLR scores ``S = q_g k_g^T + sum_l blockdiag_l(q_l k_l^T)``.

    ``q_g``/``k_g``: the first ``global_width`` dims (levels shared by every pair); level l adds its own dims
    ``q[..., lo:hi]`` inside its blocks, given as ``(lo, hi, first, full, block, ranges)``: ``full`` whole blocks
    of ``block`` tokens from index ``first`` done in one batched matmul, plus blocks done one by one as (start,
    end) ``ranges`` (the partial blocks cut by the sequence ends, and every block when there are few).
    Blocks are accumulated in place on strided diagonal views and the backward reads the same views, so there
    is no full-size temporary besides S itself.
    """

    @staticmethod
    def forward(ctx, q, k, global_width, levels):
        # q, k: (B, H, T, r). Returns S (B, H, T, T).
        ctx.save_for_backward(q, k)
        ctx.global_width, ctx.levels = global_width, levels
        scores = q[..., :global_width] @ k[..., :global_width].transpose(-1, -2)
        for lo, hi, first, full, block, ranges in levels:
            if full:
                _block_diagonal(scores, first, full, block).add_(
                    _blocks(q[..., lo:hi], first, full, block) @ _blocks(k[..., lo:hi], first, full, block).mT)
            for a, b in ranges:
                scores[:, :, a:b, a:b].add_(q[:, :, a:b, lo:hi] @ k[:, :, a:b, lo:hi].mT)
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        q, k = ctx.saved_tensors
        width = ctx.global_width
        grad_q, grad_k = torch.zeros_like(q), torch.zeros_like(k)
        grad_q[..., :width] = grad_scores @ k[..., :width]
        grad_k[..., :width] = grad_scores.mT @ q[..., :width]
        for lo, hi, first, full, block, ranges in ctx.levels:
            if full:
                grad_blocks = _block_diagonal(grad_scores, first, full, block)
                _blocks(grad_q[..., lo:hi], first, full, block).copy_(
                    grad_blocks @ _blocks(k[..., lo:hi], first, full, block))
                _blocks(grad_k[..., lo:hi], first, full, block).copy_(
                    grad_blocks.mT @ _blocks(q[..., lo:hi], first, full, block))
            for a, b in ranges:
                grad_q[:, :, a:b, lo:hi] = grad_scores[:, :, a:b, a:b] @ k[:, :, a:b, lo:hi]
                grad_k[:, :, a:b, lo:hi] = grad_scores[:, :, a:b, a:b].mT @ q[:, :, a:b, lo:hi]
        return grad_q, grad_k, None, None


def _blocks(x: torch.Tensor, first: int, full: int, block: int) -> torch.Tensor:
    """(B, H, T, E) -> (B, H, full, block, E) view of the whole blocks starting at index ``first``."""
    return x[:, :, first:first + full * block].unflatten(2, (full, block))


def _block_diagonal(scores: torch.Tensor, first: int, full: int, block: int) -> torch.Tensor:
    """(B, H, T, T) -> (B, H, full, block, block) strided view of the whole diagonal blocks from ``first``."""
    end = first + full * block
    tiles = scores[:, :, first:end, first:end].unflatten(2, (full, block)).unflatten(4, (full, block))
    return tiles.diagonal(dim1=2, dim2=4).permute(0, 1, 4, 2, 3)


_LOOPED_BLOCKS = 8


def _level_blocks(length: int, start: int, block: int) -> tuple:
    """Blocks of ``block`` positions (aligned to position 0) met by indices 0..length-1 at positions start+i:
    (first, full, partial) = index of the first whole block, number of whole blocks, partial (a, b) ranges."""
    first = min((-start) % block, length)
    full = (length - first) // block
    end = first + full * block
    partial = tuple(r for r in ((0, first), (end, length)) if r[1] > r[0])
    return first, full, partial


def _math_attention(q, k, v, key_valid, bias, ranks, block_sizes, first_depth, level_scales, average_levels, causal,
                    start: int = 0):
    """Materialised-score MLR attention with plain autograd around the score assembly (any device; the path
    that differentiates the bias, e.g. T5's learned relative position bias). O(T^2) memory like eager
    attention; score MACs ``T^2 c_first + sum_l T b_l r_l``.

    q, k: (B, H, T, r), v: (B, H, T, dv), index i at position ``start + i`` (blocks are aligned to position 0;
    ``first_depth`` levels are shared by every pair); key_valid: (B, T) bool or None; bias: broadcastable to
    (B, H, T, T) or None. Returns (B, H, T, dv).
    """
    length = q.shape[2]
    num_levels = len(ranks)
    widths = level_prefix_widths(ranks)
    level_vector = depth_scale_vector(ranks, level_scales, num_levels, False, q.dtype, q.device)
    levels = []
    for level in range(first_depth + 1, num_levels + 1):
        block = block_sizes[level - 2]
        first, full, ranges = _level_blocks(length, start, block)
        if full <= _LOOPED_BLOCKS:
            # few large blocks: one matmul per block reads S in place, where one batched matmul over the strided
            # diagonal would first copy those T x b scores (measured ~2x slower backward at T = 513, b = 256)
            ranges = tuple(sorted(ranges + tuple((first + i * block, first + (i + 1) * block) for i in range(full))))
            full = 0
        levels.append((widths[level - 2], widths[level - 1], first, full, block, ranges))
    scores = _BlockScores.apply(q * level_vector, k, widths[first_depth - 1], tuple(levels))
    if average_levels:
        positions = torch.arange(start, start + length, device=q.device)
        depth = torch.full((length, length), float(first_depth), dtype=q.dtype, device=q.device)
        for level in range(first_depth + 1, num_levels + 1):
            block = block_sizes[level - 2]
            depth += (positions[:, None] // block == positions[None, :] // block).to(q.dtype)
        scores = scores / depth
    if bias is not None:
        scores = scores + bias
    masked = None
    if key_valid is not None:
        masked = ~key_valid[:, None, None, :]
    if causal:
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
        masked = future if masked is None else masked | future
    if masked is not None:
        scores = scores.masked_fill(masked, mask_value(scores.dtype))
    return torch.softmax(scores, dim=-1, dtype=softmax_dtype(scores.dtype)).to(v.dtype) @ v


def _row_offsets(positions: torch.Tensor, valid: torch.Tensor):
    """Per-row constant ``position - index`` over valid tokens, or None if some row is not contiguous."""
    length = positions.shape[1]
    delta = positions - torch.arange(length, device=positions.device)
    big = torch.iinfo(torch.long).max
    low = torch.where(valid, delta, torch.full_like(delta, big)).amin(1)
    high = torch.where(valid, delta, torch.full_like(delta, -big)).amax(1)
    has_tokens = valid.any(1)
    if bool(((low != high) & has_tokens).any()):
        return None
    return torch.where(has_tokens, low, torch.zeros_like(low))


def mlr_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ranks: Sequence[int],
                  block_sizes: Sequence[int], causal: bool = True,
                  scales: Union[None, str, float, Sequence[float]] = None, positions: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                  average_levels: bool = False, implementation: str = "auto") -> torch.Tensor:
    """Exact multi-level low-rank attention (paper §3.4); the fused and Triton paths never materialise the
    T x T scores.

    Args:
        q, k: (B, H, T, r) queries and keys; level slices are contiguous prefixes ``[q_1 | q_2 | ...]``.
        v: (B, H, T, dv).
        ranks: (r_1, ..., r_L) summing to r.
        block_sizes: (b_2, ..., b_L) nested block sizes of levels 2..L (level 1 is global). These come from
            the training length, never from T.
        causal: causal (key position <= query position) or bidirectional.
        scales: per-level logit multipliers: None/"standard" = 1/sqrt(r), "mup" = 1/r_l, a float, or a list
            (each finite and > 0).
        positions: (B, T), (1, T) or (T,) non-negative integer absolute positions (default ``arange(T)``);
            blocks are aligned to them. Any per-row offset works, with or without a mask.
        attention_mask: (B, T) or (1, T) keep-mask over keys: bool, or integer/float holding only 0 and 1
            (1 = attend). Additive masks (0 / -inf) are refused with an error; pass them as ``bias``.
        bias: additive floating score bias broadcastable to (B, H, T, T) (e.g. T5's relative position bias, or an
            additive mask), added in every level group.
        average_levels: divide each score by the number of levels the pair shares.
        implementation: "auto", "fused" (CPU), "math", "triton" (CUDA) or "reference" (naive, for tests).

    Returns:
        (B, H, T, dv) in the inputs' dtype (float16, bfloat16, float32 or float64; the softmax and the level merge
        run in ``promote_types(dtype, float32)``). Rows whose keys are all masked hold an unspecified finite value.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    check_qkv(q, k, v)
    validate_mlr_geometry(ranks, block_sizes, q.shape[-1])
    level_scales = resolve_level_scales(ranks, scales)
    batch, heads, length, _ = q.shape
    valid = keep_mask(attention_mask, batch, length, q.device)
    positions = check_positions(positions, batch, length, q.device)
    check_bias(bias, (batch, heads, length, length))
    if implementation == "reference":
        return mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=block_sizes, causal=causal,
                                       scales=level_scales, positions=positions, attention_mask=valid,
                                       bias=bias, average_levels=average_levels)

    if positions is None:
        offsets, uniform = None, True
    else:
        offsets = _row_offsets(positions, valid if valid is not None else torch.ones_like(positions, dtype=torch.bool))
        if offsets is None:  # non-contiguous positions (e.g. packed sequences): only the naive path is exact
            return mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=block_sizes, causal=causal,
                                           scales=level_scales, positions=positions, attention_mask=valid,
                                           bias=bias, average_levels=average_levels)
        uniform = bool((offsets == offsets[0]).all())
        if not uniform and valid is None:
            # per-row offsets go through the canonical scatter, which marks real tokens with the mask
            valid = torch.ones(batch, length, dtype=torch.bool, device=q.device)

    # Range of positions that carry real tokens decides which levels every pair shares.
    if uniform:
        base_offset = 0 if offsets is None else int(offsets[0])
        low, high = base_offset, base_offset + length - 1
    else:
        token_positions = positions.masked_fill(~valid, -1) if valid is not None else positions
        high = int(token_positions.max())
        low = int(positions.masked_fill(~valid, high).min()) if valid is not None else int(positions.min())
    if low < 0:
        raise ValueError(f"positions must be non-negative for MLR attention (blocks are aligned to position 0), "
                         f"got {low}")
    first_depth = 1
    for size in block_sizes:
        if low // size != high // size:
            break
        first_depth += 1
    num_levels = len(ranks)
    if first_depth < num_levels:
        granule = block_sizes[first_depth - 1]
        base = (low // granule) * granule
        canonical_length = -(-(high + 1 - base) // granule) * granule
    else:
        base, canonical_length = low, high + 1 - low

    backend = implementation
    if backend == "auto":
        # neither kernel differentiates the additive bias (T5's learned relative bias): the math path does
        bias_needs_grad = bias is not None and bias.requires_grad
        if q.device.type == "cpu" and not bias_needs_grad:
            backend = "fused"
        elif q.device.type == "cuda" and not bias_needs_grad and _triton_kernel() is not None:
            backend = "triton"
        else:
            backend = "math"
    if backend == "math" and uniform:
        # materialised scores need no canonical padding: partial blocks at the ends are handled directly
        return _math_attention(q, k, v, valid, bias, ranks, block_sizes, first_depth, level_scales, average_levels,
                               causal, start=0 if offsets is None else int(offsets[0]))

    if uniform:
        left = base_offset - base
        right = canonical_length - left - length
        pad = (lambda t: F.pad(t, (0, 0, left, right))) if (left or right) else (lambda t: t)
        q_c, k_c, v_c = pad(q), pad(k), pad(v)
        key_valid = None
        if left or right or valid is not None:
            key_valid = torch.zeros(batch, canonical_length, dtype=torch.bool, device=q.device)
            key_valid[:, left:left + length] = True if valid is None else valid
        bias_c = None
        if bias is not None:
            bias_c = bias if bias.dim() == 4 else bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
            bias_c = bias_c.expand(bias_c.shape[0], bias_c.shape[1], length, length)
            if left or right:
                bias_c = F.pad(bias_c, (left, right, left, right))
    else:
        index = (positions - base).masked_fill(~valid, canonical_length)  # invalid tokens go to a dump slot
        gather_index = index[:, None, :, None]

        def to_canonical(t):
            shape = (batch, t.shape[1], canonical_length + 1, t.shape[-1])
            return t.new_zeros(shape).scatter(2, gather_index.expand_as(t), t)[:, :, :canonical_length]

        q_c, k_c, v_c = to_canonical(q), to_canonical(k), to_canonical(v)
        key_valid = torch.zeros(batch, canonical_length + 1, dtype=torch.bool, device=q.device)
        key_valid.scatter_(1, index, valid)
        key_valid = key_valid[:, :canonical_length]
        bias_c = None
        if bias is not None:
            full_bias = bias if bias.dim() == 4 else bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
            full_bias = full_bias.expand(batch, full_bias.shape[1], length, length)
            rows = full_bias.new_zeros(batch, full_bias.shape[1], canonical_length + 1, length)
            rows = rows.scatter(2, index[:, None, :, None].expand_as(full_bias), full_bias)
            cols = full_bias.new_zeros(batch, full_bias.shape[1], canonical_length + 1, canonical_length + 1)
            bias_c = cols.scatter(3, index[:, None, None, :].expand_as(rows), rows)[
                :, :, :canonical_length, :canonical_length]

    plan = _Plan(ranks, block_sizes, first_depth, canonical_length, causal)
    depths = {group.depth for group in plan.groups}
    scale_vectors = {depth: depth_scale_vector(ranks, level_scales, depth, average_levels, q.dtype, q.device)
                     for depth in depths}

    if backend == "fused":
        if q.device.type != "cpu":
            raise ValueError(f"implementation='fused' needs CPU tensors, got device {q.device}")
        if bias_c is not None and bias_c.requires_grad:
            raise ValueError("implementation='fused' cannot differentiate the bias; use 'math' or 'auto'")
        out_c = _fused_mlr(q_c, k_c, v_c, key_valid, bias_c, plan, scale_vectors, causal)
    elif backend == "triton":
        mlr_attention_triton = _triton_kernel()
        if mlr_attention_triton is None:
            raise ValueError("implementation='triton' needs the triton package")
        # The kernel aligns blocks to index 0; levels shared by every token get blocks covering the whole
        # canonical range (still nested) because the canonical base is only aligned to the finer levels.
        kernel_blocks = [canonical_length * 2 ** (first_depth - level) if level <= first_depth else size
                         for level, size in enumerate(block_sizes, start=2)]
        out_c = mlr_attention_triton(q_c, k_c, v_c, ranks=ranks, block_sizes=kernel_blocks, causal=causal,
                                     level_scales=level_scales, average_levels=average_levels,
                                     key_padding_mask=key_valid, bias=bias_c)
    else:
        out_c = _math_attention(q_c, k_c, v_c, key_valid, bias_c, ranks, block_sizes, first_depth, level_scales,
                                average_levels, causal, start=base)

    if uniform:
        return out_c[:, :, left:left + length] if (left or right) else out_c
    safe_index = index.clamp(max=canonical_length - 1)
    out = out_c.gather(2, safe_index[:, None, :, None].expand(batch, heads, length, out_c.shape[-1]))
    return out.masked_fill(~valid[:, None, :, None], 0.0)
