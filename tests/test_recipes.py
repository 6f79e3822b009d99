"""The accelerate recipes end to end on tiny models: arguments, offline data, outputs, exact resume,
accumulation / multi-process equivalence, Hub upload (only the network is faked), Chronos fine-tuning."""

import dataclasses
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import commit_sends

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


# ------------------------------------------------------------------------------------------------ the four recipes

ICL_TINY = ["--n_dims", "2", "--per_device_batch_size", "64", "--learning_rate", "1e-3", "--warmup_steps", "10",
            "--lr_schedule", "constant_with_warmup", "--eval_prompts", "128", "--disable_tqdm", "--n_embd", "32",
            "--n_layer", "2", "--n_head", "2", "--attention", "dense", "--qk_norm", "layernorm"]
# (LayerNorm: at d = 2 it leaves the plateau within the 200 steps these tests afford; the recipe's default RMSNorm
# stays on it longer with this config and seed)
CHRONOS_TINY = ["--disable_tqdm", "--config", str(ROOT / "configs" / "chronos_tiny_mlr.yaml"), "--synthetic_series",
                "8", "--synthetic_eval_series", "2", "--real_datasets", "nile", "--eval_num_samples", "2",
                "--per_device_batch_size", "4", "--real_eval_windows", "2", "--init", "split"]
