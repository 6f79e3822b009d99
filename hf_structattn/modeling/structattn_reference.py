"""Naive reference implementations: the executable specification of every attention variant.

Each function materialises the full score matrix exactly as the paper writes it. They are slow (O(T^2)
memory) and used only by tests and as the last-resort fallback; no model uses them by default.
"""

from typing import Optional, Sequence, Union

import torch

from .structattn_config_rules import resolve_level_scales, validate_mlr_geometry
from .structattn_inputs import check_bias, check_positions, check_qkv
from .structattn_masks import keep_mask, mask_value, softmax_dtype
from .structattn_mlr_levels import check_level_rule, depth_weight, pair_depth


def _positions_or_arange(positions: Optional[torch.Tensor], batch: int, length: int, device,
                         name: str = "positions") -> torch.Tensor:
    if positions is None:
        return torch.arange(length, device=device).expand(batch, length)
    return check_positions(positions, batch, length, device, name)


def query_key_positions(q: torch.Tensor, k: torch.Tensor, positions: Optional[torch.Tensor],
                        key_positions: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Tq) query and (B, Tk) key positions; keys default to the query positions when Tq == Tk, else arange."""
    batch, _, q_len, _ = q.shape
    k_len = k.shape[2]
    query_positions = _positions_or_arange(positions, batch, q_len, q.device)
    if key_positions is None:
        key_positions = query_positions if k_len == q_len else _positions_or_arange(None, batch, k_len, q.device)
    return query_positions, _positions_or_arange(key_positions, batch, k_len, q.device, "key_positions")


def masked_softmax(scores: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention probabilities (B, H, Tq, Tk) in the scores' dtype: softmax over keys, computed in at least float32,
    of the scores with disallowed pairs set to ``mask_value``. allowed: bool, broadcastable, True = attend."""
    if allowed is not None:
        scores = scores.masked_fill(~allowed, mask_value(scores.dtype))
    return torch.softmax(scores, dim=-1, dtype=softmax_dtype(scores.dtype)).to(scores.dtype)


def masked_softmax_attention(scores: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """``masked_softmax(scores, allowed) @ v``. scores (B,H,Tq,Tk), v (B,H,Tk,dv)."""
    return masked_softmax(scores, allowed).to(v.dtype) @ v


def allowed_pairs(query_positions: torch.Tensor, key_positions: torch.Tensor, causal: bool,
                  attention_mask: Optional[torch.Tensor], sliding_window: Optional[int] = None) -> torch.Tensor:
    """Boolean (B, 1, Tq, Tk): key allowed for query (causal by position, padding, optional window)."""
    allowed = torch.ones(query_positions.shape[0], 1, query_positions.shape[1], key_positions.shape[1],
                         dtype=torch.bool, device=query_positions.device)
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
    if causal:
        allowed = allowed & (distance >= 0)
    if sliding_window is not None:
        allowed = allowed & (distance.abs() < sliding_window)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    return allowed


def mlr_scores_reference(q: torch.Tensor, k: torch.Tensor, *, ranks: Sequence[int], block_sizes: Sequence[int],
                         scales: Union[None, str, float, Sequence[float]] = None,
                         positions: Optional[torch.Tensor] = None, key_positions: Optional[torch.Tensor] = None,
                         average_levels: bool = False, level_rule: str = "blocks") -> torch.Tensor:
    """MLR score matrix (B, H, Tq, Tk): ``sum over shared levels l of alpha_l <q_i[l], k_j[l]>``.

    q: (B, H, Tq, r), k: (B, H, Tk, r). Evaluated level by level with a dense shared-level indicator, as in
    the paper's ``S = sum_l blockdiag_k(Q_{l,k} K_{l,k}^T)``; ``level_rule`` as ``structattn_mlr_levels``'.
    """
    validate_mlr_geometry(ranks, block_sizes, q.shape[-1])
    level_scales = resolve_level_scales(ranks, scales)
    query_positions, key_positions = query_key_positions(q, k, positions, key_positions)
    depth = pair_depth(query_positions, key_positions, block_sizes, check_level_rule(level_rule))[:, None]
    scores = torch.zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=q.dtype, device=q.device)
    start = 0
    for level, (rank, scale) in enumerate(zip(ranks, level_scales), start=1):
        level_scores = q[..., start:start + rank] @ k[..., start:start + rank].transpose(-1, -2)
        scores = scores + scale * level_scores * (depth >= level)
        start += rank
    return scores * depth_weight(depth.to(scores.dtype), average_levels)


