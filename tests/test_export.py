"""torch.export of MLR models: a static-cache decode through transformers' ExecuTorch recipe
(``TorchExportableModuleForDecoderOnlyLM``, forward(input_ids, cache_position)) whose program, fed token by token,
gives the greedy tokens of ``generate``. (The uncached forward exporting twice in one process:
tests/test_cache_allocation.py.)"""

import pytest
import torch
import transformers
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

import hf_structattn
from hf_structattn.decoder_patching import tiny_decoder
from hf_structattn.flops import attention_cost_report, decoder_cache_report

from conftest import tiny_lm

NEW_TOKENS = 14


def _model(family: str):
    """float64 models: token equality must not hinge on float32 near-ties of a tiny random model's logits."""
    if family == "gpt2_mlr":
        return tiny_lm("mlr", n_positions=64).double()
    extra = dict(sliding_window_layers="replace") if family == "gemma3" else {}
    return hf_structattn.patch(tiny_decoder(family), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4], **extra)


def _feed(program, prompt: torch.Tensor) -> list:
    """The prompt token by token, then greedy tokens, as the ExecuTorch runner feeds an exported program."""
    module = program.module()
    tokens = prompt[0].tolist()
    for index, token in enumerate(tokens):
        logits = module(input_ids=torch.tensor([[token]]), cache_position=torch.tensor([index]))
    for _ in range(NEW_TOKENS):
        tokens.append(int(logits[0, -1].argmax()))
        logits = module(input_ids=torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([len(tokens) - 1]))
    return tokens


@pytest.mark.parametrize("family", ["gpt2_mlr", "llama", "qwen2", "gemma3"])
def test_static_decode_exported_through_the_executorch_recipe_gives_the_greedy_tokens(family):
    """``mlr_exportable_decoder`` is transformers' recipe with the MLR layers of its static cache in hierarchical form
    (their level-1 keys, rings and positions registered as buffers, as the recipe registers keys and values): the
    program holds the smaller cache, decodes the tokens of ``generate`` across block boundaries, and a second run
    from position 0 (the recipe's reuse of one program) gives them again. Gemma-3 with its sliding layers converted
    goes through the recipe's hybrid-cache module."""
    model = _model(family)
    prompt = torch.randint(3, 60, (1, 7), generator=torch.Generator().manual_seed(2))
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=1)[0].tolist()
    wrapper = hf_structattn.mlr_exportable_decoder(model, batch_size=1, max_cache_len=32)
    assert isinstance(wrapper, TorchExportableModuleForDecoderOnlyLM)
    program = wrapper.export(input_ids=torch.tensor([[3]]), cache_position=torch.tensor([0]))
    buffers = dict(program.named_buffers())
    geometry = next(iter(model.structattn_cache_geometries().values()))
    assert buffers["key_cache_0"].shape[-1] == geometry.ranks[0] < geometry.head_dim  # level-1 keys only
    assert buffers["fine_cache_0"].shape[-1] == sum(min(size, 32) * rank for size, rank in
                                                    zip(geometry.block_sizes, geometry.ranks[1:]))
    assert _feed(program, prompt) == expected
    assert _feed(program, prompt) == expected
    # the program's cache is the formula's bytes at 32 slots (what docs/models.md's export table counts)
    held = sum(tensor.numel() * tensor.element_size() for name, tensor in buffers.items()
               if name.split("_")[0] in ("key", "value", "fine"))
    if family == "gpt2_mlr":
        assert held == attention_cost_report(model.config, context_len=32, dtype_bytes=8).kv_cache_bytes
    elif family in ("llama", "qwen2"):
        assert held == decoder_cache_report(model.config, 32, dtype_bytes=8)["kv_cache_bytes"]


def test_the_recipe_as_is_exports_an_mlr_model_with_full_keys():
    """Without ``mlr_exportable_decoder`` the recipe's own static cache holds full-width keys (exact, no saving): it
    exports and decodes the greedy tokens too."""
    model = _model("gpt2_mlr")
    model.generation_config.cache_implementation = "static"
    prompt = torch.randint(3, 60, (1, 7), generator=torch.Generator().manual_seed(3))
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=1)[0].tolist()
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=32)
    program = wrapper.export(input_ids=torch.tensor([[3]]), cache_position=torch.tensor([0]))
    assert dict(program.named_buffers())["key_cache_0"].shape[-1] == model.config.n_embd // model.config.n_head
    assert _feed(program, prompt) == expected
