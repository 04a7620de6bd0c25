"""A stand-in for a MessageQueue writer's TCP end, for tests that forge frames.

The test holds the ROUTER socket and the HMAC key, so it can send a real
reader any frame it likes: good, forged, altered, replayed or malformed.
"""

from __future__ import annotations

import os
from typing import Any

import zmq

from shm_broadcast.message_queue import Handle


def fake_remote_writer(name: str, max_chunk_bytes: int, max_chunks: int) -> tuple[Any, Any, Handle]:
    """Bind a ROUTER on 127.0.0.1 and return (context, router, handle for one remote reader)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    handle = Handle(
        name=name,
        n_reader=1,
        local_reader_ranks=[],
        writer_rank=0,
        writer_pid=os.getpid(),
        writer_host="fake",
        max_chunk_bytes=max_chunk_bytes,
        max_chunks=max_chunks,
        buffer_name=None,
        local_address=None,
        remote_address=f"tcp://127.0.0.1:{port}",
        key=os.urandom(32),
        window=16,
        allow_pickle=False,
    )
    return ctx, router, handle