PATCHED_TINY = ["--disable_tqdm", "--pretrain_steps", "4", "--seq_len", "32", "--per_device_batch_size", "4",
                "--eval_windows", "4", "--max_train_bytes", "60000", "--max_validation_bytes", "20000",
                "--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "2",
                "--num_attention_heads", "2", "--num_key_value_heads", "1", "--mlr_ranks", "8", "4", "4",
                "--mlr_block_sizes", "16", "8", "--sample_new_tokens", "4", "--learning_rate", "3e-3",
                "--warmup_steps", "2"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One of the four recipes, as the contract tests drive it: its module, argument classes, script and a tiny
    configuration that trains in about a second."""

    name: str
    module: str
    args_class: str
    model_class: str
    tiny: tuple
    needs: tuple = ()

    @property
    def script(self) -> str:
        return f"{self.name}.py"

    def load(self):
        for package in self.needs:
            pytest.importorskip(package)
        import importlib

        return importlib.import_module(f"hf_structattn.training.{self.module}")

    def parse(self, argv):
        from hf_structattn.training.args import parse_recipe_args

        module = self.load()
        return parse_recipe_args(getattr(module, self.args_class), getattr(module, self.model_class), argv)

    def argv(self, output_dir, *extra) -> list:
        return [*self.tiny, "--output_dir", str(output_dir), *map(str, extra)]

    def run(self, output_dir, *extra) -> dict:
        return self.load().main(self.argv(output_dir, *extra))


RECIPES = {recipe.name: recipe for recipe in (
    Recipe("train_clm", "clm", "CLMArgs", "CLMModelArgs", ("--config", TINY_CLM, "--sample_new_tokens", "0")),
    Recipe("train_icl", "icl", "ICLArgs", "ICLModelArgs", tuple(ICL_TINY)),
    # (the tiny Chronos-T5 trains with dropout 0.1: its exact resume needs the checkpoint's RNG states)
    Recipe("finetune_chronos", "chronos_ft", "ChronosArgs", "ChronosModelArgs", tuple(CHRONOS_TINY),
           needs=("chronos", "statsmodels")),
    Recipe("finetune_patched", "decoder_ft", "PatchedFinetuneArgs", "PatchedModelArgs", tuple(PATCHED_TINY)),
)}
SHORT_RUN = ("--max_steps", 4, "--eval_every", 2, "--checkpoint_every", 2)


def run_capturing_stdout(recipe: Recipe, output_dir, *extra) -> tuple[dict, str]:
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        result = recipe.run(output_dir, *extra)
    return result, stdout.getvalue()


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(scope="module", params=list(RECIPES))
def interrupted_and_resumed(request, tmp_path_factory):
    """Per recipe: an uninterrupted 4-step run, and one stopped after step 2 and resumed with --resume_from latest."""
    recipe = RECIPES[request.param]
    recipe.load()
    root = tmp_path_factory.mktemp(recipe.name)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        full, full_stdout = run_capturing_stdout(recipe, root / "full", *SHORT_RUN)
        reset_accelerate()
        part, _ = run_capturing_stdout(recipe, root / "part", *SHORT_RUN, "--stop_after_steps", 2)
        reset_accelerate()
        resumed, resumed_stdout = run_capturing_stdout(recipe, root / "part", *SHORT_RUN, "--resume_from", "latest")
        reset_accelerate()
    finally:
        torch.set_default_dtype(dtype)
    return dict(recipe=recipe, root=root, full=full, part=part, resumed=resumed, full_stdout=full_stdout,
                resumed_stdout=resumed_stdout)


def test_resume_is_exact(interrupted_and_resumed):
    """--resume_from latest ends with the uninterrupted run's metrics and weights (every recipe)."""
    runs = interrupted_and_resumed
    assert runs["part"]["interrupted"] and runs["part"]["step"] == 2
    full, resumed = runs["full"], runs["resumed"]
    assert resumed["step"] == full["step"] == 4 and not resumed["interrupted"]
    evals = sorted(k for k in full if k.startswith("eval_") and isinstance(full[k], float))
    assert evals
    for key in evals:
        assert resumed[key] == pytest.approx(full[key], rel=1e-6, abs=1e-9), key
    a, b = weights(runs["root"] / "full"), weights(runs["root"] / "part")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    lines = [json.loads(x) for x in (runs["root"] / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3, 4]  # each step once
    assert [r["step"] for r in lines if "eval/loss" in r or "eval/mse" in r] == [0, 2, 4]


def test_resumed_summary_counts_only_the_steps_run_here(interrupted_and_resumed):
    """Issue 23 item 2: the resumed run ran 2 of the 4 steps; its summary said "4 steps"."""
    runs = interrupted_and_resumed
    assert runs["full"]["steps_run"] == 4 and runs["resumed"]["steps_run"] == 2
    assert re.search(r"== run finished: 4 steps in [\d.]+ s \(", runs["full_stdout"])
    assert re.search(r"== run finished: 2 steps in [\d.]+ s \(resumed at step 2, 4 in total\)",
                     runs["resumed_stdout"]), runs["resumed_stdout"][-2000:]


def test_resume_latest_of_a_finished_run_says_it_is_complete(interrupted_and_resumed, monkeypatch, capsys):
    """Issue 23 item 2: `--resume_from latest` on a finished run trained 0 steps and reported "4 steps in 0.0 s"; it
    must say the run is complete, exit 0 and change nothing."""
    from hf_structattn.training.args import run_main

    runs = interrupted_and_resumed
    recipe, out = runs["recipe"], runs["root"] / "full"
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    monkeypatch.setattr(sys, "argv", [recipe.script, *recipe.argv(out, *SHORT_RUN, "--resume_from", "latest")])
    run_main(recipe.load().main, recipe.script)  # returns: exit status 0
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.strip()]
    assert lines == [f"{recipe.script}: the run in {out} is already complete (checkpoint_1 is at step 4 of 4, final "
                     f"metrics in {out / 'final_metrics.json'}); nothing to train. To upload it (again): "
                     f"hf-structattn push {out} --repo-id USER/NAME"], captured.out
    after = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_a_run_whose_final_save_was_killed_is_not_complete_and_resume_writes_it_again(tmp_path, monkeypatch,
                                                                                       capsys):
    """The resume's "already complete" uses the one definition of a finished run (push's): a run whose final
    model.safetensors is half-written (the save killed midway) is not complete; --resume_from latest loads the last
    checkpoint, trains nothing and writes the outputs again, the same weights as the first time."""
    out = tmp_path / "run"
    code, lines = _resume_via_entry_point(out, monkeypatch, capsys, "--max_steps", 2)
    assert code == 0, lines
    expected = {name: tensor.clone() for name, tensor in weights(out).items()}  # (load_file maps the file)
    _truncate(out / "model.safetensors")
    code, lines = _resume_via_entry_point(out, monkeypatch, capsys, "--max_steps", 2, "--resume_from", "latest")
    assert code == 0, lines
    from hf_structattn.training.outputs import finished_run

    finished_run(out)  # a finished run again
    got = weights(out)
    assert got.keys() == expected.keys() and all(torch.equal(got[name], expected[name]) for name in expected)


COMMON_BAD_ARGUMENTS = [
    (["--max_steps", "-5"], "--max_steps must be >= 1, got -5"),
    (["--max_steps", "many"], "--max_steps: invalid int value: 'many'"),
    (["--max_stpes", "3"], "unknown field 'max_stpes' (did you mean 'max_steps'?)"),
    (["--per_device_batch_size", "0"], "--per_device_batch_size must be >= 1, got 0"),
    (["--lr_schedule", "cosinus"], "--lr_schedule 'cosinus' is not one of"),
    (["--lr_schedule", "constant", "--warmup_steps", "5"], "use constant_with_warmup"),
    (["--mixed_precision", "fp8"], "--mixed_precision: invalid choice: 'fp8'"),
    (["--report_to", "wandbb"], "--report_to 'wandbb' is not a tracker"),
    (["--learning_rate", "-1"], "--learning_rate must be a finite number > 0"),
    (["--resume_from", "latest", "--overwrite_output_dir"], "give one of them"),
    (["--push_to_hub"], "--push_to_hub needs --hub_model_id"),
    (["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
    (["stray"], "unexpected argument 'stray'"),
]
RECIPE_BAD_ARGUMENTS = {
    "train_clm": [(["--mlr_ranks", "3,3"], "model: mlr_ranks=[3, 3] sums to 6"),
                  (["--n_embed", "3"], "n_embed' (did you mean 'n_embd'"),
                  (["--attention", "mrl"], "model: attention='mrl' is not one of"),
                  (["--seq_len", "999"], "--seq_len 999 exceeds n_positions=64"),
                  (["--text_files", "no/such.txt"], "--text_files: no/such.txt is not a file")],
    "train_icl": [(["--n_dims", "0"], "--n_dims must be >= 1, got 0"),
                  (["--attention", "mrl"], "attention='mrl' is not one of")],
    "finetune_chronos": [(["--init", "random"], "--init 'random' is not one of split, svd"),
                         (["--mlr_ranks", "7", "9"], "--mlr_ranks/--mlr_block_sizes for d_kv=8")],
    "finetune_patched": [(["--mlr_ranks", "7", "5", "4"], "patch: mlr_ranks=[7, 5, 4] splits a RoPE rotation pair"),
                         (["--mlr_ranks", "8", "8"], "mlr_block_sizes"),
                         (["--mlr_ranks", "4", "4"], "patch: mlr_ranks=[4, 4] sums to 8, but the head dim is 16"),
                         (["--layers", "5"], "patch: layers: 5 is not a layer index in [0, 2)"),
                         (["--mlr_max_length", "64"], "--mlr_block_sizes [16, 8] and --mlr_max_length 64: give one"),
                         (["--sliding_window_layers", "keep"], "--sliding_window_layers 'keep' is not one of"),
                         (["--level_order", "frequncy"], "--level_order='frequncy' is not one of 'frequency', "
                                                         "'index', 'contribution' (did you mean 'frequency'?)"),
                         (["--calibration_windows", "0"], "--calibration_windows must be >= 1, got 0"),
                         (["--pretrain_steps", "-1"], "--pretrain_steps must be >= 0, got -1"),
                         (["--seq_len", "5000"], "--seq_len 5000 exceeds the source's max_position_embeddings=4096"),
                         (["--model_path", "no/such"], "--model_path no/such: not a model folder"),
                         (["--num_attention_heads", "3"], "model: The hidden size (32) is not a multiple of the "
                                                          "number of attention heads (3)"),
                         (["--text_files", "no/such.txt"], "--text_files: no/such.txt is not a file")],
}


@pytest.mark.parametrize("recipe_name, argv, message", [
    (name, argv, message) for name in RECIPES for argv, message in COMMON_BAD_ARGUMENTS + RECIPE_BAD_ARGUMENTS[name]])
def test_bad_arguments_are_one_line_errors_naming_the_field(recipe_name, argv, message):
    from hf_structattn.training.args import ConfigError

    recipe = RECIPES[recipe_name]
    with pytest.raises(ConfigError) as error:
        recipe.parse([*recipe.tiny, *argv])
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


BAD_CONFIG_FILES = [
    ("max_step: 3\n", "unknown field 'max_step' (did you mean 'max_steps'?)"),
    ("max_steps: 3\n  model: [1\n", "invalid YAML at line 2"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("lr_schedule: cosine_with_min_lrr\n", "--lr_schedule 'cosine_with_min_lrr' is not one of"),
    ("per_device_batch_size: 0\n", "--per_device_batch_size must be >= 1, got 0"),
    ("model:\n  no_such_field: 1\n", "under model: unknown field 'no_such_field'"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not a YAML or JSON text file (byte 0x89 at offset 0"),
    (b"max_steps: 3\x00\x00", "not a YAML or JSON text file (it holds NUL bytes)"),
]


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("text, message", BAD_CONFIG_FILES)
def test_bad_config_files_are_one_line_errors_naming_the_field(tmp_path, recipe_name, text, message):
    from hf_structattn.training.args import ConfigError

    recipe = RECIPES[recipe_name]
    config = tmp_path / "bad.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as error:
        recipe.parse(["--config", str(config)])
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    broken_json = tmp_path / "bad.json"
    broken_json.write_text('{"max_steps": 3,}')
    with pytest.raises(ConfigError, match="bad.json: invalid JSON at line 1"):
        recipe.parse(["--config", str(broken_json)])


@pytest.mark.parametrize("recipe_name", ["train_clm", "finetune_patched"])
@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"def f():\n    return '\xe9t\xe9'\n", "is not UTF-8 text (byte 0xe9 at offset {offset}: invalid continuation "
                                         "byte)"),
])
def test_text_files_that_are_empty_or_not_utf8_are_one_line_errors(tmp_path, recipe_name, content, message):
    """Issue 20 item 11: both gave a raw traceback from inside datasets' text loader."""
    from hf_structattn.training.args import ConfigError

    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("x = 1\n" * 100)
    bad.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        RECIPES[recipe_name].parse(["--text_files", str(good), str(bad)])
    offset = content.find(b"\xe9")  # the first byte that is not UTF-8
    assert str(error.value) == f"--text_files: {bad} {message.format(offset=offset)}"


@pytest.mark.parametrize("recipe_name", ["train_clm", "finetune_patched"])
def test_a_text_corpus_shorter_than_one_window_is_a_one_line_error_naming_the_flag(tmp_path, recipe_name):
    """It stopped the recipes with a traceback (a ValueError of training/data.py, not the recipes' ConfigError)."""
    from hf_structattn.training.args import ConfigError

    short = tmp_path / "short.txt"
    short.write_text("x = 1\n" * 4)  # 24 bytes: shorter than one window of 32 (finetune_patched) or 64 (train_clm)
    with pytest.raises(ConfigError) as error:
        RECIPES[recipe_name].run(tmp_path / "out", "--text_files", short)
    message = str(error.value)
    assert re.fullmatch(r"--seq_len (32|64): the (training|validation) text has \d+ tokens, fewer than one window; "
                        r"pass a smaller --seq_len or more (training|validation) text \(--(eval_)?text_files.*\)",
                        message), message


def test_a_validation_split_shorter_than_one_window_names_eval_text_files(tmp_path, capfd):
    """The guide's recovery command on SmolLM2 stopped after 15 s with a traceback: 5 % of 39 topic files by sha1 held
    347 tokens, fewer than one window of 2,048. The one-line error says what to pass: held-out files of their own."""
    from hf_structattn.training.args import ConfigError
    from hf_structattn.training.data import is_validation

    files, held_out = [], 0
    for index in range(400):  # the validation split (5 % of the files by sha1 of their path): a short file or two
        files.append(tmp_path / f"topic_{index}.txt")
        files[-1].write_text(f"{index}\n")
        held_out += is_validation(f"{files[-1]}#0", 5.0)
        if len(files) >= 40 and held_out:
            break
    assert 0 < held_out <= 12  # at most 12 x 5 tokens held out: fewer than one window of 64
    with pytest.raises(ConfigError) as error:
        RECIPES["finetune_patched"].run(tmp_path / "out", "--text_files", *files, "--seq_len", 64)
    message = str(error.value)
    assert "\n" not in message and re.fullmatch(
        r"--seq_len 64: the validation text has \d+ tokens, fewer than one window; pass a smaller --seq_len or "
        r"more validation text \(--eval_text_files FILES held out from training, or a larger --validation_percent / "
        r"--max_validation_bytes of the --text_files split\)", message), message
    assert "Generating train split" not in capfd.readouterr().err  # datasets' bar per file: 40 of them, silenced


def test_an_empty_eval_text_file_is_blamed_on_eval_text_files(tmp_path):
    """``--eval_text_files EMPTY`` was reported as ``--text_files: EMPTY is empty``."""
    from hf_structattn.training.args import ConfigError

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError) as error:
        RECIPES["finetune_patched"].parse([*PATCHED_TINY, "--eval_text_files", str(empty)])
    assert str(error.value) == f"--eval_text_files: {empty} is empty"


@pytest.mark.parametrize("name, text, message", [
    ("twice.yaml", "max_steps: 3\nlearning_rate: 0.01\nmax_steps: 4\n", "'max_steps' is set twice (again at line 3)"),
    ("nested.yaml", "model:\n  vocab_size: 100\n  vocab_size: 200\n", "'vocab_size' is set twice (again at line 3)"),
    ("twice.json", '{"max_steps": 3, "max_steps": 4}', "'max_steps' is set twice; keep one value"),
    ("both.yaml", "vocab_size: 100\nmodel:\n  vocab_size: 200\n",
     "'vocab_size' is set twice (at the top level and under model)"),
])
def test_a_config_key_set_twice_is_refused_naming_the_key_and_the_file(tmp_path, name, text, message):
    """A key set twice in a YAML or JSON config file silently took the last value."""
    from hf_structattn.training.args import ConfigError

    config = tmp_path / name
    config.write_text(text)
    with pytest.raises(ConfigError) as error:
        RECIPES["train_clm"].parse(["--config", str(config)])
    assert str(error.value).startswith(f"--config {config}: {message}") and "\n" not in str(error.value), \
        str(error.value)


def test_without_the_recipes_extra_each_recipe_says_so_in_one_line(tmp_path):
    """On the core install (no accelerate, datasets, evaluate) the recipes printed an 8-10 line traceback before the
    promised line, and ``hf_structattn.training.tracking`` / ``.metrics`` named no extra. A real process in which
    those libraries cannot be imported (``sys.modules[name] = None``, as if not installed)."""
    script = f"""
        import runpy, sys
        for name in ("accelerate", "datasets", "evaluate"):
            sys.modules[name] = None
        for module in ("tracking", "metrics", "loop"):
            try:
                __import__("hf_structattn.training." + module)
            except ModuleNotFoundError as error:
                print(module, "|", error)
        for recipe in ("train_clm", "train_icl", "finetune_chronos", "finetune_patched"):
            sys.argv = [recipe + ".py", "--max_steps", "1"]
            try:
                runpy.run_path({str(ROOT / "recipes")!r} + "/" + recipe + ".py", run_name="__main__")
            except SystemExit as exit:
                print(recipe, "| exit", exit.code)
    """
    import textwrap

    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    extra = "the recipes need the [recipes] extra (pip install 'hf-structattn[recipes]')"
    assert result.stdout.splitlines() == [
        f"tracking | No module named 'accelerate': {extra}", f"metrics | No module named 'evaluate': {extra}",
        f"loop | No module named 'accelerate': {extra}",
        *(f"{recipe} | exit 1" for recipe in ("train_clm", "train_icl", "finetune_chronos", "finetune_patched"))], \
        result.stdout
    assert result.stderr.splitlines() == [f"{recipe}.py: error: No module named 'accelerate': {extra}" for recipe in (
        "train_clm", "train_icl", "finetune_chronos", "finetune_patched")], result.stderr


def test_recipe_scripts_print_errors_as_one_line_without_traceback(tmp_path, monkeypatch, capsys):
    """Every recipe entry point (``run_main``) turns a bad argument into `<recipe>: error: ...` and exit status 2: two
    scripts as real processes, the other two in this process (the scripts are the same two lines)."""
    from hf_structattn.training.args import run_main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  resid_prdop: 0.1\n")
    cases = {
        "train_clm": (["--config", str(bad)], f"--config {bad}, under model: unknown field 'resid_prdop' (did you "
                                              "mean 'resid_pdrop'?)"),
        "finetune_patched": (["--mlr_ranks", "7", "9"], "patch: mlr_ranks=[7, 9] sums to 16, but the head dim is 32"),
        "train_icl": (["--max_steps", "-5"], "--max_steps must be >= 1, got -5"),
        "finetune_chronos": (["--max_steps", "-5"], "--max_steps must be >= 1, got -5"),
    }
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "recipes" / f"{name}.py"), *cases[name][0]],
                                    cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("train_clm", "finetune_patched")}
    for name in ("train_icl", "finetune_chronos"):
        recipe = RECIPES[name]
        monkeypatch.setattr(sys, "argv", [recipe.script, *cases[name][0]])
        with pytest.raises(SystemExit) as exit_info:
            run_main(recipe.load().main, recipe.script)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"{recipe.script}: error: {cases[name][1]}"]
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, stderr)
        assert stderr.strip().splitlines() == [f"{name}.py: error: {cases[name][1]}"], (name, stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # no output folder was created


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_help_lists_every_field_with_default_and_help(recipe_name, monkeypatch, capsys):
    recipe = RECIPES[recipe_name]
    module = recipe.load()
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        recipe.parse(["--help"])
    assert exit_info.value.code == 0
    text_out = capsys.readouterr().out
    blocks = re.split(r"\n  (?=--)", text_out)
    names = [f.name for cls in (getattr(module, recipe.args_class), getattr(module, recipe.model_class))
             for f in dataclasses.fields(cls) if f.init]
    assert len(names) > 40
    for name in names:
        block = next((b for b in blocks if b.startswith(f"--{name} ") or b.startswith(f"--{name},")), None)
        assert block is not None, name
        text = " ".join(block.split())
        assert "(default: " in text, name
        assert len(text.split("(default:")[0].split()) > 3, f"{name}: no help text in {text!r}"
    assert "--mlr_ranks MLR_RANKS [MLR_RANKS ...]" in text_out


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_non_empty_output_folder_is_refused_and_latest_needs_a_checkpoint(tmp_path, recipe_name):
    from hf_structattn.training.args import ConfigError

    recipe = RECIPES[recipe_name]
    recipe.load()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"--output_dir .*other is not empty \(notes.txt\): pass "
                                          r"--overwrite_output_dir"):
        recipe.run(tmp_path / "other", *SHORT_RUN)
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]
    with pytest.raises(ConfigError, match="no checkpoint under"):
        recipe.run(tmp_path / "empty", *SHORT_RUN, "--resume_from", "latest")


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


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant_with_warmup", "cosine_with_min_lr"])
def test_warm_up_starts_above_zero_and_reaches_the_peak_at_its_last_step(schedule):
    """transformers' warm-up runs step 0 at lr 0: a full forward and backward with no update."""
    from types import SimpleNamespace

    from hf_structattn.training.loop import build_scheduler

    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=2.0)
    scheduler = build_scheduler(optimizer, SimpleNamespace(lr_schedule=schedule, warmup_steps=4, max_steps=10,
                                                           min_lr_ratio=0.1))
    rates = []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0]) and rates[4] == pytest.approx(2.0)
    assert json.loads(json.dumps(scheduler.state_dict()))["last_epoch"] == 10  # still a JSON checkpoint state


