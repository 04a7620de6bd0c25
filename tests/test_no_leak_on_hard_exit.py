"""Queue rings leave nothing in /dev/shm however a rank ends: the writer unlinks
the ring's name as soon as every local reader has mapped it (set-up), so an
``os._exit`` (multiprocessing's fork launcher) or a SIGTERM leaves no segment."""

from __future__ import annotations

import os
import signal
import time

from ready_flags import mark, wait_for

from coordinator.launch import start_ranks
from shm_broadcast.segments import list_segments


def _ours(pids: list[int]) -> list[str]:
    return [s for s in list_segments() if int(s.split("_")[1]) in pids]


def _tp_group_then(rank: int, world: int, ending: str, flag_dir: str) -> None:
    from coordinator import parallel_state as ps

    method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    ps.init_distributed_environment(world, rank, method, rank, "gloo")
    ps.initialize_model_parallel(world)  # TP group: a message queue ring
    tp = ps.get_tp_group()
    assert tp.broadcast_object({"step": 1} if rank == 0 else None) == {"step": 1}
    if ending == "os._exit":
        os._exit(0)  # what a fork-launched worker does: no atexit, no destroy
    mark(flag_dir, f"rank {rank} idle")
    time.sleep(60)  # SIGTERMed by the test


def _run(ending: str, flag_dir: str) -> list[str]:
    group = start_ranks(_tp_group_then, 2, ending, flag_dir, timeout=60)
    pids = [group.pid(0), group.pid(1)]
    if ending == "SIGTERM":
        for rank in (0, 1):  # both ranks are past set-up and idle
            wait_for(flag_dir, f"rank {rank} idle")
        for rank in (0, 1):
            os.kill(group.pid(rank), signal.SIGTERM)
    for proc in group.procs:
        proc.join(30)
    group.terminate()
    return _ours(pids)


def test_ranks_ending_with_os_exit_leave_no_queue_ring(tmp_path):
    assert _run("os._exit", str(tmp_path)) == []


def test_sigtermed_ranks_leave_no_queue_ring(tmp_path):
    assert _run("SIGTERM", str(tmp_path)) == []
