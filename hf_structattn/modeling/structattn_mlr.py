"""Exact fast MLR attention (paper §3.4): the public ``mlr_attention`` op, its input checks and the dispatch to
a backend.

``mlr_attention`` validates and canonicalises its inputs (per-level scales, keep-mask, positions, bias), finds the
levels every token pair shares, lays the tokens out on a canonical range whose blocks are aligned to index 0
(padding or scattering when positions do not start on a block edge), and hands that to one backend:

  * ``fused`` (CPU, ``structattn_mlr_fused``): one fused flash-attention call per level group, merged by
    log-sum-exp, with a custom backward; never materialises the T x T scores.
  * ``math`` (any device, ``structattn_mlr_math``): the T x T scores materialised like eager attention with plain
    autograd around them. Used when the additive bias needs a gradient (T5's learned relative bias) and on devices
    without a fused kernel.
  * ``triton`` (CUDA, ``structattn_triton``): the Triton kernel when Triton is installed; never materialises the
    scores either.
  * ``reference`` (``structattn_reference``): the naive executable spec, for tests; also the exact fallback for
    positions that are not contiguous within a row (packed sequences).
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .structattn_config_rules import resolve_level_scales, validate_mlr_geometry
from .structattn_inputs import check_bias, check_positions, check_qkv
from .structattn_masks import keep_mask
from .structattn_mlr_fused import mlr_attention_fused
from .structattn_mlr_levels import check_level_rule
from .structattn_mlr_math import mlr_attention_math
from .structattn_mlr_nearest import mlr_nearest_attention
from .structattn_reference import mlr_attention_reference


def _triton_kernel():
    """``mlr_attention_triton``, or None without Triton. Imported on the first call (a CUDA tensor under "auto",
    or implementation="triton"), not at module import: defining the kernels costs import time on machines that
    never run them. The import is cached by Python, so later calls cost a dict lookup."""
    try:
        from .structattn_triton import TRITON_AVAILABLE, mlr_attention_triton
    except ImportError:  # the kernel file is optional in the payload
        return None
    return mlr_attention_triton if TRITON_AVAILABLE else None


IMPLEMENTATIONS = ("auto", "fused", "math", "triton", "reference")


def _row_offsets(positions: torch.Tensor, valid: torch.Tensor):
    """Per-row constant ``position - index`` over valid tokens, or None if some row is not contiguous."""
    length = positions.shape[1]
    delta = positions - torch.arange(length, device=positions.device)
    big = torch.iinfo(torch.long).max
    low = torch.where(valid, delta, torch.full_like(delta, big)).amin(1)
    high = torch.where(valid, delta, torch.full_like(delta, -big)).amax(1)
    has_tokens = valid.any(1)
    if bool(((low != high) & has_tokens).any()):
        return None
    return torch.where(has_tokens, low, torch.zeros_like(low))


@dataclass(frozen=True)
class PositionLayout:
    """What ``mlr_attention`` needs to know about its positions on the host, when the caller knows it already (the
    model's step plan reads it once per forward for every layer): contiguous: every row's real positions are its
    indices plus a per-row offset; uniform_offset: that offset when every row shares it, else None; lowest /
    highest: the lowest / highest real position. With a layout, ``mlr_attention`` reads nothing back from the
    device (the caller has checked that real positions are non-negative)."""

    contiguous: bool
    uniform_offset: Optional[int]
    lowest: int
    highest: int


def _without_leading_padding(q, k, v, skip: int, *, positions, attention_mask, bias, layout=None,
                             **kwargs) -> torch.Tensor:
    """``mlr_attention`` of the tokens from index ``skip`` on, zeros for the ``skip`` leading ones, which must be
    padding (their positions are negative)."""
    length = q.shape[2]
    if layout is not None:  # the caller checked that no real position is negative
        layout = PositionLayout(True, 0, layout.lowest, layout.highest)
    elif attention_mask is None or skip >= length or bool(attention_mask[:, :skip].any()):
        lowest = int(positions.min())
        raise ValueError(f"positions must be non-negative for MLR attention (blocks are aligned to position 0), "
                         f"got {lowest} for a real token")
    if bias is not None:
        bias = bias if bias.dim() == 4 else bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bias = bias[..., skip:, :] if bias.shape[-2] == length else bias
        bias = bias[..., skip:] if bias.shape[-1] == length else bias
    out = mlr_attention(q[:, :, skip:], k[:, :, skip:], v[:, :, skip:], positions=positions[:, skip:],
                        attention_mask=attention_mask[:, skip:], bias=bias, layout=layout, **kwargs)
    return F.pad(out, (0, 0, skip, 0))


def mlr_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ranks: Sequence[int],
                  block_sizes: Sequence[int], causal: bool = True,
                  scales: Union[None, str, float, Sequence[float]] = None, positions: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                  average_levels: bool = False, implementation: str = "auto",
                  layout: Optional[PositionLayout] = None, level_rule: str = "blocks") -> torch.Tensor:
    """Exact multi-level low-rank attention (paper §3.4); the fused and Triton paths never materialise the
    T x T scores.

    Args:
        q, k: (B, H, T, r) queries and keys; level slices are contiguous prefixes ``[q_1 | q_2 | ...]``.
        v: (B, H, T, dv).
        ranks: (r_1, ..., r_L) summing to r.
        block_sizes: (b_2, ..., b_L) nested block sizes of levels 2..L (level 1 is global). These come from
            the training length, never from T.
        causal: causal (key position <= query position) or bidirectional.
        scales: per-level logit multipliers: None/"standard" = 1/sqrt(r), "mup" = 1/r_l, a float, or a list
            (each finite and > 0).
        positions: (B, T), (1, T) or (T,) non-negative integer absolute positions (default ``arange(T)``);
            blocks are aligned to them. Any per-row offset works, with or without a mask.
        attention_mask: (B, T) or (1, T) keep-mask over keys: bool, or integer/float holding only 0 and 1
            (1 = attend). Additive masks (0 / -inf) are refused with an error; pass them as ``bias``.
        bias: additive floating score bias broadcastable to (B, H, T, T) (e.g. T5's relative position bias, or an
            additive mask), added in every level group.
        average_levels: divide each score by the number of levels the pair shares.
        implementation: "auto", "fused" (CPU), "math", "triton" (CUDA) or "reference" (naive, for tests).
        layout: a ``PositionLayout`` of ``positions`` and ``attention_mask`` the caller read already (a model's
            layers share one per forward), so that nothing is read back from the device; None: read here.
        level_rule: which levels a pair shares (``structattn_mlr_levels``): "blocks" (the paper's), or "nearest"
            (level l for keys fewer than b_l positions away; its own backend, ``structattn_mlr_nearest``, on every
            device, whatever ``implementation`` other than "reference" says).

    Returns:
        (B, H, T, dv) in the inputs' dtype (float16, bfloat16, float32 or float64; the softmax and the level merge
        run in ``promote_types(dtype, float32)``). Rows whose keys are all masked hold an unspecified finite value.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    check_qkv(q, k, v)
    validate_mlr_geometry(ranks, block_sizes, q.shape[-1])
    level_scales = resolve_level_scales(ranks, scales)
    batch, heads, length, _ = q.shape
    valid = keep_mask(attention_mask, batch, length, q.device)
    positions = check_positions(positions, batch, length, q.device)
    check_bias(bias, (batch, heads, length, length))
    common = dict(ranks=ranks, block_sizes=block_sizes, causal=causal, scales=level_scales, positions=positions,
                  attention_mask=valid, bias=bias, average_levels=average_levels)
    if check_level_rule(level_rule, "level_rule") == "nearest":
        if implementation == "reference":
            return mlr_attention_reference(q, k, v, level_rule=level_rule, **common)
        if layout is not None:
            contiguous = layout.contiguous
        else:
            contiguous = positions is None or _row_offsets(
                positions, valid if valid is not None else torch.ones_like(positions, dtype=torch.bool)) is not None
        return mlr_nearest_attention(q, k, v, ranks=ranks, block_sizes=block_sizes, level_scales=level_scales,
                                     causal=causal, positions=positions, valid=valid, bias=bias,
                                     average_levels=average_levels, contiguous=contiguous)
    if implementation == "reference":
        return mlr_attention_reference(q, k, v, **common)

    base_offset, uniform, span = 0, True, None
    if positions is not None and layout is not None:
        if not layout.contiguous:
            return mlr_attention_reference(q, k, v, **common)
        uniform = layout.uniform_offset is not None
        base_offset = layout.uniform_offset if uniform else 0
        span = (layout.lowest, layout.highest)
    elif positions is not None:
        offsets = _row_offsets(positions, valid if valid is not None else torch.ones_like(positions, dtype=torch.bool))
        if offsets is None:  # non-contiguous positions (e.g. packed sequences): only the naive path is exact
            return mlr_attention_reference(q, k, v, **common)
        uniform = bool((offsets == offsets[0]).all())
        base_offset = int(offsets[0])
    if positions is not None:
        if uniform and base_offset < 0:
            # every row's real tokens start at index -offset or later: the indices before are padding at negative
            # positions (uniform left padding); run on the rest and give the padding rows zeros
            return _without_leading_padding(q, k, v, -base_offset, implementation=implementation, layout=layout,
                                            **common)
        if not uniform and valid is None:
            # per-row offsets go through the canonical scatter, which marks real tokens with the mask
            valid = torch.ones(batch, length, dtype=torch.bool, device=q.device)
    first_depth, base, extent = _canonical_span(positions, valid, base_offset if uniform else None, length,
                                                block_sizes, len(ranks), span)
    backend = _pick_backend(implementation, q, bias)
    canonical_length = _canonical_length(backend, extent, block_sizes, first_depth)
    if backend == "math" and uniform:
        # materialised scores need no canonical padding: partial blocks at the ends are handled directly
        return mlr_attention_math(q, k, v, valid, bias, ranks, block_sizes, first_depth, level_scales,
                                  average_levels, causal, start=base_offset)
    if uniform:
        left = base_offset - base
        q_c, k_c, v_c, key_valid, bias_c = _pad_to_canonical(q, k, v, valid, bias, left, canonical_length)
    else:
        index = (positions - base).masked_fill(~valid, canonical_length)  # invalid tokens go to a dump slot
        q_c, k_c, v_c, key_valid, bias_c = _scatter_to_canonical(q, k, v, valid, bias, index, canonical_length)
    out_c = _run_backend(backend, q_c, k_c, v_c, key_valid, bias_c, ranks, block_sizes, first_depth, level_scales,
                         average_levels, causal, base)
    if uniform:
        return out_c[:, :, left:left + length] if canonical_length != length else out_c
    safe_index = index.clamp(max=canonical_length - 1)
    out = out_c.gather(2, safe_index[:, None, :, None].expand(batch, heads, length, out_c.shape[-1]))
    return out.masked_fill(~valid[:, None, :, None], 0.0)


def _canonical_span(positions: Optional[torch.Tensor], valid: Optional[torch.Tensor], uniform_offset: Optional[int],
                    length: int, block_sizes: Sequence[int], num_levels: int,
                    span: Optional[tuple] = None) -> tuple[int, int, int]:
    """(first_depth, base, extent): the deepest level every pair of real tokens shares (1 = only the global level),
    the position ``base`` the backends' canonical range starts at (aligned to the coarsest block not shared by every
    token), and ``extent``, the number of positions from ``base`` to the last real one.
    ``uniform_offset``: the shared offset of every row's positions, or None when rows differ (then read from
    ``positions`` and ``valid``, (B, T), unless ``span`` gives the lowest and highest real position)."""
    if uniform_offset is not None:
        low, high = uniform_offset, uniform_offset + length - 1
    elif span is not None:
        low, high = span
    else:
        token_positions = positions.masked_fill(~valid, -1) if valid is not None else positions
        high = int(token_positions.max())
        low = int(positions.masked_fill(~valid, high).min()) if valid is not None else int(positions.min())
    if low < 0:
        raise ValueError(f"positions must be non-negative for MLR attention (blocks are aligned to position 0), "
                         f"got {low}")
    first_depth = 1
    for size in block_sizes:
        if low // size != high // size:
            break
        first_depth += 1
    base = low
    if first_depth < num_levels:
        granule = block_sizes[first_depth - 1]
        base = (low // granule) * granule
    return first_depth, base, high + 1 - base


def _canonical_length(backend: str, extent: int, block_sizes: Sequence[int], first_depth: int) -> int:
    """The length of the canonical range the backend runs on: ``extent`` positions for the fused backend (it cuts
    the blocks where the range ends), rounded up to whole blocks of the coarsest level not shared by every token for
    the others."""
    if backend == "fused" or first_depth > len(block_sizes):  # fused, or every token in one finest block
        return extent
    block = block_sizes[first_depth - 1]
    return -(-extent // block) * block


def _pick_backend(implementation: str, q: torch.Tensor, bias: Optional[torch.Tensor]) -> str:
    if implementation != "auto":
        return implementation
    # neither kernel differentiates the additive bias (T5's learned relative bias): the math path does
    bias_needs_grad = bias is not None and bias.requires_grad
    if q.device.type == "cpu" and not bias_needs_grad:
        return "fused"
    if q.device.type == "cuda" and not bias_needs_grad and _triton_kernel() is not None:
        return "triton"
    return "math"


def _full_bias(bias: torch.Tensor, batch: Optional[int], length: int) -> torch.Tensor:
    """A bias broadcastable to (B, H, T, T) as a 4-D view expanded over the query and key dims (and the batch)."""
    full = bias if bias.dim() == 4 else bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    return full.expand(full.shape[0] if batch is None else batch, full.shape[1], length, length)


def _pad_to_canonical(q, k, v, valid, bias, left: int, canonical_length: int):
    """Rows sharing one offset: pad (B, H, T, .) to the canonical range, ``left`` slots before the tokens.
    Returns q, k, v, key_valid (B, C) or None, bias (.., C, C) or None."""
    batch, _, length, _ = q.shape
    right = canonical_length - left - length
    if left or right:
        q, k, v = (F.pad(t, (0, 0, left, right)) for t in (q, k, v))
    key_valid = None
    if left or right or valid is not None:
        key_valid = torch.zeros(batch, canonical_length, dtype=torch.bool, device=q.device)
        key_valid[:, left:left + length] = True if valid is None else valid
    bias_c = None
    if bias is not None:
        bias_c = _full_bias(bias, None, length)
        if left or right:
            bias_c = F.pad(bias_c, (left, right, left, right))
    return q, k, v, key_valid, bias_c


def _scatter_to_canonical(q, k, v, valid, bias, index: torch.Tensor, canonical_length: int):
    """Rows with their own offsets: scatter each real token to slot ``index`` (B, T) of the canonical range
    (padding to a dump slot past it). Returns q, k, v, key_valid (B, C), bias (B, H, C, C) or None."""
    batch = q.shape[0]
    length = q.shape[2]
    gather_index = index[:, None, :, None]

    def to_canonical(t):
        shape = (batch, t.shape[1], canonical_length + 1, t.shape[-1])
        return t.new_zeros(shape).scatter(2, gather_index.expand_as(t), t)[:, :, :canonical_length]

    key_valid = torch.zeros(batch, canonical_length + 1, dtype=torch.bool, device=q.device)
    key_valid.scatter_(1, index, valid)
    bias_c = None
    if bias is not None:
        full_bias = _full_bias(bias, batch, length)
        rows = full_bias.new_zeros(batch, full_bias.shape[1], canonical_length + 1, length)
        rows = rows.scatter(2, index[:, None, :, None].expand_as(full_bias), full_bias)
        cols = full_bias.new_zeros(batch, full_bias.shape[1], canonical_length + 1, canonical_length + 1)
        bias_c = cols.scatter(3, index[:, None, None, :].expand_as(rows), rows)[
            :, :, :canonical_length, :canonical_length]
    return to_canonical(q), to_canonical(k), to_canonical(v), key_valid[:, :canonical_length], bias_c


def _run_backend(backend: str, q_c, k_c, v_c, key_valid, bias_c, ranks, block_sizes, first_depth: int,
                 level_scales, average_levels: bool, causal: bool, base: int) -> torch.Tensor:
    """One backend over the canonical range: (B, H, C, r) inputs, returns (B, H, C, dv)."""
    canonical_length = q_c.shape[2]
    if backend == "fused":
        if q_c.device.type != "cpu":
            raise ValueError(f"implementation='fused' needs CPU tensors, got device {q_c.device}")
        if bias_c is not None and bias_c.requires_grad:
            raise ValueError("implementation='fused' cannot differentiate the bias; use 'math' or 'auto'")
        return mlr_attention_fused(q_c, k_c, v_c, key_valid, bias_c, ranks, block_sizes, first_depth,
                                   level_scales, average_levels, causal)
    if backend == "triton":
        mlr_attention_triton = _triton_kernel()
        if mlr_attention_triton is None:
            raise ValueError("implementation='triton' needs the triton package")
        # The kernel aligns blocks to index 0; levels shared by every token get blocks covering the whole
        # canonical range (still nested) because the canonical base is only aligned to the finer levels.
        kernel_blocks = [canonical_length * 2 ** (first_depth - level) if level <= first_depth else size
                         for level, size in enumerate(block_sizes, start=2)]
        return mlr_attention_triton(q_c, k_c, v_c, ranks=ranks, block_sizes=kernel_blocks, causal=causal,
                                    level_scales=level_scales, average_levels=average_levels,
                                    key_padding_mask=key_valid, bias=bias_c)
    return mlr_attention_math(q_c, k_c, v_c, key_valid, bias_c, ranks, block_sizes, first_depth, level_scales,
                              average_levels, causal, start=base)
