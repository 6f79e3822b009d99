"""A JSON-lines experiment tracker for ``accelerate`` (one JSON object per ``accelerator.log`` call)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from .args import missing_extra

try:
    from accelerate.tracking import GeneralTracker, on_main_process
except ModuleNotFoundError as error:  # the core install has no accelerate
    raise missing_extra(error) from None


def _jsonable(value):
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class JSONLTracker(GeneralTracker):
    """Appends ``{"step": s, "time": t, **values}`` lines to ``<logging_dir>/metrics.jsonl`` (main process only).

    Appending (not truncating) is what a resumed run needs; :func:`read_jsonl` keeps the last record per
    (step, kind) so a replayed step after a resume does not appear twice.
    """

    name = "jsonl"
    requires_logging_directory = True

    @on_main_process
    def __init__(self, run_name: str, logging_dir: str | os.PathLike, filename: str = "metrics.jsonl"):
        super().__init__()
        self.run_name = run_name
        self.path = Path(logging_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    @property
    def tracker(self):
        return self._file

    @on_main_process
    def store_init_configuration(self, values: dict):
        self._write({"event": "config", "run_name": self.run_name, "config": _jsonable(values)})

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self._write({"step": step, "time": round(time.time(), 3), **_jsonable(values)})

    def _write(self, record: dict):
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    @on_main_process
    def finish(self):
        self._file.close()


def read_log_lines(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """The one reader of a run's ``metrics.jsonl``: (line, record) of every non-empty line. A last line that does not
    parse (a run killed while it wrote it) is dropped with a one-line note on stderr; any other line that does not
    parse is a one-line :class:`.args.ConfigError` naming the file and the line."""
    from .args import ConfigError

    lines = [(number, line) for number, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    pairs = []
    for index, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as error:  # json.JSONDecodeError included
            if index == len(lines) - 1:
                print(f"note: {path}: dropped its last line (line {number}), which is not a complete record (the run "
                      f"was stopped while logging): {line[:60]!r}", file=sys.stderr, flush=True)
                break
            raise ConfigError(f"{path}: line {number} is not valid JSON ({' '.join(str(error).split())}); only a "
                              f"half-written last line is dropped") from None
        pairs.append((line, record))
    return pairs


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Metric records of a run (config events dropped); for a step logged more than once with the same keys
    (a run resumed from an earlier checkpoint), the last record wins."""
    records: dict[tuple, dict] = {}
    for _, record in read_log_lines(path):
        if record.get("event") == "config":
            continue
        key = (record.get("step"), tuple(sorted(k for k in record if k != "time")))
        records.pop(key, None)
        records[key] = record
    return sorted(records.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))
