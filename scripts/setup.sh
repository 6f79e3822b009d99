#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package with its test extras; a second run with nothing changed
# (same pyproject.toml, same Python) installs nothing and takes a few seconds.
# torch==2.13.0 is installed first: on the project machines it is the CPU build from local disk
# (any other version would download a multi-GB CUDA build); pyproject only asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
cache=${HF_STRUCTATTN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hf_structattn}
# the editable install points at this checkout, so only pyproject.toml (dependencies, entry points) can make a new
# install necessary
stamp=$( (cat pyproject.toml; python --version; pwd) | sha256sum | cut -c1-16)
if [ "$(cat .venv/.hf_structattn_installed 2>/dev/null)" != "$stamp" ] ||
   ! python -c "import hf_structattn" >/dev/null 2>&1; then
  python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
  # setuptools' editable-install banner goes to the log; errors still reach the terminal through set -e's exit
  python -m pip install -q --disable-pip-version-check -e ".[test]" >.venv/install.log 2>&1 ||
    { cat .venv/install.log >&2; exit 1; }
  echo "$stamp" >.venv/.hf_structattn_installed
fi
# transformers' own test mixins for tests/conformance: the installed version's sdist, fetched once into a cache
# outside the repository (tests/conformance/upstream.py); without it the conformance tests fail at collection
python tests/conformance/upstream.py >/dev/null ||
  echo "WARNING: could not fetch transformers' test files; tests/conformance will fail (see the error above)" >&2
# the wheels the GPU check carries (scripts/gpu_wheels.txt), fetched once into the same cache: the test of their
# offline install uses them
if [ ! -f "$cache/gpu-wheels/.complete-$(sha256sum scripts/gpu_wheels.txt | cut -c1-12)" ]; then
  rm -rf "$cache/gpu-wheels"
  if bash scripts/gpu_wheels.sh --dest "$cache/gpu-wheels" >/dev/null; then
    touch "$cache/gpu-wheels/.complete-$(sha256sum scripts/gpu_wheels.txt | cut -c1-12)"
  else
    echo "WARNING: could not fetch the GPU check's wheels; tests/test_gpu_check.py's install test will fail" >&2
  fi
fi
