"""Bilinear MLR / bilinear BTT / sliding-window ops against their references, and the bilinear-form rank probe."""

import pytest
import torch

from hf_structattn.modeling.structattn_bilinear import (
    BilinearBTTKeyProjection,
    BilinearMLRProjection,
    default_btt_factors,
)
from hf_structattn.modeling.structattn_ops import fused_attention, sliding_window_allowed
from hf_structattn.modeling.structattn_reference import (
    allowed_pairs,
    bilinear_mlr_matrix_reference,
    btt_matrix_reference,
    dense_attention_reference,
    masked_softmax_attention,
)



pytestmark = pytest.mark.usefixtures("float64_default")


def _bilinear_mlr_scores(proj_q, proj_k, x, level_scales):
    """Fast path: structured projections, per-level scale folded into q, one dot product per head."""
    q = torch.cat([s * level for s, level in zip(level_scales, proj_q(x))], dim=-1)
    k = torch.cat(proj_k(x), dim=-1)
    return q, k


@pytest.mark.parametrize("hidden,heads,ranks", [(16, 2, (2, 1, 1)), (32, 4, (4, 2, 1, 1)), (24, 3, (3, 2))])
def test_bilinear_mlr_matches_block_diagonal_reference(hidden, heads, ranks):
    torch.manual_seed(0)
    proj_q, proj_k = BilinearMLRProjection(hidden, heads, ranks), BilinearMLRProjection(hidden, heads, ranks)
    level_scales = [0.5 ** level for level in range(len(ranks))]
    x = torch.randn(2, 9, hidden)
    q, k = _bilinear_mlr_scores(proj_q, proj_k, x, level_scales)
    assert q.shape == (2, heads, 9, sum(2 ** level * r for level, r in enumerate(ranks)))
    for head in range(heads):
        matrix = bilinear_mlr_matrix_reference(list(proj_q.weights), list(proj_k.weights), head, ranks, level_scales)
        torch.testing.assert_close(q[:, head] @ k[:, head].transpose(-1, -2), x @ matrix @ x.transpose(-1, -2))


@pytest.mark.parametrize("hidden,heads,factors,rank", [(16, 2, None, 1), (12, 3, (3, 4, 2, 6), 2), (64, 2, None, 1)])
def test_btt_key_projection_matches_permutation_reference(hidden, heads, factors, rank):
    torch.manual_seed(0)
    proj = BilinearBTTKeyProjection(hidden, heads, factors, rank)
    x = torch.randn(2, 5, hidden)
    keys = proj(x)
    for head in range(heads):
        matrix = btt_matrix_reference(proj.weight_l, proj.weight_r, head, *proj.factors, rank)
        torch.testing.assert_close(keys[:, head], x @ matrix.T)


def _score_matrix_rank(scores: torch.Tensor) -> int:
    return int(torch.linalg.matrix_rank(scores))


def test_bilinear_form_rank_probe():
    """s(e_i, e_j) over basis vectors is the head's bilinear matrix: rank r (dense), D (BTT), min(D, sum p_l r_l)."""
    torch.manual_seed(0)
    hidden, heads = 32, 4
    basis = torch.eye(hidden)[None]  # T = D tokens, x_i = e_i
    head_dim = hidden // heads
    w_q, w_k = torch.randn(hidden, hidden), torch.randn(hidden, hidden)
    dense_q = (basis @ w_q).view(1, hidden, heads, head_dim).transpose(1, 2)
    dense_k = (basis @ w_k).view(1, hidden, heads, head_dim).transpose(1, 2)
    assert _score_matrix_rank(dense_q[0, 0] @ dense_k[0, 0].T) == head_dim

    btt_keys = BilinearBTTKeyProjection(hidden, heads)(basis)
    assert _score_matrix_rank(basis[0] @ btt_keys[0, 0].T) == hidden

    for ranks, expected in [((4, 2, 1, 1), 4 + 4 + 4 + 8), ((2, 2, 2, 2), 2 + 4 + 8 + 16), ((4, 4, 4, 4), hidden),
                            ((8,), 8)]:
        proj_q, proj_k = BilinearMLRProjection(hidden, heads, ranks), BilinearMLRProjection(hidden, heads, ranks)
        q, k = _bilinear_mlr_scores(proj_q, proj_k, basis, [1.0] * len(ranks))
        assert _score_matrix_rank(q[0, 1] @ k[0, 1].T) == expected


@pytest.mark.parametrize("causal", [True, False])
def test_fused_attention_with_unequal_widths_matches_softmax(causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 11, 20), torch.randn(2, 3, 11, 20), torch.randn(2, 3, 11, 6)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, :3] = False
    positions = torch.arange(11).expand(2, 11)
    allowed = allowed_pairs(positions, positions, causal, mask)
    got = fused_attention(q, k, v, scale=0.3, causal=causal, allowed=allowed)
    expected = masked_softmax_attention(0.3 * q @ k.transpose(-1, -2), v, allowed)
    torch.testing.assert_close(got[1], expected[1])
    torch.testing.assert_close(got[0, :, 3:], expected[0, :, 3:])
    narrow = fused_attention(v, v, q, scale=1.0, causal=causal)  # qk width 6 < value width 20
    torch.testing.assert_close(narrow, masked_softmax_attention(v @ v.transpose(-1, -2), q,
                                                                allowed_pairs(positions, positions, causal, None)))


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_matches_reference(causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    positions = torch.arange(30)[None]
    allowed = sliding_window_allowed(positions, positions, 5, causal)
    got = fused_attention(q, k, v, scale=8 ** -0.5, causal=causal, allowed=allowed)
    expected = dense_attention_reference(q, k, v, causal=causal, sliding_window=5)
    torch.testing.assert_close(got, expected)
    # a window of 1 with causal masking attends only to itself
    if causal:
        only_self = fused_attention(q, k, v, scale=1.0, causal=True,
                                    allowed=sliding_window_allowed(positions, positions, 1, True))
        torch.testing.assert_close(only_self, v)


def test_invalid_bilinear_geometry_names_the_field():
    with pytest.raises(ValueError, match="bilinear_mlr_ranks"):
        BilinearMLRProjection(10, 2, (2, 1, 1))  # 10 not divisible by 4
    with pytest.raises(ValueError, match="bilinear_mlr_ranks"):
        BilinearMLRProjection(16, 2, (2, 0))
    with pytest.raises(ValueError, match="btt_factors"):
        BilinearBTTKeyProjection(16, 2, (3, 5, 4, 4))
    with pytest.raises(ValueError, match="btt_rank"):
        BilinearBTTKeyProjection(16, 2, (4, 4, 4, 4), 0)
    assert default_btt_factors(256) == (16, 16, 16, 16)
    assert default_btt_factors(768) == (24, 32, 24, 32)
