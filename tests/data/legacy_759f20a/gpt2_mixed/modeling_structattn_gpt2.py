"""GPT-2-style models whose attention is dense, MLR, bilinear MLR, bilinear BTT or sliding-window.

Parameter names follow ``transformers.GPT2LMHeadModel`` (``transformer.h.{i}.attn.c_attn`` ...), so a
GPT-2 checkpoint loads into a dense or MLR model unchanged. Bilinear layers keep GPT-2's value/output
projections (``c_v``, ``c_proj``) and add their structured query/key projections.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D
from transformers.utils import ModelOutput, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_structattn_gpt2 import StructAttnGPT2Config
from .structattn_cache import StructAttnCache, cached_mlr_attention
from .structattn_geometry import check_positions, keep_mask, mask_value, resolve_level_scales, softmax_dtype
from .structattn_mlr import mlr_attention
from .structattn_ops import fused_attention
from .structattn_pretrained import StructAttnPreTrainedMixin
from .structattn_qk import StructuredQueryKey, init_structured_query_key
from .structattn_reference import allowed_pairs, masked_softmax, mlr_scores_reference


def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Materialised attention (GPT-2's eager path). Returns (B, T, H, dv) and the weights. Masking and softmax run
    in ``promote_types(dtype, float32)``: a half-precision score plus transformers' ``finfo.min`` mask would
    overflow to -inf (NaN rows)."""
    weights = (torch.matmul(query, key.transpose(-1, -2)) * scaling).to(softmax_dtype(query.dtype))
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask, mask_value(weights.dtype))
        else:
            weights = weights + attention_mask.to(weights.dtype)
    weights = nn.functional.softmax(weights, dim=-1).type(value.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2), weights


def dense_logit_scale(head_dim: int, scaling) -> float:
    """Logit multiplier of dense/SWA heads: 1/sqrt(r) ("standard"), 1/r ("mup", paper App. E) or a number."""
    if scaling == "standard":
        return head_dim ** -0.5
    if scaling == "mup":
        return 1.0 / head_dim
    return float(scaling)


GPT2_AUTO_MAP = {
    "AutoConfig": "configuration_structattn_gpt2.StructAttnGPT2Config",
    "AutoModel": "modeling_structattn_gpt2.StructAttnGPT2Model",
    "AutoModelForCausalLM": "modeling_structattn_gpt2.StructAttnGPT2LMHeadModel",
}


