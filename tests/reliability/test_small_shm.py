"""/dev/shm too small: creation refuses with a clear message, nothing is left behind.

A 1 MiB tmpfs is mounted (we run as root here) and ranks point the config's
``shm_dir`` at it with ``set_config`` (the parent has already read the
environment, and forked ranks inherit that config). Then a message queue ring, a
shared-memory all-reduce buffer, a ``coordinator.comm`` window and a plain
segment are asked for more than it holds.
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


@pytest.fixture
def small_shm(tmp_path: Any) -> Iterator[str]:
    mount = os.path.join(str(tmp_path), "shm")
    os.mkdir(mount)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mount], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
        assert os.listdir(mount) == [], f"left in the small shm dir: {os.listdir(mount)}"
    finally:
        subprocess.run(["umount", mount], check=True)


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

    set_config(shm_dir=mount)
    out: dict[str, str] = {}
    if rank == 0:
        out["MessageQueue ring 4 x 1 MiB"] = _attempt(
            lambda: MessageQueue(1, 1, [1], 1 << 20, 4).shutdown()
        )
    init_gloo(rank, world)
    pg = dist.group.WORLD
    comm = CpuCommunicator(pg, torch.device("cpu"), pg, unique_name="small")
    reason = comm.shm_all_reduce.disabled_reason
    out[f"ShmAllReduce (rank {rank})"] = f"disabled: {reason}"
    assert torch.equal(comm.all_reduce(torch.ones(4)), torch.full((4,), 2.0)), "Gloo took over"
    comm.destroy()
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
    # The creating rank says why; the others say which rank could not create it.
    reason = merged["ShmAllReduce (rank 0)"]
    assert reason.startswith("disabled: ") and _clear(reason, small_shm), reason
    assert "rank 0" in merged["ShmAllReduce (rank 1)"], merged["ShmAllReduce (rank 1)"]
    for rank in range(2):
        window = merged[f"comm window 4 MiB (rank {rank})"]
        assert "ShmSpaceError" in window or "BackendUnavailable" in window, window
