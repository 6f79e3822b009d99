"""The q/k producers shared by the GPT-2 and T5 families (``structattn_qk``), and the T5 family built on
transformers' own T5 ``__init__`` (attributes, parameter names, seeded init, loading)."""

import math

import pytest
import torch
import transformers
from torch.nn import functional as F

from hf_structattn import (
    StructAttnGPT2Config,
    StructAttnGPT2LMHeadModel,
    StructAttnT5Config,
    StructAttnT5EncoderModel,
    StructAttnT5ForConditionalGeneration,
    StructAttnT5Model,
)
from hf_structattn.modeling.modeling_structattn_t5 import StructAttnT5BilinearAttention
from hf_structattn.modeling.structattn_bilinear import BilinearBTTKeyProjection, BilinearMLRProjection
from hf_structattn.modeling.structattn_reference import btt_matrix_reference

WIDTH, HEADS, HEAD_DIM = 32, 4, 8
BILINEAR_RANKS = [4, 2, 1]  # per-head level ranks; level l splits the 32 features into 2^(l-1) chunks
BTT_FACTORS = (4, 8, 4, 8)
EXACT = dict(atol=1e-12, rtol=1e-12)
T5_BASE = dict(vocab_size=40, d_model=WIDTH, d_kv=HEAD_DIM, d_ff=48, num_layers=2, num_decoder_layers=3,
               num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
T5_VARIANT_FIELDS = {
    "mlr": dict(encoder_attention="mlr", decoder_attention="mlr", mlr_ranks=[4, 2, 2], mlr_max_length=16),
    "bilinear_mlr": dict(encoder_attention="bilinear_mlr", cross_attention="bilinear_mlr",
                         bilinear_mlr_ranks=BILINEAR_RANKS),
    "bilinear_btt": dict(encoder_attention="bilinear_btt", cross_attention="bilinear_btt", btt_factors=list(BTT_FACTORS)),
}


pytestmark = pytest.mark.usefixtures("float64_default")


def gpt2_attention(variant, **fields):
    config = StructAttnGPT2Config(vocab_size=40, n_positions=32, n_embd=WIDTH, n_layer=1, n_head=HEADS,
                                  attention=variant, mlr_ranks=[4, 2, 2], bilinear_mlr_ranks=BILINEAR_RANKS,
                                  btt_factors=list(BTT_FACTORS), **fields)
    return StructAttnGPT2LMHeadModel(config).transformer.h[0].attn


def t5_attention(variant, role="encoder"):
    model = StructAttnT5ForConditionalGeneration(StructAttnT5Config(**T5_BASE, **T5_VARIANT_FIELDS[variant]))
    if role == "encoder":
        return model.encoder.block[0].layer[0].SelfAttention
    return model.decoder.block[0].layer[1].EncDecAttention


def randomise_(module):
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param))


def heads_of(x):
    """(B, T, H*E) -> (B, H, T, E)."""
    return x.view(*x.shape[:2], HEADS, -1).transpose(1, 2)


def bilinear_mlr_reference(x, weights, scales):
    """Per-head query (or key) of bilinear MLR, by the paper's definition (App. B.2) with explicit loops: level l
    cuts x into p_l chunks, chunk c goes through its own (D/p_l, H*r_l) matrix; a head's vector is the
    concatenation over levels and, within a level, over chunks, times the level's scale."""
    heads = []
    for head in range(HEADS):
        parts = []
        for weight, rank, scale in zip(weights, BILINEAR_RANKS, scales):
            chunks, size = weight.shape[0], weight.shape[1]
            for chunk in range(chunks):
                block = weight[chunk][:, head * rank:(head + 1) * rank]
                parts.append(scale * x[..., chunk * size:(chunk + 1) * size] @ block)
        heads.append(torch.cat(parts, dim=-1))
    return torch.stack(heads, dim=1)


def bilinear_scales(scaling="standard"):
    widths = [2 ** level * rank for level, rank in enumerate(BILINEAR_RANKS)]
    return [1 / math.sqrt(w) if scaling == "standard" else 1 / w for w in widths]


