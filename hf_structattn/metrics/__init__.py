"""The project's ``evaluate`` metric scripts (``<name>/<name>.py``), loadable offline from local paths.

>>> from hf_structattn.training.metrics import load_metric
>>> load_metric("mase").compute(predictions=[[2.0]], references=[[3.0]], contexts=[[1.0, 2.0, 4.0]])
{'mase': 0.6666666666666666, 'num_series': 1, 'num_skipped': 0}
"""
