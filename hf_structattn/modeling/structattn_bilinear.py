"""Structured bilinear scoring functions (paper §3.2, App. B, App. D): bilinear MLR and bilinear BTT.

Both replace the rank-r form ``W_Q W_K^T`` of a head with a structured D x D matrix and are evaluated as
(wider) queries and keys followed by one fused attention call:
  * bilinear MLR: level l splits x into p_l = 2^(l-1) chunks of D/p_l features, each with its own
    ``W_Q^{l,k}, W_K^{l,k}`` of shape (D/p_l, H*r_l); a head's query is the concatenation over levels and
    chunks (width ``sum_l p_l r_l``), same for the key. Rank ``min(D, sum_l p_l r_l)``.
  * bilinear BTT: per head ``M_h = P_L (+)_b L P_R (+)_c R^T`` with ``a*b = c*d = D`` and BTT rank s; the
    query is x itself (width D) and the key is ``M_h x`` (App. D.2's efficient order). Full rank.
"""

import math
from typing import Optional, Sequence

import torch
from torch import nn
from transformers import initialization as init

from .structattn_config_rules import MLR_SCALINGS, check_int, check_ranks


def bilinear_level_scales(widths: Sequence[int], scaling: str, constant: float = 1.0) -> list[float]:
    """Logit multiplier per level of query/key width w: ``C/sqrt(w)`` ("standard") or ``C/w`` ("mup", App. E),
    with App. E's tunable constant ``C``."""
    return [constant * ((width ** -0.5) if scaling == "standard" else 1.0 / width) for width in widths]


def rms_clamped(weight: torch.Tensor, fan_in: int, fan_out: int) -> torch.Tensor:
    """The authors' RMS weight normalisation of a structured factor (paper App. E, after Qiu et al. 2024):
    ``W / max(1, rms(W) / tau)`` with ``tau = sqrt(min(fan_in, fan_out)) / fan_in``. Differentiable; a tensor
    ``clamp`` (no host sync, unlike the authors' Python ``max``)."""
    tau = math.sqrt(min(fan_in, fan_out)) / fan_in
    rms = weight.pow(2).mean().sqrt()
    return weight / (rms / tau).clamp(min=1.0)


def validate_bilinear_mlr(hidden_size: int, num_heads: int, ranks: Sequence[int], field: str = "bilinear_mlr_ranks",
                          hidden_field: str = "hidden size") -> list[int]:
    """The bilinear-MLR level ranks as a list, else ``ValueError`` naming the field: positive integers, and the
    hidden size divisible by the 2^(L-1) feature chunks of the finest level."""
    ranks = check_ranks(ranks, field)
    chunks = 2 ** (len(ranks) - 1)
    if hidden_size % chunks:
        raise ValueError(f"{hidden_field}={hidden_size} must be divisible by 2^(L-1)={chunks} for {field}={ranks} "
                         f"(level L splits the features into {chunks} chunks)")
    return ranks


def default_btt_factors(hidden_size: int) -> tuple[int, int, int, int]:
    """(a, b, c, d) with a*b = c*d = D and b = d the smallest divisor of D that is >= sqrt(D) (the most balanced
    split; key cost ``T*D*s*(b + c)``)."""
    check_int("hidden size", hidden_size)
    beta = next(f for f in range(math.isqrt(hidden_size), hidden_size + 1) if f * f >= hidden_size and
                hidden_size % f == 0)
    return hidden_size // beta, beta, hidden_size // beta, beta


def validate_btt(hidden_size: int, factors: Optional[Sequence[int]], rank: int, field: str = "btt_factors",
                 rank_field: str = "btt_rank", hidden_field: str = "hidden size") -> tuple[int, int, int, int]:
    """The BTT factors (a, b, c, d) (the balanced default when None), else ``ValueError`` naming the field:
    four positive integers with a*b == c*d == hidden size, and a positive BTT rank."""
    check_int(rank_field, rank)
    if factors is None:
        return default_btt_factors(hidden_size)
    if isinstance(factors, (str, bytes)) or not hasattr(factors, "__iter__"):
        raise ValueError(f"{field} must be four positive integers (a, b, c, d), got {factors!r}")
    factors = tuple(factors)
    if len(factors) != 4 or any(isinstance(f, bool) or not isinstance(f, int) or f <= 0 for f in factors):
        raise ValueError(f"{field} must be four positive integers (a, b, c, d), got {factors!r}")
    a, b, c, d = factors
    if a * b != hidden_size or c * d != hidden_size:
        raise ValueError(f"{field}={list(factors)}: need a*b == c*d == {hidden_field} {hidden_size}, "
                         f"got a*b={a * b}, c*d={c * d}")
    return factors


def validate_bilinear_fields(config, variants: set, hidden_size: int, num_heads: int, hidden_field: str) -> None:
    """Check the bilinear fields of a config (either family) whose layers or roles use ``variants``; ``ValueError``
    naming the field."""
    if "bilinear_mlr" in variants:
        if config.bilinear_mlr_ranks is None:
            raise ValueError("bilinear_mlr_ranks is required when an attention layer or role is 'bilinear_mlr'")
        validate_bilinear_mlr(hidden_size, num_heads, config.bilinear_mlr_ranks, hidden_field=hidden_field)
    if variants & {"bilinear_mlr", "bilinear_btt"} and config.bilinear_scaling not in MLR_SCALINGS:
        raise ValueError(f"bilinear_scaling={config.bilinear_scaling!r} is not one of {MLR_SCALINGS}")
    if "bilinear_btt" in variants:
        validate_btt(hidden_size, config.btt_factors, config.btt_rank, hidden_field=hidden_field)


