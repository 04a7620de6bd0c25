"""A bounded spin-wait that yields the CPU between checks.

On this 2-core class of machine a waiter that spins without yielding starves
the very process it waits for; ``os.sched_yield`` lets the peer run and costs
about a microsecond when nobody else wants the core. After a short burst the
wait backs off to short sleeps so a long wait does not burn a core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

_YIELD_ROUNDS = 2000
_MAX_SLEEP_S = 0.001


def spin_until(ready: Callable[[], bool], deadline: float) -> bool:
    """Return True once ``ready()`` holds, False if ``deadline`` (monotonic) passes."""
    rounds = 0
    sleep_s = 0.00002
    while not ready():
        if time.monotonic() >= deadline:
            return ready()
        if rounds < _YIELD_ROUNDS:
            rounds += 1
            os.sched_yield()
        else:
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)
    return True
