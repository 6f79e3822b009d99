"""MLR<Arch>: transformers decoders (Llama, Qwen2/3, Mistral, Gemma/Gemma-3, Phi-3, GPT-2, GPT-NeoX, ...) whose
attention is MLR in the layers their config names. Part of the checkpoint payload.

``MLR<Arch>Config`` is the architecture's config with its own ``model_type`` (``mlr_<type>``) and flat MLR fields:

* ``mlr_ranks`` (r_1..r_L, sum = head dim) and ``mlr_block_sizes`` (b_2..b_L, nested);
* ``mlr_layers``: indices of the MLR layers (None: every layer); the others run the model's attention unchanged.
  (The architecture's own ``layer_types`` keeps its meaning: Qwen2 and Gemma-3 key masks and RoPE by it.)
* ``mlr_dim_order``: the head-dim order in which level slices are taken (None: identity), by a level-order rule
  (``structattn_decoder_spec.LEVEL_ORDERS``; ``mlr_patch["level_order"]`` records which): for RoPE models every level
  holds complete rotation pairs (by default the unrotated dims, then the pairs from the lowest frequency up), so every
  level's score depends on relative position only; applied to q and k at run time (weights are never re-based: a
  rotation of W_Q/W_K does not commute with RoPE). A stock model run with ``attn_implementation="mlr"`` finds it on
  first use by ``config.mlr_level_order`` (default ``DEFAULT_LEVEL_ORDER``);
* ``mlr_level_scales``: per-level logit multipliers (None: the module's own ``scaling`` on every level, so
  ``mlr_ranks=[head_dim]`` is the stock model);
* ``mlr_level_rule``: which levels a pair shares (``structattn_mlr_levels``): "blocks" (the paper's; absent means
  this) or "nearest" (level l for keys fewer than b_l positions away: the rule for pretrained weights patched
  without training).

``MLR<Arch>ForCausalLM`` is the transformers class with MLR installed the way every family installs it
(``structattn_attention.install_mlr_attention`` on the attention module of each MLR layer, in ``post_init``) and a
``forward`` that hands the MLR cache layers and attention calls what they need (the step plan, ``MLRStep``). Both classes
are built on first use by the module ``__getattr__`` from the transformers class of the same name (this is how
``trust_remote_code`` finds the names in ``config.auto_map``), so one payload file serves every architecture and
importing it builds nothing.
"""

import os
from typing import Optional

import torch
import transformers
from transformers.cache_utils import DynamicCache

from .structattn_decoder_spec import (  # noqa: F401  (the decoder spec, re-exported for the patcher and flops)
    DEFAULT_LEVEL_ORDER,
    LEVEL_ORDERS,
    attention_modules,
    check_level_order,
    check_levels_hold_whole_pairs,
    decoder_geometries,
    decoder_geometry,
    level_dim_order,
    mlr_layer_indices,
    model_rotary,
    rotary_dims,
    rotary_pair_order,
    stock_layer_geometry,
    stored_dim_order,
)
from .structattn_config_rules import announce_config, one_line_field_errors
from .structattn_inputs import check_positions

MODEL_TYPE_PREFIX = "mlr_"
CLASS_PREFIX = "MLR"
MLR_FIELDS = ("mlr_ranks", "mlr_block_sizes", "mlr_layers", "mlr_dim_order", "mlr_level_scales", "mlr_level_rule")

_CLASSES = {}


# ------------------------------------------------------------------------------------------- MLR<Arch> classes


def _install(model) -> None:
    """Install MLR attention in the MLR layers of a freshly built ``MLR<Arch>`` model."""
    config = model.config.get_text_config(decoder=True)
    modules = attention_modules(model)
    geometries = decoder_geometries(config, modules)
    missing = sorted(set(geometries) - set(modules))
    if missing:
        raise ValueError(f"{type(model).__name__}: layers {missing} have no attention module that dispatches through "
                         f"transformers' attention interface, so MLR cannot be installed there")
    from .structattn_attention import install_mlr_attention  # the modeling half is imported on first use only

    for index, geometry in geometries.items():
        install_mlr_attention(modules[index], geometry)