class StructAttnGPT2Attention(StructuredQueryKey):
    """One attention layer; the variant comes from ``config.layer_attention(layer_idx)``. Dense, MLR and SWA take
    q, k and v from GPT-2's fused ``c_attn``; the bilinear variants build their structured q/k
    (``StructuredQueryKey``) and keep a value projection ``c_v``."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.variant = config.layer_attention(layer_idx)
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.is_causal = True
        self.scaling = dense_logit_scale(self.head_dim, config.dense_scaling) if config.scale_attn_weights else 1.0
        if self.variant in ("dense", "mlr", "swa"):
            self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        else:
            self.c_v = Conv1D(self.embed_dim, self.embed_dim)
        self.build_query_key(self.variant, self.embed_dim, self.num_heads, self.head_dim,
                             bilinear_mlr_ranks=config.bilinear_mlr_ranks, btt_factors=config.btt_factors,
                             btt_rank=config.btt_rank, bilinear_scaling=config.bilinear_scaling,
                             bilinear_scale_constant=config.bilinear_scale_constant,
                             rms_clamp=config.bilinear_weight_rms_clamp,
                             qk_norm=config.qk_norm if config.qk_layernorm else None,
                             norm_eps=config.layer_norm_epsilon)
        if self.variant == "mlr":
            self.ranks = config.resolved_mlr_ranks
            self.block_sizes = config.resolved_mlr_block_sizes
            scaling = config.mlr_scaling
            if scaling == "standard" and not config.scale_attn_weights:
                scaling = 1.0
            self.level_scales = resolve_level_scales(self.ranks, scaling, "mlr_scaling")
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _split_heads(self, x):
        """(B, T, H*d) -> (B, H, T, d)."""
        return x.view(*x.shape[:-1], self.num_heads, -1).transpose(1, 2)

    def _query_key_value(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states (B, T, D) -> query, key (B, H, T, E) and value (B, H, T, r): dense/MLR/SWA slice GPT-2's
        fused ``c_attn``; the bilinear variants fold their logit scales into the queries."""
        if self.variant in ("dense", "mlr", "swa"):
            query, key, value = (self._split_heads(t) for t in self.c_attn(hidden_states).split(self.embed_dim, -1))
            query, key = self.query_key(hidden_states, projected=(query, key))
            return query, key, value
        query, key = self.query_key(hidden_states)
        return query, key, self._split_heads(self.c_v(hidden_states))

    def forward(self, hidden_states: torch.Tensor, cache: Optional[Cache] = None, attention_masks=None,
                padding_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                positions_are_arange: bool = False, output_attentions: bool = False,
                **kwargs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states (B, T, D); attention_masks: dict with transformers' 4-D masks ("full", "sliding");
        padding_mask: (B, S) over cached + new slots (1 = real token); position_ids: (B, T);
        positions_are_arange: position_ids is ``arange(T)`` (lets MLR skip its position analysis);
        output_attentions: also return the probabilities (B, H, T, T) from the materialised path (uncached only).
        Returns (output (B, T, D), probabilities or None)."""
        batch, length, _ = hidden_states.shape
        dropout = self.attn_dropout.p if self.training else 0.0
        attention_masks = attention_masks or {}
        query, key, value = self._query_key_value(hidden_states)
        if output_attentions:
            output, probabilities = self._materialised(hidden_states, query, key, value, padding_mask, position_ids)
            output = output.transpose(1, 2).reshape(batch, length, self.embed_dim)
            return self.resid_dropout(self.c_proj(output)), probabilities
        if self.variant == "mlr":
            output = self._mlr(query, key, value, cache, padding_mask, position_ids, length, positions_are_arange)
        elif self.variant in ("dense", "swa"):
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
            interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
            mask = attention_masks.get("sliding" if self.variant == "swa" else "full")
            extra = {"sliding_window": self.config.sliding_window} if self.variant == "swa" else {}
            output, _ = interface(self, query, key, value, mask, dropout=dropout, scaling=self.scaling, **extra)
            output = output.transpose(1, 2)
        else:
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
            mask = attention_masks.get("full")
            allowed = mask if mask is not None and mask.dtype == torch.bool else None
            bias = mask if mask is not None and mask.dtype != torch.bool else None
            if allowed is not None and allowed.all():
                allowed = None
            output = fused_attention(query, key, value, scale=1.0, causal=allowed is None and bias is None,
                                     allowed=allowed, bias=bias, dropout=dropout)
        output = output.transpose(1, 2).reshape(batch, length, self.embed_dim)
        return self.resid_dropout(self.c_proj(output)), None

    def _materialised(self, hidden_states, query, key, value, padding_mask, position_ids):
        """Uncached attention with the T x T probabilities materialised (the reference semantics of every variant;
        slow, for ``output_attentions``); query, key from ``query_key``. Returns (output (B, H, T, dv),
        probabilities (B, H, T, T))."""
        batch, length = hidden_states.shape[:2]
        positions = position_ids.expand(batch, length)
        if self.variant == "mlr":
            scores = mlr_scores_reference(query, key, ranks=self.ranks, block_sizes=self.block_sizes,
                                          scales=self.level_scales, positions=positions,
                                          average_levels=self.config.mlr_average_levels)
        elif self.variant in ("dense", "swa"):
            scores = (query @ key.transpose(-1, -2)) * self.scaling
        else:
            scores = query @ key.transpose(-1, -2)  # logit scales folded into the queries
        window = self.config.sliding_window if self.variant == "swa" else None
        allowed = allowed_pairs(positions, positions, True, padding_mask, sliding_window=window)
        probabilities = masked_softmax(scores, allowed)
        return self.attn_dropout(probabilities).to(value.dtype) @ value, probabilities

    def _mlr(self, query, key, value, cache, padding_mask, position_ids, length, positions_are_arange=False):
        batch = query.shape[0]
        positions = position_ids.expand(batch, length)
        valid = padding_mask[:, -length:].bool() if padding_mask is not None else None
        kwargs = dict(ranks=self.ranks, block_sizes=self.block_sizes, causal=True,
                      average_levels=self.config.mlr_average_levels)
        output = cached_mlr_attention(query, key, value, cache, self.layer_idx, positions=positions, valid=valid,
                                      slot_valid=padding_mask, level_scales=self.level_scales, **kwargs)
        if output is not None:
            return output
        return mlr_attention(query, key, value, scales=self.level_scales,
                             positions=None if positions_are_arange else positions, attention_mask=valid, **kwargs)


class StructAttnGPT2MLP(nn.Module):
    def __init__(self, intermediate_size: int, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, intermediate_size)
        self.act = ACT2FN[config.activation_function]
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states):
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


class StructAttnGPT2Block(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = StructAttnGPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = StructAttnGPT2MLP(inner_dim, config)

    def forward(self, hidden_states, cache=None, attention_masks=None, padding_mask=None, position_ids=None,
                positions_are_arange=False, output_attentions=False, **kwargs):
        attention, _ = self.attn(self.ln_1(hidden_states), cache=cache, attention_masks=attention_masks,
                                 padding_mask=padding_mask, position_ids=position_ids,
                                 positions_are_arange=positions_are_arange, output_attentions=output_attentions)
        hidden_states = hidden_states + attention
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class ZeroInitLinear(nn.Linear):
    """A linear layer that new models start at zero (the ICL read-out: E[(f_hat - f)^2] = 1 at init, paper §4)."""


class StructAttnGPT2PreTrainedModel(StructAttnPreTrainedMixin, PreTrainedModel):
    config: StructAttnGPT2Config
    config_class = StructAttnGPT2Config
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["StructAttnGPT2Block"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    _can_record_outputs = {"hidden_states": StructAttnGPT2Block,
                           "attentions": OutputRecorder(StructAttnGPT2Attention, index=1)}
    _keys_to_ignore_on_load_unexpected = [r"attn\.bias", r"attn\.masked_bias"]

    structattn_auto_map = GPT2_AUTO_MAP

    def _init_weights(self, module):
        super()._init_weights(module)
        init_structured_query_key(module)
        std = self.config.initializer_range
        if isinstance(module, Conv1D):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        if isinstance(module, (StructAttnGPT2Attention, StructAttnGPT2MLP)):
            # GPT-2's scaled init of the residual projections (1/sqrt(2 * n_layer))
            init.normal_(module.c_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
        if isinstance(module, nn.RMSNorm):
            init.ones_(module.weight)
        if isinstance(module, ZeroInitLinear):
            init.zeros_(module.weight)
            init.zeros_(module.bias)


class StructAttnGPT2Model(StructAttnGPT2PreTrainedModel):
    def __init__(self, config: StructAttnGPT2Config):
        super().__init__(config)
        self.embed_dim = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = nn.Embedding(config.n_positions, self.embed_dim)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(StructAttnGPT2Block(config, layer_idx=i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, new_embeddings):
        self.wte = new_embeddings

    def new_cache(self, max_cache_len: Optional[int] = None) -> StructAttnCache:
        """An empty cache with one layer of the right kind per attention layer (MLR key cache for MLR layers);
        fixed-shape layers of ``max_cache_len`` slots when given (static cache, for ``torch.compile``)."""
        return StructAttnCache(self.config.cache_layer_specs(), max_cache_len=max_cache_len)

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids: Optional[torch.LongTensor] = None, cache: Optional[Cache] = None,
                attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.LongTensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, use_cache: Optional[bool] = None,
                **kwargs) -> BaseModelOutputWithPast:
        """input_ids (B, T) or inputs_embeds (B, T, D); attention_mask (B, S) keep-mask over cached + new tokens
        (bool or 0/1, 1 = real token; additive masks are refused); position_ids (B, T), (1, T) or (T,)
        non-negative integers (default: continue from the cache); output_attentions=True returns every layer's
        probabilities (B, H, T, T) from the materialised path and runs without a cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None and (input_ids.dim() != 2 or input_ids.dtype.is_floating_point):
            raise ValueError(f"input_ids must be an integer tensor of shape (B, T), got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.embed_dim:
            raise ValueError(f"inputs_embeds must have shape (B, T, {self.embed_dim}), got {tuple(inputs_embeds.shape)}")
        batch, length = inputs_embeds.shape[:2]
        if length == 0:
            raise ValueError(f"the input has sequence length 0 (shape {tuple(inputs_embeds.shape[:2])}): pass at "
                             f"least one token")
        output_attentions = bool(kwargs.pop("output_attentions", self.config.output_attentions))
        if output_attentions:
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("output_attentions=True materialises the attention of an uncached forward; pass "
                                 "use_cache=False (e.g. generate(..., use_cache=False)) and no filled cache")
            cache, use_cache = None, False
        if use_cache and cache is None and self.training and torch.is_grad_enabled():
            # a training step never reads a cache back, and the MLR key cache costs real time to fill (~40 ms per
            # step at T = 1024, 6 layers); pass a cache explicitly to get one anyway
            use_cache = False
        if use_cache and cache is None:
            cache = self.new_cache()
        # MLR layers skip their position checks (host syncs, graph breaks under torch.compile) when the positions
        # are the model's own arange from 0
        past = cache.get_seq_length() if cache is not None else 0
        positions_are_arange = position_ids is None and past == 0
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=inputs_embeds.device)[None]
            last_position = past + length - 1
        else:
            position_ids = check_positions(position_ids, batch, length, inputs_embeds.device, "position_ids")
            last_position = None
            if not torch.compiler.is_compiling():  # host reads: graph breaks when compiled
                last_position = int(position_ids.max())
                if int(position_ids.min()) < 0:
                    raise ValueError(f"position_ids must be non-negative, got {int(position_ids.min())}")
        if attention_mask is not None:
            attention_mask = keep_mask(attention_mask, batch, past + length, inputs_embeds.device, "attention_mask")
        if last_position is not None and last_position >= self.config.n_positions:
            raise ValueError(f"position {last_position} is beyond n_positions={self.config.n_positions}: "
                             f"this model has learned position embeddings for positions < {self.config.n_positions}")
        hidden_states = self.drop(inputs_embeds + self.wpe(position_ids))

        if (attention_mask is not None and attention_mask.dim() == 2 and not torch.compiler.is_compiling()
                and bool(attention_mask.all())):
            attention_mask = None
        variants = {self.config.layer_attention(i) for i in range(self.config.n_layer)}
        mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                           cache=cache, position_ids=position_ids)
        attention_masks = {}
        if variants & {"dense", "bilinear_mlr", "bilinear_btt"}:
            attention_masks["full"] = create_causal_mask(**mask_kwargs)
        if "swa" in variants:
            attention_masks["sliding"] = create_sliding_window_causal_mask(**mask_kwargs)

        for block in self.h:
            hidden_states = block(hidden_states, cache if not (self.gradient_checkpointing and self.training) else None,
                                  attention_masks, attention_mask, position_ids,
                                  positions_are_arange=positions_are_arange, output_attentions=output_attentions,
                                  **kwargs)
        hidden_states = self.ln_f(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)


