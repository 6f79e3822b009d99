"""T5-style encoder-decoder models whose encoder self-, decoder self- and cross-attention are each dense, MLR,
bilinear MLR or bilinear BTT.

The models are built by transformers' own T5 ``__init__`` and reuse its blocks, stacks and forwards (relative
position bias computed in block 0 and shared, no 1/sqrt(d) scaling, T5 initialisation, gated / non-gated
feed-forward); ``post_init`` then replaces the attention modules of non-dense roles by ``StructAttnT5Attention``,
which adopts T5's ``q, k, v, o`` and ``relative_attention_bias`` submodules. State-dict names therefore stay those of ``transformers.T5*``
(``encoder.block.{i}.layer.0.SelfAttention.q`` ...), so a T5 checkpoint loads unchanged into a dense or MLR model.
The same module is what ``hf_structattn.patch`` installs into a Chronos-Bolt model in place.
"""

from typing import Optional

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.models.t5.modeling_t5 import (
    T5Attention,
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5Model,
    T5PreTrainedModel,
    T5Stack,
)
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from .configuration_structattn_t5 import StructAttnT5Config
from .structattn_cache import StructAttnCache, cached_mlr_attention
from .structattn_geometry import keep_mask, mask_value
from .structattn_mlr import mlr_attention
from .structattn_ops import fused_attention
from .structattn_pretrained import StructAttnPreTrainedMixin
from .structattn_qk import StructuredQueryKey, init_structured_query_key
from .structattn_reference import allowed_pairs, masked_softmax, mlr_scores_reference

T5_AUTO_MAP = {
    "AutoConfig": "configuration_structattn_t5.StructAttnT5Config",
    "AutoModel": "modeling_structattn_t5.StructAttnT5Model",
    "AutoModelForSeq2SeqLM": "modeling_structattn_t5.StructAttnT5ForConditionalGeneration",
    "AutoModelForTextEncoding": "modeling_structattn_t5.StructAttnT5EncoderModel",
}


def key_validity_from_mask(mask: Optional[torch.Tensor], batch: int, key_length: int) -> Optional[torch.Tensor]:
    """Padding flags of the keys, (B, K) bool (True = real token), from T5's 4-D mask, or None (no padding).

    mask: (B, 1, Q, K), boolean (True = attend) or additive float (0 = attend). Its last query row allows every
    real key: in the bidirectional encoder mask every row does, and in the causal decoder mask the last query is
    the newest position, which sees every real earlier key.
    """
    if mask is None:
        return None
    row = mask[:, 0, -1, :]
    valid = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    return valid.expand(batch, key_length)


