"""hf_structattn.patch on transformers decoders (Llama, Qwen2/3, Mistral, Gemma/Gemma-3, Phi-3, GPT-2, GPT-NeoX):
exactness in float64 against the stock models and the uncached forward, RoPE-pair levels, GQA, refusals."""

import copy
import os
import subprocess
import sys
import textwrap
import json
import re

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import hf_structattn
from hf_structattn.decoder_patching import TINY_DECODERS, find_rotary, tiny_decoder
from hf_structattn.flops import attention_cost_report, decoder_cache_report, key_cache_elements
from hf_structattn.modeling.structattn_attention import mlr_attention_forward
from hf_structattn.modeling.structattn_prepare import key_cache_bytes
from hf_structattn.modeling.structattn_decoder import attention_modules, rotary_pair_order
from conftest import tiny_lm
from model_helpers import left_padded

VOCAB = 61
HEAD_DIM = 16
RANKS = [8, 4, 4]
BLOCKS = [16, 8]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHS = list(TINY_DECODERS)
# Gemma-3's first two layers use a sliding window: the exactness tests convert its global layer and keep the
# sliding ones (SDPA through the same attention function); replacing them is tested separately
ARCH_PATCH_KWARGS = {"gemma3": dict(layers=[2])}


def patched(arch, ranks=RANKS, blocks=BLOCKS, **kwargs):
    model = tiny_decoder(arch)
    return model, hf_structattn.patch(model, mlr_ranks=ranks, mlr_block_sizes=blocks,
                                      **{**ARCH_PATCH_KWARGS.get(arch, {}), **kwargs})


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_levels_equal_stock_logits(arch):
    model, mlr = patched(arch, ranks=[HEAD_DIM], blocks=[])
    ids = torch.randint(1, VOCAB, (3, 37))
    assert type(mlr).__name__ == "MLR" + type(model).__name__
    # the model keeps transformers' implementation name; its MLR layers' modules dispatch to the MLR function
    assert mlr.config._attn_implementation == "sdpa" == model.config._attn_implementation
    layers = mlr.config.mlr_layers or range(mlr.config.num_hidden_layers)
    assert {attention_modules(mlr)[index].config._attn_implementation for index in layers} == {"mlr"}
    torch.testing.assert_close(mlr(ids).logits, model(ids).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_patch_keeps_weights_and_names(arch):
    model, mlr = patched(arch)
    original, converted = model.state_dict(), mlr.state_dict()
    assert original.keys() == converted.keys()
    assert all(torch.equal(original[name], converted[name]) for name in original)
    ids = torch.randint(1, VOCAB, (2, 37))
    drift = (mlr(ids).logits - model(ids).logits).abs().max()
    assert drift > 1e-6  # the finer levels really drop cross-block terms


@pytest.mark.parametrize("built", ["new_cache", "dynamic_cache"])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_equal_uncached(arch, built):
    _, mlr = patched(arch)
    ids = torch.randint(1, VOCAB, (3, 37))
    uncached = mlr(ids).logits
    # the model's own cache, or one built the transformers way (its MLR layers take the hierarchical form on first use)
    cache = mlr.new_cache() if built == "new_cache" else DynamicCache(config=mlr.config)
    # chunks cross the 8- and 16-token blocks, then one token at a time
    bounds = [(0, 13), (13, 20), (20, 21)] + [(i, i + 1) for i in range(21, 37)]
    chunked = torch.cat([mlr(ids[:, a:b], cache=cache, use_cache=True).logits for a, b in bounds], dim=1)
    torch.testing.assert_close(chunked, uncached, rtol=0, atol=1e-12)
    # GPT-NeoX calls cache.update without kwargs: its layers keep full keys (exact, no saving)
    kinds = {type(cache.layers[index]).__name__ for index in attention_modules(mlr) if index in
             (mlr.config.mlr_layers or range(mlr.config.num_hidden_layers))}
    assert kinds == {"MLRKeyCacheLayer"}
    assert all(cache.layers[index].is_bound != (arch == "neox") for index in (mlr.config.mlr_layers or [0, 1]))


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_rows_equal_rows_alone(arch):
    _, mlr = patched(arch)
    ids = torch.randint(1, VOCAB, (3, 30))
    pads = [0, 5, 11]
    batch, mask, positions = left_padded(ids, pads, 30)
    logits = mlr(batch, attention_mask=mask, position_ids=positions).logits
    for row, pad in enumerate(pads):
        alone = mlr(ids[row:row + 1, :30 - pad]).logits[0]
        torch.testing.assert_close(logits[row, pad:], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_cached_equals_uncached(arch):
    _, mlr = patched(arch)
    ids = torch.randint(3, VOCAB, (3, 20))
    batch, mask, _ = left_padded(ids, [0, 3, 7], 20)
    kwargs = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, min_new_tokens=14)
    cached = mlr.generate(batch, **kwargs)  # the hierarchical key cache (full keys for GPT-NeoX)
    # a DynamicCache built the transformers way: its MLR layers take the hierarchical form on first use
    plain = mlr.generate(batch, cache=DynamicCache(config=mlr.config), **kwargs)
    uncached = mlr.generate(batch, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached) and torch.equal(plain, uncached)
    for row, pad in enumerate([0, 3, 7]):  # and each row generates what it generates alone
        alone = mlr.generate(ids[row:row + 1, :20 - pad], max_new_tokens=14, do_sample=False, min_new_tokens=14)
        assert torch.equal(alone[0], cached[row, pad:])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_assisted_decoding_equals_greedy_with_a_sliding_layer(arch):
    """Speculative decoding rolls the MLR cache back (and Gemma-3's sliding layers next to it): assisted decoding
    with the model itself, with another patched model, and prompt lookup give the greedy tokens and scores for a
    left-padded prompt (transformers runs speculative decoding with batch 1)."""
    _, mlr = patched(arch)
    _, assistant = patched(arch)
    with torch.no_grad():
        for param in assistant.parameters():
            param.add_(torch.randn_like(param) * 0.5)  # a different model: some drafts are rejected
    for model in (mlr, assistant):
        model.generation_config.num_assistant_tokens = 3
        model.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.randint(3, VOCAB, (1, 24))
    batch, mask, _ = left_padded(ids, [5], 24)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
    greedy = mlr.generate(batch, **kwargs)
    for extra in (dict(assistant_model=mlr), dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=3)):
        other = mlr.generate(batch, **kwargs, **extra)
        assert torch.equal(other.sequences, greedy.sequences), extra.keys()
        torch.testing.assert_close(torch.stack(other.scores), torch.stack(greedy.scores), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sampling_and_beam_cached_equal_uncached(arch):
    _, mlr = patched(arch)
    ids = torch.randint(3, VOCAB, (2, 20))
    for kwargs in (dict(do_sample=True, top_k=0, num_return_sequences=2), dict(num_beams=3, do_sample=False)):
        results = []
        for cache_kwargs in ({}, dict(cache=DynamicCache(config=mlr.config)), dict(use_cache=False)):
            torch.manual_seed(7)  # hierarchical key cache, plain DynamicCache (full keys), no cache
            results.append(mlr.generate(ids, max_new_tokens=12, min_new_tokens=12, **cache_kwargs, **kwargs))
        assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[2]), kwargs


