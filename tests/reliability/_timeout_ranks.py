"""Rank-side code of the timeout table: each row's blocking call, run while one peer stays away.

Every row runs on a fresh group/queue/communicator with a 0.5 s deadline. The
absent rank builds the same object (construction is collective) and then
skips the call; the caller's outcome is recorded and every rank meets at a
world barrier before the next row, so one set of processes serves a whole
component.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from coordinator.launch import init_gloo
from shm_broadcast.config import override
from shm_broadcast.tcp_channel import WINDOW_MESSAGES

TIMEOUT_S = 0.5
Outcome = tuple[str, str, list[int], float]


def attempt(call: Callable[[], Any]) -> Outcome:
    """Run ``call``; return (exception type, message, ranks it names, seconds taken)."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test judges the type
        named = list(getattr(exc, "missing", None) or getattr(exc, "dead", None) or [])
        return type(exc).__name__, str(exc), named, time.monotonic() - start
    return "none", "returned without waiting for the absent peer", [], time.monotonic() - start


def _rows_loop(rank: int, rows: list[tuple[str, int]], run_row: Callable[[str, bool], Any]) -> dict:
    out: dict[str, Outcome] = {}
    for call, absent in rows:
        result = run_row(call, rank == absent)
        if result is not None:
            out[call] = result
        dist.barrier()
    return out


# ---- GroupCoordinator -----------------------------------------------------------


def _coordinator_call(g: Any, call: str) -> Callable[[], Any]:
    x = torch.ones(8)
    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: g.all_reduce(x),
        "all_reduce (shared memory off)": lambda: g.all_reduce(x),
        "all_gather": lambda: g.all_gather(x, dim=0),
        "all_gatherv": lambda: g.all_gatherv(x, dim=0),
        "reduce_scatter": lambda: g.reduce_scatter(x, dim=0),
        "reduce_scatterv": lambda: g.reduce_scatterv(x, dim=0, sizes=[4, 4]),
        "gather": lambda: g.gather(x, dst=0, dim=0),
        "broadcast": lambda: g.broadcast(x, src=1),
        "broadcast_object": lambda: g.broadcast_object(src=1),
        "broadcast_object_list": lambda: g.broadcast_object_list([None], src=1),
        "broadcast_tensor_dict": lambda: g.broadcast_tensor_dict(src=1),
        "recv_object": lambda: g.recv_object(src=1),
        "recv_tensor_dict": lambda: g.recv_tensor_dict(src=1),
        "recv": lambda: g.recv(torch.Size([8]), torch.float32, src=1),
        "barrier": lambda: g.barrier(),
    }
    return calls[call]


def coordinator_rows(rank: int, world: int, rows: list[tuple[str, int]]) -> dict:
    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world, timeout_s=120)

    def run_row(call: str, absent: bool) -> Outcome | None:
        mq = "message queue" in call
        with override(disable_shm_all_reduce="shared memory off" in call):
            g = GroupCoordinator(
                [list(range(world))],
                rank,
                "gloo",
                True,
                use_message_queue_broadcaster=mq,
                group_name="tmo",
                timeout=TIMEOUT_S,
            )
        try:
            return None if absent else attempt(_coordinator_call(g, call))
        finally:
            dist.barrier()
            g.destroy()

    return _rows_loop(rank, rows, run_row)


# ---- CpuCommunicator (DeviceCommunicatorBase + ShmAllReduce) -------------------------


def communicator_rows(rank: int, world: int, rows: list[tuple[str, int]]) -> dict:
    from device_communicators.cpu_communicator import CpuCommunicator

    init_gloo(rank, world, timeout_s=120)
    x = torch.ones(8)

    def run_row(call: str, absent: bool) -> Outcome | None:
        pg = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=TIMEOUT_S))
        with override(timeout_s=TIMEOUT_S, disable_shm_all_reduce="shared memory off" in call):
            comm = CpuCommunicator(pg, torch.device("cpu"), pg, unique_name="tmo")
        calls: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: comm.all_reduce(x),
            "all_reduce (shared memory off)": lambda: comm.all_reduce(x),
            "all_gather": lambda: comm.all_gather(x, dim=0),
            "all_gatherv": lambda: comm.all_gatherv(x, dim=0),
            "reduce_scatter": lambda: comm.reduce_scatter(x, dim=0),
            "reduce_scatterv": lambda: comm.reduce_scatterv(x, dim=0, sizes=[4, 4]),
            "gather": lambda: comm.gather(x, dst=0, dim=0),
            "broadcast": lambda: comm.broadcast(x, src=1),
            "recv": lambda: comm.recv(torch.Size([8]), torch.float32, src=1),
        }
        try:
            return None if absent else attempt(calls[call])
        finally:
            dist.barrier()
            comm.destroy()
            dist.destroy_process_group(pg)

    return _rows_loop(rank, rows, run_row)


# ---- StatelessProcessGroup --------------------------------------------------------