class StructAttnT5Attention(StructuredQueryKey):
    """Drop-in replacement of one ``T5Attention`` (same forward signature and 3-tuple result).

    Built from the T5Attention it replaces: it adopts ``v``, ``o`` and ``relative_attention_bias`` (and ``q``,
    ``k`` for MLR) as the same module objects, so the parameter names and values do not change, and its
    initialisation state (transformers' ``_is_hf_initialized``): weight init then initialises only the new
    bilinear q/k projections (``StructuredQueryKey``). ``spec`` is a plain dict from
    ``StructAttnT5Config.attention_spec(role)``.
    """

    compute_bias = T5Attention.compute_bias
    _relative_position_bucket = staticmethod(T5Attention._relative_position_bucket)

    def __init__(self, source: nn.Module, spec: dict):
        super().__init__()
        self.config = source.config
        self.spec = dict(spec)
        self.variant = spec["attention"]
        if self.variant not in ("mlr", "bilinear_mlr", "bilinear_btt"):
            raise ValueError(f"StructAttnT5Attention handles 'mlr', 'bilinear_mlr' and 'bilinear_btt', got "
                             f"{self.variant!r} (dense roles keep transformers' T5Attention)")
        for name in ("is_decoder", "is_causal", "has_relative_attention_bias", "relative_attention_num_buckets",
                     "relative_attention_max_distance", "d_model", "key_value_proj_dim", "n_heads", "dropout",
                     "inner_dim", "layer_idx"):
            setattr(self, name, getattr(source, name))
        self.scaling = 1.0  # T5: no 1/sqrt(d); the scale lives in the init and the relative bias
        self.gradient_checkpointing = False
        if self.variant == "mlr":  # registered first so the state-dict order is T5's (q, k, v, o, bias)
            self.q, self.k = source.q, source.k
        self.v, self.o = source.v, source.o
        if self.has_relative_attention_bias:
            self.relative_attention_bias = source.relative_attention_bias
        if self.variant == "mlr":
            self.ranks, self.block_sizes = list(spec["ranks"]), list(spec["block_sizes"])
            self.level_scales = list(spec["level_scales"])
            if sum(self.ranks) != self.key_value_proj_dim:
                raise ValueError(f"mlr_ranks={self.ranks} sums to {sum(self.ranks)}, but d_kv is "
                                 f"{self.key_value_proj_dim}")
        self.build_query_key(self.variant, self.d_model, self.n_heads, self.key_value_proj_dim,
                             bilinear_mlr_ranks=spec["ranks"] if self.variant == "bilinear_mlr" else None,
                             btt_factors=spec.get("factors"), btt_rank=spec.get("rank", 1),
                             bilinear_scaling=spec.get("scaling", "standard"))
        if getattr(source, "_is_hf_initialized", False):  # the adopted modules are initialised (or loaded)
            self._is_hf_initialized = True

    def extra_repr(self) -> str:
        return f"variant={self.variant}, layer_idx={self.layer_idx}, causal={self.is_causal}"

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H*d) -> (B, H, T, d)."""
        return x.view(*x.shape[:-1], self.n_heads, -1).transpose(1, 2)

    def _query_key(self, hidden_states: torch.Tensor, key_states: Optional[torch.Tensor]):
        """Queries (B, H, Q, E) and keys (B, H, K, E), or None for the keys when ``key_states`` is None (a
        cross-attention step whose keys are cached)."""
        mlr = self.variant == "mlr"  # MLR projects with T5's adopted q, k; the bilinear variants with their own
        query = self.queries(hidden_states, self._heads(self.q(hidden_states)) if mlr else None)
        if key_states is None:
            return query, None
        return query, self.keys(key_states, self._heads(self.k(key_states)) if mlr else None)

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None,
                output_attentions=False, **kwargs):
        """hidden_states (B, Q, D); key_value_states (B, K, D) for cross-attention; mask: T5's 4-D mask
        (B, 1, Q, K) or None; position_bias (1, H, Q, K) from block 0 (computed here when None);
        output_attentions: also return the probabilities (B, H, Q, K) from the materialised path (no cache).
        Returns (output (B, Q, D), position_bias, probabilities or None)."""
        batch, length, _ = hidden_states.shape
        is_cross = key_value_states is not None
        if output_attentions and cache is not None:
            raise ValueError("output_attentions=True materialises the attention of an uncached forward; pass "
                             "use_cache=False (e.g. generate(..., use_cache=False))")
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        is_updated = False
        if isinstance(cache, EncoderDecoderCache):
            is_updated = bool(cache.is_updated.get(self.layer_idx))
            current_cache = cache.cross_attention_cache if is_cross else cache.self_attention_cache
        else:
            current_cache = cache
        if is_cross and cache is not None and is_updated:
            query, _ = self._query_key(hidden_states, None)
            key = current_cache.layers[self.layer_idx].keys
            value = current_cache.layers[self.layer_idx].values
        else:
            states = key_value_states if is_cross else hidden_states
            query, key = self._query_key(hidden_states, states)
            value = self._heads(self.v(states))

        probabilities = None
        if self.variant == "mlr":  # the config refuses MLR cross-attention
            output, position_bias, probabilities = self._mlr(query, key, value, mask, position_bias, current_cache,
                                                             past, batch, length, output_attentions)
        else:
            if cache is not None and not (is_cross and is_updated):
                key, value = current_cache.update(key, value, self.layer_idx)
                if is_cross and isinstance(cache, EncoderDecoderCache):
                    cache.is_updated[self.layer_idx] = True
            key_length = key.shape[-2]
            if position_bias is None:
                position_bias = self._position_bias(length, key_length, past, query)
            fill = mask_value(query.dtype)
            additive = position_bias.to(query.dtype)
            if mask is not None:
                if mask.dtype == torch.bool:
                    additive = additive.masked_fill(~mask, fill)
                else:  # transformers' additive mask (0 / dtype min): clamp so that bias + mask stays finite
                    additive = (additive + mask.to(query.dtype)).clamp(min=fill)
            elif self.is_causal and not is_cross:
                # no explicit mask (SDPA-style "rely on is_causal"): causality by slot index, queries are the
                # newest ``length`` slots
                future = torch.ones(length, key_length, dtype=torch.bool, device=query.device).triu_(
                    1 + key_length - length)
                additive = additive.masked_fill(future, fill)
            if output_attentions:
                probabilities = masked_softmax(query @ key.transpose(-1, -2) + additive, None)
                output = nn.functional.dropout(probabilities, self.dropout, self.training).to(value.dtype) @ value
            else:
                dropout = self.dropout if self.training else 0.0
                output = fused_attention(query, key, value, scale=1.0, causal=False, bias=additive, dropout=dropout)
        output = output.transpose(1, 2).reshape(batch, length, self.inner_dim)
        return self.o(output), position_bias, probabilities

    def _position_bias(self, query_length, key_length, past, reference):
        """(1, H, Q, K): T5's learned relative bias in block 0, zeros elsewhere (as T5Attention does)."""
        if self.has_relative_attention_bias:
            return self.compute_bias(query_length, key_length, device=reference.device, past_seen_tokens=past)
        return torch.zeros(1, self.n_heads, query_length, key_length, device=reference.device, dtype=reference.dtype)

    def _mlr(self, query, key, value, mask, position_bias, self_cache, past, batch, length, output_attentions=False):
        """MLR self-attention. Blocks follow positions counted over real tokens (``cumsum(mask) - 1``), so a
        left-padded row (Chronos left-pads contexts) is computed exactly as the row alone; T5's relative bias
        (index differences, equal to position differences inside a contiguous row) is added in every level.
        Returns (output, position_bias, probabilities or None)."""
        total = past + length
        # slots scored: the written ones (dynamic) or all max_cache_len slots (static cache)
        key_count = self_cache.get_mask_sizes(length, self.layer_idx)[0] if self_cache is not None and past else total
        key_valid = None
        if mask is not None:  # the mask covers key_count slots; the written ones are the first ``total``
            key_valid = key_validity_from_mask(mask, batch, mask.shape[-1])[:, :total]
        if key_valid is None:
            key_positions = torch.arange(total, device=query.device).expand(batch, total)
        else:
            key_positions = (key_valid.long().cumsum(-1) - 1).clamp(min=0)
        positions = key_positions[:, past:]
        valid = key_valid[:, past:] if key_valid is not None else None
        if position_bias is None:
            position_bias = self._position_bias(length, key_count, past, query)
        kwargs = dict(ranks=self.ranks, block_sizes=self.block_sizes, causal=self.is_causal,
                      average_levels=self.spec["average_levels"])
        output = cached_mlr_attention(query, key, value, self_cache, self.layer_idx, positions=positions, valid=valid,
                                      slot_valid=key_valid, level_scales=self.level_scales, bias=position_bias,
                                      **kwargs)
        if output is not None:
            return output, position_bias, None
        if output_attentions:  # the reference semantics, materialised
            scores = mlr_scores_reference(query, key, ranks=self.ranks, block_sizes=self.block_sizes,
                                          scales=self.level_scales, positions=positions,
                                          average_levels=kwargs["average_levels"])
            allowed = allowed_pairs(positions, positions, self.is_causal, valid)
            probabilities = masked_softmax(scores + position_bias.to(scores.dtype), allowed)
            output = nn.functional.dropout(probabilities, self.dropout, self.training).to(value.dtype) @ value
            return output, position_bias, probabilities
        output = mlr_attention(query, key, value, scales=self.level_scales, positions=positions,
                               attention_mask=valid, bias=position_bias, **kwargs)
        return output, position_bias, None


