"""Cached MLR attention: new queries against the hierarchical key cache (decode steps and chunks), and against the
full-width keys of an ordinary transformers cache. The op-package side of ``structattn_cache`` (which only stores).

Slot layout (see ``structattn_cache``): position ``p`` of a row lives in slot ``p - base``; ``keys`` hold the
level-1 dims of every slot, ring l holds the level-l dims of position ``p`` at entry ``(p - base) % b_l`` (stored
dim-major in the flat fine storage); a row's real positions are ``[first, last]``. Score of a query at position ``q``
and a key at position ``p``: ``sum over levels l shared by (q, p) of alpha_l <q_l, k_l>`` (optionally divided by the
number of shared levels), the executable spec being ``structattn_reference.mlr_attention_reference``.

* ``mlr_decode_step``: one query position per row (the newest token). Level-1 scores over every slot in one matmul;
  each finer level scores its ring and adds it onto the slots of the query's current level-l block, where slot
  ``s`` holds entry ``s % b_l``. When every row's block starts at the same slot (no padding, or padding that keeps
  rows in step) that is one contiguous ``add_`` per level; while ``torch.compile`` traces, the entry scores are
  tiled over the slot axis and kept on the row's current block (pointwise work with affine indices, which inductor
  fuses with the mask into one pass of vector loads; the matmuls stay library calls); otherwise (eager, rows in
  different blocks) each ring's entry scores are one matmul and all levels are scattered onto their slots at once.
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


def mlr_decode_step(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, fine: torch.Tensor,
                    ring_widths: Sequence[int], geometry: MLRGeometry, scales: Sequence[float],
                    new_positions: torch.Tensor, first_positions: torch.Tensor, base: int, *,
                    bias: Optional[torch.Tensor] = None, return_weights: bool = False, plan: Optional[dict] = None,
                    known_positions: Optional[tuple] = None):
    """MLR attention of the newest token of every row against the hierarchical cache.

    query: (B, Hk, g, r) in level order (g query rows per cached head: the query heads of a grouped-query group);
    keys: (B, Hk, C, r_1) level-1 slots; values: (B, Hk, C, dv); fine: (B, Hk, F) the flat storage of the rings
    (ring l, ``ring_widths[l]`` entries of ``r_l`` dims, after the rings before it: ``F = sum_l W_l r_l``);
    new_positions: (B,) the query position (the newest real position) of each row; first_positions: (B,) the row's
    first real position; base: position of slot 0; bias: additive, broadcastable to (B, Hk, g, C) in slot order.
    Returns (B, Hk, g, dv) in the query dtype, and the probabilities (B, Hk, g, C) when ``return_weights``.

    ``keys`` and ``values`` may be the whole preallocated storage (slots past each row's newest position are
    masked; what a compiled step passes: fixed shapes) or a view narrowed along the slot axis to the slots in use
    (what an eager model step passes: the 3-D matmuls read it in place, and with no padding no mask is needed).

    Finer levels, three formulations of the same sum. When every row's current block starts at the same slot (no
    padding, or padding that keeps rows in step; eager only, decided once per step by the plan) each group of levels
    adds ``q_l @ ring_l^T`` onto that block's slots in place, one small matmul per group (``_shared_start_scores``).
    While ``torch.compile`` traces, each level's entry scores ``q_l @ ring_l^T`` (B, Hk, g, W_l) are tiled over the
    slot axis (slot ``s`` of a block holds entry ``s % b_l``) and kept where the slot is in the row's current block:
    no gather or scatter, so inductor fuses every level and the mask into one pass over the slots with vector loads,
    onto which one ``baddbmm`` adds the level-1 scores (``_compiled_scores``). Otherwise (eager, rows in different
    blocks) each ring's entry scores are one matmul of the level's query dims with its dim-major rows (no index
    table over the storage), and each entry's score is added onto its slot in the row's current block (one
    ``scatter_add_`` of all levels onto the level-1 scores, padded by a coarsest block so that entries past the last
    slot land outside). ``plan``: a dict shared by the layers of one model forward that hold
    the same positions (an empty dict is filled): the index work that depends only on positions is done once.
    ``known_positions``: (the newest position, shared by every row, the rows' latest first position) as host integers
    when the caller read them already (the cache's decode write), so that planning reads nothing back from the
    device."""
    work = softmax_dtype(query.dtype)
    batch, heads, rows, _ = query.shape
    slots = keys.shape[2]
    query = query * geometry.scale_vector(scales, query.dtype, query.device)
    first_rank = geometry.ranks[0]
    plan = {} if plan is None else plan
    if plan.get("work") != work:
        _plan_decode(plan, geometry, ring_widths, new_positions, first_positions, base, slots, work, query.device,
                     known_positions)
    compiling = torch.compiler.is_compiling()
    if compiling:  # every level, and the mask unless average_levels
        scores = _compiled_scores(query, keys, fine, ring_widths, geometry, plan, work)
    elif plan["shared starts"] is not None and query.dtype == work:
        scores = _shared_start_scores(query, keys, fine, plan["shared groups"])
    else:
        scores = (query[..., :first_rank] @ keys.transpose(-1, -2)).to(work)  # (B, Hk, g, C)
    if not compiling and plan["shared starts"] is not None:
        if query.dtype != work:  # low precision: products in the query dtype, accumulated in the working dtype
            offset = 0
            for level_query, rank, width, start in zip(
                    query[..., first_rank:].split(list(geometry.ranks[1:]), dim=-1), geometry.ranks[1:],
                    ring_widths, plan["shared starts"]):
                used = min(width, slots - start)
                if used > 0:
                    ring = fine[..., offset:offset + width * rank].view(batch, heads, rank, width)[..., :used]
                    scores[..., start:start + used].add_((level_query @ ring).to(work))
                offset += width * rank
    elif not compiling and plan["entries"]:
        # each ring's entry scores (B, Hk, g, W_l) by one matmul with its dim-major rows, all levels side by side
        level_scores, offset = [], 0
        for level_query, rank, width in zip(query[..., first_rank:].split(list(geometry.ranks[1:]), dim=-1),
                                            geometry.ranks[1:], ring_widths):
            level_scores.append(level_query @ fine[..., offset:offset + width * rank].view(batch, heads, rank, width))
            offset += width * rank
        entry_scores = torch.cat(level_scores, dim=-1).to(work)  # (B, Hk, g, E)
        padded = F.pad(scores, (0, geometry.block_sizes[0]))
        target = plan["entry slots"][:, None, None, :].expand(batch, heads, rows, plan["entries"])
        scores = padded.scatter_add_(-1, target, entry_scores)[..., :slots]
    if plan["inverse depth"] is not None:
        scores = torch.addcmul(plan["additive mask"], scores, plan["inverse depth"])
    elif plan["additive mask"] is not None and not compiling:
        scores = scores + plan["additive mask"]
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
        kept = torch.where(plan["current block"][:, level], entry_scores[..., :slots], 0.0)
        fine_scores = kept if fine_scores is None else fine_scores + kept
    additive = plan["additive mask"] if plan["inverse depth"] is None else None
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


def _shared_start_scores(query: torch.Tensor, keys: torch.Tensor, fine: torch.Tensor, groups: Sequence[tuple]
                         ) -> torch.Tensor:
    """(B, Hk, g, C) scores when every row's current level-l block starts at the same slot (query already scaled,
    in the working dtype): level 1 by one bmm over every slot, each group of finer levels by one in-place
    ``baddbmm_`` of its query dims (g, dims) and its dim-major ring rows (dims, used entries) onto the block's slots.
    ``groups``: (start slot, used entries, first query dim, dims, storage offset, ring width) from ``_plan_decode``
    (levels whose blocks start at the same slot with rings as wide are one group: their dims are adjacent rows of the
    storage and their entries land on the same slots)."""
    batch, heads, rows, width = query.shape
    slots, first_rank = keys.shape[2], keys.shape[3]
    # every eager op costs microseconds of dispatch, which a decode step of ~7 levels feels: the query is split once,
    # each ring is one strided view, and groups over the same slots share one slice of the scores
    pieces = query.reshape(batch * heads, rows, width).split([first_rank] + [group[3] for group in groups], dim=2)
    scores = torch.bmm(pieces[0], keys.reshape(batch * heads, slots, first_rank).transpose(1, 2))
    fine = fine.reshape(batch * heads, -1)
    row_stride, element_stride = fine.stride()
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


def _plan_decode(plan: dict, geometry: MLRGeometry, ring_widths: Sequence[int], new_positions: torch.Tensor,
                 first_positions: torch.Tensor, base: int, slots: int, work: torch.dtype, device,
                 known_positions: Optional[tuple] = None) -> None:
    """Fill ``plan`` with what a decode step's scores need besides q, k and the storage: the constants of
    ``MLRGeometry.fine_layout`` and

    * "entry slots" (B, E): the slot an entry's score lands on, the slot of its position in the row's current
      level-l block (base is block-aligned, so entry e of ring l sits at the block's first slot + e; a row with no
      real token yet, newest position -1, has every slot masked);
    * "current block" (B, L-1, 1, 1, C), while torch.compile traces: the slot is in the row's current level-l block;
    * "inverse depth" (B, 1, 1, C) or None: 1 / the number of levels a slot shares with the query (average_levels);
    * "shared starts", "shared groups": the block start of each finer level when every row's is the same (eager
      only; None otherwise), and the level groups ``_shared_start_scores`` adds;
    * "additive mask" (B, 1, 1, C): 0 on the row's slots first..newest, the dtype's lowest value elsewhere; None when
      every row holds every slot (an eager step over the slots in use, no padding)."""
    constants = geometry.fine_layout(ring_widths, device)
    plan.update(constants)
    compiling = torch.compiler.is_compiling()
    shared, every_slot_allowed = None, False
    if not compiling and known_positions is not None:  # every row's newest position known on the host: no reads
        newest, latest_first = known_positions
        shared = [max((newest // size) * size - base, 0) for size in geometry.block_sizes]
        every_slot_allowed = latest_first <= base and newest - base >= slots - 1
    elif not compiling and new_positions.numel():
        batch = new_positions.shape[0]
        sizes = constants["sizes"]
        starts = ((new_positions[:, None] // sizes) * sizes - base).clamp(min=0)  # (B, L-1)
        # one host read per step: the rows' block starts, and whether every row holds every slot 0..C-1
        reads = torch.cat([starts.T.reshape(-1),
                           torch.stack([first_positions.max(), new_positions.min()]) - base]).tolist()
        columns = [reads[level * batch:(level + 1) * batch] for level in range(starts.shape[1])]
        if constants["entries"] and all(min(column) == max(column) for column in columns):
            shared = [column[0] for column in columns]
        every_slot_allowed = reads[-2] <= 0 and reads[-1] >= slots - 1
    plan["shared starts"] = shared
    plan["shared groups"] = None if shared is None else _shared_groups(geometry, ring_widths, shared, slots)
    if constants["entries"] and shared is None and not compiling:
        # (B, E): entry e of ring l lands on the first slot of the row's current level-l block + e
        plan["entry slots"] = torch.cat([((new_positions[:, None] // size) * size - base).clamp(min=0) +
                                         torch.arange(width, device=device)
                                         for size, width in zip(geometry.block_sizes, ring_widths)], dim=1)
    slot_index = torch.arange(slots, device=device) if compiling or geometry.average_levels or \
        not every_slot_allowed else None
    if constants["entries"] and compiling:
        # (B, L-1, 1, 1, C): the slot is in the row's current level-l block, as two comparisons with the block's
        # first and past-the-end slots (B, L-1) (a per-slot integer division, which CPUs do not vectorise, cost more
        # than the rest of the fine levels together); the block sizes as Python integers are constants in the graph
        starts = torch.stack([(new_positions // size) * size - base for size in geometry.block_sizes], dim=1)
        ends = starts + torch.tensor(geometry.block_sizes, device=device)
        plan["current block"] = ((slot_index >= starts[..., None]) & (slot_index < ends[..., None]))[
            :, :, None, None, :]
    inverse_depth = None
    if geometry.average_levels:
        sizes = constants["sizes"]
        starts = (new_positions[:, None] // sizes) * sizes - base  # (B, L-1)
        in_block = (slot_index >= starts[..., None]) & (slot_index < (starts + sizes)[..., None])  # (B, L-1, C)
        inverse_depth = (1 + in_block.sum(1)).to(work).reciprocal()[:, None, None, :]
    additive = None
    if not every_slot_allowed or inverse_depth is not None:
        slot_positions = slot_index + base
        allowed = (slot_positions >= first_positions[:, None]) & (slot_positions <= new_positions[:, None])
        additive = torch.zeros(allowed.shape, dtype=work, device=device).masked_fill(~allowed, torch.finfo(work).min)
        additive = additive[:, None, None, :]
    plan.update({"inverse depth": inverse_depth, "additive mask": additive, "work": work})


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
