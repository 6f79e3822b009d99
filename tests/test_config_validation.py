"""The package's config classes refuse a keyword that is not theirs (a misspelt field would otherwise build a model
with that field's default), name the field it resembles, and still accept everything transformers itself passes
or writes: their own ``to_dict()``, transformers' keywords, a saved config.json with keys other code added."""

import json

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn import StructAttnChronosBoltConfig, StructAttnGPT2Config, StructAttnT5Config
from hf_structattn.modeling.modeling_structattn_gpt2 import StructAttnGPT2LMHeadModel

GPT2 = dict(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
T5 = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
# every config class of the package, with a valid base and a misspelt MLR field
CASES = [
    (StructAttnGPT2Config, dict(GPT2, attention="mlr"), "mlr_rnaks", [8, 4, 2, 2], "mlr_ranks"),
    (StructAttnGPT2Config, GPT2, "atention", "mlr", "attention"),
    (StructAttnT5Config, T5, "encoder_atention", "mlr", "encoder_attention"),
    (StructAttnT5Config, dict(T5, encoder_attention="mlr", mlr_ranks=[4, 2, 2]), "mlr_block_size", [8, 4],
     "mlr_block_sizes"),
    (StructAttnChronosBoltConfig, dict(T5, encoder_attention="mlr"), "mlr_rnaks", [4, 2, 2], "mlr_ranks"),
]


@pytest.mark.parametrize("config_class,base,typo,value,field", CASES)
def test_a_misspelt_field_is_refused_naming_the_field_it_resembles(config_class, base, typo, value, field):
    with pytest.raises(ValueError) as error:
        config_class(**base, **{typo: value})
    message = str(error.value)
    assert "\n" not in message
    assert f"unknown keyword {typo}={value!r}" in message and f"did you mean {field!r}" in message, message
    assert message.startswith(config_class.__name__)


def test_the_typo_is_reported_before_the_validation_it_would_have_failed():
    # head dim 16 needs explicit mlr_ranks: the misspelt keyword is the cause, so it is what the error names
    with pytest.raises(ValueError, match="did you mean 'mlr_ranks'"):
        StructAttnGPT2Config(**GPT2, attention="mlr", mlr_rnaks=[8, 4, 2, 2])


def test_an_unknown_keyword_without_a_close_field_lists_the_fields():
    with pytest.raises(ValueError, match=r"unknown keyword wibble=3; its fields: .*mlr_ranks"):
        StructAttnGPT2Config(**GPT2, wibble=3)
    with pytest.raises(ValueError, match="unknown keyword wibble=3"):
        transformers.AutoConfig.for_model("structattn_t5", **T5, wibble=3)  # transformers' keyword entry point


@pytest.mark.parametrize("config", [
    StructAttnGPT2Config(**GPT2, attention="mlr", mlr_ranks=[8, 4, 2, 2], num_labels=3),
    StructAttnT5Config(**T5, encoder_attention="mlr", mlr_ranks=[4, 2, 2], feed_forward_proj="gated-gelu",
                       tie_word_embeddings=False),
    StructAttnChronosBoltConfig(**T5, chronos_config={"context_length": 64},
                                chronos_pipeline_class="ChronosBoltPipeline"),
], ids=["gpt2", "t5", "bolt"])
def test_a_config_is_rebuilt_from_its_own_to_dict(config):
    config.auto_map = {"AutoConfig": "x.Y"}  # what save_pretrained adds
    rebuilt = type(config)(**config.to_dict())
    assert rebuilt.to_dict() == config.to_dict()


def test_transformers_keywords_are_accepted():
    config = StructAttnGPT2Config(**GPT2, torch_dtype="float64", num_labels=5, name_or_path="some/where",
                                  attn_implementation="eager", output_attentions=True, decoder_start_token_id=7,
                                  transformers_version="5.0.0", architectures=["StructAttnGPT2LMHeadModel"],
                                  hidden_size=32, num_hidden_layers=2)
    assert config.dtype == torch.float64 and config.num_labels == 5 and config.name_or_path == "some/where"
    assert config._attn_implementation == "eager" and config.output_attentions
    assert config.decoder_start_token_id == 7 and config.n_layer == 2
    t5 = StructAttnT5Config(**T5, tie_word_embeddings=False, chronos_config={"prediction_length": 8})
    assert t5.scale_decoder_outputs is False and t5.chronos_config == {"prediction_length": 8}


def test_save_load_round_trip_keeps_keys_other_code_added(tmp_path):
    torch.manual_seed(0)
    model = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**GPT2, attention="mlr", mlr_ranks=[8, 4, 2, 2]))
    model.config.added_by_other_code = {"kept": True}  # e.g. a quantizer's quantization_config
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["added_by_other_code"] == {"kept": True} and "auto_map" in saved
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(config) is StructAttnGPT2Config and config.added_by_other_code == {"kept": True}
    assert config.mlr_ranks == [8, 4, 2, 2] and config.architectures == ["StructAttnGPT2LMHeadModel"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.added_by_other_code == {"kept": True}
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded.eval()(ids).logits, model.eval()(ids).logits)


def test_from_pretrained_keywords_behave_as_for_a_stock_config(tmp_path):
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    StructAttnT5Config(**T5, chronos_config={"context_length": 64}).save_pretrained(ours)
    transformers.T5Config(**T5, chronos_config={"context_length": 64}).save_pretrained(stock)
    overrides = dict(d_ff=128, chronos_config={"context_length": 32}, not_a_key=1, return_unused_kwargs=True)
    config, unused = StructAttnT5Config.from_pretrained(ours, **overrides)
    stock_config, stock_unused = transformers.T5Config.from_pretrained(stock, **overrides)
    assert unused == stock_unused == {"not_a_key": 1}
    assert config.d_ff == stock_config.d_ff == 128
    assert config.chronos_config == stock_config.chronos_config == {"context_length": 32}


def test_patch_keeps_the_source_checkpoints_own_keys():
    source = transformers.T5ForConditionalGeneration(transformers.T5Config(
        **T5, decoder_start_token_id=0, n_positions=512, task_specific_params={"summarization": {}}))
    patched = hf_structattn.patch(source, mlr_ranks=[4, 2, 2], mlr_block_sizes=[8, 4])
    assert patched.config.n_positions == 512 and patched.config.task_specific_params == {"summarization": {}}
