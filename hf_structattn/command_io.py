"""What the ``hf-structattn`` commands share (``hf_structattn.cli``'s patch and ``hf_structattn.hub``'s push): the
one-line user-facing error, the check of an output folder and atomic writes into it (a staging folder renamed into
place, and the stale staging folders of killed writes removed)."""

import os
import re
import secrets
import shutil
from pathlib import Path


class CliError(Exception):
    """A user-facing failure: one line on stderr, exit code ``code`` (2: bad input, 1: writing failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def check_out_dir(out: Path) -> None:
    """Refuse an output folder that exists and is not an empty directory, or whose nearest existing parent is not a
    directory (``CliError``, naming it OUT_DIR)."""
    if out.exists() and not out.is_dir():
        raise CliError(f"OUT_DIR {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise CliError(f"OUT_DIR {out} exists and is not empty")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CliError(f"OUT_DIR {out}: {parent} is not a directory")
            break


def _partial_pattern(out: Path) -> "re.Pattern":
    return re.compile(rf"\.{re.escape(out.name)}\.partial-(\d+)-[0-9a-f]{{8}}")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OverflowError:
        return False
    return True


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete the hidden staging folders of earlier writes of ``out`` whose writer is gone (killed, e.g. by
    ``kill -9``, which no ``finally`` survives): folders next to ``out`` named exactly
    ``.<name>.partial-<pid>-<8 hex>`` (the pattern :func:`save_atomically` creates) whose process no longer exists.
    Folders of a live writer, of another output, symlinks and files are left alone. Returns what was removed."""
    if not out.parent.is_dir():
        return []
    pattern, removed = _partial_pattern(out), []
    for entry in out.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir() or _process_alive(int(match.group(1))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def user_file_mode() -> int:
    """The mode a file created by ``open()`` gets in this process: ``0o666`` less the umask."""
    try:  # Linux states the umask without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def apply_umask(path: Path) -> None:
    """Give ``path`` (a file, or every file under a folder, links not followed) the mode the user's umask gives a new
    file. Writers that go through a temporary file (safetensors' ``save_file``, ``tempfile``) create it ``0600``;
    this runs on what they wrote, before it is renamed into place, so the weights are as readable as the config
    beside them."""
    mode = user_file_mode()
    path = Path(path)
    files = [path] if not path.is_dir() else [p for p in path.rglob("*") if not p.is_symlink() and p.is_file()]
    for file in files:
        if file.is_file() and not file.is_symlink() and (file.stat().st_mode & 0o777) != mode:
            os.chmod(file, mode)


def save_atomically(out: Path, write) -> None:
    """Call ``write(folder)`` on a fresh hidden folder next to ``out`` and rename it to ``out`` (which must be
    absent or empty). On any failure, interruption included, the folder and the parents this call created are
    removed and the error is re-raised: ``out`` either appears complete or not at all. A process killed outright
    (``kill -9``) cannot clean up; its folder is removed by the next write of the same ``out``
    (:func:`remove_stale_partials`)."""
    created = [parent for parent in out.parents if not parent.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        write(staging)
        apply_umask(staging)
        os.rename(staging, out)  # replaces an empty directory; fails (ENOTEMPTY) if someone filled it meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in created:  # innermost first
            try:
                parent.rmdir()
            except OSError:
                break
        raise


__all__ = ["CliError", "apply_umask", "check_out_dir", "remove_stale_partials", "save_atomically", "user_file_mode"]
