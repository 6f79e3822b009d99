"""The hierarchical MLR key cache on its own (the API a Llama-style attention function uses) and through the models:
static == dynamic, offsets and per-row positions, formula bytes, half precision, torch.compile."""

import pytest
import torch
import transformers

from hf_structattn.flops import key_cache_elements
from hf_structattn.modeling.structattn_cache import (
    MLRKeyCacheLayer,
    MLRStaticKeyCacheLayer,
    StructAttnCache,
    cached_mlr_attention,
)
from hf_structattn.modeling import structattn_cache
from hf_structattn.modeling.structattn_mlr import mlr_attention

from conftest import tiny_lm

RANKS, BLOCKS = [4, 2, 1, 1], [16, 8, 4]
EXACT = dict(atol=1e-12, rtol=1e-12)


def _qkv(batch, length, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, length, 8, generator=generator, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("index_add_rows", [16, 0])
def test_llama_style_update_then_attend_equals_uncached_op(static, average_levels, index_add_rows, monkeypatch):
    """The decoder-patch API: ``cache.update(k, v, layer_idx, cache_kwargs)`` with position_ids and a 2-D padding
    mask, then ``cache.layers[i].attend(q)``; chunked prefill, then decode, with left padding and per-row offsets.
    Both ways of adding the rings' scores in a decode step: one ``index_add_`` (small steps, 6 rows here) and the
    per-level slice adds (forced with ``INDEX_ADD_MAX_ROWS = 0``)."""
    monkeypatch.setattr(structattn_cache, "INDEX_ADD_MAX_ROWS", index_add_rows)
    q, k, v = _qkv(2, 30)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :5] = False  # left padding
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0) + torch.tensor([[7], [0]])  # row 0 starts at 7
    scales = [0.3, 0.2, 0.5, 0.4]
    reference = mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, scales=scales, positions=positions,
                              attention_mask=valid, causal=True, average_levels=average_levels)
    cache = StructAttnCache([{"attention": "mlr", "ranks": RANKS, "block_sizes": BLOCKS}],
                            max_cache_len=32 if static else None)
    layer = cache.layers[0]
    assert isinstance(layer, MLRStaticKeyCacheLayer if static else MLRKeyCacheLayer)
    outputs, start = [], 0
    for size in [6, 9] + [1] * 15:
        end = start + size
        keys, values = cache.update(k[:, :, start:end], v[:, :, start:end], 0,
                                    {"position_ids": positions[:, start:end], "attention_mask": valid[:, :end].long()})
        assert keys.shape[-1] == RANKS[0] and values.shape[-1] == 8  # level-1 keys, values of every slot
        outputs.append(layer.attend(q[:, :, start:end], level_scales=scales, average_levels=average_levels))
        start = end
    cached = torch.cat(outputs, dim=2)
    real = valid[:, None, :, None]
    torch.testing.assert_close(cached.masked_fill(~real, 0), reference.masked_fill(~real, 0), **EXACT)
    assert cache.get_seq_length() == 30


@pytest.mark.parametrize("static,compiled", [(False, False), (True, False), (True, True)])
def test_grouped_query_decode_attends_once_per_kv_head(static, compiled):
    """GQA decode: ``attend`` takes the g query heads of each KV head as g query rows of one decode step (one call
    instead of g); equals the uncached op on repeated keys/values, with left padding, across block boundaries, in
    the eager path and in the fixed-shape path ``torch.compile`` traces."""
    kv_heads, groups, length = 3, 2, 26
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, kv_heads * groups, length, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, length, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    valid = torch.ones(2, length, dtype=torch.bool)
    valid[0, :3] = False
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    scales = [0.3, 0.2, 0.5, 0.4]
    reference = mlr_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), ranks=RANKS,
                              block_sizes=BLOCKS, scales=scales, positions=positions, attention_mask=valid, causal=True)
    cache = StructAttnCache([{"attention": "mlr", "ranks": RANKS, "block_sizes": BLOCKS}],
                            max_cache_len=length + 2 if static else None)
    layer = cache.layers[0]
    attend = layer.attend
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(layer.attend, backend="eager")
    prefill = 7
    cache.update(k[:, :, :prefill], v[:, :, :prefill], 0,
                 {"position_ids": positions[:, :prefill], "attention_mask": valid[:, :prefill]})
    outputs = []
    for t in range(prefill, length):
        cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0,
                     {"position_ids": positions[:, t:t + 1], "attention_mask": valid[:, :t + 1]})
        grouped = q[:, :, t].reshape(2, kv_heads, groups, 8)  # query head h reads KV head h // groups
        outputs.append(attend(grouped, level_scales=scales).reshape(2, kv_heads * groups, 1, 8))
    torch.testing.assert_close(torch.cat(outputs, dim=2), reference[:, :, prefill:], **EXACT)
    with pytest.raises(ValueError, match="query rows per head are accepted only for a one-token decode step"):
        cache.update(k[:, :, :2], v[:, :, :2], 0, {"position_ids": positions[:, -2:] + length})
        layer.attend(q[:, :, :4], level_scales=scales)


