"""``level_order``: which head dims (whole RoPE rotation pairs) form which MLR level, on tiny random decoders (Llama,
Phi-3 and GPT-NeoX with partial RoPE, GPT-2 without RoPE): where the dims land, whole pairs, relative-position-only
levels, the measured contribution rule, refusals, the CLI, and the saved config through a remote-code reload."""

import copy
import inspect
import json
import re

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn.decoder_patching import DEFAULT_LEVEL_ORDER, LEVEL_ORDERS, find_rotary, patch_decoder, tiny_decoder
from hf_structattn.modeling.structattn_decoder_spec import rotary_dims, rotary_pair_order
from hf_structattn.qk_contribution import measure_qk_contributions

VOCAB = 61
HEAD_DIM = 16
RANKS = [8, 4, 4]
BLOCKS = [16, 8]


def calibration(rows: int = 2, length: int = 24, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def patch(model, level_order=DEFAULT_LEVEL_ORDER, ranks=RANKS, **kwargs):
    if level_order == "contribution":
        kwargs.setdefault("calibration_ids", calibration())
    blocks = [32 >> level for level in range(1, len(ranks))]  # BLOCKS for three levels
    return hf_structattn.patch(model, mlr_ranks=ranks, mlr_block_sizes=blocks, level_order=level_order, **kwargs)


def levels(order, ranks):
    """The dims of each level: consecutive slices of ``order``."""
    bounds = [sum(ranks[:i]) for i in range(len(ranks) + 1)]
    return [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]


def inv_freq_of(model) -> torch.Tensor:
    rotary, _ = find_rotary(model)
    return rotary.inv_freq.double()


def test_the_default_is_frequency_everywhere():
    """patch, the decoder patcher and the recipe share one default (the CLI passes none: patch's applies)."""
    from hf_structattn.training.decoder_ft import PatchedFinetuneArgs

    assert DEFAULT_LEVEL_ORDER == "frequency" and LEVEL_ORDERS == ("frequency", "index", "contribution")
    assert inspect.signature(patch_decoder).parameters["level_order"].default == DEFAULT_LEVEL_ORDER
    assert PatchedFinetuneArgs.__dataclass_fields__["level_order"].default == DEFAULT_LEVEL_ORDER
    mlr = hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=RANKS, mlr_block_sizes=BLOCKS)
    assert mlr.config.mlr_patch["level_order"] == "frequency"


def test_frequency_order_puts_the_slowest_pairs_in_the_global_level():
    model = tiny_decoder("llama")  # half-split RoPE: dim i rotates with i + 8 at frequency theta^(-2i/16)
    mlr = patch(model, "frequency")
    order = mlr.config.mlr_dim_order
    pairs = [tuple(order[i:i + 2]) for i in range(0, HEAD_DIM, 2)]
    assert pairs == [(i, i + 8) for i in reversed(range(8))]
    dims = rotary_dims(*find_rotary(model), HEAD_DIM)
    # the measured frequencies are the model's own inv_freq
    torch.testing.assert_close(torch.tensor(dims.frequencies, dtype=torch.float64), inv_freq_of(model),
                               rtol=1e-6, atol=0)
    assert levels(order, RANKS)[0] == [7, 15, 6, 14, 5, 13, 4, 12]  # the 4 slowest pairs are global


def test_index_order_is_the_order_before_the_keyword():
    model = tiny_decoder("llama")
    mlr = patch(model, "index")
    assert mlr.config.mlr_dim_order == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    assert mlr.config.mlr_dim_order == rotary_pair_order(*find_rotary(model), HEAD_DIM)[0]


