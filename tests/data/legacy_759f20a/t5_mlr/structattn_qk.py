"""Query/key producers of the attention variants, shared by the GPT-2 and T5 families.

``StructuredQueryKey`` is the base class of ``StructAttnGPT2Attention`` and ``StructAttnT5Attention``. Its
``build_query_key`` creates the q/k parameters of a variant *on the attention module itself*, so their state-dict
names are the attention's own (``q_proj.weights.{l}``, ``k_proj.weight_r``, ``q_norms.{l}``, ``q_norm`` ...) and
saved checkpoints and the T5 patcher's adopted ``q, k, v, o`` keep their names; its ``query_key`` returns the
per-head queries and keys with the bilinear logit scales folded into the queries. Each family keeps only what is
its own: GPT-2's fused ``c_attn`` (dense, MLR, SWA), T5's adopted ``q``/``k`` (MLR) and the value projections.

The structured parameters live in ``BilinearMLRProjection`` / ``BilinearBTTKeyProjection``, whose
``reset_parameters(factor)`` is the one place of their init formula (``N(0, factor^2 / fan_in)``, paper App. E).
"""

from typing import Optional, Sequence

import torch
from torch import nn

from .structattn_bilinear import (
    BilinearBTTKeyProjection,
    BilinearMLRProjection,
    bilinear_level_scales,
    default_btt_factors,
)

PROJECTED_VARIANTS = ("dense", "mlr", "swa")  # q and k are slices of ordinary linear projections
STRUCTURED_VARIANTS = ("bilinear_mlr", "bilinear_btt")  # q and k come from structured projections built here


def qk_norm_layer(kind: str, width: int, eps: float) -> nn.Module:
    """The q/k normalisation ``kind`` ("layernorm" or "rms") over the last dim of size ``width``."""
    if kind == "rms":
        return nn.RMSNorm(width, eps=eps)
    return nn.LayerNorm(width, eps=eps)


def init_structured_query_key(module: nn.Module, factor: float = 1.0) -> None:
    """Initialise ``module`` if it is a structured q/k projection (called from both families' ``_init_weights``)."""
    if isinstance(module, (BilinearMLRProjection, BilinearBTTKeyProjection)):
        module.reset_parameters(factor)


