"""The message-queue load shared by the reliability suite and ``soak_mq.py``.

A 4-rank queue: rank 0 writes; ranks 1 and 2 read the shared-memory ring;
rank 3 is made a remote reader (TCP on 127.0.0.1, MAC'd frames, credits) by
leaving it out of the local ranks. Chunks are 64 KiB x 8, so the larger
messages span chunks and the largest stream through the whole ring.

``message``/``check`` are the mixed messages of the kill cases; ``soak`` is the
soak: one writer streams mixed messages to the 3 readers, every reader checks
every message's number and content (a lost, duplicated, reordered or
corrupted message fails at once), and resident memory is read from /proc
after a warm-up and at the end.
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

WRITER = 0
LOCAL_READERS = [1, 2]
REMOTE_READERS = [3]
WORLD = 4
CHUNK_BYTES = 64 * 1024
CHUNKS = 8


def build_queue(rank: int, **kwargs: Any) -> Any:
    """Collective over torch's default group (Gloo): the queue, ready to use."""
    import torch.distributed as dist

    from shm_broadcast.codec import dumps, loads
    from shm_broadcast.group_io import broadcast_bytes
    from shm_broadcast.message_queue import MessageQueue

    pg = dist.group.WORLD
    if rank == WRITER:
        mq = MessageQueue(
            len(LOCAL_READERS) + len(REMOTE_READERS),
            len(LOCAL_READERS),
            LOCAL_READERS,
            CHUNK_BYTES,
            CHUNKS,
            "127.0.0.1",
            **kwargs,
        )
        broadcast_bytes(pg, dumps(mq.export_handle()), WRITER)
    else:
        handle = loads(broadcast_bytes(pg, None, WRITER))
        mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=60)
    return mq


def message(rng: random.Random, seq: int) -> Any:
    """Message number ``seq``: one of several shapes and sizes (up to 256 KiB)."""
    kind = rng.randrange(6)
    if kind == 0:
        return {"seq": seq, "ids": list(range(seq % 17)), "text": "x" * (seq % 100)}
    if kind == 1:
        return {"seq": seq, "blob": bytes([seq % 256]) * rng.choice([10, 40_000, 200_000])}
    if kind == 2:
        n = rng.choice([1, 1000, 60_000])
        return {"seq": seq, "t": torch.full((n,), float(seq % 1000), dtype=torch.float32)}
    if kind == 3:
        return {"seq": seq, "a": np.full((3, rng.choice([2, 5000])), seq % 7, dtype=np.int16)}
    if kind == 4:
        return ("tuple", seq, (None, True, 1.5), {"nested": [seq]})
    return {"seq": seq, "t": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) + seq % 5}


def seq_of(msg: Any) -> int:
    return int(msg[1] if isinstance(msg, tuple) else msg["seq"])


def check(msg: Any, seq: int) -> None:
    """``msg`` is exactly message ``seq`` (content checked, not only the number)."""
    got = seq_of(msg)
    if got != seq:
        raise AssertionError(f"expected message {seq}, got {got} (lost or reordered)")
    if isinstance(msg, dict):
        if "blob" in msg:
            assert msg["blob"] == bytes([seq % 256]) * len(msg["blob"])
        if "t" in msg and msg["t"].dtype == torch.float32:
            assert bool((msg["t"] == float(seq % 1000)).all())
        if "a" in msg:
            assert bool((msg["a"] == seq % 7).all())


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
    # One in a hundred is larger than a 64 KiB chunk (it spans two); one in a
    # thousand larger than the 512 KiB ring (it streams through it).
    size = 700_000 if seq % 1000 == 999 else 100_000
    return {"seq": seq, "blob": bytes([seq % 256]) * size}


def soak(rank: int, world: int, n_messages: int, seed: int) -> dict[str, Any]:
    init_gloo(rank, world)
    mq = build_queue(rank)
    rng = random.Random(seed)
    start_rss = 0
    start = time.monotonic()
    try:
        for seq in range(n_messages):
            if seq == WARMUP:
                start_rss = rss_bytes()
            if rank == WRITER:
                mq.enqueue(soak_message(rng, seq), timeout=60)
            else:
                check(mq.dequeue(timeout=60), seq)
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
