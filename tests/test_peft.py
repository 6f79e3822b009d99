"""PEFT LoRA on structured-attention models (docs/models.md, "Fine-tuning with PEFT"), in float64. On an MLR
GPT-2-family model and an MLR-patched Llama: the adapter changes the output; training it moves only the adapter;
merged weights give the adapter's logits exactly; the cached generation of the adapted model equals its uncached
forward; the merged model saves with its code and reloads with ``trust_remote_code``; the adapter saves alone and
reloads onto a fresh base. On an MLR T5: the adapter changes the output, the merged model gives its logits and
reloads with ``trust_remote_code``."""

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn.decoder_patching import tiny_decoder
from conftest import tiny_lm

peft = pytest.importorskip("peft")

# which modules to adapt on each family (the names of its attention and MLP projections)
FAMILIES = {
    "mlr_gpt2": dict(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True),  # Conv1D layers
    "patched_llama": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}


def _model(family):
    torch.manual_seed(0)
    if family == "mlr_gpt2":
        return tiny_lm("mlr").double()
    stock = tiny_decoder("llama").double()
    return hf_structattn.patch(stock, mlr_ranks=[8, 4, 4], mlr_block_sizes=[16, 8]).eval()


def _adapted(model, family):
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **FAMILIES[family])
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_merges_exactly_and_generates_with_the_hierarchical_cache(family, tmp_path):
    base = _model(family)
    vocab = base.config.vocab_size
    ids = torch.randint(3, vocab, (2, 27), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = base(ids).logits.clone()
    model = _adapted(base, family)

    # one training step moves only the adapter
    model.train()
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)
    model.eval()

    with torch.no_grad():
        adapted = model(ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapter is live

    # cached greedy generation of the adapted model scores what its uncached forward scores
    with torch.no_grad():
        out = model.generate(input_ids=ids[:, :9], max_new_tokens=20, min_new_tokens=20, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        uncached = model(input_ids=out.sequences, use_cache=False).logits[:, 8:28]
    assert type(out.cache.layers[0]).__name__ == "MLRKeyCacheLayer"
    # generate hands out float32 logits: equal to float32 rounding, and the same greedy tokens
    torch.testing.assert_close(torch.stack(out.logits, 1).double(), uncached, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.sequences[:, 9:], uncached.argmax(-1))

    # the adapter alone: saved, and reloaded onto a fresh base
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(_model(family), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, adapted, atol=1e-12, rtol=0)

    # merged weights give the adapter's logits; the merged model saves with its code and reloads remotely
    merged = model.merge_and_unload()
    assert type(merged) is type(base)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-10, rtol=1e-10)
    merged.save_pretrained(tmp_path / "merged")
    remote = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", trust_remote_code=True,
                                                               dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(remote(ids).logits, adapted, atol=1e-10, rtol=1e-10)


def test_lora_on_the_t5_family_merges_exactly_and_reloads_remotely(tmp_path):
    from model_helpers import T5_MLR, tiny_structattn_t5

    base = tiny_structattn_t5(**T5_MLR).double()
    assert base.config.encoder_attention == base.config.decoder_attention == "mlr"
    ids = torch.randint(2, 50, (2, 21), generator=torch.Generator().manual_seed(2))
    decoder_ids = torch.randint(2, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = base(input_ids=ids, decoder_input_ids=decoder_ids).logits.clone()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=["q", "k", "v", "o", "wi", "wo"])
    model = peft.get_peft_model(base, config).eval()
    with torch.no_grad():
        adapted = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
        assert (adapted - base_logits).abs().max() > 1e-3
        merged = model.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids, decoder_input_ids=decoder_ids).logits, adapted,
                                   atol=1e-10, rtol=1e-10)
    merged.save_pretrained(tmp_path / "merged")
    remote = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "merged", trust_remote_code=True,
                                                                dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(remote(input_ids=ids, decoder_input_ids=decoder_ids).logits, adapted,
                                   atol=1e-10, rtol=1e-10)