def _level_scores(q, k, order, ranks):
    """Per-level q.k of single vectors whose dims are taken in ``order``."""
    q, k = q[..., order], k[..., order]
    scores, start = [], 0
    for rank in ranks:
        scores.append((q[..., start:start + rank] * k[..., start:start + rank]).sum(-1))
        start += rank
    return torch.stack(scores)


@pytest.mark.parametrize("arch", ["llama", "phi3", "neox", "gemma3"])
def test_rope_levels_depend_only_on_relative_position(arch):
    model = tiny_decoder(arch)
    rotary, apply_rotary = find_rotary(model)
    layer_types = (("full_attention",) if arch == "gemma3" else (None,))
    order, rotated = rotary_pair_order(rotary, apply_rotary, HEAD_DIM, layer_types)
    assert sorted(order) == list(range(HEAD_DIM)) and rotated == {"phi3": 8, "neox": 4}.get(arch, HEAD_DIM)
    torch.manual_seed(1)
    q, k = torch.randn(2, 1, 1, 1, HEAD_DIM, dtype=torch.float64).unbind(0)  # (B, H, T, d) each
    ranks = [4, 2, 2, 8] if rotated >= 8 else [2, 2, 12]

    def scores_at(query_pos, key_pos, dims):
        extra = {"layer_type": "full_attention"} if arch == "gemma3" else {}
        rotated_q = apply_rotary(q, q, *rotary(q, torch.tensor([[query_pos]]), **extra))[0]
        rotated_k = apply_rotary(k, k, *rotary(k, torch.tensor([[key_pos]]), **extra))[0]
        return _level_scores(rotated_q.flatten(), rotated_k.flatten(), dims, ranks)

    reference = scores_at(9, 4, order)
    for shift in (1, 7, 100, 1000):
        # transformers computes the RoPE angles in float32 (inv_freq.float() @ positions): ~1e-6 at position 1000
        torch.testing.assert_close(scores_at(9 + shift, 4 + shift, order), reference, rtol=0, atol=1e-5)
    # contiguous prefixes of the model's own dim order split pairs: level scores then move with absolute position
    naive = list(range(HEAD_DIM))
    moved = max(float((scores_at(9 + s, 4 + s, naive) - scores_at(9, 4, naive)).abs().max()) for s in (1, 7, 100))
    assert moved > 0.05


def test_pair_splitting_ranks_are_refused():
    with pytest.raises(ValueError, match="splits a RoPE rotation pair"):
        patched("llama", ranks=[7, 9], blocks=[16])
    # Phi-3's partial rotary 0.5: the default level order puts its 8 unrotated dims first, then its 4 pairs
    # (tests/test_level_order.py has the "index" order, pairs first)
    with pytest.raises(ValueError, match="splits a RoPE rotation pair"):
        patched("phi3", ranks=[9, 7], blocks=[16])
    patched("phi3", ranks=[3, 13], blocks=[16])  # the boundary lies in the unrotated dims: allowed
    patched("gpt2", ranks=[7, 9], blocks=[16])  # no RoPE: any split


class _RecordShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(tensor, torch.Tensor):
                self.shapes.append(tuple(tensor.shape))
        return out


