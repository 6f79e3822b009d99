#!/usr/bin/env bash
# The README's main job, on a fresh machine, CPU only, a few minutes on 2 cores:
#   1. set up .venv (scripts/setup.sh);
#   2. train a small MLR GPT-2 on the Python standard library's own sources (recipes/train_clm.py,
#      configs/clm_mlr_stdlib.yaml) -- evaluation in bits per byte, checkpoints, plots, model card;
#   3. reload the saved folder with trust_remote_code in a fresh interpreter that cannot import hf_structattn,
#      generate a code sample with the hierarchical key cache, print the measured key-cache saving.
# Extra arguments go to the recipe, e.g. `bash scripts/run.sh --max_steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-outputs/clm_mlr_stdlib}
start=$(date +%s)
accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
  recipes/train_clm.py --config configs/clm_mlr_stdlib.yaml --output_dir "$OUT" --overwrite_output_dir "$@"
# one intra-op thread: token-by-token decoding of a small model is latency bound, and on a shared 2-core machine two
# OpenMP threads spin against other processes (measured 40 s instead of 1 s for 200 tokens)
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python scripts/reload_and_generate.py "$OUT"
echo "outputs in $OUT (model + code, tokenizer, README.md model card, metrics.jsonl, plots/); $(( $(date +%s) - start )) s"
