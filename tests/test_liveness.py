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
