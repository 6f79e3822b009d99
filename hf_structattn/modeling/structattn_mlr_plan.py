"""The plan of one forward for its MLR cache layers: where their tokens go and how their queries read. Made whole by
``structattn_prepare.prepare_step`` before the first layer runs, from the step's host facts alone; nothing in it is
made or changed later (the records are frozen), so a layer's ``update`` only writes by its layout and the attention
function only reads by its read record.

* ``MLRPlan`` (``make_plan``), per geometry: which write and which read the forward takes --

  * ``host_write``: every row is in step (every new token real, every row continuing its newest cached position, all
    rows at the same positions) and the chunk is no longer than the finest block, so where each token goes is known
    as host integers: the cache layer writes by narrowed copies and one ``index_copy_`` of the ring elements;
  * ``in_step``: besides, the chunk stays inside one block at every level, so that after the write every ring holds
    exactly the slots of that block up to the newest token: ``structattn_mlr_cached``'s in-step read applies;
  * ``traced``: torch.compile / torch.export traces (no host facts): fixed shapes, nothing read back.

* ``CacheLayout`` (``make_layout``), per storage shape of that geometry's layers (``base``, capacity, ring widths,
  whether the layers log for rollback): the write's host-known elements or its ``ChunkWrite``, and the slots a read
  covers.
* a read record per layout, query grouping and level scales, whose type is the formulation the cached op runs:
  ``InStepRead``, ``GeneralRead`` or ``TracedRead``; ``read_formulation`` is the one place that picks it.
* ``LayerPlan``, per MLR cache layer: its layout and its read record (None for a layer that held nothing before the
  forward: its chunk attends to itself with the uncached op).

A model's MLR layers share one geometry and one storage shape, so a forward makes one plan, one layout and one read
record, whatever its depth. Nothing is kept at module level: two threads decoding two caches share no plan.

Slot layout of the cache (``structattn_cache``): position ``p`` lives in slot ``p - base``; ring l holds the level-l
dims of position ``p`` at entry ``(p - base) % b_l``, stored dim-major in one flat storage
(``MLRGeometry.fine_layout``).
"""

from typing import NamedTuple, Optional, Sequence, Union

import torch

from .structattn_geometry import MLRGeometry
from .structattn_masks import softmax_dtype
from .structattn_mlr_levels import depth_weight, shares_level
from .structattn_step import NO_POSITION, MLRStep


class MLRPlan(NamedTuple):
    """One forward's plan for the MLR cache layers of one geometry.

    positions: (B, c) the new tokens' MLR positions; valid: (B, c) bool padding flags as the step has them (None:
    no padding was given); real: the same, all True without padding; all_real: known on the host that no new token is padding; chunk: c; traced: no host facts (torch.compile /
    torch.export); held: the layers held tokens before the forward (else each chunk attends to itself); host_write,
    in_step: see the module docstring; first: the (every row's) position of the chunk's first token when
    ``host_write``; newest: the newest real position of any row after the forward (None while traced);
    latest_first: the largest first real position of a row after the forward (None while traced); last_before,
    first_before: (B,) the rows' newest / first real position before the forward (the first written layer's own
    tensors: read only while planning, before any layer writes); dim_order: (r,) the head-dim permutation that puts
    the level slices first (patched RoPE decoders), or None."""

    geometry: MLRGeometry
    positions: torch.Tensor
    valid: Optional[torch.Tensor]
    real: torch.Tensor
    all_real: bool
    chunk: int
    traced: bool
    held: bool
    host_write: bool
    in_step: bool
    first: Optional[int]
    newest: Optional[int]
    latest_first: Optional[int]
    last_before: Optional[torch.Tensor]
    first_before: Optional[torch.Tensor]
    dim_order: Optional[torch.Tensor]