def stateless_rows(rank: int, world: int, rows: list[tuple[str, int]], ports: list[int]) -> dict:
    from coordinator.stateless_group import StatelessProcessGroup

    init_gloo(rank, world, timeout_s=120)  # only for the barrier between rows
    port_of = dict(zip((call for call, _ in rows), ports))

    def run_row(call: str, absent: bool) -> Outcome | None:
        port = port_of[call]
        if call == "create":
            if absent:
                return None  # the store host never comes
            return attempt(
                lambda: StatelessProcessGroup.create(
                    "127.0.0.1", port, rank, world, timeout=TIMEOUT_S
                )
            )
        group = StatelessProcessGroup.create("127.0.0.1", port, rank, world, timeout=30)
        group.timeout_s = TIMEOUT_S
        calls: dict[str, Callable[[], Any]] = {
            "recv_obj": lambda: group.recv_obj(src=1),
            "broadcast_obj": lambda: group.broadcast_obj(None, src=1),
            "all_gather_obj": lambda: group.all_gather_obj(rank),
            "barrier": lambda: group.barrier(TIMEOUT_S),  # vLLM: its own timeout, 30 s default
            "close": lambda: group.close(timeout=TIMEOUT_S),
        }
        try:
            return None if absent else attempt(calls[call])
        finally:
            dist.barrier()
            group.store = None  # the store host (rank 0) leaves at the barrier above

    return _rows_loop(rank, rows, run_row)


# ---- coordinator.comm --------------------------------------------------------------


def comm_rows(rank: int, world: int, rows: list[tuple[str, int]]) -> dict:
    from coordinator.comm import all_gather_object, new_comm

    init_gloo(rank, world, timeout_s=120)

    def run_row(call: str, absent: bool) -> Outcome | None:
        comm = new_comm("gloo", "cpu", f"tmo-{call.replace(' ', '-')}", timeout=TIMEOUT_S)
        window = None
        if call == "wait_signal":
            window = comm.new_window()
            window.window_allocate(64)
        x = torch.ones(8)
        calls: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: comm.all_reduce(x),
            "broadcast": lambda: comm.broadcast(x, root=1),
            "all_gather_single": lambda: comm.all_gather_single(torch.empty(16), x),
            "recv": lambda: comm.recv(x, src=1),
            "barrier": lambda: comm.barrier(),
            "monitored_barrier": lambda: comm.monitored_barrier(),
            "async all_reduce + wait": lambda: comm.all_reduce(x, async_op=True).wait(),
            "wait_signal": lambda: window.wait_signal(peer_rank=1).wait() if window else None,
            "all_gather_object": lambda: all_gather_object(comm, [None] * world, rank),
        }
        try:
            return None if absent else attempt(calls[call])
        finally:
            # Aborted before the barrier: a timed-out Gloo group must not be kept
            # (the communicator's documented way out of a timeout).
            comm.abort()
            dist.barrier()

    return _rows_loop(rank, rows, run_row)


# ---- MessageQueue ------------------------------------------------------------------


def mq_rows(rank: int, world: int, rows: list[tuple[str, int]]) -> dict:
    from shm_broadcast.codec import dumps, loads
    from shm_broadcast.group_io import broadcast_bytes
    from shm_broadcast.message_queue import MessageQueue

    init_gloo(rank, world, timeout_s=120)
    pg = dist.group.WORLD

    def run_row(call: str, absent: bool) -> Outcome | None:
        if call == "create_from_process_group":
            # Collective over a group whose own deadline is the row's.
            group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))
            try:
                if absent:
                    return None
                return attempt(
                    lambda: MessageQueue.create_from_process_group(group, 1024, 2).shutdown()
                )
            finally:
                dist.barrier()
                dist.destroy_process_group(group)
        remote = "remote" in call
        mq = None
        if rank == 0:
            mq = MessageQueue(1, 0 if remote else 1, None if remote else [1], 1024, 2, "127.0.0.1")
            handle = loads(broadcast_bytes(pg, dumps(mq.export_handle()), 0))
        else:
            handle = loads(broadcast_bytes(pg, None, 0))
        try:
            if call.startswith("wait_until_ready"):
                if absent:
                    return None
                if rank == 1:
                    mq = MessageQueue.create_from_handle(handle, 1)
                assert mq is not None
                return attempt(lambda: mq.wait_until_ready(timeout=TIMEOUT_S))
            if rank == 1:
                mq = MessageQueue.create_from_handle(handle, 1)
            assert mq is not None
            mq.wait_until_ready(timeout=30)
            if absent:
                return None
            if call.startswith("enqueue"):
                # The reader never reads: the ring (2 chunks) or the TCP credit window fills.
                count = WINDOW_MESSAGES + 200
                return attempt(lambda: [mq.enqueue(i, timeout=TIMEOUT_S) for i in range(count)])
            assert call.startswith("dequeue"), call
            return attempt(lambda: mq.dequeue(timeout=TIMEOUT_S))
        finally:
            dist.barrier()
            if mq is not None:
                mq.shutdown()

    return _rows_loop(rank, rows, run_row)
