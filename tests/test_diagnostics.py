"""The rank probe of each head's score form (hf_structattn.diagnostics.effective_rank) and the rank-keeping q/k
normalisation (qk_norm="rms")."""

import pytest
import torch

from hf_structattn import StructAttnGPT2Config, StructAttnGPT2ForInContextRegression, StructAttnGPT2LMHeadModel
from hf_structattn.diagnostics import effective_rank


def _model(**fields):
    base = dict(vocab_size=8, n_positions=16, n_embd=32, n_layer=1, n_head=4)
    base.update(fields)
    torch.manual_seed(0)
    return StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**base))


def _ranks(model):
    ranks = effective_rank(model)
    return {(head.span, head.local) for head in ranks}


def test_dense_head_has_rank_r():
    assert _ranks(_model()) == {(8, 8)}  # head dim 8 at D = 32


def test_bilinear_btt_is_full_rank():
    assert _ranks(_model(attention="bilinear_btt")) == {(32, 32)}
    assert _ranks(_model(attention="bilinear_btt", btt_rank=2, btt_factors=[4, 8, 8, 4])) == {(32, 32)}


@pytest.mark.parametrize("ranks, heads, expected", [([2, 1, 1], 8, 8), ([4, 4, 4], 2, 28), ([8, 8, 8], 1, 32)])
def test_bilinear_mlr_rank_is_min_of_width_and_sum_p_r(ranks, heads, expected):
    # sum_l p_l r_l: 2+2+4 = 8; 4+8+16 = 28; 8+16+32 = 56 > D = 32
    assert _ranks(_model(attention="bilinear_mlr", bilinear_mlr_ranks=ranks, n_head=heads)) == {(expected,) * 2}


def test_layernorm_loses_rank_and_rms_keeps_it():
    # dense r = 8: LayerNorm removes the mean direction (7; 6 at a point with the radial direction)
    assert _ranks(_model(qk_layernorm=True)) == {(7, 6)}
    assert _ranks(_model(qk_layernorm=True, qk_norm="rms")) == {(8, 7)}
    # bilinear MLR 2|1|1 has level widths 2, 2, 4: per-level LayerNorm leaves a sign, a sign and 3 directions
    bilinear = dict(attention="bilinear_mlr", bilinear_mlr_ranks=[2, 1, 1], n_head=8, qk_layernorm=True)
    assert _ranks(_model(**bilinear)) == {(3, 2)}
    assert _ranks(_model(**bilinear, qk_norm="rms")) == {(8, 7)}
    assert _ranks(_model(attention="bilinear_btt", qk_layernorm=True, qk_norm="rms")) == {(32, 31)}
    assert _ranks(_model(attention="mlr", mlr_ranks=[4, 2, 2], qk_layernorm=True, qk_norm="rms")) == {(8, 7)}


def test_probe_reports_every_layer_and_head_of_an_icl_model():
    torch.manual_seed(0)
    model = StructAttnGPT2ForInContextRegression(StructAttnGPT2Config(
        vocab_size=1, n_positions=16, n_embd=24, n_layer=2, n_head=8, icl_input_dim=4, qk_layernorm=True,
        qk_norm="rms"))
    ranks = effective_rank(model, num_pairs=4)
    assert [(head.layer, head.head) for head in ranks] == [(layer, head) for layer in range(2) for head in range(8)]
    assert {head.span for head in ranks} == {3}
    with pytest.raises(ValueError, match="inputs must have shape"):
        effective_rank(model, inputs=torch.zeros(4, 7))


def test_rms_norm_config_round_trips_and_default_keeps_old_checkpoints(tmp_path):
    old = _model(qk_layernorm=True)  # a config without qk_norm is what every earlier checkpoint saved
    assert old.config.qk_norm == "layernorm"
    assert type(old.transformer.h[0].attn.q_norm) is torch.nn.LayerNorm
    saved = old.config.to_dict()
    saved.pop("qk_norm")
    assert StructAttnGPT2Config(**{k: v for k, v in saved.items() if k not in ("model_type", "transformers_version",
                                                                               "architectures")}).qk_norm == "layernorm"
    new = _model(qk_layernorm=True, qk_norm="rms").eval()
    new.save_pretrained(tmp_path)
    reloaded = StructAttnGPT2LMHeadModel.from_pretrained(tmp_path)
    assert type(reloaded.transformer.h[0].attn.q_norm) is torch.nn.RMSNorm
    ids = torch.arange(8)[None]
    torch.testing.assert_close(reloaded(input_ids=ids).logits, new(input_ids=ids).logits)
    with pytest.raises(ValueError, match="qk_norm='batch'"):
        StructAttnGPT2Config(qk_norm="batch")


def test_mlr_logit_scale_by_depth_shows_what_averaging_does_to_each_scaling():
    # q/k LayerNorm gives unit-variance components, so a level of rank r_l with scale a contributes std a*sqrt(r_l):
    # ranks 32|16|8|8 -> distant pairs sqrt(32)*a_1; nearest pairs sqrt(sum a_l^2 r_l) / 4 when averaged
    from hf_structattn.diagnostics import mlr_logit_std_by_depth

    def stds(scaling):
        model = _model(attention="mlr", n_embd=64, n_head=1, n_positions=64, mlr_ranks=[32, 16, 8, 8],
                       qk_layernorm=True, mlr_scaling=scaling, mlr_average_levels=True)
        return mlr_logit_std_by_depth(model, num_tokens=128)

    standard, authors = stds("standard"), stds("mup")
    assert standard[0] == pytest.approx(32 ** 0.5 / 8, rel=0.15)
    assert standard[-1] == pytest.approx(1 / 4, rel=0.15)  # nearest pairs 2.8x smaller here (5.7x at 8 levels)
    assert authors[0] == pytest.approx(32 ** -0.5, rel=0.15)
    assert authors[-1] == pytest.approx((1 / 32 + 1 / 16 + 1 / 8 + 1 / 8) ** 0.5 / 4, rel=0.15)
    with pytest.raises(ValueError, match="no MLR layer"):
        mlr_logit_std_by_depth(_model())
