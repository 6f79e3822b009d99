"""Offline text corpora for causal LM training, as flat byte-token arrays.

Sources (no download at run time unless ``dataset_name`` is given explicitly):
* default: the ``*.py`` files of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``,
  ``site-packages``/``dist-packages`` excluded), split into train/validation by a hash of each file's path
  relative to the stdlib root (stable across runs and machines with the same Python version); with
  ``near_copy_jaccard`` (the decisive LM designs pass :data:`NEAR_COPY_JACCARD`) a file the hash holds out goes to
  training instead when it is a near-copy of a training file (:func:`near_copy_flags`), so that validation never
  scores text the model trained on (the stdlib's ``encodings/cp437.py`` and ``cp862.py``, 5.8 % of the validation
  bytes, are near-copies of ``cp865.py`` and the other code-page tables in training);
* ``text_files``: local files through ``datasets``' ``text`` loader (one document per file), split the same way;
* ``dataset_name``: a ``datasets`` Hub dataset (online users only; never used by the defaults or the tests).

Tokenization is the byte-level tokenizer of :mod:`hf_structattn.tokenization`: token id = UTF-8 byte value, and
``<|endoftext|>`` (256) separates documents. Encoding with ``str.encode`` gives exactly the tokenizer's ids
(tested) and is much faster on megabytes of text.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

EOS_ID = 256


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_python_files(root: Optional[Path] = None) -> list[Path]:
    """Sorted stdlib ``*.py`` files, third-party site directories excluded."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if any(p in ("site-packages", "dist-packages", "__pycache__") for p in parts):
            continue
        if path.is_file():
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation(key: str, validation_percent: float) -> bool:
    """Deterministic split: the first 8 bytes of sha1(key) as a fraction in [0, 1) below ``validation_percent``%."""
    digest = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big")
    return digest / 2 ** 64 < validation_percent / 100.0


# the near-copy rule of the held-out split: a held-out file whose set of word 5-grams (runs of 5 consecutive
# whitespace-separated tokens) has Jaccard similarity at least 0.5 with some training file's set is a near-copy. On the
# Python 3.11 stdlib the held-out files' highest similarities are 1.0 (3 files of 0-142 bytes: empty or one-line
# package files), 0.95 and 0.72 (encodings/cp437.py and cp862.py, against cp865.py), 0.58 (encodings/gb2312.py) and
# 0.58 (lib2to3/fixes/fix_intern.py), then 0.24 and below (ordinary files that share idioms with their neighbours).
NEAR_COPY_JACCARD = 0.5
SHINGLE_WORDS = 5
_WORD = re.compile(r"\S+")


def shingles(text: str, vocabulary: dict, words: int = SHINGLE_WORDS) -> np.ndarray:
    """The distinct word ``words``-grams of ``text`` as sorted int64 codes: a word's id in ``vocabulary`` (grown as
    new words appear; the same dict for every text that is compared), ``words`` ids combined by a polynomial in
    wrapping 64-bit arithmetic (collisions have probability ~2^-64 per pair). A text of fewer words is one gram."""
    ids = np.fromiter((vocabulary.setdefault(word, len(vocabulary)) for word in _WORD.findall(text)), dtype=np.int64)
    if ids.size < words:
        ids = np.concatenate([ids, np.full(words - ids.size, -1, dtype=np.int64)])
    count = ids.size - words + 1
    with np.errstate(over="ignore"):
        codes = np.zeros(count, dtype=np.int64)
        for offset in range(words):
            codes = codes * np.int64(1_000_003) + ids[offset:offset + count]
    return np.unique(codes)


def near_copy_flags(texts: Sequence[str], held_out: Sequence[bool],
                    threshold: float = NEAR_COPY_JACCARD) -> tuple[list[bool], list[tuple[int, int, float]]]:
    """Which held-out texts are near-copies of a training text (``held_out`` false): the Jaccard similarity of their
    word 5-gram sets (:func:`shingles`) with some training text's is at least ``threshold``. Returns the flags (one
    per text; training texts are never flagged) and, per flagged text, (its index, the most similar training text's
    index, the similarity). Exact: every held-out text is compared with every training text through the grams
    they share."""
    vocabulary: dict = {}
    grams = [shingles(text, vocabulary) for text in texts]
    held = [index for index, flag in enumerate(held_out) if flag]
    train = [index for index, flag in enumerate(held_out) if not flag]
    flags, found = [False] * len(texts), []
    if not held or not train:
        return flags, found
    sizes = np.array([grams[index].size for index in train])
    train_codes = np.concatenate([grams[index] for index in train])
    owner = np.repeat(np.arange(len(train)), sizes)
    shared_codes = np.isin(train_codes, np.concatenate([grams[index] for index in held]))
    train_codes, owner = train_codes[shared_codes], owner[shared_codes]  # only the grams some held-out text has
    for index in held:
        shared = np.bincount(owner[np.isin(train_codes, grams[index], assume_unique=False)], minlength=len(train))
        jaccard = shared / (grams[index].size + sizes - shared)
        best = int(jaccard.argmax())
        if jaccard[best] >= threshold:
            flags[index] = True
            found.append((index, train[best], float(jaccard[best])))
    return flags, found


