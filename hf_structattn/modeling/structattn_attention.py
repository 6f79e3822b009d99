"""MLR attention inside transformers: the attention functions registered in ``AttentionInterface`` and how a layer
gets them. Every family (GPT-2, T5, patched decoders) installs MLR the same way: ``install_mlr_attention(module,
geometry)`` gives the layer's attention module an ``MLRLayerConfig``, the model's own config except that
``_attn_implementation`` names the MLR function of the same kind. The module's own forward then dispatches through
``ALL_ATTENTION_FUNCTIONS`` exactly as it would for SDPA:

* ``"eager"`` -> ``"mlr_eager"``: materialised scores (the reference semantics), returns the probabilities (what
  ``output_attentions`` needs, as stock eager attention does);
* anything else (``"sdpa"``, flash, flex, ...) -> ``"mlr"``: the fused exact op (CPU flash kernel per level group,
  Triton on CUDA), the decode step and the chunk path over the hierarchical cache; no probabilities.

The model's config keeps the name the user chose (``config._attn_implementation == "eager"`` stays true, and every
other layer runs stock eager attention), so ``set_attn_implementation`` and ``from_pretrained(...,
attn_implementation=...)`` behave as for any transformers model.

Inputs the functions read besides q, k, v: the attention mask transformers built for the model's implementation (a
4-D causal or bidirectional keep/additive mask, a 2-D key mask, or None), ``position_ids`` (B, T) when the model
passes them (T5 does not: positions then count the real tokens of each row, ``cumsum(mask) - 1``), T5's
``position_bias`` (added in every level), and the ``StructAttnStep`` that the model forward puts in the kwargs
(``structattn_cache.STEP_KEY``): the self-attention cache and the new tokens' positions and padding.
"""

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .structattn_cache import MLR_CACHE_LAYERS, STEP_KEY, MLRStaticKeyCacheLayer, PendingChunk
from .structattn_decoder_spec import stock_layer_geometry
from .structattn_geometry import MLRGeometry, mask_value, softmax_dtype
from .structattn_mlr import mlr_attention
from .structattn_mlr_decode import mlr_attention_full_keys, mlr_cached_chunk, mlr_decode_step
from .structattn_reference import mlr_scores_reference

MLR_ATTENTION = "mlr"
MLR_EAGER_ATTENTION = "mlr_eager"
UNSUPPORTED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

_warned = set()


def mlr_implementation(implementation: Optional[str]) -> str:
    """The MLR attention function standing in for a transformers attention implementation name."""
    return MLR_EAGER_ATTENTION if implementation in ("eager", MLR_EAGER_ATTENTION) else MLR_ATTENTION


class MLRLayerConfig:
    """The config an MLR layer's attention module reads: every attribute is the model's (stack's) config's, read
    live, except ``_attn_implementation``, which names the MLR function of the same kind (``mlr_implementation``),
    and ``mlr_geometry``, the layer's ``MLRGeometry``. Writes go to the model's config."""

    def __init__(self, config, geometry: MLRGeometry):
        self.__dict__["_structattn_base"] = config  # past __setattr__, which writes through to the base
        self.__dict__["mlr_geometry"] = geometry

    @property
    def base_config(self):
        return self._structattn_base

    @property
    def _attn_implementation(self) -> str:
        return mlr_implementation(self._structattn_base._attn_implementation)

    def __getattr__(self, name: str):
        # only called for names not found on the view itself
        if name.startswith("__") or name == "_structattn_base":  # copy/pickle protocol: never the base's
            raise AttributeError(name)
        return getattr(self._structattn_base, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.base_config, name, value)

    def __deepcopy__(self, memo):
        import copy

        return MLRLayerConfig(copy.deepcopy(self.base_config, memo), self.mlr_geometry)

    def __reduce__(self):
        return MLRLayerConfig, (self.base_config, self.mlr_geometry)

    def __repr__(self) -> str:
        return f"MLRLayerConfig({type(self.base_config).__name__}, {self.mlr_geometry})"


