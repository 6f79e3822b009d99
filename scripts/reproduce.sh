#!/usr/bin/env bash
# The paper's experiments (Kuang et al., ICML 2025): what this script runs, exactly (docs/results.md has the table of
# claims, designs, rules and budgets).
#
#   bash scripts/reproduce.sh --designs [--device cuda] [--jobs N] [--only icl|lm|chronos]
#       The decisive designs, each with a rule coded before it runs, every shard in order, then its report (verdict
#       lines; the designs' shards one at a time: `plan --shards` and `shard ID` of each script):
#         icl:     scripts/icl_rank_experiment.py run --d 4 (the decisive design's 14 runs: arms (i), (iii), (v), (ii),
#                  seeds 1-3, 20k or 40k steps, the runs of an arm stacked into one model; --jobs arms at a time),
#                  then report
#         lm:      scripts/lm_experiment.py run (4 variants at equal FLOPs, muP, 2 seeds; 3 LRs at D = 128, the
#                  best transferred to D = 256 and 384), report
#         chronos: scripts/chronos_experiment.py run (dense / MLR x 3 widths x 3 seeds x 3 LRs, Chronos-T5's 8 x 64
#                  heads; then the logit-scale ablation), report
#       GPU work on one H100 (estimates, `plan --shards` of each script): icl 4 shards of ~6-12 min with CUDA
#       graphs; lm 8 shards of ~5-6 min; chronos 10 + 5 shards of ~5-8 min. Every command resumes when rerun
#       and skips the runs that have a results file: results/<design>/ (committed); working files and checkpoints
#       under $REPRODUCE_OUT (default outputs/reproduce); reports in $REPRODUCE_OUT/<name>_report.txt.
#   bash scripts/reproduce.sh --pilots [--device cuda]
#       The three pilots (each <= 170 s of wall on an H100 by its --budget-s), into $REPRODUCE_OUT/pilots/<name>/
#       (pilot.md, pilot.json; a rerun replaces them).
#   bash scripts/reproduce.sh [--budget small|full] [--jobs N] [--only icl|clm|chronos]
#       The earlier TOY-SCALE CPU runs of docs/results.md's toy-scale sections (not reproductions; finished runs are
#       skipped on a rerun; results under $REPRODUCE_OUT, figures in $REPRODUCE_FIGURES, default docs/results):
#
# Experiment 1, toy scale: in-context linear regression (paper §2.2 Fig. 2 and §4 Fig. 3a/3b).
#   x ~ N(0, I/d), w ~ N(0, I), y = <x, w>, N = 2d points; 8-head dense, 1-head dense, 8-head bilinear BTT and
#   8-head bilinear MLR attention at widths D; the same number of training steps for every run; evaluation on
#   fresh prompts never trained on (recipes/train_icl.py). Results: outputs/reproduce/icl/d<d>/<variant>_D<D>/
#   final_metrics.json, then scripts/plot_icl.py writes docs/results/icl_error_vs_{width,flops}.png.
#   small: d = 8, 4 layers, D in {32, 64, 128} (D = 128 only for 8-head dense), ICL_STEPS (default 1200) steps
#          -> ~27 min on 2 CPU cores shared with another 2-process job. D = 16 was dropped for the time box; add it
#          with ICL_WIDTHS="128 64 32 16" (~+11 min). ICL_DIMS="8 16" adds d = 16 (docs/results.md ran
#          ICL_DIMS=16 ICL_WIDTHS="128 64"). Overrides: ICL_STEPS, ICL_LAYERS, ICL_LR, ICL_WIDTHS, ICL_DIMS.
#   full:  d = 8 and 16, 6 layers, D in {16, 32, 64, 128, 256}, ICL_STEPS (default 20000) steps (GPU-scale time).
# Experiment 2 (language modelling, recipes/train_clm.py): scripts/reproduce_lm.sh (same --budget and --jobs).
# Experiment 3 (time series, recipes/finetune_chronos.py): dense vs MLR Chronos-T5 trained from scratch (below).
set -euo pipefail
cd "$(dirname "$0")/.."

