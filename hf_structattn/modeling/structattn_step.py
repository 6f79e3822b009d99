"""The step: what one model forward tells its MLR layers, built once before the layers run.

``build_step`` (called by every family's forward through ``structattn_prepare.prepare_step``) turns the forward's
inputs into an ``MLRStep``: the MLR positions (B, c) and padding flags of the new tokens, the self-attention cache,
and ``StepFacts``, the host integers the layers need (chunk length, the lowest / newest real position, whether every
row is real and continues its cached tokens, the newest position shared by every row, ...). Every check of the input
values (negative positions, positions that restart inside a row or do not continue a row's cached tokens, 2-D masks
holding values other than 0 and 1, positions past a learned position table) runs here, on values read back from the
device in **one** batched host read per forward; the layers read nothing back. While torch.compile or torch.export
traces, nothing is read (``facts`` is None) and the layers take their fixed-shape paths.

What each MLR cache layer writes and reads in this forward (its ``structattn_mlr_plan.LayerPlan``) is planned from
the step before the first layer runs (``structattn_prepare.prepare_step``) and handed to the layers in the step's
``layers``.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from transformers.utils import logging

STEP_KEY = "structattn_step"
NO_POSITION = torch.iinfo(torch.int64).max // 4  # the first position of a row that holds no real token yet
logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class StepFacts:
    """Host integers of one forward, read back once (``build_step``).

    tokens_before: tokens the cache held before (transformers' sequence length, padding included); held: the MLR
    layers held a token before (the chunk attends to the cache, else only to itself); all_real: no padding among the
    new tokens; lowest / highest: the lowest / highest real new position (``NO_POSITION`` / -1 when none); newest:
    the newest real position of any row after the forward (-1: none); shared_newest: that position when it is every
    row's and every row's tokens are real and continue the row (rows in step; else None); latest_first: the largest
    first real position over the rows after the forward; uniform_offset: the offset ``position - index`` shared by
    every row's real tokens, or None; contiguous: every row's real tokens have one offset (the uncached op's
    layout)."""

    tokens_before: int
    held: bool
    all_real: bool
    lowest: int
    highest: int
    newest: int
    shared_newest: Optional[int]
    latest_first: int
    uniform_offset: Optional[int]
    contiguous: bool


@dataclass(frozen=True)
class MLRStep:
    """What a model forward tells its MLR layers (in the kwargs of every attention call under ``STEP_KEY``).

    cache: the self-attention ``Cache`` or None; positions: (B, c) MLR positions of the new tokens (a right-padded
    row's run continued after its real tokens), or None (T5 beside a cache that holds full keys: the attention
    counts real tokens); valid: (B, c) bool (True = real) or None (all real); facts: ``StepFacts`` or None while
    tracing; standard_masks: every 4-D mask the model built is transformers' causal + padding mask (no caller 4-D
    mask); key_mask: the caller's 2-D keep-mask over cached and new tokens, or None; position_bias: T5's relative
    bias of the decoder self-attention over token indices (1, H, c, K) when its MLR layers read a cache (T5 sizes
    the bias by the key length ``cache.update`` returns, which for an MLR layer is the chunk's);
    last_before, first_before: (B,) the rows' newest / first real position the MLR layers hold before the forward
    (-1 / ``NO_POSITION`` for a row without one, and for every row of a traced program fed from position 0 again), or
    None without an MLR layer; tokens: the cached tokens read back by ``plain_step`` (a static cache's length);
    layers: per cache layer index, the ``structattn_mlr_plan.LayerPlan`` of an MLR cache layer this forward writes
    (None for other layers); custom_mask: the caller's 4-D mask is not transformers' causal + padding mask of the
    forward's tokens, so it is applied as given over keys in token order (an uncached forward, a cache layer that
    holds full keys, an MLR layer's first chunk; over the MLR cache's slots, the read records carry it)."""

    cache: Optional[object]
    positions: Optional[torch.Tensor]
    valid: Optional[torch.Tensor]
    facts: Optional[StepFacts]
    standard_masks: bool = True
    key_mask: Optional[torch.Tensor] = None
    position_bias: Optional[torch.Tensor] = None
    last_before: Optional[torch.Tensor] = None
    first_before: Optional[torch.Tensor] = None
    tokens: Optional[int] = None
    layers: tuple = ()
    custom_mask: bool = False

    def layer(self, layer_idx: Optional[int]):
        """The cache layer of ``layer_idx`` or None: what an ordinary (full-keys) cache layer holds is read by its
        length only."""
        cache = self.cache
        if cache is None or layer_idx is None or layer_idx >= len(cache.layers):
            return None
        return cache.layers[layer_idx]

    def real(self) -> torch.Tensor:
        """(B, c) bool padding flags (all True without padding)."""
        if self.valid is not None:
            return self.valid
        return torch.ones(self.positions.shape, dtype=torch.bool, device=self.positions.device)


UNSUPPORTED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
REFUSED_ARGUMENTS = frozenset(UNSUPPORTED_KWARGS + ("softcap", "sliding_window"))


def refuse_unsupported_arguments(kwargs: dict, layer_idx=None) -> None:
    """What MLR attention refuses in an attention call's keyword arguments, with a one-line error: packed sequences,
    logit soft-capping, a sliding window. Checked by the ``"mlr"`` functions and, before it writes, by an MLR cache
    layer's ``update`` (so that a refused call leaves the cache as it was)."""
    if REFUSED_ARGUMENTS.isdisjoint(kwargs):  # (every layer of every step asks: one set operation)
        return
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} was passed: packed sequences (varlen / padding-free batches) are not "
                             f"supported by MLR attention")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"softcap={kwargs['softcap']}: attention logit soft-capping is not supported by MLR")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"layer {'?' if layer_idx is None else layer_idx} is a sliding-window layer (window "
                         f"{kwargs['sliding_window']}); MLR replaces it only when patched with "
                         f"sliding_window_layers='replace'")


