"""EP dispatch/combine over a CudaCommunicator (one GPU: a world of one rank)."""

from __future__ import annotations

import pytest
from gpu_harness import gpu_count, run_spawned
from gpu_ranks import ep_world1

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU; this machine has none"),
]


def test_both_managers_dispatch_and_combine_cuda_tensors_at_world_1():
    # Until 2026-11-29 the managers' token-count exchange made its tensor on the
    # CPU, which a CUDA communicator refuses ("input_ is on cpu but this group
    # works on cuda:0"): found by reading, not run here (no GPU in that session).
    assert run_spawned(ep_world1, 1) == [[]]
