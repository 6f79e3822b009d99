"""Model-level contracts (docs/contracts.md): caller positions in uncached forwards, float16/bfloat16 for every
variant, output_attentions, and clear errors for bad input. Exactness checks run in float64."""

import pytest
import torch
import transformers

from hf_structattn import StructAttnT5Config, StructAttnT5ForConditionalGeneration

from conftest import tiny_lm
from model_helpers import T5_BASE, T5_MLR, tiny_structattn_t5

GPT2_VARIANTS = ["dense", "mlr", "mlr_avg_mup", "bilinear_mlr", "bilinear_btt", "swa", "mixed"]
T5_VARIANTS = {
    "dense": {},
    "mlr": T5_MLR,
    "mlr_avg": dict(T5_MLR, mlr_average_levels=True, mlr_scaling="mup"),
    "bilinear": dict(encoder_attention="bilinear_mlr", decoder_attention="bilinear_btt",
                     cross_attention="bilinear_mlr", bilinear_mlr_ranks=[4, 4]),
}
EXACT = dict(atol=1e-12, rtol=1e-12)


def _ids(batch=2, length=20, seed=3, vocab=61):
    return torch.randint(2, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# -------------------------------------------------------------------------------------------- positions (item 2)


@pytest.mark.parametrize("variant", GPT2_VARIANTS)
@pytest.mark.parametrize("training", [False, True])
def test_gpt2_uncached_forward_honours_offset_and_per_row_positions(variant, training):
    """Positions not starting at 0 and per-row offsets without a mask: the fast path equals the materialised
    reference path (attn_implementation="eager") in float64, and every row equals the row alone."""
    model = tiny_lm(variant).double().train(training)
    ids = _ids(3)
    positions = torch.stack([torch.arange(5, 25), torch.arange(0, 20), torch.arange(19, 39)])
    fast = model(ids, position_ids=positions, use_cache=False)
    materialised = tiny_lm(variant, attn_implementation="eager").double().train(training)
    reference = materialised(ids, position_ids=positions, use_cache=False)
    torch.testing.assert_close(fast.logits, reference.logits, **EXACT)
    for row in range(3):
        alone = model(ids[row:row + 1], position_ids=positions[row:row + 1], use_cache=False).logits
        torch.testing.assert_close(fast.logits[row:row + 1], alone, **EXACT)
    if training:
        fast.logits.sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_t5_mlr_unpadded_batch_with_bias_matches_rows_alone():
    """T = 9 with blocks 8|4, batch 2 and no padding mask: the (1, H, T, T) relative bias reaches the fused op
    unexpanded (the call-site workaround is gone)."""
    model = tiny_structattn_t5(**T5_MLR).double()
    ids = _ids(2, 9, vocab=50)
    decoder_ids = _ids(2, 9, seed=4, vocab=50)
    both = model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False).logits
    for row in range(2):
        alone = model(input_ids=ids[row:row + 1], decoder_input_ids=decoder_ids[row:row + 1], use_cache=False).logits
        torch.testing.assert_close(both[row:row + 1], alone, **EXACT)


# --------------------------------------------------------------------------------------- low precision (item 3)

# A tiny model's logits and gradients in fp16/bf16 against float32 on the same (rounded) weights: every matmul,
# norm and softmax rounds, so the tolerance is a multiple of the dtype's epsilon times the values' magnitude.
# 64 eps covers 2-3 layers of rounding with margin.
LOW_PRECISION_EPS = 64


def _assert_low_precision_close(low, exact, dtype, what, same_dtype=True):
    assert low.dtype == dtype or not same_dtype, what
    assert torch.isfinite(low).all(), what
    scale = max(1.0, exact.detach().abs().max().item())
    torch.testing.assert_close(low.float(), exact, atol=LOW_PRECISION_EPS * torch.finfo(dtype).eps * scale, rtol=0,
                               msg=lambda m: f"{what}: {m}")


