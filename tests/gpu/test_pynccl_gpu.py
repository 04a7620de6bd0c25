"""PyNcclCommunicator on real GPUs.

On one GPU: every op of the ctypes table at world 1 (a wrong argtype, count or
dtype enum crashes or corrupts here), the caller's stream, grouped calls and a
CUDA-graph capture; and what NCCL does with two ranks on one device (2.28
refuses: "Duplicate GPU detected"; both ranks must disable with one reason).
Multi-rank ops against references need one GPU per rank.
"""

from __future__ import annotations

import pytest
from gpu_harness import gpu_count, run_spawned
from gpu_ranks import pynccl_ops, pynccl_shared_gpu, pynccl_world1

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU; this machine has none")


@needs_gpu
def test_every_op_at_world_1_through_the_ctypes_table():
    (out,) = run_spawned(pynccl_world1, 1)
    assert out["failures"] == [], out["failures"]
    assert "torch.bfloat16" in out["dtypes"]


@needs_gpu
def test_two_ranks_on_one_gpu_work_or_disable_together():
    results = run_spawned(pynccl_shared_gpu, 2)
    assert results[0]["available"] == results[1]["available"], results
    if results[0]["available"]:
        assert all(r["ok"] for r in results), results
    else:
        assert all("Duplicate GPU" in r["reason"] for r in results), results


@pytest.mark.skipif(gpu_count() < 2, reason=f"needs 2 CUDA GPUs; this machine has {gpu_count()}")
def test_every_pynccl_op_matches_the_reference():
    assert run_spawned(pynccl_ops, 2) == [[], []]
