"""Move encoded messages over a :class:`Comm`: lengths first, then payloads.

The building block of the object collectives and of window set-up; no pickle
anywhere (a message is what ``shm_broadcast.codec.encode_message`` made; the
receivers decode the views returned with ``codec.loads``). Lengths and
messages travel as ``device_communicators.object_bytes`` tensors, so a rank
whose peer made a plain tensor call of the same size raises instead of
handing it a length, and each message moves in a pooled buffer
(``object_bytes.message_buffer``) that a view returned holds until dropped.
"""

from __future__ import annotations

import datetime

import torch

from device_communicators.object_bytes import (
    LENGTH_BYTES,
    OBJECT_DTYPE,
    lengths,
    message_buffer,
    read_lengths,
)
from shm_broadcast.codec import EncodedMessage

from .ops import CommOps


def _lengths(comm: CommOps, n: int, timeout: float | datetime.timedelta | None) -> list[int]:
    out = torch.empty(comm.get_size() * LENGTH_BYTES, dtype=OBJECT_DTYPE)
    comm.all_gather_single(out, lengths([n]), timeout=timeout)
    return read_lengths(out)


def all_gather_messages(
    comm: CommOps, msg: EncodedMessage, timeout: float | datetime.timedelta | None = None
) -> list[memoryview]:
    """Every rank's encoded message, in rank order (this rank's own included)."""
    sizes = _lengths(comm, msg.nbytes, timeout)
    mine, _ = message_buffer(msg.nbytes, msg)
    outs = [message_buffer(n, None) for n in sizes]
    comm.all_gather_v([tensor for tensor, _ in outs], mine, timeout=timeout)
    return [view for _, view in outs]


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


def gather_messages(
    comm: CommOps, msg: EncodedMessage, root: int, timeout: float | datetime.timedelta | None
) -> list[memoryview] | None:
    """Rank ``root`` returns every rank's encoded message in rank order; others None.

    Sizes are all-gathered (every rank knows them), then the messages travel
    padded to the longest, since Gloo's gather needs equal shapes.
    """
    sizes = _lengths(comm, msg.nbytes, timeout)
    longest = max(sizes)
    padded, _ = message_buffer(longest, msg)
    outs = None
    if comm.get_rank() == root:
        outs = [message_buffer(longest, None) for _ in sizes]
    comm.gather(None if outs is None else [t for t, _ in outs], padded, root, timeout=timeout)
    if outs is None:
        return None
    return [view[:n] for (_, view), n in zip(outs, sizes)]


def scatter_messages(
    comm: CommOps,
    msgs: list[EncodedMessage] | None,
    root: int,
    timeout: float | datetime.timedelta | None,
) -> memoryview:
    """Rank ``i`` receives ``msgs[i]`` (given on ``root`` only), padded to the longest."""
    # (lengths(), not torch.zeros: torch fills no bits8 tensor of 32 KiB or more)
    counts = lengths([m.nbytes for m in msgs] if msgs is not None else [0] * comm.get_size())
    comm.broadcast(counts, root, timeout=timeout)
    sizes = read_lengths(counts)
    longest = max(sizes)
    out, view = message_buffer(longest, None)
    inputs = None if msgs is None else [message_buffer(longest, m)[0] for m in msgs]
    comm.scatter(out, inputs, root, timeout=timeout)
    return view[: sizes[comm.get_rank()]]
