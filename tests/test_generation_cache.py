"""The hierarchical MLR key cache: storage (position-aligned slots, rings), the decode and chunk math over it against
the naive reference, what it allocates, static == dynamic, half precision and torch.compile (rollback:
tests/test_rollback.py)."""

import collections

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import hf_structattn

from hf_structattn.modeling.structattn_cache import MLRKeyCacheLayer, MLRStaticKeyCacheLayer
from hf_structattn.modeling.structattn_prepare import key_cache_bytes

from conftest import tiny_lm
from cache_helpers import EXACT, attend, cache_layer, make_rows, small_geometry, write


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["gpt2", "gpt2_averaged", "llama"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("read", ["in_step", "maps", "grad"])
def test_model_decode_steps_of_rows_in_step_write_from_host_integers(family, static, read):
    """A model's eager decode step of rows in step (batch 3, no padding) writes each MLR layer's token with one
    ``index_copy_`` per storage (keys, values, rings) and none of the general write's indexed assignments -- also when the
    general formulation reads it (``output_attentions`` of the eager implementation, or gradients enabled); the
    in-step read scatters nothing; its logits equal the uncached forward's (float64). Block boundaries are crossed
    on the way (10 steps over blocks of 4 and 8)."""
    eager = dict(attn_implementation="mlr_eager" if family == "llama" else "eager") if read == "maps" else {}
    if family.startswith("gpt2"):  # levels summed (scales applied by the matmuls), or averaged (one multiplier)
        model = tiny_lm("mlr" if family == "gpt2" else "mlr_avg_mup", n_layer=3, **eager).double()
        layers = 3
    else:
        config = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        torch.manual_seed(0)
        model = hf_structattn.patch(transformers.LlamaForCausalLM(config).double().eval(), mlr_ranks=[8, 4, 4],
                                    mlr_block_sizes=[8, 4])
        if eager:
            model.set_attn_implementation(eager["attn_implementation"])
        layers = 2
    ids = torch.randint(2, 61, (3, 18), generator=torch.Generator().manual_seed(5))
    cache = transformers.StaticCache(config=model.config, max_cache_len=24) if static else \
        transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], cache=cache)
    for index in range(8, 18):
        with torch.set_grad_enabled(read == "grad"), _OpCounter() as counter:
            out = model(ids[:, index:index + 1], cache=cache, output_attentions=read == "maps")
        assert counter.ops["index_copy_"] == 3 * layers, (index, counter.ops)
        assert not any(counter.ops[name] for name in ("index_put_", "narrow_copy")), (index, counter.ops)
        assert read != "in_step" or not counter.ops["scatter_add_"], (index, counter.ops)
        if read == "maps":
            width = 24 if static else index + 1  # a static cache's maps span its slots, as transformers' do
            assert all(maps.shape[-1] == width for maps in out.attentions)
        with torch.no_grad():
            expected = model(ids[:, :index + 1], use_cache=False).logits[:, -1]
        torch.testing.assert_close(out.logits[:, -1].detach(), expected, **EXACT, msg=f"step {index}")


@pytest.mark.parametrize("argument, message", [
    ({"softcap": 30.0}, "soft-capping"), ({"cu_seq_lens_q": torch.tensor([0, 1])}, "packed sequences"),
    ({"sliding_window": 4}, "sliding-window layer")])
def test_decode_steps_of_rows_in_step_still_refuse_what_mlr_refuses(argument, message):
    """An argument MLR refuses fails with its one-line error before anything is written: the cache layer's
    ``update`` checks the call's arguments before its write, so the cache is left as it was."""
    model = tiny_lm("mlr", n_layer=2).double()
    ids = torch.randint(2, 61, (1, 9), generator=torch.Generator().manual_seed(3))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], cache=cache)
        with pytest.raises(ValueError, match=message):
            model(ids[:, 8:], cache=cache, **argument)
        assert cache.get_seq_length() == 8
        torch.testing.assert_close(model(ids[:, 8:], cache=cache).logits[:, -1], model(ids).logits[:, -1], **EXACT)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("offsets", [(0, 0, 0), (0, 2, 5)])
