"""hf_structattn.patch on T5, Chronos-T5 and Chronos-Bolt (tiny models built locally), remote reload (also through
Chronos' own entry points), block sizes in time steps, the SVD level alignment, and the ``hf-structattn patch``
CLI's basic runs (atomicity and error handling: test_cli.py)."""

import contextlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn.modeling.structattn_attention import mlr_geometry_of
from hf_structattn_cli import main
from hf_structattn.decoder_patching import tiny_decoder
from hf_structattn.patching import svd_align_qk

from model_helpers import (PATCH_MLR, chronos_contexts, run_isolated, tiny_bolt, tiny_chronos_t5, tiny_stock_t5,
                           train_copy_task)

chronos = pytest.importorskip("chronos")
from chronos import BaseChronosPipeline, ChronosPipeline  # noqa: E402
from chronos.chronos import left_pad_and_stack_1D  # noqa: E402
from chronos.chronos_bolt import ChronosBoltModelForForecasting, ChronosBoltPipeline  # noqa: E402

ONE_LEVEL = dict(mlr_ranks=[8], mlr_block_sizes=[])
LONG_BLOCKS = dict(mlr_ranks=[4, 2, 2], mlr_block_sizes=[256, 128])  # longer than every test sequence


def t5_inputs():
    torch.manual_seed(2)
    ids = torch.randint(2, 64, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(2, 64, (2, 12)))


@pytest.mark.parametrize("init", ["split", "svd"])
@pytest.mark.parametrize("fields", [ONE_LEVEL, LONG_BLOCKS])
def test_degenerate_patch_leaves_t5_unchanged(fields, init):
    original = tiny_stock_t5()
    before = {k: v.clone() for k, v in original.state_dict().items()}
    patched = hf_structattn.patch(original, attention="mlr", init=init, allow_identity=True, **fields)
    assert type(patched).__name__ == "StructAttnT5ForConditionalGeneration"
    assert list(patched.state_dict()) == list(before)
    assert patched.config.structattn_patch == {"source": "T5ForConditionalGeneration", "init": init}
    for name, value in original.state_dict().items():  # the original is not modified
        assert torch.equal(value, before[name]), name
    report = hf_structattn.patch_report(original, patched, t5_inputs())
    assert report["logit_max_abs"] < 1e-4 and report["top1_agreement"] == 1.0, report
    if init == "split":  # the naive split keeps every tensor bit-for-bit
        for name, value in patched.state_dict().items():
            assert torch.equal(value, before[name]), name


def test_svd_alignment_keeps_every_q_dot_k_and_orders_singular_values():
    torch.manual_seed(0)
    heads, head_dim, width = 3, 8, 32
    q, k = torch.randn(heads * head_dim, width), torch.randn(heads * head_dim, width) * 0.1
    new_q, new_k = svd_align_qk(q, k, heads)
    x, y = torch.randn(10, width), torch.randn(7, width)
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        torch.testing.assert_close((x @ new_q[rows].T) @ (y @ new_k[rows].T).T, (x @ q[rows].T) @ (y @ k[rows].T).T,
                                   atol=1e-4, rtol=1e-4)
        # coordinate i carries the i-th singular value of W_Q,h W_K,h^T
        product_norms = new_q[rows].norm(dim=1) * new_k[rows].norm(dim=1)
        singular = torch.linalg.svdvals(q[rows].T @ k[rows])[:head_dim]
        torch.testing.assert_close(product_norms, singular, atol=1e-4, rtol=1e-4)


