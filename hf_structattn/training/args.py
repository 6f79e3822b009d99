"""Recipe arguments on ``transformers.HfArgumentParser``: a recipe dataclass plus a model dataclass, a YAML/JSON
config file and command-line overrides.

Precedence: dataclass defaults < ``--config FILE`` < command line. The file's entries become ``--name=value`` tokens
placed before the command line, so the file and the command line go through the same argparse types and choices
(and the command line wins). Model-config fields may sit under ``model:`` in the file or at its top level; a file
that sets a key twice is refused.

Conventions on top of ``HfArgumentParser``:

* list fields take ``--mlr_ranks 32,16,8,8`` (one shell word, no quoting) or ``--mlr_ranks 32 16 8 8``;
* optional fields take ``none`` / ``null`` for ``None``;
* every error is a :class:`ConfigError`, one line naming the field and the value; the recipes' entry points print it
  as ``<recipe>: error: ...`` and exit with status 2 (never a traceback). Unknown names get a "did you mean".
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from argparse import ArgumentTypeError
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml
from transformers import HfArgumentParser

NONE_WORDS = ("none", "null", "~")


def arg(help: str, **kwargs) -> dataclasses.Field:
    """A dataclass field with its one-line ``--help`` text (``default=`` / ``default_factory=`` as usual)."""
    return dataclasses.field(metadata={"help": help}, **kwargs)


class ConfigError(ValueError):
    """A bad recipe argument or config file entry (the message is one line naming the field)."""


RECIPES_EXTRA = "pip install 'hf-structattn[recipes]'"


class MissingExtra(ModuleNotFoundError):
    """A library of the ``[recipes]`` extra is not installed (the core install has none): one line naming the
    extra. The training modules raise it when they import such a library; ``run_main`` prints it as one line."""


def missing_extra(error: ModuleNotFoundError) -> MissingExtra:
    """The :class:`MissingExtra` for an ``ImportError`` of a library of the ``[recipes]`` extra."""
    package = (error.name or "?").partition(".")[0]  # (the library, not the submodule the import named)
    return MissingExtra(f"No module named {package!r}: the recipes need the [recipes] extra ({RECIPES_EXTRA})",
                        name=package)


class RunFailure(RuntimeError):
    """A run that failed after work started for a reason outside the code (disk full while saving a checkpoint, an
    upload that did not go through): one line, exit status 1, nothing finished is lost."""


def _strip_optional(annotation) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) of ``Optional[X]`` / ``X | None``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) < len(typing.get_args(annotation)) and len(options) == 1:
            return options[0], True
    return annotation, False


def _nullable(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str):
        return None if text.strip().lower() in NONE_WORDS else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its messages
    return parse


def _comma_list(convert: Callable[[str], Any]) -> Callable[[str], list]:
    """One command-line word -> a list: ``32,16,8,8`` (also ``[32, 16]``); an empty word is the empty list."""

    def parse(text: str) -> list:
        text = text.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return [convert(part.strip()) for part in text.split(",") if part.strip()]

    parse.__name__ = f"comma-separated list of {getattr(convert, '__name__', 'value')}"
    return parse


def parse_mapping(text: str) -> dict:
    """A YAML/JSON mapping given on the command line, e.g. ``{context_length: 512, n_tokens: 1024}``."""
    value = yaml.safe_load(text)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArgumentTypeError(f"expected a mapping like '{{key: value}}', got {text!r}")
    return value


parse_mapping.__name__ = "mapping"


class RecipeArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` that raises :class:`ConfigError` instead of printing usage and exiting, and that reads
    comma lists and ``none`` for optional fields."""

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, allow_abbrev=False, **kwargs)
        self._flattened = set()  # list fields: "--x a,b c" parses to [[a, b], [c]], flattened after parsing
        hints = {}
        for dtype in self.dataclass_types:
            hints.update(typing.get_type_hints(dtype))
        for action in self._actions:
            annotation = hints.get(action.dest)
            if annotation is None:
                continue
            inner, optional = _strip_optional(annotation)
            if inner is dict:
                action.type = parse_mapping
            if typing.get_origin(inner) is list and action.nargs == "+":
                action.type = _comma_list(action.type)
                self._flattened.add(action.dest)
            if optional and action.type is not None:
                action.type = _nullable(action.type)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for dest in self._flattened:
            value = getattr(namespace, dest, None)
            if isinstance(value, list):
                setattr(namespace, dest, [item for entry in value
                                          for item in (entry if isinstance(entry, list) else [entry])])
        return namespace, extras

    def error(self, message: str):
        # "argument --max_steps/--max-steps: invalid int value: 'x'" -> "--max_steps: invalid int value: 'x'"
        import re

        raise ConfigError(re.sub(r"^argument (--[\w]+)(/--[\w-]+)*: ", r"\1: ", message))


