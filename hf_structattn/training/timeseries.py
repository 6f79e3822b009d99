"""Time series for the Chronos recipe, all offline: KernelSynth-style Gaussian-process samples (Ansari et al. 2024,
App. A: random compositions of RBF / periodic / linear / rational-quadratic / white-noise kernels) and real series
that ship with statsmodels (sunspots, co2, nile, elnino, macrodata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

REAL_DATASETS = ("sunspots", "co2", "nile", "elnino", "macrodata")


def _kernel(kind: str, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    d = t[:, None] - t[None, :]
    if kind == "rbf":
        length = rng.choice([0.02, 0.05, 0.1, 0.3, 1.0])
        return np.exp(-0.5 * (d / length) ** 2)
    if kind == "periodic":
        period = rng.choice([1 / 4, 1 / 8, 1 / 12, 1 / 24, 1 / 7, 1 / 30]) * rng.choice([0.5, 1.0, 2.0])
        length = rng.choice([0.5, 1.0, 2.0])
        return np.exp(-2.0 * np.sin(np.pi * np.abs(d) / period) ** 2 / length ** 2)
    if kind == "linear":
        c = rng.choice([0.0, 0.5, 1.0])
        return (t[:, None] - c) * (t[None, :] - c)
    if kind == "rq":
        alpha = rng.choice([0.1, 1.0, 10.0])
        length = rng.choice([0.05, 0.2, 1.0])
        return (1 + d ** 2 / (2 * alpha * length ** 2)) ** (-alpha)
    if kind == "white":
        return np.eye(t.size) * rng.choice([0.01, 0.1])
    raise ValueError(kind)


KERNELS = ("rbf", "periodic", "linear", "rq", "white")


def kernel_synth(num_series: int, length: int, seed: int, max_kernels: int = 3) -> np.ndarray:
    """``num_series`` GP samples of ``length`` points on t in [0, 1]; each kernel is a random +/* composition of
    1..max_kernels base kernels. Deterministic in ``seed``. Returns float32 (num_series, length)."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 1.0, length)
    out = np.empty((num_series, length), dtype=np.float32)
    for i in range(num_series):
        count = rng.integers(1, max_kernels + 1)
        kernel = _kernel(rng.choice(KERNELS), t, rng)
        for _ in range(count - 1):
            other = _kernel(rng.choice(KERNELS), t, rng)
            kernel = kernel + other if rng.random() < 0.5 else kernel * other
        kernel = kernel + 1e-5 * np.eye(length)
        try:
            chol = np.linalg.cholesky(kernel)
        except np.linalg.LinAlgError:
            chol = np.linalg.cholesky(kernel + 1e-3 * np.eye(length))
        sample = chol @ rng.standard_normal(length)
        out[i] = sample * rng.choice([1.0, 10.0, 100.0]) + rng.normal(0, 5)  # varied scales and levels
    return out


def real_series(names: Sequence[str] = REAL_DATASETS) -> dict[str, np.ndarray]:
    """Univariate series from statsmodels' bundled datasets (no download). Missing values are interpolated."""
    import statsmodels.api as sm

    series: dict[str, np.ndarray] = {}
    for name in names:
        if name not in REAL_DATASETS:
            raise ValueError(f"unknown real dataset {name!r}; expected some of {REAL_DATASETS}")
        data = getattr(sm.datasets, name).load_pandas().data
        if name == "sunspots":
            series["sunspots"] = data["SUNACTIVITY"].to_numpy()
        elif name == "co2":
            series["co2"] = data["co2"].interpolate().bfill().to_numpy()
        elif name == "nile":
            series["nile"] = data["volume"].to_numpy()
        elif name == "elnino":
            series["elnino"] = data.drop(columns=["YEAR"]).to_numpy().reshape(-1)
        elif name == "macrodata":
            for column in ("realgdp", "cpi", "unemp", "infl"):
                series[f"macrodata/{column}"] = data[column].to_numpy()
    return {k: np.asarray(v, dtype=np.float32) for k, v in series.items()}


@dataclass
class ForecastTask:
    """Training pool and held-out evaluation windows."""

    train_pool: list          # 1-D float32 arrays; training windows are drawn inside them
    eval_contexts: list       # 1-D float32 arrays (history, up to context_length)
    eval_targets: list        # 1-D float32 arrays of prediction_length
    eval_names: list
    description: str


def build_task(context_length: int, prediction_length: int, synthetic_series: int, synthetic_eval_series: int,
               real_datasets: Sequence[str], seed: int, *, series_length: Optional[int] = None,
               eval_context_length: Optional[int] = None, real_eval_windows: int = 1) -> ForecastTask:
    """Training pool and held-out evaluation windows.

    Synthetic: ``synthetic_series`` training series of ``series_length`` points (default twice the window
    ``context_length + prediction_length``) and ``synthetic_eval_series`` held-out series (separate seed) of
    ``eval_context_length + prediction_length`` points. Real: the last ``real_eval_windows * prediction_length``
    points of each series are held out as that many consecutive targets (rolling origins), each with up to
    ``eval_context_length`` points of history before it; only the part before the first target goes into the
    training pool. ``eval_context_length`` (default ``context_length``) lets runs with different context lengths
    share one held-out set: a model keeps the last ``context_length`` points of each context, as Chronos does.
    """
    length = context_length + prediction_length
    series_length = 2 * length if series_length is None else series_length
    eval_context_length = context_length if eval_context_length is None else eval_context_length
    for name, value in (("context_length", context_length), ("prediction_length", prediction_length),
                        ("real_eval_windows", real_eval_windows), ("eval_context_length", eval_context_length)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if series_length < length:
        raise ValueError(f"series_length={series_length} is shorter than one training window "
                         f"(context_length + prediction_length = {length})")
    synthetic = kernel_synth(synthetic_series, series_length, seed=seed * 2 + 1)
    held_out = kernel_synth(synthetic_eval_series, eval_context_length + prediction_length, seed=seed * 2 + 2)
    pool = [s for s in synthetic]
    contexts, targets, names = [], [], []
    for i, s in enumerate(held_out):
        contexts.append(s[:eval_context_length])
        targets.append(s[eval_context_length:])
        names.append(f"kernelsynth/{i}")
    real = real_series(real_datasets) if real_datasets else {}
    for name, s in real.items():
        held = real_eval_windows * prediction_length
        if s.size < held + 8:
            continue
        for window in range(real_eval_windows):
            end = s.size - (real_eval_windows - 1 - window) * prediction_length
            history = s[:end - prediction_length]
            contexts.append(history[-eval_context_length:])
            targets.append(s[end - prediction_length:end])
            names.append(name if real_eval_windows == 1 else f"{name}@{end - prediction_length}")
        train_part = s[:-held]
        if train_part.size >= length:
            pool.append(train_part)
    description = (f"{synthetic_series} KernelSynth-style GP series of length {series_length} (random +/* "
                   f"compositions of RBF, periodic, linear, rational-quadratic and white-noise kernels) plus the "
                   f"training parts of statsmodels' {', '.join(real) or 'none'}; evaluation: {synthetic_eval_series} "
                   f"held-out GP series and the last {real_eval_windows} x {prediction_length} points of each real "
                   f"series (context up to {eval_context_length} points).")
    return ForecastTask(pool, contexts, targets, names, description)


def sample_windows(pool: list, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``batch`` random windows of ``length`` points (series chosen uniformly, offset uniform)."""
    out = np.empty((batch, length), dtype=np.float32)
    for b in range(batch):
        series = pool[rng.integers(len(pool))]
        start = rng.integers(0, series.size - length + 1)
        out[b] = series[start:start + length]
    return out