class StructAttnGPT2LMHeadModel(StructAttnGPT2PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: StructAttnGPT2Config):
        super().__init__(config)
        self.transformer = StructAttnGPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def new_cache(self, max_cache_len: Optional[int] = None) -> StructAttnCache:
        """The empty cache ``generate()`` fills (see ``StructAttnGPT2Model.new_cache``)."""
        return self.transformer.new_cache(max_cache_len)

    def _prepare_generated_length(self, generation_config, has_default_max_length, has_default_min_length,
                                  model_input_name, input_ids_length, inputs_tensor):
        # refuse, before any forward, a request that would run past the learned position embeddings (the forward
        # would otherwise fail at the first position >= n_positions, after the prompt and part of the output)
        generation_config = super()._prepare_generated_length(generation_config, has_default_max_length,
                                                              has_default_min_length, model_input_name,
                                                              input_ids_length, inputs_tensor)
        prompt = inputs_tensor.shape[1] if model_input_name == "inputs_embeds" else input_ids_length
        positions = generation_config.max_length
        if model_input_name == "inputs_embeds" and inputs_tensor.shape[1] != input_ids_length:
            positions += inputs_tensor.shape[1]  # transformers' max_length then counts only the new tokens
        limit = self.config.n_positions
        if positions > limit:
            if generation_config.max_new_tokens is not None:
                asked = f"max_new_tokens={generation_config.max_new_tokens}"
            else:
                asked = "transformers' default length" if has_default_max_length else f"max_length={positions}"
            raise ValueError(f"generate: a {prompt}-token prompt + {positions - prompt} new tokens ({asked}) needs "
                             f"{positions} positions, beyond n_positions={limit} (this model has learned position "
                             f"embeddings for positions < {limit}); ask for at most {max(limit - prompt, 0)} new "
                             f"tokens")
        return generation_config

    @can_return_tuple
    def forward(self, input_ids: Optional[torch.LongTensor] = None, cache: Optional[Cache] = None,
                attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.LongTensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """Returns logits (B, T, vocab) and, with ``labels`` (B, T), the shifted next-token loss."""
        outputs = self.transformer(input_ids, cache=cache, attention_mask=attention_mask, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


@dataclass
class InContextRegressionOutput(ModelOutput):
    """loss: mean squared error over the y positions; predictions: (B, N) prediction of y_i from (x_1, y_1, ...,
    x_i); hidden_states, attentions: optional per-layer states and probabilities (B, H, 2N, 2N)."""

    loss: Optional[torch.Tensor] = None
    predictions: Optional[torch.Tensor] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None


class StructAttnGPT2ForInContextRegression(StructAttnGPT2PreTrainedModel):
    """In-context linear regression (paper §4, Garg et al.): the prompt x_1, y_1, ..., x_N, y_N is embedded with a
    linear read-in (y tokens are [y, 0, ..., 0]); a zero-initialised linear read-out at each x position predicts
    its y."""

    def __init__(self, config: StructAttnGPT2Config):
        super().__init__(config)
        if config.icl_input_dim is None or config.icl_input_dim <= 0:
            raise ValueError(f"icl_input_dim must be a positive integer, got {config.icl_input_dim}")
        self.read_in = nn.Linear(config.icl_input_dim, config.n_embd)
        self.transformer = StructAttnGPT2Model(config)
        self.read_out = ZeroInitLinear(config.n_embd, 1)
        self.post_init()

    @staticmethod
    def interleave(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        """xs (B, N, d), ys (B, N) -> tokens (B, 2N, d): x_1, [y_1, 0...], x_2, ..."""
        y_tokens = torch.zeros_like(xs)
        y_tokens[..., 0] = ys
        return torch.stack([xs, y_tokens], dim=2).flatten(1, 2)

    @can_return_tuple
    def forward(self, xs: torch.Tensor, ys: torch.Tensor, **kwargs) -> InContextRegressionOutput:
        """xs (B, N, d), ys (B, N) with 2N <= n_positions."""
        if xs.shape[-1] != self.config.icl_input_dim:
            raise ValueError(f"xs has {xs.shape[-1]} features but icl_input_dim={self.config.icl_input_dim}")
        tokens = self.interleave(xs, ys)
        hidden = self.transformer(inputs_embeds=self.read_in(tokens), use_cache=False, **kwargs)
        predictions = self.read_out(hidden.last_hidden_state[:, ::2])[..., 0]
        loss = ((predictions - ys) ** 2).mean()
        return InContextRegressionOutput(loss=loss, predictions=predictions, hidden_states=hidden.hidden_states,
                                         attentions=hidden.attentions)


StructAttnGPT2Config.register_for_auto_class()
StructAttnGPT2Model.register_for_auto_class("AutoModel")
StructAttnGPT2LMHeadModel.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "StructAttnGPT2PreTrainedModel",
    "StructAttnGPT2Model",
    "StructAttnGPT2LMHeadModel",
    "StructAttnGPT2ForInContextRegression",
]