def init_fan_in_normal_(module: nn.Module, factor: float = 1.0) -> None:
    """Draw every parameter named in ``module.fan_ins()`` from ``N(0, factor^2 / fan_in)``, through
    ``transformers.initialization`` so that weights loaded by ``from_pretrained`` are left alone."""
    for name, fan_in in module.fan_ins().items():
        init.normal_(module.get_parameter(name), mean=0.0, std=factor * fan_in ** -0.5)


class BilinearMLRProjection(nn.Module):
    """Structured query or key projection of bilinear MLR.

    Parameters ``weights.{l}``: (p_l, D/p_l, H*r_l). forward: x (B, T, D) -> (B, H, T, sum_l p_l r_l), laid out
    level by level, chunk-major within a level.
    """

    def __init__(self, hidden_size: int, num_heads: int, ranks: Sequence[int], rms_clamp: bool = False):
        super().__init__()
        validate_bilinear_mlr(hidden_size, num_heads, ranks)
        self.hidden_size, self.num_heads, self.ranks = hidden_size, num_heads, list(ranks)
        self.rms_clamp = rms_clamp
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(2 ** level, hidden_size // 2 ** level, num_heads * rank))
            for level, rank in enumerate(self.ranks)
        )
        self.reset_parameters()

    @property
    def level_widths(self) -> list[int]:
        return [2 ** level * rank for level, rank in enumerate(self.ranks)]

    def fan_ins(self) -> dict[str, int]:
        """Fan-in of each parameter by name: level l's chunk projection reads D/p_l features."""
        return {f"weights.{level}": weight.shape[1] for level, weight in enumerate(self.weights)}

    def reset_parameters(self, factor: float = 1.0):
        """``N(0, factor^2 / fan_in)`` (paper App. E; T5 passes its ``initializer_factor``). The one place of this
        formula: both families' ``_init_weights`` call it, and it skips tensors transformers marked as loaded."""
        init_fan_in_normal_(self, factor)

    def forward(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """x (B, T, D) -> list over levels of (B, H, T, p_l r_l)."""
        batch, length, _ = hidden_states.shape
        levels = []
        for weight, rank in zip(self.weights, self.ranks):
            chunks = weight.shape[0]
            x = hidden_states.reshape(batch * length, chunks, -1).transpose(0, 1)  # (p, BT, D/p)
            if self.rms_clamp:
                weight = rms_clamped(weight, weight.shape[1], weight.shape[2])
            y = torch.bmm(x, weight)  # (p, BT, H*r)
            y = y.view(chunks, batch, length, self.num_heads, rank).permute(1, 3, 2, 0, 4)
            levels.append(y.reshape(batch, self.num_heads, length, chunks * rank))
        return levels


class BilinearBTTKeyProjection(nn.Module):
    """Key side of bilinear BTT: ``k_h(x) = M_h x`` for every head.

    Parameters ``weight_r``: (c, d, H*b*s) holds R_k; ``weight_l``: (H*b, a, c*s) holds L_k' per head.
    forward: x (B, T, D) -> (B, H, T, D).
    """

    def __init__(self, hidden_size: int, num_heads: int, factors: Optional[Sequence[int]] = None, rank: int = 1,
                 rms_clamp: bool = False):
        super().__init__()
        factors = validate_btt(hidden_size, factors, rank)
        self.hidden_size, self.num_heads, self.factors, self.rank = hidden_size, num_heads, factors, rank
        self.rms_clamp = rms_clamp
        a, b, c, d = factors
        self.weight_r = nn.Parameter(torch.empty(c, d, num_heads * b * rank))
        self.weight_l = nn.Parameter(torch.empty(num_heads * b, a, c * rank))
        self.reset_parameters()

    def fan_ins(self) -> dict[str, int]:
        """Fan-in of each parameter by name: R reads d features, L reads c*s."""
        a, b, c, d = self.factors
        return {"weight_r": d, "weight_l": c * self.rank}

    def reset_parameters(self, factor: float = 1.0):
        """``N(0, factor^2 / fan_in)`` per factor (see ``BilinearMLRProjection.reset_parameters``)."""
        init_fan_in_normal_(self, factor)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        a, b, c, d = self.factors
        heads, rank = self.num_heads, self.rank
        batch, length, _ = hidden_states.shape
        weight_r, weight_l = self.weight_r, self.weight_l
        if self.rms_clamp:  # fan-in d -> fan-out H*b*s; fan-in c*s -> fan-out a
            weight_r = rms_clamped(weight_r, d, heads * b * rank)
            weight_l = rms_clamped(weight_l, c * rank, a)
        x = hidden_states.reshape(batch * length, c, d).transpose(0, 1)  # (c, N, d)
        y = torch.bmm(x, weight_r)  # (c, N, H*b*s): block k applies R_k^T
        # P_R: (c, b, s) -> (b, c, s), per head
        y = y.view(c, batch * length, heads, b, rank).permute(2, 3, 1, 0, 4).reshape(heads * b, batch * length, c * rank)
        z = torch.bmm(y, weight_l.transpose(1, 2))  # (H*b, N, a): block k' applies L_k'
        # P_L: (b, a) -> (a, b)
        z = z.view(heads, b, batch, length, a).permute(2, 0, 3, 4, 1)
        return z.reshape(batch, heads, length, a * b)
