"""Recipe arguments: a dataclass of recipe fields plus a free-form ``model`` dict of model-config fields.

Precedence: dataclass defaults < ``--config FILE`` (YAML or JSON) < command-line ``--field value``.
A command-line field that is not a recipe field but is one of ``model_fields`` goes into ``args.model``.
Values are parsed with YAML (``128`` -> int, ``[32, 8]`` -> list, ``true`` -> bool); ``32|8|6`` and ``32,8,6`` are
lists of numbers. A bare ``--flag`` means ``true``.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def parse_value(text: str) -> Any:
    """Parse one command-line value."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    if "|" in text or ("," in text and not text.strip().startswith(("[", "{"))):
        parts = [p for p in text.replace("|", ",").split(",") if p.strip()]
        return [_scalar(p.strip()) for p in parts]
    value = yaml.safe_load(text)
    return text if value is None and text not in ("null", "None", "~", "") else value


def load_config_file(path: str | Path) -> dict:
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file must hold a mapping, got {type(data).__name__}")
    return data


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Best-effort check/conversion of ``value`` to a dataclass field's annotation."""
    if value is None:
        return None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union or str(origin) == "types.UnionType":
        for option in [a for a in args if a is not type(None)]:
            try:
                return _coerce(name, value, option)
            except (TypeError, ValueError):
                continue
        raise ValueError(f"--{name}: cannot interpret {value!r} as {annotation}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"--{name}: expected a boolean, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ValueError(f"--{name}: expected an integer, got {value!r}")
        return int(value)
    if annotation is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"--{name}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        return str(value)
    if origin in (list, tuple) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = args[0] if args else Any
        return [v if inner is Any else _coerce(name, v, inner) for v in value]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ValueError(f"--{name}: expected a mapping, got {value!r}")
        return dict(value)
    return value


def parse_recipe_args(cls: type, argv: Optional[Sequence[str]] = None, model_fields: Iterable[str] = ()):
    """Build ``cls`` (a dataclass with a ``model: dict`` field and a ``config: str`` field) from a config file
    and command-line overrides. Unknown fields raise ``ValueError`` (typos must not pass silently)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    model_fields = set(model_fields)
    overrides: dict[str, Any] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--"):
            raise ValueError(f"unexpected argument {token!r} (expected --field value)")
        key, eq, inline = token[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            value, index = inline, index + 1
        elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            value, index = argv[index + 1], index + 2
        else:
            value, index = "true", index + 1
        overrides[key] = value

    values: dict[str, Any] = {}
    model_default = next((f for f in dataclasses.fields(cls) if f.name == "model"), None)
    model: dict[str, Any] = dict(model_default.default_factory()) if model_default is not None and \
        model_default.default_factory is not dataclasses.MISSING else {}
    config_path = overrides.pop("config", None)
    if config_path is not None:
        values["config"] = config_path
        for key, value in load_config_file(config_path).items():
            if key == "model":
                model.update(value or {})
            elif key in names:
                values[key] = value
            elif key in model_fields:
                model[key] = value
            else:
                raise ValueError(f"{config_path}: unknown field {key!r}")
    for key, text in overrides.items():
        value = parse_value(text)
        if key in names and key != "model":
            values[key] = value
        elif key in model_fields:
            model[key] = value if not (key.endswith("ranks") or key.endswith("sizes") or key.endswith("factors")
                                       or key == "attention_layers") or isinstance(value, list) else [value]
        else:
            raise ValueError(f"unknown argument --{key}")
    values = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    values["model"] = model
    return cls(**values)


def to_dict(args) -> dict:
    return dataclasses.asdict(args)