def test_patched_t5_reloads_remotely_and_generates_the_same(tmp_path):
    original = tiny_stock_t5().double()
    patched = hf_structattn.patch(original, init="svd", **PATCH_MLR)
    patched.save_pretrained(tmp_path / "ckpt")
    inputs = t5_inputs()
    # compared in float64 with a tolerance: another interpreter may pick other kernels (no bitwise comparison
    # across processes); the generated tokens are compared within the child process only
    torch.save({"inputs": inputs, "logits": patched.double()(**inputs).logits}, tmp_path / "ref.pt")
    out = run_isolated(f"""
        import torch
        from transformers import AutoModelForSeq2SeqLM
        model = AutoModelForSeq2SeqLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True,
                                                      dtype=torch.float64).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        model = model.double()
        print("max_diff", float((model(**ref["inputs"]).logits - ref["logits"]).abs().max()))
        ids, mask = ref["inputs"]["input_ids"], ref["inputs"]["attention_mask"]
        cached = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
        uncached = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, use_cache=False)
        print("generate_equal", torch.equal(uncached, cached))
    """, tmp_path)
    assert float(out.split("max_diff")[1].split()[0]) < 1e-12
    assert "generate_equal True" in out


def test_chronos_t5_patch_unchanged_then_remote_reload_predicts_the_same(tmp_path):
    pipe = tiny_chronos_t5(tmp_path / "tiny")
    one_level = hf_structattn.patch(pipe, attention="mlr", init="svd", allow_identity=True, **ONE_LEVEL)
    assert isinstance(one_level, ChronosPipeline)
    torch.manual_seed(0)
    expected = pipe.predict(chronos_contexts(), prediction_length=8)
    torch.manual_seed(0)
    torch.testing.assert_close(one_level.predict(chronos_contexts(), prediction_length=8), expected)

    patched = hf_structattn.patch(pipe, attention="mlr", **PATCH_MLR)
    report = hf_structattn.patch_report(pipe, patched, {"context": chronos_contexts(), "prediction_length": 8})
    assert report["logit_rel"] > 0  # MLR with blocks shorter than the contexts is a different function
    patched.model.model.save_pretrained(tmp_path / "patched")
    # the reload is compared through the model's float64 logits on the tokenised contexts (left-padded batch) with
    # a tolerance: samples drawn in another interpreter need not be bitwise equal
    token_ids, mask, _ = patched.tokenizer.context_input_transform(left_pad_and_stack_1D(chronos_contexts()))
    inputs = dict(input_ids=token_ids, attention_mask=mask, decoder_input_ids=token_ids[:, -5:])
    torch.save({"inputs": inputs, "logits": patched.model.model.double()(**inputs).logits}, tmp_path / "ref.pt")
    out = run_isolated(f"""
        import torch
        from chronos import ChronosPipeline
        pipe = ChronosPipeline.from_pretrained({str(tmp_path / "patched")!r}, trust_remote_code=True,
                                               device_map="cpu", dtype=torch.float32)
        print("class", type(pipe.model.model).__name__)
        t = torch.arange(60, dtype=torch.float32)
        ctx = [10 + 4 * torch.sin(t / 3), 5 + 0.1 * t[:37] + torch.cos(t[:37])]
        samples = pipe.predict(ctx, prediction_length=8)
        print("samples", tuple(samples.shape), bool(torch.isfinite(samples).all()))
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        logits = pipe.model.model.double()(**ref["inputs"]).logits
        print("max_diff", float((logits - ref["logits"]).abs().max()))
    """, tmp_path)
    assert "class StructAttnT5ForConditionalGeneration" in out and "samples (2, 4, 8) True" in out, out
    assert float(out.split("max_diff")[1].split()[0]) < 1e-12, out