class _DuplicateKey(Exception):
    def __init__(self, key, line: Optional[int] = None):
        super().__init__(key)
        self.key, self.line = key, line


def _json_mapping(pairs: list) -> dict:
    """``json.loads``' object hook: a mapping that names no key twice."""
    mapping = {}
    for key, value in pairs:
        if key in mapping:
            raise _DuplicateKey(key)
        mapping[key] = value
    return mapping


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings name no key twice (PyYAML keeps the last value silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config_file(path: str | Path) -> dict:
    """The mapping in a YAML or JSON file; one-line :class:`ConfigError` for a missing or unparsable file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"--config {path}: not a YAML or JSON text file (byte 0x{raw[error.start]:02x} at offset "
                          f"{error.start} is not UTF-8)") from None
    if "\x00" in text:
        raise ConfigError(f"--config {path}: not a YAML or JSON text file (it holds NUL bytes)")
    try:
        data = json.loads(text, object_pairs_hook=_json_mapping) if path.suffix == ".json" else \
            yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as error:
        where = f" (again at line {error.line})" if error.line is not None else ""
        raise ConfigError(f"--config {path}: {error.key!r} is set twice{where}; keep one value") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"--config {path}: invalid JSON at line {error.lineno}: {error.msg}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"--config {path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the file must hold a mapping of field: value, got {type(data).__name__}")
    return data


def _unknown(name: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown field {name!r}{hint}")


def _as_token(name: str, value: Any) -> str:
    """A config-file value as one ``--name=value`` word that the field's argparse type reads back."""
    if value is None:
        text = "none"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple)):
        if any(isinstance(v, (list, dict)) for v in value):
            raise ConfigError(f"{name}: expected a flat list, got {value!r}")
        text = ",".join("true" if v is True else "false" if v is False else str(v) for v in value)
    elif isinstance(value, dict):
        text = json.dumps(value)
    else:
        text = str(value)
    return f"--{name}={text}"


def _field_names(dtype) -> list[str]:
    return [f.name for f in dataclasses.fields(dtype) if f.init]


def config_file_tokens(path: str, recipe_fields: Sequence[str], model_fields: Sequence[str]) -> list[str]:
    """The entries of a config file as ``--name=value`` words (``model:`` entries must be model fields)."""
    tokens = []
    data = load_config_file(path)
    for key, value in data.items():
        if key == "model":
            if not isinstance(value, dict):
                raise ConfigError(f"--config {path}: 'model' must be a mapping of model-config fields")
            for name, inner in value.items():
                if name not in model_fields:
                    raise _unknown(name, model_fields, f"--config {path}, under model")
                if name in data:
                    raise ConfigError(f"--config {path}: {name!r} is set twice (at the top level and under model); "
                                      f"keep one value")
                tokens.append(_as_token(name, inner))
        elif key == "config":
            raise ConfigError(f"--config {path}: a config file cannot name another config file")
        elif key in recipe_fields or key in model_fields:
            tokens.append(_as_token(key, value))
        else:
            raise _unknown(key, [*recipe_fields, *model_fields], f"--config {path}")
    return tokens


def _config_path(argv: Sequence[str]) -> Optional[str]:
    path = None
    for index, token in enumerate(argv):
        if token == "--config":
            if index + 1 >= len(argv):
                raise ConfigError("argument --config: expected one argument")
            path = argv[index + 1]
        elif token.startswith("--config="):
            path = token.split("=", 1)[1]
    return path