class StructuredQueryKey(nn.Module):
    """Base of the attention modules: builds and runs the query/key side of one variant.

    Subclasses call ``build_query_key`` in ``__init__`` and ``query_key`` in ``forward``.
    """

    def build_query_key(self, variant: str, hidden_size: int, num_heads: int, head_dim: int, *,
                        bilinear_mlr_ranks: Optional[Sequence[int]] = None,
                        btt_factors: Optional[Sequence[int]] = None, btt_rank: int = 1,
                        bilinear_scaling: str = "standard", bilinear_scale_constant: float = 1.0,
                        rms_clamp: bool = False, qk_norm: Optional[str] = None, norm_eps: float = 1e-5) -> None:
        """Create the q/k parameters of ``variant`` on this module.

        qk_norm: None (no q/k normalisation), "layernorm" or "rms". Dense/MLR/SWA normalise each head (width
        ``head_dim``); bilinear MLR with "layernorm" normalises each level (the paper's App. E form) and with "rms"
        the whole head; bilinear BTT normalises x and ``M_h x`` (width ``hidden_size``).
        """
        if variant not in PROJECTED_VARIANTS + STRUCTURED_VARIANTS:
            raise ValueError(f"attention variant {variant!r} is not one of {PROJECTED_VARIANTS + STRUCTURED_VARIANTS}")
        self.qk_variant, self.qk_num_heads, self.qk_norm_kind = variant, num_heads, qk_norm
        if variant in PROJECTED_VARIANTS:
            if qk_norm:
                self.q_norm = qk_norm_layer(qk_norm, head_dim, norm_eps)
                self.k_norm = qk_norm_layer(qk_norm, head_dim, norm_eps)
        elif variant == "bilinear_mlr":
            ranks = list(bilinear_mlr_ranks)
            self.q_proj = BilinearMLRProjection(hidden_size, num_heads, ranks, rms_clamp=rms_clamp)
            self.k_proj = BilinearMLRProjection(hidden_size, num_heads, ranks, rms_clamp=rms_clamp)
            widths = self.q_proj.level_widths
            self.level_scales = bilinear_level_scales(widths, bilinear_scaling, bilinear_scale_constant)
            if qk_norm == "layernorm":  # per level
                self.q_norms = nn.ModuleList(qk_norm_layer(qk_norm, w, norm_eps) for w in widths)
                self.k_norms = nn.ModuleList(qk_norm_layer(qk_norm, w, norm_eps) for w in widths)
            elif qk_norm:  # over the whole head: all levels together
                self.q_norm = qk_norm_layer(qk_norm, sum(widths), norm_eps)
                self.k_norm = qk_norm_layer(qk_norm, sum(widths), norm_eps)
        else:
            factors = btt_factors or default_btt_factors(hidden_size)
            self.k_proj = BilinearBTTKeyProjection(hidden_size, num_heads, factors, btt_rank, rms_clamp=rms_clamp)
            self.btt_scale = bilinear_level_scales([hidden_size], bilinear_scaling, bilinear_scale_constant)[0]
            if qk_norm:
                self.q_norm = qk_norm_layer(qk_norm, hidden_size, norm_eps)
                self.k_norm = qk_norm_layer(qk_norm, hidden_size, norm_eps)

    def query_key(self, hidden_states: torch.Tensor, key_states: Optional[torch.Tensor] = None,
                  projected: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, E) and keys (B, H, S, E) of this module's variant.

        hidden_states (B, T, D): the query side; key_states (B, S, D): the key side (cross-attention), default
        ``hidden_states``; projected: for dense/MLR/SWA, the per-head (query (B, H, T, r), key (B, H, S, r)) of the
        family's own linear projections (normalised here when configured; their logit scale is applied by the
        attention call). Bilinear variants fold their logit scales into the queries (E = sum_l p_l r_l for bilinear
        MLR, D for BTT).
        """
        projected_query, projected_key = projected if projected is not None else (None, None)
        key_states = hidden_states if key_states is None else key_states
        return self.queries(hidden_states, projected_query), self.keys(key_states, projected_key)

    def queries(self, hidden_states: torch.Tensor, projected: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The query half of ``query_key`` (a cross-attention step whose keys are cached needs only this)."""
        if self.qk_variant in PROJECTED_VARIANTS:
            return self.q_norm(projected) if self.qk_norm_kind else projected
        if self.qk_variant == "bilinear_mlr":
            levels = self._normalised_levels(self.q_proj(hidden_states), "q")
            return torch.cat([scale * q for scale, q in zip(self.level_scales, levels)], dim=-1)
        query = hidden_states[:, None]  # BTT: q = x (all heads share it), k = M_h x
        if self.qk_norm_kind:
            query = self.q_norm(query)
        return (query * self.btt_scale).expand(-1, self.qk_num_heads, -1, -1)

    def keys(self, key_states: torch.Tensor, projected: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The key half of ``query_key``."""
        if self.qk_variant in PROJECTED_VARIANTS:
            return self.k_norm(projected) if self.qk_norm_kind else projected
        if self.qk_variant == "bilinear_mlr":
            return torch.cat(self._normalised_levels(self.k_proj(key_states), "k"), dim=-1)
        key = self.k_proj(key_states)
        return self.k_norm(key) if self.qk_norm_kind else key

    def _normalised_levels(self, levels: list, side: str) -> list:
        """Bilinear-MLR level outputs after the configured q or k normalisation."""
        if self.qk_norm_kind == "layernorm":
            return [norm(x) for norm, x in zip(getattr(self, f"{side}_norms"), levels)]
        if self.qk_norm_kind:
            norm = getattr(self, f"{side}_norm")
            return list(norm(torch.cat(levels, dim=-1)).split(self.q_proj.level_widths, dim=-1))
        return levels


__all__ = ["StructuredQueryKey", "init_structured_query_key", "qk_norm_layer"]
