"""How a forward gets what its MLR layers need: a cache whose MLR layers hold the hierarchical form
(``prepare_structattn_cache``, also what ``generate`` and ``new_cache`` use) and the forward's whole plan, made before
its first layer runs (``prepare_step``: the step's facts, every MLR cache layer's layout and read record, the verdict
on a caller's mask, the caches' growth), shared by the GPT-2 family's forward, T5, patched decoders and the export
recipe (``forward_with_step`` wraps a transformers forward with a family's preparation)."""

import inspect
from typing import Callable, Optional

import torch
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache, QuantizedLayer, StaticLayer
from transformers.utils import logging
from transformers.utils.deprecation import deprecate_kwarg

from .structattn_cache import MLR_CACHE_LAYERS, MLRKeyCacheLayer, MLRStaticKeyCacheLayer, held_geometry
from .structattn_cache_quantized import MLRQuantizedKeyCacheLayer
from .structattn_install import MLR_EAGER_ATTENTION
from .structattn_masks import (
    MASK_REFUSED,
    additive_mask,
    check_additive_mask,
    check_mask_shape,
    group_major,
    is_standard_mask,
    key_validity,
    mask_allowed,
    own_key_allowed,
    slot_bias,
    slot_mask,
    softmax_dtype,
    token_shift,
)
from .structattn_mlr_plan import (
    InStepRead,
    LayerPlan,
    TracedRead,
    make_layout,
    make_plan,
    plan_general_read,
    plan_in_step_read,
    plan_traced_read,
    read_formulation,
)
from .structattn_step import STEP_KEY, MLRStep, build_step, plain_step

logger = logging.get_logger(__name__)


def self_attention_cache(cache: Optional[Cache]) -> Optional[Cache]:
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


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
    kind, quantised (``MLRQuantizedKeyCacheLayer``) in an ``MLRQuantizedCache`` and for an empty layer of
    transformers' ``QuantizedCache`` (its ``nbits`` and ``q_group_size``); a layer that already holds full-width keys
    stays as it is (exact, no saving). Lazily replicated caches
    (``DynamicCache()`` without config) get their layers created here. ``reserve``: final length (generate) to
    allocate exactly. Returns ``cache``."""
    target = self_attention_cache(cache)
    if target is None:
        return cache
    # an ``MLRQuantizedCache``: (bits, group size, key bits) of its MLR layers
    quantisation = getattr(target, "mlr_quantisation", None)
    if num_layers is not None:
        for part in (target, cache.cross_attention_cache) if isinstance(cache, EncoderDecoderCache) else (target,):
            _extend_layers(part, num_layers)
    for layer_idx, layer in enumerate(target.layers):
        if layer_idx not in geometries and isinstance(layer, MLR_CACHE_LAYERS) and layer.is_bound:
            # the hierarchical form of another model's MLR layer (an unbound MLR layer holds full keys, as a plain one)
            if layer.get_seq_length() > 0:
                raise ValueError(f"cache layer {layer_idx} holds {held_geometry(layer.geometry)}, written by an MLR "
                                 f"model; this model's layer {layer_idx} is not MLR: a cache is read only by a model "
                                 f"of the geometry that wrote it (start from a new cache)")
            target.layers[layer_idx] = StaticLayer(max_cache_len=layer.max_cache_len) if layer.is_static else \
                DynamicLayer()
    for layer_idx, geometry in geometries.items():
        if layer_idx >= len(target.layers):
            continue
        layer = target.layers[layer_idx]
        if quantisation is not None and type(layer) is MLRKeyCacheLayer and layer.get_seq_length() == 0:
            # a config whose layer types name MLR layers built plain ones (the GPT-2 family): quantised as asked
            recording = layer.record_past  # (generate activated rollback on the cache it built)
            layer = target.layers[layer_idx] = MLRQuantizedKeyCacheLayer(geometry, *quantisation)
            if recording:
                layer.activate_past_recording()
        if isinstance(layer, MLR_CACHE_LAYERS):
            layer.layer_index = layer_idx
            if layer.geometry is not geometry and layer.geometry != geometry and (
                    layer.geometry is not None or layer.get_seq_length() == 0):
                layer.bind(geometry)  # refuses a layer written with another geometry
        else:
            recording = bool(getattr(layer, "record_past", False))
            if type(layer) is DynamicLayer and layer.get_seq_length() == 0:
                layer = target.layers[layer_idx] = MLRKeyCacheLayer(geometry) if quantisation is None else \
                    MLRQuantizedKeyCacheLayer(geometry, *quantisation)
            elif isinstance(layer, QuantizedLayer) and not layer.is_initialized:
                # transformers' quantised cache: the MLR layers hold codes of their own, of its width and group
                layer = target.layers[layer_idx] = MLRQuantizedKeyCacheLayer(geometry, layer.nbits,
                                                                             layer.q_group_size)
            elif type(layer) is StaticLayer and not layer.is_initialized:
                layer = target.layers[layer_idx] = MLRStaticKeyCacheLayer(layer.max_cache_len, geometry)
            else:
                if type(layer) not in (DynamicLayer, StaticLayer):  # (a plain layer already written says so below)
                    logger.warning_once(
                        f"cache layer {layer_idx} is a {type(layer).__name__}, which cannot hold the MLR key "
                        f"hierarchy: it keeps full-width keys (exact, but the MLR key-cache saving is lost); "
                        f"DynamicCache(config=model.config), StaticCache, or generate's default or 'static' cache "
                        f"keep the hierarchy")
                continue
            layer.layer_index = layer_idx
            if recording:  # generate activated rollback on the cache it built (an assistant's, a speculative run's)
                layer.activate_past_recording()
        if reserve is not None and isinstance(layer, MLRKeyCacheLayer) and layer.get_seq_length() == 0:
            layer.reserve(reserve)
    return cache


def set_rollback_window(cache: Cache, tokens: Optional[int]) -> None:
    """Let ``crop`` remove at most ``tokens`` tokens from every MLR layer of ``cache`` (None: everything written since
    the last crop). The rollback log then costs ``tokens * sum_{l>=2} r_l`` entries per row and head (plus a bool and
    a position per token), however long the context."""
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"rollback window must be a positive number of tokens or None, got {tokens!r}")
    for layer in self_attention_cache(cache).layers:
        if isinstance(layer, MLR_CACHE_LAYERS):
            layer.rollback_window = tokens


def new_token_validity(mask: Optional[torch.Tensor], past, length: int) -> Optional[torch.Tensor]:
    """(B, T) padding flags of the new tokens from a 2-D keep-mask or a 4-D mask (a new token is real iff its own key
    is allowed in some head: the diagonal of its rows, at column ``past + i``), or None."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask[:, -length:].bool()
    if mask.dim() != 4 or mask.shape[-2] != length:
        return None
    return own_key_allowed(mask, past)


