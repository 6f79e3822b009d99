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

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
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


_SOFTMAX_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
                   torch.float64: torch.float64}  # a constant table: ``torch.promote_types`` is a dispatched op


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Working dtype of a softmax over scores of ``dtype``: at least float32 (fp16/bf16 scores are upcast), and
    float64 stays float64 so float64 paths are exact to ~1e-12."""
    work = _SOFTMAX_DTYPES.get(dtype)
    return work if work is not None else torch.promote_types(dtype, torch.float32)


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
        if not torch.compiler.is_compiling() and bool(outside.any()):  # a host read: checked eagerly only
            value = float(attention_mask[outside].flatten()[0])
            raise ValueError(f"{name} must be a keep-mask holding only 0 and 1 (1 = attend), got a {attention_mask.dtype} "
                             f"mask holding {value}: additive masks (0 = attend, -inf = masked) are not accepted; "
                             f"pass (mask == 0) instead")
    return attention_mask.to(device=device).bool().expand(batch, length)


MASKED_AT_MOST = -1e4  # an additive (float) mask entry at or below this is "masked": its weight underflows to 0


def mask_allowed(mask: torch.Tensor) -> torch.Tensor:
    """The one mask rule: the bool form (True = attend) of any attention mask. bool: as is; integer: non-zero
    entries (a keep-mask); floating: an additive mask, 0 = attend (``check_additive_mask`` refuses any other value
    than 0 and values at or below ``MASKED_AT_MOST``: -inf, the dtype's lowest value, -1e4, -1e9, ...)."""
    if mask.dtype == torch.bool:
        return mask
    return mask == 0 if mask.is_floating_point() else mask != 0


def own_key_allowed(mask: torch.Tensor, offset) -> torch.Tensor:
    """(B | 1, T) whether each of the T queries of a 4-D mask (B | 1, H | 1, T, K) may see its own key, column
    ``offset + i`` (clamped to the mask), in at least one head: a caller's 4-D mask's real tokens."""
    length = mask.shape[-2]
    rows = torch.arange(length, device=mask.device)
    columns = (rows + offset).clamp(max=mask.shape[-1] - 1)
    return mask_allowed(mask[..., rows, columns]).any(1)


def check_mask_shape(mask: torch.Tensor, batch: int, heads: Optional[int], length: int, past: Optional[int] = None,
                     name: str = "attention_mask") -> None:
    """The one rule for the shape of a model's attention mask, in every family (GPT-2, T5, patched decoders) and on
    every path (uncached, prefill, chunk, decode step):

    * 2-D ``(B | 1, cached + new tokens)``: a keep-mask over the keys; one row is broadcast over the batch;
    * 4-D ``(B | 1, 1 | H, new tokens, >= cached + new tokens)`` (wider: a static cache's slots): a batch of one is
      broadcast over the batch, one head over the heads, and H masks are applied one per query head;
    * anything else is refused with one line naming the argument, its shape and the accepted shapes.

    ``heads``: the query heads (None: not checked); ``past``: the cached tokens, None while not known on the host
    (then only the new tokens are counted)."""
    shape = tuple(mask.shape)
    covered = length if past is None else past + length
    if mask.is_complex():
        raise ValueError(f"{name} must be a bool, integer or float mask, got {mask.dtype} of shape {shape}")
    if mask.dim() == 2:
        if shape[0] not in (1, batch) or (shape[1] != covered if past is not None else shape[1] < covered):
            expected = f"({batch}, {covered})" if past is not None else f"({batch}, cached + new tokens)"
            raise ValueError(f"{name} must have shape {expected} (batch, cached + new tokens; 1 = attend; a batch of "
                             f"1 is broadcast), got {shape}")
    elif mask.dim() == 4:
        if shape[0] not in (1, batch) or (heads is not None and shape[1] not in (1, heads)) or \
                shape[2] != length or shape[3] < covered:
            head_dim = "1" if heads is None or heads == 1 else f"1 or {heads}"
            raise ValueError(f"a 4-D {name} must have shape ({batch} or 1, {head_dim}, {length}, >= {covered}) "
                             f"(batch, heads, new tokens, cached + new tokens; a batch or head axis of 1 is "
                             f"broadcast), got {shape}")
    else:
        raise ValueError(f"{name} must be a (batch, cached + new tokens) keep-mask or a 4-D (batch, heads, new tokens, "
                         f"cached + new tokens) mask, got shape {shape}")


def check_additive_mask(mask: torch.Tensor, name: str = "attention_mask") -> None:
    """Refuse a float mask holding a score bias (a value other than 0 and at most ``MASKED_AT_MOST``) or NaN: MLR
    attention applies masks by which pairs attend, so a bias would be dropped silently and a NaN read as masked.
    One host read (eager only)."""
    if torch.compiler.is_compiling() or not mask.is_floating_point():
        return
    bias = ~((mask == 0) | (mask <= MASKED_AT_MOST))  # NaN is neither
    if bool(bias.any()):
        value = float(mask[bias].flatten()[0])
        raise ValueError(f"{name} is a float (additive) mask holding {value}: MLR attention reads a float mask as 0 = "
                         f"attend and <= {MASKED_AT_MOST:g} (e.g. -inf or the dtype's lowest value) = masked; pass "
                         f"additive score biases as a bias, or a bool mask (True = attend)")


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


_BUILT_GEOMETRIES: dict = {}


_FUNCTORCH_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def _is_traced(value) -> bool:
    """Whether ``value`` (a tensor, or a dict / tuple of them) was made while torch.compile or torch.export traced,
    or inside a ``torch.func`` transform: a fake or functional tensor, any tensor made inside a compiled region, or
    one that ``grad`` / ``vmap`` wrapped (a tensor made inside ``grad`` is one; kept, it outlives its transform and a
    later compiled step reads it as an input without storage)."""
    if torch.compiler.is_compiling():
        return True
    if dataclasses.is_dataclass(value):
        value = tuple(getattr(value, item.name) for item in dataclasses.fields(value))
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(item, torch.Tensor) and (type(item) is not torch.Tensor or item.is_meta or (
        _FUNCTORCH_WRAPPED is not None and _FUNCTORCH_WRAPPED(item))) for item in values)


