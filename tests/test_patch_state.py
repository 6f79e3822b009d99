"""``hf_structattn.patch`` carries the model's state, not only its weights: activation (gradient) checkpointing,
weights that ``post_init()`` / ``init_weights()`` leave alone (as on the stock model), the attention implementation
(T5's ``"eager"`` stays eager, so attention maps keep coming), and patching inside ``torch.device("meta")``. For
every patched family: GPT-2, T5, Llama, Qwen2 (sliding window), Mistral (sliding layers replaced), Gemma-3."""

import copy
import warnings

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn.decoder_patching import tiny_decoder

RANKS, BLOCKS = [8, 4, 4], [8, 4]
T5_FIELDS = dict(mlr_ranks=[4, 2, 2], mlr_block_sizes=[4, 2])


def _tiny_t5(**config):
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, decoder_start_token_id=0,
        dropout_rate=0.0, **config)).double().eval()


def _qwen2_sliding(**config):
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1,
        pad_token_id=0, **config)).double().eval()


def _mistral_sliding(**config):
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, pad_token_id=0, **config)).double().eval()


def _from_tiny(arch):
    def build(**config):
        model = tiny_decoder(arch)
        if not config:
            return model
        fields = copy.deepcopy(model.config)
        for name, value in config.items():
            setattr(fields, name, value)
        rebuilt = type(model)(fields).to(torch.float64).eval()
        rebuilt.load_state_dict(model.state_dict())
        return rebuilt
    return build


FAMILIES = {
    # name: (stock model builder taking config fields, patch kwargs, inputs)
    "gpt2": (_from_tiny("gpt2"), dict(mlr_ranks=RANKS, mlr_block_sizes=BLOCKS), None),
    "llama": (_from_tiny("llama"), dict(mlr_ranks=RANKS, mlr_block_sizes=BLOCKS), None),
    "qwen2_sliding": (_qwen2_sliding, dict(mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, layers=[0]), None),
    "mistral_replace": (_mistral_sliding, dict(mlr_ranks=RANKS, mlr_block_sizes=BLOCKS,
                                               sliding_window_layers="replace"), None),
    "gemma3_both": (_from_tiny("gemma3"), dict(mlr_ranks=RANKS, mlr_block_sizes=BLOCKS,
                                               sliding_window_layers="replace"), None),
    "t5": (_tiny_t5, T5_FIELDS, "t5"),
}


def _inputs(kind):
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    if kind == "t5":
        return dict(input_ids=ids, decoder_input_ids=ids[:, :5], labels=ids[:, 1:6].contiguous())
    return dict(input_ids=ids, labels=ids)


def _checkpointing_flags(model) -> dict:
    return {name: module.gradient_checkpointing for name, module in model.named_modules()
            if hasattr(module, "gradient_checkpointing")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patch_keeps_activation_checkpointing(family):
    build, kwargs, kind = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        stock = build()
        stock.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert stock.is_activation_checkpointing
        patched = hf_structattn.patch(stock, **kwargs)
        assert patched.is_activation_checkpointing
        assert _checkpointing_flags(patched) == _checkpointing_flags(stock)
        # every_n_layers: the per-layer pattern is carried, not just "on"
        stock.activation_checkpointing_enable(every_n_layers=2)
        assert _checkpointing_flags(hf_structattn.patch(stock, **kwargs)) == _checkpointing_flags(stock)
        # enabled through the config (transformers turns config.gradient_checkpointing=True on at post_init)
        from_config = build(gradient_checkpointing=True)
        assert from_config.is_activation_checkpointing
        assert hf_structattn.patch(from_config, **kwargs).is_activation_checkpointing
    # and it really checkpoints: a training step runs the first layer's attention twice (the recompute in the
    # backward), with the gradients of the model without checkpointing
    reference = hf_structattn.patch(build(), **kwargs)
    patched = hf_structattn.patch(stock, **kwargs)
    grads = []
    for model in (patched, reference):
        model.train()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        attention = [m for n, m in model.named_modules() if n.endswith(("attn", "SelfAttention"))][0]
        calls = []
        handle = attention.register_forward_hook(lambda *args: calls.append(1))
        model(**_inputs(kind)).loss.backward()
        handle.remove()
        assert len(calls) == (2 if model is patched else 1)
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_post_init_and_init_weights_keep_the_converted_weights(family):
    build, kwargs, kind = FAMILIES[family]
    stock = build()
    patched = hf_structattn.patch(stock, **kwargs)
    before = {name: tensor.clone() for name, tensor in patched.state_dict().items()}
    inputs = {k: v for k, v in _inputs(kind).items() if k != "labels"}
    with torch.no_grad():
        logits = patched(**inputs).logits
    for call in (patched.init_weights, patched.post_init):
        call()
        changed = [name for name, tensor in patched.state_dict().items() if not torch.equal(tensor, before[name])]
        assert not changed, f"{call.__name__} re-drew {len(changed)} of {len(before)} tensors: {changed[:4]}"
    with torch.no_grad():
        torch.testing.assert_close(patched(**inputs).logits, logits, rtol=0, atol=0)
    # as on the stock model
    stock_before = {name: tensor.clone() for name, tensor in stock.state_dict().items()}
    stock.init_weights()
    assert all(torch.equal(tensor, stock_before[name]) for name, tensor in stock.state_dict().items())


@pytest.mark.parametrize("family", ["t5", "llama", "gemma3_both"])
def test_patch_keeps_the_attention_implementation(family):
    build, kwargs, kind = FAMILIES[family]
    stock = build()
    stock.set_attn_implementation("eager")
    patched = hf_structattn.patch(stock, **kwargs)
    assert patched.config._attn_implementation == "eager"
    inputs = {k: v for k, v in _inputs(kind).items() if k != "labels"}
    out = patched(**inputs, output_attentions=True)
    maps = out.encoder_attentions + out.decoder_attentions if kind == "t5" else out.attentions
    assert maps and all(m is not None and torch.allclose(m.sum(-1), torch.ones_like(m.sum(-1))) for m in maps)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patch_inside_a_meta_device_context(family):
    build, kwargs, _ = FAMILIES[family]
    with torch.device("meta"):
        stock = build()
        patched = hf_structattn.patch(stock, **kwargs)
    assert all(p.is_meta for p in patched.parameters())
    reference = hf_structattn.patch(build(), **kwargs)
    assert type(patched) is type(reference) and patched.config.to_dict() == reference.config.to_dict()
    assert patched.state_dict().keys() == reference.state_dict().keys()
