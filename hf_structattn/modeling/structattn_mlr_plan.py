"""The plan of one forward for the MLR cache layers of one geometry: where their tokens go and how their queries read.

``mlr_plan(step, geometry)`` makes it once per forward (the first MLR cache layer of that geometry asks; it is kept on
the step, ``MLRStep.plans``) and decides, from the step's host facts alone, which write and which read the forward
takes:

* ``host_write``: every row is in step (every new token real, every row continuing its newest cached position, all
  rows at the same positions) and the chunk is no longer than the finest block, so where each token goes is known
  as host integers: the cache layer writes by narrowed copies and one ``index_copy_`` of the ring elements;
* ``in_step``: besides, the chunk stays inside one block at every level, so that after the write every ring holds
  exactly the slots of that block up to the newest token: ``structattn_mlr_cached``'s in-step read applies;
* ``traced``: torch.compile / torch.export traces (no host facts): fixed shapes, nothing read back.

What depends on a layer's storage (its ``base``, capacity and ring widths, the dtype, the device) is a
``CacheLayout``, made once per forward for every layer of that storage shape (``MLRPlan.layout``, a bounded memo on
the plan); what a read needs (per formulation, query groups and level scales) is made once on the layout
(``CacheLayout.read``). Nothing is kept at module level: two threads decoding two caches share no plan.

Slot layout of the cache (``structattn_cache``): position ``p`` lives in slot ``p - base``; ring l holds the level-l
dims of position ``p`` at entry ``(p - base) % b_l``, stored dim-major in one flat storage
(``MLRGeometry.fine_layout``).
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .structattn_geometry import MLRGeometry, softmax_dtype
from .structattn_mlr_levels import depth_weight
from .structattn_step import NO_POSITION, MLRStep

MAX_LAYOUTS = 4  # storage shapes one plan serves (a model's MLR layers share one; a resize adds another)


def mlr_plan(step: MLRStep, geometry: MLRGeometry) -> "MLRPlan":
    """The step's plan for the MLR cache layers of ``geometry`` (made by the first of them; keyed by the geometry
    object, which a model's layers share and which outlives the step)."""
    plan = step.plans.get(id(geometry))
    if plan is None:
        plan = step.plans[id(geometry)] = MLRPlan(step, geometry)
    return plan


