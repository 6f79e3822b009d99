"""Publishing a finished output folder (a recipe run or a ``hf-structattn patch`` result) to the Hub, again or for the
first time, and rehearsing that upload offline.

``hf-structattn push OUTPUT_DIR --repo-id USER/NAME`` sends exactly what a recipe's ``--push_to_hub`` sends: the files
of a finished run as :func:`hf_structattn.training.outputs.finished_run` (the one definition) read and checked them.
That check reads each file once from the folder itself (directory handles, ``O_NOFOLLOW``: no link is followed),
checks those bytes (sizes, safetensors headers against the data and the config, JSON, no pickle or other stream an
unpickler would run, ``auto_map`` naming only modules in the folder, every ``.py`` compiling and the package's
payload byte for byte) and returns them; the upload (one ``create_commit`` of those bytes) and the rehearsal send
those bytes, never the folder as it is later. It leaves out checkpoints, bookkeeping, pickles, staging folders and
links, and lists them. ``--dry-run`` prints that file list without touching the network; ``--to-folder DIR`` writes
the checked bytes into a local folder (each file verified, size and sha256, before the folder appears), which then
holds what the Hub repository would (load it with ``trust_remote_code=True`` to check).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


class PushError(Exception):
    """A user-facing failure: one line; ``code`` 2 for bad input or an unusable Hub, 1 when the upload failed."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def finished(output_dir: str | Path):
    """The folder as a finished run (:func:`hf_structattn.training.outputs.finished_run`, the one definition the
    recipes use too), or :class:`PushError` with its one line."""
    from .training.outputs import NotAFinishedRun, finished_run

    try:
        return finished_run(output_dir)
    except NotAFinishedRun as error:
        raise PushError(str(error)) from None


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


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def describe(run) -> list[str]:
    """The listing of a push: every file sent with its size, the total, then what is skipped and why."""
    from .training.outputs import describe_skipped

    files = run.files
    return [f"  {_mib(f.size):>12}  {f.path}" for f in files] + [
        f"  {_mib(sum(f.size for f in files)):>12}  in all ({len(files)} files)"] + describe_skipped(run)


def copy_to_folder(run, target: str | Path):
    """Write exactly the bytes an upload of ``run`` (a :func:`finished` run) would send into ``target`` (absent or
    empty): the local rehearsal of a push. Each file is read back and verified (size and sha256 of the bytes
    checked) before the folder is renamed into place, so ``target`` appears complete and right or not at all."""
    import hashlib

    from .command_io import CliError, check_out_dir, save_atomically

    dest, out = Path(target), run.folder
    try:
        check_out_dir(dest)
    except CliError as error:
        raise PushError(str(error).replace("OUT_DIR", "--to-folder", 1)) from None
    if dest.resolve() == out.resolve() or out.resolve() in dest.resolve().parents:
        raise PushError(f"--to-folder {dest} lies inside OUTPUT_DIR {out}; choose a folder outside it")

    def write(folder: Path) -> None:
        flags = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        for f in run.files:
            (folder / f.path).parent.mkdir(parents=True, exist_ok=True)
            with os.fdopen(os.open(folder / f.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644), "wb") as w:
                w.write(f.data)
        for f in run.files:
            with os.fdopen(os.open(folder / f.path, os.O_RDONLY | flags), "rb") as handle:
                copied = handle.read()
            if len(copied) != f.size or hashlib.sha256(copied).hexdigest() != f.sha256:
                raise PushError(f"--to-folder: the copy of {f.path} is not the bytes checked ({len(copied)} bytes, "
                                f"sha256 {hashlib.sha256(copied).hexdigest()[:16]}; checked {f.size} bytes, sha256 "
                                f"{f.sha256[:16]}); nothing written to {dest}", code=1)

    save_atomically(dest, write)
    return run


def push_output_dir(output_dir: str | Path, repo_id: str, private: bool = False,
                    commit_message: str = "Upload model trained with hf_structattn"):
    """Check that the folder is a finished run, the token and the repository (``whoami``,
    ``create_repo(exist_ok=True)``), then upload exactly the run's files. Returns the finished run."""
    from .training.args import ConfigError, RunFailure
    from .training.outputs import check_hub_access, push_to_hub

    run = finished(output_dir)
    repo_id = check_repo_id(repo_id)
    try:
        repo_id = check_hub_access(repo_id, private=private, flag="push")
    except ConfigError as error:
        raise PushError(str(error), code=2) from None
    try:
        push_to_hub(run, repo_id, private=private, commit_message=commit_message)
    except RunFailure as error:
        raise PushError(str(error), code=1) from None
    return run
