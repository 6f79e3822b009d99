"""Convert a pretrained transformers decoder (Llama, Qwen2/3, Mistral, Gemma/Gemma-3, Phi-3, GPT-2, GPT-NeoX,
... any ``*ForCausalLM`` that dispatches through the attention interface) to MLR attention.

``patch_decoder`` returns a new model of class ``MLR<Arch>`` (a subclass of the transformers class built by the
payload module ``modeling/structattn_decoder.py``, constructed from the new config; the original is not modified):
every weight keeps its name and value (cloned), the config becomes
``MLR<Arch>Config`` (model_type ``mlr_<type>``) carrying the MLR fields, and ``save_pretrained`` writes the payload
code next to the weights so the checkpoint reloads with ``trust_remote_code=True`` where hf_structattn is absent.

Level slices of RoPE models hold complete rotation pairs: the pair structure and each pair's frequency are read from
the model's own rotary embedding (``rotary_dims``), ``level_order`` says which pairs go to which level
(``LEVEL_ORDERS``; default ``DEFAULT_LEVEL_ORDER``, "frequency": position-free dims, then the pairs from the lowest
frequency up), and the resulting head-dim order is applied to q and k at run time. Block sizes come from
``mlr_block_sizes`` or the stated training length ``mlr_max_length`` (dyadic), never from
``max_position_embeddings``.
"""

import sys
from typing import Optional, Sequence

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel

from .conversion import convert_model
from .modeling.structattn_decoder import (
    DEFAULT_LEVEL_ORDER,
    LEVEL_ORDERS,
    MODEL_TYPE_PREFIX,
    attention_modules,
    base_model_name,
    check_level_order,
    check_levels_hold_whole_pairs,
    decoder_geometry,
    level_dim_order,
    mlr_config_class,
    mlr_model_class,
    rotary_dims,
    stored_dim_order,
)
from .modeling.structattn_config_rules import default_block_sizes, validate_mlr_geometry

ATTENTION_NAME = "mlr"
SLIDING_WINDOW_CHOICES = ("refuse", "replace")
DECODER_INITS = ("split",)
LOAD_NOTICE = ("This checkpoint uses MLR structured attention (hf_structattn). Load it with "
               "trust_remote_code=True, or after `import hf_structattn`. Loading it as a stock {arch} (e.g. "
               "{arch}.from_pretrained) ignores the MLR fields and gives a DENSE model with different outputs.")


def is_patchable_decoder(model) -> bool:
    """A transformers ``PreTrainedModel`` decoder whose class transformers exports (so the payload can rebuild it)."""
    if not isinstance(model, PreTrainedModel) or getattr(model.config, "is_encoder_decoder", False):
        return False
    # an MLR<Arch> model counts too, so that patch refuses it with a clear message
    return getattr(transformers, type(model).__name__, None) is type(model) or \
        model.config.model_type.startswith(MODEL_TYPE_PREFIX)


def is_decoder_architecture(architectures) -> bool:
    """Whether a config.json ``architectures`` list names a transformers causal-LM class (for the CLI)."""
    return any((name.endswith("ForCausalLM") or name.endswith("LMHeadModel")) and
               isinstance(getattr(transformers, name, None), type) for name in architectures)


def _refuse_unsupported(model) -> None:
    config = model.config
    name = type(model).__name__
    if config.model_type.startswith(MODEL_TYPE_PREFIX):
        raise ValueError(f"this model already has MLR attention (model_type {config.model_type!r}); patch the "
                         f"original checkpoint instead")
    if config.sub_configs or getattr(config, "vision_config", None) is not None:
        raise ValueError(f"{name} is a multimodal / composite model ({sorted(config.sub_configs)}); MLR patching "
                         f"supports text decoders (multimodal position ids and masks are not supported)")
    if not name.endswith("ForCausalLM") and not name.endswith("LMHeadModel"):
        raise ValueError(f"{name}: patch converts causal-LM heads (*ForCausalLM / *LMHeadModel)")
    layers = attention_modules(model)
    missing = sorted(set(range(config.num_hidden_layers)) - set(layers))
    if missing:
        raise ValueError(f"{name}: layers {missing} have no attention module that dispatches through transformers' "
                         f"attention interface, so MLR cannot be installed without rewriting its attention module")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping}: attention logit soft-capping is "
                         f"not supported by MLR attention")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("add_cross_attention=True: MLR patching converts decoder self-attention only")
    rope = getattr(config, "rope_parameters", None) or {}
    if any(isinstance(value, dict) and "mrope_section" in value for value in [rope, *rope.values()]) or \
            "mrope_section" in rope:
        raise ValueError("multimodal rotary positions (mrope_section) are not supported by MLR attention")