@dataclass
class TextCorpus:
    train: torch.Tensor        # int64 token ids (bytes + EOS separators)
    validation: torch.Tensor
    description: str
    train_documents: int
    validation_documents: int


def encode_documents(texts: Iterable[str], max_bytes: Optional[int] = None) -> tuple[torch.Tensor, int]:
    chunks, total, count = [], 0, 0
    for text in texts:
        data = text.encode("utf-8") + bytes([0])  # placeholder byte, replaced by EOS below
        array = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        array[-1] = EOS_ID
        if max_bytes is not None and total + array.size > max_bytes:
            array = array[:max(0, max_bytes - total)]
        if array.size:
            chunks.append(array)
            total += array.size
            count += 1
        if max_bytes is not None and total >= max_bytes:
            break
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(ids), count


def _split(documents: Sequence[tuple[str, str]], validation_percent: float, max_train_bytes, max_validation_bytes,
           description: str) -> TextCorpus:
    train_docs = [text for key, text in documents if not is_validation(key, validation_percent)]
    val_docs = [text for key, text in documents if is_validation(key, validation_percent)]
    train, n_train = encode_documents(train_docs, max_train_bytes)
    validation, n_val = encode_documents(val_docs, max_validation_bytes)
    if validation.numel() == 0 or train.numel() == 0:
        # every document fell on one side of the hash split (e.g. a single file, which lands in validation with
        # probability validation_percent): hold out the tail of all the tokens instead
        train, n_train = encode_documents([text for _, text in documents], max_train_bytes)
        n_val = 0
        cut = int(train.numel() * (1 - max(validation_percent, 1.0) / 100.0))
        train, validation = train[:cut], train[cut:]
        description += " (validation = tail of the training tokens)"
    return TextCorpus(train, validation, description, n_train, n_val)


def load_stdlib_corpus(validation_percent: float = 5.0, max_train_bytes: Optional[int] = None,
                       max_validation_bytes: Optional[int] = None,
                       near_copy_jaccard: Optional[float] = None) -> TextCorpus:
    """The stdlib ``*.py`` files in sorted path order; a file goes to validation by :func:`is_validation` of its
    relative path, unless ``near_copy_jaccard`` is given and the file is a near-copy of a training file at that
    threshold (:func:`near_copy_flags`; it then goes to training). Without the rule files are only read until each
    split's byte cap is reached; with it every file is read (the rule compares with all of training, whatever the
    caps), which takes a few seconds."""
    import sys

    root = stdlib_root()
    files = stdlib_python_files(root)
    keys = [path.relative_to(root).as_posix() for path in files]
    val_flags = [is_validation(key, validation_percent) for key in keys]
    rule = ""
    if near_copy_jaccard is not None:
        contents = [path.read_bytes().decode("utf-8", errors="replace") for path in files]
        copies, found = near_copy_flags(contents, val_flags, near_copy_jaccard)
        val_flags = [flag and not copy for flag, copy in zip(val_flags, copies)]
        moved = ", ".join(f"{keys[held]} ~ {keys[train]} {similarity:.2f}" for held, train, similarity in found)
        rule = (f"; {len(found)} held-out files that are near-copies of a training file (word 5-gram Jaccard >= "
                f"{near_copy_jaccard:g}) moved to train: {moved or 'none'}")

    def texts(want_validation: bool):
        for index, (path, flag) in enumerate(zip(files, val_flags)):
            if flag == want_validation:
                yield contents[index] if rule else path.read_bytes().decode("utf-8", errors="replace")

    train, n_train = encode_documents(texts(False), max_train_bytes)
    validation, n_val = encode_documents(texts(True), max_validation_bytes)
    description = (f"Python {sys.version_info.major}.{sys.version_info.minor} standard library sources "
                   f"(*.py files, site-packages excluded, sorted by path relative to the stdlib root; validation = "
                   f"{validation_percent:g}% of the {len(files)} files by sha1 of their relative path{rule}; "
                   f"{n_train} train files / {train.numel():,} bytes, {n_val} validation files / "
                   f"{validation.numel():,} bytes)")
    return TextCorpus(train, validation, description, n_train, n_val)


