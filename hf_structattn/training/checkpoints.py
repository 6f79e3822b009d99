"""Resumable training checkpoints of the recipes: atomic, verified, rotated only after success, and free of pickles.

A checkpoint is a folder ``OUTPUT/checkpoints/checkpoint_<i>`` (``i`` counts saves) holding

* what ``accelerator.save_state`` writes for the model(s) and optimizer(s): ``model.safetensors`` (safetensors) and
  ``optimizer.bin`` (``torch.save`` of plain tensors and numbers; accelerate loads it with ``weights_only=True``);
* ``scheduler.json``: the learning-rate scheduler's ``state_dict`` (numbers only) as JSON;
* ``rng_state_<rank>.safetensors``: each process's RNG states (torch CPU/CUDA, Python ``random``, NumPy) as tensors;
* ``run.json``: the step, the run configuration, the number of processes, and the size of every file above.

accelerate's own RNG file (``random_states_<rank>.pkl``, a pickle with NumPy objects) is not kept, and no object is
registered with ``register_for_checkpointing`` (its ``custom_checkpoint_<n>.pkl`` is loaded with
``weights_only=False``, i.e. it can run code). Nothing in a checkpoint is ever unpickled with arbitrary globals.

**Saving** writes into a hidden ``checkpoints/.checkpoint_<i>.partial`` folder, writes ``run.json`` last, flushes
everything to disk and renames the folder to ``checkpoint_<i>``; only then are the oldest complete checkpoints beyond
``checkpoints_total_limit`` deleted. A crash while saving (disk full, kill) leaves at most a ``.partial`` folder,
which never counts toward the limit and is deleted by the next save or run.

**Resuming** (``--resume_from latest`` = the newest ``checkpoint_<i>`` with a ``run.json``, or a folder) first
verifies the checkpoint without loading it: ``run.json`` parses, every listed file exists with its recorded size,
nothing unlisted sits beside them, the safetensors headers and ``scheduler.json`` parse, and there is an RNG state for
every process. Any problem is one :class:`CheckpointError` line naming the file and what is wrong, and the previous
complete checkpoint to resume from instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..command_io import apply_umask
from .args import ConfigError, RunFailure

CHECKPOINT_STATE = "run.json"
SCHEDULER_STATE = "scheduler.json"
RNG_STATE = "rng_state_{rank}.safetensors"
FORMAT = 2  # run.json "format": 2 = this layout (file list, JSON scheduler, safetensors RNG states)
_COMPLETE = re.compile(r"checkpoint_(\d+)")
_PARTIAL = re.compile(r"\.checkpoint_(\d+)\.partial")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed (one line: the file and what is wrong); exit status 2 like bad input."""


class CheckpointWriteError(RunFailure):
    """Writing a checkpoint failed (disk full, ...); the previous checkpoints are untouched. Exit status 1."""