def _forward_backward(model, rows, **inputs):
    """Logits of the real rows (B, T, 1) and parameter gradients of a loss over them (padded rows are
    unspecified)."""
    model.zero_grad()
    logits = model(**inputs, use_cache=False).logits * rows
    logits.float().square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _compare_low_precision(model, dtype, rows, **inputs):
    low_model = model.to(dtype)
    exact_model = type(model)(model.config).float().eval()
    exact_model.load_state_dict({k: v.float() for k, v in low_model.state_dict().items()})
    low, low_grads = _forward_backward(low_model, rows.to(dtype), **inputs)
    exact, exact_grads = _forward_backward(exact_model, rows.float(), **inputs)
    _assert_low_precision_close(low, exact, dtype, "logits")
    assert low_grads.keys() == exact_grads.keys()
    for name in exact_grads:
        _assert_low_precision_close(low_grads[name], exact_grads[name], dtype, f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", GPT2_VARIANTS)
def test_gpt2_low_precision_forward_backward(variant, dtype):
    model = tiny_lm(variant)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    _compare_low_precision(model, dtype, mask[..., None], input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["dense", "swa", "mixed"])
def test_gpt2_eager_low_precision_with_padding(variant, dtype):
    """The eager path adds transformers' finfo.min mask: done in float32, it cannot overflow to -inf rows."""
    model = tiny_lm(variant, attn_implementation="eager")
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    _compare_low_precision(model, dtype, mask[..., None], input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", list(T5_VARIANTS))
def test_t5_low_precision_forward_backward(variant, dtype):
    torch.manual_seed(0)  # T5's own init (float32 is ~2 eps from float64 on these logits)
    model = StructAttnT5ForConditionalGeneration(StructAttnT5Config(**T5_BASE, **T5_VARIANTS[variant])).eval()
    ids = _ids(2, 21, vocab=50)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    _compare_low_precision(model, dtype, torch.ones(2, 9, 1), input_ids=ids, attention_mask=mask,
                           decoder_input_ids=_ids(2, 9, seed=5, vocab=50))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", GPT2_VARIANTS)
def test_gpt2_autocast_training_step(variant, dtype):
    """What ``--mixed_precision fp16 / bf16`` runs: float32 weights, half-precision matmuls under autocast."""
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    exact = tiny_lm(variant).train()(ids, attention_mask=mask, labels=labels).loss
    model = tiny_lm(variant).train()
    with torch.autocast("cpu", dtype=dtype):
        loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss.float(), exact, atol=LOW_PRECISION_EPS * torch.finfo(dtype).eps * exact.detach().item(),
                               rtol=0)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", list(T5_VARIANTS))
def test_t5_autocast_training_step(variant, dtype):
    torch.manual_seed(0)
    config = StructAttnT5Config(**T5_BASE, **T5_VARIANTS[variant], initializer_factor=0.3)
    model = StructAttnT5ForConditionalGeneration(config).train()
    ids = _ids(2, 21, vocab=50)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    labels = _ids(2, 9, seed=5, vocab=50)
    exact = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    with torch.autocast("cpu", dtype=dtype):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss.float(), exact.detach(),
                               atol=LOW_PRECISION_EPS * torch.finfo(dtype).eps * exact.detach().item(), rtol=0)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _generate_scores(model, ids, **kwargs):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.scores, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", GPT2_VARIANTS)
def test_gpt2_low_precision_generate(variant, dtype):
    """Cached half-precision decoding: every step's scores equal a float32 forward over the generated tokens."""
    model = tiny_lm(variant)
    exact_model = tiny_lm(variant)
    exact_model.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
    ids = _ids(2, 12)
    sequences, scores = _generate_scores(model.to(dtype), ids, max_new_tokens=20)
    exact = exact_model(sequences, use_cache=False).logits[:, ids.shape[1] - 1:-1]
    _assert_low_precision_close(scores, exact, dtype, "scores", same_dtype=False)  # generate upcasts its scores


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", list(T5_VARIANTS))
def test_t5_low_precision_generate(variant, dtype):
    torch.manual_seed(0)
    config = StructAttnT5Config(**T5_BASE, **T5_VARIANTS[variant], initializer_factor=0.3)
    model = StructAttnT5ForConditionalGeneration(config).eval()
    exact_model = StructAttnT5ForConditionalGeneration(config).eval()
    exact_model.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
    ids = _ids(2, 21, vocab=50)
    sequences, scores = _generate_scores(model.to(dtype), ids, max_new_tokens=12)
    exact = exact_model(input_ids=ids, decoder_input_ids=sequences[:, :-1], use_cache=False).logits
    _assert_low_precision_close(scores, exact, dtype, "scores", same_dtype=False)  # generate upcasts its scores


