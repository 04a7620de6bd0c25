"""Kill harness: start ranks, let them reach steady state, SIGKILL one, time the survivors.

A rank function runs ``survive(op, ready)``: one warm-up call of ``op``, then it
bumps the shared ``ready`` counter and calls ``op`` in a loop until it raises.
The parent waits for every rank to be ready, sleeps a random fraction of a
second (so the victim dies at a random point inside an operation), SIGKILLs the
victim and records the kill time. ``time.monotonic`` is CLOCK_MONOTONIC, one
clock for every process on the machine, so survivors' detection times compare
directly with it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.launch import start_ranks
from shm_broadcast.segments import list_segments

from ._common import DETECT_LIMIT_S, FORK, ipc_sockets, leftovers, report

# Longest a survivor keeps calling ``op`` before it gives up and reports a hang.
SURVIVE_S = 30.0


def survive(op: Callable[[], Any], ready: Any) -> tuple[str, str, float, list[int]]:
    """Warm up, report ready, then loop ``op`` until it raises; return what was raised."""
    op()
    with ready.get_lock():
        ready.value += 1
    end = time.monotonic() + SURVIVE_S
    while time.monotonic() < end:
        try:
            op()
        except Exception as exc:  # noqa: BLE001 - the parent judges which errors are right
            named = list(getattr(exc, "dead", None) or getattr(exc, "missing", None) or [])
            return type(exc).__name__, str(exc), time.monotonic(), named
    return "none", f"no error within {SURVIVE_S:g} s", time.monotonic(), []


def run_kill_case(
    case: str,
    fn: Callable[..., Any],
    world: int,
    victims: Sequence[int],
    n_trials: int,
    allowed: Callable[[int, int, str, list[int]], bool],
    *args: Any,
    env: dict[str, str] | None = None,
) -> float:
    """Run ``n_trials`` randomised kills of ``fn``; assert and report; return the worst time.

    ``allowed(rank, victim, kind, named)`` says whether survivor ``rank`` may
    raise ``kind`` naming ranks ``named`` when ``victim`` was killed.
    """
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    times: list[float] = []
    problems: list[str] = []
    left_behind: list[Any] = []
    for trial in range(n_trials):
        segments_before = set(list_segments())
        sockets_before = set(ipc_sockets())
        victim = rng.choice(list(victims))
        ready = FORK.Value("i", 0)
        group = start_ranks(
            fn, world, victim, ready, rng.randrange(2**31), *args, timeout=60, env=env
        )
        try:
            deadline = time.monotonic() + 45
            while ready.value < world:
                if any(p.exitcode is not None for p in group.procs) or time.monotonic() > deadline:
                    group.collect()  # raises with the rank's traceback
                    raise AssertionError(f"{case}: ranks never all became ready")
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.25))
            killed_at = time.monotonic()
            group.kill(victim)
        except BaseException:
            group.terminate()
            raise
        results = group.collect(killed=[victim])
        where = f"trial {trial} (seed {seed}, victim rank {victim})"
        for rank, result in enumerate(results):
            if rank == victim:
                continue
            kind, message, detected_at, named = result
            took = detected_at - killed_at
            times.append(took)
            if not allowed(rank, victim, kind, named):
                problems.append(f"{where}: rank {rank} raised {kind} naming {named}: {message}")
            if took >= DETECT_LIMIT_S:
                problems.append(f"{where}: rank {rank} took {took:.2f} s: {message}")
        left = leftovers(segments_before, sockets_before, {group.pid(r) for r in range(world)})
        if left != {"segments": [], "ipc_sockets": [], "processes": []}:
            left_behind.append({"trial": trial, **left})
    worst = max(times, default=0.0)
    # Figures first, so a failing case still reports what it measured.
    report(
        case,
        trials=n_trials,
        worst_detect_s=round(worst, 3),
        median_detect_s=round(sorted(times)[len(times) // 2], 3) if times else None,
        over_limit=sum(t >= DETECT_LIMIT_S for t in times),
        left_behind=left_behind or "nothing",
        seed=seed,
    )
    assert not problems, f"{case}: " + "\n".join(problems[:5])
    assert not left_behind, f"{case}: left behind {left_behind}"
    return worst
