"""Gloo's bare RuntimeErrors become groupcoord errors naming the group, the call and the peers."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator.launch import init_gloo, start_ranks
from shm_broadcast.errors import GroupcoordTimeoutError, PeerDiedError
from shm_broadcast.gloo_errors import failure_kind, gloo_errors, translate_gloo_error

GLOO_TIMEOUT = (
    "[/gloo/transport/tcp/unbound_buffer.cc:81] "
    "Timed out waiting 500ms for recv operation to complete"
)
GLOO_CLOSED = "[/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"


def _pid_that_cannot_exist() -> int:
    with open("/proc/sys/kernel/pid_max") as fh:
        return int(fh.read())  # pids are always below pid_max


def test_failure_kind_reads_gloos_text() -> None:
    assert failure_kind(RuntimeError(GLOO_TIMEOUT)) == "timeout"
    assert failure_kind(RuntimeError(GLOO_CLOSED)) == "peer gone"
    assert failure_kind(RuntimeError("Read error: Connection reset by peer")) == "peer gone"
    assert failure_kind(RuntimeError("Invalid scalar type")) is None


def test_timeout_names_what_operation_peers_and_the_gloo_deadline() -> None:
    raw = RuntimeError(GLOO_TIMEOUT)
    error = translate_gloo_error(raw, "tp", "recv", None, peers=[3])
    assert isinstance(error, GroupcoordTimeoutError)
    assert error.missing == [3] and error.timeout_s == 0.5
    assert str(error).startswith("tp: recv timed out after 0.5 s waiting for ranks [3]")
    assert error.transport_error is raw


def test_closed_connection_names_only_the_dead_peer_when_a_pid_shows_it() -> None:
    raw = RuntimeError(GLOO_CLOSED)
    gone = _pid_that_cannot_exist()
    error = translate_gloo_error(
        raw, "tp", "all_reduce", None, peers=[1, 2, 3], pids={1: os.getpid(), 2: gone}
    )
    assert isinstance(error, PeerDiedError)
    assert error.dead == [2]
    assert error.transport_error is raw


def test_closed_connection_without_pids_lists_every_possible_peer() -> None:
    error = translate_gloo_error(RuntimeError(GLOO_CLOSED), "tp", "all_reduce", None, [2, 1])
    assert isinstance(error, PeerDiedError)
    assert error.dead == [1, 2]
    assert "which of these ranks is unknown" in str(error)


def test_a_closed_connection_every_rank_reached_names_no_rank_dead() -> None:
    """Every rank posted its arrival and none is dead, yet the transport says a
    peer closed its connection (its own call timed out first, say): the error
    said "peer rank(s) [] died". It still closes the group (the pair is gone)."""
    from coordinator.failures import classify

    error = classify("tp:0", "all_reduce", 2.0, [], RuntimeError(GLOO_CLOSED))
    assert isinstance(error, PeerDiedError) and error.dead == []
    assert "[] died" not in str(error), str(error)
    assert "tp:0: all_reduce failed: a peer closed its connection, though none is known dead" in (
        str(error)
    )


def test_a_dead_peer_wins_over_the_timeout_text() -> None:
    gone = _pid_that_cannot_exist()
    error = translate_gloo_error(RuntimeError(GLOO_TIMEOUT), "tp", "recv", None, [5], {5: gone})
    assert isinstance(error, PeerDiedError) and error.dead == [5]


def test_other_runtime_errors_pass_through_unchanged() -> None:
    raw = RuntimeError("Invalid scalar type")
    assert translate_gloo_error(raw, "tp", "all_reduce", None, [1]) is None
    with pytest.raises(RuntimeError) as info, gloo_errors("tp", "all_reduce", None, [1]):
        raise raw
    assert info.value is raw


def test_context_manager_raises_ours_from_gloos() -> None:
    with pytest.raises(GroupcoordTimeoutError) as info, gloo_errors("mq", "set-up", None, [1]):
        raise RuntimeError(GLOO_TIMEOUT)
    assert isinstance(info.value.__cause__, RuntimeError)


# ---- real ranks: the peer's process exits, the survivor's Gloo call names it ----------


def _peer_exits(rank: int, world: int, call: str) -> Any:
    from device_communicators.cpu_communicator import CpuCommunicator
    from shm_broadcast.message_queue import MessageQueue

    init_gloo(rank, world, timeout_s=60)
    # A long deadline: the survivor must learn of the exit from the closed connection.
    pg = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    comm = CpuCommunicator(pg, torch.device("cpu"), pg, unique_name="gone")
    dist.barrier(group=pg)
    if rank == 1:
        os._exit(0)
    calls = {
        "CpuCommunicator.recv": lambda: comm.recv(torch.Size([8]), torch.float32, src=1),
        # What a group whose ranks do not share a node reduces with (pids known here).
        "Gloo all_reduce (the chain's last back end)": lambda: comm.all_reduce_chain.backends[
            -1
        ].all_reduce(torch.ones(8)),
        "MessageQueue.create_from_process_group": lambda: MessageQueue.create_from_process_group(
            pg, 1024, 2
        ).shutdown(),
    }
    pid_ranks = sorted(comm.peer_pids)  # exchanged by the shm set-up
    start = time.monotonic()
    try:
        calls[call]()
    except PeerDiedError as exc:
        return "PeerDiedError", exc.dead, str(exc), time.monotonic() - start, pid_ranks
    except Exception as exc:  # noqa: BLE001 - the test reports the wrong type
        return type(exc).__name__, [], str(exc), time.monotonic() - start, pid_ranks
    finally:
        comm.destroy()
    return "none", [], "returned", time.monotonic() - start, pid_ranks


@pytest.mark.parametrize(
    "call",
    [
        "CpuCommunicator.recv",
        "Gloo all_reduce (the chain's last back end)",
        "MessageQueue.create_from_process_group",
    ],
)
def test_exited_peer_is_named_by_the_survivors_gloo_call(call: str) -> None:
    survivor, _ = start_ranks(_peer_exits, 2, call, timeout=90).collect(killed=[1])
    kind, dead, message, took, pid_ranks = survivor
    assert pid_ranks == [1], "the communicator should know its same-host peer's pid"
    assert kind == "PeerDiedError", f"{call} raised {kind}: {message}"
    assert dead == [1], message
    assert "died" in message and ("gone" in message or "MessageQueue" in message), message
    assert took < 10.0, f"{call} took {took:.2f} s to notice"


def _every_rank_fails_alike(rank: int, world: int) -> tuple[str, str, bool]:
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.errors import TransportError

    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="alike")

    def refused() -> None:  # what Gloo raises for a call it refuses on every rank
        raise RuntimeError("[/gloo/allreduce.cc:90] Tensors must all have the same type")

    try:
        with pytest.raises(TransportError) as caught:
            group._collective("all_reduce", refused)
        usable = group.all_reduce(torch.ones(4)).tolist() == [float(world)] * 4
        return type(caught.value).__name__, str(caught.value), usable
    finally:
        group.destroy()


def test_a_failure_every_rank_reached_is_not_reported_as_a_dead_peer() -> None:
    """Every rank posted its arrival, none is dead, the transport's words name no
    gone peer: the error used to be PeerDiedError "peer rank(s) [] died ... which
    ranks is unknown (the store did not answer)", both claims untrue."""
    from coordinator.launch import run_ranks

    for kind, message, usable in run_ranks(_every_rank_fails_alike, 2, timeout=60):
        assert kind == "TransportError" and usable, (kind, message)
        assert "alike:0: all_reduce failed on every rank alike, none dead or late" in message
        assert "Tensors must all have the same type" in message


