"""The ``hf-structattn patch`` CLI: atomic output folder, no stale weight files, one-line errors with exit code 2,
Chronos-Bolt block sizes in time steps."""

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn_cli import main

from model_helpers import chronos_contexts, tiny_bolt, tiny_stock_t5

chronos = pytest.importorskip("chronos")
from chronos import BaseChronosPipeline  # noqa: E402

MLR_ARGS = ["--mlr-ranks", "4,2,2", "--mlr-block-sizes", "8,4"]


def _limit_file_size(limit_bytes):
    def apply():  # in the child before exec: a write past the limit fails with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def test_failure_while_writing_leaves_no_out_dir_and_a_rerun_succeeds(tmp_path, capsys):
    tiny_stock_t5().save_pretrained(tmp_path / "t5")  # ~220 kB of weights
    weights = (tmp_path / "t5" / "model.safetensors").stat().st_size
    limit = 64 * 1024  # config.json and the payload code fit, the weights do not: a real full-disk style failure
    assert weights > 2 * limit
    out = tmp_path / "parent" / "out"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run([sys.executable, "-m", "hf_structattn_cli", "patch", str(tmp_path / "t5"), str(out),
                             *MLR_ARGS], capture_output=True, text=True, timeout=300, env=env,
                            preexec_fn=_limit_file_size(limit))
    assert not out.exists() and not (tmp_path / "parent").exists()  # nor the parent it had created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t5"]  # no staging folder left either
    assert result.returncode == 1, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("hf-structattn: error:")]
    assert len(error_lines) == 1 and "nothing was left behind" in error_lines[0], result.stderr
    assert "Traceback" not in result.stderr

    assert main(["patch", str(tmp_path / "t5"), str(out), *MLR_ARGS]) == 0
    assert "saved to" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_sharded_source_leaves_no_stale_weights_and_side_files_travel(tmp_path, capsys):
    source = tmp_path / "sharded"
    original = tiny_stock_t5()
    original.save_pretrained(source, max_shard_size="60KB")
    shards = sorted(p.name for p in source.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (source / "model.safetensors.index.json").is_file()
    (source / "spiece.model").write_bytes(b"tokenizer bytes")
    (source / "training_args.bin").write_bytes(b"stale pickle")
    (source / "README.md").write_text("# t5-tiny: a dense T5")  # the card of another model
    (source / "LICENSE").write_text("license text")
    out = tmp_path / "out"
    out.mkdir()  # an existing empty OUT_DIR is accepted

    assert main(["patch", str(source), str(out), *MLR_ARGS]) == 0, capsys.readouterr().err
    names = {p.name for p in out.iterdir()}
    assert (out / "spiece.model").read_bytes() == b"tokenizer bytes"
    assert (out / "LICENSE").read_text() == "license text" and "README.md" not in names
    weight_files = {n for n in names if n.endswith((".safetensors", ".bin", ".index.json"))}
    assert weight_files == {"model.safetensors"}, names  # no shard, index or pickle of the source
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())

    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "StructAttnT5ForConditionalGeneration"
    expected = hf_structattn.patch(original, mlr_ranks=[4, 2, 2], mlr_block_sizes=[8, 4])
    ids = torch.randint(2, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, decoder_input_ids=ids[:, :7])
    torch.testing.assert_close(reloaded(**inputs).logits, expected(**inputs).logits, atol=1e-6, rtol=1e-6)


