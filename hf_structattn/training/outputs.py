"""What a recipe leaves behind: model card, plots, metrics file, and the optional Hub upload of a finished run."""

from __future__ import annotations

import fnmatch
import json
import os
import pickletools
import re
import socket
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .args import ConfigError, RunFailure, run_configuration

# never uploaded: resumable training state, the recipes' sources and bookkeeping are not part of the published model
HUB_IGNORE_PATTERNS = ["checkpoints/*", "checkpoints/**", "base_tiny_chronos_t5/*", "source/*", "source/**", "*.pkl",
                       "run_config.json"]
# huggingface_hub's own defaults (``hf_api.DEFAULT_IGNORE_PATTERNS``), which upload_folder adds to any
_HUB_DEFAULT_IGNORE = [".git", ".git/*", "*/.git", "**/.git/**", ".cache/huggingface", ".cache/huggingface/*",
                       "*/.cache/huggingface", "**/.cache/huggingface/**"]
# the staging folder of a write killed midway: a patch's ``.OUT.partial-<pid>-<8 hex>`` (command_io.save_atomically), a
# checkpoint's ``.checkpoint_<i>.partial`` (training.checkpoints)
_STAGING = re.compile(r"\..+\.partial(-\d+-[0-9a-f]{8})?")
_WEIGHTS_INDEX = "model.safetensors.index.json"
_PICKLE_SCAN_BYTES = 16 * 2**20  # protocol 0/1 pickles (no magic bytes) are parsed up to this size


class NotAFinishedRun(ConfigError):
    """What makes a folder not a finished run, in one line naming the file."""


@dataclass(frozen=True)
class UploadFile:
    path: str  # relative to the output folder, with forward slashes (its path in the repository)
    size: int


@dataclass(frozen=True)
class FinishedRun:
    """A folder that passed :func:`finished_run`: the files an upload sends and what it leaves out, with why."""

    folder: Path
    files: tuple  # UploadFile, sorted by path
    skipped: tuple  # (path relative to the folder, a trailing "/" for a folder; why it is not uploaded)


def is_pickle(path: str | os.PathLike) -> bool:
    """Whether a file is a pickle by its content, whatever its name (``training_args.bin``, ``optimizer.bin``,
    ``*.pt``, ``*.pickle``): a pickle of protocol 2 to 5 (its PROTO opcode), a zip holding one (``torch.save``'s
    format), or, up to 16 MiB, the opcodes of protocol 0 or 1 read to their STOP."""
    with open(path, "rb") as handle:
        head = handle.read(2)
        if _pickle_head(head):
            return True
        if head == b"PK":
            try:
                with zipfile.ZipFile(path) as archive:
                    return any(name.endswith(".pkl") or _pickle_head(archive.open(name).read(2))
                               for name in archive.namelist() if not name.endswith("/"))
            except (zipfile.BadZipFile, OSError):
                return False
        handle.seek(0)
        data = handle.read(_PICKLE_SCAN_BYTES + 1)
    if len(data) > _PICKLE_SCAN_BYTES:
        return False
    try:
        return any(opcode.name == "STOP" for opcode, _, _ in pickletools.genops(data))
    except Exception:  # not opcodes: not a pickle
        return False


def _pickle_head(head: bytes) -> bool:
    """The PROTO opcode of pickle protocols 2 to 5."""
    return head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")


def _ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern in HUB_IGNORE_PATTERNS + _HUB_DEFAULT_IGNORE)


def _inside(target: Path, folder: Path) -> bool:
    return target == folder or folder in target.parents


def _walk(out: Path) -> tuple[list, list]:
    """(files to check, skipped) of ``out``: the staging folders of killed writes, symlinked folders, symlinks to
    files outside ``out``, the ignore patterns and pickles are skipped with why."""
    root = out.resolve()
    files, skipped = [], []
    for folder, dirnames, filenames in os.walk(out):
        base = Path(folder)
        for name in sorted(dirnames):
            path = base / name
            relative = path.relative_to(out).as_posix()
            if path.is_symlink():
                skipped.append((relative + "/", f"a symlinked folder (to {os.path.realpath(path)})"))
                dirnames.remove(name)
            elif _STAGING.fullmatch(name):
                skipped.append((relative + "/", "the staging folder of a write that did not finish"))
                dirnames.remove(name)
            elif _ignored(relative + "/x"):
                skipped.append((relative + "/", "training state or sources, not part of the published model"))
                dirnames.remove(name)
        for name in sorted(filenames):
            path = base / name
            relative = path.relative_to(out).as_posix()
            if path.is_symlink() and not _inside(path.resolve(), root):
                skipped.append((relative, f"a symlink to {path.resolve()}, outside the folder"))
            elif not path.is_file():
                skipped.append((relative, "not a regular file"))
            elif _ignored(relative):
                skipped.append((relative, "a pickle (by name): not published" if relative.endswith(".pkl") else
                                "bookkeeping, not part of the published model"))
            elif not relative.endswith(".safetensors") and is_pickle(path):
                skipped.append((relative, "a pickle (unpickling runs code): not published"))
            else:
                files.append(relative)
    return sorted(files), sorted(skipped)


