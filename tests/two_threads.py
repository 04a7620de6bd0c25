"""Two threads of one rank calling one group or communicator at once."""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_two_threads(calls: Callable[[int, threading.Barrier], None], problems: list[str]) -> None:
    """Run ``calls(k, phase)`` on threads ``k`` = 0 and 1 and wait for both. ``phase``
    is a barrier of the two (to make one kind of call at a time). An error a thread
    meets goes into ``problems`` (the test fails on it) and breaks ``phase``, so the
    other thread does not wait for it."""
    phase = threading.Barrier(2)

    def run(k: int) -> None:
        try:
            calls(k, phase)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            problems.append(f"thread {k}: {type(exc).__name__}: {exc}")
            phase.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