class TensorMemo:
    """The few small device tensors an ``MLRGeometry`` derives (index constants, scale vectors), at most
    ``capacity`` entries (the oldest made goes first: a hit is one dict lookup, which every layer of a decode step
    pays). Nothing made while tracing is kept (a fake tensor of one ``torch.export`` would end up in the next one's
    constants). The tables are per level or per head dim, never per cache slot, so the memo stays a few hundred bytes
    whatever the caches hold (``hf_structattn.cache_memory.allocated_cache_bytes`` counts it)."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self.entries = {}

    def lookup(self, key):
        """The value memoised under ``key``, or None."""
        return self.entries.get(key)

    def get(self, key, make):
        """The value memoised under ``key``, else ``make()`` (kept unless traced)."""
        value = self.entries.get(key)
        if value is not None:
            return value
        value = make()
        if not _is_traced(value):
            self.entries[key] = value
            # (safe when two threads share the geometry: ``list`` of a dict and ``pop`` are atomic)
            for old in list(self.entries)[:-self.capacity]:
                self.entries.pop(old, None)
        return value

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True)
class MLRGeometry:
    """Everything MLR attention needs to know about one layer, validated once (by ``build``).

    ranks: (r_1, ..., r_L) summing to the head dim; block_sizes: (b_2, ..., b_L), nested, aligned to position 0;
    level_scales: per-level logit multipliers, or None for "the attention module's own ``scaling`` on every
    level" (patched decoders: ``mlr_ranks=[head_dim]`` is then the stock model); average_levels: divide each logit
    by the number of levels the pair shares; dim_order: the head-dim permutation that puts the level slices first
    (whole RoPE rotation pairs for patched RoPE decoders), or None for the identity. Hashable; the small device
    tensors derived from it are memoised in ``tensors`` (a bounded ``TensorMemo``, not part of equality).
    """

    ranks: tuple
    block_sizes: tuple
    level_scales: Optional[tuple] = None
    average_levels: bool = False
    dim_order: Optional[tuple] = None
    tensors: TensorMemo = field(default_factory=TensorMemo, compare=False, hash=False, repr=False)
    head_dim: int = field(init=False, compare=False, repr=False)  # sum(ranks): read by every layer of every step
    num_levels: int = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "head_dim", sum(self.ranks))
        object.__setattr__(self, "num_levels", len(self.ranks))

    @classmethod
    def build(cls, ranks, block_sizes, scales=None, *, head_dim: Optional[int] = None, average_levels: bool = False,
              dim_order=None, ranks_field: str = "mlr_ranks", blocks_field: str = "mlr_block_sizes",
              scales_field: str = "mlr_scaling") -> "MLRGeometry":
        """Validate and build. ``scales``: None (module scaling), "standard" (1/sqrt(r)), "mup" (1/r_l), a number
        or one number per level; errors name the given field names. Built once per distinct arguments (a model
        forward asks its config for its geometries; the validation would cost every decode step)."""
        try:
            key = (cls, tuple(ranks), tuple(block_sizes), tuple(scales) if isinstance(scales, list) else scales,
                   head_dim, bool(average_levels), None if dim_order is None else tuple(dim_order), ranks_field,
                   blocks_field, scales_field)
            hash(key)
        except TypeError:  # unhashable or non-iterable input: validation below names the field
            key = None
        built = _BUILT_GEOMETRIES.get(key) if key is not None else None
        if built is not None:
            return built
        built = cls._build(ranks, block_sizes, scales, head_dim=head_dim, average_levels=average_levels,
                           dim_order=dim_order, ranks_field=ranks_field, blocks_field=blocks_field,
                           scales_field=scales_field)
        if key is not None and len(_BUILT_GEOMETRIES) < 256:
            _BUILT_GEOMETRIES[key] = built
        return built

    @classmethod
    def _build(cls, ranks, block_sizes, scales, *, head_dim, average_levels, dim_order, ranks_field, blocks_field,
               scales_field) -> "MLRGeometry":
        validate_mlr_geometry(ranks, block_sizes, head_dim, ranks_field, blocks_field)
        ranks, block_sizes = tuple(int(r) for r in ranks), tuple(int(b) for b in block_sizes)
        level_scales = None if scales is None else tuple(resolve_level_scales(ranks, scales, scales_field))
        if dim_order is not None:
            dim_order = tuple(int(d) for d in dim_order)
            if sorted(dim_order) != list(range(sum(ranks))):
                raise ValueError(f"mlr_dim_order={list(dim_order)} is not a permutation of the {sum(ranks)} head dims")
            if dim_order == tuple(range(sum(ranks))):
                dim_order = None
        return cls(ranks, block_sizes, level_scales, bool(average_levels), dim_order)

    def scales(self, module_scaling: Optional[float] = None) -> tuple:
        """The per-level multipliers, with ``module_scaling`` (default 1/sqrt(r)) standing in when not configured."""
        if self.level_scales is not None:
            return self.level_scales
        scale = self.head_dim ** -0.5 if module_scaling is None else float(module_scaling)
        return (scale,) * self.num_levels

    def key_cache_elements(self, slots: int) -> int:
        """Key entries the hierarchical cache holds per (row, head) for ``slots`` positions:
        ``slots r_1 + sum_l min(b_l, slots) r_l``."""
        return slots * self.ranks[0] + sum(min(size, slots) * rank
                                           for size, rank in zip(self.block_sizes, self.ranks[1:]))

    def fine_elements(self, ring_widths: Sequence[int], slot: int) -> list:
        """The elements of the flat ring storage (``fine_layout``) a token at slot ``slot`` writes, as host integers:
        dim j of level l goes to ``o_l + j W_l + slot % b_l``."""
        elements, offset = [], 0
        for rank, width, size in zip(self.ranks[1:], ring_widths, self.block_sizes):
            elements += [offset + j * width + slot % size for j in range(rank)]
            offset += width * rank
        return elements

    def fine_layout(self, ring_widths: Sequence[int], device) -> dict:
        """What indexing the flat storage of the finer levels' rings needs (ring l: ``ring_widths[l]`` entries of
        ``r_l`` dims, after the rings before it, dim-major: element ``o_l + j W_l + e`` is dim j of entry e, so that
        one dim of consecutive entries is contiguous; memoised, a few values per fine head dim):

        * "entries": E = sum_l W_l, the ring entries of all levels;
        * "element block", "element offset" (sum_l r_l,): per fine dim j of level l, b_l and ``o_l + j W_l``
          (o_l: the ring's start), so that a token at slot s writes element ``o_l + j W_l + s % b_l``;
        * "sizes" (L-1,): the block sizes."""
        widths = tuple(int(width) for width in ring_widths)

        def make():
            element_block, element_offset, offset = [], [], 0
            for rank, width, size in zip(self.ranks[1:], widths, self.block_sizes):
                element_block += [size] * rank
                element_offset += [offset + j * width for j in range(rank)]
                offset += width * rank

            def tensor(values):
                return torch.tensor(values, dtype=torch.long, device=device)

            return {"entries": sum(widths), "element block": tensor(element_block),
                    "element offset": tensor(element_offset), "sizes": tensor(list(self.block_sizes))}

        return self.tensors.get(("fine layout", widths, device), make)

    def dim_order_index(self, device) -> Optional[torch.Tensor]:
        """``dim_order`` as a long tensor on ``device`` (memoised), or None."""
        if self.dim_order is None:
            return None
        return self.tensors.get(("dim_order", device),
                                lambda: torch.tensor(self.dim_order, dtype=torch.long, device=device))

    def scale_vector(self, scales: Sequence[float], dtype: torch.dtype, device) -> torch.Tensor:
        """(r,) per-dim multiplier: ``scales[l]`` on the dims of level l (folded into queries; memoised). Called by
        every layer of every decode step: a hit is one dict lookup."""
        key = ("scales", tuple(scales), dtype, device)
        value = self.tensors.lookup(key)
        if value is None:
            value = self.tensors.get(key, lambda: torch.tensor(
                [s for s, r in zip(scales, self.ranks) for _ in range(r)], dtype=dtype, device=device))
        return value


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