def test_bilinear_mlr_query_key_equal_in_both_families_and_the_definition():
    torch.manual_seed(0)
    gpt2, t5 = gpt2_attention("bilinear_mlr"), t5_attention("bilinear_mlr", role="cross")
    randomise_(gpt2)
    with torch.no_grad():  # identical structured weights in both families
        for side in ("q_proj", "k_proj"):
            for ours, theirs in zip(getattr(t5, side).weights, getattr(gpt2, side).weights):
                ours.copy_(theirs)
    x, encoder_states = torch.randn(2, 7, WIDTH), torch.randn(2, 5, WIDTH)
    query, key, _ = gpt2._query_key_value(x)
    expected_query = bilinear_mlr_reference(x, list(gpt2.q_proj.weights), bilinear_scales())
    torch.testing.assert_close(query, expected_query, **EXACT)
    torch.testing.assert_close(key, bilinear_mlr_reference(x, list(gpt2.k_proj.weights), [1.0] * 3), **EXACT)
    t5_query, t5_key = t5.queries(x), t5.keys(encoder_states)  # cross-attention: keys from the encoder states
    torch.testing.assert_close(t5_query, expected_query, **EXACT)
    torch.testing.assert_close(t5_key, bilinear_mlr_reference(encoder_states, list(gpt2.k_proj.weights), [1.0] * 3),
                               **EXACT)


def test_bilinear_btt_query_key_equal_in_both_families_and_the_definition():
    torch.manual_seed(0)
    gpt2, t5 = gpt2_attention("bilinear_btt"), t5_attention("bilinear_btt")
    randomise_(gpt2)
    with torch.no_grad():
        t5.k_proj.weight_r.copy_(gpt2.k_proj.weight_r)
        t5.k_proj.weight_l.copy_(gpt2.k_proj.weight_l)
    x = torch.randn(2, 6, WIDTH)
    query, key, _ = gpt2._query_key_value(x)
    # query = x / sqrt(D) for every head; key_h = M_h x with M_h built from block-diagonal and permutation matrices
    expected_query = (x / math.sqrt(WIDTH))[:, None].expand(-1, HEADS, -1, -1)
    matrices = [btt_matrix_reference(gpt2.k_proj.weight_l, gpt2.k_proj.weight_r, head, *BTT_FACTORS, 1)
                for head in range(HEADS)]
    expected_key = torch.stack([x @ m.T for m in matrices], dim=1)
    torch.testing.assert_close(query, expected_query, **EXACT)
    torch.testing.assert_close(key, expected_key, **EXACT)
    t5_query, t5_key = t5.queries(x), t5.keys(x)
    torch.testing.assert_close(t5_query, expected_query, **EXACT)
    torch.testing.assert_close(t5_key, expected_key, **EXACT)


def test_mlr_query_key_equal_from_gpt2_fused_projection_and_t5_separate_projections():
    torch.manual_seed(0)
    gpt2, t5 = gpt2_attention("mlr"), t5_attention("mlr")
    randomise_(gpt2)
    weight = gpt2.c_attn.weight  # Conv1D: (D, 3D), columns [q | k | v]
    with torch.no_grad():  # nn.Linear stores (out, in)
        t5.q.weight.copy_(weight[:, :WIDTH].T)
        t5.k.weight.copy_(weight[:, WIDTH:2 * WIDTH].T)
    x = torch.randn(2, 6, WIDTH)
    expected_query = heads_of(x @ weight[:, :WIDTH] + gpt2.c_attn.bias[:WIDTH])
    expected_key = heads_of(x @ weight[:, WIDTH:2 * WIDTH] + gpt2.c_attn.bias[WIDTH:2 * WIDTH])
    query, key, _ = gpt2._query_key_value(x)
    torch.testing.assert_close(query, expected_query, **EXACT)
    torch.testing.assert_close(key, expected_key, **EXACT)
    # an MLR role keeps transformers' T5Attention and its q, k (no bias): MLR only changes how q.k is scored
    assert type(t5) is transformers.models.t5.modeling_t5.T5Attention
    t5_query, t5_key = heads_of(t5.q(x)), heads_of(t5.k(x))
    torch.testing.assert_close(t5_query, heads_of(x @ weight[:, :WIDTH]), **EXACT)
    torch.testing.assert_close(t5_key, heads_of(x @ weight[:, WIDTH:2 * WIDTH]), **EXACT)


