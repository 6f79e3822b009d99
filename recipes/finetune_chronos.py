"""Patch a Chronos-T5 with structured attention (hf_structattn.patch) and fine-tune it on synthetic + real series.

    accelerate launch recipes/finetune_chronos.py --config configs/chronos_tiny_mlr.yaml [--checkpoint DIR] ...

All logic lives in ``hf_structattn.training.chronos_ft`` (chronos-forecasting is imported lazily); see
recipes/README.md.
"""

from hf_structattn.training.args import run_recipe

if __name__ == "__main__":
    run_recipe("chronos_ft", "finetune_chronos.py")
