"""SIGKILL one rank mid-operation: every survivor raises a clear error within 5 s.

Cases: a tensor-parallel peer inside ``all_reduce`` (shared-memory and Gloo
sizes mixed), a pipeline peer inside ``send_tensor_dict``/``recv_tensor_dict``,
and the message queue's writer, a local (ring) reader and a remote (TCP)
reader. After each trial nothing of ours is left in /dev/shm or the temp dir
and no process survives; nobody calls ``cleanup_stale_segments`` — the
library's own clean-up has to do it.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from coordinator.launch import init_gloo

from ._common import trials
from ._kill import run_kill_case, survive

# Settings used by every rank of the kill cases: the defaults, so the figures
# are what an engine gets out of the box.
ENV: dict[str, str] = {}


def _names_victim(rank: int, victim: int, kind: str, named: list[int]) -> bool:
    return kind in ("PeerDiedError", "GroupcoordTimeoutError") and victim in named


# -- tensor parallel: all_reduce ------------------------------------------------------


def _tp_all_reduce(rank: int, world: int, victim: int, ready: Any, seed: int) -> Any:
    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="tp")
    sizes = random.Random(seed)  # same sequence on every rank: the calls must match
    # Small sizes take the shared-memory path, 1M floats the pieces path, int8 Gloo.
    choices = [
        (16, torch.float32),
        (4096, torch.bfloat16),
        (1 << 20, torch.float32),
        (64, torch.int8),
    ]

    def op() -> None:
        n, dtype = sizes.choice(choices)
        out = group.all_reduce(torch.ones(n, dtype=dtype))
        assert int(out[0]) == world

    try:
        return survive(op, ready)
    finally:
        group.destroy()


def test_kill_tp_peer_during_all_reduce() -> None:
    run_kill_case(
        "kill: TP peer in all_reduce (world 3)",
        _tp_all_reduce,
        3,
        [0, 1, 2],
        trials(2),
        _names_victim,
        env=ENV,
    )


# -- pipeline parallel: send/recv_tensor_dict ----------------------------------------------


def _pp_tensor_dict(rank: int, world: int, victim: int, ready: Any, seed: int) -> Any:
    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="pp")
    sizes = random.Random(seed)
    step = [0]

    def op() -> None:
        n = sizes.choice([8, 1024, 256 * 1024])
        step[0] += 1
        if rank == 0:
            tensors = {"hidden": torch.full((n,), float(step[0])), "residual": torch.ones(4, 4)}
            group.send_tensor_dict({**tensors, "step": step[0]}, dst=1)
        else:
            got = group.recv_tensor_dict(src=0)
            assert got is not None and got["step"] == step[0] and got["hidden"].numel() == n

    try:
        return survive(op, ready)
    finally:
        group.destroy()


def test_kill_pp_peer_during_send_tensor_dict() -> None:
    run_kill_case(
        "kill: PP peer in send/recv_tensor_dict (world 2)",
        _pp_tensor_dict,
        2,
        [0, 1],
        trials(2),
        _names_victim,
        env=ENV,
    )


# -- message queue: writer, local reader, remote reader -----------------------------------


def _mq_stream(rank: int, world: int, victim: int, ready: Any, seed: int) -> Any:
    from groupcoord_benchmarks import _mq_soak as _mq

    init_gloo(rank, world)
    mq = _mq.build_queue(rank)
    rng = random.Random(seed)  # the writer's choice of shapes
    seq = [0]

    def op() -> None:
        if rank == _mq.WRITER:
            mq.enqueue(_mq.message(rng, seq[0]))
        else:
            _mq.check(mq.dequeue(), seq[0])
        seq[0] += 1

    try:
        return survive(op, ready)
    finally:
        # What an engine does on an error: stop the queue (wakes/ends the other side).
        mq.shutdown()


def _mq_allowed(rank: int, victim: int, kind: str, named: list[int]) -> bool:
    from groupcoord_benchmarks import _mq_soak as _mq

    if victim == _mq.WRITER or rank == _mq.WRITER:
        # The side that waited on the dead process must name it.
        return _names_victim(rank, victim, kind, named)
    # A reader whose fellow reader died: the writer stopped the queue (ClosedError)
    # or has exited by the time it looked (PeerDiedError naming the writer).
    return kind == "ClosedError" or (kind == "PeerDiedError" and named == [_mq.WRITER])


def test_kill_mq_writer() -> None:
    run_kill_case("kill: MQ writer", _mq_stream, 4, [0], trials(2), _mq_allowed, env=ENV)


def test_kill_mq_local_reader() -> None:
    run_kill_case("kill: MQ local reader", _mq_stream, 4, [1, 2], trials(2), _mq_allowed, env=ENV)


def test_kill_mq_remote_reader() -> None:
    run_kill_case(
        "kill: MQ remote (TCP) reader", _mq_stream, 4, [3], trials(2), _mq_allowed, env=ENV
    )
