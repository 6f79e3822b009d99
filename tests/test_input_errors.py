"""One-line errors for inputs the models cannot use: token ids outside the vocabulary (named with their index, value
and the vocabulary size; caught from the embedding, so a valid forward reads nothing back from the device), and a
cached generate() continued by prompt lookup, which feeds positions the cache already holds."""

import pytest
import torch

from hf_structattn import StructAttnGPT2Config, StructAttnT5Config
from hf_structattn.modeling.modeling_structattn_gpt2 import StructAttnGPT2LMHeadModel
from hf_structattn.modeling.modeling_structattn_t5 import (
    StructAttnT5EncoderModel,
    StructAttnT5ForConditionalGeneration,
)

VOCAB = 64
IDS = torch.tensor([[1, 2, 3, 4], [4, 70, 5, 6]])  # 70 is outside a 64-token vocabulary
VOCAB_TEXT = "its vocabulary has 64 tokens (ids 0 to 63)"


def _gpt2():
    torch.manual_seed(0)
    config = StructAttnGPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2, attention="mlr",
                                  mlr_ranks=[8, 4, 2, 2], bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return StructAttnGPT2LMHeadModel(config).eval()


def _t5(model_class=StructAttnT5ForConditionalGeneration):
    torch.manual_seed(0)
    config = StructAttnT5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                encoder_attention="mlr", decoder_attention="mlr", mlr_ranks=[4, 2, 2],
                                mlr_block_sizes=[8, 4], decoder_start_token_id=0)
    return model_class(config).eval()


def _expect(call, text):
    with pytest.raises(IndexError) as raised:
        call()
    message = str(raised.value)
    assert message == f"{text} is not a token id of this model: {VOCAB_TEXT}", message
    assert isinstance(raised.value.__cause__, IndexError)  # the embedding's own error stays attached


def test_gpt2_names_the_out_of_vocabulary_id():
    model = _gpt2()
    _expect(lambda: model(IDS), "input_ids[1, 1] = 70")
    _expect(lambda: model(torch.tensor([[3, -2]])), "input_ids[0, 1] = -2")
    _expect(lambda: model(IDS[:1], token_type_ids=torch.tensor([[0, 0, 99, 0]])), "token_type_ids[0, 2] = 99")
    _expect(lambda: model.generate(IDS, max_new_tokens=2, do_sample=False), "input_ids[1, 1] = 70")
    assert model(IDS[:1]).logits.shape == (1, 4, VOCAB)  # ids inside the vocabulary run as before


def test_t5_names_the_out_of_vocabulary_id():
    model = _t5()
    good = IDS[:1]
    _expect(lambda: model(IDS, decoder_input_ids=IDS[:, :1]), "input_ids[1, 1] = 70")
    _expect(lambda: model(IDS[:, :1], IDS[:, :1] * 0 + 1, IDS), "decoder_input_ids[1, 1] = 70")  # by position
    bad_labels = torch.tensor([[-100, 3], [2, 64]])
    _expect(lambda: model(input_ids=IDS[:, :2] * 0 + 1, labels=bad_labels), "labels[1, 1] = 64")
    _expect(lambda: model.generate(IDS, max_new_tokens=2, do_sample=False), "inputs[1, 1] = 70")
    _expect(lambda: model.generate(input_ids=IDS, max_new_tokens=2, do_sample=False), "input_ids[1, 1] = 70")
    encoder = _t5(StructAttnT5EncoderModel)
    _expect(lambda: encoder(IDS), "input_ids[1, 1] = 70")
    labels = torch.tensor([[-100, 3, 4]])  # -100 is the loss's ignore index, not a token id
    assert model(input_ids=good, labels=labels).loss.isfinite()
    assert model.generate(good, max_new_tokens=2, do_sample=False).shape == (1, 3)


def test_prompt_lookup_continuing_a_generate_cache_is_refused_with_what_happened():
    """transformers' prompt lookup feeds the whole sequence again, over positions the cache already holds; stock
    models give wrong tokens there, an MLR cache refuses and says why and what to do."""
    model = _gpt2()
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    first = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    held = first.cache.get_seq_length()
    with pytest.raises(ValueError) as raised:
        model.generate(first.sequences, cache=first.cache, prompt_lookup_num_tokens=2, max_new_tokens=4,
                       do_sample=False)
    message = str(raised.value)
    assert "\n" not in message
    assert f"the cache holds positions up to {held - 1}, this call feeds real tokens at positions [0, 1, 2" in message
    assert "another generate() call filled and transformers re-feeds the whole sequence (prompt lookup" in message
    assert "pass that call a fresh cache" in message
    assert "packed sequences and gaps" not in message
    fresh = model.generate(first.sequences, prompt_lookup_num_tokens=2, max_new_tokens=4, min_new_tokens=4,
                           do_sample=False)  # the remedy works
    assert fresh.shape == (1, first.sequences.shape[1] + 4)
