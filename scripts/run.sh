#!/usr/bin/env bash
# The README's main job, on a fresh machine, CPU only, a few minutes on 2 cores:
#   1. set up .venv (scripts/setup.sh);
#   2. train the same small GPT-2 twice on the same data (the Python standard library's own sources, byte level,
#      configs/clm_mlr_stdlib.yaml), once with dense and once with MLR attention, side by side (one thread each);
#   3. compare them (scripts/compare_runs.py): validation bits per byte, training tokens/s, key-cache bytes and decode
#      ms/token in a table, validation curves in $OUT/dense_vs_mlr.png;
#   4. reload the MLR model with trust_remote_code in a fresh interpreter that cannot import hf_structattn, generate a
#      sample with the hierarchical key cache, print the measured key-cache saving.
# Extra arguments go to both training runs, e.g. `bash scripts/run.sh --max_steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
say() { echo "[run +$(( $(date +%s) - started ))s] $*"; }
say "1/4 setting up .venv (scripts/setup.sh: the package and matplotlib; nothing else is downloaded)"
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-outputs}
mkdir -p "$OUT"

# one intra-op thread per run: the two runs share the 2 cores, and a small model is latency bound anyway
train() {
  OMP_NUM_THREADS=1 accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
    recipes/train_clm.py --config configs/clm_mlr_stdlib.yaml --overwrite_output_dir --disable_tqdm \
    --progress_every_s 15 "$@"   # a progress line every 15 s (the default is 30)
}
say "2/4 training dense and MLR attention side by side (logs: $OUT/clm_dense_stdlib.log, $OUT/clm_mlr_stdlib.log)"
say "    each run first reads the corpus (the standard library's *.py files, byte level) and builds its model;"
say "    the MLR run's progress lines follow"
train --output_dir "$OUT/clm_dense_stdlib" --attention dense "$@" > "$OUT/clm_dense_stdlib.log" 2>&1 &
dense_pid=$!
train --output_dir "$OUT/clm_mlr_stdlib" "$@" 2>&1 | tee "$OUT/clm_mlr_stdlib.log" |
  grep --line-buffered -E "^(step|data|==|final)" | while IFS= read -r line; do say "$line"; done || true
if ! wait "$dense_pid"; then tail -20 "$OUT/clm_dense_stdlib.log"; echo "the dense run failed" >&2; exit 1; fi
[[ -f "$OUT/clm_mlr_stdlib/final_metrics.json" ]] || { tail -20 "$OUT/clm_mlr_stdlib.log"; echo "the MLR run failed" >&2; exit 1; }
say "both runs finished"

echo
say "3/4 comparing the runs (scripts/compare_runs.py): decode timing of both models, then the table and the plot"
python scripts/compare_runs.py "$OUT/clm_dense_stdlib" "$OUT/clm_mlr_stdlib" --plot "$OUT/dense_vs_mlr.png"
echo
say "4/4 reloading the MLR model where hf_structattn cannot be imported, and generating (scripts/reload_and_generate.py)"
OMP_NUM_THREADS=1 python scripts/reload_and_generate.py "$OUT/clm_mlr_stdlib"
say "done. Outputs in $OUT/clm_{dense,mlr}_stdlib (model + code, tokenizer, README.md model card, metrics.jsonl, plots/) and $OUT/dense_vs_mlr.{png,md}"