def install_structured_attention(stack: nn.Module, config, specs: dict) -> int:
    """Replace the attention modules of a T5 stack (transformers' ``T5Stack`` or ours) in place.

    specs: {"self": spec or None, "cross": spec or None}; a dense spec (or None) keeps the T5Attention.
    Returns the number of modules replaced. Parameters are adopted, never copied.
    """
    replaced = 0
    for block in stack.block:
        targets = [("self", block.layer[0], "SelfAttention")]
        if len(block.layer) == 3:
            targets.append(("cross", block.layer[1], "EncDecAttention"))
        for role, parent, name in targets:
            spec = specs.get(role)
            if spec is None or spec["attention"] == "dense":
                continue
            source = getattr(parent, name)
            if isinstance(source, StructAttnT5Attention):
                raise ValueError(f"{name} of layer {source.layer_idx} already has structured attention "
                                 f"({source.variant}); patch the original model")
            setattr(parent, name, StructAttnT5Attention(source, spec))
            replaced += 1
    return replaced


def role_specs(config) -> dict:
    """{"self": spec, "cross": spec} of a decoder stack's config, {"self": spec} of an encoder stack's."""
    if config.is_decoder:
        return {"self": config.attention_spec("decoder_self"), "cross": config.attention_spec("cross")}
    return {"self": config.attention_spec("encoder_self")}


