"""``MLRGeometry``: everything MLR attention needs to know about one layer (ranks, block sizes, level scales, level
averaging, the head-dim order), validated once, with the small device tensors it derives kept in a bounded memo
(``TensorMemo``). Part of the checkpoint payload.

The "depth" of a pair is the number of levels it shares (1..L); nested blocks make the shared levels a prefix, so a
depth-d pair scores with the first ``r_1 + ... + r_d`` dims (``structattn_config_rules`` states the conventions).
"""

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .structattn_config_rules import resolve_level_scales, validate_mlr_geometry
from .structattn_mlr_levels import check_level_rule

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
    (whole RoPE rotation pairs for patched RoPE decoders), or None for the identity; level_rule: which levels a pair
    shares, "blocks" or "nearest" (``structattn_mlr_levels``). Hashable; the small device
    tensors derived from it are memoised in ``tensors`` (a bounded ``TensorMemo``, not part of equality).
    """

    ranks: tuple
    block_sizes: tuple
    level_scales: Optional[tuple] = None
    average_levels: bool = False
    dim_order: Optional[tuple] = None
    level_rule: str = "blocks"
    tensors: TensorMemo = field(default_factory=TensorMemo, compare=False, hash=False, repr=False)
    head_dim: int = field(init=False, compare=False, repr=False)  # sum(ranks): read by every layer of every step
    num_levels: int = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "head_dim", sum(self.ranks))
        object.__setattr__(self, "num_levels", len(self.ranks))

    @classmethod
    def build(cls, ranks, block_sizes, scales=None, *, head_dim: Optional[int] = None, average_levels: bool = False,
              dim_order=None, level_rule: str = "blocks", ranks_field: str = "mlr_ranks",
              blocks_field: str = "mlr_block_sizes", scales_field: str = "mlr_scaling",
              rule_field: str = "mlr_level_rule") -> "MLRGeometry":
        """Validate and build. ``scales``: None (module scaling), "standard" (1/sqrt(r)), "mup" (1/r_l), a number
        or one number per level; errors name the given field names. Built once per distinct arguments (a model
        forward asks its config for its geometries; the validation would cost every decode step)."""
        try:
            key = (cls, tuple(ranks), tuple(block_sizes), tuple(scales) if isinstance(scales, list) else scales,
                   head_dim, bool(average_levels), None if dim_order is None else tuple(dim_order), level_rule,
                   ranks_field, blocks_field, scales_field, rule_field)
            hash(key)
        except TypeError:  # unhashable or non-iterable input: validation below names the field
            key = None
        built = _BUILT_GEOMETRIES.get(key) if key is not None else None
        if built is not None:
            return built
        built = cls._build(ranks, block_sizes, scales, head_dim=head_dim, average_levels=average_levels,
                           dim_order=dim_order, level_rule=level_rule, ranks_field=ranks_field,
                           blocks_field=blocks_field, scales_field=scales_field, rule_field=rule_field)
        if key is not None and len(_BUILT_GEOMETRIES) < 256:
            _BUILT_GEOMETRIES[key] = built
        return built

    @classmethod
    def _build(cls, ranks, block_sizes, scales, *, head_dim, average_levels, dim_order, level_rule, ranks_field,
               blocks_field, scales_field, rule_field) -> "MLRGeometry":
        validate_mlr_geometry(ranks, block_sizes, head_dim, ranks_field, blocks_field)
        check_level_rule(level_rule, rule_field)
        ranks, block_sizes = tuple(int(r) for r in ranks), tuple(int(b) for b in block_sizes)
        level_scales = None if scales is None else tuple(resolve_level_scales(ranks, scales, scales_field))
        if dim_order is not None:
            if isinstance(dim_order, (str, bytes)) or not hasattr(dim_order, "__iter__") or any(
                    isinstance(d, bool) or not isinstance(d, numbers.Integral) for d in dim_order) or \
                    sorted(dim_order) != list(range(sum(ranks))):
                raise ValueError(f"mlr_dim_order={dim_order!r} is not a permutation of the {sum(ranks)} head dims "
                                 f"(a list holding each of the integers 0..{sum(ranks) - 1} once)")
            dim_order = tuple(int(d) for d in dim_order)
            if dim_order == tuple(range(sum(ranks))):
                dim_order = None
        return cls(ranks, block_sizes, level_scales, bool(average_levels), dim_order, level_rule)

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

    def fine_layout(self, ring_widths: Sequence[int], device) -> dict:
        """What indexing the flat storage of the finer levels' rings needs (ring l: ``ring_widths[l]`` entries of
        ``r_l`` dims, after the rings before it, dim-major: element ``o_l + j W_l + e`` is dim j of entry e, so that
        one dim of consecutive entries is contiguous; memoised, a few values per fine head dim):

        * "entries": E = sum_l W_l, the ring entries of all levels;
        * "element block", "element offset" (sum_l r_l,): per fine dim j of level l, b_l and ``o_l + j W_l``
          (o_l: the ring's start), so that a token at slot s writes element ``o_l + j W_l + s % b_l``;
        * "sizes" (L-1,): the block sizes."""
        widths = tuple([int(width) for width in ring_widths])  # (a generator costs a call per item)

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


__all__ = ["MLRGeometry", "TensorMemo"]