# ------------------------------------------------------------------------------------ output_attentions (item 8)


@pytest.mark.parametrize("variant", GPT2_VARIANTS)
def test_gpt2_output_attentions_are_real_probabilities(variant):
    """With attn_implementation="eager" every variant returns its real probabilities (as transformers' GPT-2 does;
    other implementations return none), and the forward still returns its cache."""
    model = tiny_lm(variant, attn_implementation="eager").double()
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = model(ids, attention_mask=mask, output_attentions=True)
    assert out.cache is not None and out.cache.get_seq_length() == 20
    assert len(out.attentions) == model.config.n_layer
    for probabilities in out.attentions:
        assert probabilities.shape == (2, model.config.n_head, 20, 20)
        torch.testing.assert_close(probabilities.sum(-1), torch.ones(2, model.config.n_head, 20, dtype=torch.float64),
                                   **EXACT)
        future = probabilities.detach().triu(1)
        assert float(future[0].abs().max()) == 0.0 and float(future[1, :, 4:].abs().max()) == 0.0  # causal
        assert float(probabilities.detach()[1, :, 4:, :4].abs().max()) < 1e-300  # padding keys get no weight
    fast = tiny_lm(variant).double()
    torch.testing.assert_close(out.logits[0], fast(ids, attention_mask=mask, use_cache=False).logits[0], **EXACT)
    torch.testing.assert_close(out.logits[1, 4:], fast(ids, attention_mask=mask, use_cache=False).logits[1, 4:],
                               **EXACT)


def test_gpt2_dense_attentions_equal_transformers_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    reference = transformers.GPT2LMHeadModel(config).double().eval()
    ours = tiny_lm("dense", attn_implementation="eager").double()
    ours.load_state_dict(reference.state_dict(), strict=False)
    ids = _ids()
    expected = reference(ids, output_attentions=True).attentions
    got = ours(ids, output_attentions=True).attentions
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.parametrize("variant", ["mlr", "mixed"])
def test_gpt2_output_attentions_with_a_filled_cache(variant):
    """A decode step with the cache returns the new token's row of the uncached probabilities, over the cached and
    new tokens in token order (padding 0); generate(output_attentions=True) keeps the cache and its tokens."""
    model = tiny_lm(variant, attn_implementation="eager").double()
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    reference = model(ids, attention_mask=mask, position_ids=positions, use_cache=False, output_attentions=True)
    cache = model(ids[:, :17], attention_mask=mask[:, :17], position_ids=positions[:, :17]).cache
    for step in range(17, 20):
        out = model(ids[:, step:step + 1], attention_mask=mask[:, :step + 1], position_ids=positions[:, step:step + 1],
                    cache=cache, output_attentions=True)
        for kind, got, expected in zip(model.config.layer_types, out.attentions, reference.attentions):
            # a sliding-window layer's cache holds the window only (transformers' DynamicSlidingWindowLayer)
            first = step + 1 - model.config.sliding_window if kind == "sliding_attention" else 0
            torch.testing.assert_close(got, expected[:, :, step:step + 1, first:step + 1], **EXACT)
    prompt = dict(input_ids=ids[:, :6], attention_mask=mask[:, :6], max_new_tokens=8, do_sample=False)
    plain = model.generate(**prompt)
    generated = model.generate(**prompt, output_attentions=True, return_dict_in_generate=True)
    torch.testing.assert_close(generated.sequences, plain, atol=0, rtol=0)
    assert len(generated.attentions) == 8 and len(generated.attentions[0]) == model.config.n_layer
    assert generated.attentions[-1][0].shape == (2, model.config.n_head, 1, 13)


