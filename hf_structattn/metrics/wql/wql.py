"""Weighted quantile loss (the probabilistic metric of the Chronos paper, GluonTS' mean_weighted_sum_quantile_loss)."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """WQL = mean over quantile levels q of  2 * sum_{series,t} rho_q(y, yhat_q) / sum_{series,t} |y|,
with the pinball loss rho_q(y, yhat) = max(q (y - yhat), (q - 1)(y - yhat)). Sums run over all series and horizon
steps (the scale is pooled, as in GluonTS and Chronos). Also returns the per-level weighted losses."""

_KWARGS = """Args:
    predictions: list (series) of lists (horizon) of lists (one value per quantile level).
    references: list (series) of lists (horizon) of floats.
    quantile_levels: list of floats in (0, 1), same order as the innermost prediction axis.
Example:
    >>> metric.compute(predictions=[[[1.0]]], references=[[2.0]], quantile_levels=[0.5])
    {'wql': 0.5, 'wql_by_quantile': [0.5]}
"""


class WQL(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS,
            features=datasets.Features({
                "predictions": datasets.List(datasets.List(datasets.Value("float64"))),
                "references": datasets.List(datasets.Value("float64"))}),
        )

    def _compute(self, predictions, references, quantile_levels):
        levels = np.asarray(quantile_levels, dtype=np.float64)
        if levels.ndim != 1 or not ((levels > 0) & (levels < 1)).all():
            raise ValueError(f"quantile_levels must be a list of levels in (0, 1), got {quantile_levels}")
        pred = np.concatenate([np.asarray(p, dtype=np.float64).reshape(-1, levels.size) for p in predictions])
        ref = np.concatenate([np.asarray(r, dtype=np.float64).reshape(-1) for r in references])
        if pred.shape[0] != ref.shape[0]:
            raise ValueError(f"{pred.shape[0]} forecast steps but {ref.shape[0]} reference values")
        error = ref[:, None] - pred
        pinball = np.maximum(levels * error, (levels - 1.0) * error)
        denominator = np.abs(ref).sum()
        if denominator == 0:
            raise ValueError("wql is undefined when every reference value is zero")
        by_level = 2.0 * pinball.sum(axis=0) / denominator
        return {"wql": float(by_level.mean()), "wql_by_quantile": [float(v) for v in by_level]}