@pytest.mark.parametrize("arch, rotated_pairs, unrotated", [
    ("phi3", [(0, 4), (1, 5), (2, 6), (3, 7)], list(range(8, 16))),  # partial_rotary_factor 0.5
    ("neox", [(0, 2), (1, 3)], list(range(4, 16))),  # rotary_pct 0.25
])
def test_partial_rope_puts_the_unrotated_dims_first_then_pairs_by_frequency(arch, rotated_pairs, unrotated):
    """The rule for partial RoPE: unrotated dims are position-free (frequency 0), so "frequency" and "contribution"
    put them first, then the pairs; "index" keeps the pairs first, as before the keyword."""
    model = tiny_decoder(arch)
    frequency = patch(model, "frequency").config.mlr_dim_order
    assert frequency == unrotated + [dim for pair in reversed(rotated_pairs) for dim in pair]
    index = patch(model, "index").config.mlr_dim_order
    assert index == [dim for pair in rotated_pairs for dim in pair] + unrotated
    contribution = patch(model, "contribution").config.mlr_dim_order
    assert sorted(contribution[:len(unrotated)]) == unrotated  # ranked among themselves
    assert {tuple(sorted(contribution[i:i + 2])) for i in range(len(unrotated), HEAD_DIM, 2)} == set(rotated_pairs)


@pytest.mark.parametrize("arch", ["llama", "phi3", "neox", "qwen3", "gemma3"])
@pytest.mark.parametrize("level_order", LEVEL_ORDERS)
def test_every_level_holds_whole_pairs_and_depends_only_on_relative_position(arch, level_order):
    model = tiny_decoder(arch)
    kwargs = {"layers": [2]} if arch == "gemma3" else {}
    ranks = [4, 2, 2, 8] if level_order == "index" or arch == "llama" else [8, 4, 4]
    order = patch(model, level_order, ranks=ranks, **kwargs).config.mlr_dim_order
    assert sorted(order) == list(range(HEAD_DIM))
    layer_types = ("full_attention",) if arch == "gemma3" else (None,)
    rotary, apply_rotary = find_rotary(model)
    dims = rotary_dims(rotary, apply_rotary, HEAD_DIM, layer_types)
    level_of = {dim: level for level, members in enumerate(levels(order, ranks)) for dim in members}
    assert all(level_of[a] == level_of[b] for a, b in dims.pairs)
    torch.manual_seed(1)
    q, k = torch.randn(2, 1, 1, 1, HEAD_DIM, dtype=torch.float64).unbind(0)  # (B, H, T, d) each
    extra = {"layer_type": "full_attention"} if arch == "gemma3" else {}

    def level_scores(query_pos, key_pos):
        rotated_q = apply_rotary(q, q, *rotary(q, torch.tensor([[query_pos]]), **extra))[0].flatten()
        rotated_k = apply_rotary(k, k, *rotary(k, torch.tensor([[key_pos]]), **extra))[0].flatten()
        return torch.stack([(rotated_q[members] * rotated_k[members]).sum() for members in levels(order, ranks)])

    reference = level_scores(9, 4)
    for shift in (1, 7, 100, 1000):  # RoPE angles are computed in float32 by transformers: ~1e-6 at 1000
        torch.testing.assert_close(level_scores(9 + shift, 4 + shift), reference, rtol=0, atol=1e-5)


def test_pair_splitting_ranks_depend_on_the_order_and_are_refused():
    phi3 = tiny_decoder("phi3")  # 8 unrotated dims and 4 pairs
    # "index": pairs first, so a boundary at 3 splits a pair and one at 9 lies in the unrotated dims
    with pytest.raises(ValueError, match=r"mlr_ranks=\[3, 13\] splits a RoPE rotation pair.*level_order='index'"):
        patch(phi3, "index", ranks=[3, 13])
    patch(phi3, "index", ranks=[9, 7])
    # "frequency": unrotated dims first, so it is the other way round
    with pytest.raises(ValueError, match=r"mlr_ranks=\[9, 7\] splits a RoPE rotation pair.*unrotated dims first"):
        patch(phi3, "frequency", ranks=[9, 7])
    patch(phi3, "frequency", ranks=[3, 13])
    with pytest.raises(ValueError, match="splits a RoPE rotation pair"):  # checked before the calibration runs
        patch(phi3, "contribution", ranks=[9, 7])


