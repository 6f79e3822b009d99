"""``hf-structattn push``: upload a finished run again (or for the first time), rehearse it offline (``--dry-run``,
``--to-folder``). The run is a real tiny ``train_clm`` run; only the Hub's network boundary (``HfApi.whoami`` /
``create_repo`` / ``create_commit``, and ``upload_folder``, which reads the folder at send time) is replaced, as in
tests/test_recipes.py: what it records as sent is the bytes the real call would send."""

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_structattn_cli import main

from conftest import commit_sends, upload_folder_sends

ROOT = Path(__file__).resolve().parent.parent
REPO = "someone/tiny-mlr"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A complete train_clm run (2 steps, a checkpoint, final metrics) whose own upload was never made."""
    import torch
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from hf_structattn.training.clm import main as clm_main

    out = tmp_path_factory.mktemp("push") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        clm_main(["--config", str(ROOT / "configs" / "clm_tiny.json"), "--sample_new_tokens", "0", "--output_dir",
                  str(out), "--max_steps", "2", "--eval_every", "0", "--checkpoint_every", "1", "--disable_tqdm"])
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    assert (out / "final_metrics.json").is_file() and any((out / "checkpoints").iterdir())
    return out


@pytest.fixture
def fake_hub(monkeypatch):
    """The network boundary of the upload: records the calls, uploads nothing."""
    import huggingface_hub

    calls = []

    def fake_whoami(self, *args, **kwargs):
        calls.append(("whoami", None, {}))
        return {"name": "someone"}

    def fake_create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def fake_upload_folder(self, *, repo_id, folder_path, **kwargs):  # not called: it would read the folder again
        sent = {path: (Path(folder_path) / path).read_bytes()
                for path in upload_folder_sends(folder_path, **kwargs)}
        calls.append(("upload", repo_id, dict(kwargs, sent=sent)))

    def fake_create_commit(self, repo_id, operations, **kwargs):
        calls.append(("upload", repo_id, dict(kwargs, sent=commit_sends(operations))))

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", fake_whoami)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake_upload_folder)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", fake_create_commit)
    return calls


def _dry_run_listing(output: str) -> list[str]:
    return [line.split()[-1] for line in output.splitlines()[1:] if "MiB" in line and "in all" not in line]


def test_push_uploads_a_finished_run_with_the_recipes_ignore_patterns(finished_run, fake_hub, capsys):
    assert main(["push", str(finished_run), "--repo-id", REPO, "--private"]) == 0
    assert [c[0] for c in fake_hub] == ["whoami", "create_repo", "upload"]
    assert fake_hub[1][1] == REPO and fake_hub[1][2]["private"] is True and fake_hub[1][2]["exist_ok"] is True
    upload = fake_hub[2][2]
    assert fake_hub[2][1] == REPO and upload["repo_type"] == "model"
    sent = set(upload["sent"])
    assert all(upload["sent"][path] == (finished_run / path).read_bytes() for path in sent)
    assert {"config.json", "model.safetensors", "modeling_structattn_gpt2.py", "README.md",
            "final_metrics.json"} <= sent, sent
    assert not any(p.startswith("checkpoints/") for p in sent) and "run_config.json" not in sent
    out = capsys.readouterr().out
    assert f"to https://huggingface.co/{REPO}" in out

    # the dry run lists exactly what the upload sent, and touches no network
    fake_hub.clear()
    assert main(["push", str(finished_run), "--repo-id", REPO, "--dry-run"]) == 0
    assert fake_hub == []
    out = capsys.readouterr().out
    assert out.startswith(f"dry run: would upload {len(sent)} files") and "nothing uploaded" in out
    assert sorted(_dry_run_listing(out)) == sorted(sent)


def test_dry_run_and_to_folder_need_no_network_and_the_folder_loads(finished_run, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "hf_structattn_cli", "push", str(finished_run), "--repo-id", REPO,
                             "--dry-run"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    listed = _dry_run_listing(result.stdout)
    assert "model.safetensors" in listed and not any(p.startswith("checkpoints/") for p in listed)

    target = tmp_path / "rehearsal"
    result = subprocess.run([sys.executable, "-m", "hf_structattn_cli", "push", str(finished_run), "--to-folder",
                             str(target)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    copied = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert copied == sorted(listed)
    # the rehearsal folder is what the repository would hold: it loads with its own code
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target, trust_remote_code=True).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(finished_run, trust_remote_code=True).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_push_offline_is_one_line_exit_2_and_a_failed_upload_exit_1(finished_run, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["push", str(finished_run), "--repo-id", REPO]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hf-structattn: error: push: the Hub is unreachable in offline mode (HF_HUB_OFFLINE "
                   "is set)"], err
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda self, *a, **k: {"name": "someone"})
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **k: huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}"))

    def refused(self, *args, **kwargs):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", refused)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", refused)
    assert main(["push", str(finished_run), "--repo-id", REPO]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the Hub is unreachable" in err[0], err
    assert f"hf-structattn push {finished_run} --repo-id {REPO}" in err[0]  # says how to retry


@pytest.mark.parametrize("make, args, message", [
    (None, ["--repo-id", REPO], "does not exist"),
    ("empty", ["--repo-id", REPO], "holds no config.json"),
    ("config_only", ["--repo-id", REPO], "holds no weights"),
    ("run", [], "--repo-id is required"),
    ("run", ["--repo-id", "no-slash"], "--repo-id 'no-slash' must be USER/NAME"),
    ("run", ["--repo-id", "a/b/c"], "--repo-id 'a/b/c' is not a valid repository id"),
])
def test_bad_push_arguments_are_one_line_exit_2_naming_the_value(finished_run, tmp_path, fake_hub, capsys, make, args,
                                                                message):
    folder = {"run": finished_run}.get(make, tmp_path / "folder")
    if make in ("empty", "config_only"):
        folder.mkdir()
        if make == "config_only":
            (folder / "config.json").write_text("{}")
    assert main(["push", str(folder), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert fake_hub == []  # nothing reached the Hub


def test_to_folder_refuses_a_non_empty_target_and_writes_nothing(finished_run, tmp_path, capsys):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    assert main(["push", str(finished_run), "--to-folder", str(target)]) == 2
    err = capsys.readouterr().err
    assert "--to-folder" in err and "not empty" in err
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_push_help_answers_without_importing_torch():
    code = ("import sys, hf_structattn_cli\n"
            "try:\n    hf_structattn_cli.main(['push', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('torch imported:', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "--dry-run" in result.stdout and "--to-folder" in result.stdout and "``" not in result.stdout
    assert result.stdout.strip().endswith("torch imported: False")


# ------------------------------------------------------------------------------------ what a finished run is


def _copy(finished_run, folder: Path) -> Path:
    shutil.copytree(finished_run, folder, symlinks=True)
    return folder


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def _edit_config(out: Path, **values) -> None:
    config = json.loads((out / "config.json").read_text())
    config.update(values)
    (out / "config.json").write_text(json.dumps(config))


def _edit_auto_map(out: Path, name: str, **entries) -> None:
    data = json.loads((out / name).read_text()) if (out / name).exists() else {}
    data["auto_map"] = dict(data.get("auto_map") or {}, **entries)
    (out / name).write_text(json.dumps(data))


def _append(path: Path, data: bytes) -> None:
    path.write_bytes(path.read_bytes() + data)


def _symlink_config_from_outside(out: Path) -> None:
    outside = out.parent / "config_elsewhere.json"
    (out / "config.json").rename(outside)
    (out / "config.json").symlink_to(outside)


NOT_FINISHED = {
    "half-written weights": (lambda out: _truncate(out / "model.safetensors"),
                             "model.safetensors is not a complete safetensors file"),
    "unparsable config": (lambda out: (out / "config.json").write_text('{"n_embd": 32, "n_la'),
                          "config.json is not valid JSON"),
    "weights of another config": (lambda out: _edit_config(out, vocab_size=300),
                                  "transformer.wte.weight has shape [257, 32], the model config.json describes "
                                  "[300, 32]"),
    "a layer more than the weights": (lambda out: _edit_config(out, n_layer=3, layer_types=None),
                                      "lack transformer.h.2."),
    "a recipe run that did not finish": (lambda out: (out / "final_metrics.json").unlink(),
                                         "is a recipe run that did not finish (no final_metrics.json)"),
    "config.json symlinked from outside": (_symlink_config_from_outside, "config.json is a symlink to"),
    "a half-written json file": (lambda out: _truncate(out / "tokenizer_config.json"),
                                 "tokenizer_config.json is not valid JSON"),
    # auto_map names only modules of the folder, as plain module.Class
    "auto_map into another Hub repository": (
        lambda out: _edit_auto_map(out, "config.json", AutoModel="someone/evil--modeling_evil.EvilModel"),
        "config.json: auto_map['AutoModel'] = 'someone/evil--modeling_evil.EvilModel' names code in another Hub "
        "repository"),
    "auto_map out of the folder": (lambda out: _edit_auto_map(out, "config.json", AutoModel="../outside.Model"),
                                   "config.json: auto_map['AutoModel'] = '../outside.Model' is not module.Class"),
    "auto_map to a module not in the folder": (
        lambda out: _edit_auto_map(out, "config.json", AutoModel="missing_module.Model"),
        "config.json: auto_map['AutoModel'] = 'missing_module.Model' names missing_module.py, which is not in the "
        "folder"),
    "a tokenizer's auto_map into another repository": (
        lambda out: _edit_auto_map(out, "tokenizer_config.json", AutoTokenizer=["other/repo--tok.Tok", None]),
        "tokenizer_config.json: auto_map['AutoTokenizer'][0] = 'other/repo--tok.Tok' names code in another Hub "
        "repository"),
    "a generation config's auto_map": (lambda out: _edit_auto_map(out, "generation_config.json", AutoX="nope.X"),
                                       "generation_config.json: auto_map['AutoX'] = 'nope.X' names nope.py"),
    # every shipped .py compiles and is the payload the package writes for this checkpoint
    "a deleted payload file": (lambda out: (out / "structattn_mlr.py").unlink(),
                               "structattn_mlr.py, part of the payload hf_structattn writes for this checkpoint "
                               "(auto_map module modeling_structattn_gpt2), is missing"),
    "a half-written payload file": (lambda out: _truncate(out / "modeling_structattn_gpt2.py"),
                                    "modeling_structattn_gpt2.py does not compile (SyntaxError: "),
    "an edited payload file": (lambda out: _append(out / "structattn_ops.py", b"\nimport os\n"),
                               "structattn_ops.py is not the payload hf_structattn writes for this checkpoint"),
    "a shipped .py that does not compile": (lambda out: (out / "helper.py").write_text("def (:\n"),
                                            "helper.py does not compile (SyntaxError: "),
}


@pytest.mark.parametrize("case", list(NOT_FINISHED))
def test_push_refuses_what_is_not_a_finished_run_in_one_line(finished_run, tmp_path, fake_hub, capsys, case):
    """A push, its dry run and its rehearsal refuse, with exit status 2 and one line naming the file, a folder whose
    weights are half-written or do not match its config, whose config does not parse, whose run did not finish, or
    whose config is a symlink out of it; nothing reaches the Hub, nothing is copied."""
    out = _copy(finished_run, tmp_path / "run")
    make, message = NOT_FINISHED[case]
    make(out)
    for extra in ([], ["--dry-run"], ["--to-folder", str(tmp_path / "rehearsal")]):
        args = ["push", str(out)] + (["--repo-id", REPO] if "--to-folder" not in extra else []) + extra
        assert main(args) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (extra, err)
    assert fake_hub == [] and not (tmp_path / "rehearsal").exists()


def test_push_refuses_the_staging_folder_of_a_killed_patch(finished_run, tmp_path, fake_hub, capsys):
    staging = _copy(finished_run, tmp_path / ".tiny-mlr.partial-4242-0123abcd")
    assert main(["push", str(staging), "--repo-id", REPO]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is the staging folder of a write that did not finish" in err[0], err
    assert fake_hub == []


def test_push_skips_pickles_staging_folders_and_symlinks_out_and_lists_them(finished_run, tmp_path, fake_hub,
                                                                            capsys):
    """Pickles by content whatever their name (training_args.bin, optimizer.bin, *.pt, *.pickle, a protocol-0 pickle
    named .txt), a killed write's staging folder inside the run, a file and a folder symlinked from outside: none is
    uploaded, copied or listed as sent, and each is listed as skipped with why. A .bin that is not a pickle is
    uploaded (content, not name)."""
    import torch

    assert main(["push", str(finished_run), "--repo-id", REPO, "--dry-run"]) == 0
    clean = sorted(_dry_run_listing(capsys.readouterr().out))
    out = _copy(finished_run, tmp_path / "run")
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-7f3a")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "notes.md").write_text("outside")
    (out / "training_args.bin").write_bytes(pickle.dumps({"lr": 1e-3}, protocol=4))
    torch.save({"state": {}, "param_groups": []}, out / "optimizer.bin")
    torch.save(torch.zeros(2), out / "extra.pt")
    (out / "run_state.pickle").write_bytes(pickle.dumps([1, 2], protocol=2))
    (out / "notes.txt").write_bytes(pickle.dumps({"a": 1}, protocol=0))
    (out / ".tiny.partial-4242-0123abcd").mkdir()
    (out / ".tiny.partial-4242-0123abcd" / "model.safetensors").write_bytes(b"half")
    (out / "linked.txt").symlink_to(secret)
    (out / "shared").symlink_to(tmp_path / "shared")
    (out / "vocab.bin").write_bytes(bytes(range(256)))
    planted = ["training_args.bin", "optimizer.bin", "extra.pt", "run_state.pickle", "notes.txt",
               ".tiny.partial-4242-0123abcd/", "linked.txt", "shared/"]

    assert main(["push", str(out), "--repo-id", REPO]) == 0
    sent = fake_hub[-1][2]["sent"]
    assert sorted(sent) == sorted(clean + ["vocab.bin"]), sent
    printed = capsys.readouterr().out
    skipped = {line.split()[0] for line in printed.split("skipped (not uploaded)")[1].splitlines()[1:] if line}
    assert set(planted) <= skipped, printed
    assert "a pickle" in printed and "outside the folder" in printed and "staging folder" in printed

    assert main(["push", str(out), "--repo-id", REPO, "--dry-run"]) == 0
    assert sorted(_dry_run_listing(capsys.readouterr().out)) == sorted(sent)
    target = tmp_path / "rehearsal"
    assert main(["push", str(out), "--to-folder", str(target)]) == 0
    copied = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert copied == sorted(sent) and "SECRET-7f3a" not in "".join(p.read_text(errors="ignore")
                                                           for p in target.rglob("*") if p.is_file())


def test_push_never_sends_a_pickle_that_loads(finished_run, tmp_path, fake_hub, capsys):
    """Pickles that load, whatever their size and wrapping: a protocol-0 pickle padded past 16 MiB, a protocol-2
    pickle without its PROTO opcode padded the same way (an unpickler runs opcodes to STOP whatever the header), a
    gzip / bz2 / xz pickle, and opcodes that import and call something before the stream breaks (an unpickler runs
    them before it fails). None is sent, each is listed as skipped."""
    import bz2
    import gzip
    import io
    import lzma

    pad = "a" * (17 * 2**20)
    protoless = pickle.dumps({"pad": pad}, protocol=2)
    assert protoless[:2] == b"\x80\x02"
    calls_then_breaks = b"cbuiltins\nlen\n(S'ab'\ntR\xff\xff"
    planted = {"padded0.txt": pickle.dumps({"pad": pad}, protocol=0),
               "padded2.dat": protoless[2:],
               "state.gz": gzip.compress(pickle.dumps({"lr": 1e-3}, protocol=4)),
               "state.bz2": bz2.compress(pickle.dumps({"lr": 1e-3}, protocol=0)),
               "state.xz": lzma.compress(pickle.dumps({"lr": 1e-3}, protocol=2)[2:]),
               "calls.bin": calls_then_breaks}
    decompress = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}
    for name, data in planted.items():  # each really is what an unpickler runs
        data = decompress.get(Path(name).suffix, bytes)(data)
        if name == "calls.bin":
            found = []

            class Recording(pickle.Unpickler):
                def find_class(self, module, qualname):
                    found.append((module, qualname))
                    return super().find_class(module, qualname)

            with pytest.raises(pickle.UnpicklingError):
                Recording(io.BytesIO(data)).load()
            assert found == [("builtins", "len")]  # it imported, and called, before it broke
        else:
            assert pickle.loads(data) in ({"pad": pad}, {"lr": 1e-3})
    out = _copy(finished_run, tmp_path / "run")
    for name, data in planted.items():
        (out / name).write_bytes(data)
    assert main(["push", str(out), "--repo-id", REPO]) == 0
    sent = fake_hub[-1][2]["sent"]
    printed = capsys.readouterr().out
    assert not set(planted) & set(sent), sorted(sent)
    skipped = printed.split("skipped (not uploaded)")[1]
    for name in planted:
        assert f"  {name} " in skipped and "a pickle" in skipped, (name, skipped)
    target = tmp_path / "rehearsal"
    assert main(["push", str(out), "--to-folder", str(target)]) == 0
    assert not any((target / name).exists() for name in planted)


def _outside_weights(out: Path) -> None:
    outside = out.parent / "outside.safetensors"
    outside.write_bytes(b"OUTSIDE-BYTES-1c9e" * 64)
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").symlink_to(outside)


CHANGED_AFTER_THE_CHECK = {
    "weights truncated to half": lambda out: _truncate(out / "model.safetensors"),
    "weights replaced by a symlink out": _outside_weights,
    "config rewritten half": lambda out: (out / "config.json").write_text('{"model_type": '),
}


@pytest.mark.parametrize("case", list(CHANGED_AFTER_THE_CHECK))
def test_push_and_to_folder_send_the_bytes_they_checked(finished_run, tmp_path, fake_hub, case):
    """The check returns the bytes it checked, and the upload and the rehearsal send those: a folder changed after
    the check (another process still writing) changes nothing that is sent. Two phases, called here as the command
    calls them: ``finished_run`` (the check) then ``push_to_hub`` / ``copy_to_folder`` (the send)."""
    from hf_structattn.hub import copy_to_folder
    from hf_structattn.training.outputs import finished_run as check, push_to_hub

    out = _copy(finished_run, tmp_path / "run")
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    run = check(out)
    CHANGED_AFTER_THE_CHECK[case](out)
    assert push_to_hub(run, REPO) == REPO
    sent = fake_hub[-1][2]["sent"]
    assert "model.safetensors" in sent and "config.json" in sent
    assert {path: before[path] for path in sent} == sent
    assert not any(b"OUTSIDE-BYTES" in data for data in sent.values())

    target = tmp_path / "rehearsal"
    copy_to_folder(run, target)
    copied = {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert copied == sent


def test_links_are_not_followed_even_inside_the_folder(finished_run, tmp_path, fake_hub, capsys):
    """A symlink to a file of the folder is not sent either: a push reads the folder's own files, never a link
    (which could point elsewhere by the time it is read). Listed as skipped."""
    out = _copy(finished_run, tmp_path / "run")
    (out / "alias.json").symlink_to(out / "final_metrics.json")
    assert main(["push", str(out), "--repo-id", REPO]) == 0
    assert "alias.json" not in fake_hub[-1][2]["sent"]
    skipped = capsys.readouterr().out.split("skipped (not uploaded)")[1]
    assert "alias.json" in skipped and "a symlink" in skipped


TEXT_SUFFIXES = (".json", ".jsonl", ".md", ".py", ".txt", ".yaml", ".jinja", ".model")


def test_a_push_names_no_path_of_the_machine_it_came_from(tmp_path, fake_hub, capsys):
    """The card of a ``--model_path`` run embedded the config with ``"_name_or_path": "<home>/.cache/..."``: no file a
    push sends may name a path of this machine (the source folder, the output folder, the home folder)."""
    import torch
    import transformers
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from hf_structattn.tokenization import build_byte_tokenizer
    from hf_structattn.training.decoder_ft import main as finetune

    source = tmp_path / "home" / ".cache" / "some-model"  # where a user's downloaded or converted checkpoint sits
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      bos_token_id=256, eos_token_id=256, pad_token_id=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    tokenizer = build_byte_tokenizer()
    tokenizer.model_max_length = 256
    tokenizer.save_pretrained(source)
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        finetune(["--model_path", str(source), "--output_dir", str(out), "--mlr_ranks", "8", "4", "4",
                  "--mlr_max_length", "32", "--seq_len", "32", "--per_device_batch_size", "2", "--eval_windows", "2",
                  "--max_train_bytes", "20000", "--max_validation_bytes", "5000", "--max_steps", "2",
                  "--eval_every", "0", "--checkpoint_every", "1", "--sample_new_tokens", "4", "--disable_tqdm",
                  "--report_to", "none"])
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    assert main(["push", str(out), "--repo-id", REPO]) == 0
    sent = fake_hub[-1][2]["sent"]
    assert {"README.md", "config.json", "final_metrics.json", "tokenizer_config.json"} <= set(sent), sorted(sent)
    machine = {str(tmp_path), str(source), str(out), str(Path.home())} - {"/"}
    leaks = [f"{name}: {where}" for name, data in sent.items() if name.endswith(TEXT_SUFFIXES)
             for where in machine if where in data.decode("utf-8", errors="replace")]
    assert not leaks, leaks
    card = sent["README.md"].decode()
    assert '"_name_or_path"' not in card and "some-model" in card  # the source named by its folder's name only
