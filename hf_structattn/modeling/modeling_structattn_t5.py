"""T5-style encoder-decoder models whose encoder self-, decoder self- and cross-attention are each dense, MLR,
bilinear MLR or bilinear BTT.

The models are transformers' own T5 classes (``__init__``, stacks, blocks, forwards, masks, relative position bias
computed in block 0 and shared, T5 initialisation). ``post_init`` installs the configured attention per role:

* MLR: ``install_mlr_attention`` on the stock ``T5Attention`` (its parameters, cache branches and relative bias stay
  transformers'; T5 hands the bias to the attention function, which adds it in every level);
* bilinear MLR / BTT: ``StructAttnT5BilinearAttention``, a ``T5Attention`` whose query/key come from the structured
  projections (new parameters) and which adopts the ``v``, ``o`` and ``relative_attention_bias`` modules it replaces.

State-dict names therefore stay those of ``transformers.T5*`` (``encoder.block.{i}.layer.0.SelfAttention.q`` ...),
so a T5 checkpoint loads unchanged into a dense or MLR model. The same installation is what ``hf_structattn.patch``
applies to Chronos-T5 and Chronos-Bolt models.
"""

from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticLayer
from transformers.models.t5.modeling_t5 import (
    T5Attention,
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5Model,
    T5PreTrainedModel,
)

from .configuration_structattn_t5 import StructAttnT5Config
from .structattn_attention import install_mlr_attention, mlr_geometry_of
from .structattn_step import STEP_KEY
from .structattn_prepare import forward_with_step, prepare_step, self_attention_cache
from .structattn_masks import check_mask_shape, keep_mask, mask_value, softmax_dtype
from .structattn_ops import fused_attention
from .structattn_pretrained import StructAttnPreTrainedMixin
from .structattn_qk import StructuredQueryKey, init_structured_query_key
from .structattn_token_ids import naming_out_of_vocabulary_ids

T5_AUTO_MAP = {
    "AutoConfig": "configuration_structattn_t5.StructAttnT5Config",
    "AutoModel": "modeling_structattn_t5.StructAttnT5Model",
    "AutoModelForSeq2SeqLM": "modeling_structattn_t5.StructAttnT5ForConditionalGeneration",
    "AutoModelForTextEncoding": "modeling_structattn_t5.StructAttnT5EncoderModel",
}
BILINEAR_VARIANTS = ("bilinear_mlr", "bilinear_btt")


class _ReplacedProjection(nn.Module):
    """Stands where ``T5Attention`` keeps ``q`` / ``k`` when a bilinear role's structured projections replace them:
    no parameters, and a ``weight`` that T5's init formula for ``T5Attention`` finds already initialised."""

    def __init__(self):
        super().__init__()
        self.weight = torch.empty(0)
        self.weight._is_hf_initialized = True

    def forward(self, hidden_states):
        raise RuntimeError("a bilinear attention role has no dense q/k projection")