def install_mlr_attention(module: torch.nn.Module, geometry: MLRGeometry) -> None:
    """Make ``module`` (any attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS`` with
    ``self.config._attn_implementation``) run MLR attention of ``geometry``. Its parameters are untouched."""
    config = module.config
    if isinstance(config, MLRLayerConfig):
        config = config.base_config
    module.config = MLRLayerConfig(config, geometry)


def mlr_geometry_of(module: torch.nn.Module) -> Optional[MLRGeometry]:
    config = getattr(module, "config", None)
    return config.mlr_geometry if isinstance(config, MLRLayerConfig) else None


def _layer_geometry(module: torch.nn.Module) -> Optional[MLRGeometry]:
    """The layer's ``MLRGeometry``: installed (``MLRLayerConfig``), or, for a stock model run with
    ``attn_implementation="mlr"`` whose config carries MLR fields, resolved and installed now; None for a layer
    that is not MLR."""
    geometry = mlr_geometry_of(module)
    if geometry is not None or getattr(getattr(module, "config", None), "mlr_ranks", None) is None:
        return geometry
    geometry = stock_layer_geometry(module)
    if geometry is not None:
        install_mlr_attention(module, geometry)
    return geometry


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


# ------------------------------------------------------------------------------------------- masks


def key_validity(attention_mask: Optional[torch.Tensor], batch: int, key_length: int) -> Optional[torch.Tensor]:
    """(B, K) bool padding flags of the keys (True = real) from the mask transformers built, or None (no padding).

    A 4-D mask's last query row allows every real key (a causal mask's last query is the newest position, and a
    bidirectional mask's rows are all alike); a 2-D mask is a key keep-mask; additive float masks count entries
    above half the dtype's lowest value as allowed."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        row = attention_mask[:, 0, -1, :]
    elif attention_mask.dim() == 2:
        row = attention_mask
    else:
        raise ValueError(f"MLR attention got a {attention_mask.dim()}-D attention mask of shape "
                         f"{tuple(attention_mask.shape)}; it reads a (B, K) key mask or transformers' 4-D mask")
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2 if row.is_floating_point() else row != 0
    return row[:, -key_length:].expand(batch, key_length)


MASK_REFUSED = ("MLR attention got a 4-D attention mask that allows keys the MLR key cache does not hold ({what}); "
                "with a cache a 4-D mask is applied over the cached real tokens of each row at or before each query "
                "(rows padded on the left), so it may not allow padding, future keys or empty slots: pass "
                "use_cache=False to apply it over every key")


def _allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """The bool (True = attend) form of a 4-D mask: bool as is, additive float masks allow entries above half the
    dtype's lowest value, integer masks their non-zero entries."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_floating_point():
        return attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return attention_mask != 0


def _is_standard_mask(attention_mask: Optional[torch.Tensor], valid: Optional[torch.Tensor], causal: bool,
                      query_length: int, query_offset: Optional[int] = None) -> bool:
    """Whether a mask is transformers' causal (or bidirectional) + padding mask, which MLR reads only for padding
    (causality and blocks come from positions); any other 4-D mask (a sliding window, a bidirectional or
    block-diagonal overlay, a hidden pair) is applied as given by the caller. No mask, a 2-D mask and a compiled
    region count as standard."""
    if attention_mask is None or attention_mask.dim() != 4 or torch.compiler.is_compiling() or \
            attention_mask.shape[-2] != query_length:
        return True
    key_length = attention_mask.shape[-1]
    allowed = _allowed(attention_mask)
    expected = valid[:, None, None, :] if valid is not None else torch.ones(
        1, 1, 1, key_length, dtype=torch.bool, device=attention_mask.device)
    if causal:
        offset = key_length - query_length if query_offset is None else query_offset
        future = torch.ones(query_length, key_length, dtype=torch.bool, device=attention_mask.device).triu_(1 + offset)
        expected = expected & ~future
    expected = expected[..., -allowed.shape[-2]:, :].expand_as(allowed)
    # a query with no real key at all (a padding query) may be given no key or every key (transformers unmasks such
    # rows to avoid NaN) -- but not some keys: that is a packed sequence, whose earlier segments would look like
    # padding to the last row that ``key_validity`` reads
    rows = expected.any(-1, keepdim=True)
    padding_row_ok = ~allowed.any(-1, keepdim=True) | allowed.all(-1, keepdim=True)
    return bool(torch.where(rows, allowed == expected, padding_row_ok).all())


