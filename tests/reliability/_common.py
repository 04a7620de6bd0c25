"""Shared pieces of the reliability suite: mode, trial counts, leftovers and the figures file.

Fast mode (the default, run by CI) keeps every case to a few trials; long mode
(``pytest --long`` or ``GROUPCOORD_TEST_LONG=1``) runs the issue's full counts.
Each case appends one JSON line of figures to the file named by
``GROUPCOORD_RELIABILITY_REPORT`` (if set), from which docs/RELIABILITY.md is built.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

from shm_broadcast.segments import list_segments

LONG = os.environ.get("GROUPCOORD_TEST_LONG") == "1"
FORK = mp.get_context("fork")
# The bound on detecting a dead or absent peer.
DETECT_LIMIT_S = 5.0


def trials(fast: int, long: int = 20) -> int:
    """How many randomised trials a case runs in this mode."""
    return long if LONG else fast


def report(case: str, **figures: Any) -> None:
    """Record one case's figures (printed; appended to the report file when asked)."""
    line = {"case": case, "mode": "long" if LONG else "fast", **figures}
    print(f"RELIABILITY {json.dumps(line)}")
    path = os.environ.get("GROUPCOORD_RELIABILITY_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


def ipc_sockets() -> list[str]:
    """ZeroMQ ipc:// socket files of our message queues in the temp dir."""
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), "groupcoord_mq_*.sock")))


def child_pids() -> list[int]:
    """Live (not zombie) children of this process, read from /proc."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        state, ppid = fields[0], int(fields[1])
        if ppid == me and state != "Z":
            found.append(int(entry))
    return found


def _creator_pid(name: str) -> int:
    """The creating pid in ``groupcoord_<pid>_...`` (segment or ipc socket name)."""
    base = os.path.basename(name)
    digits = base.split("groupcoord_")[-1].split("_")[0]
    return int(digits) if digits.isdigit() else -1


def leftovers(
    segments_before: set[str], sockets_before: set[str], pids: set[int] | None = None
) -> dict[str, list[Any]]:
    """What a trial left behind: new shm segments, ipc socket files, live children.

    Other engineers' tests share this machine's /dev/shm, so with ``pids``
    (the trial's ranks) only names created by those processes count.
    """

    def ours(name: str) -> bool:
        return pids is None or _creator_pid(name) in pids

    return {
        "segments": sorted(n for n in set(list_segments()) - segments_before if ours(n)),
        "ipc_sockets": sorted(n for n in set(ipc_sockets()) - sockets_before if ours(n)),
        "processes": child_pids(),
    }


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)