def parse_recipe_args(recipe_cls: type, model_cls: type, argv: Optional[Sequence[str]] = None,
                      prog: Optional[str] = None):
    """Parse ``argv`` (default ``sys.argv[1:]``) into ``recipe_cls`` with ``.model`` = the dict of ``model_cls``.

    Dataclass ``__post_init__`` checks run here, so every field is validated before any work starts; each problem
    is one :class:`ConfigError` line naming the field.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = RecipeArgumentParser([recipe_cls, model_cls], prog=prog)
    recipe_fields, model_fields = _field_names(recipe_cls), _field_names(model_cls)
    path = _config_path(argv)
    tokens = config_file_tokens(path, recipe_fields, model_fields) if path else []
    namespace, unknown = parser.parse_known_args(tokens + argv)
    if unknown:
        name = next((u for u in unknown if u.startswith("--")), unknown[0])
        if name.startswith("--"):
            raise _unknown(name[2:].split("=")[0].replace("-", "_"), [*recipe_fields, *model_fields],
                           "command line")
        raise ConfigError(f"unexpected argument {name!r} (expected --field value)")
    values = vars(namespace)
    try:
        model = model_cls(**{k: values[k] for k in model_fields})
        args = recipe_cls(**{k: values[k] for k in recipe_fields})
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:  # a dataclass check that did not name itself as ConfigError
        raise ConfigError(str(error).splitlines()[0]) from None
    args.model = dataclasses.asdict(model)
    try:
        args.check_model()
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:  # the model config's own validation
        raise ConfigError(f"model: {str(error).splitlines()[0]}") from None
    return args


def help_from_docstring(doc: Optional[str]) -> dict[str, str]:
    """First line of each ``name (type, ...): text`` / ``name: text`` entry of a docstring (``a, b: text`` gives
    both names the text)."""
    import re

    found: dict[str, str] = {}
    lines = (doc or "").splitlines()
    for index, line in enumerate(lines):
        match = re.match(r"^\s+([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*)(?: \([^)]*\))?:\s*(.*)$", line)
        if not match:
            continue
        text = match.group(2).strip()
        if not text and index + 1 < len(lines):
            text = lines[index + 1].strip()
        text = re.split(r"\. (?=[A-Z])", text)[0].rstrip(".")
        for name in match.group(1).split(", "):
            found.setdefault(name, text)
    return found


def name_or_number(text: str) -> Any:
    """The command-line (and config-file) reading of a field that is a name or a number: ``"0.0625"`` -> 0.0625,
    ``"mup"`` -> ``"mup"`` (the config's own validation then checks either)."""
    try:
        return float(text)
    except ValueError:
        return text


def _cli_annotation(annotation) -> Any:
    """An argparse-friendly annotation for a config field: ``float | int`` -> float, ``int | list[int]`` -> int,
    ``str | float`` -> :func:`name_or_number`, ``str | float | list[float]`` -> str (the field's own validation reads
    the string)."""
    inner, optional = _strip_optional(annotation)
    origin = typing.get_origin(inner)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in typing.get_args(inner) if a is not type(None)]
        optional = optional or len(options) < len(typing.get_args(inner))
        if str in options and (float in options or int in options) and not optional and \
                all(a in (str, float, int) for a in options):
            return name_or_number
        inner = str if str in options else float if float in options else options[0]
    if inner is dict or typing.get_origin(inner) is dict:
        inner = dict
    return Optional[inner] if optional else inner


