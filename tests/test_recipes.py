"""The accelerate recipes end to end on tiny models: arguments, offline data, outputs, exact resume,
accumulation / multi-process equivalence, Hub upload (only the network is faked), Chronos fine-tuning."""

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
TINY_CLM = str(ROOT / "configs" / "clm_tiny.json")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process recipe run builds its own Accelerator (accelerate's state is a per-process singleton)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and it does not spin against other processes
    torch.set_default_dtype(torch.float32)  # the recipes' default, whatever another test module left behind
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_clm(output_dir, *extra):
    from hf_structattn.training.clm import main

    return main(["--config", TINY_CLM, "--output_dir", str(output_dir), *map(str, extra)])


def weights(path):
    return load_file(str(Path(path) / "model.safetensors"))


# ------------------------------------------------------------------------------------------------ arguments


def parse_clm(argv):
    from hf_structattn.training.args import parse_recipe_args
    from hf_structattn.training.clm import CLMArgs, CLMModelArgs

    return parse_recipe_args(CLMArgs, CLMModelArgs, argv)


def test_config_file_then_command_line_overrides(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("max_steps: 7\nlearning_rate: 3e-3\nmax_train_bytes: null\nmodel:\n  n_embd: 64\n"
                      "  attention: mlr\n  mlr_ranks: [16, 8, 4, 4]\n")
    args = parse_clm(["--config", str(config), "--n_embd", "128", "--mlr_ranks", "32,16,8,8", "--seed=3", "--mup",
                      "--text_files", str(config), str(config)])
    assert args.max_steps == 7 and args.learning_rate == 3e-3 and args.seed == 3 and args.mup is True
    assert args.max_train_bytes is None  # null in the file: no cap
    assert args.model["n_embd"] == 128 and args.model["mlr_ranks"] == [32, 16, 8, 8]
    assert args.model["n_layer"] == 4  # recipe default kept where neither the file nor the CLI says otherwise
    assert args.text_files == [str(config)] * 2
    # lists: one comma word, several words, or both
    assert parse_clm(["--mlr_ranks", "32", "16", "8,8"]).model["mlr_ranks"] == [32, 16, 8, 8]
    assert parse_clm(["--max_train_bytes", "none"]).max_train_bytes is None
    from hf_structattn.training.clm import gpt2_config_fields

    scaled = parse_clm(["--mlr_scaling", "0.2,0.1", "--mlr_ranks", "32,32"])
    assert gpt2_config_fields(scaled.model)["mlr_scaling"] == [0.2, 0.1]


@pytest.mark.parametrize("argv, field", [
    (["--n_embed", "3"], "n_embed' (did you mean 'n_embd'"),
    (["--max_steps", "many"], "--max_steps: invalid int value: 'many'"),
    (["--max_steps", "-5"], "--max_steps must be >= 1, got -5"),
    (["--per_device_batch_size", "0"], "--per_device_batch_size must be >= 1, got 0"),
    (["--lr_schedule", "cosinus"], "--lr_schedule 'cosinus' is not one of"),
    (["--lr_schedule", "constant"], "use constant_with_warmup"),
    (["--mixed_precision", "fp8"], "--mixed_precision: invalid choice: 'fp8'"),
    (["--report_to", "wandbb"], "--report_to 'wandbb' is not a tracker"),
    (["--learning_rate", "-1"], "--learning_rate must be a finite number > 0"),
    (["--resume_from", "latest", "--overwrite_output_dir"], "give one of them"),
    (["--push_to_hub"], "--push_to_hub needs --hub_model_id"),
    (["--mlr_ranks", "3,3"], "model: mlr_ranks=[3, 3] sums to 6"),
    (["--attention", "mrl"], "model: attention='mrl' is not one of"),
    (["--seq_len", "999"], "--seq_len 999 exceeds n_positions=256"),
    (["--text_files", "no/such.txt"], "--text_files: no/such.txt is not a file"),
    (["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
    (["stray"], "unexpected argument 'stray'"),
])
def test_bad_arguments_are_one_line_errors_naming_the_field(argv, field):
    from hf_structattn.training.args import ConfigError

    with pytest.raises(ConfigError) as error:
        parse_clm(argv)
    assert field in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("text, message", [
    ("max_steps: 3\nmodel:\n  resid_prdop: 0.1\n", "under model: unknown field 'resid_prdop' (did you mean "
                                                    "'resid_pdrop'?)"),
    ("max_step: 3\n", "unknown field 'max_step' (did you mean 'max_steps'?)"),
    ("max_steps: 3\n  model: [1\n", "invalid YAML at line 2"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("lr_schedule: cosine_with_min_lrr\n", "--lr_schedule 'cosine_with_min_lrr' is not one of"),
    ("per_device_batch_size: 0\n", "--per_device_batch_size must be >= 1, got 0"),
    ("model:\n  mlr_ranks: [[1, 2]]\n", "mlr_ranks: expected a flat list"),
])
def test_bad_config_files_are_one_line_errors_naming_the_field(tmp_path, text, message):
    from hf_structattn.training.args import ConfigError

    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as error:
        parse_clm(["--config", str(config)])
    assert message in str(error.value) and "\n" not in str(error.value)
    broken_json = tmp_path / "bad.json"
    broken_json.write_text('{"max_steps": 3,}')
    with pytest.raises(ConfigError, match="bad.json: invalid JSON at line 1"):
        parse_clm(["--config", str(broken_json)])


def test_recipe_scripts_print_errors_as_one_line_without_traceback(tmp_path, monkeypatch, capsys):
    """The recipe entry points turn every ConfigError into `<recipe>: error: ...` and exit status 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  resid_prdop: 0.1\n")
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "train_clm.py"), "--config", str(bad)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"train_clm.py: error: --config {bad}, under model: unknown field 'resid_prdop' (did you mean 'resid_pdrop'?)"]
    # the same entry point (run_main) in this process for the other two recipes
    from hf_structattn.training import chronos_ft, icl
    from hf_structattn.training.args import run_main

    for module, script, argv in ((icl, "train_icl.py", ["--max_steps", "-5"]),
                                 (chronos_ft, "finetune_chronos.py", ["--init", "random"])):
        monkeypatch.setattr(sys, "argv", [script, *argv])
        with pytest.raises(SystemExit) as exit_info:
            run_main(module.main, script)
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{script}: error: --"), lines


def test_help_lists_every_field_with_default_and_help():
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "train_clm.py"), "--help"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200"))
    assert proc.returncode == 0, proc.stderr
    from hf_structattn.training.clm import CLMArgs, CLMModelArgs

    blocks = re.split(r"\n  (?=--)", proc.stdout)
    names = [f.name for cls in (CLMArgs, CLMModelArgs) for f in dataclasses.fields(cls) if f.init]
    assert len(names) > 60
    for name in names:
        block = next((b for b in blocks if b.startswith(f"--{name} ") or b.startswith(f"--{name},")), None)
        assert block is not None, name
        text = " ".join(block.split())
        assert "(default: " in text, name
        help_text = text.split("  ")[-1] if "  " in text else text
        assert len(text.split("(default:")[0].split()) > 3, f"{name}: no help text in {text!r}"
    assert "--mlr_ranks MLR_RANKS [MLR_RANKS ...]" in proc.stdout


# ------------------------------------------------------------------------------------------------ data


def test_stdlib_corpus_is_offline_deterministic_and_byte_tokenized():
    from hf_structattn.tokenization import build_byte_tokenizer
    from hf_structattn.training import data

    files = data.stdlib_python_files()
    assert files and not any("site-packages" in str(f) for f in files)
    first = data.load_stdlib_corpus(max_train_bytes=50_000, max_validation_bytes=20_000)
    again = data.load_stdlib_corpus(max_train_bytes=50_000, max_validation_bytes=20_000)
    assert torch.equal(first.train, again.train) and torch.equal(first.validation, again.validation)
    assert first.train.numel() == 50_000 and first.validation.numel() == 20_000
    root = data.stdlib_root()
    val_files = [f for f in files if data.is_validation(f.relative_to(root).as_posix(), 5.0)]
    assert 0 < len(val_files) < 0.1 * len(files)
    # the fast path (str.encode) gives exactly the saved tokenizer's ids
    text = files[0].read_text(encoding="utf-8", errors="replace")[:2000] + " é ü 中"
    ids, _ = data.encode_documents([text])
    assert build_byte_tokenizer()(text).input_ids == ids[:-1].tolist() and ids[-1] == data.EOS_ID


def test_text_files_corpus_through_datasets(tmp_path):
    from hf_structattn.training import data

    paths = []
    for i in range(40):
        path = tmp_path / f"doc{i}.txt"
        path.write_text(f"document {i}\n\nsecond paragraph\n")
        paths.append(str(path))
    corpus = data.load_text_files_corpus(paths, validation_percent=20)
    assert corpus.train_documents + corpus.validation_documents == 40 and corpus.validation_documents > 0
    assert bytes(corpus.train[:12].tolist()).startswith(b"document ")


# ------------------------------------------------------------------------------------------------ CLM


def test_clm_outputs_and_exact_resume(tmp_path):
    full = run_clm(tmp_path / "full")
    assert full["step"] == 8 and not full["interrupted"]
    part = run_clm(tmp_path / "part", "--stop_after_steps", 4)
    assert part["interrupted"] and part["step"] == 4
    resumed = run_clm(tmp_path / "part", "--resume_from", "latest")
    assert resumed["step"] == 8
    assert resumed["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)
    assert resumed["eval_bits_per_byte"] == pytest.approx(full["eval_bits_per_byte"], rel=1e-6)
    a, b = weights(tmp_path / "full"), weights(tmp_path / "part")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)

    out = tmp_path / "full"
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_structattn_gpt2.py", "tokenizer.json", "README.md",
            "metrics.jsonl", "final_metrics.json", "plots", "checkpoints"} <= files
    assert {p.name for p in (out / "plots").iterdir()} == {"loss_vs_steps.png", "loss_vs_flops.png"}
    card = (out / "README.md").read_text()
    for needle in ("mlr", "trust_remote_code=True", "key cache bytes", "FLOPs per token", "bits_per_byte",
                   "standard library"):
        assert needle in card, needle
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 9))
    assert [r["step"] for r in records if "eval/loss" in r] == [0, 4, 8]
    assert all(r["flops"] > 0 for r in records if "train/loss" in r)
    assert full["sample_key_cache_bytes"] < full["sample_dense_key_cache_bytes"]
    # the resumed run's log holds each step once (the resume dropped nothing it did not replay)
    lines = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == list(range(1, 9))
    assert [r["step"] for r in lines if "eval/loss" in r] == [0, 4, 8]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 64  # n_positions of the tiny model
    # the card names no local path (the output folder is a pytest tmp dir)
    assert str(tmp_path) not in card and "/tmp" not in card


def test_clm_refuses_a_sample_longer_than_n_positions_before_training(tmp_path):
    from hf_structattn.training.args import ConfigError

    with pytest.raises(ConfigError, match=r"--sample_new_tokens 61 \+ the 4-token --sample_prompt exceeds "
                                          r"n_positions=64"):
        run_clm(tmp_path / "run", "--sample_new_tokens", 61)
    assert not (tmp_path / "run").exists()


def test_resume_from_an_earlier_checkpoint_replays_and_numbers_new_checkpoints_after_old_ones(tmp_path):
    full = run_clm(tmp_path / "full", "--checkpoint_every", 2, "--checkpoints_total_limit", 3,
                   "--sample_new_tokens", 0)
    checkpoints = tmp_path / "full" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert json.loads((checkpoints / "checkpoint_1" / "run.json").read_text())["step"] == 4
    replay = run_clm(tmp_path / "full", "--checkpoint_every", 2, "--checkpoints_total_limit", 3,
                     "--sample_new_tokens", 0, "--resume_from", checkpoints / "checkpoint_1")
    assert replay["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)
    # accelerate kept the 3 newest saves; the replay's saves come after the old ones, so "latest" is the newest
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]
    assert json.loads((checkpoints / "checkpoint_5" / "run.json").read_text())["step"] == 8
    lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == list(range(1, 9))


def test_a_new_run_never_continues_the_run_in_its_output_folder(tmp_path):
    """Issue 11 item 1: a second run (another seed) into a finished run's folder used to pick up the old run's
    checkpoint, train 0 steps and save the old weights as its result."""
    from hf_structattn.training.args import ConfigError

    out = tmp_path / "out"
    first = run_clm(out, "--seed", 0, "--sample_new_tokens", 0)
    old_weights = weights(out)
    with pytest.raises(ConfigError, match=r"--output_dir .*out is not empty .*--overwrite_output_dir"):
        run_clm(out, "--seed", 1, "--sample_new_tokens", 0)
    # resuming with another configuration is refused, naming every differing field
    with pytest.raises(ConfigError) as error:
        run_clm(out, "--seed", 1, "--learning_rate", 0.01, "--n_layer", 1, "--sample_new_tokens", 0,
                "--resume_from", "latest")
    message = str(error.value)
    assert "seed (0 -> 1)" in message and "learning_rate (0.003 -> 0.01)" in message
    assert "model.n_layer (2 -> 1)" in message and "\n" not in message
    # nothing was touched by the refused runs
    for name, tensor in weights(out).items():
        assert torch.equal(tensor, old_weights[name]), name
    # --overwrite_output_dir: a clean new run, the same as one in a fresh folder
    second = run_clm(out, "--seed", 1, "--sample_new_tokens", 0, "--overwrite_output_dir")
    fresh = run_clm(tmp_path / "fresh", "--seed", 1, "--sample_new_tokens", 0)
    assert second["eval_loss"] == pytest.approx(fresh["eval_loss"], rel=1e-6) != first["eval_loss"]
    a, b = weights(out), weights(tmp_path / "fresh")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=name)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == list(range(1, 9))  # one run's log only
    configs = [r for r in lines if r.get("event") == "config"]
    assert len(configs) == 1 and configs[0]["config"]["args"]["seed"] == 1
    assert json.loads((out / "run_config.json").read_text())["args"]["seed"] == 1
    # a folder that holds something else is refused too, and a file is not a folder
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        run_clm(tmp_path / "other")
    with pytest.raises(ConfigError, match="no checkpoint under"):
        run_clm(tmp_path / "empty", "--resume_from", "latest")
    with pytest.raises(ConfigError, match="is not a folder"):
        run_clm(tmp_path / "other" / "notes.txt")


def test_gradient_accumulation_matches_the_large_batch(tmp_path):
    big = run_clm(tmp_path / "big", "--max_steps", 3, "--eval_every", 0, "--checkpoint_every", 0,
                  "--sample_new_tokens", 0)
    accum = run_clm(tmp_path / "accum", "--max_steps", 3, "--eval_every", 0, "--checkpoint_every", 0,
                    "--sample_new_tokens", 0, "--per_device_batch_size", 2, "--gradient_accumulation_steps", 2)
    assert accum["eval_loss"] == pytest.approx(big["eval_loss"], rel=1e-5)


def test_bf16_and_mup_flags_train(tmp_path):
    result = run_clm(tmp_path / "bf16", "--max_steps", 3, "--eval_every", 0, "--checkpoint_every", 0,
                     "--sample_new_tokens", 0, "--mixed_precision", "bf16", "--mup", "--attention", "bilinear_mlr",
                     "--bilinear_mlr_ranks", "8,4", "--qk_layernorm", "true")
    assert torch.isfinite(torch.tensor(result["eval_loss"]))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["attention"] == "bilinear_mlr" and config["bilinear_scaling"] == "mup"


def test_push_to_hub_checks_the_hub_first_and_uploads_the_output_folder(tmp_path, monkeypatch):
    """Only the Hub network boundary (HfApi.whoami / create_repo / upload_folder) is replaced."""
    import huggingface_hub

    calls = []

    def fake_whoami(self, *args, **kwargs):
        calls.append(("whoami", None, {"trained": (tmp_path / "hub" / "metrics.jsonl").exists()}))
        return {"name": "someone"}

    def fake_create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, dict(kwargs, trained=(tmp_path / "hub" / "metrics.jsonl").exists())))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def fake_upload_folder(self, *, repo_id, folder_path, **kwargs):
        listing = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        calls.append(("upload_folder", repo_id, dict(kwargs, folder_path=folder_path, listing=listing)))

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", fake_whoami)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake_upload_folder)
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("def f(x):\n    return x + 1\n" * 3000)
    result = run_clm(tmp_path / "hub", "--max_steps", 2, "--eval_every", 0, "--sample_new_tokens", 0,
                     "--push_to_hub", "--hub_model_id", "someone/tiny-mlr", "--text_files", text_file)
    assert [c[0] for c in calls] == ["whoami", "create_repo", "upload_folder"]
    assert not calls[0][2]["trained"] and not calls[1][2]["trained"]  # checked before any training
    assert calls[1][1] == "someone/tiny-mlr" and calls[1][2]["exist_ok"] is True
    upload = calls[2][2]
    assert calls[2][1] == "someone/tiny-mlr" and upload["folder_path"] == str(tmp_path / "hub")
    assert "checkpoints/*" in upload["ignore_patterns"]
    import fnmatch

    listing = {p for p in upload["listing"] if not any(fnmatch.fnmatch(p, pattern)
                                                      for pattern in upload["ignore_patterns"])}
    assert not any(p.startswith("checkpoints/") for p in listing) and "run_config.json" not in listing
    assert {"config.json", "model.safetensors", "modeling_structattn_gpt2.py", "structattn_mlr.py",
            "structattn_mlr_fused.py", "structattn_mlr_math.py", "tokenizer.json", "README.md",
            "plots/loss_vs_steps.png", "metrics.jsonl"} <= listing
    # no local absolute path in any uploaded text file
    for name in listing:
        if name.endswith((".json", ".jsonl", ".md", ".py", ".txt")):
            assert str(tmp_path) not in (tmp_path / "hub" / name).read_text(), name
    card = (tmp_path / "hub" / "README.md").read_text()
    assert 'path = "someone/tiny-mlr"' in card and "from_pretrained(path, trust_remote_code=True)" in card
    from huggingface_hub import ModelCard

    data = ModelCard.load(tmp_path / "hub" / "README.md").data
    assert data.library_name == "transformers" and data.license == "apache-2.0"
    assert data.pipeline_tag == "text-generation" and "hf_structattn" in data.tags
    assert data.eval_results[0].metric_type == "bits_per_byte"
    assert data.eval_results[0].metric_value == pytest.approx(result["eval_bits_per_byte"])
    assert result["hub_repo_id"] == "someone/tiny-mlr"


def test_push_to_hub_offline_or_without_token_fails_before_training(tmp_path, monkeypatch):
    import time

    import huggingface_hub

    from hf_structattn.training.args import ConfigError

    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="--push_to_hub: the Hub is unreachable in offline mode"):
        run_clm(tmp_path / "offline", "--push_to_hub", "--hub_model_id", "someone/x")  # HF_HUB_OFFLINE=1 here
    assert time.perf_counter() - started < 30 and not (tmp_path / "offline").exists()

    def no_token(self, *args, **kwargs):
        raise huggingface_hub.errors.LocalTokenNotFoundError("Token is required but no token found.")

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", no_token)
    with pytest.raises(ConfigError, match="cannot authenticate with the Hub.*LocalTokenNotFoundError"):
        run_clm(tmp_path / "notoken", "--push_to_hub", "--hub_model_id", "someone/x")
    assert not (tmp_path / "notoken").exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_cpu_processes_match_one_process(tmp_path):
    common = ["--config", TINY_CLM, "--max_steps", "4", "--eval_every", "2", "--checkpoint_every", "2",
              "--sample_new_tokens", "0"]
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(_free_port()), "--mixed_precision", "no",
               "--dynamo_backend", "no", str(ROOT / "recipes" / "train_clm.py"), *common,
               "--per_device_batch_size", "2", "--output_dir", str(tmp_path / "two")]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = run_clm(tmp_path / "one", *common[2:], "--per_device_batch_size", 4)
    two = json.loads((tmp_path / "two" / "final_metrics.json").read_text())
    assert two["tokens_per_step"] == one["tokens_per_step"]  # the same global batch
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
    # only rank 0 wrote: the same files as the 1-process run plus rank 1's RNG state inside each checkpoint,
    # and each log line once
    def tree(root):
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    extra = tree(tmp_path / "two") - tree(tmp_path / "one")
    assert extra == {"checkpoints/checkpoint_0/random_states_1.pkl", "checkpoints/checkpoint_1/random_states_1.pkl"}
    assert tree(tmp_path / "one") - tree(tmp_path / "two") == set()
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3, 4]
    assert sum(r.get("event") == "config" for r in lines) == 1


def test_main_job_reload_script_uses_only_the_saved_code(tmp_path):
    """scripts/reload_and_generate.py (the last step of scripts/run.sh): a fresh interpreter that cannot import
    hf_structattn loads the recipe's output with trust_remote_code, generates with the hierarchical key cache and
    reports fewer key bytes than full-width keys, with the tokens of uncached generation."""
    run_clm(tmp_path / "out", "--max_steps", 2, "--eval_every", 0, "--sample_new_tokens", 0)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "reload_and_generate.py"), str(tmp_path / "out"),
                           "--max_new_tokens", "40"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hf_structattn not importable" in proc.stdout and "transformers_modules" in proc.stdout
    assert "same tokens without a cache: True" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("key cache bytes"))
    mlr, dense = (int(v.replace(",", "")) for v in re.findall(r"([\d,]+) vs full-width keys ([\d,]+)", line)[0])
    assert 0 < mlr < dense


# ------------------------------------------------------------------------------------------------ ICL


ICL_TINY = ["--n_dims", "2", "--per_device_batch_size", "64", "--learning_rate", "1e-3", "--warmup_steps", "10",
            "--lr_schedule", "constant_with_warmup", "--eval_prompts", "128", "--disable_tqdm", "--n_embd", "32",
            "--n_layer", "2", "--n_head", "2", "--attention", "dense", "--qk_norm", "layernorm"]
# (LayerNorm: at d = 2 it leaves the plateau within the 200 steps these tests afford; the recipe's default RMSNorm
# stays on it longer with this config and seed)


def test_icl_learns_on_fresh_prompts(tmp_path):
    from hf_structattn.training.icl import ICLArgs, eval_set, main, train_batch

    # (the plateau escape of this tiny task is sensitive to the warm-up: 200 steps leave a margin)
    result = main(ICL_TINY + ["--output_dir", str(tmp_path / "icl"), "--max_steps", "200", "--eval_every", "200",
                              "--checkpoint_every", "0"])
    records = [json.loads(x) for x in (tmp_path / "icl" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/mse" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 200
    assert evals[-1]["eval/mse"] < 0.95 * evals[0]["eval/mse"]
    assert evals[0]["eval/baseline_zero_mse"] == pytest.approx(evals[0]["eval/mse"], rel=0.05)  # zero read-out
    assert result["eval_mse_last"] > 0
    # the evaluation prompts are never among the training prompts
    args = ICLArgs(n_dims=2, per_device_batch_size=64, eval_prompts=128)
    eval_w = eval_set(args)[2]
    for step in range(100):
        train_w = train_batch(args, step, world=1)[2]
        assert not (torch.cdist(eval_w, train_w) < 1e-6).any()
    assert (tmp_path / "icl" / "modeling_structattn_gpt2.py").exists()
    config = json.loads((tmp_path / "icl" / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_structattn_gpt2.StructAttnGPT2ForInContextRegression"
    from hf_structattn import StructAttnGPT2ForInContextRegression

    # (in this process hf_structattn's local Auto registration wins over auto_map; remote loading of the same
    # files is what test_remote_code covers)
    reloaded = StructAttnGPT2ForInContextRegression.from_pretrained(str(tmp_path / "icl")).eval()
    xs, ys, _ = eval_set(args)
    with torch.no_grad():
        assert reloaded(xs=xs, ys=ys).loss.item() == pytest.approx(result["eval_mse"], rel=1e-5)
    assert "trust_remote_code=True" in (tmp_path / "icl" / "README.md").read_text()


def test_icl_curriculum_and_exact_resume(tmp_path):
    from hf_structattn.training.icl import ICLArgs, curriculum_state, main, train_batch

    args = ICLArgs(n_dims=8, curriculum=True, curriculum_dims_start=4, curriculum_points_start=8,
                   curriculum_interval=10, curriculum_dims_increment=2, curriculum_points_increment=4)
    assert [curriculum_state(args, s) for s in (0, 9, 10, 25, 1000)] == [(4, 8), (4, 8), (6, 12), (8, 16), (8, 16)]
    xs, ys, w = train_batch(args, 0, world=1)
    assert xs.shape[1:] == (8, 8) and (xs[..., 4:] == 0).all() and (xs[..., :4] != 0).all()
    curriculum = ["--curriculum", "--curriculum_interval", "3", "--curriculum_dims_start", "1",
                  "--curriculum_points_start", "2", "--max_steps", "6", "--eval_every", "3", "--checkpoint_every", "3"]
    full = main(ICL_TINY + curriculum + ["--output_dir", str(tmp_path / "full")])
    main(ICL_TINY + curriculum + ["--output_dir", str(tmp_path / "part"), "--stop_after_steps", "3"])
    resumed = main(ICL_TINY + curriculum + ["--output_dir", str(tmp_path / "part"), "--resume_from",
                                            str(tmp_path / "part" / "checkpoints" / "checkpoint_0")])
    assert resumed["eval_mse"] == pytest.approx(full["eval_mse"], rel=1e-6)


# ------------------------------------------------------------------------------------------------ Chronos


def test_finetune_chronos_tiny_end_to_end(tmp_path):
    pytest.importorskip("chronos")
    pytest.importorskip("statsmodels")
    from chronos import ChronosPipeline

    from hf_structattn.training.chronos_ft import main

    out = tmp_path / "chronos"
    result = main(["--config", str(ROOT / "configs" / "chronos_tiny_mlr.yaml"), "--output_dir", str(out),
                   "--max_steps", "4", "--eval_every", "4", "--checkpoint_every", "2", "--synthetic_series", "16",
                   "--synthetic_eval_series", "2", "--real_datasets", "nile,sunspots", "--eval_num_samples", "4",
                   "--per_device_batch_size", "4", "--disable_tqdm"])
    assert result["step"] == 4
    for key in ("eval_mase", "eval_wql", "eval_loss"):
        assert result[key] > 0 and torch.isfinite(torch.tensor(result[key])), key
    assert "patch_logit_rel" in result
    config = json.loads((out / "config.json").read_text())
    assert "chronos_config" in config and config["model_type"] != "t5"
    assert (out / "README.md").exists() and (out / "plots" / "loss_vs_flops.png").exists()
    pipe = ChronosPipeline.from_pretrained(str(out), trust_remote_code=True)
    forecast = pipe.predict(torch.arange(40, dtype=torch.float32), prediction_length=8, num_samples=3)
    assert forecast.shape == (1, 3, 8)


def test_finetune_chronos_dense_baseline_keeps_stock_attention(tmp_path):
    """``--attention dense`` trains the unpatched T5 (experiment 3's baseline); FLOPs come from the saved config."""
    pytest.importorskip("chronos")
    pytest.importorskip("statsmodels")
    from transformers import AutoConfig

    from hf_structattn.flops import encoder_decoder_flops
    from hf_structattn.training.chronos_ft import main

    common = ["--config", str(ROOT / "configs" / "chronos_tiny_mlr.yaml"), "--max_steps", "2", "--eval_every", "2",
              "--checkpoint_every", "100", "--synthetic_series", "8", "--synthetic_eval_series", "2",
              "--real_datasets", "nile", "--eval_num_samples", "2", "--per_device_batch_size", "4",
              "--real_eval_windows", "2", "--disable_tqdm"]
    dense = main(common + ["--attention", "dense", "--output_dir", str(tmp_path / "dense")])
    mlr = main(common + ["--attention", "mlr", "--output_dir", str(tmp_path / "mlr")])
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert config["model_type"] == "t5" and "chronos_config" in config
    assert not any(key.startswith("patch_") for key in dense)
    window = (dense["context_length"] + 1, dense["prediction_length"] + 1)  # + EOS on both sides
    # the counts take the configs the models are built from (a stock T5Config here, a StructAttnT5Config below)
    assert dense["flops_per_window"] == encoder_decoder_flops(AutoConfig.from_pretrained(tmp_path / "dense"), *window)
    mlr_config = AutoConfig.from_pretrained(tmp_path / "mlr")
    assert type(mlr_config).__name__ == "StructAttnT5Config"
    assert mlr["flops_per_window"] == encoder_decoder_flops(mlr_config, *window) < dense["flops_per_window"]
    assert dense["training_flops"] == pytest.approx(2 * dense["tokens_per_step"] * dense["flops_per_token"])


def test_forecast_task_holds_out_the_same_targets_for_every_context_length():
    pytest.importorskip("statsmodels")
    from hf_structattn.training.timeseries import build_task, real_series

    tasks = {c: build_task(c, 8, 4, 3, ["nile", "sunspots"], seed=0, series_length=96, eval_context_length=64,
                           real_eval_windows=3) for c in (16, 48)}
    short, long = tasks[16], tasks[48]
    assert short.eval_names == long.eval_names and len(short.eval_names) == 3 + 2 * 3
    for a, b in zip(short.eval_targets, long.eval_targets):
        np.testing.assert_array_equal(a, b)
    sunspots = real_series(["sunspots"])["sunspots"]
    held = [i for i, name in enumerate(long.eval_names) if name.startswith("sunspots")]
    # three consecutive horizons at the end, each preceded by up to 64 points of its own history
    np.testing.assert_array_equal(np.concatenate([long.eval_targets[i] for i in held]), sunspots[-24:])
    end = sunspots.size - 24
    np.testing.assert_array_equal(long.eval_contexts[held[0]], sunspots[end - 64:end])
    # nothing held out leaks into the training pool
    assert any(s.size == end and np.array_equal(s, sunspots[:end]) for s in long.train_pool)
    assert all(s.size == 96 for s in long.train_pool[:4])
    with pytest.raises(ValueError, match="real_eval_windows"):
        build_task(16, 8, 4, 3, ["nile"], seed=0, real_eval_windows=0)
    with pytest.raises(ValueError, match="series_length"):
        build_task(16, 8, 4, 3, ["nile"], seed=0, series_length=20)
    with pytest.raises(ValueError, match="eval_context_length"):
        build_task(16, 8, 4, 3, ["nile"], seed=0, eval_context_length=0)


def test_finetune_chronos_resume_is_exact_with_dropout(tmp_path):
    """The tiny Chronos-T5 trains with dropout 0.1: exact resume needs the RNG states of the checkpoint."""
    pytest.importorskip("chronos")
    pytest.importorskip("statsmodels")
    from hf_structattn.training.chronos_ft import main

    common = ["--config", str(ROOT / "configs" / "chronos_tiny_mlr.yaml"), "--max_steps", "4", "--eval_every", "0",
              "--checkpoint_every", "2", "--synthetic_series", "8", "--synthetic_eval_series", "2",
              "--real_datasets", "nile", "--eval_num_samples", "2", "--per_device_batch_size", "4",
              "--disable_tqdm", "--init", "split"]
    full = main(common + ["--output_dir", str(tmp_path / "full")])
    main(common + ["--output_dir", str(tmp_path / "part"), "--stop_after_steps", "2"])
    resumed = main(common + ["--output_dir", str(tmp_path / "part"), "--resume_from", "latest"])
    assert resumed["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)
    a, b = weights(tmp_path / "full"), weights(tmp_path / "part")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("config_name", sorted(p.name for p in (ROOT / "configs").iterdir()
                                               if p.suffix in (".yaml", ".yml", ".json")))
def test_shipped_configs_parse_and_build(config_name):
    """Every config in configs/ is valid for its recipe (fields known, every field validated, model buildable)."""
    from hf_structattn.training import chronos_ft, clm, icl
    from hf_structattn.training.args import parse_recipe_args

    path = str(ROOT / "configs" / config_name)
    if config_name.startswith("clm"):
        args = parse_recipe_args(clm.CLMArgs, clm.CLMModelArgs, ["--config", path])
        model = clm.build_model(args)
        assert model.config.vocab_size == 257
    elif config_name.startswith("icl"):
        args = parse_recipe_args(icl.ICLArgs, icl.ICLModelArgs, ["--config", path])
        model = icl.build_model(args)
        assert model.config.icl_input_dim == args.n_dims
    elif config_name.startswith("chronos"):
        args = parse_recipe_args(chronos_ft.ChronosArgs, chronos_ft.ChronosModelArgs, ["--config", path])
        assert args.init in ("split", "svd")
    elif config_name.startswith("accelerate"):
        import yaml

        assert yaml.safe_load((ROOT / "configs" / config_name).read_text())["distributed_type"] == "FSDP"
    else:
        pytest.fail(f"configs/{config_name}: no recipe prefix (clm_, icl_, chronos_, accelerate_)")


def test_eval_windows_cover_the_whole_validation_split():
    from hf_structattn.training.data import eval_windows

    tokens = torch.arange(1000)
    windows = eval_windows(tokens, 10, 8)
    assert windows.shape == (8, 10)
    starts = windows[:, 0].tolist()
    assert starts[0] == 0 and starts[-1] >= 800  # reaches the end of the split, not only its first 80 tokens
    assert all(b - a >= 10 for a, b in zip(starts, starts[1:]))  # no overlap
    torch.testing.assert_close(windows[3], tokens[starts[3]:starts[3] + 10])
    assert eval_windows(tokens, 10, 1000).shape == (100, 10)  # capped by what fits


def test_fsdp2_on_two_cpu_processes_trains_an_mlr_model_like_one_process(tmp_path):
    """The MLR model trains under FSDP2 (torch's fully_shard per block + root, as configs/accelerate_fsdp.yaml asks
    accelerate for on GPUs) on 2 gloo processes exactly like one process on the whole batch (float64)."""
    worker = str(ROOT / "tests" / "fsdp_train_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), worker, str(tmp_path / "two.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, worker, str(tmp_path / "one.pt")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["losses"][-1] < one["losses"][0]
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-12)
    assert one["state"].keys() == two["state"].keys()
    for name, tensor in one["state"].items():
        assert tensor.dtype == torch.float64
        torch.testing.assert_close(two["state"][name], tensor, rtol=1e-9, atol=1e-11, msg=name)
