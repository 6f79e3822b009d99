"""Host reads per forward (what stalls a GPU: a device value read back by the host), counted on the CPU with a
dispatch mode (tests/host_reads.py): an MLR model makes at most one more than the stock model it stands in for, in
every kind of forward, however many MLR layers it has (the model builds its step plan with one batched read; the
layers read nothing back)."""

import pytest
import torch
import transformers

import hf_structattn

from conftest import tiny_lm
from host_reads import count_host_reads

LAYERS = 4  # a read per layer would show as 4


def _gpt2_pair():
    mlr = tiny_lm("mlr", n_layer=LAYERS).double()
    config = transformers.GPT2Config(vocab_size=61, n_positions=64, n_embd=32, n_layer=LAYERS, n_head=2,
                                     bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().eval(), mlr


def _llama_pair():
    """A grouped-query Llama (4 query heads, 2 KV heads, head dim 16) and its MLR patch."""
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).double().eval()
    return stock, hf_structattn.patch(stock, mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])


def _count(run) -> int:
    with torch.no_grad(), count_host_reads() as counter:
        run()
    return counter.total


def _forward_reads(model, static: bool) -> dict:
    """Reads of each kind of forward on a batch of two whose second row is left-padded: uncached, the prefill of a
    cache, a decode step with the padding in the mask (rows at different positions), and a decode step of rows in
    step (no padding)."""
    ids = torch.randint(2, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    new = torch.randint(2, 61, (2, 1), generator=torch.Generator().manual_seed(4))

    def cache():
        return transformers.StaticCache(config=model.config, max_cache_len=24) if static else \
            transformers.DynamicCache(config=model.config)

    reads = {"uncached": _count(lambda: model(ids, attention_mask=mask, position_ids=positions, use_cache=False))}
    padded = cache()
    model(ids[:, :8], attention_mask=mask[:, :8], position_ids=positions[:, :8], cache=padded)
    reads["prefill"] = _count(lambda: model(ids, attention_mask=mask, position_ids=positions, cache=cache()))
    reads["decode with padding"] = _count(lambda: model(
        ids[:, 8:9], attention_mask=mask[:, :9], position_ids=positions[:, 8:9], cache=padded))
    in_step = cache()
    model(ids, cache=in_step)
    reads["decode"] = _count(lambda: model(new, cache=in_step))
    return reads


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("static", [False, True])
def test_each_forward_reads_at_most_one_value_more_than_the_stock_model(family, static):
    stock, mlr = _gpt2_pair() if family == "gpt2" else _llama_pair()
    layers = mlr.transformer.h if family == "gpt2" else mlr.model.layers
    assert len(layers) == LAYERS
    stock_reads, mlr_reads = _forward_reads(stock, static), _forward_reads(mlr, static)
    for kind, reads in mlr_reads.items():
        assert reads <= stock_reads[kind] + 1, (kind, mlr_reads, stock_reads)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generation_reads_at_most_one_value_per_forward_more_than_the_stock_model(family):
    """Greedy, left-padded, and prompt-lookup decoding (verification chunks and crops of the MLR cache): the reads of
    a whole generation exceed the stock model's by at most one per forward."""
    stock, mlr = _gpt2_pair() if family == "gpt2" else _llama_pair()
    prompt = torch.randint(2, 61, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    repeating = torch.cat([prompt[:1], prompt[:1, :6]], dim=1)
    runs = {"left-padded greedy": dict(input_ids=prompt, attention_mask=mask),
            "prompt lookup": dict(input_ids=repeating, prompt_lookup_num_tokens=3)}
    for name, inputs in runs.items():
        counts = {}
        for label, model in (("stock", stock), ("mlr", mlr)):
            forwards = []
            handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
            try:
                reads = _count(lambda: model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                                      pad_token_id=1))
            finally:
                handle.remove()
            counts[label] = (reads, len(forwards))
        (stock_reads, _), (mlr_reads, forwards) = counts["stock"], counts["mlr"]
        assert mlr_reads <= stock_reads + forwards, (name, counts)
