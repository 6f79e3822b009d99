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

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .structattn_geometry import (
    check_bias,
    check_positions,
    check_qkv,
    keep_mask,
    resolve_level_scales,
    validate_mlr_geometry,
)
from .structattn_mlr_fused import mlr_attention_fused
from .structattn_mlr_math import mlr_attention_math
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


def mlr_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ranks: Sequence[int],
                  block_sizes: Sequence[int], causal: bool = True,
                  scales: Union[None, str, float, Sequence[float]] = None, positions: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                  average_levels: bool = False, implementation: str = "auto") -> torch.Tensor:
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
    if implementation == "reference":
        return mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=block_sizes, causal=causal,
                                       scales=level_scales, positions=positions, attention_mask=valid,
                                       bias=bias, average_levels=average_levels)

    if positions is None:
        offsets, uniform = None, True
    else:
        offsets = _row_offsets(positions, valid if valid is not None else torch.ones_like(positions, dtype=torch.bool))
        if offsets is None:  # non-contiguous positions (e.g. packed sequences): only the naive path is exact
            return mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=block_sizes, causal=causal,
                                           scales=level_scales, positions=positions, attention_mask=valid,
                                           bias=bias, average_levels=average_levels)
        uniform = bool((offsets == offsets[0]).all())
        if not uniform and valid is None:
            # per-row offsets go through the canonical scatter, which marks real tokens with the mask
            valid = torch.ones(batch, length, dtype=torch.bool, device=q.device)

    # Range of positions that carry real tokens decides which levels every pair shares.
    if uniform:
        base_offset = 0 if offsets is None else int(offsets[0])
        low, high = base_offset, base_offset + length - 1
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
    num_levels = len(ranks)
    if first_depth < num_levels:
        granule = block_sizes[first_depth - 1]
        base = (low // granule) * granule
        canonical_length = -(-(high + 1 - base) // granule) * granule
    else:
        base, canonical_length = low, high + 1 - low

    backend = implementation
    if backend == "auto":
        # neither kernel differentiates the additive bias (T5's learned relative bias): the math path does
        bias_needs_grad = bias is not None and bias.requires_grad
        if q.device.type == "cpu" and not bias_needs_grad:
            backend = "fused"
        elif q.device.type == "cuda" and not bias_needs_grad and _triton_kernel() is not None:
            backend = "triton"
        else:
            backend = "math"
    if backend == "math" and uniform:
        # materialised scores need no canonical padding: partial blocks at the ends are handled directly
        return mlr_attention_math(q, k, v, valid, bias, ranks, block_sizes, first_depth, level_scales,
                                  average_levels, causal, start=0 if offsets is None else int(offsets[0]))

    if uniform:
        left = base_offset - base
        right = canonical_length - left - length
        pad = (lambda t: F.pad(t, (0, 0, left, right))) if (left or right) else (lambda t: t)
        q_c, k_c, v_c = pad(q), pad(k), pad(v)
        key_valid = None
        if left or right or valid is not None:
            key_valid = torch.zeros(batch, canonical_length, dtype=torch.bool, device=q.device)
            key_valid[:, left:left + length] = True if valid is None else valid
        bias_c = None
        if bias is not None:
            bias_c = bias if bias.dim() == 4 else bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
            bias_c = bias_c.expand(bias_c.shape[0], bias_c.shape[1], length, length)
            if left or right:
                bias_c = F.pad(bias_c, (left, right, left, right))
    else:
        index = (positions - base).masked_fill(~valid, canonical_length)  # invalid tokens go to a dump slot
        gather_index = index[:, None, :, None]

        def to_canonical(t):
            shape = (batch, t.shape[1], canonical_length + 1, t.shape[-1])
            return t.new_zeros(shape).scatter(2, gather_index.expand_as(t), t)[:, :, :canonical_length]

        q_c, k_c, v_c = to_canonical(q), to_canonical(k), to_canonical(v)
        key_valid = torch.zeros(batch, canonical_length + 1, dtype=torch.bool, device=q.device)
        key_valid.scatter_(1, index, valid)
        key_valid = key_valid[:, :canonical_length]
        bias_c = None
        if bias is not None:
            full_bias = bias if bias.dim() == 4 else bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
            full_bias = full_bias.expand(batch, full_bias.shape[1], length, length)
            rows = full_bias.new_zeros(batch, full_bias.shape[1], canonical_length + 1, length)
            rows = rows.scatter(2, index[:, None, :, None].expand_as(full_bias), full_bias)
            cols = full_bias.new_zeros(batch, full_bias.shape[1], canonical_length + 1, canonical_length + 1)
            bias_c = cols.scatter(3, index[:, None, None, :].expand_as(rows), rows)[
                :, :, :canonical_length, :canonical_length]

    if backend == "fused":
        if q.device.type != "cpu":
            raise ValueError(f"implementation='fused' needs CPU tensors, got device {q.device}")
        if bias_c is not None and bias_c.requires_grad:
            raise ValueError("implementation='fused' cannot differentiate the bias; use 'math' or 'auto'")
        out_c = mlr_attention_fused(q_c, k_c, v_c, key_valid, bias_c, ranks, block_sizes, first_depth,
                                    level_scales, average_levels, causal)
    elif backend == "triton":
        mlr_attention_triton = _triton_kernel()
        if mlr_attention_triton is None:
            raise ValueError("implementation='triton' needs the triton package")
        # The kernel aligns blocks to index 0; levels shared by every token get blocks covering the whole
        # canonical range (still nested) because the canonical base is only aligned to the finer levels.
        kernel_blocks = [canonical_length * 2 ** (first_depth - level) if level <= first_depth else size
                         for level, size in enumerate(block_sizes, start=2)]
        out_c = mlr_attention_triton(q_c, k_c, v_c, ranks=ranks, block_sizes=kernel_blocks, causal=causal,
                                     level_scales=level_scales, average_levels=average_levels,
                                     key_padding_mask=key_valid, bias=bias_c)
    else:
        out_c = mlr_attention_math(q_c, k_c, v_c, key_valid, bias_c, ranks, block_sizes, first_depth,
                                   level_scales, average_levels, causal, start=base)

    if uniform:
        return out_c[:, :, left:left + length] if (left or right) else out_c
    safe_index = index.clamp(max=canonical_length - 1)
    out = out_c.gather(2, safe_index[:, None, :, None].expand(batch, heads, length, out_c.shape[-1]))
    return out.masked_fill(~valid[:, None, :, None], 0.0)
