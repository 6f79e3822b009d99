"""Causal LM pre-training of a structured-attention GPT-2 (any variant) on an offline text corpus.

    accelerate launch recipes/train_clm.py --config configs/clm_mlr_stdlib.yaml [--field value ...]

All logic lives in ``hf_structattn.training.clm``; see recipes/README.md.
"""

from hf_structattn.training.args import run_recipe

if __name__ == "__main__":
    run_recipe("clm", "train_clm.py")