def test_t5_mlr_attentions_equal_transformers_t5_when_blocks_cover_the_sequence():
    """MLR whose blocks cover the whole sequence is dense attention: its probabilities must be T5's own."""
    torch.manual_seed(0)
    config = transformers.T5Config(**T5_BASE, attn_implementation="eager")
    reference = transformers.T5ForConditionalGeneration(config).double().eval()
    ours = StructAttnT5ForConditionalGeneration(StructAttnT5Config(
        **T5_BASE, attn_implementation="eager", encoder_attention="mlr", decoder_attention="mlr", mlr_ranks=[4, 2, 2],
        mlr_block_sizes=[64, 32])).double().eval()
    ours.load_state_dict(reference.state_dict())
    ids = _ids(2, 21, vocab=50)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    decoder_ids = _ids(2, 9, seed=5, vocab=50)
    expected = reference(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, output_attentions=True)
    got = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, output_attentions=True)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        assert len(getattr(got, name)) == len(getattr(expected, name)) > 0, name
        for a, b in zip(getattr(got, name), getattr(expected, name)):
            # padded query rows are unspecified; compare the real ones
            rows = mask[:, None, :, None].bool() if name == "encoder_attentions" else True
            torch.testing.assert_close(a * rows, b * rows, **EXACT, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(got.logits, expected.logits, **EXACT)


@pytest.mark.parametrize("variant", ["mlr", "bilinear"])
def test_t5_output_attentions_every_structured_variant(variant):
    model = tiny_structattn_t5(**T5_VARIANTS[variant], attn_implementation="eager").double()
    ids = _ids(2, 21, vocab=50)
    decoder_ids = _ids(2, 9, seed=5, vocab=50)
    out = model(input_ids=ids, decoder_input_ids=decoder_ids, output_attentions=True)
    plain = model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False)
    torch.testing.assert_close(out.logits, plain.logits, **EXACT)
    for name, count, shape in (("encoder_attentions", 2, (21, 21)), ("decoder_attentions", 3, (9, 9)),
                               ("cross_attentions", 3, (9, 21))):
        maps = getattr(out, name)
        assert len(maps) == count, name
        for probabilities in maps:
            assert probabilities.shape == (2, 4, *shape)
            torch.testing.assert_close(probabilities.sum(-1), torch.ones(2, 4, shape[0], dtype=torch.float64),
                                       **EXACT)
    # as transformers' T5: only the eager implementation returns probabilities
    model = tiny_structattn_t5(**T5_MLR)
    assert model(input_ids=ids, decoder_input_ids=decoder_ids, output_attentions=True).encoder_attentions in ((), None)


# ------------------------------------------------------------------------------------- bad input (items 12, 13)


def test_gpt2_bad_inputs_name_the_argument():
    model = tiny_lm("mlr")
    ids = _ids()
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(2, 20\).*got \(2, 19\)"):
        model(ids, attention_mask=torch.ones(2, 19), use_cache=False)
    additive = torch.zeros(2, 20)
    additive[1, :3] = -torch.inf
    with pytest.raises(ValueError, match=r"attention_mask must be a keep-mask.*additive"):
        model(ids, attention_mask=additive, use_cache=False)
    with pytest.raises(ValueError, match=r"position_ids must have shape \(2, 20\).*got \(1, 21\)"):
        model(ids, position_ids=torch.arange(21)[None], use_cache=False)
    with pytest.raises(ValueError, match=r"position_ids must be an integer tensor"):
        model(ids, position_ids=torch.arange(20.0)[None], use_cache=False)
    with pytest.raises(ValueError, match=r"position_ids must be non-negative"):
        model(ids, position_ids=torch.arange(20)[None] - 1, use_cache=False)
    with pytest.raises(ValueError, match=r"sequence length 0"):
        model(ids[:, :0], use_cache=False)
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor"):
        model(ids.float(), use_cache=False)
    # the 0/1 float mask tokenizers sometimes give is the same keep-mask as the integer one
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    torch.testing.assert_close(model(ids, attention_mask=mask.float(), use_cache=False).logits,
                               model(ids, attention_mask=mask, use_cache=False).logits, atol=0, rtol=0)


