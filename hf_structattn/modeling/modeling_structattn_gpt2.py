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
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D
from transformers.utils import ModelOutput, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_structattn_gpt2 import StructAttnGPT2Config
from .structattn_attention import install_mlr_attention
from .structattn_bilinear_attention import install_bilinear_attention
from .structattn_config_rules import BILINEAR_BTT_ATTENTION, BILINEAR_MLR_ATTENTION, MLR_ATTENTION, SLIDING_ATTENTION
from .structattn_inputs import check_positions
from .structattn_step import STEP_KEY
from .structattn_prepare import prepare_step
from .structattn_ops import eager_attention_forward
from .structattn_pretrained import StructAttnPreTrainedMixin
from .structattn_qk import StructuredQueryKey, init_structured_query_key
from .structattn_token_ids import vocabulary_error

BILINEAR_KINDS = (BILINEAR_MLR_ATTENTION, BILINEAR_BTT_ATTENTION)


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
    """One attention layer, GPT-2's attention module for every kind in ``config.layer_types``: dense, MLR and SWA
    take q, k and v from GPT-2's fused ``c_attn`` and dispatch through transformers' ``ALL_ATTENTION_FUNCTIONS``
    (an MLR layer's config is an ``MLRLayerConfig``, which names the MLR function; see ``structattn_attention``);
    the bilinear kinds build their structured q/k (``StructuredQueryKey``), keep a value projection ``c_v`` and
    dispatch the same way to the bilinear functions (their config is a ``BilinearLayerConfig``)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.kind = config.layer_types[layer_idx]
        self.variant = config.layer_attention(layer_idx)
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.is_causal = True
        self.scaling = dense_logit_scale(self.head_dim, config.dense_scaling) if config.scale_attn_weights else 1.0
        if self.kind in BILINEAR_KINDS:
            self.c_v = Conv1D(self.embed_dim, self.embed_dim)
        else:
            self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.build_query_key(self.variant, self.embed_dim, self.num_heads, self.head_dim,
                             bilinear_mlr_ranks=config.bilinear_mlr_ranks, btt_factors=config.btt_factors,
                             btt_rank=config.btt_rank, bilinear_scaling=config.bilinear_scaling,
                             bilinear_scale_constant=config.bilinear_scale_constant,
                             rms_clamp=config.bilinear_weight_rms_clamp,
                             qk_norm=config.qk_norm if config.qk_layernorm else None,
                             norm_eps=config.layer_norm_epsilon)
        if self.kind == MLR_ATTENTION:
            install_mlr_attention(self, config.mlr_geometry())
        elif self.kind in BILINEAR_KINDS:
            install_bilinear_attention(self)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _split_heads(self, x):
        """(B, T, H*d) -> (B, H, T, d)."""
        return x.view(*x.shape[:-1], self.num_heads, -1).transpose(1, 2)

    def _query_key_value(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states (B, T, D) -> query, key (B, H, T, E) and value (B, H, T, r): dense/MLR/SWA slice GPT-2's
        fused ``c_attn``; the bilinear kinds fold their logit scales into the queries."""
        if self.kind not in BILINEAR_KINDS:
            query, key, value = (self._split_heads(t) for t in self.c_attn(hidden_states).split(self.embed_dim, -1))
            query, key = self.query_key(hidden_states, projected=(query, key))
            return query, key, value
        query, key = self.query_key(hidden_states)
        return query, key, self._split_heads(self.c_v(hidden_states))

    def forward(self, hidden_states: torch.Tensor, cache: Optional[Cache] = None,
                attention_mask: Optional[torch.Tensor] = None, **kwargs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states (B, T, D); attention_mask: the mask transformers built for this layer's kind (4-D, or None);
        kwargs: ``position_ids`` and the model's ``MLRStep`` (``STEP_KEY``), handed to ``cache.update`` and the attention
        function. Returns (output (B, T, D), probabilities (B, H, T, S) with the eager implementation, else None)."""
        batch, length, _ = hidden_states.shape
        dropout = self.attn_dropout.p if self.training else 0.0
        query, key, value = self._query_key_value(hidden_states)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        # every kind through transformers' attention interface: an MLR or bilinear layer's config names this
        # package's function of the model's implementation kind (``structattn_attention``); the bilinear kinds fold
        # their logit scales into the queries
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        extra = {"sliding_window": self.config.sliding_window} if self.kind == SLIDING_ATTENTION else {}
        output, weights = interface(self, query, key, value, attention_mask, dropout=dropout,
                                    scaling=1.0 if self.kind in BILINEAR_KINDS else self.scaling, **extra, **kwargs)
        output = output.reshape(batch, length, self.embed_dim)
        return self.resid_dropout(self.c_proj(output)), weights


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

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        attention, _ = self.attn(self.ln_1(hidden_states), cache=cache, attention_mask=attention_mask, **kwargs)
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
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": StructAttnGPT2Block,
                           "attentions": OutputRecorder(StructAttnGPT2Attention, index=1)}
    _keys_to_ignore_on_load_unexpected = [r"attn\.bias", r"attn\.masked_bias"]

    structattn_auto_map = GPT2_AUTO_MAP
    structattn_max_positions_field = "n_positions"

    def structattn_num_cache_layers(self) -> int:
        return self.config.n_layer

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

    @merge_with_config_defaults
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, input_ids: Optional[torch.LongTensor] = None, cache: Optional[Cache] = None,
                attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.LongTensor] = None,
                position_ids: Optional[torch.LongTensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                use_cache: Optional[bool] = None, **kwargs) -> BaseModelOutputWithPast:
        """input_ids (B, T) or inputs_embeds (B, T, D); attention_mask (B, S) keep-mask over cached + new tokens
        (bool or 0/1, 1 = real token; additive masks are refused) or transformers' 4-D mask; token_type_ids (B, T)
        (embedded with ``wte``, as GPT-2 does); position_ids (B, T), (1, T) or (T,) non-negative integers (default:
        continue from the cache). With ``use_cache`` and no cache, a ``DynamicCache(config=...)`` is built: its
        "mlr_attention" layers are the hierarchical MLR key cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None and (input_ids.dim() != 2 or input_ids.dtype.is_floating_point):
            raise ValueError(f"input_ids must be an integer tensor of shape (B, T), got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if inputs_embeds is None:
            try:
                inputs_embeds = self.wte(input_ids)
            except IndexError as error:  # an id outside the vocabulary (CPU): the ids are read only now
                raise vocabulary_error(error, self.wte.num_embeddings, input_ids=input_ids)
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.embed_dim:
            raise ValueError(f"inputs_embeds must have shape (B, T, {self.embed_dim}), got {tuple(inputs_embeds.shape)}")
        batch, length = inputs_embeds.shape[:2]
        if length == 0 or batch == 0:
            raise ValueError(f"the input of shape {tuple(inputs_embeds.shape[:2])} is empty (batch {batch}, sequence "
                             f"length {length}): pass at least one token in at least one row")
        if use_cache and cache is None and self.training and torch.is_grad_enabled():
            # a training step never reads a cache back, and filling the MLR key cache costs real time (~40 ms per
            # step at T = 1024, 6 layers); pass a cache explicitly to get one anyway
            use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is not None:
            position_ids = check_positions(position_ids, batch, length, inputs_embeds.device, "position_ids")
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask.to(inputs_embeds.device)
        # the step plan: the mask's shape (``check_mask_shape``), positions, padding and the host facts every layer
        # shares, checked with one host read
        step = prepare_step(self, cache=cache, batch=batch, length=length, device=inputs_embeds.device,
                            position_ids=position_ids, attention_mask=attention_mask,
                            max_positions=("n_positions", self.config.n_positions), heads=self.config.n_head)
        if position_ids is None:  # continuing the cache: the plan's positions (no row is continued behind them)
            position_ids = step.positions[:1]
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask.bool().expand(batch, -1)
        hidden_states = inputs_embeds + self.wpe(position_ids)
        if token_type_ids is not None:
            try:
                hidden_states = hidden_states + self.wte(token_type_ids.view(-1, length))
            except IndexError as error:
                raise vocabulary_error(error, self.wte.num_embeddings, token_type_ids=token_type_ids)
        hidden_states = self.drop(hidden_states)

        kinds = set(self.config.layer_types)
        mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                           cache=cache, position_ids=position_ids)
        masks = {kind: None for kind in kinds}
        if kinds == {MLR_ATTENTION} and step.standard_masks and self.config._attn_implementation != "eager" and \
                (cache is None or all(getattr(layer, "holds_mlr_positions", False) and layer.is_bound
                                      for layer in cache.layers)):
            # every layer is MLR over the hierarchical cache (or none) and reads causality and padding from the
            # step plan: transformers' 4-D mask would be built for nobody
            kinds = set()
        if kinds - {SLIDING_ATTENTION}:
            full = create_causal_mask(**mask_kwargs)
            masks.update({kind: full for kind in kinds if kind != SLIDING_ATTENTION})
        if SLIDING_ATTENTION in kinds:
            masks[SLIDING_ATTENTION] = create_sliding_window_causal_mask(**mask_kwargs)
        kwargs[STEP_KEY] = step
        layer_cache = cache if not (self.gradient_checkpointing and self.training) else None
        for block, kind in zip(self.h, self.config.layer_types):
            hidden_states = block(hidden_states, layer_cache, masks.get(kind), position_ids=position_ids, **kwargs)
        hidden_states = self.ln_f(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)


class StructAttnGPT2LMHeadModel(StructAttnGPT2PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: StructAttnGPT2Config):
        super().__init__(config)
        # transformers picks the loss from the class name, which names no task here ("...LMHeadModel" as GPT-2's)
        self.loss_type = "ForCausalLM"
        self.transformer = StructAttnGPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, input_ids: Optional[torch.LongTensor] = None, cache: Optional[Cache] = None,
                attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.LongTensor] = None,
                position_ids: Optional[torch.LongTensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """Returns logits (B, T, vocab) and, with ``labels`` (B, T), the shifted next-token loss."""
        outputs = self.transformer(input_ids, cache=cache, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, position_ids=position_ids,
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