class StructAttnT5BilinearAttention(StructuredQueryKey, T5Attention):
    """A ``T5Attention`` whose queries and keys come from a bilinear MLR / BTT projection (same forward signature
    and 3-tuple result). Built from the ``T5Attention`` it replaces: it adopts ``v``, ``o`` and
    ``relative_attention_bias`` as the same module objects (names and values unchanged) and their initialisation
    state; only the structured q/k projections are new. ``spec``: ``StructAttnT5Config.attention_spec(role)``."""

    def __init__(self, source: T5Attention, spec: dict):
        with torch.device("meta"):  # T5's own q, k, v, o are replaced below: build them without memory or RNG draws
            T5Attention.__init__(self, source.config, has_relative_attention_bias=source.has_relative_attention_bias,
                                 layer_idx=source.layer_idx, is_causal=source.is_causal)
        self.spec = dict(spec)
        self.variant = spec["attention"]
        if self.variant not in BILINEAR_VARIANTS:
            raise ValueError(f"StructAttnT5BilinearAttention handles {BILINEAR_VARIANTS}, got {self.variant!r}")
        self.q, self.k = _ReplacedProjection(), _ReplacedProjection()
        self.v, self.o = source.v, source.o
        if self.has_relative_attention_bias:
            self.relative_attention_bias = source.relative_attention_bias
        self.build_query_key(self.variant, self.d_model, self.n_heads, self.key_value_proj_dim,
                             bilinear_mlr_ranks=spec.get("ranks"), btt_factors=spec.get("factors"),
                             btt_rank=spec.get("rank", 1), bilinear_scaling=spec.get("scaling", "standard"))

    def extra_repr(self) -> str:
        return f"variant={self.variant}, layer_idx={self.layer_idx}, causal={self.is_causal}"

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H*d) -> (B, H, T, d)."""
        return x.view(*x.shape[:-1], self.n_heads, -1).transpose(1, 2)

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
        """``T5Attention.forward`` with structured queries/keys: hidden_states (B, Q, D); key_value_states (B, K, D)
        for cross-attention; mask: T5's 4-D mask or None; position_bias (1, H, Q, K) from block 0 (computed here
        when None). Returns (output (B, Q, D), position_bias, probabilities (eager implementation) or None)."""
        batch, length, _ = hidden_states.shape
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        past = past.clone() if isinstance(past, torch.Tensor) else past
        is_cross = key_value_states is not None
        is_updated = False
        current_cache = cache
        if isinstance(cache, EncoderDecoderCache):
            is_updated = bool(cache.is_updated.get(self.layer_idx))
            current_cache = cache.cross_attention_cache if is_cross else cache.self_attention_cache
        query = self.queries(hidden_states)
        if is_cross and cache is not None and is_updated:
            key = current_cache.layers[self.layer_idx].keys
            value = current_cache.layers[self.layer_idx].values
        else:
            states = key_value_states if is_cross else hidden_states
            key, value = self.keys(states), self._heads(self.v(states))
            if cache is not None:
                key, value = current_cache.update(key, value, self.layer_idx, kwargs=kwargs)
                if is_cross and isinstance(cache, EncoderDecoderCache):
                    cache.is_updated[self.layer_idx] = True
        key_length = key.shape[-2]
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(length, key_length, device=query.device, past_seen_tokens=past)
            else:
                position_bias = torch.zeros(1, self.n_heads, length, key_length, device=query.device,
                                            dtype=query.dtype)
        work = softmax_dtype(query.dtype)
        additive = position_bias.to(work)
        if mask is not None:
            if mask.dtype == torch.bool:
                additive = additive.masked_fill(~mask, mask_value(work))
            else:
                additive = (additive + mask.to(work)).clamp(min=mask_value(work))
        elif self.is_causal and not is_cross:
            future = torch.ones(length, key_length, dtype=torch.bool, device=query.device).triu_(
                1 + key_length - length)
            additive = additive.masked_fill(future, mask_value(work))
        dropout = self.dropout if self.training else 0.0
        if self.config._attn_implementation == "eager":
            probabilities = torch.softmax((query @ key.transpose(-1, -2)).to(work) + additive, dim=-1)
            probabilities = nn.functional.dropout(probabilities, p=dropout, training=self.training)
            output = probabilities.to(value.dtype) @ value
            probabilities = probabilities.to(query.dtype)
        else:
            output = fused_attention(query, key, value, scale=1.0, causal=False, bias=additive.to(query.dtype),
                                     dropout=dropout)
            probabilities = None
        output = output.transpose(1, 2).reshape(batch, length, self.inner_dim)
        return self.o(output), position_bias, probabilities


def _role_attentions(stack: nn.Module):
    """(role, parent module, attribute name) of every attention module of a T5 stack."""
    decoder = stack.config.is_decoder
    for block in stack.block:
        yield ("decoder_self" if decoder else "encoder_self"), block.layer[0], "SelfAttention"
        if len(block.layer) == 3:
            yield "cross", block.layer[1], "EncDecAttention"


def install_t5_structured_attention(model: nn.Module, config) -> int:
    """Install the configured attention of every role in the T5 stacks of ``model`` (a T5 model, a Chronos-Bolt
    model or a stack) in place. Returns the number of attention modules changed. Parameters are adopted, never
    copied."""
    stacks = [model] if hasattr(model, "block") else [getattr(model, name) for name in ("encoder", "decoder")
                                                      if hasattr(model, name)]
    changed = 0
    for stack in stacks:
        for role, parent, name in _role_attentions(stack):
            variant = config.role_attention(role)
            module = getattr(parent, name)
            if variant == "dense":
                continue
            installed = mlr_geometry_of(module)
            if variant == "mlr" and installed == config.mlr_geometry() or isinstance(
                    module, StructAttnT5BilinearAttention) and module.spec == config.attention_spec(role):
                continue  # already this attention (``post_init`` runs again, e.g. after resizing embeddings)
            if installed is not None or isinstance(module, StructAttnT5BilinearAttention):
                raise ValueError(f"{name} of layer {module.layer_idx} already has another structured attention; "
                                 f"patch the original model")
            if variant == "mlr":
                install_mlr_attention(module, config.mlr_geometry())
            else:
                replacement = StructAttnT5BilinearAttention(module, config.attention_spec(role))
                if getattr(module, "_is_hf_initialized", False):  # the adopted modules are initialised (or loaded)
                    replacement._is_hf_initialized = True
                setattr(parent, name, replacement)
            changed += 1
    return changed


def _check_inputs(kwargs: dict, heads: int, cross_attention: bool) -> None:
    """One-line errors for inputs T5 would misread: empty sequences, encoder masks of a shape outside the mask rule
    (``check_mask_shape``; with a decoder only a 2-D one, which T5 applies to the cross-attention too) and 2-D
    encoder masks holding values other than 0 and 1 (additive masks read as keep-masks would be silently inverted).
    Keep-masks may be bool, integer or 0/1 float. The decoder's mask is checked by the step plan."""
    for tokens_name, embeds_name in (("input_ids", "inputs_embeds"), ("decoder_input_ids", "decoder_inputs_embeds")):
        tokens = kwargs.get(tokens_name)
        tokens = kwargs.get(embeds_name) if tokens is None else tokens
        if tokens is not None and (tokens.dim() < 2 or tokens.shape[1] == 0):
            raise ValueError(f"{tokens_name}: the input has sequence length 0 or no batch axis (shape "
                             f"{tuple(tokens.shape)}): pass at least one token as (B, T)")
    tokens = kwargs.get("input_ids")
    tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
    mask = kwargs.get("attention_mask")
    if tokens is not None and isinstance(mask, torch.Tensor):
        if cross_attention and mask.dim() == 4:
            raise ValueError(f"attention_mask of a T5 encoder-decoder must be the encoder's ({tokens.shape[0]}, "
                             f"{tokens.shape[1]}) keep-mask (T5 applies it to the cross-attention too), got "
                             f"{tuple(mask.shape)}; pass 4-D masks to the decoder as decoder_attention_mask")
        check_mask_shape(mask, tokens.shape[0], heads, tokens.shape[1], past=0)
        if mask.dim() == 2 and not torch.compiler.is_compiling():
            keep_mask(mask, tokens.shape[0], tokens.shape[1], name="attention_mask")


