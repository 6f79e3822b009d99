"""MLR attention for transformers decoders that dispatch through the attention interface (Llama, Qwen2/3,
Mistral, Gemma/Gemma-3, Phi-3, GPT-2, GPT-NeoX, ...). Part of the checkpoint payload.

Importing this module registers ``"mlr"`` with transformers' ``AttentionInterface`` and
``AttentionMaskInterface``. A model whose ``config._attn_implementation == "mlr"`` then runs MLR attention in
the layers its config names, read from flat config fields:

* ``mlr_ranks`` (r_1..r_L, sum = head dim) and ``mlr_block_sizes`` (b_2..b_L, nested);
* ``mlr_layers``: indices of the MLR layers (None: every layer); the others run SDPA exactly as before;
* ``mlr_dim_order``: the head-dim order in which level slices are taken (None: identity). For RoPE models it
  lists complete rotation pairs first (``[0, d/2, 1, d/2 + 1, ...]`` for half-split RoPE, then unrotated dims),
  so every level's score depends on relative position only. It is applied to q and k at run time; weights are
  never re-based (a rotation of W_Q/W_K does not commute with RoPE);
* ``mlr_level_scales``: per-level logit multipliers (None: the model's own ``scaling`` on every level, so
  ``mlr_ranks=[head_dim]`` is the stock model).

``MLR<Arch>`` classes (``MLRLlamaForCausalLM``, ``MLRLlamaConfig``, ...) are built on demand by the module
``__getattr__`` from the transformers class of the same name, so one payload file serves every architecture:
the config gets its own ``model_type`` (``mlr_<type>``), the model forces ``attn_implementation="mlr"``.

Semantics (docs/contracts.md): blocks align to each row's absolute positions (``position_ids``); the padding
mask is the 2-D (B, S) key mask (the mask function returns it, the flash-attention contract); cached keys sit
at contiguous positions ending at the current chunk (what ``generate`` and chunked prefill produce).
Grouped-query attention: the uncached pass repeats K/V as a temporary; cached passes stack each KV head's
query heads along the query axis, so cached keys are never repeated.
"""

import functools
import inspect
import os
import warnings
from typing import Optional, Sequence

import torch
import transformers
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .structattn_cache import MLRKeyCacheLayer, StructAttnCache
from .structattn_geometry import validate_mlr_geometry
from .structattn_mlr import mlr_attention

ATTENTION_NAME = "mlr"
MODEL_TYPE_PREFIX = "mlr_"
CLASS_PREFIX = "MLR"
UNSUPPORTED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

_warned = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


# ------------------------------------------------------------------------------------------- layer spec


def is_mlr_layer(config, layer_idx: Optional[int]) -> bool:
    layers = getattr(config, "mlr_layers", None)
    return layers is None or (layer_idx is not None and layer_idx in layers)


def layer_ranks(config) -> list:
    """``config.mlr_ranks`` and ``config.mlr_block_sizes`` checked (ValueError naming the field)."""
    ranks = getattr(config, "mlr_ranks", None)
    blocks = getattr(config, "mlr_block_sizes", None)
    if ranks is None or blocks is None:
        raise ValueError(f"attn_implementation='mlr' needs config.mlr_ranks and config.mlr_block_sizes; got "
                         f"mlr_ranks={ranks!r}, mlr_block_sizes={blocks!r} (use hf_structattn.patch, or set both "
                         f"on the config: config = AutoConfig.from_pretrained(path); config.mlr_ranks = [...]; "
                         f"config.mlr_block_sizes = [...]; from_pretrained(path, config=config, "
                         f"attn_implementation='mlr'))")
    return list(ranks), list(blocks)


