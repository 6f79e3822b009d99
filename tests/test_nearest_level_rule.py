"""The nearest-keys level rule (``mlr_level_rule="nearest"``: level l for keys fewer than b_l positions away): the
rule by hand, its op against the naive reference (outputs and gradients, odd shapes, float64 and float32), and
patched decoders that use it: cached == uncached across block boundaries, left padding, greedy, sampling, beam,
static caches, speculative rollback, the cache's bytes, save and reload."""

import pytest
import torch
import transformers
from transformers import DynamicCache

import hf_structattn
from hf_structattn.decoder_patching import tiny_decoder
from hf_structattn.flops import decoder_cache_report
from hf_structattn.modeling.structattn_mlr import mlr_attention
from hf_structattn.modeling.structattn_mlr_levels import pair_depth
from hf_structattn.modeling.structattn_mlr_nearest import mlr_nearest_attention
from hf_structattn.modeling.structattn_prepare import key_cache_bytes
from hf_structattn.modeling.structattn_mlr_plan import GeneralRead, InStepRead
from hf_structattn.modeling.structattn_reference import mlr_attention_reference

from cache_helpers import EXACT, attend, cache_layer, make_rows, reference_rows, small_geometry, write
from model_helpers import left_padded

VOCAB = 61
RANKS = [8, 4, 4]
BLOCKS = [16, 8]
ARCH_PATCH_KWARGS = {"gemma3": dict(layers=[2])}  # its first two layers slide


def nearest(arch, **kwargs):
    model = tiny_decoder(arch)
    return model, hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, mlr_level_rule="nearest",
                                      **{**ARCH_PATCH_KWARGS.get(arch, {}), **kwargs})


def test_the_rule_by_hand():
    positions = torch.arange(6)[None]
    # sizes 4 and 2: query 5 shares level 2 with keys 2..5 (distance < 4) and level 3 with keys 4, 5 (distance < 2);
    # under the paper's blocks it shares level 2 with 4, 5 only (block [4, 8)) and level 3 with 4, 5 (block [4, 6))
    assert pair_depth(positions, positions, [4, 2], "nearest")[0, 5].tolist() == [1, 1, 2, 2, 3, 3]
    assert pair_depth(positions, positions, [4, 2], "blocks")[0, 5].tolist() == [1, 1, 1, 1, 3, 3]
    # query 4 at a block start: the nearest rule keeps its neighbours 3 (and 2) at its finer levels, blocks do not
    assert pair_depth(positions, positions, [4, 2], "nearest")[0, 4].tolist() == [1, 2, 2, 3, 3, 3]
    assert pair_depth(positions, positions, [4, 2], "blocks")[0, 4].tolist() == [1, 1, 1, 1, 3, 3]


def _inputs(dtype, batch=2, heads=3, length=41, width=8, value_width=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, size, dtype=dtype, generator=generator, requires_grad=True)
            for size in (width, width, value_width)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("rows", ["plain", "offset_and_padded", "packed"])
def test_op_equals_the_reference_outputs_and_gradients(dtype, tolerance, causal, average_levels, rows):
    q, k, v = _inputs(dtype)
    batch, heads, length = q.shape[:3]
    positions = mask = None
    if rows == "offset_and_padded":  # row 1 starts at position 13 after 4 padding tokens (parked at position 1)
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[1, :4] = False
        positions = torch.stack([torch.arange(length), (torch.arange(length) + 9).masked_fill(~mask[1], 1)])
    elif rows == "packed":  # two documents in row 0: positions restart (the op's non-contiguous case)
        positions = torch.cat([torch.arange(20), torch.arange(length - 20)])[None].expand(batch, length)
    bias = torch.randn(1, heads, length, length, dtype=dtype, generator=torch.Generator().manual_seed(1))
    kwargs = dict(ranks=[4, 2, 2], block_sizes=[8, 4], causal=causal, positions=positions, attention_mask=mask,
                  average_levels=average_levels, bias=bias, level_rule="nearest")
    reference = mlr_attention_reference(q, k, v, **kwargs)
    real = torch.ones(batch, 1, length, 1, dtype=torch.bool) if mask is None else mask[:, None, :, None]
    scale = float(reference.detach().abs().max())
    outputs = [mlr_attention(q, k, v, **kwargs)]
    if positions is None:  # and in query chunks smaller than the sequence (the band of each finer level)
        outputs.append(mlr_nearest_attention(q, k, v, ranks=[4, 2, 2], block_sizes=[8, 4], level_scales=[8 ** -0.5] * 3,
                                             causal=causal, positions=None, valid=None, bias=bias,
                                             average_levels=average_levels, contiguous=True, query_chunk=6))
    with torch.no_grad():  # inference on contiguous causal rows without a bias: the flash path for far keys
        for chunk in (6, 256):
            fast = mlr_nearest_attention(q, k, v, ranks=[4, 2, 2], block_sizes=[8, 4], level_scales=[8 ** -0.5] * 3,
                                         causal=causal, positions=positions, valid=mask, bias=None,
                                         average_levels=average_levels, contiguous=rows != "packed",
                                         query_chunk=chunk)
            unbiased = mlr_attention_reference(q, k, v, **{**kwargs, "bias": None})
            torch.testing.assert_close(fast * real, unbiased * real, rtol=0,
                                       atol=tolerance * float(unbiased.abs().max()))
    expected = torch.autograd.grad((reference * real).square().sum(), (q, k, v))
    for out in outputs:
        torch.testing.assert_close(out * real, reference * real, rtol=0, atol=tolerance * scale)
        grads = torch.autograd.grad((out * real).square().sum(), (q, k, v))
        for grad, want in zip(grads, expected):
            torch.testing.assert_close(grad, want, rtol=0, atol=tolerance * float(want.abs().max()))


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9, 12, 13])
def test_inference_path_at_lengths_around_the_sizes(length):
    """Prompts shorter than, equal to and just past each size (4, 8): bands with no query, one query, one chunk."""
    q, k, v = _inputs(torch.float64, length=length)
    with torch.no_grad():
        out = mlr_attention(q, k, v, ranks=[4, 2, 2], block_sizes=[8, 4], level_rule="nearest")
        reference = mlr_attention_reference(q, k, v, ranks=[4, 2, 2], block_sizes=[8, 4], level_rule="nearest")
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12 * float(reference.abs().max()))


