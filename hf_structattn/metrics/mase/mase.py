"""Mean Absolute Scaled Error (Hyndman & Koehler 2006) of point forecasts, averaged over series."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """MASE of one series = mean_t |y_t - yhat_t| / mean_t |c_t - c_{t-m}|, the in-sample seasonal-naive
error of its context c (seasonality m). The metric is the mean over series; series whose context has zero naive
error are skipped (they are counted in "num_skipped")."""

_KWARGS = """Args:
    predictions: list of lists of floats (point forecast per series, e.g. the median).
    references: list of lists of floats (true future values, same lengths).
    contexts: list of lists of floats (the history the forecast was made from).
    seasonality: int m >= 1 (default 1).
Example:
    >>> metric.compute(predictions=[[2.0]], references=[[3.0]], contexts=[[1.0, 2.0, 4.0]])
    {'mase': 0.6666666666666666, 'num_series': 1, 'num_skipped': 0}
"""


class MASE(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.List(datasets.Value("float64")),
                                        "references": datasets.List(datasets.Value("float64")),
                                        "contexts": datasets.List(datasets.Value("float64"))}),
        )

    def _compute(self, predictions, references, contexts, seasonality=1):
        if seasonality < 1:
            raise ValueError(f"seasonality must be >= 1, got {seasonality}")
        scores, skipped = [], 0
        for pred, ref, ctx in zip(predictions, references, contexts):
            pred, ref, ctx = (np.asarray(a, dtype=np.float64) for a in (pred, ref, ctx))
            if pred.shape != ref.shape:
                raise ValueError(f"prediction length {pred.shape} != reference length {ref.shape}")
            if ctx.size <= seasonality:
                raise ValueError(f"a context of length {ctx.size} is too short for seasonality {seasonality}")
            scale = np.nanmean(np.abs(ctx[seasonality:] - ctx[:-seasonality]))
            if not np.isfinite(scale) or scale == 0:
                skipped += 1
                continue
            scores.append(np.nanmean(np.abs(ref - pred)) / scale)
        return {"mase": float(np.mean(scores)) if scores else float("nan"), "num_series": len(scores),
                "num_skipped": skipped}
