#!/usr/bin/env bash
# The GPU check in one command, on an offline CUDA machine, within a time budget of 480 s, setup included
# (--total-budget; the parts share it out; not yet run on a GPU):
#   bash scripts/gpu_check.sh [--out outputs/gpu_check.md] [--parts tests attention training decode icl]
#                             [--budget-scale 1] [--total-budget 480]
#   bash scripts/gpu_check.sh --rehearse      # the same on this CPU machine, against the GPU image's packages
#
# 1. Finds what the machine's python3 (the image's, with its CUDA torch) lacks for hf_structattn
#    (scripts/gpu_env.py) and installs the carried wheels of .whl/ (built beforehand by scripts/gpu_wheels.sh
#    where PyPI is reachable) with `pip install --no-index --no-deps --target`, so the image's torch, triton and
#    nvidia-* packages are never touched; the target goes first on PYTHONPATH. With nothing missing and no .whl/ it
#    runs as it is; with .whl/ missing, a package missing and no index reachable it says so in one line and exits 3.
# 2. Runs benchmarks/gpu_check.py: (a) correctness on CUDA, (b) the op vs SDPA/flash at T = 1k..16k, (c) a training
#    step vs GPT2LMHeadModel at T = 4096, (d) decode eager and compiled, (e) the ICL pilot, each part with its own
#    time budget; the report (default outputs/gpu_check.md) starts with the versions actually used and is rewritten
#    after every part. The last line is `gpu_check: N/M parts passed`; exit 0 only when all passed.
# Without a CUDA GPU (and without --rehearse) it prints one line and exits 0.
#
# --rehearse builds (once, then reuses) a throwaway environment under the cache folder with the image's pure-Python
# packages at the image's versions (scripts/gpu_image.txt) and this machine's CPU torch, builds or reuses .whl/,
# then makes the package index unreachable (PIP_NO_INDEX=1, no pip configuration) for the rest of the run, installs
# .whl/ exactly as the GPU run does, and runs every part at toy size on the CPU (Triton under its interpreter). Its
# last line is `rehearsal: N/M parts passed` (exit 0 only then); its report is outputs/gpu_check_rehearsal.md.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
rehearse=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--rehearse" ]; then rehearse=1; else args+=("$arg"); fi
done
wheels=${GPU_CHECK_WHEELS:-.whl}
cache=${HF_STRUCTATTN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hf_structattn}
mkdir -p outputs

if [ "$rehearse" = 1 ]; then
  stamp=$( (cat scripts/gpu_image.txt; python3 --version) | sha256sum | cut -c1-12)
  venv="$cache/gpu-rehearsal-$stamp"
  if [ ! -f "$venv/.complete" ]; then
    echo "gpu_check: building the rehearsal environment $venv (the image's packages, this machine's CPU torch)"
    rm -rf "$venv"
    { python3 -m venv "$venv" &&
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" &&
      "$venv/bin/python" -m pip install -q --disable-pip-version-check -r scripts/gpu_image.txt; } \
      >outputs/gpu_rehearsal_env.log 2>&1 ||
      { echo "gpu_check: could not build the rehearsal environment: $(grep -m1 ERROR outputs/gpu_rehearsal_env.log ||
          tail -1 outputs/gpu_rehearsal_env.log) (log: outputs/gpu_rehearsal_env.log)"; exit 3; }
    touch "$venv/.complete"
  fi
  PY="$venv/bin/python"
  if ! bash scripts/gpu_wheels.sh --dest "$wheels" >outputs/gpu_wheels.log 2>&1; then
    echo "gpu_check: scripts/gpu_wheels.sh failed: $(tail -1 outputs/gpu_wheels.log)"; exit 3
  fi
  # from here on no index: what the run needs must come from the environment and the carried wheels
  unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL
  export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null TRITON_INTERPRET=1
  report=outputs/gpu_check_rehearsal.md
  site="$cache/gpu-rehearsal-site"
else
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU on this machine (nvidia-smi finds none); nothing to check."
    exit 0
  fi
  PY=${GPU_CHECK_PYTHON:-python3}
  report=outputs/gpu_check.md
  site=${GPU_CHECK_SITE:-/tmp/hf_structattn_gpu_site}
fi

step=$("$PY" scripts/gpu_env.py plan "$wheels") || { echo "gpu_check: scripts/gpu_env.py failed with $PY"; exit 3; }
if [ "$step" = "download" ]; then  # an online GPU machine without carried wheels: build them here
  bash scripts/gpu_wheels.sh --dest "$wheels" >outputs/gpu_wheels.log 2>&1 ||
    { echo "gpu_check: scripts/gpu_wheels.sh failed: $(tail -1 outputs/gpu_wheels.log)"; exit 3; }
  step=install
fi
case "$step" in
  ready)
    setup="nothing to install: $PY already meets every requirement of the check" ;;
  install)
    rm -rf "$site"
    if ! bash scripts/offline_install.sh "$wheels" "$site" "$PY" >outputs/gpu_check_install.log 2>&1; then
      echo "gpu_check: installing $wheels into $site failed: $(tail -1 outputs/gpu_check_install.log)"; exit 3
    fi
    setup="installed $(cd "$wheels" && ls -- *.whl | paste -sd' ') from $wheels into $site (pip --no-index --no-deps --target), first on PYTHONPATH"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;;
  *)
    echo "gpu_check: $step"; exit 3 ;;
esac
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! missing=$("$PY" scripts/gpu_env.py needs); then
  echo "gpu_check: still missing after setup: $(echo "$missing" | paste -sd';')"; exit 3
fi
setup="$setup; $(( $(date +%s) - started )) s"
echo "gpu_check: $setup"
if [ "$rehearse" = 1 ]; then
  exec "$PY" benchmarks/gpu_check.py --rehearse --out "$report" --budget-scale 8 --total-budget 4800 \
    --started "$started" --setup "$setup" --command "bash scripts/gpu_check.sh --rehearse ${args[*]}" "${args[@]}"
fi
exec "$PY" benchmarks/gpu_check.py --out "$report" --started "$started" --setup "$setup" \
  --command "bash scripts/gpu_check.sh ${args[*]}" "${args[@]}"