@torch.no_grad()
def rotary_pair_order(rotary, apply_rotary_pos_emb, head_dim: int, layer_types=(None,)) -> tuple[list, int]:
    """Head-dim order with complete rotation pairs first, found numerically from a model's own rotary embedding.

    Each basis vector e_i of the head dim is rotated by ``apply_rotary_pos_emb`` at a few positions; dims that
    rotate together form a pair, dims that never move are unrotated. Works for half-split, interleaved and
    partial RoPE. Returns (``[a_1, b_1, a_2, b_2, ..., unrotated...]`` with pairs ordered by their first dim, i.e.
    the model's own frequency order; the number of rotated dims). Raises ValueError when the rotation couples
    more than two dims.
    """
    basis = torch.eye(head_dim, dtype=torch.float64)[None, None]  # (1, 1, d, d): query "token" i is e_i
    takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    moved = torch.zeros(head_dim, head_dim, dtype=torch.bool)
    for layer_type in layer_types:
        for position in (1, 3, 17, 1001):
            position_ids = torch.full((1, head_dim), position, dtype=torch.long)
            extra = {"layer_type": layer_type} if takes_layer_type else {}
            cos, sin = rotary(basis, position_ids, **extra)
            rotated, _ = apply_rotary_pos_emb(basis, basis, cos.to(torch.float64), sin.to(torch.float64))
            moved |= rotated[0, 0].abs() > 1e-9
    moved |= torch.eye(head_dim, dtype=torch.bool)
    pairs, unrotated, seen = [], [], set()
    for dim in range(head_dim):
        partners = [other for other in moved[dim].nonzero().flatten().tolist() if other != dim]
        if len(partners) > 1 or (partners and moved[partners[0]].sum() != 2):
            raise ValueError(f"the rotary embedding couples head dim {dim} with {partners}: only 2-D rotations "
                             f"(RoPE pairs) can be split into MLR levels")
        if not partners:
            unrotated.append(dim)
        elif dim not in seen:
            pairs.append((dim, partners[0]))
            seen.update((dim, partners[0]))
    return [dim for pair in pairs for dim in pair] + unrotated, 2 * len(pairs)


def check_pair_complete_levels(ranks, rotated_dims: int) -> None:
    """Level slices of the pair-first order must not split a rotation pair: every level boundary inside the
    first ``rotated_dims`` dims falls at an even offset."""
    boundary = 0
    for level, rank in enumerate(ranks[:-1], start=1):
        boundary += rank
        if boundary < rotated_dims and boundary % 2:
            raise ValueError(f"mlr_ranks={list(ranks)} splits a RoPE rotation pair: level {level} ends at head dim "
                             f"{boundary} of the pair-ordered head ({rotated_dims // 2} pairs first); within the "
                             f"rotated dims every level must hold whole pairs (even boundaries)")


def _model_rotary(module):
    """(rotary embedding built from the module's config, apply_rotary_pos_emb) from the attention module's own
    modeling file, or None for a model without RoPE."""
    modeling = inspect.getmodule(type(module))
    apply_fn = getattr(modeling, "apply_rotary_pos_emb", None)
    classes = [obj for name, obj in vars(modeling).items() if name.endswith("RotaryEmbedding") and
               isinstance(obj, type) and issubclass(obj, torch.nn.Module)] if modeling is not None else []
    if apply_fn is None or not classes:
        return None
    return classes[0](config=module.config), apply_fn


def _dim_order(module, device) -> Optional[torch.Tensor]:
    """The config's head-dim order as an index tensor on ``device`` (cached on the module), or None for identity.

    A config without ``mlr_dim_order`` (a stock checkpoint loaded with ``attn_implementation="mlr"``) gets it from
    the model's rotary embedding on first use; it is stored in the config, so it is saved with the model."""
    config = module.config
    if not hasattr(config, "mlr_dim_order"):
        found = _model_rotary(module)
        head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size")
        layer_types = tuple(sorted(set(getattr(config, "layer_types", None) or [None])))
        order, rotated = (None, 0) if found is None else rotary_pair_order(*found, head_dim, layer_types)
        check_pair_complete_levels(layer_ranks(config)[0], rotated)
        config.mlr_dim_order = order
    order = config.mlr_dim_order
    if order is None or list(order) == list(range(len(order))):
        return None
    cached = getattr(module, "_mlr_dim_order", None)
    if cached is None or cached.device != device or cached.tolist() != list(order):
        cached = torch.tensor(list(order), dtype=torch.long, device=device)
        module._mlr_dim_order = cached
    return cached


# ------------------------------------------------------------------------------------------- masks


