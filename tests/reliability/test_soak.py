"""Load: mixed messages to 3 readers (2 on the ring, 1 over TCP): zero lost, zero
reordered, memory flat. Fast mode 20,000 messages; long mode 1,000,000."""

from __future__ import annotations

import random

import pytest
from groupcoord_benchmarks import _mq_soak as _mq
from groupcoord_benchmarks._mq_soak import soak

from coordinator.launch import run_ranks

from ._common import LONG, report

MESSAGES = 1_000_000 if LONG else 20_000
# Growth allowed between the warm-up and the end: allocator noise, not a leak
# (a leak of 100 bytes a message would show 2 MiB here, 95 MiB in long mode).
RSS_SLACK_MIB = 24


@pytest.mark.timeout(7300 if LONG else 120)
def test_soak_mixed_messages_to_three_readers() -> None:
    seed = random.randrange(2**31)
    results = run_ranks(soak, _mq.WORLD, MESSAGES, seed, timeout=110 if not LONG else 7200)
    for rank, r in enumerate(results):
        report(
            f"soak: rank {rank} ({r['role']})",
            seed=seed,
            **{k: v for k, v in r.items() if k != "role"},
        )
    assert [r["role"] for r in results] == [
        "writer",
        "local reader",
        "local reader",
        "remote reader",
    ]
    for r in results:
        assert r["messages"] == MESSAGES and r["bad_frames"] == 0, r
        assert r["rss_end_mib"] - r["rss_start_mib"] < RSS_SLACK_MIB, f"memory grew: {r}"
