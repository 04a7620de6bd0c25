"""A rank tells the test it reached a point (a file in a temporary folder), so a
test acts on it then, not after a fixed sleep that a loaded machine outlasts."""

from __future__ import annotations

import os
import time


def mark(flag_dir: str, name: str) -> None:
    """Called by a rank: it has reached ``name``."""
    with open(os.path.join(flag_dir, name), "w") as fh:
        fh.write(str(time.monotonic()))


def wait_for(flag_dir: str, name: str, timeout: float = 30.0) -> None:
    """Called by the test: return once a rank marked ``name`` (fail after ``timeout``)."""
    path = os.path.join(flag_dir, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"no rank marked {name!r} within {timeout:g} s"
        time.sleep(0.05)
