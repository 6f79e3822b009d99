"""The hierarchical MLR key cache and the cached (decode / chunked-prefill) MLR attention.

Level 1 keeps its ``r_1`` key dims for every position; level l >= 2 keeps only the keys of the current
level-l block (at most ``b_l`` positions, ``r_l`` dims), stored at ``position % b_l``; values keep every
position (DESIGN.md §2). Blocks follow each row's own positions, so a left-padded batch decodes exactly like
each row alone.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .structattn_geometry import MASK_VALUE, pair_depth


@dataclass
class MLRCachedKeys:
    """Everything a query chunk needs from the cache (past tokens plus the new chunk).

    level_one_keys: (B, H, S, r_1) for every slot; values: (B, H, S, dv); key_positions / key_valid: (B, S).
    For each level l >= 2: level_keys[l-2] (B, H, W_l, r_l) with level_slots[l-2] (B, W_l) (slot index of each
    key) and level_positions[l-2] (B, W_l) (position, -1 for empty entries).
    """

    level_one_keys: torch.Tensor
    values: torch.Tensor
    key_positions: torch.Tensor
    key_valid: torch.Tensor
    level_keys: list
    level_slots: list
    level_positions: list


RESERVE_POSITIONS = 256


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


class MLRKeyCacheLayer(_BatchOpsMixin, DynamicLayer):
    """Cache layer of one MLR attention layer (see module docstring).

    ``keys`` mirrors the level-1 keys and ``values`` the values, so generic transformers code that inspects a
    layer sees sensible tensors. Rolling back (``crop``) is impossible because finer levels forget old blocks.
    """

    is_croppable = False

    def __init__(self, ranks: Sequence[int], block_sizes: Sequence[int]):
        super().__init__()
        self.ranks = list(ranks)
        self.block_sizes = list(block_sizes)
        self.key_positions = self.key_valid = None
        self.level_keys, self.level_slots, self.level_positions = [], [], []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        device = key_states.device
        self.device = device
        self._stores = {name: ReservedSequence(-2 if name in ("keys", "values") else -1)
                        for name in ("keys", "values", "key_positions", "key_valid")}
        self._stores["keys"].reset_to(key_states.new_zeros(batch, heads, 0, self.ranks[0]))
        self._stores["values"].reset_to(value_states.new_zeros(batch, heads, 0, value_states.shape[-1]))
        self._stores["key_positions"].reset_to(torch.zeros(batch, 0, dtype=torch.long, device=device))
        self._stores["key_valid"].reset_to(torch.zeros(batch, 0, dtype=torch.bool, device=device))
        self.keys, self.values = self._stores["keys"].view, self._stores["values"].view
        self.key_positions, self.key_valid = self._stores["key_positions"].view, self._stores["key_valid"].view
        self.level_keys = [key_states.new_zeros(batch, heads, 0, rank) for rank in self.ranks[1:]]
        self.level_slots = [torch.zeros(batch, 0, dtype=torch.long, device=device) for _ in self.ranks[1:]]
        self.level_positions = [torch.zeros(batch, 0, dtype=torch.long, device=device) for _ in self.ranks[1:]]
        self.is_initialized = True

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.values.shape[-2]

    def key_cache_elements(self) -> int:
        """Key entries held per (batch row, head): ``S * r_1 + sum_l W_l * r_l``."""
        if not self.is_initialized:
            return 0
        return self.keys.shape[-2] * self.ranks[0] + sum(k.shape[-2] * k.shape[-1] for k in self.level_keys)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, positions: torch.Tensor = None,
               valid: Optional[torch.Tensor] = None, **kwargs) -> MLRCachedKeys:
        """Append a chunk and return the keys its queries need.

        key_states: (B, H, c, r); value_states: (B, H, c, dv); positions: (B, c) absolute positions; valid:
        (B, c) padding flags (True = real token). The returned level keys include the previous block's keys even
        when the chunk crosses into a new block; the stored state afterwards keeps only the current blocks.
        """
        if positions is None:
            raise ValueError("MLRKeyCacheLayer.update needs the positions of the new tokens")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, _, chunk, _ = key_states.shape
        valid = torch.ones(batch, chunk, dtype=torch.bool, device=key_states.device) if valid is None else valid.bool()
        past = self.values.shape[-2]
        new_slots = torch.arange(past, past + chunk, device=key_states.device).expand(batch, chunk)
        self.keys = self._stores["keys"].append(key_states[..., :self.ranks[0]])
        self.values = self._stores["values"].append(value_states)
        self.key_positions = self._stores["key_positions"].append(positions.expand(batch, chunk))
        self.key_valid = self._stores["key_valid"].append(valid)
        result = MLRCachedKeys(self.keys, self.values, self.key_positions, self.key_valid, [], [], [])
        start = self.ranks[0]
        total = past + chunk
        for index, (rank, size) in enumerate(zip(self.ranks[1:], self.block_sizes)):
            new_keys = key_states[..., start:start + rank]
            start += rank
            new_positions = positions.masked_fill(~valid, -1)
            if self._store_in_place(index, new_keys, new_slots, new_positions, size, total):
                # the overwritten entry belonged to the previous block, which the new query cannot see
                result.level_keys.append(self.level_keys[index])
                result.level_slots.append(self.level_slots[index])
                result.level_positions.append(self.level_positions[index])
                continue
            result.level_keys.append(torch.cat([self.level_keys[index], new_keys], dim=-2))
            result.level_slots.append(torch.cat([self.level_slots[index], new_slots], dim=-1))
            result.level_positions.append(torch.cat([self.level_positions[index], new_positions], dim=-1))
            self._store_level(index, new_keys, new_slots, new_positions, size, total)
        return result

    def _store_in_place(self, index, new_keys, new_slots, new_positions, block, total) -> bool:
        """Decode step with a full buffer (it holds ``block`` entries): overwrite one entry per row in place, no
        reallocation and no copy of the buffer. Returns False when this fast path does not apply."""
        keys = self.level_keys[index]
        if keys.shape[-2] != min(block, total) or new_keys.shape[-2] != 1 or not bool((new_positions >= 0).all()):
            return False
        target = new_positions % block  # (B, 1)
        keys.scatter_(2, target[:, None, :, None].expand_as(new_keys), new_keys)
        self.level_slots[index].scatter_(1, target, new_slots)
        self.level_positions[index].scatter_(1, target, new_positions)
        return True

    def _store_level(self, index, new_keys, new_slots, new_positions, block, total):
        """Write the chunk's level keys at ``position % block``; only the newest ``block`` positions of a row
        can still be needed, older ones (and padding) go to a dump slot that is cut off."""
        keys, slots, positions = self.level_keys[index], self.level_slots[index], self.level_positions[index]
        capacity = min(block, total)
        batch, heads, held, rank = keys.shape
        if capacity > held:
            keys = torch.cat([keys, keys.new_zeros(batch, heads, capacity - held, rank)], dim=-2)
            slots = torch.cat([slots, slots.new_zeros(batch, capacity - held)], dim=-1)
            positions = torch.cat([positions, positions.new_full((batch, capacity - held), -1)], dim=-1)
        newest = new_positions.amax(dim=-1, keepdim=True)
        keep = (new_positions >= 0) & (new_positions > newest - block)
        target = torch.where(keep, new_positions % block, torch.full_like(new_positions, capacity))
        dump = lambda t, width: torch.cat([t, t.new_zeros(*t.shape[:-2], 1, width)], dim=-2)  # noqa: E731
        keys = dump(keys, rank).scatter(2, target[:, None, :, None].expand_as(new_keys), new_keys)[..., :capacity, :]
        slots = torch.cat([slots, slots.new_zeros(batch, 1)], -1).scatter(1, target, new_slots)[:, :capacity]
        positions = torch.cat([positions, positions.new_zeros(batch, 1)], -1).scatter(1, target, new_positions)[
            :, :capacity]
        self.level_keys[index], self.level_slots[index], self.level_positions[index] = keys, slots, positions

    def _apply(self, fn) -> None:
        if not self.is_initialized:
            return
        for name, store in self._stores.items():
            store.reset_to(fn(getattr(self, name)))
            setattr(self, name, store.view)
        self.level_keys = [fn(t) for t in self.level_keys]
        self.level_slots = [fn(t) for t in self.level_slots]
        self.level_positions = [fn(t) for t in self.level_positions]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ValueError("the MLR key cache cannot be cropped: finer levels keep only the current block's keys "
                         "(assisted decoding and other roll-backs are unsupported for MLR layers)")

    def reset(self) -> None:
        self.key_positions = self.key_valid = None
        self.level_keys, self.level_slots, self.level_positions = [], [], []
        super().reset()


def mlr_attention_cached(q: torch.Tensor, cached: MLRCachedKeys, *, ranks: Sequence[int], block_sizes: Sequence[int],
                         level_scales: Sequence[float], query_positions: torch.Tensor, causal: bool = True,
                         average_levels: bool = False, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MLR attention of a query chunk against cached keys (materialises only the (c, S) scores of the chunk).

    q: (B, H, c, r); query_positions: (B, c); bias broadcastable to (B, H, c, S). Returns (B, H, c, dv).
    Level-1 scores cover every slot; each finer level adds ``alpha_l q_l . k_l`` on the slots of its kept keys
    that share the query's block.
    """
    head_starts = [sum(ranks[:level]) for level in range(len(ranks))]
    q_one = q[..., :ranks[0]] * level_scales[0]
    scores = q_one @ cached.level_one_keys.transpose(-1, -2)  # (B, H, c, S)
    batch, heads, chunk, slots = scores.shape
    for index, (rank, size) in enumerate(zip(ranks[1:], block_sizes)):
        level = index + 1
        q_level = q[..., head_starts[level]:head_starts[level] + rank] * level_scales[level]
        level_scores = q_level @ cached.level_keys[index].transpose(-1, -2)  # (B, H, c, W)
        key_pos = cached.level_positions[index]
        same_block = (key_pos[:, None, :] >= 0) & (
            (query_positions[:, :, None] // size) == (key_pos[:, None, :] // size))  # (B, c, W)
        level_scores = level_scores * same_block[:, None]
        target = cached.level_slots[index][:, None, None, :].expand(batch, heads, chunk, -1)
        scores.scatter_add_(-1, target, level_scores)  # scores is this function's own fresh tensor
    # softmax (and everything added before it) in promote_types(dtype, float32): float64 stays exact, half
    # precision does not overflow (DESIGN.md §4b)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if average_levels:
        scores = scores / pair_depth(query_positions, cached.key_positions, block_sizes)[:, None]
    if bias is not None:
        scores = scores + bias
    allowed = cached.key_valid[:, None, None, :]
    if causal:
        allowed = allowed & (cached.key_positions[:, None, None, :] <= query_positions[:, None, :, None])
    scores.masked_fill_(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1).to(cached.values.dtype) @ cached.values


def plain_cached_keys(keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor,
                      ranks: Sequence[int]) -> MLRCachedKeys:
    """View full-width cached keys (an ordinary DynamicLayer) as hierarchical cache contents: every level keeps
    every slot."""
    batch, _, slots, _ = keys.shape
    slot_index = torch.arange(slots, device=keys.device).expand(batch, slots)
    level_positions = key_positions.masked_fill(~key_valid, -1)
    starts = [sum(ranks[:level]) for level in range(len(ranks))]
    return MLRCachedKeys(keys[..., :ranks[0]], values, key_positions, key_valid,
                         [keys[..., starts[level]:starts[level] + ranks[level]] for level in range(1, len(ranks))],
                         [slot_index] * (len(ranks) - 1), [level_positions] * (len(ranks) - 1))


class StructAttnCache(DynamicCache):
    """A DynamicCache whose layers follow the model's per-layer attention: MLR layers get an
    ``MLRKeyCacheLayer``, sliding-window layers a ``DynamicSlidingWindowLayer``, the rest an
    ``AppendingDynamicLayer``. Key/value bytes are reported for the used positions; storage is reserved in steps of
    ``max(256, S/8)`` positions.

    ``layer_specs``: one dict per layer with ``attention`` and, for MLR, ``ranks`` and ``block_sizes``, for SWA
    ``sliding_window``.
    """

    def __init__(self, layer_specs: Sequence[dict], **kwargs):
        layers = []
        for spec in layer_specs:
            if spec["attention"] == "mlr":
                layers.append(MLRKeyCacheLayer(spec["ranks"], spec["block_sizes"]))
            elif spec["attention"] == "swa":
                layers.append(DynamicSlidingWindowLayer(sliding_window=spec["sliding_window"]))
            else:
                layers.append(AppendingDynamicLayer())
        super(DynamicCache, self).__init__(layers=layers, **kwargs)

    def key_cache_bytes(self) -> int:
        """Bytes of keys held over all layers (batch and heads included)."""
        total = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            if isinstance(layer, MLRKeyCacheLayer):
                total += layer.keys.element_size() * layer.keys.shape[0] * layer.keys.shape[1] * \
                    layer.key_cache_elements()
            else:
                total += layer.keys.numel() * layer.keys.element_size()
        return total
