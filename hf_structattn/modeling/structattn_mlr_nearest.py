"""MLR attention under the nearest-keys level rule (``structattn_mlr_levels``: level l >= 2 for keys fewer than
``b_l`` positions away), uncached: the backend ``structattn_mlr.mlr_attention`` hands ``level_rule="nearest"`` to.

The rule depends on position differences only, so no canonical block layout is needed. Queries go in chunks of
``QUERY_CHUNK``: each chunk's level-1 scores over the keys it may see (up to the chunk's end when causal and the rows
are contiguous, else every key) by one matmul, and each finer level's products only over the band of keys within its
size (contiguous rows; else every key), added where the pair shares the level; softmax and values per chunk, with
plain autograd. Memory is O(chunk x T) per head, never T x T.

Inference on CPU (nothing needs a gradient, causal contiguous rows, no bias, levels not averaged) takes the fused
path, ``_fused``: the pairs that share exactly d levels are a band of distances (b_{d+1} <= i - j < b_d), so each
depth is one flash-attention call on its first c_d dims (``aten._scaled_dot_product_flash_attention_for_cpu``, as
the fused block backend calls it): level 1 alone as a causal square shifted by b_2, each finer band as queries in
chunks of ``BAND_CHUNK``, every chunk against its window of keys under a band mask, the chunks batched into one call;
the L pieces are merged by their log-sum-exp. Nothing T x T is materialised. The executable spec of both paths is
``structattn_reference.mlr_attention_reference(..., level_rule="nearest")``.
"""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .structattn_masks import mask_value, softmax_dtype
from .structattn_mlr_levels import depth_scale_vector, depth_weight, level_prefix_widths, pair_depth

QUERY_CHUNK = 256  # queries per chunk: (chunk x T) scores per head live at once
# queries per chunk of a band in the fused path: a chunk computes (chunk - 1) x chunk pairs outside its band and copies
# its window of band + chunk - 1 keys; 64 measured fastest of 64, 128, 256 at T = 2,048 and 8,192 (9 heads of 64 dims,
# blocks 1024, 512, 256, one thread: 1.9x and 1.3x SDPA's time)
BAND_CHUNK = 64
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
        return _fused(q, k, v, ranks, block_sizes, level_scales, valid, min(query_chunk, BAND_CHUNK))
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
    widths = [0] + level_prefix_widths(ranks)
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
    """``mlr_nearest_attention`` of causal contiguous rows without a bias, gradients or averaged levels, on CPU: one
    flash call per depth d over the pairs that share exactly d levels (module docstring), merged by log-sum-exp.
    Same arguments (levels' sizes ``block_sizes``) and result."""
    batch, heads, length, width = q.shape
    value_width = v.shape[-1]
    work = softmax_dtype(q.dtype)
    sizes = list(block_sizes) + [0]  # the pairs of depth d are b_{d+1} <= i - j < b_d (b_{L+1} = 0)
    prefix = level_prefix_widths(ranks)  # c_d: the dims of a depth-d pair
    # the kernel takes equal q / k / v widths; with padding one more dim carries it to the level-1-only call (which
    # takes no mask beside its causal flag): q holds 1 there, a padding key the mask value
    flagged = valid is not None
    padded = max(width, value_width) + flagged
    scaled_q = q * depth_scale_vector(ranks, level_scales, len(ranks), False, q.dtype, q.device)
    flags = {}
    if flagged:
        flags[True] = torch.ones(batch, heads, length, 1, dtype=q.dtype, device=q.device)
        flags[False] = torch.zeros(batch, 1, length, 1, dtype=q.dtype, device=q.device).masked_fill(
            ~valid[:, None, :, None], mask_value(q.dtype)).expand(batch, heads, length, 1)

    def prefixed(x, dims, is_query: bool):
        if dims == padded:
            return x
        parts = [x[..., :dims], x.new_zeros(batch, heads, length, padded - flagged - dims)]
        return torch.cat(parts + ([flags[is_query]] if flagged else []), dim=-1)

    values = v if padded == value_width else torch.cat([v, v.new_zeros(batch, heads, length, padded - value_width)],
                                                       dim=-1)
    out = lse = None
    for depth in range(len(ranks), 0, -1):  # the nearest first: its piece covers every query
        near, far = sizes[depth - 1], sizes[depth - 2] if depth > 1 else None
        if length <= near:  # no pair is that far apart
            continue
        dims = prefix[depth - 1]
        query, key = prefixed(scaled_q, dims, True), prefixed(k, dims, False)
        if far is None or far >= length:  # no upper bound within the prompt: a causal square shifted by ``near``
            first = near
            piece_out, piece_lse = _cpu_flash(query[:, :, near:], key[:, :, :length - near],
                                              values[:, :, :length - near], 0.0, True, scale=1.0)
        else:
            first, (piece_out, piece_lse) = _band(query, key, values, valid, near, far, query_chunk)
        piece_out, piece_lse = piece_out[..., :value_width].to(work), piece_lse.to(work)
        if out is None:
            out, lse = piece_out, piece_lse
            continue
        rows_out, rows_lse = out[:, :, first:], lse[:, :, first:]
        total = torch.logaddexp(rows_lse, piece_lse)
        out = torch.cat([out[:, :, :first], rows_out * (rows_lse - total).exp()[..., None]
                         + piece_out * (piece_lse - total).exp()[..., None]], dim=2)
        lse = torch.cat([lse[:, :, :first], total], dim=2)
    out = out.to(v.dtype)
    return out if valid is None else out.masked_fill(~valid[:, None, :, None], 0.0)