def test_gqa_decode_does_not_repeat_cached_keys():
    _, mlr = patched("llama")  # 4 query heads, 2 KV heads
    ids = torch.randint(1, VOCAB, (1, 41))
    cache = mlr.new_cache()
    mlr(ids[:, :40], cache=cache, use_cache=True)
    recorder = _RecordShapes()
    with recorder:
        step = mlr(ids[:, 40:], cache=cache, use_cache=True).logits
    assert any(shape[:2] == (1, 2) and shape[-1] == 8 for shape in recorder.shapes)  # level-1 keys per KV head
    assert not [shape for shape in recorder.shapes if len(shape) == 4 and shape[1] == 4 and shape[2] == 41]
    torch.testing.assert_close(step[:, -1], mlr(ids).logits[:, -1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch != "neox"])
def test_generate_keeps_the_hierarchical_key_cache_of_the_formula(arch):
    _, mlr = patched(arch)
    ids = torch.randint(3, VOCAB, (2, 30))
    out = mlr.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    cache = out.cache
    mlr_layers = [index for index, layer in enumerate(cache.layers)
                  if type(layer).__name__ == "MLRKeyCacheLayer" and layer.is_bound]
    assert mlr_layers == ([2] if arch == "gemma3" else list(range(mlr.config.num_hidden_layers)))
    slots = cache.get_seq_length(mlr_layers[0])
    assert slots == 38  # 30 prompt tokens + 8 fed back
    dtype_bytes = torch.float64
    expected = decoder_cache_report(mlr.config, slots, dtype_bytes=dtype_bytes)["key_cache_bytes"]
    if arch == "gemma3":  # its sliding layers hold their window (transformers' DynamicSlidingWindowLayer)
        expected = sum(cache.layers[index].key_cache_bytes() for index in mlr_layers) // 2 + \
            sum(layer.keys.numel() * 8 for index, layer in enumerate(cache.layers) if index not in mlr_layers) // 2
    assert key_cache_bytes(cache) == 2 * expected  # batch 2


def test_neox_generates_with_full_keys_and_says_so_once(logged_warnings):
    _, mlr = patched("neox")
    ids = torch.randint(3, VOCAB, (2, 12))
    first = mlr.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    mlr.generate(ids, max_new_tokens=6, do_sample=False)
    assert sum("cache.update without kwargs" in record.getMessage() for record in logged_warnings.records) == 1
    assert all(not layer.is_bound and layer.keys.shape[-1] == HEAD_DIM for layer in first.cache.layers)
    assert torch.equal(first.sequences, mlr.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False))


def test_key_cache_bytes_follow_the_formula():
    _, mlr = patched("llama")
    report = decoder_cache_report(mlr.config, 37, dtype_bytes=torch.float64)
    per_head = 37 * 8 + min(16, 37) * 4 + min(8, 37) * 4  # level 1 every key, finer levels the current block
    assert per_head == key_cache_elements("mlr", 37, RANKS, BLOCKS)
    assert report["key_cache_bytes"] == 2 * 2 * per_head * 8  # layers x KV heads x entries x bytes
    assert report["dense_key_cache_bytes"] == 2 * 2 * 37 * HEAD_DIM * 8
    assert report["key_cache_ratio"] == pytest.approx(per_head / (37 * HEAD_DIM))
    _, gemma3 = patched("gemma3")  # sliding layers 0, 1 keep min(T, 8) full keys
    mixed = decoder_cache_report(gemma3.config, 37, dtype_bytes=2)
    assert mixed["key_cache_bytes"] == 2 * 2 * (2 * 8 * HEAD_DIM + per_head)


def test_sliding_window_layers_are_refused_unless_replaced_or_excluded():
    model = tiny_decoder("gemma3")
    assert model.config.layer_types[:2] == ["sliding_attention"] * 2
    with pytest.raises(ValueError, match=r"layers \[0, 1\] use sliding-window attention"):
        hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    replaced = hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, sliding_window_layers="replace")
    assert replaced.config.layer_types == ["full_attention"] * 3 and model.config.layer_types[0] == "sliding_attention"
    # the replaced model is the model its saved config describes
    rebuilt = type(replaced)(copy.deepcopy(replaced.config)).double().eval()
    rebuilt.load_state_dict(replaced.state_dict())
    ids = torch.randint(1, VOCAB, (2, 37))
    torch.testing.assert_close(rebuilt(ids).logits, replaced(ids).logits, rtol=0, atol=1e-12)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, num_key_value_heads=2,
                                                                         sliding_window=16))
    with pytest.raises(ValueError, match="sliding-window"):
        hf_structattn.patch(mistral, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    with pytest.raises(ValueError, match="replace all layers or none"):
        hf_structattn.patch(mistral, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, layers=[0],
                            sliding_window_layers="replace")
    whole = hf_structattn.patch(mistral, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, sliding_window_layers="replace")
    assert whole.config.sliding_window is None and mistral.config.sliding_window == 16


def test_soft_capping_and_multimodal_are_refused():
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **COMMON, num_key_value_heads=2, head_dim=HEAD_DIM, layer_types=["full_attention"] * 2))
    with pytest.raises(ValueError, match="soft-capping"):
        hf_structattn.patch(gemma2, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    _, mlr = patched("llama")
    attention = mlr.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, HEAD_DIM, dtype=torch.float64)
    k = torch.randn(1, 2, 5, HEAD_DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match="multimodal"):
        mlr_attention_forward(attention, q, k, k, None, position_ids=torch.zeros(3, 1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="soft-capping"):
        mlr_attention_forward(attention, q, k, k, None, softcap=30.0)


def test_packed_sequences_are_refused():
    """With or without a cache: uncached, transformers turns restarting position_ids into a block-diagonal mask whose
    last row (the one MLR reads padding from) hides the earlier segments -- they must not pass as padding."""
    _, mlr = patched("llama")
    ids = torch.randint(1, VOCAB, (1, 20))
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="packed sequences"):
            mlr(ids, position_ids=torch.cat([torch.arange(10), torch.arange(10)])[None], use_cache=use_cache)
    gpt2 = tiny_lm("mlr")
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="packed sequences"):
            gpt2(ids, position_ids=torch.cat([torch.arange(8), torch.arange(12)])[None], use_cache=use_cache)


