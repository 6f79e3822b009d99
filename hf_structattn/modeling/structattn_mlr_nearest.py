"""MLR attention under the nearest-keys level rule (``structattn_mlr_levels``: level l >= 2 for keys fewer than
``b_l`` positions away), uncached: the backend ``structattn_mlr.mlr_attention`` hands ``level_rule="nearest"`` to.

The rule depends on position differences only, so no canonical block layout is needed. Queries go in chunks of
``QUERY_CHUNK``: each chunk's level-1 scores over the keys it may see (up to the chunk's end when causal and the rows
are contiguous, else every key) by one matmul, and each finer level's products only over the band of keys within its
size (contiguous rows; else every key), added where the pair shares the level; softmax and values per chunk, with
plain autograd. Memory is O(chunk x T) per head, never T x T.

Inference on CPU (nothing needs a gradient, causal contiguous rows, no bias, levels not averaged) takes the fused
path, ``_fused``: for a chunk of c queries (c at most the finest size and the gaps between sizes) the keys fall into
zones in which every pair of the chunk shares the same levels -- level 1 only far back, levels 1..l between the
sizes, all levels nearest -- each one flash-attention call on its prefix of dims
(``aten._scaled_dot_product_flash_attention_for_cpu``, as the fused block backend calls it), and L - 1 transition
zones of c - 1 keys where a level starts, two masked calls each (the pairs nearer than the level's size, and the
others); the pieces are merged by their log-sum-exp. The executable
spec of both paths is ``structattn_reference.mlr_attention_reference(..., level_rule="nearest")``.
"""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .structattn_masks import mask_value, softmax_dtype
from .structattn_mlr_levels import depth_weight, pair_depth

QUERY_CHUNK = 256  # queries per chunk: (chunk x T) scores per head live at once
_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def mlr_nearest_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ranks: Sequence[int],
                          block_sizes: Sequence[int], level_scales: Sequence[float], causal: bool,
                          positions: Optional[torch.Tensor], valid: Optional[torch.Tensor],
                          bias: Optional[torch.Tensor], average_levels: bool, contiguous: bool,
                          query_chunk: int = QUERY_CHUNK) -> torch.Tensor:
    """Exact MLR attention under the nearest-keys rule.

    q, k: (B, H, T, r) in level order; v: (B, H, T, dv); ranks, block_sizes, level_scales: the geometry's (checked
    by the caller); positions: (B, T) or None (``arange``); valid: (B, T) bool keep-mask or None; bias: additive,
    broadcastable to (B, H, T, T), or None; contiguous: every row's real positions increase by one per index (so a
    causal query sees no key after its own index, and level l's keys lie within ``b_l`` indices). Returns (B, H, T,
    dv) in the inputs' dtype; rows of padding queries are zeros.
    """
    batch, heads, length, _ = q.shape
    if positions is None:
        positions = torch.arange(length, device=q.device).expand(batch, length)
    inference = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    if inference and causal and contiguous and bias is None and q.device.type == "cpu" and not average_levels \
            and block_sizes:
        return _fused(q, k, v, ranks, block_sizes, level_scales, valid, query_chunk)
    full_bias = None if bias is None else bias if bias.dim() == 4 else bias.view((1,) * (4 - bias.dim()) + bias.shape)
    work = softmax_dtype(q.dtype)
    outputs = []
    for start in range(0, length, query_chunk):
        end = min(start + query_chunk, length)
        key_end = end if causal and contiguous else length
        key_start = 0
        chunk_bias = None
        if full_bias is not None:
            chunk_bias = full_bias[..., start:end, :] if full_bias.shape[-2] == length else full_bias
            chunk_bias = chunk_bias[..., key_start:key_end] if chunk_bias.shape[-1] != 1 else chunk_bias
        scores = _scores(q[:, :, start:end], k[:, :, key_start:key_end], positions[:, start:end],
                         positions[:, key_start:key_end], None if valid is None else valid[:, key_start:key_end],
                         ranks, block_sizes, level_scales, causal, contiguous, average_levels, chunk_bias, work)
        outputs.append(torch.softmax(scores, dim=-1).to(v.dtype) @ v[:, :, key_start:key_end])
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return out if valid is None else out.masked_fill(~valid[:, None, :, None], 0.0)


