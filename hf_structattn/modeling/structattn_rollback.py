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

from typing import Optional

import torch

from .structattn_step import NO_POSITION


class RollbackLog:
    """Fixed buffers holding what the last writes replaced: valid (B, n) bool, positions (B, n) int64 and the old
    fine entries (B, H, n, sum_{l>=2} r_l), ``count`` tokens of them in use (oldest first)."""

    def __init__(self):
        self.buffers = None
        self.count = 0
        self.padded = False  # a logged write had padding or no host facts (then two tokens may share an entry)

    def tensors(self) -> tuple:
        return self.buffers or ()

    def start(self, batch: int, heads: int, fine_width: int, tokens: int, like: torch.Tensor) -> None:
        """Begin a log of up to ``tokens`` tokens (buffers kept when they are large enough)."""
        if self.buffers is None or self.buffers[0].shape[1] < tokens or self.buffers[2].shape[:2] != (batch, heads):
            self.buffers = (torch.zeros(batch, tokens, dtype=torch.bool, device=like.device),
                            torch.zeros(batch, tokens, dtype=torch.long, device=like.device),
                            like.new_zeros(batch, heads, tokens, fine_width))
        self.count = 0

    def append(self, old_fine: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
               window: Optional[int], all_real: bool = False) -> None:
        """Log one write of c tokens (old_fine (B, H, c, F), positions / valid (B, c)); with a ``window`` only the
        last ``window`` logged tokens are kept. ``all_real``: the write had no padding (host facts)."""
        chunk = old_fine.shape[2]
        self.padded = self.padded or not all_real
        if window is not None and self.count + chunk > window and not torch.compiler.is_compiling():
            if chunk >= window:  # only the chunk's last ``window`` tokens can be rolled back
                old_fine, positions, valid = old_fine[:, :, -window:], positions[:, -window:], valid[:, -window:]
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
            self.start(batch, heads, width, max(2 * capacity, count + chunk), kept[2])
            for old, new in zip(kept, self.buffers):
                new.narrow(2 if new.dim() == 4 else 1, 0, count).copy_(old)
            self.count = count
        valid_log, position_log, fine_log = self.buffers
        valid_log.narrow(1, self.count, chunk).copy_(valid)
        position_log.narrow(1, self.count, chunk).copy_(positions)
        fine_log.narrow(2, self.count, chunk).copy_(old_fine)
        self.count += chunk

    def last(self, tokens: int) -> tuple:
        """(valid, positions, old fine entries) of the last ``tokens`` logged tokens, oldest first."""
        start = self.count - tokens
        valid_log, position_log, fine_log = self.buffers
        return valid_log.narrow(1, start, tokens), position_log.narrow(1, start, tokens), \
            fine_log.narrow(2, start, tokens)

    @property
    def tokens(self) -> int:
        return self.count if self.buffers is not None else 0

    def clear(self) -> None:
        self.count = 0
        self.padded = False

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

    def activate_past_recording(self, **kwargs) -> None:
        """Log what each write overwrites until the next ``crop`` (transformers calls this before speculative
        decoding), so that ``crop(-n)`` can restore the state of the shorter prefix exactly. Keywords transformers
        passes for other layer kinds (``recurrent_states_to_keep``: linear-attention states) concern no MLR layer."""
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
            # consecutive real positions, no more of them than the finest block: every token has entries of its own
            distinct = not self.rollback_log.padded and (not self.geometry.block_sizes or
                                                         count <= min(self.geometry.block_sizes))
            self._restore(*self.rollback_log.last(count), distinct=distinct)
        self.rollback_log.clear()

    def _restore(self, valid: torch.Tensor, positions: torch.Tensor, old_fine: torch.Tensor,
                 distinct: bool = False) -> None:
        """Undo the writes of n tokens: valid, positions (B, n) oldest first; old_fine (B, H, n, F), what each token's
        write replaced. Every fine dim of every token at once, by one indexed assignment of the ring elements: an
        entry written by several of them gets back what the oldest real one replaced (tokens that share an entry
        write the same value); an entry no real token wrote keeps its value. ``distinct``: known on the host that
        every token is real and has entries of its own (then each simply gets back what it replaced)."""
        geometry = self.geometry
        batch, heads, count = old_fine.shape[:3]
        if geometry.block_sizes:
            layout = geometry.fine_layout(self.ring_widths, positions.device)
            block, offset = layout["element block"], layout["element offset"]  # (F,)
            entries = (positions - self.base)[:, :, None] % block
            if not distinct:  # (padding tokens carry any position)
                entries = entries.clamp(max=self.capacity - 1)
            element = offset + entries  # (B, n, F)
            rows = torch.arange(batch, device=positions.device)[:, None, None]
            restored = old_fine.permute(0, 2, 3, 1)  # (B, n, F, H): what each token replaced
            if not distinct:
                index = torch.arange(count, device=positions.device)[None, None, :, None]
                same = (element[:, :, None, :] == element[:, None, :, :]) & valid[:, None, :, None]  # (B, n, n', F)
                oldest = torch.where(same, index, count).amin(2)  # (B, n, F)
                source = restored.gather(1, oldest.clamp(max=count - 1)[..., None].expand(-1, -1, -1, heads))
                restored = torch.where((oldest < count)[..., None], source, self.fine_storage[rows, :, element])
            self.fine_storage[rows, :, element] = restored
        if distinct:  # every row's oldest removed token is its first
            held = positions[:, 0]
            emptied = held <= self.first_positions
            self.last_positions.copy_(torch.where(emptied, -1, held - 1))
        else:
            held = torch.where(valid, positions, NO_POSITION).amin(-1)  # the oldest removed real position per row
            removed = held != NO_POSITION
            emptied = removed & (held <= self.first_positions)
            self.last_positions.copy_(torch.where(emptied, -1, torch.where(removed, held - 1, self.last_positions)))
        self.first_positions.copy_(torch.where(emptied, NO_POSITION, self.first_positions))
        self._rewind(count)


__all__ = ["RollbackLog", "RollbackMixin"]
