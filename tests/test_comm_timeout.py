"""A missing peer: bounded waits, errors naming op/communicator/peers, clean abort."""

from __future__ import annotations

import os
import time

import pytest
import torch

from coordinator.comm import WorkStatus, new_comm, recv_object_list
from coordinator.errors import ClosedError, GroupcoordTimeoutError, PeerDiedError
from coordinator.launch import run_ranks, start_ranks


def _last_rank_missing(rank: int, world_size: int) -> float:
    absent = world_size - 1
    watched = new_comm("gloo", "cpu", "watched", timeout=30)
    async_comm = new_comm("gloo", "cpu", "to-async", timeout=30)
    sync_comm = new_comm("gloo", "cpu", "to-sync", timeout=30)
    abort_comm = new_comm("gloo", "cpu", "to-abort", timeout=30)
    obj_comm = new_comm("gloo", "cpu", "to-obj", timeout=30)
    # The ranks that take part leave together: rank 0 hosts the TCPStore, and when
    # it left first a later rank's lazy channel set-up (recv_object_list) failed.
    others = [r for r in range(world_size) if r != absent]
    present = watched.split([] if rank == absent else others, "present")
    if rank == absent:
        time.sleep(6)  # alive but never joins: a timeout, not a dead peer
        return 0.0

    with pytest.raises(GroupcoordTimeoutError) as caught:
        watched.monitored_barrier(timeout=1.0)
    assert caught.value.missing == [absent]
    assert "'watched': monitored_barrier timed out after 1 s" in str(caught.value)
    assert f"waiting for ranks [{absent}]" in str(caught.value)

    start = time.monotonic()
    work = async_comm.all_reduce(torch.ones(2), async_op=True, timeout=1.0)
    assert not work.is_completed()
    with pytest.raises(GroupcoordTimeoutError) as caught:
        work.wait()
    elapsed = time.monotonic() - start
    assert work.status is WorkStatus.TIMED_OUT
    message = str(caught.value)
    assert "communicator 'to-async': all_reduce timed out after 1 s" in message
    # The shared-memory path sees which rank never arrived: exactly that one is named.
    assert caught.value.missing == [absent], message
    assert f"waiting for ranks [{absent}]" in message
    with pytest.raises(ClosedError, match="all_reduce timed out earlier"):
        async_comm.barrier()
    async_comm.abort()
    assert work.status is WorkStatus.TIMED_OUT
    with pytest.raises(ClosedError, match="aborted"):
        async_comm.all_reduce(torch.ones(1))

    with pytest.raises(GroupcoordTimeoutError, match="'to-sync': barrier timed out after 0.5 s"):
        sync_comm.barrier(timeout=0.5)
    sync_comm.abort()

    # Object collectives honour their timeout too.
    with pytest.raises(GroupcoordTimeoutError, match=rf"'to-obj': recv timed out .*\[{absent}\]"):
        recv_object_list(obj_comm, [None], src=absent, timeout=0.5)
    obj_comm.abort()

    # Aborting with an op in flight: it becomes ABORTED at once, nothing hangs.
    work = abort_comm.all_reduce(torch.ones(2), async_op=True)
    abort_start = time.monotonic()
    abort_comm.abort()
    with pytest.raises(ClosedError, match="all_reduce aborted"):
        work.wait()
    assert work.status is WorkStatus.ABORTED
    assert time.monotonic() - abort_start < 1.0
    assert present is not None
    present.barrier()
    present.finalize()
    return elapsed


@pytest.mark.parametrize("world_size", [2, 4])
def test_timeout_on_a_missing_peer_names_it(world_size: int) -> None:
    elapsed = run_ranks(_last_rank_missing, world_size, timeout=60)[:-1]
    assert all(0.9 < t < 5.0 for t in elapsed), elapsed


def _one_rank_exits(rank: int, world_size: int) -> str:
    comm = new_comm("gloo", "cpu", "dies", timeout=30)
    last = world_size - 1
    # The survivors stay alive until every one has checked its error: a rank
    # that exits early would itself (truthfully) be reported dead.
    survivors = comm.split([] if rank == last else list(range(last)), "survivors")
    comm.barrier()
    if rank == last:
        os._exit(0)
    assert survivors is not None
    start = time.monotonic()
    with pytest.raises((PeerDiedError, GroupcoordTimeoutError)) as caught:
        comm.all_reduce(torch.ones(4), timeout=3.0)
    assert time.monotonic() - start < 6.0
    comm.abort()
    outcome = "timeout"  # a rank whose ring neighbours gave up before it heard of the death
    if isinstance(caught.value, PeerDiedError):
        # Only the rank that is gone is named, not every peer of the op.
        assert caught.value.dead == [last], str(caught.value)
        outcome = "died"
    survivors.barrier()
    survivors.finalize()
    return outcome  # a rank whose ring neighbours gave up before it heard of the death


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_dead_peer_is_named(world_size: int) -> None:
    outcomes = start_ranks(_one_rank_exits, world_size, timeout=60).collect(
        killed=[world_size - 1]
    )[:-1]
    assert "died" in outcomes, outcomes
