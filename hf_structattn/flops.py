"""Compute and memory accounting for every attention variant (docs/models.md; paper §3.4 and App. D).

Pure Python integer arithmetic: no tensors are built, so any sequence length is cheap and every count is exact.

Units and conventions (unless a function says otherwise):
  * ``*_macs`` functions count multiply-accumulates (MACs) for **batch 1, one head, one layer**.
  * FLOPs = 2 x MACs. Only the report and :func:`flops_per_token` speak in FLOPs, and they say so.
  * ``seq_len`` = T query positions ``0..T-1`` attending to keys at the same positions (a full forward pass,
    e.g. training or prefill). ``causal=True`` keeps pairs with ``j <= i``; otherwise every pair counts.
  * Score MACs count the ``T x T`` contraction only (``Q K^T`` or its structured equivalent). The q/k projections
    are weight matmuls, already inside the ``2 x params`` term of :func:`flops_per_token`; pass
    ``include_projections=True`` to add them and get the per-head totals of the paper's App. D tables.
  * PV MACs = scored pairs x value width ``dv``. ``dv`` is the head dim r for dense / mlr / swa and ``D/H``
    for the bilinear variants (their query/key width differs from the value width).

Geometry keywords shared by :func:`score_macs`, :func:`pv_macs` and :func:`attention_pairs` (so one dict can be
splatted into all of them):
  * ``head_dim`` r (dense, swa; for mlr optional, then checked against ``sum(ranks)``);
  * ``ranks`` (r_1..r_L): MLR level ranks for ``mlr``, bilinear level ranks for ``bilinear_mlr``;
  * ``block_sizes`` (b_2..b_L) for ``mlr``: nested, absolute-position aligned; or ``n_positions`` to derive the
    dyadic defaults ``b_l = n_positions / 2^(l-1)`` (never derived from ``seq_len``, which would change the function);
  * ``window`` w for ``swa`` (causal: ``0 <= i - j < w``; otherwise ``|i - j| < w``);
  * ``n_embd`` D and ``n_head`` H for the bilinear variants and for ``include_projections``;
  * ``btt_rank`` s and ``btt_factors`` (a, b, c, d) with ``D = a*b = c*d`` for ``bilinear_btt``;
  * ``value_dim`` to override dv.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from .modeling.structattn_bilinear import default_btt_factors as _default_btt_factors
from .modeling.structattn_bilinear import validate_bilinear_mlr, validate_btt
from .modeling.structattn_config_rules import check_block_sizes, check_int, check_ranks, default_block_sizes

VARIANTS = ("dense", "mlr", "bilinear_mlr", "bilinear_btt", "swa")

__all__ = [
    "VARIANTS",
    "AttentionCostReport",
    "attention_cost_report",
    "attention_pairs",
    "decoder_cache_report",
    "default_btt_factors",
    "dyadic_block_sizes",
    "encoder_decoder_flops",
    "flops_per_token",
    "key_cache_bytes",
    "key_cache_elements",
    "kv_cache_bytes",
    "mlr_pairs_per_depth",
    "nonembedding_matmul_params",
    "pv_macs",
    "qk_projection_macs",
    "score_macs",
    "value_cache_elements",
]


# ----------------------------------------------------------------------------------------------- validation


# The geometry keywords are checked with the models' own rules (modeling/structattn_geometry.py,
# modeling/structattn_bilinear.py), so that a geometry the models accept is one these counts accept. The
# config-level functions take configs that validated themselves when they were built.


def _check_variant(variant: Any) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not a known attention variant; expected one of {VARIANTS}")
    return variant


def dyadic_block_sizes(n_positions: int, num_levels: int) -> list[int]:
    """Default MLR blocks ``b_l = n_positions / 2^(l-1)`` for levels 2..L (token counts)."""
    check_int("num_levels", num_levels)
    return default_block_sizes(n_positions, num_levels, "n_positions")


def default_btt_factors(n_embd: int) -> tuple[int, int, int, int]:
    """``(a, b, c, d)`` with ``a = c`` the largest divisor of D that is <= sqrt(D) and ``b = d = D / a``:
    the most balanced split (the models' own default); key cost ``T*D*s*(b + c)``."""
    check_int("n_embd", n_embd)
    return _default_btt_factors(n_embd)


def _dtype_bytes(dtype_bytes: Any) -> int:
    # Duck-typed so torch stays an optional import: torch.dtype exposes .itemsize.
    itemsize = getattr(dtype_bytes, "itemsize", None)
    if itemsize is not None and not isinstance(dtype_bytes, int):
        return int(itemsize)
    return check_int("dtype_bytes", dtype_bytes)


# ------------------------------------------------------------------------------------------ head geometry


@dataclass(frozen=True)
class _Head:
    """Resolved per-head geometry. ``key_width``: per-pair score MACs at full depth (the query/key width)."""

    variant: str
    key_width: int
    value_dim: int
    ranks: tuple = ()
    block_sizes: tuple = ()
    window: Optional[int] = None
    n_embd: Optional[int] = None
    btt_rank: Optional[int] = None
    btt_factors: Optional[tuple] = None


def _resolve_head(variant: str, *, head_dim: Optional[int] = None, ranks: Optional[Sequence[int]] = None,
                  block_sizes: Optional[Sequence[int]] = None, n_positions: Optional[int] = None,
                  window: Optional[int] = None, n_embd: Optional[int] = None, n_head: Optional[int] = None,
                  btt_rank: Optional[int] = None, btt_factors: Optional[Sequence[int]] = None,
                  value_dim: Optional[int] = None) -> _Head:
    _check_variant(variant)
    if n_embd is not None:
        check_int("n_embd", n_embd)
    if n_head is not None:
        check_int("n_head", n_head)
        if n_embd is not None and n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    if value_dim is not None:
        check_int("value_dim", value_dim)
    if head_dim is not None:
        check_int("head_dim", head_dim)

    def split_width() -> Optional[int]:
        return n_embd // n_head if n_embd is not None and n_head is not None else None

    if variant in ("dense", "swa", "mlr"):
        if variant == "mlr":
            level_ranks = check_ranks(ranks, "ranks")
            if head_dim is None:
                head_dim = split_width()
            if head_dim is not None and sum(level_ranks) != head_dim:
                raise ValueError(f"ranks={level_ranks} sums to {sum(level_ranks)}, but the head dim is {head_dim}")
            head_dim = sum(level_ranks)
        elif head_dim is None:
            head_dim = sum(check_ranks(ranks, "ranks")) if ranks is not None else split_width()
        if head_dim is None:
            raise ValueError(f"head_dim is required for variant {variant!r} (or n_embd and n_head), got None")
        if split_width() is not None and split_width() != head_dim:
            raise ValueError(f"head_dim={head_dim} does not match n_embd/n_head={split_width()}")
        dv = value_dim if value_dim is not None else head_dim
        if variant == "dense":
            return _Head(variant, head_dim, dv)
        if variant == "swa":
            if window is None:
                raise ValueError("window is required for variant 'swa', got None")
            return _Head(variant, head_dim, dv, window=check_int("window", window))
        if block_sizes is None:
            if n_positions is None:
                raise ValueError("block_sizes is required for variant 'mlr' (or n_positions for the dyadic "
                                 "defaults), got None")
            block_sizes = dyadic_block_sizes(n_positions, len(level_ranks))
        blocks = check_block_sizes(block_sizes, len(level_ranks), "block_sizes", "ranks")
        return _Head(variant, head_dim, dv, ranks=tuple(level_ranks), block_sizes=tuple(blocks))

    if n_embd is None:
        raise ValueError(f"n_embd is required for variant {variant!r}, got None")
    dv = value_dim if value_dim is not None else head_dim if head_dim is not None else split_width()
    if dv is None:
        raise ValueError(f"n_head (or value_dim) is required for variant {variant!r} to fix the value width D/H, "
                         f"got None")
    if variant == "bilinear_mlr":
        level_ranks = validate_bilinear_mlr(n_embd, n_head, ranks, "ranks", "n_embd")
        width = sum(2 ** level * rank for level, rank in enumerate(level_ranks))
        return _Head(variant, width, dv, ranks=tuple(level_ranks), n_embd=n_embd)
    if btt_rank is None:
        raise ValueError("btt_rank is required for variant 'bilinear_btt', got None")
    factors = validate_btt(n_embd, btt_factors, btt_rank, "btt_factors", "btt_rank", "n_embd")
    return _Head(variant, n_embd, dv, n_embd=n_embd, btt_rank=btt_rank, btt_factors=factors)


# ---------------------------------------------------------------------------------------------- pair counts


def _blocked_pairs(seq_len: int, block: int, causal: bool) -> int:
    """Pairs (i, j), 0 <= i, j < T, with ``i // block == j // block`` (and ``j <= i`` when causal)."""
    full, rest = divmod(seq_len, block)
    if causal:
        return full * block * (block + 1) // 2 + rest * (rest + 1) // 2
    return full * block * block + rest * rest


def _all_pairs(seq_len: int, causal: bool) -> int:
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def mlr_pairs_per_depth(seq_len: int, block_sizes: Sequence[int], causal: bool = False) -> list[int]:
    """Number of (query, key) pairs of each depth d = 1..L (levels shared), positions ``0..T-1``.

    A depth-d pair costs ``c_d = r_1 + ... + r_d`` score MACs. Exact for any T (partial trailing blocks
    included, so also beyond the training length). Returns a list of L = len(block_sizes) + 1 ints summing to
    ``T^2`` (or ``T(T+1)/2`` when causal).
    """
    check_int("seq_len", seq_len, minimum=0)
    blocks = check_block_sizes(block_sizes, len(block_sizes) + 1, "block_sizes", "block_sizes")
    # Pairs sharing level l are a superset of those sharing l+1 (nested blocks), so depth counts are differences.
    sharing = [_all_pairs(seq_len, causal)] + [_blocked_pairs(seq_len, b, causal) for b in blocks] + [0]
    return [sharing[d] - sharing[d + 1] for d in range(len(blocks) + 1)]


def _pairs(head: _Head, seq_len: int, causal: bool) -> int:
    if head.variant == "swa":
        w = head.window
        # Causal row i sees min(i + 1, w) keys; the two-sided window double-counts only the diagonal.
        one_sided = seq_len * (seq_len + 1) // 2 if seq_len <= w else w * (w + 1) // 2 + (seq_len - w) * w
        return one_sided if causal else 2 * one_sided - seq_len
    return _all_pairs(seq_len, causal)


def attention_pairs(variant: str, seq_len: int, *, causal: bool = False, **geometry) -> int:
    """Number of (query, key) pairs that get a score and a softmax weight, per head (dimensionless count).

    ``T^2`` (``T(T+1)/2`` causal) for every variant except ``swa`` (window pairs only). Geometry keywords: see
    the module docstring.
    """
    check_int("seq_len", seq_len, minimum=0)
    return _pairs(_resolve_head(variant, **geometry), seq_len, causal)


# ------------------------------------------------------------------------------------------- MAC counts


def _projection_macs(head: _Head, seq_len: int, n_embd: Optional[int]) -> int:
    if head.variant == "bilinear_btt":
        a, b, c, d = head.btt_factors
        s = head.btt_rank
        # Query is x itself; key = M_h x: right factor (c blocks of (b*s) x d) then left (b blocks of a x (c*s)).
        return seq_len * (c * d * b * s + b * a * c * s)
    if n_embd is None:
        raise ValueError("n_embd is required for include_projections=True, got None")
    if head.variant == "bilinear_mlr":
        # Level l: p_l chunks of D/p_l features, each projected to r_l dims, for q and for k: 2*T*D*r_l.
        return 2 * seq_len * n_embd * sum(head.ranks)
    return 2 * seq_len * n_embd * head.key_width


def qk_projection_macs(variant: str, seq_len: int, **geometry) -> int:
    """MACs (batch 1, one head) to form the query and key of T tokens from the D-dim inputs.

    dense/mlr/swa: ``2*T*D*r``; bilinear_mlr: ``2*T*D*sum(r_l)`` (App. D.1); bilinear_btt: the key ``M_h x``
    only, ``T*(c*d*b*s + b*a*c*s)`` = ``2*s*T*D^{3/2}`` for ``a=b=c=d`` (App. D.2), the query being x itself.
    Requires ``n_embd`` (also for dense / mlr / swa).
    """
    check_int("seq_len", seq_len, minimum=0)
    return _projection_macs(_resolve_head(variant, **geometry), seq_len, geometry.get("n_embd"))


def score_macs(variant: str, seq_len: int, *, causal: bool = False, include_projections: bool = False,
               **geometry) -> int:
    """Score MACs (batch 1, one head, one layer; FLOPs = 2 x MACs) for a full pass over T positions.

    * dense: ``pairs * r`` with pairs = ``T^2`` or ``T(T+1)/2`` (causal);
    * mlr: ``sum_d n_d * (r_1 + ... + r_d)`` with n_d the pairs of depth d (:func:`mlr_pairs_per_depth`);
      ``T^2 * sum_l r_l / 2^(l-1)`` for non-causal dyadic blocks at T = training length (paper §3.4);
    * bilinear_mlr: ``pairs * sum_l 2^(l-1) r_l``; bilinear_btt: ``pairs * D``; swa: window pairs ``* r``.

    ``include_projections`` adds :func:`qk_projection_macs`, giving App. D's per-head totals
    (``2TDr + T^2 sum_l 2^(l-1) r_l`` for bilinear MLR, ``T^2 D + 2sTD^{3/2}`` for bilinear BTT).
    """
    check_int("seq_len", seq_len, minimum=0)
    head = _resolve_head(variant, **geometry)
    if head.variant == "mlr":
        # Each level l adds r_l MACs to every pair that shares it; summing per level equals sum_d n_d c_d.
        sharing = [_all_pairs(seq_len, causal)] + [_blocked_pairs(seq_len, b, causal) for b in head.block_sizes]
        macs = sum(pairs * rank for pairs, rank in zip(sharing, head.ranks))
    else:
        macs = _pairs(head, seq_len, causal) * head.key_width
    if include_projections:
        macs += _projection_macs(head, seq_len, geometry.get("n_embd"))
    return macs


def pv_macs(variant: str, seq_len: int, *, causal: bool = False, include_projections: bool = False,
            **geometry) -> int:
    """Softmax-weights-times-values MACs (batch 1, one head, one layer; FLOPs = 2 x MACs): ``pairs * dv``.

    dv = r for dense / mlr / swa (MLR values keep the full head dim), ``D/H`` for the bilinear variants (or
    ``value_dim``). ``include_projections`` is accepted (and ignored) so one keyword set serves both counters.
    """
    del include_projections
    check_int("seq_len", seq_len, minimum=0)
    head = _resolve_head(variant, **geometry)
    return _pairs(head, seq_len, causal) * head.value_dim


# ------------------------------------------------------------------------------------------------- caches


def key_cache_elements(variant: str, context_len: int, ranks: Optional[Sequence[int]] = None,
                       block_sizes: Optional[Sequence[int]] = None, head_dim: Optional[int] = None, *,
                       window: Optional[int] = None, n_embd: Optional[int] = None,
                       n_positions: Optional[int] = None) -> int:
    """Key-cache entries (scalars) of one head, one layer, one sequence holding ``context_len`` = T tokens.

    dense: ``T*r``; swa: ``min(T, w)*r``; mlr: ``T*r_1 + sum_{l>=2} min(b_l, T)*r_l`` (level l keeps only the
    current level-l block, as ``structattn_cache`` stores it). Each level is counted at its peak over a generation of T tokens,
    ``min(b_l, T)`` positions: what a preallocated cache holds, and the paper's count at T = training length.
    Right after token T a level holds ``(T - 1) % b_l + 1`` positions, never more;
    bilinear_mlr: ``T * sum_l 2^(l-1) r_l`` (``ranks`` = bilinear ranks); bilinear_btt: ``T*D``
    (``n_embd`` = D). Multiply by H and the layer count for a model.
    """
    check_int("context_len", context_len, minimum=0)
    _check_variant(variant)
    # value_dim / btt_rank placeholders: the key width alone does not depend on them.
    head = _resolve_head(variant, ranks=ranks, block_sizes=block_sizes, head_dim=head_dim, window=window,
                         n_embd=n_embd, n_positions=n_positions, value_dim=1 if variant.startswith("bilinear")
                         else None, btt_rank=1)
    if head.variant == "mlr":
        return context_len * head.ranks[0] + sum(min(b, context_len) * r
                                                 for b, r in zip(head.block_sizes, head.ranks[1:]))
    if head.variant == "swa":
        return min(context_len, head.window) * head.key_width
    return context_len * head.key_width


def value_cache_elements(variant: str, context_len: int, head_dim: Optional[int] = None, *,
                         ranks: Optional[Sequence[int]] = None, window: Optional[int] = None,
                         n_embd: Optional[int] = None, n_head: Optional[int] = None,
                         value_dim: Optional[int] = None) -> int:
    """Value-cache entries of one head, one layer, one sequence of T tokens: ``T*dv`` (``min(T, w)*dv`` for swa).

    dv = ``value_dim`` if given, else ``head_dim`` (or ``sum(ranks)``), else ``n_embd // n_head``.
    """
    check_int("context_len", context_len, minimum=0)
    _check_variant(variant)
    if value_dim is None:
        if head_dim is None and ranks is not None and not variant.startswith("bilinear"):
            head_dim = sum(check_ranks(ranks, "ranks"))
        if head_dim is not None:
            value_dim = head_dim
        elif n_embd is not None and n_head is not None:
            check_int("n_embd", n_embd)
            check_int("n_head", n_head)
            if n_embd % n_head:
                raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
            value_dim = n_embd // n_head
        else:
            raise ValueError("value_dim (or head_dim, or n_embd and n_head) is required, got None")
    check_int("value_dim", value_dim)
    if variant == "swa":
        if window is None:
            raise ValueError("window is required for variant 'swa', got None")
        return min(context_len, check_int("window", window)) * value_dim
    return context_len * value_dim


def key_cache_bytes(variant: str, context_len: int, ranks: Optional[Sequence[int]] = None,
                    block_sizes: Optional[Sequence[int]] = None, head_dim: Optional[int] = None, *,
                    dtype_bytes: Any = 2, **kwargs) -> int:
    """Bytes of :func:`key_cache_elements` (one head, one layer); ``dtype_bytes`` is an int or a torch dtype."""
    return key_cache_elements(variant, context_len, ranks, block_sizes, head_dim, **kwargs) * _dtype_bytes(dtype_bytes)


def kv_cache_bytes(variant: str, context_len: int, ranks: Optional[Sequence[int]] = None,
                   block_sizes: Optional[Sequence[int]] = None, head_dim: Optional[int] = None, *,
                   window: Optional[int] = None, n_embd: Optional[int] = None, n_head: Optional[int] = None,
                   value_dim: Optional[int] = None, n_positions: Optional[int] = None, dtype_bytes: Any = 2) -> int:
    """Bytes of keys + values cached for one head, one layer, one sequence of T tokens.

    ``dtype_bytes``: bytes per element (int, default 2 for fp16/bf16) or a torch dtype (its ``itemsize``).
    """
    keys = key_cache_elements(variant, context_len, ranks, block_sizes, head_dim, window=window, n_embd=n_embd,
                              n_positions=n_positions)
    values = value_cache_elements(variant, context_len, head_dim, ranks=ranks, window=window, n_embd=n_embd,
                                  n_head=n_head, value_dim=value_dim)
    return (keys + values) * _dtype_bytes(dtype_bytes)


# ------------------------------------------------------------------------------------------ config level
#
# The config-level functions take the configs the models take: ``StructAttnGPT2Config`` (GPT-2 family),
# ``StructAttnT5Config`` or a stock ``T5Config`` (encoder-decoder), the ``MLR<Arch>Config`` of a patched decoder.
# Those configs validate their fields when they are built (ValueError naming the field), so the fields are read
# as they are here. To count a config held as a dict (e.g. a saved config.json), build the config first:
# ``StructAttnGPT2Config.from_dict(d)``.


def _gpt2_layer_geometry(config: Any, variant: str) -> dict:
    """Geometry keywords (module docstring) of one ``variant`` layer of a ``StructAttnGPT2Config``."""
    geometry = {"n_embd": config.n_embd, "n_head": config.n_head}
    if variant == "mlr":
        geometry.update(ranks=config.resolved_mlr_ranks, block_sizes=config.resolved_mlr_block_sizes)
    elif variant == "bilinear_mlr":
        geometry["ranks"] = config.bilinear_mlr_ranks
    elif variant == "bilinear_btt":
        geometry.update(btt_rank=config.btt_rank, btt_factors=config.btt_factors)
    elif variant == "swa":
        geometry["window"] = config.sliding_window
    return geometry


def _gpt2_layers(config: Any) -> list[tuple[str, dict]]:
    """(variant, geometry) of every layer, following ``layer_types`` (e.g. global + SWA stacks)."""
    variants = [config.layer_attention(layer) for layer in range(config.n_layer)]
    return [(variant, _gpt2_layer_geometry(config, variant)) for variant in variants]


def nonembedding_matmul_params(config: Any) -> int:
    """Weight-matrix entries outside the embeddings of a ``StructAttnGPT2Config`` decoder (an integer count).

    Per layer: q/k projections (dense/mlr/swa ``2 D^2``; bilinear_mlr ``2 D H sum_l r_l``; bilinear_btt
    ``H (c d b s + b a c s)``, the query being x itself), value and output projections ``2 D^2``, MLP
    ``2 D n_inner`` (``n_inner`` defaults to 4D). Mixed stacks (``layer_types``) are counted layer by layer.
    Biases and LayerNorms are left out: they carry no MACs, and every counted entry costs exactly one MAC per
    token, so the forward cost of these matmuls is ``2 x`` this.
    """
    n_embd, n_head = config.n_embd, config.n_head
    n_inner = 4 * n_embd if config.n_inner is None else config.n_inner
    qk = sum(n_head * _projection_macs(_resolve_head(variant, **geometry), 1, n_embd)
             for variant, geometry in _gpt2_layers(config))
    return qk + config.n_layer * (2 * n_embd * n_embd + 2 * n_embd * n_inner)


def flops_per_token(config: Any, seq_len: int, *, causal: bool = True, training: bool = True,
                    params_nonembedding: Optional[int] = None) -> float:
    """Whole-model FLOPs per token of a ``StructAttnGPT2Config`` decoder (FLOPs = 2 x MACs), batch-size
    independent, at sequence length ``seq_len``.

    ``forward = 2 * N + 2 * n_head * sum_layers (score_macs + pv_macs) / T`` and ``training = 3 * forward``
    (backward ~ 2x forward: the "6N" rule plus the attention terms), where N = ``params_nonembedding`` or
    :func:`nonembedding_matmul_params` (q/k projections of structured variants included there, so they are not
    counted twice), and the attention terms are the causal (by default) per-head counts averaged over the T
    positions. Embedding lookups and the LM head are excluded, as in the usual 6N estimate. MLR block sizes
    come from the config (its training length), not from ``seq_len``. Mixed stacks (``layer_types``) are
    counted layer by layer.
    """
    check_int("seq_len", seq_len)
    if params_nonembedding is None:
        params_nonembedding = nonembedding_matmul_params(config)
    check_int("params_nonembedding", params_nonembedding, minimum=0)
    attention_macs = sum(score_macs(variant, seq_len, causal=causal, **geometry)
                         + pv_macs(variant, seq_len, causal=causal, **geometry)
                         for variant, geometry in _gpt2_layers(config))
    forward = 2 * params_nonembedding + 2 * config.n_head * attention_macs / seq_len
    return 3 * forward if training else forward


@dataclass(frozen=True)
class AttentionCostReport:
    """Attention cost of a whole model (all layers, all heads, batch 1) at ``context_len`` = n_positions.

    FLOP fields are FLOPs (= 2 x MACs) per token: the full-pass count over ``context_len`` positions divided by
    ``context_len`` (``causal`` says which pairs were counted). Score FLOPs exclude the q/k projections (those are
    weight matmuls); ``qk_projection_flops_per_token`` lists them separately. Cache fields are bytes for one
    sequence of ``context_len`` tokens at ``dtype_bytes`` per element. Ratios divide by dense attention of the
    same width (head dim ``n_embd / n_head``) and context.
    """

    variant: str
    context_len: int
    causal: bool
    n_layer: int
    n_head: int
    key_width: int
    value_dim: int
    dtype_bytes: int
    score_flops_per_token: float
    pv_flops_per_token: float
    qk_projection_flops_per_token: int
    dense_score_flops_per_token: float
    dense_pv_flops_per_token: float
    dense_qk_projection_flops_per_token: int
    score_ratio: float
    attention_ratio: float
    key_cache_bytes: int
    kv_cache_bytes: int
    dense_key_cache_bytes: int
    dense_kv_cache_bytes: int
    key_cache_ratio: float
    kv_cache_ratio: float
    # speculative decoding: what the MLR layers' rollback logs add for a crop window of ``rollback_window`` tokens
    rollback_window: int = 0
    rollback_log_bytes: int = 0

    @property
    def attention_flops_per_token(self) -> float:
        """Score + PV FLOPs per token (whole model)."""
        return self.score_flops_per_token + self.pv_flops_per_token

    def to_dict(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        """A small table for model cards and the README."""
        mode = "causal" if self.causal else "bidirectional"
        rows = [
            ("score FLOPs / token", f"{self.score_flops_per_token:,.0f}", f"{self.dense_score_flops_per_token:,.0f}",
             f"{self.score_ratio:.4f}"),
            ("score + PV FLOPs / token", f"{self.attention_flops_per_token:,.0f}",
             f"{self.dense_score_flops_per_token + self.dense_pv_flops_per_token:,.0f}", f"{self.attention_ratio:.4f}"),
            ("q/k projection FLOPs / token", f"{self.qk_projection_flops_per_token:,}",
             f"{self.dense_qk_projection_flops_per_token:,}",
             _ratio_text(self.qk_projection_flops_per_token, self.dense_qk_projection_flops_per_token)),
            ("key cache bytes", f"{self.key_cache_bytes:,}", f"{self.dense_key_cache_bytes:,}",
             f"{self.key_cache_ratio:.4f}"),
            ("KV cache bytes", f"{self.kv_cache_bytes:,}", f"{self.dense_kv_cache_bytes:,}",
             f"{self.kv_cache_ratio:.4f}"),
        ]
        lines = [f"Attention cost of `{self.variant}` ({self.n_layer} layers x {self.n_head} heads, {mode}, "
                 f"context {self.context_len}, cache at {self.dtype_bytes} bytes/element; FLOPs = 2 x MACs)",
                 "", f"| quantity | {self.variant} | dense | ratio |", "|---|---:|---:|---:|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def _ratio_text(value: float, reference: float) -> str:
    return f"{value / reference:.4f}" if reference else "n/a"


def rollback_log_bytes(ranks: Sequence[int], kv_heads: int, mlr_layers: int, rollback_window: Optional[int], *,
                       dtype_bytes: Any = 2) -> int:
    """Bytes one sequence's MLR cache adds to be croppable by up to ``rollback_window`` tokens (speculative
    decoding; None or 0: nothing is recorded). Per MLR layer and logged token: the finer-level keys a write replaced,
    ``kv_heads * sum(ranks[1:])`` elements, plus its position (int64) and padding flag (bool). O(window), independent
    of the context length; the formula bytes of the cache itself are unchanged."""
    window = 0 if rollback_window is None else check_int("rollback_window", rollback_window, minimum=0)
    fine_width = sum(int(rank) for rank in list(ranks)[1:])
    return window * mlr_layers * (kv_heads * fine_width * _dtype_bytes(dtype_bytes) + 8 + 1)


def attention_cost_report(config: Any, *, causal: bool = True, dtype_bytes: Any = 2,
                          context_len: Optional[int] = None,
                          rollback_window: Optional[int] = None) -> AttentionCostReport:
    """Attention FLOPs and cache bytes of a ``StructAttnGPT2Config`` model, whole model, against the same model
    with dense attention.

    Counts every layer as built: its ``layer_types`` entry (the report's ``variant``
    then lists them; ``key_width``/``value_dim`` stay those of ``attention``), MLR blocks from
    ``mlr_block_sizes`` or the dyadic defaults of ``n_positions``, BTT factors from ``btt_factors`` or the
    balanced split of :func:`default_btt_factors`. ``context_len`` defaults to n_positions. ``rollback_window``:
    the crop window of speculative decoding, whose log bytes (:func:`rollback_log_bytes`) the report adds as
    ``rollback_log_bytes`` (not counted in ``key_cache_bytes``).
    """
    context = config.n_positions if context_len is None else check_int("context_len", context_len)
    n_head = config.n_head
    item = _dtype_bytes(dtype_bytes)
    per_token = 2 * n_head / context  # MACs of one head over the pass -> one layer's FLOPs per token

    def layer_costs(variant: str, geometry: dict) -> tuple:
        """(score, PV, q/k projection FLOPs per token, key cache bytes, KV cache bytes) of one layer."""
        head = _resolve_head(variant, **geometry)
        keys = key_cache_elements(variant, context, list(head.ranks) or None, list(head.block_sizes) or None,
                                  head.key_width if variant in ("dense", "swa") else None, window=head.window,
                                  n_embd=head.n_embd)
        values = value_cache_elements(variant, context, window=head.window, value_dim=head.value_dim)
        return (score_macs(variant, context, causal=causal, **geometry) * per_token,
                pv_macs(variant, context, causal=causal, **geometry) * per_token,
                2 * n_head * qk_projection_macs(variant, 1, **geometry),
                keys * n_head * item, (keys + values) * n_head * item)

    layers = _gpt2_layers(config)
    score, pv, projection, keys, kv = (sum(values) for values in zip(*(layer_costs(*layer) for layer in layers)))
    dense_score, dense_pv, dense_projection, dense_keys, dense_kv = (
        config.n_layer * value for value in layer_costs("dense", _gpt2_layer_geometry(config, "dense")))
    names = [variant for variant, _ in layers]
    head = _resolve_head(config.attention, **_gpt2_layer_geometry(config, config.attention))
    return AttentionCostReport(
        variant=config.attention if len(set(names)) == 1 else "|".join(names), context_len=context, causal=causal,
        n_layer=config.n_layer, n_head=n_head, key_width=head.key_width, value_dim=head.value_dim,
        dtype_bytes=item, score_flops_per_token=score, pv_flops_per_token=pv,
        qk_projection_flops_per_token=projection, dense_score_flops_per_token=dense_score,
        dense_pv_flops_per_token=dense_pv, dense_qk_projection_flops_per_token=dense_projection,
        score_ratio=score / dense_score, attention_ratio=(score + pv) / (dense_score + dense_pv),
        key_cache_bytes=keys, kv_cache_bytes=kv, dense_key_cache_bytes=dense_keys, dense_kv_cache_bytes=dense_kv,
        key_cache_ratio=keys / dense_keys, kv_cache_ratio=kv / dense_kv,
        rollback_window=rollback_window or 0,
        rollback_log_bytes=rollback_log_bytes(config.resolved_mlr_ranks, n_head, names.count("mlr"),
                                              rollback_window, dtype_bytes=item) if "mlr" in names else 0,
    )


# --------------------------------------------------------------------------------------- encoder-decoder (T5)


_T5_ROLE_FIELDS = {"encoder_self": "encoder_attention", "decoder_self": "decoder_attention",
                   "cross": "cross_attention"}


def _t5_role_geometry(config: Any, role: str) -> tuple[str, dict]:
    """(variant, geometry) of a T5 attention role; a stock ``T5Config`` has no role fields: dense everywhere."""
    variant = getattr(config, _T5_ROLE_FIELDS[role], "dense")
    if variant == "mlr":
        return variant, {"head_dim": config.d_kv, "ranks": config.mlr_ranks,
                         "block_sizes": config.resolved_mlr_block_sizes}
    if variant == "bilinear_mlr":
        return variant, {"n_embd": config.d_model, "n_head": config.num_heads, "value_dim": config.d_kv,
                         "ranks": config.bilinear_mlr_ranks}
    if variant == "bilinear_btt":
        return variant, {"n_embd": config.d_model, "n_head": config.num_heads, "value_dim": config.d_kv,
                         "btt_rank": config.btt_rank, "btt_factors": config.btt_factors}
    return variant, {"head_dim": config.d_kv}


def _t5_score_pv_macs(variant: str, geometry: dict, query_len: int, key_len: int, causal: bool) -> int:
    if query_len == key_len:
        return (score_macs(variant, query_len, causal=causal, **geometry)
                + pv_macs(variant, query_len, causal=causal, **geometry))
    # cross-attention: every decoder query scores every encoder key (dense or full-rank bilinear only)
    head = _resolve_head(variant, **geometry)
    return query_len * key_len * (head.key_width + head.value_dim)


def encoder_decoder_flops(config: Any, encoder_len: int, decoder_len: int, *, training: bool = True) -> float:
    """FLOPs (= 2 x MACs) of one (encoder_len, decoder_len) example through a T5-style encoder-decoder.

    Works for ``transformers.T5Config`` (dense everywhere) and ``StructAttnT5Config`` (``encoder_attention``,
    ``decoder_attention``, ``cross_attention`` per role; MLR blocks from ``mlr_block_sizes`` or the dyadic
    defaults of ``mlr_max_length``). Counted per layer: q/k/v/o projections ``4 * d_model * num_heads * d_kv``
    per token and role (q/k of the bilinear variants per :func:`qk_projection_macs`), the feed-forward
    (``2`` or, for gated activations, ``3`` ``d_model * d_ff`` per token), the LM head (``d_model * vocab``
    per decoder token: unlike GPT-2's 6N estimate it is kept, being a large share of a tiny Chronos-T5), and
    the score + PV terms of each attention role (encoder self bidirectional, decoder self causal, cross
    ``decoder_len * encoder_len`` pairs). ``training`` multiplies the forward by 3 (backward ~ 2x forward).
    Embedding lookups, norms and the relative position bias are left out.
    """
    encoder_len = check_int("encoder_len", encoder_len)
    decoder_len = check_int("decoder_len", decoder_len)
    d_model, inner = config.d_model, config.num_heads * config.d_kv
    ffn = (3 if config.is_gated_act else 2) * d_model * config.d_ff

    def role_macs(role: str, query_len: int, key_len: int, causal: bool) -> int:
        variant, geometry = _t5_role_geometry(config, role)
        if variant in ("dense", "mlr"):
            qk = (query_len + key_len) * d_model * inner  # q of the queries, k of the keys (cross: decoder/encoder)
        else:
            qk = config.num_heads * _projection_macs(_resolve_head(variant, **geometry), query_len, d_model)
        vo = key_len * d_model * inner + query_len * inner * d_model
        return qk + vo + config.num_heads * _t5_score_pv_macs(variant, geometry, query_len, key_len, causal)

    encoder = config.num_layers * (role_macs("encoder_self", encoder_len, encoder_len, False) + encoder_len * ffn)
    decoder = config.num_decoder_layers * (role_macs("decoder_self", decoder_len, decoder_len, True)
                                           + role_macs("cross", decoder_len, encoder_len, False) + decoder_len * ffn)
    forward = 2.0 * (encoder + decoder + decoder_len * d_model * config.vocab_size)
    return 3.0 * forward if training else forward


# ------------------------------------------------------------------------------- patched transformers decoders


def decoder_cache_report(config: Any, context_len: int, *, dtype_bytes: Any = 2,
                         rollback_window: Optional[int] = None) -> dict:
    """Key / KV cache bytes of a transformers decoder patched by ``hf_structattn.patch`` (its ``MLR<Arch>Config``:
    ``mlr_ranks``, ``mlr_block_sizes`` and ``mlr_layers`` set and checked by the patcher), for one sequence of
    ``context_len`` = T tokens, whole model.

    MLR layers (``mlr_layers``, None = all) hold :func:`key_cache_elements` ``("mlr", T, ...)`` per KV head
    (level 1 every key, level l >= 2 the current block); the other layers keep full keys, ``min(T, w)`` of them
    for sliding-window layers (``layer_types`` / ``sliding_window``). Values keep every position (``min(T, w)``
    for sliding layers). ``dense_*`` counts the same model with full-width keys in its MLR layers.
    Returns ``key_cache_bytes``, ``dense_key_cache_bytes``, ``key_cache_ratio``, ``kv_cache_bytes``,
    ``dense_kv_cache_bytes``, ``kv_cache_ratio`` and ``rollback_log_bytes``: what speculative decoding with a crop
    window of ``rollback_window`` tokens adds (:func:`rollback_log_bytes`; 0 without one).
    """
    from .modeling.structattn_decoder import decoder_geometry, mlr_layer_indices  # the patched models' own reading

    context = check_int("context_len", context_len, minimum=0)
    item = _dtype_bytes(dtype_bytes)
    n_head = config.num_attention_heads
    # architecture-dependent fields: not every transformers decoder config has them
    kv_heads = getattr(config, "num_key_value_heads", None) or n_head
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    geometry = decoder_geometry(config)
    mlr_layers = set(mlr_layer_indices(config))
    mlr_keys = key_cache_elements("mlr", context, list(geometry.ranks), list(geometry.block_sizes), head_dim)
    keys = dense_keys = values = 0
    for layer in range(config.num_hidden_layers):
        sliding = (layer_types[layer] != "full_attention") if layer_types is not None else window is not None
        held = min(context, window) if sliding and window is not None else context
        full = held * head_dim
        values += full
        dense_keys += full
        keys += mlr_keys if layer in mlr_layers else full
    keys, dense_keys, values = (kv_heads * item * count for count in (keys, dense_keys, values))
    return {"key_cache_bytes": keys, "dense_key_cache_bytes": dense_keys,
            "key_cache_ratio": keys / dense_keys if dense_keys else 1.0,
            "kv_cache_bytes": keys + values, "dense_kv_cache_bytes": dense_keys + values,
            "kv_cache_ratio": (keys + values) / (dense_keys + values) if dense_keys else 1.0,
            "rollback_log_bytes": rollback_log_bytes(geometry.ranks, kv_heads, len(mlr_layers), rollback_window,
                                                     dtype_bytes=item)}
