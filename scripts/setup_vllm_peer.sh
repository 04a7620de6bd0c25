#!/usr/bin/env bash
# Install vLLM 0.33 into the venv as a benchmark peer: bench_mq.py then runs
# vLLM's MessageQueue beside ours in the same ranks ("vllm msgs/s", "vs vllm").
# --no-deps: vLLM's requirements pin torch 2.14 and CUDA packages (gigabytes);
# only its message queue module is imported, which needs torch (2.13 here),
# pyzmq and the four small packages below. The wheel is about 340 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${GROUPCOORD_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  bash scripts/setup.sh "test,bench"
fi
echo "# pip may list vLLM requirements that are not installed: the peer needs none of them"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "vllm==0.33.0"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check packaging psutil urllib3 regex
VLLM_LOGGING_LEVEL=WARNING "$venv/bin/python" -c \
  "from vllm.distributed.device_communicators.shm_broadcast import MessageQueue; print('vLLM peer ready:', MessageQueue.__module__)"