# ------------------------------------------------------------------------------------------ folders


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """The ``checkpoints/checkpoint_<i>`` folders of a run in save order (partial ``.checkpoint_<i>.partial``
    folders are not among them)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and _COMPLETE.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def partial_dirs(output_dir: str | Path) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and _PARTIAL.fullmatch(p.name)]


def remove_partial_checkpoints(output_dir: str | Path) -> list[Path]:
    """Delete what interrupted saves left behind (a run owns its output folder, so no one else writes there)."""
    removed = partial_dirs(output_dir)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _read_state(path: Path) -> Optional[dict]:
    """``run.json`` of a checkpoint folder as a dict, or None when it is missing or unreadable."""
    try:
        state = json.loads((path / CHECKPOINT_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def is_complete(path: Path) -> bool:
    """Written to the end by this version (run.json lists the files). Cheap: used for rotation."""
    state = _read_state(path)
    return state is not None and state.get("format") == FORMAT and isinstance(state.get("files"), dict)


# ------------------------------------------------------------------------------------------ RNG states


def rng_state_tensors() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states as tensors + string metadata (what ``safetensors`` stores; nothing executable)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    version, python_state, gauss = random.getstate()
    tensors["python_mt"] = torch.tensor(python_state, dtype=torch.int64)
    kind, numpy_state, position, has_gauss, cached = np.random.get_state()
    tensors["numpy_mt"] = torch.from_numpy(numpy_state.astype(np.int64))
    metadata = {"python_version": str(version), "python_gauss": json.dumps(gauss), "numpy_kind": kind,
                "numpy_position": str(position), "numpy_has_gauss": str(has_gauss),
                "numpy_cached_gaussian": repr(float(cached))}
    return tensors, metadata


def save_rng_state(path: Path) -> None:
    from safetensors.torch import save_file

    tensors, metadata = rng_state_tensors()
    save_file(tensors, str(path), metadata=metadata)


def load_rng_state(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted((int(name.rsplit("_", 1)[1]), t) for name, t in tensors.items() if name.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t for _, t in cuda])
    random.setstate((int(metadata["python_version"]), tuple(int(v) for v in tensors["python_mt"].tolist()),
                     json.loads(metadata["python_gauss"])))
    np.random.set_state((metadata["numpy_kind"], tensors["numpy_mt"].numpy().astype(np.uint32),
                         int(metadata["numpy_position"]), int(metadata["numpy_has_gauss"]),
                         float(metadata["numpy_cached_gaussian"])))


_RNG_KEYS = ("torch_cpu", "python_mt", "numpy_mt")
_RNG_METADATA = ("python_version", "python_gauss", "numpy_kind", "numpy_position", "numpy_has_gauss",
                 "numpy_cached_gaussian")


# ------------------------------------------------------------------------------------------ verification


def _size(count: int) -> str:
    return f"{count:,} byte{'s' if count != 1 else ''}"


def verify_checkpoint(path: Path, world_size: int) -> dict:
    """Check a checkpoint folder without loading it (module docstring); returns its ``run.json``. Raises
    :class:`CheckpointError` naming the first file that is wrong."""
    from safetensors import safe_open

    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    run = path / CHECKPOINT_STATE
    if not run.is_file():
        raise CheckpointError(f"{run}: missing (the save did not finish, or this is not a recipe checkpoint)")
    raw = run.read_bytes()
    if not raw.strip():
        raise CheckpointError(f"{run}: empty")
    try:
        state = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{run}: not text (invalid UTF-8)") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{run}: invalid JSON at line {error.lineno}, column {error.colno}: "
                              f"{error.msg}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{run}: expected a JSON object, got {type(state).__name__}")
    if state.get("format") != FORMAT or not isinstance(state.get("files"), dict):
        raise CheckpointError(f"{run}: written by an older hf_structattn (no file list; its training state is "
                              "pickled and is not loaded); start a new run")
    step, configuration, processes = state.get("step"), state.get("configuration"), state.get("processes")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{run}: 'step' must be a non-negative integer, got {step!r}")
    if not isinstance(configuration, dict):
        raise CheckpointError(f"{run}: 'configuration' must be an object, got {type(configuration).__name__}")
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise CheckpointError(f"{run}: 'processes' must be a positive integer, got {processes!r}")
    if processes != world_size:
        raise CheckpointError(f"{path}: written by {processes} process(es) but resumed with {world_size}: every "
                              "process needs its own RNG state, resume with the same number of processes")
    listed: dict = state["files"]
    for name, size in listed.items():
        parts = Path(name).parts
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in parts or not parts:
            raise CheckpointError(f"{run}: file entry {name!r} is not a path inside the checkpoint")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{run}: size of {name} must be a non-negative integer, got {size!r}")
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() or p.is_symlink()}
    for name in sorted(present - set(listed) - {CHECKPOINT_STATE}):
        raise CheckpointError(f"{path / name}: not part of the checkpoint (not in {CHECKPOINT_STATE}); a file "
                              "nobody wrote is never loaded: remove it")
    required = [SCHEDULER_STATE] + [RNG_STATE.format(rank=r) for r in range(world_size)]
    if not any(name.endswith(".safetensors") and name.startswith("model") for name in listed) and \
            not any(name.startswith("pytorch_model") for name in listed):
        required.insert(0, "model.safetensors")
    for name in required + sorted(listed):
        file = path / name
        if file.is_symlink() or (file.exists() and not file.is_file()):
            raise CheckpointError(f"{file}: not a regular file")
        if not file.exists():
            raise CheckpointError(f"{file}: missing")
        if name in listed and file.stat().st_size != listed[name]:
            actual = file.stat().st_size
            what = "truncated" if actual < listed[name] else "changed"
            raise CheckpointError(f"{file}: {what} ({_size(actual)} on disk, {_size(listed[name])} written)")
    for name in sorted(listed):
        file = path / name
        if name.endswith(".safetensors"):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    keys, metadata = list(handle.keys()), handle.metadata() or {}
            except Exception as error:  # safetensors raises its own SafetensorError
                raise CheckpointError(f"{file}: not a valid safetensors file ({_first_line(error)})") from None
            if name.startswith("rng_state_"):
                missing = [k for k in _RNG_KEYS if k not in keys] + [k for k in _RNG_METADATA if k not in metadata]
                if missing:
                    raise CheckpointError(f"{file}: RNG state without {', '.join(missing)}")
    try:
        scheduler = json.loads((path / SCHEDULER_STATE).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path / SCHEDULER_STATE}: invalid JSON ({_first_line(error)})") from None
    if not isinstance(scheduler, dict) or "last_epoch" not in scheduler:
        raise CheckpointError(f"{path / SCHEDULER_STATE}: not a learning-rate scheduler state")
    return state


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def previous_complete(path: Path, world_size: int) -> Optional[tuple[Path, int]]:
    """The newest checkpoint saved before ``path`` (beside it) that passes :func:`verify_checkpoint`."""
    match = _COMPLETE.fullmatch(path.name)
    siblings = checkpoint_dirs(path.parent.parent) if path.parent.name == "checkpoints" else []
    older = [p for p in siblings if match is None or int(p.name.split("_")[1]) < int(match.group(1))]
    for candidate in reversed(older):
        try:
            return candidate, verify_checkpoint(candidate, world_size)["step"]
        except CheckpointError:
            continue
    return None


def _with_previous(error: CheckpointError, path: Path, world_size: int) -> CheckpointError:
    previous = previous_complete(path, world_size)
    hint = (f"; the previous complete checkpoint is {previous[0].name} (step {previous[1]}): --resume_from "
            f"{previous[0]}" if previous else "; there is no earlier complete checkpoint")
    return CheckpointError(f"{error}{hint}")


def resolve_checkpoint(resume_from: str, output_dir: str | Path, world_size: int) -> tuple[Path, dict]:
    """The checkpoint ``--resume_from`` names (``latest``: the newest ``checkpoint_<i>`` that has a run.json),
    verified; returns it and its ``run.json``."""
    if resume_from == "latest":
        found = [p for p in checkpoint_dirs(output_dir) if (p / CHECKPOINT_STATE).exists()]
        if not found:
            raise CheckpointError(f"--resume_from latest: no checkpoint under {Path(output_dir) / 'checkpoints'}")
        path = found[-1]
    else:
        path = Path(resume_from)
        if not path.is_dir():
            raise CheckpointError(f"--resume_from {path}: no such folder")
    try:
        return path, verify_checkpoint(path, world_size)
    except CheckpointError as error:
        raise _with_previous(error, path, world_size) from None


# ------------------------------------------------------------------------------------------ saving and loading


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(descriptor)



class _TiedWeightsNotice(logging.Filter):
    """accelerate logs "Removed shared tensor {'lm_head.weight'} while saving" at every checkpoint of a model with
    tied embeddings: the tensor is saved once and re-tied on load (the resume tests check the weights), so the line
    says nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


