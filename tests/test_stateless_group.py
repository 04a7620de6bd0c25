"""StatelessProcessGroup over a TCPStore, with real forked ranks."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.distributed import ReduceOp

from coordinator.errors import DesyncError, GroupcoordTimeoutError, GroupcoordValueError
from coordinator.launch import run_ranks, start_ranks
from coordinator.stateless_group import StatelessProcessGroup


def _join(rank: int, world_size: int, timeout: float | None = None) -> StatelessProcessGroup:
    port = int(os.environ["MASTER_PORT"])
    return StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, timeout=timeout)


def _every_call(rank: int, world_size: int) -> dict:
    group = _join(rank, world_size, timeout=30)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    for i in range(3):
        group.send_obj({"from": rank, "i": i, "t": (1, 2.5, "x")}, dst=nxt)
    got = [group.recv_obj(src=prev) for _ in range(3)]
    bcast = [
        group.broadcast_obj([src, b"\x00\xff"] if rank == src else None, src=src)
        for src in range(world_size)
    ]
    gathered = group.all_gather_obj({"rank": rank, "sq": rank * rank})
    group.barrier()
    # Readers never delete: each rank expires the keys it wrote (vLLM's scheme).
    mine = [key for key, _ in group.entries]
    group.data_expiration_seconds = 0.2
    time.sleep(0.3)
    group.barrier()  # a write: expires this rank's older keys first
    assert group.store is not None
    still_there = [k for k in mine if group.store.check([k])]
    group.close()
    return {"got": got, "bcast": bcast, "gathered": gathered, "still_there": still_there}


def test_every_call_on_three_ranks_and_each_writer_expires_its_keys() -> None:
    results = run_ranks(_every_call, 3, timeout=60)
    for rank, res in enumerate(results):
        prev = (rank - 1) % 3
        assert res["got"] == [{"from": prev, "i": i, "t": (1, 2.5, "x")} for i in range(3)]
        assert res["bcast"] == [[src, b"\x00\xff"] for src in range(3)]
        assert res["gathered"] == [{"rank": r, "sq": r * r} for r in range(3)]
    assert all(res["still_there"] == [] for res in results)


def _absent_rank(rank: int, world_size: int) -> str:
    group = _join(rank, world_size, timeout=30)
    if rank == 2:
        time.sleep(2.5)
        group.barrier(timeout=30)
        group.close()
        return "late"
    start = time.monotonic()
    with pytest.raises(GroupcoordTimeoutError) as info:
        group.barrier(timeout=1.0)
    assert time.monotonic() - start < 5
    assert info.value.missing == [2]
    # The late rank does arrive; the rank that timed out joins again and all proceed.
    group.barrier(timeout=30)
    group.close()
    return str(info.value)


def test_barrier_timeout_names_the_absent_rank() -> None:
    results = run_ranks(_absent_rank, 3, timeout=60)
    assert "barrier timed out after 1 s" in results[0]
    assert "waiting for ranks [2]" in results[0]


def _bad_then_good(rank: int, world_size: int) -> list[str]:
    group = _join(rank, world_size, timeout=30)
    errors = []
    for call in (
        lambda: group.send_obj(1, dst=rank),
        lambda: group.send_obj(1, dst=world_size),
        lambda: group.recv_obj(src=-1),
        lambda: group.broadcast_obj(1, src=7),
    ):
        with pytest.raises(GroupcoordValueError) as info:
            call()
        errors.append(str(info.value))
    with pytest.raises(TypeError):
        group.send_obj(object(), dst=1 - rank)
    with pytest.raises(
        GroupcoordTimeoutError, match=rf"recv_obj.*waiting for ranks \[{1 - rank}\]"
    ):
        group.recv_obj(src=1 - rank, timeout=0.3)
    group.barrier()
    assert group.broadcast_obj("ok" if rank == 0 else None, src=0) == "ok"
    group.close()
    return errors


def test_bad_arguments_raise_at_the_call_site_and_the_group_stays_usable() -> None:
    errors = run_ranks(_bad_then_good, 2, timeout=60)[0]
    assert "dst=0 is this rank itself" in errors[0]
    assert "dst=2 is not a rank of this group" in errors[1]
    assert "src=-1" in errors[2]
    assert "src=7" in errors[3]


def _calls_that_differ(rank: int, world_size: int) -> tuple[list[str], list, list]:
    group = _join(rank, world_size, timeout=30)
    last = rank == world_size - 1  # the one rank whose call differs
    messages = []
    for call in (
        # Another shape: the sum broadcast a [1] into the others' [4].
        lambda: group.all_reduce(torch.ones(1 if last else 4)),
        # Another dtype: promoted silently; another op: each rank its own result.
        lambda: group.all_reduce(torch.ones(4, dtype=torch.int64 if last else torch.float32)),
        lambda: group.all_reduce(torch.ones(4), ReduceOp.MAX if last else ReduceOp.SUM),
        # Another collective: the all-reduce added the gathered 5 to its tensor.
        lambda: group.all_gather_obj(5) if last else group.all_reduce(torch.ones(4)),
        lambda: group.all_gather_obj({"x": 1}) if last else group.barrier(),
    ):
        with pytest.raises(DesyncError) as info:
            call()
        messages.append(str(info.value))
    # Still in step and usable.
    gathered = group.all_gather_obj(rank)
    total = group.all_reduce(torch.full((2,), float(rank))).tolist()
    group.close()
    return messages, gathered, total


def test_calls_that_differ_raise_on_every_rank_naming_both() -> None:
    results = run_ranks(_calls_that_differ, 3, timeout=60)
    for rank, (messages, gathered, total) in enumerate(results):
        other = "rank 0" if rank == 2 else "rank 2"
        assert "all_reduce(float32[1], SUM)" in messages[0] and other in messages[0]
        assert "all_reduce(float32[4], SUM)" in messages[0]
        assert "all_reduce(int64[4], SUM)" in messages[1]
        assert "all_reduce(float32[4], MAX)" in messages[2]
        assert "all_gather_obj()" in messages[3] and "all_reduce(float32[4], SUM)" in messages[3]
        assert "all_gather_obj()" in messages[4] and "barrier()" in messages[4]
        assert gathered == [0, 1, 2]
        assert total == [3.0, 3.0]


def test_create_refuses_a_rank_outside_the_world() -> None:
    with pytest.raises(GroupcoordValueError, match="rank=2 is not in range"):
        StatelessProcessGroup.create("127.0.0.1", 1, 2, 2)


def _queue_over_stateless_group(rank: int, world_size: int) -> list:
    from shm_broadcast.message_queue import MessageQueue

    group = _join(rank, world_size, timeout=30)
    mq = MessageQueue.create_from_process_group(group, 1 << 16, 4, writer_rank=1)
    got = [mq.broadcast_object({"step": i} if rank == 1 else None) for i in range(5)]
    group.barrier()
    mq.shutdown()
    group.close()
    return got


def test_a_message_queue_builds_over_a_stateless_group() -> None:
    results = run_ranks(_queue_over_stateless_group, 3, timeout=60)
    assert all(r == [{"step": i} for i in range(5)] for r in results)


def _no_store_host(rank: int, world_size: int) -> str:
    port = int(os.environ["MASTER_PORT"])  # nobody listens there
    start = time.monotonic()
    with pytest.raises(GroupcoordTimeoutError) as info:
        StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=1.0)
    assert time.monotonic() - start < 10
    assert info.value.missing == [0]
    return str(info.value)


def test_joining_without_a_store_host_times_out_naming_rank_0() -> None:
    message = run_ranks(_no_store_host, 1, timeout=60)[0]
    assert "connect timed out after 1 s waiting for ranks [0]" in message


def _host_returns_first(rank: int, world_size: int) -> dict | None:
    group = _join(rank, world_size, timeout=30)
    value = group.broadcast_obj({"step": 1} if rank == 0 else None, src=0)
    everyone = group.all_gather_obj(rank)
    group.barrier()
    if rank == 0:
        os._exit(0)  # the store host returns and exits at once, as vLLM's test workers do
    time.sleep(0.2)  # the host is gone by now: nothing here may need the store any more
    return {"value": value, "everyone": everyone}


def test_ranks_finish_when_the_store_host_returns_and_exits_first() -> None:
    for _ in range(5):
        group = start_ranks(_host_returns_first, 3, timeout=60)
        results = group.collect(killed=[0])
        assert results[1:] == [{"value": {"step": 1}, "everyone": [0, 1, 2]}] * 2


def _store_host_gone(rank: int, world_size: int) -> str:
    group = _join(rank, world_size, timeout=30)
    group.barrier()
    if rank == 0:
        os._exit(0)
    time.sleep(0.5)
    try:
        group.recv_obj(src=0, timeout=5)
    except ConnectionError as exc:  # PeerDiedError naming the store host
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_call_after_the_store_host_left_names_it() -> None:
    group = start_ranks(_store_host_gone, 2, timeout=60)
    message = group.collect(killed=[0])[1]
    assert message.startswith("PeerDiedError") and "rank 0" in message, message
