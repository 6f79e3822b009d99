"""The hierarchical MLR key cache: storage only. The attention math over it lives in ``structattn_mlr_decode``.

An MLR cache layer holds, per batch row and KV head:

* level-1 keys (``r_1`` dims) and values of every position, in **position-aligned slots**: position ``p`` lives in
  slot ``p - base`` (``base`` is a multiple of the coarsest fine block ``b_2``, fixed at the first write). Padding
  tokens are not stored; a row is the contiguous span ``[first, last]`` of its real positions (``first_positions``,
  ``last_positions``: (B,)), so no per-slot flags or positions are kept.
* per finer level l >= 2 a ring of ``W_l = min(b_l, capacity)`` keys of ``r_l`` dims: position ``p`` is written to
  entry ``(p - base) % b_l``. The entries of the current level-l block of a row therefore sit at the same offsets
  as the block's slots: the block ``[s, s + b_l)`` of slots maps onto entries ``[0, b_l)``, so a decode query adds
  its ring scores to one contiguous run of slots (or, for rows in different blocks, a reshaped broadcast with no
  scatter; see ``structattn_mlr_decode``). Entries beyond a row's newest position are stale and masked as future.

Key entries held per (row, head): ``S r_1 + sum_l min(b_l, S) r_l`` for S slots (``MLRGeometry.key_cache_elements``).

A layer is built without geometry (``DynamicCache(config=...)`` and ``StaticCache`` construct registered layer types
with no arguments) and behaves as transformers' ``DynamicLayer`` / ``StaticLayer`` until a model ``bind``s it to
its ``MLRGeometry`` before the first write (``prepare_structattn_cache``): T5 builds its cross-attention cache from
the same config, and those layers stay plain.

Per-call information travels in the forward kwargs as ``StructAttnStep`` under ``STEP_KEY``: the model forward
creates it (positions and padding flags of the new tokens, the self-attention cache), every attention module hands
its kwargs to ``cache.update(..., kwargs=kwargs)`` (transformers' convention) and to the attention function, so the
layer reads where to write and the attention function finds the layer it attends over.

Rollback (speculative decoding): transformers calls ``activate_past_recording()`` before it may ``crop``. While
recording, each write logs what it overwrites (ring entries, the token's position and realness) until the next
``crop``; ``crop(-n)`` restores the last n tokens exactly and ``crop(0)`` drops the log. The extra memory is
``O(tokens since the last crop)``: ``(2 + H sum_{l>=2} r_l)`` values per row and token. Without recording only
``crop(0)`` is accepted.
"""

import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache, StaticLayer

from .structattn_geometry import MLRGeometry

STEP_KEY = "structattn_step"
NO_POSITION = torch.iinfo(torch.int64).max // 4  # ``first_positions`` of a row with no real token yet
_WARNED_WITHOUT_KWARGS = set()
_WARNED_BEHIND: list = []
MIN_GROWTH = 16  # dynamic layers grow by max(MIN_GROWTH, S/32) slots when no length was reserved


@dataclass
class StructAttnStep:
    """What a model forward tells its MLR layers about one call (passed down in kwargs under ``STEP_KEY``).

    cache: the self-attention ``Cache`` of this call or None; positions: (B, c) absolute positions of the new
    tokens or None (continue each row after its newest real position); valid: (B, c) bool, True = real token, or
    None (all real). ``plans`` memoises per-geometry index tensors shared by the layers of one call.
    ``standard_masks``: the model's masks were built by transformers from no mask or a 2-D keep-mask."""

    cache: Optional[Cache] = None
    positions: Optional[torch.Tensor] = None
    valid: Optional[torch.Tensor] = None
    plans: dict = field(default_factory=dict)
    # the caller gave no mask or a 2-D keep-mask, so every 4-D mask the model built is transformers' causal (or
    # bidirectional) + padding mask: layers over the MLR cache need not compare it with one
    standard_masks: bool = False
    # the caller's 2-D keep-mask over the cached and new tokens, or None: only a row that holds padding after a real
    # token may continue behind its newest cached position (right padding in generate); other restarts are refused
    key_mask: Optional[torch.Tensor] = None

    def layer(self, layer_idx: Optional[int]):
        """The cache layer of ``layer_idx``, or None."""
        cache = self.cache
        if cache is None or layer_idx is None or layer_idx >= len(cache.layers):
            return None
        return cache.layers[layer_idx]


def new_token_validity(mask: Optional[torch.Tensor], past, length: int) -> Optional[torch.Tensor]:
    """(B, T) padding flags of the new tokens from a 2-D keep-mask or transformers' 4-D mask (a new token is real
    iff its own key is allowed: the diagonal of its rows, at column ``past + i``), or None."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask[:, -length:].bool()
    if mask.dim() != 4 or mask.shape[-2] != length:
        return None
    rows = torch.arange(length, device=mask.device)
    own = mask[:, 0][:, rows, rows + past]
    if own.dtype == torch.bool:
        return own
    return own > torch.finfo(own.dtype).min / 2 if own.is_floating_point() else own != 0


def self_attention_cache(cache: Optional[Cache]) -> Optional[Cache]:
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


@dataclass
class PendingChunk:
    """What the last ``update`` wrote, for the attention call that follows it (which drops it). keys: (B, H, c, r)
    full-width keys in level order; values: (B, H, c, dv); positions: (B, c); valid: (B, c) bool; last_before: (B,) newest real position before the chunk;
    rings_before: the fine storage before the chunk (only for c > 1, whose writes may overwrite entries its own
    earlier queries read); had_past: the layer held tokens before the chunk."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    last_before: torch.Tensor
    rings_before: Optional[torch.Tensor]
    had_past: bool
    # eager decode write (no padding, every row continuing): newest real position - base + 1 over the rows, and the
    # host values the read's plan needs (newest position of every row when they are equal, else None; the rows'
    # latest first position), so that it reads nothing back
    slots_in_use: Optional[int] = None
    shared_newest: Optional[int] = None
    latest_first: Optional[int] = None


