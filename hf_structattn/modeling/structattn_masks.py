"""The dtypes of scores and masks, and the one rule for attention masks: what a mask's values mean
(``mask_allowed``), which shapes a model accepts (``check_mask_shape``), which float masks are refused
(``check_additive_mask``), and how a mask is read over keys in token order or over the MLR cache's slots (a caller's
4-D mask compared with transformers' causal + padding mask, ``is_standard_mask``; at the slots, ``slot_mask``). Part
of the checkpoint payload."""

from typing import Optional

import torch


def mask_value(dtype: torch.dtype) -> float:
    """Additive value for masked pairs, finite in ``dtype``: half its lowest value, so a mask plus a bias (or a
    second mask) of up to the same magnitude stays finite. Finite on purpose: a group whose keys are all masked
    then has a finite log-sum-exp and contributes exactly zero weight when merged, where ``-inf`` gives NaN."""
    return torch.finfo(dtype).min / 2


_SOFTMAX_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
                   torch.float64: torch.float64}  # a constant table: ``torch.promote_types`` is a dispatched op


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Working dtype of a softmax over scores of ``dtype``: at least float32 (fp16/bf16 scores are upcast), and
    float64 stays float64 so float64 paths are exact to ~1e-12."""
    work = _SOFTMAX_DTYPES.get(dtype)
    return work if work is not None else torch.promote_types(dtype, torch.float32)



def keep_mask(attention_mask: Optional[torch.Tensor], batch: int, length: int, device=None,
              name: str = "attention_mask") -> Optional[torch.Tensor]:
    """The (B, T) bool keep-mask (True = attend) of a (B, T) or (1, T) mask, or None.

    Accepted: bool, or integer / floating tensors holding only 0 and 1 (what tokenizers return, also as float).
    An additive mask (0 = attend, -inf or a large negative number = masked) is refused rather than guessed: read
    as a keep-mask it would be silently inverted."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape ({batch}, {length}), got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2 or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[1] != length:
        raise ValueError(f"{name} must have shape ({batch}, {length}) (batch, key positions; 1 = attend), got "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.dtype != torch.bool:
        if attention_mask.is_complex():
            raise ValueError(f"{name} must be a bool, integer or 0/1 float keep-mask, got {attention_mask.dtype}")
        outside = (attention_mask != 0) & (attention_mask != 1)
        if not torch.compiler.is_compiling() and bool(outside.any()):  # a host read: checked eagerly only
            value = float(attention_mask[outside].flatten()[0])
            raise ValueError(f"{name} must be a keep-mask holding only 0 and 1 (1 = attend), got a {attention_mask.dtype} "
                             f"mask holding {value}: additive masks (0 = attend, -inf = masked) are not accepted; "
                             f"pass (mask == 0) instead")
    return attention_mask.to(device=device).bool().expand(batch, length)



MASKED_AT_MOST = -1e4  # an additive (float) mask entry at or below this is "masked": its weight underflows to 0


def mask_allowed(mask: torch.Tensor) -> torch.Tensor:
    """The one mask rule: the bool form (True = attend) of any attention mask. bool: as is; integer: non-zero
    entries (a keep-mask); floating: an additive mask, 0 = attend (``check_additive_mask`` refuses any other value
    than 0 and values at or below ``MASKED_AT_MOST``: -inf, the dtype's lowest value, -1e4, -1e9, ...)."""
    if mask.dtype == torch.bool:
        return mask
    return mask == 0 if mask.is_floating_point() else mask != 0


def own_key_allowed(mask: torch.Tensor, offset) -> torch.Tensor:
    """(B | 1, T) whether each of the T queries of a 4-D mask (B | 1, H | 1, T, K) may see its own key, column
    ``offset + i`` (clamped to the mask), in at least one head: a caller's 4-D mask's real tokens."""
    length = mask.shape[-2]
    rows = torch.arange(length, device=mask.device)
    columns = (rows + offset).clamp(max=mask.shape[-1] - 1)
    return mask_allowed(mask[..., rows, columns]).any(1)


def check_mask_shape(mask: torch.Tensor, batch: int, heads: Optional[int], length: int, past: Optional[int] = None,
                     name: str = "attention_mask") -> None:
    """The one rule for the shape of a model's attention mask, in every family (GPT-2, T5, patched decoders) and on
    every path (uncached, prefill, chunk, decode step):

    * 2-D ``(B | 1, cached + new tokens)``: a keep-mask over the keys; one row is broadcast over the batch;
    * 4-D ``(B | 1, 1 | H, new tokens, >= cached + new tokens)`` (wider: a static cache's slots): a batch of one is
      broadcast over the batch, one head over the heads, and H masks are applied one per query head;
    * anything else is refused with one line naming the argument, its shape and the accepted shapes.

    ``heads``: the query heads (None: not checked); ``past``: the cached tokens, None while not known on the host
    (then only the new tokens are counted)."""
    shape = tuple(mask.shape)
    covered = length if past is None else past + length
    if mask.is_complex():
        raise ValueError(f"{name} must be a bool, integer or float mask, got {mask.dtype} of shape {shape}")
    if mask.dim() == 2:
        if shape[0] not in (1, batch) or (shape[1] != covered if past is not None else shape[1] < covered):
            expected = f"({batch}, {covered})" if past is not None else f"({batch}, cached + new tokens)"
            raise ValueError(f"{name} must have shape {expected} (batch, cached + new tokens; 1 = attend; a batch of "
                             f"1 is broadcast), got {shape}")
    elif mask.dim() == 4:
        if shape[0] not in (1, batch) or (heads is not None and shape[1] not in (1, heads)) or \
                shape[2] != length or shape[3] < covered:
            head_dim = "1" if heads is None or heads == 1 else f"1 or {heads}"
            raise ValueError(f"a 4-D {name} must have shape ({batch} or 1, {head_dim}, {length}, >= {covered}) "
                             f"(batch, heads, new tokens, cached + new tokens; a batch or head axis of 1 is "
                             f"broadcast), got {shape}")
    else:
        raise ValueError(f"{name} must be a (batch, cached + new tokens) keep-mask or a 4-D (batch, heads, new tokens, "
                         f"cached + new tokens) mask, got shape {shape}")


def check_additive_mask(mask: torch.Tensor, name: str = "attention_mask") -> None:
    """Refuse a float mask holding a score bias (a value other than 0 and at most ``MASKED_AT_MOST``) or NaN: MLR
    attention applies masks by which pairs attend, so a bias would be dropped silently and a NaN read as masked.
    One host read (eager only)."""
    if torch.compiler.is_compiling() or not mask.is_floating_point():
        return
    bias = ~((mask == 0) | (mask <= MASKED_AT_MOST))  # NaN is neither
    if bool(bias.any()):
        value = float(mask[bias].flatten()[0])
        raise ValueError(f"{name} is a float (additive) mask holding {value}: MLR attention reads a float mask as 0 = "
                         f"attend and <= {MASKED_AT_MOST:g} (e.g. -inf or the dtype's lowest value) = masked; pass "
                         f"additive score biases as a bias, or a bool mask (True = attend)")



def key_validity(attention_mask: Optional[torch.Tensor], batch: int, key_length: int) -> Optional[torch.Tensor]:
    """(B, K) bool padding flags of the keys (True = real) from the mask transformers built, or None (no padding).

    A 4-D mask's last query row allows every real key in some head (a causal mask's last query is the newest
    position, and a bidirectional mask's rows are all alike); a 2-D mask is a key keep-mask; a float 4-D mask is
    additive (``mask_allowed``)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        return mask_allowed(attention_mask[:, :, -1, -key_length:]).any(1).expand(batch, key_length)
    if attention_mask.dim() == 2:
        return mask_allowed(attention_mask)[:, -key_length:].expand(batch, key_length)
    raise ValueError(f"MLR attention got a {attention_mask.dim()}-D attention mask of shape "
                     f"{tuple(attention_mask.shape)}; it reads a (B, K) key mask or transformers' 4-D mask")


MASK_REFUSED = ("MLR attention got a 4-D attention mask that allows keys the MLR key cache does not hold ({what}); "
                "with a cache a 4-D mask is applied over the cached real tokens of each row at or before each query "
                "(rows padded on the left), so it may not allow padding, future keys or empty slots: pass "
                "use_cache=False to apply it over every key")


def is_standard_mask(attention_mask: Optional[torch.Tensor], valid: Optional[torch.Tensor], causal: bool,
                     query_length: int, query_offset: Optional[int] = None) -> bool:
    """Whether a mask is transformers' causal (or bidirectional) + padding mask, which MLR reads only for padding
    (causality and blocks come from positions); any other 4-D mask (a sliding window, a bidirectional or
    block-diagonal overlay, a hidden pair) is applied as given by the caller. No mask, a 2-D mask and a compiled
    region count as standard. One host read (a caller's 4-D mask only)."""
    if attention_mask is None or attention_mask.dim() != 4 or torch.compiler.is_compiling() or \
            attention_mask.shape[-2] != query_length:
        return True
    key_length = attention_mask.shape[-1]
    allowed = mask_allowed(attention_mask)
    expected = valid[:, None, None, :] if valid is not None else torch.ones(
        1, 1, 1, key_length, dtype=torch.bool, device=attention_mask.device)
    if causal:
        offset = key_length - query_length if query_offset is None else query_offset
        future = torch.ones(query_length, key_length, dtype=torch.bool, device=attention_mask.device).triu_(1 + offset)
        expected = expected & ~future
    # a mask of batch or heads 1 is broadcast (``check_mask_shape``): compare at the shape both broadcast to
    expected, allowed = torch.broadcast_tensors(expected[..., -allowed.shape[-2]:, :], allowed)
    # a query with no real key at all (a padding query) may be given no key or every key (transformers unmasks such
    # rows to avoid NaN) -- but not some keys: that is a packed sequence, whose earlier segments would look like
    # padding to the last row that ``key_validity`` reads
    rows = expected.any(-1, keepdim=True)
    padding_row_ok = ~allowed.any(-1, keepdim=True) | allowed.all(-1, keepdim=True)
    return bool(torch.where(rows, allowed == expected, padding_row_ok).all())


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form (0 = attend, ``mask_value`` elsewhere) of a bool keep-mask, in ``dtype``."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, mask_value(dtype))


def group_major(bias: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """A bias or additive mask (B | 1, 1 | Hq, T, K) over query heads, at the rows of a grouped-query read: query
    head ``h * groups + g`` is row ``g * T + i`` of KV head ``h``, so (B | 1, 1 | Hk, groups * T, K). One head is
    repeated over the groups; per-head masks go to their rows (a reshape, no copy)."""
    if groups == 1 or bias.dim() != 4:
        return bias
    if bias.shape[1] == 1:
        return bias.repeat(1, 1, groups, 1)
    return bias.reshape(bias.shape[0], kv_heads, groups * bias.shape[2], bias.shape[3])


def token_shift(positions: torch.Tensor, valid: torch.Tensor, tokens, base: int) -> torch.Tensor:
    """(B,) token index of slot 0 of each row (slot ``s`` holds token ``s + shift``): token index minus position of
    the chunk's real tokens (the chunk is the last c of ``tokens``), plus ``base``. Exact for rows whose cached real
    tokens are consecutive and end right before the chunk (left padding, or none)."""
    chunk = positions.shape[1]
    offset = (tokens - chunk + torch.arange(chunk, device=positions.device))[None, :] - positions
    shift = torch.where(valid, offset, torch.full_like(offset, torch.iinfo(offset.dtype).min)).amax(-1)
    return torch.where(valid.any(-1), shift, torch.zeros_like(shift)) + base


def slot_bias(bias: torch.Tensor, shift: torch.Tensor, slots: int) -> torch.Tensor:
    """A bias over token indices (T5's relative bias, built from the slot count) read at slot order: slot ``s`` of
    row b is token ``s + shift[b]``; (.., S), zero-padded when the bias is narrower. Identity (no copy) when every
    shift is zero."""
    if not torch.compiler.is_compiling() and not bool(shift.any()):
        read = bias[..., :slots] if bias.shape[-1] >= slots else bias
    else:
        index = (torch.arange(slots, device=bias.device) + shift[:, None]).clamp(min=0, max=bias.shape[-1] - 1)
        expanded = bias.expand(shift.shape[0], *bias.shape[1:])
        read = expanded.gather(-1, index[:, None, None, :].expand(*expanded.shape[:-1], slots))
    if read.shape[-1] < slots:
        read = torch.nn.functional.pad(read, (0, slots - read.shape[-1]))
    return read


def slot_mask(attention_mask: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, tokens,
              first_positions: torch.Tensor, base: int, slots: int) -> Optional[torch.Tensor]:
    """A caller's 4-D mask (B | 1, 1 | Hq, c, K) over the tokens (token order) read at an MLR cache layer's slots
    after the chunk's write: None when it is the causal + padding mask of what the layer holds (nothing to apply),
    else (B, 1 | Hq, c, S) bool in slot order (a per-head mask stays per head). positions, real: (B, c) the chunk's;
    tokens: the tokens the layer holds after the write (padding included); first_positions: (B,) the rows' first
    real position after the write; base: the layer's slot 0 position.

    A mask that allows a key the cache does not hold (a padding token, which is never stored, a future key, an
    empty slot) for a real query is refused. Host reads: made once per forward and storage shape, while planning."""
    allowed = mask_allowed(attention_mask)
    batch, chunk = positions.shape
    if allowed.shape[-2] != chunk:
        raise ValueError(MASK_REFUSED.format(what=f"mask of shape {tuple(attention_mask.shape)} for {chunk} new "
                                                  f"tokens"))
    heads, key_length = allowed.shape[1], allowed.shape[-1]  # one mask for every head, or one per query head
    allowed = allowed.expand(batch, heads, chunk, key_length)
    shift = token_shift(positions, real, tokens, base)
    column = torch.arange(slots, device=allowed.device) + shift[:, None]  # (B, S): the token held in slot s
    inside = (column >= 0) & (column < key_length)
    index = column.clamp(min=0, max=key_length - 1)[:, None, None, :].expand(batch, heads, chunk, slots)
    gathered = allowed.gather(-1, index) & inside[:, None, None, :]
    slot_positions = torch.arange(slots, device=allowed.device) + base
    held = (slot_positions >= first_positions[:, None, None]) & \
        (slot_positions <= positions[:, :, None])  # (B, c, S): written, real, not in the future
    held = held[:, None]
    outside = (allowed.sum(-1, keepdim=True) != (gathered & held).sum(-1, keepdim=True)) & real[:, None, :, None]
    if bool(outside.any()):
        row, _, query_index, _ = outside.nonzero()[0].tolist()
        raise ValueError(MASK_REFUSED.format(what=f"row {row}, new token {query_index}"))
    return None if bool(((gathered == held) | ~real[:, None, :, None]).all()) else gathered & held


__all__ = ["MASKED_AT_MOST", "MASK_REFUSED", "additive_mask", "check_additive_mask", "check_mask_shape",
           "group_major", "is_standard_mask", "keep_mask", "key_validity", "mask_allowed", "mask_value",
           "own_key_allowed", "slot_bias", "slot_mask", "softmax_dtype", "token_shift"]
