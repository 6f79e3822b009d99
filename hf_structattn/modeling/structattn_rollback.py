"""Rollback of the hierarchical MLR key cache for speculative decoding (``crop``).

transformers calls ``cache.activate_past_recording()`` before it may ``crop`` (assisted and prompt-lookup decoding).
While recording, each write logs what it overwrites: per new token the finer levels' ring entries its write replaces
(as they were just before that token), its position and whether it is real. ``crop(-n)`` restores the state of the
n-token-shorter prefix exactly, across block boundaries at every level; ``crop(0)`` drops the log. Level-1 keys and
values need no log: slots are addressed by position, so the cropped slots are simply past the rows' newest position.

The log is one set of fixed buffers per layer (``RollbackLog``): ``window`` tokens of ``H * sum_{l>=2} r_l`` entries,
a position and a flag per row, grown outside compiled code when a longer window is asked for. With a rollback window
(``generate`` sets it from the draft length) only the last ``window`` writes are kept: O(draft), whatever the
context length.
"""

from typing import Optional, Sequence

import torch

from .structattn_plan import NO_POSITION


_RESTORE_INDEX = [None, None]  # (key, (n, sum r_l) ring elements) of the last ``_restore_in_step``


class RollbackLog:
    """Fixed buffers holding what the last writes replaced: valid (B, n) bool, positions (B, n) int64 and the old
    fine entries (B, H, n, sum_{l>=2} r_l), ``count`` tokens of them in use (oldest first)."""

    def __init__(self):
        self.buffers = None
        self.count = 0
        self.real = []  # per logged token, whether the write that logged it had no padding (host facts), oldest first
        self.host = []  # per logged token, its position when every row's is the same and known on the host, else None

    def tensors(self) -> tuple:
        return self.buffers or ()

    def start(self, batch: int, heads: int, fine_width: int, tokens: int, like: torch.Tensor) -> None:
        """Begin a log of up to ``tokens`` tokens (buffers kept when they are large enough)."""
        if self.buffers is None or self.buffers[0].shape[1] < tokens or self.buffers[2].shape[:2] != (batch, heads):
            self.buffers = (torch.zeros(batch, tokens, dtype=torch.bool, device=like.device),
                            torch.zeros(batch, tokens, dtype=torch.long, device=like.device),
                            like.new_zeros(batch, heads, tokens, fine_width))
        self.count = 0
        self.real = []
        self.host = []

    def append(self, old_fine: torch.Tensor, positions: Optional[torch.Tensor], valid: Optional[torch.Tensor],
               window: Optional[int], all_real: bool = False, host_positions: Optional[Sequence[int]] = None) -> None:
        """Log one write of c tokens (old_fine (B, H, c, F), positions / valid (B, c); ``all_real``: the write had no
        padding, known on the host); with a ``window`` only the last ``window`` logged tokens are kept.
        ``host_positions``: the c positions of a write whose rows are in step (``structattn_lane``), given instead
        of ``positions`` and ``valid`` (every token real), which are then written only when a crop needs them."""
        chunk = old_fine.shape[2]
        keep_last = -(window or chunk + self.count)
        self.real = (self.real[:self.count] + [all_real] * chunk)[keep_last:]
        hosts = list(host_positions) if host_positions is not None else [None] * chunk
        self.host = (self.host[:self.count] + hosts)[keep_last:]
        if window is not None and self.count + chunk > window and not torch.compiler.is_compiling():
            if chunk >= window:  # only the chunk's last ``window`` tokens can be rolled back
                old_fine = old_fine[:, :, -window:]
                if host_positions is None:
                    positions, valid = positions[:, -window:], valid[:, -window:]
                self.count, chunk = 0, window
            else:  # forget the oldest logged writes
                keep = window - chunk
                start = self.count - keep
                for tensor in self.buffers:
                    axis = tensor.dim() - 2 if tensor.dim() == 4 else 1
                    tensor.narrow(axis, 0, keep).copy_(tensor.narrow(axis, start, keep).clone())
                self.count = keep
        capacity = self.buffers[0].shape[1]
        if self.count + chunk > capacity:
            if torch.compiler.is_compiling():
                raise ValueError(f"the MLR cache records at most {capacity} tokens between crops; set a larger "
                                 f"rollback window (structattn_prepare.set_rollback_window)")
            kept = [tensor.narrow(2 if tensor.dim() == 4 else 1, 0, self.count) for tensor in self.buffers]
            count, batch, heads, width = self.count, *self.buffers[2].shape[:2], self.buffers[2].shape[-1]
            self.buffers = None
            real, host = self.real, self.host
            self.start(batch, heads, width, max(2 * capacity, count + chunk), kept[2])
            self.real, self.host = real, host
            for old, new in zip(kept, self.buffers):
                new.narrow(2 if new.dim() == 4 else 1, 0, count).copy_(old)
            self.count = count
        valid_log, position_log, fine_log = self.buffers
        if host_positions is None:
            valid_log.narrow(1, self.count, chunk).copy_(valid)
            position_log.narrow(1, self.count, chunk).copy_(positions)
        fine_log.narrow(2, self.count, chunk).copy_(old_fine)
        self.count += chunk

    def last(self, tokens: int) -> tuple:
        """(valid, positions, old fine entries) of the last ``tokens`` logged tokens, oldest first."""
        valid_log, position_log, fine_log = self.buffers
        start = self.count - tokens
        for index, position in enumerate(self.host[len(self.host) - tokens:]):
            if position is not None:  # a write of rows in step logged its positions on the host only
                valid_log[:, start + index] = True
                position_log[:, start + index] = position
        return valid_log.narrow(1, start, tokens), position_log.narrow(1, start, tokens), \
            fine_log.narrow(2, start, tokens)

    def host_positions(self, tokens: int) -> Optional[list]:
        """The positions of the last ``tokens`` logged tokens when writes of rows in step logged all of them (every
        row's, every token real), else None."""
        positions = self.host[len(self.host) - tokens:] if tokens <= len(self.host) else [None]
        return None if any(position is None for position in positions) else positions

    @property
    def tokens(self) -> int:
        return self.count if self.buffers is not None else 0

    def all_real(self, tokens: int) -> bool:
        """Whether the last ``tokens`` logged tokens come from writes without padding."""
        return len(self.real) >= tokens and all(self.real[len(self.real) - tokens:])

    def clear(self) -> None:
        self.count = 0
        self.real = []
        self.host = []

    def apply(self, fn) -> None:
        """Apply a per-row function (beam reordering, batch selection) to the logged rows."""
        if self.buffers is not None:
            self.buffers = tuple(fn(tensor) for tensor in self.buffers)