def head_dim_of(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    return head_dim if head_dim else config.hidden_size // config.num_attention_heads


def sliding_layers(config) -> list:
    """Indices of the layers that use a sliding window (or another non-full attention type)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [index for index, kind in enumerate(layer_types) if kind != "full_attention"]
    if getattr(config, "sliding_window", None) is not None:
        return list(range(config.num_hidden_layers))
    return []


def _resolve_layers(layers, num_layers: int) -> Optional[list]:
    if layers is None:
        return None
    layers = sorted(set(layers))
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ValueError(f"layers: {layer!r} is not a layer index in [0, {num_layers})")
    if not layers:
        raise ValueError("layers must name at least one layer")
    return layers


def _block_sizes(ranks, mlr_block_sizes, mlr_max_length) -> list:
    if mlr_block_sizes is not None:
        if mlr_max_length is not None:
            raise ValueError("give mlr_block_sizes or mlr_max_length, not both")
        return list(mlr_block_sizes)
    if mlr_max_length is None:
        raise ValueError("mlr_block_sizes (b_2..b_L) or mlr_max_length (the training length, for dyadic blocks) is "
                         "required; block sizes are never derived from max_position_embeddings")
    return default_block_sizes(mlr_max_length, len(ranks))


def find_rotary(model):
    """(a copy of the model's rotary embedding built on the CPU from its config, its modeling file's
    ``apply_rotary_pos_emb``), or None without RoPE. The copy works for a model on the meta device too."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            apply_fn = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
            if apply_fn is None:
                raise ValueError(f"{type(module).__name__} has no apply_rotary_pos_emb next to it: cannot find the "
                                 f"rotation pairs of this model")
            with torch.device("cpu"):
                return type(module)(config=module.config), apply_fn
    return None


def patch_decoder(model, attention: str = "mlr", *, mlr_ranks: Optional[Sequence[int]] = None, mlr_block_sizes=None,
                  mlr_max_length: Optional[int] = None, layers: Optional[Sequence[int]] = None, init: str = "split",
                  sliding_window_layers: str = "refuse", mlr_level_scales: Optional[Sequence[float]] = None,
                  level_order: str = DEFAULT_LEVEL_ORDER, calibration_ids: Optional[torch.Tensor] = None,
                  mlr_level_rule: str = "blocks"):
    """Return an MLR copy of a transformers decoder (``model`` is not modified); see the module docstring and
    ``plan_decoder_patch`` (which checks the arguments) for the arguments."""
    new_config = plan_decoder_patch(model, attention, mlr_ranks=mlr_ranks, mlr_block_sizes=mlr_block_sizes,
                                    mlr_max_length=mlr_max_length, layers=layers, init=init,
                                    sliding_window_layers=sliding_window_layers, mlr_level_scales=mlr_level_scales,
                                    level_order=level_order, calibration_ids=calibration_ids,
                                    mlr_level_rule=mlr_level_rule)
    return build_patched_decoder(model, new_config)


def build_patched_decoder(model, new_config):
    """The ``MLR<Arch>`` copy of ``model`` for a config returned by ``plan_decoder_patch(model, ...)``."""
    model_class = mlr_model_class(type(model))
    register_local(model_class)
    return convert_model(model, model_class, new_config)


def plan_decoder_patch(model, attention: str = "mlr", *, mlr_ranks: Optional[Sequence[int]] = None,
                       mlr_block_sizes=None, mlr_max_length: Optional[int] = None,
                       layers: Optional[Sequence[int]] = None, init: str = "split",
                       sliding_window_layers: str = "refuse", mlr_level_scales: Optional[Sequence[float]] = None,
                       level_order: str = DEFAULT_LEVEL_ORDER, calibration_ids: Optional[torch.Tensor] = None,
                       mlr_level_rule: str = "blocks"):
    """Every check of ``patch_decoder`` and the ``MLR<Arch>Config`` it builds (ValueError naming the field
    otherwise). Reads the model's config, class and module structure (its attention modules, its rotary
    embedding) but no weight, except for ``level_order="contribution"``, which runs the model on
    ``calibration_ids``: ``hf-structattn patch`` runs it on a model built on the meta device from config.json
    before loading any weight (``weightless_check_fields`` makes its keywords fit that check).

    Args:
        mlr_ranks: level ranks r_1..r_L summing to the head dim. For RoPE models every level boundary inside the
            rotated dims must be even (levels hold whole rotation pairs).
        mlr_block_sizes / mlr_max_length: nested block sizes b_2..b_L, or the training length they are derived
            from (b_l = max_length / 2^(l-1)).
        layers: indices of the layers to convert (default: all); the others keep their attention.
        init: "split" (levels take the pair-ordered dims in order; weights unchanged).
        sliding_window_layers: "refuse" (default: converting a sliding-window layer is an error) or "replace"
            (converted sliding layers become global MLR layers: outputs change beyond the window).
        mlr_level_scales: per-level logit multipliers (default: the model's own attention scaling).
        level_order: which head dims form which level, every level holding whole RoPE pairs (``LEVEL_ORDERS``):
            "frequency" (the default, ``DEFAULT_LEVEL_ORDER``, chosen by measurement on real weights): position-free
            dims first (unrotated dims of partial RoPE), then the rotation pairs from the lowest frequency to the
            highest; "index": the pairs in the model's own dim order (highest frequency first for transformers'
            RoPE), then the unrotated dims (the order before this keyword existed); "contribution": position-free
            dims first, then the pairs, each part ranked by its measured contribution to the attention scores on
            ``calibration_ids`` (``qk_contribution``, MHA2MLA's rule). A model without RoPE has only position-free
            dims: "frequency" and "index" both keep its dims in order, "contribution" ranks them.
        calibration_ids: token ids, (tokens,) or (windows, tokens), that ``level_order="contribution"`` runs the
            stock model on (one forward per window; refused with any other order); recorded as a token count in
            ``config.mlr_patch``.
        mlr_level_rule: which levels a (query, key) pair shares: "blocks" (the paper's blocks aligned to position 0,
            the default) or "nearest" (level l for keys fewer than b_l positions away: a window per finer level, the
            same cache bytes; on pretrained weights without training it keeps each token's nearest keys at full
            width, docs/patching.md).
    """
    if attention != ATTENTION_NAME:
        raise ValueError(f"attention={attention!r}: decoders can be patched to {ATTENTION_NAME!r} only")
    if init not in DECODER_INITS:
        raise ValueError(f"init={init!r} is not one of {DECODER_INITS} for decoders (an SVD re-basis of W_Q/W_K "
                         f"does not commute with RoPE or q/k norms)")
    if sliding_window_layers not in SLIDING_WINDOW_CHOICES:
        raise ValueError(f"sliding_window_layers={sliding_window_layers!r} is not one of {SLIDING_WINDOW_CHOICES}")
    check_level_order_and_calibration(level_order, calibration_ids, model.config)
    _refuse_unsupported(model)
    if mlr_ranks is None:
        raise ValueError("mlr_ranks (r_1..r_L summing to the head dim) is required to patch a decoder")
    config = model.config
    ranks = list(mlr_ranks)
    head_dim = head_dim_of(config)
    block_sizes = _block_sizes(ranks, mlr_block_sizes, mlr_max_length)
    validate_mlr_geometry(ranks, block_sizes, head_dim, "mlr_ranks", "mlr_block_sizes")
    if mlr_level_scales is not None and len(mlr_level_scales) != len(ranks):
        raise ValueError(f"mlr_level_scales={list(mlr_level_scales)} must give one value per level ({len(ranks)})")
    num_layers = config.num_hidden_layers
    selected = _resolve_layers(layers, num_layers)
    converted = list(range(num_layers)) if selected is None else selected
    windowed = [layer for layer in converted if layer in sliding_layers(config)]
    if windowed and sliding_window_layers == "refuse":
        raise ValueError(f"layers {windowed} use sliding-window attention (window {config.sliding_window}); pass "
                         f"sliding_window_layers='replace' to convert them to global MLR layers, or layers=[...] "
                         f"without them")
    layer_types = getattr(config, "layer_types", None)
    if windowed and layer_types is None and len(converted) != num_layers:
        raise ValueError(f"{type(config).__name__} has one sliding window for every layer; replace all layers or "
                         f"none (layers={selected})")

    rotary = find_rotary(model)
    dims = None
    if rotary is not None:
        types = tuple(sorted({layer_types[i] for i in converted})) if layer_types is not None else (None,)
        dims = rotary_dims(*rotary, head_dim, types)
    # "contribution" puts the same groups first as "frequency" (position-free dims, then pairs): the whole-pair check
    # runs on that order before the measurement, which runs last, once every other field is checked
    order = level_dim_order(dims, head_dim, "frequency" if level_order == "contribution" else level_order)

    model_class = mlr_model_class(type(model))
    fields = {name: value for name, value in config.to_dict().items() if name not in ("model_type", "auto_map")}
    new_config = mlr_config_class(type(config)).from_dict(fields)
    new_config._attn_implementation = config._attn_implementation
    if windowed:
        _replace_sliding_layers(new_config, windowed)
    new_config.mlr_ranks = ranks
    new_config.mlr_block_sizes = block_sizes
    new_config.mlr_layers = selected
    new_config.mlr_dim_order = stored_dim_order(order)
    new_config.mlr_level_scales = None if mlr_level_scales is None else [float(s) for s in mlr_level_scales]
    new_config.mlr_level_rule = mlr_level_rule
    new_config.mlr_patch = {"source": type(model).__name__, "source_model_type": config.model_type, "init": init,
                            "sliding_window_layers": sliding_window_layers, "replaced_sliding_layers": windowed,
                            "level_order": level_order}
    new_config.mlr_notice = LOAD_NOTICE.format(arch=type(model).__name__)
    new_config.architectures = [model_class.__name__]
    # every field checked before anything is built, by the rule the loaded checkpoint is checked by
    decoder_geometry(new_config, head_dim, dims, level_order, new_config.mlr_dim_order)
    if level_order == "contribution":
        from .qk_contribution import measure_qk_contributions

        groups = dims.groups() if dims is not None else [(dim,) for dim in range(head_dim)]
        contributions = measure_qk_contributions(model, calibration_ids, groups, head_dim, converted)
        order = level_dim_order(dims, head_dim, level_order, contributions)
        check_levels_hold_whole_pairs(ranks, order, dims, level_order)
        new_config.mlr_dim_order = stored_dim_order(order)
        new_config.mlr_patch["calibration_tokens"] = int(calibration_ids.numel())
    return new_config


def check_level_order_and_calibration(level_order, calibration_ids, config=None) -> None:
    """One-line ValueErrors for a ``level_order`` that is not one of ``LEVEL_ORDERS``, for "contribution" without
    ``calibration_ids``, for ``calibration_ids`` given with another order (they would be ignored) and, with the
    model's ``config``, for ids outside its vocabulary or windows longer than its positions."""
    check_level_order(level_order)
    if level_order == "contribution":
        if calibration_ids is None:
            raise ValueError("level_order='contribution' ranks the RoPE pairs by their q/k norms on calibration text: "
                             "pass calibration_ids (token ids, (tokens,) or (windows, tokens)), or choose "
                             "level_order='frequency'")
        from .qk_contribution import check_calibration_ids, max_positions

        check_calibration_ids(calibration_ids, getattr(config, "vocab_size", None),
                              None if config is None else max_positions(config))
    elif calibration_ids is not None:
        raise ValueError(f"calibration_ids is used by level_order='contribution' only; level_order={level_order!r} "
                         f"would ignore it")


def weightless_check_fields(fields: dict) -> dict:
    """``patch`` keywords for a check on a model without weights (the meta device: ``hf-structattn patch`` and the
    recipe check their arguments before loading any weight): ``level_order`` and, when given, ``calibration_ids``
    are checked here, and "contribution", which needs the weights, is replaced by "frequency" (the same pairs in
    another order: every other check is the same). Whether "contribution" has calibration text is the caller's to
    check (the CLI asks for ``--calibration-text``, the recipe takes training windows)."""
    fields = dict(fields)
    level_order = check_level_order(fields.get("level_order", DEFAULT_LEVEL_ORDER))
    calibration_ids = fields.pop("calibration_ids", None)
    if calibration_ids is not None:
        check_level_order_and_calibration(level_order, calibration_ids)
    if level_order == "contribution":
        fields["level_order"] = "frequency"
    return fields


def _replace_sliding_layers(config, windowed: list) -> None:
    """Make the replaced layers full-attention layers of the architecture (the model is then built from this
    config, so its modules and everything the architecture ties to the layer type follow, e.g. Gemma-3's global
    RoPE base)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        config.layer_types = ["full_attention" if i in windowed else kind for i, kind in enumerate(layer_types)]
    else:
        config.sliding_window = None


def register_local(model_class) -> None:
    """Make ``Auto*.from_pretrained`` find an MLR class (and its base model, for ``AutoModel``) in this process
    without trust_remote_code."""
    config_class = model_class.config_class
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
    base_name = base_model_name(getattr(transformers, model_class._mlr_base))
    if base_name is not None:
        AutoModel.register(config_class, mlr_model_class(getattr(transformers, base_name)), exist_ok=True)


@torch.no_grad()
def drift_report(original, patched, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> dict:
    """How far the patched decoder's next-token logits moved before fine-tuning: ``logit_max_abs``, ``logit_rel``
    (||dz|| / ||z||), ``top1_agreement`` and the loss of both models on ``input_ids`` (B, T)."""
    kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
    reference = original(input_ids, labels=input_ids, **kwargs)
    moved = patched(input_ids, labels=input_ids, **kwargs)
    diff = moved.logits.float() - reference.logits.float()
    return {"logit_max_abs": float(diff.abs().max()),
            "logit_rel": float(diff.norm() / reference.logits.float().norm().clamp_min(1e-30)),
            "top1_agreement": float((moved.logits.argmax(-1) == reference.logits.argmax(-1)).float().mean()),
            "loss_original": float(reference.loss), "loss_patched": float(moved.loss)}


def _tiny_common(vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


TINY_DECODERS = {
    # head dim 16 everywhere; GQA where the architecture has it; random init (tests, benchmarks, recipes)
    "llama": lambda v: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_tiny_common(v), num_key_value_heads=2)),
    "qwen2": lambda v: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_tiny_common(v), num_key_value_heads=2)),
    "qwen3": lambda v: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**_tiny_common(v), num_key_value_heads=2, head_dim=16)),
    "mistral": lambda v: transformers.MistralForCausalLM(
        transformers.MistralConfig(**_tiny_common(v), num_key_value_heads=2, sliding_window=None)),
    "gemma": lambda v: transformers.GemmaForCausalLM(
        transformers.GemmaConfig(**_tiny_common(v), num_key_value_heads=1, head_dim=16)),
    "gemma3": lambda v: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**_tiny_common(v), "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "phi3": lambda v: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**_tiny_common(v), num_key_value_heads=2, partial_rotary_factor=0.5)),
    "gpt2": lambda v: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=v, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, scale_attn_by_inverse_layer_idx=True)),
    "neox": lambda v: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **_tiny_common(v), rotary_pct=0.25)),
}


def tiny_decoder(arch: str, seed: int = 0, vocab_size: int = 61, dtype: torch.dtype = torch.float64):
    """A tiny random decoder of one of ``TINY_DECODERS`` (head dim 16), in eval mode, with every weight nudged by
    N(0, 0.05) so that symmetric inits (zero biases, unit norms) cannot hide head or level mix-ups."""
    if arch not in TINY_DECODERS:
        raise ValueError(f"arch={arch!r} is not one of {sorted(TINY_DECODERS)}")
    torch.manual_seed(seed)
    model = TINY_DECODERS[arch](vocab_size).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


__all__ = ["DEFAULT_LEVEL_ORDER", "LEVEL_ORDERS", "TINY_DECODERS", "check_level_order",
           "check_level_order_and_calibration", "drift_report", "find_rotary", "is_decoder_architecture",
           "is_patchable_decoder", "patch_decoder", "register_local", "sliding_layers", "tiny_decoder",
           "weightless_check_fields"]
