#!/usr/bin/env bash
# Installs every wheel of WHEEL_DIR into TARGET with no package index and no dependency resolution, so that nothing
# already installed (the GPU image's torch, triton, nvidia-* packages) can be replaced; put TARGET first on
# PYTHONPATH to use it. scripts/gpu_check.sh runs it on the GPU machine and in its CPU rehearsal.
#   bash scripts/offline_install.sh WHEEL_DIR TARGET [PYTHON]
set -euo pipefail
wheel_dir=${1:?usage: offline_install.sh WHEEL_DIR TARGET [PYTHON]}
target=${2:?usage: offline_install.sh WHEEL_DIR TARGET [PYTHON]}
py=${3:-python3}
shopt -s nullglob
wheels=("$wheel_dir"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "offline_install: no wheels in $wheel_dir" >&2
  exit 2
fi
PIP_NO_INDEX=1 "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
  --target "$target" "${wheels[@]}"
echo "offline_install: ${#wheels[@]} wheel(s) from $wheel_dir into $target"
