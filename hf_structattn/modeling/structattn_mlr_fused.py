"""Fused CPU backend of exact MLR attention: one flash-attention call per level group, merged by log-sum-exp.

Part of the checkpoint payload (only torch imports, flat relative imports); called by ``structattn_mlr.mlr_attention``
on the canonical layout it builds.

For a query in finest block F the keys split into at most L contiguous groups: its own finest block (all r dims),
and for each coarser depth d the part of its level-d block outside its level-(d+1) block (the first
``c_d = r_1 + ... + r_d`` dims). Each group is an ordinary attention problem, so the op is a handful of
``aten._scaled_dot_product_flash_attention_for_cpu`` calls whose (output, log-sum-exp) pairs are merged; the T x T
score matrix is never materialised. The custom backward calls the fused backward once per group with the *global*
output and LSE (that is exactly flash backward with ``P = exp(S_g - LSE)``). The kernel needs equal q/k/v widths,
so truncated q is zero-padded (scales folded into q, ``scale=1``).
"""

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .structattn_masks import mask_value, softmax_dtype
from .structattn_mlr_levels import depth_scale_vector, level_multipliers, level_prefix_widths

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# A coarse group's forward holds its scaled query rows and the kernel's output for them until they are merged, and
# every coarse depth covers about half of all rows: in one piece the two add ~1x the output to the peak (a prefill
# at 2x SDPA's memory). Pieces of at most 1/PIECE_FRACTION of the output keep the extra at ~2/PIECE_FRACTION;
# pieces are not cut below MIN_PIECE_ELEMENTS (1 MiB in float32), where the extra kernel calls and merges cost more
# time than the memory is worth (5-15 % of the forward at T = 1024, 8 heads, one thread). Above it the pieces cost
# 0-5 % of the forward (docs/benchmarks.md, "Transient memory of the op").
PIECE_FRACTION = 8
MIN_PIECE_ELEMENTS = 2 ** 18