def test_token_by_token_writes_store_what_one_chunk_write_stores(static, offsets):
    """The eager decode write (every row's token in one slot: narrowed copies and one ``index_copy_``; rows at
    different positions: indexed assignments) leaves the slots and rings a single 40-token write leaves."""
    geometry = small_geometry()
    _, k, v, positions, valid = make_rows(pads=(0, 0, 0), offsets=offsets)
    stepwise, chunked = cache_layer(static, geometry), cache_layer(static, geometry)
    write(stepwise, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    for index in range(9, 40):
        write(stepwise, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
               valid[:, index:index + 1])
    write(chunked, k, v, positions, valid)
    used = 40 + max(offsets)
    for got, expected in ((stepwise.keys_storage(), chunked.keys_storage()),
                          (stepwise.values_storage(), chunked.values_storage())):
        torch.testing.assert_close(got[:, :, :used], expected[:, :, :used], atol=0, rtol=0)
    for got, expected in zip(stepwise.rings, chunked.rings):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert torch.equal(stepwise.last_positions, chunked.last_positions)
    assert torch.equal(stepwise.first_positions, chunked.first_positions)


def test_padding_is_not_stored_and_rows_are_position_aligned():
    geometry = small_geometry()
    _, k, v, positions, valid = make_rows(length=20)
    layer = MLRKeyCacheLayer(geometry)
    write(layer, k, v, positions, valid)
    assert layer.base == 0 and layer.first_positions.tolist() == [0, 0, 3]
    assert layer.last_positions.tolist() == [19, 14, 9]
    assert layer.keys.shape[-2] == 20  # slots in use: the longest row
    row = 1  # 5 padding tokens: its real token k (position k) sits in slot k
    torch.testing.assert_close(layer.keys[row, :, :15], k[row, :, 5:, :4], atol=0, rtol=0)
    assert layer.get_seq_length() == 20  # transformers' sequence length counts padding


def test_non_contiguous_positions_in_a_cache_are_refused():
    layer = MLRKeyCacheLayer(small_geometry())
    _, k, v, positions, valid = make_rows(length=12, pads=(0, 0, 0), offsets=(0, 0, 0))
    write(layer, k[:, :, :6], v[:, :, :6], positions[:, :6], valid[:, :6])
    with pytest.raises(ValueError, match="consecutive increasing positions"):
        write(layer, k[:, :, 6:8], v[:, :, 6:8], positions[:, 6:8] + 2, valid[:, 6:8])


@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup"])
def test_offset_and_per_row_positions_cached_equal_uncached(variant):
    model = tiny_lm(variant).double()
    ids = torch.randint(2, 61, (2, 24))
    positions = torch.arange(5, 29)[None]
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


def test_formula_bytes_and_layer_types():
    model = tiny_lm("mlr")
    geometry = model.config.mlr_geometry()
    ids = torch.randint(2, 61, (3, 40))
    for max_cache_len in (None, 20, 48):
        cache = model.transformer.new_cache(max_cache_len=max_cache_len)
        assert {type(layer) for layer in cache.layers} == {MLRKeyCacheLayer if max_cache_len is None
                                                           else MLRStaticKeyCacheLayer}
        length = 20 if max_cache_len == 20 else 40
        model(ids[:, :length], cache=cache, use_cache=True)
        held = length if max_cache_len is None else max_cache_len  # a static cache holds its whole allocation
        layer = cache.layers[0]
        assert layer.key_cache_elements() == geometry.key_cache_elements(held)
        itemsize = layer.keys.element_size()
        assert key_cache_bytes(cache) == model.config.n_layer * 3 * model.config.n_head * \
            geometry.key_cache_elements(held) * itemsize


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_float16_cached_decode_stays_finite_at_scores_past_the_half_range(cache_implementation):
    """q and k weights x300 put |q.k| far past float16's 65504: the uncached float16 forward (the fused op
    accumulates in float32) stays finite, and the cached reads took q.k in float16 and went NaN. Now the cached
    logits are finite and match the uncached float16 forward over the generated tokens (to float16's resolution of
    their magnitude)."""
    model = tiny_lm("mlr")
    width = model.config.n_embd
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, :2 * width] *= 300
            block.attn.c_attn.bias[:2 * width] *= 300
    model = model.half()
    prompt = torch.randint(2, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=14, min_new_tokens=14,
                         do_sample=False, pad_token_id=1, output_logits=True, return_dict_in_generate=True,
                         cache_implementation=cache_implementation)
    cached = torch.stack(out.logits, 1).float()
    assert torch.isfinite(cached).all()
    uncached = model(out.sequences).logits[:, prompt.shape[1] - 1:-1].float()
    assert torch.isfinite(uncached).all()
    scale = uncached.abs().max().item()
    torch.testing.assert_close(cached, uncached, rtol=0, atol=2e-2 * scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_half_precision_decode_is_finite_and_close_to_float32(dtype, compiled):
    """Masked fills and the softmax run in promote_types(dtype, float32): padded and unwritten slots never overflow;
    eagerly and in the formulation torch.compile traces (level-1 scores accumulated in float32 there too)."""
    geometry = small_geometry()
    q, k, v, positions, valid = make_rows(length=18, dtype=torch.float32)
    torch._dynamo.reset()  # the traced ``attend`` of other tests does not count against this one's recompile budget
    read = torch.compile(attend, backend="eager", fullgraph=True) if compiled else attend
    results = {}
    for run_dtype in (torch.float32, dtype):
        layer, outputs = MLRStaticKeyCacheLayer(24, geometry), []
        cast = (lambda t: t.to(run_dtype))
        write(layer, cast(k[:, :, :6]), cast(v[:, :, :6]), positions[:, :6], valid[:, :6], traced=compiled)
        for index in range(6, 18):
            view = write(layer, cast(k[:, :, index:index + 1]), cast(v[:, :, index:index + 1]),
                          positions[:, index:index + 1], valid[:, index:index + 1], traced=compiled)
            outputs.append(read(cast(q[:, :, :, index:index + 1]), view))
        results[run_dtype] = torch.stack(outputs)
    assert results[dtype].dtype == dtype and torch.isfinite(results[dtype]).all()
    eps = torch.finfo(dtype).eps
    scale = float(results[torch.float32].abs().max())
    torch.testing.assert_close(results[dtype].float(), results[torch.float32], atol=40 * eps * scale, rtol=40 * eps)


def test_compiled_decode_steps_do_not_recompile_per_step():
    """A compiled decode step must not specialise on the step: after the first steps further steps, crossing block
    boundaries, compile nothing."""
    model = tiny_lm("mlr")
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend=counting_backend, fullgraph=True)
    cache = model.transformer.new_cache(max_cache_len=40)
    prompt = torch.randint(2, 61, (2, 6))
    token = torch.randint(2, 61, (2, 1))
    settled = None
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        for step in range(20):  # positions 6 .. 25: across the 8- and 16-blocks of the tiny model
            if step == 4:
                settled = len(graphs)
            forward(token, cache=cache, use_cache=True, position_ids=torch.full((2, 1), 6 + step))
    assert settled > 0 and len(graphs) == settled