def mlr_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function=causal_mask_function, attention_mask: Optional[torch.Tensor] = None,
             use_vmap: bool = False, **kwargs) -> Optional[torch.Tensor]:
    """The mask transformers builds for ``attn_implementation="mlr"``: the (B, kv_length) boolean key-padding
    mask (True = real token) or None when nothing is padded. Causality and blocks come from positions inside the
    attention function. Custom mask overlays (``or_mask_function`` / ``and_mask_function``: multimodal or
    bidirectional-block masks) cannot be expressed by MLR and are refused."""
    if use_vmap:
        raise ValueError("MLR attention does not support custom mask overlays (or_mask_function / "
                         "and_mask_function, e.g. multimodal bidirectional image blocks)")
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    if attention_mask.shape[-1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


# ------------------------------------------------------------------------------------------- hierarchical cache

CACHE_LAYER_KEY = "mlr_cache_layer"  # set by DecoderMLRKeyCacheLayer.update in the attention call's kwargs
FULL_KEYS_KEY = "mlr_full_keys"
KEY_VALID_KEY = "mlr_key_valid"  # (B, c) padding flags of the new tokens, added to the model's kwargs by MLR<Arch>


class DecoderMLRKeyCacheLayer(MLRKeyCacheLayer):
    """The hierarchical key cache layer for a decoder whose attention calls ``cache.update(k, v, layer_idx,
    kwargs=kwargs)`` (Llama and most transformers decoders).

    ``kwargs`` is the attention call's own keyword dict (the one later unpacked into the attention function): its
    ``position_ids`` and ``mlr_key_valid`` (added by ``MLR<Arch>.forward``) locate the new tokens; the full-width keys
    are reordered into the pair-complete level order (``dim_order``) before they are stored; and the layer puts
    itself and the reordered full keys back into that dict, so that the attention function can ``attend`` (or run
    the uncached op when nothing was cached before the chunk)."""

    def __init__(self, ranks, block_sizes, dim_order: Optional[Sequence[int]] = None, plan=None):
        super().__init__(ranks, block_sizes, plan=plan)
        self.dim_order = None if dim_order is None else list(dim_order)

    def update(self, key_states, value_states, cache_kwargs=None, *args, kwargs=None, **rest):
        call = cache_kwargs if cache_kwargs is not None else kwargs
        if call is None:
            raise ValueError("this attention module calls cache.update without its kwargs, so the MLR key cache "
                             "cannot see positions or padding; use a plain DynamicCache (full keys, exact)")
        if KEY_VALID_KEY not in call:
            raise ValueError("the MLR key cache needs the padding flags of the new tokens; this model did not pass "
                             "its forward kwargs down to the attention layers (use a plain DynamicCache)")
        if self.dim_order is not None:
            order = getattr(self, "_order_index", None)
            if order is None or order.device != key_states.device:
                order = self._order_index = torch.tensor(self.dim_order, device=key_states.device)
            key_states = key_states.index_select(-1, order)
        valid = call[KEY_VALID_KEY]
        keys, values = super().update(key_states, value_states, {"position_ids": call.get("position_ids"),
                                                                 "key_valid": valid})
        call[CACHE_LAYER_KEY] = self
        call[FULL_KEYS_KEY] = key_states
        return keys, values


def passes_cache_kwargs(model) -> bool:
    """Whether the model's attention modules hand their kwargs to ``cache.update`` (read from their source)."""
    for module in model.modules():
        forward = type(module).forward
        if getattr(module, "layer_idx", None) is None or not hasattr(module, "config"):
            continue
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):
            continue
        if ".update(" in source and "ALL_ATTENTION_FUNCTIONS" in source:
            return "kwargs=kwargs" in source or "cache_kwargs" in source
    return False