@contextlib.contextmanager
def _without_tied_weights_notice():
    logger, notice = logging.getLogger("accelerate.utils.other"), _TiedWeightsNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)

class CheckpointWriter:
    """Numbers, writes and rotates the checkpoints of one run (module docstring). Every process calls
    :meth:`save` together."""

    def __init__(self, accelerator, output_dir: str | Path, total_limit: int):
        self.accelerator = accelerator
        self.root = Path(output_dir) / "checkpoints"
        self.total_limit = total_limit
        existing = checkpoint_dirs(output_dir)
        # new saves number after every existing folder, so "latest" is always the newest save
        self.next_index = int(existing[-1].name.split("_")[1]) + 1 if existing else 0

    def save(self, step: int, configuration: dict, scheduler) -> Path:
        accelerator = self.accelerator
        index = self.next_index
        self.next_index += 1
        staging, final = self.root / f".checkpoint_{index}.partial", self.root / f"checkpoint_{index}"
        try:
            if accelerator.is_main_process:
                if staging.exists():
                    shutil.rmtree(staging)
                staging.mkdir(parents=True)
            accelerator.wait_for_everyone()
            with _without_tied_weights_notice():
                accelerator.save_state(str(staging))  # model(s), optimizer(s), scaler; plus accelerate's RNG pickle:
            rank = accelerator.process_index
            (staging / f"random_states_{rank}.pkl").unlink(missing_ok=True)  # replaced by a safetensors file
            save_rng_state(staging / RNG_STATE.format(rank=rank))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                (staging / SCHEDULER_STATE).write_text(json.dumps(scheduler.state_dict(), indent=1))
                files = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*"))
                         if p.is_file()}
                state = {"format": FORMAT, "step": step, "configuration": configuration,
                         "processes": accelerator.num_processes, "files": files}
                (staging / CHECKPOINT_STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
                apply_umask(staging)  # safetensors writes 0600; the checkpoint's files get the user's mode
                for path in [*staging.rglob("*"), staging]:
                    _fsync(path)
                os.rename(staging, final)  # atomic: the folder appears complete or not at all
                _fsync(self.root)
                self.rotate()
        except BaseException as error:
            if accelerator.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            if isinstance(error, Exception):
                complete = [p for p in checkpoint_dirs(self.root.parent) if is_complete(p)]
                where = (f"--resume_from latest continues from {complete[-1].name}" if complete else
                         "no earlier checkpoint exists")
                raise CheckpointWriteError(f"saving checkpoint_{index} (step {step}) failed, the earlier "
                                           f"checkpoints are intact ({where}): {_first_line(error)}") from error
            raise
        accelerator.wait_for_everyone()
        return final

    def rotate(self) -> list[Path]:
        """Delete the oldest complete checkpoints beyond the limit (partial folders never count)."""
        complete = [p for p in checkpoint_dirs(self.root.parent) if is_complete(p)]
        doomed = complete[:max(0, len(complete) - self.total_limit)]
        for path in doomed:
            shutil.rmtree(path)
        return doomed


def load_checkpoint(accelerator, path: Path, scheduler) -> None:
    """Restore model(s), optimizer(s) (through accelerate: safetensors and ``weights_only=True``), the scheduler
    (JSON) and this process's RNG states (safetensors). A file that verified but does not load is a one-line
    :class:`CheckpointError`."""
    try:
        accelerator.load_state(str(path))
        scheduler.load_state_dict(json.loads((path / SCHEDULER_STATE).read_text(encoding="utf-8")))
        load_rng_state(path / RNG_STATE.format(rank=accelerator.process_index))
    except Exception as error:
        raise _with_previous(CheckpointError(f"{_unloadable_file(path)}: cannot be loaded ({_first_line(error)})"),
                             path, accelerator.num_processes) from None


def _unloadable_file(path: Path) -> Path:
    """The first file of a verified checkpoint that does not load on its own (accelerate's error does not say which:
    tried only after a load failed, with the same safe loaders), or the folder when each file loads alone."""
    from safetensors.torch import load_file

    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        try:
            if file.suffix == ".safetensors":
                load_file(str(file))
            elif file.suffix in (".bin", ".pt"):
                torch.load(file, map_location="cpu", weights_only=True)
            elif file.suffix == ".json":
                json.loads(file.read_text(encoding="utf-8"))
        except Exception:
            return file
    return path
