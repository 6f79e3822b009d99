"""The hierarchical MLR key cache (dynamic and static) and cached MLR attention (decode / chunked prefill).

What an MLR cache layer holds, per batch row and head:

* level-1 keys (``r_1`` dims) and values for every slot, in arrival order (``keys``, ``values``), with each slot's
  absolute position and padding flag (``key_positions``, ``key_valid``: (B, S));
* for each level l >= 2 a ring of ``W_l = min(b_l, capacity)`` entries of ``r_l`` dims (``level_keys[l-2]``:
  (B, H, W_l, r_l)); slot t lives at ring index ``t % W_l``, so the ring holds the newest ``W_l`` slots, which
  contain every key of the current level-l block of each row (positions increase along a row, and a block has at
  most ``b_l`` positions). Key entries held per (row, head): ``S r_1 + sum_l min(b_l, S) r_l`` for the dynamic
  layer, ``C r_1 + sum_l min(b_l, C) r_l`` for the static one (C = ``max_cache_len``), which is
  ``hf_structattn.flops.key_cache_elements``.

The cache stores detached states (it is written in place into preallocated storage): gradients do not flow
through cached decoding steps into earlier tokens; training forwards run without a cache (the models skip it).

Blocks follow each row's own positions, so a left-padded batch (or any per-row offset) decodes exactly like each row
alone. The only requirement is that positions increase along a row (any start, gaps allowed).

API (what the GPT-2 / T5 models and a Llama-style ``"mlr"`` attention function call)
----------------------------------------------------------------------------------
``cache.update(key_states, value_states, layer_idx, cache_kwargs)`` keeps transformers' meaning on every layer:
store the new tokens, return ``(keys, values)`` of every held slot. On an MLR layer ``keys`` are the *level-1* keys
(B, H, S, r_1) (the only level held for every slot) and ``values`` (B, H, S, dv); ``cache_kwargs`` may carry
``"position_ids"`` (B, c) or (1, c) absolute positions of the new tokens (default: continue each row after its last
real token) and ``"attention_mask"``, a 2-D keep-mask (B, S_total) over cached + new slots (its last c columns mark
the new tokens real or padding; default: all real), or ``"key_valid"`` (B, c) bool flags of the new tokens. Then ``layer.attend(query, ...)`` (``MLRCacheLayerMixin``)
computes the MLR attention of the new tokens' queries against everything held.

``cached_mlr_attention(query, key, value, cache, layer_idx, ...)`` is the one dispatch both model families use:
MLR cache layer -> update + attend; any other transformers cache layer (a plain ``DynamicCache``/``StaticCache`` a
caller built) -> its own ``update`` and an exact materialised MLR over the full-width keys, with the cached slots'
positions taken as consecutive real tokens ending just before the new tokens (such caches store no positions);
no cache, or nothing cached yet -> ``None`` (the caller runs the uncached op).
"""

from typing import Optional, Sequence

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)

RESERVE_POSITIONS = 256
# batch x heads x query rows up to which a decode step adds all fine-level scores with one index_add_ (measured on CPU)
INDEX_ADD_MAX_ROWS = 16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, masks and softmax run in ``promote_types(dtype, float32)`` (docs/contracts.md)."""
    return torch.promote_types(dtype, torch.float32)


class ReservedSequence:
    """A growing (..., S, ...) tensor that appends into reserved storage instead of re-concatenating.

    ``torch.cat`` on every decode step copies the whole cache (and page-faults a fresh multi-MB buffer on CPU);
    here storage grows by ``max(256, S/8)`` positions at a time, so a step writes only the new entries. ``view``
    is the used part (a strided view of the storage).
    """

    def __init__(self, dim: int):
        self.dim = dim
        self.storage = None
        self.view = None

    def reset_to(self, tensor: torch.Tensor) -> None:
        self.storage = tensor
        self.view = tensor

    def append(self, new: torch.Tensor) -> torch.Tensor:
        used = 0 if self.view is None else self.view.shape[self.dim]
        needed = used + new.shape[self.dim]
        if self.storage is None or self.storage.shape[self.dim] < needed:
            shape = list(new.shape)
            shape[self.dim] = needed + max(RESERVE_POSITIONS, needed // 8)
            grown = new.new_empty(shape)
            if used:
                grown.narrow(self.dim, 0, used).copy_(self.view)
            self.storage = grown
        self.storage.narrow(self.dim, used, new.shape[self.dim]).copy_(new)
        self.view = self.storage.narrow(self.dim, 0, needed)
        return self.view


class _BatchOpsMixin:
    """Beam-search reordering and batch selection/expansion through one ``_apply(fn)`` over every stored tensor."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices, ...])