def finished_run(output_dir: str | os.PathLike, name: str = "OUTPUT_DIR") -> FinishedRun:
    """The one definition of a finished run (a recipe's output folder or a patched checkpoint), used by
    ``hf-structattn push`` (and its ``--dry-run`` / ``--to-folder``), the recipes' ``--push_to_hub`` and the
    ``--resume_from`` check that a run is complete:

    * ``config.json`` parses as a JSON object, and a recipe run (``run_config.json``) wrote ``final_metrics.json``;
    * the weights are safetensors (``model.safetensors``, or the shards of ``model.safetensors.index.json``) whose
      headers parse (a save killed midway leaves a file the header does not cover) and hold every tensor, of its
      shape, of the model ``config.json`` describes (built on the meta device);
    * the folder is not the staging folder of a write that did not finish, and no essential file is a symlink out
      of it.

    What is not uploaded is skipped and listed: pickles by content whatever their name, staging folders inside,
    symlinked folders, symlinks to files outside, the recipes' ignore patterns (checkpoints, sources,
    bookkeeping). Anything else is a one-line :class:`NotAFinishedRun` naming the file."""
    out = Path(output_dir)
    if not out.exists():
        raise NotAFinishedRun(f"{name} {out} does not exist")
    if not out.is_dir():
        raise NotAFinishedRun(f"{name} {out} is not a directory")
    if _STAGING.fullmatch(out.resolve().name):
        raise NotAFinishedRun(f"{name} {out} is the staging folder of a write that did not finish (a patch or a "
                              f"checkpoint save killed midway): not a finished run; write it again")
    files, skipped = _walk(out)
    listed = set(files)
    for essential in ("config.json", "model.safetensors", _WEIGHTS_INDEX):
        why = dict(skipped).get(essential)
        if why is not None and (out / essential).is_symlink():
            raise NotAFinishedRun(f"{out / essential} is {why}: copy the file into the folder")
    if "config.json" not in listed:
        raise NotAFinishedRun(f"{name} {out} holds no config.json: not a finished run or checkpoint folder")
    config_path = out / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NotAFinishedRun(f"{config_path} is not valid JSON ({' '.join(str(error).split())}): not a finished "
                              f"run") from None
    if not isinstance(config, dict):
        raise NotAFinishedRun(f"{config_path} holds a JSON {type(config).__name__}, not an object: not a finished run")
    if (out / "run_config.json").is_file() and "final_metrics.json" not in listed:
        raise NotAFinishedRun(f"{name} {out} is a recipe run that did not finish (no final_metrics.json): continue it "
                              f"with --resume_from latest")
    tensors = _weights(out, listed, skipped, name)
    _check_against_config(out, config, tensors)
    uploads = tuple(UploadFile(path, (out / path).stat().st_size) for path in files)
    return FinishedRun(out, uploads, tuple(skipped))


def _weights(out: Path, listed: set, skipped: list, name: str) -> dict:
    """{tensor name: (file, shape)} of the folder's safetensors weights; every ``*.safetensors`` file's header must
    parse."""
    from safetensors import safe_open

    if _WEIGHTS_INDEX in listed:
        index_path = out / _WEIGHTS_INDEX
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise NotAFinishedRun(f"{index_path} is not a safetensors index ({type(error).__name__}: "
                                  f"{' '.join(str(error).split())})") from None
        for shard in shards:
            if shard not in listed:
                raise NotAFinishedRun(f"{out / shard}, a shard {_WEIGHTS_INDEX} lists, is missing: not a finished run")
        weights = shards
    elif "model.safetensors" in listed:
        weights = ["model.safetensors"]
    else:
        pickled = [path for path, _ in skipped if path.startswith("pytorch_model")]
        hint = f" ({pickled[0]} is a pickle, not uploaded: save with safetensors)" if pickled else ""
        raise NotAFinishedRun(f"{name} {out} holds no weights (model.safetensors or {_WEIGHTS_INDEX}){hint}: not a "
                              f"finished run or checkpoint folder")
    tensors = {}
    for path in sorted(listed):
        if not path.endswith(".safetensors"):
            continue
        try:
            with safe_open(str(out / path), framework="pt") as handle:
                shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
        except Exception as error:  # safetensors' own SafetensorError
            raise NotAFinishedRun(f"{out / path} is not a complete safetensors file ({' '.join(str(error).split())}): "
                                  f"its save did not finish; not a finished run") from None
        if path in weights:
            tensors.update({key: (path, shape) for key, shape in shapes.items()})
    return tensors


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


def _literal(path: str) -> str:
    """An fnmatch pattern that matches ``path`` only (upload_folder's allow_patterns are fnmatch patterns)."""
    return re.sub(r"([*?\[])", r"[\1]", path)


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


def write_model_card(output_dir: str | Path, args, *, recipe: str, title: str, summary: str, config: dict, data: str,
                     metrics: dict, usage: str, pipeline_tag: str, eval_results: list[tuple] = (),
                     dataset_type: str = "custom", datasets: Optional[list[str]] = None,
                     cost_markdown: Optional[str] = None, flops_per_token: Optional[float] = None,
                     extra_sections: Optional[dict] = None, tags: tuple = (), notice: str = "") -> Path:
    """README.md through ``huggingface_hub.ModelCard`` with ``ModelCardData`` metadata (license, library_name,
    pipeline_tag, tags, datasets where known, model-index from ``eval_results`` = [(task_type, metric_type,
    metric_name, value)]), then the variant/config, data, metrics, FLOPs and cache tables and a loading snippet.
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
    lines += ["## Model configuration", "", "```json", json.dumps(config, indent=2, sort_keys=True, default=str),
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
    """``HfApi().upload_folder`` of exactly the files of a finished run (:func:`finished_run`; the repository was
    created by :func:`check_hub_access` before training). Returns the repository id. A failed upload is one
    :class:`RunFailure` line (the trained run stays on disk)."""
    from huggingface_hub import HfApi

    output_dir = run.folder
    try:
        HfApi().upload_folder(repo_id=repo_id, folder_path=str(output_dir), commit_message=commit_message,
                              allow_patterns=[_literal(f.path) for f in run.files],
                              ignore_patterns=HUB_IGNORE_PATTERNS, repo_type="model")
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
