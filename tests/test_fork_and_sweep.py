"""A process forked from a rank that exits normally leaves the rank's groups,
queues and segments intact; segments of killed processes are swept at the next
init_distributed_environment and before a process creates its first segment,
but only those of this pid namespace."""

from __future__ import annotations

import atexit
import io
import logging
import multiprocessing
import os
import time
from typing import Any

import torch

from coordinator import parallel_state as ps
from coordinator.launch import free_port, run_ranks
from shm_broadcast import segments
from shm_broadcast.config import get_config
from shm_broadcast.liveness import pid_namespace, process_alive
from shm_broadcast.segments import ShmSegment, cleanup_stale_segments, list_segments


def _init(rank: int, world: int) -> None:
    method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    ps.init_distributed_environment(world, rank, method, rank, "gloo")
    ps.initialize_model_parallel(world)


def _fork_then_collectives(rank: int, world: int) -> dict:
    _init(rank, world)
    try:
        tp = ps.get_tp_group()
        assert tp.broadcast_object("before" if rank == 0 else None) == "before"
        pid = os.fork()
        if pid == 0:  # the child: a normal interpreter exit runs the at-exit hooks
            atexit._run_exitfuncs()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        got = {
            "child_exit": os.waitstatus_to_exitcode(status),
            "all_reduce": tp.all_reduce(torch.ones(1000)).sum().item(),
            "queue": tp.broadcast_object({"after": rank} if rank == 0 else None),
        }
        return got
    finally:
        ps.destroy_distributed_environment()


def test_a_forked_child_exiting_normally_leaves_the_parent_working():
    for got in run_ranks(_fork_then_collectives, 2, timeout=60):
        assert got == {"child_exit": 0, "all_reduce": 2000.0, "queue": {"after": 0}}


def _child_uses_its_parents_groups(rank: int, world: int, port: int) -> dict[str, Any]:
    from coordinator.comm import new_comm
    from coordinator.stateless_group import StatelessProcessGroup

    _init(rank, world)
    comm = new_comm("gloo", "cpu", "forked", timeout=30)
    stateless = StatelessProcessGroup.create("127.0.0.1", port, rank, world, timeout=30)
    try:
        tp = ps.get_tp_group()
        queue = tp.mq_broadcaster
        got: dict[str, Any] = {}
        if rank == 0:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: every use raises, naming the owner
                os.close(read)
                said = []
                for call in (
                    lambda: tp.all_reduce(torch.full((4,), 100.0)),
                    lambda: tp.broadcast_object({"from": "child"}),
                    lambda: tp.send_tensor_dict({"x": torch.ones(2)}, dst=1),
                    lambda: comm.all_reduce(torch.full((4,), 100.0)),
                    lambda: queue.enqueue({"from": "child"}),
                    lambda: stateless.send_obj({"from": "child"}, dst=1),
                ):
                    try:
                        call()
                        said.append("returned")
                    except Exception as exc:  # noqa: BLE001 - the parent judges it
                        said.append(f"{type(exc).__name__}: {exc}")
                said.append(f"{tp.unique_name} {tp.rank_in_group} {comm.get_size()}")
                tp.destroy()  # the parent's to close: nothing happens
                os.write(write, "\n".join(said).encode())
                os._exit(0)
            os.close(write)
            os.waitpid(pid, 0)
            with os.fdopen(read) as pipe:
                got["child"] = pipe.read().split("\n")
            got["parent_pid"] = os.getpid()
        # The rank and its peer go on, with their own values.
        got["all_reduce"] = tp.all_reduce(torch.full((4,), rank + 1.0)).tolist()
        x = torch.full((4,), rank + 1.0)
        comm.all_reduce(x)
        got["comm"] = x.tolist()
        got["queue"] = tp.broadcast_object({"from": "parent"} if rank == 0 else None)
        if rank == 0:
            stateless.send_obj({"from": "parent"}, dst=1)
        else:
            got["stateless"] = stateless.recv_obj(src=0)
        return got
    finally:
        stateless.close()
        comm.finalize()
        ps.destroy_distributed_environment()


def test_a_forked_child_cannot_use_its_parents_groups_communicators_or_queues():
    # Before: the child's all_reduce paired with the peer's next call, which
    # returned the child's 100s (102) while the rank got 3, with no error.
    first, second = run_ranks(_child_uses_its_parents_groups, 2, free_port(), timeout=60)
    *errors, described = first["child"]
    assert len(errors) == 6
    owners = ["group tp:"] * 3 + ["communicator", "MessageQueue", "StatelessProcessGroup"]
    for said, what in zip(errors, owners):
        assert said.startswith("ClosedError: " + what), said
        assert f"belongs to process {first['parent_pid']}" in said and "forked" in said
    assert described.startswith("tp:") and described.endswith(" 0 2")
    for got in (first, second):
        assert got["all_reduce"] == [3.0] * 4 and got["comm"] == [3.0] * 4
        assert got["queue"] == {"from": "parent"}
    assert second["stateless"] == {"from": "parent"}


def _fork_with_a_store(rank: int, world: int) -> tuple[int, bytes, bool]:
    from coordinator.comm import bootstrap

    port = int(os.environ["MASTER_PORT"])
    parent = bootstrap.host_store("127.0.0.1", port, 0, 2, 10.0)
    parent.set("from", "parent")
    pid = os.fork()
    if pid == 0:
        # The parent's store object shares its socket (and names a server thread
        # the child does not have): the child must get a client of its own.
        child = bootstrap.host_store("127.0.0.1", port, 1, 2, 10.0)
        ok = child is not parent and child.get("from") == b"parent"
        child.set("child", "done")
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    same = bootstrap.host_store("127.0.0.1", port, 0, 2, 10.0) is parent
    return os.waitstatus_to_exitcode(status), parent.get("child"), same


