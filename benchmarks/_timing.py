"""How the collective benchmarks time a call, ours and every peer's alike.

No torch here: MPI's side (``_mpi_peer.py``, under ``mpiexec``) imports it too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

# A batch lasts about this long, at any speed: 200 calls of 5 µs (the old fixed
# count) is one millisecond, where a single preemption on a 2-core machine
# doubles the batch; 50 ms spreads such events over many calls. (What the host
# itself does from one minute to the next still moves whole runs.)
TARGET_BATCH_S = 0.05
_PROBE_CALLS = 3
# Untimed calls after each batch's barrier: ranks leave a barrier at different
# times (with more ranks than cores, some only after a sleep); these put them in
# step, so the batch times the calls, not the wake-up.
_IN_STEP_CALLS = 2


def per_call_seconds(
    fn: Callable[[], object],
    agree: Callable[[int], int],
    max_iters: int,
    batches: int,
) -> float:
    """Median seconds per call of ``fn``: :func:`per_call_seconds_each` of one."""
    return per_call_seconds_each([fn], agree, max_iters, batches)[0]


def per_call_seconds_each(
    fns: list[Callable[[], object]],
    agree: Callable[[int], int],
    max_iters: int,
    batches: int,
) -> list[float]:
    """Median seconds per call of each of ``fns``: :func:`batch_seconds_each`'s medians."""
    return [
        statistics.median(times) for times in batch_seconds_each(fns, agree, max_iters, batches)
    ]


def batch_seconds_each(
    fns: list[Callable[[], object]],
    agree: Callable[[int], int],
    max_iters: int,
    batches: int,
) -> list[list[float]]:
    """Seconds per call of each of ``fns`` in each of ``batches`` timed batches,
    after an untimed one (and a few untimed calls after each batch's barrier).

    The functions take turns batch by batch, the order rotating every batch, so
    whatever the host does over the run (it moves whole runs on a shared VM)
    reaches each of them alike and their ratio stays fair. Every rank runs the
    same number of calls of a function per batch: enough for
    ``TARGET_BATCH_S`` at rank 0's pace, at least 2, at most ``max_iters``.

    ``agree(value)`` is collective: it returns rank 0's ``value`` on every rank
    (and so is also the barrier that starts each batch in step).
    """
    agree(0)
    iters = []
    for fn in fns:
        # The fastest probe call: a first call can pay a one-off set-up (a channel
        # opened through the store, ~50 ms), which would shrink every batch to 2 calls.
        each = float("inf")
        for _ in range(_PROBE_CALLS):
            start = time.perf_counter()
            fn()
            each = min(each, time.perf_counter() - start)
        iters.append(agree(max(2, min(max_iters, int(TARGET_BATCH_S / max(each, 1e-7))))))
    per_call: list[list[float]] = [[] for _ in fns]
    for batch in range(batches + 1):
        for turn in range(len(fns)):
            i = (batch + turn) % len(fns)
            fn, n = fns[i], iters[i]
            agree(0)
            for _ in range(_IN_STEP_CALLS):
                fn()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            if batch:
                per_call[i].append((time.perf_counter() - start) / n)
    return per_call