def _right_padded(key_mask: Optional[torch.Tensor], chunk: int, batch: int, device) -> torch.Tensor:
    """(B,) bool: the row's tokens before the last ``chunk`` hold a padding token after a real one (the caller's 2-D
    keep-mask over the cached and new tokens)."""
    if key_mask is None or key_mask.dim() != 2 or key_mask.shape[-1] <= chunk:
        return torch.zeros(batch, dtype=torch.bool, device=device)
    past = key_mask[:, :-chunk] != 0
    return (past.long().cummax(-1).values.bool() & ~past).any(-1).to(device).expand(batch)


def build_step(*, cache, positions: Optional[torch.Tensor], valid: Optional[torch.Tensor], batch: int, length: int,
               device, key_mask: Optional[torch.Tensor] = None, standard_masks: bool = True,
               checked_mask: Optional[torch.Tensor] = None, embedding_positions: Optional[torch.Tensor] = None,
               max_positions: Optional[tuple] = None, position_bias: Optional[torch.Tensor] = None,
               mlr_layers: Optional[list] = None) -> MLRStep:
    """The ``MLRStep`` of one forward, its input values checked with one host read (none while tracing).

    positions: (B, c) | (1, c) absolute positions of the new tokens, or None (count each row's real tokens: T5);
    valid: (B, c) bool or None (all real); key_mask: the caller's 2-D keep-mask over cached + new tokens;
    checked_mask: a 2-D mask whose values must be 0 or 1 (a non-bool mask the caller gave); embedding_positions:
    the given position ids, checked against ``max_positions`` = (field name, limit) (learned position tables);
    mlr_layers: the cache's MLR layers of the model's geometries (every one holds the same rows at the same positions;
    None: the cache's layers that hold the MLR form). Errors are one-line ``ValueError``s naming the argument."""
    tracing = torch.compiler.is_compiling()
    tokens_before = cache.get_seq_length() if cache is not None else 0
    last = first = None
    if mlr_layers is None and cache is not None:
        mlr_layers = [layer for layer in cache.layers if getattr(layer, "holds_mlr_positions", False) and
                      layer.is_bound]
    if mlr_layers:
        layer = None
        for candidate in mlr_layers:  # a written one (before the first write none is)
            if candidate.is_initialized:
                layer = candidate
                break
        if layer is not None:
            last, first = layer.last_positions, layer.first_positions
            if last.shape[0] != batch:
                raise ValueError(f"the cache holds {last.shape[0]} rows, the input has batch size {batch}")
            if tracing and isinstance(tokens_before, torch.Tensor):
                # a traced program fed from position 0 again (an exported decoder run for a new sequence): its cache
                # layers hold the last run's positions, which a restart at cumulative length 0 forgets
                fresh = tokens_before == 0
                last = torch.where(fresh, torch.full_like(last, -1), last)
                first = torch.where(fresh, torch.full_like(first, NO_POSITION), first)
        else:  # the MLR layers' first write: the rules of a cache, over rows that hold nothing yet
            last = torch.full((batch,), -1, dtype=torch.long, device=device)
            first = torch.full((batch,), NO_POSITION, dtype=torch.long, device=device)
    if positions is None:
        if last is None and cache is not None and (isinstance(tokens_before, torch.Tensor) or tokens_before):
            # T5 beside a cache that holds full keys: the attention counts the real tokens over its keys
            return MLRStep(cache, None, valid, None, standard_masks, key_mask, position_bias)
        start = last if last is not None else torch.full((batch,), -1, dtype=torch.long, device=device)
        counted = valid.long() if valid is not None else torch.ones(batch, length, dtype=torch.long, device=device)
        positions = start[:, None] + counted.cumsum(-1)
    positions = positions.to(device=device, dtype=torch.long).expand(batch, length)
    if batch * length <= HOST_FACTS_ELEMENTS and last is not None and not tracing:
        # a decode step or a short chunk: the positions read back as they are, checked in Python (ops less per step)
        facts = _host_facts(positions, valid, last, first, tokens_before, checked_mask, max_positions,
                            embedding_positions is not None, key_mask)
        if facts is not None:
            return MLRStep(cache, positions, valid, facts, standard_masks, key_mask, position_bias, last_before=last,
                           first_before=first)
    shift = None
    if last is not None:
        # right padding in generate: transformers continues a right-padded row's positions from its padded tail, so
        # its new tokens start at or before its newest cached position; they continue right after its real tokens
        real_positions = positions if valid is None else torch.where(valid, positions, NO_POSITION)
        first_new = real_positions.amin(-1)
        behind = (last >= 0) & (first_new <= last)
        if not tracing:
            behind = behind & _right_padded(key_mask, length, batch, device)
        shift = torch.where(behind, last + 1 - first_new, torch.zeros_like(first_new))
        positions = positions + shift[:, None]
    if tracing:
        return MLRStep(cache, positions, valid, None, standard_masks, key_mask, position_bias, last_before=last,
                       first_before=first)
    facts = _read_facts(positions, valid, last, first, shift, tokens_before, checked_mask, embedding_positions,
                        max_positions, key_mask)
    if isinstance(facts, torch.Tensor):  # uncached runs after padding that go behind the row: continued (rare)
        positions = facts
        facts = _read_facts(positions, valid, None, None, None, tokens_before, None, None, None)
    return MLRStep(cache, positions, valid, facts, standard_masks, key_mask, position_bias, last_before=last,
                   first_before=first)


