"""A JSON-lines experiment tracker for ``accelerate`` (one JSON object per ``accelerator.log`` call)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from accelerate.tracking import GeneralTracker, on_main_process


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


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Metric records of a run (config events dropped); for a step logged more than once with the same keys
    (a run resumed from an earlier checkpoint), the last record wins."""
    records: dict[tuple, dict] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("event") == "config":
            continue
        key = (record.get("step"), tuple(sorted(k for k in record if k != "time")))
        records.pop(key, None)
        records[key] = record
    return sorted(records.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))
