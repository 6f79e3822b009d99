"""``hf-structattn push``: upload a finished run again (or for the first time), rehearse it offline (``--dry-run``,
``--to-folder``). The run is a real tiny ``train_clm`` run; only the Hub's network boundary (``HfApi.whoami`` /
``create_repo`` / ``upload_folder``) is replaced, as in tests/test_recipes.py."""

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

from hf_structattn_cli import main

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

    def fake_upload_folder(self, *, repo_id, folder_path, **kwargs):
        listing = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file())
        sent = [p for p in listing if not any(fnmatch.fnmatch(p, pat) for pat in kwargs["ignore_patterns"])]
        calls.append(("upload_folder", repo_id, dict(kwargs, folder_path=folder_path, sent=sent)))

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", fake_whoami)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake_upload_folder)
    return calls


def _dry_run_listing(output: str) -> list[str]:
    return [line.split()[-1] for line in output.splitlines()[1:] if "MiB" in line and "in all" not in line]


def test_push_uploads_a_finished_run_with_the_recipes_ignore_patterns(finished_run, fake_hub, capsys):
    assert main(["push", str(finished_run), "--repo-id", REPO, "--private"]) == 0
    assert [c[0] for c in fake_hub] == ["whoami", "create_repo", "upload_folder"]
    assert fake_hub[1][1] == REPO and fake_hub[1][2]["private"] is True and fake_hub[1][2]["exist_ok"] is True
    upload = fake_hub[2][2]
    assert fake_hub[2][1] == REPO and upload["folder_path"] == str(finished_run)
    sent = set(upload["sent"])
    assert {"config.json", "model.safetensors", "modeling_structattn_gpt2.py", "README.md",
            "final_metrics.json"} <= sent, sent
    assert not any(p.startswith("checkpoints/") for p in sent) and "run_config.json" not in sent
    out = capsys.readouterr().out
    assert f"to https://huggingface.co/{REPO}" in out

    # the dry run lists exactly what upload_folder was given to send, and touches no network
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

    def refused(self, **kwargs):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", refused)
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
