"""Level geometry of MLR attention: validation, default block sizes, per-level scales.

Part of the checkpoint payload (only torch/transformers imports, flat relative imports).

Conventions (DESIGN.md §2):
  * ``ranks`` = (r_1, ..., r_L), ``sum(ranks) == head_dim``; level slices are contiguous prefixes of the
    head dim in level order ``[q_1 | q_2 | ... | q_L]``.
  * ``block_sizes`` = (b_2, ..., b_L) for levels 2..L; level 1 is always global. Blocks are nested
    (``b_{l+1}`` divides ``b_l``) and aligned to absolute positions: positions ``i, j`` share level ``l``
    iff ``i // b_l == j // b_l``.
  * the "depth" of a pair is the number of levels it shares (1..L); nested blocks make the shared levels
    a prefix, so a depth-d pair scores with the first ``r_1 + ... + r_d`` dims.
"""

import math
from typing import Optional, Sequence, Union

import torch

MLR_SCALINGS = ("standard", "mup")
MASK_VALUE = -1e30
"""Additive value for masked pairs. Finite on purpose: a group whose keys are all masked then has a finite
log-sum-exp and contributes exactly zero weight when merged, where ``-inf`` would produce NaN."""


def default_block_sizes(n_positions: int, num_levels: int) -> list[int]:
    """Dyadic blocks ``b_l = n_positions / 2^(l-1)`` for levels 2..L (paper §3.4)."""
    if num_levels < 1:
        raise ValueError(f"mlr_ranks must name at least one level, got {num_levels} levels")
    sizes = []
    for level in range(2, num_levels + 1):
        divisor = 2 ** (level - 1)
        if n_positions % divisor:
            raise ValueError(
                f"n_positions={n_positions} is not divisible by 2^{level - 1}={divisor}: the default dyadic "
                f"mlr_block_sizes need it; pass mlr_block_sizes explicitly"
            )
        sizes.append(n_positions // divisor)
    return sizes


def validate_mlr_geometry(ranks: Sequence[int], block_sizes: Sequence[int], head_dim: Optional[int] = None,
                          ranks_field: str = "ranks", blocks_field: str = "block_sizes") -> None:
    """Raise ``ValueError`` naming the field for any invalid rank split or block geometry."""
    ranks = list(ranks)
    block_sizes = list(block_sizes)
    if len(ranks) == 0:
        raise ValueError(f"{ranks_field} must not be empty")
    for rank in ranks:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"{ranks_field} must be positive integers, got {ranks}")
    if head_dim is not None and sum(ranks) != head_dim:
        raise ValueError(f"{ranks_field}={ranks} sums to {sum(ranks)}, but the head dim is {head_dim}")
    if len(block_sizes) != len(ranks) - 1:
        raise ValueError(
            f"{blocks_field}={block_sizes} must give one block size per level 2..L "
            f"({len(ranks) - 1} values for {ranks_field}={ranks})"
        )
    for size in block_sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"{blocks_field} must be positive integers, got {block_sizes}")
    for coarse, fine in zip(block_sizes, block_sizes[1:]):
        if fine >= coarse or coarse % fine:
            raise ValueError(
                f"{blocks_field}={block_sizes} are not nested: each block size must be a proper divisor of the "
                f"previous one ({fine} vs {coarse})"
            )


def resolve_level_scales(ranks: Sequence[int], scales: Union[None, str, float, Sequence[float]],
                         field: str = "scales") -> list[float]:
    """Per-level logit multipliers ``alpha_l``.

    ``None`` or ``"standard"``: ``1/sqrt(r)`` on every level (r = sum of ranks); ``"mup"``: ``1/r_l``;
    a float: that value on every level (T5 uses 1.0); a sequence: one value per level.
    """
    head_dim = sum(ranks)
    if scales is None or scales == "standard":
        return [1.0 / math.sqrt(head_dim)] * len(ranks)
    if scales == "mup":
        return [1.0 / rank for rank in ranks]
    if isinstance(scales, str):
        raise ValueError(f"{field}={scales!r} is not one of {MLR_SCALINGS}, a number or a list of numbers")
    if isinstance(scales, (int, float)):
        return [float(scales)] * len(ranks)
    scales = [float(s) for s in scales]
    if len(scales) != len(ranks):
        raise ValueError(f"{field}={scales} must have one value per level ({len(ranks)} levels)")
    return scales


def level_prefix_widths(ranks: Sequence[int]) -> list[int]:
    """``c_d = r_1 + ... + r_d`` for d = 1..L."""
    widths, total = [], 0
    for rank in ranks:
        total += rank
        widths.append(total)
    return widths


def depth_scale_vector(ranks: Sequence[int], level_scales: Sequence[float], depth: int, average_levels: bool,
                       dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Multiplier per head dim for a pair of the given depth: ``alpha_l`` on the dims of levels <= depth
    (divided by ``depth`` when averaging over shared levels), 0 beyond. Shape (r,)."""
    parts = []
    for level, (rank, scale) in enumerate(zip(ranks, level_scales), start=1):
        value = (scale / depth if average_levels else scale) if level <= depth else 0.0
        parts.append(torch.full((rank,), value, dtype=dtype, device=device))
    return torch.cat(parts)


def pair_depth(query_positions: torch.Tensor, key_positions: torch.Tensor, block_sizes: Sequence[int]) -> torch.Tensor:
    """Number of levels shared by every (query, key) pair.

    query_positions: (B, Tq), key_positions: (B, Tk) -> (B, Tq, Tk) int64 in 1..L.
    """
    depth = torch.ones(query_positions.shape[0], query_positions.shape[1], key_positions.shape[1],
                       dtype=torch.long, device=query_positions.device)
    for size in block_sizes:
        same = (query_positions[:, :, None] // size) == (key_positions[:, None, :] // size)
        depth = depth + same.long()
    return depth