def test_a_forked_child_does_not_share_its_parents_store():
    assert run_ranks(_fork_with_a_store, 1, timeout=30) == [(0, b"done", True)]


def _first_parallel_op(errors: list[str]) -> None:
    try:
        torch.full((65536,), 1.0).sum()
    except RuntimeError as exc:  # torch's "Invalid thread pool!"
        errors.append(str(exc))


def _forks_whose_two_threads_start_at_once(rank: int, world: int) -> int:
    import threading

    from device_communicators.shm_reduce import settle_torch_pool

    torch.set_num_threads(2)
    torch.full((65536,), 1.0)  # the pool has run in the parent, as in a test runner
    failed = 0
    for _ in range(150):
        pid = os.fork()
        if pid == 0:
            settle_torch_pool()  # what a group's constructor does
            errors: list[str] = []
            threads = [
                threading.Thread(target=_first_parallel_op, args=(errors,)) for _ in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            os._exit(1 if errors else 0)
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    return failed


def test_two_threads_of_a_forked_rank_can_start_torch_ops_at_once():
    # Without settle_torch_pool, about 1 fork in 9 failed here (torch rebuilds its
    # pool after a fork on first use, and two threads at once race in it).
    assert run_ranks(_forks_whose_two_threads_start_at_once, 1, timeout=60) == [0]


def _name_a_segment_then_wait(ready: Any) -> None:
    from shm_broadcast.segments import ShmSegment

    # A segment killed while still named (a crash during set-up, say): rings
    # are unlinked once set up, so this is what the sweep is for.
    ShmSegment.create(4096, tag="orphan")
    ready.set()
    time.sleep(60)  # killed by the test with the segment still named


def _init_and_report(rank: int, world: int, dead: list[int]) -> list[str]:
    _init(rank, world)
    try:
        return [s for s in list_segments() if int(s.split("_")[1]) in dead]
    finally:
        ps.destroy_distributed_environment()


def _killed_workers_with_segments() -> list[int]:
    """The pids of two plain multiprocessing workers SIGKILLed with a segment each
    still named: nothing of ours cleans up after them (coordinator.launch would
    sweep what it killed itself)."""
    ctx = multiprocessing.get_context("fork")
    ready = [ctx.Event() for _ in range(2)]
    procs = [ctx.Process(target=_name_a_segment_then_wait, args=(r,)) for r in ready]
    for proc in procs:
        proc.start()
    try:
        for event in ready:
            assert event.wait(30), "a worker never made its segment"
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
    pids = [proc.pid for proc in procs]
    assert sum(int(s.split("_")[1]) in pids for s in list_segments()) == 2  # left behind
    return pids


def test_segments_of_killed_ranks_are_swept_at_the_next_init():
    pids = _killed_workers_with_segments()
    left = run_ranks(_init_and_report, 2, pids, timeout=60)
    assert left == [[], []]


def _first_queue_and_report(rank: int, world: int, dead: list[int]) -> tuple[list[str], str]:
    from shm_broadcast.message_queue import MessageQueue

    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    logging.getLogger("groupcoord.shm_broadcast").addHandler(handler)
    try:
        MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2).close()  # no init before
        return [s for s in list_segments() if int(s.split("_")[1]) in dead], logged.getvalue()
    finally:
        logging.getLogger("groupcoord.shm_broadcast").removeHandler(handler)


def test_segments_of_killed_processes_are_swept_before_a_process_creates_its_first():
    # vLLM's executors make queues without init_distributed_environment: the first
    # segment a process creates sweeps first (and what it frees is room for it).
    pids = _killed_workers_with_segments()
    [(left, logged)] = run_ranks(_first_queue_and_report, 1, pids, timeout=60)
    assert left == []
    assert "removed 2 shared-memory segment(s) of dead processes" in logged
    assert all(f"groupcoord_{pid}_orphan_" in logged for pid in pids)


def test_the_sweep_leaves_segments_of_another_pid_namespace():
    # A dead pid, but made in another pid namespace (a container sharing /dev/shm):
    # its pid means nothing here, so the segment is not ours to judge.
    name = "groupcoord_999999_ring_0123456789abn1"
    path = os.path.join(get_config().shm_dir, name)
    open(path, "wb").close()
    try:
        assert name not in cleanup_stale_segments()
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_the_sweep_skips_a_dead_processs_segment_it_may_not_remove(monkeypatch):
    # Another user's segment in a sticky /dev/shm: unlinking it is refused. The sweep
    # runs before a process's first segment, so raising would stop every queue.
    assert not process_alive(999999)
    name = f"groupcoord_999999_ring_0123456789abn{pid_namespace()}"
    path = os.path.join(get_config().shm_dir, name)
    open(path, "wb").close()
    real_unlink = os.unlink

    def unlink(target: str, *args: Any, **kwargs: Any) -> None:
        if target == path:
            raise PermissionError(1, "Operation not permitted", target)
        real_unlink(target, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(segments, "_swept_pid", None)  # as in a process yet to create one
    try:
        assert name not in cleanup_stale_segments()
        segment = ShmSegment.create(4096, tag="after")  # sweeps first, then creates
        segment.close()
        segment.unlink()
    finally:
        monkeypatch.undo()
        os.unlink(path)