class StructAttnT5PreTrainedModel(StructAttnPreTrainedMixin, T5PreTrainedModel):
    """Base of the T5 family. The models are transformers' T5 classes built by their own ``__init__``; ``post_init``
    then turns their ``T5Stack``s into ``StructAttnT5Stack``s with the configured attention, before weight init, so
    that init (skipped for modules already initialised and for loaded weights) reaches the new modules once."""

    config: StructAttnT5Config
    config_class = StructAttnT5Config
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    structattn_auto_map = T5_AUTO_MAP

    def post_init(self):
        for name in ("encoder", "decoder"):
            stack = getattr(self, name, None)
            if isinstance(stack, T5Stack) and not isinstance(stack, StructAttnT5Stack):
                # the stock __init__ built (and initialised) a transformers T5Stack: re-class it in place
                # (StructAttnT5Stack adds methods, no state, so every attribute upstream set stays) and swap in
                # the configured attention, adopting T5's q, k, v, o
                stack.__class__ = StructAttnT5Stack
                # the one class-keyed record PreTrainedModel.__init__ makes: which outputs capture_outputs records
                _CAN_RECORD_REGISTRY[stack] = stack._can_record_outputs
                install_structured_attention(stack, stack.config, role_specs(stack.config))
        super().post_init()

    def _init_weights(self, module):
        super()._init_weights(module)  # T5's init: layer norms, feed-forward, embeddings, T5Attention
        factor = self.config.initializer_factor
        init_structured_query_key(module, factor)  # bilinear q/k projections: N(0, factor^2 / fan_in)
        if isinstance(module, StructAttnT5Attention):  # its adopted T5 modules, with T5Attention's formulas
            d_model, d_kv, heads = self.config.d_model, self.config.d_kv, self.config.num_heads
            if module.variant == "mlr":
                init.normal_(module.q.weight, mean=0.0, std=factor * ((d_model * d_kv) ** -0.5))
                init.normal_(module.k.weight, mean=0.0, std=factor * (d_model ** -0.5))
            init.normal_(module.v.weight, mean=0.0, std=factor * (d_model ** -0.5))
            init.normal_(module.o.weight, mean=0.0, std=factor * ((heads * d_kv) ** -0.5))
            if module.has_relative_attention_bias:
                init.normal_(module.relative_attention_bias.weight, mean=0.0, std=factor * (d_model ** -0.5))