def _refuse_bad_inputs(bad_mask: bool, low: Optional[int] = None, high: Optional[int] = None,
                       max_positions: Optional[tuple] = None) -> None:
    """One-line errors for the values a step read back: a 2-D mask holding values other than 0 and 1, and position
    ids ``low``..``high`` that are negative or beyond a learned position table (``max_positions``: (field, limit))."""
    if bad_mask:
        raise ValueError("attention_mask must be a keep-mask holding only 0 and 1 (1 = attend): additive masks (0 = "
                         "attend, -inf = masked) are not accepted; pass (mask == 0) instead")
    if low is not None and low < 0:
        raise ValueError(f"position_ids must be non-negative, got {low}")
    if high is not None and max_positions is not None and high >= max_positions[1]:
        name, limit = max_positions
        raise ValueError(f"position {high} is beyond {name}={limit}: this model has learned position embeddings for "
                         f"positions < {limit}")


def plain_step(*, cache, positions: Optional[torch.Tensor], valid: Optional[torch.Tensor], batch: int, length: int,
               device, key_mask: Optional[torch.Tensor] = None, standard_masks: bool = True,
               checked_mask: Optional[torch.Tensor] = None, past=0,
               max_positions: Optional[tuple] = None) -> MLRStep:
    """The step of a forward whose cache no MLR layer reads (a dense model of the family, a T5 without MLR decoder
    self-attention): no facts, only the input checks of ``build_step`` that concern every model (non-negative
    positions below a learned position table, a 0/1 mask; the cached length of a static cache is left in
    ``tokens`` for the mask's length check), with at most one host read."""
    if positions is not None:
        positions = positions.to(device=device, dtype=torch.long).expand(batch, length)
    step = MLRStep(cache, positions, valid, None, standard_masks, key_mask)
    if torch.compiler.is_compiling():
        return step
    parts = []
    if positions is not None:
        parts.append(torch.stack([positions.min(), positions.max()]))
    if checked_mask is not None:
        parts.append(_mask_check(checked_mask))
    if isinstance(past, torch.Tensor):
        parts.append(past.reshape(1).long().to(device))
    if not parts:
        return step
    values = torch.cat([part.long() for part in parts]).tolist()  # the one host read of the forward
    low = high = None
    if positions is not None:
        (low, high), values = values[:2], values[2:]
    if checked_mask is not None:
        bad_mask, values = bool(values[0]), values[1:]
    _refuse_bad_inputs(checked_mask is not None and bad_mask, low, high, max_positions)
    if isinstance(past, torch.Tensor):
        return dataclasses.replace(step, tokens=values[0])
    return step


