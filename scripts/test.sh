#!/usr/bin/env bash
# Set up from scratch (idempotent) and run lint, type checks and the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh --long`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,cuda,bench"
venv=${GROUPCOORD_VENV:-.venv}
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check --quiet coordinator device_communicators shm_broadcast tests benchmarks
"$venv/bin/mypy"
"$venv/bin/python" -m pytest -q "$@"
