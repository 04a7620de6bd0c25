"""Custom all-reduce on a real GPU: eager and under CUDA-graph capture/replay.

Two processes share one GPU through CUDA IPC when the machine has only one,
so these run on any machine with a GPU. Skipped (with the reason) without one.
"""

from __future__ import annotations

import pytest
from gpu_harness import gpu_count, run_spawned
from gpu_ranks import MiB, custom_ar_eager, custom_ar_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU; this machine has none"),
]


def skip_if_disabled(results: list) -> None:
    # Ranks agree on enablement, so either all of them report it or none.
    if isinstance(results[0], str):
        pytest.skip(results[0])


CASES = [
    (dtype, numel, algo)
    for dtype in ("float32", "float16", "bfloat16")
    for numel, algo in (
        (1024, "auto"),  # one-shot
        (3 * MiB // 4, "auto"),  # two-shot for fp16/bf16 (1.5 MiB), fp32 3 MiB
        (8 * 1000, "twoshot"),  # two-shot with a remainder for the last rank
        (3 * MiB // 4, "oneshot"),  # pinned one-shot at a two-shot size
    )
]


@pytest.mark.parametrize("world", [2, 4])
def test_custom_all_reduce_eager_matches_rank_order_fp32_sum(world):
    if world > 2 and gpu_count() < world:
        pytest.skip(f"world {world} needs {world} GPUs (IPC on one GPU is only tested with 2)")
    results = run_spawned(custom_ar_eager, world, CASES)
    skip_if_disabled(results)
    assert results == [[]] * world, results


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_custom_all_reduce_under_graph_capture_and_replay(dtype):
    results = run_spawned(custom_ar_graph, 2, [1024, 64 * 1024, 512 * 1024], dtype)
    skip_if_disabled(results)
    assert results == [[], []], results
