"""Publishing a finished output folder (a recipe run or a ``hf-structattn patch`` result) to the Hub, again or for the
first time, and rehearsing that upload offline.

``hf-structattn push OUTPUT_DIR --repo-id USER/NAME`` uploads with ``HfApi().upload_folder`` exactly what a recipe's
``--push_to_hub`` uploads (:data:`hf_structattn.training.outputs.HUB_IGNORE_PATTERNS` leaves out checkpoints and
bookkeeping). ``--dry-run`` prints that file list without touching the network; ``--to-folder DIR`` copies it into a
local folder, which then holds what the Hub repository would (load it with ``trust_remote_code=True`` to check).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# what makes a folder a model checkpoint worth uploading (a recipe's output folder or a patched checkpoint)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


class PushError(Exception):
    """A user-facing failure: one line; ``code`` 2 for bad input or an unusable Hub, 1 when the upload failed."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class UploadFile:
    path: str  # relative to the output folder, with forward slashes (its path in the repository)
    size: int


def ignore_patterns() -> list[str]:
    """The patterns ``upload_folder`` skips for a recipe's upload: ours plus huggingface_hub's defaults (``.git``,
    ``.cache/huggingface``)."""
    from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS

    from .training.outputs import HUB_IGNORE_PATTERNS

    return list(HUB_IGNORE_PATTERNS) + list(DEFAULT_IGNORE_PATTERNS)


def check_output_dir(output_dir: str | Path) -> Path:
    """The folder exists and holds a checkpoint (``config.json`` and weights); :class:`PushError` naming it if not."""
    out = Path(output_dir)
    if not out.exists():
        raise PushError(f"OUTPUT_DIR {out} does not exist")
    if not out.is_dir():
        raise PushError(f"OUTPUT_DIR {out} is not a directory")
    if not (out / "config.json").is_file():
        raise PushError(f"OUTPUT_DIR {out} holds no config.json: not a finished run or checkpoint folder")
    if not any((out / name).is_file() for name in _WEIGHT_FILES):
        raise PushError(f"OUTPUT_DIR {out} holds no weights ({', '.join(_WEIGHT_FILES)}): not a finished run or "
                        f"checkpoint folder")
    return out


def check_repo_id(repo_id: Optional[str]) -> str:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not repo_id:
        raise PushError("--repo-id is required (USER/NAME or ORG/NAME), e.g. --repo-id someone/gpt2-mlr")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(f"--repo-id {repo_id!r} is not a valid repository id ({str(error).splitlines()[0]})") from None
    if repo_id.count("/") != 1:
        raise PushError(f"--repo-id {repo_id!r} must be USER/NAME or ORG/NAME")
    return repo_id


def files_to_upload(output_dir: str | Path) -> list[UploadFile]:
    """The files ``upload_folder`` sends from ``output_dir``, sorted (the same filter, the same patterns)."""
    from huggingface_hub.utils import filter_repo_objects

    out = Path(output_dir)
    relative = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    kept = filter_repo_objects(relative, ignore_patterns=ignore_patterns())
    return [UploadFile(path, (out / path).stat().st_size) for path in kept]


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def describe(files: list[UploadFile]) -> list[str]:
    return [f"  {_mib(f.size):>12}  {f.path}" for f in files] + [
        f"  {_mib(sum(f.size for f in files)):>12}  in all ({len(files)} files)"]


def copy_to_folder(output_dir: str | Path, target: str | Path) -> list[UploadFile]:
    """Copy exactly the files an upload would send into ``target`` (absent or empty; written atomically): the local
    rehearsal of a push."""
    from .cli import CliError, _check_out_dir, save_atomically

    out, dest = check_output_dir(output_dir), Path(target)
    try:
        _check_out_dir(dest)
    except CliError as error:
        raise PushError(str(error).replace("OUT_DIR", "--to-folder", 1)) from None
    if dest.resolve() == out.resolve() or out.resolve() in dest.resolve().parents:
        raise PushError(f"--to-folder {dest} lies inside OUTPUT_DIR {out}; choose a folder outside it")
    files = files_to_upload(out)

    def write(folder: Path) -> None:
        for f in files:
            (folder / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / f.path, folder / f.path)

    save_atomically(dest, write)
    return files


def push_output_dir(output_dir: str | Path, repo_id: str, private: bool = False,
                    commit_message: str = "Upload model trained with hf_structattn") -> list[UploadFile]:
    """Check the token and the repository (``whoami``, ``create_repo(exist_ok=True)``), then ``upload_folder`` the
    output folder with the recipes' ignore patterns. Returns the files sent."""
    from .training.args import ConfigError, RunFailure
    from .training.outputs import check_hub_access, push_to_hub

    out = check_output_dir(output_dir)
    repo_id = check_repo_id(repo_id)
    files = files_to_upload(out)
    try:
        repo_id = check_hub_access(repo_id, private=private, flag="push")
    except ConfigError as error:
        raise PushError(str(error), code=2) from None
    try:
        push_to_hub(out, repo_id, private=private, commit_message=commit_message)
    except RunFailure as error:
        raise PushError(str(error), code=1) from None
    return files
