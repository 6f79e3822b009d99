"""Shared code of the accelerate recipes in ``recipes/`` (kept out of the checkpoint payload ``modeling/``).

* :mod:`.args`      -- recipe arguments: a dataclass + a YAML/JSON config file + ``--field value`` overrides
* :mod:`.tracking`  -- ``JSONLTracker``, a small ``accelerate.tracking.GeneralTracker`` writing ``metrics.jsonl``
* :mod:`.loop`      -- the training loop: deterministic per-step data, accumulation, evaluation, exact resume
* :mod:`.checkpoints` -- atomic, verified, pickle-free checkpoints, rotated only after a save completes
* :mod:`.outputs`   -- model card, plots, ``push_to_hub``
* :mod:`.data`      -- offline text corpora (the Python standard library's own sources by default)
* :mod:`.icl`       -- in-context linear regression prompts (paper §4)
* :mod:`.timeseries`-- KernelSynth-style Gaussian-process series and statsmodels' real series
* :mod:`.clm`, :mod:`.icl`, :mod:`.chronos_ft`, :mod:`.decoder_ft` -- the four recipes
* :mod:`.metrics`   -- the project's ``evaluate`` metric modules, loaded from local paths
* :mod:`.batched`   -- ``StackedRuns``: the runs of one architecture (LRs x seeds) trained as one stacked model
* :mod:`.sweep`     -- one arm of an LR x seed sweep on ``StackedRuns``, resumable (the LM and Chronos designs)
"""
