"""Load the project's ``evaluate`` metrics from the local scripts shipped in ``hf_structattn/metrics/``."""

from __future__ import annotations

from pathlib import Path

from .args import missing_extra

try:
    import evaluate
except ModuleNotFoundError as error:  # the core install has no evaluate
    raise missing_extra(error) from None

METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics"
METRIC_NAMES = ("bits_per_byte", "icl_mse", "mase", "wql")


def metric_path(name: str) -> Path:
    if name not in METRIC_NAMES:
        raise ValueError(f"unknown metric {name!r}; expected one of {METRIC_NAMES}")
    return METRICS_DIR / name / f"{name}.py"


def load_metric(name: str) -> evaluate.EvaluationModule:
    """``evaluate.load`` on the local script (no network; kept in memory, so nothing is written to disk)."""
    return evaluate.load(str(metric_path(name)), keep_in_memory=True)
