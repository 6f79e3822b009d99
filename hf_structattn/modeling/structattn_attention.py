"""MLR attention inside transformers: the attention functions registered in ``AttentionInterface``. Every family
(GPT-2, T5, patched decoders) installs MLR the same way (``structattn_install``): ``install_mlr_attention(module,
geometry)`` gives the layer's attention module an ``MLRLayerConfig``, the model's own config except that
``_attn_implementation`` names the MLR function of the same kind. The module's own forward then dispatches through
``ALL_ATTENTION_FUNCTIONS`` exactly as it would for SDPA:

* ``"eager"`` -> ``"mlr_eager"``: materialised scores (the reference semantics), returns the probabilities (what
  ``output_attentions`` needs, as stock eager attention does);
* anything else (``"sdpa"``, flash, flex, ...) -> ``"mlr"``: the fused exact op (CPU flash kernel per level group,
  Triton on CUDA), the decode step and the chunk path over the hierarchical cache; no probabilities.

The bilinear MLR / BTT layers of the GPT-2 family dispatch the same way to functions of their own
(``structattn_bilinear_attention``, which only that family's checkpoints ship).

The model's config keeps the name the user chose (``config._attn_implementation == "eager"`` stays true, and every
other layer runs stock eager attention), so ``set_attn_implementation`` and ``from_pretrained(...,
attn_implementation=...)`` behave as for any transformers model.

Inputs the functions read besides q, k, v: the attention mask transformers built for the model's implementation (a
4-D causal or bidirectional keep/additive mask, a 2-D key mask, or None), ``position_ids`` (B, T) when the model
passes them (T5 does not: positions then count the real tokens of each row, ``cumsum(mask) - 1``), T5's
``position_bias`` (added in every level), and the ``MLRStep`` that the model forward puts in the kwargs
(``structattn_step.STEP_KEY``): the self-attention cache, the new tokens' positions and padding and the host facts
every layer shares, so that no layer reads anything back from the device.

Over an MLR cache layer the flow is explicit: ``cache.update`` wrote the chunk and returned its keys in level order
and, in place of the values, the layer's read-only ``MLRCacheView``, whose ``plan`` the forward made before its first
layer; ``_forward`` checks the call's contract in one place and reads the view once with
``structattn_mlr_cached.mlr_cached_attention(query, view, read)``, the read record's type being the formulation. The
attention functions never write a cache.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from .structattn_cache import MLRCacheView
from .structattn_geometry import MLRGeometry
from .structattn_install import (  # noqa: F401  (the installation API, re-exported: where every family finds it)
    MLR_ATTENTION,
    MLR_EAGER_ATTENTION,
    STOCK_GEOMETRY_RESOLVERS,
    MLRLayerConfig,
    install_mlr_attention,
    mlr_geometry_of,
    mlr_implementation,
)
from .structattn_masks import (
    additive_mask,
    check_additive_mask,
    check_mask_shape,
    group_major,
    is_standard_mask,
    key_validity,
    mask_allowed,
    mask_value,
    own_key_allowed,
    softmax_dtype,
    token_shift,
)
from .structattn_mlr import PositionLayout, mlr_attention
from .structattn_mlr_cached import mlr_cached_attention
from .structattn_mlr_math import mlr_attention_full_keys
from .structattn_step import REFUSED_ARGUMENTS, STEP_KEY, continue_runs, refuse_unsupported_arguments

logger = logging.get_logger(__name__)


def _layer_geometry(module: torch.nn.Module) -> Optional[MLRGeometry]:
    """The layer's ``MLRGeometry``: installed (``MLRLayerConfig``), or, for a stock model run with
    ``attn_implementation="mlr"`` whose config carries MLR fields, resolved (``STOCK_GEOMETRY_RESOLVERS``) and
    installed now; None for a layer that is not MLR."""
    geometry = mlr_geometry_of(module)
    if geometry is not None:
        return geometry
    config = getattr(module, "config", None)
    if getattr(config, "mlr_ranks", None) is None and "mlr_ranks" in getattr(type(config), "__dataclass_fields__", {}):
        return None  # a family whose config declares mlr_ranks (GPT-2, T5) installs its MLR layers when built
    # a stock model (its config does not declare mlr_ranks): the resolver checks its MLR fields, refusing a config
    # without them rather than running the dense model under the name "mlr"
    for resolve in STOCK_GEOMETRY_RESOLVERS:
        geometry = resolve(module)
        if geometry is not None:
            install_mlr_attention(module, geometry)
            return geometry
    return None


# ------------------------------------------------------------------------------------------- masks


def _runs_without_plan(config) -> bool:
    """A stock checkpoint run with ``attn_implementation="mlr"``: neither a family of ours (its config declares
    ``mlr_ranks``) nor a patched decoder (``mlr_patch``), so no per-forward plan tells its layers what a cache holds."""
    return getattr(config, "mlr_patch", None) is None and \
        "mlr_ranks" not in getattr(type(config), "__dataclass_fields__", {})


def _mlr_mask(*args, **kwargs):
    # A fixed-size buffer (a static cache: a tensor offset, or more slots than tokens written) with no plan: SDPA may
    # skip the mask there (its upper-left causal alignment, empty slots ignored), but without a mask the attention
    # cannot tell written slots from empty ones, so the mask is built; it says how many slots are written.
    offset, length, kv_length = kwargs.get("q_offset", 0), kwargs.get("q_length"), kwargs.get("kv_length")
    if _runs_without_plan(kwargs.get("config")) and (isinstance(offset, torch.Tensor) or
                                                     (length is not None and kv_length != offset + length)):
        kwargs["allow_is_causal_skip"] = False
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
    previous real token, as the MLR cache places it (``structattn_step.build_step``, which warns), so that
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
    return continue_runs(positions, valid)  # rare (right-padded generation)


def _key_positions(query_positions: torch.Tensor, valid_queries: Optional[torch.Tensor], written,
                   key_length: int) -> torch.Tensor:
    """(B, K) positions of the keys of an ordinary cache (full keys in token order, the chunk being the last T of the
    ``written`` tokens, an int or, while tracing a static cache, a tensor): consecutive and ending at the chunk,
    derived per row from its last real query (slots past ``written`` get positions too; they are not valid keys)."""
    length = query_positions.shape[1]
    index = torch.arange(length, device=query_positions.device).expand_as(query_positions)
    if valid_queries is not None:
        last = torch.where(valid_queries, index, torch.zeros_like(index)).amax(dim=1, keepdim=True)
    else:
        last = torch.full_like(query_positions[:, :1], length - 1)
    offset = query_positions.gather(1, last) - (written - length) - last
    return offset + torch.arange(key_length, device=query_positions.device)


# ------------------------------------------------------------------------------------------- the functions


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
              allowed=None, layout=None):
    """Uncached MLR (training, prefill, encoders): (B, Hq, T, r) queries, (B, Hk, T, r) keys in level order.
    ``allowed``: (B | 1, 1, T, T) bool, a caller's 4-D mask applied as given (instead of causality by position and
    the padding flags ``valid``); ``layout``: the positions' ``PositionLayout`` from the step plan (None: read)."""
    key, value = key.to(query.dtype), value.to(query.dtype)  # the chunk's keys may predate autocast's cast
    if allowed is not None:
        additive = additive_mask(allowed, softmax_dtype(query.dtype))
        bias = additive if bias is None else bias + additive
        causal, valid = False, None
    # unpadded rows at one shared run of positions (the plan read it): the materialised path forms the finer
    # levels on their diagonal blocks only
    aligned = layout.uniform_offset if layout is not None and layout.contiguous and valid is None and \
        allowed is None else None
    if torch.compiler.is_compiling() and not eager:
        # a compiled prefill: the materialised path traces without host reads or graph breaks (the fused kernel
        # runs eagerly and reads its inputs' positions on the host)
        batch, q_heads, length, width = query.shape
        groups = q_heads // key.shape[1]
        rows = query.reshape(batch, key.shape[1], groups * length, width)
        key_valid = valid if valid is not None else torch.ones(batch, length, dtype=torch.bool, device=query.device)
        if bias is not None and bias.shape[-2] == length:
            bias = group_major(bias, key.shape[1], groups)
        out = mlr_attention_full_keys(rows, key, value, geometry=geometry, scales=scales,
                                      query_positions=positions.repeat(1, groups), key_positions=positions,
                                      key_valid=key_valid, causal=causal, bias=bias,
                                      aligned_start=aligned if groups == 1 else None)
        return out.reshape(batch, q_heads, length, -1), None
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if not eager:
        out = mlr_attention(query, key, value, ranks=geometry.ranks, block_sizes=geometry.block_sizes, causal=causal,
                            scales=list(scales), positions=positions, attention_mask=valid, bias=bias,
                            average_levels=geometry.average_levels, layout=layout, level_rule=geometry.level_rule)
        return out, None
    # the materialised maps: the op layer's one materialised MLR (the full-keys path), keys in token order
    key_valid = valid if valid is not None else torch.ones(positions.shape, dtype=torch.bool, device=query.device)
    out, weights = mlr_attention_full_keys(query, key, value, geometry=geometry, scales=scales,
                                           query_positions=positions, key_positions=positions, key_valid=key_valid,
                                           causal=causal, bias=bias, return_weights=True,
                                           dropout=float(dropout) if module.training else 0.0, aligned_start=aligned)
    return out, weights.to(query.dtype)


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