def _own_key_allowed(allowed: torch.Tensor, offset: int) -> torch.Tensor:
    """(B, T) whether each query may see its own key (column ``offset + i``): a custom mask's real tokens."""
    length = allowed.shape[-2]
    rows = torch.arange(length, device=allowed.device)
    return allowed[:, 0][:, rows, rows + offset]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, mask_value(dtype))


def _mlr_mask(*args, **kwargs):
    return sdpa_mask(*args, **kwargs)


def _mlr_eager_mask(*args, **kwargs):
    return eager_mask(*args, **kwargs)


# ------------------------------------------------------------------------------------------- positions


def _query_positions(kwargs: dict, valid: Optional[torch.Tensor], batch: int, length: int, key_length: int,
                     device) -> torch.Tensor:
    """(B, T) absolute positions of the queries: ``position_ids`` when the model passes them, else the real-token
    count of each row (``cumsum(mask) - 1`` over the keys) for its last ``length`` keys."""
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids of shape {tuple(position_ids.shape)}: MLR attention needs (batch, length) "
                             f"positions; multimodal (3-D, e.g. M-RoPE) position ids are not supported")
        return position_ids.to(device=device, dtype=torch.long).expand(batch, length)
    if valid is None:
        return torch.arange(key_length - length, key_length, device=device).expand(batch, length)
    return (valid.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]


def _checked_positions(positions: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, T) positions MLR uses for causality and blocks. Positions of adjacent real tokens of a row must increase:
    a reset means packed sequences, which MLR's causal-by-position attention would mix across sequence boundaries
    (refused). A run of real tokens after padding that does not continue the row (transformers' positions for the
    tokens generated after a right-padded prompt repeat the prompt's last ones) continues right after the row's
    previous real token, as the MLR cache places it (``MLRKeyCacheLayer._continue_rows_behind``, which warns), so that
    uncached and cached generation agree; the model's position embeddings still see the given positions."""
    if positions.shape[1] < 2 or torch.compiler.is_compiling():
        return positions
    step = positions[:, 1:] - positions[:, :-1]
    if valid is not None:
        step = torch.where(valid[:, 1:] & valid[:, :-1], step, torch.ones_like(step))
    if bool((step <= 0).any()):
        raise ValueError("position_ids restart or decrease inside a row: packed sequences are not supported by MLR "
                         "attention (pass one sequence per row, with padding)")
    if valid is None:
        return positions
    real = torch.where(valid, positions, torch.full_like(positions, torch.iinfo(positions.dtype).min))
    before = torch.cat([real[:, :1], real[:, :-1]], 1).cummax(1).values  # newest real position before each token
    before[:, 0] = torch.iinfo(positions.dtype).min
    if not bool((valid & (positions <= before)).any()):
        return positions
    fixed = positions.clone()
    for row in range(positions.shape[0]):  # rare (right-padded generation): a host loop over the row's real runs
        newest = None
        for index in valid[row].nonzero().flatten().tolist():
            if newest is not None and int(fixed[row, index]) <= newest:
                fixed[row, index:] += newest + 1 - int(fixed[row, index])
            newest = int(fixed[row, index])
    return fixed


def _key_positions(query_positions: torch.Tensor, valid_queries: Optional[torch.Tensor], slots: int) -> torch.Tensor:
    """(B, S) positions of the keys of an ordinary cache (full keys in token order, the chunk being the last T):
    consecutive and ending at the chunk, derived per row from its last real query."""
    length = query_positions.shape[1]
    index = torch.arange(length, device=query_positions.device).expand_as(query_positions)
    if valid_queries is not None:
        last = torch.where(valid_queries, index, torch.zeros_like(index)).amax(dim=1, keepdim=True)
    else:
        last = torch.full_like(query_positions[:, :1], length - 1)
    offset = query_positions.gather(1, last) - (slots - length) - last
    return offset + torch.arange(slots, device=query_positions.device)


# ------------------------------------------------------------------------------------------- the functions


def _check_kwargs(module, kwargs: dict, dropout: float, eager: bool) -> None:
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} was passed: packed sequences (varlen / padding-free batches) are not "
                             f"supported by MLR attention")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"softcap={kwargs['softcap']}: attention logit soft-capping is not supported by MLR")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')} is a sliding-window layer (window "
                         f"{kwargs['sliding_window']}); MLR replaces it only when patched with "
                         f"sliding_window_layers='replace'")
    if dropout and module.training and not eager:
        _warn_once("dropout", f"attention dropout (p={dropout}) is applied by MLR attention layers only with "
                              f"attn_implementation='eager' (the fused kernels do not drop weights)")


