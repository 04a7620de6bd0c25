"""GroupCoordinator on CUDA: world 1 through parallel_state, and several ranks
sharing one GPU (custom all-reduce only: NCCL refuses two ranks on a device)."""

from __future__ import annotations

import pytest
from gpu_harness import gpu_count, run_spawned
from gpu_ranks import (
    coordinator_cuda_settings_differ,
    coordinator_shared_gpu,
    coordinator_world1,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU; this machine has none"),
]


def test_world_1_every_op_and_graph_capture():
    assert run_spawned(coordinator_world1, 1) == [[]]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu_all_reduce_eager_and_in_a_graph(world):
    results = run_spawned(coordinator_shared_gpu, world)
    for out in results:
        assert out["failures"] == [], out["failures"]
        if out["describe"]["custom_all_reduce"] != "enabled":
            pytest.skip(f"custom all-reduce disabled here: {out['describe']}")


def test_ranks_whose_cuda_settings_differ_raise_naming_both_and_can_agree_after():
    # RELIABILITY row 66: a CUDA group's meeting carries the custom all-reduce's
    # and PyNCCL's settings; one rank with the custom all-reduce off would take
    # another path at its first all_reduce.
    for rank, out in enumerate(run_spawned(coordinator_cuda_settings_differ, 2)):
        refused = out["refused"]
        assert refused.startswith("DesyncError"), (rank, refused)
        assert "GROUPCOORD_DISABLE_CUSTOM_ALL_REDUCE=False" in refused, refused
        assert "GROUPCOORD_DISABLE_CUSTOM_ALL_REDUCE=True" in refused, refused
        assert out["failures"] == [], out["failures"]
