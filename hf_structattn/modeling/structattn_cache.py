"""The hierarchical MLR key cache: its storage, and ``update``, the one write.

An MLR cache layer holds, per batch row and KV head:

* level-1 keys (``r_1`` dims) and values of every position, in **position-aligned slots**: position ``p`` lives in
  slot ``p - base`` (``base`` is a multiple of the coarsest fine block ``b_2``, fixed at the first write). Padding
  tokens are not stored; a row is the contiguous span ``[first, last]`` of its real positions (``first_positions``,
  ``last_positions``: (B,)), so no per-slot flags or positions are kept.
* per finer level l >= 2 a ring of ``W_l = min(b_l, capacity)`` keys of ``r_l`` dims: position ``p`` is written to
  entry ``(p - base) % b_l``. The entries of the current level-l block of a row therefore sit at the same offsets
  as the block's slots. All rings are views into one flat storage (B, H, sum_l W_l r_l), dim-major. Entries beyond a
  row's newest position are stale and masked as future.

Key entries held per (row, head): ``S r_1 + sum_l min(b_l, S) r_l`` for S slots (``MLRGeometry.key_cache_elements``).

One forward: the model makes the step and, before its first layer runs, every MLR cache layer's plan
(``structattn_prepare.prepare_step``: the layer's ``CacheLayout`` and read record, ``structattn_mlr_plan``; a dynamic
layer grows there, ``planned_storage``); an attention module calls ``cache.update(k, v, layer_idx, kwargs=kwargs)``,
which writes the chunk by the layer's layout (host-addressed copies for rows in step, indexed assignments otherwise)
and returns the chunk's keys in level order and an ``MLRCacheView`` in place of the values; the ``"mlr"`` attention
function reads the view with ``structattn_mlr_cached.mlr_cached_attention``. Rollback for speculative decoding is
``structattn_rollback``; how a cache gets its MLR layers, ``structattn_prepare``.

A layer is built without geometry (``DynamicCache(config=...)`` and ``StaticCache`` construct registered layer types
with no arguments) and behaves as transformers' ``DynamicLayer`` / ``StaticLayer`` until a model ``bind``s it to
its ``MLRGeometry`` before the first write (``structattn_prepare.prepare_structattn_cache``).
"""

from typing import NamedTuple, Optional

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.utils import logging

from .structattn_geometry import MLRGeometry
from .structattn_mlr_plan import CacheLayout, LayerPlan
from .structattn_rollback import RollbackLog, RollbackMixin
from .structattn_step import NO_POSITION, REFUSED_ARGUMENTS, STEP_KEY, refuse_unsupported_arguments

logger = logging.get_logger(__name__)
MIN_GROWTH = 16  # dynamic layers grow by max(MIN_GROWTH, S/32) slots when no length was reserved


class MLRCacheView(NamedTuple):
    """What ``update`` returns in place of the values: everything an MLR cache layer holds for one forward's queries,
    after the chunk was written (read-only; a named tuple, which ``update`` builds with ``tuple.__new__``: no Python
    call in every layer of every step).

    key_storage: (B, Hk, C, r_1) level-1 slots; value_storage: (B, Hk, C, dv); fine: (B, Hk, F) the flat ring
    storage (``MLRGeometry.fine_layout``); chunk_keys: (B, Hk, c, r) the chunk's keys in level order (with their
    autograd history); chunk_values: (B, Hk, c, dv) its values; replaced: (B, Hk, c, F) per new token the ring
    entries of its own position as they were before the chunk (chunks of several tokens), else None; tokens: tokens
    held after the chunk (transformers' sequence length, padding included); first_positions, last_positions: (B,)
    the rows' spans after the chunk; plan: the layer's ``LayerPlan`` of this forward, which the write followed (its
    layout) and the read follows (its read record); codecs: a quantised layer's ``SlotCodecs`` (its key and value
    storages hold rows of codes, ``structattn_cache_quantized``), else None."""

    key_storage: torch.Tensor
    value_storage: torch.Tensor
    fine: torch.Tensor
    chunk_keys: torch.Tensor
    chunk_values: torch.Tensor
    replaced: Optional[torch.Tensor]
    tokens: object
    first_positions: torch.Tensor
    last_positions: torch.Tensor
    plan: LayerPlan
    codecs: Optional[NamedTuple]