def _read_cache(module, query, view: MLRCacheView, attention_mask, step, scaling, bias, dropout, eager):
    """The queries of the tokens ``update`` just wrote against everything the layer holds (``view``): query
    (B, Hq, c, r) in the module's dim order. Returns (output (B, c, Hq, dv) contiguous, probabilities in token order
    or None). The layer's read record (``view.plan.read``, planned before the first layer) says how; a layer that held
    nothing before (no read record) attends over the chunk alone (the uncached op). A caller's 4-D mask and T5's
    relative bias were read at the slots when the record was made."""
    layer_plan = view.plan
    if scaling != layer_plan.scaling:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: the attention call's scaling {scaling} differs "
                         f"from the module's scaling {layer_plan.scaling}, which MLR was installed with and the "
                         f"forward's plan reads with")
    plan = layer_plan.layout.plan
    if plan.dim_order is not None:
        query = query.index_select(-1, plan.dim_order)
    dropout = float(dropout) if eager and module.training else 0.0
    read = layer_plan.read
    if read is None:
        return _prefill(module, query, view, attention_mask, step, plan.geometry, scaling, bias, dropout, eager)
    out, weights = mlr_cached_attention(query, view, read, return_weights=eager, dropout=dropout)
    if weights is not None:
        batch, q_heads, length = query.shape[:3]
        layout = layer_plan.layout
        slots = layout.slots
        tokens = view.tokens
        key_length = attention_mask.shape[-1] if attention_mask is not None else int(tokens)
        weights = weights.reshape(batch, q_heads, length, slots)
        if read.slot_mask is not None:  # the caller's mask: token k of a row sits in slot k - shift
            shift = token_shift(plan.positions, plan.real, tokens, layout.base)
            column = torch.arange(key_length, device=weights.device) - shift[:, None]
            inside = (column >= 0) & (column < slots)
            index = column.clamp(min=0, max=slots - 1)[:, None, None, :].expand(batch, q_heads, length, key_length)
            weights = (weights.gather(-1, index) * inside[:, None, None, :]).to(query.dtype)
        else:
            valid_keys = key_validity(attention_mask, batch, key_length)
            weights = _token_weights(weights, valid_keys, view.first_positions, layout.base,
                                     key_length).to(query.dtype)
    return out, weights