def prepare_step(model, *, cache: Optional[Cache], batch: int, length: int, device,
                 position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 count_positions: bool = False, max_positions: Optional[tuple] = None,
                 heads: Optional[int] = None, relative_bias: Optional[Callable] = None) -> MLRStep:
    """The whole plan of one forward of ``model`` (any family: ``model.structattn_layer_configs()`` names its MLR
    layers), made before its first layer runs. ``cache``: the forward's cache (its self-attention part is used; its
    MLR layers get their hierarchical form here unless tracing, and grow here); ``position_ids``: the given (B, T) |
    (1, T) positions, or None (continue the cache, or with ``count_positions`` count each row's real tokens: T5);
    ``attention_mask``: the caller's 2-D keep-mask over cached + new tokens or 4-D mask, or None; ``max_positions``:
    (field, limit) of a learned position table; ``heads``: the model's query heads (the mask's head axis is 1 or
    that); ``relative_bias``: T5's relative bias of its decoder self-attention, ``relative_bias(cached tokens)`` ->
    (1, H, T, K) over token indices, added in the MLR layers' cached reads.

    Checks the mask's shape (``check_mask_shape``, the one rule) against the cache once the step has read the cache's
    length back (the one host read of the forward); a caller's 4-D mask is compared with the causal + padding mask
    here, once (``MLRStep.custom_mask``, and at the slots in the read records)."""
    tracing = torch.compiler.is_compiling()
    target = self_attention_cache(cache)
    layer_configs = model.structattn_layer_configs()
    if cache is not None and not tracing:  # a compiled step gets generate's prepared cache
        prepare_structattn_cache(cache, model.structattn_cache_geometries(),
                                 num_layers=model.structattn_num_cache_layers())
    past = target.get_seq_length() if target is not None else 0
    if position_ids is not None:
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        positions = position_ids if position_ids.dim() == 2 else None  # (3, B, T) multimodal: refused later
    elif count_positions:
        positions = None
    else:
        positions = (torch.arange(length, device=device) + past)[None]
    valid = key_mask = checked = None
    standard = not isinstance(attention_mask, dict)  # per-layer-type masks the caller built
    if not isinstance(attention_mask, torch.Tensor):
        attention_mask = None
    if attention_mask is not None:
        check_mask_shape(attention_mask, batch, heads, length, None if isinstance(past, torch.Tensor) else past)
    if attention_mask is not None and attention_mask.dim() == 2:
        valid = attention_mask[:, -length:].bool().to(device).expand(batch, length)
        key_mask = attention_mask
        if attention_mask.dtype != torch.bool:
            checked = attention_mask
    elif attention_mask is not None and attention_mask.dim() == 4:
        check_additive_mask(attention_mask)
        valid = new_token_validity(attention_mask, past, length)
        valid = None if valid is None else valid.expand(batch, length)
        standard = False
    if not layer_configs:  # no MLR layer reads a cache: the input checks only (one read at most)
        step = plain_step(cache=target, positions=positions, valid=valid, batch=batch, length=length, device=device,
                          key_mask=key_mask, standard_masks=standard, checked_mask=checked, past=past,
                          max_positions=max_positions)
        if attention_mask is not None and isinstance(past, torch.Tensor) and step.tokens is not None:
            check_mask_shape(attention_mask, batch, heads, length, step.tokens)
        return step
    # the cache's MLR layers of this model (prepare_structattn_cache bound them; others hold full keys)
    layers = [] if target is None else [target.layers[index] for index in layer_configs
                                        if index < len(target.layers) and
                                        isinstance(target.layers[index], MLR_CACHE_LAYERS) and
                                        target.layers[index].geometry is not None]
    step = build_step(cache=target, positions=positions, valid=valid, batch=batch, length=length, device=device,
                      key_mask=key_mask, standard_masks=standard, checked_mask=checked,
                      embedding_positions=positions if max_positions is not None else None,
                      max_positions=max_positions, mlr_layers=layers)
    facts = step.facts
    if facts is not None and attention_mask is not None and isinstance(past, torch.Tensor):
        check_mask_shape(attention_mask, batch, heads, length, facts.tokens_before)
    custom = False
    if not standard and attention_mask is not None and attention_mask.dim() == 4 and not tracing:
        # the caller's own 4-D mask (a window, a bidirectional or block overlay, a hidden pair) is applied as given
        # wherever its keys are in token order; one comparison per forward
        keys = attention_mask.shape[-1]
        key_valid = step.valid if keys == length and step.valid is not None else key_validity(attention_mask, batch,
                                                                                             keys)
        tokens_before = facts.tokens_before if facts is not None else int(past)
        custom = not is_standard_mask(attention_mask, key_valid, True, length, query_offset=tokens_before)
        if custom and not tokens_before and keys > length and layers:
            # an MLR layer's first chunk attends to its own keys: a static cache's empty slots after them hold nothing
            if bool((mask_allowed(attention_mask)[..., length:].any(-1) & step.real()[:, None, :]).any()):
                raise ValueError(MASK_REFUSED.format(what="an empty slot of the static cache"))
    position_bias = None
    if relative_bias is not None and target is not None and step.positions is not None:
        position_bias = relative_bias(facts.tokens_before if facts is not None else past)
    caller_mask = attention_mask if not standard and attention_mask is not None and attention_mask.dim() == 4 and \
        not tracing else None  # (read at the MLR layers' slots, where it may differ from what they hold)
    plans = plan_layers(step, target, layer_configs, custom_mask=caller_mask, position_bias=position_bias) \
        if layers else ()
    return MLRStep(step.cache, step.positions, step.valid, facts, step.standard_masks, step.key_mask, position_bias,
                   step.last_before, step.first_before, step.tokens, plans, custom)


