"""Math backend of exact MLR attention: the T x T scores materialised like eager attention.

Part of the checkpoint payload (only torch imports, flat relative imports); called by ``structattn_mlr.mlr_attention``.
The global dims go in one matmul and finer levels are added on the diagonal blocks, with plain autograd around the
score assembly, so it runs on any device and differentiates an additive bias (T5's learned relative bias).
"""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .structattn_geometry import MLRGeometry
from .structattn_masks import mask_value, softmax_dtype
from .structattn_mlr_levels import depth_scale_vector, depth_weight, level_prefix_widths, shares_level

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


def mlr_attention_math(q, k, v, key_valid, bias, ranks, block_sizes, first_depth, level_scales, average_levels, causal,
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
        scores = scores * depth_weight(depth, average_levels)
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


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` (working dtype) with disallowed entries at the dtype's lowest value
    (finite: a row with nothing allowed gives a uniform, finite result)."""
    return torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)


def _aligned_scores(query: torch.Tensor, keys: torch.Tensor, geometry: MLRGeometry, start: int,
                    work: torch.dtype) -> torch.Tensor:
    """(B, Hk, n, n) scores of queries and keys at the same positions ``start + index`` in every row: level 1 by one
    matmul, each finer level only on its diagonal blocks (``T b_l r_l`` MACs and ``T b_l`` scores where the general
    path below forms ``T^2`` of both), added in place onto strided views of the level-1 scores; the level averaging
    weight is built from the same blocks. Plain autograd ops (vmap and torch.compile trace them)."""
    length, first_rank = query.shape[2], geometry.ranks[0]
    scores = (query[..., :first_rank] @ keys[..., :first_rank].transpose(-1, -2)).to(work)
    depth = torch.ones(length, length, dtype=work, device=query.device) if geometry.average_levels else None
    low = first_rank
    for rank, block in zip(geometry.ranks[1:], geometry.block_sizes):
        level_query, level_keys = query[..., low:low + rank], keys[..., low:low + rank]
        low += rank
        first, full, ranges = _level_blocks(length, start, block)
        if full:
            _block_diagonal(scores, first, full, block).add_(
                (_blocks(level_query, first, full, block) @ _blocks(level_keys, first, full, block).mT).to(work))
            if depth is not None:
                _block_diagonal(depth[None, None], first, full, block).add_(1)
        for a, b in ranges:
            scores[:, :, a:b, a:b].add_((level_query[:, :, a:b] @ level_keys[:, :, a:b].mT).to(work))
            if depth is not None:
                depth[a:b, a:b].add_(1)
    return scores if depth is None else scores * depth_weight(depth, True)


def mlr_attention_full_keys(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                            geometry: MLRGeometry, scales: Sequence[float], query_positions: torch.Tensor,
                            key_positions: torch.Tensor, key_valid: torch.Tensor, causal: bool = True,
                            bias: Optional[torch.Tensor] = None, return_weights: bool = False, dropout: float = 0.0,
                            aligned_start: Optional[int] = None):
    """Materialised MLR attention over full-width keys: what an ordinary transformers cache holds, the attention maps
    of ``"mlr_eager"`` and a traced prefill (the op layer's one materialised MLR).

    query: (B, Hk, n, r) level order; keys: (B, Hk, K, r) level order; values: (B, Hk, K, dv); query_positions
    (B, n); key_positions, key_valid (B, K); bias broadcastable to (B, Hk, n, K); dropout: probability of dropping a
    weight (training); aligned_start: known on the host that the keys are the queries' tokens (K = n) and every
    row's positions are ``aligned_start + index`` (the uncached forward of unpadded rows): the finer levels are then
    formed on their diagonal blocks only. Returns (B, Hk, n, dv) [, probabilities (after dropout)]."""
    work = softmax_dtype(query.dtype)
    query = query * geometry.scale_vector(scales, query.dtype, query.device)
    if aligned_start is not None and geometry.level_rule == "blocks":
        scores = _aligned_scores(query, keys, geometry, aligned_start, work)
    else:
        scores, depth, start = None, None, 0
        for level, rank in enumerate(geometry.ranks):
            level_scores = (query[..., start:start + rank] @ keys[..., start:start + rank].transpose(-1, -2)).to(work)
            start += rank
            if level == 0:
                scores = level_scores
                continue
            size = geometry.block_sizes[level - 1]
            same = shares_level(query_positions, key_positions, size, geometry.level_rule)[:, None]
            scores = scores + level_scores * same
            depth = same.to(work) if depth is None else depth + same
        if depth is not None:
            scores = scores * depth_weight(1 + depth, geometry.average_levels)
    if bias is not None:
        scores = scores + bias.to(work)
    allowed = key_valid[:, None, None, :]
    if causal:
        allowed = allowed & (key_positions[:, None, None, :] <= query_positions[:, None, :, None])
    probabilities = _masked_softmax(scores, allowed)
    if dropout:
        probabilities = F.dropout(probabilities, p=dropout, training=True)
    output = probabilities.to(values.dtype) @ values
    return (output, probabilities) if return_weights else output


