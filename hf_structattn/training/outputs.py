"""What a recipe leaves behind: model card, plots, metrics file, and the optional Hub upload of a finished run."""

from __future__ import annotations

import bz2
import fnmatch
import gzip
import hashlib
import io
import json
import lzma
import os
import pickletools
import re
import socket
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .args import ConfigError, RunFailure, run_configuration

# never uploaded: resumable training state, the recipes' sources and bookkeeping are not part of the published model
HUB_IGNORE_PATTERNS = ["checkpoints/*", "checkpoints/**", "base_tiny_chronos_t5/*", "source/*", "source/**", "*.pkl",
                       "run_config.json"]
# huggingface_hub's own defaults (``hf_api.DEFAULT_IGNORE_PATTERNS``), which its upload_folder adds to any: kept
_HUB_DEFAULT_IGNORE = [".git", ".git/*", "*/.git", "**/.git/**", ".cache/huggingface", ".cache/huggingface/*",
                       "*/.cache/huggingface", "**/.cache/huggingface/**"]
# the staging folder of a write killed midway: a patch's ``.OUT.partial-<pid>-<8 hex>`` (command_io.save_atomically), a
# checkpoint's ``.checkpoint_<i>.partial`` (training.checkpoints)
_STAGING = re.compile(r"\..+\.partial(-\d+-[0-9a-f]{8})?")
_WEIGHTS_INDEX = "model.safetensors.index.json"


class NotAFinishedRun(ConfigError):
    """What makes a folder not a finished run, in one line naming the file."""


@dataclass(frozen=True)
class UploadFile:
    """One file a push sends: its path in the repository (relative to the folder, forward slashes) and the bytes
    :func:`finished_run` read and checked, which are what is sent or copied."""

    path: str
    data: bytes = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class FinishedRun:
    """A folder that passed :func:`finished_run`: the files an upload sends (with the bytes checked) and what it
    leaves out, with why."""

    folder: Path
    files: tuple  # UploadFile, sorted by path
    skipped: tuple  # (path relative to the folder, a trailing "/" for a folder; why it is not uploaded)


# ------------------------------------------------------------------------------ nothing sent can execute on load
# opcodes by which an unpickler imports something, and by which it calls what it has imported (INST does both)
_IMPORTS = {"GLOBAL", "STACK_GLOBAL", "INST", "EXT1", "EXT2", "EXT4"}
_CALLS = {"REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX"}
_COMPRESSED = ((b"\x1f\x8b", "gzip", lambda stream: gzip.GzipFile(fileobj=stream)), (b"BZh", "bz2", bz2.BZ2File),
               (b"\xfd7zXZ\x00", "xz", lzma.LZMAFile))


def pickle_inside(data: bytes) -> Optional[str]:
    """How ``data`` would run code when unpickled, or None: a pickle of any protocol, with or without its PROTO
    opcode, whatever its size (its opcodes are read as a stream, to STOP), or opcodes that import and call something
    before the stream breaks (an unpickler runs those before it fails); looked for inside gzip / bz2 / xz streams and
    zip members (``torch.save``'s format), one level deep (a compressed stream or zip inside one is not looked
    into, and counts as one)."""
    return _pickle_in_stream(io.BytesIO(data), depth=0)


def _pickle_in_stream(stream, depth: int) -> Optional[str]:
    head = stream.read(6)
    stream.seek(0)  # (a decompressing stream rewinds by starting again)
    wrapped = "zip" if head[:2] == b"PK" else next((kind for magic, kind, _ in _COMPRESSED if head.startswith(magic)),
                                                   None)
    if wrapped and depth >= 1:
        return f"a {wrapped} stream inside another, not looked into (it could hold a pickle)"
    if wrapped == "zip":
        try:
            with zipfile.ZipFile(stream) as archive:
                for name in archive.namelist():
                    if name.endswith(".pkl"):
                        return f"a zip holding a pickle ({name}; unpickling runs code)"
                    if not name.endswith("/"):
                        with archive.open(name) as member:
                            found = _pickle_in_stream(member, depth + 1)
                        if found:
                            return f"a zip whose member {name} is {found}"
            return None
        except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError):
            stream.seek(0)  # not a zip after all: its opcodes, below
    elif wrapped:
        opener = next(opener for _, kind, opener in _COMPRESSED if kind == wrapped)
        found = _pickle_in_stream(opener(stream), depth + 1)
        return f"a {wrapped}-compressed {found.removeprefix('a ')}" if found else None
    return _opcodes_run_code(stream)


