"""What the generation caches really allocate (issue 24): the unique storage bytes of every tensor the cache returned
by ``generate`` holds stay within ``1.05 x`` the formula plus one block per level, for the GPT-2 family, T5 and a
patched decoder, with the dynamic and the static cache, at prompts of one block, several blocks and 4x the coarsest
block; and an MLR cache allocates less than the stock dense cache of the same model once the formula says so.

The formula is written out here, independently of the package: per layer, row and KV head, an MLR layer holds
``S r_1 + sum_{l>=2} min(b_l, S) r_l`` key entries and ``S dv`` value entries (S = tokens held), any other layer
``S (r + dv)``."""

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel, StructAttnT5Config
from hf_structattn import StructAttnT5ForConditionalGeneration
from hf_structattn.cache_memory import allocated_cache_bytes

BLOCKS = [16, 8, 4]  # b_2, b_3, b_4: the coarsest fine block is 16 tokens
RANKS = [8, 4, 2, 2]  # head dim 16
PROMPTS = {"one block": 16, "several blocks": 40, "4x coarsest block": 64}
NEW_TOKENS = 4
BYTES = 4  # float32


def _mlr_elements(tokens: int, ranks=RANKS, blocks=BLOCKS) -> int:
    return tokens * ranks[0] + sum(min(block, tokens) * rank for block, rank in zip(blocks, ranks[1:]))


def _one_block_per_level(ranks=RANKS, blocks=BLOCKS) -> int:
    return sum(block * rank for block, rank in zip(blocks, ranks[1:]))


def _gpt2(layer_types):
    config = StructAttnGPT2Config(vocab_size=61, n_positions=128, n_embd=32, n_layer=len(layer_types), n_head=2,
                                  layer_types=layer_types, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return StructAttnGPT2LMHeadModel(config).eval()


def _check(cache, rows: int, heads: int, layers_mlr: list, head_dim: int = 16, value_dim: int = 16,
           cross_attention: bool = True):
    """allocated <= 1.05 formula + one block per level (per MLR layer, row and head); returns (allocated, formula)."""
    held = int(hf_structattn.modeling.structattn_prepare.self_attention_cache(cache).get_seq_length())
    formula = slack = 0
    for is_mlr in layers_mlr:
        keys = _mlr_elements(held) if is_mlr else held * head_dim
        formula += rows * heads * (keys + held * value_dim) * BYTES
        slack += rows * heads * _one_block_per_level() * BYTES if is_mlr else 0
    allocated = allocated_cache_bytes(cache, cross_attention=cross_attention)
    assert allocated <= 1.05 * formula + slack, (held, allocated, formula, slack)
    assert allocated >= formula, "the cache holds fewer bytes than the formula: the formula or the check is wrong"
    return allocated, formula


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_gpt2_family_cache_allocates_the_formula(prompt, cache_implementation):
    layer_types = ["mlr_attention", "full_attention", "mlr_attention"]
    model = _gpt2(layer_types)
    ids = torch.randint(2, 61, (2, prompt))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, return_dict_in_generate=True, cache_implementation=cache_implementation)
    _check(out.cache, rows=2, heads=2, layers_mlr=[kind == "mlr_attention" for kind in layer_types])


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_t5_decoder_cache_allocates_the_formula(prompt, cache_implementation):
    torch.manual_seed(0)
    config = StructAttnT5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                decoder_attention="mlr", mlr_ranks=RANKS, mlr_block_sizes=BLOCKS,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = StructAttnT5ForConditionalGeneration(config).eval()
    encoder_ids = torch.randint(2, 64, (2, 9))
    decoder_ids = torch.randint(2, 64, (2, prompt))
    out = model.generate(encoder_ids, decoder_input_ids=decoder_ids, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                         cache_implementation=cache_implementation)
    # the self-attention part (the cross-attention cache is the encoder's keys and values, not structured)
    _check(out.cache, rows=2, heads=2, layers_mlr=[True, True], cross_attention=False)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_patched_decoder_cache_allocates_the_formula_and_less_than_stock(prompt, cache_implementation):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).eval()
    patched = hf_structattn.patch(stock, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS).eval()
    ids = torch.randint(2, 64, (2, prompt))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                  do_sample=False, return_dict_in_generate=True, cache_implementation=cache_implementation)
    ours, formula = _check(patched.generate(ids, **kwargs).cache, rows=2, heads=2, layers_mlr=[True, True])
    dense = allocated_cache_bytes(stock.generate(ids, **kwargs).cache)
    if formula < dense:
        assert ours < dense, (ours, dense)


