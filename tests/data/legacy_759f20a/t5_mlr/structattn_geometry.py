"""Level geometry of MLR attention: validation, default block sizes, per-level scales.

Part of the checkpoint payload (only torch/transformers imports, flat relative imports).

Conventions (paper §3.4):
  * ``ranks`` = (r_1, ..., r_L), ``sum(ranks) == head_dim``; level slices are contiguous prefixes of the
    head dim in level order ``[q_1 | q_2 | ... | q_L]``.
  * ``block_sizes`` = (b_2, ..., b_L) for levels 2..L; level 1 is always global. Blocks are nested
    (``b_{l+1}`` divides ``b_l``) and aligned to absolute positions: positions ``i, j`` share level ``l``
    iff ``i // b_l == j // b_l``.
  * the "depth" of a pair is the number of levels it shares (1..L); nested blocks make the shared levels
    a prefix, so a depth-d pair scores with the first ``r_1 + ... + r_d`` dims.
"""

import math
import numbers
from typing import Optional, Sequence, Union

import torch

MLR_SCALINGS = ("standard", "mup")
MASK_VALUE = -1e30
"""Legacy float32-only fill; use ``mask_value(dtype)`` (finite in every dtype) in new code."""


def mask_value(dtype: torch.dtype) -> float:
    """Additive value for masked pairs, finite in ``dtype``: half its lowest value, so a mask plus a bias (or a
    second mask) of up to the same magnitude stays finite. Finite on purpose: a group whose keys are all masked
    then has a finite log-sum-exp and contributes exactly zero weight when merged, where ``-inf`` gives NaN."""
    return torch.finfo(dtype).min / 2


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Working dtype of a softmax over scores of ``dtype``: at least float32 (fp16/bf16 scores are upcast), and
    float64 stays float64 so float64 paths are exact to ~1e-12."""
    return torch.promote_types(dtype, torch.float32)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_length: bool = True) -> None:
    """Raise ``ValueError`` unless q, k (B, H, Tq|Tk, E) and v (B, H, Tk, dv) share one floating dtype and
    consistent shapes, with at least one query and one key."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, T, E); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype (float16, bfloat16, float32 or float64); got "
                         f"q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1] or v.shape[:3] != k.shape[:3] or (
            same_length and k.shape[2] != q.shape[2]):
        raise ValueError(f"expected q, k of shape (B, H, T, r) and v of shape (B, H, T, dv); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"attention needs at least one query and one key position; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)} (sequence length 0)")


def keep_mask(attention_mask: Optional[torch.Tensor], batch: int, length: int, device=None,
              name: str = "attention_mask") -> Optional[torch.Tensor]:
    """The (B, T) bool keep-mask (True = attend) of a (B, T) or (1, T) mask, or None.

    Accepted: bool, or integer / floating tensors holding only 0 and 1 (what tokenizers return, also as float).
    An additive mask (0 = attend, -inf or a large negative number = masked) is refused rather than guessed: read
    as a keep-mask it would be silently inverted."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape ({batch}, {length}), got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2 or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[1] != length:
        raise ValueError(f"{name} must have shape ({batch}, {length}) (batch, key positions; 1 = attend), got "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.dtype != torch.bool:
        if attention_mask.is_complex():
            raise ValueError(f"{name} must be a bool, integer or 0/1 float keep-mask, got {attention_mask.dtype}")
        outside = (attention_mask != 0) & (attention_mask != 1)
        if bool(outside.any()):
            value = float(attention_mask[outside].flatten()[0])
            raise ValueError(f"{name} must be a keep-mask holding only 0 and 1 (1 = attend), got a {attention_mask.dtype} "
                             f"mask holding {value}: additive masks (0 = attend, -inf = masked) are not accepted; "
                             f"pass (mask == 0) instead")
    return attention_mask.to(device=device).bool().expand(batch, length)


def check_positions(positions: Optional[torch.Tensor], batch: int, length: int, device=None,
                    name: str = "positions") -> Optional[torch.Tensor]:
    """(B, T) int64 positions from a (B, T), (1, T) or (T,) integer tensor, or None."""
    if positions is None:
        return None
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.is_complex() \
            or positions.dtype == torch.bool:
        kind = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"{name} must be an integer tensor of shape ({batch}, {length}), got {kind}")
    if positions.dim() == 1:
        positions = positions[None]
    if positions.dim() != 2 or positions.shape[0] not in (1, batch) or positions.shape[1] != length:
        raise ValueError(f"{name} must have shape ({batch}, {length}) (or ({length},)), got {tuple(positions.shape)}")
    return positions.to(device=device, dtype=torch.long).expand(batch, length)


def check_bias(bias: Optional[torch.Tensor], shape: tuple, name: str = "bias") -> None:
    """Raise ``ValueError`` unless ``bias`` is a floating tensor broadcastable to ``shape`` (B, H, Tq, Tk)."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point:
        kind = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{name} must be a floating tensor broadcastable to {tuple(shape)}, got {kind}")
    if bias.dim() > 4:
        raise ValueError(f"{name} must be broadcastable to {tuple(shape)} (B, H, Tq, Tk), got {tuple(bias.shape)}")
    try:
        broadcast = torch.broadcast_shapes(tuple(bias.shape), tuple(shape))
    except RuntimeError:
        broadcast = None
    if broadcast != tuple(shape):
        raise ValueError(f"{name} must be broadcastable to {tuple(shape)} (B, H, Tq, Tk), got {tuple(bias.shape)}")