BUDGET=small
JOBS=
ONLY=all
MODE=toy
DEVICE=cuda
while [[ $# -gt 0 ]]; do
  case "$1" in
    --designs) MODE=designs; shift ;;
    --pilots) MODE=pilots; shift ;;
    --device) DEVICE="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --budget=*) BUDGET="${1#*=}"; shift ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [[ -z $JOBS ]]; then JOBS=$([[ $MODE == designs ]] && echo 6 || echo 2); fi
if [[ -f .venv/bin/activate ]]; then . .venv/bin/activate; fi
PY=${PYTHON:-python}

case "$BUDGET" in
  small) DIMS=(${ICL_DIMS:-8}); WIDTHS=(${ICL_WIDTHS:-128 64 32}); LAYERS=${ICL_LAYERS:-4}; STEPS=${ICL_STEPS:-1200} ;;
  full)  DIMS=(8 16); WIDTHS=(${ICL_WIDTHS:-256 128 64 32 16}); LAYERS=${ICL_LAYERS:-6}; STEPS=${ICL_STEPS:-20000} ;;
  *) echo "--budget must be small or full, got $BUDGET" >&2; exit 2 ;;
esac
VARIANTS=(dense8 dense1 btt8 mlr8)
LR=${ICL_LR:-1e-3}
OUT=${REPRODUCE_OUT:-outputs/reproduce}/icl

RUNNING=0
# launch DIR LOG SCRIPT ARGS...: one run in the background (log in DIR.log, "done"/"FAILED" line in LOG), one thread
# per run and at most JOBS at a time (tiny models: parallel runs beat intra-op threads on CPU).
launch() {
  local dir=$1 log=$2
  shift 2
  # finished runs are skipped before launch; an unfinished one starts again from scratch
  echo "OMP_NUM_THREADS=1 $PY $* --overwrite_output_dir" | tee -a "$log"
  ( s=$SECONDS; OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $PY "$@" --overwrite_output_dir > "$dir.log" 2>&1 \
      && echo "done $dir in $((SECONDS - s)) s" | tee -a "$log" \
      || echo "FAILED $dir (see $dir.log)" | tee -a "$log" ) &
  RUNNING=$((RUNNING + 1))
  if (( RUNNING >= JOBS )); then wait -n || true; RUNNING=$((RUNNING - 1)); fi
}

# finish_sweep NAME T0 LOG: wait for every launched run, then log the sweep's wall time.
finish_sweep() {
  wait || true
  RUNNING=0
  echo "# $1 wall time: $((SECONDS - $2)) s (end=$(date -u +%FT%TZ))" | tee -a "$3"
}

# the curriculum reaches the full d and N = 2d after a quarter of the steps (d = 8, 1200 steps: every 50 steps)
# bilinear MLR ranks for 8 heads: sum of ranks = head dim r = D/8 (the paper's "match the efficiency of standard
# attention"), levels with 1, 2, 4, 8 chunks of the D features.
mlr_ranks() {
  case "$1" in
    16) echo "1,1" ;;
    32) echo "2,1,1" ;;
    64) echo "4,2,1,1" ;;
    128) echo "8,4,2,2" ;;
    256) echo "16,8,4,4" ;;
    *) echo "no MLR ranks for D=$1" >&2; return 1 ;;
  esac
}