def test_bad_patch_arguments_name_the_field():
    model = tiny_decoder("llama")
    with pytest.raises(ValueError, match="mlr_ranks"):
        hf_structattn.patch(tiny_decoder("gpt2"))
    with pytest.raises(ValueError, match="mlr_max_length"):
        hf_structattn.patch(model, mlr_ranks=RANKS)  # never from max_position_embeddings
    with pytest.raises(ValueError, match="mlr_ranks"):
        hf_structattn.patch(model, mlr_ranks=[8, 4], mlr_block_sizes=[16])
    with pytest.raises(ValueError, match="layers"):
        hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, layers=[5])
    with pytest.raises(ValueError, match="init="):
        hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, init="svd")
    mlr = hf_structattn.patch(model, mlr_ranks=RANKS, mlr_max_length=32)
    assert mlr.config.mlr_block_sizes == [16, 8]
    with pytest.raises(ValueError, match="already has MLR attention"):
        hf_structattn.patch(mlr, mlr_ranks=RANKS, mlr_max_length=32)


def test_stock_checkpoint_loads_with_attn_implementation_mlr(tmp_path):
    model, mlr = patched("llama")
    model.save_pretrained(tmp_path / "stock")
    ids = torch.randint(1, VOCAB, (2, 37))
    hf_structattn.register_attention()  # as docs/patching.md says (patch() above registered it already)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "stock")
    config.mlr_ranks, config.mlr_block_sizes = RANKS, BLOCKS
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stock", config=config,
                                                               attn_implementation="mlr", dtype=torch.float64)
    assert type(loaded) is transformers.LlamaForCausalLM
    torch.testing.assert_close(loaded(ids).logits, mlr(ids).logits, rtol=0, atol=1e-12)
    assert loaded.config.mlr_dim_order == mlr.config.mlr_dim_order  # found from the model's own rotary embedding


