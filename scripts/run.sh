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
# Each step is named with an estimate (the README's times: 4 min 2 s in all on a fresh clone of the 2-core Intel Xeon
# VM, setup 80 s of it; 19.5 min on a loaded 2-core AMD EPYC VM); a silence of 20 s gets a line saying what is
# still running; the end says the wall time and the CPU time of every process it ran.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
say() { echo "[run +$(( $(date +%s) - started ))s] $*"; }
tick=$(getconf CLK_TCK 2>/dev/null || echo 100)
# CPU seconds (user + sys) of this shell and of every process it has waited for
cpu_s() { local f; read -r -a f </proc/$$/stat && echo $(( (f[13] + f[14] + f[15] + f[16]) / tick )) || echo "?"; }
load() { cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?"; }
cores() { env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc; }  # nproc alone answers OMP_NUM_THREADS
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)
say "on $(cores) cores of ${cpu:-an unknown CPU}, load average $(load) (over 1 min: near 0 means idle cores)"
say "1/4 setting up .venv (scripts/setup.sh: the package, the recipes' libraries and matplotlib; nothing else is" \
    "downloaded): 80 s on a fresh machine (README), seconds once installed"
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
say "2/4 training dense and MLR attention side by side (logs: $OUT/clm_dense_stdlib.log, $OUT/clm_mlr_stdlib.log);"
say "    steps 2-4 took 2 min 42 s of the README's 4 min 2 s (Intel Xeon VM); the progress lines give an ETA"
say "    each run first starts accelerate, imports torch and transformers, reads the corpus (the standard library's"
say "    *.py files, byte level) and builds its model; the MLR run's progress lines follow"
train --output_dir "$OUT/clm_dense_stdlib" --attention dense "$@" > "$OUT/clm_dense_stdlib.log" 2>&1 &
dense_pid=$!
# the MLR run's lines as they come; 20 s without one gets a line saying what is still going on
train --output_dir "$OUT/clm_mlr_stdlib" "$@" 2>&1 | tee "$OUT/clm_mlr_stdlib.log" |
  grep --line-buffered -E "^(step|data|==|final)" | {
    last=$(date +%s) seen=
    while true; do
      if IFS= read -r -t 20 line; then
        say "$line"; last=$(date +%s) seen=1
      elif [ $? -gt 128 ]; then
        if [ -z "$seen" ]; then
          say "    ... still starting (accelerate launch, imports, the corpus, the model; load average $(load))"
        else
          say "    ... still training (last line $(( $(date +%s) - last )) s ago; log: $OUT/clm_mlr_stdlib.log)"
        fi
      else
        break
      fi
    done
  } || true
kill -0 "$dense_pid" 2>/dev/null && say "    the MLR run has finished; waiting for the dense run (log: $OUT/clm_dense_stdlib.log)"
if ! wait "$dense_pid"; then tail -20 "$OUT/clm_dense_stdlib.log"; echo "the dense run failed" >&2; exit 1; fi
[[ -f "$OUT/clm_mlr_stdlib/final_metrics.json" ]] || { tail -20 "$OUT/clm_mlr_stdlib.log"; echo "the MLR run failed" >&2; exit 1; }
say "both runs finished"

echo
say "3/4 comparing the runs (scripts/compare_runs.py): decode timing of both models, then the table and the plot"
python scripts/compare_runs.py "$OUT/clm_dense_stdlib" "$OUT/clm_mlr_stdlib" --plot "$OUT/dense_vs_mlr.png"
echo
say "4/4 reloading the MLR model where hf_structattn cannot be imported, and generating (scripts/reload_and_generate.py)"
OMP_NUM_THREADS=1 python scripts/reload_and_generate.py "$OUT/clm_mlr_stdlib"
say "done: $(( $(date +%s) - started )) s wall, $(cpu_s) s CPU of the processes it ran (load average now $(load))."
say "Outputs in $OUT/clm_{dense,mlr}_stdlib (model + code, tokenizer, README.md model card, metrics.jsonl, plots/) and $OUT/dense_vs_mlr.{png,md}"
