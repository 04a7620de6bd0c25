#!/usr/bin/env bash
# Set up from scratch (idempotent) and run the main job.
# Extra arguments go to the demo, e.g. `bash scripts/demo.sh --tp 2 --pp 2 --ep`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,bench"
venv=${GROUPCOORD_VENV:-.venv}
exec "$venv/bin/python" -m coordinator demo "$@"