def _one_rank_fails_alone(rank: int, world: int) -> tuple[str, str, bool]:
    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="alone")

    def fails_here() -> None:  # a torch op that fails on this rank only
        raise NotImplementedError("\"copy_kernel\" not implemented for 'Int4'")

    try:
        kind, message = "none", ""
        try:
            group._collective("all_gather", fails_here if rank == 1 else lambda: None)
        except Exception as exc:  # noqa: BLE001 - the class is what the test checks
            kind, message = type(exc).__name__, str(exc)
        usable = group.all_reduce(torch.ones(4)).tolist() == [float(world)] * 4
        return kind, message, usable
    finally:
        group.destroy()


def test_a_failure_on_one_rank_alone_does_not_call_its_living_peers_dead() -> None:
    """Rank 1's call failed on its own (a torch op raised; rank 0's returned). Rank 0
    never posts an arrival for that call, and this used to report it as dead:
    PeerDiedError "peer rank(s) [0] died", while rank 0 lived and went on."""
    from coordinator.launch import run_ranks

    (kind0, _, usable0), (kind1, message, usable1) = run_ranks(_one_rank_fails_alone, 2, timeout=60)
    assert kind0 == "none" and usable0 and usable1
    assert kind1 == "TransportError", (kind1, message)
    assert "alone:0: all_gather failed on this rank" in message, message
    assert "copy_kernel" in message and "rank(s) [0] did not fail in this call" in message
    assert "died" not in message, message