def test_t5_bad_inputs_name_the_argument():
    model = tiny_structattn_t5(**T5_MLR)
    ids = _ids(2, 21, vocab=50)
    decoder_ids = _ids(2, 9, seed=5, vocab=50)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(2, 21\).*got \(2, 20\)"):
        model(input_ids=ids, attention_mask=torch.ones(2, 20), decoder_input_ids=decoder_ids)
    additive = torch.zeros(2, 21)
    additive[1, :3] = torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match=r"attention_mask must be a keep-mask.*additive"):
        model(input_ids=ids, attention_mask=additive, decoder_input_ids=decoder_ids)
    with pytest.raises(ValueError, match=r"decoder|attention_mask must have shape \(2, 9\)"):
        model(input_ids=ids, decoder_input_ids=decoder_ids, decoder_attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"sequence length 0"):
        model(input_ids=ids[:, :0], decoder_input_ids=decoder_ids)


# ------------------------------------------------------------------------------------ config validation (item 12)


@pytest.mark.parametrize("fields,match", [
    (dict(n_head=0), r"n_head must be an integer >= 1, got 0"),
    (dict(n_layer=0), r"n_layer must be an integer >= 1, got 0"),
    (dict(layer_norm_epsilon=-1e-5), r"layer_norm_epsilon must be a finite number >= 0"),
    (dict(mlr_scaling=float("nan")), r"mlr_scaling=nan: every level scale must be a finite number > 0"),
    (dict(mlr_scaling=[1.0, -1.0, 1.0, 1.0]), r"mlr_scaling=.*finite number > 0"),
    (dict(dense_scaling=float("inf")), r"dense_scaling=inf must be .*finite number > 0"),
    (dict(bilinear_scale_constant=float("inf")), r"bilinear_scale_constant=inf must be a finite number > 0"),
    (dict(bilinear_scale_constant=float("nan")), r"bilinear_scale_constant=nan must be a finite number > 0"),
    (dict(resid_pdrop=1.5), r"resid_pdrop=1.5 must be a dropout probability in \[0, 1\]"),
    (dict(embd_pdrop=-0.1), r"embd_pdrop must be a finite number >= 0, got -0.1"),
])
def test_gpt2_config_rejects_degenerate_numbers(fields, match):
    from conftest import tiny_gpt2_config

    with pytest.raises(ValueError, match=match):
        tiny_gpt2_config("mlr", **fields)


@pytest.mark.parametrize("fields,match", [
    (dict(num_heads=0), r"num_heads must be an integer >= 1, got 0"),
    (dict(num_layers=0), r"num_layers must be an integer >= 1, got 0"),
    (dict(layer_norm_epsilon=-1.0), r"layer_norm_epsilon must be a finite number >= 0"),
    (dict(mlr_scaling=float("nan")), r"mlr_scaling=nan: every level scale must be a finite number > 0"),
])
def test_t5_config_rejects_degenerate_numbers(fields, match):
    with pytest.raises(ValueError, match=match):
        StructAttnT5Config(**{**T5_BASE, **T5_MLR, **fields})


def test_integer_numbers_are_numbers_in_every_config(tmp_path):
    """An int where a number is allowed (mlr_scaling 2 or [1, 1, ...], epsilons, dense_scaling, the bilinear
    constant) is accepted by the GPT-2 and the T5 config alike, means what the float means, and a hand-written
    config.json holding ``"mlr_scaling": 1`` loads."""
    import json

    from conftest import tiny_gpt2_config

    for fields in (dict(mlr_scaling=2), dict(mlr_scaling=[1, 1, 2, 1]), dict(layer_norm_epsilon=1),
                   dict(initializer_range=1), dict(dense_scaling=2), dict(bilinear_scale_constant=2)):
        as_int = tiny_gpt2_config("mlr", **fields)
        as_float = tiny_gpt2_config("mlr", **{name: [float(v) for v in value] if isinstance(value, list)
                                              else float(value) for name, value in fields.items()})
        assert as_int.mlr_geometry() == as_float.mlr_geometry()
    for fields in (dict(mlr_scaling=2), dict(mlr_scaling=[1, 1, 1]), dict(layer_norm_epsilon=1)):
        StructAttnT5Config(**{**T5_BASE, **T5_MLR, **fields})
    model = tiny_lm("mlr", mlr_scaling=1).double()
    model.save_pretrained(tmp_path / "gpt2")
    path = tmp_path / "gpt2" / "config.json"
    written = json.loads(path.read_text())
    written["mlr_scaling"] = 1  # as a person writes it
    path.write_text(json.dumps(written))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", dtype=torch.float64)
    ids = _ids(2, 12)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, **EXACT)
    t5 = StructAttnT5Config(**T5_BASE, **T5_MLR)
    t5.save_pretrained(tmp_path / "t5")
    path = tmp_path / "t5" / "config.json"
    written = json.loads(path.read_text())
    written["mlr_scaling"], written["layer_norm_epsilon"] = [1, 1, 1], 1
    path.write_text(json.dumps(written))
    assert StructAttnT5Config.from_pretrained(tmp_path / "t5").mlr_scaling == [1, 1, 1]


