"""MLR attention under the nearest-keys level rule (``structattn_mlr_levels``: level l >= 2 for keys fewer than
``b_l`` positions away), uncached: the backend ``structattn_mlr.mlr_attention`` hands ``level_rule="nearest"`` to.

The rule depends on position differences only, so no canonical block layout is needed. Queries go in chunks of
``QUERY_CHUNK``: each chunk's level-1 scores over the keys it may see (up to the chunk's end when causal and the rows
are contiguous, else every key) by one matmul, and each finer level's products only over the band of keys within its
size (contiguous rows; else every key), added where the pair shares the level; softmax and values per chunk, with
plain autograd. Memory is O(chunk x T) per head, never T x T. The executable spec is
``structattn_reference.mlr_attention_reference(..., level_rule="nearest")``.
"""

from typing import Optional, Sequence

import torch

from .structattn_masks import mask_value, softmax_dtype
from .structattn_mlr_levels import depth_weight, pair_depth

QUERY_CHUNK = 256  # queries per chunk: (chunk x T) scores per head live at once


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
    device = q.device
    if positions is None:
        positions = torch.arange(length, device=device).expand(batch, length)
    work = softmax_dtype(q.dtype)
    lowest = mask_value(work)
    bounded = causal and contiguous  # a chunk's keys end with the chunk
    full_bias = None if bias is None else bias if bias.dim() == 4 else bias.view((1,) * (4 - bias.dim()) + bias.shape)
    widths = [0]
    for rank in ranks:
        widths.append(widths[-1] + rank)
    outputs = []
    for start in range(0, length, query_chunk):
        end = min(start + query_chunk, length)
        key_end = end if bounded else length
        query_positions, key_positions = positions[:, start:end], positions[:, :key_end]
        depth = pair_depth(query_positions, key_positions, block_sizes, "nearest")[:, None]  # (B, 1, c, S)
        chunk_q = q[:, :, start:end].to(work)
        keys = k[:, :, :key_end].to(work)
        scores = level_scales[0] * (chunk_q[..., :widths[1]] @ keys[..., :widths[1]].mT)
        for level, (size, scale) in enumerate(zip(block_sizes, level_scales[1:]), start=2):
            band = max(0, start - size + 1) if contiguous else 0
            band_end = min(key_end, end + size - 1) if contiguous else key_end
            lo, hi = widths[level - 1], widths[level]
            products = chunk_q[..., lo:hi] @ keys[:, :, band:band_end, lo:hi].mT
            scores.narrow(-1, band, band_end - band).add_(products * (depth[..., band:band_end] >= level),
                                                          alpha=scale)
        if average_levels:
            scores = scores * depth_weight(depth.to(work), True)
        if full_bias is not None:
            chunk_bias = full_bias[..., start:end, :] if full_bias.shape[-2] == length else full_bias
            scores = scores + chunk_bias[..., :key_end].to(work)
        allowed = None
        if causal:
            allowed = key_positions[:, None, None, :] <= query_positions[:, None, :, None]
        if valid is not None:
            keep = valid[:, None, None, :key_end]
            allowed = keep if allowed is None else allowed & keep
        if allowed is not None:
            scores = scores.masked_fill(~allowed, lowest)
        probabilities = torch.softmax(scores, dim=-1).to(v.dtype)
        outputs.append(probabilities @ v[:, :, :key_end])
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return out if valid is None else out.masked_fill(~valid[:, None, :, None], 0.0)


__all__ = ["QUERY_CHUNK", "mlr_nearest_attention"]