def test_final_weights_only_drops_the_checkpoints_of_a_finished_run_and_says_what_is_kept(tmp_path, capsys):
    """A finished run kept a resumable checkpoint (weights and AdamW moments: ~3x the model) with no way to say it
    is not wanted; the summary did not say what the folder keeps or why."""
    from hf_structattn.training.outputs import finished_run

    kept = run_clm(tmp_path / "kept", "--max_steps", 2, "--checkpoint_every", 1, "--sample_new_tokens", 0,
                   "--disable_tqdm")
    assert (tmp_path / "kept" / "checkpoints").is_dir() and kept["kept"]["checkpoints/"] > 0
    printed = capsys.readouterr().out
    assert "kept in the output folder" in printed and "--final_weights_only deletes them" in printed
    lean = run_clm(tmp_path / "lean", "--max_steps", 2, "--checkpoint_every", 1, "--sample_new_tokens", 0,
                   "--disable_tqdm", "--final_weights_only")
    assert not (tmp_path / "lean" / "checkpoints").exists() and "checkpoints/" not in lean["kept"]
    assert lean["kept"]["model weights (*.safetensors)"] == kept["kept"]["model weights (*.safetensors)"]
    finished_run(tmp_path / "lean")  # still a finished run: it loads and pushes
    saved = json.loads((tmp_path / "lean" / "final_metrics.json").read_text())
    assert saved["kept"] == lean["kept"]


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


