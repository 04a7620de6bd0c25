"""Shared-memory segments: created reserved, named for clean-up, never left behind."""

from __future__ import annotations

import os
import time

import pytest

from coordinator.launch import run_ranks, start_ranks
from shm_broadcast import ShmSpaceError, override
from shm_broadcast.segments import (
    ShmSegment,
    cleanup_owned_segments,
    cleanup_stale_segments,
    list_segments,
    shm_path,
)


def test_create_attach_share_bytes_and_unlink() -> None:
    seg = ShmSegment.create(4096, tag="t")
    try:
        assert seg.name.startswith(f"groupcoord_{os.getpid()}_t_")
        other = ShmSegment.attach(seg.name)
        seg.buf[:5] = b"hello"
        assert bytes(other.buf[:5]) == b"hello"
        other.close()
    finally:
        seg.close()
        seg.unlink()
    assert not os.path.exists(shm_path(seg.name))


def test_oversize_segment_is_refused_with_the_free_space() -> None:
    with pytest.raises(ShmSpaceError, match="has only .* bytes free"):
        ShmSegment.create(1 << 60, tag="huge")


def test_full_tmpfs_is_refused_at_creation(tmp_path) -> None:
    # A plain directory stands in for a tiny shm dir: statvfs reports its disk,
    # so ask for more than that disk has free.
    with override(shm_dir=str(tmp_path)):
        st = os.statvfs(tmp_path)
        with pytest.raises(ShmSpaceError):
            ShmSegment.create(st.f_bavail * st.f_frsize + (1 << 30), tag="big")
        assert os.listdir(tmp_path) == []


def test_owned_segments_are_cleaned_up() -> None:
    seg = ShmSegment.create(1024, tag="own")
    seg.close()
    assert cleanup_owned_segments() == 1
    assert seg.name not in list_segments()


def _create_and_return(names) -> None:
    names.put(ShmSegment.create(1024, tag="child").name)


def test_a_multiprocessing_child_unlinks_what_it_created_when_it_returns() -> None:
    # A multiprocessing worker ends with os._exit after multiprocessing's own exit
    # hooks, never running atexit: the segment must go anyway.
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    names = ctx.Queue()
    child = ctx.Process(target=_create_and_return, args=(names,))
    child.start()
    name = names.get(timeout=20)
    child.join(20)
    assert child.exitcode == 0
    assert name not in list_segments()


def _create_and_wait(rank: int, world_size: int) -> None:
    ShmSegment.create(1024, tag="orphan")
    time.sleep(30)


def test_segments_of_a_killed_creator_are_removed_by_stale_cleanup() -> None:
    group = start_ranks(_create_and_wait, 1, timeout=20.0)
    prefix = f"groupcoord_{group.pid(0)}_orphan_"
    # A loaded machine can take seconds to run the new rank: wait for its segment
    # (not a fixed time), so the kill always lands after the creation.
    deadline = time.monotonic() + 15.0
    while not any(n.startswith(prefix) for n in list_segments()):
        assert time.monotonic() < deadline, "the rank never created its segment"
        time.sleep(0.01)
    group.kill(0)
    # Reap it first: collect() itself sweeps when it finds the rank still exiting
    # (its pipe closes before it is a zombie), which would leave nothing to test here.
    group.procs[0].join(10)
    assert group.procs[0].exitcode is not None
    removed = cleanup_stale_segments()
    assert any(n.startswith(prefix) for n in removed)
    assert not any(n.startswith(prefix) for n in list_segments())
    group.collect(killed=[0])


def test_bad_names_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="segment size"):
        ShmSegment.create(0)
    with pytest.raises(ValueError, match="not a groupcoord segment"):
        ShmSegment.attach("../etc/passwd")


def _read_tensor_after_close(rank: int, world_size: int) -> int:
    import torch

    seg = ShmSegment.create(1 << 16, tag="view")
    whole = torch.frombuffer(seg.buf, dtype=torch.uint8)
    part = torch.frombuffer(seg.buf[16:32], dtype=torch.uint8)
    whole[:20] = 3
    seg.close()
    seg.unlink()
    return int(whole[:4].sum()) + int(part.sum())


def test_tensors_over_a_closed_segment_stay_readable() -> None:
    # Before the fix, close() unmapped memory under `whole` and the rank segfaulted.
    assert run_ranks(_read_tensor_after_close, 1, timeout=30.0) == [12 + 12]


def test_check_shm_free_space_names_the_allocation_and_the_shortfall() -> None:
    from shm_broadcast import check_shm_free_space

    check_shm_free_space(1)  # plenty
    with pytest.raises(ShmSpaceError, match=r"10\d* byte KV arena: .* has only"):
        check_shm_free_space(10**18, allocation_name="KV arena")
    with pytest.raises(OSError):  # ShmSpaceError is an OSError, as vLLM's callers expect
        check_shm_free_space(10**18, "/dev/shm")


_CREATING_THREAD = """
import atexit, threading, time
# Registered before groupcoord's, so it runs after its clean-up (atexit runs the
# last registered first): an exit handler of a library imported earlier.
atexit.register(time.sleep, 0.05)
from shm_broadcast.segments import ShmSegment

def create_forever():
    kept = []
    while True:
        kept.append(ShmSegment.create(4096, tag="late"))
        if len(kept) > 20:
            old = kept.pop(0)
            old.close()
            old.unlink()

threading.Thread(target=create_forever, daemon=True).start()
time.sleep(0.05)
print("exiting", flush=True)
"""


def _late_segments(pid: int) -> list[str]:
    return [n for n in list_segments() if n.startswith(f"groupcoord_{pid}_late_")]


def test_a_thread_creating_segments_as_its_process_exits_leaves_none() -> None:
    # A daemon thread goes on running after the exit clean-up (through the exit
    # handlers after it, until the interpreter ends): a segment it made then was
    # left in /dev/shm. It is refused instead. Before the fix every such exit left
    # segments behind.
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for _ in range(5):
        child = subprocess.run(
            [sys.executable, "-c", _CREATING_THREAD],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0 and "exiting" in child.stdout, child.stderr
        # The child's pid is gone now; its segments carry it in their names.
        left = [n for n in list_segments() if "_late_" in n]
        for name in left:
            os.unlink(shm_path(name))
        assert left == [], child.stderr
