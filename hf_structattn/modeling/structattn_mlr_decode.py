"""Cached MLR attention: the queries of one forward against the hierarchical key cache (decode steps and chunks), and
against the full-width keys of an ordinary transformers cache. The op-package side of ``structattn_cache`` (which only
stores).

Slot layout (see ``structattn_cache``): position ``p`` of a row lives in slot ``p - base``; ``keys`` hold the
level-1 dims of every slot, ring l holds the level-l dims of position ``p`` at entry ``(p - base) % b_l`` (stored
dim-major in the flat fine storage); a row's real positions are ``[first, last]``. Score of a query at position ``q``
and a key at position ``p``: ``sum over levels l shared by (q, p) of alpha_l <q_l, k_l>`` (optionally divided by the
number of shared levels), the executable spec being ``structattn_reference.mlr_attention_reference``.

``mlr_cached_attention(query, chunk_keys, view, step, geometry, scales, bias)`` is the one op over the cache: it
takes the layer's read-only ``MLRCacheView`` and the forward's ``MLRStep`` and plans (typed, memoised on the step,
so the layers of one geometry share them):

* one new token per row (``mlr_decode_step``, plan ``DecodeReadPlan``): level-1 scores over every slot in one
  matmul; each finer level scores its ring and adds it onto the slots of the query's current level-l block, where
  slot ``s`` holds entry ``s % b_l``. When every row's block starts at the same slot (known on the host from the
  step's facts) that is one in-place ``baddbmm_`` per group of levels; while ``torch.compile`` traces, the entry
  scores are tiled over the slot axis and kept on the row's current block (pointwise work with affine indices, which
  inductor fuses with the mask into one pass of vector loads; the matmuls stay library calls); otherwise (eager,
  rows in different blocks) each ring's entry scores are one matmul and all levels are scattered onto their slots at
  once.
* several new tokens per row (``mlr_cached_chunk``, plan ``ChunkReadPlan``: chunked prefill, speculative
  verification), one pass per level: the scores of the ring entries of the block of each row's newest cached
  position (as written before the chunk: entries the chunk overwrote come from the view's ``replaced``) and of the
  chunk's own keys are added onto their slots with their same-block weights by one ``scatter_add_``.

``mlr_attention_full_keys``: an ordinary cache holding full-width keys in token order (no positions stored): the
cached real tokens are taken as consecutive positions ending just before each row's first new token.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .structattn_geometry import MLRGeometry, softmax_dtype


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` (working dtype) with disallowed entries at the dtype's lowest value
    (finite: a row with nothing allowed gives a uniform, finite result)."""
    return torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)


@dataclass(frozen=True)
class DecodeReadPlan:
    """What a decode step's scores need besides q, k and the storage, for every layer of one geometry in a forward.

    work: the softmax dtype; entries: E = sum_l W_l; shared_groups: when every row's current block of every finer
    level starts at the same slot (eager), the level groups ``_shared_start_scores`` adds, else None; entry_slots:
    (B, E) the slot each ring entry's score lands on (eager, rows in different blocks); current_block:
    (B, L-1, 1, 1, C) whether a slot is in the row's current level-l block (while tracing); inverse_depth:
    (B, 1, 1, C) 1 / the number of levels a slot shares with the query (average_levels) or None; additive_mask:
    (B, 1, 1, C) 0 on the row's slots first..newest and the dtype's lowest value elsewhere, or None when every row
    holds every slot; scaled: the level scales (all equal) are folded into ``inverse_depth``, so the queries are not
    scaled (one op less per layer)."""

    work: torch.dtype
    entries: int
    shared_groups: Optional[tuple]
    entry_slots: Optional[torch.Tensor]
    current_block: Optional[torch.Tensor]
    inverse_depth: Optional[torch.Tensor]
    additive_mask: Optional[torch.Tensor]
    scaled: bool = False


