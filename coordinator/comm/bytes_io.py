"""Move byte strings over a :class:`Comm`: lengths first, then payloads.

The building block of the object collectives and of window set-up; no pickle
anywhere (the bytes are whatever the caller encoded, e.g. with the msgspec codec).
Lengths and bytes travel as ``device_communicators.object_bytes`` tensors, so a
rank whose peer made a plain tensor call of the same size raises instead of
handing it a length.
"""

from __future__ import annotations

import datetime

import torch

from device_communicators.object_bytes import (
    LENGTH_BYTES,
    OBJECT_DTYPE,
    from_bytes,
    lengths,
    message_buffer,
    read_lengths,
    to_bytes,
)
from shm_broadcast.codec import EncodedMessage

from .ops import CommOps


def _lengths(comm: CommOps, n: int, timeout: float | datetime.timedelta | None) -> list[int]:
    out = torch.empty(comm.get_size() * LENGTH_BYTES, dtype=OBJECT_DTYPE)
    comm.all_gather_single(out, lengths([n]), timeout=timeout)
    return read_lengths(out)


def all_gather_bytes(
    comm: CommOps, data: bytes, timeout: float | datetime.timedelta | None = None
) -> list[bytes]:
    sizes = _lengths(comm, len(data), timeout)
    outs = [torch.empty(n, dtype=OBJECT_DTYPE) for n in sizes]
    comm.all_gather_v(outs, from_bytes(data), timeout=timeout)
    return [to_bytes(t) for t in outs]


def broadcast_message(
    comm: CommOps,
    msg: EncodedMessage | None,
    root: int,
    timeout: float | datetime.timedelta | None,
) -> memoryview:
    """``root``'s encoded message (None elsewhere) on every rank, as the bytes
    ``codec.loads`` reads, in a pooled buffer (``object_bytes.message_buffer``)
    the view holds until it is dropped."""
    length = lengths([msg.nbytes if msg is not None else 0])
    comm.broadcast(length, root, timeout=timeout)
    tensor, view = message_buffer(read_lengths(length)[0], msg)
    comm.broadcast(tensor, root, timeout=timeout)
    return view


def send_message(
    comm: CommOps,
    msg: EncodedMessage,
    dst: int,
    timeout: float | datetime.timedelta | None,
) -> None:
    """Send an encoded message to ``dst``: its length, then its bytes from a pooled
    buffer (``object_bytes.message_buffer``)."""
    comm.send(lengths([msg.nbytes]), dst, timeout=timeout)
    tensor, _ = message_buffer(msg.nbytes, msg)
    comm.send(tensor, dst, timeout=timeout)


def recv_message(comm: CommOps, src: int, timeout: float | datetime.timedelta | None) -> memoryview:
    """What :func:`send_message` sent from ``src``, as the bytes ``codec.loads``
    reads, in a pooled buffer the view holds until it is dropped."""
    length = torch.empty(LENGTH_BYTES, dtype=OBJECT_DTYPE)
    comm.recv(length, src, timeout=timeout)
    tensor, view = message_buffer(read_lengths(length)[0], None)
    comm.recv(tensor, src, timeout=timeout)
    return view


def gather_bytes(
    comm: CommOps, data: bytes, root: int, timeout: float | datetime.timedelta | None
) -> list[bytes] | None:
    """Rank ``root`` returns every rank's bytes in rank order; others return None.

    Sizes are all-gathered (every rank knows them), then the payloads travel
    padded to the longest, since Gloo's gather needs equal shapes.
    """
    sizes = _lengths(comm, len(data), timeout)
    longest = max(sizes)
    if longest == 0:
        return [b""] * comm.get_size() if comm.get_rank() == root else None
    padded = torch.zeros(longest, dtype=OBJECT_DTYPE)
    padded[: len(data)] = from_bytes(data)
    outs = None
    if comm.get_rank() == root:
        outs = [torch.empty(longest, dtype=OBJECT_DTYPE) for _ in sizes]
    comm.gather(outs, padded, root, timeout=timeout)
    if outs is None:
        return None
    return [to_bytes(t[:n]) for t, n in zip(outs, sizes)]


def scatter_bytes(
    comm: CommOps, items: list[bytes] | None, root: int, timeout: float | datetime.timedelta | None
) -> bytes:
    """Rank ``i`` receives ``items[i]`` from ``root``."""
    size = comm.get_size()
    mine = comm.get_rank() == root
    counts = torch.zeros(size * LENGTH_BYTES, dtype=OBJECT_DTYPE)
    if mine:
        assert items is not None
        counts = lengths([len(b) for b in items])
    comm.broadcast(counts, root, timeout=timeout)
    sizes = read_lengths(counts)
    longest = max(sizes)
    if longest == 0:
        return b""
    out = torch.empty(longest, dtype=OBJECT_DTYPE)
    inputs = None
    if mine:
        assert items is not None
        inputs = [torch.zeros(longest, dtype=OBJECT_DTYPE) for _ in items]
        for tensor, item in zip(inputs, items):
            tensor[: len(item)] = from_bytes(item)
    comm.scatter(out, inputs, root, timeout=timeout)
    return to_bytes(out[: sizes[comm.get_rank()]])