def _read_facts(positions, valid, last, first, shift, tokens_before, checked_mask, embedding_positions,
                max_positions, key_mask=None):
    """Check the step's values and read its ``StepFacts`` back in one host read. Returns the facts, or (rare) the
    corrected positions of an uncached chunk whose real runs after padding go behind the row (to be read again).
    ``last`` / ``first`` (B,): the rows' newest / first cached real positions when the MLR cache is written (the
    cache's rules: consecutive positions continuing each row), else None (uncached: positions increase)."""
    batch, length = positions.shape
    device = positions.device
    big = NO_POSITION
    index = torch.arange(length, device=device)
    zero = torch.zeros((), dtype=torch.bool, device=device)
    if valid is not None:
        low_new = torch.where(valid, positions, big).amin(-1)
        high_new = torch.where(valid, positions, -1).amax(-1)
        offsets = positions - index
        low_off = torch.where(valid, offsets, big).amin(-1)
        high_off = torch.where(valid, offsets, -big).amax(-1)
        has = valid.any(-1)
        low_off, high_off = torch.where(has, low_off, 0), torch.where(has, high_off, 0)
    else:
        low_new, high_new = positions[:, 0], positions[:, -1]
        low_off = high_off = positions[:, 0]
        if length > 1:
            high_new = positions.amax(-1)
            low_new = positions.amin(-1)
            offsets = positions - index
            low_off, high_off = offsets.amin(-1), offsets.amax(-1)
    parts = [low_new, high_new, low_off, high_off]  # per row, B values each
    if last is not None:
        # the real tokens of a row must be consecutive and continue the row (slots are addressed by position)
        rank = valid.long().cumsum(-1) - 1 if valid is not None else index
        start = torch.where(last >= 0, last + 1, low_new)
        broken = positions != start[:, None] + rank
        broken = (broken & valid).any(-1) if valid is not None else broken.any(-1)
        parts += [last, first, shift, broken]
        kept = _kept_cached(key_mask, batch, length)
        parts.append(kept if kept is not None else first)  # (without a mask: a placeholder of B values)
        flags = [zero, zero]
    else:
        steps = positions[:, 1:] - positions[:, :-1]
        if valid is not None:
            steps = torch.where(valid[:, 1:] & valid[:, :-1], steps, 1)
        restart = (steps <= 0).any() if length > 1 else zero
        behind_run = zero
        if valid is not None and length > 1:
            held = torch.where(valid, positions, -big).cummax(-1).values
            before = torch.cat([torch.full_like(held[:, :1], -big), held[:, :-1]], -1)
            behind_run = (valid & (positions <= before)).any()
        flags = [restart, behind_run]
    flags.append(valid.all() if valid is not None else ~zero)
    scalars = [torch.stack(flags).long()]
    scalars.append(_mask_check(checked_mask) if checked_mask is not None else zero.long().reshape(1))
    if embedding_positions is not None:
        scalars.append(torch.stack([embedding_positions.min(), embedding_positions.max()]).long())
    if isinstance(tokens_before, torch.Tensor):
        scalars.append(tokens_before.reshape(1).long().to(device))
    # the one host read of the forward
    values = torch.cat([part.long() for part in parts] + scalars).tolist()
    rows = [values[i * batch:(i + 1) * batch] for i in range(len(parts))]
    rest = values[len(parts) * batch:]
    restart, behind_run, all_real, bad_mask = (bool(value) for value in rest[:4])
    rest = rest[4:]
    if embedding_positions is not None:
        (low_embedding, high_embedding), rest = rest[:2], rest[2:]
    if isinstance(tokens_before, torch.Tensor):
        tokens_before = rest[0]
    if embedding_positions is not None:
        _refuse_bad_inputs(bad_mask, low_embedding, high_embedding, max_positions)
    else:
        _refuse_bad_inputs(bad_mask)
    low_rows, high_rows, low_offsets, high_offsets = rows[:4]
    lowest, highest = min(low_rows), max(high_rows)
    if highest >= 0 and lowest < 0:
        raise ValueError(f"positions must be non-negative for MLR attention, got {lowest}")
    contiguous = [low == high for low, high in zip(low_offsets, high_offsets)]
    uniform = low_offsets[0] if all(contiguous) and all(value == low_offsets[0] for value in low_offsets) else None
    if last is None:
        if restart:
            raise ValueError("position_ids restart or decrease inside a row: packed sequences are not supported by "
                             "MLR attention (pass one sequence per row, with padding)")
        if behind_run:
            return continue_runs(positions, valid)
        firsts = [low if low != big else -1 for low in low_rows]
        return StepFacts(tokens_before, bool(tokens_before), all_real, lowest, highest, max(high_rows), None,
                         max(firsts), uniform, all(contiguous))
    last_rows, first_rows, shifts, broken_rows, kept_rows = rows[4:]
    if key_mask is not None:
        _refuse_hidden_cached_tokens(kept_rows, last_rows, first_rows)
    for row in range(batch):
        if broken_rows[row]:
            _refuse_gap(row, last_rows[row], positions, valid)
    shifted = [row for row in range(batch) if shifts[row]]
    if shifted:
        row = shifted[0]
        # (once per message: the row's newest position is left out, it moves with every step)
        logger.warning_once(f"row {row}: new positions start {shifts[row]} behind the row's newest cached position + "
                            f"1 (right padding?): MLR attention places them right after the row's real tokens, behind "
                            f"its padding; pad on the left (tokenizer padding_side='left') to generate what each row "
                            f"generates alone")
    newest = [max(old, new) for old, new in zip(last_rows, high_rows)]
    firsts = [min(old, new) for old, new in zip(first_rows, low_rows)]
    continuing = all_real and all(old >= 0 and low == old + 1 for old, low in zip(last_rows, low_rows))
    shared = newest[0] if continuing and all(value == newest[0] for value in newest) else None
    return StepFacts(tokens_before, bool(tokens_before), all_real, lowest, highest, max(newest), shared, max(firsts),
                     uniform, all(contiguous))


