"""Rank-side code of the bad-input table.

Only rank 0 makes the bad calls; rank 1 goes straight to the good calls. A bad
call that sent anything before raising would therefore be paired with rank 1's
good call, and that good call's checked result (or a hang) would show it. Each
bad call's outcome is recorded: (exception type, message, is ValueError, is TypeError).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from coordinator.launch import init_gloo

Outcome = tuple[str, str, bool, bool]
BadCall = tuple[str, Callable[[Any], Any]]

T = torch.arange(4, dtype=torch.float32)
META = torch.empty(4, device="meta")


def _two_tensor() -> torch.Tensor:
    """A wrapper subclass (torch's own test one, like DTensor or a quantized weight):
    it has no memory of its own (data_ptr() is 0), so a path that moved its memory
    crashed the process (SIGSEGV) or returned one of its inner tensors' sums."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(T.clone(), T * 10)


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the nested tensor API is in prototype stage"
        return torch.nested.nested_tensor([T, T[:2]])


def _attempt(call: Callable[[], Any]) -> Outcome:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test judges the type
        return type(exc).__name__, str(exc), isinstance(exc, ValueError), isinstance(exc, TypeError)
    return "none", "accepted", False, False


# (label, call on the object under test). Labels say what is wrong; the test
# table says which argument name the message must carry.
COORDINATOR_BAD: list[BadCall] = [
    ("all_reduce: not a tensor", lambda g: g.all_reduce([1.0, 2.0])),
    ("all_reduce: wrong device", lambda g: g.all_reduce(META)),
    ("all_gather: dim out of range", lambda g: g.all_gather(T, dim=3)),
    ("all_gather: dim not an int", lambda g: g.all_gather(T, dim="0")),
    ("all_gatherv: sizes of wrong length", lambda g: g.all_gatherv(T, dim=0, sizes=[4])),
    ("all_gatherv: sizes not matching the tensor", lambda g: g.all_gatherv(T, 0, sizes=[3, 3])),
    ("all_gatherv: empty list", lambda g: g.all_gatherv([], 0)),
    ("reduce_scatter: dim not divisible", lambda g: g.reduce_scatter(torch.ones(3), dim=0)),
    ("reduce_scatterv: sizes of wrong sum", lambda g: g.reduce_scatterv(T, 0, sizes=[1, 1])),
    ("gather: dst out of range", lambda g: g.gather(T, dst=2, dim=0)),
    ("gather: dst negative", lambda g: g.gather(T, dst=-1, dim=0)),
    ("broadcast: src out of range", lambda g: g.broadcast(T, src=5)),
    ("broadcast: src a bool", lambda g: g.broadcast(T, src=True)),
    ("send: dst is self", lambda g: g.send(T, dst=0)),
    ("send: dst out of range", lambda g: g.send(T, dst=7)),
    ("recv: src is self", lambda g: g.recv(torch.Size([4]), torch.float32, src=0)),
    ("recv: dtype not a dtype", lambda g: g.recv(torch.Size([4]), "float32", src=1)),
    ("recv: negative size", lambda g: g.recv(torch.Size([-1]), torch.float32, src=1)),
    ("send_object: dst is self", lambda g: g.send_object({"a": 1}, dst=0)),
    ("send_object: unsupported object", lambda g: g.send_object(object(), dst=1)),
    ("broadcast_object: unsupported object (queue)", lambda g: g.broadcast_object(print)),
    ("broadcast_object_list: not a list", lambda g: g.broadcast_object_list((1,), src=0)),
    (
        "broadcast_tensor_dict: unsupported value",
        lambda g: g.broadcast_tensor_dict({"x": object()}),
    ),
    ("send_tensor_dict: dst is self", lambda g: g.send_tensor_dict({"x": T}, dst=0)),
    (
        "send_tensor_dict: all_gather_group not a group",
        lambda g: g.send_tensor_dict({"x": T}, dst=1, all_gather_group="tp"),
    ),
    ("all_reduce: a wrapper subclass", lambda g: g.all_reduce(_two_tensor())),
    ("all_gather: a wrapper subclass", lambda g: g.all_gather(_two_tensor(), 0)),
    ("broadcast: a wrapper subclass", lambda g: g.broadcast(_two_tensor(), src=0)),
    ("send: a wrapper subclass", lambda g: g.send(_two_tensor(), dst=1)),
    ("all_reduce: a nested tensor", lambda g: g.all_reduce(_nested())),
    (
        "broadcast_tensor_dict: a wrapper subclass",
        lambda g: g.broadcast_tensor_dict({"x": _two_tensor()}),
    ),
    ("send_tensor_dict: a wrapper subclass", lambda g: g.send_tensor_dict({"x": _two_tensor()}, 1)),
    ("broadcast_object: a nested tensor", lambda g: g.broadcast_object([_nested()])),
    ("queue enqueue: unsupported object", lambda g: g.mq_broadcaster.enqueue(threading.Lock())),
    ("queue enqueue: non-positive timeout", lambda g: g.mq_broadcaster.enqueue(1, timeout=0)),
]

COMMUNICATOR_BAD: list[BadCall] = [
    ("all_reduce: not a tensor", lambda c: c.all_reduce(3)),
    ("all_reduce: wrong device", lambda c: c.all_reduce(META)),
    ("all_gather: dim out of range", lambda c: c.all_gather(T, dim=-2)),
    ("all_gatherv: sizes of wrong length", lambda c: c.all_gatherv(T, dim=0, sizes=[1, 1, 2])),
    ("reduce_scatterv: negative size", lambda c: c.reduce_scatterv(T, 0, sizes=[5, -1])),
    ("gather: dst out of range", lambda c: c.gather(T, dst=3, dim=0)),
    ("broadcast: src out of range", lambda c: c.broadcast(T, src=-3)),
    ("send: dst is self", lambda c: c.send(T, dst=0)),
    ("recv: size not a sequence", lambda c: c.recv(4.5, torch.float32, src=1)),
]

STATELESS_BAD: list[BadCall] = [
    ("send_obj: dst is self", lambda s: s.send_obj(1, dst=0)),
    ("send_obj: unsupported object", lambda s: s.send_obj(object(), dst=1)),
    ("recv_obj: src out of range", lambda s: s.recv_obj(src=9)),
    ("broadcast_obj: src negative", lambda s: s.broadcast_obj(1, src=-1)),
    ("broadcast_obj: unsupported object", lambda s: s.broadcast_obj(lambda: 1, src=0)),
    ("all_gather_obj: non-positive timeout", lambda s: s.all_gather_obj(1, timeout=-1)),
]

COMM_BAD: list[BadCall] = [
    ("all_reduce: not a tensor", lambda c: c.all_reduce("x")),
    ("all_reduce: op not a ReduceOp", lambda c: c.all_reduce(T, op="sum")),
    ("broadcast: root out of range", lambda c: c.broadcast(T, root=9)),
    ("send: dst is self", lambda c: c.send(T, dst=0)),
    ("all_reduce: a wrapper subclass", lambda c: c.all_reduce(_two_tensor())),
    ("broadcast: a wrapper subclass", lambda c: c.broadcast(_two_tensor(), root=0)),
    ("send: a wrapper subclass", lambda c: c.send(_two_tensor(), dst=1)),
    ("all_gather_single: output of wrong size", lambda c: c.all_gather_single(T, T)),
    (
        "all_to_all_v_single: split sizes of wrong sum",
        lambda c: c.all_to_all_v_single(torch.empty(4), T, [2, 2], [3, 3]),
    ),
    ("split: ranks without the caller", lambda c: c.split([1], "child")),
]


def _good_coordinator(g: Any, rank: int) -> None:
    assert torch.equal(g.all_reduce(T), T * 2)
    assert torch.equal(g.all_gatherv(torch.ones(rank + 1), dim=0), torch.ones(3))
    assert g.broadcast_object({"step": 7} if rank == 0 else None) == {"step": 7}
    if rank == 0:
        g.send_tensor_dict({"x": T, "n": 3}, dst=1)
        g.send(T * 3, dst=1)
    else:
        got = g.recv_tensor_dict(src=0)
        assert got is not None and torch.equal(got["x"], T) and got["n"] == 3
        assert torch.equal(g.recv(torch.Size([4]), torch.float32, src=0), T * 3)


def coordinator_case(rank: int, world: int) -> dict[str, Outcome]:
    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world)
    g = GroupCoordinator(
        [list(range(world))],
        rank,
        "gloo",
        True,
        use_message_queue_broadcaster=True,
        group_name="bad",
    )
    try:
        out = (
            {label: _attempt(lambda c=call: c(g)) for label, call in COORDINATOR_BAD}
            if rank == 0
            else {}
        )
        _good_coordinator(g, rank)
        return out
    finally:
        g.destroy()