def test_plain_dynamic_cache_honours_offset_and_per_row_positions():
    """Per-row offsets without a mask (no padding): the MLR layer's dispatch through an ordinary DynamicCache."""
    q, k, v = _qkv(2, 20, seed=3)
    positions = torch.arange(20)[None] + torch.tensor([[5], [40]])
    scales = [0.5] * 4
    all_real = torch.ones(2, 20, dtype=torch.bool)
    reference = mlr_attention(q, k, v, ranks=RANKS, block_sizes=BLOCKS, scales=scales, positions=positions,
                              attention_mask=all_real, causal=True)
    for cache in (transformers.DynamicCache(),
                  StructAttnCache([{"attention": "mlr", "ranks": RANKS, "block_sizes": BLOCKS}])):
        outputs, start = [], 0
        for size in [7] + [1] * 13:
            end = start + size
            out = cached_mlr_attention(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], cache, 0,
                                       positions=positions[:, start:end], valid=None, ranks=RANKS,
                                       block_sizes=BLOCKS, level_scales=scales)
            if out is None:  # nothing cached before the first chunk: the caller runs the uncached op
                out = mlr_attention(q[:, :, :end], k[:, :, :end], v[:, :, :end], ranks=RANKS, block_sizes=BLOCKS,
                                    scales=scales, positions=positions[:, :end], attention_mask=all_real[:, :end],
                                    causal=True)
            outputs.append(out)
            start = end
        torch.testing.assert_close(torch.cat(outputs, dim=2), reference, **EXACT)


@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup"])
def test_offset_and_per_row_positions_cached_equal_uncached(variant):
    model = tiny_lm(variant).double()
    ids = torch.randint(2, 61, (2, 24))
    positions = torch.arange(5, 29)[None]  # model(ids, position_ids=arange(5, 29)) used to crash in eval mode
    reference = model(ids, position_ids=positions, use_cache=False).logits
    for cache in (model.transformer.new_cache(), transformers.DynamicCache(),
                  model.transformer.new_cache(max_cache_len=30)):
        steps = [model(ids[:, :9], position_ids=positions[:, :9], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, t:t + 1], position_ids=positions[:, t:t + 1], cache=cache, use_cache=True).logits
                  for t in range(9, 24)]
        torch.testing.assert_close(torch.cat(steps, 1), reference, **EXACT)


@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup", "mixed"])
def test_static_cache_generates_what_the_dynamic_cache_generates(variant):
    model = tiny_lm(variant)
    prompt = torch.randint(2, 61, (2, 7))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0  # left padding
    common = dict(max_new_tokens=30, min_new_tokens=30, attention_mask=mask, pad_token_id=1)
    for kwargs in (dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=2)):
        dynamic = model.generate(prompt, **common, **kwargs)
        static = model.generate(prompt, cache_implementation="static", **common, **kwargs)
        torch.testing.assert_close(static, dynamic)
    torch.manual_seed(5)
    dynamic = model.generate(prompt, do_sample=True, top_k=20, num_return_sequences=2, **common)
    torch.manual_seed(5)
    static = model.generate(prompt, do_sample=True, top_k=20, num_return_sequences=2, cache_implementation="static",
                            **common)
    torch.testing.assert_close(static, dynamic)


def test_static_and_dynamic_cache_hold_the_formula_bytes():
    model = tiny_lm("mlr")
    config = model.config
    ranks, blocks, head_dim = config.resolved_mlr_ranks, config.resolved_mlr_block_sizes, config.head_dim
    ids = torch.randint(2, 61, (3, 40))
    for max_cache_len in (None, 20, 48):
        cache = model.transformer.new_cache(max_cache_len=max_cache_len)
        length = 20 if max_cache_len == 20 else 40
        model(ids[:, :length], cache=cache, use_cache=True)
        held = length if max_cache_len is None else max_cache_len  # a static cache holds its whole allocation
        expected = key_cache_elements("mlr", held, ranks, blocks, head_dim)
        layer = cache.layers[0]
        assert layer.key_cache_elements() == expected
        # the tensors really allocated for keys: level 1 plus the rings
        allocated = layer.keys.shape[-2] * ranks[0] + sum(ring.shape[-2] * ring.shape[-1] for ring in layer.level_keys)
        if max_cache_len is not None:
            assert allocated == expected
        itemsize = layer.keys.element_size()
        assert cache.key_cache_bytes() == config.n_layer * 3 * config.n_head * expected * itemsize


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cached_attention_is_finite_and_close_to_float32(dtype):
    """Masked fills and the softmax run in promote_types(dtype, float32): padded and unwritten slots never overflow."""
    q, k, v = _qkv(2, 18, dtype=torch.float32, seed=4)
    valid = torch.ones(2, 18, dtype=torch.bool)
    valid[0, :4] = False
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    results = {}
    for run_dtype in (torch.float32, dtype):
        cache = StructAttnCache([{"attention": "mlr", "ranks": RANKS, "block_sizes": BLOCKS}], max_cache_len=24)
        layer, outputs = cache.layers[0], []
        cache.update(k[:, :, :6].to(run_dtype), v[:, :, :6].to(run_dtype), 0,
                     {"position_ids": positions[:, :6], "attention_mask": valid[:, :6].long()})
        for t in range(6, 18):
            cache.update(k[:, :, t:t + 1].to(run_dtype), v[:, :, t:t + 1].to(run_dtype), 0,
                         {"position_ids": positions[:, t:t + 1], "attention_mask": valid[:, :t + 1].long()})
            outputs.append(layer.attend(q[:, :, t:t + 1].to(run_dtype), level_scales=[0.5] * 4))
        results[run_dtype] = torch.cat(outputs, dim=2)
    assert results[dtype].dtype == dtype and torch.isfinite(results[dtype]).all()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(results[dtype].float(), results[torch.float32], atol=40 * eps, rtol=40 * eps)


