"""Patch a local transformers decoder (Llama, Qwen, Mistral, Gemma, Phi-3, GPT-2, ...) to MLR attention with
``hf_structattn.patch``, report the drift, fine-tune it and save it with its code.

    accelerate launch recipes/finetune_patched.py --config configs/patched_tiny_llama.yaml [--model_path DIR] ...

Without ``--model_path`` a tiny Llama is built and pretrained (dense) here first. All logic lives in
``hf_structattn.training.decoder_ft``; see recipes/README.md.
"""

from hf_structattn.training.args import run_recipe

if __name__ == "__main__":
    run_recipe("decoder_ft", "finetune_patched.py")