def check_int(field: str, value, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum``, else ``ValueError`` naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def check_non_negative(field: str, value) -> float:
    """``value`` if it is a finite number >= 0 (epsilons, dropout rates, init scales), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{field} must be a finite number >= 0, got {value!r}")
    return value


def is_positive_scale(value) -> bool:
    """A logit multiplier must be a finite number > 0: NaN and inf poison every score, 0 erases the level, and the
    fused CPU kernel cannot take a negative scale."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value) and value > 0


def validate_config_numbers(config, positive_ints: Sequence[str], non_negative_floats: Sequence[str] = ()) -> None:
    """Raise ``ValueError`` naming the field unless each of ``positive_ints`` is an integer >= 1 and each of
    ``non_negative_floats`` a finite number >= 0. Shared by the GPT-2 and T5 configs."""
    for field in positive_ints:
        check_int(field, getattr(config, field))
    for field in non_negative_floats:
        check_non_negative(field, getattr(config, field))


def check_ranks(ranks, field: str = "ranks") -> list[int]:
    """Level ranks as a list: a non-empty sequence of positive integers, else ``ValueError`` naming the field."""
    if ranks is None:
        raise ValueError(f"{field} is required for this variant, got None")
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise ValueError(f"{field} must be a sequence of positive integers, got {ranks!r}")
    ranks = list(ranks)
    if not ranks:
        raise ValueError(f"{field} must name at least one level, got {ranks!r}")
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"{field} must be positive integers, got {ranks!r}")
    return ranks


def check_block_sizes(block_sizes, num_levels: int, field: str = "block_sizes",
                      ranks_field: str = "ranks") -> list[int]:
    """Block sizes of levels 2..L as a list: one positive integer per level, strictly nested (each a proper
    divisor of the previous one, which the group decomposition needs), else ``ValueError`` naming the field."""
    if isinstance(block_sizes, (str, bytes)) or not hasattr(block_sizes, "__iter__"):
        raise ValueError(f"{field} must be a sequence of positive integers, got {block_sizes!r}")
    block_sizes = list(block_sizes)
    if len(block_sizes) != num_levels - 1:
        raise ValueError(f"{field}={block_sizes} must give one block size per level 2..L "
                         f"({num_levels - 1} values for the {num_levels} levels of {ranks_field})")
    for size in block_sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{field} must be positive integers, got {block_sizes!r}")
    for coarse, fine in zip(block_sizes, block_sizes[1:]):
        if fine >= coarse or coarse % fine:
            raise ValueError(f"{field}={block_sizes} are not nested: each block size must be a proper divisor of "
                             f"the previous one ({fine} vs {coarse})")
    return block_sizes


def default_block_sizes(n_positions: int, num_levels: int, field: str = "n_positions") -> list[int]:
    """Dyadic blocks ``b_l = n_positions / 2^(l-1)`` for levels 2..L (paper §3.4)."""
    check_int(field, n_positions)
    if isinstance(num_levels, bool) or not isinstance(num_levels, int) or num_levels < 1:
        raise ValueError(f"mlr_ranks must name at least one level, got {num_levels} levels")
    divisor = 2 ** (num_levels - 1)
    if n_positions % divisor:
        raise ValueError(f"{field}={n_positions} is not divisible by 2^{num_levels - 1}={divisor}, which the "
                         f"default dyadic block sizes of {num_levels} levels need; pass the block sizes explicitly")
    return [n_positions // 2 ** (level - 1) for level in range(2, num_levels + 1)]


def validate_mlr_geometry(ranks: Sequence[int], block_sizes: Sequence[int], head_dim: Optional[int] = None,
                          ranks_field: str = "ranks", blocks_field: str = "block_sizes") -> None:
    """Raise ``ValueError`` naming the field for any invalid rank split or block geometry."""
    if ranks is not None and not isinstance(ranks, (str, bytes)) and hasattr(ranks, "__len__") and len(ranks) == 0:
        raise ValueError(f"{ranks_field} must not be empty")
    ranks = check_ranks(ranks, ranks_field)
    if head_dim is not None and sum(ranks) != head_dim:
        raise ValueError(f"{ranks_field}={ranks} sums to {sum(ranks)}, but the head dim is {head_dim}")
    check_block_sizes(block_sizes, len(ranks), blocks_field, ranks_field)


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
    if isinstance(scales, bool):
        raise ValueError(f"{field}={scales!r} is not one of {MLR_SCALINGS}, a number or a list of numbers")
    values = [scales] * len(ranks) if isinstance(scales, numbers.Real) else list(scales)
    if len(values) != len(ranks):
        raise ValueError(f"{field}={values} must have one value per level ({len(ranks)} levels)")
    for value in values:
        if not is_positive_scale(value):
            raise ValueError(f"{field}={scales!r}: every level scale must be a finite number > 0, got {value!r}")
    return [float(value) for value in values]


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


class StructAttnConfigMixin:
    """Placed before the transformers config class; subclasses define ``_validate_structured_attention``."""

    def validate_architecture(self):
        """transformers' strict-config hook: runs at construction and again at ``save_pretrained``, so a field
        changed after construction cannot be saved into an invalid config."""
        super().validate_architecture()
        self._validate_structured_attention()

