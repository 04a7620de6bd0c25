"""Shared-memory windows: put/signal/wait_signal across forked processes, both API forms."""

from __future__ import annotations

import os
import time

import pytest
import torch

from coordinator.comm import SignalCmpOp, WorkStatus, new_comm
from coordinator.errors import (
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
    PeerDiedError,
)
from coordinator.launch import run_ranks, start_ranks
from shm_broadcast.segments import list_segments

_ITERS = 50


def _window_ring(rank: int, world_size: int) -> str:
    comm = new_comm("gloo", "cpu", "win", timeout=30)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    original = torch.full((8,), float(rank))
    win = comm.new_window()
    win.tensor_register(original)
    # The creator unlinked its name once every peer had mapped it.
    assert not [s for s in list_segments() if s.startswith(f"groupcoord_{os.getpid()}_")]
    assert win.get_size() == 8 * 4
    assert win.get_tensor().tolist() == [float(rank)] * 8
    assert win.map_remote_tensor(right).tolist() == [float(right)] * 8
    comm.barrier()  # everyone has looked at the initial contents before any put

    # Ring of put + signal; acks travel back through value slot 1 so no put
    # overwrites data its target has not read yet.
    for i in range(_ITERS):
        if i:
            # torchcomms' enum and its lower-case name are the same comparison.
            win.wait_signal(1, i, SignalCmpOp.GE if i % 2 else "ge")
        win.put(torch.tensor([1000.0 * i + rank, -1.0 * i]), right, target_disp=2)
        win.signal(dst_rank=right)
        win.wait_signal(peer_rank=left)
        assert win.get_tensor()[2:4].tolist() == [1000.0 * i + left, -1.0 * i]
        win.signal(1, i + 1, left)  # torchcomms' positional form
    # The older view form: rank, sizes, dtype, offset (elements).
    assert win.get_tensor(right, [2], torch.float32, 2).tolist() == [
        1000.0 * (_ITERS - 1) + rank,
        -1.0 * (_ITERS - 1),
    ]

    # Asynchronous wait: not complete until the peer signals after a barrier.
    if rank == 0:
        work = win.wait_signal(peer_rank=left_of_zero(world_size), async_op=True)
        assert not work.is_completed() and work.status is WorkStatus.INPROGRESS
        comm.barrier()
        work.wait()
        assert work.status is WorkStatus.COMPLETED
        assert win.get_tensor()[6].item() == 42.0
    else:
        comm.barrier()
        if rank == left_of_zero(world_size):
            win.put(torch.tensor([42.0]), 0, target_disp=6, async_op=True).wait()
            win.signal(dst_rank=0, async_op=True).wait()

    with pytest.raises(GroupcoordValueError, match="runs past"):
        win.put(torch.ones(3), right, target_disp=6)
    for sizes in ([-2], [-1, -1], [2.0]):  # torch's own errors before
        with pytest.raises(GroupcoordValueError, match="sizes must be ints"):
            win.get_tensor(right, sizes, torch.float32)
    with pytest.raises(GroupcoordValueError, match="in whole rows of 3"):
        win.get_tensor(right, [-1, 3], torch.float32)  # 8 elements are not rows of 3
    assert win.get_tensor(right, [-1, 2], torch.float32, 2).shape == (3, 2)
    with pytest.raises(GroupcoordTypeError, match="dtype"):
        win.put(torch.ones(1, dtype=torch.int64), right)
    with pytest.raises(GroupcoordValueError, match="dst_rank"):
        win.put(torch.ones(1), world_size)
    with pytest.raises(GroupcoordValueError, match="cmp_op"):
        win.wait_signal(signal_disp=0, signal_val=0, cmp_op="approx")
    with pytest.raises(GroupcoordTimeoutError, match=rf"wait_signal timed out .*\[{left}\]"):
        win.wait_signal(peer_rank=left, timeout=0.3)

    comm.barrier()
    held = win.get_tensor()
    win.tensor_deregister()
    # A view kept past deregistration stays readable (the mapping lives on with it).
    assert held[2:4].tolist() == [1000.0 * (_ITERS - 1) + left, -1.0 * (_ITERS - 1)]
    del held
    # Puts landed in the registered tensor once it was deregistered.
    assert original[2:4].tolist() == [1000.0 * (_ITERS - 1) + left, -1.0 * (_ITERS - 1)]

    # Ranks that disagree on the dtype all refuse, and the window stays usable.
    with pytest.raises(GroupcoordTypeError, match="different dtypes"):
        win.tensor_register(torch.zeros(2, dtype=torch.float32 if rank else torch.float64))

    # window_allocate: a byte window, typed per view.
    buf = win.window_allocate(64)
    assert buf.dtype == torch.uint8 and buf.numel() == 64 and int(buf.sum()) == 0
    comm.barrier()
    win.put(torch.tensor([rank + 1], dtype=torch.int32), right, target_disp=rank)
    win.signal(dst_rank=right)
    win.wait_signal(peer_rank=left)
    assert win.get_tensor(rank, [1], torch.int32, left).item() == left + 1
    comm.barrier()
    win.tensor_deregister()
    comm.finalize()
    return "ok"


def left_of_zero(world_size: int) -> int:
    return world_size - 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_window_put_signal_wait_across_processes(world_size: int) -> None:
    assert run_ranks(_window_ring, world_size, timeout=90) == ["ok"] * world_size


def _peer_exits(rank: int, world_size: int) -> float:
    comm = new_comm("gloo", "cpu", "windead", timeout=30)
    win = comm.new_window()
    win.tensor_register(torch.zeros(4))
    comm.barrier()
    if rank == 1:
        os._exit(0)  # leaves without signalling
    start = time.monotonic()
    with pytest.raises(PeerDiedError, match=r"wait_signal failed: peer rank\(s\) \[1\] died"):
        win.wait_signal(peer_rank=1, timeout=20)
    comm.abort()
    return time.monotonic() - start


def test_window_wait_detects_a_dead_peer() -> None:
    elapsed, _ = start_ranks(_peer_exits, 2, timeout=60).collect(killed=[1])
    assert elapsed < 5.0