def test_contribution_ranks_pairs_by_their_measured_q_and_k_norms():
    """Pair (3, 11) made dominant in every head and layer goes to the global level first; the measurement equals
    an independent one from the q/k projections' outputs (Llama: no q/k norm, and RoPE keeps a pair's norm)."""
    model = tiny_decoder("llama")  # 4 query heads, 2 KV heads
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                weight = projection.weight.view(-1, HEAD_DIM, projection.weight.shape[-1])
                weight[:, [3, 11]] *= 6.0
    ids = calibration()
    order = patch(model, "contribution", calibration_ids=ids).config.mlr_dim_order
    assert order[:2] == [3, 11]

    dims = rotary_dims(*find_rotary(model), HEAD_DIM)
    measured = measure_qk_contributions(model, ids, dims.groups(), HEAD_DIM, [0, 1])
    captured = {}

    def keep(name):
        return lambda module, inputs, output: captured.setdefault(name, []).append(output)

    hooks = [projection.register_forward_hook(keep((kind, n))) for n, layer in enumerate(model.model.layers)
             for kind, projection in (("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj))]
    with torch.no_grad():
        for window in ids:
            model(window[None], use_cache=False)
    for hook in hooks:
        hook.remove()
    expected = {}
    for group in dims.groups():
        total = 0.0
        for layer in range(2):
            q = torch.cat(captured[("q", layer)], dim=1).view(-1, 4, HEAD_DIM)[..., list(group)].norm(dim=-1).mean(0)
            k = torch.cat(captured[("k", layer)], dim=1).view(-1, 2, HEAD_DIM)[..., list(group)].norm(dim=-1).mean(0)
            total += float((q * k.repeat_interleave(2)).sum())
        expected[group] = total
    assert measured.keys() == expected.keys()
    for group in expected:  # (transformers computes cos / sin in float32: a rotation keeps norms to ~1e-7)
        assert measured[group] == pytest.approx(expected[group], rel=1e-6)
    pairs_by_contribution = sorted(expected, key=lambda group: -expected[group])
    assert order == [dim for pair in pairs_by_contribution for dim in pair]


def test_contribution_leaves_the_source_model_as_it_was():
    model = tiny_decoder("llama")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    configs = [id(module.config) for module in model.modules() if hasattr(module, "layer_idx")]
    ids = torch.randint(1, VOCAB, (2, 20))
    logits = model(ids).logits
    patch(model, "contribution")
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert [id(module.config) for module in model.modules() if hasattr(module, "layer_idx")] == configs
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=0)


def test_gpt2_without_rope_frequency_and_index_keep_the_dims_contribution_ranks_them():
    """Without RoPE every dim is position-free: "frequency" and "index" keep the dims in order (no permutation),
    "contribution" ranks single dims by their measured q/k norms."""
    model = tiny_decoder("gpt2")
    ids = torch.randint(1, VOCAB, (2, 20))
    frequency, index = patch(model, "frequency"), patch(model, "index")
    assert frequency.config.mlr_dim_order is None and index.config.mlr_dim_order is None
    torch.testing.assert_close(frequency(ids).logits, index(ids).logits, rtol=0, atol=0)
    contribution = patch(model, "contribution", calibration_ids=calibration())
    scores = measure_qk_contributions(model, calibration(), [(dim,) for dim in range(HEAD_DIM)], HEAD_DIM, [0, 1])
    assert contribution.config.mlr_dim_order == [dim for (dim,) in sorted(scores, key=lambda g: -scores[g])]
    assert contribution.config.mlr_patch["calibration_tokens"] == 48


@pytest.mark.parametrize("bad, message", [
    ("frequncy", "level_order='frequncy' is not one of 'frequency', 'index', 'contribution' (did you mean "
                 "'frequency'?)"),
    ("Index", "level_order='Index' is not one of 'frequency', 'index', 'contribution' (did you mean 'index'?)"),
    ("svd", "level_order='svd' is not one of 'frequency', 'index', 'contribution'"),
    (None, "level_order=None is not one of"),
    (2, "level_order=2 is not one of"),
])
def test_bad_level_orders_are_refused_with_one_line(bad, message):
    with pytest.raises(ValueError) as error:
        patch(tiny_decoder("llama"), bad)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_calibration_ids_are_required_checked_and_never_ignored():
    model = tiny_decoder("llama")
    with pytest.raises(ValueError, match="level_order='contribution' ranks the RoPE pairs.*pass calibration_ids"):
        hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, level_order="contribution")
    with pytest.raises(ValueError, match="calibration_ids is used by level_order='contribution' only; "
                                         "level_order='frequency' would ignore it"):
        hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, calibration_ids=calibration())
    for bad, message in ((torch.rand(2, 8), "calibration_ids must be an integer tensor"),
                         ([1, 2, 3], "calibration_ids must be an integer tensor of token ids.*got list"),
                         (torch.zeros(1, 0, dtype=torch.long), "holds no token"),
                         (torch.full((1, 4), VOCAB), r"outside the model's vocabulary \[0, 61\)")):
        with pytest.raises(ValueError, match=message):
            patch(model, "contribution", calibration_ids=bad)
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(model.config)
    with pytest.raises(ValueError, match="needs the model's weights; this model is on the meta device"):
        patch(empty, "contribution")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0))
    with pytest.raises(ValueError, match="unknown keyword 'level_order' for T5 / Chronos models"):
        hf_structattn.patch(t5, mlr_ranks=[4, 4], mlr_block_sizes=[8], level_order="frequency")