def _geometry_fields(geometry: MLRGeometry) -> dict:
    """What a cache layer's geometry fixes, field by field, as the refusals print it."""
    scales = geometry.level_scales
    return {"ranks": f"ranks {list(geometry.ranks)}", "blocks": f"blocks {list(geometry.block_sizes)}",
            "level scales": "level scales " + ("of the attention module" if scales is None else
                                               "[" + ", ".join(f"{scale:g}" for scale in scales) + "]"),
            "level averaging": f"level averaging {'on' if geometry.average_levels else 'off'}",
            "dim order": "dim order " + ("identity" if geometry.dim_order is None else str(list(geometry.dim_order)))}


def held_geometry(geometry: MLRGeometry) -> str:
    """``MLR keys of ranks [...], blocks [...]``: what a written MLR cache layer holds, for one-line refusals."""
    fields = _geometry_fields(geometry)
    return f"MLR keys of {fields['ranks']}, {fields['blocks']}"


def geometry_mismatch(held: Optional[MLRGeometry], geometry: MLRGeometry) -> str:
    """The one-line refusal of a written cache layer read by a model layer of another geometry: ranks and blocks of
    both, and every other field that differs (level scales, level averaging, dim order), named."""
    new = _geometry_fields(geometry)
    if held is None:
        return (f"this cache layer holds no MLR keys; the model's layer is MLR with {new['ranks']}, {new['blocks']}: "
                f"a cache is read only by a model of the geometry that wrote it (start from a new cache)")
    old = _geometry_fields(held)
    differing = [name for name in old if old[name] != new[name]]
    shown = ["ranks", "blocks"] + [name for name in differing if name not in ("ranks", "blocks")]
    return (f"this cache layer holds MLR keys of {', '.join(old[name] for name in shown)}; the model's layer is MLR "
            f"with {', '.join(new[name] for name in shown)} (they differ in {' and '.join(differing)}): a cache is "
            f"read only by a model of the geometry that wrote it (start from a new cache)")


