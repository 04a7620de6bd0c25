"""A missing peer: bounded waits, errors naming op/communicator/peers, clean abort."""

from __future__ import annotations

import os
import time

import pytest
import torch

from coordinator.comm import WorkStatus, new_comm, recv_object_list
from coordinator.errors import ClosedError, GroupcoordTimeoutError, PeerDiedError
from coordinator.launch import run_ranks, start_ranks
from shm_broadcast.config import set_config


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


def _dies_after_a_send(rank: int, world_size: int, shm: bool) -> str:
    set_config(disable_shm_all_reduce=not shm)
    comm = new_comm("gloo", "cpu", "dies-after-send", timeout=5)
    if rank == 1:
        comm.send(torch.ones(8), 0)
        comm.send(torch.full((8,), 2.0), 0)  # for a receive after an all_reduce ...
        os._exit(0)  # ... which rank 1 never joins
    first = torch.zeros(8)
    comm.recv(first, 1)
    with pytest.raises((PeerDiedError, GroupcoordTimeoutError)):
        comm.all_reduce(torch.ones(4))
    # The ranks' calls now disagree: rank 1's second message was meant for a call
    # after an all_reduce it never made. Until 2026-11-29 a comm whose Gloo
    # all_reduce lost its peer went on, and this receive returned 2.0.
    second = torch.zeros(8)
    with pytest.raises(ClosedError, match="all_reduce (lost a peer|timed out) earlier"):
        comm.recv(second, 1)
    assert not second.any()
    comm.abort()
    return "refused"


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_a_comm_that_lost_a_peer_in_a_collective_refuses_the_calls_after_it(shm: bool) -> None:
    ranks = start_ranks(_dies_after_a_send, 2, shm, timeout=60)
    assert ranks.collect(killed=[1]) == ["refused", None]