def test_a_stock_checkpoint_run_with_attn_implementation_mlr_follows_mlr_level_order(tmp_path):
    model = tiny_decoder("llama")
    model.save_pretrained(tmp_path)
    ids = torch.randint(1, VOCAB, (2, 37))
    for level_order in (None, "index", "frequency"):
        config = transformers.AutoConfig.from_pretrained(tmp_path)
        config.mlr_ranks, config.mlr_block_sizes = RANKS, BLOCKS
        if level_order is not None:
            config.mlr_level_order = level_order
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, config=config, dtype=torch.float64,
                                                                   attn_implementation="mlr")
        expected = patch(model, level_order or DEFAULT_LEVEL_ORDER)
        torch.testing.assert_close(loaded(ids).logits, expected(ids).logits, rtol=0, atol=1e-12)
        assert loaded.config.mlr_dim_order == expected.config.mlr_dim_order
    for level_order, message in (("contribution", "needs calibration text"), ("frequncy", "did you mean")):
        config = transformers.AutoConfig.from_pretrained(tmp_path)
        config.mlr_ranks, config.mlr_block_sizes, config.mlr_level_order = RANKS, BLOCKS, level_order
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, config=config, dtype=torch.float64,
                                                                   attn_implementation="mlr")
        with pytest.raises(ValueError, match=message):
            loaded(ids)


def test_the_order_is_saved_and_survives_a_remote_code_reload(tmp_path):
    from model_helpers import run_isolated

    checks = []
    for arch, level_order in (("llama", "frequency"), ("neox", "contribution"), ("llama", "index")):
        mlr = patch(tiny_decoder(arch), level_order)
        folder = tmp_path / f"{arch}_{level_order}"
        mlr.save_pretrained(folder)
        ids = torch.randint(3, VOCAB, (2, 37))
        torch.save({"ids": ids, "logits": mlr(ids).logits.detach()}, folder / "expected.pt")
        saved = json.loads((folder / "config.json").read_text())
        assert saved["mlr_dim_order"] == mlr.config.mlr_dim_order and saved["mlr_patch"]["level_order"] == level_order
        checks.append((str(folder), mlr.config.mlr_dim_order, level_order))
    out = run_isolated(f"""
        import torch, transformers
        for path, order, level_order in {checks!r}:
            expected = torch.load(path + "/expected.pt")
            model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True,
                                                                      dtype=torch.float64)
            assert type(model).__module__.startswith("transformers_modules")
            assert model.config.mlr_dim_order == order and model.config.mlr_patch["level_order"] == level_order
            print(path, "max_diff", float((model(expected["ids"]).logits - expected["logits"]).abs().max()))
    """, tmp_path)
    diffs = [float(value) for value in re.findall(r"max_diff (\S+)", out)]
    assert len(diffs) == 3 and max(diffs) <= 1e-12, out


