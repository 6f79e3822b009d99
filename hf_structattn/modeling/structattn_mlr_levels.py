"""The level rule of MLR attention, in one place: which levels a (query, key) pair shares and how their per-level
dot products combine.

A pair's *depth* is the number of levels it shares: level 1 always, and level l >= 2

* under ``level_rule="blocks"`` (the paper's, the default) when both positions are in the same level-l block
  (blocks of ``b_l`` positions aligned to position 0);
* under ``level_rule="nearest"`` when the positions are fewer than ``b_l`` apart (a sliding window of the level's
  size: a token's nearest keys at full width, farther ones coarser). For pretrained decoders patched without
  training: no token loses its nearest neighbours' fine dims at a block start, and a cache keeps the same ring of
  ``b_l`` entries per level (its last ``b_l`` keys), so the bytes are the blocks'.

Nested sizes make the shared levels a prefix under either rule. The pair scores

    s = depth_weight(d) * sum_{l <= d} alpha_l <q_l, k_l>

with ``alpha_l`` the level scales (``MLRGeometry.scales``) and ``depth_weight(d)`` = 1, or ``1 / d`` when the geometry
averages over shared levels (the authors' LM runs). Every formulation -- the reference, the fused CPU op, the
materialised op, the three cached reads -- takes its per-pair multipliers from ``depth_weight`` /
``level_multipliers`` here; the Triton kernel (``structattn_triton``, its ``AVERAGE`` branches) implements the same
rule in its own language and names this module there. Changing the averaging rule is an edit of ``depth_weight``
(and of that kernel branch).
"""

from typing import Sequence

import torch


def depth_weight(depth, average_levels: bool):
    """The multiplier of a pair's summed level scores, given the number of levels it shares: ``depth`` an int or a
    floating tensor of depths (any shape); returns 1.0, or ``1 / depth`` when ``average_levels``."""
    if not average_levels:
        return 1.0
    return depth.reciprocal() if isinstance(depth, torch.Tensor) else 1.0 / depth


def level_multipliers(level_scales: Sequence[float], depth: int, average_levels: bool) -> list:
    """Per level, the multiplier of its dot product in a pair of ``depth`` shared levels: ``alpha_l *
    depth_weight(depth)`` for the shared levels, 0 for the others."""
    weight = depth_weight(depth, average_levels)
    return [scale * weight if level <= depth else 0.0 for level, scale in enumerate(level_scales, start=1)]


def depth_scale_vector(ranks: Sequence[int], level_scales: Sequence[float], depth: int, average_levels: bool,
                       dtype: torch.dtype, device) -> torch.Tensor:
    """(r,) the multiplier of every head dim in a pair of ``depth`` shared levels (``level_multipliers`` per dim):
    folded into a query, the pair's score is one dot product."""
    multipliers = level_multipliers(level_scales, depth, average_levels)
    return torch.tensor([value for value, rank in zip(multipliers, ranks) for _ in range(rank)], dtype=dtype,
                        device=device)


def level_prefix_widths(ranks: Sequence[int]) -> list:
    """``c_d = r_1 + ... + r_d`` for d = 1..L: the dims a pair of depth d uses."""
    widths, total = [], 0
    for rank in ranks:
        total += rank
        widths.append(total)
    return widths


LEVEL_RULES = ("blocks", "nearest")


def check_level_rule(level_rule, field: str = "mlr_level_rule") -> str:
    """``level_rule`` when it is one of ``LEVEL_RULES``; else a one-line ValueError naming ``field``."""
    if level_rule not in LEVEL_RULES:
        raise ValueError(f"{field}={level_rule!r} is not one of {LEVEL_RULES}: 'blocks' (the paper's blocks aligned "
                         f"to position 0) or 'nearest' (level l for keys fewer than b_l positions away)")
    return level_rule


def shares_level(query_positions: torch.Tensor, key_positions: torch.Tensor, size, level_rule: str = "blocks"
                 ) -> torch.Tensor:
    """(B, Tq, Tk) bool: whether each (query, key) pair shares the level of size ``size`` (an int, or a (Tk,) long
    tensor: each key's level) under ``level_rule``. query_positions (B, Tq), key_positions (B, Tk)."""
    if level_rule == "nearest":
        return (query_positions[:, :, None] - key_positions[:, None, :]).abs() < size
    return (query_positions[:, :, None] // size) == (key_positions[:, None, :] // size)


def pair_depth(query_positions: torch.Tensor, key_positions: torch.Tensor, block_sizes: Sequence[int],
               level_rule: str = "blocks") -> torch.Tensor:
    """(B, Tq, Tk) int64 in 1..L: the number of levels every (query, key) pair shares under ``level_rule``.
    query_positions (B, Tq), key_positions (B, Tk)."""
    depth = torch.ones(query_positions.shape[0], query_positions.shape[1], key_positions.shape[1],
                       dtype=torch.long, device=query_positions.device)
    for size in block_sizes:
        depth = depth + shares_level(query_positions, key_positions, size, level_rule).long()
    return depth


__all__ = ["LEVEL_RULES", "check_level_rule", "depth_scale_vector", "depth_weight", "level_multipliers",
           "level_prefix_widths", "pair_depth", "shares_level"]