def test_compiled_decode_equals_eager():
    """``model.forward = torch.compile(model.forward)`` with the static cache (transformers' recipe) gives the eager
    tokens; the decode step traces the fixed-shape path (flat finer levels, indexed writes) with no graph break."""
    model = tiny_lm("mlr")
    prompt = torch.randint(2, 61, (2, 6))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    common = dict(max_new_tokens=16, min_new_tokens=16, pad_token_id=1, do_sample=False, attention_mask=mask,
                  cache_implementation="static")
    eager = model.generate(prompt, **common)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        torch.testing.assert_close(model.generate(prompt, **common), eager)
    finally:
        del model.forward


def test_inductor_compiled_static_decode_recompiles_for_a_new_batch_and_prompt_length():
    """A compiled forward (inductor, the default backend) generates with a static cache at one batch and prompt
    length, then at another in the same process: the second ``max_cache_len`` makes the cache's length a symbol, and
    the recompiled graph must still run and give the eager tokens (it raised ``NameError: name 's9' is not defined``
    when two layers' symbolic capacities were compared while planning)."""
    model = tiny_lm("mlr")
    shapes = [(1, 12), (4, 37)]
    prompts = [torch.randint(2, 61, shape, generator=torch.Generator().manual_seed(index))
               for index, shape in enumerate(shapes)]
    common = dict(max_new_tokens=6, min_new_tokens=6, pad_token_id=1, do_sample=False, cache_implementation="static")
    eager = [model.generate(prompt, **common) for prompt in prompts]
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward)
    try:
        for prompt, tokens in zip(prompts, eager):
            torch.testing.assert_close(model.generate(prompt, **common), tokens)
    finally:
        del model.forward
        torch._dynamo.reset()