def make_plan(step: MLRStep, geometry: MLRGeometry) -> MLRPlan:
    """The plan of ``step``'s forward for the MLR cache layers of ``geometry``."""
    facts = step.facts
    positions = step.positions
    batch, chunk = positions.shape
    real = step.valid
    if real is None:  # (read-only flags; in the geometry's bounded memo: no op per forward)
        real = geometry.tensors.get(("all real", batch, chunk, positions.device),
                                    lambda: torch.ones(batch, chunk, dtype=torch.bool, device=positions.device))
    newest = None if facts is None else facts.shared_newest
    sizes = geometry.block_sizes
    host_write = newest is not None and (not sizes or chunk <= min(sizes))
    first = newest - chunk + 1 if host_write else None
    # (list comprehensions, not generators, here and below: a generator costs a Python call per item, every forward)
    in_step = host_write and all([first // size == newest // size for size in sizes])
    traced = facts is None
    return MLRPlan(geometry, positions, step.valid, real, not traced and facts.all_real, chunk, traced, traced or facts.held,
                   host_write, in_step, first, None if traced else facts.newest,
                   None if traced else facts.latest_first, step.last_before, step.first_before,
                   geometry.dim_order_index(positions.device))


class ChunkWrite(NamedTuple):
    """Where a chunk's tokens go when they are not known on the host (rows at different positions, padding, long
    chunks, tracing), for every MLR layer of one layout (positions only).

    Every token writes: a real token its own key, a padding token the row's newest real token of the chunk again
    (so writes to one slot or entry always agree, whatever order the backend applies them in); a row without a real
    token writes back what the slot holds (``keep``). rows: (B, 1); slot, column: (B, c) the slot each token writes
    and the chunk column whose key / value it writes; fine_element, fine_column: (B, c, F) the same per fine dim (an
    element of the flat ring storage; a ring entry gets the newest real position of the chunk that maps to it);
    own_element: (B, c, F) each token's own ring entries (what it replaces); keep: (B,) rows without a real token
    (None: every row has one); last_after, first_after: (B,) the rows' spans after the chunk; log_source: (B, c, F)
    for the rollback log, the chunk column whose earlier write an entry holds just before a token's write, or -1
    (the entry's value before the chunk)."""

    rows: torch.Tensor
    slot: torch.Tensor
    column: Optional[torch.Tensor]
    fine_element: Optional[torch.Tensor]
    fine_column: Optional[torch.Tensor]
    own_element: Optional[torch.Tensor]
    keep: Optional[torch.Tensor]
    last_after: torch.Tensor
    first_after: torch.Tensor
    log_source: Optional[torch.Tensor]


class CacheLayout(NamedTuple):
    """What the writes and reads of one forward need over MLR cache layers of one storage shape.

    plan: the geometry's ``MLRPlan``; base, capacity, ring_widths: of the layers after this forward's growth;
    value_width: dv of the allocated storages, or None for layers that the write allocates (their first write, by
    narrowed copies); record: the layers log what they overwrite (rollback); slots: the slots a read covers (eager:
    up to the newest position; traced: the whole storage); newest_slot: the slots in use after the write (host
    facts), else None; first_slot, and for one token into allocated storages key_index ((r_1,)) and value_index
    ((dv,)), and fine_index ((c F,), token-major): the host write's first slot and elements of the storages' flat
    (B, H, 1, ·) views; chunk_write: the general write (``ChunkWrite``, None for a host write); first_after: (B,) the
    rows' first real position after the write."""

    plan: MLRPlan
    base: int
    capacity: int
    ring_widths: tuple
    value_width: Optional[int]
    record: bool
    slots: int
    newest_slot: Optional[int]
    first_slot: Optional[int]
    key_index: Optional[torch.Tensor]
    value_index: Optional[torch.Tensor]
    fine_index: Optional[torch.Tensor]
    chunk_write: Optional[ChunkWrite]
    first_after: Optional[torch.Tensor]


def _counting(geometry: MLRGeometry, count: int, device) -> torch.Tensor:
    """(count,) 0, 1, ..., count - 1 (in the geometry's bounded memo)."""
    return geometry.tensors.get(("counting", count, device), lambda: torch.arange(count, device=device))


def make_layout(plan: MLRPlan, base: int, capacity: int, value_width: Optional[int], record: bool) -> CacheLayout:
    """The ``CacheLayout`` of the plan's layers with slot ``p - base`` for position ``p`` and ``capacity`` slots (what
    this forward's growth left them); value_width: dv of their allocated storages (None: the write allocates);
    record: they log what they overwrite (rollback)."""
    geometry = plan.geometry
    device = plan.positions.device
    ring_widths = tuple([min(size, capacity) for size in geometry.block_sizes])
    if plan.traced:
        slots, newest_slot = capacity, None
    else:
        newest_slot = plan.newest - base + 1
        slots = min(max(newest_slot, 1), capacity)
    first_slot = key_index = value_index = fine_index = chunk_write = None
    first_after = plan.first_before
    if plan.host_write:
        first_slot, chunk = plan.first - base, plan.chunk
        # the elements of the (B, H, 1, ·) flat views of the storages that the chunk's tokens write, token-major: a
        # few ops on small tables of the geometry (the tables do not depend on the slot)
        if chunk == 1 and value_width is not None:  # (several tokens, and a first write, by narrowed copies)
            rank = geometry.ranks[0]
            key_index = _counting(geometry, rank, device) + first_slot * rank
            value_index = _counting(geometry, value_width, device) + first_slot * value_width
        if geometry.block_sizes:
            fine = geometry.fine_layout(ring_widths, device)  # element of dim f: o_f + slot % b_f
            slots_written = first_slot if chunk == 1 else _counting(geometry, chunk, device)[:, None] + first_slot
            fine_index = (torch.remainder(slots_written, fine["element block"]) + fine["element offset"]).reshape(-1)
    else:
        chunk_write = plan_chunk_write(plan, base, capacity, ring_widths, record)
        first_after = chunk_write.first_after
    return CacheLayout(plan, base, capacity, ring_widths, value_width, record, slots, newest_slot, first_slot,
                       key_index, value_index, fine_index, chunk_write, first_after)


def plan_chunk_write(plan: MLRPlan, base: int, capacity: int, ring_widths: tuple, record: bool) -> ChunkWrite:
    """The ``ChunkWrite`` of the plan's chunk for layers with slot ``p - base`` for position ``p``, rings of
    ``ring_widths`` entries and ``capacity`` slots; ``record``: the layers log what they overwrite (rollback)."""
    geometry = plan.geometry
    positions, valid = plan.positions, plan.valid
    batch, chunk = positions.shape
    device = positions.device
    index = torch.arange(chunk, device=device)
    rows = torch.arange(batch, device=device)[:, None]
    if valid is None:
        start, count = positions[:, 0], None
        last_new = positions[:, -1]
        rank = index.expand(batch, chunk)
        writer = positions
        order = None
    else:
        rank = valid.long().cumsum(-1) - 1
        count = valid.long().sum(-1)
        # the chunk column of a row's k-th real token (real positions of a row are consecutive)
        order = torch.argsort(torch.where(valid, index, index + chunk), dim=-1, stable=True)
        start = torch.where(valid, positions - rank, NO_POSITION).amin(-1)
        last_new = start + count - 1
        writer = torch.where(valid, positions, last_new[:, None])

    def column_of(target):
        if order is None:
            return (target - start[:, None]).clamp(min=0, max=chunk - 1)
        return order.gather(-1, (target - start[:, None]).clamp(min=0, max=chunk - 1))

    slot = (writer - base).clamp(min=0, max=capacity - 1)
    column = None if valid is None else column_of(writer)
    fine_element = fine_column = own_element = log_source = None
    if geometry.block_sizes:
        layout = geometry.fine_layout(ring_widths, device)
        dims_block = layout["element block"]  # (F,) b_l of each fine dim
        if chunk == 1 or (valid is None and chunk <= min(geometry.block_sizes)):
            fine_writer = writer[:, :, None]  # no two real tokens of the chunk share an entry
            fine_column = None if column is None else column[:, :, None].expand(batch, chunk, dims_block.shape[0])
        else:
            # a ring entry gets the newest real position of the chunk that maps to it
            fine_writer = writer[:, :, None] + ((last_new[:, None, None] - writer[:, :, None]) // dims_block) * \
                dims_block
            fine_column = column_of(fine_writer.reshape(batch, -1)).view(batch, chunk, -1)
        entry = ((fine_writer - base) % dims_block)
        fine_element = layout["element offset"] + entry.clamp(max=capacity - 1)
        own_entry = ((positions[:, :, None] - base).clamp(min=0) % dims_block).clamp(max=capacity - 1)
        own_element = layout["element offset"] + own_entry
        if record and chunk > min(geometry.block_sizes):  # (shorter chunks never overwrite their own entries)
            # the rollback log keeps, per token, what its entry holds just before its write: the chunk's own real
            # token one block earlier when there is one, else the value before the chunk (-1)
            source_rank = rank[:, :, None] - dims_block
            from_chunk = (source_rank >= 0) if valid is None else (source_rank >= 0) & valid[:, :, None]
            source = column_of((start[:, None, None] + source_rank.clamp(min=0)).reshape(batch, -1)).view(
                batch, chunk, -1)
            log_source = torch.where(from_chunk, source, -1)
    keep = None if valid is None else count == 0
    if valid is None:
        newest, oldest = last_new, start
    else:
        newest = torch.where(count > 0, last_new, -1)
        oldest = torch.where(count > 0, start, NO_POSITION)
    # the rows' spans before the chunk as the step sees them (a traced program fed from position 0 again starts
    # them afresh); the results are new tensors, which the layers copy into their own
    return ChunkWrite(rows, slot, column, fine_element, fine_column, own_element, keep,
                      torch.maximum(plan.last_before, newest), torch.minimum(plan.first_before, oldest), log_source)


# ------------------------------------------------------------------------------------------- reads


READ_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # the dtypes the in-step read takes


def read_formulation(plan: MLRPlan, *, contiguous: bool, dtype: torch.dtype, biased: bool, maps: bool,
                     gradients: bool) -> type:
    """The one place that picks how a cached read is computed: the type of the layer's read record.

    contiguous: the layer's storages are (the in-step read views them with strides of its own); dtype: theirs;
    biased: a bias over the slots is added (T5's relative bias, a caller's 4-D mask); maps: the probabilities are
    returned (``"mlr_eager"``: ``output_attentions``, attention dropout); gradients: grad mode is on (the in-step
    read's products accumulate in place)."""
    blocks = plan.geometry.level_rule == "blocks"
    if plan.traced:  # (the traced read lays the rings out by block)
        return TracedRead if blocks and plan.chunk == 1 and not biased and not maps else GeneralRead
    # nearest keys: one token per row, whose write leaves each ring holding exactly its nearest keys
    in_step = plan.in_step if blocks else plan.host_write and plan.chunk == 1
    if in_step and contiguous and not biased and not maps and not gradients and dtype in READ_DTYPES:
        return InStepRead
    return GeneralRead


class InStepRead(NamedTuple):
    """The in-step read (``structattn_mlr_cached._in_step``) of one layout: rows in step, the chunk inside one block
    at every level, eager.

    work: the softmax dtype, in which the scores are accumulated (half-precision products are added onto float32
    scores); slots: S, the slots read; query_split: the query dims of level 1 and of each query piece after it; groups:
    per group of consecutive finer levels whose blocks start at the same slot with rings as wide, or (nearest-keys
    rule) per run of a level's ring entries over consecutive slots (start slot, used entries, first query dim, dims,
    storage offset of the first entry used, ring width, the index of its query piece); alphas: the scale of the level-1 product and of each group's
    (levels summed, one scale per group), applied by the matmuls, else None; query_scale: (r,) the per-dim level
    scales when neither the matmuls nor the multiplier apply them, else None; multiplier: (1, 1, S) level scale x
    ``depth_weight`` per slot (averaged levels) or None; additive: 0 where a token may attend and the work dtype's
    lowest value elsewhere (slots before a row's first position, and after the token when c > 1): (B, 1, 1, S) for
    one token, (B | 1, 1, 1, c, S) for several; None when everything may be attended; zero: a 0-d zero (the ignored
    input of the scaled level-1 product)."""

    work: torch.dtype
    slots: int
    query_split: list
    groups: tuple
    alphas: Optional[tuple]
    query_scale: Optional[torch.Tensor]
    multiplier: Optional[torch.Tensor]
    additive: Optional[torch.Tensor]
    zero: torch.Tensor


def _shared_groups(geometry: MLRGeometry, ring_widths: Sequence[int], starts: Sequence[int], slots: int) -> tuple:
    """The finer levels of a read whose rows share block starts, as groups of consecutive levels with the same start
    slot and ring width (their dims are adjacent rows of the storage and their entries land on the same slots):
    (start slot, used entries, first query dim, dims, storage offset, ring width), in level order."""
    groups = []  # [start, width, first query dim, dims, storage offset]
    offset, dim = 0, geometry.ranks[0]
    for rank, width, start in zip(geometry.ranks[1:], ring_widths, starts):
        if groups and groups[-1][0] == start and groups[-1][1] == width:
            groups[-1][3] += rank
        else:
            groups.append([start, width, dim, rank, offset])
        offset += width * rank
        dim += rank
    return tuple([(min(start, slots), max(0, min(width, slots - start)), dim, dims, offset, width, piece)
                  for piece, (start, width, dim, dims, offset) in enumerate(groups, start=1)])


def _nearest_groups(geometry: MLRGeometry, ring_widths: Sequence[int], newest_slot: int) -> tuple:
    """The ``InStepRead`` groups of one token at slot ``newest_slot`` under the nearest-keys rule: per finer level, its
    ring holds the slots from ``newest_slot - b_l + 1`` (or 0) on, slot s at entry s % b_l, so one run of entries, or
    two where the ring wraps (the groups' tuple as ``_shared_groups``')."""
    groups, offset, dim = [], 0, geometry.ranks[0]
    for piece, (rank, width, size) in enumerate(zip(geometry.ranks[1:], ring_widths, geometry.block_sizes), start=1):
        first = max(newest_slot - size + 1, 0)
        count, entry = newest_slot + 1 - first, first % size
        head = min(count, width - entry)
        groups.append((first, head, dim, rank, offset + entry, width, piece))
        if count > head:  # the run wraps to the ring's first entry
            groups.append((first + head, count - head, dim, rank, offset, width, piece))
        offset += width * rank
        dim += rank
    return tuple(groups)


def _depth_multiplier(geometry: MLRGeometry, starts: tuple, scale: float, dtype: torch.dtype, device,
                      memoise: bool = True) -> torch.Tensor:
    """(1, 1, span) ``scale * depth_weight`` of every slot up to the end of the finest block of a query whose finer
    levels start at ``starts`` (each level holds the query, so from its start on); every read in that block uses a
    prefix. Kept in the geometry's bounded memo, unless ``memoise`` is False (the nearest-keys rule: its starts move
    with every token, and would push the constant entries out)."""
    span = min(start + size for start, size in zip(starts, geometry.block_sizes))

    def make():
        depth = torch.ones(span, dtype=dtype, device=device)
        for start in starts:
            depth[start:].add_(1)
        return (scale * depth_weight(depth, True))[None, None, :]

    return geometry.tensors.get(("depth multiplier", starts, scale, dtype, device), make) if memoise else make()


def _level_scaling(geometry: MLRGeometry, groups: tuple, scales: Sequence[float], dtype, device) -> tuple:
    """(alphas, query_scale) of ``InStepRead``: the matmuls' scales when every group has one scale (levels summed),
    else the per-dim query scale when the levels' scales differ (else both None: the one scale is in the
    multiplier). (A ``bmm`` and a multiply by the multiplier take less time than the matmuls' own ``beta`` /
    ``alpha`` averaging: ``baddbmm`` with ``beta`` != 1 takes another path.)"""
    shared_scale = geometry.average_levels and len(set(scales)) == 1
    if shared_scale:
        return None, None
    level_of_dim = [level for level, rank in enumerate(geometry.ranks) for _ in range(rank)]
    group_scales = [{scales[level] for level in level_of_dim[group[2]:group[2] + group[3]]} for group in groups]
    if not geometry.average_levels and all(len(group) == 1 for group in group_scales):
        return (float(scales[0]),) + tuple(float(group.pop()) for group in group_scales), None
    return None, geometry.scale_vector(scales, dtype, device)


def plan_in_step_read(layout: CacheLayout, scales: tuple, dtype: torch.dtype) -> InStepRead:
    """The ``InStepRead`` of ``layout`` for level scales ``scales`` over storages of ``dtype``."""
    plan = layout.plan
    geometry, chunk, device = plan.geometry, plan.chunk, plan.positions.device
    work = softmax_dtype(dtype)
    base, first_slot = layout.base, layout.first_slot
    slots = first_slot + chunk
    newest = plan.first + chunk - 1
    nearest = geometry.level_rule == "nearest"
    if nearest:  # one token: each level's keys start b_l - 1 slots before it
        starts = tuple([max(newest - base - size + 1, 0) for size in geometry.block_sizes])
        level_groups = _nearest_groups(geometry, layout.ring_widths, newest - base)
        query_split = list(geometry.ranks)
    else:
        starts = tuple([max((newest // size) * size - base, 0) for size in geometry.block_sizes])
        level_groups = _shared_groups(geometry, layout.ring_widths, starts, slots)
        query_split = [geometry.ranks[0]] + [group[3] for group in level_groups]
    merged = tuple([(group[2], group[3]) for group in level_groups])  # which levels share a product
    alphas, query_scale = geometry.tensors.get(("level scaling", merged, scales, dtype, device),
                                               lambda: _level_scaling(geometry, level_groups, scales, dtype, device))
    multiplier = None
    if geometry.average_levels:
        scale = scales[0] if len(set(scales)) == 1 else 1.0
        multiplier = _depth_multiplier(geometry, starts, scale, work, device, memoise=not nearest).narrow(2, 0, slots)
    lowest = torch.finfo(work).min
    additive = None
    if plan.latest_first > base:  # a row starts after slot 0 (left padding): its earlier slots are masked
        slot_positions = torch.arange(slots, device=device) + base
        additive = torch.zeros(plan.real.shape[0], 1, 1, slots, dtype=work, device=device).masked_fill(
            (slot_positions < layout.first_after[:, None])[:, None, None, :], lowest)
    if chunk > 1:  # token i attends to the slots up to its own
        future = torch.arange(slots, device=device) > torch.arange(first_slot, slots, device=device)[:, None]
        causal = torch.zeros(chunk, slots, dtype=work, device=device).masked_fill(future, lowest)
        additive = causal[None, None, None] if additive is None else \
            torch.minimum(additive[:, :, :, None, :], causal[None, None, None])
    zero = geometry.tensors.get(("zero", work, device), lambda: torch.zeros((), dtype=work, device=device))
    return InStepRead(work, slots, query_split, level_groups, alphas, query_scale, multiplier, additive, zero)


class GeneralRead(NamedTuple):
    """The general read (``structattn_mlr_cached._general``) of one layout and query grouping: any rows, any chunk
    (eager or traced). The finer levels' key sources, in the order their scores are concatenated: every level's ring
    entries (the block of each row's newest cached position, as written before the chunk: entries the chunk
    overwrote are left to the next source), then per level the values the chunk's writes replaced (chunks of
    several tokens) and the chunk's own keys.

    work: the softmax dtype; ranks: the geometry's; ring_widths: the layout's; query_scale: (r,) the per-dim level
    scales, in the storage dtype; target: (B, E) the slot of each source; weight: (B, 1, n, E) 1 where a source is
    held and shares the query's block at its level; multiplier: (B, 1, n, S) ``depth_weight`` of every pair (averaged
    levels) or None; additive: (B, 1, n, S) the causal mask over held slots; bias: (B | 1, Hk | 1, n, S) in the work
    dtype, T5's relative bias and a caller's 4-D mask at the slots, or None; slot_mask: (B, 1 | Hq, c, S) bool, the
    caller's 4-D mask at the slots (what the probabilities are read back through), or None; n = query rows per cached
    head (group-major: row g c + i)."""

    work: torch.dtype
    ranks: tuple
    ring_widths: tuple
    query_scale: torch.Tensor
    target: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    multiplier: Optional[torch.Tensor]
    additive: torch.Tensor
    bias: Optional[torch.Tensor]
    slot_mask: Optional[torch.Tensor]


def plan_general_read(layout: CacheLayout, groups: int, scales: tuple, dtype: torch.dtype,
                      bias: Optional[torch.Tensor] = None, slot_mask: Optional[torch.Tensor] = None) -> GeneralRead:
    """The ``GeneralRead`` of ``layout`` for ``groups`` query rows per cached head and token, level scales
    ``scales`` over storages of ``dtype``; bias, slot_mask: see ``GeneralRead``."""
    plan = layout.plan
    geometry, device, slots, base = plan.geometry, plan.positions.device, layout.slots, layout.base
    work = softmax_dtype(dtype)
    positions, valid = plan.positions, plan.real
    write = layout.chunk_write  # a host write: rows in step, which keep their first position
    last_before = plan.last_before
    first = write.first_after if write is not None else plan.first_before
    query_positions = positions.repeat(1, groups)  # (B, n)
    target = weight = multiplier = None
    if geometry.block_sizes:
        chunk = plan.chunk
        ring_size, ring_entry, level_size, source_size = _general_read_constants(geometry, layout.ring_widths, chunk,
                                                                                 device)
        newest_new = torch.where(valid, positions, -1).amax(-1)  # (B,)
        last, oldest = last_before[:, None], first[:, None]
        nearest = geometry.level_rule == "nearest"
        # ring entries as written before the chunk (blocks: the block of the newest cached position; nearest: the
        # last b_l positions, entry e holding the newest position p <= last with (p - base) % b_l == e): an entry
        # the chunk overwrote (a position one block on, up to the chunk's newest) is left to what the write replaced
        if nearest:
            entry_positions = last - torch.remainder(last - base - ring_entry, ring_size)
        else:
            entry_positions = (last // ring_size) * ring_size + ring_entry  # (B, sum W_l)
        ring_held = (last >= 0) & (entry_positions <= last) & (entry_positions >= oldest) & \
            (entry_positions + ring_size > newest_new[:, None])
        batch, levels = positions.shape[0], level_size.shape[0]
        own_positions = positions[:, None, :].expand(batch, levels, chunk)
        own_held = valid[:, None, :].expand(batch, levels, chunk)
        if chunk > 1:
            # what each new token's write replaced: the position one block earlier, when it was cached in that block
            # (one token's replaced entry is never in its own block: no source)
            earlier = positions[:, None, :] - level_size  # (B, L-1, c)
            in_ring = earlier > last[:, :, None] - level_size if nearest else \
                earlier >= (last[:, :, None] // level_size) * level_size
            replaced = valid[:, None, :] & in_ring & (earlier <= last[:, :, None]) & (earlier >= oldest[:, :, None])
            own_positions = torch.cat([earlier, own_positions], dim=2)
            own_held = torch.cat([replaced, own_held], dim=2)
        key_positions = torch.cat([entry_positions, own_positions.reshape(batch, -1)], dim=1)  # (B, E)
        key_held = torch.cat([ring_held, own_held.reshape(batch, -1)], dim=1)
        target = (key_positions - base).clamp(min=0, max=slots - 1)
        shared = shares_level(query_positions, key_positions, source_size, geometry.level_rule)
        weight = (key_held[:, None, :] & shared)[:, None].to(work)
        if geometry.average_levels:
            depth = torch.ones(batch, 1, query_positions.shape[1], slots, dtype=work, device=device)
            depth.scatter_add_(-1, target[:, None, None, :].expand(*weight.shape), weight)
            multiplier = depth_weight(depth, True)
    slot_positions = torch.arange(slots, device=device) + base
    allowed = (slot_positions >= first[:, None, None]) & (slot_positions <= query_positions[:, :, None])
    additive = torch.zeros(allowed.shape, dtype=work, device=device).masked_fill(~allowed, torch.finfo(work).min)
    return GeneralRead(work, geometry.ranks, layout.ring_widths, geometry.scale_vector(scales, dtype, device),
                       target, weight, multiplier, additive[:, None], None if bias is None else bias.to(work),
                       slot_mask)


def _general_read_constants(geometry: MLRGeometry, ring_widths: Sequence[int], chunk: int, device) -> tuple:
    """What ``plan_general_read`` indexes by source (in the geometry's bounded memo): (sum W_l,) each ring entry's
    block size and index in its ring; (L-1, 1) the block sizes; (E,) the block size of every source in plan order
    (the ring entries level by level, then per level the c replaced (chunks of several tokens) and the c new keys)."""
    def make():
        sizes = geometry.block_sizes
        ring_size = [size for size, width in zip(sizes, ring_widths) for _ in range(width)]
        ring_entry = [entry for width in ring_widths for entry in range(width)]
        per_level = 2 * chunk if chunk > 1 else 1
        source_size = ring_size + [size for size in sizes for _ in range(per_level)]
        return (torch.tensor(ring_size, dtype=torch.long, device=device),
                torch.tensor(ring_entry, dtype=torch.long, device=device),
                torch.tensor(sizes, dtype=torch.long, device=device)[:, None],
                torch.tensor(source_size, dtype=torch.long, device=device))
    return geometry.tensors.get(("general read", tuple(ring_widths), chunk, device), make)


class TracedRead(NamedTuple):
    """The traced read of one token per row (``structattn_mlr_cached._traced``): work: the softmax dtype; ranks,
    block_sizes: the geometry's; ring_widths: the layout's; query_scale: (r,) the per-dim level scales in the storage
    dtype, or None when the (one) level scale is in ``multiplier``; current_block: (B, L-1, 1, 1, S) whether a slot
    is in the row's current level-l block; multiplier: (B, 1, 1, S) level scale x ``depth_weight`` per slot
    (averaged levels) or None; additive: (B, 1, 1, S) 0 on the row's slots first..newest, the dtype's lowest value
    elsewhere."""

    work: torch.dtype
    ranks: tuple
    block_sizes: tuple
    ring_widths: tuple
    query_scale: Optional[torch.Tensor]
    current_block: Optional[torch.Tensor]
    multiplier: Optional[torch.Tensor]
    additive: torch.Tensor


def plan_traced_read(layout: CacheLayout, scales: tuple, dtype: torch.dtype) -> TracedRead:
    """The ``TracedRead`` of ``layout`` for level scales ``scales`` over storages of ``dtype``."""
    plan = layout.plan
    geometry, device, slots, base = plan.geometry, plan.positions.device, layout.slots, layout.base
    work = softmax_dtype(dtype)
    write = layout.chunk_write  # (traced: always the general write) the rows' spans after it
    newest, first = write.last_after, write.first_after
    slot_index = torch.arange(slots, device=device)
    current_block = multiplier = None
    if geometry.block_sizes:
        # two comparisons with the block's first and past-the-end slots (a per-slot integer division, which CPUs do
        # not vectorise, costs more than the rest of the finer levels); the block sizes are graph constants
        starts = torch.stack([(newest // size) * size - base for size in geometry.block_sizes], dim=1)
        ends = starts + torch.tensor(geometry.block_sizes, device=device)
        in_block = (slot_index >= starts[..., None]) & (slot_index < ends[..., None])  # (B, L-1, S)
        current_block = in_block[:, :, None, None, :]
        if geometry.average_levels:
            multiplier = depth_weight((1 + in_block.sum(1)).to(work), True)[:, None, None, :]
    scaled = multiplier is not None and len(set(scales)) == 1
    if scaled:
        multiplier = multiplier * scales[0]
    slot_positions = slot_index + base
    allowed = (slot_positions >= first[:, None]) & (slot_positions <= newest[:, None])
    additive = torch.zeros(allowed.shape, dtype=work, device=device).masked_fill(~allowed, torch.finfo(work).min)
    return TracedRead(work, geometry.ranks, geometry.block_sizes, layout.ring_widths,
                      None if scaled else geometry.scale_vector(scales, dtype, device), current_block, multiplier,
                      additive[:, None, None, :])


class LayerPlan(NamedTuple):
    """What an MLR cache layer writes and reads in this forward (layers of one layout and read share one): layout:
    its ``CacheLayout``; read: its read record, whose type is the formulation (None: the layer held nothing before the
    forward, so its chunk attends to itself with the uncached op); scaling: the attention module's ``scaling`` the
    read's level scales come from (None: 1/sqrt(r))."""

    layout: CacheLayout
    read: Union[InStepRead, GeneralRead, TracedRead, None]
    scaling: Optional[float]


__all__ = ["CacheLayout", "ChunkWrite", "GeneralRead", "InStepRead", "LayerPlan", "MLRPlan", "READ_DTYPES",
           "TracedRead", "make_layout", "make_plan", "plan_chunk_write", "plan_general_read", "plan_in_step_read",
           "plan_traced_read", "read_formulation"]