def test_chronos_bolt_identity_patches_need_allow_identity_and_change_nothing(tmp_path):
    pipe = tiny_bolt(tmp_path / "bolt")  # context 64 steps in patches of 4: 16 patch tokens + [REG]
    expected = pipe.predict(chronos_contexts(), prediction_length=8)
    for fields in (ONE_LEVEL, LONG_BLOCKS):
        with pytest.raises(ValueError, match="allow_identity=True"):
            hf_structattn.patch(pipe, **fields)
        for init in ("split", "svd"):
            same = hf_structattn.patch(pipe, init=init, allow_identity=True, **fields)
            torch.testing.assert_close(same.predict(chronos_contexts(), prediction_length=8), expected, atol=1e-5,
                                       rtol=1e-5)
    # block sizes meant as time steps but read as patch tokens: the message gives both units and the way out
    with pytest.raises(ValueError, match=r"mlr_block_sizes=\[64, 32\] \(tokens = \[256, 128\] time steps at 4 time "
                                         r"steps per token\).*encoder_self 17 tokens.*mlr_block_steps"):
        hf_structattn.patch(pipe, mlr_ranks=[4, 2, 2], mlr_block_sizes=[64, 32])
    with pytest.raises(ValueError, match=r"block\(s\) \[32\] cover"):  # one level of two is dense again
        hf_structattn.patch(pipe, mlr_ranks=[4, 2, 2], mlr_block_sizes=[32, 4])
    with pytest.raises(ValueError, match="decoder_self 1 tokens"):  # Bolt's decoder attends over one token
        hf_structattn.patch(pipe, targets=("decoder_self",), **PATCH_MLR)


def test_block_sizes_in_time_steps_and_context_defaults_for_chronos(tmp_path):
    bolt = tiny_bolt(tmp_path / "bolt")
    by_steps = hf_structattn.patch(bolt, init="svd", mlr_ranks=[4, 2, 2], mlr_block_steps=[32, 16])
    by_tokens = hf_structattn.patch(bolt, init="svd", **PATCH_MLR)
    assert by_steps.model.config.mlr_block_sizes == [8, 4]
    assert by_steps.model.config.structattn_patch == {"source": "ChronosBoltPipeline", "init": "svd",
                                                      "time_steps_per_token": 4}
    assert torch.equal(by_steps.predict(chronos_contexts(), prediction_length=8),
                       by_tokens.predict(chronos_contexts(), prediction_length=8))
    # without block fields the dyadic blocks come from the context (16 patch tokens), not the generic 512
    assert hf_structattn.patch(bolt, mlr_ranks=[4, 2, 2]).model.config.resolved_mlr_block_sizes == [8, 4]
    with pytest.raises(ValueError, match=r"mlr_block_steps=\[30, 15\].*multiple of 4"):
        hf_structattn.patch(bolt, mlr_ranks=[4, 2, 2], mlr_block_steps=[30, 15])
    with pytest.raises(ValueError, match="not both"):
        hf_structattn.patch(bolt, mlr_block_steps=[32, 16], **PATCH_MLR)
    with pytest.raises(ValueError, match="no time axis"):
        hf_structattn.patch(tiny_stock_t5(), mlr_ranks=[4, 2, 2], mlr_block_steps=[8, 4])
    with pytest.raises(ValueError, match="no time axis"):  # nor is it silently ignored for a decoder
        hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_block_steps=[16, 8])

    chronos_t5 = tiny_chronos_t5(tmp_path / "chronos_t5")  # one token per time step, context 64 (+ EOS)
    patched = hf_structattn.patch(chronos_t5, mlr_ranks=[4, 2, 2], mlr_block_steps=[16, 8])
    assert patched.model.model.config.mlr_block_sizes == [16, 8]
    assert hf_structattn.patch(chronos_t5, mlr_ranks=[4, 2, 2]).model.model.config.resolved_mlr_block_sizes == [32, 16]
    with pytest.raises(ValueError, match=r"block\(s\) \[128\]"):
        hf_structattn.patch(chronos_t5, mlr_ranks=[4, 2, 2], mlr_block_steps=[128, 8])