def _expect_refusal(capsys, argv, *fragments):
    capsys.readouterr()  # drop the setup's output
    assert main(argv) == 2
    captured = capsys.readouterr()
    # transformers' loading progress bars may precede it on stderr; the error itself is one line
    lines = [line for line in captured.err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("hf-structattn: error:"), captured.err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_unusable_source_or_out_dir_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    good = tmp_path / "t5"
    tiny_stock_t5().save_pretrained(good)
    out = tmp_path / "out"

    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "config.json").write_text('{"model_type": "t5", "d_model": ')
    (malformed / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    _expect_refusal(capsys, ["patch", str(malformed), str(out), *MLR_ARGS], "config.json", "not valid JSON")

    not_object = tmp_path / "list_config"
    not_object.mkdir()
    (not_object / "config.json").write_text("[1, 2]")
    _expect_refusal(capsys, ["patch", str(not_object), str(out), *MLR_ARGS], "JSON object")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((good / "config.json").read_text())
    _expect_refusal(capsys, ["patch", str(no_weights), str(out), *MLR_ARGS], "no weights", "model.safetensors")

    chronos2 = tmp_path / "chronos2"
    chronos2.mkdir()
    (chronos2 / "config.json").write_text(json.dumps({"model_type": "t5", "chronos_pipeline_class": "Chronos2Pipeline",
                                                      "chronos_config": {}}))
    (chronos2 / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    _expect_refusal(capsys, ["patch", str(chronos2), str(out), *MLR_ARGS], "'Chronos2Pipeline'")

    bad_values = tmp_path / "bad_values"
    bad_values.mkdir()
    config = json.loads((good / "config.json").read_text())
    (bad_values / "config.json").write_text(json.dumps({**config, "d_model": "wide"}))
    (bad_values / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    _expect_refusal(capsys, ["patch", str(bad_values), str(out), *MLR_ARGS], "cannot load")
    assert not out.exists()

    as_file = tmp_path / "out_file"
    as_file.write_text("keep me")
    _expect_refusal(capsys, ["patch", str(good), str(as_file), *MLR_ARGS], "not a directory")
    _expect_refusal(capsys, ["patch", str(good), str(as_file / "sub"), *MLR_ARGS], "not a directory")
    assert as_file.read_text() == "keep me"

    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    _expect_refusal(capsys, ["patch", str(good), str(full), *MLR_ARGS], "not empty")
    assert [p.name for p in full.iterdir()] == ["x"]


def test_bolt_block_sizes_in_time_steps_identity_refusal_and_chronos_reload(tmp_path, capsys):
    tiny_bolt(tmp_path / "bolt")  # context 64 steps in patches of 4: 16 patch tokens + [REG]
    source = str(tmp_path / "bolt")
    ranks = ["--mlr-ranks", "4,2,2"]
    # block sizes in tokens that cover the whole context (the user meant time steps): refused
    _expect_refusal(capsys, ["patch", source, str(tmp_path / "a"), *ranks, "--mlr-block-sizes", "64,32"],
                    "[64, 32]", "[256, 128] time steps", "encoder_self 17 tokens", "--mlr-block-steps",
                    "--allow-identity")
    _expect_refusal(capsys, ["patch", source, str(tmp_path / "a"), *ranks, "--mlr-block-steps", "32,6"],
                    "mlr_block_steps=[32, 6]", "multiple of 4")
    assert not (tmp_path / "a").exists()

    assert main(["patch", source, str(tmp_path / "steps"), *ranks, "--mlr-block-steps", "32,16"]) == 0
    stdout = capsys.readouterr().out
    assert "BaseChronosPipeline.from_pretrained(OUT_DIR, trust_remote_code=True)" in stdout
    config = json.loads((tmp_path / "steps" / "config.json").read_text())
    assert config["model_type"] == "structattn_chronos_bolt" and config["mlr_block_sizes"] == [8, 4]
    assert config["structattn_patch"]["time_steps_per_token"] == 4
    assert config["architectures"] == ["StructAttnChronosBoltModelForForecasting"]
    assert (tmp_path / "steps" / "modeling_structattn_chronos_bolt.py").is_file()
    pipe = BaseChronosPipeline.from_pretrained(tmp_path / "steps", device_map="cpu", dtype=torch.float32)
    assert type(pipe.model).__name__ == "StructAttnChronosBoltModelForForecasting"
    expected = hf_structattn.patch(chronos.chronos_bolt.ChronosBoltPipeline.from_pretrained(source),
                                   mlr_ranks=[4, 2, 2], mlr_block_sizes=[8, 4])
    torch.testing.assert_close(pipe.predict(chronos_contexts(), prediction_length=8),
                               expected.predict(chronos_contexts(), prediction_length=8))

    assert main(["patch", source, str(tmp_path / "identity"), *ranks, "--mlr-block-sizes", "64,32",
                 "--allow-identity"]) == 0
    drift = capsys.readouterr().out.split("forecast_rel")[1].split()[0]
    assert float(drift) < 1e-5  # an identity patch moves nothing beyond float32 rounding


def test_help_is_plain_text_without_rest_markup(capsys):
    """Issue 23 item 9: `hf-structattn --help` printed the docstring's reST literals (``hf-structattn``)."""
    from hf_structattn_cli import build_parser

    for argv in (["--help"], ["patch", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert "``" not in text and ":func:" not in text and ":class:" not in text, text
        assert text.startswith("usage: hf-structattn"), text
    top = build_parser().format_help()
    assert "convert Hugging Face checkpoints to structured (MLR) attention" in " ".join(top.split())


def test_decoder_output_names_decoder_fields_and_refuses_t5_only_options(tmp_path, capsys):
    """Issue 23 item 8: a decoder conversion printed `init=split targets=('encoder_self', 'decoder_self')`, T5 fields
    that do not apply to decoders."""
    from hf_structattn.decoder_patching import tiny_decoder

    source = tmp_path / "src"
    tiny_decoder("llama", vocab_size=64, dtype=torch.float32).save_pretrained(source)
    assert main(["patch", str(source), str(tmp_path / "out"), "--mlr-ranks", "8,4,4", "--mlr-block-sizes", "16,8",
                 "--layers", "1"]) == 0
    stdout = capsys.readouterr().out
    first = stdout.splitlines()[0]
    assert first == (f"patched decoder checkpoint {source} (LlamaForCausalLM) with attention=mlr mlr_ranks=[8, 4, 4] "
                     "mlr_block_sizes=[16, 8] layers=[1] sliding_window_layers=refuse level_order=frequency "
                     "level_rule=blocks"), first
    assert "targets=" not in stdout and "init=" not in stdout
    _expect_refusal(capsys, ["patch", str(source), str(tmp_path / "b"), *MLR_ARGS[:2], "--mlr-block-sizes", "16,8",
                             "--targets", "encoder_self"], "--targets encoder_self", "decoder")
    t5 = tmp_path / "t5"
    tiny_stock_t5().save_pretrained(t5)
    _expect_refusal(capsys, ["patch", str(t5), str(tmp_path / "c"), *MLR_ARGS, "--layers", "0"],
                    "--layers applies to transformers decoders only")
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert main(["patch", str(t5), str(tmp_path / "d"), *MLR_ARGS]) == 0
    assert "init=split targets=('encoder_self', 'decoder_self')" in capsys.readouterr().out


def test_a_kill_9_leaves_a_partial_folder_that_the_next_run_removes(tmp_path, capsys):
    """Issue 20 item 12: `kill -9` of `hf-structattn patch` while it writes leaves `.OUT.partial-<pid>-<hex>`, which
    later runs never removed. The next write of the same OUT removes it once its writer is gone; a live writer's
    folder, another output's folder and lookalike names stay."""
    big = tmp_path / "t5"
    # about 30 MB of weights, so that writing them takes long enough to be interrupted
    tiny_stock_t5(d_ff=3072, num_layers=3, num_decoder_layers=3).save_pretrained(big)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    for attempt in range(4):  # the kill must land while OUT is being written; retried when it did not
        out = tmp_path / f"out{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "hf_structattn_cli", "patch", str(big), str(out), *MLR_ARGS],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while proc.poll() is None and not list(tmp_path.glob(f".{out.name}.partial-*")):
                time.sleep(0.0002)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=300)
        left = list(tmp_path.glob(f".{out.name}.partial-*"))
        if proc.returncode == -signal.SIGKILL and left:
            break
    else:
        pytest.fail("four runs finished before their output could be interrupted")
    assert not out.exists() and len(left) == 1 and left[0].name.startswith(f".{out.name}.partial-{proc.pid}-")
    live = tmp_path / f".{out.name}.partial-{os.getpid()}-0123abcd"  # this process is alive: not stale
    other = tmp_path / f".other.partial-{proc.pid}-0123abcd"  # another output
    lookalike = tmp_path / f".{out.name}.partial-{proc.pid}-notahex!"
    for folder in (live, other, lookalike):
        folder.mkdir()
    assert main(["patch", str(big), str(out), *MLR_ARGS]) == 0, capsys.readouterr().err
    assert (out / "model.safetensors").is_file()
    assert not left[0].exists()
    assert live.is_dir() and other.is_dir() and lookalike.is_dir()


def _break_weights(folder, how):
    weights = folder / "model.safetensors"
    if how == "missing":
        weights.unlink()
    else:
        weights.write_bytes(b"not a safetensors file")


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_arguments_are_checked_against_config_json_before_any_weight_is_read(tmp_path, capsys, how):
    """A checkpoint whose weights cannot be read still gets the argument error: the arguments are checked on
    config.json alone (the checks hf_structattn.patch makes), before the weights are looked for or loaded."""
    from hf_structattn.decoder_patching import tiny_decoder

    llama, t5 = tmp_path / "llama", tmp_path / "t5"
    tiny_decoder("llama", vocab_size=64, dtype=torch.float32).save_pretrained(llama)  # head dim 16, RoPE
    tiny_stock_t5().save_pretrained(t5)  # d_kv 8
    tiny_bolt(tmp_path / "bolt")  # context 64 steps in patches of 4: 16 patch tokens + [REG]
    for folder in (llama, t5, tmp_path / "bolt"):
        _break_weights(folder, how)
    out = str(tmp_path / "out")
    _expect_refusal(capsys, ["patch", str(llama), out, "--mlr-ranks", "8,4,4"],
                    "mlr_block_sizes (b_2..b_L) or mlr_max_length", "required")
    _expect_refusal(capsys, ["patch", str(llama), out, "--mlr-ranks", "8,4,2", "--mlr-block-sizes", "16,8"],
                    "mlr_ranks=[8, 4, 2] sums to 14", "head dim is 16")
    _expect_refusal(capsys, ["patch", str(llama), out, "--mlr-ranks", "9,7", "--mlr-block-sizes", "16"],
                    "RoPE rotation pair")  # read from the rotary embedding of a model built without weights
    _expect_refusal(capsys, ["patch", str(llama), out, "--mlr-ranks", "8,8", "--mlr-block-steps", "16"],
                    "mlr_block_steps", "no time axis")
    _expect_refusal(capsys, ["patch", str(t5), out, "--mlr-ranks", "4,2", "--mlr-block-sizes", "8"],
                    "mlr_ranks")
    _expect_refusal(capsys, ["patch", str(t5), out, "--mlr-ranks", "4,2,2", "--mlr-block-sizes", "8,4",
                             "--targets", "cross"], "cross_attention='mlr'")
    _expect_refusal(capsys, ["patch", str(tmp_path / "bolt"), out, "--mlr-ranks", "4,2,2", "--mlr-block-sizes",
                             "64,32"], "[256, 128] time steps", "--allow-identity")
    assert not (tmp_path / "out").exists()
    # valid arguments: only now are the weights looked for, and their absence or corruption is what is reported
    expected = "no weights" if how == "missing" else "cannot load as a decoder checkpoint"
    _expect_refusal(capsys, ["patch", str(llama), out, "--mlr-ranks", "8,4,4", "--mlr-block-sizes", "16,8"],
                    expected)


def test_a_hub_id_is_answered_with_how_to_download_it(tmp_path, capsys):
    _expect_refusal(capsys, ["patch", "google-t5/t5-small", str(tmp_path / "out"), *MLR_ARGS],
                    "SRC_DIR google-t5/t5-small is not a directory", "Hub model id",
                    "hf download google-t5/t5-small --local-dir DIR")
    _expect_refusal(capsys, ["patch", str(tmp_path / "absent"), str(tmp_path / "out"), *MLR_ARGS],
                    "is not a directory")
    assert "hf download" not in capsys.readouterr().err  # an absolute path is no Hub id


def test_patch_help_promises_no_default_block_size_for_decoders(capsys, monkeypatch):
    from hf_structattn_cli import build_parser

    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens otherwise
    with pytest.raises(SystemExit):
        build_parser().parse_args(["patch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Decoders: this or --mlr-max-length is required" in text
    assert "(default: dyadic from --mlr-max-length" not in text
