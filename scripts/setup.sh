#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package with its test extras.
# torch==2.13.0 is installed first: on the project machines it is the CPU build from local disk
# (any other version would download a multi-GB CUDA build); pyproject only asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# transformers' own test mixins for tests/conformance: the installed version's sdist, fetched once into a cache
# outside the repository (tests/conformance/upstream.py); without it the conformance tests fail at collection
python tests/conformance/upstream.py >/dev/null ||
  echo "WARNING: could not fetch transformers' test files; tests/conformance will fail (see the error above)" >&2