# ------------------------------------------------------------------------------------------------ checkpoints


def _limit_file_size(limit_bytes):
    def apply():  # in the child before exec: a write past the limit fails (EFBIG), like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def _tree_bytes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _script_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path):
    """Issue 20 item 1: with --checkpoints_total_limit 1 a failed save (the disk full) deleted checkpoint_0 before
    writing checkpoint_1, and `--resume_from latest` then found nothing. The subprocess writes under a real file-size
    limit: every checkpoint file that fits is written, optimizer.bin does not."""
    full = run_clm(tmp_path / "full", "--sample_new_tokens", 0)
    part = tmp_path / "part"
    run_clm(part, "--sample_new_tokens", 0, "--stop_after_steps", 4)
    checkpoints = part / "checkpoints"
    saved = _tree_bytes(checkpoints)
    limit = len(saved["checkpoint_0/optimizer.bin"]) // 2  # the biggest file: the model (and the rest) fit
    assert max(len(data) for name, data in saved.items() if name != "checkpoint_0/optimizer.bin") < limit
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "train_clm.py"), "--config", TINY_CLM,
                           "--output_dir", str(part), "--sample_new_tokens", "0", "--resume_from", "latest",
                           "--checkpoints_total_limit", "1"], cwd=tmp_path, env=_script_env(), capture_output=True,
                          text=True, timeout=300, preexec_fn=_limit_file_size(limit))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train_clm.py: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("train_clm.py: error: saving checkpoint_1 (step 8) failed, the earlier checkpoints "
                                "are intact (--resume_from latest continues from checkpoint_0): ")
    assert _tree_bytes(checkpoints) == saved  # checkpoint_0 untouched, no partial checkpoint_1 left behind
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0"]
    assert sorted(saved) == ["checkpoint_0/model.safetensors", "checkpoint_0/optimizer.bin",  # no pickle in it
                             "checkpoint_0/rng_state_0.safetensors", "checkpoint_0/run.json",
                             "checkpoint_0/scheduler.json"]
    resumed = run_clm(part, "--sample_new_tokens", 0, "--resume_from", "latest")
    assert resumed["step"] == 8 and resumed["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)
    a, b = weights(tmp_path / "full"), weights(part)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_save_killed_midway_leaves_a_partial_folder_that_never_counts_and_is_removed(tmp_path):
    """kill -9 while a checkpoint is being written (a real SIGKILL of a real run): only a hidden
    .checkpoint_<i>.partial folder is left; `latest` is the newest complete checkpoint, the partial folder counts
    toward no limit, and the resumed run removes it and ends exactly like an uninterrupted run."""
    from hf_structattn.training.checkpoints import checkpoint_dirs, partial_dirs, verify_checkpoint

    common = ["--sample_new_tokens", "0", "--checkpoint_every", "1", "--checkpoints_total_limit", "2", "--max_steps",
              "24", "--eval_every", "0", "--log_every", "4"]
    for attempt in range(4):  # the kill must land while a save is in progress; retried when it did not
        out = tmp_path / f"run{attempt}"
        proc = subprocess.Popen([sys.executable, str(ROOT / "recipes" / "train_clm.py"), "--config", TINY_CLM,
                                 "--output_dir", str(out), *common], cwd=tmp_path, env=_script_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # a save in progress after at least one complete checkpoint
            while proc.poll() is None and not (partial_dirs(out) and checkpoint_dirs(out)):
                time.sleep(0.0002)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=300)
        if proc.returncode == -signal.SIGKILL and partial_dirs(out) and checkpoint_dirs(out):
            break
    else:
        pytest.fail("four runs finished before a save could be interrupted")
    assert len(partial_dirs(out)) == 1
    complete = checkpoint_dirs(out)
    assert complete and len(complete) <= 3  # the limit (2), or one more if the kill fell between rename and rotation
    steps = [verify_checkpoint(path, 1)["step"] for path in complete]
    assert int(partial_dirs(out)[0].name.split("_")[1].split(".")[0]) > int(complete[-1].name.split("_")[1])
    resumed = run_clm(out, *common, "--resume_from", "latest")
    assert resumed["step"] == 24 and resumed["resumed_at"] == steps[-1]
    assert partial_dirs(out) == [] and len(checkpoint_dirs(out)) == 2
    full = run_clm(tmp_path / "full", *common)
    assert resumed["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A CLM run stopped at step 4 with checkpoint_0 (step 2) and checkpoint_1 (step 4)."""
    out = tmp_path_factory.mktemp("two_checkpoints") / "run"
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        run_clm(out, "--sample_new_tokens", 0, "--checkpoint_every", 2, "--stop_after_steps", 4)
    finally:
        torch.set_default_dtype(dtype)
        reset_accelerate()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
    return out


def _resume_via_entry_point(out, monkeypatch, capsys, *extra) -> tuple:
    """Run the recipe's entry point (run_main) in this process; returns (exit status, stderr lines)."""
    from hf_structattn.training import clm
    from hf_structattn.training.args import run_main

    monkeypatch.setattr(sys, "argv", ["train_clm.py", "--config", TINY_CLM, "--output_dir", str(out),
                                      "--sample_new_tokens", "0", "--checkpoint_every", "2", *map(str, extra)])
    capsys.readouterr()
    try:
        run_main(clm.main, "train_clm.py")
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    except Exception as error:  # what escaped the entry point: a traceback for the user
        code = f"traceback: {type(error).__name__}"
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def _scramble(path: Path) -> None:
    """The same number of bytes, none of them the file's: a corruption that every size check passes."""
    path.write_bytes(bytes(255 - byte for byte in path.read_bytes()))


CORRUPTIONS = {
    "model missing": ("model.safetensors", lambda p: p.unlink(), "missing"),
    "model truncated": ("model.safetensors", _truncate, "truncated ("),
    "optimizer missing": ("optimizer.bin", lambda p: p.unlink(), "missing"),
    "optimizer truncated": ("optimizer.bin", _truncate, "truncated ("),
    "optimizer corrupt": ("optimizer.bin", _scramble, "cannot be loaded ("),
    "run.json empty": ("run.json", lambda p: p.write_text(""), "empty"),
    "run.json invalid": ("run.json", lambda p: p.write_text('{"step": 4, "configuration": '), "invalid JSON at line 1"),
    "RNG state missing": ("rng_state_0.safetensors", lambda p: p.unlink(), "missing"),
    "scheduler state missing": ("scheduler.json", lambda p: p.unlink(), "missing"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_one_line_exit_2_naming_the_file_and_the_previous_checkpoint(
        two_checkpoints, tmp_path, monkeypatch, capsys, case):
    """Issue 20 item 2: raw tracebacks (and a config event appended to metrics.jsonl per attempt), or a silent resume
    without the RNG state. Now: one line naming the file and the fault, the previous complete checkpoint by name,
    exit status 2, and not a byte of the run folder changed."""
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    name, corrupt, fault = CORRUPTIONS[case]
    target = out / "checkpoints" / "checkpoint_1" / name
    corrupt(target)
    before = _tree_bytes(out)
    code, lines = _resume_via_entry_point(out, monkeypatch, capsys, "--resume_from", "latest")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"train_clm.py: error: {target}: {fault}"), lines[0]
    assert lines[0].endswith(f"; the previous complete checkpoint is checkpoint_0 (step 2): --resume_from "
                             f"{out / 'checkpoints' / 'checkpoint_0'}"), lines[0]
    assert _tree_bytes(out) == before
    # the named checkpoint resumes
    code, lines = _resume_via_entry_point(out, monkeypatch, capsys, "--resume_from",
                                          out / "checkpoints" / "checkpoint_0")
    assert code == 0, lines
    assert json.loads((out / "final_metrics.json").read_text())["resumed_at"] == 2


def test_resuming_a_run_killed_while_logging_drops_the_half_written_line_with_a_note(two_checkpoints, tmp_path,
                                                                                     monkeypatch, capsys):
    """A run killed while it wrote metrics.jsonl leaves half a line: the resume drops that line with a one-line note
    (no JSONDecodeError traceback) and continues; the log then parses line by line and holds each step once."""
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    log = out / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 5, "train/lo')
    code, lines = _resume_via_entry_point(out, monkeypatch, capsys, "--resume_from", "latest")
    assert code == 0, lines
    notes = [line for line in lines if "metrics.jsonl" in line]
    assert len(notes) == 1 and "dropped its last line" in notes[0] and "line " in notes[0], lines
    steps = [json.loads(line).get("step") for line in log.read_text().splitlines() if "train/loss" in line]
    assert steps == sorted(set(steps)) and steps[-1] == json.loads((out / "final_metrics.json").read_text())["step"]


def test_the_metrics_reader_drops_only_a_half_written_last_line(tmp_path, capsys):
    """One reader for the resume's cut (truncate_log) and the plots (read_jsonl): a last line that does not parse is
    dropped with a note naming the file and the line; any other line that does not parse is one line naming both."""
    from hf_structattn.training.args import ConfigError
    from hf_structattn.training.loop import truncate_log
    from hf_structattn.training.tracking import read_jsonl

    log = tmp_path / "metrics.jsonl"
    good = [{"event": "config", "config": {}}, {"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.5}]
    text = "".join(json.dumps(record) + "\n" for record in good)
    log.write_text(text + '{"step": 3, "train/l')
    assert read_jsonl(log) == good[1:]
    assert "metrics.jsonl: dropped its last line (line 4)" in capsys.readouterr().err
    truncate_log(log, 2)
    assert log.read_text() == text
    log.write_text(text[:-1] + ",\n" + text)  # a bad line in the middle is not a half-written one
    for read in (read_jsonl, lambda path: truncate_log(path, 2)):
        with pytest.raises(ConfigError, match=rf"{re.escape(str(log))}: line 3 is not valid JSON") as raised:
            read(log)
        assert "\n" not in str(raised.value)


class _Plant:
    """Unpickling this object opens (creates) ``marker``: the stand-in for arbitrary code in a planted pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


PLANTED = ["model.safetensors", "optimizer.bin", "scheduler.json", "rng_state_0.safetensors", "run.json",
           "custom_checkpoint_0.pkl", "random_states_0.pkl"]


@pytest.mark.parametrize("name", PLANTED)
def test_resuming_never_runs_a_pickle_planted_in_a_checkpoint(two_checkpoints, tmp_path, monkeypatch, capsys, name):
    """Issue 20 item 3: the scheduler went through accelerate's custom-object pickle (weights_only=False), so a
    planted custom_checkpoint_0.pkl ran code on --resume_from latest. A pickle whose unpickling creates a marker file
    replaces each file of the checkpoint in turn (or is added beside them, under the names accelerate would load);
    run.json's file list is updated to the planted sizes so that every loader is reached. Nothing runs: the marker
    never appears, and the resume stops with one line naming the file."""
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    checkpoint = out / "checkpoints" / "checkpoint_1"
    marker = tmp_path / "pwned"
    torch.save({"state": _Plant(marker), "param_groups": []}, checkpoint / name)
    state_file = checkpoint / "run.json"
    if name != "run.json":
        state = json.loads(state_file.read_text())
        if name in state.get("files", {}):
            state["files"][name] = (checkpoint / name).stat().st_size
            state_file.write_text(json.dumps(state))
    metrics_before = (out / "metrics.jsonl").read_bytes()
    code, lines = _resume_via_entry_point(out, monkeypatch, capsys, "--resume_from", "latest")
    assert not marker.exists()
    assert code == 2 and len(lines) == 1 and f"{checkpoint}" in lines[0], lines
    assert (out / "metrics.jsonl").read_bytes() == metrics_before


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


RECIPE_CODE_FILE = {"train_clm": "modeling_structattn_gpt2.py", "train_icl": "modeling_structattn_gpt2.py",
                    "finetune_chronos": "modeling_structattn_t5.py", "finetune_patched": "structattn_decoder.py"}


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_push_to_hub_checks_the_hub_first_and_uploads_the_output_folder(tmp_path, monkeypatch, recipe_name):
    """Only the Hub network boundary (HfApi.whoami / create_repo / create_commit) is replaced."""
    import huggingface_hub

    recipe = RECIPES[recipe_name]
    recipe.load()
    out = tmp_path / "hub"
    calls = []

    def fake_whoami(self, *args, **kwargs):
        calls.append(("whoami", None, {"trained": (out / "metrics.jsonl").exists()}))
        return {"name": "someone"}

    def fake_create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, dict(kwargs, trained=(out / "metrics.jsonl").exists())))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def fake_create_commit(self, repo_id, operations, **kwargs):
        listing = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
        calls.append(("create_commit", repo_id, dict(kwargs, sent=commit_sends(operations), listing=listing)))

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", fake_whoami)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", fake_create_commit)
    extra = []
    if recipe_name in ("train_clm", "finetune_patched"):
        text_file = tmp_path / "corpus.txt"
        text_file.write_text("def f(x):\n    return x + 1\n" * 3000)
        extra = ["--text_files", text_file]
    result = recipe.run(out, "--max_steps", 2, "--eval_every", 0, "--checkpoint_every", 1, "--push_to_hub",
                        "--hub_model_id", "someone/tiny-mlr", *extra)
    assert [c[0] for c in calls] == ["whoami", "create_repo", "create_commit"]
    assert not calls[0][2]["trained"] and not calls[1][2]["trained"]  # checked before any training
    assert calls[1][1] == "someone/tiny-mlr" and calls[1][2]["exist_ok"] is True
    upload = calls[2][2]
    assert calls[2][1] == "someone/tiny-mlr" and upload["repo_type"] == "model"
    listing = set(upload["sent"])
    assert all(upload["sent"][name] == (out / name).read_bytes() for name in listing)
    assert any(p.startswith("checkpoints/") for p in upload["listing"])  # there were checkpoints: left out
    assert not any(p.startswith(("checkpoints/", "source/", "base_tiny_chronos_t5/")) for p in listing)
    assert "run_config.json" not in listing and not any(p.endswith(".pkl") for p in listing)
    assert {"config.json", "model.safetensors", RECIPE_CODE_FILE[recipe_name], "README.md", "final_metrics.json",
            "plots/loss_vs_steps.png", "metrics.jsonl"} <= listing, listing
    # no local absolute path in any uploaded text file
    for name in listing:
        if name.endswith((".json", ".jsonl", ".md", ".py", ".txt")):
            assert str(tmp_path) not in (out / name).read_text(), name
    card = (out / "README.md").read_text()
    assert '"someone/tiny-mlr"' in card and "trust_remote_code=True" in card  # the loading snippet names the repo
    from huggingface_hub import ModelCard

    data = ModelCard.load(out / "README.md").data
    assert data.library_name == "transformers" and data.license == "apache-2.0"
    assert "hf_structattn" in data.tags and data.eval_results
    assert result["hub_repo_id"] == "someone/tiny-mlr"


def test_push_to_hub_offline_or_without_token_fails_before_training(tmp_path, monkeypatch):
    import time

    from hf_structattn.training.args import ConfigError

    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="--push_to_hub: the Hub is unreachable in offline mode"):
        run_clm(tmp_path / "offline", "--push_to_hub", "--hub_model_id", "someone/x")  # HF_HUB_OFFLINE=1 here
    assert time.perf_counter() - started < 30 and not (tmp_path / "offline").exists()

    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored token either
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "tokens"))
    with pytest.raises(ConfigError, match=r"--push_to_hub: no Hub token found; log in with `hf auth login`"):
        run_clm(tmp_path / "notoken", "--push_to_hub", "--hub_model_id", "someone/x")
    assert not (tmp_path / "notoken").exists()


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_push_to_hub_with_a_token_but_no_network_says_the_hub_is_unreachable(tmp_path, monkeypatch, recipe_name):
    """Issue 23 item 3: a token and no network blamed the login. The client talks to a real closed port here (the
    network boundary: a refused TCP connection), and the run stops before touching the output folder."""
    import huggingface_hub

    from hf_structattn.training.args import ConfigError

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the tests run offline otherwise
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    recipe = RECIPES[recipe_name]
    recipe.load()
    with pytest.raises(ConfigError) as error:
        recipe.run(tmp_path / "out", "--push_to_hub", "--hub_model_id", "someone/x")
    message = str(error.value)
    assert message.startswith(f"--push_to_hub: the Hub at {endpoint} is unreachable (ConnectError: ")
    assert "log in" not in message and "\n" not in message
    assert not (tmp_path / "out").exists()


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
    assert extra == {"checkpoints/checkpoint_0/rng_state_1.safetensors",
                     "checkpoints/checkpoint_1/rng_state_1.safetensors"}
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


def test_finetune_chronos_tiny_end_to_end(tmp_path, capsys):
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
    # the tiny Chronos has Chronos-T5's dropout 0.1: off in the MLR layers' attention weights, said once
    assert "attention dropout: 0.1 in the config, off in the mlr layers" in capsys.readouterr().out
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


# ------------------------------------------------------------------------------------------------ patched decoder


def test_finetune_patched_reports_drift_recovers_and_saves_a_loadable_model(tmp_path):
    import transformers

    recipe = RECIPES["finetune_patched"]
    out = tmp_path / "run"
    result = recipe.run(out, "--pretrain_steps", 30, "--max_steps", 30, "--eval_every", 0, "--checkpoint_every", 0,
                        "--sample_new_tokens", 40)  # 44 tokens: beyond the finest blocks, where MLR keys are saved
    assert result["drift"]["logit_max_abs"] > 1e-4 and result["loss_gap_before"] != 0.0
    # the default objective distills the source (this undertrained tiny source's patch barely moves it: the KL
    # stays at rounding level; the recovery on real weights is benchmarks/bench_real_weights.py's)
    assert result["objective"] == "distill" and result["loss_patched_after"] == result["eval_loss"]
    assert abs(result["kl_to_source_before"]) < 1e-3 and 0 <= result["eval_kl_to_source"] < 1e-3
    assert 0.9 < result["eval_top1_source"] <= 1.0
    assert result["cache_key_cache_bytes"] < result["cache_dense_key_cache_bytes"]
    assert result["cache_context_tokens"] == 4096 and result["sample_cache_tokens"] == 44  # 4 prompt + 40 new
    # what the folder keeps, and why, is in the summary; every file has the user's mode (safetensors wrote 0600)
    assert result["kept"]["model weights (*.safetensors)"] == (out / "model.safetensors").stat().st_size
    assert {"checkpoints/", "source/"} <= set(result["kept"]) and result["weights_dtype"] == "float32"
    mode = os.umask(0o022)
    os.umask(mode)
    assert {oct(p.stat().st_mode & 0o777) for p in out.rglob("*") if p.is_file()} == {oct(0o666 & ~mode)}
    assert {"structattn_decoder.py", "config.json", "model.safetensors", "final_metrics.json", "tokenizer.json",
            "README.md", "metrics.jsonl", "run_config.json", "source", "checkpoints"} <= {p.name for p in out.iterdir()}
    source = transformers.AutoModelForCausalLM.from_pretrained(out / "source")
    assert type(source) is transformers.LlamaForCausalLM and source.config.hidden_size == 32
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded).__name__ == "MLRLlamaForCausalLM"
    assert reloaded.config.mlr_ranks == [8, 4, 4] and reloaded.config.mlr_block_sizes == [16, 8]
    for folder in (out, out / "source"):  # the saved tokenizers know the model's context, not a default
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        assert tokenizer_config["model_max_length"] == reloaded.config.max_position_embeddings == 4096
    card = (out / "README.md").read_text()
    assert "Drift of the patch before fine-tuning" in card and str(tmp_path) not in card
    # the card says first what a stock load gives, as the card of patch / save_pretrained does, and its snippet loads
    # the tokenizer with remote code too (where hf_structattn is not installed, AutoTokenizer reads the auto_map)
    assert card_paragraphs(card)[1].startswith("> **WARNING: this is not a stock LlamaForCausalLM.**")
    assert "AutoTokenizer.from_pretrained(path, trust_remote_code=True)" in card
    # the saved model is the trained one: its validation loss is the run's final evaluation
    from hf_structattn.training.data import eval_windows
    from hf_structattn.training.decoder_ft import load_corpus, validation_loss

    windows = eval_windows(load_corpus(recipe.parse(recipe.argv(out))).validation, 32, 4)
    assert validation_loss(reloaded, windows, 4) == pytest.approx(result["eval_loss"], rel=1e-5)


def test_the_finetune_patched_cache_line_is_at_the_models_context_and_labels_the_sample():
    """The card and final_metrics.json gave only the cache of the 66-token greedy sample, which lies inside one block
    (1.000x: "saves nothing"); the saving is at the model's context length, as in the guide's table."""
    import hf_structattn
    from hf_structattn.decoder_patching import tiny_decoder
    from hf_structattn.flops import decoder_cache_report
    from hf_structattn.training.decoder_ft import cache_summary

    patched = hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_max_length=2048)  # blocks 1024, 512
    summary = {}
    line = cache_summary(patched.config, 2048, 66, torch.float32, summary)
    at_context = decoder_cache_report(patched.config, 2048, dtype_bytes=torch.float32)
    assert summary["cache_context_tokens"] == 2048 and summary["cache"] == at_context
    assert summary["cache_key_cache_ratio"] == at_context["key_cache_ratio"] < 0.75
    assert summary["sample_cache_tokens"] == 66 and summary["sample_cache_key_cache_ratio"] == 1.0
    assert line.startswith("Cache of one sequence at the model's context length, 2,048 tokens")
    assert f"({at_context['key_cache_ratio']:.3f}x)" in line
    assert "At the 66-token greedy sample's length: keys 1.000x" in line and "inside one block" in line
    # without mlr_max_length (explicit blocks) the context is the config's max positions
    cache_summary(patched.config, None, 66, torch.float32, summary)
    assert summary["cache_context_tokens"] == patched.config.max_position_embeddings


def card_paragraphs(card: str) -> list:
    """The paragraphs of a model card below its YAML front matter (the first one is its title)."""
    body = card.split("\n---\n", 1)[1] if card.startswith("---\n") else card
    return [part.strip() for part in body.split("\n\n") if part.strip()]


def test_the_finetune_patched_card_starts_with_the_warning_of_the_patched_model_card(tmp_path):
    from huggingface_hub import ModelCard

    import hf_structattn
    from hf_structattn.decoder_patching import tiny_decoder
    from hf_structattn.modeling.structattn_decoder import CARD_WARNING
    from hf_structattn.training.args import parse_recipe_args
    from hf_structattn.training.decoder_ft import (PatchedFinetuneArgs, PatchedModelArgs, loading_snippet,
                                                   saved_card_warning)
    from hf_structattn.training.outputs import write_model_card

    with pytest.raises(ValueError, match="holds no 'WARNING: this is not a stock' paragraph"):
        saved_card_warning(tmp_path)
    patched = hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_block_sizes=[16, 8])
    patched.save_pretrained(tmp_path)
    notice = saved_card_warning(tmp_path)  # the paragraph save_pretrained wrote, word for word
    assert notice.startswith(f"> **{CARD_WARNING} LlamaForCausalLM.**") and notice in card_paragraphs(
        (tmp_path / "README.md").read_text())
    args = parse_recipe_args(PatchedFinetuneArgs, PatchedModelArgs, ["--output_dir", str(tmp_path)],
                             prog="finetune_patched.py")
    snippet = loading_snippet("someone/tiny-mlr", "def ")
    write_model_card(tmp_path, args, recipe="finetune_patched", title="MLRLlamaForCausalLM: a title",
                     summary="A summary.", config={}, data="some text", metrics={}, usage=snippet,
                     pipeline_tag="text-generation", notice=notice)
    card = (tmp_path / "README.md").read_text()
    assert card_paragraphs(card)[:3] == ["# MLRLlamaForCausalLM: a title", notice, "A summary."]
    assert ModelCard.load(tmp_path / "README.md").data.library_name == "transformers"  # still a valid card
    assert "tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)" in snippet
    assert "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)" in snippet


def test_the_distillation_loss_is_the_kl_from_the_source_and_pulls_towards_it():
    from hf_structattn.training.decoder_ft import distillation_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 5, 11, dtype=torch.float64)
    p, log_q = target.softmax(-1), logits.log_softmax(-1)
    reference = (p * (p.log() - log_q)).sum(-1).mean()  # KL(p || q) per token, averaged over the 10 tokens
    loss = distillation_loss(logits, target)
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-14)
    assert abs(float(distillation_loss(target, target))) < 1e-14
    loss.backward()
    moved = logits.detach() - 0.5 * logits.grad
    assert distillation_loss(moved, target) < loss
    assert distillation_loss(logits.detach().float(), target.float()).dtype == torch.float32


def test_finetune_patched_with_the_lm_objective_lowers_the_validation_loss_and_logs_training_cpu_time(tmp_path):
    recipe = RECIPES["finetune_patched"]
    out = tmp_path / "run"
    result = recipe.run(out, "--pretrain_steps", 30, "--max_steps", 30, "--eval_every", 10, "--checkpoint_every", 0,
                        "--sample_new_tokens", 0, "--objective", "lm")
    assert result["objective"] == "lm" and "eval_kl_to_source" not in result and "kl_to_source_before" not in result
    assert result["loss_patched_after"] == result["eval_loss"] < result["loss_patched_before"]
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval/loss" in line]
    assert [e["step"] for e in evals] == [0, 10, 20, 30] and "train_cpu_s" not in evals[0]
    cpu = [e["train_cpu_s"] for e in evals[1:]]
    assert 0 < cpu[0] < cpu[1] < cpu[2]


def test_finetune_patched_evaluates_on_its_own_text_files_and_refuses_an_unknown_objective(tmp_path):
    from hf_structattn.training.args import ConfigError
    from hf_structattn.training.decoder_ft import PatchedFinetuneArgs, load_corpus

    (tmp_path / "train.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    (tmp_path / "eval.txt").write_text("class C:\n    pass\n" * 50)
    recipe = RECIPES["finetune_patched"]
    args = recipe.parse(recipe.argv(tmp_path / "run") + ["--text_files", str(tmp_path / "train.txt"),
                                                         "--eval_text_files", str(tmp_path / "eval.txt")])
    corpus = load_corpus(args)
    assert bytes(corpus.validation[corpus.validation < 256].tolist()).decode() == "class C:\n    pass\n" * 50
    assert corpus.validation_documents == 1 and "evaluated on 1 text file(s) of its own" in corpus.description
    with pytest.raises(ConfigError, match="--objective 'kl' is not one of distill, lm"):
        PatchedFinetuneArgs(objective="kl")


@pytest.mark.parametrize("level_order", ["contribution", "index"])
def test_finetune_patched_patches_as_patch_does(tmp_path, level_order):
    """The recipe's patch is hf_structattn.patch with the same keywords and default: its saved level order equals
    patch's on the same source (contribution: calibrated on the first --calibration_windows training windows)."""
    import transformers

    import hf_structattn
    from hf_structattn.training.decoder_ft import load_corpus

    recipe = RECIPES["finetune_patched"]
    out = tmp_path / "run"
    recipe.run(out, "--pretrain_steps", 2, "--max_steps", 1, "--eval_every", 0, "--checkpoint_every", 0,
               "--sample_new_tokens", 0, "--eval_windows", 2, "--level_order", level_order,
               "--calibration_windows", 3)
    saved = transformers.AutoModelForCausalLM.from_pretrained(out).config
    source = transformers.AutoModelForCausalLM.from_pretrained(out / "source")
    args = recipe.parse(recipe.argv(out))
    train = load_corpus(args).train
    extra = {"calibration_ids": train[:3 * args.seq_len].view(3, args.seq_len)} if level_order == "contribution" \
        else {}
    expected = hf_structattn.patch(source, mlr_ranks=saved.mlr_ranks, mlr_block_sizes=saved.mlr_block_sizes,
                                   level_order=level_order, **extra).config
    assert saved.mlr_patch["level_order"] == level_order and saved.mlr_dim_order == expected.mlr_dim_order
    assert saved.mlr_patch.get("calibration_tokens") == (3 * args.seq_len if extra else None)


@pytest.mark.parametrize("config_name", sorted(p.name for p in (ROOT / "configs").iterdir()
                                               if p.suffix in (".yaml", ".yml", ".json")))
def test_shipped_configs_parse_and_build(config_name):
    """Every config in configs/ is valid for its recipe (fields known, every field validated, model buildable)."""
    from hf_structattn.training import chronos_ft, clm, decoder_ft, icl
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
    elif config_name.startswith("patched"):
        args = parse_recipe_args(decoder_ft.PatchedFinetuneArgs, decoder_ft.PatchedModelArgs, ["--config", path])
        assert args.model_path is None and args.source_config().model_type == "llama"
    elif config_name.startswith("accelerate"):
        import yaml

        from accelerate.commands.config.config_args import load_config_from_file

        expected = {"accelerate_fsdp.yaml": "FSDP", "accelerate_one_process.yaml": "NO"}[config_name]
        assert yaml.safe_load((ROOT / "configs" / config_name).read_text())["distributed_type"] == expected
        assert str(load_config_from_file(path).distributed_type).endswith(expected)  # accelerate reads it
    else:
        pytest.fail(f"configs/{config_name}: no recipe prefix (clm_, icl_, chronos_, patched_, accelerate_)")


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


def test_a_run_prints_no_warning_a_user_cannot_act_on(tmp_path):
    """transformers' loss-type notice (the class name names no task) and accelerate's tied-weights notice at every
    checkpoint are silenced at their source; the run still saves checkpoints with tied weights."""
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "train_clm.py"), "--config", TINY_CLM,
                           "--output_dir", str(tmp_path / "out"), "--sample_new_tokens", "0"], cwd=tmp_path,
                          env=_script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert (tmp_path / "out" / "checkpoints").is_dir()
    for notice in ("Removed shared tensor", "loss_type=None"):
        assert notice not in output, output[-3000:]


def test_without_the_progress_bar_a_run_prints_progress_lines_with_a_rate_and_an_eta(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "train_clm.py"), "--config", TINY_CLM,
                           "--output_dir", str(tmp_path / "out"), "--sample_new_tokens", "0", "--disable_tqdm",
                           "--progress_every_s", "0.001"], cwd=tmp_path, env=_script_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if re.fullmatch(
        r"step \d+/\d+: loss \d+\.\d{4}, [\d,]+ tokens/s, ETA (\d+m\d\ds|\d+s)", line)]
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    assert len(steps) >= 3 and steps == sorted(steps), proc.stdout[-2000:]
    bad = subprocess.run([sys.executable, str(ROOT / "recipes" / "train_clm.py"), "--config", TINY_CLM,
                          "--output_dir", str(tmp_path / "bad"), "--progress_every_s", "-1"], cwd=tmp_path,
                         env=_script_env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--progress_every_s must be >= 0, got -1.0" in bad.stderr


def test_in_a_log_a_run_prints_progress_lines_not_a_carriage_return_bar(tmp_path):
    """A 17-minute run showed its training only as a tqdm bar (carriage returns) in a log: when stderr is not a
    terminal the loop prints progress lines, as with --disable_tqdm, and transformers' bars are off."""
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "train_clm.py"), "--config", TINY_CLM,
                           "--output_dir", str(tmp_path / "out"), "--sample_new_tokens", "0", "--progress_every_s",
                           "0.001"], cwd=tmp_path, env=_script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
    assert re.search(r"^step \d+/\d+: loss \d+\.\d{4}, [\d,]+ tokens/s, ETA ", proc.stdout, re.M), proc.stdout[-2000:]