def communicator_case(rank: int, world: int) -> dict[str, Outcome]:
    from device_communicators.cpu_communicator import CpuCommunicator

    init_gloo(rank, world)
    pg = dist.group.WORLD
    c = CpuCommunicator(pg, torch.device("cpu"), pg, unique_name="bad")
    try:
        out = (
            {label: _attempt(lambda f=call: f(c)) for label, call in COMMUNICATOR_BAD}
            if rank == 0
            else {}
        )
        assert torch.equal(c.all_reduce(T), T * 2)
        assert torch.equal(c.all_gather(T, dim=0), torch.cat([T, T]))
        if rank == 0:
            c.send(T, dst=1)
        else:
            assert torch.equal(c.recv(torch.Size([4]), torch.float32, src=0), T)
        return out
    finally:
        c.destroy()


def stateless_case(rank: int, world: int, port: int) -> dict[str, Outcome]:
    from coordinator.stateless_group import StatelessProcessGroup

    s = StatelessProcessGroup.create("127.0.0.1", port, rank, world, timeout=30)
    out = (
        {label: _attempt(lambda f=call: f(s)) for label, call in STATELESS_BAD} if rank == 0 else {}
    )
    if rank == 0:
        out["create: rank out of range"] = _attempt(
            lambda: StatelessProcessGroup.create("127.0.0.1", port, 5, world)
        )
        s.send_obj({"ok": 1}, dst=1)
    else:
        assert s.recv_obj(src=0) == {"ok": 1}
    assert s.broadcast_obj("hi" if rank == 0 else None, src=0) == "hi"
    assert s.all_gather_obj(rank) == list(range(world))
    s.close()
    return out


