"""Cached MLR attention: new queries against the hierarchical key cache (decode steps and chunks), and against the
full-width keys of an ordinary transformers cache. The op-package side of ``structattn_cache`` (which only stores).

Slot layout (see ``structattn_cache``): position ``p`` of a row lives in slot ``p - base``; ``keys`` hold the
level-1 dims of every slot, ring l holds the level-l dims of position ``p`` at entry ``(p - base) % b_l``; a row's
real positions are ``[first, last]``. Score of a query at position ``q`` and a key at position ``p``:
``sum over levels l shared by (q, p) of alpha_l <q_l, k_l>`` (optionally divided by the number of shared levels),
the executable spec being ``structattn_reference.mlr_attention_reference``.

* ``mlr_decode_step``: one query position per row (the newest token). Level-1 scores over every slot in one matmul;
  each finer level scores its ring and adds it onto the slots of the query's current level-l block: slot
  ``s0 + e`` gets entry ``e`` where ``s0`` is the block's first slot. When every row's block starts at the same
  slot (no padding, or padding that keeps rows in step) that is one contiguous ``add_`` per level; otherwise (rows
  in different blocks, and always while ``torch.compile`` traces) the slot axis is viewed as blocks of ``b_l`` and
  the ring scores are broadcast onto the query's block with a one-hot block mask: pointwise work that compiles to
  one fused kernel, with no scatter. Stale entries land on future or empty slots, which are masked.
* ``mlr_cached_chunk``: several new queries per row (chunked prefill, speculative verification): materialised scores
  over every slot; fine-level scores of the rings as they were before the chunk and of the chunk's own keys are
  scattered onto their slots with their same-block weights.
* ``mlr_attention_full_keys``: an ordinary cache holding full-width keys in token order (no positions stored): the
  cached real tokens are taken as consecutive positions ending just before each row's first new token.
"""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .structattn_geometry import MLRGeometry, softmax_dtype


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` (working dtype) with disallowed entries at the dtype's lowest value
    (finite: a row with nothing allowed gives a uniform, finite result)."""
    return torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)


def _decode_block_starts(geometry: MLRGeometry, new_positions: torch.Tensor, base: int) -> list:
    """Per fine level, the (B,) slot where each row's current block starts."""
    return [(new_positions // size) * size - base for size in geometry.block_sizes]


def _shared_block_starts(block_starts: list) -> Optional[list]:
    """The block-start slot of each level when every row has the same one (eager only), else None."""
    if torch.compiler.is_compiling() or not block_starts or block_starts[0].numel() == 0:
        return None
    stacked = torch.stack(block_starts)  # (L-1, B)
    if bool((stacked == stacked[:, :1]).all()):
        return stacked[:, 0].tolist()
    return None


def mlr_decode_step(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rings: Sequence[torch.Tensor],
                    geometry: MLRGeometry, scales: Sequence[float], new_positions: torch.Tensor,
                    first_positions: torch.Tensor, base: int, *, bias: Optional[torch.Tensor] = None,
                    return_weights: bool = False):
    """MLR attention of the newest token of every row against the hierarchical cache.

    query: (B, Hk, g, r) in level order (g query rows per cached head: the query heads of a grouped-query group);
    keys: (B, Hk, C, r_1) level-1 slots; values: (B, Hk, C, dv); rings: per fine level (B, Hk, W_l, r_l);
    new_positions: (B,) the query position (the newest real position) of each row; first_positions: (B,) the row's
    first real position; base: position of slot 0; bias: additive, broadcastable to (B, Hk, g, C) in slot order.
    Returns (B, Hk, g, dv) in the query dtype, and the probabilities (B, Hk, g, C) when ``return_weights``."""
    work = softmax_dtype(query.dtype)
    batch, heads, rows, _ = query.shape
    slots = keys.shape[2]
    query = query * geometry.scale_vector(scales, query.dtype, query.device)
    level_queries = query.split(list(geometry.ranks), dim=-1)
    scores = (level_queries[0] @ keys.transpose(-1, -2)).to(work)  # (B, Hk, g, C)
    block_starts = _decode_block_starts(geometry, new_positions, base)
    shared = _shared_block_starts(block_starts)
    depth = None
    if geometry.average_levels:
        slot_index = torch.arange(slots, device=query.device)
        depth = 1 + sum(((slot_index >= start[:, None]) & (slot_index < start[:, None] + size)).to(work)
                        for start, size in zip(block_starts, geometry.block_sizes))
        depth = depth[:, None, None, :]
    if shared is not None:
        for q_level, ring, start in zip(level_queries[1:], rings, shared):
            used = min(ring.shape[-2], slots - start)
            if used > 0:
                scores[..., start:start + used] += (q_level @ ring.narrow(2, 0, used).transpose(-1, -2)).to(work)
    elif rings:
        coarsest = geometry.block_sizes[0]
        padded = -(-slots // coarsest) * coarsest
        scores = F.pad(scores, (0, padded - slots))
        for q_level, ring, start, size in zip(level_queries[1:], rings, block_starts, geometry.block_sizes):
            ring_scores = (q_level @ ring.transpose(-1, -2)).to(work)  # (B, Hk, g, W_l)
            if ring_scores.shape[-1] < size:
                ring_scores = F.pad(ring_scores, (0, size - ring_scores.shape[-1]))
            blocks = padded // size
            current = (torch.arange(blocks, device=query.device) == (start // size)[:, None]).to(work)  # (B, n)
            scores = (scores.view(batch, heads, rows, blocks, size)
                      + ring_scores[:, :, :, None, :] * current[:, None, None, :, None]).view(batch, heads, rows,
                                                                                             padded)
        scores = scores[..., :slots]
    if depth is not None:
        scores = scores / depth
    if bias is not None:
        scores = scores + bias.to(work)
    slot_positions = torch.arange(slots, device=query.device) + base
    allowed = (slot_positions >= first_positions[:, None]) & (slot_positions <= new_positions[:, None])
    probabilities = _masked_softmax(scores, allowed[:, None, None, :])
    output = probabilities.to(values.dtype) @ values
    return (output, probabilities) if return_weights else output


def mlr_cached_chunk(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     rings_before: Sequence[torch.Tensor], chunk_keys: torch.Tensor, geometry: MLRGeometry,
                     scales: Sequence[float], query_positions: torch.Tensor, chunk_positions: torch.Tensor,
                     chunk_valid: torch.Tensor, last_before: torch.Tensor, first_positions: torch.Tensor,
                     base: int, *, bias: Optional[torch.Tensor] = None, return_weights: bool = False):
    """Causal MLR attention of n query rows per cached head against every slot, after a chunk of c tokens was
    written.

    query: (B, Hk, n, r) level order (n = g * c for g query heads per cached head, group-major); query_positions:
    (B, n); keys, values: (B, Hk, C, r_1 | dv) after the chunk was written; rings_before: per fine level
    (B, Hk, W_l, r_l) as they were before the chunk; chunk_keys: (B, Hk, c, r) full-width level order;
    chunk_positions, chunk_valid: (B, c); last_before: (B,) newest real position before the chunk (-1: none);
    first_positions: (B,) after the chunk; bias: broadcastable to (B, Hk, n, C) in slot order.
    Returns (B, Hk, n, dv) [, probabilities (B, Hk, n, C)]."""
    work = softmax_dtype(query.dtype)
    batch, heads, rows, _ = query.shape
    slots = keys.shape[2]
    query = query * geometry.scale_vector(scales, query.dtype, query.device)
    level_queries = query.split(list(geometry.ranks), dim=-1)
    scores = (level_queries[0] @ keys.transpose(-1, -2)).to(work)  # (B, Hk, n, C)
    depth = torch.ones(batch, 1, rows, slots, dtype=work, device=query.device) if geometry.average_levels else None
    chunk_slots = (chunk_positions - base).clamp(min=0, max=slots - 1)  # (B, c)
    start = geometry.ranks[0]
    for q_level, ring, size in zip(level_queries[1:], rings_before, geometry.block_sizes):
        rank = q_level.shape[-1]
        query_block = query_positions // size  # (B, n)
        targets, weights, level_scores = [], [], []
        if ring is not None:  # entries of the block of the newest cached position, up to that position
            last_block_start = (last_before // size) * size  # (B,)
            entry = torch.arange(ring.shape[-2], device=query.device)
            entry_positions = last_block_start[:, None] + entry  # (B, W)
            held = (last_before[:, None] >= 0) & (entry_positions <= last_before[:, None]) & \
                (entry_positions >= first_positions[:, None])
            targets.append((entry_positions - base).clamp(min=0, max=slots - 1))
            weights.append(held[:, None, :] & (query_block[:, :, None] == (last_block_start // size)[:, None, None]))
            level_scores.append(q_level @ ring.transpose(-1, -2))
        chunk_level = chunk_keys[..., start:start + rank]
        targets.append(chunk_slots)
        weights.append(chunk_valid[:, None, :] & (query_block[:, :, None] == (chunk_positions // size)[:, None, :]))
        level_scores.append(q_level @ chunk_level.transpose(-1, -2))
        target = torch.cat(targets, dim=-1)[:, None, None, :].expand(batch, heads, rows, -1)
        weight = torch.cat(weights, dim=-1)[:, None].to(work)  # (B, 1, n, entries)
        scores.scatter_add_(-1, target, torch.cat(level_scores, dim=-1).to(work) * weight)
        if depth is not None:
            depth.scatter_add_(-1, target[:, :1], weight)
        start += rank
    if depth is not None:
        scores = scores / depth
    if bias is not None:
        scores = scores + bias.to(work)
    slot_positions = torch.arange(slots, device=query.device) + base
    allowed = (slot_positions >= first_positions[:, None, None]) & \
        (slot_positions <= query_positions[:, :, None])  # (B, n, C): written and not in the future
    probabilities = _masked_softmax(scores, allowed[:, None])
    output = probabilities.to(values.dtype) @ values
    return (output, probabilities) if return_weights else output


def mlr_attention_full_keys(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                            geometry: MLRGeometry, scales: Sequence[float], query_positions: torch.Tensor,
                            key_positions: torch.Tensor, key_valid: torch.Tensor, causal: bool = True,
                            bias: Optional[torch.Tensor] = None, return_weights: bool = False):
    """Materialised MLR attention over full-width keys (what an ordinary transformers cache holds).

    query: (B, Hk, n, r) level order; keys: (B, Hk, K, r) level order; values: (B, Hk, K, dv); query_positions
    (B, n); key_positions, key_valid (B, K); bias broadcastable to (B, Hk, n, K). Returns (B, Hk, n, dv)
    [, probabilities]."""
    work = softmax_dtype(query.dtype)
    query = query * geometry.scale_vector(scales, query.dtype, query.device)
    scores, depth, start = None, None, 0
    for level, rank in enumerate(geometry.ranks):
        level_scores = (query[..., start:start + rank] @ keys[..., start:start + rank].transpose(-1, -2)).to(work)
        start += rank
        if level == 0:
            scores = level_scores
            continue
        size = geometry.block_sizes[level - 1]
        same = ((query_positions[:, :, None] // size) == (key_positions[:, None, :] // size))[:, None]
        scores = scores + level_scores * same
        depth = same.to(work) if depth is None else depth + same
    if geometry.average_levels and depth is not None:
        scores = scores / (1 + depth)
    if bias is not None:
        scores = scores + bias.to(work)
    allowed = key_valid[:, None, None, :]
    if causal:
        allowed = allowed & (key_positions[:, None, None, :] <= query_positions[:, None, :, None])
    probabilities = _masked_softmax(scores, allowed)
    output = probabilities.to(values.dtype) @ values
    return (output, probabilities) if return_weights else output


__all__ = ["mlr_attention_full_keys", "mlr_cached_chunk", "mlr_decode_step"]
