"""/dev/shm too small: creation refuses with a clear message, our own buffers
shrink to fit where they can, nothing is left behind.

A 1 MiB tmpfs is mounted (we run as root here) and ranks point the config's
``shm_dir`` at it with ``set_config`` (the parent has already read the
environment, and forked ranks inherit that config). Then a message queue ring, a
shared-memory all-reduce buffer, a ``coordinator.comm`` window and a plain
segment are asked for more than it holds. A 64 MiB one (Docker's default) runs
a TP 2 x PP 2 engine.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator.launch import init_gloo, run_ranks

from ._common import report


def _tmpfs(tmp_path: Any, size: str) -> Iterator[str]:
    mount = os.path.join(str(tmp_path), "shm")
    os.mkdir(mount)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mount],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
        assert os.listdir(mount) == [], f"left in the small shm dir: {os.listdir(mount)}"
    finally:
        subprocess.run(["umount", mount], check=True)


@pytest.fixture
def small_shm(tmp_path: Any) -> Iterator[str]:
    yield from _tmpfs(tmp_path, "1m")


@pytest.fixture
def container_shm(tmp_path: Any) -> Iterator[str]:
    """Docker's default /dev/shm: 64 MiB."""
    yield from _tmpfs(tmp_path, "64m")


def _attempt(call: Any) -> str:
    try:
        made = call()
    except Exception as exc:  # noqa: BLE001 - judged by the test
        return f"{type(exc).__name__}: {exc}"
    if hasattr(made, "unlink"):  # a segment that should not exist: do not leave it
        made.close()
        made.unlink()
    return "created"


def _segments(rank: int, world: int, mount: str) -> dict[str, str]:
    from shm_broadcast.config import set_config
    from shm_broadcast.segments import ShmSegment

    set_config(shm_dir=mount)
    out = {"segment 2 MiB": _attempt(lambda: ShmSegment.create(2 << 20, "big"))}
    first = ShmSegment.create(700 << 10, "first")
    try:
        # Passes the free-space check only if the first one's pages were not reserved.
        out["second segment 700 KiB"] = _attempt(lambda: ShmSegment.create(700 << 10, "second"))
    finally:
        first.close()
        first.unlink()
    return out


def _queue_and_all_reduce(rank: int, world: int, mount: str) -> dict[str, str]:
    from coordinator.comm import new_comm
    from device_communicators.cpu_communicator import CpuCommunicator
    from shm_broadcast.config import set_config
    from shm_broadcast.message_queue import MessageQueue
    from shm_broadcast.segments import ShmSegment

    set_config(shm_dir=mount)
    out: dict[str, str] = {}
    if rank == 0:
        out["MessageQueue ring 4 x 1 MiB"] = _attempt(
            lambda: MessageQueue(1, 1, [1], 1 << 20, 4).shutdown()
        )
    init_gloo(rank, world)
    pg = dist.group.WORLD
    # The whole MiB free: the usual slots (4 MiB) do not fit, the small ones do.
    comm = CpuCommunicator(pg, torch.device("cpu"), pg, unique_name="small")
    shm = comm.shm_all_reduce
    out[f"ShmAllReduce, 1 MiB free (rank {rank})"] = (
        f"slots of {shm.max_bytes} bytes" if shm.disabled_reason is None else shm.disabled_reason
    )
    assert torch.equal(comm.all_reduce(torch.ones(4)), torch.full((4,), 2.0))
    comm.destroy()
    dist.barrier()  # every rank unmapped them: their pages are free again
    # Nearly full: not even the small slots fit.
    filler = ShmSegment.create(900 << 10, "filler") if rank == 0 else None
    dist.barrier()
    try:
        comm = CpuCommunicator(pg, torch.device("cpu"), pg, unique_name="full")
        reason = comm.shm_all_reduce.disabled_reason
        out[f"ShmAllReduce (rank {rank})"] = f"disabled: {reason}"
        assert torch.equal(comm.all_reduce(torch.ones(4)), torch.full((4,), 2.0)), "Gloo took over"
        comm.destroy()
    finally:
        if filler is not None:
            filler.close()
            filler.unlink()
    c = new_comm("gloo", "cpu", "small", timeout=30)
    try:
        out[f"comm window 4 MiB (rank {rank})"] = _attempt(
            lambda: c.new_window().window_allocate(4 << 20)
        )
    finally:
        c.abort()
    return out