def _attend_grouped(layer, query, level_scales, kv_heads):
    """``layer.attend`` for GQA without repeating cached keys. query (B, Hq, T, d) with Hq = kv_heads * groups (query
    head h reads KV head h // groups, transformers' ``repeat_kv`` order). A decode step (T = 1) scores each group's
    query heads against their KV head in one call; a chunk takes one call per query head of each group."""
    batch, q_heads, length, width = query.shape
    groups = q_heads // kv_heads
    if groups == 1:
        return layer.attend(query.contiguous(), level_scales=level_scales)
    if length == 1:
        out = layer.attend(query.reshape(batch, kv_heads, groups, width), level_scales=level_scales)
        return out.reshape(batch, q_heads, 1, out.shape[-1])
    per_group = query.reshape(batch, kv_heads, groups, length, width)
    outs = [layer.attend(per_group[:, :, group].contiguous(), level_scales=level_scales) for group in range(groups)]
    return torch.stack(outs, dim=2).reshape(batch, q_heads, length, outs[0].shape[-1])


def _layer_is_sliding(config, layer_idx):
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return layer_types[layer_idx] != "full_attention"
    return getattr(config, "sliding_window", None) is not None


# ------------------------------------------------------------------------------------------- attention


def _query_positions(position_ids: Optional[torch.Tensor], batch: int, length: int, slots: int, device):
    """(B, T) absolute positions of the queries; without ``position_ids`` the keys are taken as 0..S-1."""
    if position_ids is None:
        return torch.arange(slots - length, slots, device=device).expand(batch, length)
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)}: MLR attention needs (batch, length) "
                         f"positions; multimodal (3-D, e.g. M-RoPE) position ids are not supported")
    return position_ids.to(device=device, dtype=torch.long).expand(batch, length)


