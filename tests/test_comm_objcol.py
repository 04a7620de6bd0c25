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
from coordinator.errors import (
    DesyncError,
    GroupcoordTypeError,
    GroupcoordValueError,
    PeerDiedError,
    ProtocolError,
)
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


def _large_broadcasts(rank: int, world_size: int) -> bool:
    comm = new_comm("gloo", "cpu", "objbig", timeout=60)
    try:
        held = []
        for fill in (1, 2, 3):  # past the pool's 256 KiB: each read into a pooled buffer
            big = {"data": bytes([fill]) * (2 << 20), "t": torch.full((70_000,), float(fill))}
            objs = [big, fill] if rank == 0 else [None, None]
            broadcast_object_list(comm, objs, root=0)
            held.append(objs)
            sent = [big, fill] if rank == 1 else [None, None]  # and point to point, 1 -> 0
            if rank == 1:
                send_object_list(comm, sent, dst=0)
            else:
                recv_object_list(comm, sent, src=1)
            held.append(sent)
        # What a receiver decoded owns its memory: later messages reused the buffer.
        return all(
            objs[1] == fill
            and objs[0]["data"] == bytes([fill]) * (2 << 20)
            and torch.equal(objs[0]["t"], torch.full((70_000,), float(fill)))
            for objs, fill in zip(held, (1, 1, 2, 2, 3, 3))
        )
    finally:
        comm.finalize()


def test_large_objects_broadcast_or_sent_arrive_whole_and_stay_whole() -> None:
    assert run_ranks(_large_broadcasts, 2, timeout=90) == [True, True]


def _gathered_part(r: int, fill: int) -> dict:
    """Rank ``r``'s object in round ``fill``: past the pool's 256 KiB, a different
    length on each rank (the gather's and scatter's parts travel padded)."""
    return {"r": r, "data": bytes([fill + r]) * ((1 << 20) + 4099 * r)}


def _large_gathers(rank: int, world_size: int) -> bool:
    comm = new_comm("gloo", "cpu", "objgather", timeout=60)
    try:
        held = []
        for fill in (1, 2, 3):
            slots: list = [None] * world_size
            all_gather_object(comm, slots, _gathered_part(rank, fill))
            gathered: list | None = [None] * world_size if rank == 1 else None
            gather_object(comm, _gathered_part(rank, fill), 1, gathered)
            out: list = [None]
            inputs = [_gathered_part(r, fill) for r in range(world_size)] if rank == 2 else None
            scatter_object_list(comm, 2, out, inputs)
            held.append((fill, slots, gathered, out))
        # Every result is whole and stays so while later calls reuse the pooled buffers.
        for fill, slots, gathered, out in held:
            expected = [_gathered_part(r, fill) for r in range(world_size)]
            if slots != expected or out != [expected[rank]]:
                return False
            if gathered is not None and gathered != expected:
                return False
        return True
    finally:
        comm.finalize()


def test_large_objects_gathered_or_scattered_arrive_whole_and_stay_whole() -> None:
    assert run_ranks(_large_gathers, 3, timeout=90) == [True, True, True]


def test_a_padded_message_buffer_holds_zeros_after_the_message() -> None:
    from device_communicators.object_bytes import message_buffer
    from shm_broadcast import codec

    dirty = message_buffer(300_000, None)[0]  # a pooled buffer, handed out again below
    dirty.view(torch.uint8).fill_(0xAB)
    address = dirty.data_ptr()
    del dirty
    msg = codec.encode_message({"x": 1})
    tensor, view = message_buffer(300_000, msg)
    raw = tensor.view(torch.uint8)
    assert tensor.data_ptr() == address  # the same memory: its old bytes were there
    assert codec.loads(view[: msg.nbytes]) == {"x": 1}
    assert int(raw[msg.nbytes :].count_nonzero()) == 0


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


# (object call on rank 0, the plain tensor call of the same size on rank 1): lengths
# and bytes travel as bits8, so the plain call raises instead of taking the length.
AGAINST_PLAIN = {
    "send_object_list": (
        lambda comm: send_object_list(comm, [1, 2, 3], 1),
        lambda comm: comm.recv(torch.empty(1, dtype=torch.int64), 0),
        "rank 1 called recv(int64[1]) from rank 0, which sent a bits8[8] tensor",
    ),
    "send_object_list over Gloo": (
        lambda comm: send_object_list(comm, [1, 2, 3], 1),
        lambda comm: comm.recv(torch.empty(1, dtype=torch.int64), 0),
        "rank 1 called recv(int64[1]) from rank 0, which sent a bits8[8] tensor",
    ),
    "broadcast_object_list": (
        lambda comm: broadcast_object_list(comm, [1, 2, 3], 0),
        lambda comm: comm.broadcast(torch.empty(1, dtype=torch.int64), 0),
        "called broadcast(bits8[8], src=0)",
    ),
    "all_gather_object": (
        lambda comm: all_gather_object(comm, [None, None], "x"),
        lambda comm: comm.all_gather_single(
            torch.empty(2, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
        ),
        "called all_gather(bits8[8])",
    ),
}


def _object_against_plain(rank: int, world_size: int, case: str) -> str:
    from shm_broadcast.config import set_config

    if "Gloo" in case:  # the pair's transport between nodes
        set_config(disable_shm_all_reduce=True, disable_shm_p2p=True)
    comm = new_comm("gloo", "cpu", "plain", timeout=5)
    object_call, plain_call, _ = AGAINST_PLAIN[case]
    try:
        try:
            (object_call if rank == 0 else plain_call)(comm)
        except DesyncError as exc:
            return str(exc)
        except PeerDiedError:  # over Gloo a send waits for its receive: rank 1 left
            return "returned"
        return "returned"
    finally:
        comm.finalize()


@pytest.mark.parametrize("case", sorted(AGAINST_PLAIN))
def test_a_plain_tensor_call_against_an_object_call_raises(case: str) -> None:
    object_side, plain_side = run_ranks(_object_against_plain, 2, case, timeout=60)
    assert AGAINST_PLAIN[case][2] in plain_side, plain_side
    # A collective raises on both ranks; a send's length went (rank 1 took it).
    assert object_side == "returned" if case.startswith("send") else "bits8" in object_side
