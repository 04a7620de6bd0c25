#!/usr/bin/env bash
# Prove the CUDA path on a GPU machine that has torch but no network:
#   bash scripts/gpu_wheels.sh     # beforehand, where the registry is reachable
#   bash scripts/gpu_check.sh      # on the GPU machine, from the repository root
# Uses the python that holds torch (never installs one), installs groupcoord
# with --no-deps (pyzmq/msgspec from .whl/ when the image lacks them), prints
# `python -m coordinator info`, runs tests/gpu and the CUDA all-reduce
# benchmark, and ends with one summary line. Exit status 0 only if every GPU
# test passed (or skipped with its reason) and the benchmark ran.
# Logs go to $GROUPCOORD_GPU_LOGS (default: gpu_check_logs/, git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
wheels=${GROUPCOORD_WHEELS:-.whl}
site=${GROUPCOORD_GPU_SITE:-/tmp/groupcoord-gpu-site}
logs=${GROUPCOORD_GPU_LOGS:-gpu_check_logs}
start=$(date +%s)
mkdir -p "$logs" "$site"
export PYTHONUNBUFFERED=1 PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

fail() { echo "gpu_check: FAIL - $*"; exit 1; }

"$python" -c "import torch" 2>/dev/null || fail "$python has no torch"
"$python" -c "import torch, sys; sys.exit(torch.cuda.device_count() < 1)" \
  || fail "torch sees no CUDA device"
pip_offline=(-m pip install --quiet --disable-pip-version-check --no-index --no-deps
  --no-compile --no-cache-dir --upgrade --target "$site")
missing=$("$python" - <<'PY'
import importlib.util
print(" ".join(m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  compgen -G "$wheels/*.whl" >/dev/null \
    || fail "missing $missing and no wheels in $wheels (run scripts/gpu_wheels.sh first)"
  "$python" "${pip_offline[@]}" "$wheels"/*.whl || fail "could not install $wheels/*.whl"
fi
# groupcoord itself, without its dependencies and without build isolation (no network).
"$python" "${pip_offline[@]}" --no-build-isolation . >"$logs/install.log" 2>&1 \
  || fail "pip install --no-deps . failed (see $logs/install.log)"
(cd /tmp && "$python" -c "import coordinator, device_communicators, shm_broadcast") \
  || fail "the installed package does not import"

device=$("$python" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'{torch.cuda.device_count()} x {p.name} (sm_{p.major}{p.minor}), torch {torch.__version__}')")
echo "== $device"
echo "== python -m coordinator info"
"$python" -m coordinator info 2>&1 | tee "$logs/info.txt"

echo "== tests/gpu"
"$python" -m pytest tests/gpu -p no:cacheprovider -q -rs --timeout 300 2>&1 | tee "$logs/tests.txt"
tests_rc=${PIPESTATUS[0]}
tests_summary=$(tail -n 1 "$logs/tests.txt" | tr -d '=' | sed 's/^ *//')

echo "== this machine's CUDA toolchain: kernels for sm_80/sm_90 (NVRTC, nvcc), the NCCL binding"
"$python" -m pytest tests/test_custom_all_reduce_compile.py tests/test_pynccl_wrapper.py \
  tests/test_pynccl_mock.py -p no:cacheprovider -q -rs --timeout 300 2>&1 | tee "$logs/toolchain.txt"
toolchain_rc=${PIPESTATUS[0]}
toolchain_summary=$(tail -n 1 "$logs/toolchain.txt" | tr -d '=' | sed 's/^ *//')

echo "== benchmarks/bench_cuda_allreduce.py (ranks time-sliced on one GPU)"
worlds=${GROUPCOORD_GPU_BENCH_WORLDS:-1,2,4}
"$python" benchmarks/bench_cuda_allreduce.py --worlds "$worlds" \
  --json "$logs/cuda_allreduce.json" 2>&1 | tee "$logs/bench.txt"
bench_rc=${PIPESTATUS[0]}

# Ranks sharing a GPU run concurrently only under MPS; measure that too where it starts.
mps_note="MPS not available"
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/groupcoord-mps CUDA_MPS_LOG_DIRECTORY=/tmp/groupcoord-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    echo "== benchmarks/bench_cuda_allreduce.py under MPS (ranks run concurrently)"
    timeout 300 "$python" benchmarks/bench_cuda_allreduce.py --worlds "${worlds#1,}" \
      --json "$logs/cuda_allreduce_mps.json" 2>&1 | tee "$logs/bench_mps.txt"
    mps_rc=${PIPESTATUS[0]}
    echo quit | nvidia-cuda-mps-control
    mps_note="MPS bench exit $mps_rc"
  else
    mps_note="MPS daemon did not start"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

elapsed=$(($(date +%s) - start))
status=PASS
[ "$tests_rc" -eq 0 ] && [ "$toolchain_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] || status=FAIL
echo "gpu_check: $status - tests/gpu: $tests_summary; toolchain: $toolchain_summary;" \
  "bench exit $bench_rc; $mps_note;" \
  "$device; ${elapsed}s"
[ "$status" = PASS ]
