"""A rank whose shared-memory collective is interrupted part-way (its signal handler
raised KeyboardInterrupt while it waited for a late peer) and which then goes on
calling: no rank may return a value that is not its call's.

Until 2026-11-28 the interrupted rank's next call published a later phase, on
which its late peer's wait for the interrupted call passed: the peer then read
the interrupted rank's buffer after it was freed and refilled by the next call
(an all-gather returned the next call's part, an all-reduce and a broadcast
garbage such as 1.3e37) with no error, and every call after raised DesyncError
("... read directly") for ever. Now the interrupted rank leaves the group's
shared-memory path: its later calls raise ``ClosedError`` naming the
interruption, and its peers' waits on it raise ``PeerLeftError`` at once.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import torch

from coordinator.errors import ClosedError, GroupcoordError, PeerLeftError
from coordinator.group_coordinator import GroupCoordinator
from coordinator.launch import init_gloo, run_ranks
from shm_broadcast.config import set_config


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("interrupted by the test's alarm")


def _call(g: GroupCoordinator, op: str, rank: int, n: int, v: int) -> list[float]:
    t = torch.full((n,), float(v + 100 * rank))
    if op == "all_reduce":
        r = g.all_reduce(t)
        return [r[0].item(), r[-1].item()]
    if op == "all_gather":
        r = g.all_gather(t)
        return [r[0].item(), r[n].item(), r[-1].item()]
    r = g.broadcast(t, 1)  # the interrupted rank is the root
    return [r[0].item(), r[-1].item()]


def _expected(op: str, v: int) -> list[float]:
    if op == "all_reduce":
        return [2.0 * v + 100] * 2
    if op == "all_gather":
        return [float(v), v + 100.0, v + 100.0]
    return [v + 100.0] * 2


def _interrupted_rank(rank: int, world: int, op: str, n: int) -> list[Any]:
    set_config(timeout_s=60.0)
    init_gloo(rank, world)
    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="intr")
    for _ in range(4):  # the allocator's threshold for fresh mappings rises past n floats,
        x = torch.empty(n)  # so a freed input's memory is handed out again (silent
        del x  # garbage before the fix, not a failed read)
    g.barrier()
    outcomes: list[Any] = []
    try:
        if rank == 1:
            signal.signal(signal.SIGALRM, _interrupt)
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # while it waits for rank 0
            try:
                _call(g, op, rank, n, 1)
                outcomes.append(("returned", None))
            except KeyboardInterrupt:
                outcomes.append(("interrupted", None))
            values: tuple[int, ...] = (2, 3)
        else:
            time.sleep(1.0)
            values = (1, 2, 3)
        for v in values:
            start = time.monotonic()
            try:
                got = _call(g, op, rank, n, v)
                outcomes.append(("value", v, got == _expected(op, v), got))
            except (ClosedError, PeerLeftError) as exc:
                outcomes.append((type(exc).__name__, v, str(exc), time.monotonic() - start))
        return outcomes
    finally:
        g.destroy()


@pytest.mark.parametrize(
    "op,n",
    [
        ("all_reduce", 1024),  # the lean path
        ("all_reduce", 262144),  # 1 MiB: reads the peer's memory where allowed
        ("all_gather", 262144),
        ("broadcast", 262144),
    ],
)
def test_an_interrupted_call_never_lets_a_peer_return_a_wrong_value(op: str, n: int) -> None:
    late, interrupted = run_ranks(_interrupted_rank, 2, op, n, timeout=60)
    assert interrupted[0] == ("interrupted", None)
    for kind, v, message, _ in interrupted[1:]:
        assert kind == "ClosedError", (v, message)
        assert f"its {op}" in message and "KeyboardInterrupt" in message, message
    first, *later = late
    if first[0] == "value":  # it met the interrupted rank's published part in time
        assert first[2], first
    else:
        kind, _, message, waited = first
        assert kind == "PeerLeftError" and "peer rank(s) [1] left" in message, first
        assert waited < 5, first  # at once, not at the 60 s timeout
    for outcome in later:
        assert outcome[0] in ("ClosedError", "PeerLeftError"), outcome


def _gloo_call(g: GroupCoordinator, op: str, rank: int, v: int) -> Any:
    if op == "broadcast_object":
        got = g.broadcast_object({"v": v, "pad": "x" * 100 * v} if rank == 0 else None, src=0)
        return got["v"]
    if op == "broadcast_tensor_dict":
        sent = {"v": v, "t": torch.full((100_000 * v,), float(v))} if rank == 0 else None
        got = g.broadcast_tensor_dict(sent, src=0)
        assert got is not None
        return [got["v"], got["t"].numel(), got["t"][0].item()]
    if op == "all_gatherv":  # the lengths, then the parts
        joined = g.all_gatherv(torch.full((3 + v + rank,), float(10 * v + rank)), 0)
        assert isinstance(joined, torch.Tensor)
        return joined.tolist()
    if rank == 0:  # an object larger than a message's inline room: a header, then its bytes
        g.send_object({"v": v, "pad": "x" * 70_000 * v}, 1)
        return "sent"
    return g.recv_object(0)["v"]


def _gloo_call_expected(op: str) -> Any:
    """Rank 0's result of ``_gloo_call(..., v=1)``."""
    return {
        "broadcast_object": 1,
        "broadcast_tensor_dict": [1, 100_000, 1.0],
        "all_gatherv": [10.0] * 4 + [11.0] * 5,
        "send_recv_object": "sent",
    }[op]