def test_compiled_forward_over_the_dynamic_cache_falls_back_quietly_and_fullgraph_names_the_static_cache():
    """A dynamic MLR cache cannot be filled inside a compiled region: ``torch.compile(model.forward)`` over it gives
    the eager tokens (torch.compile runs that frame eagerly), and ``fullgraph=True`` stops with dynamo's report,
    which quotes our message naming the static cache."""
    model = tiny_lm("mlr")
    prompt = torch.randint(2, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    common = dict(max_new_tokens=5, pad_token_id=1, do_sample=False)
    eager = model.generate(prompt, **common)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        assert torch.equal(model.generate(prompt, **common), eager)
    finally:
        del model.forward
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    try:
        with pytest.raises(Exception, match="cache_implementation='static'"):
            model.generate(prompt, **common)
    finally:
        del model.forward
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_compiled_decode_equals_eager_for_t5_and_patched_decoders(family):
    """The same recipe, traced as one graph per step (``fullgraph=True``), for a T5 MLR decoder and a patched Llama
    (grouped-query attention): the compiled tokens and scores are the eager ones, with a left-padded row."""
    torch.manual_seed(0)
    if family == "t5":
        model = transformers.AutoModelForSeq2SeqLM.from_config(hf_structattn.StructAttnT5Config(
            vocab_size=61, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_attention="mlr",
            mlr_ranks=[4, 2, 2], mlr_block_sizes=[8, 4], decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1)).eval()
    else:
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=1))
        model = hf_structattn.patch(llama.eval(), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4]).eval()
    prompt = torch.randint(2, 61, (2, 7))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    common = dict(max_new_tokens=14, min_new_tokens=14, do_sample=False, attention_mask=mask,
                  cache_implementation="static", return_dict_in_generate=True, output_scores=True)
    eager = model.generate(prompt, **common)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    try:
        compiled = model.generate(prompt, **common)
    finally:
        del model.forward
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.scores), torch.stack(eager.scores), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mlr", "mlr_avg_mup"])
def test_inductor_generate_equals_eager(variant):
    """The same with inductor (minutes on CPU), at two batch sizes through one compiled forward."""
    model = tiny_lm(variant)
    common = dict(max_new_tokens=6, min_new_tokens=6, pad_token_id=1, do_sample=False, cache_implementation="static")
    prompts = [torch.randint(2, 61, (batch, 20)) for batch in (1, 3)]
    eager = [model.generate(prompt, **common) for prompt in prompts]
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward)
    try:
        for prompt, tokens in zip(prompts, eager):
            torch.testing.assert_close(model.generate(prompt, **common), tokens)
    finally:
        del model.forward