def plan_layers(step: MLRStep, target: Optional[Cache], layer_configs: dict, *,
                custom_mask: Optional[torch.Tensor] = None, position_bias: Optional[torch.Tensor] = None) -> tuple:
    """Per cache layer index of ``target`` (a self-attention cache), the ``LayerPlan`` of each MLR cache layer of
    ``layer_configs`` ({layer index: ``MLRLayerConfig``}) that the forward of ``step`` writes (None elsewhere): one
    ``MLRPlan`` per geometry, one ``CacheLayout`` per storage shape, one read record per layout, query grouping and
    level scales (a model's layers share all three). Growth happens here (``planned_storage``), before any write.
    custom_mask: a caller's 4-D mask (read at each layout's slots, applied where it differs from the causal +
    padding mask of what the layers hold); position_bias: T5's
    relative bias over token indices (read at the slots). What ``prepare_step`` puts into ``MLRStep.layers``; public
    for code that drives a cache without a model (the cached op's tests)."""
    if target is None or step.positions is None:
        return ()
    tracing = torch.compiler.is_compiling()
    facts = step.facts
    chunk = step.positions.shape[1]
    gradients = torch.is_grad_enabled()
    tokens_after = (facts.tokens_before if facts is not None else target.get_seq_length()) + chunk
    plans, layouts, layer_plans, made = [], [], [None] * len(target.layers), []
    base_config = maps = None
    for index, config in layer_configs.items():
        if index >= len(target.layers):
            continue
        layer = target.layers[index]
        if not (isinstance(layer, MLR_CACHE_LAYERS) and layer.geometry is not None):
            continue  # a layer that holds full keys: the attention reads it in token order
        if not tracing:  # where ``update`` finds its plan (no attribute writes while tracing: set by earlier calls)
            layer.layer_index = index
        geometry = config.mlr_geometry
        plan = None
        for candidate in plans:
            if candidate.geometry is geometry:
                plan = candidate
                break
        if plan is None:
            plan = make_plan(step, geometry)
            plans.append(plan)
        base, capacity, value_width, dtype, kv_heads, record = layer.planned_storage(facts, chunk)
        layout = None
        # While tracing, each layer's capacity is its own symbol (a static cache's ``max_cache_len`` becomes dynamic
        # when a later ``generate`` changes it): comparing two layers' symbols makes inductor express the graph in a
        # symbol it never binds (``NameError: name 's9' is not defined`` on the recompile), so traced layers share no
        # layout.
        for candidate in () if tracing else layouts:
            if candidate.plan is plan and candidate.base == base and candidate.capacity == capacity and \
                    candidate.value_width == value_width and candidate.record == record:
                layout = candidate
                break
        if layout is None:
            layout = make_layout(plan, base, capacity, value_width, record)
            layouts.append(layout)
        read = None
        if plan.held and value_width is not None:  # (a layer its first write allocates attends to its own chunk)
            if config.base_config is not base_config:  # (the layers of a model share one config)
                base_config = config.base_config
                maps = config._attn_implementation == MLR_EAGER_ATTENTION
            scaling, groups = config.mlr_scaling, config.mlr_query_groups
            # the in-step read views float storages with strides of its own; codes only the general read decodes
            contiguous = layer.contiguous and layer.codecs is None
            for entry in made:
                if entry[0] is layout and entry[1] == groups and entry[2] == scaling and entry[3] == maps and \
                        entry[4] == dtype and entry[5] == contiguous:
                    read = entry[6]
                    break
            else:
                read = _plan_read(layout, geometry.scales(scaling), groups, kv_heads, dtype, contiguous=contiguous,
                                  maps=maps, gradients=gradients, custom_mask=custom_mask,
                                  position_bias=position_bias, tokens_after=tokens_after)
                made.append((layout, groups, scaling, maps, dtype, contiguous, read))
        shared = None
        for entry in layer_plans:  # layers of one layout and read share their LayerPlan
            if entry is not None and entry.layout is layout and entry.read is read and entry.scaling == \
                    config.mlr_scaling:
                shared = entry
                break
        layer_plans[index] = shared if shared is not None else LayerPlan(layout, read, config.mlr_scaling)
    return tuple(layer_plans)