def _interrupted_between_gloo_steps(rank: int, world: int, op: str) -> list[Any]:
    set_config(timeout_s=20.0, disable_shm_all_reduce=True, disable_shm_p2p=True)
    init_gloo(rank, world)
    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="intr")
    g.barrier()
    try:
        # Rank 1 waits in Gloo's first step (C++), so its handler runs as soon as that
        # step returns: between the steps.
        return _interrupt_then_go_on(rank, lambda v: _gloo_call(g, op, rank, v))
    finally:
        g.destroy()


def _interrupt_then_go_on(rank: int, call: Any) -> list[Any]:
    """Rank 1: ``call(1)``, interrupted 0.3 s into its wait for rank 0, then
    ``call(2)`` and ``call(3)``; rank 0: ``call(1)`` after 1 s. What each got."""
    outcomes: list[Any] = []
    if rank == 1:
        signal.signal(signal.SIGALRM, _interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            call(1)
            outcomes.append(("returned", None))
        except KeyboardInterrupt:
            outcomes.append(("interrupted", None))
        for v in (2, 3):
            try:
                outcomes.append(("value", call(v)))
            except ClosedError as exc:
                outcomes.append(("ClosedError", str(exc)))
    else:
        time.sleep(1.0)
        try:  # rank 1 took part in its first step only
            outcomes.append(("value", call(1)))
        except GroupcoordError as exc:  # rank 1 closed its group
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


@pytest.mark.parametrize(
    "op", ["broadcast_object", "broadcast_tensor_dict", "all_gatherv", "send_recv_object"]
)
def test_a_call_interrupted_between_two_gloo_steps_closes_the_group_on_that_rank(op: str) -> None:
    """Until 2026-11-28 the interrupted rank's next call took the step its peer sent
    for the interrupted one (a length's place held the bytes), and Gloo aborted the
    process (SIGABRT: "Received data size doesn't match expected size")."""
    late, interrupted = run_ranks(_interrupted_between_gloo_steps, 2, op, timeout=60)
    assert interrupted[0] == ("interrupted", None), interrupted
    if late[0][0] == "value":  # the root's sends may complete without the receiver
        assert late[0][1] == _gloo_call_expected(op), late
    name = "recv_object" if op == "send_recv_object" else op
    for kind, message in interrupted[1:]:
        assert kind == "ClosedError", message
        assert f"its {name} ended part-way on this rank with KeyboardInterrupt" in message


def _comm_interrupted(rank: int, world: int, op: str) -> list[Any]:
    from coordinator.comm import new_comm

    set_config(disable_shm_all_reduce=True, disable_shm_p2p=True)
    comm = new_comm("gloo", "cpu", "intr", timeout=20)

    def call(v: int) -> Any:
        if op == "all_gather_v":  # the counts are checked, then the parts move
            outs = [torch.empty(3 + v + r) for r in range(world)]
            comm.all_gather_v(outs, torch.full((3 + v + rank,), float(10 * v + rank)))
            return [o[0].item() for o in outs]
        if rank == 0:  # past a header's inline room: a header, then the data
            comm.send(torch.full((100_000 * v,), float(v)), 1)
            return "sent"
        t = torch.empty(100_000 * v)
        comm.recv(t, 0)
        return t[0].item()

    comm.barrier()
    try:
        return _interrupt_then_go_on(rank, call)
    finally:
        comm.finalize()


@pytest.mark.parametrize("op", ["all_gather_v", "send_recv"])
def test_a_comm_call_interrupted_part_way_refuses_the_calls_after_it(op: str) -> None:
    """``coordinator.comm`` likewise: a receive interrupted between a header and its
    data made Gloo abort the process at the next receive (SIGABRT) until 2026-11-28,
    and an interrupted ``all_gather_v`` read garbage counts."""
    late, interrupted = run_ranks(_comm_interrupted, 2, op, timeout=60)
    assert interrupted[0] == ("interrupted", None), interrupted
    name = "recv" if op == "send_recv" else op
    for kind, message in interrupted[1:]:
        assert kind == "ClosedError", message
        assert f"{name} ended part-way on this rank with KeyboardInterrupt" in message
    if late[0][0] == "value":
        assert late[0][1] == ("sent" if op == "send_recv" else [10.0, 11.0]), late


def _queue_broadcasts(rank: int, world: int, op: str) -> list[Any]:
    set_config(timeout_s=20.0)
    init_gloo(rank, world)
    g = GroupCoordinator(
        [[0, 1]], rank, "gloo", True, use_message_queue_broadcaster=True, group_name="intr"
    )
    assert g.mq_broadcaster is not None

    def call(v: int) -> Any:
        if op == "broadcast_object":
            return g.broadcast_object({"v": v} if rank == 0 else None, src=0)["v"]
        got = g.broadcast_tensor_dict({"v": v, "t": torch.full((4,), v)} if rank == 0 else None)
        assert got is not None
        return got["v"]

    g.barrier()
    try:
        return _interrupt_then_go_on(rank, call)
    finally:
        g.destroy()


@pytest.mark.parametrize("op", ["broadcast_object", "broadcast_tensor_dict"])
def test_a_queue_broadcast_interrupted_before_its_message_came_closes_the_group(op: str) -> None:
    """The queue's reader, interrupted while it waited, consumed nothing: its next
    call returned the interrupted call's object (2026-11-28: [1, 2] for calls 2 and 3)."""
    late, interrupted = run_ranks(_queue_broadcasts, 2, op, timeout=60)
    assert late == [("value", 1)]
    assert interrupted[0] == ("interrupted", None)
    for kind, message in interrupted[1:]:
        assert kind == "ClosedError", message
        assert f"its {op} ended part-way on this rank with KeyboardInterrupt" in message