def check_text_files(text_files: Optional[Sequence[str]], field: str = "--text_files") -> None:
    """Each file exists, is not empty and is UTF-8 text; otherwise a one-line ``ConfigError`` naming the file (and
    the offset of the first byte that is not UTF-8). Reads the files once, in chunks."""
    import codecs

    from .args import ConfigError

    for name in text_files or []:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"{field}: {name} is not a file")
        if path.stat().st_size == 0:
            raise ConfigError(f"{field}: {name} is empty")
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(1 << 20)
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    # error.object is the decoder's pending bytes of the previous chunk followed by this chunk
                    pending = len(error.object) - len(chunk)
                    position = offset - pending + error.start
                    raise ConfigError(f"{field}: {name} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
                                      f"offset {position:,}: {error.reason})") from None
                if not chunk:
                    break
                offset += len(chunk)


def load_text_files_corpus(text_files: Sequence[str], validation_percent: float = 5.0,
                           max_train_bytes: Optional[int] = None,
                           max_validation_bytes: Optional[int] = None) -> TextCorpus:
    """Local text files via ``datasets.load_dataset("text", sample_by="document")`` (one document per file)."""
    from .args import missing_extra

    try:
        from datasets import load_dataset
    except ModuleNotFoundError as error:  # the core install has no datasets
        raise missing_extra(error) from None

    import datasets

    files = sorted(str(Path(f)) for f in text_files)
    documents = []
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one "Generating train split" bar per file said nothing a user can use
    try:
        for file in files:  # one load per file keeps the file name as the split key
            data = load_dataset("text", data_files=[file], sample_by="document", split="train")
            documents.extend((f"{file}#{i}", text) for i, text in enumerate(data["text"]))
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
    description = f"{len(files)} local text file(s) via datasets' text loader"
    return _split(documents, validation_percent, max_train_bytes, max_validation_bytes, description)


def load_hub_corpus(dataset_name: str, dataset_config: Optional[str] = None, text_column: str = "text",
                    validation_percent: float = 5.0, max_train_bytes: Optional[int] = None,
                    max_validation_bytes: Optional[int] = None) -> TextCorpus:
    """A Hub dataset (needs the network). Uses its "validation" split if it has one, else the hash split."""
    from .args import missing_extra

    try:
        from datasets import load_dataset
    except ModuleNotFoundError as error:  # the core install has no datasets
        raise missing_extra(error) from None

    data = load_dataset(dataset_name, dataset_config)
    if "validation" in data:
        train, n_train = encode_documents(list(data["train"][text_column]), max_train_bytes)
        validation, n_val = encode_documents(list(data["validation"][text_column]), max_validation_bytes)
        return TextCorpus(train, validation, f"Hub dataset {dataset_name}", n_train, n_val)
    split = data["train"]
    documents = [(f"{i}", text) for i, text in enumerate(split[text_column])]
    return _split(documents, validation_percent, max_train_bytes, max_validation_bytes, f"Hub dataset {dataset_name}")


def step_generator(seed: int, stream: int, step: int) -> torch.Generator:
    """A generator that depends only on (seed, stream, step): the data of a step is a pure function of these."""
    return torch.Generator().manual_seed((seed * 1_000_003 + stream * 7_919 + step) % (2 ** 63 - 1))


def lm_micro_batch(tokens: torch.Tensor, seq_len: int, step: int, micro: int, rank: int, world: int,
                   per_device_batch: int, accum: int, seed: int) -> torch.Tensor:
    """This rank's rows of micro-step ``micro`` of step ``step``: the step draws ``world*accum*per_device_batch``
    random windows of ``seq_len`` tokens from ``tokens``; rows are ordered (micro, rank, row)."""
    global_batch = world * accum * per_device_batch
    high = tokens.numel() - seq_len
    if high < 0:
        from .args import ConfigError

        raise ConfigError(f"--seq_len {seq_len}: the training text has {tokens.numel()} tokens, fewer than one "
                          f"window; pass a smaller --seq_len or more training text (--text_files, --max_train_bytes)")
    starts = torch.randint(0, high + 1, (global_batch,), generator=step_generator(seed, 1, step))
    first = (micro * world + rank) * per_device_batch
    mine = starts[first:first + per_device_batch]
    return torch.stack([tokens[s:s + seq_len] for s in mine.tolist()])


def eval_windows(tokens: torch.Tensor, seq_len: int, max_windows: int,
                 sources: str = "--text_files, --validation_percent, --max_validation_bytes") -> torch.Tensor:
    """At most ``max_windows`` non-overlapping windows (count, seq_len) spread evenly over the whole validation
    split: taking them from its start would score only the first file or two. ``sources``: the flags that give the
    validation text, named by the error for a split shorter than one window."""
    count = min(max_windows, tokens.numel() // seq_len)
    if count == 0:
        from .args import ConfigError

        raise ConfigError(f"--seq_len {seq_len}: the validation text has {tokens.numel()} tokens, fewer than one "
                          f"window; pass a smaller --seq_len or more validation text ({sources})")
    stride = tokens.numel() // count  # >= seq_len, so the windows never overlap
    return torch.stack([tokens[start:start + seq_len] for start in range(0, count * stride, stride)])
