"""Cached MLR attention: the queries of one forward against the hierarchical key cache, after the cache layer's
``update`` wrote their tokens. One entry, ``mlr_cached_attention(query, view, read)``; three formulations of the same
sum, and the type of the layer's read record (made before the forward's first layer by
``structattn_prepare.prepare_step``, picked by ``structattn_mlr_plan.read_formulation``) says which one runs:

* ``InStepRead`` -- rows in step, the chunk inside one block at every level (``MLRPlan.in_step``: greedy and sampled
  decoding, speculative verification chunks that stay in a block; under the nearest-keys rule one token per row),
  eager, nothing else asked: level-1 scores by one ``bmm`` over a strided view of the whole key storage, each group
  of finer levels by one in-place ``baddbmm_`` of its ring onto its block's slots (after the write a ring holds
  exactly that block's slots up to the newest token; under the nearest-keys rule its last b_l slots, the ring's
  entries in two runs where it wraps),
  the level weights and the mask in one op, softmax, one ``bmm`` with the values. The fewest eager ops.

Every formulation takes q.k in the working dtype (``promote_types(dtype, float32)``), as SDPA accumulates: half
precision converts the read keys and queries first, so that a product past the half range cannot turn into inf.
* ``TracedRead`` -- one token per row while torch.compile / torch.export traces: each level's entry scores are
  tiled over the slot axis (slot ``s`` of a block holds entry ``s % b_l``) and kept where the slot is in the row's
  current block: affine indices and no scatter, which inductor fuses into one pass of vector loads.
* ``GeneralRead`` -- everything else (rows at different positions or padded, chunks that cross a block, a bias, a
  caller's mask, attention maps, gradients, dropout, traced chunks): level-1 scores over every slot, and for all
  finer levels at once the scores of their key sources (ring entries of the block of each row's newest cached
  position, the entries the chunk's writes replaced, the chunk's own keys), weighted by whether they share the
  query's block and added onto their slots by one ``scatter_add_``. The one read of a quantised layer
  (``structattn_cache_quantized``), whose level-1 and value rows it decodes a block of slots at a time.

Per-pair level weights come from ``structattn_mlr_levels`` (through the read records); the executable spec is
``structattn_reference.mlr_attention_reference``, against which every formulation is tested
(tests/test_mlr_cached.py).
"""

from typing import Union

import torch
import torch.nn.functional as F

from .structattn_cache import MLRCacheView
from .structattn_cache_quantized import decoded_products, decoded_weighted_sum
from .structattn_mlr_plan import GeneralRead, InStepRead, TracedRead


