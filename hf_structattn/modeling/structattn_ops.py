"""Fused attention helpers shared by the non-MLR variants: dense, sliding-window and bilinear scores.

``fused_attention`` accepts query/key widths that differ from the value width (bilinear variants): the
narrower side is zero-padded so the fused kernel (flash on CPU, flash/efficient on CUDA) can run; zero dims
do not change q.k and padded value dims are sliced off.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .structattn_masks import mask_value, softmax_dtype


def sliding_window_allowed(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int,
                           causal: bool) -> torch.Tensor:
    """Boolean (B, 1, Tq, Tk): ``0 <= i - j < window`` (causal) or ``|i - j| < window`` (bidirectional)."""
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
    allowed = distance.abs() < window
    if causal:
        allowed = allowed & (distance >= 0)
    return allowed


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                    allowed: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                    dropout: float = 0.0) -> torch.Tensor:
    """softmax(scale * q k^T + bias, masked) v with a fused kernel.

    q: (B, H, Tq, E), k: (B, H, Tk, E), v: (B, H, Tk, dv) -> (B, H, Tq, dv). ``allowed``: boolean mask
    broadcastable to (B, H, Tq, Tk) (True = attend); when given, causality must already be folded into it.
    ``causal`` without ``allowed`` uses the kernel's own causal mask (bottom-right aligned for Tq < Tk is not
    what SDPA does, so callers with a cache pass ``allowed``).
    """
    qk_width, value_width = q.shape[-1], v.shape[-1]
    width = max(qk_width, value_width)
    if qk_width < width:
        q = F.pad(q, (0, width - qk_width))
        k = F.pad(k, (0, width - qk_width))
    if value_width < width:
        v = F.pad(v, (0, width - value_width))
    mask = None
    if allowed is not None:
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, mask_value(q.dtype))
    if bias is not None:
        mask = bias.to(q.dtype) if mask is None else mask + bias.to(q.dtype)
    is_causal = causal and mask is None and q.shape[-2] > 1
    if causal and mask is not None and allowed is None:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu_(
            1 + k.shape[-2] - q.shape[-2])
        mask = mask.masked_fill(future, mask_value(q.dtype))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale)
    return out[..., :value_width] if value_width < width else out


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
    weights = F.softmax(weights, dim=-1).type(value.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2), weights
