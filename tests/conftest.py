"""Test-suite set-up shared by every test file.

Ranks are forked from this process, so it must stay single-threaded: torch is
pinned to one intra-op thread before any test runs (an OpenMP pool started in
the parent can hang a forked child in its first parallel op).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="run the long reliability mode")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--long"):
        os.environ["GROUPCOORD_TEST_LONG"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip_long = pytest.mark.skip(reason="long mode only: pass --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip_long)


@pytest.fixture(autouse=True)
def _no_leaked_segments():
    """Every test must leave no groupcoord shared memory behind.

    Only segments created by this process or the ranks it started count: other
    test runs may share the machine's /dev/shm.
    """
    from coordinator.launch import started_pids
    from shm_broadcast.segments import list_segments

    def ours() -> set[str]:
        pids = {os.getpid(), *started_pids}
        return {n for n in list_segments() if int(n.split("_")[1]) in pids}

    before = ours()
    yield
    leaked = sorted(ours() - before)
    assert not leaked, f"test leaked shared-memory segments: {leaked}"
