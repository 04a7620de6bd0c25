#!/usr/bin/env bash
# Create .venv (or $GROUPCOORD_VENV) and install groupcoord with the given extras.
# torch is pinned to 2.13.0: a CPU build that pip finds on this kind of machine;
# an unpinned torch would download a multi-gigabyte CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${GROUPCOORD_VENV:-.venv}
extras=${1:-test}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "torch==2.13.0" -e ".[$extras]"