def test_register_attention_is_what_a_fresh_process_needs_for_a_stock_checkpoint(tmp_path):
    """In a fresh interpreter, ``import hf_structattn`` registers configs only (no modeling import), and
    ``register_attention()`` is enough for a stock checkpoint to load with ``attn_implementation="mlr"`` and run MLR
    (its geometry resolved: ``mlr_dim_order`` found from its rotary embedding)."""
    script = f"""
        import sys
        import torch, transformers
        config = transformers.LlamaConfig(vocab_size={VOCAB}, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained("stock")
        import hf_structattn
        assert "hf_structattn.modeling.structattn_attention" not in sys.modules
        hf_structattn.register_attention()
        config = transformers.AutoConfig.from_pretrained("stock")
        config.mlr_ranks, config.mlr_block_sizes = {RANKS}, {BLOCKS}
        model = transformers.AutoModelForCausalLM.from_pretrained("stock", config=config, attn_implementation="mlr")
        logits = model(torch.arange(1, 40)[None] % {VOCAB}).logits
        model.save_pretrained("saved")
        print(type(model).__name__, model.config.mlr_dim_order is not None, bool(logits.isfinite().all()))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["LlamaForCausalLM", "True", "True"], result.stdout
    # what it saved names its attention: without hf_structattn transformers refuses it (it loaded as the dense model)
    reload = "import transformers; transformers.AutoModelForCausalLM.from_pretrained('saved')"
    result = subprocess.run([sys.executable, "-c", reload], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0 and 'Specified `attn_implementation="mlr"` is not supported' in result.stderr, \
        result.stderr[-3000:]


@pytest.mark.parametrize("arch", ARCHS)
def test_mlr_classes_do_not_claim_serving_engines_attention_backends(arch):
    """``_supports_attention_backend`` (``is_backend_compatible()``) is what the transformers backends of vLLM and TGI
    read to run a model with their own attention function and paged cache: MLR attention would be replaced (a
    silent dense model) or fed a cache layout it does not know. The stock class claims it; no MLR class does -- the
    patched causal LM, its base model, the GPT-2 and T5 families, the patched Chronos-Bolt."""
    from hf_structattn.modeling.structattn_decoder import mlr_model_class

    stock, model = patched(arch)
    base = type(stock.base_model)
    assert not type(model).is_backend_compatible() and not mlr_model_class(base).is_backend_compatible()
    assert type(stock).is_backend_compatible() or arch == "gpt2"  # (stock GPT-2 does not claim it either)
    from hf_structattn import StructAttnGPT2LMHeadModel, StructAttnT5ForConditionalGeneration
    from hf_structattn.modeling.modeling_structattn_chronos_bolt import bolt_model_class

    for cls in (StructAttnGPT2LMHeadModel, StructAttnT5ForConditionalGeneration, bolt_model_class()):
        assert cls is None or not cls.is_backend_compatible(), cls  # (None: chronos-forecasting not installed)


def test_save_and_load_with_remote_code_without_the_plugin(tmp_path):
    from model_helpers import run_isolated

    checks = []
    for arch in ("llama", "gpt2"):  # one RoPE + GQA model, one learned-position model; one interpreter for both
        _, mlr = patched(arch)
        save_dir = tmp_path / arch
        mlr.save_pretrained(save_dir)
        ids = torch.randint(3, VOCAB, (2, 23))
        torch.save({"ids": ids, "logits": mlr(ids).logits.detach(),
                    "hidden": mlr(ids, output_hidden_states=True).hidden_states[-1].detach(),
                    "generated": mlr.generate(ids[:, :9], max_new_tokens=10, min_new_tokens=10, do_sample=False)},
                   save_dir / "expected.pt")
        # the base model is mapped too: AutoModel loads the MLR base model of the architecture
        assert set(json.loads((save_dir / "config.json").read_text())["auto_map"]) == {
            "AutoConfig", "AutoModel", "AutoModelForCausalLM"}
        files = {path.name for path in save_dir.iterdir()}
        assert {"structattn_decoder.py", "structattn_mlr.py", "structattn_mlr_fused.py", "structattn_mlr_math.py",
                 "structattn_geometry.py", "README.md"} <= files
        assert "WARNING: this is not a stock" in (save_dir / "README.md").read_text()
        config = transformers.AutoConfig.from_pretrained(save_dir)
        assert config.model_type == "mlr_" + mlr.config.mlr_patch["source_model_type"]
        assert "DENSE" in config.mlr_notice
        checks.append((str(save_dir), type(mlr).__name__, mlr._mlr_base))

    out = run_isolated(f"""
        import torch, transformers
        for path, name, stock_name in {checks!r}:
            expected = torch.load(path + "/expected.pt")
            try:
                transformers.AutoModelForCausalLM.from_pretrained(path)
            except ValueError as error:
                print(name, "no_trust_refused", "trust_remote_code" in str(error))
            model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True,
                                                                      dtype=torch.float64)
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            assert type(model).__name__ == name and model.config._attn_implementation == "sdpa"
            print(name, "max_diff", float((model(expected["ids"]).logits - expected["logits"]).abs().max()))
            generated = model.generate(expected["ids"][:, :9], max_new_tokens=10, min_new_tokens=10,
                                       do_sample=False)
            print(name, "generate_equal", torch.equal(generated, expected["generated"]))
            out = model.generate(expected["ids"][:, :9], max_new_tokens=4, do_sample=False,
                                 return_dict_in_generate=True)
            print(name, "cache_layer", type(out.cache.layers[0]).__name__)
            stock = getattr(transformers, stock_name).from_pretrained(path, dtype=torch.float64)
            print(name, "stock_dense_diff", float((stock(expected["ids"]).logits - expected["logits"]).abs().max()))
            base = transformers.AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float64)
            assert type(base).__module__.startswith("transformers_modules"), type(base).__module__
            hidden = base(expected["ids"]).last_hidden_state
            print(name, "base_model", type(base).__name__, float((hidden - expected["hidden"]).abs().max()))
            print(name, "backend_compatible", type(model).is_backend_compatible() or type(base).is_backend_compatible())
    """, tmp_path)
    for _, name, _ in checks:
        result = dict(re.findall(rf"{name} (\w+) (\S+)", out))  # the trust prompt shares a line with one of them
        assert result.get("no_trust_refused") == "True", out
        assert float(result["max_diff"]) <= 1e-12
        assert result["generate_equal"] == "True"
        assert result["cache_layer"] == "MLRKeyCacheLayer"  # the hierarchical key cache, from remote code
        assert result["backend_compatible"] == "False"  # no serving engine's attention backend takes it over
        # the documented outcome of a stock-class load (stated in README.md and config.mlr_notice): a dense model
        assert float(result["stock_dense_diff"]) > 1e-6
        base_name, base_diff = re.search(rf"{name} base_model (\w+) (\S+)", out).groups()
        assert base_name == "MLR" + {"MLRLlamaForCausalLM": "LlamaModel", "MLRGPT2LMHeadModel": "GPT2Model"}[name]
        assert float(base_diff) <= 1e-12


# logits are ~1.5 here; the stock Llama's own error against float64 is 6e-7 (float32) and 0.011 (bfloat16, eps 2^-8)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_lower_precision_matches_float64(dtype, tolerance):
    _, mlr = patched("llama")
    ids = torch.randint(1, VOCAB, (2, 37))
    reference = mlr(ids).logits
    low = copy.deepcopy(mlr).to(dtype)
    torch.testing.assert_close(low(ids).logits.double(), reference, rtol=0, atol=tolerance)
    cache = DynamicCache(config=low.config)
    decoded = torch.cat([low(ids[:, :20], cache=cache, use_cache=True).logits] +
                        [low(ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(20, 37)], dim=1)
    torch.testing.assert_close(decoded.double(), reference, rtol=0, atol=tolerance)


def test_cli_patches_a_decoder_checkpoint(tmp_path, capsys):
    from hf_structattn_cli import main as cli
    from hf_structattn.tokenization import build_byte_tokenizer

    model = tiny_decoder("llama", vocab_size=257)
    model.save_pretrained(tmp_path / "src")
    build_byte_tokenizer().save_pretrained(tmp_path / "src")
    assert cli(["patch", str(tmp_path / "src"), str(tmp_path / "out"), "--mlr-ranks", "8,4,4",
                "--mlr-block-sizes", "16,8", "--layers", "1"]) == 0
    assert "logit_rel" in capsys.readouterr().out
    files = {path.name for path in (tmp_path / "out").iterdir()}
    assert {"structattn_decoder.py", "tokenizer.json", "README.md", "model.safetensors"} <= files
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    expected = hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, layers=[1])
    ids = torch.randint(0, 257, (2, 37))
    assert type(loaded).__name__ == "MLRLlamaForCausalLM" and loaded.config.mlr_layers == [1]
    torch.testing.assert_close(loaded(ids).logits, expected(ids).logits, rtol=0, atol=1e-12)
    assert cli(["patch", str(tmp_path / "out"), str(tmp_path / "again"), "--mlr-ranks", "8,4,4",
                "--mlr-block-sizes", "16,8"]) == 2
    assert "already an MLR decoder checkpoint" in capsys.readouterr().err
    tiny_decoder("gemma3", vocab_size=257).save_pretrained(tmp_path / "gemma3")
    assert cli(["patch", str(tmp_path / "gemma3"), str(tmp_path / "g"), "--mlr-ranks", "8,4,4",
                "--mlr-block-sizes", "16,8"]) == 2
    assert "sliding_window_layers='replace'" in capsys.readouterr().err and not (tmp_path / "g").exists()


@pytest.mark.parametrize("stock_card", ["---\nlicense: apache-2.0\n---\n# A stock tiny model\nIts own text.\n",
                                        "# A card without front matter\n"])
def test_saving_over_a_stock_card_puts_the_warning_on_top_and_keeps_its_text(tmp_path, stock_card):
    _, mlr = patched("llama")
    (tmp_path / "README.md").write_text(stock_card)
    mlr.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\n") and "WARNING: this is not a stock" in card
    assert stock_card.split("---\n")[-1] in card  # the stock text is kept below the warning
    assert card.index("WARNING") < card.index("# A ")
    if "license" in stock_card:
        assert card.count("---\n") == 2 and "license: apache-2.0" in card  # one front matter, the stock one
    mlr.save_pretrained(tmp_path)  # saving again does not stack a second warning
    assert (tmp_path / "README.md").read_text() == card


def test_patch_keywords_and_scales_are_checked_before_anything_is_built():
    model = tiny_decoder("llama")
    with pytest.raises(ValueError, match="unknown keyword 'mlr_rnaks'.*did you mean mlr_ranks"):
        hf_structattn.patch(model, mlr_rnaks=RANKS, mlr_block_sizes=BLOCKS)
    with pytest.raises(ValueError, match="mlr_level_scales.*finite number > 0"):
        hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, mlr_level_scales=[-1, 1, 1])

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0))
    with pytest.raises(ValueError, match="unknown keyword 'mlr_rank'.*did you mean mlr_ranks"):
        hf_structattn.patch(t5, mlr_rank=[4, 4], mlr_block_sizes=[8])


def test_patch_works_on_the_meta_device():
    """A model initialised on the meta device (init-empty loading of a big checkpoint) patches without touching data;
    filling it with the stock weights afterwards gives the model patched from real weights."""
    real = tiny_decoder("llama")
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(real.config)
    patched_empty = hf_structattn.patch(empty, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    assert all(param.is_meta for param in patched_empty.parameters())
    patched_empty = patched_empty.to_empty(device="cpu").double()
    patched_empty.load_state_dict(real.state_dict())
    for name, buffer in real.named_buffers():  # the non-persistent RoPE frequencies
        owner, _, attribute = name.rpartition(".")
        setattr(patched_empty.get_submodule(owner), attribute, buffer.clone())
    reference = hf_structattn.patch(real, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    assert patched_empty.config.mlr_dim_order == reference.config.mlr_dim_order
    ids = torch.randint(1, VOCAB, (2, 20))
    torch.testing.assert_close(patched_empty(ids).logits, reference(ids).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_forward_and_backward(dtype):
    """Under autocast RoPE gives float32 q/k next to a half-precision v; MLR computes in the autocast dtype as SDPA
    does (plain torch.autocast; accelerate's mixed_precision uses the same context)."""
    _, mlr = patched("llama")
    mlr = mlr.float().train()
    ids = torch.randint(1, VOCAB, (2, 20))
    with torch.autocast("cpu", dtype=dtype):
        out = mlr(ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in mlr.parameters() if p.grad is not None)
    reference = mlr(ids, labels=ids, use_cache=False).loss
    assert abs(float(out.loss) - float(reference)) < 0.05 * abs(float(reference))
    mlr.eval()
    with torch.autocast("cpu", dtype=dtype):
        generated = mlr.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
    assert generated.shape == (2, 14)


def test_every_tested_architecture_reloads_bare_generates_and_saves(tmp_path):
    """Reloaded with trust_remote_code where hf_structattn cannot be imported (transformers builds its own subclass
    of a remote class), every tested architecture generates without a cache and saves again (a class found twice in
    the MRO made Phi-3 recurse forever)."""
    from model_helpers import run_isolated

    paths = []
    for arch in ARCHS:
        _, mlr = patched(arch)
        mlr.save_pretrained(tmp_path / arch)
        paths.append(str(tmp_path / arch))
    out = run_isolated(f"""
        import torch, transformers
        for path in {paths!r}:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
            ids = torch.randint(3, 61, (1, 9))
            tokens = model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False)
            cached = model.generate(ids, max_new_tokens=3, do_sample=False)
            model.save_pretrained(path + "-again")
            print(path.rsplit("/", 1)[-1], "ok", torch.equal(tokens, cached))
    """, tmp_path)
    for arch in ARCHS:
        assert f"{arch} ok True" in out, out[-3000:]


def test_attention_dropout_is_applied_by_the_eager_implementation_and_warned_about_otherwise(logged_warnings):
    _, mlr = patched("llama")
    for module in attention_modules(mlr).values():
        module.attention_dropout = 0.5
    mlr.train()
    ids = torch.randint(1, VOCAB, (2, 12))
    mlr.set_attn_implementation("eager")
    torch.manual_seed(0)
    first = mlr(ids, use_cache=False).logits
    second = mlr(ids, use_cache=False).logits
    assert not torch.allclose(first, second)  # different dropout masks
    mlr.eval()
    torch.testing.assert_close(mlr(ids, use_cache=False).logits, mlr(ids, use_cache=False).logits, atol=0, rtol=0)
    mlr.train()
    mlr.set_attn_implementation("sdpa")
    mlr(ids, use_cache=False)
    mlr(ids, use_cache=False)
    assert sum("only with attn_implementation='eager'" in record.getMessage()
               for record in logged_warnings.records) == 1


def test_reports_state_the_rollback_log_bytes_speculative_decoding_allocates():
    """The static cache's rollback log (fixed buffers sized by the crop window generate sets) is what the cache
    reports say speculative decoding adds: patched GQA Llama (float64) and an MLR GPT-2 (float32)."""
    _, mlr = patched("llama")
    gpt2 = tiny_lm("mlr", n_positions=128)
    prompt = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    for model in (mlr, gpt2):
        out = model.generate(prompt, prompt_lookup_num_tokens=4, max_new_tokens=6, do_sample=False, pad_token_id=1,
                             return_dict_in_generate=True, cache_implementation="static")
        layers = [layer for layer in out.cache.layers if getattr(layer, "rollback_log", None) is not None and
                  layer.rollback_log.tensors()]
        assert layers and {layer.rollback_window for layer in layers} == {6}
        logged = sum(t.numel() * t.element_size() for layer in layers for t in layer.rollback_log.tensors())
        item = layers[0].keys.element_size()
        if model is mlr:
            report = decoder_cache_report(model.config, 46, dtype_bytes=item, rollback_window=6)
            assert report["rollback_log_bytes"] == logged > 0
            assert decoder_cache_report(model.config, 46, dtype_bytes=item)["rollback_log_bytes"] == 0
        else:
            report = attention_cost_report(model.config, dtype_bytes=item, rollback_window=6)
            assert report.rollback_log_bytes == logged > 0
            assert report.key_cache_bytes == attention_cost_report(model.config, dtype_bytes=item).key_cache_bytes


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
])
def test_rope_scaling_cached_equals_uncached(rope):
    """RoPE scaling changes the frequencies, not the pair structure MLR levels are cut along: a patched Llama with
    linear, YaRN and Llama-3 scaling decodes chunk by chunk exactly as its uncached forward (float64)."""
    from hf_structattn.decoder_patching import _tiny_common

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_tiny_common(VOCAB), num_key_value_heads=2,
                                      rope_parameters={"rope_theta": 10000.0, **rope})
    model = transformers.LlamaForCausalLM(config).double().eval()
    mlr = hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    ids = torch.randint(1, VOCAB, (2, 37))
    uncached = mlr(ids, use_cache=False).logits
    cache = mlr.new_cache()
    bounds = [(0, 13), (13, 20)] + [(i, i + 1) for i in range(20, 37)]
    chunked = torch.cat([mlr(ids[:, a:b], cache=cache, use_cache=True).logits for a, b in bounds], dim=1)
    torch.testing.assert_close(chunked, uncached, rtol=0, atol=1e-12)
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(mlr.generate(ids, **greedy), mlr.generate(ids, use_cache=False, **greedy))


