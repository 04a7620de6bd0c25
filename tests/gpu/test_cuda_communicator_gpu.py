"""CudaCommunicator on real GPUs: back-end choice, every op, graph capture (needs 2 GPUs)."""

from __future__ import annotations

import pytest
from gpu_harness import gpu_count, run_spawned
from gpu_ranks import cuda_communicator_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        gpu_count() < 2, reason=f"needs 2 CUDA GPUs; this machine has {gpu_count()}"
    ),
]


def test_cuda_communicator_picks_back_ends_and_computes_exactly():
    for out in run_spawned(cuda_communicator_ops, 2):
        assert out["failures"] == [], out["failures"]
        assert out["chosen"] == {
            "small bf16": "custom_all_reduce",
            "8 MiB bf16": "pynccl",
            "int64": "pynccl",
        }, out["describe"]
