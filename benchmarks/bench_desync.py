"""Cost of desync detection per shared-memory collective: what it adds to a call
(stamping the call's fingerprint, then comparing every peer's after the first
barrier), timed on real control lines in one process with every peer's stamp
in agreement (the common case: the full comparison runs); and the same where
rank 0 has sent a point-to-point message in the group that rank 1 received, so
the stamps' message counts differ and each call adds them up.

Then what the debug check on the Gloo and NCCL paths (``GROUPCOORD_DEBUG_DESYNC=1``:
a checksum all-gather before each collective) adds to a 4 KiB ``all_reduce`` of a
``GroupCoordinator`` at world 2, with real ranks, on the shared-memory path and
on Gloo (shared memory off), setting off vs on in the same run; and to a
``coordinator.comm`` communicator's over Gloo (a record of the call all-gathered
first, ``CommCore._agree``).

    python benchmarks/bench_desync.py
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table, reproduce_command  # noqa: E402

from coordinator.launch import init_gloo, run_ranks  # noqa: E402


def _per_call_ns(world: int, calls: int, messages: bool = False) -> float:
    """``messages``: rank 0 has sent a point-to-point message in the group that rank 1
    received (a pipeline's stages), so their stamps differ and every call sums the
    ranks' message counts in Python (``PhaseLines._check_agreement``)."""
    import torch

    from device_communicators.shm_phases import LINE, PhaseLines, call_code

    region = memoryview(bytearray(world * LINE))
    ranks = list(range(world))
    views = [PhaseLines(region, ranks, r, "bench", 1.0, 1.0) for r in ranks]
    code = call_code("all_reduce", torch.float32, torch.distributed.ReduceOp.SUM, 0)
    me = views[0]
    if messages:
        me.traffic.count_message(sent=True)
        views[1].traffic.count_message(sent=False)
    # A call's first barrier with its stamp (the peers' agreeing), then the same
    # barrier unstamped, in turns: the difference of the best of each is what the
    # detection adds (the machine's noise only ever adds).
    best = {True: float("inf"), False: float("inf")}
    phase = 0
    for _ in range(5):
        for stamped in (True, False):
            start = time.perf_counter_ns()
            for _ in range(calls):
                phase += 1
                for v in views[1:]:  # the peers' stamps and arrivals (their own processes')
                    v.calls = me.calls
                    v.stamp(code, 1024)
                    v._counters[v._my_counter] = phase
                if stamped:
                    me.stamp(code, 1024)
                me.arrive(phase)
            best[stamped] = min(best[stamped], (time.perf_counter_ns() - start) / calls)
    return best[True] - best[False]


def _all_reduce_us(rank: int, world: int, debug: bool, shm: bool) -> float:
    import torch

    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config

    set_config(debug_desync=debug, disable_shm_all_reduce=not shm)
    init_gloo(rank, world)  # torch's default threads, as a user runs it
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="bench")
    tensor = torch.ones(1024)
    best = _best_us(lambda: group.all_reduce(tensor), group.barrier)
    group.destroy()
    return best


def _comm_all_reduce_us(rank: int, world: int, debug: bool) -> float:
    import torch

    from coordinator.comm import new_comm
    from shm_broadcast.config import set_config

    set_config(debug_desync=debug, disable_shm_all_reduce=True)
    comm = new_comm("gloo", "cpu", "bench", timeout=120)
    tensor = torch.ones(1024)
    best = _best_us(lambda: comm.all_reduce(tensor), comm.barrier)
    comm.finalize()
    return best


def _best_us(call: Callable[[], object], barrier: Callable[[], object]) -> float:
    """Microseconds a ``call`` (a 4 KiB all-reduce) takes: the best of 5 rounds of 300,
    each started in step with the peers, after 100 untimed."""
    for _ in range(100):
        call()
    best = float("inf")
    for _ in range(5):
        barrier()
        start = time.perf_counter()
        for _ in range(300):
            call()
        best = min(best, (time.perf_counter() - start) / 300 * 1e6)
    return best


def main() -> int:
    import torch

    print(f"# {reproduce_command()}")
    sent = "with a message sent and received (ns)"
    rows = [
        {
            "world": w,
            "added per call (ns)": _per_call_ns(w, 20_000),
            sent: _per_call_ns(w, 20_000, messages=True),
        }
        for w in (2, 4, 8)
    ]
    print_table(rows, ["world", "added per call (ns)", sent])
    torch.set_num_threads(1)  # the forking parent stays single-threaded
    debug_rows = []
    for path, shm in (("shared memory", True), ("gloo", False)):
        off, on = (max(run_ranks(_all_reduce_us, 2, d, shm, timeout=120)) for d in (False, True))
        debug_rows.append(
            {"path": path, "off (us)": off, "debug_desync on (us)": on, "added (us)": on - off}
        )
    off, on = (max(run_ranks(_comm_all_reduce_us, 2, d, timeout=120)) for d in (False, True))
    debug_rows.append(
        {
            "path": "gloo (a Comm)",
            "off (us)": off,
            "debug_desync on (us)": on,
            "added (us)": on - off,
        }
    )
    print("\n# 4 KiB GroupCoordinator.all_reduce, world 2, GROUPCOORD_DEBUG_DESYNC off vs on")
    print_table(debug_rows, ["path", "off (us)", "debug_desync on (us)", "added (us)"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
