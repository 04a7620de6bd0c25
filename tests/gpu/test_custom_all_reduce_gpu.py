"""Custom all-reduce on a real GPU: eager and under CUDA-graph capture/replay.

Ranks share the machine's GPUs through CUDA IPC (rank r on GPU r mod count),
so 2, 4 and 8 ranks run on a single GPU. Results are compared bit for bit with
a host-side fp32 rank-order sum, which also makes them identical across ranks.
Skipped (with the reason) without a GPU.
"""

from __future__ import annotations

import pytest
from gpu_harness import gpu_count, run_spawned
from gpu_ranks import MiB, custom_ar_eager, custom_ar_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU; this machine has none"),
]

MAX_BYTES = 8 * MiB  # the default custom_all_reduce_max_bytes; the limit is exclusive
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def skip_if_disabled(results: list) -> None:
    # Ranks agree on enablement, so either all of them report it or none.
    if isinstance(results[0], str):
        pytest.skip(results[0])


def cases(dtype: str) -> list[tuple[str, int, str]]:
    size = ELEMENT_BYTES[dtype]
    out = []
    for nbytes in (1024, 64 * 1024, MiB, MAX_BYTES - 16):  # 1 KiB up to the largest taken
        for algo in ("oneshot", "twoshot", "auto"):
            out.append((dtype, nbytes // size, algo))
    out.append((dtype, 8 * 1000, "twoshot"))  # a remainder for the last rank
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_custom_all_reduce_eager_matches_rank_order_fp32_sum(world, dtype):
    results = run_spawned(custom_ar_eager, world, cases(dtype))
    skip_if_disabled(results)
    assert results == [[]] * world, results


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_custom_all_reduce_under_graph_capture_and_replay(world, dtype):
    results = run_spawned(custom_ar_graph, world, [256, 64 * 1024, 512 * 1024], dtype)
    skip_if_disabled(results)
    assert results == [[]] * world, results