def _prefill(module, query, view: MLRCacheView, attention_mask, step, geometry, scaling, bias, dropout, eager):
    """The first chunk a layer holds: it attends over its own keys (``view.chunk_keys`` / ``chunk_values``) with
    the uncached op (a caller's 4-D mask, when it applies, over those keys: ``MLRStep.custom_mask``)."""
    if step.position_bias is not None:  # T5: the bias over every token index, made once per forward by the model
        bias = step.position_bias
    length = query.shape[2]
    key, value = view.chunk_keys, view.chunk_values
    if bias is not None and bias.shape[-1] > length:  # T5's bias over a static cache's slots: the chunk's first
        bias = bias[..., :length]
    valid = step.valid
    allowed = None
    if step.custom_mask and attention_mask is not None:
        # the caller's 4-D mask over the chunk's own keys (a static cache's empty slots after them: refused when
        # planned)
        allowed = mask_allowed(attention_mask)[..., :length]
    facts = step.facts
    if facts is not None and facts.all_real:
        valid = None
    elif facts is None and valid is not None and not torch.compiler.is_compiling() and bool(valid.all()):
        valid = None
    out, weights = _uncached(module, query, key, value, geometry, geometry.scales(scaling), step.positions, valid,
                             bias, True, eager, dropout, allowed=allowed, layout=_layout(step))
    capacity = view.key_storage.shape[2]
    if weights is not None and isinstance(view.tokens, torch.Tensor) and capacity > length:
        # as transformers' static layers: a prefill's maps span the cache's slots (the chunk's tokens first)
        weights = F.pad(weights, (0, capacity - weights.shape[-1]))
    return out.transpose(1, 2).contiguous(), weights


