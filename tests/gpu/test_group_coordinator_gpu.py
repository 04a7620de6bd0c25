"""GroupCoordinator on CUDA: world 1 through parallel_state, and several ranks
sharing one GPU (custom all-reduce only: NCCL refuses two ranks on a device)."""

from __future__ import annotations

import pytest
from gpu_harness import gpu_count, run_spawned
from gpu_ranks import coordinator_shared_gpu, coordinator_world1

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