def _scores(chunk_q, keys, query_positions, key_positions, key_valid, ranks, block_sizes, level_scales, causal: bool,
            contiguous: bool, average_levels: bool, bias, work) -> torch.Tensor:
    """(B, H, c, S) masked scores of ``chunk_q`` (B, H, c, r) against ``keys`` (B, H, S, r) at their positions ((B, c),
    (B, S)); key_valid (B, S) or None; bias broadcastable to (B, H, c, S) or None. Level l >= 2's products are formed
    over the keys within ``b_l`` indices of the chunk only when ``contiguous``."""
    widths = [0]
    for rank in ranks:
        widths.append(widths[-1] + rank)
    chunk_q, keys = chunk_q.to(work), keys.to(work)
    depth = pair_depth(query_positions, key_positions, block_sizes, "nearest")[:, None]  # (B, 1, c, S)
    scores = level_scales[0] * (chunk_q[..., :widths[1]] @ keys[..., :widths[1]].mT)
    count, total = chunk_q.shape[2], keys.shape[2]
    # the chunk's queries are the last keys' tokens when contiguous and causal (keys end with the chunk)
    first_query = total - count if causal and contiguous else None
    for level, (size, scale) in enumerate(zip(block_sizes, level_scales[1:]), start=2):
        band, band_end = 0, total
        if contiguous and first_query is not None:
            band = max(0, first_query - size + 1)
        lo, hi = widths[level - 1], widths[level]
        products = chunk_q[..., lo:hi] @ keys[:, :, band:band_end, lo:hi].mT
        scores.narrow(-1, band, band_end - band).add_(products * (depth[..., band:band_end] >= level), alpha=scale)
    if average_levels:
        scores = scores * depth_weight(depth.to(work), True)
    if bias is not None:
        scores = scores + bias.to(work)
    allowed = None
    if causal:
        allowed = key_positions[:, None, None, :] <= query_positions[:, None, :, None]
    if key_valid is not None:
        keep = key_valid[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    return scores if allowed is None else scores.masked_fill(~allowed, mask_value(work))


def _fused(q, k, v, ranks, block_sizes, level_scales, valid, query_chunk: int) -> torch.Tensor:
    """``mlr_nearest_attention`` of causal contiguous rows without a bias, gradients or averaged levels, on CPU: per
    query chunk, flash calls over the zones of constant depth and materialised transition zones, merged by
    log-sum-exp (module docstring). Same arguments (levels' sizes ``block_sizes``) and result."""
    batch, heads, length, width = q.shape
    value_width = v.shape[-1]
    work = softmax_dtype(q.dtype)
    sizes = list(block_sizes)
    gaps = [larger - smaller + 1 for larger, smaller in zip(sizes, sizes[1:])]
    chunk = max(1, min([query_chunk, sizes[-1]] + gaps))
    prefix = [sum(ranks[:depth]) for depth in range(1, len(ranks) + 1)]  # c_d: the dims of a depth-d pair
    scale_of_dim = torch.tensor([scale for scale, rank in zip(level_scales, ranks) for _ in range(rank)],
                                dtype=q.dtype, device=q.device)
    padded = max(width, value_width)  # the kernel takes equal q / k / v widths: the narrower side zero-padded
    scaled_q = q * scale_of_dim
    # per depth d, q and k with the dims past c_d zeroed, once (the chunks' calls slice them)
    queries = [F.pad(scaled_q[..., :dims], (0, padded - dims)) for dims in prefix]
    keys = [F.pad(k[..., :dims], (0, padded - dims)) for dims in prefix]
    values = F.pad(v, (0, padded - value_width))
    masked = None if valid is None else torch.zeros(batch, 1, 1, length, dtype=q.dtype, device=q.device).masked_fill(
        ~valid[:, None, None, :], mask_value(q.dtype))
    positions = torch.arange(length, device=q.device)
    outputs = []
    for a in range(0, length, chunk):
        b = min(a + chunk, length)
        pieces = []  # (out (B, H, c, dv), lse (B, H, c)) in the work dtype

        def flash(lo: int, hi: int, depth: int, nearer_than: Optional[int] = None, farther: bool = False) -> None:
            """Keys lo..hi-1 at the first ``depth`` levels' dims; with ``nearer_than`` only the pairs fewer than that
            many positions apart (causal: 1), or with ``farther`` only the others."""
            lo, hi = max(lo, 0), min(hi, b)
            if hi <= lo:
                return
            query, key = queries[depth - 1][:, :, a:b], keys[depth - 1][:, :, lo:hi]
            mask = None if masked is None else masked[..., lo:hi]
            if nearer_than is not None:
                near = positions[a:b, None] - positions[None, lo:hi] < nearer_than
                kept = ~near if farther else near & (positions[None, lo:hi] <= positions[a:b, None])
                cut = torch.zeros(kept.shape, dtype=q.dtype, device=q.device).masked_fill(~kept, mask_value(q.dtype))
                mask = cut if mask is None else mask + cut
            out, lse = _cpu_flash(query, key, values[:, :, lo:hi], 0.0, False, attn_mask=mask, scale=1.0)
            pieces.append((out[..., :value_width].to(work), lse.to(work)))

        # keys by distance from the chunk (queries a..b-1): depth 1 up to a - b_2, then per level l a transition
        # (a - b_l + 1 .. b - b_l - 1: its pairs fewer than b_l apart at depth l, the others at l - 1) and a zone of
        # depth l (b - b_l .. a - b_{l+1}); the nearest b_L keys of the last query at depth L, causal
        flash(0, a - sizes[0] + 1, 1)
        for level, size in enumerate(sizes, start=2):
            flash(a - size + 1, b - size, level - 1, nearer_than=size, farther=True)
            flash(a - size + 1, b - size, level, nearer_than=size)
            if level <= len(sizes):
                flash(b - size, a - sizes[level - 1] + 1, level)
        flash(b - sizes[-1], b, len(ranks), nearer_than=sizes[-1])
        out, lse = pieces[0]
        for piece_out, piece_lse in pieces[1:]:
            total = torch.logaddexp(lse, piece_lse)
            out = out * (lse - total).exp()[..., None] + piece_out * (piece_lse - total).exp()[..., None]
            lse = total
        outputs.append(out.to(v.dtype))
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return out if valid is None else out.masked_fill(~valid[:, None, :, None], 0.0)


__all__ = ["QUERY_CHUNK", "mlr_nearest_attention"]