def model_args_dataclass(name: str, config_cls: type, defaults: dict, helps: dict,
                         extra: Sequence[tuple[str, Any, Any, str]] = (), exclude: Sequence[str] = ()) -> type:
    """A dataclass of ``config_cls``'s own fields (not ``PreTrainedConfig``'s) for ``HfArgumentParser``, in an
    argument group "model (<config class>)". ``defaults`` override the config's defaults (the recipe's model);
    ``extra`` adds ``(name, annotation, default, help)`` fields; ``exclude`` names fields the recipe sets itself."""
    namespace = dict(vars(sys.modules[config_cls.__module__]))
    hints = {name: eval(value, namespace) if isinstance(value, str) else value  # noqa: S307 (annotations)
             for name, value in vars(config_cls).get("__annotations__", {}).items() if not name.startswith("_")}
    own = list(hints)
    base = {name for parent in config_cls.__mro__[1:] for name in vars(parent).get("__annotations__", {})}
    doc_help = help_from_docstring(config_cls.__doc__)
    specs = []
    for field_name in own:
        if field_name in exclude:
            continue
        if field_name in base and field_name not in ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id",
                                                     "tie_word_embeddings", "use_cache"):
            continue
        default = defaults.get(field_name, getattr(config_cls, field_name, None))
        text = helps.get(field_name) or doc_help.get(field_name) or f"{config_cls.__name__}.{field_name}"
        annotation = _cli_annotation(hints[field_name])
        if isinstance(default, (list, dict)):
            value = dataclasses.field(default_factory=lambda v=default: type(v)(v), metadata={"help": text})
        else:
            value = dataclasses.field(default=default, metadata={"help": text})
        specs.append((field_name, annotation, value))
    for field_name, annotation, default, text in extra:
        factory = (lambda v=default: type(v)(v)) if isinstance(default, (list, dict)) else None
        value = dataclasses.field(default_factory=factory, metadata={"help": text}) if factory else \
            dataclasses.field(default=default, metadata={"help": text})
        specs.append((field_name, annotation, value))
    cls = dataclasses.make_dataclass(name, specs)
    cls._argument_group_name = f"model ({config_cls.__name__} fields; also under 'model:' in a config file)"
    return cls


def run_main(main: Callable[[Optional[Sequence[str]]], Any], prog: str) -> None:
    """Entry point of a recipe script: a :class:`ConfigError` (bad argument, config file, output folder, checkpoint,
    Hub access) becomes one line on stderr and exit status 2; a :class:`RunFailure` (checkpoint write, upload) or a
    :class:`MissingExtra` (a library of the [recipes] extra not installed) one line and status 1; a ``--resume_from``
    of a run that is already complete one line on stdout and status 0."""

    try:
        main(None)
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except (RunFailure, MissingExtra) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except RunComplete as complete:
        print(f"{prog}: {complete}", flush=True)


def run_recipe(module: str, prog: str) -> None:
    """A recipe script's entry point: ``run_main`` of the ``main`` of ``hf_structattn.training.<module>``, imported
    inside it, so that a library of the ``[recipes]`` extra that is not installed is one line too."""
    import importlib

    def main(argv):
        return importlib.import_module(f"{__package__}.{module}").main(argv)

    run_main(main, prog)


# ------------------------------------------------------------------------------------------ what defines a run

FREE_ON_RESUME = ("config", "output_dir", "overwrite_output_dir", "resume_from", "stop_after_steps", "log_every",
                  "checkpoint_every", "checkpoints_total_limit", "report_to", "run_name", "disable_tqdm",
                  "push_to_hub", "hub_model_id", "hub_private", "hub_token", "final_weights_only")


def run_configuration(args, recipe: str) -> dict:
    """What defines a run: the recipe, every field that shapes training or evaluation, the model fields."""
    values = dataclasses.asdict(args)
    model = values.pop("model")
    return {"recipe": recipe, "args": {k: v for k, v in values.items() if k not in FREE_ON_RESUME}, "model": model}


def configuration_differences(stored: dict, current: dict) -> list[str]:
    """``name (stored -> now)`` for every differing field; model fields are prefixed ``model.``."""
    found = []
    if stored.get("recipe") != current.get("recipe"):
        found.append(f"recipe ({stored.get('recipe')} -> {current.get('recipe')})")
    for section, prefix in (("args", ""), ("model", "model.")):
        old, new = stored.get(section, {}), current.get(section, {})
        for name in sorted(set(old) | set(new)):
            if json.dumps(old.get(name), sort_keys=True) != json.dumps(new.get(name), sort_keys=True):
                found.append(f"{prefix}{name} ({old.get(name, '<absent>')!r} -> {new.get(name, '<absent>')!r})")
    return found


class RunComplete(Exception):
    """``--resume_from`` on a run that already reached ``max_steps`` and wrote its outputs: nothing to do (the
    recipe entry points print the message and exit with status 0)."""
