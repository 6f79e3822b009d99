#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the default test suite.
#   bash scripts/test.sh                 # the default suite (-m "not slow", two workers); extra arguments go to pytest
#   bash scripts/test.sh --quick         # for development: the op, model, cache and patching tests that catch most
#                                        # regressions, without reloads, compiles and Chronos (~2-3 min on 2 cores)
#   bash scripts/test.sh --portability   # the model, op and cache tests once per CPU kernel set torch can
#                                        # dispatch to here: ATEN_CPU_CAPABILITY=default, avx2, and avx512 where
#                                        # /proc/cpuinfo lists avx512f (tolerances must hold on any x86 CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ "${1:-}" = "--quick" ]; then
  shift
  quick=(tests/test_mlr_ops.py tests/test_bilinear_ops.py tests/test_attention_contracts.py tests/test_gpt2_models.py
         tests/test_t5_models.py tests/test_model_contracts.py tests/test_cache_allocation.py
         tests/test_generation_cache.py tests/test_patching.py tests/test_decoder_patching.py)
  # the slowest tests of those files (remote-code reloads, compiles, Chronos pipelines, the CLI) run in the full suite
  exec python -m pytest -q -n 2 -m "not slow" -k "not remote and not compiled and not inductor and not chronos and not cli \
and not svd and not reload" "${quick[@]}" "$@"
fi
if [ "${1:-}" != "--portability" ]; then
  # two xdist workers where two cores are free to us (each test runs one torch thread): the suite in about half the
  # wall time; HF_STRUCTATTN_TEST_WORKERS=1 runs it in one process
  workers=${HF_STRUCTATTN_TEST_WORKERS:-$(python -c 'import os; print(min(2, len(os.sched_getaffinity(0))))')}
  if [ "$workers" -gt 1 ]; then
    exec python -m pytest -q -n "$workers" -m "not slow" "$@"
  fi
  exec python -m pytest -q -m "not slow" "$@"
fi
shift
capabilities=(default)
grep -qw avx2 /proc/cpuinfo 2>/dev/null && capabilities+=(avx2)
grep -qw avx512f /proc/cpuinfo 2>/dev/null && capabilities+=(avx512)
tests=(tests/test_mlr_ops.py tests/test_bilinear_ops.py tests/test_attention_contracts.py tests/test_gpt2_models.py
       tests/test_t5_models.py tests/test_model_contracts.py tests/test_remote_code.py tests/test_patching.py
       tests/test_generation_cache.py tests/test_decoder_patching.py)
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