@pytest.mark.parametrize("qk_norm", ["layernorm", "rms"])
def test_gpt2_normalised_bilinear_mlr_query_key_follow_the_definition(qk_norm):
    """LayerNorm per level (paper App. E), RMSNorm over the whole head, scales after the normalisation."""
    torch.manual_seed(0)
    attention = gpt2_attention("bilinear_mlr", qk_layernorm=True, qk_norm=qk_norm, bilinear_scaling="mup")
    randomise_(attention)
    x = torch.randn(2, 5, WIDTH)
    query, key, _ = attention._query_key_value(x)
    widths = [2 ** level * rank for level, rank in enumerate(BILINEAR_RANKS)]

    def normalised(projection, norms):
        raw = bilinear_mlr_reference(x, list(projection.weights), [1.0] * 3).split(widths, dim=-1)
        if qk_norm == "layernorm":
            return [F.layer_norm(level, (w,), n.weight, n.bias, 1e-5) for level, w, n in zip(raw, widths, norms)]
        whole = torch.cat(raw, dim=-1)
        whole = whole / whole.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * norms.weight
        return whole.split(widths, dim=-1)

    q_norms = attention.q_norms if qk_norm == "layernorm" else attention.q_norm
    k_norms = attention.k_norms if qk_norm == "layernorm" else attention.k_norm
    expected_query = torch.cat([s * q for s, q in zip(bilinear_scales("mup"), normalised(attention.q_proj, q_norms))],
                               dim=-1)
    torch.testing.assert_close(query, expected_query, **EXACT)
    torch.testing.assert_close(key, torch.cat(normalised(attention.k_proj, k_norms), dim=-1), **EXACT)


def test_structured_projections_initialise_from_their_fan_in():
    """N(0, factor^2 / fan_in) per factor, the one formula behind both families' init and muP's fan-ins."""
    torch.manual_seed(0)
    mlr = BilinearMLRProjection(256, 8, [16, 8])
    btt = BilinearBTTKeyProjection(256, 8, (16, 16, 16, 16), 2)
    assert mlr.fan_ins() == {"weights.0": 256, "weights.1": 128}
    assert btt.fan_ins() == {"weight_r": 16, "weight_l": 32}
    for factor in (1.0, 3.0):
        for module in (mlr, btt):
            module.reset_parameters(factor)
            for name, fan_in in module.fan_ins().items():
                weight = module.get_parameter(name)
                # >= 16k samples: the sample std is within 3% of the true one far beyond 5 sigma
                assert weight.numel() >= 16384
                assert abs(float(weight.std()) / (factor * fan_in ** -0.5) - 1) < 0.03, name
                assert abs(float(weight.mean())) < 0.05 * factor * fan_in ** -0.5, name


# --- the T5 family on transformers' own T5 __init__ -------------------------------------------------------------

STOCK_CLASSES = [(StructAttnT5ForConditionalGeneration, transformers.T5ForConditionalGeneration),
                 (StructAttnT5Model, transformers.T5Model), (StructAttnT5EncoderModel, transformers.T5EncoderModel)]


@pytest.mark.parametrize("variant", ["dense", "mlr", "bilinear_mlr"])
@pytest.mark.parametrize("ours_class,stock_class", STOCK_CLASSES)
def test_every_attribute_of_stock_t5_exists_on_ours(ours_class, stock_class, variant):
    fields = T5_VARIANT_FIELDS.get(variant, {})
    if stock_class is transformers.T5EncoderModel:
        fields = {k: v for k, v in fields.items() if k != "cross_attention"}
    stock = stock_class(transformers.T5Config(**T5_BASE))
    ours = ours_class(StructAttnT5Config(**T5_BASE, **fields))
    ours_modules = dict(ours.named_modules())
    replaced = [name for name, module in ours_modules.items() if isinstance(module, StructAttnT5BilinearAttention)]
    for name, module in stock.named_modules():
        if any(name == r or name.startswith(r + ".") for r in replaced):
            continue  # a structured role replaces the T5Attention (and adopts its v, o: test_seeded_bilinear_...)
        missing = set(vars(module)) - set(vars(ours_modules[name]))
        assert not missing, f"{name or 'the model'} lacks {sorted(missing)}"
    for name in ("encoder", "decoder"):  # the stacks are transformers' own
        if hasattr(stock, name):
            assert type(getattr(ours, name)) is transformers.models.t5.modeling_t5.T5Stack
    if variant == "dense":
        assert list(ours.state_dict()) == list(stock.state_dict())