def test_patched_chronos_bolt_loads_as_mlr_through_chronos_entry_points(tmp_path):
    pipe = tiny_bolt(tmp_path / "bolt")
    expected = pipe.predict(chronos_contexts(), prediction_length=8)
    patched = hf_structattn.patch(pipe.model, attention="mlr", init="svd", **PATCH_MLR)
    assert type(patched).__name__ == "StructAttnChronosBoltModelForForecasting"
    assert isinstance(patched, ChronosBoltModelForForecasting)
    assert list(patched.state_dict()) == list(pipe.model.state_dict())
    assert sum(mlr_geometry_of(m) is not None for m in patched.modules()) == 2 + 3
    moved = ChronosBoltPipeline(patched).predict(chronos_contexts(), prediction_length=8)
    assert not torch.allclose(moved, expected, atol=1e-4)
    patched.save_pretrained(tmp_path / "patched")
    # hf_structattn is imported here: Chronos' own entry points find the class without trust_remote_code
    for load in (BaseChronosPipeline.from_pretrained, ChronosBoltPipeline.from_pretrained,
                 hf_structattn.load_patched_chronos_bolt):
        reloaded = load(tmp_path / "patched", device_map="cpu", dtype=torch.float32)
        assert type(reloaded.model) is type(patched), load
        torch.testing.assert_close(reloaded.predict(chronos_contexts(), prediction_length=8), moved)
    with pytest.raises(ValueError, match="structattn_chronos_bolt"):
        hf_structattn.load_patched_chronos_bolt(tmp_path / "bolt")

    torch.save({"moved": moved}, tmp_path / "ref.pt")
    out = run_isolated(f"""
        import io, sys
        import torch
        from chronos import BaseChronosPipeline
        sys.stdin = io.StringIO()  # transformers would ask on a terminal whether to run the code
        path = {str(tmp_path / "patched")!r}
        try:
            BaseChronosPipeline.from_pretrained(path, device_map="cpu", dtype=torch.float32)
        except ValueError as error:
            print("refused", "trust_remote_code=True" in str(error))
        else:
            print("loaded without trust_remote_code")
        pipe = BaseChronosPipeline.from_pretrained(path, trust_remote_code=True, device_map="cpu",
                                                   dtype=torch.float32)
        print("class", type(pipe).__name__, type(pipe.model).__module__.split(".")[0], type(pipe.model).__name__)
        t = torch.arange(60, dtype=torch.float32)
        ctx = [10 + 4 * torch.sin(t / 3), 5 + 0.1 * t[:37] + torch.cos(t[:37])]
        moved = torch.load({str(tmp_path / "ref.pt")!r})["moved"]
        print("rel_diff", float((pipe.predict(ctx, prediction_length=8) - moved).abs().max() / moved.abs().max()))
        from transformers import AutoModel
        print("auto", type(AutoModel.from_pretrained(path, trust_remote_code=True)).__name__)
    """, tmp_path)
    assert "refused True" in out, out
    assert "class ChronosBoltPipeline transformers_modules StructAttnChronosBoltModelForForecasting" in out, out
    assert float(out.split("rel_diff")[1].split()[0]) < 1e-5, out  # float32 forecasts, another process
    assert "auto StructAttnChronosBoltModelForForecasting" in out, out

    # a fresh process that imports hf_structattn before chronos: the package import leaves chronos out, and the
    # local class is still what Chronos' own entry point finds (defined when AutoConfig builds the config)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        import torch
        import hf_structattn
        print("chronos_imported", "chronos" in sys.modules)
        from chronos import BaseChronosPipeline
        pipe = BaseChronosPipeline.from_pretrained({str(tmp_path / "patched")!r}, device_map="cpu", dtype=torch.float32)
        print("local", type(pipe.model).__module__, type(pipe.model).__name__)
        t = torch.arange(60, dtype=torch.float32)
        ctx = [10 + 4 * torch.sin(t / 3), 5 + 0.1 * t[:37] + torch.cos(t[:37])]
        moved = torch.load({str(tmp_path / "ref.pt")!r})["moved"]
        print("rel_diff", float((pipe.predict(ctx, prediction_length=8) - moved).abs().max() / moved.abs().max()))
    """)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "chronos_imported False" in out, out
    assert ("local hf_structattn.modeling.modeling_structattn_chronos_bolt StructAttnChronosBoltModelForForecasting"
            in out), out
    assert float(out.split("rel_diff")[1].split()[0]) < 1e-5, out


def test_patch_refuses_bad_requests():
    model = tiny_stock_t5()
    with pytest.raises(ValueError, match="attention='bilinear_mlr'"):
        hf_structattn.patch(model, attention="bilinear_mlr")
    with pytest.raises(ValueError, match="mlr_ranks"):
        hf_structattn.patch(model, mlr_ranks=[4, 2], mlr_block_sizes=[8])
    with pytest.raises(ValueError, match="cross_attention='mlr'"):
        hf_structattn.patch(model, targets=("cross",), **PATCH_MLR)
    with pytest.raises(ValueError, match="init="):
        hf_structattn.patch(model, init="random", **PATCH_MLR)
    with pytest.raises(ValueError, match=r"mlr_ranks=\[8\] has one level.*allow_identity=True"):
        hf_structattn.patch(model, **ONE_LEVEL)
    with pytest.raises(ValueError, match="already has structured attention"):
        hf_structattn.patch(hf_structattn.patch(model, **PATCH_MLR), **PATCH_MLR)
    with pytest.raises(ValueError, match="BertModel"):  # decoders are patched too (tests/test_decoder_patching.py)
        hf_structattn.patch(transformers.BertModel(transformers.BertConfig(
            num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16, vocab_size=20)))


@pytest.mark.parametrize("kind", ["t5", "decoder"])
@pytest.mark.parametrize("typo, meant", [("target", "targets"), ("allow_identiy", "allow_identity"),
                                         ("inti", "init"), ("mlr_block_step", "mlr_block_steps")])
def test_a_typo_of_patch_s_own_keywords_gets_did_you_mean(kind, typo, meant):
    """patch's own keywords (targets, init, allow_identity, mlr_block_steps, attention) are candidates of the "did
    you mean" as much as the config fields, for T5 and for decoders, in one line."""
    model = tiny_stock_t5() if kind == "t5" else tiny_decoder("llama")
    fields = PATCH_MLR if kind == "t5" else dict(mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
    with pytest.raises(ValueError, match=f"unknown keyword '{typo}'.*did you mean {meant}\\?") as raised:
        hf_structattn.patch(model, **{typo: "x"}, **fields)
    assert "\n" not in str(raised.value)


def test_svd_init_moves_a_trained_model_less_than_the_naive_split():
    model = train_copy_task(tiny_stock_t5(initializer_factor=1.0))
    torch.manual_seed(5)
    ids = torch.randint(2, 64, (8, 24))
    inputs = dict(input_ids=ids, decoder_input_ids=model._shift_right(ids.flip(1)))
    drift = {init: hf_structattn.patch_report(model, hf_structattn.patch(model, init=init, **PATCH_MLR), inputs)
             for init in ("split", "svd")}
    assert drift["svd"]["logit_rel"] < drift["split"]["logit_rel"], drift


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hf_structattn_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_cli_patches_checkpoints_and_refuses_bad_arguments(tmp_path, capsys):
    tiny_stock_t5().save_pretrained(tmp_path / "t5")
    result = _cli("patch", tmp_path / "t5", tmp_path / "out", "--attention", "mlr", "--mlr-ranks", "4,2,2",
                  "--mlr-block-sizes", "8,4", "--init", "svd")
    assert result.returncode == 0, result.stderr
    assert "logit_rel" in result.stdout
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "structattn_t5" and config["mlr_ranks"] == [4, 2, 2]
    assert (tmp_path / "out" / "modeling_structattn_t5.py").exists()

    # further cases in-process (each interpreter start costs ~9 s on the shared CPUs): same main() as the script
    tiny_bolt(tmp_path / "bolt")
    assert main(["patch", str(tmp_path / "bolt"), str(tmp_path / "bolt_out"), "--mlr-ranks", "4,2,2",
                 "--mlr-block-sizes", "8,4"]) == 0
    assert "forecast_rel" in capsys.readouterr().out
    assert json.loads((tmp_path / "bolt_out" / "config.json").read_text())["model_type"] == "structattn_chronos_bolt"

    bert = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                                   vocab_size=20)
    transformers.BertModel(bert).save_pretrained(tmp_path / "bert")  # neither T5 nor a decoder
    bad = [(["--attention", "fancy", "--mlr-ranks", "4,2,2", "--mlr-block-sizes", "8,4"], "attention='fancy'"),
           (["--mlr-ranks", "4,2", "--mlr-block-sizes", "8"], "mlr_ranks"),
           (["--mlr-ranks", "4,2,2", "--mlr-block-sizes", "8,x"], "comma-separated integers")]
    for index, (args, message) in enumerate(bad):
        out = tmp_path / f"bad{index}"
        with pytest.raises(SystemExit) if "integers" in message else contextlib.nullcontext() as exiting:
            code = main(["patch", str(tmp_path / "t5"), str(out), *args])
        code = exiting.value.code if "integers" in message else code
        assert code == 2 and message in capsys.readouterr().err
        assert not out.exists()
    assert main(["patch", str(tmp_path / "bert"), str(tmp_path / "bad_bert"), "--mlr-ranks", "4,4"]) == 2
    assert "model_type='bert'" in capsys.readouterr().err and not (tmp_path / "bad_bert").exists()