def comm_case(rank: int, world: int) -> dict[str, Outcome]:
    from coordinator.comm import new_comm

    comm = new_comm("gloo", "cpu", "bad", timeout=30)
    try:
        out = (
            {label: _attempt(lambda f=call: f(comm)) for label, call in COMM_BAD}
            if rank == 0
            else {}
        )
        x = T.clone()
        comm.all_reduce(x)
        assert torch.equal(x, T * 2)
        y = torch.zeros(4) if rank else T.clone()
        comm.broadcast(y, root=0)
        assert torch.equal(y, T)
        return out
    finally:
        comm.finalize()


def mq_case(rank: int, world: int) -> dict[str, Outcome]:
    from groupcoord_benchmarks import _mq_soak as _mq

    from shm_broadcast.message_queue import MessageQueue

    out: dict[str, Outcome] = {}
    if rank == 0:
        for label, call in [
            ("MessageQueue: negative n_reader", lambda: MessageQueue(-1, 0)),
            ("MessageQueue: more local than readers", lambda: MessageQueue(1, 2)),
            ("MessageQueue: connect_ip any-interface", lambda: MessageQueue(2, 1, connect_ip="*")),
            ("MessageQueue: tiny max_chunk_bytes", lambda: MessageQueue(1, 1, max_chunk_bytes=8)),
            ("MessageQueue: local_reader_ranks repeated", lambda: MessageQueue(2, 2, [1, 1])),
            ("MessageQueue: reader_pids of 0", lambda: MessageQueue(1, 1, reader_pids=[0])),
            ("create_from_handle: not a handle", lambda: MessageQueue.create_from_handle({}, 1)),
        ]:
            out[label] = _attempt(call)
    init_gloo(rank, world)
    mq = _mq.build_queue(rank)
    try:
        if rank == 0:
            out["enqueue: unsupported object"] = _attempt(lambda: mq.enqueue(object()))
            out["enqueue: a wrapper subclass"] = _attempt(lambda: mq.enqueue(_two_tensor()))
            out["enqueue: non-positive timeout"] = _attempt(lambda: mq.enqueue(1, timeout=-1.0))
            for seq in range(3):
                mq.enqueue({"seq": seq})
        else:
            if rank == 1:
                out["enqueue: on a reader"] = _attempt(lambda: mq.enqueue(1))
                out["dequeue: non-positive timeout"] = _attempt(lambda: mq.dequeue(timeout=0))
            assert [mq.dequeue(timeout=30)["seq"] for _ in range(3)] == [0, 1, 2]
        return out
    finally:
        dist.barrier()
        mq.shutdown()