def test_the_rule_is_not_the_blocks_and_a_bad_rule_names_the_field():
    q, k, v = _inputs(torch.float64)
    kwargs = dict(ranks=[4, 2, 2], block_sizes=[8, 4])
    assert (mlr_attention(q, k, v, level_rule="nearest", **kwargs) - mlr_attention(q, k, v, **kwargs)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="level_rule='near'"):
        mlr_attention(q, k, v, level_rule="near", **kwargs)
    with pytest.raises(ValueError, match="mlr_level_rule='windows'"):
        hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, mlr_level_rule="windows")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("average_levels", [False, True])
@pytest.mark.parametrize("rows, read", [(((0, 0, 0), (0, 0, 0)), InStepRead), (((0, 2, 4), None), InStepRead),
                                        (((0, 5, 13), (0, 0, 3)), GeneralRead)])
def test_cache_layer_decode_steps_and_chunks_equal_the_reference(static, average_levels, rows, read):
    """A cache layer of the nearest-keys rule (blocks 16, 8, 4): one token at a time across every ring wrap, rows in
    step (the in-step read: each ring's entries in one or two runs), left padded, and at different positions (the
    general read); then chunks longer than the finest level (the general read with the entries a write replaced)."""
    geometry = small_geometry(average_levels, level_rule="nearest")
    q, k, v, positions, valid = make_rows(pads=rows[0], offsets=rows[1] or (0, 0, 0))
    if rows[1] is None:  # padding first, then real tokens at the same positions in every row
        positions = torch.arange(40).expand(3, 40)
    layer = cache_layer(static, geometry)
    write(layer, k[:, :, :9], v[:, :, :9], positions[:, :9], valid[:, :9])
    for index in range(9, 30):
        view = write(layer, k[:, :, index:index + 1], v[:, :, index:index + 1], positions[:, index:index + 1],
                     valid[:, index:index + 1])
        assert type(view.plan.read) is read
        got = attend(q[:, :, :, index:index + 1], view)[:, :, :, 0]
        real = valid[:, index][:, None, None, None]
        expected = reference_rows(q, k, v, positions, valid, geometry, index)
        torch.testing.assert_close(got * real, expected * real, **EXACT, msg=f"step {index}")
    start = 30
    for size in (7, 3):
        view = write(layer, k[:, :, start:start + size], v[:, :, start:start + size],
                     positions[:, start:start + size], valid[:, start:start + size])
        assert type(view.plan.read) is GeneralRead
        got = attend(q[:, :, :, start:start + size], view)
        for index in range(start, start + size):
            real = valid[:, index][:, None, None, None]
            expected = reference_rows(q, k, v, positions, valid, geometry, index)
            torch.testing.assert_close(got[:, :, :, index - start] * real, expected * real, **EXACT)
        start += size


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "gemma3"])
def test_chunked_prefill_and_decode_equal_uncached(arch):
    model, mlr = nearest(arch)
    assert mlr.config.mlr_level_rule == "nearest"
    ids = torch.randint(1, VOCAB, (3, 37))
    uncached = mlr(ids).logits
    blocks = hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, **ARCH_PATCH_KWARGS.get(arch, {}))
    assert (blocks(ids).logits - uncached).abs().max() > 1e-3  # another rule, other logits
    for cache in (mlr.new_cache(), DynamicCache(config=mlr.config)):
        # chunks longer than the finest level and across every block boundary, then one token at a time
        bounds = [(0, 13), (13, 30), (30, 31)] + [(i, i + 1) for i in range(31, 37)]
        chunked = torch.cat([mlr(ids[:, a:b], cache=cache, use_cache=True).logits for a, b in bounds], dim=1)
        torch.testing.assert_close(chunked, uncached, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_left_padded_rows_and_greedy_generation_equal_rows_alone_and_uncached(arch):
    _, mlr = nearest(arch)
    ids = torch.randint(3, VOCAB, (3, 20))
    pads = [0, 3, 7]
    batch, mask, positions = left_padded(ids, pads, 20)
    logits = mlr(batch, attention_mask=mask, position_ids=positions).logits
    for row, pad in enumerate(pads):
        torch.testing.assert_close(logits[row, pad:], mlr(ids[row:row + 1, :20 - pad]).logits[0], rtol=0, atol=1e-12)
    kwargs = dict(attention_mask=mask, max_new_tokens=14, min_new_tokens=14, do_sample=False)
    cached = mlr.generate(batch, **kwargs)  # 34 positions: past both block sizes
    assert torch.equal(cached, mlr.generate(batch, use_cache=False, **kwargs))
    assert torch.equal(cached, mlr.generate(batch, cache_implementation="static", **kwargs))
    for row, pad in enumerate(pads):
        alone = mlr.generate(ids[row:row + 1, :20 - pad], max_new_tokens=14, min_new_tokens=14, do_sample=False)
        assert torch.equal(alone[0], cached[row, pad:])


def test_sampling_and_beam_search_cached_equal_uncached():
    _, mlr = nearest("llama")
    ids = torch.randint(3, VOCAB, (2, 20))
    for kwargs in (dict(do_sample=True, top_k=0, num_return_sequences=2), dict(num_beams=3, do_sample=False)):
        results = []
        for cache_kwargs in ({}, dict(use_cache=False)):
            torch.manual_seed(7)
            results.append(mlr.generate(ids, max_new_tokens=12, min_new_tokens=12, **cache_kwargs, **kwargs))
        assert torch.equal(results[0], results[1]), kwargs


def test_assisted_decoding_rolls_the_rings_back_exactly():
    _, mlr = nearest("llama")
    _, assistant = nearest("llama")
    with torch.no_grad():
        for param in assistant.parameters():
            param.add_(torch.randn_like(param) * 0.5)  # some drafts are rejected
    for model in (mlr, assistant):
        model.generation_config.num_assistant_tokens = 3
        model.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.randint(3, VOCAB, (1, 24))
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    greedy = mlr.generate(ids, **kwargs)
    for extra in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(mlr.generate(ids, **kwargs, **extra), greedy), extra.keys()


def test_the_cache_holds_the_bytes_of_the_blocks_and_the_rule_survives_a_reload(tmp_path):
    _, mlr = nearest("llama")
    ids = torch.randint(3, VOCAB, (2, 30))
    out = mlr.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    expected = decoder_cache_report(mlr.config, 38, dtype_bytes=torch.float64)["key_cache_bytes"]
    assert key_cache_bytes(out.cache) == 2 * expected  # batch 2: the same formula as the blocks' cache
    mlr.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True,
                                                                 dtype=torch.float64)
    assert reloaded.config.mlr_level_rule == "nearest"
    torch.testing.assert_close(reloaded(ids).logits, mlr(ids).logits, rtol=0, atol=1e-12)