def _stock_run_with_mlr(folder, **fields):
    """The README's path: a stock checkpoint's config given MLR ``fields``, loaded with attn_implementation="mlr"."""
    hf_structattn.register_attention()
    config = transformers.AutoConfig.from_pretrained(folder)
    for name, value in fields.items():
        setattr(config, name, value)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, attn_implementation="mlr",
                                                             dtype=torch.float64)


def _one_line_error(model, ids) -> str:
    with pytest.raises(ValueError) as error:
        model(ids)
    message = str(error.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_a_stock_model_run_with_mlr_refuses_a_config_without_mlr_fields(tmp_path, arch):
    """It ran the dense model under the name "mlr", saying nothing."""
    tiny_decoder(arch).save_pretrained(tmp_path)
    message = _one_line_error(_stock_run_with_mlr(tmp_path), torch.randint(1, VOCAB, (1, 9)))
    assert message.startswith("config.mlr_ranks is missing:") and "hf_structattn.patch" in message, message


def test_a_stock_model_run_with_mlr_refuses_layers_it_does_not_have_and_ranks_off_the_head_dim(tmp_path):
    """``mlr_layers=[5]`` on a 2-layer model ran the dense model; ranks summing to 14 (head dim 16) raised a raw
    ``KeyError: 0`` from the RoPE pair check, which ran before the ranks were checked."""
    tiny_decoder("llama").save_pretrained(tmp_path)
    ids = torch.randint(1, VOCAB, (1, 9))
    message = _one_line_error(_stock_run_with_mlr(tmp_path, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, mlr_layers=[5]),
                              ids)
    assert message.startswith("mlr_layers=[5] must list layer indices of this 2-layer model (0..1)"), message
    message = _one_line_error(_stock_run_with_mlr(tmp_path, mlr_ranks=[8, 4, 2], mlr_block_sizes=BLOCKS), ids)
    assert message == "mlr_ranks=[8, 4, 2] sums to 14, but the head dim is 16"
    message = _one_line_error(_stock_run_with_mlr(tmp_path, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS,
                                                  mlr_dim_order=list(range(HEAD_DIM))), ids)
    assert message.startswith("mlr_dim_order=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] splits the RoPE "
                              "rotation pair (0, 8)"), message


def test_a_stock_gemma3_run_with_mlr_keeps_its_sliding_layers_outside_mlr_layers(tmp_path):
    """``mlr_layers=[2]`` (the global layer) was refused for sliding layer 0, which is not an MLR layer; the layers
    outside ``mlr_layers`` run the stock attention with their window, as in the patched model."""
    model, mlr = patched("gemma3")  # layers=[2]
    model.save_pretrained(tmp_path)
    loaded = _stock_run_with_mlr(tmp_path, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, mlr_layers=[2])
    ids = torch.randint(1, VOCAB, (2, 37))  # longer than the window (8)
    torch.testing.assert_close(loaded(ids).logits, mlr(ids).logits, rtol=0, atol=1e-12)
    sliding = _stock_run_with_mlr(tmp_path, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, mlr_layers=[0])
    assert "layer 0 is a sliding-window layer (window 8)" in _one_line_error(sliding, ids)  # an MLR layer still is


def test_a_stock_model_run_with_mlr_saves_as_what_it_runs(tmp_path):
    """Saved with ``save_pretrained`` and reloaded without ``attn_implementation``, it loaded as the dense model
    (0.16 off in logits) without a word: the saved config now keeps ``attn_implementation`` and the level order."""
    tiny_decoder("llama").save_pretrained(tmp_path / "stock")
    model = _stock_run_with_mlr(tmp_path / "stock", mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    ids = torch.randint(1, VOCAB, (2, 37))
    expected = model(ids).logits
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["attn_implementation"] == "mlr" and saved["mlr_dim_order"] == model.config.mlr_dim_order
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float64)
    assert type(reloaded) is transformers.LlamaForCausalLM and reloaded.config._attn_implementation == "mlr"
    torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_a_stock_model_run_with_mlr_over_a_static_cache_is_exact(tmp_path, arch):
    """Over ``StaticCache(max_cache_len=64)`` a 14-token prompt's logits differed from ``use_cache=False`` by up to
    0.15 (Llama), 0.74 (Qwen3), 0.08 (Phi-3), and ``generate(cache_implementation="static")`` gave other tokens
    from the first: with no plan the attention took the whole buffer as written. Batch 2 with left padding, then
    the static generation against the dynamic one and against the uncached forward over its output."""
    tiny_decoder(arch).save_pretrained(tmp_path)
    model = _stock_run_with_mlr(tmp_path, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    uncached = model(ids, attention_mask=mask, use_cache=False).logits
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)
    cached = model(ids, attention_mask=mask, cache=cache, use_cache=True).logits
    real = mask.bool()
    torch.testing.assert_close(cached[real], uncached[real], rtol=0, atol=1e-12)
    alone = transformers.StaticCache(config=model.config, max_cache_len=64)  # no mask at all: SDPA would skip it
    torch.testing.assert_close(model(ids[:1], cache=alone, use_cache=True).logits, model(ids[:1]).logits,
                               rtol=0, atol=1e-12)
    greedy = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    static = model.generate(ids, cache_implementation="static", **greedy)  # blocks of 16 and 8 crossed
    assert torch.equal(static, model.generate(ids, **greedy))
    assert torch.equal(static, model.generate(ids, use_cache=False, **greedy))


def test_a_cache_layer_that_cannot_hold_the_hierarchy_says_the_saving_is_lost(logged_warnings):
    """A patched model handed a cache whose layers are of a foreign class (a user's, an offloading or quantising
    one) ran without a word and stored full-width keys: now it says, once per layer, that the saving is lost and
    what keeps it, and stays exact (logits equal the uncached forward's)."""
    class UsersOwnLayer(transformers.cache_utils.DynamicLayer):
        """A user's cache layer: transformers' dynamic layer under another class."""

    _, mlr = patched("llama")
    mlr = mlr.to(torch.float64)
    ids = torch.randint(1, VOCAB, (2, 21), generator=torch.Generator().manual_seed(4))
    cache = transformers.DynamicCache()
    cache.layers = [UsersOwnLayer() for _ in range(mlr.config.num_hidden_layers)]
    cached = torch.cat([mlr(ids[:, :13], cache=cache, use_cache=True).logits,
                        mlr(ids[:, 13:], cache=cache, use_cache=True).logits], dim=1)
    torch.testing.assert_close(cached, mlr(ids, use_cache=False).logits, rtol=0, atol=1e-12)
    lost = [r.getMessage() for r in logged_warnings.records if "cannot hold the MLR key hierarchy" in r.getMessage()]
    assert lost and all("UsersOwnLayer" in message and "saving is lost" in message for message in lost), lost
    assert all(type(layer) is UsersOwnLayer for layer in cache.layers)
