#!/usr/bin/env bash
# Run on a machine with the package registry, before scripts/gpu_check.sh is
# taken to a GPU machine with no network: downloads the runtime dependencies
# that such a machine's image may lack (pyzmq, msgspec) as CPython 3.12
# manylinux x86-64 wheels into .whl/ (git-ignored).
#   bash scripts/gpu_wheels.sh            # into .whl/
#   GROUPCOORD_WHEELS=dir bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${GROUPCOORD_WHEELS:-.whl}
python=${PYTHON:-python3}
mkdir -p "$dest"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest" \
  "pyzmq>=25" "msgspec>=0.18"
ls -1 "$dest"