class _Group:
    """One level group on the canonical layout (token index == position - base, length Tc).

    From index ``start`` the sequence is viewed as ``n_parents`` parents of ``n_children`` children of ``child``
    tokens; queries in child i attend keys in child ``i - offset`` of the same parent. The finest group is
    ``n_children == 1, offset == 0`` (own block, causal inside when causal).
    """

    def __init__(self, depth: int, start: int, parent: int, child: int, offset: int, n_parents: int):
        self.depth = depth
        self.start = start
        self.parent = parent
        self.child = child  # query rows of each child: the kernel's query length
        self.n_parents = n_parents
        self.n_children = parent // child
        self.is_own_block = offset == 0  # a causal call runs causal inside the own block
        self.count = self.n_children - abs(offset)
        self.query_children = slice(max(offset, 0), self.n_children + min(offset, 0))
        self.key_children = slice(max(-offset, 0), self.n_children - max(offset, 0))

    def select(self, x: torch.Tensor, keys: bool) -> torch.Tensor:
        """x (B, H, Tc, ...) -> (B, H, n_parents, count, rows, ...) view of the query (or key) children."""
        region = x[:, :, self.start:self.start + self.n_parents * self.parent]
        children = region.unflatten(2, (self.n_parents, self.n_children, self.child))
        return children[:, :, :, self.key_children if keys else self.query_children]

    def rows(self, lse: torch.Tensor) -> torch.Tensor:
        """lse (B, H, Tc) -> (B, H, n_parents, count, rows) view of the query rows."""
        return self.select(lse[..., None], keys=False)[..., 0]

    def bias_blocks(self, bias: torch.Tensor) -> torch.Tensor:
        """bias (Bb, Hb, Tc, Tc) -> (Bb, Hb, n_parents, count, rows, key rows): each query child's scores against
        its key child."""
        rows = self.select(bias, keys=False)[..., self.start:self.start + self.n_parents * self.parent]
        tiles = rows.unflatten(-1, (self.n_parents, self.n_children, self.child))[..., self.key_children, :]
        tiles = tiles.diagonal(dim1=2, dim2=5).diagonal(dim1=2, dim2=4)  # (Bb, Hb, rows, key rows, nP, count)
        return tiles.permute(0, 1, 4, 5, 2, 3)

    def additive_mask(self, key_valid: Optional[torch.Tensor], bias: Optional[torch.Tensor], batch: int, heads: int,
                      dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Additive mask (B, H * n_parents * count, 1 | rows, key rows) for this group from the canonical key
        validity (B, Tc) and bias (Bb, Hb, Tc, Tc) with Bb in (1, B), Hb in (1, H), or None."""
        result = None
        if key_valid is not None:
            valid = self.select(key_valid[:, None, :, None], keys=True).transpose(-1, -2)  # (B, 1, nP, count, 1, k)
            valid = valid.expand(batch, heads, *valid.shape[2:]).reshape(batch, -1, 1, valid.shape[-1])
            result = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, mask_value(dtype))
        if bias is not None:
            blocks = self.bias_blocks(bias)
            blocks = blocks.expand(batch, heads, *blocks.shape[2:]).reshape(batch, -1, *blocks.shape[-2:]).to(dtype)
            result = blocks if result is None else result + blocks
        return result

    # Fused path: (B, n_parents, count) fold into the kernel's batch dim. The kernel returns gradients (and
    # wants the output gradient) with (batch, length, heads, width) memory, so the fold follows the inputs'
    # layout: for (B, T, H, E) memory (what a model's ``view(B, T, H, E).transpose(1, 2)`` gives) H stays the
    # kernel's head dim; for (B, H, T, E) memory H joins the batch too and the kernel sees one head. Either
    # way every group is a strided view of the inputs, and the own-block group's results are whole-sequence
    # tensors in the inputs' layout without a copy.
    def fold(self, x: torch.Tensor, keys: bool, heads_in_batch: bool, piece: Optional[tuple] = None) -> torch.Tensor:
        """x (B, H, Tc, ...) -> (B * n_parents * count, H, rows, ...), or (B * H * n_parents * count, 1, rows, ...)
        when ``heads_in_batch`` (a view when the strides allow), of the query (or key) children. ``piece``: (batch,
        heads, parents) slices to fold only a part of the group (see ``_GroupInputs.pieces``)."""
        picked = self.select(x, keys)
        if piece is not None:
            picked = picked[piece]
        batch, heads, parents, count, rows = picked.shape[:5]
        rest = picked.shape[5:]
        if heads_in_batch:
            return picked.reshape(batch * heads * parents * count, 1, rows, *rest)
        picked = picked.movedim(1, 3)  # (B, nP, count, H, rows, ...)
        return picked.reshape(batch * parents * count, heads, rows, *rest)

    def unfold(self, t: torch.Tensor, batch: int, heads: int, heads_in_batch: bool, parents: Optional[int] = None
               ) -> torch.Tensor:
        """Inverse of ``fold`` as a view: kernel-side tensor -> (B, H, n_parents, count, rows, ...) (the
        piece's sizes when ``fold`` had a piece)."""
        parents = self.n_parents if parents is None else parents
        if heads_in_batch:
            return t.squeeze(1).unflatten(0, (batch, heads, parents, self.count))
        return t.unflatten(0, (batch, parents, self.count)).movedim(3, 1)

    def fold_mask(self, key_valid: Optional[torch.Tensor], bias: Optional[torch.Tensor], batch: int, heads: int,
                  dtype: torch.dtype, heads_in_batch: bool) -> Optional[torch.Tensor]:
        """``additive_mask`` in the fused path's fold, or None."""
        mask = self.additive_mask(key_valid, bias, batch, heads, dtype)
        if mask is None:
            return None
        mask = mask.view(batch, heads, self.n_parents, self.count, *mask.shape[2:])
        if heads_in_batch:
            return mask.reshape(batch * heads * self.n_parents * self.count, 1, *mask.shape[-2:])
        return mask.movedim(1, 3).reshape(batch * self.n_parents * self.count, heads, *mask.shape[-2:])


class _SpanGroup(_Group):
    """Queries at indices [query_start, query_start + rows) against the keys at [key_start, key_start + key_rows),
    all pairs sharing ``depth`` levels: a child that the end of the range cuts against the whole children before it
    in its parent (and, not causal, the reverse), or (``own``) the cut finest block against itself. Folds as a
    group of one parent and one child."""

    def __init__(self, depth: int, query_start: int, rows: int, key_start: int, key_rows: int, own: bool = False):
        self.depth = depth
        self.child, self.n_parents, self.count, self.is_own_block = rows, 1, 1, own
        self.spans = {False: (query_start, rows), True: (key_start, key_rows)}

    def select(self, x: torch.Tensor, keys: bool) -> torch.Tensor:
        start, rows = self.spans[keys]
        return x[:, :, start:start + rows].unflatten(2, (1, 1, rows))

    def bias_blocks(self, bias: torch.Tensor) -> torch.Tensor:
        (query_start, rows), (key_start, key_rows) = self.spans[False], self.spans[True]
        return bias[:, :, None, None, query_start:query_start + rows, key_start:key_start + key_rows]


def _depth_groups(depth: int, parent: int, child: int, length: int, causal: bool) -> list:
    """The groups of the pairs that share exactly ``depth`` levels (same parent, other child) on a range of
    ``length`` tokens: the whole parents fold into one group per child offset, the last parent's whole children
    into one more each, and the child the range's end cuts gets span groups against the whole children before it.
    Cutting, rather than padding the range to whole blocks, keeps a prompt just past a block edge from costing
    whole blocks more (T = 4,098 with 4,096-token blocks: 1.0x the work at 4,096, where padding cost 4x)."""

    def offsets(children: int) -> list:
        return list(range(1, children)) + ([] if causal else list(range(-(children - 1), 0)))

    whole = length // parent
    groups = [_Group(depth, 0, parent, child, offset, whole) for offset in offsets(parent // child)] if whole else []
    start = whole * parent
    children, cut = divmod(length - start, child)
    groups += [_Group(depth, start, children * child, child, offset, 1) for offset in offsets(children)]
    if cut and children:
        cut_start = start + children * child
        groups.append(_SpanGroup(depth, cut_start, cut, start, children * child))
        if not causal:
            groups.append(_SpanGroup(depth, start, children * child, cut_start, cut))
    return groups


class _Plan:
    """Groups of one call: built from the canonical length and the levels that are not shared by all tokens.
    ``groups[0]`` is the own-block group of the whole finest blocks; ``covers_all``: it covers every row (the
    range is whole finest blocks), else a span group for the cut last block follows it."""

    def __init__(self, ranks: Sequence[int], block_sizes: Sequence[int], first_depth: int, length: int, causal: bool):
        num_levels = len(ranks)
        finest = block_sizes[-1] if first_depth < num_levels else length  # first_depth == L: one dense group
        whole, cut = divmod(length, finest)
        self.groups = [_Group(num_levels, 0, finest, finest, 0, whole)]
        self.covers_all = cut == 0
        if cut:
            self.groups.append(_SpanGroup(num_levels, whole * finest, cut, whole * finest, cut, own=True))
        for depth in range(num_levels - 1, first_depth - 1, -1):
            child = block_sizes[depth - 1]
            # the shared level's block is the whole range: one parent, cut where the range ends
            parent = block_sizes[depth - 2] if depth > first_depth else -(-length // child) * child
            self.groups += _depth_groups(depth, parent, child, length, causal)
        self.prefix_widths = level_prefix_widths(ranks)


def _split(size: int, parts: int) -> list:
    """``parts`` (at most ``size``) contiguous slices of nearly equal length covering ``range(size)``."""
    parts = max(1, min(parts, size))
    bounds = [size * index // parts for index in range(parts + 1)]
    return [slice(start, stop) for start, stop in zip(bounds[:-1], bounds[1:])]


class _Scales:
    """Per-depth scale vectors (depth -> (r,) tensor) and ``own``: the one scale of the own-block group when every dim
    it uses has the same non-zero multiplier (then the kernel takes it as its ``scale`` and runs on q itself), else
    None -- decided from the Python level scales, so that nothing is read back from the device."""

    def __init__(self, vectors: dict, own: Optional[float]):
        self.vectors, self.own = vectors, own


def _own_scale(level_scales: Sequence[float], depth: int, num_levels: int, average_levels: bool) -> Optional[float]:
    """The multiplier of every head dim in a group of ``depth`` shared levels, when it is one non-zero number."""
    if depth < num_levels:  # the dims of the unshared levels are zeroed
        return None
    values = set(level_multipliers(level_scales, depth, average_levels))
    value = values.pop() if len(values) == 1 else 0.0
    return float(value) if value != 0.0 else None


def _heads_in_batch(q: torch.Tensor) -> bool:
    """Fold heads into the kernel batch for (B, H, T, E) memory, keep them as kernel heads otherwise."""
    return q.is_contiguous()


def _fold_layout(t: torch.Tensor, heads_in_batch: bool) -> torch.Tensor:
    """``t`` in a layout whose group folds are views: (B, H, T, E) memory for the heads-in-batch fold, else
    (B, T, H, E) memory (any layout works when B == 1). One up-front copy when needed replaces a copy of
    every group's rows."""
    if heads_in_batch:
        return t.contiguous()
    if t.shape[0] == 1 or t.transpose(1, 2).is_contiguous():
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _scratch_view(inputs, attr: str, like: torch.Tensor) -> torch.Tensor:
    """A reused buffer shaped like the kernel-side ``like`` (B', H, L, E) with (B', L, H, E) memory."""
    buffer = getattr(inputs, attr)
    if buffer is None or buffer.numel() < like.numel():
        buffer = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        setattr(inputs, attr, buffer)
    rows, heads, length, width = like.shape
    return buffer[:like.numel()].view(rows, length, heads, width).transpose(1, 2)


class _GroupInputs:
    """Per-call constants of the fused path: padded inputs, per-depth scale vectors and reused scratch.

    The kernel wants equal q/k/v widths and one scalar scale, so every coarse group runs on a copy of its
    query rows, scaled and zero-masked beyond the group's prefix width; writing that copy into one reused
    buffer (instead of a fresh tensor per group) saves an allocation and its page faults per group. The
    own-block group uses every dim, so with uniform scales it runs on q itself with the kernel's ``scale``.
    """

    def __init__(self, q, k, v, plan, scale_vectors):
        self.head_dim, self.value_dim = q.shape[-1], v.shape[-1]
        self.width = width = max(self.head_dim, self.value_dim)
        self.heads_in_batch = fold = _heads_in_batch(q)
        padded = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
        self.q, self.k, self.v = (_fold_layout(t, fold) for t in padded)
        self.plan = plan
        self.vectors = {depth: F.pad(vec, (0, width - vec.shape[0])) for depth, vec in scale_vectors.vectors.items()}
        self.own_scale = scale_vectors.own
        self.q_scratch = self.grad_scratch = None
        self.max_piece = max(q.shape[0] * q.shape[1] * q.shape[2] * width // PIECE_FRACTION, MIN_PIECE_ELEMENTS)

    def pieces(self, group: _Group, masked: bool) -> list:
        """((batch, heads, parents) slices, a slice of each query child's rows) pairs that split the group's
        forward into pieces of at most ``max_piece`` kernel elements; [(whole, whole)] for small groups and for
        masked calls (padding, bias). Pieces cut the batch first, then the heads when they are in the kernel
        batch (a head slice of (B, T, H, E) memory makes the kernel slow), then the parents, and the rows only
        when that is not enough: every piece's fold stays a view, and the kernel keeps long query runs (it tiles
        queries more finely, and runs slower, below 768 rows)."""
        whole = (slice(None), slice(None), slice(None))
        batch, heads, _, width = self.q.shape
        elements = batch * heads * group.n_parents * group.count * group.child * width
        wanted = -(-elements // self.max_piece)
        if wanted <= 1 or masked:
            return [(whole, slice(None))]
        if wanted <= batch:
            return [((part, slice(None), slice(None)), slice(None)) for part in _split(batch, wanted)]
        wanted = -(-wanted // batch)  # per batch row
        head_parts = [slice(None)]
        if self.heads_in_batch:
            head_parts = _split(heads, wanted)
            wanted = -(-wanted // heads)
        parent_parts = _split(group.n_parents, wanted)
        wanted = -(-wanted // group.n_parents)
        row_parts = _split(group.child, wanted)
        return [((slice(index, index + 1), head_part, parent_part), row_part) for index in range(batch)
                for head_part in head_parts for parent_part in parent_parts for row_part in row_parts]

    def prefix(self, group: _Group) -> int:
        """Number of leading dims the group's scores use (later dims of its scaled q are zero)."""
        if group.depth >= len(self.plan.prefix_widths):
            return self.head_dim
        return self.plan.prefix_widths[group.depth - 1]

    def queries(self, group: _Group, piece: Optional[tuple] = None, rows: slice = slice(None)):
        """(kernel q, kernel scale, multiplier of the kernel's dq or None) for one group, or for one piece of it
        and a slice of the rows of each query child (the kernel's length dim)."""
        rows = group.fold(self.q, False, self.heads_in_batch, piece)[:, :, rows]
        if group.is_own_block and self.own_scale is not None:
            return rows, self.own_scale, None
        vector = self.vectors[group.depth]
        return torch.mul(rows, vector, out=_scratch_view(self, "q_scratch", rows)), 1.0, vector

    def keys(self, group: _Group, piece: Optional[tuple] = None):
        fold = self.heads_in_batch
        return group.fold(self.k, True, fold, piece), group.fold(self.v, True, fold, piece)

    def fold(self, group: _Group, x: torch.Tensor) -> torch.Tensor:
        """The group's query rows of x (B, H, Tc, ...) as the kernel sees them."""
        return group.fold(x, False, self.heads_in_batch)

    def unfold(self, group: _Group, t: torch.Tensor) -> torch.Tensor:
        return group.unfold(t, self.q.shape[0], self.q.shape[1], self.heads_in_batch)

    def mask(self, group: _Group, key_valid, bias, dtype):
        return group.fold_mask(key_valid, bias, self.q.shape[0], self.q.shape[1], dtype, self.heads_in_batch)

    def kernel_grad(self, group: _Group, grad: torch.Tensor) -> torch.Tensor:
        """The group's output-gradient rows with (B', L, H, E) memory: the fused backward reads that layout
        and copies anything else into a fresh tensor per call; this reuses one buffer."""
        rows = self.fold(group, grad)
        if rows.transpose(1, 2).is_contiguous():
            return rows
        return _scratch_view(self, "grad_scratch", rows).copy_(rows)


class _FusedMLRFunction(torch.autograd.Function):
    """Exact MLR attention on the canonical layout using the fused CPU flash kernel per group."""

    @staticmethod
    def forward(ctx, q, k, v, key_valid, bias, plan, scale_vectors, causal):
        batch, heads, length, _ = q.shape
        inputs = _GroupInputs(q, k, v, plan, scale_vectors)
        value_dim = inputs.value_dim
        acc_dtype = softmax_dtype(q.dtype)
        out = lse = None
        for group in plan.groups:
            mask = inputs.mask(group, key_valid, bias, q.dtype)
            if out is None:  # the own-block group of the whole finest blocks: its result starts the merge
                group_q, kernel_scale, _ = inputs.queries(group)
                group_k, group_v = inputs.keys(group)
                group_out, group_lse = _cpu_flash(group_q, group_k, group_v, 0.0, causal, attn_mask=mask,
                                                  scale=kernel_scale)
                own_out = inputs.unfold(group, group_out[..., :value_dim]).to(acc_dtype)
                own_lse = inputs.unfold(group, group_lse).to(acc_dtype)
                if plan.covers_all:  # a view of the kernel's result, no copy
                    out, lse = own_out.reshape(batch, heads, length, value_dim), own_lse.reshape(batch, heads, length)
                    continue
                # the cut last block's rows start empty (log-sum-exp -inf): its own span group's merge fills them
                out = own_out.new_zeros(batch, heads, length, value_dim)
                lse = own_lse.new_full((batch, heads, length), -math.inf)
                group.select(out, keys=False).copy_(own_out)
                group.rows(lse).copy_(own_lse)
                continue
            # Coarse groups are not causal inside, so their query rows split into independent pieces.
            out_rows, lse_rows = group.select(out, keys=False), group.rows(lse)
            pieces = inputs.pieces(group, mask is not None or group.is_own_block)
            for piece, rows in pieces:
                group_q, kernel_scale, _ = inputs.queries(group, piece, rows)
                if rows.start is None or rows.start == 0:  # a piece's keys serve every row slice of it
                    group_k, group_v = inputs.keys(group, piece)
                group_out, group_lse = _cpu_flash(group_q, group_k, group_v, 0.0, causal and group.is_own_block,
                                                  attn_mask=mask, scale=kernel_scale)
                piece_out, piece_lse = out_rows[piece][..., rows, :], lse_rows[piece][..., rows]
                batch_part, heads_part, parents_part = piece_out.shape[:3]
                group_out = group.unfold(group_out[..., :value_dim], batch_part, heads_part, inputs.heads_in_batch,
                                         parents_part)
                group_lse = group.unfold(group_lse, batch_part, heads_part, inputs.heads_in_batch,
                                         parents_part).to(acc_dtype)
                # Merge weights sum to one, so the merge is one in-place lerp over the piece's rows.
                merged = torch.logaddexp(piece_lse, group_lse)
                weight = torch.sub(group_lse, merged, out=group_lse).exp_()
                piece_out.lerp_(group_out.to(acc_dtype), weight[..., None])
                piece_lse.copy_(merged)
                del group_out
        inputs.q_scratch = None
        result = out.to(q.dtype)
        if result._is_view():
            # ``out`` views a kernel result (the own-block group's output, unfolded without a copy), and autograd
            # refuses any in-place op on a custom Function output that is a view ("Output 0 of ... is a view and is
            # being modified inplace"). A tensor that ``set_`` points at the same storage is no view to autograd
            # (``_is_view()`` is False) and copies nothing, so the output behaves like SDPA's: in-place ops on it
            # are allowed, and because it is the saved output with its own version counter, an in-place op
            # followed by backward raises autograd's "modified by an inplace operation" error instead of
            # returning wrong gradients. tests/test_mlr_ops.py::test_set_alias_* pin that torch behaviour.
            result = torch.empty(0, dtype=result.dtype, device=result.device).set_(
                result.untyped_storage(), result.storage_offset(), result.size(), result.stride())
        ctx.save_for_backward(q, k, v, key_valid, bias, result, lse)
        ctx.plan, ctx.scale_vectors, ctx.causal = plan, scale_vectors, causal
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, key_valid, bias, out, lse = ctx.saved_tensors
        plan, causal = ctx.plan, ctx.causal
        batch, heads, length, head_dim = q.shape
        inputs = _GroupInputs(q, k, v, plan, ctx.scale_vectors)
        value_dim, width = inputs.value_dim, inputs.width
        out_pad, grad_pad = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t
                             for t in (out, grad_out))
        acc_dtype = softmax_dtype(q.dtype)
        lse = lse.to(acc_dtype)
        grad_q = grad_k = grad_v = None
        for group in plan.groups:
            mask = inputs.mask(group, key_valid, bias, q.dtype)
            group_q, kernel_scale, dq_scale = inputs.queries(group)
            group_k, group_v = inputs.keys(group)
            group_lse = inputs.fold(group, lse[..., None])[..., 0]
            dq, dk, dv = _cpu_flash_backward(
                inputs.kernel_grad(group, grad_pad), group_q, group_k, group_v,
                inputs.fold(group, out_pad), group_lse, 0.0, causal and group.is_own_block,
                attn_mask=mask, scale=kernel_scale)
            dq, dk, dv = (inputs.unfold(group, t) for t in (dq, dk, dv))
            if grad_q is None:
                # The own-block group's gradients come back in the inputs' layout (see ``_Group.fold``); when it
                # touches every query and key row, whole-sequence views of them start the sums.
                if dq_scale is not None:
                    dq.mul_(dq_scale)
                if plan.covers_all:
                    grad_q, grad_k, grad_v = (t.to(acc_dtype).reshape(batch, heads, length, width)
                                              for t in (dq, dk, dv))
                    continue
                grad_q, grad_k, grad_v = (torch.zeros(batch, heads, length, width, dtype=acc_dtype, device=q.device)
                                          for _ in range(3))
                for total, part in zip((grad_q, grad_k, grad_v), (dq, dk, dv)):
                    group.select(total, keys=False).copy_(part)
                continue
            # dq beyond the prefix is discarded and dk beyond it is exactly zero (q was zero-masked there).
            prefix = inputs.prefix(group)
            query_rows = group.select(grad_q, keys=False)[..., :prefix]
            if dq_scale is None:
                query_rows.add_(dq[..., :prefix])
            else:
                query_rows.addcmul_(dq[..., :prefix], dq_scale[:prefix])
            group.select(grad_k, keys=True)[..., :prefix].add_(dk[..., :prefix])
            group.select(grad_v, keys=True).add_(dv)
            del dq, dk, dv
        inputs.q_scratch = inputs.grad_scratch = None
        return (grad_q[..., :head_dim].to(q.dtype), grad_k[..., :head_dim].to(k.dtype),
                grad_v[..., :value_dim].to(v.dtype), None, None, None, None, None)



@torch.compiler.disable
def mlr_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor], ranks: Sequence[int], block_sizes: Sequence[int],
                        first_depth: int, level_scales: Sequence[float], average_levels: bool,
                        causal: bool) -> torch.Tensor:
    """Exact MLR attention on the canonical layout with the fused CPU kernel per level group.

    q, k: (B, H, Tc, r), v: (B, H, Tc, dv) on CPU, index i at position ``base + i``, where ``base`` is a multiple of
    the block of level ``first_depth + 1`` (the coarsest block not shared by every token; ``first_depth`` levels
    are shared by every pair), any length Tc (the end of the range may cut blocks); key_valid: (B, Tc) bool or
    None; bias: (Bb, Hb, Tc, Tc) with Bb in (1, B) and Hb in (1, H), not requiring grad, or None.
    Returns (B, H, Tc, dv).

    Runs eagerly under torch.compile: it writes through strided views and ``out=`` buffers that Dynamo cannot
    trace, and the fused kernel is already the whole cost.
    """
    plan = _Plan(ranks, block_sizes, first_depth, q.shape[2], causal)
    scale_vectors = _Scales({depth: depth_scale_vector(ranks, level_scales, depth, average_levels, q.dtype, q.device)
                             for depth in {group.depth for group in plan.groups}},
                            _own_scale(level_scales, plan.groups[0].depth, len(ranks), average_levels))
    return _FusedMLRFunction.apply(q, k, v, key_valid, bias, plan, scale_vectors, causal)