def _check_not_packed(positions: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
    """Positions of the real tokens of a row must increase: a reset means packed sequences, which would attend
    across sequence boundaries."""
    if positions.shape[1] < 2:
        return
    step = positions[:, 1:] - positions[:, :-1]
    if valid is not None:
        both = valid[:, 1:] & valid[:, :-1]
        step = torch.where(both, step, torch.ones_like(step))
    if bool((step <= 0).any()):
        raise ValueError("position_ids restart or decrease inside a row: packed sequences are not supported by MLR "
                         "attention (pass one sequence per row, with padding)")


def _key_positions(query_positions: torch.Tensor, valid_queries: Optional[torch.Tensor], slots: int) -> torch.Tensor:
    """(B, S) positions of the cached slots: contiguous and ending at the chunk's queries (the chunk is the last T
    slots). Derived per row from its last real query."""
    length = query_positions.shape[1]
    index = torch.arange(length, device=query_positions.device).expand_as(query_positions)
    if valid_queries is not None:
        # the last real query of each row (index 0 when the chunk is all padding: its rows are masked anyway)
        last = torch.where(valid_queries, index, torch.zeros_like(index)).amax(dim=1, keepdim=True)
    else:
        last = torch.full_like(query_positions[:, :1], length - 1)
    offset = query_positions.gather(1, last) - (slots - length) - last  # position of slot 0
    return offset + torch.arange(slots, device=query_positions.device)


def mlr_cached_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, ranks, block_sizes,
                         level_scales, query_positions: torch.Tensor, key_positions: torch.Tensor,
                         key_valid: Optional[torch.Tensor]) -> torch.Tensor:
    """MLR attention of a query chunk against full cached keys, without repeating keys for GQA.

    query (B, Hq, T, r); key (B, Hkv, S, r); value (B, Hkv, S, dv), Hq = G * Hkv; level slices are prefixes of
    r. query_positions (B, T), key_positions (B, S), key_valid (B, S) or None. Each KV head's G query heads are
    stacked along the query axis, so scores are (B, Hkv, G*T, S). Softmax in ``promote_types(dtype, float32)``.
    Returns (B, Hq, T, dv).
    """
    batch, q_heads, length, _ = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    stacked = query.reshape(batch, kv_heads, groups * length, query.shape[-1])
    stacked_positions = query_positions.repeat(1, groups)  # (B, G*T), group-major like ``stacked``
    start = ranks[0]
    scores = (stacked[..., :start] * level_scales[0]) @ key[..., :start].transpose(-1, -2)
    for rank, size, scale in zip(ranks[1:], block_sizes, level_scales[1:]):
        level = (stacked[..., start:start + rank] * scale) @ key[..., start:start + rank].transpose(-1, -2)
        same_block = (stacked_positions[:, :, None] // size) == (key_positions[:, None, :] // size)
        scores = scores + level * same_block[:, None]
        start += rank
    allowed = key_positions[:, None, :] <= stacked_positions[:, :, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :]
    work = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(work).masked_fill(~allowed[:, None], torch.finfo(work).min)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return (probs @ value).reshape(batch, q_heads, length, value.shape[-1])


def _dense_attention(module, query, key, value, padding, scaling, dropout, kwargs):
    """A layer the patch left alone: SDPA with the mask transformers would have built from the same padding."""
    batch, _, length, _ = query.shape
    slots = key.shape[2]
    window = kwargs.pop("sliding_window", None)
    mask = sdpa_mask(batch_size=batch, q_length=length, kv_length=slots, q_offset=slots - length, kv_offset=0,
                     mask_function=causal_mask_function if window is None else
                     sliding_window_causal_mask_function(window),
                     attention_mask=padding, local_size=window, allow_is_causal_skip=True, device=query.device)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def mlr_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs):
    """The attention-interface function registered as ``"mlr"``.

    query (B, Hq, T, d) after RoPE / q-k norm; key, value (B, Hkv, S, d) after the cache update (S > T when a
    cache holds earlier tokens); attention_mask: (B, S) key-padding mask from ``mlr_mask`` or None;
    kwargs: ``position_ids`` (B, T), ``sliding_window``, ``softcap``, ... Returns ((B, T, Hq, dv), None).
    """
    config = module.config
    if not is_mlr_layer(config, getattr(module, "layer_idx", None)):
        return _dense_attention(module, query, key, value, attention_mask, scaling, dropout, dict(kwargs))
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"MLR attention got a {attention_mask.dim()}-D attention mask of shape "
                         f"{tuple(attention_mask.shape)}; it accepts only the (batch, length) padding mask "
                         f"(custom 4-D masks, packed or multimodal masks are not supported)")
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} was passed: packed sequences (varlen / padding-free batches) are not "
                             f"supported by MLR attention")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"softcap={kwargs['softcap']}: attention logit soft-capping is not supported by MLR")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"layer {module.layer_idx} is a sliding-window layer (window {kwargs['sliding_window']}); "
                         f"MLR replaces it only when patched with sliding_window_layers='replace'")
    if not getattr(module, "is_causal", True):
        raise ValueError("MLR attention is implemented for causal (decoder) self-attention only")
    if dropout and module.training:
        _warn_once("dropout", f"attention dropout (p={dropout}) is not applied by MLR attention layers")

    ranks, block_sizes = layer_ranks(config)
    head_dim = query.shape[-1]
    validate_mlr_geometry(ranks, block_sizes, head_dim, "mlr_ranks", "mlr_block_sizes")
    level_scales = getattr(config, "mlr_level_scales", None)
    if level_scales is None:
        level_scales = [head_dim ** -0.5 if scaling is None else float(scaling)] * len(ranks)
    batch, q_heads, length, _ = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    if attention_mask is not None and attention_mask.shape[-1] != slots:
        raise ValueError(f"the padding mask covers {attention_mask.shape[-1]} keys but the layer holds {slots}: "
                         f"static / preallocated caches are not supported by MLR attention")
    positions = _query_positions(kwargs.get("position_ids"), batch, length, slots, query.device)
    valid_queries = None if attention_mask is None else attention_mask[:, -length:]
    _check_not_packed(positions, valid_queries)

    order = _dim_order(module, query.device)
    layer = kwargs.get(CACHE_LAYER_KEY)
    if layer is not None:  # the hierarchical key cache: ``key`` holds level-1 keys only, already in level order
        key = kwargs[FULL_KEYS_KEY]  # (B, Hkv, T, d) of this chunk, level order
        if order is not None:
            query = query.index_select(-1, order)
        if slots > length:
            return _attend_grouped(layer, query, level_scales, kv_heads).transpose(1, 2), None
    elif order is not None:
        query, key = query.index_select(-1, order), key.index_select(-1, order)
    if slots == length:  # no earlier tokens: the fused exact op (K/V repeated for GQA as a temporary)
        groups = q_heads // kv_heads
        out = mlr_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), ranks=ranks,
                            block_sizes=block_sizes, causal=True, scales=level_scales, positions=positions,
                            attention_mask=valid_queries)
    else:
        out = mlr_cached_attention(query, key, value, ranks=ranks, block_sizes=block_sizes,
                                   level_scales=level_scales, query_positions=positions,
                                   key_positions=_key_positions(positions, valid_queries, slots),
                                   key_valid=attention_mask)
    return out.transpose(1, 2), None


ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, mlr_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, mlr_mask)


