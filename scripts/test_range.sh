#!/usr/bin/env bash
# The focused tests (generation, caches, conformance with transformers' own test mixins, the docs' snippets, the
# overrides' signatures) on the newest transformers and accelerate the package index serves within pyproject.toml's
# ranges, and on the lowest the ranges admit, each where it differs from the pinned set in .venv
# (scripts/constraints.txt; scripts/dependency_range.py picks the versions). scripts/test.sh runs it after the
# default suite; alone: bash scripts/test_range.sh (after bash scripts/setup.sh --test).
# Each version set gets its own environment in .venv-range/LABEL: transformers and accelerate (with whatever they
# need that .venv lacks) installed over .venv's packages, which it sees through a .pth file (torch is not copied).
# A failure says so in one line naming the versions; the exit status is 1 if any set failed.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
focused=(tests/test_generation_cache.py tests/test_rollback.py tests/test_mlr_cached.py tests/test_decode_reliability.py
         tests/test_cache_allocation.py tests/test_transformers_overrides.py tests/test_docs_snippets.py tests/conformance)
if ! sets=$(python scripts/dependency_range.py); then
  echo "range check: FAILED, could not tell which versions to test (see above)"
  exit 1
fi
if [ -z "$sets" ]; then
  echo "range check: the newest and lowest transformers / accelerate in range are the pinned ones" \
       "($(python -c 'import transformers, accelerate; print(f"transformers {transformers.__version__}, accelerate {accelerate.__version__}")')): nothing more to run"
  exit 0
fi
base=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
workers=${HF_STRUCTATTN_TEST_WORKERS:-$(python -c 'import os; print(min(2, len(os.sched_getaffinity(0))))')}
failed=()
while read -r label pins; do
  env=.venv-range/$label
  if [ ! -x "$env/bin/python" ]; then
    python -m venv "$env"
  fi
  # .venv's packages after the range environment's own (addsitedir also runs .venv's .pth files: the editable install)
  echo "import site; site.addsitedir('$base')" >"$($env/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_project_venv.pth"
  echo "== $label: $pins (environment $env)"
  # shellcheck disable=SC2086
  if ! "$env/bin/python" -m pip install -q --disable-pip-version-check $pins >"$env/install.log" 2>&1; then
    tail -5 "$env/install.log"
    echo "range check: FAILED to install the $label versions $pins (log: $env/install.log)"
    failed+=("$label"); continue
  fi
  "$env/bin/python" tests/conformance/upstream.py >/dev/null || true  # transformers' test files of that version
  if ! "$env/bin/python" -m pytest -q -p no:cacheprovider -n "$workers" -m "not slow" "${focused[@]}"; then
    echo "range check: FAILED on the $label versions $pins"
    failed+=("$label")
  else
    echo "range check: passed on the $label versions $pins"
  fi
done <<<"$sets"
[ ${#failed[@]} -eq 0 ]