def _layout(step) -> Optional[PositionLayout]:
    facts = None if step is None else step.facts
    if facts is None:
        return None
    return PositionLayout(facts.contiguous, facts.uniform_offset, facts.lowest, facts.highest)


def _forward(module, query, key, value, attention_mask, scaling, dropout, eager, kwargs):
    """The one gate: a layer without MLR geometry runs plain attention; for an MLR layer, what MLR attention refuses
    (whatever the path), then which contract applies -- a cache layer's view (``update`` wrote the chunk: read the
    cache) or keys in token order (no cache, or an ordinary cache layer)."""
    over_cache = type(value) is MLRCacheView
    geometry = value.plan.layout.plan.geometry if over_cache else _layer_geometry(module)
    if geometry is None:  # not an MLR layer: what the stock function does (a sliding window is in the mask)
        return _dense_fallback(module, query, key, value, attention_mask, scaling, dropout, eager, kwargs)
    if not REFUSED_ARGUMENTS.isdisjoint(kwargs):
        refuse_unsupported_arguments(kwargs, getattr(module, "layer_idx", None))
    if dropout and not eager and module.training:
        logger.warning_once(f"attention dropout (p={dropout}) is applied by MLR attention layers only with "
                            f"attn_implementation='eager' (the fused kernels do not drop weights)")
    bias = kwargs.get("position_bias")
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # as SDPA under autocast: RoPE hands float32 q/k next to a half-precision v; compute in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key = query.to(dtype), key.to(dtype)
        value = value if over_cache else value.to(dtype)
    step = kwargs.get(STEP_KEY)
    if over_cache:
        return _read_cache(module, query, value, attention_mask, step, scaling, bias, dropout, eager)
    scales = geometry.scales(scaling)
    causal = bool(getattr(module, "is_causal", True))
    batch, _, length, _ = query.shape
    if step is None and causal and isinstance(attention_mask, torch.Tensor):
        # no plan checked this mask before layer 0 (a stock model run with attn_implementation="mlr", a direct call):
        # the same rules here, so that a wrong shape or a NaN is refused rather than broadcast or read as masked
        check_mask_shape(attention_mask, batch, query.shape[1], length)
        check_additive_mask(attention_mask)
    if not (getattr(module, "is_decoder", True) and causal):
        step = None  # the step describes the decoder's self-attention tokens, not T5's encoder or cross-attention
    layer = step.layer(getattr(module, "layer_idx", None)) if step is not None else None
    # no cache, or an ordinary transformers cache layer: full-width keys in token order; a static layer's buffer holds
    # the written tokens first, then empty slots
    key_length = key.shape[2]
    written = key_length
    facts = None if step is None else step.facts
    if layer is not None and key_length != length:
        if facts is not None:
            written = facts.tokens_before + length
        else:
            written = layer.get_seq_length()
            written = written if torch.compiler.is_compiling() else int(written)
    elif step is None and key_length != length and isinstance(attention_mask, torch.Tensor) and \
            attention_mask.dim() == 4:
        # no plan (a stock model run as "mlr"): a static cache's buffer has empty slots after the written ones, which
        # the mask (``_mlr_mask`` builds one for such buffers) marks unseen by the newest query: written up to the
        # last slot some row's newest query may see (a tensor, as while tracing a static cache)
        seen = mask_allowed(attention_mask[:, :, -1, -key_length:]).any(1).any(0)
        written = torch.where(seen, torch.arange(1, key_length + 1, device=seen.device), 0).amax()
    if step is not None and step.positions is not None and key_length == length:
        valid_keys = step.valid  # the plan's padding flags of the new tokens: here every key
    else:
        valid_keys = key_validity(attention_mask, batch, key_length)
    allowed = None
    custom = step.custom_mask if step is not None else not is_standard_mask(
        attention_mask, valid_keys, causal, length, query_offset=written - length)
    if custom:
        # the caller's own 4-D mask (a window, a bidirectional or block overlay, a hidden pair): applied as given,
        # blocks from the positions; a token is real iff it may see itself
        allowed = mask_allowed(attention_mask)
        own = own_key_allowed(attention_mask, written - length).expand(batch, length)
        valid_keys = own if key_length == length else None
    query, key = _reorder(query, key, geometry)
    valid_queries = None
    if valid_keys is not None and isinstance(written, torch.Tensor):  # a traced static cache: no data-dependent slice
        columns = written - length + torch.arange(length, device=valid_keys.device)
        valid_queries = valid_keys.gather(1, columns.expand(valid_keys.shape[0], length))
    elif valid_keys is not None:
        valid_queries = valid_keys[:, written - length:written]
    if step is not None and step.positions is not None:
        positions = step.positions
    else:
        positions = _query_positions(kwargs, None if valid_keys is None else valid_keys[:, :written], batch, length,
                                     written, query.device)
        positions = _checked_positions(positions, valid_queries if allowed is None else own)
    if key_length == length:
        if facts is not None and facts.all_real and allowed is None:
            valid_queries = None
        out, weights = _uncached(module, query, key, value, geometry, scales, positions, valid_queries, bias, causal,
                                 eager, dropout, allowed=allowed, layout=_layout(step) if allowed is None else None)
        return out.transpose(1, 2).contiguous(), weights
    if not causal:
        raise ValueError("MLR attention with cached keys is implemented for causal self-attention only")
    kv_heads = key.shape[1]
    groups = query.shape[1] // kv_heads
    rows = query.reshape(batch, kv_heads, groups * length, query.shape[-1])
    slot = torch.arange(key_length, device=query.device)
    key_valid = slot < written if valid_keys is None else valid_keys & (slot < written)
    key_valid = key_valid.expand(batch, key_length)
    key_positions = _key_positions(positions, valid_queries, written, key_length)
    if allowed is not None:  # keys in token order: the mask applies as given (rows are group-major)
        additive = group_major(additive_mask(allowed, softmax_dtype(rows.dtype)), kv_heads, groups)
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

__all__ = ["MLRLayerConfig", "MLR_ATTENTION", "MLR_EAGER_ATTENTION", "install_mlr_attention", "mlr_attention_forward",
           "mlr_eager_attention_forward", "mlr_geometry_of", "mlr_implementation"]