def _plan_read(layout, scales: tuple, groups: int, kv_heads: int, dtype: torch.dtype, *, contiguous: bool, maps: bool,
               gradients: bool, custom_mask: Optional[torch.Tensor], position_bias: Optional[torch.Tensor],
               tokens_after):
    """The read record of the layers of ``layout`` with ``kv_heads`` cached heads of ``groups`` query rows each and
    level ``scales`` over storages of ``dtype``: its type is the formulation (``read_formulation``). A caller's 4-D mask and T5's
    relative bias are read at the layout's slots here (the slot mask reads back once, and refuses a mask that allows
    a key the cache does not hold)."""
    plan = layout.plan
    bias = mask = None
    if position_bias is not None:  # T5: the bias over every token index, read at each row's slots
        bias = slot_bias(position_bias, token_shift(plan.positions, plan.real, tokens_after, layout.base),
                         layout.slots)
    if custom_mask is not None:  # None when it is the causal + padding mask of what the layers hold
        mask = slot_mask(custom_mask, plan.positions, plan.real, tokens_after, layout.first_after, layout.base,
                         layout.slots)
        if mask is not None:
            from_mask = group_major(additive_mask(mask, softmax_dtype(dtype)), kv_heads, groups)
            bias = from_mask if bias is None else bias + from_mask
    formulation = read_formulation(plan, contiguous=contiguous, dtype=dtype, biased=bias is not None, maps=maps,
                                   gradients=gradients)
    if formulation is InStepRead:
        return plan_in_step_read(layout, scales, dtype)
    if formulation is TracedRead:
        return plan_traced_read(layout, scales, dtype)
    return plan_general_read(layout, groups, scales, dtype, bias=bias, slot_mask=mask)