class MLRPlan:
    """One forward's plan for the MLR cache layers of one geometry.

    step: the forward's ``MLRStep``; chunk: c, the new tokens per row; traced: no host facts (torch.compile /
    torch.export); host_write, in_step: see the module docstring; first: the (every row's) position of the chunk's
    first token when ``host_write``; real: (B, c) bool padding flags; last_before, first_before: (B,) the rows' newest
    / first real position before the forward; dim_order: (r,) the head-dim permutation that puts the level slices
    first (patched RoPE decoders), or None; layouts: the ``CacheLayout``s made so far."""

    def __init__(self, step: MLRStep, geometry: MLRGeometry):
        self.step, self.geometry = step, geometry
        facts = step.facts
        self.chunk = chunk = step.positions.shape[1]
        self.traced = facts is None
        newest = None if facts is None else facts.shared_newest
        sizes = geometry.block_sizes
        self.host_write = newest is not None and (not sizes or chunk <= min(sizes))
        self.first = newest - chunk + 1 if self.host_write else None
        self.in_step = self.host_write and all(self.first // size == newest // size for size in sizes)
        self._real = step.valid
        device = step.positions.device
        self.dim_order = geometry.dim_order_index(device)  # (r,) the head-dim permutation to level order, or None
        # the rows' spans before the forward: the step refers to the layers' own positions, which the first write
        # changes, and every later layer's read needs the old ones. A host write moves no row's first position, and
        # every row's newest was ``first - 1`` (made when a read asks); any other write works on copies
        self._last_before = None
        self.first_before = step.first_before
        if not self.host_write:
            self._last_before = None if step.last_before is None else step.last_before.clone()
            self.first_before = None if step.first_before is None else step.first_before.clone()
        self.layouts = {}

    @property
    def real(self) -> torch.Tensor:
        """(B, c) bool padding flags (all True without padding)."""
        if self._real is None:
            self._real = self.step.real()
        return self._real

    @property
    def last_before(self) -> Optional[torch.Tensor]:
        """(B,) the rows' newest real position before the forward."""
        if self._last_before is None and self.host_write:
            self._last_before = torch.full_like(self.first_before, self.first - 1)
        return self._last_before

    def layout(self, layer, key: tuple) -> "CacheLayout":
        """The ``CacheLayout`` of ``layer``'s storage, made and kept under ``key`` = (base, capacity, key dtype,
        the layer records for rollback) in ``layouts`` (which a layer reads first: a layout is made once per
        forward and storage shape)."""
        layout = self.layouts.get(key)
        if layout is None:
            if len(self.layouts) >= MAX_LAYOUTS:
                self.layouts.clear()
            layout = self.layouts[key] = CacheLayout(self, layer, key[2])
        return layout


class CacheLayout:
    """What the writes and reads of one forward need over MLR cache layers of one storage shape.

    base, capacity, ring_widths: of the layers; slots: the slots a read covers (eager: up to the newest position;
    traced: the whole storage); first_slot, fine_index ((c F,), token-major), and for one token key_index ((r_1,))
    and value_index ((dv,)): the host write's first slot and elements of the storages' flat views; chunk_write: the
    general write (``ChunkWrite``, None for a host write); reads: the reads made so far, by (formulation, query rows
    per cached head, level scales)."""

    def __init__(self, plan: MLRPlan, layer, dtype: torch.dtype):
        geometry = plan.geometry
        step = plan.step
        self.plan, self.dtype = plan, dtype
        self.base, self.capacity, self.ring_widths = layer.base, layer.capacity, layer.ring_widths
        self.device = device = layer.fine_storage.device
        facts = step.facts
        self.slots = self.capacity if facts is None else min(max(facts.newest - self.base + 1, 1), self.capacity)
        self.first_slot = self.key_index = self.value_index = self.fine_index = self.chunk_write = None
        if plan.host_write:
            first_slot, chunk = plan.first - self.base, plan.chunk
            self.first_slot = first_slot
            # the elements of the (B, H, 1, ·) flat views of the storages that the chunk's tokens write, token-major:
            # a few ops on small tables of the geometry (the tables do not depend on the slot)
            if chunk == 1:  # (several tokens are written by narrowed copies)
                rank, width = geometry.ranks[0], layer.values_storage().shape[-1]
                self.key_index = _counting(geometry, rank, device) + first_slot * rank
                self.value_index = _counting(geometry, width, device) + first_slot * width
            if geometry.block_sizes:
                fine = geometry.fine_layout(self.ring_widths, device)  # element of dim f: o_f + slot % b_f
                slots = first_slot if chunk == 1 else _counting(geometry, chunk, device)[:, None] + first_slot
                self.fine_index = (torch.remainder(slots, fine["element block"]) +
                                   fine["element offset"]).reshape(-1)
        else:
            self.chunk_write = plan_chunk_write(plan, self.base, self.capacity, self.ring_widths, layer.record_past)
        self.reads = {}

    def read(self, key: tuple):
        """The read plan under ``key`` = (formulation: "in_step", "general" or "traced", query heads per cached head,
        level scales), made once per forward and layout and kept in ``reads`` (which the op reads first)."""
        read = self.reads.get(key)
        if read is None:
            make = {"in_step": plan_in_step_read, "general": plan_general_read, "traced": plan_traced_read}
            read = self.reads[key] = make[key[0]](self, key[1], key[2])
        return read


# ------------------------------------------------------------------------------------------- writes


def _counting(geometry: MLRGeometry, count: int, device) -> torch.Tensor:
    """(count,) 0, 1, ..., count - 1 (in the geometry's bounded memo)."""
    return geometry.tensors.get(("counting", count, device), lambda: torch.arange(count, device=device))


@dataclass(frozen=True)
class ChunkWrite:
    """Where a chunk's tokens go when they are not known on the host (rows at different positions, padding, long
    chunks, tracing), for every MLR layer of one layout (positions only).

    Every token writes: a real token its own key, a padding token the row's newest real token of the chunk again
    (so writes to one slot or entry always agree, whatever order the backend applies them in); a row without a real
    token writes back what the slot holds (``keep``). rows: (B, 1); slot, column: (B, c) the slot each token writes
    and the chunk column whose key / value it writes; fine_element, fine_column: (B, c, F) the same per fine dim (an
    element of the flat ring storage; a ring entry gets the newest real position of the chunk that maps to it);
    own_element: (B, c, F) each token's own ring entries (what it replaces); keep: (B,) rows without a real token
    (None: every row has one); last_after, first_after: (B,) the rows' spans after the chunk; last_before: (B,);
    log_source: (B, c, F) for the rollback log, the chunk column whose earlier write an entry holds just before a
    token's write, or -1 (the entry's value before the chunk)."""

    rows: torch.Tensor
    slot: torch.Tensor
    column: Optional[torch.Tensor]
    fine_element: Optional[torch.Tensor]
    fine_column: Optional[torch.Tensor]
    own_element: Optional[torch.Tensor]
    keep: Optional[torch.Tensor]
    last_after: torch.Tensor
    first_after: torch.Tensor
    last_before: torch.Tensor
    log_source: Optional[torch.Tensor]


def plan_chunk_write(plan: MLRPlan, base: int, capacity: int, ring_widths: tuple, record: bool) -> ChunkWrite:
    """The ``ChunkWrite`` of the plan's chunk for layers with slot ``p - base`` for position ``p``, rings of
    ``ring_widths`` entries and ``capacity`` slots; ``record``: the layers log what they overwrite (rollback)."""
    step, geometry = plan.step, plan.geometry
    positions, valid = step.positions, step.valid
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
    # them afresh)
    last_before, first_before = plan.last_before, plan.first_before
    return ChunkWrite(rows, slot, column, fine_element, fine_column, own_element, keep,
                      torch.maximum(last_before, newest), torch.minimum(first_before, oldest), last_before, log_source)


# ------------------------------------------------------------------------------------------- reads


@dataclass(frozen=True)
class InStepRead:
    """The in-step read (``structattn_mlr_cached._in_step``) of one layout: rows in step, the chunk inside one block
    at every level, eager.

    slots: S, the slots read; query_split: the query dims of level 1 and of each group; groups: per group of
    consecutive finer levels whose blocks start at the same slot with rings as wide (start slot, used entries, first
    query dim, dims, storage offset, ring width); alphas: the scale of the level-1 product and of each group's
    (levels summed, one scale per group), applied by the matmuls, else None; query_scale: (r,) the per-dim level
    scales when neither the matmuls nor the multiplier apply them, else None; multiplier: (1, 1, S) level scale x
    ``depth_weight`` per slot (averaged levels) or None; additive: 0 where a token may attend and the dtype's lowest
    value elsewhere (slots before a row's first position, and after the token when c > 1): (B, 1, 1, S) for one
    token, (B | 1, 1, 1, c, S) for several; None when everything may be attended; zero: a 0-d zero (the ignored
    input of the scaled level-1 product)."""

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
    return tuple((min(start, slots), max(0, min(width, slots - start)), dim, dims, offset, width)
                 for start, width, dim, dims, offset in groups)


def _depth_multiplier(geometry: MLRGeometry, starts: tuple, scale: float, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, 1, span) ``scale * depth_weight`` of every slot up to the end of the finest block of a query whose finer
    blocks start at ``starts`` (each level's block holds the query, so from its start on); every read in that
    block uses a prefix. Kept in the geometry's bounded memo."""
    span = min(start + size for start, size in zip(starts, geometry.block_sizes))

    def make():
        depth = torch.ones(span, dtype=dtype, device=device)
        for start in starts:
            depth[start:].add_(1)
        return (scale * depth_weight(depth, True))[None, None, :]

    return geometry.tensors.get(("depth multiplier", starts, scale, dtype, device), make)


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


def plan_in_step_read(layout: CacheLayout, groups: int, scales: tuple) -> InStepRead:
    plan = layout.plan
    geometry, facts, chunk, dtype, device = plan.geometry, plan.step.facts, plan.chunk, layout.dtype, layout.device
    base, first_slot = layout.base, layout.first_slot
    slots = first_slot + chunk
    newest = plan.first + chunk - 1
    starts = tuple(max((newest // size) * size - base, 0) for size in geometry.block_sizes)
    level_groups = _shared_groups(geometry, layout.ring_widths, starts, slots)
    merged = tuple((group[2], group[3]) for group in level_groups)  # which levels share a product
    alphas, query_scale = geometry.tensors.get(("level scaling", merged, scales, dtype, device),
                                               lambda: _level_scaling(geometry, level_groups, scales, dtype, device))
    multiplier = None
    if geometry.average_levels:
        scale = scales[0] if len(set(scales)) == 1 else 1.0
        multiplier = _depth_multiplier(geometry, starts, scale, dtype, device).narrow(2, 0, slots)
    lowest = torch.finfo(dtype).min
    additive = None
    if facts.latest_first > base:  # a row starts after slot 0 (left padding): its earlier slots are masked
        slot_positions = torch.arange(slots, device=device) + base
        additive = torch.zeros(plan.real.shape[0], 1, 1, slots, dtype=dtype, device=device).masked_fill(
            (slot_positions < plan.first_before[:, None])[:, None, None, :], lowest)
    if chunk > 1:  # token i attends to the slots up to its own
        future = torch.arange(slots, device=device) > torch.arange(first_slot, slots, device=device)[:, None]
        causal = torch.zeros(chunk, slots, dtype=dtype, device=device).masked_fill(future, lowest)
        additive = causal[None, None, None] if additive is None else \
            torch.minimum(additive[:, :, :, None, :], causal[None, None, None])
    zero = geometry.tensors.get(("zero", dtype, device), lambda: torch.zeros((), dtype=dtype, device=device))
    return InStepRead(slots, [geometry.ranks[0]] + [group[3] for group in level_groups], level_groups, alphas,
                      query_scale, multiplier, additive, zero)


@dataclass(frozen=True)
class GeneralRead:
    """The general read (``structattn_mlr_cached._general``) of one layout: any rows, any chunk (eager or traced).
    The finer levels' key sources, in the order their scores are concatenated: every level's ring entries (the block
    of each row's newest cached position, as written before the chunk: entries the chunk overwrote are left to the
    next source), then per level the values the chunk's writes replaced (chunks of several tokens) and the chunk's
    own keys. work: the softmax dtype; target: (B, E) the slot of each source; weight: (B, 1, n, E) 1 where a source
    is held and shares the query's block at its level; multiplier: (B, 1, n, S) ``depth_weight`` of every pair
    (averaged levels) or None; additive: (B, 1, n, S) the causal mask over held slots; n = query rows per cached
    head (group-major: row g c + i)."""

    work: torch.dtype
    target: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    multiplier: Optional[torch.Tensor]
    additive: torch.Tensor


def plan_general_read(layout: CacheLayout, groups: int, scales: tuple) -> GeneralRead:
    plan = layout.plan
    geometry, step, device, slots, base = plan.geometry, plan.step, layout.device, layout.slots, layout.base
    work = softmax_dtype(layout.dtype)
    positions, valid = step.positions, plan.real
    write = layout.chunk_write  # a host write: rows in step, which keep their first position
    last_before, first = (write.last_before, write.first_after) if write is not None else \
        (plan.last_before, plan.first_before)
    query_positions = positions.repeat(1, groups)  # (B, n)
    target = weight = multiplier = None
    if geometry.block_sizes:
        chunk = plan.chunk
        ring_size, ring_entry, level_size, source_size = _general_read_constants(geometry, layout.ring_widths, chunk,
                                                                                 device)
        newest_new = torch.where(valid, positions, -1).amax(-1)  # (B,)
        last, oldest = last_before[:, None], first[:, None]
        # ring entries of the block of the newest cached position, as written before the chunk: an entry the chunk
        # overwrote (a position one block on, up to the chunk's newest) is left to what the chunk's write replaced
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
            replaced = valid[:, None, :] & (earlier >= (last[:, :, None] // level_size) * level_size) & \
                (earlier <= last[:, :, None]) & (earlier >= oldest[:, :, None])
            own_positions = torch.cat([earlier, own_positions], dim=2)
            own_held = torch.cat([replaced, own_held], dim=2)
        key_positions = torch.cat([entry_positions, own_positions.reshape(batch, -1)], dim=1)  # (B, E)
        key_held = torch.cat([ring_held, own_held.reshape(batch, -1)], dim=1)
        target = (key_positions - base).clamp(min=0, max=slots - 1)
        weight = (key_held[:, None, :] & (query_positions[:, :, None] // source_size ==
                                          key_positions[:, None, :] // source_size))[:, None].to(work)
        if geometry.average_levels:
            depth = torch.ones(batch, 1, query_positions.shape[1], slots, dtype=work, device=device)
            depth.scatter_add_(-1, target[:, None, None, :].expand(*weight.shape), weight)
            multiplier = depth_weight(depth, True)
    slot_positions = torch.arange(slots, device=device) + base
    allowed = (slot_positions >= first[:, None, None]) & (slot_positions <= query_positions[:, :, None])
    additive = torch.zeros(allowed.shape, dtype=work, device=device).masked_fill(~allowed, torch.finfo(work).min)
    return GeneralRead(work, target, weight, multiplier, additive[:, None])


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


@dataclass(frozen=True)
class TracedRead:
    """The traced read of one token per row (``structattn_mlr_cached._traced``): work: the softmax dtype;
    current_block: (B, L-1, 1, 1, S) whether a slot is in the row's current level-l block; multiplier: (B, 1, 1, S)
    level scale x ``depth_weight`` per slot (averaged levels) or None; additive: (B, 1, 1, S) 0 on the row's slots
    first..newest, the dtype's lowest value elsewhere; scaled: the (one) level scale is in ``multiplier``."""

    work: torch.dtype
    current_block: Optional[torch.Tensor]
    multiplier: Optional[torch.Tensor]
    additive: torch.Tensor
    scaled: bool


def plan_traced_read(layout: CacheLayout, groups: int, scales: tuple) -> TracedRead:
    plan = layout.plan
    geometry, device, slots, base = plan.geometry, layout.device, layout.slots, layout.base
    work = softmax_dtype(layout.dtype)
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
    return TracedRead(work, current_block, multiplier, additive[:, None, None, :], scaled)


__all__ = ["CacheLayout", "ChunkWrite", "GeneralRead", "InStepRead", "MLRPlan", "TracedRead", "mlr_plan",
           "plan_chunk_write", "plan_general_read", "plan_in_step_read", "plan_traced_read"]