def test_a_long_phase_names_itself_and_its_estimate_before_it_starts(capsys):
    from accelerate import PartialState

    from hf_structattn.training.loop import announce, duration

    state = PartialState()
    announce(state, "drift before fine-tuning: 24 forwards of 2048 tokens at 8.0 s each", 192.0)
    announce(state, "a short phase", 5.0)
    assert capsys.readouterr().out == ("drift before fine-tuning: 24 forwards of 2048 tokens at 8.0 s each (about "
                                       "3.2 min) ...\n")
    assert [duration(s) for s in (45, 210, 7200)] == ["45 s", "3.5 min", "2.0 h"]


def test_chronos_recipe_turns_off_only_the_attention_dropout_the_fused_mlr_op_cannot_apply():
    import transformers

    import hf_structattn
    from hf_structattn.modeling.structattn_attention import mlr_geometry_of
    from hf_structattn.training.chronos_ft import _no_attention_dropout_in_mlr_layers

    fields = dict(vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    for implementation, expected in (("sdpa", 0.1), ("eager", 0.0)):
        stock = transformers.T5ForConditionalGeneration(transformers.T5Config(**fields,
                                                                              attn_implementation=implementation))
        model = hf_structattn.patch(stock, mlr_ranks=[4, 2, 2], mlr_max_length=16).train()
        assert _no_attention_dropout_in_mlr_layers(model) == expected
        mlr_modules = [m for m in model.modules() if mlr_geometry_of(m) is not None]
        assert mlr_modules and all(m.dropout == 0.1 - expected for m in mlr_modules)
        assert all(m.p == 0.1 for m in model.modules() if isinstance(m, torch.nn.Dropout))  # the rest stays
