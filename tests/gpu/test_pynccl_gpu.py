"""PyNcclCommunicator ops on real GPUs against torch references (needs 2 GPUs:
NCCL refuses two ranks on one device)."""

from __future__ import annotations

import pytest
from gpu_harness import gpu_count, run_spawned
from gpu_ranks import pynccl_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        gpu_count() < 2, reason=f"needs 2 CUDA GPUs; this machine has {gpu_count()}"
    ),
]


def test_every_pynccl_op_matches_the_reference():
    assert run_spawned(pynccl_ops, 2) == [[], []]
