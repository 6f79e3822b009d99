"""Saved checkpoints load with trust_remote_code in an interpreter that cannot import hf_structattn."""

import json

import pytest
import torch

from hf_structattn.tokenization import build_byte_tokenizer

from conftest import tiny_lm
from model_helpers import run_isolated


@pytest.mark.parametrize("variant", ["mixed", "bilinear_btt"])
def test_remote_code_round_trip(tmp_path, variant):
    model = tiny_lm(variant, vocab_size=257, bos_token_id=256, eos_token_id=256, pad_token_id=256)
    save_dir = tmp_path / "checkpoint"
    model.save_pretrained(save_dir)
    build_byte_tokenizer().save_pretrained(save_dir)
    ids = torch.randint(0, 256, (2, 23))
    # the reload is compared in float64 with a tolerance: another interpreter may pick other kernels, so float32
    # logits need not be bitwise equal across processes
    torch.save({"ids": ids, "logits": model.double()(ids, use_cache=False).logits.detach()}, tmp_path / "expected.pt")

    config = json.loads((save_dir / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_structattn_gpt2.StructAttnGPT2Config",
        "AutoModel": "modeling_structattn_gpt2.StructAttnGPT2Model",
        "AutoModelForCausalLM": "modeling_structattn_gpt2.StructAttnGPT2LMHeadModel",
    }
    files = {p.name for p in save_dir.iterdir()}
    assert {"model.safetensors", "configuration_structattn_gpt2.py", "modeling_structattn_gpt2.py",
            "structattn_mlr.py", "structattn_mlr_fused.py", "structattn_mlr_math.py", "structattn_cache.py",
            "structattn_geometry.py", "structattn_qk.py", "structattn_pretrained.py",
            "structattn_bilinear_attention.py"} <= files
    # the code a GPT-2 family model runs, and no other family's (the patched-decoder spec and classes)
    assert not {"structattn_decoder.py", "structattn_decoder_spec.py", "modeling_structattn_t5.py"} & files

    out = run_isolated(f"""
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, pipeline
        path = {str(save_dir)!r}
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        assert config.model_type == "structattn_gpt2", config.model_type
        base = AutoModel.from_pretrained(path, trust_remote_code=True)
        assert type(base).__name__ == "StructAttnGPT2Model"
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        logits = model.double()(expected["ids"], use_cache=False).logits
        print("max_diff", float((logits - expected["logits"]).abs().max()))
        generated = model.generate(expected["ids"][:, :5], max_new_tokens=12, do_sample=False)
        assert generated.shape == (2, 17), generated.shape
        uncached = model.generate(expected["ids"][:, :5], max_new_tokens=12, do_sample=False, use_cache=False)
        assert torch.equal(generated, uncached)  # same process, float64: cached and uncached pick the same tokens
        model.float()
        generator = pipeline("text-generation", model=path, trust_remote_code=True)
        text = generator("def main(", max_new_tokens=8, do_sample=False)[0]["generated_text"]
        assert isinstance(text, str) and text.startswith("def main("), text
        print("pipeline_ok", len(text))
        model.save_pretrained("resaved")
    """, tmp_path)
    assert "pipeline_ok" in out
    max_diff = float(out.split("max_diff")[1].split()[0])
    assert max_diff < 1e-12
    assert (tmp_path / "resaved" / "modeling_structattn_gpt2.py").exists()


def test_remote_code_needs_trust_flag(tmp_path):
    tiny_lm("mlr").save_pretrained(tmp_path / "ckpt")
    out = run_isolated(f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=False)
        except ValueError as error:
            print("refused", "trust_remote_code" in str(error))
    """, tmp_path)
    assert "refused True" in out


def test_t5_family_round_trip(tmp_path):
    """A T5 family checkpoint (MLR encoder and decoder self-attention, a bilinear MLR cross-attention) reloads where
    hf_structattn is not importable: float64 logits equal, cached generation equals uncached; it ships the T5
    family's code and no other family's."""
    from hf_structattn import StructAttnT5Config, StructAttnT5ForConditionalGeneration

    torch.manual_seed(0)
    config = StructAttnT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3,
                                num_heads=4, encoder_attention="mlr", decoder_attention="mlr",
                                cross_attention="bilinear_mlr", bilinear_mlr_ranks=[4, 4], mlr_ranks=[4, 2, 2],
                                mlr_block_sizes=[8, 4], dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                decoder_start_token_id=0)
    model = StructAttnT5ForConditionalGeneration(config).eval()
    save_dir = tmp_path / "checkpoint"
    model.save_pretrained(save_dir)
    files = {p.name for p in save_dir.iterdir()}
    assert {"configuration_structattn_t5.py", "modeling_structattn_t5.py", "structattn_cache.py",
            "structattn_mlr_plan.py", "structattn_bilinear.py"} <= files
    assert not {"structattn_decoder.py", "structattn_decoder_spec.py", "modeling_structattn_gpt2.py",
                "structattn_bilinear_attention.py"} & files
    generator = torch.Generator().manual_seed(1)
    inputs = dict(input_ids=torch.randint(2, 64, (2, 21), generator=generator),
                  decoder_input_ids=torch.randint(2, 64, (2, 11), generator=generator))
    torch.save({"inputs": inputs, "logits": model.double()(**inputs, use_cache=False).logits.detach()},
               tmp_path / "expected.pt")
    out = run_isolated(f"""
        import torch
        from transformers import AutoModelForSeq2SeqLM
        model = AutoModelForSeq2SeqLM.from_pretrained({str(save_dir)!r}, trust_remote_code=True,
                                                      dtype=torch.float64).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        print("max_diff", float((model(**expected["inputs"], use_cache=False).logits - expected["logits"]).abs().max()))
        ids = expected["inputs"]["input_ids"]
        cached = model.generate(ids, max_new_tokens=12, do_sample=False)
        uncached = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False)
        print("generate_equal", torch.equal(cached, uncached))
    """, tmp_path)
    assert float(out.split("max_diff")[1].split()[0]) < 1e-12
    assert "generate_equal True" in out