def _generate_at_two_batch_sizes(model, backend):
    """Greedy static-cache generation at batch 1, then batch 3, with one compiled forward (the second batch size
    makes Dynamo recompile with a symbolic batch); returns eager and compiled tokens per batch size."""
    common = dict(max_new_tokens=4, min_new_tokens=4, pad_token_id=1, do_sample=False, cache_implementation="static")
    prompts = [torch.randint(2, 61, (batch, 20)) for batch in (1, 3)]  # 20 tokens cross the 8- and 16-blocks
    eager = [model.generate(prompt, **common) for prompt in prompts]
    model.forward = torch.compile(model.forward, backend=backend)
    try:
        compiled = [model.generate(prompt, **common) for prompt in prompts]
    finally:
        del model.forward
    return eager, compiled


def test_compiled_forward_recompiles_for_a_new_batch_size_without_aliased_cache_inputs():
    """One compiled forward serves batch 1, then batch 3 (the benchmark's batch 1 -> 16 failure). The cause was
    the cache's ring views entering the graph as separate inputs that share one storage and are written in place:
    AOTAutograd rebuilds their base with ``Tensor.set_``, which fails under a symbolic batch (inductor) or refuses
    outright with grad on. The backend checks that no two graph inputs taken from the cache share a storage (q/k/v
    views of one projection may: they are not written), then runs the graph eagerly."""
    from torch.multiprocessing.reductions import StorageWeakRef

    cache_inputs, shared = [], []

    def no_aliased_cache_inputs(graph, example_inputs):
        names = [node.name for node in graph.graph.nodes if node.op == "placeholder"]
        storages = [StorageWeakRef(tensor.untyped_storage()) for name, tensor in zip(names, example_inputs)
                    if isinstance(tensor, torch.Tensor) and "cache" in name]
        cache_inputs.append(len(storages))
        shared.append(len(storages) - len(set(storages)))
        return graph.forward

    torch._dynamo.reset()
    eager, compiled = _generate_at_two_batch_sizes(tiny_lm("mlr"), no_aliased_cache_inputs)
    assert sum(cache_inputs) > 0 and shared == [0] * len(shared)  # cache buffers were graph inputs, none aliased
    for eager_tokens, compiled_tokens in zip(eager, compiled):
        torch.testing.assert_close(compiled_tokens, eager_tokens)


def test_compiled_decode_steps_do_not_recompile_per_step():
    """A compiled decode step must not specialise on the step: after the first steps (the first graph, then one
    recompile that makes the slot count symbolic) further steps, crossing block boundaries, compile nothing."""
    model = tiny_lm("mlr")
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend=counting_backend)
    cache = model.transformer.new_cache(max_cache_len=40)
    prompt = torch.randint(2, 61, (2, 6))
    token = torch.randint(2, 61, (2, 1))
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        for step in range(20):  # slots 6 .. 25: across the 8- and 16-blocks of the tiny model
            if step == 4:
                settled = len(graphs)
            forward(token, cache=cache, use_cache=True, position_ids=torch.full((2, 1), 6 + step))
    assert settled > 0 and len(graphs) == settled


@pytest.mark.slow
def test_inductor_generate_at_two_batch_sizes_equals_eager():
    """The same with inductor (minutes on CPU), the backend the benchmark uses."""
    torch._dynamo.reset()
    eager, compiled = _generate_at_two_batch_sizes(tiny_lm("mlr"), "inductor")
    for eager_tokens, compiled_tokens in zip(eager, compiled):
        torch.testing.assert_close(compiled_tokens, eager_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup"])
def test_compiled_generate_equals_eager(variant):
    """``model.forward = torch.compile(model.forward)`` with the static cache (the transformers recipe) gives the
    eager tokens; the decode step runs the fixed-shape path."""
    model = tiny_lm(variant)
    prompt = torch.randint(2, 61, (2, 6))
    common = dict(max_new_tokens=16, min_new_tokens=16, pad_token_id=1, do_sample=False,
                  cache_implementation="static")
    eager = model.generate(prompt, **common)
    model.forward = torch.compile(model.forward, backend="eager")
    torch.testing.assert_close(model.generate(prompt, **common), eager)