def _dense_fallback(module, query, key, value, attention_mask, scaling, dropout, eager, kwargs):
    """A layer without MLR geometry under a model-wide MLR implementation name: plain attention."""
    if not eager:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query @ key.transpose(-1, -2)).to(softmax_dtype(query.dtype)) * scaling
    if kwargs.get("position_bias") is not None:
        scores = scores + kwargs["position_bias"]
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, mask_value(scores.dtype)) if attention_mask.dtype == torch.bool \
            else scores + attention_mask
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _reorder(query: torch.Tensor, key: Optional[torch.Tensor], geometry: MLRGeometry):
    order = geometry.dim_order_index(query.device)
    if order is None:
        return query, key
    return query.index_select(-1, order), (None if key is None else key.index_select(-1, order))


def _uncached(module, query, key, value, geometry, scales, positions, valid, bias, causal, eager, dropout=0.0,
              allowed=None):
    """Uncached MLR (training, prefill, encoders): (B, Hq, T, r) queries, (B, Hk, T, r) keys in level order.
    ``allowed``: (B | 1, 1, T, T) bool, a caller's 4-D mask applied as given (instead of causality by position and
    the padding flags ``valid``)."""
    key, value = key.to(query.dtype), value.to(query.dtype)  # a cache's pending keys may predate autocast's cast
    if allowed is not None:
        additive = _additive(allowed, softmax_dtype(query.dtype))
        bias = additive if bias is None else bias + additive
        causal, valid = False, None
    if torch.compiler.is_compiling() and not eager:
        # a compiled prefill: the materialised path traces without host reads or graph breaks (the fused kernel
        # runs eagerly and reads its inputs' positions on the host)
        batch, q_heads, length, width = query.shape
        groups = q_heads // key.shape[1]
        rows = query.reshape(batch, key.shape[1], groups * length, width)
        key_valid = valid if valid is not None else torch.ones(batch, length, dtype=torch.bool, device=query.device)
        if bias is not None and bias.dim() == 4 and groups > 1 and bias.shape[-2] == length:
            bias = bias.repeat(1, 1, groups, 1)  # rows are group-major: row g * T + i
        out = mlr_attention_full_keys(rows, key, value, geometry=geometry, scales=scales,
                                      query_positions=positions.repeat(1, groups), key_positions=positions,
                                      key_valid=key_valid, causal=causal, bias=bias)
        return out.reshape(batch, q_heads, length, -1), None
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if not eager:
        out = mlr_attention(query, key, value, ranks=geometry.ranks, block_sizes=geometry.block_sizes, causal=causal,
                            scales=list(scales), positions=positions, attention_mask=valid, bias=bias,
                            average_levels=geometry.average_levels)
        return out, None
    scores = mlr_scores_reference(query, key, ranks=geometry.ranks, block_sizes=geometry.block_sizes,
                                  scales=list(scales), positions=positions, average_levels=geometry.average_levels)
    work = softmax_dtype(scores.dtype)
    scores = scores.to(work)
    if bias is not None:
        scores = scores + bias.to(work)
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=query.device)
    if causal:
        allowed = positions[:, None, None, :] <= positions[:, None, :, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    weights = torch.softmax(scores.masked_fill(~allowed, torch.finfo(work).min), dim=-1)
    if dropout and module.training:
        weights = torch.nn.functional.dropout(weights, p=float(dropout), training=True)
    return weights.to(value.dtype) @ value, weights.to(query.dtype)


def _slot_bias(bias: Optional[torch.Tensor], shift: torch.Tensor, slots: int) -> Optional[torch.Tensor]:
    """A bias over token indices (T5's relative bias, built from the slot count) read at slot order: slot ``s`` of
    row b is token ``s + shift[b]``. Identity (no copy) when every shift is zero."""
    if bias is None:
        return None
    if not torch.compiler.is_compiling() and not bool(shift.any()):
        return bias[..., :slots] if bias.shape[-1] >= slots else bias
    index = (torch.arange(slots, device=bias.device) + shift[:, None]).clamp(min=0, max=bias.shape[-1] - 1)
    expanded = bias.expand(shift.shape[0], *bias.shape[1:])
    return expanded.gather(-1, index[:, None, None, :].expand(*expanded.shape[:-1], slots))


def _token_weights(weights: torch.Tensor, valid_keys: Optional[torch.Tensor], first: torch.Tensor, base: int,
                   key_length: int) -> torch.Tensor:
    """Slot-order probabilities (B, H, n, C) -> token order (B, H, n, K): the k-th real token of a row is in slot
    ``first - base + k``; padding tokens get probability 0."""
    batch, heads, rows, slots = weights.shape
    if valid_keys is None:
        valid_keys = torch.ones(batch, key_length, dtype=torch.bool, device=weights.device)
    rank = valid_keys.long().cumsum(-1) - 1
    index = (first[:, None] - base + rank).clamp(min=0, max=slots - 1)
    gathered = weights.gather(-1, index[:, None, None, :].expand(batch, heads, rows, key_length))
    return gathered * valid_keys[:, None, None, :]


def _token_shift(pending: PendingChunk, tokens, base: int) -> torch.Tensor:
    """(B,) token index of slot 0 of each row (slot ``s`` holds token ``s + shift``): token index minus position of
    the chunk's real tokens (the chunk is the last c tokens), plus ``base``. Exact for rows whose cached real tokens
    are consecutive and end right before the chunk (left padding, or none)."""
    chunk = pending.positions.shape[1]
    offset = (tokens - chunk + torch.arange(chunk, device=pending.positions.device))[None, :] - pending.positions
    shift = torch.where(pending.valid, offset, torch.full_like(offset, torch.iinfo(offset.dtype).min)).amax(-1)
    return torch.where(pending.valid.any(-1), shift, torch.zeros_like(shift)) + base


def _slot_mask(attention_mask: torch.Tensor, layer, pending: PendingChunk, slots: int, plans: Optional[dict]
               ) -> Optional[torch.Tensor]:
    """A caller's 4-D mask (B | 1, 1, c, K) over the tokens (token order) read at the cache's slots: None when it
    is the causal + padding mask of what the cache holds (nothing to apply), else (B, 1, c, S) bool in slot order.
    A mask that allows a key the cache does not hold (a padding token, which is never stored, a future key, an
    empty slot) for a real query is refused. Computed once per forward (the layers of one geometry hold the same
    positions)."""
    key = ("slot mask", id(attention_mask), layer.base, slots)
    if plans is not None and key in plans:
        return plans[key]
    allowed = _allowed(attention_mask)
    batch, chunk = pending.positions.shape
    if allowed.shape[-2] != chunk:
        raise ValueError(MASK_REFUSED.format(what=f"mask of shape {tuple(attention_mask.shape)} for {chunk} new "
                                                  f"tokens"))
    key_length = allowed.shape[-1]
    allowed = allowed[:, :1].expand(batch, 1, chunk, key_length)
    shift = _token_shift(pending, int(layer.get_seq_length()), layer.base)
    column = torch.arange(slots, device=allowed.device) + shift[:, None]  # (B, S): the token held in slot s
    inside = (column >= 0) & (column < key_length)
    index = column.clamp(min=0, max=key_length - 1)[:, None, None, :].expand(batch, 1, chunk, slots)
    gathered = allowed.gather(-1, index) & inside[:, None, None, :]
    slot_positions = torch.arange(slots, device=allowed.device) + layer.base
    held = (slot_positions >= layer.first_positions[:, None, None]) & \
        (slot_positions <= pending.positions[:, :, None])  # (B, c, S): written, real, not in the future
    held = held[:, None]
    real = pending.valid[:, None, :, None]
    outside = (allowed.sum(-1, keepdim=True) != (gathered & held).sum(-1, keepdim=True)) & real
    if bool(outside.any()):
        row, _, query_index, _ = outside.nonzero()[0].tolist()
        raise ValueError(MASK_REFUSED.format(what=f"row {row}, new token {query_index}"))
    result = None if bool(((gathered == held) | ~real).all()) else gathered & held
    if plans is not None:
        plans[key] = result
    return result


def _cached(module, query, layer, pending: PendingChunk, geometry, scales, bias, attention_mask, eager,
            plans: Optional[dict] = None, standard_masks: bool = True):
    """Queries of the tokens the layer's last update stored, against everything it holds. query (B, Hq, c, r) level
    order. Returns (output (B, c, Hq, dv) contiguous, as attention functions return it; probabilities in token order
    or None). Unless ``standard_masks``, a 4-D ``attention_mask`` is compared with the causal + padding mask of what
    the cache holds and, where it differs, applied over the slots (``_slot_mask``)."""
    batch, q_heads, chunk, width = query.shape
    kv_heads = layer.keys.shape[1]
    groups = q_heads // kv_heads
    slots = layer.keys.shape[2]
    base = layer.base
    tokens = layer.get_seq_length()
    rows = query.reshape(batch, kv_heads, groups * chunk, width)  # group-major: row g*c + i
    custom = not standard_masks and attention_mask is not None and attention_mask.dim() == 4 and \
        not torch.compiler.is_compiling()
    if chunk == 1 and not eager:
        shift = (tokens - 1) - layer.last_positions + base if bias is not None else None
        # one plan per forward, shared by its layers (they hold the same positions); keyed by plain tuples, which
        # torch.compile can trace (so a compiled step computes it once too)
        key = ("decode read", geometry.ranks, geometry.block_sizes, geometry.average_levels, base,
               layer.keys_storage().shape[2], tuple(layer.ring_widths))
        plan = None if plans is None else plans.setdefault(key + (pending.slots_in_use,), {})
        # the whole storages (slots past the newest are masked; a compiled step keeps fixed shapes), or in an eager
        # step the slots up to the newest position (a narrowed view along the slot axis: the step's 3-D matmuls read
        # it in place)
        keys, values = layer.keys_storage(), layer.values_storage()
        if pending.slots_in_use is not None:
            slots = pending.slots_in_use
            keys, values = keys.narrow(2, 0, slots), values.narrow(2, 0, slots)
        slot_bias = _slot_bias(bias, shift, slots)
        if slot_bias is not None and slot_bias.shape[-1] < keys.shape[2]:
            slot_bias = F.pad(slot_bias, (0, keys.shape[2] - slot_bias.shape[-1]))
        mask = _slot_mask(attention_mask, layer, pending, keys.shape[2], plans) if custom else None
        if mask is not None:
            additive = _additive(mask, softmax_dtype(rows.dtype))
            slot_bias = additive if slot_bias is None else slot_bias + additive
        known = None if pending.shared_newest is None else (pending.shared_newest, pending.latest_first)
        out = mlr_decode_step(rows, keys, values, layer.fine_storage, layer.ring_widths, geometry, scales,
                              layer.last_positions, layer.first_positions, base, bias=slot_bias, plan=plan,
                              known_positions=known)
        # (B, Hk, g, dv) holds the heads of the one new token in order: it is the (B, 1, Hq, dv) output already
        return out.view(batch, 1, q_heads, -1), None
    query_positions = pending.positions.repeat(1, groups)  # (B, g*c)
    rings_before = layer._fine_views(pending.rings_before, layer._capacity()) if pending.rings_before is not None \
        else layer.rings
    # token index minus position of the chunk's real tokens, per row (the chunk is the last c)
    shift = _token_shift(pending, tokens, base) if bias is not None else None
    slot_bias = _slot_bias(bias, shift, slots) if bias is not None else None
    mask = _slot_mask(attention_mask, layer, pending, slots, plans) if custom else None
    if mask is not None:
        additive = _additive(mask, softmax_dtype(rows.dtype)).repeat(1, 1, groups, 1)  # rows are group-major
        slot_bias = additive if slot_bias is None else slot_bias + additive
    out = mlr_cached_chunk(rows, layer.keys, layer.values, rings_before, pending.keys, geometry, scales,
                           query_positions, pending.positions, pending.valid, pending.last_before,
                           layer.first_positions, base, bias=slot_bias, return_weights=eager)
    out, weights = out if eager else (out, None)
    out = out.reshape(batch, q_heads, chunk, -1).transpose(1, 2).contiguous()
    if weights is not None:
        key_length = attention_mask.shape[-1] if attention_mask is not None else int(tokens)
        weights = weights.reshape(batch, q_heads, chunk, slots)
        if mask is not None:  # the caller's mask: token k of a row sits in slot k - shift
            column = torch.arange(key_length, device=weights.device) - _token_shift(pending, tokens, base)[:, None]
            inside = (column >= 0) & (column < slots)
            index = column.clamp(min=0, max=slots - 1)[:, None, None, :].expand(batch, q_heads, chunk, key_length)
            weights = (weights.gather(-1, index) * inside[:, None, None, :]).to(query.dtype)
        else:
            valid_keys = key_validity(attention_mask, batch, key_length)
            weights = _token_weights(weights, valid_keys, layer.first_positions, base, key_length).to(query.dtype)
    return out, weights


def _forward(module, query, key, value, attention_mask, scaling, dropout, eager, kwargs):
    geometry = _layer_geometry(module)
    if geometry is None:
        return _dense_fallback(module, query, key, value, attention_mask, scaling, dropout, eager, kwargs)
    _check_kwargs(module, kwargs, dropout, eager)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # as SDPA under autocast: RoPE hands float32 q/k next to a half-precision v; compute in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    scales = geometry.scales(scaling)
    causal = bool(getattr(module, "is_causal", True))
    bias = kwargs.get("position_bias")
    batch, _, length, _ = query.shape
    step = kwargs.get(STEP_KEY)
    layer = step.layer(getattr(module, "layer_idx", None)) if step is not None and \
        getattr(module, "is_decoder", True) and causal else None
    if isinstance(layer, MLR_CACHE_LAYERS) and layer.is_bound and layer.pending is not None:
        pending, layer.pending = layer.pending, None
        query, _ = _reorder(query, None, geometry)
        if pending.had_past:
            return _cached(module, query, layer, pending, geometry, scales, bias, attention_mask, eager, step.plans,
                           step.standard_masks)
        if bias is not None and bias.shape[-1] > length:  # T5's bias over a static cache's slots: the chunk's first
            bias = bias[..., :length]
        allowed = None
        if not step.standard_masks and attention_mask is not None and attention_mask.dim() == 4 and \
                not _is_standard_mask(attention_mask, key_validity(attention_mask, batch, attention_mask.shape[-1]),
                                      causal, length, query_offset=0):
            # the caller's 4-D mask over the chunk's own keys (a static cache's empty slots after them)
            allowed = _allowed(attention_mask)
            if bool((allowed[..., length:].any(-1) & pending.valid[:, None, :]).any()):
                raise ValueError(MASK_REFUSED.format(what="an empty slot of the static cache"))
            allowed = allowed[..., :length]
        out, weights = _uncached(module, query, pending.keys, pending.values, geometry, scales, pending.positions,
                                 None if bool(pending.valid.all()) else pending.valid, bias, causal, eager,
                                 allowed=allowed)
        if weights is not None and isinstance(layer, MLRStaticKeyCacheLayer) and layer.max_cache_len > length:
            # as transformers' static layers: a prefill's maps span the cache's slots (the chunk's tokens first)
            weights = F.pad(weights, (0, layer.max_cache_len - weights.shape[-1]))
        return out.transpose(1, 2).contiguous(), weights
    # no cache, or an ordinary transformers cache layer: full-width keys in token order; a static layer's buffer holds
    # the written tokens first, then empty slots
    key_length = key.shape[2]
    written = key_length
    if layer is not None and key_length != length:
        written = layer.get_seq_length()
        written = written if torch.compiler.is_compiling() else int(written)
    valid_keys = key_validity(attention_mask, batch, key_length)
    allowed = None
    if not _is_standard_mask(attention_mask, valid_keys, causal, length, query_offset=written - length):
        # the caller's own 4-D mask (a window, a bidirectional or block overlay, a hidden pair): applied as given,
        # blocks from the positions; a token is real iff it may see itself
        allowed = _allowed(attention_mask)
        own = _own_key_allowed(allowed, written - length).expand(batch, length)
        valid_keys = own if key_length == length else None
    query, key = _reorder(query, key, geometry)
    if step is not None and step.positions is not None and kwargs.get("position_ids") is None:
        kwargs = dict(kwargs, position_ids=step.positions)
    positions = _query_positions(kwargs, None if valid_keys is None else valid_keys[:, :written], batch, length,
                                 written, query.device)
    valid_queries = None if valid_keys is None else valid_keys[:, written - length:written]
    positions = _checked_positions(positions, valid_queries if allowed is None else own)
    if key_length == length:
        out, weights = _uncached(module, query, key, value, geometry, scales, positions, valid_queries, bias, causal,
                                 eager, dropout, allowed=allowed)
        return out.transpose(1, 2).contiguous(), weights
    if not causal:
        raise ValueError("MLR attention with cached keys is implemented for causal self-attention only")
    kv_heads = key.shape[1]
    groups = query.shape[1] // kv_heads
    rows = query.reshape(batch, kv_heads, groups * length, query.shape[-1])
    slot = torch.arange(key_length, device=query.device)
    key_valid = slot < written if valid_keys is None else valid_keys & (slot < written)
    key_valid = key_valid.expand(batch, key_length)
    key_positions = _key_positions(positions, valid_queries, written)
    if written != key_length:
        key_positions = torch.cat([key_positions, key_positions.new_zeros(batch, key_length - written)], dim=-1)
    if allowed is not None:  # keys in token order: the mask applies as given (rows are group-major)
        additive = _additive(allowed, softmax_dtype(rows.dtype)).repeat(1, 1, groups, 1)
        bias = additive if bias is None else bias + additive
    out = mlr_attention_full_keys(rows, key, value, geometry=geometry, scales=scales,
                                  query_positions=positions.repeat(1, groups), key_positions=key_positions,
                                  key_valid=key_valid, causal=allowed is None, bias=bias, return_weights=eager)
    out, weights = out if eager else (out, None)
    out = out.reshape(batch, query.shape[1], length, -1)
    if weights is not None:
        weights = weights.reshape(batch, query.shape[1], length, key_length).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights


def mlr_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs):
    """``"mlr"`` in ``AttentionInterface``: exact MLR attention without materialising the T x T scores.

    query (B, Hq, T, r); key, value (B, Hk, S, r | dv) as the module's ``cache.update`` returned them (level-1 keys
    of an MLR cache layer, full keys otherwise); attention_mask: transformers' mask or None. Returns
    ((B, T, Hq, dv), None)."""
    return _forward(module, query, key, value, attention_mask, scaling, dropout, False, kwargs)


def mlr_eager_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                                dropout: float = 0.0, **kwargs):
    """``"mlr_eager"``: the same attention with the scores materialised; returns ((B, T, Hq, dv), probabilities
    (B, Hq, T, K) over the keys in token order)."""
    return _forward(module, query, key, value, attention_mask, scaling, dropout, True, kwargs)


ALL_ATTENTION_FUNCTIONS.register(MLR_ATTENTION, mlr_attention_forward)
ALL_ATTENTION_FUNCTIONS.register(MLR_EAGER_ATTENTION, mlr_eager_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(MLR_ATTENTION, _mlr_mask)
ALL_MASK_ATTENTION_FUNCTIONS.register(MLR_EAGER_ATTENTION, _mlr_eager_mask)

__all__ = ["MLRLayerConfig", "MLR_ATTENTION", "MLR_EAGER_ATTENTION", "install_mlr_attention", "key_validity",
           "mlr_attention_forward", "mlr_eager_attention_forward", "mlr_geometry_of", "mlr_implementation"]
