#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the default test suite.
#   bash scripts/test.sh                 # the default suite (-m "not slow", two workers); extra arguments go to pytest
#   bash scripts/test.sh --quick         # for development: the op, model, cache and patching tests that catch most
#                                        # regressions, without reloads, compiles and Chronos (41 s on 2 cores, README)
#   bash scripts/test.sh --portability   # the model, op and cache tests once per CPU kernel set torch can
#                                        # dispatch to here: ATEN_CPU_CAPABILITY=default, avx2, and avx512 where
#                                        # /proc/cpuinfo lists avx512f (tolerances must hold on any x86 CPU)
# The default suite also fetches, once, into a cache outside the repository (~/.cache/hf_structattn, or
# $HF_STRUCTATTN_CACHE): transformers' own test files for tests/conformance (tests/conformance/upstream.py) and the
# wheels the GPU check carries (scripts/gpu_wheels.sh; tests/test_gpu_check.py installs them offline). Both need the
# network the first time; the main job (scripts/run.sh) needs neither.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
say() { echo "[test +$(( $(date +%s) - started ))s] $*"; }
bash scripts/setup.sh --test
. .venv/bin/activate
fetch_test_sources() {
  local where
  say "transformers' own test files for tests/conformance (fetched once) ..."
  if where=$(python tests/conformance/upstream.py); then
    say "transformers' test files: $where"
  else
    echo "WARNING: could not fetch transformers' test files; tests/conformance will fail (see the error above)" >&2
  fi
  local cache=${HF_STRUCTATTN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hf_structattn}
  local complete="$cache/gpu-wheels/.complete-$(sha256sum scripts/gpu_wheels.txt | cut -c1-12)"
  if [ -f "$complete" ]; then
    say "the GPU check's wheels (scripts/gpu_wheels.txt): already in $cache/gpu-wheels"
  else
    say "fetching the GPU check's wheels (scripts/gpu_wheels.txt) into $cache/gpu-wheels ..."
    rm -rf "$cache/gpu-wheels"
    if bash scripts/gpu_wheels.sh --dest "$cache/gpu-wheels" >/dev/null; then
      touch "$complete"
    else
      echo "WARNING: could not fetch the GPU check's wheels; tests/test_gpu_check.py's install test will fail" >&2
    fi
  fi
}
if [ "${1:-}" = "--quick" ]; then
  shift
  quick=(tests/test_mlr_ops.py tests/test_bilinear_ops.py tests/test_attention_contracts.py tests/test_gpt2_models.py
         tests/test_t5_models.py tests/test_model_contracts.py tests/test_cache_allocation.py
         tests/test_generation_cache.py tests/test_mlr_cached.py tests/test_decode_reliability.py tests/test_patching.py
         tests/test_decoder_patching.py)
  say "running the quick tier ..."
  # the slowest tests of those files (remote-code reloads, compiles, Chronos pipelines, the CLI) run in the full suite
  exec python -m pytest -q -n 2 -m "not slow" -k "not remote and not compiled and not inductor and not chronos and not cli \
and not svd and not reload" "${quick[@]}" "$@"
fi
if [ "${1:-}" != "--portability" ]; then
  fetch_test_sources
  # two xdist workers where two cores are free to us (each test runs one torch thread): the suite in about half the
  # wall time; HF_STRUCTATTN_TEST_WORKERS=1 runs it in one process
  workers=${HF_STRUCTATTN_TEST_WORKERS:-$(python -c 'import os; print(min(2, len(os.sched_getaffinity(0))))')}
  if [ "$workers" -gt 1 ]; then
    say "running pytest -m 'not slow' on $workers workers ..."
    exec python -m pytest -q -n "$workers" -m "not slow" "$@"
  fi
  say "running pytest -m 'not slow' in one process ..."
  exec python -m pytest -q -m "not slow" "$@"
fi
shift
capabilities=(default)
grep -qw avx2 /proc/cpuinfo 2>/dev/null && capabilities+=(avx2)
grep -qw avx512f /proc/cpuinfo 2>/dev/null && capabilities+=(avx512)
tests=(tests/test_mlr_ops.py tests/test_bilinear_ops.py tests/test_attention_contracts.py tests/test_gpt2_models.py
       tests/test_t5_models.py tests/test_model_contracts.py tests/test_remote_code.py tests/test_patching.py
       tests/test_generation_cache.py tests/test_mlr_cached.py tests/test_decode_reliability.py
       tests/test_decoder_patching.py tests/test_batched_runs.py)
failed=()
for capability in "${capabilities[@]}"; do
  echo "== ATEN_CPU_CAPABILITY=$capability (torch dispatches to" \
       "$(ATEN_CPU_CAPABILITY=$capability python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())'))"
  ATEN_CPU_CAPABILITY=$capability python -m pytest -q -m "not slow" "${tests[@]}" "$@" || failed+=("$capability")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "portability: FAILED under ATEN_CPU_CAPABILITY=${failed[*]}"
  exit 1
fi
echo "portability: passed under ATEN_CPU_CAPABILITY=${capabilities[*]}"
