"""Peer liveness: a running pid is alive; a gone or zombie pid is dead."""

from __future__ import annotations

import os
import time

from shm_broadcast.liveness import pid_namespace, process_alive


def test_this_process_is_alive_and_has_a_pid_namespace() -> None:
    assert process_alive(os.getpid())
    assert pid_namespace() != 0


def test_an_unreaped_child_is_dead_and_so_is_a_reaped_one() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process_alive(pid), "a zombie must count as dead"
    finally:
        os.waitpid(pid, 0)
    assert not process_alive(pid)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


def test_a_killed_process_is_dead_while_it_still_tears_down() -> None:
    """A SIGKILLed process spends a while in states R and D freeing its memory
    (and closing its sockets) before it is a zombie: a peer whose Gloo call failed
    on the closed socket then still saw it alive, and one survivor of a kill test
    named a rank that left instead of the dead one (docs/RELIABILITY.md row 89).
    The kernel's PF_EXITING flag says so from the start."""
    import mmap
    import signal

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child with 1 GiB of touched memory: its exit takes a while
        memory = mmap.mmap(-1, 1 << 30)
        for at in range(0, 1 << 30, mmap.PAGESIZE):
            memory[at] = 1
        os.write(write_end, b"x")
        time.sleep(60)
        os._exit(0)
    try:
        assert os.read(read_end, 1) == b"x"
        assert process_alive(pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_alive(pid) and time.monotonic() < deadline:
            pass
        state = _state(pid)
        assert not process_alive(pid)
        assert state != "Z", "dead only once a zombie: its teardown looked alive"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
        os.close(write_end)