class MLRCacheLayerMixin:
    """Storage shared by ``MLRKeyCacheLayer`` (dynamic) and ``MLRStaticKeyCacheLayer`` (static). Subclasses provide
    ``_allocate(like_keys, like_values, capacity)``, ``_ensure_capacity(slots, like_keys, like_values)`` and
    ``_capacity()``."""

    geometry: Optional[MLRGeometry] = None
    # the most tokens a crop can remove (the rollback log keeps what the last ``rollback_window`` writes replaced);
    # None: everything written since the last crop. ``generate`` sets it from the draft length of speculative decoding
    rollback_window: Optional[int] = None

    def _init_state(self) -> None:
        self.geometry = None
        self.base = None
        self.first_positions = self.last_positions = None
        self._fine = None
        self._widths_at = None  # (capacity, geometry, ring widths) of the last ``_ring_widths`` call
        self.rings = []
        self.pending = None
        self._record_past = False
        self._log = []  # dynamic: one (valid, positions, old fine entries) triple per update since the last crop

    # ------------------------------------------------------------------ binding
    def bind(self, geometry: MLRGeometry) -> None:
        """Make this layer hold the hierarchical form of ``geometry`` (before its first write)."""
        if self.geometry == geometry:
            return
        if self.get_seq_length() > 0:
            raise ValueError("an MLR cache layer can only be bound to its geometry before its first write")
        if self.is_initialized:  # early_initialization allocated plain buffers: drop them
            self._drop_storage()
        self.geometry = geometry

    @property
    def is_bound(self) -> bool:
        return self.geometry is not None

    # ------------------------------------------------------------------ storage helpers
    @property
    def rings(self) -> list:
        """Per fine level (B, H, W_l, r_l): views into the one flat fine storage ``_fine`` (B, H, sum W_l r_l),
        transposed (the storage is dim-major, see ``fine_storage``).

        While ``torch.compile`` traces, the views are made from ``_fine`` inside the graph, so ``_fine`` is the only
        graph input behind them: stored views would each become an input aliasing the others, and the decode step
        writes through them, which makes AOTAutograd rebuild their base with ``Tensor.set_`` (it fails once the batch
        size is symbolic)."""
        if self._fine is not None and torch.compiler.is_compiling():
            return self._fine_views(self._fine, self._capacity())
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
    def ring_widths(self) -> list:
        """Entries W_l = min(b_l, capacity) of each ring."""
        return self._ring_widths(self._capacity()) if self._fine is not None else []

    def _ring_widths(self, capacity: int) -> list:
        if torch.compiler.is_compiling():  # no attribute writes in a traced step
            return [min(size, capacity) for size in self.geometry.block_sizes]
        cached = self._widths_at  # per-step Python of an eager decode step adds up: computed once per capacity
        if cached is None or cached[0] != capacity or cached[1] is not self.geometry:
            cached = self._widths_at = (capacity, self.geometry, [min(size, capacity) for size in
                                                                  self.geometry.block_sizes])
        return cached[2]

    def _fine_views(self, fine: torch.Tensor, capacity: int) -> list:
        """Per fine level (B, H, W_l, r_l): entry-major views of the dim-major storage ``fine``."""
        return [view.transpose(-1, -2) for view in self._dim_major_views(fine, capacity)]

    def _dim_major_views(self, fine: torch.Tensor, capacity: int) -> list:
        """Per fine level (B, H, r_l, W_l): the rings as stored (what an in-place write traced by torch.compile must
        go through: AOTAutograd cannot replay a write through the transposed views)."""
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
        tensors += [getattr(self, "cumulative_length", None)] + list(self._log_tensors())
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

    # ------------------------------------------------------------------ the Cache contract
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store c new tokens; return (level-1 keys (B, H, S, r_1), values (B, H, S, dv)) over the slots in use (the
        static layer: all ``max_cache_len`` slots, like ``StaticLayer``). key_states: (B, H, c, r) full-width keys in
        the model's head-dim order; value_states: (B, H, c, dv). The new tokens' positions and padding come from
        ``kwargs["kwargs"][STEP_KEY]`` (a ``StructAttnStep``; default: real tokens continuing each row)."""
        step = _step_of(args, kwargs)
        if self.is_bound and step is None and not self.is_initialized:
            # the attention module calls cache.update without its kwargs (GPT-NeoX, Falcon, ...): the layer cannot
            # learn positions or padding, so it keeps full keys (exact, no saving)
            if type(self) not in _WARNED_WITHOUT_KWARGS:
                _WARNED_WITHOUT_KWARGS.add(type(self))
                warnings.warn("an attention module calls cache.update without kwargs, so the MLR key cache cannot "
                              "see positions or padding: its layers keep full keys (exact, no memory saving)",
                              stacklevel=3)
            self.geometry = None
        if not self.is_bound:
            return super().update(key_states, value_states, *args, **kwargs)
        if step is None:
            raise ValueError("the MLR key cache needs the attention call's kwargs (cache.update(k, v, layer_idx, "
                             "kwargs=kwargs)) to place the new tokens")
        geometry = self.geometry
        batch, _, chunk, width = key_states.shape
        if width != geometry.head_dim:
            raise ValueError(f"MLR cache layer: key width {width} differs from sum(mlr_ranks)={geometry.head_dim}")
        order = geometry.dim_order_index(key_states.device)
        if order is not None:
            key_states = key_states.index_select(-1, order)
        if chunk == 1 and self.is_initialized and not self.record_past:
            if torch.compiler.is_compiling():
                plan = self._compiled_decode_plan(step, batch, key_states.device)
                with torch.no_grad():
                    self._put_one_token(key_states.detach(), value_states.detach(), plan["rows"], plan["slot"],
                                        plan["valid"][:, 0], plan["fine index"])
                    self.last_positions.copy_(torch.maximum(self.last_positions, plan["newest"]))
                    self.first_positions.copy_(torch.minimum(self.first_positions, plan["oldest"]))
                    self._advance(1)
                self.pending = PendingChunk(key_states, value_states, plan["positions"], plan["valid"],
                                            plan["last_before"], None, True)
                return self.keys, self.values
            plan = self._decode_write_plan(step, batch, key_states.device)
            if plan is not None:
                if torch.is_grad_enabled():
                    with torch.no_grad():  # copies into the buffers: nothing recorded, no detach needed
                        self._decode_write(plan, key_states, value_states)
                else:  # generate: skip the context manager's cost
                    self._decode_write(plan, key_states, value_states)
                self.pending = PendingChunk(key_states, value_states, plan["positions"], plan["valid"],
                                            plan["last_before"], None, True, plan["needed"], plan["shared newest"],
                                            plan["latest first"])
                return self.keys, self.values
        positions, valid = self._new_token_positions(step, batch, chunk, key_states.device)
        if not self.is_initialized:
            self._lazy_init(key_states, value_states, positions, valid)
        had_past = True if torch.compiler.is_compiling() else bool(self.get_seq_length() > 0)
        last_before = self.last_positions.clone()
        with torch.no_grad():  # the cache holds detached states written in place
            rings_before = self._write(key_states.detach(), value_states.detach(), positions, valid,
                                       keep_rings_before=chunk > 1 and had_past)
        self.pending = PendingChunk(key_states, value_states, positions, valid, last_before, rings_before, had_past)
        return self.keys, self.values

    def _decode_write_plan(self, step, batch: int, device) -> Optional[dict]:
        """What an eager decode step (one real token per row, continuing each row) writes, worked out once per model
        forward and shared by its MLR layers of this geometry (they hold the same positions): one host read per step
        instead of several per layer. None: the general path (padding in the step, a row not continuing, the first
        write)."""
        key = ("decode write", self.geometry, self.base, batch)
        plan = step.plans.get(key)
        if plan is not None:
            return plan or None
        step.plans[key] = {}
        if self.last_positions is None or self.last_positions.shape[0] != batch or batch == 0:
            return None
        last = self.last_positions
        if step.positions is None:
            position = last + 1
        else:
            position = step.positions.to(device=device, dtype=torch.long).expand(batch, 1)[:, 0]
        rows = [position, last, self.first_positions]
        rows += [step.valid.to(device).reshape(batch).long()] if step.valid is not None else []
        # one host read per step, and the checks in Python: a few tensor ops less per step
        reads = torch.stack(rows).tolist()
        real = reads[3] if step.valid is not None else [1] * batch
        if not all(is_real and newest >= 0 and new == newest + 1
                   for new, newest, is_real in zip(reads[0], reads[1], real)):
            return None
        newest, oldest = max(reads[0]), min(reads[0])
        slot = position - self.base
        shared_slot = newest - self.base if newest == oldest else None
        # every row continuing holds a real token already (first <= last < position): first_positions stay
        plan = {"positions": position[:, None], "valid": torch.ones(batch, 1, dtype=torch.bool, device=device),
                "last_before": last.clone(), "slot": slot, "shared slot": shared_slot,
                "rows": torch.arange(batch, device=device) if shared_slot is None else None,
                "needed": newest - self.base + 1, "last": position, "fine index": {},
                "shared newest": newest if newest == oldest else None, "latest first": max(reads[2])}
        step.plans[key] = plan
        return plan

    def _compiled_decode_plan(self, step, batch: int, device) -> dict:
        """The decode write of a compiled step (no host reads: padding tokens write back what their slot holds),
        traced once per forward and shared by the MLR layers of this geometry (keyed by plain tuples, which Dynamo
        traces)."""
        geometry = self.geometry
        key = ("compiled decode write", geometry.ranks, geometry.block_sizes, batch)
        plan = step.plans.get(key)
        if plan is None:
            positions, valid = self._new_token_positions(step, batch, 1, device)
            slot = (positions[:, 0] - self.base).clamp(min=0, max=self._capacity() - 1)
            plan = step.plans[key] = {
                "positions": positions, "valid": valid, "slot": slot, "rows": torch.arange(batch, device=device),
                "fine index": self._fine_index(slot) if geometry.block_sizes else None,
                "last_before": self.last_positions.clone(),
                "newest": torch.where(valid[:, 0], positions[:, 0], torch.full_like(slot, -1)),
                "oldest": torch.where(valid[:, 0], positions[:, 0], torch.full_like(slot, NO_POSITION))}
        return plan

    def _decode_write(self, plan: dict, key_states, value_states) -> None:
        """One token per row into its slot and ring entries (every row's token is real)."""
        self._ensure_capacity(max(plan["needed"], self._view_length(1)), key_states, value_states)
        widths = tuple(self.ring_widths)
        shared_slot = plan["shared slot"]
        if widths not in plan["fine index"]:
            index = self._fine_index(plan["slot"])  # (B, sum_{l>=2} r_l)
            plan["fine index"][widths] = index if shared_slot is None else index[0]
        if shared_slot is None:
            self._put_one_token(key_states, value_states, plan["rows"], plan["slot"], None, plan["fine index"][widths])
        else:
            self._put_at_slot(key_states, value_states, shared_slot, plan["fine index"][widths])
        self.last_positions.copy_(plan["last"])
        self._advance_decoded(plan["needed"])
        self._refresh_views()

    def _fine_index(self, slot: torch.Tensor) -> torch.Tensor:
        """(B, sum_{l>=2} r_l): the elements of the flat fine storage a token at slot ``slot`` (B,) writes: dim j of
        level l goes to element ``o_l + j W_l + slot % b_l`` (dim j of entry ``slot % b_l`` of ring l)."""
        layout = self.geometry.fine_layout(self.ring_widths, slot.device)
        return layout["element offset"] + slot[:, None] % layout["element block"]

    def _put_at_slot(self, key_states, value_states, slot: int, fine_index: torch.Tensor) -> None:
        """Write one token per row, every row's into slot ``slot`` (key_states (B, H, 1, r)): the eager decode step
        without padding, where a narrowed copy and one ``index_copy_`` of the fine dims (``fine_index``
        (sum_{l>=2} r_l,), the elements ``_fine_index`` gives for this slot) cost a few small ops, where indexed
        assignments with index tensors cost several each."""
        rank = self.geometry.ranks[0]
        self.keys_storage().narrow(2, slot, 1).copy_(key_states[..., :rank])
        self.values_storage().narrow(2, slot, 1).copy_(value_states)
        if self.geometry.block_sizes:
            self._fine.index_copy_(2, fine_index, key_states[:, :, 0, rank:])

    def _put_one_token(self, key_states, value_states, rows, slot, valid, fine_index) -> None:
        """Write one token per row (key_states (B, H, 1, r), slot (B,)) with indexed assignments, which inductor
        performs in place on the cache's buffers (a ``scatter_`` there makes it copy whole storages every step).
        ``valid`` (B,) bool or None (all real): a padding token writes back what its slot holds."""
        rank = self.geometry.ranks[0]
        parts = [(self.keys_storage(), rows, slot, key_states[:, :, 0, :rank]),
                 (self.values_storage(), rows, slot, value_states[:, :, 0])]
        if self.geometry.block_sizes:  # (B, sum r_l, H): advanced indices before the sliced head axis come first
            parts.append((self._fine, rows[:, None], fine_index, key_states[:, :, 0, rank:].transpose(1, 2)))
        for storage, row_index, column_index, new in parts:
            if valid is not None:
                keep = valid.view(-1, *([1] * (new.dim() - 1)))
                new = torch.where(keep, new, storage[row_index, :, column_index])
            storage[row_index, :, column_index] = new

    def _new_token_positions(self, step, batch: int, chunk: int, device):
        positions = valid = None
        if step is not None:
            positions, valid = step.positions, step.valid
        if valid is None:
            valid = torch.ones(batch, chunk, dtype=torch.bool, device=device)
        elif valid.shape != (batch, chunk):
            raise ValueError(f"the padding flags of the new tokens have shape {tuple(valid.shape)}, expected "
                             f"({batch}, {chunk})")
        if positions is None:  # continue each row after its newest real token (T5 counts real tokens)
            last = self.last_positions if self.last_positions is not None else \
                torch.full((batch,), -1, dtype=torch.long, device=device)
            positions = last[:, None] + valid.long().cumsum(-1)
        elif positions.shape[-1] != chunk or positions.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must have shape ({batch}, {chunk}) for {chunk} new tokens, got "
                             f"{tuple(positions.shape)}")
        positions = positions.to(device=device, dtype=torch.long).expand(batch, chunk)
        valid = valid.to(device=device)
        if self.last_positions is not None:
            positions = self._continue_rows_behind(positions, valid, None if step is None else step.key_mask)
        return positions, valid

    def _continue_rows_behind(self, positions, valid, key_mask=None):
        """Rows whose new real tokens start at or before the row's newest cached position: the signature of right
        padding in ``generate`` (transformers gives the first generated token position ``0 + 1`` after a padded
        tail). A position-addressed hierarchical cache cannot hold two tokens at one position, so such a row's new
        tokens continue right after its newest cached token (MLR blocks follow the row's real tokens in order; the
        model's position embeddings still see the given ``position_ids``); uncached MLR attention places them the
        same way (``structattn_attention._checked_positions``), so cached and uncached agree. Warned once: the
        row's generated tokens then follow its padding, which is why transformers asks for left padding. Only a row
        whose cached tokens hold padding after a real token (the caller's 2-D ``key_mask`` over the cached and new
        tokens) is continued: a row that restarts or goes back without such padding is a packed sequence, refused
        by ``_check_contiguous``."""
        first_new = torch.where(valid, positions, torch.full_like(positions, NO_POSITION)).amin(-1)
        behind = (self.last_positions >= 0) & valid.any(-1) & (first_new <= self.last_positions)
        if not torch.compiler.is_compiling() and bool(behind.any()):  # rare: read the caller's mask only then
            behind = behind & _right_padded(key_mask, positions.shape[1], behind.device)
        shift = torch.where(behind, self.last_positions + 1 - first_new, torch.zeros_like(first_new))
        if not torch.compiler.is_compiling() and bool(behind.any()) and not _WARNED_BEHIND:
            _WARNED_BEHIND.append(True)
            row = int(behind.nonzero()[0, 0])
            warnings.warn(f"row {row}: new positions {positions[row][valid[row]].tolist()[:4]} do not continue the "
                          f"row's newest cached position {int(self.last_positions[row])} (right padding?): MLR "
                          f"attention places them right after the row's real tokens, behind its padding; pad on the "
                          f"left (tokenizer padding_side='left') to generate what each row generates alone",
                          stacklevel=4)
        return positions + shift[:, None]

    def _lazy_init(self, key_states, value_states, positions, valid) -> None:
        """First write: fix ``base`` from the lowest real position, allocate, and start the per-row spans."""
        batch = key_states.shape[0]
        if torch.compiler.is_compiling():  # no host reads in a compiled prefill: slots from position 0
            self.base = 0
        else:
            real = positions[valid]
            lowest = int(real.min()) if real.numel() else 0
            if lowest < 0:
                raise ValueError(f"positions must be non-negative for MLR attention, got {lowest}")
            self.base = lowest // self.alignment * self.alignment
        self.device = key_states.device
        self.first_positions = torch.full((batch,), NO_POSITION, dtype=torch.long, device=key_states.device)
        self.last_positions = torch.full((batch,), -1, dtype=torch.long, device=key_states.device)
        self._allocate(key_states, value_states, self._initial_capacity(positions, valid))
        self.is_initialized = True
        if self.record_past:
            self._start_log(key_states)

    def _write(self, key_states, value_states, positions, valid, keep_rings_before: bool = False):
        """Write the real tokens of a chunk into their slots and ring entries (padding is not stored). Returns a copy
        of the fine storage as it was before the writes (at the capacity after them) when ``keep_rings_before``."""
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self._check_contiguous(positions, valid)
            slots = int(positions[valid].max()) - self.base + 1 if bool(valid.any()) else 0
            self._ensure_capacity(max(slots, self._view_length(key_states.shape[2])), key_states, value_states)
        rings_before = self._fine.clone() if keep_rings_before else None
        slots = (positions - self.base).clamp(min=0, max=self._capacity() - 1)  # (B, c)
        if self.record_past:
            self._log_write(self._overwritten_fine(key_states, slots, valid), positions, valid)
        if compiling:
            self._scatter_write(key_states, value_states, slots, valid)
        else:
            self._indexed_write(key_states, value_states, slots, positions, valid)
        newest = torch.where(valid, positions, torch.full_like(positions, -1)).amax(-1)
        oldest = torch.where(valid, positions, torch.full_like(positions, NO_POSITION)).amin(-1)
        self.last_positions.copy_(torch.maximum(self.last_positions, newest))
        self.first_positions.copy_(torch.minimum(self.first_positions, oldest))
        self._advance(key_states.shape[2])
        self._refresh_views()
        return rings_before

    def _indexed_write(self, key_states, value_states, slots, positions, valid) -> None:
        """Eager writes of the real tokens only (a padding token may share a real token's position)."""
        rows, columns = valid.nonzero(as_tuple=True)
        if rows.numel() == 0:
            return
        targets = slots[rows, columns]
        ranks = self.geometry.ranks
        self.keys_storage()[rows, :, targets] = key_states[rows, :, columns, :ranks[0]]
        self.values_storage()[rows, :, targets] = value_states[rows, :, columns]
        real_positions = positions[rows, columns]
        newest = torch.where(valid, positions, torch.full_like(positions, -1)).amax(-1)[rows]
        start = ranks[0]
        for rank, size, ring in zip(ranks[1:], self.geometry.block_sizes, self.rings):
            newest_per_entry = real_positions > newest - size  # a chunk longer than the block: the newest wins
            picked_rows, picked_columns = rows[newest_per_entry], columns[newest_per_entry]
            ring[picked_rows, :, targets[newest_per_entry] % size] = \
                key_states[picked_rows, :, picked_columns, start:start + rank]
            start += rank

    def _scatter_write(self, key_states, value_states, slots, valid) -> None:
        """Fixed-shape writes (what torch.compile traces; a decode step has one token per row): a padding token writes
        back what its slot holds."""
        batch, heads, chunk, _ = key_states.shape
        if chunk == 1:
            slot = slots[:, 0]
            self._put_one_token(key_states, value_states, torch.arange(batch, device=slot.device), slot, valid[:, 0],
                                self._fine_index(slot) if self.geometry.block_sizes else None)
            return
        ranks = self.geometry.ranks
        keep = valid[:, None, :, None]

        def put(storage, index, new):
            index = index[:, None, :, None].expand(batch, heads, chunk, new.shape[-1])
            storage.scatter_(2, index, torch.where(keep, new, storage.gather(2, index)))

        put(self.keys_storage(), slots, key_states[..., :ranks[0]])
        put(self.values_storage(), slots, value_states)
        start = ranks[0]
        for rank, size, ring in zip(ranks[1:], self.geometry.block_sizes,
                                    self._dim_major_views(self._fine, self._capacity())):
            index = (slots % size)[:, None, None, :].expand(batch, heads, rank, chunk)
            new = key_states[..., start:start + rank].transpose(-1, -2)  # (B, H, r_l, c)
            ring.scatter_(3, index, torch.where(valid[:, None, None, :], new, ring.gather(3, index)))
            start += rank

    def _overwritten_fine(self, key_states, slots, valid) -> torch.Tensor:
        """(B, H, c, sum_{l>=2} r_l): for each new token, the ring entries its write replaces, as they are just
        before that token is written (an earlier token of the same chunk may have written them)."""
        batch, heads, chunk, _ = key_states.shape
        rank_in_row = valid.long().cumsum(-1) - 1
        index = torch.arange(chunk, device=slots.device).expand(batch, chunk)
        real_first = torch.argsort(torch.where(valid, index, index + chunk), dim=-1)  # k-th real token's column
        parts, start = [], self.geometry.ranks[0]
        for rank, size, ring in zip(self.geometry.ranks[1:], self.geometry.block_sizes, self.rings):
            entries = (slots % size).clamp(max=ring.shape[-2] - 1)
            before = ring.gather(2, entries[:, None, :, None].expand(batch, heads, chunk, rank))
            source_rank = rank_in_row - size
            from_chunk = valid & (source_rank >= 0)
            source = real_first.gather(-1, source_rank.clamp(min=0))
            earlier = key_states[..., start:start + rank].gather(2, source[:, None, :, None].expand(
                batch, heads, chunk, rank))
            parts.append(torch.where(from_chunk[:, None, :, None], earlier, before))
            start += rank
        if not parts:
            return key_states.new_zeros(batch, heads, chunk, 0)
        return torch.cat(parts, dim=-1)

    def _check_contiguous(self, positions, valid) -> None:
        """The real tokens of a row must have consecutive increasing positions that continue the row (slots are
        addressed by position)."""
        rank_in_row = valid.long().cumsum(-1) - 1
        first_new = torch.where(valid, positions, torch.full_like(positions, NO_POSITION)).amin(-1)
        start = torch.where(self.last_positions >= 0, self.last_positions + 1, first_new)
        broken = valid & (positions != start[:, None] + rank_in_row)
        if bool(broken.any()):
            row = int(broken.nonzero()[0, 0])
            raise ValueError(f"the MLR cache addresses slots by position: the real tokens of a row must have "
                             f"consecutive increasing positions continuing the row (row {row}: newest cached "
                             f"position {int(self.last_positions[row])}, new real positions "
                             f"{positions[row][valid[row]].tolist()}); packed sequences and gaps are not supported "
                             f"with a cache")

    # ------------------------------------------------------------------ rollback
    @property
    def record_past(self) -> bool:
        return self._record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        # transformers turns recording off by assignment when it hands a cache back (generate's deferred stop check)
        self._record_past = bool(value)
        if not value and self.is_initialized and self.is_bound:
            self._clear_log()

    def activate_past_recording(self) -> None:
        """Log what each write overwrites until the next ``crop`` (transformers calls this before speculative
        decoding), so that ``crop(-n)`` can restore the state of the shorter prefix exactly."""
        self.record_past = True
        if self.is_initialized and self.is_bound:
            self._start_log(self.keys)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative int, transformers' convention; 0 only drops the
        rollback log). Removing tokens needs ``activate_past_recording()`` before they were written."""
        if not self.is_bound:
            return super().crop(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        count = -tokens_to_remove
        if count and not self.record_past:
            raise ValueError("the MLR key cache can roll back only tokens written while recording: call "
                             "cache.activate_past_recording() before the tokens that crop removes are written "
                             "(transformers does this for assisted and prompt-lookup decoding)")
        if count > self._logged_tokens():
            raise ValueError(f"crop(-{count}): only the {self._logged_tokens()} tokens written since the last crop "
                             f"can be rolled back (finer levels keep only the current block's keys)")
        if count:
            self._rollback(count)
        self._clear_log()
        self.pending = None

    def _restore(self, valid, positions, old_fine) -> None:
        """Undo the writes of tokens (newest first): valid, positions (B, n); old_fine (B, H, n, sum r_l)."""
        geometry = self.geometry
        batch, heads = old_fine.shape[:2]
        count = positions.shape[1]
        if count and bool(valid.all()) and all(count <= size <= ring.shape[-2] for size, ring in
                                               zip(geometry.block_sizes, self.rings)):
            # every token real and at most one block per level: consecutive positions hit distinct ring entries, so
            # one scatter per level restores them all (in any order)
            slots = (positions - self.base).clamp(min=0)
            start = 0
            for rank, size, ring in zip(geometry.ranks[1:], geometry.block_sizes, self.rings):
                target = (slots % size)[:, None, :, None].expand(batch, heads, count, rank)
                ring.scatter_(2, target, old_fine[..., start:start + rank].to(ring.dtype))
                start += rank
            oldest = positions[:, 0]
            emptied = oldest <= self.first_positions
            self.last_positions.copy_(torch.where(emptied, torch.full_like(oldest, -1), oldest - 1))
            self.first_positions.copy_(torch.where(emptied, torch.full_like(oldest, NO_POSITION),
                                                   self.first_positions))
            self._rewind(count)
            self._refresh_views()
            return
        for index in range(positions.shape[1] - 1, -1, -1):
            real, position = valid[:, index], positions[:, index]
            slots = (position - self.base).clamp(min=0)
            start = 0
            for rank, size, ring in zip(geometry.ranks[1:], geometry.block_sizes, self.rings):
                entry = (slots % size).clamp(max=ring.shape[-2] - 1)
                target = entry[:, None, None, None].expand(batch, heads, 1, rank)
                current = ring.gather(2, target)
                restored = torch.where(real[:, None, None, None], old_fine[:, :, index:index + 1, start:start + rank],
                                       current)
                ring.scatter_(2, target, restored)
                start += rank
            emptied = real & (position <= self.first_positions)
            last = torch.where(real, position - 1, self.last_positions)
            self.last_positions.copy_(torch.where(emptied, torch.full_like(position, -1), last))
            self.first_positions.copy_(torch.where(emptied, torch.full_like(position, NO_POSITION),
                                                   self.first_positions))
        self._rewind(positions.shape[1])
        self._refresh_views()

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
        self._apply_log(fn)
        self.pending = None

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


def _right_padded(key_mask: Optional[torch.Tensor], chunk: int, device) -> torch.Tensor:
    """(B,) bool or a False scalar: the row's tokens before the last ``chunk`` hold a padding token after a real one
    (per the caller's 2-D keep-mask over the cached and new tokens)."""
    if key_mask is None or key_mask.dim() != 2 or key_mask.shape[-1] <= chunk:
        return torch.tensor(False, device=device)
    past = key_mask[:, :-chunk] != 0
    return (past.long().cummax(-1).values.bool() & ~past).any(-1).to(device)


def _step_of(args, kwargs) -> Optional[StructAttnStep]:
    """The ``StructAttnStep`` in the attention call's kwargs handed to ``update`` (``kwargs=kwargs`` in transformers'
    attention modules; a positional dict too)."""
    call = kwargs.get("kwargs")
    if call is None and args and isinstance(args[0], dict):
        call = args[0]
    if call is None:
        call = kwargs.get("cache_kwargs")
    return call.get(STEP_KEY) if isinstance(call, dict) else None


class MLRKeyCacheLayer(MLRCacheLayerMixin, DynamicLayer):
    """Dynamic MLR cache layer (``layer_types`` entry ``"mlr_attention"``). Storage is reserved ahead (exactly what
    ``reserve`` asks for, e.g. generate's final length; otherwise ``max(16, S/32)`` slots more than needed) and
    written in place; rings grow with the capacity up to ``b_l``."""

    _layer_type = "mlr_attention"

    def __init__(self, geometry: Optional[MLRGeometry] = None, **kwargs):
        super().__init__()
        self._init_state()
        self._storage = None  # {"keys": (B, H, C, r1), "values": (B, H, C, dv)}
        self._used = 0  # slots in use: max over rows of last position - base + 1
        self._reserved = None
        self.cumulative_length = 0  # tokens seen (padding included): transformers' sequence length
        if geometry is not None:
            self.bind(geometry)

    def reserve(self, positions: int) -> None:
        """Allocate exactly enough slots for ``positions`` positions from ``base`` on the next growth (generate
        knows its final length)."""
        self._reserved = int(positions)

    def _initial_capacity(self, positions, valid) -> int:
        if torch.compiler.is_compiling():
            raise ValueError("a dynamic MLR cache cannot be filled inside a compiled region; use the static cache "
                             "(cache_implementation='static') with torch.compile")
        real = positions[valid]
        needed = int(real.max()) - self.base + 1 if real.numel() else 1
        return self._grown_capacity(max(needed, positions.shape[1]))

    def _grown_capacity(self, needed: int) -> int:
        if self._reserved is not None and self._reserved - self.base >= needed:
            return self._reserved - self.base
        return needed + max(MIN_GROWTH, needed // 32)

    def _allocate(self, like_keys, like_values, capacity: int) -> None:
        batch, heads = like_keys.shape[:2]
        self._storage = {"keys": like_keys.new_zeros(batch, heads, capacity, self.geometry.ranks[0]),
                         "values": like_values.new_zeros(batch, heads, capacity, like_values.shape[-1])}
        self._fine = self._new_fine(like_keys, capacity)
        self.rings = self._fine_views(self._fine, capacity)
        self._used = 0
        self._refresh_views()

    def _capacity(self) -> int:
        return self._storage["keys"].shape[-2]

    def _ensure_capacity(self, slots: int, like_keys, like_values) -> None:
        capacity = self._capacity()
        if slots <= capacity:
            return
        old_storage, old_rings, used = self._storage, self.rings, self._used
        self._allocate(like_keys, like_values, self._grown_capacity(slots))
        for name, tensor in old_storage.items():
            self._storage[name].narrow(2, 0, capacity).copy_(tensor)
        for old, new, size in zip(old_rings, self.rings, self.geometry.block_sizes):
            if old.shape[-2] == new.shape[-2]:
                new.copy_(old)
            else:  # a ring that grew (capacity was below b_l): entries keep their index (position - base)
                new.narrow(2, 0, old.shape[-2]).copy_(old)
        self._used = used
        self._refresh_views()

    def keys_storage(self) -> torch.Tensor:
        return self._storage["keys"]

    def values_storage(self) -> torch.Tensor:
        return self._storage["values"]

    def _held_slots(self) -> int:
        return self._used

    def _advance(self, chunk: int) -> None:
        self.cumulative_length += chunk
        self._used = max(self._used, int(self.last_positions.max()) - self.base + 1) if self.last_positions.numel() \
            else self._used

    def _advance_decoded(self, needed_slots: int) -> None:
        self.cumulative_length += 1
        self._used = max(self._used, needed_slots)

    def _rewind(self, tokens: int) -> None:
        self.cumulative_length -= tokens
        self._used = max(int(self.last_positions.max()) - self.base + 1, 0) if self.last_positions.numel() else 0

    def _view_length(self, new_tokens: int = 0) -> int:
        """Slots the returned views cover: every slot in use, and at least as many as tokens seen (padding
        included), so that a consumer sizing a bias by the keys it gets (T5's relative bias) sees every token."""
        return max(self._used, self.cumulative_length + new_tokens)

    def _refresh_views(self) -> None:
        if self._storage is None:
            return
        length = self._view_length()
        self.keys = self._storage["keys"].narrow(2, 0, length)
        self.values = self._storage["values"].narrow(2, 0, length)

    def _drop_storage(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def get_seq_length(self) -> int:
        if not self.is_bound:
            return super().get_seq_length()
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def _apply_storage(self, fn) -> None:
        self._storage = {name: fn(tensor) for name, tensor in self._storage.items()}
        self._fine = fn(self._fine)
        self.rings = self._fine_views(self._fine, self._capacity())
        self._refresh_views()

    def reset(self) -> None:
        if not self.is_bound:
            return super().reset()
        geometry = self.geometry
        self._init_state()
        self._storage, self._used, self.cumulative_length = None, 0, 0
        self.keys = self.values = None
        self.is_initialized = False
        self.geometry = geometry

    # ------------------------------------------------------------------ rollback log (a list per update)
    def _start_log(self, like) -> None:
        self._log = []

    def _log_write(self, old_fine, positions, valid) -> None:
        self._log.append((valid.clone(), positions.clone(), old_fine))
        excess = self._logged_tokens() - self.rollback_window if self.rollback_window is not None else 0
        while excess > 0:  # forget the oldest writes: the log stays O(window), whatever the prompt's length
            valid, positions, old = self._log[0]
            if valid.shape[1] <= excess:
                self._log.pop(0)
                excess -= valid.shape[1]
            else:
                self._log[0] = (valid[:, excess:].clone(), positions[:, excess:].clone(), old[:, :, excess:].clone())
                excess = 0

    def _logged_tokens(self) -> int:
        return sum(entry[0].shape[1] for entry in self._log)

    def _rollback(self, count: int) -> None:
        while count:
            valid, positions, old_fine = self._log.pop()
            take = min(count, valid.shape[1])
            self._restore(valid[:, -take:], positions[:, -take:], old_fine[:, :, -take:])
            if take < valid.shape[1]:  # the rest of that update stays, and stays logged
                self._log.append((valid[:, :-take], positions[:, :-take], old_fine[:, :, :-take]))
            count -= take

    def _clear_log(self) -> None:
        self._log = []

    def _log_tensors(self):
        for entry in self._log:
            yield from entry

    def _apply_log(self, fn) -> None:
        self._log = [(fn(valid), fn(positions), fn(old)) for valid, positions, old in self._log]


class MLRStaticKeyCacheLayer(MLRCacheLayerMixin, StaticLayer):
    """Fixed-shape MLR cache layer (``cache_implementation="static"``, ``StaticCache``; what ``torch.compile``
    wants): ``max_cache_len`` slots and rings of ``min(b_l, max_cache_len)`` entries, allocated once and written in
    place. Positions must stay below ``base + max_cache_len``. The rollback log is a fixed buffer of
    ``rollback_tokens`` tokens (grown outside compiled code when a longer rollback window is needed)."""

    _layer_type = "mlr_attention"

    def __init__(self, max_cache_len: int, geometry: Optional[MLRGeometry] = None, rollback_tokens: int = 64,
                 **kwargs):
        super().__init__(max_cache_len=max_cache_len)
        self._init_state()
        self.rollback_tokens = int(rollback_tokens)
        self._log_buffers = None
        self._log_count = 0
        if geometry is not None:
            self.bind(geometry)

    def _initial_capacity(self, positions, valid) -> int:
        return self.max_cache_len

    def _allocate(self, like_keys, like_values, capacity: int) -> None:
        batch, heads = like_keys.shape[:2]
        self.keys = like_keys.new_zeros(batch, heads, capacity, self.geometry.ranks[0])
        self.values = like_values.new_zeros(batch, heads, capacity, like_values.shape[-1])
        self._fine = self._new_fine(like_keys, capacity)
        self.rings = self._fine_views(self._fine, capacity)
        self.cumulative_length = self.cumulative_length.to(like_keys.device)
        if not torch.compiler.is_compiling():
            for tensor in (self.keys, self.values, self._fine, self.cumulative_length, self.first_positions,
                           self.last_positions):
                torch._dynamo.mark_static_address(tensor)

    def _capacity(self) -> int:
        return self.max_cache_len

    def _ensure_capacity(self, slots: int, like_keys, like_values) -> None:
        if slots > self.max_cache_len:
            raise ValueError(f"the static MLR cache holds positions base..base + max_cache_len - 1 = {self.base}.."
                             f"{self.base + self.max_cache_len - 1}; a write needs position {self.base + slots - 1}")

    def keys_storage(self) -> torch.Tensor:
        return self.keys

    def values_storage(self) -> torch.Tensor:
        return self.values

    def _view_length(self, new_tokens: int = 0) -> int:
        return self.max_cache_len

    def _held_slots(self) -> int:
        return self.max_cache_len

    def _advance(self, chunk: int) -> None:
        self.cumulative_length.add_(chunk)

    def _advance_decoded(self, needed_slots: int) -> None:
        self.cumulative_length.add_(1)

    def _rewind(self, tokens: int) -> None:
        self.cumulative_length.sub_(tokens)

    def _refresh_views(self) -> None:
        pass

    def _drop_storage(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def get_seq_length(self):
        if not self.is_bound:
            return super().get_seq_length()
        return self.cumulative_length if self.is_initialized else 0

    def _apply_storage(self, fn) -> None:
        self.keys, self.values, self._fine = fn(self.keys), fn(self.values), fn(self._fine)
        self.rings = self._fine_views(self._fine, self.max_cache_len)

    def reset(self) -> None:
        if not self.is_bound:
            return super().reset()
        if self.is_initialized:
            for tensor in (self.keys, self.values, self._fine):
                tensor.zero_()
            self.first_positions.fill_(NO_POSITION)
            self.last_positions.fill_(-1)
        self.cumulative_length.zero_()
        self.pending = None
        self._log_count = 0

    # ------------------------------------------------------------------ rollback log (fixed buffers)
    def _start_log(self, like) -> None:
        if self.rollback_window is not None:
            self.rollback_tokens = self.rollback_window
        if self._log_buffers is None or self._log_buffers[0].shape[1] < self.rollback_tokens:
            batch, heads = self._fine.shape[:2]
            fine_width = sum(self.geometry.ranks[1:])
            self._log_buffers = (torch.zeros(batch, self.rollback_tokens, dtype=torch.bool, device=like.device),
                                 torch.zeros(batch, self.rollback_tokens, dtype=torch.long, device=like.device),
                                 self._fine.new_zeros(batch, heads, self.rollback_tokens, fine_width))
        self._log_count = 0

    def _log_write(self, old_fine, positions, valid) -> None:
        chunk = positions.shape[1]
        window = self.rollback_window
        if window is not None and self._log_count + chunk > window and not torch.compiler.is_compiling():
            if chunk >= window:  # only the chunk's last ``window`` tokens can be rolled back
                old_fine, positions, valid = old_fine[:, :, -window:], positions[:, -window:], valid[:, -window:]
                self._log_count, chunk = 0, window
            else:  # forget the oldest logged writes
                keep = window - chunk
                start = self._log_count - keep
                for tensor in self._log_buffers:
                    axis = 1 if tensor.dim() == 2 else 2
                    tensor.narrow(axis, 0, keep).copy_(tensor.narrow(axis, start, keep).clone())
                self._log_count = keep
        if self._log_count + chunk > self._log_buffers[0].shape[1]:
            if torch.compiler.is_compiling():
                raise ValueError(f"the static MLR cache records at most {self._log_buffers[0].shape[1]} tokens between "
                                 f"crops; raise rollback_tokens")
            self.rollback_tokens = max(2 * self.rollback_tokens, self._log_count + chunk)
            kept = [tensor.narrow(1 if tensor.dim() == 2 else 2, 0, self._log_count) for tensor in self._log_buffers]
            count = self._log_count
            self._log_buffers = None
            self._start_log(self.keys)
            for old, new in zip(kept, self._log_buffers):
                new.narrow(1 if new.dim() == 2 else 2, 0, count).copy_(old)
            self._log_count = count
        valid_log, position_log, fine_log = self._log_buffers
        valid_log.narrow(1, self._log_count, chunk).copy_(valid)
        position_log.narrow(1, self._log_count, chunk).copy_(positions)
        fine_log.narrow(2, self._log_count, chunk).copy_(old_fine)
        self._log_count += chunk

    def _logged_tokens(self) -> int:
        return self._log_count if self._log_buffers is not None else 0

    def _rollback(self, count: int) -> None:
        valid_log, position_log, fine_log = self._log_buffers
        start = self._log_count - count
        self._restore(valid_log.narrow(1, start, count), position_log.narrow(1, start, count),
                      fine_log.narrow(2, start, count))

    def _clear_log(self) -> None:
        self._log_count = 0

    def _log_tensors(self):
        return self._log_buffers or ()

    def _apply_log(self, fn) -> None:
        if self._log_buffers is not None:
            self._log_buffers = tuple(fn(tensor) for tensor in self._log_buffers)


MLR_CACHE_LAYERS = (MLRKeyCacheLayer, MLRStaticKeyCacheLayer)


def set_rollback_window(cache: Cache, tokens: Optional[int]) -> None:
    """Let ``crop`` remove at most ``tokens`` tokens from every MLR layer of ``cache`` (None: everything written since
    the last crop). The rollback log then costs ``tokens * sum_{l>=2} r_l`` entries per row and head (plus a bool and
    a position per token), however long the context."""
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"rollback window must be a positive number of tokens or None, got {tokens!r}")
    for layer in self_attention_cache(cache).layers:
        if isinstance(layer, MLR_CACHE_LAYERS):
            layer.rollback_window = tokens


def key_cache_bytes(cache: Cache) -> int:
    """Bytes of keys a cache holds by the formula (MLR layers: ``S r_1 + sum_l min(b_l, S) r_l`` per row and head;
    other layers: their key tensors), batch and heads included; an ``EncoderDecoderCache`` counts its
    self-attention part."""
    total = 0
    for layer in self_attention_cache(cache).layers:
        if isinstance(layer, MLR_CACHE_LAYERS) and layer.is_bound:
            total += layer.key_cache_bytes()
        elif getattr(layer, "is_initialized", False) and layer.keys is not None:
            total += layer.keys.numel() * layer.keys.element_size()
    return total


# Bilinear layers cache their (structured, wider) keys like any full-attention layer: transformers' plain layers,
# registered under this package's layer types so that ``DynamicCache(config=...)`` and ``StaticCache`` build them.
class BilinearMLRKeyCacheLayer(DynamicLayer):
    _layer_type = "bilinear_mlr_attention"


class BilinearMLRStaticKeyCacheLayer(StaticLayer):
    _layer_type = "bilinear_mlr_attention"


class BilinearBTTKeyCacheLayer(DynamicLayer):
    _layer_type = "bilinear_btt_attention"


class BilinearBTTStaticKeyCacheLayer(StaticLayer):
    _layer_type = "bilinear_btt_attention"


def _extend_layers(cache: Cache, num_layers: int) -> None:
    """Give ``cache`` one layer per model layer: a lazily replicated cache gets its layers now, and a cache built from
    a config that counts fewer layers than the stack it serves (transformers 5.24 sizes a T5 cache by ``num_layers``,
    the encoder's, also when ``num_decoder_layers`` is larger) gets empty layers of its own kind appended."""
    while len(cache.layers) < num_layers:
        if cache.layer_class_to_replicate is not None:
            cache.layers.append(cache.layer_class_to_replicate())
        elif cache.layers and isinstance(cache.layers[-1], StaticLayer):
            cache.layers.append(StaticLayer(max_cache_len=cache.layers[-1].max_cache_len))
        else:
            cache.layers.append(DynamicLayer())


def prepare_structattn_cache(cache: Optional[Cache], geometries: dict, *, reserve: Optional[int] = None,
                             num_layers: Optional[int] = None) -> Optional[Cache]:
    """Give the MLR layers of ``cache`` (its self-attention part) their hierarchical form before they are written.

    geometries: {layer_idx: MLRGeometry} of the model's MLR layers. An empty layer of a transformers cache built
    from the config (``DynamicLayer``/``StaticLayer``, or an unbound MLR layer) becomes an MLR layer of the same
    kind; a layer that already holds full-width keys stays as it is (exact, no saving). Lazily replicated caches
    (``DynamicCache()`` without config) get their layers created here. ``reserve``: final length (generate) to
    allocate exactly. Returns ``cache``."""
    target = self_attention_cache(cache)
    if target is None:
        return cache
    if num_layers is not None:
        for part in (target, cache.cross_attention_cache) if isinstance(cache, EncoderDecoderCache) else (target,):
            _extend_layers(part, num_layers)
    for layer_idx, geometry in geometries.items():
        if layer_idx >= len(target.layers):
            continue
        layer = target.layers[layer_idx]
        if isinstance(layer, MLR_CACHE_LAYERS):
            if not layer.is_bound and layer.get_seq_length() == 0:
                layer.bind(geometry)
        else:
            recording = bool(getattr(layer, "record_past", False))
            if type(layer) is DynamicLayer and layer.get_seq_length() == 0:
                layer = target.layers[layer_idx] = MLRKeyCacheLayer(geometry)
            elif type(layer) is StaticLayer and not layer.is_initialized:
                layer = target.layers[layer_idx] = MLRStaticKeyCacheLayer(layer.max_cache_len, geometry)
            else:
                continue
            if recording:  # generate activated rollback on the cache it built (an assistant's, a speculative run's)
                layer.activate_past_recording()
        if reserve is not None and isinstance(layer, MLRKeyCacheLayer) and layer.get_seq_length() == 0:
            layer.reserve(reserve)
    return cache


__all__ = ["MLRKeyCacheLayer", "MLRStaticKeyCacheLayer", "StructAttnStep", "STEP_KEY", "key_cache_bytes",
           "new_token_validity", "prepare_structattn_cache", "self_attention_cache", "set_rollback_window"]