def test_the_cli_patches_a_checkpoint_with_the_rule(tmp_path, capsys):
    from hf_structattn_cli import main as cli

    source = tmp_path / "src"
    tiny_decoder("llama").save_pretrained(source)
    common = ["--mlr-ranks", "8,4,4", "--mlr-block-sizes", "16,8"]
    assert cli(["patch", str(source), str(tmp_path / "out"), *common, "--level-rule", "nearest"]) == 0
    assert "level_rule=nearest" in capsys.readouterr().out
    saved = transformers.AutoConfig.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert saved.mlr_level_rule == "nearest"
    assert cli(["patch", str(source), str(tmp_path / "bad"), *common, "--level-rule", "window"]) != 0
    assert "mlr_level_rule='window'" in capsys.readouterr().err


def test_compiled_static_decode_equals_eager():
    """``torch.compile(model.forward, fullgraph=True)`` with the static cache: a traced prefill (the materialised
    path) and traced decode steps (the general read) give the eager tokens and scores, with a left-padded row."""
    _, mlr = nearest("llama")
    prompt = torch.randint(2, VOCAB, (2, 7))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    common = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, attention_mask=mask,
                  cache_implementation="static", return_dict_in_generate=True, output_scores=True)
    eager = mlr.generate(prompt, **common)  # 27 positions: past both sizes
    torch._dynamo.reset()
    mlr.forward = torch.compile(mlr.forward, backend="eager", fullgraph=True)
    try:
        compiled = mlr.generate(prompt, **common)
    finally:
        del mlr.forward
        torch._dynamo.reset()
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.scores), torch.stack(eager.scores), rtol=1e-10, atol=1e-10)