class MLRCacheLayerMixin(RollbackMixin):
    """Storage shared by ``MLRKeyCacheLayer`` (dynamic) and ``MLRStaticKeyCacheLayer`` (static). Subclasses provide
    ``_allocate(like_keys, like_values, capacity)``, ``_ensure_capacity(slots, like_keys, like_values)``,
    ``capacity``, ``keys_storage()`` / ``values_storage()``, ``_advance(chunk, newest_slot)`` and ``_rewind``."""

    holds_mlr_positions = True  # what ``structattn_step`` looks for (the rows' positions every MLR layer holds)
    is_static = False  # a fixed-shape layer (``MLRStaticKeyCacheLayer``)
    geometry: Optional[MLRGeometry] = None
    codecs = None  # a quantised layer's ``SlotCodecs`` (structattn_cache_quantized): its slots hold codes
    # this layer's index in its cache, where the forward's plan holds its ``LayerPlan`` (``MLRStep.layers``):
    # transformers' layers are not told their index, so ``prepare_structattn_cache`` records it (kept by ``reset``)
    layer_index: Optional[int] = None

    def _init_state(self) -> None:
        self.geometry = None
        self.base = None
        self.first_positions = self.last_positions = None
        self._fine = None
        self.contiguous = True  # the storages are contiguous (the in-step read views them with strides of its own)
        self._flat = None  # (storages, their flat views): ``_flat_views``
        self._widths_at = None  # (capacity, geometry, ring widths) of the last ``_ring_widths`` call
        self.rings = []
        self._record_past = False
        self.rollback_log = RollbackLog()

    # ------------------------------------------------------------------ binding
    def bind(self, geometry: MLRGeometry) -> None:
        """Make this layer hold the hierarchical form of ``geometry`` (before its first write)."""
        if self.geometry == geometry:
            return
        if self.get_seq_length() > 0:
            raise ValueError(geometry_mismatch(self.geometry, geometry))
        if self.is_initialized:  # early_initialization allocated plain buffers: drop them
            self._drop_storage()
        self.geometry = geometry

    @property
    def is_bound(self) -> bool:
        return self.geometry is not None

    # ------------------------------------------------------------------ storage views
    @property
    def rings(self) -> list:
        """Per fine level (B, H, W_l, r_l): views into the one flat fine storage (B, H, sum W_l r_l), transposed (the
        storage is dim-major, see ``fine_storage``). While ``torch.compile`` traces, the views are made from the flat
        storage inside the graph, so that it is the only graph input behind them."""
        if self._fine is not None and torch.compiler.is_compiling():
            return self._fine_views(self._fine, self.capacity)
        return self._ring_views

    @rings.setter
    def rings(self, views: list) -> None:
        self._ring_views = views

    @property
    def fine_storage(self) -> Optional[torch.Tensor]:
        """(B, H, sum_l W_l r_l): every ring, flat (ring l after the rings before it, dim-major: the ``W_l`` entries
        of dim 1, then of dim 2, ...; ``MLRGeometry.fine_layout``). Dim-major, one fine dim of consecutive slots is
        contiguous, so a compiled decode step reads the ring entries of a block of slots with vector loads."""
        return self._fine

    @property
    def ring_widths(self) -> tuple:
        """Entries W_l = min(b_l, capacity) of each ring."""
        return self._ring_widths(self.capacity) if self._fine is not None else ()

    def _ring_widths(self, capacity: int) -> tuple:
        if torch.compiler.is_compiling():  # no attribute writes in a traced step
            return tuple(min(size, capacity) for size in self.geometry.block_sizes)
        cached = self._widths_at  # per-step Python of an eager decode step adds up: computed once per capacity
        if cached is None or cached[0] != capacity or cached[1] is not self.geometry:
            cached = self._widths_at = (capacity, self.geometry, tuple(min(size, capacity) for size in
                                                                       self.geometry.block_sizes))
        return cached[2]

    def _fine_views(self, fine: torch.Tensor, capacity: int) -> list:
        """Per fine level (B, H, W_l, r_l): entry-major views of the dim-major storage ``fine``."""
        return [view.transpose(-1, -2) for view in self._dim_major_views(fine, capacity)]

    def _dim_major_views(self, fine: torch.Tensor, capacity: int) -> list:
        """Per fine level (B, H, r_l, W_l): the rings as stored."""
        views, offset = [], 0
        batch, heads = fine.shape[:2]
        for rank, width in zip(self.geometry.ranks[1:], self._ring_widths(capacity)):
            views.append(fine[..., offset:offset + width * rank].view(batch, heads, rank, width))
            offset += width * rank
        return views

    def _new_fine(self, like: torch.Tensor, capacity: int) -> torch.Tensor:
        elements = sum(w * r for w, r in zip(self._ring_widths(capacity), self.geometry.ranks[1:]))
        return like.new_zeros(like.shape[0], like.shape[1], elements)

    @property
    def alignment(self) -> int:
        """``base`` is a multiple of this (the coarsest fine block), so ring entries line up with slot blocks."""
        return self.geometry.block_sizes[0] if self.geometry.block_sizes else 1

    def allocated_bytes(self) -> int:
        """Bytes of every tensor this layer holds (unique storages)."""
        tensors = [self.keys, self.values, self._fine, self.first_positions, self.last_positions]
        tensors += [getattr(self, "cumulative_length", None)] + list(self.rollback_log.tensors())
        seen, total = set(), 0
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    def key_cache_elements(self) -> int:
        """Key entries per (row, head) of the formula ``S r_1 + sum_l min(b_l, S) r_l`` (S = slots in use for the
        dynamic layer, ``max_cache_len`` for the static one)."""
        if not self.is_initialized or not self.is_bound:
            return 0
        return self.geometry.key_cache_elements(self._held_slots())

    def key_cache_bytes(self) -> int:
        """Bytes of keys by the formula, batch and heads included."""
        if not self.is_initialized or not self.is_bound:
            return 0
        return self.keys.shape[0] * self.keys.shape[1] * self.key_cache_elements() * self.keys.element_size()

    # ------------------------------------------------------------------ the forward's plan
    def planned_storage(self, facts, chunk: int) -> tuple:
        """(base, capacity, value width, key dtype, heads, records) of this layer for a forward of ``chunk`` tokens
        with the step's host ``facts`` (None while tracing), made so now: an allocated dynamic layer grows here, before
        any layer of the forward runs, and a static layer after ``reset`` is placed afresh. An unallocated layer is
        allocated by its first write, to this capacity (only the write sees the key and value widths and their
        dtype): value width, dtype and heads are None then. records: the layer logs what it overwrites (rollback)."""
        if not self.is_initialized:
            base = self._base_for(facts)
            newest = max(facts.newest, base) if facts is not None else 0
            return base, self._initial_capacity(newest - base + 1, base), None, None, None, self._record_past
        if self.base is None:  # a static layer after ``reset``: placed afresh
            self.base = self._base_for(facts)
        cached = self._flat  # (inline: every MLR layer of every forward comes here)
        storages = cached[1] if cached is not None and cached[0] is self._fine else self._storages()
        capacity = storages[0].shape[2]
        if facts is not None:  # the slots in use, and (dynamic) at least the tokens seen: ``keys`` exposes them
            needed = max(facts.newest - self.base + 1, 1)
            if not self.is_static:
                needed = max(needed, facts.tokens_before + chunk)
            if needed > capacity:
                self._ensure_capacity(needed, storages[0], storages[1])
                storages = self._storages()
                capacity = storages[0].shape[2]
        keys = storages[0]
        return self.base, capacity, storages[1].shape[-1], keys.dtype, keys.shape[1], self._record_past

    # ------------------------------------------------------------------ the Cache contract: the one write
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write a chunk of c tokens by this layer's plan and return what its queries read: key_states (B, H, c, r),
        value_states (B, H, c, dv) -> (the chunk's keys in level order (B, H, c, r), ``MLRCacheView``). The step,
        which holds every layer's plan (``MLRStep.layers``, made before the first layer ran), is in the attention
        call's kwargs (``kwargs["kwargs"][STEP_KEY]``, transformers' convention). The layer holds detached states
        written in place. An unbound layer is transformers' plain layer."""
        call = kwargs.get("kwargs")
        if type(call) is not dict or not REFUSED_ARGUMENTS.isdisjoint(call):
            call = _call_kwargs(args, kwargs)  # (a positional dict, ``cache_kwargs``; refused arguments)
        step = None if call is None else call.get(STEP_KEY)
        geometry = self.geometry
        if geometry is None or step is None:
            return self._update_without_plan(key_states, value_states, step, *args, **kwargs)
        layers, index = step.layers, self.layer_index
        plan = layers[index] if index is not None and index < len(layers) else None
        if plan is None:
            raise ValueError(f"MLR cache layer {index}: the step holds no plan for it; a model's forward plans every "
                             f"MLR cache layer before its first layer runs (structattn_prepare.prepare_step)")
        layout = plan.layout
        mlr = layout.plan
        if key_states.shape[-1] != geometry.head_dim:
            raise ValueError(f"MLR cache layer: key width {key_states.shape[-1]} differs from sum(mlr_ranks)="
                             f"{geometry.head_dim}")
        if mlr.positions.shape != key_states.shape[:1] + key_states.shape[2:3]:
            raise ValueError(f"the step has positions of shape {tuple(mlr.positions.shape)} for a chunk of "
                             f"{key_states.shape[2]} tokens in {key_states.shape[0]} rows")
        keys = key_states if mlr.dim_order is None else key_states.index_select(-1, mlr.dim_order)
        keys, value_states, slot_keys, slot_values = self._slot_entries(keys, value_states)
        if not self.is_initialized:
            self._lazy_init(keys, value_states, layout)
        write = self._write_in_step if layout.first_slot is not None else self._write_chunk
        if torch.is_grad_enabled():  # (entering no_grad costs an eager decode step microseconds per layer)
            with torch.no_grad():
                replaced = write(keys.detach(), slot_keys.detach(), slot_values.detach(), layout)
        else:
            replaced = write(keys, slot_keys, slot_values, layout)
        self._advance(mlr.chunk, layout.newest_slot)
        flat = self._flat
        key_storage, value_storage, fine = flat[1] if flat is not None and flat[0] is self._fine else \
            self._storages()
        return keys, tuple.__new__(MLRCacheView, (key_storage, value_storage, fine, keys, value_states, replaced,
                                                  self.cumulative_length, self.first_positions, self.last_positions,
                                                  plan, self.codecs))

    def _slot_entries(self, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        """keys (B, H, c, r) in level order, values (B, H, c, dv) -> (the keys and values as the layer holds them,
        which its queries read; what its level-1 and value slots store: (B, H, c, ·)). The plain layer holds them as
        they come; a quantised one (``structattn_cache_quantized``) rounds them and stores codes."""
        return keys, values, keys[..., :self.geometry.ranks[0]], values

    def _update_without_plan(self, key_states, value_states, step, *args, **kwargs):
        """``update`` of an unbound layer (transformers' plain layer), of a layer written by an attention module that
        hands it no kwargs (GPT-NeoX, Falcon, ...: it keeps full keys), or a refusal."""
        geometry = self.geometry
        if geometry is not None and step is None and not self.is_initialized:
            # the layer cannot learn positions or padding, so it keeps full keys (exact, no saving)
            logger.warning_once("an attention module calls cache.update without kwargs, so the MLR key cache cannot "
                                "see positions or padding: its layers keep full keys (exact, no memory saving)")
            self.geometry = geometry = None
        if geometry is None:
            return super().update(key_states, value_states, *args, **kwargs)
        raise ValueError("the MLR key cache needs the attention call's kwargs (cache.update(k, v, layer_idx, "
                         "kwargs=kwargs)) to place the new tokens")

    def _base_for(self, facts) -> int:
        """``base`` for a first write: the lowest real new position rounded down to the alignment (0 while
        tracing)."""
        lowest = 0 if facts is None or facts.lowest == NO_POSITION else facts.lowest
        return lowest // self.alignment * self.alignment

    def _lazy_init(self, keys, values, layout: CacheLayout) -> None:
        """First write: the base and capacity the layout names, the storage, the spans."""
        batch = keys.shape[0]
        self.base = layout.base
        self.device = keys.device
        self.first_positions = torch.full((batch,), NO_POSITION, dtype=torch.long, device=keys.device)
        self.last_positions = torch.full((batch,), -1, dtype=torch.long, device=keys.device)
        self._allocate(keys, values, layout.capacity)
        self.is_initialized = True
        if self.record_past:
            self._start_log()

    def _write_in_step(self, keys, slot_keys, slot_values, layout: CacheLayout) -> Optional[torch.Tensor]:
        """Rows in step (``MLRPlan.host_write``): the chunk's slots and ring elements are host integers of the
        layout: one token into allocated storages, one ``index_copy_`` per storage into its flat (B, H, 1, ·) view;
        several (or a first write), narrowed copies and one indexed assignment of the ring elements. Returns the
        replaced ring entries (B, H, c, F) of a chunk of several tokens (the general read needs them), else None."""
        plan = layout.plan
        chunk, rank = plan.chunk, self.geometry.ranks[0]
        batch, heads = keys.shape[:2]
        cached = self._flat  # (inline: every layer of every decode step comes here)
        storages, (flat_keys, flat_values, flat_fine) = cached[1:] if cached is not None and cached[0] is self._fine \
            else self._flat_views()
        finer = keys[..., rank:] if layout.fine_index is not None else None
        replaced = None
        if finer is not None and (chunk > 1 or self._record_past):
            replaced = flat_fine.index_select(3, layout.fine_index).view(batch, heads, chunk, -1)
        if self._record_past:
            self.rollback_log.append(replaced if replaced is not None else keys.new_zeros(batch, heads, chunk, 0),
                                     plan.positions, plan.real, self.rollback_window, True)
        if layout.key_index is not None and self.codecs is None:  # a decode step: one index_copy_ per storage
            flat_keys.index_copy_(3, layout.key_index, slot_keys)
            flat_values.index_copy_(3, layout.value_index, slot_values)
            if finer is not None:
                flat_fine.index_copy_(3, layout.fine_index, finer)
        else:  # consecutive slots, or rows of codes: narrowed copies; the ring elements (c, F) by one assignment
            key_storage, value_storage, fine = storages
            key_storage.narrow(2, layout.first_slot, chunk).copy_(slot_keys)
            value_storage.narrow(2, layout.first_slot, chunk).copy_(slot_values)
            if finer is not None:
                fine[:, :, layout.fine_index.view(chunk, -1)] = finer
        self.last_positions.fill_(plan.first + chunk - 1)
        return replaced if chunk > 1 else None

    def _flat_views(self) -> tuple:
        """((keys (B, H, C, r_1), values (B, H, C, dv), fine (B, H, F)): the whole storages, and the same as
        (B, H, 1, ·) flat views), made again when the storages were replaced (growth, reordering, offloading: every
        one replaces all three, the ring storage included) and kept in ``_flat`` (the view ``update`` returns reads
        it). The storages are contiguous (every allocation and row operation makes them so)."""
        cached = self._flat
        if cached is not None and cached[0] is self._fine:
            return cached[1:]
        storages = self.keys_storage(), self.values_storage(), self._fine
        batch, heads = storages[0].shape[:2]
        views = tuple(tensor.reshape(batch, heads, 1, -1) for tensor in storages)
        if not torch.compiler.is_compiling():  # (no attribute writes in a traced step)
            self._flat = (self._fine, storages, views)
        return storages, views

    def _storages(self) -> tuple:
        """(keys (B, H, C, r_1), values (B, H, C, dv), fine (B, H, F)): the whole storages (no flat views made)."""
        cached = self._flat
        if cached is not None and cached[0] is self._fine:
            return cached[1]
        return self.keys_storage(), self.values_storage(), self._fine

    def _write_chunk(self, keys, slot_keys, slot_values, layout: CacheLayout) -> Optional[torch.Tensor]:
        """Every real token of a chunk into its slot and ring entries (padding is not stored: see ``ChunkWrite``)
        with indexed assignments, which need no host reads and keep fixed shapes (what a traced step runs). Returns
        the ring entries of each token's own position as they were before the chunk (B, H, c, F) for a chunk of
        several tokens into a layer that held tokens, else None."""
        plan, write = layout.plan, layout.chunk_write
        batch, heads, chunk, _ = keys.shape
        rank = self.geometry.ranks[0]
        rows = write.rows
        replaced = None
        if write.own_element is not None and ((chunk > 1 and plan.held) or self.record_past):
            flat = write.own_element.reshape(batch, 1, -1).expand(batch, heads, write.own_element[0].numel())
            replaced = self._fine.gather(2, flat).view(batch, heads, chunk, -1)
        if self.record_past:
            fine = keys[..., rank:]
            if write.log_source is not None:
                source = write.log_source.clamp(min=0)[:, None].expand(batch, heads, chunk, fine.shape[-1])
                earlier = fine.gather(2, source)
                logged = torch.where((write.log_source >= 0)[:, None], earlier, replaced)
            elif replaced is not None:  # a chunk shorter than every block: no token overwrites another's entry
                logged = replaced
            else:
                logged = keys.new_zeros(batch, heads, chunk, 0)
            self.rollback_log.append(logged, plan.positions, plan.real, self.rollback_window, plan.all_real)
        new_keys = slot_keys.transpose(1, 2) if write.column is None else slot_keys[rows, :, write.column]
        new_values = slot_values.transpose(1, 2) if write.column is None else slot_values[rows, :, write.column]
        if write.keep is not None:  # rows without a real token write back what their slots hold
            keep = write.keep[:, None, None, None]
            new_keys = torch.where(keep, self.keys_storage()[rows, :, write.slot], new_keys)
            new_values = torch.where(keep, self.values_storage()[rows, :, write.slot], new_values)
        self.keys_storage()[rows, :, write.slot] = new_keys  # (B, c, H, r_1): advanced indices come first
        self.values_storage()[rows, :, write.slot] = new_values
        if write.fine_element is not None:
            fine = keys[..., rank:]  # (B, H, c, F)
            if write.fine_column is not None:
                fine = fine.gather(2, write.fine_column[:, None].expand(batch, heads, chunk, fine.shape[-1]))
            fine = fine.permute(0, 2, 3, 1)  # (B, c, F, H)
            if write.keep is not None:
                fine = torch.where(write.keep[:, None, None, None],
                                   self._fine[rows[:, :, None], :, write.fine_element], fine)
            self._fine[rows[:, :, None], :, write.fine_element] = fine
        self.last_positions.copy_(write.last_after)
        self.first_positions.copy_(write.first_after)
        return replaced if chunk > 1 and plan.held else None

    # ------------------------------------------------------------------ batch operations (beam search etc.)
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_rows(lambda t: t[indices, ...])

    def _apply_rows(self, fn) -> None:
        if not self.is_bound:
            if self.get_seq_length() > 0:
                self.keys, self.values = fn(self.keys), fn(self.values)
            return
        if not self.is_initialized:
            return
        self._apply_storage(fn)
        self.first_positions, self.last_positions = fn(self.first_positions), fn(self.last_positions)
        self.rollback_log.apply(fn)

    def offload(self):
        if self.is_initialized and self.is_bound:
            self._apply_storage(lambda t: t.to("cpu", non_blocking=True))
        elif self.is_initialized:
            super().offload()

    def prefetch(self):
        if self.is_initialized and self.is_bound and self.keys.device != self.device:
            self._apply_storage(lambda t: t.to(self.device, non_blocking=True))
        elif self.is_initialized and not self.is_bound:
            super().prefetch()


def _call_kwargs(args, kwargs) -> Optional[dict]:
    """The attention call's kwargs handed to ``update`` (``kwargs=kwargs`` in transformers' attention modules; a
    positional dict or ``cache_kwargs`` too), or None, after refusing what MLR attention refuses there (so that a
    refused call leaves the cache as it was)."""
    call = kwargs.get("kwargs")
    if call is None and args and isinstance(args[0], dict):
        call = args[0]
    if call is None:
        call = kwargs.get("cache_kwargs")
    if not isinstance(call, dict):
        return None
    if call.get(STEP_KEY) is not None and not REFUSED_ARGUMENTS.isdisjoint(call):
        refuse_unsupported_arguments(call)
    return call


class MLRKeyCacheLayer(MLRCacheLayerMixin, DynamicLayer):
    """Dynamic MLR cache layer (``layer_types`` entry ``"mlr_attention"``). Storage is reserved ahead (exactly what
    ``reserve`` asks for, e.g. generate's final length; otherwise ``max(16, S/32)`` slots more than needed) and
    written in place; rings grow with the capacity up to ``b_l``."""

    _layer_type = "mlr_attention"

    def __init__(self, geometry: Optional[MLRGeometry] = None, **kwargs):
        super().__init__()
        self._init_state()
        self._storage = None  # (keys (B, H, C, r1), values (B, H, C, dv))
        self._used = 0  # slots in use: max over rows of last position - base + 1
        self._reserved = None
        self.cumulative_length = 0  # tokens seen (padding included): transformers' sequence length
        if geometry is not None:
            self.bind(geometry)

    def reserve(self, positions: int) -> None:
        """Allocate exactly enough slots for ``positions`` positions from ``base`` on the next growth (generate
        knows its final length)."""
        self._reserved = int(positions)

    def _initial_capacity(self, needed: int, base: int) -> int:
        """The capacity of a first write of ``needed`` slots from ``base`` on."""
        if torch.compiler.is_compiling():
            raise ValueError("a dynamic MLR cache cannot be filled inside a compiled region; use the static cache "
                             "(cache_implementation='static') with torch.compile")
        return self._grown_capacity(max(needed, 1), base)

    def _grown_capacity(self, needed: int, base: int) -> int:
        if self._reserved is not None and self._reserved - base >= needed:
            return self._reserved - base
        return needed + max(MIN_GROWTH, needed // 32)

    def _allocate(self, like_keys, like_values, capacity: int) -> None:
        batch, heads = like_keys.shape[:2]
        self._storage = (like_keys.new_zeros(batch, heads, capacity, self.geometry.ranks[0]),
                         like_values.new_zeros(batch, heads, capacity, like_values.shape[-1]))
        self._fine = self._new_fine(like_keys, capacity)
        self.rings = self._fine_views(self._fine, capacity)
        self._used = 0

    @property
    def capacity(self) -> int:
        return self._storage[0].shape[-2]

    def _ensure_capacity(self, slots: int, like_keys, like_values) -> None:
        capacity = self.capacity
        if slots <= capacity:
            return
        old_storage, old_rings, used = self._storage, self.rings, self._used
        self._allocate(like_keys, like_values, self._grown_capacity(slots, self.base))
        for old, new in zip(old_storage, self._storage):
            new.narrow(2, 0, capacity).copy_(old)
        for old, new in zip(old_rings, self.rings):
            if old.shape[-2] == new.shape[-2]:
                new.copy_(old)
            else:  # a ring that grew (capacity was below b_l): entries keep their index (position - base)
                new.narrow(2, 0, old.shape[-2]).copy_(old)
        self._used = used

    def keys_storage(self) -> torch.Tensor:
        return self._storage[0]

    def values_storage(self) -> torch.Tensor:
        return self._storage[1]

    def _held_slots(self) -> int:
        if self._used is None:  # after a crop: read once, outside the forwards
            self._used = max(int(self.last_positions.max()) - self.base + 1, 0) if self.last_positions.numel() else 0
        return self._used

    def _advance(self, chunk: int, newest_slot: Optional[int]) -> None:
        self.cumulative_length += chunk
        if newest_slot is not None:  # the step's facts: the rows' newest position after the write, over all rows
            self._used = newest_slot

    def _rewind(self, tokens: int) -> None:
        # the slots in use after a crop are known at the next write (its step reads the rows' newest positions);
        # reading them here would cost a host read per layer and crop
        self.cumulative_length -= tokens
        self._used = None

    # ``keys`` / ``values`` as transformers' layers expose what they hold: the slots in use, or the tokens seen when
    # more (padding included; a dynamic layer's capacity covers both), so that two caches holding the same tokens
    # expose the same tensors whatever they reserved; views made when read (the forwards read the storage through
    # ``store``'s view)
    @property
    def keys(self):
        return self._exposed(0) if self._storage is not None else self._plain[0]

    @keys.setter
    def keys(self, value) -> None:
        self._plain = (value, getattr(self, "_plain", (None, None))[1])

    @property
    def values(self):
        return self._exposed(1) if self._storage is not None else self._plain[1]

    @values.setter
    def values(self, value) -> None:
        self._plain = (getattr(self, "_plain", (None, None))[0], value)

    def _exposed(self, index: int) -> torch.Tensor:
        return self._storage[index].narrow(2, 0, min(max(self._held_slots(), self.cumulative_length), self.capacity))

    def _drop_storage(self) -> None:
        self._storage = None
        self.keys = self.values = None
        self.is_initialized = False

    def get_seq_length(self) -> int:
        if self.geometry is None:  # (not ``is_bound``: every forward asks every layer)
            return super().get_seq_length()
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def _apply_storage(self, fn) -> None:
        self._storage = tuple(fn(tensor) for tensor in self._storage)
        self._fine = fn(self._fine)
        self.rings = self._fine_views(self._fine, self.capacity)
        self.contiguous = all(tensor.is_contiguous() for tensor in self._storage + (self._fine,))

    def reset(self) -> None:
        if not self.is_bound:
            return super().reset()
        geometry = self.geometry
        self._init_state()
        self._storage, self._used, self.cumulative_length = None, 0, 0
        self.keys = self.values = None
        self.is_initialized = False
        self.geometry = geometry


class MLRStaticKeyCacheLayer(MLRCacheLayerMixin, StaticLayer):
    """Fixed-shape MLR cache layer (``cache_implementation="static"``, ``StaticCache``; what ``torch.compile`` and
    ``torch.export`` want): ``max_cache_len`` slots and rings of ``min(b_l, max_cache_len)`` entries, allocated once
    (at the first write, or by ``early_initialization``, then with ``base`` 0) and written in place. Positions must
    stay below ``base + max_cache_len``."""

    _layer_type = "mlr_attention"
    is_static = True

    def __init__(self, max_cache_len: int, geometry: Optional[MLRGeometry] = None, rollback_tokens: int = 64,
                 **kwargs):
        super().__init__(max_cache_len=max_cache_len)
        self._init_state()
        self.rollback_tokens = int(rollback_tokens)
        if geometry is not None:
            self.bind(geometry)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, **kwargs) -> None:
        """``Cache.early_initialization`` (what transformers' export recipes call): the MLR storage, base 0."""
        if not self.is_bound:
            return super().lazy_initialization(key_states, value_states, **kwargs)
        batch = key_states.shape[0]
        self.base = 0
        self.device = key_states.device
        self.first_positions = torch.full((batch,), NO_POSITION, dtype=torch.long, device=key_states.device)
        self.last_positions = torch.full((batch,), -1, dtype=torch.long, device=key_states.device)
        self._allocate(key_states, value_states, self.max_cache_len)
        self.is_initialized = True

    def _initial_capacity(self, needed: int, base: int) -> int:
        return self.max_cache_len

    def _allocate(self, like_keys, like_values, capacity: int) -> None:
        batch, heads = like_keys.shape[:2]
        self.keys = like_keys.new_zeros(batch, heads, capacity, self.geometry.ranks[0])
        self.values = like_values.new_zeros(batch, heads, capacity, like_values.shape[-1])
        self._fine = self._new_fine(like_keys, capacity)
        self.rings = self._fine_views(self._fine, capacity)
        self.cumulative_length = self.cumulative_length.to(like_keys.device)
        if not torch.compiler.is_compiling():
            for tensor in (self.keys, self.values, self._fine, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)

    @property
    def capacity(self) -> int:
        return self.max_cache_len

    def _ensure_capacity(self, slots: int, like_keys, like_values) -> None:
        if slots > self.max_cache_len:
            raise ValueError(f"the static MLR cache holds positions base..base + max_cache_len - 1 = {self.base}.."
                             f"{self.base + self.max_cache_len - 1}; a write needs position {self.base + slots - 1}")

    def keys_storage(self) -> torch.Tensor:
        return self.keys

    def values_storage(self) -> torch.Tensor:
        return self.values

    def _held_slots(self) -> int:
        return self.max_cache_len

    def _advance(self, chunk: int, newest_slot: Optional[int]) -> None:
        self.cumulative_length.add_(chunk)

    def _rewind(self, tokens: int) -> None:
        self.cumulative_length.sub_(tokens)

    def _drop_storage(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def get_seq_length(self):
        if self.geometry is None:
            return super().get_seq_length()
        return self.cumulative_length if self.is_initialized else 0

    def _apply_storage(self, fn) -> None:
        self.keys, self.values, self._fine = fn(self.keys), fn(self.values), fn(self._fine)
        self.rings = self._fine_views(self._fine, self.max_cache_len)
        self.contiguous = all(tensor.is_contiguous() for tensor in (self.keys, self.values, self._fine))

    def reset(self) -> None:
        if not self.is_bound:
            return super().reset()
        if self.is_initialized:
            for tensor in (self.keys, self.values, self._fine):
                tensor.zero_()
            self.first_positions.fill_(NO_POSITION)
            self.last_positions.fill_(-1)
            self.base = None  # placed afresh by the next write (its positions may start lower or higher)
        self.cumulative_length.zero_()
        self.rollback_log.clear()


MLR_CACHE_LAYERS = (MLRKeyCacheLayer, MLRStaticKeyCacheLayer)


__all__ = ["MLRCacheView", "MLRKeyCacheLayer", "MLRStaticKeyCacheLayer", "MLR_CACHE_LAYERS"]
