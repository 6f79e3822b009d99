#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package into it, saying what it does and how long each step took.
#   bash scripts/setup.sh           # what the main job (scripts/run.sh) runs: the package with the recipes' libraries
#                                   # (accelerate, datasets, evaluate, ...) and matplotlib (".[recipes,plots]")
#   bash scripts/setup.sh --test    # what the tests need: ".[test]" (all of the above, pytest, peft, triton,
#                                   # chronos-forecasting, statsmodels, ...); scripts/test.sh calls this
# A second run with nothing changed (same pyproject.toml, same Python) installs nothing and takes a few seconds.
# torch==2.13.0 is installed first when no torch is present: on the project machines it is the CPU build from local
# disk (any other version would download a multi-GB CUDA build); pyproject only asks for a range. On CUDA, install
# your torch build into .venv first.
# Every other package is installed at the version scripts/constraints.txt pins (the set the whole suite last passed
# with); scripts/test_range.sh tries the newest and lowest transformers / accelerate the ranges admit.
# Nothing else is fetched here: the test-only downloads (transformers' test sources, the GPU check's wheels) are
# scripts/test.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=recipes,plots
case "${1:-}" in
  "") ;;
  --test) extras=test ;;
  *) echo "setup.sh: unknown argument $1 (expected nothing or --test)" >&2; exit 2 ;;
esac
started=$(date +%s)
say() { echo "[setup +$(( $(date +%s) - started ))s] $*"; }
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
else
  say "using the virtual environment .venv ($(.venv/bin/python --version 2>&1))"
fi
. .venv/bin/activate
# the editable install points at this checkout, so only pyproject.toml (dependencies, entry points) can make a new
# install necessary; the stamp records which extras were installed (".[test]" includes ".[recipes,plots]")
stamp=$( (cat pyproject.toml scripts/constraints.txt; python --version; pwd) | sha256sum | cut -c1-16)
installed() { [ "$(cat ".venv/.hf_structattn_installed-$1" 2>/dev/null)" = "$stamp" ]; }
if { installed "$extras" || installed test; } &&
   say "checking that the installed package imports (a few seconds; longer on loaded cores) ..." &&
   python -c "import hf_structattn" >/dev/null 2>&1; then
  say "hf_structattn with its [$extras] extras is already installed; nothing to do"
  exit 0
fi
python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
if python -c "import torch" 2>/dev/null; then
  say "torch $(python -c 'import torch; print(torch.__version__)') is already installed"
else
  say "installing torch 2.13.0 (the CPU build) ..."
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  say "torch installed"
fi
say "installing hf_structattn (editable) with its [$extras] extras and their dependencies at the known-good versions" \
    "of scripts/constraints.txt (log: .venv/install.log) ..."
# setuptools' editable-install banner goes to the log; errors still reach the terminal through set -e's exit
python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e ".[$extras]" >.venv/install.log 2>&1 ||
  { cat .venv/install.log >&2; exit 1; }
echo "$stamp" >".venv/.hf_structattn_installed-$extras"
say "hf_structattn installed: transformers $(python -c 'import transformers; print(transformers.__version__)'), accelerate $(python -c 'import accelerate; print(accelerate.__version__)')"