@pytest.mark.parametrize("family", ["gpt2", "t5", "patched"])
def test_a_wrongly_typed_config_field_is_one_line_naming_field_and_value(family):
    from conftest import tiny_gpt2_config
    from hf_structattn.modeling.structattn_decoder import mlr_config_class

    build = {"gpt2": lambda **fields: tiny_gpt2_config("mlr", **fields),
             "t5": lambda **fields: StructAttnT5Config(**{**T5_BASE, **T5_MLR, **fields}),
             "patched": lambda **fields: mlr_config_class(transformers.LlamaConfig)(**fields)}[family]
    cases = {"gpt2": [("n_embd", 32.0), ("mlr_ranks", "abc"), ("mlr_ranks", [8.0, 4, 2, 2]), ("qk_layernorm", "yes"),
                      ("mlr_average_levels", 1), ("sliding_window", "8"), ("attention", 3), ("mlr_scaling", None)],
             "t5": [("d_model", 32.0), ("mlr_max_length", 8.0), ("mlr_average_levels", "no"),
                    ("mlr_scaling", {"a": 1})],
             "patched": [("hidden_size", 32.5), ("num_attention_heads", "4")]}[family]
    for name, value in cases:
        with pytest.raises(ValueError) as raised:
            build(**{name: value})
        message = str(raised.value)
        assert "\n" not in message and message.startswith(f"{name}={value!r}"), message
    config = build()
    name, value = cases[0]
    with pytest.raises(ValueError, match=f"^{name}="):  # assignment too
        setattr(config, name, value)


def test_configs_changed_after_construction_cannot_be_saved_invalid(tmp_path):
    from conftest import tiny_gpt2_config

    config = tiny_gpt2_config("mlr")
    config.mlr_ranks = [3, 3]
    with pytest.raises(Exception, match=r"mlr_ranks=\[3, 3\] sums to 6, but the head dim is 16"):
        config.save_pretrained(tmp_path / "gpt2")
    assert not (tmp_path / "gpt2" / "config.json").exists()
    t5_config = StructAttnT5Config(**T5_BASE, **T5_MLR)
    t5_config.mlr_block_sizes = [4, 8]
    with pytest.raises(Exception, match=r"mlr_block_sizes=\[4, 8\] are not nested"):
        t5_config.save_pretrained(tmp_path / "t5")
    assert not (tmp_path / "t5" / "config.json").exists()


# ------------------------------------------------------------------------------ stock GPT-2 / T5 behaviour (issue 20)


def test_gpt2_accepts_past_key_values_as_transformers_gpt2_does():
    """``past_key_values=`` is transformers 5.24's deprecated name of ``cache``: mapped, with its warning, never
    dropped into **kwargs (the cached logits would silently ignore the cache)."""
    model = tiny_lm("mlr").double()
    ids = _ids(2, 20)
    full = model(ids, use_cache=False).logits
    cache = model(ids[:, :12]).cache
    with pytest.warns(FutureWarning, match="past_key_values"):
        rest = model(ids[:, 12:], past_key_values=cache).logits
    torch.testing.assert_close(rest, full[:, 12:], **EXACT)