# ------------------------------------------------------------------------------------------- MLR<Arch> classes

_CLASSES = {}


def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                  max_cache_length):
    assisted = "assisted" in str(getattr(generation_mode, "value", generation_mode))
    if assisted or model_kwargs.get("assistant_model") is not None or \
            getattr(generation_config, "prompt_lookup_num_tokens", None):
        raise ValueError("assisted decoding (assistant_model / prompt lookup) rolls the cache back, which the MLR "
                         "key cache cannot do; generate without an assistant")
    implementation = generation_config.cache_implementation
    if model_kwargs.get("cache") is None and implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={implementation!r} is not supported by MLR attention layers; use "
                         f"the default dynamic cache")
    if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
        if passes_cache_kwargs(self):
            model_kwargs["cache"] = self.new_cache()
            return
        _warn_once(f"full-keys-{type(self).__name__}",
                   f"{type(self).__name__}: its attention calls cache.update without kwargs, so the MLR key cache "
                   f"cannot see positions and padding; generation keeps full keys in a plain DynamicCache (exact, "
                   f"no key-cache saving)")
    return super(_mlr_owner(self), self)._prepare_cache_for_generation(
        generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)


def _mlr_owner(model) -> type:
    """The MLR<Arch> class in the model's MRO (the class whose methods these functions are)."""
    return next(c for c in type(model).__mro__ if "_mlr_base" in c.__dict__)


def _new_cache(self) -> StructAttnCache:
    """An empty cache for this model: the hierarchical MLR key cache in its MLR layers (``DecoderMLRKeyCacheLayer``),
    a sliding-window or an appending layer elsewhere. ``generate`` builds it when the architecture hands its
    kwargs to ``cache.update`` (Llama, Qwen, Mistral, Gemma, Phi-3, GPT-2, ...)."""
    config = self.config.get_text_config(decoder=True)
    ranks, block_sizes = layer_ranks(config)
    specs = []
    for index in range(config.num_hidden_layers):
        if is_mlr_layer(config, index):
            specs.append({"attention": "mlr", "ranks": ranks, "block_sizes": block_sizes})
        elif _layer_is_sliding(config, index):
            specs.append({"attention": "swa", "sliding_window": config.sliding_window})
        else:
            specs.append({"attention": "dense"})
    cache = StructAttnCache(specs)
    order = getattr(config, "mlr_dim_order", None)
    for index, spec in enumerate(specs):
        if spec["attention"] == "mlr":
            cache.layers[index] = DecoderMLRKeyCacheLayer(ranks, block_sizes, order, plan=cache.layers[index].plan)
    return cache


def _forward_of(base):
    """``forward`` of ``MLR<base>``: the base forward plus the padding flags of the new tokens, which the MLR key
    cache needs and transformers does not hand to ``cache.update``; they travel with the forward kwargs down to
    each attention call. It keeps the base signature (``generate`` reads it to decide what to pass, e.g.
    ``position_ids``)."""
    signature = inspect.signature(base.forward)

    @functools.wraps(base.forward)
    def forward(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        mask = bound.get("attention_mask")
        tokens = bound.get("input_ids") if bound.get("input_ids") is not None else bound.get("inputs_embeds")
        valid = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tokens is not None:
            valid = mask[:, -tokens.shape[1]:].bool()
        kwargs[KEY_VALID_KEY] = valid
        return base.forward(self, *args, **kwargs)

    return forward


def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, allow_all_kernels=False):
    # an MLR model runs "mlr" whatever the load path asks for by default (sdpa / None)
    if attn_implementation not in (None, "sdpa", ATTENTION_NAME):
        raise ValueError(f"attn_implementation={attn_implementation!r}: {type(self).__name__} runs MLR attention "
                         f"(attn_implementation='mlr'); load the original checkpoint for other implementations")
    return ATTENTION_NAME