def _opcodes_run_code(stream) -> Optional[str]:
    imported = False
    try:
        for opcode, _, _ in pickletools.genops(stream):
            if opcode.name == "STOP" or (imported and opcode.name in _CALLS):
                return "a pickle (unpickling runs code)"
            imported = imported or opcode.name in _IMPORTS
    except Exception:  # the stream breaks here, as it would for an unpickler: what came before has run
        pass
    return None


# --------------------------------------------------------------------------------------- the folder's own files
def _ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern in HUB_IGNORE_PATTERNS + _HUB_DEFAULT_IGNORE)


def _read_once(dir_fd: int, name: str, listed_size: int, path: Path) -> bytes:
    """The bytes of ``name`` in the folder ``dir_fd``, opened once without following a link (``O_NOFOLLOW``),
    checked to be a regular file of the size the listing saw, and read to its end from that handle."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError as error:
        raise NotAFinishedRun(f"{path} changed while being read ({error.strerror}; now a link or gone): another "
                              f"process is writing the folder; push when it is done") from None
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode) or status.st_size != listed_size:
            raise NotAFinishedRun(f"{path} changed while being read (size {listed_size} listed, {status.st_size} "
                                  f"opened): another process is writing the folder; push when it is done")
        data = handle.read()
    if len(data) != listed_size:
        raise NotAFinishedRun(f"{path} changed while being read ({listed_size} bytes listed, {len(data)} read): "
                              f"another process is writing the folder; push when it is done")
    return data


def _snapshot(out: Path) -> tuple[dict, list]:
    """({path: bytes} of the files to check, skipped) of ``out``, walked through directory handles without
    following any link; every file is read once (:func:`_read_once`). Skipped with why: links (files or folders),
    staging folders of killed writes, the ignore patterns, pickles by content and what is not a regular file."""
    files, skipped = {}, []

    def walk(dir_fd: int, prefix: str) -> None:
        for name in sorted(os.listdir(dir_fd)):
            relative, path = prefix + name, out / (prefix + name)
            status = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(status.st_mode):
                target = path.resolve()
                where = "inside the folder: links are not followed" if root in target.parents else "outside the folder"
                if target.is_dir():
                    skipped.append((relative + "/", f"a symlinked folder (to {target}, {where})"))
                else:
                    skipped.append((relative, f"a symlink to {target}, {where}"))
            elif stat.S_ISDIR(status.st_mode):
                if _STAGING.fullmatch(name):
                    skipped.append((relative + "/", "the staging folder of a write that did not finish"))
                elif _ignored(relative + "/x"):
                    skipped.append((relative + "/", "training state or sources, not part of the published model"))
                else:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                    try:
                        walk(sub, relative + "/")
                    finally:
                        os.close(sub)
            elif not stat.S_ISREG(status.st_mode):
                skipped.append((relative, "not a regular file"))
            elif _ignored(relative):
                skipped.append((relative, "a pickle (by name): not published" if relative.endswith(".pkl") else
                                "bookkeeping, not part of the published model"))
            else:
                data = _read_once(dir_fd, name, status.st_size, path)
                found = None if relative.endswith(".safetensors") else pickle_inside(data)
                if found:
                    skipped.append((relative, f"{found}: not published"))
                else:
                    files[relative] = data

    root, root_fd = out.resolve(), os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        walk(root_fd, "")
    except OSError as error:  # an entry went away or became a link between listing and opening it
        raise NotAFinishedRun(f"{out} changed while being read ({error.strerror}: {error.filename}): another process "
                              f"is writing the folder; push when it is done") from None
    finally:
        os.close(root_fd)
    return dict(sorted(files.items())), sorted(skipped)


def _json(out: Path, path: str, data: bytes):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NotAFinishedRun(f"{out / path} is not valid JSON ({' '.join(str(error).split())}): not a finished "
                              f"run") from None


def finished_run(output_dir: str | os.PathLike, name: str = "OUTPUT_DIR") -> FinishedRun:
    """The one definition of a finished run (a recipe's output folder or a patched checkpoint), used by
    ``hf-structattn push`` (and its ``--dry-run`` / ``--to-folder``), the recipes' ``--push_to_hub`` and the
    ``--resume_from`` check that a run is complete. It reads every file once, from the folder itself (through
    directory handles, ``O_NOFOLLOW``: no link is followed), checks those bytes and returns them: what a push sends
    is the :class:`FinishedRun` this returns, not what is on disk later. A folder is a finished run when:

    * ``config.json`` parses as a JSON object, every other ``*.json`` parses, and a recipe run (``run_config.json``)
      wrote ``final_metrics.json``;
    * the weights are safetensors (``model.safetensors``, or the shards of ``model.safetensors.index.json``) whose
      headers parse and whose tensors cover their data exactly (a save killed midway leaves a file the header does
      not cover), holding every tensor, of its shape, of the model ``config.json`` describes (built on the meta
      device);
    * every ``auto_map`` (of ``config.json`` and of any other JSON that carries one) names ``module.Class`` of a
      ``module.py`` in the folder; every ``.py`` compiles, and each the package writes (the module of an
      ``auto_map`` and what it imports, as ``save_pretrained`` copies them) is there, byte for byte the package's;
    * the folder is not the staging folder of a write that did not finish, and no essential file is a link.

    What is not uploaded is skipped and listed: anything an unpickler would run (:func:`pickle_inside`) whatever
    its name, staging folders inside, links (files and folders), the recipes' ignore patterns (checkpoints,
    sources, bookkeeping). Anything else is a one-line :class:`NotAFinishedRun` naming the file."""
    out = Path(output_dir)
    if not out.exists():
        raise NotAFinishedRun(f"{name} {out} does not exist")
    if not out.is_dir():
        raise NotAFinishedRun(f"{name} {out} is not a directory")
    if _STAGING.fullmatch(out.resolve().name):
        raise NotAFinishedRun(f"{name} {out} is the staging folder of a write that did not finish (a patch or a "
                              f"checkpoint save killed midway): not a finished run; write it again")
    files, skipped = _snapshot(out)
    for essential in ("config.json", "model.safetensors", _WEIGHTS_INDEX):
        why = dict(skipped).get(essential)
        if why is not None and why.startswith("a symlink"):
            raise NotAFinishedRun(f"{out / essential} is {why}: copy the file into the folder")
    if "config.json" not in files:
        raise NotAFinishedRun(f"{name} {out} holds no config.json: not a finished run or checkpoint folder")
    config = _json(out, "config.json", files["config.json"])
    if not isinstance(config, dict):
        raise NotAFinishedRun(f"{out / 'config.json'} holds a JSON {type(config).__name__}, not an object: not a "
                              f"finished run")
    documents = {path: _json(out, path, data) for path, data in files.items() if path.endswith(".json")}
    if any(path == "run_config.json" for path, _ in skipped) and "final_metrics.json" not in files:
        raise NotAFinishedRun(f"{name} {out} is a recipe run that did not finish (no final_metrics.json): continue it "
                              f"with --resume_from latest")
    tensors = _weights(out, files, documents, skipped, name)
    _check_against_config(out, config, tensors)
    _check_code(out, files, documents)
    return FinishedRun(out, tuple(UploadFile(path, data) for path, data in files.items()), tuple(skipped))


# bits per element of each safetensors dtype
_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
               "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64, "F4": 4,
               "F6_E2M3": 6, "F6_E3M2": 6}


def safetensors_shapes(data: bytes) -> dict:
    """{tensor: shape} of the bytes of a safetensors file, or ValueError: its 8-byte header length, its JSON header,
    and tensors that cover the data after the header exactly, each the length its dtype and shape need."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than the 8-byte header length")
    length = int.from_bytes(data[:8], "little")
    if 8 + length > len(data):
        raise ValueError(f"a header of {length} bytes, past the end of the file's {len(data)} bytes")
    header = json.loads(data[8:8 + length].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    shapes, spans = {}, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(int(n) for n in info["shape"])
        bits = _DTYPE_BITS.get(info["dtype"])
        count = 1
        for n in shape:
            count *= n
        if bits is not None and end - begin != (count * bits + 7) // 8:
            raise ValueError(f"{key} holds {end - begin} bytes, its {info['dtype']} {list(shape)} needs "
                             f"{(count * bits + 7) // 8}")
        shapes[key] = shape
        spans.append((begin, end, key))
    position = 0
    for begin, end, key in sorted(spans):
        if begin != position or end < begin:
            raise ValueError(f"{key} lies at bytes {begin}-{end}, not from {position}")
        position = end
    if position != len(data) - 8 - length:
        raise ValueError(f"the tensors cover {position} of the {len(data) - 8 - length} data bytes")
    return shapes


def _weights(out: Path, files: dict, documents: dict, skipped: list, name: str) -> dict:
    """{tensor name: (file, shape)} of the folder's safetensors weights; every ``*.safetensors`` file's header must
    parse and cover its data."""
    if _WEIGHTS_INDEX in files:
        try:
            weight_map = documents[_WEIGHTS_INDEX]["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError) as error:
            raise NotAFinishedRun(f"{out / _WEIGHTS_INDEX} is not a safetensors index ({type(error).__name__}: "
                                  f"{' '.join(str(error).split())})") from None
        for shard in shards:
            if shard not in files:
                why = dict(skipped).get(shard)
                raise NotAFinishedRun(f"{out / shard}, a shard {_WEIGHTS_INDEX} lists, is "
                                      f"{why if why else 'missing'}: not a finished run")
        weights = shards
    elif "model.safetensors" in files:
        weights = ["model.safetensors"]
    else:
        pickled = [path for path, _ in skipped if path.startswith("pytorch_model")]
        hint = f" ({pickled[0]} is a pickle, not uploaded: save with safetensors)" if pickled else ""
        raise NotAFinishedRun(f"{name} {out} holds no weights (model.safetensors or {_WEIGHTS_INDEX}){hint}: not a "
                              f"finished run or checkpoint folder")
    tensors = {}
    for path, data in files.items():
        if not path.endswith(".safetensors"):
            continue
        try:
            shapes = safetensors_shapes(data)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
            text = f"{type(error).__name__}: {error}" if isinstance(error, (KeyError, TypeError)) else str(error)
            raise NotAFinishedRun(f"{out / path} is not a complete safetensors file ({' '.join(text.split())}): "
                                  f"its save did not finish; not a finished run") from None
        if path in weights:
            tensors.update({key: (path, shape) for key, shape in shapes.items()})
    return tensors


# ------------------------------------------------------------------------------------- the code a push ships
_AUTO_MAP_ENTRY = re.compile(r"([A-Za-z_]\w*)\.([A-Za-z_]\w*)")


def _check_code(out: Path, files: dict, documents: dict) -> None:
    """Every ``auto_map`` names ``module.Class`` of a ``module.py`` in the folder; every ``.py`` compiles; the
    payload the package writes for those modules (each module and what it imports, copied by ``save_pretrained``)
    is all there, byte for byte the package's own files."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from .. import modeling

    modules = set()  # the modules the auto_maps name
    for path, document in documents.items():
        if not isinstance(document, dict) or "auto_map" not in document:
            continue
        auto_map = document["auto_map"]
        if not isinstance(auto_map, dict):
            raise NotAFinishedRun(f"{out / path}: auto_map = {auto_map!r} is not an object of Auto class: "
                                  f"module.Class")
        for auto_class, value in auto_map.items():
            entries = [(f"[{auto_class!r}]", value)] if not isinstance(value, (list, tuple)) else [
                (f"[{auto_class!r}][{i}]", v) for i, v in enumerate(value) if v is not None]
            for where, entry in entries:
                field_value = f"{out / path}: auto_map{where} = {entry!r}"
                if isinstance(entry, str) and "--" in entry:
                    raise NotAFinishedRun(f"{field_value} names code in another Hub repository: a push ships only "
                                          f"code in the folder (module.Class)")
                match = _AUTO_MAP_ENTRY.fullmatch(entry) if isinstance(entry, str) else None
                if match is None:
                    raise NotAFinishedRun(f"{field_value} is not module.Class of a module in the folder (no path, "
                                          f"no '..')")
                if f"{match[1]}.py" not in files:
                    raise NotAFinishedRun(f"{field_value} names {match[1]}.py, which is not in the folder")
                modules.add(match[1])
    for path, data in files.items():
        if path.endswith(".py"):
            try:
                compile(data, str(out / path), "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as error:
                line = f" line {error.lineno}" if getattr(error, "lineno", None) else ""
                raise NotAFinishedRun(f"{out / path} does not compile ({type(error).__name__}: "
                                      f"{getattr(error, 'msg', error)}{line})") from None
    package = Path(modeling.__file__).parent
    for module in sorted(modules):
        source = package / f"{module}.py"
        if source.is_file():  # a module of the package: save_pretrained copied it and what it imports
            for needed in sorted(Path(p).name for p in get_relative_import_files(source)):
                if needed not in files:
                    raise NotAFinishedRun(f"{out / needed}, part of the payload hf_structattn writes for this "
                                          f"checkpoint (auto_map module {module}), is missing: save the checkpoint "
                                          f"again")
    for path, data in files.items():
        source = package / path
        if path.endswith(".py") and "/" not in path and source.is_file():
            ours, theirs = (hashlib.sha256(source.read_bytes()).hexdigest(), hashlib.sha256(data).hexdigest())
            if theirs != ours:
                raise NotAFinishedRun(f"{out / path} is not the payload hf_structattn writes for this checkpoint "
                                      f"(sha256 {theirs[:16]}, the package's {ours[:16]}): save the checkpoint again "
                                      f"with this version")


def _model_class(architecture: Optional[str]):
    """The model class ``config.json``'s ``architectures[0]`` names, from this package (GPT-2 / T5 families, patched
    ``MLR<Arch>``, Chronos-Bolt) or transformers; None when it cannot be built here."""
    import transformers

    import hf_structattn
    from ..modeling import structattn_decoder
    from ..modeling.modeling_structattn_chronos_bolt import BOLT_MODEL_CLASS_NAME, bolt_model_class

    if not isinstance(architecture, str):
        return None
    if architecture == BOLT_MODEL_CLASS_NAME:
        return bolt_model_class()
    for source in (hf_structattn, structattn_decoder, transformers):
        try:
            cls = getattr(source, architecture)
        except AttributeError:
            continue
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return None


def _check_against_config(out: Path, config: dict, tensors: dict) -> None:
    """The weights hold every tensor of the model ``config.json`` describes, of its shape (tied tensors once)."""
    import torch

    architecture = (config.get("architectures") or [None])[0]
    cls = _model_class(architecture)
    if cls is None:
        raise NotAFinishedRun(f"{out / 'config.json'} names the architecture {architecture!r}, which cannot be built "
                              f"here (hf_structattn, transformers, chronos-forecasting for Chronos-Bolt), so its "
                              f"weights cannot be checked against it")
    try:
        model_config = cls.config_class.from_dict(config)
        with torch.device("meta"):
            model = cls(model_config)
    except Exception as error:
        raise NotAFinishedRun(f"{out / 'config.json'} does not build its model {architecture} "
                              f"({type(error).__name__}: {' '.join(str(error).split())})") from None
    groups: dict = {}  # tied parameters are one tensor under several names: saved once
    for key, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append((key, tuple(value.shape)))
    for group in groups.values():
        present = [(key, shape) for key, shape in group if key in tensors]
        if not present:
            raise NotAFinishedRun(f"the weights of {out} lack {group[0][0]}, a tensor of the model config.json "
                                  f"describes: not the weights of this config")
        for key, shape in present:
            file, stored = tensors[key]
            if stored != shape:
                raise NotAFinishedRun(f"{out / file}: {key} has shape {list(stored)}, the model config.json describes "
                                      f"{list(shape)}: not the weights of this config")


def describe_skipped(run: FinishedRun) -> list[str]:
    """The lines that list what an upload of ``run`` leaves out, and why (none when nothing is)."""
    if not run.skipped:
        return []
    width = max(len(path) for path, _ in run.skipped)
    return [f"skipped (not uploaded): {len(run.skipped)} entries"] + [
        f"  {path:<{width}}  {why}" for path, why in run.skipped]


def write_plots(output_dir: str | Path, log_path: Optional[str | Path] = None, loss_key: str = "train/loss",
                eval_key: Optional[str] = None) -> list[Path]:
    """``plots/loss_vs_steps.png`` and ``plots/loss_vs_flops.png`` from the run's JSONL log."""
    try:
        import matplotlib
    except ImportError:  # plots are optional: pip install 'hf-structattn[plots]'
        import warnings

        warnings.warn("matplotlib is not installed: no loss plots written")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .tracking import read_jsonl  # imports accelerate: not at module level, so that `hf-structattn push` runs
    # on the core install (torch, transformers, safetensors) without the [recipes] extra

    out = Path(output_dir)
    records = read_jsonl(log_path or out / "metrics.jsonl")
    train = [r for r in records if loss_key in r]
    evals = [r for r in records if eval_key and eval_key in r]
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    for axis, xlabel, name in (("step", "optimizer step", "loss_vs_steps.png"),
                               ("flops", "training FLOPs (estimate)", "loss_vs_flops.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        keep = (lambda r: r.get(axis, 0) > 0) if axis == "flops" else (lambda r: True)  # log axis: no 0
        tr, ev = [r for r in train if keep(r)], [r for r in evals if keep(r)]
        if tr:
            ax.plot([r[axis] for r in tr], [r[loss_key] for r in tr], label=loss_key, lw=1)
        if ev:
            ax.plot([r[axis] for r in ev], [r[eval_key] for r in ev], "o-", label=eval_key)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        if axis == "flops" and any(r.get("flops", 0) > 0 for r in train):
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(plots / name, dpi=100)
        plt.close(fig)
        written.append(plots / name)
    return written


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def public_configuration(args, recipe: str) -> dict:
    """The run configuration as it may be published (tracker config, model card): the fields named in the args
    class's ``PATH_FIELDS`` keep only their file names, so no local absolute path leaves the machine."""
    configuration = run_configuration(args, recipe)
    for name in getattr(args, "PATH_FIELDS", ()):
        value = configuration["args"].get(name)
        if value is not None:
            names = [Path(v).name for v in value] if isinstance(value, list) else Path(value).name
            configuration["args"][name] = names
    return configuration


# the keys transformers fills with the folder a model or tokenizer was loaded from
_LOCAL_ORIGIN_KEYS = ("_name_or_path", "name_or_path")


def public_model_config(config):
    """A model config (``config.to_dict()``) as a card may publish it: the keys naming the folder it was loaded from
    (``_name_or_path``) dropped and any other absolute or home-relative path replaced by its file name, at any depth
    (a composite model's sub-configs), so that no path of this machine leaves it."""
    if isinstance(config, dict):
        return {key: public_model_config(value) for key, value in config.items() if key not in _LOCAL_ORIGIN_KEYS}
    if isinstance(config, (list, tuple)):
        return [public_model_config(value) for value in config]
    if isinstance(config, str) and (os.path.isabs(config) or config.startswith("~")) and "\n" not in config:
        return Path(config).name
    return config


def write_model_card(output_dir: str | Path, args, *, recipe: str, title: str, summary: str, config: dict, data: str,
                     metrics: dict, usage: str, pipeline_tag: str, eval_results: list[tuple] = (),
                     dataset_type: str = "custom", datasets: Optional[list[str]] = None,
                     cost_markdown: Optional[str] = None, flops_per_token: Optional[float] = None,
                     extra_sections: Optional[dict] = None, tags: tuple = (), notice: str = "") -> Path:
    """README.md through ``huggingface_hub.ModelCard`` with ``ModelCardData`` metadata (license, library_name,
    pipeline_tag, tags, datasets where known, model-index from ``eval_results`` = [(task_type, metric_type,
    metric_name, value)]), then the variant/config (:func:`public_model_config`: no local path), data, metrics, FLOPs
    and cache tables and a loading snippet.
    ``notice`` (markdown) is the card's first paragraph under its title: a patched decoder's WARNING that it is not
    the stock model (``decoder_ft.saved_card_warning``)."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    model_name = (args.hub_model_id or Path(args.output_dir).name).split("/")[-1]
    results = [EvalResult(task_type=task, dataset_type=dataset_type, dataset_name=data.split(" (")[0][:80],
                          metric_type=metric, metric_name=name, metric_value=float(value))
               for task, metric, name, value in eval_results if value is not None]
    card_data = ModelCardData(license="apache-2.0", library_name="transformers", pipeline_tag=pipeline_tag,
                              tags=["hf_structattn", "structured-attention", "custom_code", *tags],
                              datasets=datasets or None, model_name=model_name, eval_results=results or None)
    lines = [f"# {title}", "", *([notice.strip(), ""] if notice else []), summary, ""]
    lines += ["## Loading", "", "```python", usage.strip(), "```", ""]
    lines += ["## Evaluation", "", "| metric | value |", "|---|---:|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in metrics.items() if not isinstance(v, (list, dict))]
    lines += ["", "## Training data", "", data, ""]
    if flops_per_token is not None or cost_markdown:
        lines += ["## Compute and memory", ""]
        if flops_per_token is not None:
            lines += [f"Training FLOPs per token (6N + attention, `hf_structattn.flops.flops_per_token`): "
                      f"{flops_per_token:,.0f}", ""]
        if cost_markdown:
            lines += [cost_markdown, ""]
    for heading, body in (extra_sections or {}).items():
        lines += [f"## {heading}", "", body, ""]
    lines += ["## Model configuration", "", "```json",
              json.dumps(public_model_config(config), indent=2, sort_keys=True, default=str),
              "```", ""]
    lines += [f"## Recipe arguments (`recipes/{recipe}.py`)", "", "```json",
              json.dumps(public_configuration(args, recipe), indent=2, sort_keys=True, default=str), "```", ""]
    lines += ["![loss vs steps](plots/loss_vs_steps.png)", "![loss vs FLOPs](plots/loss_vs_flops.png)", ""]
    card = ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines))
    path = Path(output_dir) / "README.md"
    card.save(path)
    return path


_NETWORK_ERROR_NAMES = {"TransportError", "NetworkError", "ConnectError", "ConnectTimeout", "ReadTimeout",
                        "TimeoutException", "ConnectionError", "ProxyError", "SSLError", "RemoteProtocolError"}


def is_network_error(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a failure to reach a server at all (connection refused, DNS, timeout,
    TLS), as opposed to an answer from the Hub. Recognised by the HTTP clients' exception classes (httpx / requests
    families) and the OS's socket errors, so no particular client has to be imported."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        names = {cls.__name__ for cls in type(error).__mro__}
        if names & _NETWORK_ERROR_NAMES or isinstance(error, (ConnectionError, TimeoutError, socket.gaierror,
                                                               socket.herror)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def check_hub_access(repo_id: str, private: bool = False, flag: str = "--push_to_hub") -> str:
    """Before any training: the token works (``whoami``) and the repository exists or can be created
    (``create_repo(exist_ok=True)``). Offline, unreachable, without a token, with a rejected token or without write
    access this fails in seconds with a one-line :class:`ConfigError` that says which (starting with ``flag``, the
    option or command that asked). Returns the repository id."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    api = HfApi()
    try:
        user = api.whoami()
    except OfflineModeIsEnabled:
        raise ConfigError(f"{flag}: the Hub is unreachable in offline mode (HF_HUB_OFFLINE is set)") from None
    except LocalTokenNotFoundError:
        raise ConfigError(f"{flag}: no Hub token found; log in with `hf auth login` or set HF_TOKEN") from None
    except Exception as error:
        if is_network_error(error):
            raise ConfigError(f"{flag}: the Hub at {api.endpoint or constants.ENDPOINT} is unreachable "
                              f"({_one_line(error)}); check the network connection (or HF_ENDPOINT) and retry"
                              ) from None
        status = getattr(getattr(error, "response", None), "status_code", None)
        if isinstance(error, HfHubHTTPError) and status == 401:
            raise ConfigError(f"{flag}: the Hub rejected the token (401 Unauthorized); log in with `hf auth "
                              "login` or set a valid HF_TOKEN") from None
        raise ConfigError(f"{flag}: cannot authenticate with the Hub ({_one_line(error)})") from None
    try:
        repo = api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    except Exception as error:
        if is_network_error(error):
            raise ConfigError(f"{flag}: the Hub became unreachable while creating {repo_id} "
                              f"({_one_line(error)})") from None
        if not isinstance(error, (HfHubHTTPError, OSError)):
            raise
        raise ConfigError(f"{flag}: cannot create or access {repo_id} as {user.get('name', '?')} "
                          f"({str(error).splitlines()[0]})") from None
    return getattr(repo, "repo_id", repo_id)


def push_to_hub(run: FinishedRun, repo_id: str, private: bool = False,
                commit_message: str = "Upload model trained with hf_structattn") -> str:
    """One ``HfApi().create_commit`` adding exactly the files of a finished run with the bytes :func:`finished_run`
    read and checked (``CommitOperationAdd`` of those bytes: nothing is read from the folder again; the repository
    was created by :func:`check_hub_access` before training). Returns the repository id. A failed upload is one
    :class:`RunFailure` line (the trained run stays on disk)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    output_dir = run.folder
    try:
        operations = [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=f.data) for f in run.files]
        HfApi().create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message,
                              repo_type="model")
    except Exception as error:
        what = "the Hub is unreachable" if is_network_error(error) else "the Hub refused it"
        raise RunFailure(f"uploading {output_dir} to {repo_id} failed, {what} ({_one_line(error)}); the trained run "
                         f"is complete on disk: upload it again with `hf-structattn push {output_dir} --repo-id "
                         f"{repo_id}`") from None
    return repo_id


def write_metrics_json(output_dir: str | Path, metrics: dict) -> Path:
    path = Path(output_dir) / "final_metrics.json"
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    return path
