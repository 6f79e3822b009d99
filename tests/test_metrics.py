"""The project's evaluate metric scripts, loaded offline from local paths, against hand-computed values."""

import math
import tomllib
from pathlib import Path

import pytest

from hf_structattn.training.metrics import METRIC_NAMES, load_metric, metric_path


def test_metric_scripts_are_shipped_as_package_data():
    for name in METRIC_NAMES:
        assert metric_path(name).is_file()
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["hf_structattn"]
    assert "metrics/*/*.py" in patterns


def test_bits_per_byte_by_hand():
    metric = load_metric("bits_per_byte")
    # two windows: 3 bytes at NLL ln(4) each and 1 byte at ln(2): (3*2 + 1) bits / 4 bytes = 1.75
    result = metric.compute(nll_sum=[3 * math.log(4), math.log(2)], num_bytes=[3, 1])
    assert result["bits_per_byte"] == pytest.approx(1.75)
    assert result["nats_per_byte"] == pytest.approx(1.75 * math.log(2))
    assert result["perplexity_per_byte"] == pytest.approx(2 ** 1.75)
    assert result["num_bytes"] == 4
    # add_batch path gives the same
    metric.add_batch(nll_sum=[3 * math.log(4)], num_bytes=[3])
    metric.add_batch(nll_sum=[math.log(2)], num_bytes=[1])
    assert metric.compute()["bits_per_byte"] == pytest.approx(1.75)
    with pytest.raises(ValueError):
        metric.compute(nll_sum=[1.0], num_bytes=[0])


def test_icl_mse_by_hand():
    result = load_metric("icl_mse").compute(predictions=[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]],
                                            references=[[1.0, 1.0, 0.0], [1.0, 3.0, 1.0]], input_dim=2)
    # squared errors: [1, 0, 4] and [0, 4, 0] -> by position [0.5, 2, 2], mean 1.5, last 2
    assert result["mse_by_position"] == pytest.approx([0.5, 2.0, 2.0])
    assert result["mse"] == pytest.approx(1.5)
    assert result["mse_last"] == pytest.approx(2.0)
    assert result["normalized_mse_last"] == pytest.approx(1.0)
    assert result["num_prompts"] == 2


def test_mase_by_hand():
    metric = load_metric("mase")
    # series 1: naive error of context [1, 2, 4] = mean(1, 2) = 1.5, forecast MAE = mean(|3-2|, |5-5|) = 0.5 -> 1/3
    # series 2: context [0, 2, 0, 2] seasonality 1 -> scale 2; MAE 1 -> 0.5. mean = (1/3 + 1/2) / 2
    result = metric.compute(predictions=[[2.0, 5.0], [1.0]], references=[[3.0, 5.0], [2.0]],
                            contexts=[[1.0, 2.0, 4.0], [0.0, 2.0, 0.0, 2.0]])
    assert result["mase"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    # seasonality 2: series 2's seasonal naive error is 0 -> skipped; series 1: |4 - 1| = 3, MAE 0.5 -> 1/6
    seasonal = metric.compute(predictions=[[2.0, 5.0], [1.0]], references=[[3.0, 5.0], [2.0]],
                              contexts=[[1.0, 2.0, 4.0], [0.0, 2.0, 0.0, 2.0]], seasonality=2)
    assert seasonal["mase"] == pytest.approx(1 / 6)
    assert seasonal["num_skipped"] == 1


def test_wql_by_hand():
    # one series, 2 steps, levels 0.1 / 0.5 / 0.9; y = [10, 20]
    predictions = [[[8.0, 10.0, 12.0], [25.0, 30.0, 35.0]]]
    result = load_metric("wql").compute(predictions=predictions, references=[[10.0, 20.0]],
                                        quantile_levels=[0.1, 0.5, 0.9])
    # pinball: q=0.1: y-yhat = 2 -> 0.2 ; -5 -> 0.9*5 = 4.5  => 4.7
    #          q=0.5: 0 -> 0 ; -10 -> 5                      => 5
    #          q=0.9: -2 -> 0.1*2 = 0.2 ; -15 -> 1.5           => 1.7
    expected = [2 * 4.7 / 30, 2 * 5 / 30, 2 * 1.7 / 30]
    assert result["wql_by_quantile"] == pytest.approx(expected)
    assert result["wql"] == pytest.approx(sum(expected) / 3)
    with pytest.raises(ValueError):
        load_metric("wql").compute(predictions=[[[1.0]]], references=[[1.0]], quantile_levels=[1.5])