def test_seeded_mlr_model_has_exactly_stock_t5_weights():
    """MLR adds no parameter: built under the same seed, every tensor equals stock T5's (the stock __init__ and its
    init ran unchanged, and nothing was initialised a second time after the swap)."""
    stock = (torch.manual_seed(3), transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_BASE)))[1]
    ours = (torch.manual_seed(3), StructAttnT5ForConditionalGeneration(StructAttnT5Config(
        **T5_BASE, **T5_VARIANT_FIELDS["mlr"])))[1]
    assert list(ours.state_dict()) == list(stock.state_dict())
    for (name, a), (_, b) in zip(ours.state_dict().items(), stock.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("variant", ["bilinear_mlr", "bilinear_btt"])
def test_seeded_bilinear_model_is_deterministic_and_keeps_stock_stack_weights(variant):
    def build():
        torch.manual_seed(5)
        return StructAttnT5ForConditionalGeneration(StructAttnT5Config(**T5_BASE, **T5_VARIANT_FIELDS[variant]))

    first, second = build(), build()
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    torch.manual_seed(5)
    stock = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_BASE)).state_dict()
    ours = first.state_dict()
    shared = [name for name in stock if name.startswith(("encoder.block", "decoder.block")) and name in ours]
    # the stacks' own parameters (v, o and relative bias of the structured roles included) keep the stock values
    assert any(".SelfAttention.v." in name for name in shared)
    for name in shared:
        torch.testing.assert_close(ours[name], stock[name], atol=0, rtol=0, msg=name)
    new = [name for name in ours if name not in stock]
    assert new and all("_proj." in name for name in new)


def test_a_built_model_initialises_adopted_and_new_modules():
    config = StructAttnT5Config(**T5_BASE, **T5_VARIANT_FIELDS["bilinear_mlr"])
    torch.manual_seed(0)
    model = StructAttnT5EncoderModel(config)
    attention = model.encoder.block[0].layer[0].SelfAttention
    assert isinstance(attention, StructAttnT5BilinearAttention)
    # T5's formula for v (std d_model^-1/2) and the fan-in formula for the new projections, not torch.empty
    for weight, std in [(attention.v.weight, WIDTH ** -0.5), (attention.q_proj.weights[0], WIDTH ** -0.5)]:
        assert torch.isfinite(weight).all() and 0.7 < float(weight.std()) / std < 1.3


def test_from_pretrained_keeps_loaded_weights_and_initialises_only_new_projections(tmp_path):
    torch.manual_seed(0)
    stock = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_BASE))
    with torch.no_grad():
        for param in stock.parameters():
            param.add_(3.0)  # far from any init: a re-initialised tensor cannot pass for a loaded one
    stock.save_pretrained(tmp_path)
    config = StructAttnT5Config(**T5_BASE, **T5_VARIANT_FIELDS["bilinear_mlr"])
    loaded = StructAttnT5ForConditionalGeneration.from_pretrained(tmp_path, config=config)
    state, expected = loaded.state_dict(), stock.state_dict()
    for name in set(state) & set(expected):
        torch.testing.assert_close(state[name], expected[name], atol=0, rtol=0, msg=name)
    projection = loaded.encoder.block[0].layer[0].SelfAttention.q_proj.weights[0]
    assert torch.isfinite(projection).all() and 0.7 < float(projection.std()) * WIDTH ** 0.5 < 1.3
    assert abs(float(projection.mean())) < 0.1


def test_both_families_initialise_container_modules_by_their_formulas():
    """Init branches that target a module without direct parameters (an attention or feed-forward layer setting its
    children) run: T5's q/k/v/o and wi/wo formulas in dense and structured roles, GPT-2's scaled residual
    projections (std 0.02 / sqrt(2 n_layer)). transformers' custom-code guard would skip them."""
    torch.manual_seed(0)
    width, head_dim, layers = 256, 64, 8
    t5 = StructAttnT5ForConditionalGeneration(StructAttnT5Config(
        vocab_size=40, d_model=width, d_kv=head_dim, d_ff=256, num_layers=1, num_decoder_layers=1, num_heads=4,
        encoder_attention="mlr", mlr_ranks=[32, 32], mlr_max_length=16, decoder_start_token_id=0))
    checks = []
    for attention in (t5.encoder.block[0].layer[0].SelfAttention, t5.decoder.block[0].layer[0].SelfAttention):
        checks += [(attention.q.weight, (width * head_dim) ** -0.5), (attention.k.weight, width ** -0.5),
                   (attention.o.weight, (4 * head_dim) ** -0.5)]
    checks.append((t5.encoder.block[0].layer[1].DenseReluDense.wo.weight, 256 ** -0.5))
    gpt2 = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(vocab_size=40, n_positions=32, n_embd=width,
                                                          n_layer=layers, n_head=4))
    block = gpt2.transformer.h[0]
    checks += [(block.attn.c_proj.weight, 0.02 / math.sqrt(2 * layers)),
               (block.mlp.c_proj.weight, 0.02 / math.sqrt(2 * layers)), (block.attn.c_attn.weight, 0.02)]
    for weight, std in checks:  # >= 65k samples each: the sample std is within 3% far beyond 5 sigma
        assert abs(float(weight.std()) / std - 1) < 0.03, (tuple(weight.shape), float(weight.std()), std)