class StructAttnT5Stack(StructAttnT5PreTrainedModel, T5Stack):
    """transformers' T5Stack (its ``__init__`` and forward) with the configured attention in every block; the
    decoder stack creates the MLR-aware cache when asked to cache and none is given."""

    def post_init(self):
        # built directly (not re-classed by a model's post_init): T5Stack.__init__ calls this before any init
        if not any(isinstance(module, StructAttnT5Attention) for module in self.modules()):
            install_structured_attention(self, self.config, role_specs(self.config))
        super().post_init()

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                inputs_embeds=None, cache=None, use_cache=None, **kwargs):
        """See ``transformers.T5Stack.forward``; input_ids (B, T), attention_mask (B, T) over cached + new tokens and
        encoder_attention_mask (B, S): keep-masks (bool or 0/1, 1 = real token; additive masks are refused).
        ``output_attentions=True`` returns the probabilities of every layer from the materialised path and runs
        without a cache (dense roles need ``attn_implementation="eager"``)."""
        if "past_key_values" in kwargs and cache is None:
            cache = kwargs.pop("past_key_values")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        shape = tuple((input_ids if input_ids is not None else inputs_embeds).shape)
        if len(shape) < 2 or shape[1] == 0:
            raise ValueError(f"the input has sequence length 0 or no batch axis (shape {shape}): pass at least one "
                             f"token as (B, T)")
        past = cache.get_seq_length() if cache is not None else 0
        attention_mask = keep_mask(attention_mask, shape[0], past + shape[1], name="attention_mask")
        if encoder_hidden_states is not None:
            encoder_attention_mask = keep_mask(encoder_attention_mask, shape[0], encoder_hidden_states.shape[1],
                                               name="encoder_attention_mask")
        output_attentions = kwargs.get("output_attentions")
        if output_attentions is None:
            output_attentions = bool(self.config.output_attentions)
        if output_attentions:
            self._check_can_output_attentions(past)
            kwargs["output_attentions"] = True
            cache, use_cache = None, False
        wants_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.is_decoder and cache is None and wants_cache and self.config.is_encoder_decoder:
            cache = EncoderDecoderCache(StructAttnCache(self.config.cache_layer_specs()), DynamicCache())
        return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                               encoder_hidden_states=encoder_hidden_states,
                               encoder_attention_mask=encoder_attention_mask, inputs_embeds=inputs_embeds,
                               cache=cache, use_cache=use_cache, **kwargs)

    def _check_can_output_attentions(self, past: int) -> None:
        """Refuse ``output_attentions`` where it would silently give no probabilities."""
        if past > 0:
            raise ValueError("output_attentions=True materialises the attention of an uncached forward; pass "
                             "use_cache=False (e.g. generate(..., use_cache=False)) and no filled cache")
        dense_roles = [module for module in self.modules() if isinstance(module, T5Attention)]
        if dense_roles and self.config._attn_implementation != "eager":
            raise ValueError(f"output_attentions=True: the dense attention roles of this model run transformers' "
                             f"T5Attention, which returns probabilities only with attn_implementation='eager' "
                             f"(this model uses {self.config._attn_implementation!r}); build or load it with "
                             f"attn_implementation='eager'")


class StructAttnT5Model(StructAttnT5PreTrainedModel, T5Model):
    """``transformers.T5Model`` with structured attention (same ``__init__``, forward, outputs and parameter
    names)."""


class StructAttnT5ForConditionalGeneration(StructAttnT5PreTrainedModel, T5ForConditionalGeneration):
    """``transformers.T5ForConditionalGeneration`` with structured attention; ``generate`` uses an
    ``EncoderDecoderCache(StructAttnCache, DynamicCache)`` whose MLR decoder layers keep the hierarchical key
    cache."""

    def new_cache(self, max_cache_len: Optional[int] = None) -> EncoderDecoderCache:
        """An empty generation cache sized by ``num_decoder_layers`` (MLR key cache for MLR decoder layers);
        fixed-shape self-attention layers of ``max_cache_len`` slots when given (static cache)."""
        return EncoderDecoderCache(StructAttnCache(self.config.cache_layer_specs(), max_cache_len=max_cache_len),
                                   DynamicCache())


class StructAttnT5EncoderModel(StructAttnT5PreTrainedModel, T5EncoderModel):
    """``transformers.T5EncoderModel`` with structured encoder self-attention."""


StructAttnT5Config.register_for_auto_class()
StructAttnT5Model.register_for_auto_class("AutoModel")
StructAttnT5ForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
StructAttnT5EncoderModel.register_for_auto_class("AutoModelForTextEncoding")

__all__ = [
    "StructAttnT5Attention",
    "StructAttnT5PreTrainedModel",
    "StructAttnT5Model",
    "StructAttnT5ForConditionalGeneration",
    "StructAttnT5EncoderModel",
    "install_structured_attention",
    "key_validity_from_mask",
]
