"""Bits per byte of a language model: summed negative log-likelihood (nats) over the byte count, divided by ln 2."""

import math

import datasets
import evaluate

_DESCRIPTION = """Bits per byte (bpb) = sum(nll) / (ln(2) * sum(num_bytes)), where each example gives the summed
negative log-likelihood in nats of the tokens of a text window and the number of UTF-8 bytes those tokens cover.
Also returns nats per byte and the byte-level perplexity exp(nats per byte)."""

_KWARGS = """Args:
    nll_sum: list of floats, summed NLL (natural log) per example.
    num_bytes: list of ints, bytes covered by the scored tokens of each example.
Returns: {"bits_per_byte", "nats_per_byte", "perplexity_per_byte", "num_bytes"}
Example:
    >>> metric.compute(nll_sum=[math.log(2) * 8], num_bytes=[4])["bits_per_byte"]
    2.0
"""


class BitsPerByte(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"nll_sum": datasets.Value("float64"), "num_bytes": datasets.Value("int64")}),
        )

    def _compute(self, nll_sum, num_bytes):
        total_bytes = int(sum(num_bytes))
        if total_bytes <= 0:
            raise ValueError("bits_per_byte needs a positive number of bytes")
        nats = float(sum(nll_sum)) / total_bytes
        return {"bits_per_byte": nats / math.log(2), "nats_per_byte": nats, "perplexity_per_byte": math.exp(nats),
                "num_bytes": total_bytes}