def _save_pretrained(self, save_directory, *args, **kwargs):
    # a model card that says loudly what a stock load of this checkpoint would get (written before the upload of
    # push_to_hub=True; an existing card is kept)
    os.makedirs(save_directory, exist_ok=True)
    card = os.path.join(save_directory, "README.md")
    ours = MODEL_CARD.format(arch=type(self).__name__, base=self._mlr_base, ranks=self.config.mlr_ranks,
                             blocks=self.config.mlr_block_sizes, layers=self.config.mlr_layers)
    existing = ""
    if os.path.exists(card):
        with open(card, encoding="utf-8") as handle:
            existing = handle.read()
    if CARD_WARNING not in existing:
        # a card already there (often the stock model's) keeps its text, but the warning goes on top of it:
        # otherwise a folder that held the stock checkpoint would describe a dense model
        if existing:
            front, body = _split_front_matter(existing)
            ours = (ours if front is None else front + ours.split("---\n", 2)[2]) + "\n" + body
        with open(card, "w", encoding="utf-8") as handle:
            handle.write(ours)
    return super(_mlr_owner(self), self).save_pretrained(save_directory, *args, **kwargs)


CARD_WARNING = "WARNING: this is not a stock"


def _split_front_matter(text: str):
    """(YAML front matter including its closing ``---`` line, or None; the rest of a model card)."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end >= 0:
            return text[:end + 5], text[end + 5:]
    return None, text


MODEL_CARD = """---
library_name: transformers
tags: [hf_structattn, mlr-attention, custom_code]
---
# {arch}: MLR structured attention

> **WARNING: this is not a stock {base}.** Its attention is multi-level low-rank (MLR) attention
> (mlr_ranks={ranks}, mlr_block_sizes={blocks}, layers={layers}). Load it with
> `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` or after `import hf_structattn`.
> `{base}.from_pretrained(path)` ignores the MLR fields and gives a DENSE model with different outputs.
"""


def mlr_config_class(base):
    """``MLR<Base>`` config class: the base config with model_type ``mlr_<base model_type>``."""
    name = CLASS_PREFIX + base.__name__
    if name not in _CLASSES:
        cls = type(name, (base,), {"model_type": MODEL_TYPE_PREFIX + base.model_type, "__module__": __name__})
        cls.register_for_auto_class()
        _CLASSES[name] = cls
    return _CLASSES[name]


def mlr_model_class(base, auto_class: str = "AutoModelForCausalLM"):
    """``MLR<Base>`` model class: the transformers class with MLR attention forced and generate's cache checks."""
    name = CLASS_PREFIX + base.__name__
    if name not in _CLASSES:
        namespace = {
            "__module__": __name__,
            "config_class": mlr_config_class(base.config_class),
            "_check_and_adjust_attn_implementation": _check_and_adjust_attn_implementation,
            "_prepare_cache_for_generation": _prepare_cache_for_generation,
            "new_cache": _new_cache,
            "forward": _forward_of(base),
            "save_pretrained": _save_pretrained,
            "_mlr_base": base.__name__,
        }
        cls = type(name, (base,), namespace)
        cls.register_for_auto_class(auto_class)
        _CLASSES[name] = cls
    return _CLASSES[name]


def __getattr__(name: str):
    """``MLRLlamaForCausalLM``, ``MLRLlamaConfig``, ...: built from the transformers class of the same name (this
    is how ``trust_remote_code`` finds the classes named in ``config.auto_map``)."""
    if name.startswith(CLASS_PREFIX) and not name.startswith("__"):
        base = getattr(transformers, name[len(CLASS_PREFIX):], None)
        if isinstance(base, type) and issubclass(base, transformers.PreTrainedConfig):
            return mlr_config_class(base)
        if isinstance(base, type) and issubclass(base, transformers.PreTrainedModel):
            return mlr_model_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ATTENTION_NAME", "mlr_attention_forward", "mlr_cached_attention", "mlr_config_class", "mlr_mask",
           "mlr_model_class"]