def _prepare(self, kwargs: dict) -> dict:
    """The keyword arguments of a T5 forward: the decoder cache built the way T5Stack builds it when caching and none
    is given, and the decoder's step plan (``structattn_prepare.prepare_step``: its tokens' padding, positions
    counting each row's real tokens) under ``STEP_KEY``, with the relative bias of its MLR self-attention over every
    token index (T5 sizes the bias by the key length ``cache.update`` returns, which an MLR layer keeps to the
    chunk)."""
    _check_inputs(kwargs, self.config.num_heads, hasattr(self, "decoder"))
    if not hasattr(self, "decoder"):
        return kwargs
    cache = kwargs.get("cache")
    use_cache = kwargs.get("use_cache")
    use_cache = self.config.use_cache if use_cache is None else use_cache
    if cache is None and use_cache:
        decoder_config = self.decoder.config
        cache = kwargs["cache"] = EncoderDecoderCache(DynamicCache(config=decoder_config),
                                                      DynamicCache(config=decoder_config))
    labels = kwargs.get("labels")
    if labels is not None and kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None:
        kwargs["decoder_input_ids"] = self._shift_right(labels)  # what T5 does, here before the plan needs them
    tokens = kwargs.get("decoder_input_ids")
    tokens = kwargs.get("decoder_inputs_embeds") if tokens is None else tokens
    if tokens is None:
        return kwargs
    batch, length = tokens.shape[:2]
    mask = kwargs.get("decoder_attention_mask")
    attention = self.decoder.block[0].layer[0].SelfAttention
    relative_bias = None
    if attention.has_relative_attention_bias:
        def relative_bias(past):
            """The decoder self-attention's relative bias over every token index (1, H, c, K) for ``past`` cached
            tokens (a static cache: K spans its slots)."""
            layer = self_attention_cache(cache).layers[0]
            keys = layer.max_cache_len if isinstance(layer, StaticLayer) else past + length
            return attention.compute_bias(length, keys, device=tokens.device, past_seen_tokens=past)
    step = prepare_step(self, cache=cache, batch=batch, length=length, device=tokens.device, attention_mask=mask,
                        count_positions=True, heads=self.config.num_heads, relative_bias=relative_bias)
    kwargs[STEP_KEY] = step
    return kwargs


