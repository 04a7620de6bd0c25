"""Object collectives: plain data and tensors round-trip; pickles are refused by default."""

from __future__ import annotations

import fractions
import os
import pathlib

import numpy as np
import pytest
import torch

from coordinator.comm import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    new_comm,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from coordinator.errors import GroupcoordTypeError, GroupcoordValueError, ProtocolError
from coordinator.launch import run_ranks


def _payload(rank: int) -> dict:
    return {
        "rank": rank,
        "name": f"r{rank}",
        "shape": (rank, rank + 1),
        "tensor": torch.arange(rank + 2, dtype=torch.bfloat16),
        "array": np.full(rank + 1, rank, dtype=np.int16),
        "nested": [None, True, 1.5, b"\x00" * rank],
    }


def _same(a: dict, b: dict) -> bool:
    return (
        {k: a[k] for k in ("rank", "name", "shape", "nested")}
        == {k: b[k] for k in ("rank", "name", "shape", "nested")}
        and torch.equal(a["tensor"], b["tensor"])
        and np.array_equal(a["array"], b["array"])
    )


def _objects(rank: int, world_size: int) -> str:
    comm = new_comm("gloo", "cpu", "obj", timeout=30)
    w = world_size

    slots: list = [None] * w
    all_gather_object(comm, slots, _payload(rank))
    assert all(_same(slots[i], _payload(i)) for i in range(w))

    gathered: list | None = [None] * w if rank == w - 1 else None
    gather_object(comm, _payload(rank), w - 1, gathered)
    if gathered is not None:
        assert all(_same(gathered[i], _payload(i)) for i in range(w))

    objs: list = [_payload(1), "second", 3] if rank == 1 else [None, None, None]
    broadcast_object_list(comm, objs, root=1)
    assert _same(objs[0], _payload(1)) and objs[1:] == ["second", 3]

    if rank == 0:
        send_object_list(comm, [{"to": 1}, (1, 2)], dst=1)
        got: list = [None]
        recv_object_list(comm, got, src=1)
        assert got == ["back"]
    elif rank == 1:
        got = [None, None]
        recv_object_list(comm, got, src=0)
        assert got == [{"to": 1}, (1, 2)]
        send_object_list(comm, ["back"], dst=0)

    out: list = [None]
    inputs = [{"for": i} for i in range(w)] if rank == 0 else None
    scatter_object_list(comm, 0, out, inputs)
    assert out == [{"for": rank}]

    with pytest.raises(GroupcoordValueError, match="object_list must have"):
        all_gather_object(comm, [None], 1)
    with pytest.raises(GroupcoordValueError, match="dst="):
        send_object_list(comm, [1], dst=rank)
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_object_collectives_round_trip(world_size: int) -> None:
    assert run_ranks(_objects, world_size, timeout=90) == ["ok"] * world_size


class _CreatesFile:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def _pickle_refused(rank: int, world_size: int, marker: str) -> str:
    comm = new_comm("gloo", "cpu", "pickle", timeout=30)
    evil = _CreatesFile(marker)
    if rank == 0:  # the sender refuses by default, before anything is sent
        with pytest.raises(GroupcoordTypeError, match="_CreatesFile"):
            broadcast_object_list(comm, [evil], root=0)
    # A sender that opts in cannot opt the receivers in.
    objs: list = [evil] if rank == 0 else [None]
    if rank == 0:
        broadcast_object_list(comm, objs, root=0, weights_only=False)
    else:
        with pytest.raises(ProtocolError, match="allow_pickle=False"):
            broadcast_object_list(comm, objs, root=0)
        assert objs == [None]
    comm.barrier()
    assert not os.path.exists(marker)
    # Explicit opt-in on both sides works, and the comm is still in step.
    slots: list = [None] * world_size
    all_gather_object(comm, slots, fractions.Fraction(rank, 3), weights_only=False)
    assert slots == [fractions.Fraction(i, 3) for i in range(world_size)]
    return "ok"


def test_object_collectives_refuse_pickle_by_default(tmp_path: pathlib.Path) -> None:
    marker = str(tmp_path / "unpickled-code-ran")
    assert run_ranks(_pickle_refused, 2, marker, timeout=60) == ["ok", "ok"]
    assert not os.path.exists(marker)
