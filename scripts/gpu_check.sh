#!/usr/bin/env bash
# The GPU check of issue 22 in one command, on a CUDA machine, in under 8 minutes:
#   bash scripts/gpu_check.sh [--out outputs/gpu_check.md] [--parts tests attention training decode] [--budget-scale 1]
# 1. sets up .venv (scripts/setup.sh; a new .venv sees the system's packages, so a CUDA torch/triton installed there
#    is used and nothing but pip packages is downloaded; if pip cannot reach its index the check goes on with the
#    packages already there and the source tree on PYTHONPATH, and says so in the report);
# 2. runs benchmarks/gpu_check.py: the CUDA/Triton tests, MLR vs SDPA/FlashAttention (T = 1k..16k, bf16), a training
#    step of the GPT-2 family vs GPT2LMHeadModel (T = 4096), compiled static-cache decode MLR vs dense (batch 1, 16),
#    each part with its own time budget; a part that fails or times out is recorded and the next one runs;
# 3. prints the path of the one markdown report (default outputs/gpu_check.md).
# Without a CUDA GPU it prints one line and exits 0. More options: python benchmarks/gpu_check.py --help.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no CUDA GPU on this machine (nvidia-smi finds none); nothing to check."
  exit 0
fi
started=$(date +%s)
mkdir -p outputs
setup_log=outputs/gpu_check_setup.log
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv
  # python3 may itself be a virtual environment holding the CUDA torch (--system-site-packages only reaches the base
  # interpreter's): a .pth file makes its packages visible too, behind what setup.sh installs into .venv
  parent=$(python3 -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')
  if [ -n "$parent" ]; then
    .venv/bin/python -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/zz_gpu_check_parent_env.pth", "w").write(sys.argv[1] + "\n")' "$parent"
  fi
fi
# fail fast where pip's index is unreachable (an offline GPU machine), instead of retrying for minutes
if PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_RETRIES=0 PIP_DEFAULT_TIMEOUT=20 bash scripts/setup.sh >"$setup_log" 2>&1; then
  setup="scripts/setup.sh succeeded in $(( $(date +%s) - started )) s"
else
  setup="scripts/setup.sh FAILED after $(( $(date +%s) - started )) s (log: $setup_log: $(tail -1 "$setup_log" | cut -c1-200)); running with the packages already installed and the source tree on PYTHONPATH"
fi
echo "gpu_check: $setup"
. .venv/bin/activate
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python benchmarks/gpu_check.py --started "$started" --setup "$setup" --command "bash scripts/gpu_check.sh $*" "$@"
