#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the default test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -m "not slow" "$@"