icl_args() {  # variant D d -> recipe arguments
  local variant=$1 D=$2 d=$3
  local common=(--config configs/icl_bilinear_mlr.yaml --n_dims "$d" --n_layer "$LAYERS" --n_embd "$D"
                --max_steps "$STEPS" --learning_rate "$LR" --lr_schedule constant_with_warmup --warmup_steps 20
                --per_device_batch_size 64
                --curriculum --curriculum_dims_start 2 --curriculum_points_start 4
                --curriculum_dims_increment 1 --curriculum_points_increment 2
                --curriculum_interval $(( STEPS / (4 * (d - 2)) > 0 ? STEPS / (4 * (d - 2)) : 1 ))
                --eval_every $(( STEPS / 6 > 0 ? STEPS / 6 : 1 )) --eval_prompts 512
                --checkpoint_every 1000000 --report_to none --seed 0
                --output_dir "$OUT/d$d/${variant}_D$D")
  case "$variant" in
    dense8) echo "${common[@]} --attention dense --n_head 8" ;;
    dense1) echo "${common[@]} --attention dense --n_head 1" ;;
    btt8)   echo "${common[@]} --attention bilinear_btt --n_head 8 --btt_rank 1" ;;
    mlr8)   echo "${common[@]} --attention bilinear_mlr --n_head 8 --bilinear_mlr_ranks $(mlr_ranks "$D")" ;;
  esac
}

run_icl() {
  mkdir -p "$OUT"
  local log="$OUT/sweep_log.txt"
  echo "# budget=$BUDGET layers=$LAYERS steps=$STEPS lr=$LR jobs=$JOBS start=$(date -u +%FT%TZ)" >> "$log"
  local t0=$SECONDS
  for d in "${DIMS[@]}"; do
    for D in "${WIDTHS[@]}"; do
      for v in "${VARIANTS[@]}"; do
        local dir="$OUT/d$d/${v}_D$D"
        if [[ -f "$dir/final_metrics.json" ]]; then echo "skip $dir (done)"; continue; fi
        # small budget: D = 128 only for 8-head dense (the one variant whose head dim r = D/8 needs it to reach d);
        # the full-rank variants are expected to work already at D <= 64.
        if [[ $BUDGET == small && $D -ge 128 && $v != dense8 ]]; then continue; fi
        mkdir -p "$dir"
        launch "$dir" "$log" recipes/train_icl.py $(icl_args "$v" "$D" "$d")
      done
    done
  done
  finish_sweep "experiment 1" "$t0" "$log"
  $PY scripts/plot_icl.py --root "$OUT" --out "${REPRODUCE_FIGURES:-docs/results}"
}

# ---------------------------------------------------------------------------------------------------------------
# Experiment 2 -- language modelling (paper §5.1 Fig. 4, MLR attention vs dense / sliding-window scaling, recipes/train_clm.py)
run_clm() { bash scripts/reproduce_lm.sh --budget "$BUDGET" --jobs "$JOBS"; }