def _clear(message: str, mount: str) -> bool:
    return mount in message and "bytes" in message


def test_segments_refuse_a_full_shm_dir(small_shm: str) -> None:
    (out,) = run_ranks(_segments, 1, small_shm, timeout=60)
    report("small /dev/shm: segments", **out)
    for label, message in out.items():
        assert message.startswith("ShmSpaceError") and _clear(message, small_shm), (label, message)


def test_queue_all_reduce_and_window_refuse_a_full_shm_dir(small_shm: str) -> None:
    results = run_ranks(_queue_and_all_reduce, 2, small_shm, timeout=90)
    merged = {k: v for r in results for k, v in r.items()}
    report("small /dev/shm: queue, all-reduce, window", **merged)
    ring = merged["MessageQueue ring 4 x 1 MiB"]
    assert ring.startswith("ShmSpaceError") and _clear(ring, small_shm), ring
    from device_communicators.shm_slots import SMALL_SLOT_BYTES

    for rank in range(2):
        assert merged[f"ShmAllReduce, 1 MiB free (rank {rank})"] == (
            f"slots of {SMALL_SLOT_BYTES} bytes"
        )
    # The creating rank says why; the others say which rank could not create it.
    reason = merged["ShmAllReduce (rank 0)"]
    assert reason.startswith("disabled: ") and _clear(reason, small_shm), reason
    assert "rank 0" in merged["ShmAllReduce (rank 1)"], merged["ShmAllReduce (rank 1)"]
    for rank in range(2):
        window = merged[f"comm window 4 MiB (rank {rank})"]
        assert "ShmSpaceError" in window or "BackendUnavailable" in window, window


def _engine_in_a_container(rank: int, world: int, mount: str) -> dict[str, Any]:
    from coordinator import parallel_state as ps
    from shm_broadcast.config import set_config

    set_config(shm_dir=mount)
    ps.init_distributed_environment(backend="gloo", timeout=60)
    ps.initialize_model_parallel(2, 2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    try:
        big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: more than a small ring
        step = tp.broadcast_object({"step": 1} if tp.rank_in_group == 0 else None)
        got = tp.broadcast_tensor_dict({"x": big} if tp.rank_in_group == 0 else None)
        if pp.rank_in_group == 0:
            pp.send_tensor_dict({"h": big * 2, "n": 3}, dst=1)
            sent = pp.recv_tensor_dict(src=1)
        else:
            sent = pp.recv_tensor_dict(src=0)
            pp.send_tensor_dict(sent, dst=0)
        return {
            "step": step,
            "broadcast whole": torch.equal(got["x"], big),
            "sent whole": torch.equal(sent["h"], big * 2) and sent["n"] == 3,
            "tp all_reduce": tp.all_reduce(torch.ones(4)).tolist(),
            "queue chunks": None if tp.mq_broadcaster is None else tp.mq_broadcaster.max_chunks,
        }
    finally:
        ps.destroy_distributed_environment()


def test_an_engine_runs_in_a_containers_64_mib_of_shm(container_shm: str) -> None:
    """TP 2 x PP 2 in Docker's default /dev/shm, where the two TP queues' usual
    rings (40 MiB each) and the PP channels' (64 MiB each) cannot all fit: the
    groups take small rings, or go on without (Gloo for a pair's dicts), and
    every call still returns the right values."""
    results = run_ranks(_engine_in_a_container, 4, container_shm, timeout=120)
    report(
        "64 MiB /dev/shm: TP 2 x PP 2",
        **{f"rank {r} queue chunks": res["queue chunks"] for r, res in enumerate(results)},
    )
    for res in results:
        assert res["step"] == {"step": 1}
        assert res["broadcast whole"] and res["sent whole"]
        assert res["tp all_reduce"] == [2.0] * 4