class RollbackMixin:
    """``activate_past_recording`` / ``crop`` of an MLR cache layer (``MLRCacheLayerMixin``), whose storage provides
    ``rings`` (per fine level (B, H, W_l, r_l)), ``first_positions`` / ``last_positions``, ``base``, ``geometry`` and
    ``_rewind(tokens)``."""

    # the most tokens a crop can remove (the log keeps what the last ``rollback_window`` writes replaced); None:
    # everything written since the last crop. ``generate`` sets it from the draft length of speculative decoding
    rollback_window: Optional[int] = None
    rollback_tokens = 64  # the log's initial size when no window is set

    @property
    def record_past(self) -> bool:
        return self._record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        # transformers turns recording off by assignment when it hands a cache back (generate's deferred stop check)
        self._record_past = bool(value)
        if not value and self.is_initialized and self.is_bound:
            self.rollback_log.clear()

    def activate_past_recording(self) -> None:
        """Log what each write overwrites until the next ``crop`` (transformers calls this before speculative
        decoding), so that ``crop(-n)`` can restore the state of the shorter prefix exactly."""
        self.record_past = True
        if self.is_initialized and self.is_bound:
            self._start_log()

    def _start_log(self) -> None:
        fine = self.fine_storage
        self.rollback_log.start(fine.shape[0], fine.shape[1], sum(self.geometry.ranks[1:]),
                                self.rollback_window or self.rollback_tokens, fine)

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
        logged = self.rollback_log.tokens
        if count > logged:
            raise ValueError(f"crop(-{count}): only the {logged} tokens written since the last crop can be rolled "
                             f"back (finer levels keep only the current block's keys)")
        if count:
            hosts = self.rollback_log.host_positions(count)
            if hosts is not None and self.geometry.block_sizes and count <= min(self.geometry.block_sizes):
                self._restore_in_step(self.rollback_log.buffers[2].narrow(2, self.rollback_log.count - count, count),
                                      hosts)
            else:
                self._restore(*self.rollback_log.last(count), all_real=self.rollback_log.all_real(count))
        self.rollback_log.clear()

    def _restore_in_step(self, old_fine: torch.Tensor, positions: list) -> None:
        """Undo the writes of n tokens of rows in step (``structattn_lane``): old_fine (B, H, n, sum r_l) what each
        replaced; ``positions`` their (every row's) positions on the host, consecutive. No more of them than the
        finest block, so they hit distinct entries of every ring: one indexed assignment of the ring elements from
        host integers. Every row held tokens before them (the lane writes continuing rows only), so none is
        emptied and the rows' first positions stand."""
        geometry, widths, base, fine = self.geometry, self.ring_widths, self.base, self.fine_storage
        key = (tuple(positions), widths, base, geometry, fine.device)
        if _RESTORE_INDEX[0] != key:  # every layer of a crop restores the same elements: made once per crop
            elements = [geometry.fine_elements(widths, position - base) for position in positions]
            _RESTORE_INDEX[:] = [key, torch.tensor(elements, dtype=torch.long, device=fine.device)]
        fine[:, :, _RESTORE_INDEX[1]] = old_fine
        self.last_positions.fill_(positions[0] - 1)
        self._rewind(len(positions))

    def _restore(self, valid: torch.Tensor, positions: torch.Tensor, old_fine: torch.Tensor,
                 all_real: bool = False) -> None:
        """Undo the writes of n tokens: valid, positions (B, n) oldest first; old_fine (B, H, n, sum r_l), what each
        token's write replaced. An entry written by several of them gets back what the oldest one replaced.
        ``all_real``: no padding among them (host knowledge of the writes)."""
        geometry = self.geometry
        batch, heads, count = old_fine.shape[:3]
        if all_real and geometry.block_sizes and count <= min(geometry.block_sizes):
            # a draft no longer than the finest block, without padding (speculative decoding): consecutive positions
            # hit distinct entries of every ring, so one indexed assignment of all fine dims restores them
            layout = geometry.fine_layout(self.ring_widths, positions.device)
            entries = (positions - self.base).clamp(min=0, max=self.capacity - 1)[:, :, None] % layout["element block"]
            rows = torch.arange(batch, device=positions.device)[:, None, None]
            self.fine_storage[rows, :, layout["element offset"] + entries] = old_fine.permute(0, 2, 3, 1).to(
                self.fine_storage.dtype)
            oldest = positions[:, 0]
            emptied = oldest <= self.first_positions
            self.last_positions.copy_(torch.where(emptied, -1, oldest - 1))
            self.first_positions.copy_(torch.where(emptied, NO_POSITION, self.first_positions))
            self._rewind(count)
            return
        real = valid
        index = torch.arange(count, device=positions.device)
        offset = 0
        for rank, size, ring in zip(geometry.ranks[1:], geometry.block_sizes, self.rings):
            # every token writes back what the oldest removed real token of its row with the same entry replaced (the
            # entry's value before the removed tokens), so tokens that share an entry write the same value; an entry
            # no real token wrote keeps its value
            entries = ((positions - self.base) % size).clamp(min=0, max=ring.shape[-2] - 1)
            same = (entries[:, :, None] == entries[:, None, :]) & real[:, None, :]  # (B, n, n)
            oldest = torch.where(same, index, count).amin(-1)  # (B, n)
            target = entries[:, None, :, None].expand(batch, heads, count, rank)
            source = old_fine[..., offset:offset + rank].gather(
                2, oldest.clamp(max=count - 1)[:, None, :, None].expand(batch, heads, count, rank))
            restored = torch.where((oldest < count)[:, None, :, None], source.to(ring.dtype), ring.gather(2, target))
            ring.scatter_(2, target, restored)
            offset += rank
        held = torch.where(real, positions, NO_POSITION).amin(-1)  # the oldest removed real position per row
        removed = held != NO_POSITION
        emptied = removed & (held <= self.first_positions)
        last = torch.where(removed, held - 1, self.last_positions)
        self.last_positions.copy_(torch.where(emptied, torch.full_like(last, -1), last))
        self.first_positions.copy_(torch.where(emptied, torch.full_like(last, NO_POSITION), self.first_positions))
        self._rewind(count)


__all__ = ["RollbackLog", "RollbackMixin"]