def _mask_check(checked_mask: torch.Tensor) -> torch.Tensor:
    """(1,) 1 when a 2-D keep-mask holds a value other than 0 and 1 (an integer mask: its least and largest value
    tell, one op)."""
    if checked_mask.is_floating_point():
        return ((checked_mask != 0) & (checked_mask != 1)).any().long().reshape(1)
    low, high = torch.aminmax(checked_mask)
    return ((low < 0) | (high > 1)).long().reshape(1)


HOST_FACTS_ELEMENTS = 256  # steps of at most this many new tokens read their positions back as they are


def _host_facts(positions, valid, last, first, tokens_before, checked_mask, max_positions, embedding: bool,
                key_mask=None):
    """``StepFacts`` of a short step (decode steps, speculative verification chunks: at most ``HOST_FACTS_ELEMENTS``
    new tokens) over MLR layers that are written, from the new tokens' positions and padding and the rows' newest and
    first cached positions read back as they are in one host read and checked in Python (fewer ops than reducing
    them on the device); None when a row starts behind its newest cached position (right padding in generate:
    ``build_step``'s general path continues it). ``embedding``: the positions are the given position ids, checked
    against ``max_positions`` (else only the real tokens' positions must be non-negative)."""
    batch, length = positions.shape
    parts = [positions.reshape(-1), last, first]
    if valid is not None:
        parts.append(valid.reshape(-1).long())
    if checked_mask is not None:
        parts.append(_mask_check(checked_mask))
    if isinstance(tokens_before, torch.Tensor):
        parts.append(tokens_before.reshape(1).long().to(positions.device))
    kept = _kept_cached(key_mask, batch, length)
    if kept is not None:
        parts.append(kept)
    values = torch.cat(parts).tolist()  # the one host read of the forward
    kept_rows = None
    if kept is not None:
        kept_rows, values = values[-batch:], values[:-batch]
    count = batch * length
    rows = [values[row * length:(row + 1) * length] for row in range(batch)]
    old, firsts, rest = values[count:count + batch], values[count + batch:count + 2 * batch], values[count + 2 * batch:]
    flags = [[True] * length] * batch
    if valid is not None:
        flags = [[bool(value) for value in rest[row * length:(row + 1) * length]] for row in range(batch)]
        rest = rest[count:]
    bad_mask = False
    if checked_mask is not None:
        bad_mask, rest = bool(rest[0]), rest[1:]
    if bad_mask:  # an additive 2-D mask is refused as such, also over a cache (its columns are not a keep-mask)
        _refuse_bad_inputs(bad_mask)
    if kept_rows is not None:
        _refuse_hidden_cached_tokens(kept_rows, last_rows=old, first_rows=firsts)
    if isinstance(tokens_before, torch.Tensor):
        tokens_before = rest[0]
    # (list comprehensions, not generators: a generator costs a Python call per item, every decode step)
    reals = [[position for position, real in zip(row, flag) if real] for row, flag in zip(rows, flags)]
    if any([real and cached >= 0 and real[0] <= cached for real, cached in zip(reals, old)]):
        return None
    every = [position for real in reals for position in real]
    if embedding:
        _refuse_bad_inputs(bad_mask, min(values[:count]), max(values[:count]), max_positions)
    else:
        _refuse_bad_inputs(bad_mask)
    if every and min(every) < 0:
        raise ValueError(f"positions must be non-negative for MLR attention, got {min(every)}")
    for row, (real, cached) in enumerate(zip(reals, old)):
        start = cached + 1 if cached >= 0 else (real[0] if real else 0)
        if real != list(range(start, start + len(real))):
            _refuse_gap(row, cached, positions, valid)
    offsets = [[position - index for index, (position, real) in enumerate(zip(row, flag)) if real]
               for row, flag in zip(rows, flags)]
    contiguous = all([len(set(offset)) <= 1 for offset in offsets])
    row_offsets = [offset[0] if offset else 0 for offset in offsets]
    uniform = row_offsets[0] if contiguous and len(set(row_offsets)) == 1 else None
    newest = [max(cached, real[-1]) if real else cached for real, cached in zip(reals, old)]
    firsts = [min(held, real[0]) if real else held for real, held in zip(reals, firsts)]
    all_real = all([all(flag) for flag in flags])
    continuing = all_real and all([cached >= 0 for cached in old])
    shared = newest[0] if continuing and len(set(newest)) == 1 else None
    return StepFacts(tokens_before, bool(tokens_before), all_real, min(every, default=NO_POSITION),
                     max(every, default=-1), max(newest), shared, max(firsts), uniform, contiguous)