def _band(query, key, values, valid, near: int, far: int, chunk: int) -> tuple:
    """(first query, (out, lse)) of the attention of each query i to the keys j with ``near <= i - j < far``, for the
    queries from ``first`` on (the earlier ones have no such key): queries in chunks of ``chunk`` (at most), each chunk
    against its window of keys, the chunks batched into one masked flash call. query, key, values (B, H, T, E); valid
    (B, T) bool or None; returns out (B, H, T - first, E), lse (B, H, T - first)."""
    batch, heads, length, width = query.shape
    band = far - near
    chunk = max(1, min(chunk, band))
    first = (near // chunk) * chunk  # chunks wholly before any key are skipped
    count = -(-(length - first) // chunk)
    span = chunk + band - 1  # the keys a chunk's queries reach: from first query - far + 1 to last query - near
    lead = far - 1  # the padded keys start far - 1 before position 0: chunk n's window starts at its first query
    tail = max(0, first + count * chunk + band - 1 - lead - length)

    def windows(t):  # (B, H, T, E) -> (B count, H, span, E): each chunk's window of keys
        framed = F.pad(t, (0, 0, lead, tail))[:, :, first:].unfold(2, span, chunk)[:, :, :count]
        return framed.permute(0, 2, 1, 4, 3).reshape(batch * count, heads, span, width)

    queries = F.pad(query[:, :, first:], (0, 0, 0, count * chunk - (length - first)))
    queries = queries.view(batch, heads, count, chunk, width).transpose(1, 2).reshape(batch * count, heads, chunk,
                                                                                       width)
    # query ii of a chunk and window key jj are (ii - jj) + far - 1 apart: in the band when ii <= jj <= ii + band - 1;
    # and the key must exist (not before position 0, not padding)
    rows = torch.arange(chunk, device=query.device)[:, None]
    columns = torch.arange(span, device=query.device)[None, :]
    inside = (columns >= rows) & (columns <= rows + band - 1)
    exists = torch.ones(batch, length, dtype=torch.bool, device=query.device) if valid is None else valid
    exists = F.pad(exists, (lead, tail), value=False)[:, first:].unfold(1, span, chunk)[:, :count]  # (B, count, span)
    allowed = inside & exists.reshape(batch * count, 1, 1, span)
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~allowed, mask_value(query.dtype))
    out, lse = _cpu_flash(queries, windows(key), windows(values), 0.0, False, attn_mask=mask, scale=1.0)
    unfold = lambda t: t.view(batch, count, heads, chunk, *t.shape[3:]).transpose(1, 2).reshape(  # noqa: E731
        batch, heads, count * chunk, *t.shape[3:])[:, :, :length - first]
    return first, (unfold(out), unfold(lse))


__all__ = ["BAND_CHUNK", "QUERY_CHUNK", "mlr_nearest_attention"]