def test_a_cache_grown_outside_generate_over_allocates_a_bounded_fraction_and_reset_releases_it():
    """A direct ``model(ids, use_cache=True)`` loop (no final length known): the MLR layers grow by at most
    max(16 slots, S / 32) of level-1 keys and values past the S tokens held, never by doubling; ``reset`` frees
    the storage."""
    layer_types = ["mlr_attention", "mlr_attention"]
    model = _gpt2(layer_types)
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(2, 61, (1, 120))
    with torch.no_grad():
        model(ids[:, :16], cache=cache, use_cache=True)
        for step in range(16, 120):
            model(ids[:, step:step + 1], cache=cache, use_cache=True)
            held = step + 1
            formula = 2 * 2 * (_mlr_elements(held) + held * 16) * BYTES  # 2 layers x 2 heads, batch 1
            spare_slots = max(16, held // 32)
            # + two positions per layer, + the geometry's memo of index constants (shared by the layers)
            memo = _memo_bytes(cache.layers[0].geometry)
            bound = formula + 2 * 2 * spare_slots * (RANKS[0] + 16) * BYTES + 2 * 2 * 8 + memo
            assert formula <= allocated_cache_bytes(cache) <= bound, (held, allocated_cache_bytes(cache), bound)
    cache.reset()
    assert allocated_cache_bytes(cache) <= 2 * 2 * 8 + memo  # only the per-row positions (and the memo) remain


# ------------------------------------------------------------------- the geometry's memo of device tensors


def _llama(kv_heads: int, blocks=(256, 64, 16)):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads,
                                      max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return hf_structattn.patch(transformers.LlamaForCausalLM(config).eval(), mlr_ranks=RANKS,
                               mlr_block_sizes=list(blocks))


def _memo_bytes(geometry) -> int:
    storages = {}
    for value in geometry.tensors.entries.values():
        for tensor in (value.values() if isinstance(value, dict) else [value]):
            if isinstance(tensor, torch.Tensor):
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_unique_storage_reachable_from_a_small_cache_is_within_1_10_of_the_formula(kv_heads):
    """Everything a cache reaches (its buffers, positions, and the MLR geometry with its memo of index constants,
    shared tensors once) within 1.10 x the formula, also for a small model (2 layers, 2 or 4 KV heads, batch 1),
    whose cache is small next to per-geometry tables: prompts of 64, 512 and 2000 tokens, in one process (the memo
    of the shared geometry sees every capacity)."""
    model = _llama(kv_heads)
    blocks = model.config.mlr_block_sizes
    for prompt in (64, 512, 2000):
        ids = torch.randint(2, 64, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        cache = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                               return_dict_in_generate=True).cache
        held = prompt + 3  # the last generated token is not fed back
        formula = 2 * kv_heads * (_mlr_elements(held, blocks=blocks) + held * 16) * BYTES
        allocated = allocated_cache_bytes(cache)
        memo = _memo_bytes(cache.layers[0].geometry)
        assert memo > 0 and allocated >= formula + memo, "the geometry's memo must be counted"
        assert allocated <= 1.10 * formula, (prompt, allocated / formula)


def test_the_geometry_memo_is_bounded_and_holds_no_per_slot_tables():
    """A server with varied prompt lengths: every cache capacity below the coarsest block is a new ring layout, and
    each used to add a layout of two int64 tables per fine cache element, kept for the life of the process. The
    memo is an LRU of a few entries whose tables are per head dim."""
    model = _llama(2, blocks=(512, 128, 32))
    geometry = model.model.layers[0].self_attn.config.mlr_geometry
    for prompt in range(3, 300, 7):  # 43 distinct capacities below the coarsest block of 512
        ids = torch.randint(2, 64, (2, prompt), generator=torch.Generator().manual_seed(prompt))
        mask = torch.ones_like(ids)
        mask[1, :2] = 0  # rows in different blocks: the decode step's general path
        model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        assert len(geometry.tensors) <= geometry.tensors.capacity
    assert _memo_bytes(geometry) <= geometry.tensors.capacity * 4 * 16 * 8  # a few tables of <= head-dim longs


@pytest.mark.parametrize("family", ["gpt2_mlr", "llama"])
def test_torch_export_of_the_same_mlr_model_twice(family):
    """Nothing made while tracing is memoised: a second export of the same model used to find the first one's
    fake tensors among its constants."""
    from conftest import tiny_lm

    model = tiny_lm("mlr") if family == "gpt2_mlr" else _llama(2, blocks=(8, 4, 2))
    ids = torch.randint(2, 61, (2, 12), generator=torch.Generator().manual_seed(0))

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids, use_cache=False).logits

    expected = model(ids, use_cache=False).logits
    for _ in range(2):
        exported = torch.export.export(Logits(model), (ids,))
        torch.testing.assert_close(exported.module()(ids), expected, rtol=1e-5, atol=1e-5)
    for module in model.modules():
        geometry = getattr(getattr(module, "config", None), "mlr_geometry", None)
        if geometry is not None and not callable(geometry):
            for value in geometry.tensors.entries.values():
                for tensor in (value.values() if isinstance(value, dict) else [value]):
                    assert not isinstance(tensor, torch.Tensor) or type(tensor) is torch.Tensor


def test_repeated_static_generate_holds_at_most_twice_the_formula_of_the_call():
    """transformers sizes a static cache to the longest earlier static generation of the model (to spare a compiled
    step its recompilation). A call that needs less than half of that gets a cache of its own size; one that needs
    more than half reuses the longer length (at most 2x its formula); ``max_cache_len`` asks for the worst case."""
    model = _gpt2(["mlr_attention", "mlr_attention"])
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                  cache_implementation="static")

    def run(prompt, batch=2, **extra):
        ids = torch.randint(2, 61, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
        cache = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, **extra).cache
        slots = cache.layers[0].max_cache_len
        formula = 2 * batch * 2 * (_mlr_elements(slots) + slots * 16) * BYTES  # 2 layers x 2 heads at `slots`
        memo = _memo_bytes(cache.layers[0].geometry)
        return slots, allocated_cache_bytes(cache) - memo, formula

    assert run(100)[0] == 100 + NEW_TOKENS - 1
    slots, allocated, _ = run(40)  # less than half: its own size
    assert slots == 40 + NEW_TOKENS - 1
    _, _, own = run(40)
    assert allocated <= 1.05 * own + 2 * 2 * 2 * _one_block_per_level() * BYTES
    run(100)
    slots, _, _ = run(60, batch=3)  # more than half: the longer length, reused
    assert slots == 100 + NEW_TOKENS - 1 and slots <= 2 * (60 + NEW_TOKENS - 1)
    model.generation_config.max_cache_len = 120  # the worst case, asked for
    assert run(20)[0] == 120