def mlr_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ranks: Sequence[int],
                            block_sizes: Sequence[int], causal: bool = True,
                            scales: Union[None, str, float, Sequence[float]] = None,
                            positions: Optional[torch.Tensor] = None, key_positions: Optional[torch.Tensor] = None,
                            attention_mask: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                            average_levels: bool = False, level_rule: str = "blocks") -> torch.Tensor:
    """Naive MLR attention. q, k: (B, H, Tq|Tk, r); v: (B, H, Tk, dv) -> (B, H, Tq, dv).

    positions: (B, Tq) absolute positions of the queries (default ``arange``); key_positions: (B, Tk)
    (default: the query positions when Tq == Tk). Causality compares positions. attention_mask: (B, Tk)
    keep-mask (bool or 0/1, 1 = attend; additive masks are refused). bias: additive, broadcastable to
    (B, H, Tq, Tk), added to every score. The softmax runs in ``promote_types(dtype, float32)``.
    """
    check_qkv(q, k, v, same_length=False)
    attention_mask = keep_mask(attention_mask, q.shape[0], k.shape[2], q.device)
    check_bias(bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    query_positions, key_positions = query_key_positions(q, k, positions, key_positions)
    # padding slots may carry any position (e.g. -1); only real tokens must be at non-negative positions
    real_keys = key_positions if attention_mask is None else key_positions[attention_mask]
    real_queries = query_positions if attention_mask is None or q.shape[2] != k.shape[2] else \
        query_positions[attention_mask]
    lowest = min([int(t.min()) for t in (real_keys, real_queries) if t.numel()] or [0])
    if lowest < 0:
        raise ValueError(f"positions must be non-negative for MLR attention (blocks are aligned to position 0), "
                         f"got {lowest}")
    scores = mlr_scores_reference(q, k, ranks=ranks, block_sizes=block_sizes, scales=scales,
                                  positions=query_positions, key_positions=key_positions,
                                  average_levels=average_levels, level_rule=level_rule)
    if bias is not None:
        scores = scores + bias
    allowed = allowed_pairs(query_positions, key_positions, causal, attention_mask)
    return masked_softmax_attention(scores, v, allowed)


def dense_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                              causal: bool = True, attention_mask: Optional[torch.Tensor] = None,
                              bias: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                              positions: Optional[torch.Tensor] = None,
                              key_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Standard (optionally sliding-window) attention, materialised. Window ``w`` keeps keys with
    ``|i - j| < w`` (w keys including the query itself when causal), as in transformers' ``sliding_window``."""
    check_qkv(q, k, v, same_length=False)
    attention_mask = keep_mask(attention_mask, q.shape[0], k.shape[2], q.device)
    check_bias(bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    query_positions, key_positions = query_key_positions(q, k, positions, key_positions)
    scores = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    allowed = allowed_pairs(query_positions, key_positions, causal, attention_mask, sliding_window)
    return masked_softmax_attention(scores, v, allowed)


def bilinear_mlr_matrix_reference(weight_q: Sequence[torch.Tensor], weight_k: Sequence[torch.Tensor], head: int,
                                  ranks: Sequence[int], level_scales: Sequence[float]) -> torch.Tensor:
    """The D x D bilinear form of one bilinear-MLR head: ``sum_l alpha_l blockdiag_k(W_Q^{l,k} W_K^{l,k T})``.

    weight_q[l], weight_k[l]: (p_l, D/p_l, H*r_l) with p_l = 2^(l-1) (paper eq. 4, App. B.1).
    """
    blocks_per_level = []
    for level, (wq, wk, rank, scale) in enumerate(zip(weight_q, weight_k, ranks, level_scales)):
        head_slice = slice(head * rank, (head + 1) * rank)
        diagonal = [wq[chunk][:, head_slice] @ wk[chunk][:, head_slice].T for chunk in range(wq.shape[0])]
        blocks_per_level.append(scale * torch.block_diag(*diagonal))
    return sum(blocks_per_level)


def btt_matrix_reference(weight_l: torch.Tensor, weight_r: torch.Tensor, head: int, a: int, b: int, c: int, d: int,
                         rank: int) -> torch.Tensor:
    """One head's D x D Block Tensor Train matrix ``P_L (+)_{k'=1..b} L_k' P_R (+)_{k=1..c} R_k^T`` (paper eq. 3).

    weight_r: (c, d, H*b*s) holds R_k (d x bs) per block k; weight_l: (H*b, a, c*s) holds L_k' (a x cs) per
    head and block k'. Built from explicit block-diagonal and permutation matrices.
    """
    dim = a * b
    right_blocks = [weight_r[k][:, head * b * rank:(head + 1) * b * rank].T for k in range(c)]  # each (b*s, d)
    right = torch.block_diag(*right_blocks)  # (c*b*s, c*d): rows indexed (k, beta, sigma)
    left_blocks = [weight_l[head * b + beta] for beta in range(b)]  # each (a, c*s)
    left = torch.block_diag(*left_blocks)  # (b*a, b*c*s): rows (beta, alpha), cols (beta, k, sigma)
    # P_R: (c, b, s) -> (b, c, s)
    perm_r = torch.arange(c * b * rank).reshape(c, b, rank).permute(1, 0, 2).reshape(-1)
    p_right = torch.zeros(c * b * rank, c * b * rank, dtype=right.dtype)
    p_right[torch.arange(c * b * rank), perm_r] = 1.0
    # P_L: (b, a) -> (a, b)
    perm_l = torch.arange(b * a).reshape(b, a).T.reshape(-1)
    p_left = torch.zeros(dim, dim, dtype=right.dtype)
    p_left[torch.arange(dim), perm_l] = 1.0
    return p_left @ left @ p_right @ right