def test_patched_chronos_forecasts_series_with_leading_nans(tmp_path):
    """Leading NaNs are missing values that Chronos masks (every row padded alike when the batch is one series):
    the patched Chronos-T5 and Chronos-Bolt forecast them as the series without the NaNs, as the stock pipelines
    forecast them at all."""
    series = chronos_contexts()[0]
    gapped = torch.cat([torch.full((9,), float("nan")), series[9:]])
    chronos_t5 = hf_structattn.patch(tiny_chronos_t5(tmp_path / "t5"), mlr_ranks=[4, 2, 2], mlr_block_steps=[16, 8])
    bolt = ChronosBoltPipeline(hf_structattn.patch(tiny_bolt(tmp_path / "bolt").model, **PATCH_MLR))
    for pipe in (chronos_t5, bolt):
        torch.manual_seed(0)
        with_nans = pipe.predict([gapped], prediction_length=8)
        torch.manual_seed(0)
        trimmed = pipe.predict([series[9:]], prediction_length=8)
        assert torch.isfinite(with_nans).all()
        torch.testing.assert_close(with_nans, trimmed, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["chronos_t5", "chronos_bolt"])
def test_patch_report_takes_a_single_series_as_chronos_does(tmp_path, kind):
    """A 1-D context (one series, which Chronos' predict accepts) gives the report of the same series as a batch of
    one; a context Chronos would not take either is one line naming it."""
    pipe = tiny_chronos_t5(tmp_path / "t5") if kind == "chronos_t5" else tiny_bolt(tmp_path / "bolt")
    patched = hf_structattn.patch(pipe, attention="mlr", **PATCH_MLR)
    series = chronos_contexts()[0]
    one = hf_structattn.patch_report(pipe, patched, {"context": series, "prediction_length": 8})
    batch = hf_structattn.patch_report(pipe, patched, {"context": series[None], "prediction_length": 8})
    assert one.keys() == batch.keys() and all(value == pytest.approx(batch[name], rel=1e-9, abs=1e-12)
                                              for name, value in one.items())
    assert one.get("logit_rel", one["forecast_rel"]) > 0  # the patch changed something
    with pytest.raises(ValueError, match=r"context must be .*shape \(1, 2, 60\)"):
        hf_structattn.patch_report(pipe, patched, series[None, None].expand(1, 2, 60))