def forward_with_step(base, prepare: Callable):
    """``forward`` of a model class built on the transformers class ``base``: ``prepare(self, kwargs)`` fills the
    keyword arguments (the cache, the step plan under ``STEP_KEY``) and returns them, or None to call ``base.forward``
    unchanged; then the base forward runs. It keeps the base signature (``generate`` reads it to decide what to
    pass) and transformers' renaming of ``past_key_values``."""
    signature = inspect.signature(base.forward)
    positional = [name for name, parameter in signature.parameters.items()
                  if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)][1:]

    def forward(self, *args, **kwargs):
        kwargs.update(zip(positional, args))
        return base.forward(self, **prepare(self, kwargs))

    forward.__signature__ = signature
    forward.__doc__ = base.forward.__doc__
    if "cache" in signature.parameters:  # transformers' own renaming and FutureWarning for ``past_key_values``
        forward = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)
    forward.__name__ = "forward"
    return forward


def mlr_exportable_decoder(model, batch_size: int = 1, max_cache_len: Optional[int] = None, device=None):
    """transformers' ExecuTorch recipe (``TorchExportableModuleForDecoderOnlyLM``: forward(input_ids, cache_position)
    -> logits over a static cache, ``.export(...)``) for a model of this package, with the MLR layers of its static
    cache in hierarchical form: each becomes an ``MLRStaticKeyCacheLayer``, allocated now (base 0), and all its
    tensors are module buffers as the recipe registers keys, values and cumulative lengths (``key_cache_{i}``,
    ``value_cache_{i}``, ``cumulative_length_{i}``, and ``fine_cache_{i}``, ``first_positions_{i}``,
    ``last_positions_{i}`` for the MLR layers), so that ``torch.export`` carries them as mutable state. The recipe
    asks for ``generation_config.cache_implementation == "static"``; the model's own generation config is left as
    it was."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    generation_config = model.generation_config
    previous = generation_config.cache_implementation
    generation_config.cache_implementation = "static"
    try:
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=batch_size, max_cache_len=max_cache_len,
                                                        device=device)
    finally:
        generation_config.cache_implementation = previous
    inner = wrapper.model
    cache = getattr(inner, "static_cache", None) or inner.cache
    for index, geometry in model.structattn_cache_geometries().items():
        old = cache.layers[index]
        layer = MLRStaticKeyCacheLayer(old.max_cache_len, geometry)
        layer.lazy_initialization(old.keys, old.values)  # shapes, dtype and device of the recipe's allocation
        layer.layer_index = index  # (the traced forward does not prepare the cache: it records no index)
        cache.layers[index] = layer
        buffers = {"key_cache": layer.keys, "value_cache": layer.values, "cumulative_length": layer.cumulative_length,
                   "fine_cache": layer.fine_storage, "first_positions": layer.first_positions,
                   "last_positions": layer.last_positions}
        for name, tensor in buffers.items():
            inner.register_buffer(f"{name}_{index}", tensor, persistent=False)
    return wrapper


__all__ = ["STEP_KEY", "forward_with_step", "key_cache_bytes", "mlr_exportable_decoder", "new_token_validity",
           "plan_layers", "prepare_step", "prepare_structattn_cache", "self_attention_cache", "set_rollback_window"]
