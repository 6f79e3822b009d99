"""Write the tiny checkpoints of tests/data/legacy_759f20a/ with the code of main at 759f20a (run from a checkout of
that commit: `cd <checkout of 759f20a> && python <this repo>/scripts/make_legacy_checkpoints.py OUT`): a GPT-2 family
model with per-layer variants in the old `attention_layers` field, a T5 family model with MLR encoder and decoder
self-attention and a Llama patched to MLR, each with the payload code that release saves next to the weights, plus
`expected.safetensors`: inputs and the logits that code computed (float64). tests/test_legacy_checkpoints.py loads them
with today's code, and with the saved code in an interpreter where hf_structattn is not importable, and compares."""

import os
import sys

import torch
import transformers
from safetensors.torch import save_file

import hf_structattn


def main(out: str) -> None:
    torch.manual_seed(0)
    expected = {}
    gpt2 = hf_structattn.StructAttnGPT2LMHeadModel(hf_structattn.StructAttnGPT2Config(
        vocab_size=61, n_positions=64, n_embd=32, n_layer=3, n_head=2, attention="mlr", mlr_ranks=[8, 4, 2, 2],
        attention_layers=["mlr", "dense", "bilinear_mlr"], bilinear_mlr_ranks=[4, 4], qk_layernorm=True,
        bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    gpt2.save_pretrained(os.path.join(out, "gpt2_mixed"))
    ids = torch.randint(2, 61, (2, 40))
    expected["gpt2_mixed.input_ids"] = ids
    expected["gpt2_mixed.logits"] = gpt2.double()(ids).logits

    t5 = hf_structattn.StructAttnT5ForConditionalGeneration(hf_structattn.StructAttnT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, encoder_attention="mlr",
        decoder_attention="mlr", mlr_ranks=[4, 2, 2], mlr_block_sizes=[8, 4], decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1)).eval()
    t5.save_pretrained(os.path.join(out, "t5_mlr"))
    encoder_ids, decoder_ids = torch.randint(2, 64, (2, 21)), torch.randint(2, 64, (2, 13))
    expected["t5_mlr.input_ids"], expected["t5_mlr.decoder_input_ids"] = encoder_ids, decoder_ids
    expected["t5_mlr.logits"] = t5.double()(input_ids=encoder_ids, decoder_input_ids=decoder_ids).logits

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    patched = hf_structattn.patch(llama, mlr_ranks=[8, 4, 4], mlr_block_sizes=[16, 8]).eval()
    patched.save_pretrained(os.path.join(out, "llama_mlr"))
    ids = torch.randint(2, 61, (2, 40))
    expected["llama_mlr.input_ids"] = ids
    expected["llama_mlr.logits"] = patched.double()(ids).logits

    save_file({name: tensor.contiguous() for name, tensor in expected.items()},
              os.path.join(out, "expected.safetensors"),
              metadata={"commit": "759f20a", "torch": torch.__version__, "transformers": transformers.__version__})


if __name__ == "__main__":
    main(sys.argv[1])
