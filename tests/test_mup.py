import pytest
import torch

from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
from hf_structattn.mup import mup_config_overrides, mup_init_, mup_param_groups, mup_rules


def _model(width, attention="mlr", tie=True):
    fields = dict(mlr_ranks=[4, 2, 1, 1]) if attention == "mlr" else dict(bilinear_mlr_ranks=[4, 2, 1, 1])
    config = StructAttnGPT2Config(vocab_size=50, n_positions=32, n_embd=width, n_head=width // 8, n_layer=2,
                                  attention=attention, tie_word_embeddings=tie, **fields,
                                  **mup_config_overrides())
    return StructAttnGPT2LMHeadModel(config)


def _multipliers(model, base_width):
    return {name: group["lr_multiplier"] for group in mup_param_groups(model, 1e-3, base_width)
            for name in group["names"]}


def test_multipliers_for_two_widths():
    small, large = _multipliers(_model(32), 32), _multipliers(_model(64), 32)
    # hidden matrices: lr * base / fan_in -> halves when the width doubles
    assert small["transformer.h.0.attn.c_attn.weight"] == 1.0
    assert large["transformer.h.0.attn.c_attn.weight"] == 0.5
    assert small["transformer.h.0.mlp.c_proj.weight"] == 32 / 128  # fan-in 4D
    assert large["transformer.h.0.mlp.c_proj.weight"] == 32 / 256
    # embeddings, norms, biases keep the base learning rate at every width
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.1.ln_1.weight",
                 "transformer.h.0.attn.c_attn.bias"):
        assert small[name] == large[name] == 1.0


def test_bilinear_levels_get_their_own_fan_in():
    multipliers = _multipliers(_model(64, "bilinear_mlr"), 64)
    # level l has fan-in D / 2^(l-1): finer levels learn faster
    assert [multipliers[f"transformer.h.0.attn.q_proj.weights.{level}"] for level in range(4)] == [1.0, 2.0, 4.0, 8.0]


def test_mup_init_zeroes_outputs_and_scales_hidden():
    torch.manual_seed(0)
    model = _model(64, tie=False)  # the authors' muP runs untie the LM head
    mup_init_(model)
    assert torch.count_nonzero(model.lm_head.weight) == 0
    assert _multipliers(model, 32)["lm_head.weight"] == 0.5
    assert torch.count_nonzero(model.transformer.h[0].attn.c_proj.weight) == 0
    std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert std == pytest.approx(64 ** -0.5, rel=0.1)
    rules = mup_rules(model)
    assert rules["transformer.h.0.attn.c_attn.weight"].fan_in == 64
    tied = _model(64)  # a tied head is the embedding: initialised and stepped as one
    mup_init_(tied)
    assert "lm_head.weight" not in mup_rules(tied)
    assert tied.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_param_groups_cover_every_parameter_once():
    model = _model(32)
    groups = mup_param_groups(model, 1e-3, 32, weight_decay=0.1)
    grouped = [p for g in groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in model.parameters()})
    rules = mup_rules(model)
    for group in groups:
        assert group["lr"] == pytest.approx(1e-3 * group["lr_multiplier"])
        for name in group["names"]:  # decay only on matrices
            assert group["weight_decay"] == (0.1 if rules[name].fan_in is not None else 0.0), name
    with pytest.raises(ValueError, match="base_width"):
        mup_param_groups(model, 1e-3, 0)
