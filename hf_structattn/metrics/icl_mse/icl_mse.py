"""Mean squared error of in-context regression predictions, per prompt position and overall."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """In-context regression error (Garg et al. 2022; Kuang et al. 2025 §4). Each example is one prompt:
the model's predictions of y_1..y_N (each made from the points before it) and the true y_1..y_N. Returns the MSE over
all positions, the MSE at the last position (the quantity the paper plots), the per-position MSE, and the same
values divided by `input_dim` when given (error normalised by the problem dimension)."""

_KWARGS = """Args:
    predictions: list of lists of floats (one list of N predictions per prompt).
    references: list of lists of floats (the true y's, same shape).
    input_dim: optional int d; adds "normalized_mse" and "normalized_mse_last" (= value / d).
Example:
    >>> metric.compute(predictions=[[0.0, 1.0]], references=[[1.0, 1.0]])
    {'mse': 0.5, 'mse_last': 0.0, 'mse_by_position': [1.0, 0.0], 'num_prompts': 1}
"""


class ICLMSE(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.List(datasets.Value("float64")),
                                        "references": datasets.List(datasets.Value("float64"))}),
        )

    def _compute(self, predictions, references, input_dim=None):
        pred = np.asarray(predictions, dtype=np.float64)
        ref = np.asarray(references, dtype=np.float64)
        if pred.shape != ref.shape or pred.ndim != 2:
            raise ValueError(f"predictions {pred.shape} and references {ref.shape} must be equal (prompts, positions)")
        by_position = ((pred - ref) ** 2).mean(axis=0)
        result = {"mse": float(by_position.mean()), "mse_last": float(by_position[-1]),
                  "mse_by_position": [float(v) for v in by_position], "num_prompts": int(pred.shape[0])}
        if input_dim:
            result["normalized_mse"] = result["mse"] / input_dim
            result["normalized_mse_last"] = result["mse_last"] / input_dim
        return result