def _kept_cached(key_mask: Optional[torch.Tensor], batch: int, length: int) -> Optional[torch.Tensor]:
    """(B,) how many cached tokens the caller's 2-D keep-mask keeps per row (its columns before the new tokens), or
    None without such a mask."""
    if key_mask is None or key_mask.dim() != 2 or key_mask.shape[-1] <= length:
        return None
    return (key_mask[:, :-length] != 0).sum(-1).expand(batch)


def _refuse_hidden_cached_tokens(kept_rows: list, last_rows: list, first_rows: list) -> None:
    """A 2-D mask may hide padding, never a real token the cache already holds: the MLR cache keeps a row's real
    tokens as one span and reads all of them (a later mask cannot take one back)."""
    for row, (kept, last, first) in enumerate(zip(kept_rows, last_rows, first_rows)):
        held = last - first + 1 if last >= 0 else 0
        if kept < held:
            raise ValueError(f"attention_mask hides a cached real token of row {row}: the MLR cache holds its "
                             f"{held} real tokens, the mask keeps {kept} of the cached columns; a cached token cannot "
                             f"be hidden afterwards (run the whole sequence with use_cache=False, or start a new cache)")


def _refuse_gap(row: int, last: int, positions, valid) -> None:
    real = positions[row] if valid is None else positions[row][valid[row]]
    raise ValueError(f"the MLR cache addresses slots by position: the real tokens of a row must have consecutive "
                     f"increasing positions continuing the row, and row {row} does not: the cache holds "
                     f"{f'positions up to {last}' if last >= 0 else 'no position'}, this call feeds real tokens at "
                     f"positions {real.tolist()[:8]}{' and more' if real.numel() > 8 else ''}. Positions the cache "
                     f"already holds are fed again when generate() continues a cache that another generate() call "
                     f"filled and transformers re-feeds the whole sequence (prompt lookup, assisted generation): "
                     f"pass that call a fresh cache, or feed only the tokens after the cached ones. Positions that "
                     f"skip ahead or restart (packed sequences) cannot use a cache")


def continue_runs(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) positions where each run of real tokens after padding that does not continue the row (transformers'
    positions for the tokens generated after a right-padded prompt repeat the prompt's last ones) continues right
    after the row's previous real token, as the MLR cache places it. Rare: a host loop over the rows' real runs."""
    fixed = positions.clone()
    for row in range(positions.shape[0]):
        newest = None
        for index in valid[row].nonzero().flatten().tolist():
            if newest is not None and int(fixed[row, index]) <= newest:
                fixed[row, index:] += newest + 1 - int(fixed[row, index])
            newest = int(fixed[row, index])
    return fixed


__all__ = ["MLRStep", "NO_POSITION", "REFUSED_ARGUMENTS", "STEP_KEY", "StepFacts", "UNSUPPORTED_KWARGS", "build_step",
           "continue_runs", "plain_step", "refuse_unsupported_arguments"]
