"""The multi-rank harness itself: results, failures, hangs and kills are reported."""

from __future__ import annotations

import os
import time

import pytest

from coordinator.launch import run_ranks, start_ranks


def _rank_pid(rank: int, world_size: int) -> tuple[int, int, int]:
    return rank, world_size, int(os.environ["RANK"])


def test_results_come_back_in_rank_order() -> None:
    assert run_ranks(_rank_pid, 3) == [(0, 3, 0), (1, 3, 1), (2, 3, 2)]


_SET_IN_THE_PARENT = {"set": False}


def _start_facts(rank: int, world_size: int) -> tuple[int, str, bool]:
    return rank, os.environ["GC_TEST_START"], _SET_IN_THE_PARENT["set"]


def test_spawned_ranks_are_fresh_interpreters_with_the_env_given() -> None:
    """start_method="spawn" (what the GPU tests use: CUDA forbids fork after init)."""
    _SET_IN_THE_PARENT["set"] = True  # a forked rank would see this, a spawned one not
    try:
        out = run_ranks(
            _start_facts, 2, timeout=60, env={"GC_TEST_START": "yes"}, start_method="spawn"
        )
    finally:
        _SET_IN_THE_PARENT["set"] = False
    assert out == [(0, "yes", False), (1, "yes", False)]


def _raise_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom from rank one")


def test_a_raising_rank_fails_with_its_traceback() -> None:
    with pytest.raises(AssertionError, match="(?s)rank 1 raised.*boom from rank one"):
        run_ranks(_raise_on_one, 2)


def _hang_on_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_a_hung_rank_fails_fast_and_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 did not finish"):
        run_ranks(_hang_on_zero, 2, timeout=2.0)
    assert time.monotonic() - start < 10


def _sleep(rank: int, world_size: int) -> int:
    time.sleep(0.5 if rank == 0 else 30)
    return rank


def test_a_killed_rank_is_excused_when_expected() -> None:
    group = start_ranks(_sleep, 2, timeout=10.0)
    group.kill(1)
    assert group.collect(killed=[1]) == [0, None]
    assert not any(p.is_alive() for p in group.procs)


def test_ranks_run_when_the_callers_stderr_is_not_a_file(monkeypatch) -> None:
    """A notebook or a captured stream has no file descriptor behind sys.stderr: the
    ranks used to die before reporting anything ("exited with code 1 without
    reporting an error"); they run, and a failure still comes back."""
    import io
    import sys

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert run_ranks(_rank_pid, 2, timeout=30) == [(0, 2, 0), (1, 2, 1)]
    with pytest.raises(AssertionError, match="(?s)rank 1 raised.*boom from rank one"):
        run_ranks(_raise_on_one, 2, timeout=30)