@pytest.mark.parametrize("variant", ["dense", "mlr"])
def test_gpt2_token_type_ids_are_embedded_as_in_transformers_gpt2(variant):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    stock = transformers.GPT2LMHeadModel(config).double().eval()
    fields = dict(mlr_ranks=[16], mlr_block_sizes=[]) if variant == "mlr" else {}
    ours = tiny_lm("dense" if variant == "dense" else "mlr", **fields).double()
    ours.load_state_dict(stock.state_dict(), strict=False)
    ids, types = _ids(2, 20), _ids(2, 20, seed=9) % 3
    torch.testing.assert_close(ours(ids, token_type_ids=types).logits, stock(ids, token_type_ids=types).logits,
                               **EXACT)
    assert not torch.allclose(ours(ids, token_type_ids=types).logits, ours(ids).logits)
    generated = ours.generate(ids[:, :8], token_type_ids=types[:, :8], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, stock.generate(ids[:, :8], token_type_ids=types[:, :8], max_new_tokens=4,
                                                 do_sample=False, pad_token_id=1))


@pytest.mark.parametrize("variant", ["mlr", "mixed"])
def test_gpt2_generate_with_every_row_padded_alike(variant):
    """A batch whose rows are all left-padded by the same amount (positions from the mask: every real token is
    offset by the same negative amount from its index) generates what each row generates alone."""
    model = tiny_lm(variant).double()
    ids = _ids(2, 12)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    for row in range(2):
        alone = model.generate(ids[row:row + 1, 3:], max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert torch.equal(batch[row, 3:], alone[0])


def test_t5_with_one_left_padded_row_equals_the_row_alone():
    model = tiny_structattn_t5(**T5_MLR).double()
    ids = _ids(1, 21, vocab=50)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    decoder_ids = _ids(1, 9, seed=5, vocab=50)
    padded = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    alone = model(input_ids=ids[:, 5:], decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(padded, alone, **EXACT)
    decoder_mask = torch.ones_like(decoder_ids)
    decoder_mask[0, :2] = 0  # a decoder mask that starts with 0 (transformers' batching-equivalence test)
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask)
    assert torch.isfinite(out.logits).all()


def test_gpt2_config_does_not_inherit_token_ids_outside_its_vocabulary(recwarn):
    from hf_structattn import StructAttnGPT2Config

    config = StructAttnGPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=2, n_head=2, attention="mlr",
                                  mlr_ranks=[8, 4, 2, 2])
    assert config.bos_token_id is None and config.eos_token_id is None
    assert not [w for w in recwarn if "token_id" in str(w.message)]
    assert StructAttnGPT2Config(n_layer=1).eos_token_id == 50256  # the full GPT-2 vocabulary keeps GPT-2's ids


def test_right_padded_generate_warns_once_and_continues_the_rows(logged_warnings):
    model = tiny_lm("mlr").double()
    ids = _ids(2, 10, vocab=61)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         pad_token_id=1)
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1)
    warned = [record.getMessage() for record in logged_warnings.records if "right padding" in record.getMessage()]
    assert len(warned) == 1 and "padding_side='left'" in warned[0]
    alone = model.generate(ids[:1], max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1)
    assert torch.equal(out[0], alone[0])  # the unpadded row is unaffected
    # transformers repeats the right-padded row's positions after its padding; uncached MLR continues the row as the
    # cache does, so the cache stays an optimisation (transformers' tester prompts are right-padded like this)
    common = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1,
                  output_scores=True, return_dict_in_generate=True)
    cached, uncached = model.generate(ids, **common), model.generate(ids, use_cache=False, **common)
    assert torch.equal(cached.sequences, uncached.sequences) and torch.equal(cached.sequences, out)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), **EXACT)


def test_static_cache_attention_maps_span_the_cache_slots_as_transformers_does():
    """With cache_implementation="static", transformers' layers return maps over every slot of the cache, the
    prefill included; MLR layers do the same (the prefill's maps padded past its tokens with zeros)."""
    model = tiny_lm("mlr")
    model.set_attn_implementation("eager")
    ids = _ids(2, 7, vocab=61)
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=1,
                         cache_implementation="static", output_attentions=True, return_dict_in_generate=True)
    slots = out.cache.layers[0].max_cache_len
    for step, maps in enumerate(out.attentions):
        for layer_maps in maps:
            assert layer_maps.shape[-1] == slots, (step, layer_maps.shape)
    prefill = out.attentions[0][0]
    assert torch.equal(prefill[..., 7:], torch.zeros_like(prefill[..., 7:]))
    torch.testing.assert_close(prefill.sum(-1), torch.ones_like(prefill.sum(-1)))
