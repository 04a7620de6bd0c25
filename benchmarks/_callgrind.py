"""Counting a process's CPU instructions per call under valgrind's callgrind.

On a shared, noisy host the same loop can time 22 us one minute and 41 us the
next, so a change of a few percent in a hot path cannot be seen in timings.
The number of instructions a call executes does not move with the host's load:
``count_instructions`` runs a command under callgrind with instrumentation off,
turns it on (``callgrind_control``) only around the measured loops, dumps after
each and returns the instructions per call.

The measured process (the command) keeps to a hand-over protocol through files
in ``folder``, which :func:`run_phases` implements: it writes ``folder/phases``
(one ``"<calls> <name>"`` line per phase, the first a phase that does nothing,
whose count is the loop's own cost and is taken off the others), warms up,
calls :func:`await_handover` with :data:`READY`, then runs each phase's loop and
calls :func:`await_handover` with :data:`DONE` after each.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence

READY, DONE = "ready", "done"


def missing_tools() -> str | None:
    """Why instructions cannot be counted here, or None when they can."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return "valgrind (with callgrind_control) is not installed"
    return None


def await_handover(folder: str, name: str) -> None:
    """The measured process's side of a hand-over: leave ``name`` in ``folder``,
    wait until the parent removes it."""
    path = os.path.join(folder, name)
    open(path, "w").close()
    while os.path.exists(path):
        time.sleep(0.005)


def run_phases(
    folder: str,
    phases: Sequence[tuple[str, Callable[[], object], int]],
    *,
    measured: bool = True,
    warm_up: int = 50,
) -> None:
    """The measured process's side of the protocol: each (name, call, calls) phase,
    warmed up, then timed between hand-overs. ``measured=False``: a peer that runs
    the same calls (another rank) without writing or handing over anything."""
    if measured:
        with open(os.path.join(folder, "phases"), "w", encoding="utf-8") as fh:
            fh.writelines(f"{n} {name}\n" for name, _, n in phases)
    for _, fn, _ in phases:
        for _ in range(warm_up):  # caches, type specialisation, a collective's plans
            fn()
    if measured:
        await_handover(folder, READY)
    for _, fn, n in phases:
        for _ in range(n):
            fn()
        if measured:
            await_handover(folder, DONE)


def count_instructions(
    command: Sequence[str], folder: str, peers: Sequence[subprocess.Popen[bytes]] = ()
) -> list[tuple[str, int]]:
    """Run ``command`` under callgrind and return (phase, instructions per call) for
    each phase after the first, the first's (the loop's own) taken off. ``peers``:
    processes the command works with (another rank), watched so that one exiting
    early fails the count instead of leaving it waiting."""
    out = os.path.join(folder, "callgrind.out")
    child = subprocess.Popen(
        [
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}", *command,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip

    watched = [(child, "the process under valgrind")] + [(p, "a peer") for p in peers]

    def handover(name: str) -> None:
        path = os.path.join(folder, name)
        while not os.path.exists(path):
            for process, what in watched:
                if process.poll() is not None:
                    raise RuntimeError(f"{what} exited ({process.returncode}) mid-count")
            time.sleep(0.05)

    def control(*args: str) -> None:
        subprocess.run(
            ["callgrind_control", *args, str(child.pid)], check=True, capture_output=True
        )

    counts = []
    try:
        handover(READY)
        control("-i", "on")
        control("-z")
        os.remove(os.path.join(folder, READY))
        with open(os.path.join(folder, "phases"), encoding="utf-8") as fh:
            phases = [line.rstrip("\n").split(" ", 1) for line in fh]
        for dump, (calls, name) in enumerate(phases, start=1):
            handover(DONE)
            control("-d")
            with open(f"{out}.{dump}", encoding="utf-8") as fh:
                total = next(int(line.split()[1]) for line in fh if line.startswith("summary:"))
            counts.append((name, total / int(calls)))
            os.remove(os.path.join(folder, DONE))
    finally:
        if child.poll() is None:  # a hand-over failed: the child would wait for ever
            child.kill()
        child.wait()
    loop = counts[0][1]
    return [(name, round(per - loop)) for name, per in counts[1:]]