def plan_decode_read(geometry: MLRGeometry, view, slots: int, work: torch.dtype, facts=None,
                     scales: Sequence[float] = ()) -> DecodeReadPlan:
    """The ``DecodeReadPlan`` of a step over ``view`` (an ``MLRCacheView`` whose ``last_positions`` are the query
    positions) read over ``slots`` slots. ``facts``: the step's ``StepFacts`` (eager: block starts and whether every
    row holds every slot are decided from host integers, nothing is read back), or None while tracing; ``scales``:
    the level scales of the layers that read it."""
    device = view.keys.device
    ring_widths, base = view.ring_widths, view.base
    new_positions, first_positions = view.last_positions, view.first_positions
    constants = geometry.fine_layout(ring_widths, device)
    entries = constants["entries"]
    compiling = facts is None
    shared_groups = entry_slots = current_block = inverse_depth = shared_starts = None
    every_slot_allowed = False
    scaled = geometry.average_levels and len(set(scales)) == 1
    if not compiling:
        every_slot_allowed = facts.latest_first <= base and facts.earliest_newest - base >= slots - 1
        if entries and facts.shares_blocks(tuple(geometry.block_sizes)):
            shared_starts = [max((facts.row0_newest // size) * size - base, 0) for size in geometry.block_sizes]
            shared_groups = tuple(_shared_groups(geometry, ring_widths, shared_starts, slots))
        elif entries:
            # (B, E): entry e of ring l lands on the first slot of the row's current level-l block + e
            entry_slots = torch.cat([((new_positions[:, None] // size) * size - base).clamp(min=0) +
                                     torch.arange(width, device=device)
                                     for size, width in zip(geometry.block_sizes, ring_widths)], dim=1)
    slot_index = torch.arange(slots, device=device) if compiling or not every_slot_allowed or \
        (geometry.average_levels and shared_starts is None) else None
    if entries and compiling:
        # (B, L-1, 1, 1, C): the slot is in the row's current level-l block, as two comparisons with the block's
        # first and past-the-end slots (B, L-1) (a per-slot integer division, which CPUs do not vectorise, cost more
        # than the rest of the fine levels together); the block sizes as Python integers are constants in the graph
        starts = torch.stack([(new_positions // size) * size - base for size in geometry.block_sizes], dim=1)
        ends = starts + torch.tensor(geometry.block_sizes, device=device)
        current_block = ((slot_index >= starts[..., None]) & (slot_index < ends[..., None]))[:, :, None, None, :]
    if geometry.average_levels and shared_starts is not None:
        # every row's blocks start at the same slots (host integers): a few in-place adds per forward
        inverse_depth, _ = _shared_inverse_depth(shared_starts, geometry.block_sizes, slots, work,
                                                               device, scales[0] if scaled else 1.0)
    elif geometry.average_levels:
        sizes = constants["sizes"]
        starts = (new_positions[:, None] // sizes) * sizes - base  # (B, L-1)
        in_block = (slot_index >= starts[..., None]) & (slot_index < (starts + sizes)[..., None])  # (B, L-1, C)
        inverse_depth = (1 + in_block.sum(1)).to(work).reciprocal()[:, None, None, :]
        if scaled:  # one multiplier per slot: the shared level scale over the number of shared levels
            inverse_depth = inverse_depth * scales[0]
    additive = None
    if not every_slot_allowed:
        slot_positions = slot_index + base
        allowed = (slot_positions >= first_positions[:, None]) & (slot_positions <= new_positions[:, None])
        additive = torch.zeros(allowed.shape, dtype=work, device=device).masked_fill(~allowed, torch.finfo(work).min)
        additive = additive[:, None, None, :]
    return DecodeReadPlan(work, entries, shared_groups, entry_slots, current_block, inverse_depth, additive, scaled)


_INVERSE_DEPTHS: dict = {}  # (starts, dtype, device, scale) -> (1, 1, 1, S) inverse depths over S >= the slots read


def _shared_inverse_depth(starts: Sequence[int], block_sizes: Sequence[int], slots: int, work: torch.dtype, device,
                          scale: float) -> tuple:
    """``_inverse_depth`` over ``slots`` slots as (1, 1, 1, C) and (1, 1, C) views of a tensor made once per block
    starts (read-only, shared by the steps whose query stays in the same finest blocks: the inverse depths over C
    slots are a prefix of those over more), which saves the decode step's plan a dozen small ops."""
    key = (tuple(starts), work, device, scale)
    full = _INVERSE_DEPTHS.get(key)
    if full is None or full.shape[-1] < slots:
        if len(_INVERSE_DEPTHS) >= 16:
            _INVERSE_DEPTHS.clear()
        # every step until the query leaves its finest block reads a prefix of this span
        span = max(slots, min(start + size for start, size in zip(starts, block_sizes)))
        full = _INVERSE_DEPTHS[key] = _inverse_depth(starts, span, work, device, scale)
    inverse_depth = full.narrow(3, 0, slots)
    return inverse_depth, inverse_depth.view(1, 1, slots)


def _inverse_depth(starts: Sequence[int], span: int, work: torch.dtype, device, scale: float) -> torch.Tensor:
    """(1, 1, 1, span): ``scale`` / the number of levels slot s shares with a query whose finer blocks start at the
    slots ``starts`` (each level's block holds the query, so from its start on)."""
    depth = torch.ones(span, dtype=work, device=device)
    for start in starts:
        depth[start:].add_(1)
    return (scale / depth)[None, None, None, :]


def mlr_decode_step(query: torch.Tensor, view, plan: DecodeReadPlan, geometry: MLRGeometry,
                    scales: Sequence[float], *, bias: Optional[torch.Tensor] = None, return_weights: bool = False):
    """MLR attention of the newest token of every row against the hierarchical cache.

    query: (B, Hk, g, r) in level order (g query rows per cached head: the query heads of a grouped-query group);
    view: the layer's ``MLRCacheView`` (keys (B, Hk, C, r_1), values (B, Hk, C, dv), the flat fine storage
    (B, Hk, F)); plan: the ``DecodeReadPlan`` of C slots; bias: additive, broadcastable to (B, Hk, g, C) in slot
    order. Returns (B, Hk, g, dv) in the query dtype, and the probabilities (B, Hk, g, C) when ``return_weights``.

    ``keys`` and ``values`` are the whole preallocated storage while tracing (slots past each row's newest position
    are masked; fixed shapes) or a view narrowed along the slot axis to the slots in use (an eager step: the 3-D
    matmuls read it in place, and with no padding no mask is needed).

    Finer levels, three formulations of the same sum. When every row's current block starts at the same slot (no
    padding, or padding that keeps rows in step; eager only) each group of levels adds ``q_l @ ring_l^T`` onto that
    block's slots in place, one small matmul per group (``_shared_start_scores``). While ``torch.compile`` traces,
    each level's entry scores (B, Hk, g, W_l) are tiled over the slot axis (slot ``s`` of a block holds entry
    ``s % b_l``) and kept where the slot is in the row's current block: no gather or scatter, so inductor fuses every
    level and the mask into one pass over the slots with vector loads, onto which one ``baddbmm`` adds the level-1
    scores (``_compiled_scores``). Otherwise (eager, rows in different blocks) each ring's entry scores are one
    matmul of the level's query dims with its dim-major rows, and each entry's score is added onto its slot in the
    row's current block (one ``scatter_add_`` of all levels onto the level-1 scores, padded by a coarsest block so
    that entries past the last slot land outside)."""
    keys, values, fine, ring_widths = view.keys, view.values, view.fine, view.ring_widths
    work = plan.work
    batch, heads, rows, _ = query.shape
    slots = keys.shape[2]
    if not plan.scaled:
        query = query * geometry.scale_vector(scales, query.dtype, query.device)
    first_rank = geometry.ranks[0]
    compiling = torch.compiler.is_compiling()
    if compiling:  # every level, and the mask unless average_levels
        scores = _compiled_scores(query, keys, fine, ring_widths, geometry, plan, work)
    elif plan.shared_groups is not None and query.dtype == work:
        scores = _shared_start_scores(query, keys, fine, plan.shared_groups)
    else:
        scores = (query[..., :first_rank] @ keys.transpose(-1, -2)).to(work)  # (B, Hk, g, C)
    if not compiling and plan.shared_groups is not None and query.dtype != work:
        # low precision: products in the query dtype, accumulated in the working dtype
        pieces = query.split([first_rank] + [group[3] for group in plan.shared_groups], dim=-1)
        for (start, used, _, dims, offset, width), level_query in zip(plan.shared_groups, pieces[1:]):
            if used > 0:
                ring = fine[..., offset:offset + width * dims].view(batch, heads, dims, width)[..., :used]
                scores[..., start:start + used].add_((level_query @ ring).to(work))
    elif not compiling and plan.entry_slots is not None:
        # each ring's entry scores (B, Hk, g, W_l) by one matmul with its dim-major rows, all levels side by side
        level_scores, offset = [], 0
        for level_query, rank, width in zip(query[..., first_rank:].split(list(geometry.ranks[1:]), dim=-1),
                                            geometry.ranks[1:], ring_widths):
            level_scores.append(level_query @ fine[..., offset:offset + width * rank].view(batch, heads, rank, width))
            offset += width * rank
        entry_scores = torch.cat(level_scores, dim=-1).to(work)  # (B, Hk, g, E)
        padded = F.pad(scores, (0, geometry.block_sizes[0]))
        target = plan.entry_slots[:, None, None, :].expand(batch, heads, rows, plan.entries)
        scores = padded.scatter_add_(-1, target, entry_scores)[..., :slots]
    if plan.inverse_depth is not None and plan.additive_mask is not None:
        scores = torch.addcmul(plan.additive_mask, scores, plan.inverse_depth)
    elif plan.inverse_depth is not None:
        scores = scores * plan.inverse_depth
    elif plan.additive_mask is not None and not compiling:
        scores = scores + plan.additive_mask
    if bias is not None:
        scores = scores + bias.to(work)
    probabilities = torch.softmax(scores, dim=-1)
    # 3-D bmm: a 4-D matmul adds a handful of expand / reshape calls per layer, which an eager step pays for
    weights = probabilities.to(values.dtype).reshape(batch * heads, rows, slots)
    values = values.reshape(batch * heads, slots, values.shape[-1])
    if compiling:
        # inductor lowers a CPU bmm with one query row to its own multiply-and-sum loop (it assumes such a product is
        # memory bound), which walks the values 8 columns at a time, all C slots per pass: slower than the BLAS
        # product at long contexts; a baddbmm onto zeros stays one library call
        output = torch.baddbmm(weights.new_zeros(batch * heads, rows, values.shape[-1]), weights, values)
    else:
        output = torch.bmm(weights, values)
    output = output.view(batch, heads, rows, -1)
    return (output, probabilities) if return_weights else output


def _compiled_scores(query: torch.Tensor, keys: torch.Tensor, fine: torch.Tensor, ring_widths: Sequence[int],
                     geometry: MLRGeometry, plan: dict, work: torch.dtype) -> torch.Tensor:
    """(B, Hk, g, C) scores of a compiled step in the working dtype (query already scaled), the additive mask
    included unless ``average_levels`` (which divides the scores first): the finer levels' scores and the mask as one
    pointwise tensor over the slots, then the level-1 product added onto it (in the query's dtype: by one ``baddbmm``,
    a library matmul; inductor would lower a one-row ``bmm`` to a slower loop of its own, see the values product in
    ``mlr_decode_step``).

    Finer levels: each level's entry scores ``q_l @ ring_l^T`` (B, Hk, g, W_l) are tiled over the slot axis (slot
    ``s`` of a block holds entry ``s % b_l``; an expand and a reshape, affine indices that inductor turns into vector
    loads) and kept where the slot is in the row's current block: no gather or scatter (a gather made inductor load
    ring entries one scalar at a time), every level fuses into one pass over the slots."""
    batch, heads, rows, _ = query.shape
    slots, first_rank = keys.shape[2], geometry.ranks[0]
    fine_scores, offset = None, 0
    for level, (level_query, rank, width, size) in enumerate(zip(
            query[..., first_rank:].split(list(geometry.ranks[1:]), dim=-1), geometry.ranks[1:], ring_widths,
            geometry.block_sizes)):
        ring = fine[..., offset:offset + width * rank].view(batch, heads, rank, width)
        offset += width * rank
        entry_scores = (level_query @ ring).to(work)  # (B, Hk, g, W_l)
        if size <= slots:  # W_l = b_l: one copy of the entries per block
            tiles = -(-slots // size)
            entry_scores = entry_scores[..., None, :].expand(batch, heads, rows, tiles, size).reshape(
                batch, heads, rows, tiles * size)
        kept = torch.where(plan.current_block[:, level], entry_scores[..., :slots], 0.0)
        fine_scores = kept if fine_scores is None else fine_scores + kept
    additive = plan.additive_mask if plan.inverse_depth is None else None
    if additive is not None:
        fine_scores = additive.expand(batch, heads, rows, slots) if fine_scores is None else fine_scores + additive
    first_query = query[..., :first_rank].reshape(batch * heads, rows, first_rank)
    first_keys = keys.reshape(batch * heads, slots, first_rank).transpose(1, 2)
    if query.dtype != work:  # low precision: the product in the query dtype, accumulated in the working dtype
        first_scores = torch.bmm(first_query, first_keys).to(work).view(batch, heads, rows, slots)
        return first_scores if fine_scores is None else fine_scores + first_scores
    if fine_scores is None:
        fine_scores = query.new_zeros(batch, heads, rows, slots)
    return torch.baddbmm(fine_scores.reshape(batch * heads, rows, slots), first_query, first_keys).view(
        batch, heads, rows, slots)


def _shared_start_scores(query: torch.Tensor, keys: torch.Tensor, fine: torch.Tensor,
                         groups: Sequence[tuple]) -> torch.Tensor:
    """(B, Hk, g, C) scores when every row's current level-l block starts at the same slot (query already scaled,
    in the working dtype): level 1 by one bmm over every slot, each group of finer levels by one in-place
    ``baddbmm_`` of its query dims (g, dims) and its dim-major ring rows (dims, used entries) onto the block's slots.
    ``groups``: (start slot, used entries, first query dim, dims, storage offset, ring width) from ``_plan_decode``
    (levels whose blocks start at the same slot with rings as wide are one group: their dims are adjacent rows of the
    storage and their entries land on the same slots)."""
    batch, heads, rows, width = query.shape
    slots, first_rank = keys.shape[2], keys.shape[3]
    split_sizes = [first_rank] + [group[3] for group in groups]
    # every eager op costs microseconds of dispatch, which a decode step of ~7 levels feels: the query is split once,
    # each ring is one strided view, and groups over the same slots share one slice of the scores
    pieces = query.reshape(batch * heads, rows, width).split_with_sizes(split_sizes, dim=2)
    key_strides = keys.stride()
    if key_strides[0] == heads * key_strides[1]:  # (B Hk, r_1, C) as one strided view of the (narrowed) storage
        keys_t = keys.as_strided((batch * heads, first_rank, slots), (key_strides[1], key_strides[3], key_strides[2]),
                                 keys.storage_offset())
    else:
        keys_t = keys.reshape(batch * heads, slots, first_rank).transpose(1, 2)
    scores = torch.bmm(pieces[0], keys_t)
    if fine.stride(0) != heads * fine.stride(1):
        fine = fine.reshape(batch * heads, -1)
    row_stride, element_stride = fine.stride(-2), fine.stride(-1)
    storage_offset = fine.storage_offset()
    targets = {}
    for (start, used, dim, dims, offset, ring_width), level_query in zip(groups, pieces[1:]):
        ring = fine.as_strided((batch * heads, dims, used), (row_stride, ring_width * element_stride, element_stride),
                               storage_offset + offset * element_stride)
        target = targets.get((start, used))
        if target is None:
            target = targets[start, used] = scores.narrow(2, start, used)
        target.baddbmm_(level_query, ring)
    return scores.view(batch, heads, rows, slots)


def _shared_groups(geometry: MLRGeometry, ring_widths: Sequence[int], starts: Sequence[int], slots: int) -> list:
    """The finer levels of a step whose rows share block starts, as ``_shared_start_scores`` scores them: (start
    slot, used entries, first query dim, dims, storage offset, ring width) per group of consecutive levels with the
    same start and ring width, in level order (together they cover every fine dim once)."""
    groups = []  # [start, width, first query dim, dims, storage offset]
    offset, dim = 0, geometry.ranks[0]
    for rank, width, start in zip(geometry.ranks[1:], ring_widths, starts):
        if groups and groups[-1][0] == start and groups[-1][1] == width:
            groups[-1][3] += rank
        else:
            groups.append([start, width, dim, rank, offset])
        offset += width * rank
        dim += rank
    return [(min(start, slots), max(0, min(width, slots - start)), dim, dims, offset, width)
            for start, width, dim, dims, offset in groups]


@dataclass(frozen=True)
class ChunkReadPlan:
    """What a chunk's scores need besides q, k and the storage (positions only), for every layer of one geometry in a
    forward. The finer levels' key sources, in the order ``mlr_cached_chunk`` concatenates their scores: every
    level's ring entries (the block of each row's newest cached position, as written before the chunk: entries the
    chunk overwrote are left to the next source), then per level the values the chunk's writes replaced and the
    chunk's own keys. target: (B, E) the slot of each source; weight: (B, 1, n, E) 1 where a source is held and
    shares the query's block at its level; depth: (B, 1, n, C) the number of levels a pair shares (average_levels)
    or None; additive_mask: (B, 1, n, C) the causal mask over held slots."""

    work: torch.dtype
    target: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    depth: Optional[torch.Tensor]
    additive_mask: torch.Tensor


def plan_chunk_read(geometry: MLRGeometry, view, positions: torch.Tensor, valid: torch.Tensor, groups: int,
                    slots: int, work: torch.dtype) -> ChunkReadPlan:
    """The ``ChunkReadPlan`` of a chunk of c tokens (positions, valid (B, c)) read by g = ``groups`` query rows per
    token (n = g c, group-major) over ``slots`` slots of ``view``."""
    device = positions.device
    base, last_before, first = view.base, view.last_before, view.first_positions
    query_positions = positions.repeat(1, groups)  # (B, n)
    target = weight = depth = None
    if geometry.block_sizes:
        # every level at once (a handful of ops per forward instead of a dozen per level): per source s its level's
        # block size and, for a ring entry, its index in the ring (constants of the geometry)
        chunk = positions.shape[1]
        ring_size, ring_entry, level_size, source_size = _chunk_read_constants(geometry, view.ring_widths, chunk,
                                                                               device)
        newest_new = torch.where(valid, positions, -1).amax(-1)  # (B,)
        last, oldest = last_before[:, None], first[:, None]
        # ring entries of the block of the newest cached position, as written before the chunk: an entry the chunk
        # overwrote (a position one block on, up to the chunk's newest) is left to what the chunk's write replaced
        entry_positions = (last // ring_size) * ring_size + ring_entry  # (B, sum W_l)
        ring_held = (last >= 0) & (entry_positions <= last) & (entry_positions >= oldest) & \
            (entry_positions + ring_size > newest_new[:, None])
        # what each new token's write replaced: the position one block earlier, when it was cached in that block
        earlier = positions[:, None, :] - level_size  # (B, L-1, c)
        replaced = valid[:, None, :] & (earlier >= (last[:, :, None] // level_size) * level_size) & \
            (earlier <= last[:, :, None]) & (earlier >= oldest[:, :, None])
        batch, levels = earlier.shape[:2]
        pair_positions = torch.cat([earlier, positions[:, None, :].expand(batch, levels, chunk)], dim=2)
        pair_held = torch.cat([replaced, valid[:, None, :].expand(batch, levels, chunk)], dim=2)
        key_positions = torch.cat([entry_positions, pair_positions.reshape(batch, -1)], dim=1)  # (B, E)
        key_held = torch.cat([ring_held, pair_held.reshape(batch, -1)], dim=1)
        target = (key_positions - base).clamp(min=0, max=slots - 1)
        weight = (key_held[:, None, :] & (query_positions[:, :, None] // source_size ==
                                          key_positions[:, None, :] // source_size))[:, None].to(work)
        if geometry.average_levels:
            depth = torch.ones(positions.shape[0], 1, query_positions.shape[1], slots, dtype=work, device=device)
            depth.scatter_add_(-1, target[:, None, None, :].expand(*weight.shape), weight)
    slot_positions = torch.arange(slots, device=device) + base
    allowed = (slot_positions >= first[:, None, None]) & (slot_positions <= query_positions[:, :, None])
    additive = torch.zeros(allowed.shape, dtype=work, device=device).masked_fill(~allowed, torch.finfo(work).min)
    return ChunkReadPlan(work, target, weight, depth, additive[:, None])


def _chunk_read_constants(geometry: MLRGeometry, ring_widths: Sequence[int], chunk: int, device) -> tuple:
    """What ``plan_chunk_read`` indexes by source (memoised per geometry): (sum W_l,) each ring entry's block size
    and index in its ring; (L-1, 1) the block sizes; (E,) the block size of every source in plan order (the ring
    entries level by level, then per level the c replaced and the c new keys)."""
    def make():
        sizes = geometry.block_sizes
        ring_size = [size for size, width in zip(sizes, ring_widths) for _ in range(width)]
        ring_entry = [entry for width in ring_widths for entry in range(width)]
        source_size = ring_size + [size for size in sizes for _ in range(2 * chunk)]
        return (torch.tensor(ring_size, dtype=torch.long, device=device),
                torch.tensor(ring_entry, dtype=torch.long, device=device),
                torch.tensor(sizes, dtype=torch.long, device=device)[:, None],
                torch.tensor(source_size, dtype=torch.long, device=device))
    return geometry.tensors.get(("chunk read", tuple(ring_widths), chunk, device), make)


def mlr_cached_chunk(query: torch.Tensor, chunk_keys: torch.Tensor, view, plan: ChunkReadPlan,
                     geometry: MLRGeometry, scales: Sequence[float], *, bias: Optional[torch.Tensor] = None,
                     return_weights: bool = False):
    """Causal MLR attention of n query rows per cached head against every slot, after a chunk of c tokens was
    written.

    query: (B, Hk, n, r) level order (n = g * c for g query heads per cached head, group-major); chunk_keys:
    (B, Hk, c, r) full-width level order; view: the layer's ``MLRCacheView`` after the chunk (``replaced``: the ring
    entries the chunk's writes replaced); plan: its ``ChunkReadPlan``; bias: broadcastable to (B, Hk, n, C) in slot
    order. Returns (B, Hk, n, dv) [, probabilities (B, Hk, n, C)].

    One pass for all finer levels: each level's ring entries and its replaced and new keys scored by one matmul each,
    the scores side by side, weighted by the plan and added onto their slots by one ``scatter_add_``."""
    work = plan.work
    keys, values, fine = view.keys, view.values, view.fine
    batch, heads, rows, width = query.shape
    slots = keys.shape[2]
    flat = batch * heads
    # 3-D products throughout: a 4-D matmul costs a handful of expand / view calls each, which the ~2L matmuls of a
    # layer would pay for
    query = (query * geometry.scale_vector(scales, query.dtype, query.device)).reshape(flat, rows, width)
    level_queries = query.split(list(geometry.ranks), dim=-1)
    first_rank = geometry.ranks[0]
    scores = torch.bmm(level_queries[0], keys.reshape(flat, slots, first_rank).transpose(1, 2)).to(work)
    if plan.target is not None:
        pair_keys = torch.cat([view.replaced, chunk_keys[..., first_rank:]], dim=2)  # (B, Hk, 2c, F)
        pair_keys = pair_keys.reshape(flat, pair_keys.shape[2], -1).transpose(1, 2)  # (B Hk, F, 2c)
        fine = fine.reshape(flat, -1)
        ring_scores, pair_scores, offset = [], [], 0
        for q_level, keys_level, rank, ring_width in zip(level_queries[1:], pair_keys.split(list(geometry.ranks[1:]), 1),
                                                         geometry.ranks[1:], view.ring_widths):
            ring_scores.append(torch.bmm(q_level, fine[:, offset:offset + ring_width * rank].view(flat, rank,
                                                                                                  ring_width)))
            pair_scores.append(torch.bmm(q_level, keys_level))
            offset += ring_width * rank
        level_scores = torch.cat(ring_scores + pair_scores, dim=-1).to(work).view(batch, heads, rows, -1) * plan.weight
        scores.view(batch, heads, rows, slots).scatter_add_(
            -1, plan.target[:, None, None, :].expand(batch, heads, rows, -1), level_scores)
    scores = scores.view(batch, heads, rows, slots)
    if plan.depth is not None:
        scores = scores / plan.depth
    scores = scores + plan.additive_mask
    if bias is not None:
        scores = scores + bias.to(work)
    probabilities = torch.softmax(scores, dim=-1)
    output = torch.bmm(probabilities.to(values.dtype).reshape(flat, rows, slots),
                       values.reshape(flat, slots, values.shape[-1])).view(batch, heads, rows, -1)
    return (output, probabilities) if return_weights else output


def mlr_cached_attention(query: torch.Tensor, chunk_keys: torch.Tensor, view, step, geometry: MLRGeometry,
                         scales: Sequence[float], *, bias: Optional[torch.Tensor] = None,
                         return_weights: bool = False):
    """The one op over the hierarchical cache: the queries of a chunk of c tokens (c = 1: a decode step) against
    every slot of ``view`` (the layer's ``MLRCacheView`` after the chunk was written).

    query: (B, Hk, n, r) level order, n = g * c rows per cached head (the g query heads of a grouped-query group,
    group-major); chunk_keys: (B, Hk, c, r) level order; step: the forward's ``MLRStep``; bias: additive,
    broadcastable to (B, Hk, n, C) in slot order. Plans are made once per forward and geometry (memoised on the
    step). Returns (B, Hk, n, dv) [, probabilities (B, Hk, n, C) in slot order]."""
    chunk = chunk_keys.shape[2]
    slots = view.keys.shape[2]
    work = softmax_dtype(query.dtype)
    # the geometry object (one per config, alive for the forward) stands for its fields: a cheaper hash
    key = (id(geometry), view.base, slots, view.ring_widths, work)
    if chunk == 1:
        plan = step.memo.get(("decode read",) + key + (scales,))
        if plan is None:
            plan = step.memo[("decode read",) + key + (scales,)] = plan_decode_read(geometry, view, slots, work,
                                                                                   step.facts, tuple(scales))
        return mlr_decode_step(query, view, plan, geometry, scales, bias=bias, return_weights=return_weights)
    groups = query.shape[2] // chunk
    plan = step.memoised(("chunk read", groups) + key, lambda: plan_chunk_read(
        geometry, view, step.positions, step.real(), groups, slots, work))
    return mlr_cached_chunk(query, chunk_keys, view, plan, geometry, scales, bias=bias, return_weights=return_weights)


def mlr_attention_full_keys(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                            geometry: MLRGeometry, scales: Sequence[float], query_positions: torch.Tensor,
                            key_positions: torch.Tensor, key_valid: torch.Tensor, causal: bool = True,
                            bias: Optional[torch.Tensor] = None, return_weights: bool = False, dropout: float = 0.0):
    """Materialised MLR attention over full-width keys: what an ordinary transformers cache holds, the attention maps
    of ``"mlr_eager"`` and a traced prefill (the op layer's one materialised MLR).

    query: (B, Hk, n, r) level order; keys: (B, Hk, K, r) level order; values: (B, Hk, K, dv); query_positions
    (B, n); key_positions, key_valid (B, K); bias broadcastable to (B, Hk, n, K); dropout: probability of dropping a
    weight (training). Returns (B, Hk, n, dv) [, probabilities (after dropout)]."""
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
    if dropout:
        probabilities = F.dropout(probabilities, p=dropout, training=True)
    output = probabilities.to(values.dtype) @ values
    return (output, probabilities) if return_weights else output


__all__ = ["ChunkReadPlan", "DecodeReadPlan", "mlr_attention_full_keys", "mlr_cached_attention", "mlr_cached_chunk",
           "mlr_decode_step", "plan_chunk_read", "plan_decode_read"]
