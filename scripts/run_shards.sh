#!/usr/bin/env bash
# Run science shards one after another in one process at a time (one core), committing after each: the shard's
# results folder, its log, and docs/results.md's status table regenerated (scripts/results_status.py --write; the
# docs test fails when the table and the committed results disagree). Each item is EXPERIMENT:SHARD:
#   bash scripts/run_shards.sh icl:r1 icl:r2 icl:r4          # the decisive ICL design (results/icl_rank/decisive_d4)
#   bash scripts/run_shards.sh lm:g1 lm:g2 chronos:g1         # the CPU designs (results/lm_cpu, results/chronos_cpu)
# A shard that stops (its CPU budget, a kill) is resumable: rerunning the same item continues from its checkpoint.
# Start it with nohup in the background; one chain per core at most. DEADLINE (anything `date -d` reads, e.g.
# DEADLINE=08:00) gives each shard --budget-s up to that moment, so that it stops, writes its record and is committed
# before a session ends; a shard that would get under 5 minutes is not started.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}  # the project venv when there is one
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
for item in "$@"; do
  experiment=${item%%:*}
  shard=${item#*:}
  case $experiment in
    icl) command=(scripts/icl_rank_experiment.py shard "$shard"); folder=results/icl_rank/decisive_d4
         figure=docs/results/icl_rank_decisive ;;
    lm | chronos) command=(scripts/${experiment}_experiment.py shard "$shard" --design cpu); folder=results/${experiment}_cpu
         figure= ;;
    *) echo "run_shards.sh: experiment '$experiment' in '$item' is not one of icl, lm, chronos" >&2; exit 2 ;;
  esac
  if [ -n "${DEADLINE:-}" ]; then
    left=$(( $(date -d "$DEADLINE" +%s) - $(date +%s) ))
    if [ $left -lt 300 ]; then echo "run_shards.sh: under 5 minutes to DEADLINE=$DEADLINE; $item not started" >&2; exit 0; fi
    command+=(--budget-s "$left")
  fi
  mkdir -p "$folder/logs"
  log=$folder/logs/$shard.log
  echo "[$(date -u +%FT%TZ)] shard $shard start" >> "$log"
  "$python" "${command[@]}" >> "$log" 2>&1
  status=$?
  echo "[$(date -u +%FT%TZ)] shard $shard exit $status" >> "$log"
  "$python" scripts/results_status.py --write >> "$log" 2>&1
  [ -n "$figure" ] && "$python" scripts/icl_rank_experiment.py report >> "$log" 2>&1  # redraws the figure
  for attempt in 1 2 3 4 5; do  # another chain may be committing at the same moment
    git add "$folder" docs/results.md $figure &&
      git commit -q -m "results: $experiment shard $shard (exit $status), CPU, $cpu" -- "$folder" docs/results.md $figure && break
    sleep 7
  done
  [ $status -ne 0 ] && exit $status
done