def _post_init(self):
    _install(self)
    from .structattn_pretrained import StructAttnPreTrainedMixin

    # called on the mixin explicitly, not through super(<own class>): transformers may subclass a remote class
    # (add_generation_mixin_to_remote_model), and a lookup of "our" class in the MRO would then find that subclass
    return StructAttnPreTrainedMixin.post_init(self)


def _num_cache_layers(self) -> int:
    return self.config.get_text_config(decoder=True).num_hidden_layers


def _check_inputs(kwargs: dict, tokens: torch.Tensor) -> None:
    """One-line errors naming the argument for inputs the attention would misread or fail on with a raw error:
    empty inputs (no token, or a batch of 0), token ids that are not integers, ``position_ids`` of the wrong shape
    or dtype, an attention mask that is not a tensor. The mask's shape (``check_mask_shape``) and values (a 2-D mask
    holding values other than 0 and 1, its length against the cache's) are checked by the step plan."""
    name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    if name == "input_ids" and (tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool):
        raise ValueError(f"input_ids must be an integer tensor of shape (batch, length), got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    if name == "inputs_embeds" and tokens.dim() != 3:
        raise ValueError(f"inputs_embeds must have shape (batch, length, hidden), got {tuple(tokens.shape)}")
    batch, length = tokens.shape[:2]
    if batch == 0 or length == 0:
        raise ValueError(f"{name} of shape {tuple(tokens.shape)} is empty (batch {batch}, length {length}): pass at "
                         f"least one token in at least one row")
    positions = kwargs.get("position_ids")
    well_formed = isinstance(positions, torch.Tensor) and positions.shape[-1:] == (length,) and (
        positions.dim() == 3 or (positions.dim() == 2 and positions.shape[0] in (1, batch)) or positions.dim() == 1) \
        and not (positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool)
    if positions is not None and not well_formed:
        # (3, B, T) multimodal positions are refused by the attention with their own message
        check_positions(positions, batch, length, name="position_ids")
    mask = kwargs.get("attention_mask")
    if mask is None or isinstance(mask, dict):
        return
    if not isinstance(mask, torch.Tensor):  # its shape: ``check_mask_shape``, in the step plan
        raise ValueError(f"attention_mask must be a tensor, got {type(mask).__name__}")


def _prepare(self, kwargs: dict) -> dict:
    """The keyword arguments of an ``MLR<Arch>`` forward: a ``DynamicCache(config=...)`` when caching and none is
    given, and the step plan (``structattn_prepare.prepare_step``) under ``STEP_KEY``."""
    from .structattn_prepare import STEP_KEY, prepare_step  # the modeling half is imported on first use only

    tokens = kwargs.get("input_ids")
    tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
    config = self.config.get_text_config(decoder=True)
    cache = kwargs.get("cache")
    use_cache = kwargs.get("use_cache")
    use_cache = config.use_cache if use_cache is None else use_cache
    if cache is None and use_cache and tokens is not None:
        cache = kwargs["cache"] = DynamicCache(config=config)
    if tokens is None:
        return kwargs
    if not torch.compiler.is_compiling():
        _check_inputs(kwargs, tokens)
    batch, length = tokens.shape[:2]
    mask = kwargs.get("attention_mask")
    step = prepare_step(self, cache=cache, batch=batch, length=length, device=tokens.device,
                        position_ids=kwargs.get("position_ids"), attention_mask=mask,
                        heads=config.num_attention_heads)
    kwargs[STEP_KEY] = step
    return kwargs


def _forward_with_step(base):
    from .structattn_prepare import forward_with_step

    return forward_with_step(base, _prepare)


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
    return transformers.PreTrainedModel.save_pretrained(self, save_directory, *args, **kwargs)


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
        def __post_init__(self, **kwargs):
            base.__post_init__(self, **kwargs)
            announce_config(self)

        cls = one_line_field_errors(type(name, (base,), {"model_type": MODEL_TYPE_PREFIX + base.model_type,
                                                         "__module__": __name__, "__post_init__": __post_init__}))
        cls.register_for_auto_class()
        _CLASSES[name] = cls
    return _CLASSES[name]


def _is_causal_lm(base) -> bool:
    return base.__name__.endswith("ForCausalLM") or base.__name__.endswith("LMHeadModel")


def base_model_name(base) -> Optional[str]:
    """The name of the transformers base model (``LlamaModel``, ``GPT2Model``, ``Gemma3TextModel``) of a causal-LM
    class, from transformers' ``AutoModel`` name table; None when it has none."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(base.config_class.model_type)
    name = name[0] if isinstance(name, (tuple, list)) else name
    return name if isinstance(name, str) and isinstance(getattr(transformers, name, None), type) else None


def auto_map_of(base) -> dict:
    """The ``auto_map`` a saved ``MLR<Arch>`` checkpoint carries: its config, its causal-LM class and its base model
    (``AutoModel``), whichever of the two was saved."""
    causal = base if _is_causal_lm(base) else None
    if causal is None:  # a base model: its causal-LM class is the one whose base model it is
        causal = next((cls for name, cls in vars(transformers).items() if isinstance(cls, type) and
                       issubclass(cls, transformers.PreTrainedModel) and _is_causal_lm(cls) and
                       cls.config_class is base.config_class and base_model_name(cls) == base.__name__), None)
    module = __name__.rpartition(".")[2]
    auto_map = {"AutoConfig": f"{module}.{CLASS_PREFIX}{base.config_class.__name__}"}
    base_name = base.__name__ if causal is not base else base_model_name(base)
    if base_name is not None:
        auto_map["AutoModel"] = f"{module}.{CLASS_PREFIX}{base_name}"
    if causal is not None:
        auto_map["AutoModelForCausalLM"] = f"{module}.{CLASS_PREFIX}{causal.__name__}"
    return auto_map


def mlr_model_class(base, auto_class: Optional[str] = None):
    """``MLR<Base>`` model class: the transformers class with MLR attention installed (see the module docstring).
    ``base`` is a causal-LM class (registered for ``AutoModelForCausalLM``) or a base model (``AutoModel``)."""
    name = CLASS_PREFIX + base.__name__
    if name not in _CLASSES:
        from .structattn_pretrained import StructAttnPreTrainedMixin  # the modeling half, on first use

        namespace = {
            "__module__": __name__,
            "config_class": mlr_config_class(base.config_class),
            "post_init": _post_init,
            "forward": _forward_with_step(base),
            "save_pretrained": _save_pretrained,
            "structattn_num_cache_layers": _num_cache_layers,
            "structattn_auto_map": auto_map_of(base),
            "_mlr_base": base.__name__,
        }
        cls = type(name, (StructAttnPreTrainedMixin, base), namespace)
        cls.register_for_auto_class(auto_class or ("AutoModelForCausalLM" if _is_causal_lm(base) else "AutoModel"))
        _CLASSES[name] = cls
    return _CLASSES[name]


def __getattr__(name: str):
    """``MLRLlamaForCausalLM``, ``MLRLlamaConfig``, ...: built from the transformers class of the same name."""
    if name.startswith(CLASS_PREFIX) and not name.startswith("__"):
        base = getattr(transformers, name[len(CLASS_PREFIX):], None)
        if isinstance(base, type) and issubclass(base, transformers.PreTrainedConfig):
            return mlr_config_class(base)
        if isinstance(base, type) and issubclass(base, transformers.PreTrainedModel):
            return mlr_model_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CLASS_PREFIX", "DEFAULT_LEVEL_ORDER", "LEVEL_ORDERS", "MODEL_TYPE_PREFIX", "attention_modules",
           "auto_map_of", "base_model_name", "check_level_order", "check_levels_hold_whole_pairs", "decoder_geometry",
           "decoder_geometries", "level_dim_order", "mlr_config_class", "mlr_layer_indices", "mlr_model_class",
           "model_rotary", "rotary_dims", "rotary_pair_order", "stock_layer_geometry", "stored_dim_order"]