class AppendingDynamicLayer(_BatchOpsMixin, DynamicLayer):
    """A DynamicLayer whose keys and values append into reserved storage (see ``ReservedSequence``); used for the
    dense and bilinear layers of ``StructAttnCache``."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_store, self._value_store = ReservedSequence(-2), ReservedSequence(-2)
        self.keys = self.values = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._key_store.append(key_states)
        self.values = self._value_store.append(value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if not self.is_initialized or self.keys is None else self.keys.shape[-2]

    def _apply(self, fn) -> None:
        if self.get_seq_length() > 0:
            self._key_store.reset_to(fn(self.keys))
            self._value_store.reset_to(fn(self.values))
            self.keys, self.values = self._key_store.view, self._value_store.view

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self.get_seq_length() == 0:
            return
        self._apply(lambda t: t[..., :tokens_to_remove, :].contiguous())


def _new_token_inputs(cache_kwargs: Optional[dict], batch: int, chunk: int, device) -> tuple:
    """(positions (B, c) or None, valid (B, c) bool or None) of the new tokens from ``cache_kwargs``."""
    cache_kwargs = cache_kwargs or {}
    positions = cache_kwargs.get("position_ids")
    if positions is not None:
        if positions.dim() != 2 or positions.shape[-1] != chunk or positions.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must have shape ({batch}, {chunk}) or (1, {chunk}) for {chunk} new "
                             f"tokens, got {tuple(positions.shape)}")
        positions = positions.to(device=device, dtype=torch.long).expand(batch, chunk)
    mask = cache_kwargs.get("attention_mask")
    valid = cache_kwargs.get("key_valid")
    if valid is not None:
        if valid.shape != (batch, chunk) or valid.dtype != torch.bool:
            raise ValueError(f"key_valid must be a bool tensor of shape ({batch}, {chunk}), got {valid.dtype} "
                             f"{tuple(valid.shape)}")
    elif mask is not None:
        if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[-1] < chunk:
            raise ValueError(f"attention_mask for the MLR cache must be a 2-D keep-mask (batch {batch}, >= {chunk} "
                             f"slots), got shape {tuple(mask.shape)}")
        if mask.is_floating_point():
            raise ValueError("attention_mask for the MLR cache must be a bool/int keep-mask (1 = real token), "
                             f"got dtype {mask.dtype}")
        valid = mask[:, -chunk:].to(device=device, dtype=torch.bool)
    return positions, valid


class _StepPlan:
    """Index and mask tensors of one step, shared by every MLR layer of a cache with the same geometry (they all
    see the same positions): computed by the first layer of a forward, reused by the others. ``entries`` maps a
    key (what the tensors depend on) to them."""

    def __init__(self):
        self.entries = {}

    def get(self, key, build):
        if torch.compiler.is_compiling():
            return build()
        if key not in self.entries:
            if len(self.entries) > 8:  # keys hold the step's slot count: old steps are never asked again
                self.entries.clear()
            self.entries[key] = build()
        return self.entries[key]

    def clear(self):
        self.entries.clear()


class MLRCacheLayerMixin:
    """Storage and attention shared by ``MLRKeyCacheLayer`` (dynamic) and ``MLRStaticKeyCacheLayer`` (static).

    Subclasses provide ``_capacity()`` (slots allocated), ``_seen()`` (slots written), ``_held_slots()`` (slots
    counted by ``key_cache_elements``), ``_write_slots(...)`` (store level-1 keys, values, positions and flags of a
    chunk, growing storage if needed) and ``_apply_storage(fn)``. See the module docstring for what is stored.

    Ring invariant: an entry of the level-l ring is either a real key of the current level-l block of its row (the
    block of the row's newest real position, ``_latest``) or zero. So a decode query, which lives in that block,
    adds every ring entry's score unmasked: a stale or padding entry contributes ``q . 0 = 0``.
    """

    is_croppable = False

    def _init_geometry(self, ranks: Sequence[int], block_sizes: Sequence[int], plan: Optional[_StepPlan]):
        self.ranks = [int(r) for r in ranks]
        self.block_sizes = [int(b) for b in block_sizes]
        if len(self.block_sizes) != len(self.ranks) - 1:
            raise ValueError(f"block_sizes={self.block_sizes} must give one block size per level 2..L "
                             f"(ranks={self.ranks})")
        self.plan = plan if plan is not None else _StepPlan()
        self.key_positions = self.key_valid = None
        self.level_keys = []
        self._fine = None
        self._latest = None  # (B,) newest real position of each row, -1 before any
        self._last = None  # what the last update stored, for attend()

    # ------------------------------------------------------------------ storage helpers
    @property
    def level_keys(self) -> list:
        """Per-level rings (B, H, W_l, r_l), views into the flat fine-level storage ``_fine`` (B, H, sum W_l r_l).

        While ``torch.compile`` traces, the views are made from ``_fine`` inside the graph, so ``_fine`` is the
        only graph input behind them. Stored views would each become an input aliasing the others, and the decode
        step writes through them: AOTAutograd then rebuilds a synthetic base with ``Tensor.set_`` on the shared
        storage, which fails once the batch size is symbolic (``Expected !size_bytes_is_heap_allocated_`` when
        the compiled forward recompiles for a second batch size), and refuses aliased mutated inputs outright
        when grad mode is on."""
        if self._fine is not None and torch.compiler.is_compiling():
            return self._fine_views(self._fine, self._capacity())
        return self._level_views

    @level_keys.setter
    def level_keys(self, views: list) -> None:
        self._level_views = views

    def _ring_sizes(self, capacity: int) -> list:
        return [min(size, capacity) for size in self.block_sizes]

    def _fine_views(self, fine: torch.Tensor, capacity: int) -> list:
        """Per-level ring views (B, H, W_l, r_l) into the flat fine-level storage (B, H, sum W_l r_l)."""
        views, offset = [], 0
        batch, heads = fine.shape[:2]
        for rank, width in zip(self.ranks[1:], self._ring_sizes(capacity)):
            views.append(fine[..., offset:offset + width * rank].view(batch, heads, width, rank))
            offset += width * rank
        return views

    def _new_fine(self, like: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads = like.shape[:2]
        elements = sum(w * r for w, r in zip(self._ring_sizes(capacity), self.ranks[1:]))
        return like.new_zeros(batch, heads, elements)

    @staticmethod
    def _ring_slots(width: int, newest_slot: int, device) -> torch.Tensor:
        """(W,) slot held at each ring index when ``newest_slot`` is the newest slot written (negative: none)."""
        entry = torch.arange(width, device=device)
        return newest_slot - torch.remainder(newest_slot - entry, width)

    def _write_chunk_rings(self, key_states: torch.Tensor, first_slot: int) -> None:
        """Write the fine-level keys of slots ``first_slot .. first_slot + c - 1`` into the rings, then zero every
        entry outside its row's current block (the ring invariant)."""
        chunk = key_states.shape[-2]
        start = self.ranks[0]
        newest = first_slot + chunk - 1
        for rank, size, ring in zip(self.ranks[1:], self.block_sizes, self.level_keys):
            width = ring.shape[-2]
            kept = min(chunk, width)  # older entries of a long chunk would be overwritten anyway
            slots = torch.arange(newest + 1 - kept, newest + 1, device=ring.device) % width
            ring.index_copy_(2, slots, key_states[..., chunk - kept:, start:start + rank])
            start += rank
            held = self._ring_slots(width, newest, ring.device)
            keep = (held >= 0)[None] & self.key_valid[:, held.clamp(min=0)] & (
                self.key_positions[:, held.clamp(min=0)] // size == self._latest[:, None] // size)
            ring.mul_(keep[:, None, :, None].to(ring.dtype))

    def key_cache_elements(self) -> int:
        """Key entries held per (batch row, head): ``S r_1 + sum_l min(b_l, S) r_l`` (dynamic, S slots written) or
        ``C r_1 + sum_l min(b_l, C) r_l`` (static, C = max_cache_len)."""
        if not self.is_initialized:
            return 0
        slots = self._held_slots()
        return slots * self.ranks[0] + sum(min(size, slots) * rank
                                           for size, rank in zip(self.block_sizes, self.ranks[1:]))

    def key_cache_bytes(self) -> int:
        """Bytes of keys held by this layer (batch and heads included)."""
        if not self.is_initialized:
            return 0
        return self.keys.shape[0] * self.keys.shape[1] * self.key_cache_elements() * self.keys.element_size()

    # ------------------------------------------------------------------ the Cache contract
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: Optional[dict] = None,
               *args, **kwargs):
        """Store c new tokens; return (level-1 keys (B, H, S, r_1), values (B, H, S, dv)) of every held slot
        (S = slots written; the static layer returns its whole max_cache_len buffers, like ``StaticLayer``).

        key_states: (B, H, c, r) full-width keys; value_states: (B, H, c, dv); cache_kwargs: see the module
        docstring (``position_ids``, ``attention_mask`` or ``key_valid``)."""
        batch, _, chunk, width = key_states.shape
        if width != sum(self.ranks):
            raise ValueError(f"MLR cache layer: key width {width} differs from sum(ranks)={sum(self.ranks)}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions, valid = _new_token_inputs(cache_kwargs, batch, chunk, key_states.device)
        past = self._seen()
        if valid is None:
            valid = torch.ones(batch, chunk, dtype=torch.bool, device=key_states.device)
        if self._latest is None or past == 0:
            self._latest = torch.full((batch,), -1, dtype=torch.long, device=key_states.device)
        if positions is None:  # continue each row after its newest real token
            positions = (self._latest[:, None] + valid.long().cumsum(-1)).clamp(min=0)
        # chunked prefill: the chunk's own writes may overwrite ring entries its first queries still need
        previous_fine = (self._fine.clone(), self._capacity()) if (chunk > 1 and past > 0) else None
        with torch.no_grad():  # preallocated storage written in place: the cache holds detached states
            key_states, value_states = key_states.detach(), value_states.detach()
            if chunk == 1 and past > 0:
                self._write_decode(key_states, value_states, positions, valid, past)
            else:
                self._write_slots(key_states, value_states, positions, valid, past)
                newest = torch.where(valid, positions, torch.full_like(positions, -1)).amax(-1)
                self._latest = torch.maximum(self._latest, newest)
                self._write_chunk_rings(key_states, past)
        self._last = (key_states, positions, valid, past, previous_fine)
        return self.keys, self.values

    def _write_decode(self, key_states, value_states, positions, valid, past) -> None:
        """One new token per row: zero the rings of rows whose new position starts a new block, write level 1,
        values and flags at slot ``past`` and the fine keys with one ``index_copy_`` into the flat storage."""
        self._write_slots(key_states, value_states, positions, valid, past)
        step = self.plan.get(("write", positions.data_ptr(), past, self._capacity(), key_states.dtype),
                             lambda: self._decode_write_plan(positions[:, 0], valid[:, 0], past, key_states.dtype))
        for ring, keep in zip(self.level_keys, step["keep"]):
            if keep is not None:
                ring.mul_(keep)
        if self.level_keys:
            fine_keys = key_states[:, :, 0, self.ranks[0]:]
            if step["real"] is not None:
                fine_keys = fine_keys * step["real"]
            self._fine.index_copy_(-1, step["index"], fine_keys)
        self._latest = step["latest"]

    def _decode_write_plan(self, new_positions, new_valid, past, dtype) -> dict:
        """What a decode step writes, shared by the layers of one geometry: per level a (B, 1, 1, 1) 0/1 factor that
        clears the ring of the rows whose new token starts a new block (None where no row does), the flat
        fine-storage index of the new token's fine dims, its 0/1 realness factor (None if all real) and the rows'
        newest positions."""
        device = new_positions.device
        sizes = torch.tensor(self.block_sizes, device=device)
        crosses = new_valid[:, None] & (new_positions[:, None] // sizes != self._latest[:, None] // sizes)  # (B, L-1)
        keeps = (~crosses).to(dtype).t()[:, :, None, None, None]  # (L-1, B, 1, 1, 1)
        if torch.compiler.is_compiling():
            keep = list(keeps)
        else:
            keep = [factor if level_crossed else None for factor, level_crossed in zip(keeps, crosses.any(0).tolist())]
        # flat index of the new token's fine dims: level offset + (slot % W_l) * r_l + dim, as tensor arithmetic on
        # ``past`` (Python arithmetic would make a compiled graph specialise on every step's slot count)
        base, widths, ranks, offset = [], [], [], 0
        for rank, ring in zip(self.ranks[1:], self.level_keys):
            width = ring.shape[-2]
            base.extend(range(offset, offset + rank))
            widths.extend([width] * rank)
            ranks.extend([rank] * rank)
            offset += width * rank
        widths = torch.tensor(widths, device=device)
        index = torch.tensor(base, device=device) + torch.remainder(past, widths) * torch.tensor(ranks, device=device)
        all_real = not torch.compiler.is_compiling() and bool(new_valid.all())
        return {"keep": keep, "index": index,
                "real": None if all_real else new_valid.to(dtype)[:, None, None],
                "latest": torch.where(new_valid, new_positions, self._latest)}

    def get_seq_length(self) -> int:
        return self._seen() if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ValueError("the MLR key cache cannot be cropped: finer levels keep only the current block's keys "
                         "(assisted decoding and other roll-backs are unsupported for MLR layers)")

    # ------------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, *, level_scales: Sequence[float], causal: bool = True,
               average_levels: bool = False, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """MLR attention of the queries of the tokens stored by the last ``update`` against every written slot.

        query: (B, H, c, r), or for a decode step (c = 1) (B, H, g, r): g queries per cached head at the new token's
        position (the query heads of a grouped-query-attention group, scored against their shared KV head in one
        call); bias: additive, broadcastable to (B, H, c, K) with K >= S (S = slots written; extra columns, e.g. a
        static cache's unwritten slots, are ignored). Returns (B, H, c or g, dv).

        Decode step (c = 1): level 1 scores every slot in one matmul; each finer level adds its ring's scores in
        place onto the slots it holds (one ``bmm`` per level; see ``_add_ring_scores``; the ring invariant makes
        masks unnecessary); one softmax, one matmul with the values. Chunk (c > 1): the rings as they were before
        the chunk plus the chunk's own keys, weighted by "same block as the query" and added with one
        ``scatter_add_``.
        """
        key_states, positions, valid, past, previous_fine = self._last
        chunk = key_states.shape[-2]
        if query.shape[2] != chunk and chunk != 1:
            raise ValueError(f"attend: query has {query.shape[2]} rows per head but the last update stored {chunk} "
                             f"tokens (several query rows per head are accepted only for a one-token decode step)")
        held = past + chunk
        work = compute_dtype(query.dtype)
        query = query * self._scale_vector(level_scales, query)
        if chunk == 1 and torch.compiler.is_compiling():
            return self._attend_decode_fixed_shape(query, positions[:, 0], held, work, average_levels, bias)
        keys, values = self.keys.narrow(-2, 0, held), self.values.narrow(-2, 0, held)
        scores = (query.narrow(-1, 0, self.ranks[0]) @ keys.transpose(-1, -2)).to(work)  # (B, H, c or g, S)
        if chunk == 1:
            plan = self.plan.get(("attend", positions.data_ptr(), past, work, average_levels),
                                 lambda: self._decode_attend_plan(positions[:, 0], held, work, average_levels))
            self._add_ring_scores(scores, query, held, work)
        else:
            plan = self._chunk_plan(positions, valid, past, chunk, causal, work, average_levels, previous_fine)
            self._add_chunk_scores(scores, query, key_states, previous_fine, plan, work)
        if plan["depth"] is not None:
            scores = scores / plan["depth"]
        if bias is not None:
            scores = scores + (bias.narrow(-1, 0, held) if bias.shape[-1] > held else bias)
        if plan["mask"] is not None:
            scores = scores + plan["mask"]
        return torch.softmax(scores, dim=-1).to(values.dtype) @ values

    def _add_ring_scores(self, scores, query, held, work) -> None:
        """Decode: scores (B, H, g, S) += alpha_l q_l . ring_l on the slots each ring holds, in place (query (B, H,
        g, r), g query rows per head).

        One ``bmm`` per level over the ring entries in use (a separate ``bmm``, not an in-place ``baddbmm_`` into
        the strided score slice: that one measured 1.6-4x slower on CPU). For up to
        ``INDEX_ADD_MAX_ROWS`` (batch x heads x query rows) rows the level scores are concatenated and land with one
        ``index_add_`` (fewer ops: what decides the time of a small step); above it ``index_add_`` along the last
        dim is slower than one or two contiguous slice ``add_`` per level, so the slices are used."""
        batch, heads, query_rows = query.shape[:3]
        flat_scores = scores.view(batch * heads, query_rows, held)
        q_levels = query.view(batch * heads, query_rows, query.shape[-1]).split(self.ranks, dim=-1)[1:]
        rings = self._transposed_rings()
        if batch * heads * query_rows <= INDEX_ADD_MAX_ROWS:
            level_scores = [torch.bmm(q_level, ring if ring.shape[-1] <= held else ring.narrow(2, 0, held))
                            for q_level, ring in zip(q_levels, rings)]
            slots = self.plan.get(("ring slots", held, self._capacity(), scores.device),
                                  lambda: self._ring_entry_slots(held, scores.device))
            flat_scores.index_add_(2, slots, torch.cat(level_scores, dim=-1).to(work))
            return
        level_scores = {}
        for level, first_slot, count, first_entry in self._ring_runs(held):
            if level not in level_scores:
                ring = rings[level]
                level_scores[level] = torch.bmm(q_levels[level], ring.narrow(2, 0, min(ring.shape[-1], held))).to(work)
            flat_scores.narrow(2, first_slot, count).add_(level_scores[level].narrow(2, first_entry, count))

    def _ring_entry_slots(self, held: int, device) -> torch.Tensor:
        """(sum_l min(W_l, held),) slot held by each ring entry in use, levels concatenated in order, when ``held``
        slots are written (entry i of a ring of W entries holds the newest slot s < held with s % W == i)."""
        parts = []
        for ring in self.level_keys:
            width = ring.shape[-2]
            parts.append(self._ring_slots(width, held - 1, device)[:min(width, held)])
        return torch.cat(parts)

    def _attend_decode_fixed_shape(self, query, new_positions, held, work, average_levels, bias) -> torch.Tensor:
        """The decode step with shapes that do not depend on the step (what ``torch.compile`` traces): every
        allocated slot is scored and masked by "written and real", and each ring's scores go to their slots with
        one ``scatter_add_`` per level. (A gather by ``slot % W_l`` per level, pointwise over all slots, was no
        faster compiled: 156 vs 170 ms/token at batch 16.)"""
        batch, heads, query_rows = query.shape[:3]
        keys, values = self.keys, self.values
        slots = keys.shape[-2]
        scores = (query.narrow(-1, 0, self.ranks[0]) @ keys.transpose(-1, -2)).to(work)  # (B, H, g, C)
        newest = held - 1
        start = self.ranks[0]
        for rank, ring in zip(self.ranks[1:], self.level_keys):
            width = ring.shape[-2]
            slot = newest - torch.remainder(newest - torch.arange(width, device=query.device), width)
            level = (query.narrow(-1, start, rank) @ ring.transpose(-1, -2)).to(work) * (slot >= 0)
            scores.scatter_add_(-1, slot.clamp(min=0).expand(batch, heads, query_rows, width), level)
            start += rank
        allowed = self.key_valid & (torch.arange(slots, device=query.device) < held)  # (B, C)
        if average_levels:
            depth = torch.ones(allowed.shape, dtype=work, device=query.device)
            for size in self.block_sizes:
                depth = depth + ((self.key_positions // size == new_positions[:, None] // size) & allowed)
            scores = scores / depth[:, None, None, :]
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~allowed[:, None, None, :], torch.finfo(work).min)
        return torch.softmax(scores, dim=-1).to(values.dtype) @ values

    def _transposed_rings(self) -> list:
        """Per level (B*H, r_l, W_l) views of the rings (rebuilt only when the storage changes)."""
        if getattr(self, "_rings_source", None) is not self._fine:
            self._rings_source = self._fine
            self._rings_t = [ring.reshape(-1, *ring.shape[2:]).transpose(1, 2) for ring in self.level_keys]
        return self._rings_t

    def _ring_runs(self, held: int) -> list:
        """(level, first slot, count, first ring entry) runs that map ring entries onto the slots they hold when
        ``held`` slots are written: ring index i holds the slot s < held with s % W == i, so the slots
        [held - min(W, held), held) come in at most two contiguous runs per level."""
        runs = []
        for level, ring in enumerate(self.level_keys):
            width = ring.shape[-2]
            used = min(width, held)
            rotation = held % width if held >= width else 0
            if used - rotation > 0:
                runs.append((level, held - used, used - rotation, rotation))
            if rotation:
                runs.append((level, held - rotation, rotation, 0))
        return runs

    def _decode_attend_plan(self, new_positions, held, work, average_levels) -> dict:
        plan = {"mask": None, "depth": None}
        valid = self.key_valid[:, :held]
        if torch.compiler.is_compiling() or not bool(valid.all()):
            plan["mask"] = torch.zeros(valid.shape, dtype=work, device=valid.device).masked_fill_(
                ~valid, torch.finfo(work).min)[:, None, None, :]
        if average_levels:
            depth = torch.ones(valid.shape, dtype=work, device=valid.device)
            positions = self.key_positions[:, :held]
            for size in self.block_sizes:
                depth += (positions // size == new_positions[:, None] // size) & valid
            plan["depth"] = depth[:, None, None, :]
        return plan

    def _chunk_plan(self, positions, valid, past, chunk, causal, work, average_levels, previous_fine) -> dict:
        """Scatter targets and 0/1 "same block" weights of the fine-level scores of a chunk of queries (the rings
        before the chunk, then the chunk's own keys), the additive mask and the level counts (for averaging)."""
        device = positions.device
        batch = positions.shape[0]
        held = past + chunk
        rings = self._fine_views(*previous_fine) if previous_fine is not None else []
        targets, weights = [], []
        for level, size in enumerate(self.block_sizes):
            slot_parts, position_parts, valid_parts = [], [], []
            if rings:
                slot = self._ring_slots(rings[level].shape[-2], past - 1, device)
                held_entry = slot >= 0
                slot = slot.clamp(min=0)
                slot_parts.append(slot)
                position_parts.append(self.key_positions[:, slot])
                valid_parts.append(self.key_valid[:, slot] & held_entry)
            slot_parts.append(torch.arange(past, held, device=device))
            position_parts.append(positions)
            valid_parts.append(valid)
            entry_positions = torch.cat(position_parts, dim=-1)
            same = (entry_positions[:, None, :] // size) == (positions[:, :, None] // size)  # (B, c, entries)
            weights.append(same & torch.cat(valid_parts, dim=-1)[:, None, :])
            targets.append(torch.cat(slot_parts))
        plan = {"fine_targets": None, "fine_weights": None, "depth": None, "mask": None}
        if targets:
            plan["fine_targets"] = torch.cat(targets)[None, None, None, :]
            plan["fine_weights"] = torch.cat(weights, dim=-1)[:, None].to(work)  # (B, 1, c, entries)
        allowed = self.key_valid[:, None, :held].expand(batch, chunk, held)
        if causal:
            allowed = allowed & (self.key_positions[:, None, :held] <= positions[:, :, None])
        plan["mask"] = torch.zeros(allowed.shape, dtype=work, device=device).masked_fill_(
            ~allowed, torch.finfo(work).min)[:, None]
        if average_levels:
            depth = torch.ones(batch, 1, chunk, held, dtype=work, device=device)
            if targets:
                depth.scatter_add_(-1, plan["fine_targets"].expand(batch, 1, chunk, -1), plan["fine_weights"])
            plan["depth"] = depth
        return plan

    def _add_chunk_scores(self, scores, query, key_states, previous_fine, plan, work) -> None:
        if not self.ranks[1:]:
            return
        batch, heads, chunk, _ = query.shape
        rings = self._fine_views(*previous_fine) if previous_fine is not None else [None] * len(self.block_sizes)
        level_scores, start = [], self.ranks[0]
        for rank, ring in zip(self.ranks[1:], rings):
            q_level = query[..., start:start + rank]
            if ring is not None:
                level_scores.append(q_level @ ring.transpose(-1, -2))
            level_scores.append(q_level @ key_states[..., start:start + rank].transpose(-1, -2))
            start += rank
        fine = torch.cat(level_scores, dim=-1).to(work) * plan["fine_weights"]
        scores.scatter_add_(-1, plan["fine_targets"].expand(batch, heads, chunk, -1), fine)

    def _scale_vector(self, level_scales, query) -> torch.Tensor:
        """(r,) per-dim logit multipliers alpha_l (folded into the query)."""
        key = (tuple(level_scales), query.dtype, query.device)
        if getattr(self, "_scale_key", None) != key:
            self._scale_key = key
            self._scale = torch.tensor([s for s, r in zip(level_scales, self.ranks) for _ in range(r)],
                                       dtype=query.dtype, device=query.device)
        return self._scale

    def _apply(self, fn) -> None:
        if not self.is_initialized:
            return
        self._apply_storage(fn)
        self._rings_source = None
        if self._latest is not None:
            self._latest = fn(self._latest)
        self.plan.clear()


class MLRKeyCacheLayer(MLRCacheLayerMixin, _BatchOpsMixin, DynamicLayer):
    """Dynamic cache layer of one MLR attention layer: storage reserved ahead in steps of ``max(256, S/8)`` slots
    and written in place (no per-step concatenation); rings grow with the reserved capacity up to ``b_l``."""

    def __init__(self, ranks: Sequence[int], block_sizes: Sequence[int], plan: Optional[_StepPlan] = None):
        super().__init__()
        self._init_geometry(ranks, block_sizes, plan)
        self._used = 0
        self._storage = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self._used = 0
        self._storage = None
        self.is_initialized = True

    def _capacity(self) -> int:
        return 0 if self._storage is None else self._storage["values"].shape[-2]

    def _seen(self) -> int:
        return self._used

    def _held_slots(self) -> int:
        return self._used

    def _grow(self, needed: int, key_states, value_states) -> None:
        capacity = needed + max(RESERVE_POSITIONS, needed // 8)
        batch, heads = key_states.shape[:2]
        used = self._used
        grown = {
            "keys": key_states.new_zeros(batch, heads, capacity, self.ranks[0]),
            "values": value_states.new_zeros(batch, heads, capacity, value_states.shape[-1]),
            "key_positions": torch.zeros(batch, capacity, dtype=torch.long, device=key_states.device),
            "key_valid": torch.zeros(batch, capacity, dtype=torch.bool, device=key_states.device),
        }
        fine = self._new_fine(key_states, capacity)
        if self._storage is not None:
            for name, tensor in self._storage.items():
                grown[name].narrow(-2 if tensor.dim() == 4 else -1, 0, used).copy_(
                    tensor.narrow(-2 if tensor.dim() == 4 else -1, 0, used))
            for old, new in zip(self.level_keys, self._fine_views(fine, capacity)):
                slots = torch.arange(max(0, used - old.shape[-2]), used, device=fine.device)
                new.index_copy_(2, slots % new.shape[-2], old.index_select(2, slots % old.shape[-2]))
        self._storage, self._fine = grown, fine
        self.level_keys = self._fine_views(fine, capacity)

    def _write_slots(self, key_states, value_states, positions, valid, past) -> None:
        chunk = key_states.shape[-2]
        if self._storage is None or past + chunk > self._capacity():
            self._grow(past + chunk, key_states, value_states)
        store = self._storage
        store["keys"].narrow(-2, past, chunk).copy_(key_states[..., :self.ranks[0]])
        store["values"].narrow(-2, past, chunk).copy_(value_states)
        store["key_positions"].narrow(-1, past, chunk).copy_(positions)
        store["key_valid"].narrow(-1, past, chunk).copy_(valid)
        self._used = past + chunk
        self._refresh_views()

    def _refresh_views(self) -> None:
        used = self._used
        self.keys = self._storage["keys"].narrow(-2, 0, used)
        self.values = self._storage["values"].narrow(-2, 0, used)
        self.key_positions = self._storage["key_positions"].narrow(-1, 0, used)
        self.key_valid = self._storage["key_valid"].narrow(-1, 0, used)

    def _apply_storage(self, fn) -> None:
        if self._storage is None:
            return
        self._storage = {name: fn(tensor) for name, tensor in self._storage.items()}
        self._fine = fn(self._fine)
        self.level_keys = self._fine_views(self._fine, self._capacity())
        self._refresh_views()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        self._storage = self._fine = None
        self.level_keys = []
        self.key_positions = self.key_valid = self._latest = None
        self._used = 0
        self.plan.clear()
        super().reset()


class MLRStaticKeyCacheLayer(MLRCacheLayerMixin, _BatchOpsMixin, StaticLayer):
    """Fixed-shape cache layer of one MLR attention layer for ``cache_implementation="static"`` and
    ``torch.compile``: level-1 keys, values, positions and flags sized to ``max_cache_len`` slots, rings of
    ``min(b_l, max_cache_len)`` entries, all allocated once and written in place."""

    def __init__(self, ranks: Sequence[int], block_sizes: Sequence[int], max_cache_len: int,
                 plan: Optional[_StepPlan] = None):
        StaticLayer.__init__(self, max_cache_len=max_cache_len)
        self._init_geometry(ranks, block_sizes, plan)
        self._written = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        capacity = self.max_cache_len
        self.device = key_states.device
        self.keys = key_states.new_zeros(batch, heads, capacity, self.ranks[0])
        self.values = value_states.new_zeros(batch, heads, capacity, value_states.shape[-1])
        self.key_positions = torch.zeros(batch, capacity, dtype=torch.long, device=key_states.device)
        self.key_valid = torch.zeros(batch, capacity, dtype=torch.bool, device=key_states.device)
        self._fine = self._new_fine(key_states, capacity)
        self.level_keys = self._fine_views(self._fine, capacity)
        self._written = 0
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def _capacity(self) -> int:
        return self.max_cache_len

    def _seen(self) -> int:
        return self._written

    def _held_slots(self) -> int:
        return self.max_cache_len

    def _write_slots(self, key_states, value_states, positions, valid, past) -> None:
        chunk = key_states.shape[-2]
        if past + chunk > self.max_cache_len:
            raise ValueError(f"the static MLR cache holds max_cache_len={self.max_cache_len} tokens; writing {chunk} "
                             f"after {past} would exceed it")
        self.keys.narrow(-2, past, chunk).copy_(key_states[..., :self.ranks[0]])
        self.values.narrow(-2, past, chunk).copy_(value_states)
        self.key_positions.narrow(-1, past, chunk).copy_(positions)
        self.key_valid.narrow(-1, past, chunk).copy_(valid)
        self._written = past + chunk
        self.cumulative_length.fill_(self._written)

    def _apply_storage(self, fn) -> None:
        for name in ("keys", "values", "key_positions", "key_valid", "_fine"):
            setattr(self, name, fn(getattr(self, name)))
        self.level_keys = self._fine_views(self._fine, self.max_cache_len)

    def get_seq_length(self) -> int:
        return self._written if self.is_initialized else 0

    def reset(self) -> None:
        if self.is_initialized:
            for tensor in (self.keys, self.values, self.key_positions, self.key_valid, self._fine):
                tensor.zero_()
        self._written = 0
        self._latest = None
        self.cumulative_length.zero_()
        self.plan.clear()


class StructAttnCache(DynamicCache):
    """A DynamicCache whose layers follow the model's per-layer attention: MLR layers get an
    ``MLRKeyCacheLayer``, sliding-window layers a ``DynamicSlidingWindowLayer``, the rest an
    ``AppendingDynamicLayer``. With ``max_cache_len`` every layer is fixed-shape instead
    (``MLRStaticKeyCacheLayer``, ``StaticSlidingWindowLayer``, ``StaticLayer``): what ``generate(...,
    cache_implementation="static")`` builds for these models, and what ``torch.compile`` wants.

    ``layer_specs``: one dict per layer with ``attention`` and, for MLR, ``ranks`` and ``block_sizes``, for SWA
    ``sliding_window``.
    """

    def __init__(self, layer_specs: Sequence[dict], max_cache_len: Optional[int] = None, **kwargs):
        super().__init__(**kwargs)
        plans = {}
        layers = []
        for spec in layer_specs:
            if spec["attention"] == "mlr":
                geometry = (tuple(spec["ranks"]), tuple(spec["block_sizes"]))
                plan = plans.setdefault(geometry, _StepPlan())
                if max_cache_len is None:
                    layers.append(MLRKeyCacheLayer(spec["ranks"], spec["block_sizes"], plan=plan))
                else:
                    layers.append(MLRStaticKeyCacheLayer(spec["ranks"], spec["block_sizes"], max_cache_len,
                                                         plan=plan))
            elif spec["attention"] == "swa":
                layers.append(DynamicSlidingWindowLayer(sliding_window=spec["sliding_window"]) if max_cache_len is None
                              else StaticSlidingWindowLayer(max_cache_len=max_cache_len,
                                                            sliding_window=spec["sliding_window"]))
            else:
                layers.append(AppendingDynamicLayer() if max_cache_len is None else StaticLayer(max_cache_len))
        self.layers = layers
        self.layer_class_to_replicate = None
        self.max_cache_len = max_cache_len

    def key_cache_bytes(self) -> int:
        """Bytes of keys held over all layers (batch and heads included); static layers count their whole
        allocation."""
        total = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            if isinstance(layer, MLRCacheLayerMixin):
                total += layer.key_cache_bytes()
            else:
                total += layer.keys.numel() * layer.keys.element_size()
        return total


def _self_attention_cache(cache):
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def mlr_attention_full_keys(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                            query_positions: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor,
                            ranks: Sequence[int], block_sizes: Sequence[int], level_scales: Sequence[float],
                            causal: bool, average_levels: bool, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Materialised MLR attention over full-width keys (what an ordinary transformers cache holds).

    query: (B, H, c, r); keys: (B, H, K, r); values: (B, H, K, dv); query_positions (B, c); key_positions,
    key_valid (B, K); bias broadcastable to (B, H, c, K). Returns (B, H, c, dv)."""
    work = compute_dtype(query.dtype)
    scores, depth, start = None, None, 0
    for level, (rank, scale) in enumerate(zip(ranks, level_scales)):
        level_scores = (query[..., start:start + rank] * scale) @ keys[..., start:start + rank].transpose(-1, -2)
        level_scores = level_scores.to(work)
        start += rank
        if level == 0:
            scores = level_scores
            continue
        size = block_sizes[level - 1]
        same = ((query_positions[:, :, None] // size) == (key_positions[:, None, :] // size))[:, None]
        scores = scores + level_scores * same
        depth = same.to(work) if depth is None else depth + same
    if average_levels and depth is not None:
        scores = scores / (1 + depth)
    if bias is not None:
        scores = scores + bias
    allowed = key_valid[:, None, None, :]
    if causal:
        allowed = allowed & (key_positions[:, None, None, :] <= query_positions[:, None, :, None])
    scores = scores.masked_fill(~allowed, torch.finfo(work).min)
    return torch.softmax(scores, dim=-1).to(values.dtype) @ values


def cached_mlr_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: Optional[Cache],
                         layer_idx: int, *, positions: torch.Tensor, valid: Optional[torch.Tensor],
                         slot_valid: Optional[torch.Tensor] = None,
                         ranks: Sequence[int], block_sizes: Sequence[int], level_scales: Sequence[float],
                         causal: bool = True, average_levels: bool = False,
                         bias=None) -> Optional[torch.Tensor]:
    """The cached-attention dispatch of every MLR layer (GPT-2 and T5 families): store the new tokens in ``cache``
    and return their attention output (B, H, c, dv), or ``None`` when there is nothing cached before them (no cache,
    or an empty one: the caller runs the uncached op, which is the faster prefill).

    query, key: (B, H, c, r); value: (B, H, c, dv); positions (B, c) absolute positions of the new tokens; valid
    (B, c) bool or None (all real); slot_valid (B, past + c) bool flags of every slot (cached + new) or None, only
    read for an ordinary transformers cache, which stores no padding flags. ``bias``: None, a tensor broadcastable to (B, H, c, K), or a callable
    ``bias(K)`` returning one, where K is the number of slots scored (``cache.get_mask_sizes``)."""
    self_cache = _self_attention_cache(cache)
    if self_cache is None:
        return None
    if layer_idx >= len(self_cache.layers) and getattr(self_cache, "layer_class_to_replicate", None) is None:
        raise ValueError(f"the cache has {len(self_cache.layers)} layers; layer {layer_idx} has none")
    past = self_cache.get_seq_length(layer_idx) if layer_idx < len(self_cache.layers) else 0
    if not isinstance(past, int):
        past = int(past)
    batch, _, chunk, _ = key.shape
    layer = self_cache.layers[layer_idx] if layer_idx < len(self_cache.layers) else None
    if isinstance(layer, MLRCacheLayerMixin):
        layer.update(key, value, {"position_ids": positions, "key_valid": None if valid is None else valid.bool()})
        if past == 0:
            return None
        key_count = layer.get_mask_sizes(chunk)[0]
        return layer.attend(query, level_scales=level_scales, causal=causal, average_levels=average_levels,
                            bias=bias(key_count) if callable(bias) else bias)
    # an ordinary transformers cache: it stores full-width keys and no positions
    keys, values = self_cache.update(key, value, layer_idx)
    if past == 0:
        return None
    key_count = keys.shape[-2]
    if slot_valid is None:
        slot_valid = torch.ones(batch, past + chunk, dtype=torch.bool, device=key.device)
    elif slot_valid.shape != (batch, past + chunk):
        raise ValueError(f"slot_valid must have shape ({batch}, {past + chunk}) (cached + new slots), got "
                         f"{tuple(slot_valid.shape)}")
    key_valid = slot_valid.bool()
    past_valid = key_valid[:, :past]
    # consecutive real tokens ending just before each row's first new token
    first_new = positions[:, :1]
    real_before = past_valid.long().flip(-1).cumsum(-1).flip(-1)  # real slots at or after each past slot
    past_positions = first_new - real_before
    key_positions = torch.cat([past_positions, positions], dim=-1)
    if key_count > past + chunk:  # a static layer: slots beyond the written ones are empty
        filler = key_count - past - chunk
        key_valid = torch.cat([key_valid, key_valid.new_zeros(batch, filler)], dim=-1)
        key_positions = torch.cat([key_positions, key_positions.new_zeros(batch, filler)], dim=-1)
    return mlr_attention_full_keys(query, keys, values, query_positions=positions, key_positions=key_positions,
                                   key_valid=key_valid, ranks=ranks, block_sizes=block_sizes,
                                   level_scales=level_scales, causal=causal, average_levels=average_levels,
                                   bias=bias(key_count) if callable(bias) else bias)


def structattn_generation_cache(new_cache, generation_config, model_kwargs: dict, max_cache_length: int):
    """The cache ``generate()`` should use for these models, or None to let transformers decide.

    ``new_cache(max_cache_len=None)`` builds the model's ``StructAttnCache`` (or an ``EncoderDecoderCache`` around
    one). ``cache_implementation`` None/"dynamic" -> dynamic layers; "static" -> fixed-shape layers of
    ``max(max_cache_length, generation_config.max_cache_len)`` slots; anything else, or a cache the caller passed,
    or ``use_cache=False`` -> None."""
    if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
        return None
    implementation = generation_config.cache_implementation
    if implementation in (None, "dynamic"):
        return new_cache()
    if implementation == "static":
        if generation_config.max_cache_len is not None:
            max_cache_length = max(max_cache_length, generation_config.max_cache_len)
        return new_cache(max_cache_len=max_cache_length)
    return None
