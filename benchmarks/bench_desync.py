"""Cost of desync detection per shared-memory collective: what it adds to a call
(stamping the call's fingerprint, then comparing every peer's after the first
barrier), timed on real control lines in one process with every peer's stamp
in agreement (the common case: the full comparison runs).

    python benchmarks/bench_desync.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table, reproduce_command  # noqa: E402


def _per_call_ns(world: int, calls: int) -> float:
    import torch

    from device_communicators.shm_phases import LINE, PhaseLines, call_code

    region = memoryview(bytearray(world * LINE))
    ranks = list(range(world))
    views = [PhaseLines(region, ranks, r, "bench", 1.0, 1.0) for r in ranks]
    code = call_code("all_reduce", torch.float32, torch.distributed.ReduceOp.SUM, 0)
    me = views[0]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(calls):
            for v in views[1:]:  # the peers' stamps (their own processes' work in real life)
                v.calls = me.calls
                v.stamp(code, 1024)
            me.stamp(code, 1024)
            me._check_agreement()
        peers = (time.perf_counter_ns() - start) / calls
        start = time.perf_counter_ns()
        for _ in range(calls):
            for v in views[1:]:
                v.calls = me.calls
                v.stamp(code, 1024)
        only_peers = (time.perf_counter_ns() - start) / calls
        best = min(best, peers - only_peers)
    return best


def main() -> int:
    print(f"# {reproduce_command()}")
    rows = [{"world": w, "added per call (ns)": _per_call_ns(w, 20_000)} for w in (2, 4, 8)]
    print_table(rows, ["world", "added per call (ns)"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