def mlr_cached_attention(query: torch.Tensor, view: MLRCacheView, read: Union[InStepRead, GeneralRead, TracedRead],
                         *, return_weights: bool = False, dropout: float = 0.0):
    """MLR attention of a forward's queries against everything ``view``'s layer holds after its write.

    query: (B, Hq, c, r) in level order; view: the layer's ``MLRCacheView`` (what ``update`` returned); read: the
    layer's read record (``view.plan.read``), whose type is the formulation; return_weights: also return the
    probabilities; dropout: probability of dropping a weight (training). The last two are the general read's
    (``read_formulation`` gives eager layers a ``GeneralRead``). Returns the output (B, c, Hq, dv) (contiguous) and
    the probabilities (B, Hk, n, S) in slot order when ``return_weights``, else None (n = g c query rows per cached
    head, group-major)."""
    if torch.is_autocast_enabled(query.device.type):
        # the reads choose their own dtypes (q.k in float32): autocast would cast the products back to its half dtype
        # and hand the in-place accumulations mixed dtypes
        with torch.autocast(query.device.type, enabled=False):
            return mlr_cached_attention(query, view, read, return_weights=return_weights, dropout=dropout)
    batch, q_heads, chunk, width = query.shape
    kind = type(read)
    if kind is InStepRead and not return_weights and not dropout:
        out, weights = _in_step(query, view, read), None
    else:
        kv_heads = view.key_storage.shape[1]
        rows = query.reshape(batch, kv_heads, q_heads // kv_heads * chunk, width)  # group-major: row g c + i
        if kind is TracedRead and not return_weights and not dropout:
            out, weights = _traced(rows, view, read), None
        elif kind is GeneralRead:
            out, weights = _general(rows, view, read, return_weights, dropout)
        else:
            raise ValueError(f"a {kind.__name__} returns no probabilities and drops no weights: a read that does "
                             f"either is planned as a GeneralRead (structattn_mlr_plan.read_formulation)")
    if chunk == 1:  # (B, Hk, g, dv) holds the heads of the one new token in order
        return out.reshape(batch, 1, q_heads, -1), weights
    return out.reshape(batch, q_heads, chunk, -1).transpose(1, 2).contiguous(), weights


def _in_step(query: torch.Tensor, view: MLRCacheView, read: InStepRead) -> torch.Tensor:
    """(B, Hk, g c, dv) from whole (contiguous) storages read through strided views (no narrowing)."""
    keys, values, fine = view.key_storage, view.value_storage, view.fine
    batch, heads, capacity, first_rank = keys.shape
    flat, slots, width = batch * heads, read.slots, values.shape[-1]
    rows = query.shape[1] // heads * query.shape[2]
    if read.query_scale is not None:
        query = query * read.query_scale
    pieces = query.reshape(flat, rows, query.shape[-1]).split_with_sizes(read.query_split, dim=2)
    first_keys = keys.as_strided((flat, first_rank, slots), (capacity * first_rank, 1, first_rank),
                                 keys.storage_offset())
    alphas = read.alphas
    # half precision: q and k in the working dtype before the products (as SDPA accumulates in float32): a q.k past
    # the half-precision range (65504) would be inf, and the softmax NaN, where SDPA and the uncached op stay finite
    low = read.work is not query.dtype
    if low:
        pieces, first_keys = [piece.to(read.work) for piece in pieces], first_keys.to(read.work)
    scores = torch.bmm(pieces[0], first_keys) if alphas is None else \
        torch.baddbmm(read.zero, pieces[0], first_keys, beta=0, alpha=alphas[0])
    elements, fine_offset = fine.shape[-1], fine.storage_offset()
    targets = {}
    for index, (start, used, _, dims, offset, ring_width, piece) in enumerate(read.groups):
        level_query = pieces[piece]
        ring = fine.as_strided((flat, dims, used), (elements, ring_width, 1), fine_offset + offset)
        if low:
            ring = ring.to(read.work)
        target = targets.get((start, used))
        if target is None:  # groups over the same slots share one slice of the scores
            target = targets[start, used] = scores.narrow(2, start, used)
        if alphas is None:  # (an ``alpha`` keyword costs the call its parsing: every group of every layer)
            target.baddbmm_(level_query, ring)
        else:
            target.baddbmm_(level_query, ring, alpha=alphas[index + 1])
    if read.additive is not None:
        tokens = read.additive.shape[-2] if read.additive.dim() == 5 else 1
        shaped = scores.view(batch, heads, rows, slots) if tokens == 1 else \
            scores.view(batch, heads, rows // tokens, tokens, slots)
        shaped = torch.addcmul(read.additive, shaped, read.multiplier) if read.multiplier is not None \
            else shaped + read.additive
        scores = shaped.view(flat, rows, slots)
    elif read.multiplier is not None:
        scores.mul_(read.multiplier)
    values_read = values.as_strided((flat, slots, width), (capacity * width, width, 1), values.storage_offset())
    probabilities = torch.softmax(scores, dim=-1)
    if low:
        probabilities = probabilities.to(values.dtype)
    return torch.bmm(probabilities, values_read).view(batch, heads, rows, width)


def _read_slots(view, slots: int) -> tuple:
    """(keys (B, Hk, S, r_1), values (B, Hk, S, dv)): the slots a read covers (the whole storage while tracing)."""
    keys, values = view.key_storage, view.value_storage
    if slots != keys.shape[2]:
        keys, values = keys.narrow(2, 0, slots), values.narrow(2, 0, slots)
    return keys, values


def _general(rows: torch.Tensor, view: MLRCacheView, read: GeneralRead, return_weights: bool, dropout: float):
    """rows (B, Hk, n, r) -> (B, Hk, n, dv) [, probabilities (B, Hk, n, S)]."""
    work = read.work
    slots = read.additive.shape[-1]
    keys, values = _read_slots(view, slots)
    batch, heads, count, width = rows.shape
    flat = batch * heads
    # 3-D products throughout: a 4-D matmul costs a handful of expand / view calls each
    ranks = read.ranks
    # (q and k in the working dtype before the products, as in ``_in_step``)
    query = (rows.to(work) * read.query_scale).reshape(flat, count, width)
    level_queries = query.split(ranks, dim=-1)
    first_rank = ranks[0]
    codecs = view.codecs
    if codecs is None:
        scores = torch.bmm(level_queries[0], keys.reshape(flat, slots, first_rank).transpose(1, 2).to(work))
    else:  # rows of codes, decoded a block of slots at a time
        scores = decoded_products(level_queries[0], keys.reshape(flat, slots, -1), codecs.keys, work)
    if read.target is not None:
        own_keys = view.chunk_keys[..., first_rank:]
        if view.replaced is not None:
            own_keys = torch.cat([view.replaced.to(own_keys.dtype), own_keys], dim=2)  # (B, Hk, 2c, F)
        own_keys = own_keys.reshape(flat, own_keys.shape[2], -1).transpose(1, 2)  # (B Hk, F, sources)
        fine = view.fine.reshape(flat, -1)
        ring_scores, own_scores, offset = [], [], 0
        for level_query, level_keys, rank, ring_width in zip(level_queries[1:],
                                                             own_keys.split(ranks[1:], 1), ranks[1:],
                                                             read.ring_widths):
            ring = fine[:, offset:offset + ring_width * rank].view(flat, rank, ring_width)
            ring_scores.append(torch.bmm(level_query, ring.to(work)))
            own_scores.append(torch.bmm(level_query, level_keys.to(work)))
            offset += ring_width * rank
        level_scores = torch.cat(ring_scores + own_scores, dim=-1).view(batch, heads, count, -1) * read.weight
        scores.view(batch, heads, count, slots).scatter_add_(
            -1, read.target[:, None, None, :].expand(batch, heads, count, -1), level_scores)
    scores = scores.view(batch, heads, count, slots)
    if read.multiplier is not None:
        scores = scores * read.multiplier
    scores = scores + read.additive
    if read.bias is not None:
        scores = scores + read.bias
    probabilities = torch.softmax(scores, dim=-1)
    if dropout:
        probabilities = F.dropout(probabilities, p=dropout, training=True)
    if codecs is None:
        output = torch.bmm(probabilities.to(values.dtype).reshape(flat, count, slots),
                           values.reshape(flat, slots, values.shape[-1])).view(batch, heads, count, -1)
    else:
        output = decoded_weighted_sum(probabilities.to(codecs.values.dtype).reshape(flat, count, slots),
                                      values.reshape(flat, slots, -1), codecs.values).view(batch, heads, count, -1)
    return output, (probabilities if return_weights else None)


def _traced(rows: torch.Tensor, view: MLRCacheView, read: TracedRead) -> torch.Tensor:
    """rows (B, Hk, g, r), one token per row, traced -> (B, Hk, g, dv)."""
    work, ranks = read.work, read.ranks
    keys, values, fine = view.key_storage, view.value_storage, view.fine
    batch, heads, count, _ = rows.shape
    slots, first_rank = keys.shape[2], ranks[0]
    rows = rows.to(work)  # (q and k in the working dtype before the products, as in ``_in_step``)
    if read.query_scale is not None:
        rows = rows * read.query_scale
    fine_scores, offset = None, 0
    for level, (level_query, rank, width, size) in enumerate(zip(
            rows[..., first_rank:].split(ranks[1:], dim=-1), ranks[1:], read.ring_widths, read.block_sizes)):
        ring = fine[..., offset:offset + width * rank].view(batch, heads, rank, width).to(work)
        offset += width * rank
        entry_scores = level_query @ ring  # (B, Hk, g, W_l)
        if size <= slots:  # W_l = b_l: one copy of the entries per block
            tiles = -(-slots // size)
            entry_scores = entry_scores[..., None, :].expand(batch, heads, count, tiles, size).reshape(
                batch, heads, count, tiles * size)
        kept = torch.where(read.current_block[:, level], entry_scores[..., :slots], 0.0)
        fine_scores = kept if fine_scores is None else fine_scores + kept
    first_query = rows[..., :first_rank].reshape(batch * heads, count, first_rank)
    first_keys = keys.reshape(batch * heads, slots, first_rank).transpose(1, 2).to(work)
    # inductor would lower a one-row ``bmm`` to a slower loop of its own; ``baddbmm`` stays a library call
    base = fine_scores if fine_scores is not None else rows.new_zeros(batch, heads, count, slots)
    scores = torch.baddbmm(base.reshape(batch * heads, count, slots), first_query, first_keys).view(
        batch, heads, count, slots)
    scores = scores * read.multiplier + read.additive if read.multiplier is not None else scores + read.additive
    weights = torch.softmax(scores, dim=-1).to(values.dtype).reshape(batch * heads, count, slots)
    values = values.reshape(batch * heads, slots, values.shape[-1])
    # (a baddbmm onto zeros for the same reason as above)
    output = torch.baddbmm(weights.new_zeros(batch * heads, count, values.shape[-1]), weights, values)
    return output.view(batch, heads, count, -1)


__all__ = ["mlr_cached_attention"]