# Experiment 3 -- time series (paper §5.2 Fig. 5 and App. I, recipes/finetune_chronos.py)
# A small Chronos-T5 trained from scratch (no pretrained weights can be downloaded) on KernelSynth-style GP series +
# statsmodels' real series, stock dense T5 attention vs MLR in encoder and decoder self-attention (ranks 8|2|2|2|1|1 =
# the paper's 32|10|8|8|4|2 scaled to d_kv 16, dyadic blocks from the context length), same random init, same
# data order, equal steps; widths D (heads D/16) and context lengths C. Config: configs/chronos_mlr_vs_dense.yaml.
#   small: D in {64, 128}, C in {128, 512}, CHRONOS_STEPS (default 300) steps of 16 windows.
#   full:  D in {128, 256, 512}, C in {128, 256, 512}, CHRONOS_STEPS (default 5000) steps.
#   Overrides: CHRONOS_WIDTHS, CHRONOS_CONTEXTS, CHRONOS_STEPS, CHRONOS_SEED (init, data and held-out series).
run_chronos() {
  local out=${REPRODUCE_OUT:-outputs/reproduce}/chronos widths contexts steps
  case "$BUDGET" in
    small) widths=(${CHRONOS_WIDTHS:-128 64}); contexts=(${CHRONOS_CONTEXTS:-512 128}); steps=${CHRONOS_STEPS:-300} ;;
    full)  widths=(${CHRONOS_WIDTHS:-512 256 128}); contexts=(${CHRONOS_CONTEXTS:-512 256 128})
           steps=${CHRONOS_STEPS:-5000} ;;
  esac
  mkdir -p "$out"
  local log="$out/sweep_log.txt" t0=$SECONDS
  echo "# budget=$BUDGET steps=$steps jobs=$JOBS start=$(date -u +%FT%TZ)" >> "$log"
  for D in "${widths[@]}"; do
    for C in "${contexts[@]}"; do
      for attention in dense mlr; do
        local dir="$out/D${D}_C${C}/$attention"
        if [[ -f "$dir/final_metrics.json" ]]; then echo "skip $dir (done)"; continue; fi
        mkdir -p "$dir"
        local args="--config configs/chronos_mlr_vs_dense.yaml --attention $attention --d_model $D
                    --num_heads $((D / 16)) --d_ff $((4 * D)) --max_steps $steps --eval_every $((steps / 5))
                    --warmup_steps $((steps / 10)) --chronos_config {\"context_length\":$C,\"prediction_length\":32,\"n_tokens\":1024}
                    --seed ${CHRONOS_SEED:-0} --output_dir $dir --disable_tqdm"
        launch "$dir" "$log" recipes/finetune_chronos.py $args
      done
    done
  done
  finish_sweep "experiment 3" "$t0" "$log"
  $PY scripts/plot_chronos.py --root "$out" --out "${REPRODUCE_FIGURES:-docs/results}"
}
# ---------------------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------------------
# The decisive designs and their pilots (the scripts' own docstrings hold the designs and rules).
run_designs() {
  local out=${REPRODUCE_OUT:-outputs/reproduce}
  mkdir -p "$out"
  case "$ONLY" in all|icl|lm|chronos) ;; *) echo "--only must be icl, lm or chronos with --designs" >&2; exit 2 ;; esac
  if [[ $ONLY == all || $ONLY == icl ]]; then
    $PY scripts/icl_rank_experiment.py run --d 4 --device "$DEVICE" --jobs "$JOBS" --out "$out/icl_rank_v3"
    $PY scripts/icl_rank_experiment.py report --d 4 --figures "$out/icl_rank_v3" \
      | tee "$out/icl_report.txt"
  fi
  if [[ $ONLY == all || $ONLY == lm ]]; then
    $PY scripts/lm_experiment.py run --device "$DEVICE" --out "$out/lm_equal_flops"
    $PY scripts/lm_experiment.py report | tee "$out/lm_report.txt"
  fi
  if [[ $ONLY == all || $ONLY == chronos ]]; then
    $PY scripts/chronos_experiment.py run --device "$DEVICE" --out "$out/chronos_design"
    $PY scripts/chronos_experiment.py report | tee "$out/chronos_report.txt"
  fi
}

run_pilots() {
  local out=${REPRODUCE_OUT:-outputs/reproduce}/pilots
  mkdir -p "$out"
  rm -rf "$out/icl" "$out/lm" "$out/chronos"  # a pilot starts from scratch
  $PY scripts/icl_rank_experiment.py pilot --device "$DEVICE" --budget-s 170 --out "$out/icl"
  $PY scripts/lm_experiment.py pilot --device "$DEVICE" --budget-s 170 --out "$out/lm"
  $PY scripts/chronos_experiment.py pilot --device "$DEVICE" --budget-s 170 --out "$out/chronos"
}

if [[ $MODE == designs ]]; then run_designs; exit 0; fi
if [[ $MODE == pilots ]]; then run_pilots; exit 0; fi

case "$ONLY" in
  all) run_icl; run_clm; run_chronos ;;
  icl) run_icl ;;
  clm) run_clm ;;
  chronos) run_chronos ;;
  *) echo "--only must be icl, clm or chronos" >&2; exit 2 ;;
esac
exit 0
