"""The bilinear MLR / BTT layers of the GPT-2 family inside transformers (only that family's checkpoints ship this
file): ``install_bilinear_attention(module)`` gives a layer's attention module a ``BilinearLayerConfig``, whose
``_attn_implementation`` names ``"bilinear"`` (the fused kernel on zero-padded q/k: their query/key width differs
from the value width, which transformers' functions do not take) or ``"bilinear_eager"`` (materialised), both
registered here in transformers' ``AttentionInterface``; their keys are cached by transformers' plain layers,
registered under the bilinear layer types. Part of the checkpoint payload."""

from typing import Optional

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .structattn_install import LayerConfigView
from .structattn_ops import eager_attention_forward, fused_attention

BILINEAR_ATTENTION = "bilinear"
BILINEAR_EAGER_ATTENTION = "bilinear_eager"


def bilinear_implementation(implementation: Optional[str]) -> str:
    """The bilinear attention function standing in for a transformers attention implementation name."""
    return BILINEAR_EAGER_ATTENTION if implementation in ("eager", BILINEAR_EAGER_ATTENTION) else BILINEAR_ATTENTION


class BilinearLayerConfig(LayerConfigView):
    """The config a bilinear MLR / BTT layer's attention module reads (``LayerConfigView``): ``_attn_implementation``
    names the bilinear function of the same kind (their query/key width differs from the value width, which
    transformers' functions do not take)."""

    implementation = staticmethod(bilinear_implementation)


def install_bilinear_attention(module: torch.nn.Module) -> None:
    """Make ``module`` (an attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS``, whose structured
    queries carry the logit scales) run the bilinear attention functions."""
    config = module.config
    if isinstance(config, LayerConfigView):
        config = config.base_config
    module.config = BilinearLayerConfig(config)


def bilinear_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                               dropout: float = 0.0, **kwargs):
    """``"bilinear"`` in ``AttentionInterface``: attention whose query/key width E differs from the value width (the
    bilinear MLR / BTT layers) with the fused kernel on zero-padded q/k. query (B, H, T, E); key (B, H, S, E); value
    (B, H, S, dv); attention_mask: transformers' bool keep-mask or additive mask, or None (causal). Returns
    ((B, T, H, dv), None)."""
    allowed = attention_mask if attention_mask is not None and attention_mask.dtype == torch.bool else None
    bias = attention_mask if attention_mask is not None and attention_mask.dtype != torch.bool else None
    out = fused_attention(query, key, value, scale=1.0 if scaling is None else scaling,
                          causal=attention_mask is None and getattr(module, "is_causal", True), allowed=allowed,
                          bias=bias, dropout=dropout)
    return out.transpose(1, 2), None


def _bilinear_mask(*args, **kwargs):
    return sdpa_mask(*args, **kwargs)


def _bilinear_eager_mask(*args, **kwargs):
    return eager_mask(*args, **kwargs)


# Bilinear layers cache their (structured, wider) keys like any full-attention layer: transformers' plain layers,
# registered under this package's layer types so that ``DynamicCache(config=...)`` and ``StaticCache`` build them.
class BilinearMLRKeyCacheLayer(DynamicLayer):
    _layer_type = "bilinear_mlr_attention"


class BilinearMLRStaticKeyCacheLayer(StaticLayer):
    _layer_type = "bilinear_mlr_attention"


class BilinearBTTKeyCacheLayer(DynamicLayer):
    _layer_type = "bilinear_btt_attention"


class BilinearBTTStaticKeyCacheLayer(StaticLayer):
    _layer_type = "bilinear_btt_attention"


ALL_ATTENTION_FUNCTIONS.register(BILINEAR_ATTENTION, bilinear_attention_forward)
# materialised: the scores of any q/k width (masking and softmax in promote_types(dtype, float32))
ALL_ATTENTION_FUNCTIONS.register(BILINEAR_EAGER_ATTENTION, eager_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(BILINEAR_ATTENTION, _bilinear_mask)
ALL_MASK_ATTENTION_FUNCTIONS.register(BILINEAR_EAGER_ATTENTION, _bilinear_eager_mask)

__all__ = ["BILINEAR_ATTENTION", "BILINEAR_EAGER_ATTENTION", "BilinearBTTKeyCacheLayer", "BilinearBTTStaticKeyCacheLayer",
           "BilinearLayerConfig", "BilinearMLRKeyCacheLayer", "BilinearMLRStaticKeyCacheLayer",
           "bilinear_attention_forward", "bilinear_implementation", "install_bilinear_attention"]