class StructAttnT5PreTrainedModel(StructAttnPreTrainedMixin, T5PreTrainedModel):
    """Base of the T5 family: transformers' T5 classes built by their own ``__init__``; ``post_init`` installs the
    configured attention before weight init, so that init (skipped for loaded weights) reaches new modules once."""

    config: StructAttnT5Config
    config_class = StructAttnT5Config
    _supports_flex_attn = False
    _can_compile_fullgraph = True
    structattn_auto_map = T5_AUTO_MAP

    def post_init(self):
        install_t5_structured_attention(self, self.config)
        super().post_init()

    def structattn_num_cache_layers(self) -> Optional[int]:
        return self.config.num_decoder_layers

    def structattn_cache_config(self):
        return self.decoder.config

    def _init_weights(self, module):
        super()._init_weights(module)  # T5's init: layer norms, feed-forward, embeddings, T5Attention (v, o, bias)
        factor = self.config.initializer_factor
        if module is self:
            # the structured q/k projections sit inside transformers' T5 stacks, which initialise their modules with
            # T5's own _init_weights: the outermost model initialises them (N(0, factor^2 / fan_in); loaded tensors
            # are left alone by transformers.initialization)
            for submodule in self.modules():
                init_structured_query_key(submodule, factor)


class StructAttnT5Model(StructAttnT5PreTrainedModel, T5Model):
    """``transformers.T5Model`` with structured attention (same ``__init__``, forward, outputs and parameter names)."""

    forward = naming_out_of_vocabulary_ids(forward_with_step(T5Model, _prepare))


class StructAttnT5ForConditionalGeneration(StructAttnT5PreTrainedModel, T5ForConditionalGeneration):
    """``transformers.T5ForConditionalGeneration`` with structured attention; a cache built the transformers way
    (``EncoderDecoderCache(DynamicCache(config=...), ...)``, what ``generate`` and the decoder build) holds the
    hierarchical key cache in its MLR decoder self-attention layers."""

    forward = naming_out_of_vocabulary_ids(forward_with_step(T5ForConditionalGeneration, _prepare))
    generate = naming_out_of_vocabulary_ids(T5ForConditionalGeneration.generate)  # it runs the encoder itself


class StructAttnT5EncoderModel(StructAttnT5PreTrainedModel, T5EncoderModel):
    """``transformers.T5EncoderModel`` with structured encoder self-attention."""

    forward = naming_out_of_vocabulary_ids(forward_with_step(T5EncoderModel, _prepare))


StructAttnT5Config.register_for_auto_class()
StructAttnT5Model.register_for_auto_class("AutoModel")
StructAttnT5ForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
StructAttnT5EncoderModel.register_for_auto_class("AutoModelForTextEncoding")

__all__ = [
    "StructAttnT5BilinearAttention",
    "StructAttnT5PreTrainedModel",
    "StructAttnT5Model",
    "StructAttnT5ForConditionalGeneration",
    "StructAttnT5EncoderModel",
    "install_t5_structured_attention",
]
