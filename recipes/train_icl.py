"""In-context linear regression (Kuang et al. 2025 §4) with a structured-attention GPT-2.

    accelerate launch recipes/train_icl.py --config configs/icl_bilinear_mlr.yaml [--field value ...]

All logic lives in ``hf_structattn.training.icl``; see recipes/README.md.
"""

from hf_structattn.training.args import run_recipe

if __name__ == "__main__":
    run_recipe("icl", "train_icl.py")
