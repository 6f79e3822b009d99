"""What the configs of every family share: validators of their fields (errors name the field), the per-level logit
scales, default block sizes, the per-layer attention kinds, and the hooks a config class runs (the first config of a
class registers its models; one-line field errors). Part of the checkpoint payload.

Conventions (paper §3.4):
  * ``ranks`` = (r_1, ..., r_L), ``sum(ranks) == head_dim``; level slices are contiguous prefixes of the
    head dim in level order ``[q_1 | q_2 | ... | q_L]``.
  * ``block_sizes`` = (b_2, ..., b_L) for levels 2..L; level 1 is always global. Blocks are nested
    (``b_{l+1}`` divides ``b_l``) and aligned to absolute positions: positions ``i, j`` share level ``l``
    iff ``i // b_l == j // b_l``.
"""

import math
import numbers
from typing import Optional, Sequence, Union

import torch

MLR_SCALINGS = ("standard", "mup")


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
    for name in positive_ints:
        check_int(name, getattr(config, name))
    for name in non_negative_floats:
        check_non_negative(name, getattr(config, name))


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
    if isinstance(scales, torch.Tensor):  # a 0-d tensor is a number, a 1-d one a list of per-level numbers
        if scales.dim() > 1 or scales.is_complex() or not (scales.is_floating_point() or scales.dim() == 0):
            raise ValueError(f"{field} must be a number or one number per level, got a tensor of shape "
                             f"{tuple(scales.shape)} and dtype {scales.dtype}")
        scales = float(scales) if scales.dim() == 0 else [float(value) for value in scales]
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


# The per-layer attention kinds of every family, in transformers' ``layer_types`` vocabulary where one exists.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
MLR_ATTENTION = "mlr_attention"
BILINEAR_MLR_ATTENTION = "bilinear_mlr_attention"
BILINEAR_BTT_ATTENTION = "bilinear_btt_attention"
ATTENTION_KINDS = (FULL_ATTENTION, MLR_ATTENTION, SLIDING_ATTENTION, BILINEAR_MLR_ATTENTION, BILINEAR_BTT_ATTENTION)
# the short variant names of the configs' ``attention`` / ``*_attention`` fields
VARIANT_KINDS = {"dense": FULL_ATTENTION, "mlr": MLR_ATTENTION, "swa": SLIDING_ATTENTION,
                 "bilinear_mlr": BILINEAR_MLR_ATTENTION, "bilinear_btt": BILINEAR_BTT_ATTENTION}
KIND_VARIANTS = {kind: variant for variant, kind in VARIANT_KINDS.items()}



# Callbacks run once per config class, when the first config of that class is built: the installed package registers
# its model classes with the Auto classes there, so that importing it builds none (transformers' modeling code is the
# expensive import). A payload loaded as remote code has its own, empty list.
FIRST_CONFIG_HOOKS: list = []
_announced: set = set()


def announce_config(config) -> None:
    """Run ``FIRST_CONFIG_HOOKS`` for ``type(config)`` if no config of that class was built before."""
    config_class = type(config)
    if config_class in _announced:
        return
    _announced.add(config_class)
    for hook in list(FIRST_CONFIG_HOOKS):
        hook(config_class)


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "").replace("NoneType", "None")


def one_line_field_errors(cls):
    """Class decorator, applied after ``@strict``: a field set to a value of the wrong type (at construction, by
    ``from_pretrained`` or by assignment) raises a one-line ``ValueError`` naming the field, the value and the
    accepted types, instead of huggingface_hub's multi-line ``StrictDataclassFieldValidationError``."""
    strict_setattr = cls.__setattr__

    def __setattr__(self, name, value):
        try:
            strict_setattr(self, name, value)
        except Exception as error:  # huggingface_hub's error class: matched by name (the payload imports no hub)
            if not type(error).__name__.startswith("StrictDataclass"):
                raise
            fields = getattr(type(self), "__dataclass_fields__", {})
            expected = _type_name(fields[name].type) if name in fields else "its declared type"
            raise ValueError(f"{name}={value!r} ({type(value).__name__}) is not a valid value of the config field "
                             f"{name}: expected {expected}") from None

    cls.__setattr__ = __setattr__
    return cls


class StructAttnConfigMixin:
    """Placed before the transformers config class; subclasses define ``_validate_structured_attention``."""

    def validate_architecture(self):
        """transformers' strict-config hook: runs at construction and again at ``save_pretrained``, so a field
        changed after construction cannot be saved into an invalid config."""
        super().validate_architecture()
        self._validate_structured_attention()




__all__ = ["ATTENTION_KINDS", "BILINEAR_BTT_ATTENTION", "BILINEAR_MLR_ATTENTION", "FIRST_CONFIG_HOOKS",
           "FULL_ATTENTION", "KIND_VARIANTS", "MLR_ATTENTION", "MLR_SCALINGS", "SLIDING_ATTENTION",
           "StructAttnConfigMixin", "VARIANT_KINDS", "announce_config", "check_block_sizes", "check_int",
           "check_non_negative", "check_ranks", "default_block_sizes", "is_positive_scale", "one_line_field_errors",
           "resolve_level_scales", "validate_config_numbers", "validate_mlr_geometry"]