def test_cli_takes_the_level_order_and_calibration_text(tmp_path, capsys):
    from hf_structattn_cli import main as cli
    from hf_structattn.tokenization import build_byte_tokenizer

    model = tiny_decoder("llama", vocab_size=257)
    source = tmp_path / "src"
    model.save_pretrained(source)
    build_byte_tokenizer().save_pretrained(source)
    common = ["--mlr-ranks", "8,4,4", "--mlr-block-sizes", "16,8"]
    assert cli(["patch", str(source), str(tmp_path / "index"), *common, "--level-order", "index"]) == 0
    assert "level_order=index" in capsys.readouterr().out
    assert json.loads((tmp_path / "index" / "config.json").read_text())["mlr_patch"]["level_order"] == "index"
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert cli(["patch", str(source), str(tmp_path / "contribution"), *common, "--level-order", "contribution",
                "--calibration-text", str(text), "--calibration-tokens", "600"]) == 0
    saved = json.loads((tmp_path / "contribution" / "config.json").read_text())
    # the byte tokenizer: one token per byte; windows of the model's 256 positions, whole windows only
    ids = torch.tensor(list(text.read_bytes()[:512])).view(2, 256)
    expected = hf_structattn.patch(model, mlr_ranks=RANKS, mlr_block_sizes=BLOCKS, level_order="contribution",
                                   calibration_ids=ids)
    assert saved["mlr_dim_order"] == expected.config.mlr_dim_order and saved["mlr_patch"]["calibration_tokens"] == 512
    capsys.readouterr()
    refusals = [
        (["--level-order", "frequncy"], "level_order='frequncy' is not one of 'frequency', 'index', 'contribution' "
                                        "(did you mean 'frequency'?)"),
        (["--level-order", "contribution"], "--level-order contribution ranks the RoPE pairs by their q/k norms on "
                                            "calibration text: give --calibration-text FILE"),
        (["--calibration-text", str(text)], "--calibration-text is used by --level-order contribution only"),
        (["--level-order", "contribution", "--calibration-text", str(tmp_path / "none.txt")],
         "--calibration-text " + str(tmp_path / "none.txt")),
    ]
    for extra, message in refusals:
        assert cli(["patch", str(source), str(tmp_path / "refused"), *common, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "refused").exists()
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0))
    t5.save_pretrained(tmp_path / "t5")
    assert cli(["patch", str(tmp_path / "t5"), str(tmp_path / "t5_out"), "--mlr-ranks", "4,4", "--mlr-block-sizes",
                "8", "--level-order", "index"]) == 2
    assert "--level-order applies to transformers decoders only" in capsys.readouterr().err


def test_a_loaded_or_hand_edited_config_is_checked_by_the_rule_patch_checks_by(tmp_path):
    """A patched checkpoint whose ``mlr_dim_order`` splits RoPE pairs loaded silently (patch refuses such orders);
    ``mlr_dim_order: "abc"`` gave ``invalid literal for int()``; ranks summing to 14 were blamed on mlr_dim_order.
    The fields are checked in order -- ranks, the order's type, whole pairs -- each error naming its field, whether
    the config comes from ``from_pretrained`` or is built by hand."""
    mlr = patch(tiny_decoder("llama"))
    mlr.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    model_class = type(mlr)
    cases = [
        ({"mlr_dim_order": list(range(HEAD_DIM))},
         "mlr_dim_order=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] splits the RoPE rotation pair (0, 8) "
         "between levels 1 and 2 of mlr_ranks=[8, 4, 4]"),
        ({"mlr_dim_order": "abc"}, "mlr_dim_order='abc' is not a permutation of the 16 head dims"),
        ({"mlr_dim_order": [0.5] * HEAD_DIM}, "mlr_dim_order=[0.5, 0.5,"),
        ({"mlr_ranks": [8, 4, 2]}, "mlr_ranks=[8, 4, 2] sums to 14, but the head dim is 16"),
        ({"mlr_ranks": [8, 4, 2], "mlr_dim_order": "abc"}, "mlr_ranks=[8, 4, 2] sums to 14, but the head dim is 16"),
    ]
    for edit, message in cases:
        (tmp_path / "config.json").write_text(json.dumps({**saved, **edit}))
        with pytest.raises(ValueError) as error:
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        assert str(error.value).startswith(message) and "\n" not in str(error.value), (edit, str(error.value))
        config = copy.deepcopy(mlr.config)
        for name, value in edit.items():
            setattr(config, name, value)
        with pytest.raises(ValueError) as error:
            model_class(config)
        assert str(error.value).startswith(message), (edit, str(error.value))
