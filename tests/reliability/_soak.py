"""The soak: one writer streams mixed messages to 2 ring readers and 1 TCP reader.

Every reader checks every message's number and content, so a lost,
duplicated, reordered or corrupted message fails at once. Resident memory is
read from /proc after a warm-up and at the end. Also run by
``benchmarks/soak_mq.py`` outside pytest.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from coordinator.launch import init_gloo

from . import _mq

WARMUP = 1000


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak_message(rng: random.Random, seq: int) -> Any:
    """Mostly small messages (the scheduler's per-step inputs), some tensors, a few large."""
    roll = rng.random()
    if roll < 0.5:
        return {"seq": seq, "ids": list(range(seq % 33)), "req": f"r{seq}"}
    if roll < 0.7:
        return {"seq": seq, "blob": bytes([seq % 256]) * rng.randrange(1, 4096)}
    if roll < 0.85:
        return {"seq": seq, "t": torch.full((rng.choice([1, 64, 512]),), float(seq % 1000))}
    if roll < 0.95:
        return {"seq": seq, "a": np.full((2, rng.choice([3, 300])), seq % 7, dtype=np.int16)}
    if roll < 0.99:
        return ("tuple", seq, (None, True, 1.5), {"nested": [seq]})
    # One in a hundred overflows the 64 KiB chunk (ZeroMQ ipc path behind a ring marker).
    return {"seq": seq, "blob": bytes([seq % 256]) * 100_000}


def soak(rank: int, world: int, n_messages: int, seed: int) -> dict[str, Any]:
    init_gloo(rank, world)
    mq = _mq.build_queue(rank)
    rng = random.Random(seed)
    start_rss = 0
    start = time.monotonic()
    try:
        for seq in range(n_messages):
            if seq == WARMUP:
                start_rss = rss_bytes()
            if rank == _mq.WRITER:
                mq.enqueue(soak_message(rng, seq), timeout=60)
            else:
                _mq.check(mq.dequeue(timeout=60), seq)
        elapsed = time.monotonic() - start
        return {
            "role": mq.role,
            "messages": n_messages,
            "seconds": round(elapsed, 2),
            "rss_start_mib": round(start_rss / 2**20, 1),
            "rss_end_mib": round(rss_bytes() / 2**20, 1),
            "bad_frames": mq.bad_frames,
        }
    finally:
        dist.barrier()
        mq.shutdown()
