"""The eager lane of the hierarchical cache: a forward whose rows are **in step** (every new token real, every row
continuing its newest cached position, all rows at the same positions: ``StepFacts.shared_newest``), which is what
greedy and sampled decoding, and the verification chunks of speculative decoding, run at batch 1 or on unpadded
batches.

There, where each token goes is known on the host, for every layer of a geometry alike: the forward's ``StepLane``
(made once, memoised on the step) holds the slots, the ring elements, the query split, the level groups and the
mask as host integers and small tensors, and a layer's attention is ~20 eager ops: the cache layer writes the chunk
into its storages (``MLRCacheLayerMixin.write_in_step``: ``index_copy_`` into flat views for one token, narrowed
copies and one indexed assignment for several, logging what the write replaces while speculative decoding records),
then ``mlr_lane_attention`` reads strided views of the whole storages: level-1 scores by one ``bmm``, each group of
finer levels by one in-place ``baddbmm_`` onto its block's slots, the inverse depth and the mask in one op, softmax,
one ``bmm`` with the values. The chunk's tokens must share their block at every level (then the rings, after the
write, hold exactly the slots of that block up to the newest token); a chunk that crosses a block boundary is split
there into lanes run one after the other. Everything else (padding inside the chunk, rows at different positions,
half precision, a caller's mask, a bias, gradients, tracing) takes the general path of ``structattn_cache`` /
``structattn_mlr_decode``, against which the lane is tested.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .structattn_cache import MLRStaticKeyCacheLayer
from .structattn_geometry import MLRGeometry, softmax_dtype
from .structattn_mlr_decode import _shared_groups, _shared_inverse_depth


MAX_RUNS = 4  # a chunk split into more runs than this (block boundaries) takes the general path


@dataclass(frozen=True)
class StepLane:
    """A run of c tokens of a forward whose rows are in step, all in the same block at every level, for the layers
    of one geometry, capacity and base.

    capacity, base: of the layers it serves; first_slot: the slot of the first token; tokens: c; slots: S =
    first_slot + c, the slots read; positions: the tokens' positions (every row's); key_split: [r_1, sum_{l>=2} r_l]
    (None without finer levels); key_index (r_1,), value_index (dv,): the elements one token (c = 1) writes in the
    layer's flat (B, H, 1, ·) views of its keys and values; fine_index: (c, sum_{l>=2} r_l) the elements of the flat
    ring storage token i's finer dims go to ((sum_{l>=2} r_l,) when c = 1), or None; query_scale: (r,) the level scales when not folded into
    ``multiplier``, else None; query_split: the query dims of level 1 and of each group of ``groups``
    (``_shared_groups``: levels whose blocks start at the same slot with rings as wide); multiplier: (1, 1, S)
    scale / the number of levels a slot shares with the tokens (average_levels) or None; additive: 0 where a token
    may attend and the dtype's lowest value elsewhere (slots before a row's first position, and after the token
    when c > 1): (B, 1, 1, S) when c = 1, (B | 1, 1, 1, c, S) when c > 1; None when everything may be attended;
    readable: ``mlr_lane_attention`` may read (the softmax runs in the queries' dtype; a half-precision step only
    writes by the lane and is read by the general op); alphas: the scale of the level-1 product and of each group's
    (levels not averaged, one scale per group), applied by the matmuls, else None; zero: a 0-d zero, the ignored
    input of the scaled level-1 product."""

    capacity: int
    base: int
    first_slot: int
    tokens: int
    slots: int
    positions: tuple
    key_split: Optional[list]
    key_index: Optional[torch.Tensor]
    value_index: Optional[torch.Tensor]
    fine_index: Optional[torch.Tensor]
    query_scale: Optional[torch.Tensor]
    query_split: list
    groups: tuple
    multiplier: Optional[torch.Tensor]
    additive: Optional[torch.Tensor]
    readable: bool = True
    alphas: Optional[tuple] = None
    zero: Optional[torch.Tensor] = None


def lane_runs(geometry: MLRGeometry, first: int, tokens: int) -> list:
    """The chunk of ``tokens`` tokens from position ``first`` as runs (first position, length) that each stay in
    one block at every level (split where any level's block ends)."""
    cuts = {first + tokens}
    for size in geometry.block_sizes:
        boundary = (first // size + 1) * size
        while boundary < first + tokens:
            cuts.add(boundary)
            boundary += size
    runs, start = [], first
    for cut in sorted(cuts):
        runs.append((start, cut - start))
        start = cut
    return runs


def plan_step_lanes(geometry: MLRGeometry, step, base: int, capacity: int, ring_widths: tuple, value_width: int,
                    needed: int, dtype: torch.dtype, device, scales: Sequence[float]) -> Optional[tuple]:
    """The ``StepLane``s of an eager forward of c tokens per row (one per run of ``lane_runs``) over layers of
    ``capacity`` slots from position ``base`` (ring widths ``ring_widths``, values ``value_width`` wide, queries and
    storage in ``dtype``), or None when the rows are not in step or the layers must grow first (``needed``: the
    slots they must hold after the write)."""
    facts = step.facts
    if facts is None or facts.shared_newest is None or needed > capacity:
        return None
    tokens = step.positions.shape[1]
    runs = lane_runs(geometry, tokens=tokens, first=facts.shared_newest - tokens + 1)
    if len(runs) > MAX_RUNS:  # a long chunk (chunked prefill): the general chunk op reads it in one pass
        return None
    return tuple(_plan_run(geometry, facts, step.first_before, base, capacity, ring_widths, value_width, dtype,
                           device, scales, start, length) for start, length in runs)


TEMPLATE_SLOTS = 64  # the slots one lane template serves (its index tensors stay a few KiB)


@dataclass(frozen=True)
class _LaneTemplate:
    """What the lanes of up to ``TEMPLATE_SLOTS`` consecutive slots of one finest block share (every level's block
    start is the same for them): made once per window, so that a step's plan is a few views and host integers (and
    the masks of a chunk or of left padding).

    geometry: the geometry it serves (the memo is keyed by its id); lowest, highest: the slots it serves;
    key_range ((highest - lowest) r_1,), value_range ((highest - lowest) dv,): the elements of those slots in the
    flat key / value views, narrowed per slot; fine_rows: (highest - lowest, sum_{l>=2} r_l) the ring elements of
    each slot (None without finer levels); group_meta: per group (start slot, width, first query dim, dims, storage
    offset); multiplier_span: (1, 1, highest) the inverse depths (average_levels) or None; the rest as
    ``StepLane``."""

    geometry: MLRGeometry
    lowest: int
    highest: int
    key_range: torch.Tensor
    value_range: torch.Tensor
    fine_rows: Optional[torch.Tensor]
    group_meta: tuple
    multiplier_span: Optional[torch.Tensor]
    key_split: Optional[list]
    query_scale: Optional[torch.Tensor]
    query_split: list
    alphas: Optional[tuple]
    readable: bool
    zero: torch.Tensor


_LANE_TEMPLATES: dict = {}  # (id(geometry), base, capacity, ring widths, value width, dtype, device, scales,
# block starts, first slot) -> _LaneTemplate; a few windows in flight (one per geometry of a model)


def _template(geometry, base, capacity, ring_widths, value_width, dtype, device, scales, starts: tuple,
              first_slot: int, tokens: int) -> _LaneTemplate:
    """The template whose window holds the run's slots ``first_slot`` .. ``first_slot + tokens - 1`` (all in one
    block at every level: the blocks that start at ``starts``): the aligned window of ``TEMPLATE_SLOTS`` slots of
    the finest block, or one starting at the run when the run crosses that window's end."""
    finest = max(starts, default=0)
    block_end = min([capacity] + [start + size for start, size in zip(starts, geometry.block_sizes)])
    lowest = finest + (first_slot - finest) // TEMPLATE_SLOTS * TEMPLATE_SLOTS
    if first_slot + tokens > lowest + TEMPLATE_SLOTS:
        lowest = first_slot
    key = (id(geometry), base, capacity, ring_widths, value_width, dtype, device, scales, starts, lowest)
    template = _LANE_TEMPLATES.get(key)
    if template is not None and template.geometry is geometry:
        return template
    if len(_LANE_TEMPLATES) >= 8:
        _LANE_TEMPLATES.clear()
    highest = min(block_end, lowest + max(TEMPLATE_SLOTS, tokens))
    first_rank, fine_ranks = geometry.ranks[0], sum(geometry.ranks[1:])
    fine_rows = None
    if geometry.block_sizes:
        fine_rows = torch.tensor([geometry.fine_elements(ring_widths, row) for row in range(lowest, highest)],
                                 dtype=torch.long, device=device)
    # the groups of the window's last slot: levels merge by (start, ring width), which the slot does not change
    groups = _shared_groups(geometry, ring_widths, starts, highest)
    alphas, query_scale = _level_scaling(geometry, groups, scales, dtype, device)
    multiplier = None
    if geometry.average_levels:
        scaled = len(set(scales)) == 1
        multiplier = _shared_inverse_depth(starts, geometry.block_sizes, highest, dtype, device,
                                           scales[0] if scaled else 1.0)[1]
    template = _LANE_TEMPLATES[key] = _LaneTemplate(
        geometry, lowest, highest, torch.arange(lowest * first_rank, highest * first_rank, device=device),
        torch.arange(lowest * value_width, highest * value_width, device=device), fine_rows,
        tuple((start, width, dim, dims, offset) for start, _, dim, dims, offset, width in groups), multiplier,
        [first_rank, fine_ranks] if fine_ranks else None, query_scale, [first_rank] + [group[3] for group in groups],
        alphas, softmax_dtype(dtype) == dtype, torch.zeros((), dtype=dtype, device=device))
    return template


def _level_scaling(geometry: MLRGeometry, groups, scales, dtype, device) -> tuple:
    """(alphas, query_scale) of ``StepLane`` for these groups: the matmuls' scales when every group has one scale
    (levels summed), else the per-dim query scale when the levels' scales differ (else both None: the scale is in
    the multiplier). A ``bmm`` and a multiply by the inverse depths take less time than the matmuls' own
    ``beta`` / ``alpha`` averaging (measured: ``baddbmm`` with ``beta`` != 1 takes another path)."""
    scaled = geometry.average_levels and len(set(scales)) == 1
    level_of_dim = [level for level, rank in enumerate(geometry.ranks) for _ in range(rank)]
    group_scales = [{scales[level] for level in level_of_dim[group[2]:group[2] + group[3]]} for group in groups]
    if not scaled and not geometry.average_levels and all(len(group) == 1 for group in group_scales):
        # each product scaled by its levels' scale (``alpha`` of the matmul): no scaled copy of the query
        return (float(scales[0]),) + tuple(float(group.pop()) for group in group_scales), None
    if not scaled:
        return None, geometry.scale_vector(scales, dtype, device)
    return None, None


def _plan_run(geometry, facts, first_before, base, capacity, ring_widths, value_width, dtype, device, scales,
              first: int, tokens: int) -> StepLane:
    """The lane of the run of ``tokens`` positions from ``first``: views of its template, and the masks the run
    needs (left padding, the chunk's own causal mask) made here."""
    newest = first + tokens - 1
    first_slot = first - base
    slots = first_slot + tokens
    starts = tuple(max((newest // size) * size - base, 0) for size in geometry.block_sizes)
    template = _template(geometry, base, capacity, ring_widths, value_width, dtype, device, scales, starts,
                         first_slot, tokens)
    row = first_slot - template.lowest
    key_index = value_index = fine_index = None
    if tokens == 1:
        key_index = template.key_range.narrow(0, row * geometry.ranks[0], geometry.ranks[0])
        value_index = template.value_range.narrow(0, row * value_width, value_width)
    if template.fine_rows is not None:
        fine_index = template.fine_rows[row] if tokens == 1 else template.fine_rows.narrow(0, row, tokens)
    groups = tuple((min(start, slots), max(0, min(width, slots - start)), dim, dims, offset, width)
                   for start, width, dim, dims, offset in template.group_meta)
    additive = None
    lowest = torch.finfo(dtype).min
    if facts.latest_first > base:  # a row starts after slot 0 (left padding): its earlier slots are masked
        slot_positions = torch.arange(slots, device=device) + base
        additive = torch.zeros(first_before.shape[0], 1, 1, slots, dtype=dtype, device=device).masked_fill(
            (slot_positions < first_before[:, None])[:, None, None, :], lowest)
    if tokens > 1:  # token i attends to the slots up to its own (B | 1, 1, 1, c, S)
        future = torch.arange(slots, device=device) > torch.arange(first_slot, slots, device=device)[:, None]
        causal = torch.zeros(tokens, slots, dtype=dtype, device=device).masked_fill(future, lowest)
        additive = causal[None, None, None] if additive is None else \
            torch.minimum(additive[:, :, :, None, :], causal[None, None, None])
    return StepLane(capacity, base, first_slot, tokens, slots, tuple(range(first, newest + 1)), template.key_split,
                    key_index, value_index, fine_index, template.query_scale, template.query_split, groups,
                    None if template.multiplier_span is None else template.multiplier_span.narrow(2, 0, slots),
                    additive, template.readable, template.alphas, template.zero)


def mlr_lane_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, fine: torch.Tensor,
                       lane: StepLane) -> torch.Tensor:
    """MLR attention of a lane's c tokens per row against the cache layer whose whole (contiguous) storages are
    ``keys`` (B, Hk, C, r_1), ``values`` (B, Hk, C, dv) and ``fine`` (B, Hk, F), the tokens already written.
    query: (B, Hq, c, r) in level order. Returns the (B, c, Hq, dv) output (contiguous).

    The sum of ``mlr_decode_step``'s shared-start formulation in as few eager ops as it takes: level-1 scores by one
    ``bmm`` over a strided view of the storage (no narrowing), each group of finer levels by one in-place
    ``baddbmm_`` of its ring onto its block's slots (after the write a ring holds the block's slots up to the newest
    token; a token's later slots are masked), the inverse depth and the mask in one op, softmax, one ``bmm`` with a
    strided view of the values."""
    batch, heads, capacity, first_rank = keys.shape
    flat, slots, width, tokens = batch * heads, lane.slots, values.shape[-1], lane.tokens
    q_heads = query.shape[1]
    rows = q_heads // heads * tokens  # per cached head: its query heads' tokens, head-major
    if lane.query_scale is not None:
        query = query * lane.query_scale
    pieces = query.reshape(flat, rows, query.shape[-1]).split_with_sizes(lane.query_split, dim=2)
    first_keys = keys.as_strided((flat, first_rank, slots), (capacity * first_rank, 1, first_rank),
                                 keys.storage_offset())
    alphas = lane.alphas
    scores = torch.bmm(pieces[0], first_keys) if alphas is None else \
        torch.baddbmm(lane.zero, pieces[0], first_keys, beta=0, alpha=alphas[0])
    elements = fine.shape[-1]
    fine_offset = fine.storage_offset()
    targets = {}
    for index, ((start, used, _, dims, offset, ring_width), level_query) in enumerate(zip(lane.groups, pieces[1:])):
        ring = fine.as_strided((flat, dims, used), (elements, ring_width, 1), fine_offset + offset)
        target = targets.get((start, used))
        if target is None:
            target = targets[start, used] = scores.narrow(2, start, used)
        if alphas is None:
            target.baddbmm_(level_query, ring)
        else:
            target.baddbmm_(level_query, ring, alpha=alphas[index + 1])
    if lane.additive is not None:
        shaped = scores.view(batch, heads, rows, slots) if tokens == 1 else \
            scores.view(batch, heads, rows // tokens, tokens, slots)
        shaped = torch.addcmul(lane.additive, shaped, lane.multiplier) if lane.multiplier is not None \
            else shaped + lane.additive
        scores = shaped.view(flat, rows, slots)
    elif lane.multiplier is not None:
        scores.mul_(lane.multiplier)
    output = torch.bmm(torch.softmax(scores, dim=-1),
                       values.as_strided((flat, slots, width), (capacity * width, width, 1), values.storage_offset()))
    if tokens == 1:
        return output.view(batch, 1, q_heads, width)
    return output.view(batch, q_heads, tokens, width).transpose(1, 2).contiguous()


_MISSING = object()


def step_lanes(query, key, value, layer, step, geometry, scales, readable: bool):
    """The forward's ``StepLane``s for the cache layer ``layer`` when its rows are in step (made once per forward
    for the layers of one geometry, after growing a dynamic layer that needs more slots), or None: the general path
    writes. ``readable``: the lane's op may read (else only a one-token write takes the lane)."""
    facts = step.facts
    if facts is None or facts.shared_newest is None or not layer.is_initialized or \
            (query.shape[2] > 1 and not readable):
        return None
    static = isinstance(layer, MLRStaticKeyCacheLayer)
    needed = facts.shared_newest - layer.base + 1
    if not static:  # a dynamic layer exposes the tokens seen too
        needed = max(needed, facts.tokens_before + query.shape[2])
    if needed > layer.capacity:
        layer.ensure_slots(needed, key, value)
    memo_key = ("lanes", id(geometry), scales, layer.capacity, layer.base, value.shape[-1], query.dtype, static)
    lanes = step.memo.get(memo_key, _MISSING)
    if lanes is _MISSING:
        lanes = step.memo[memo_key] = plan_step_lanes(geometry, step, layer.base, layer.capacity, layer.ring_widths,
                                                      value.shape[-1], needed, query.dtype, query.device, scales)
    return lanes


def lane_attention(query, key, value, layer, lanes):
    """Write and read each lane (a chunk across a block boundary: its runs one after the other). query (B, Hq, c, r)
    level order. Returns (B, c, Hq, dv), or None (nothing written) when the lanes do not fit the layer."""
    if len(lanes) == 1:
        storages = layer.write_in_step(key, value, lanes[0])
        return None if storages is None else mlr_lane_attention(query, *storages, lanes[0])
    outputs, start = [], 0
    for lane in lanes:
        run = slice(start, start + lane.tokens)
        storages = layer.write_in_step(key[:, :, run], value[:, :, run], lane)
        if storages is None:  # the first run decides (every run fits the same layer)
            return None
        outputs.append(mlr_lane_attention(query[:, :, run], *storages, lane))
        start += lane.tokens
    return torch.cat(outputs, dim=1)



__all__ = ["MAX_RUNS", "StepLane", "TEMPLATE_SLOTS", "lane_attention", "lane_runs", "mlr_lane_attention",
           "plan_step_lanes", "step_lanes"]
