"""The level rule of MLR attention, in one place: how the per-level dot products of a (query, key) pair combine.

A pair that shares ``d`` levels (its *depth*: level 1 always, level l >= 2 when both positions are in the same
level-l block) scores

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


def pair_depth(query_positions: torch.Tensor, key_positions: torch.Tensor, block_sizes: Sequence[int]) -> torch.Tensor:
    """(B, Tq, Tk) int64 in 1..L: the number of levels every (query, key) pair shares. query_positions (B, Tq),
    key_positions (B, Tk)."""
    depth = torch.ones(query_positions.shape[0], query_positions.shape[1], key_positions.shape[1],
                       dtype=torch.long, device=query_positions.device)
    for size in block_sizes:
        depth = depth + ((query_positions[:, :, None] // size) == (key_positions[:, None, :] // size)).long()
    return depth


__all__ = ["depth_scale_vector", "depth_weight", "level_multipliers", "level_prefix_widths", "pair_depth"]
