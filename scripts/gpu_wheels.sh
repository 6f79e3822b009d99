#!/usr/bin/env bash
# Downloads the wheels that the offline GPU image lacks (scripts/gpu_wheels.txt) into .whl/, for Python 3.12 on
# manylinux x86_64, and prints each wheel with its size. Run it where PyPI is reachable; scripts/gpu_check.sh installs
# .whl/ on the GPU machine without an index. Wheels already there are reused; wheels not in the list are removed.
#   bash scripts/gpu_wheels.sh [--dest DIR]      (default .whl; at most 40 MiB in all)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) dest=${2:?--dest needs a folder}; shift 2 ;;
    *) echo "gpu_wheels: unknown argument $1 (expected --dest DIR)" >&2; exit 2 ;;
  esac
done
limit_bytes=$((40 * 1024 * 1024))
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/gpu_wheels.txt | grep -v '^$')
for requirement in "${wanted[@]}"; do
  name=${requirement%%[=<>!~]*}
  case "$(echo "$name" | tr 'A-Z_' 'a-z-')" in
    torch|triton|nvidia-*) echo "gpu_wheels: refusing $requirement: the image's own $name must stay in charge" >&2; exit 2 ;;
  esac
  if [[ "$requirement" != *==* ]]; then
    echo "gpu_wheels: $requirement in scripts/gpu_wheels.txt must pin one version (NAME==VERSION)" >&2; exit 2
  fi
done
mkdir -p "$dest"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$dest" "${wanted[@]}"
# keep exactly one wheel per listed requirement: older versions left from earlier lists would stop the install
keep=()
for requirement in "${wanted[@]}"; do
  name=$(echo "${requirement%%==*}" | tr 'A-Z-' 'a-z_')
  version=${requirement#*==}
  match=$(cd "$dest" && ls | awk -v n="$name" -v v="$version" 'tolower($0) ~ "^" n "-" v "-.*\\.whl$"' | head -1)
  [ -n "$match" ] || { echo "gpu_wheels: no wheel for $requirement in $dest" >&2; exit 1; }
  keep+=("$match")
done
for file in "$dest"/*; do
  base=$(basename "$file")
  [[ " ${keep[*]} " == *" $base "* ]] || { echo "gpu_wheels: removing $base (not in scripts/gpu_wheels.txt)"; rm -rf "$file"; }
done
total=0
for wheel in "${keep[@]}"; do
  size=$(stat -c %s "$dest/$wheel")
  total=$((total + size))
  awk -v s="$size" -v w="$wheel" 'BEGIN { printf "%8.1f MiB  %s\n", s / 1048576, w }'
done
awk -v s="$total" -v d="$dest" 'BEGIN { printf "%8.1f MiB  in all (%s, limit 40 MiB)\n", s / 1048576, d }'
if [ "$total" -gt "$limit_bytes" ]; then
  echo "gpu_wheels: $dest holds $total bytes, over the 40 MiB that a device call may carry with the tree" >&2
  exit 1
fi
