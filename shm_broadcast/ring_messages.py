"""How a queue's messages sit in a ring's chunks: one chunk, a span, or a stream.

The first byte of a chunk says what it holds; the message itself starts
``MSG_OFFSET`` bytes in, so its frames are 64-byte aligned:

* ``INLINE``: the whole encoded message in this chunk.
* ``SPAN``: a message larger than a chunk that fits the ring. It starts at the
  first chunk's ``MSG_OFFSET`` and runs on through the next chunks (their memory
  is contiguous), so readers decode it in place; the first chunk says how many
  chunks (uint32 after the kind byte), the others are message bytes throughout.
  When too few chunks are left before the ring wraps, they are marked ``PAD``
  and the span starts at chunk 0.
* ``STREAM``: a message larger than the whole ring. Its bytes stream through
  the chunks in order, each filled and published as the writer gets to it,
  while readers copy each out. The first chunk holds the stream's length
  (uint64 at byte 8); the stream is ``[u32 parts][u64 length per part][parts]``,
  the parts being the codec's header and frames, each 64-byte aligned.
* ``RAW``: bytes written through ``MessageQueue.acquire_write``.

A :class:`RingCursor` is one queue end's position in the ring. Waiting for a
chunk is the queue's business (deadlines, liveness, notices): each call gets
a ``wait`` callback that returns once chunk ``idx`` is free (writer) or
written (reader), or raises.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from typing import Any

from .codec import MESSAGE_PREFIX, Codec, EncodedMessage, read_message, write_message
from .errors import ProtocolError
from .ring import ShmRingBuffer

__all__ = ["MSG_OFFSET", "RingCursor"]

INLINE = 1
STREAM = 2
RAW = 3
SPAN = 4
PAD = 5
MSG_OFFSET = 64
_SPAN_COUNT = struct.Struct("<I")
_STREAM_LEN = struct.Struct("<Q")

WaitFor = Callable[[int], None]


class RingCursor:
    """The next chunk one end of a queue writes or reads, and the message layouts.

    A stream that fails half-way (a timeout, a dead peer) sets ``broken``: the
    readers can no longer find where the next message starts, so the queue
    must close (the writer's side also marks the ring shut).
    """

    def __init__(self, ring: ShmRingBuffer, codec: Codec, what: str) -> None:
        self.ring = ring
        self.codec = codec
        self.what = what
        self.idx = 0
        self.capacity = ring.max_chunk_bytes - MSG_OFFSET  # message bytes in one chunk
        self.broken = False

    def _advance(self, count: int = 1) -> None:
        self.idx = (self.idx + count) % self.ring.max_chunks

    # ---- writer ---------------------------------------------------------------

    def _free(self, idx: int, wait_free: WaitFor) -> None:
        if not self.ring.chunk_free(idx):
            wait_free(idx)

    def write(self, msg: EncodedMessage, wait_free: WaitFor) -> bool:
        """Write ``msg`` in one chunk or a span; False (nothing written) when it is
        larger than the whole ring: then :meth:`write_stream` it."""
        if msg.nbytes > self.capacity:
            return self._write_span(msg, wait_free)
        buf, at, idx = self._begin(INLINE, wait_free)
        if msg.frames:
            write_message(msg, buf, at + MSG_OFFSET, self.ring.address)
        else:
            header = msg.header
            pos = at + MSG_OFFSET
            MESSAGE_PREFIX.pack_into(buf, pos, len(header), 0)
            buf[pos + 8 : pos + 8 + len(header)] = header
        self.ring.publish(idx)
        self._advance()
        return True

    def _begin(self, kind: int, wait_free: WaitFor) -> tuple[memoryview, int, int]:
        """Open the next chunk for writing, once free, marked ``kind``: (the ring's
        buffer, the chunk's offset in it, its index)."""
        idx = self.idx
        self._free(idx, wait_free)
        buf = self.ring.begin_write(idx)
        at = self.ring.chunk_at[idx]
        buf[at] = kind
        return buf, at, idx

    def _write_span(self, msg: EncodedMessage, wait_free: WaitFor) -> bool:
        ring = self.ring
        count = -(-(msg.nbytes + MSG_OFFSET) // ring.chunk_stride)
        if count > ring.max_chunks:
            return False
        if self.idx + count > ring.max_chunks:
            # Not enough chunks before the ring wraps: pad them, start at chunk 0.
            for pad in range(self.idx, ring.max_chunks):
                self._free(pad, wait_free)
                ring.begin_write(pad)[ring.chunk_at[pad]] = PAD
                ring.publish(pad)
            self.idx = 0
        idx = self.idx
        for j in range(idx, idx + count):
            self._free(j, wait_free)
        for j in range(idx, idx + count):
            buf = ring.begin_write(j)
        at = ring.chunk_at[idx]
        write_message(msg, buf, at + MSG_OFFSET, self.ring.address)
        buf[at] = SPAN
        _SPAN_COUNT.pack_into(buf, at + 1, count)
        # The first chunk last: a reader that sees it written finds the rest written.
        for j in range(idx + 1, idx + count):
            ring.publish(j)
        ring.publish(idx)
        self._advance(count)
        return True

    def write_stream(self, parts: list[Any], wait_free: WaitFor) -> None:
        """Stream a message larger than the ring (``parts``: header, then frames)."""
        ring = self.ring
        views = [memoryview(p).cast("B") for p in parts]
        table = struct.pack(f"<I{len(views)}Q", len(views), *(len(v) for v in views))
        # Each part starts 64-byte aligned in the stream (tensors are built on it).
        segments = []
        total = 0
        for v in [memoryview(table), *views]:
            pad = -total % 64
            if pad:
                segments.append(memoryview(bytes(pad)))
            segments.append(v)
            total += pad + len(v)
        first = True
        try:
            while segments:
                idx = self.idx
                self._free(idx, wait_free)
                buf = ring.begin_write(idx)
                at = ring.chunk_at[idx]
                pos = at + MSG_OFFSET
                end = pos + self.capacity
                if first:
                    buf[at] = STREAM
                    _STREAM_LEN.pack_into(buf, at + 8, total)
                    first = False
                while segments and pos < end:
                    n = min(len(segments[0]), end - pos)
                    buf[pos : pos + n] = segments[0][:n]
                    pos += n
                    segments[0] = segments[0][n:]
                    if not segments[0]:
                        segments.pop(0)
                ring.publish(idx)
                self._advance()
        except BaseException:
            if not first:
                ring.set_shutdown()
                self.broken = True
            raise

    @contextlib.contextmanager
    def raw_write(self, wait_free: WaitFor) -> Iterator[memoryview]:
        """A writable view of the next chunk's payload, published when the block ends
        (not when it raises)."""
        buf, at, idx = self._begin(RAW, wait_free)
        with buf[at + MSG_OFFSET : at + self.ring.max_chunk_bytes] as view:
            yield view
        self.ring.publish(idx)
        self._advance()

    # ---- reader ----------------------------------------------------------------

    def _next_message_chunk(self, me: int, wait_ready: WaitFor) -> int:
        """Wait for the next chunk that starts a message, releasing pad chunks."""
        ring = self.ring
        while True:
            idx = self.idx
            if not ring.ready(idx, me):
                wait_ready(idx)
            if ring.buf[ring.chunk_at[idx]] != PAD:
                return idx
            ring.release(idx, me)
            self._advance()

    def read(self, me: int, wait_ready: WaitFor) -> Any:
        """The next message for local reader ``me``, decoded."""
        ring = self.ring
        idx = self._next_message_chunk(me, wait_ready)
        buf = ring.buf
        at = ring.chunk_at[idx]
        kind = buf[at]
        count = 1
        if kind == INLINE:
            pos = at + MSG_OFFSET
            header_len, n_frames = MESSAGE_PREFIX.unpack_from(buf, pos)
            if n_frames == 0:
                try:
                    return self.codec.decode_header_only(buf[pos + 8 : pos + 8 + header_len])
                finally:
                    ring.release(idx, me)
                    self._advance()
        elif kind == SPAN:
            count = _SPAN_COUNT.unpack_from(buf, at + 1)[0]
        elif kind == STREAM:
            return self._read_stream(me, wait_ready)
        try:
            if kind == INLINE or kind == SPAN:
                return read_message(self.codec, buf, at + MSG_OFFSET)
            if kind == RAW:
                raise ProtocolError(
                    f"{self.what}: chunk {idx} holds raw bytes written with acquire_write: "
                    "read them with acquire_read"
                )
            raise ProtocolError(f"{self.what}: chunk {idx} has unknown kind {kind}")
        finally:
            # Released even when decoding failed, so the queue stays usable.
            for j in range(idx, idx + count):
                ring.release(j, me)
            self._advance(count)

    def _read_stream(self, me: int, wait_ready: WaitFor) -> Any:
        """Copy a streamed message out chunk by chunk (releasing each), then decode it."""
        import torch

        from .host_memory import empty_output  # imports torch: only when a stream arrives

        ring = self.ring
        total = _STREAM_LEN.unpack_from(ring.buf, ring.chunk_at[self.idx] + 8)[0]
        view = empty_output((total,), torch.uint8).numpy().data
        got = 0
        try:
            while got < total:
                idx = self.idx
                if not ring.ready(idx, me):
                    wait_ready(idx)
                n = min(self.capacity, total - got)
                pos = ring.chunk_at[idx] + MSG_OFFSET
                view[got : got + n] = ring.buf[pos : pos + n]
                got += n
                ring.release(idx, me)
                self._advance()
        except BaseException:
            self.broken = True
            raise
        (count,) = struct.unpack_from("<I", view, 0)
        lens = struct.unpack_from(f"<{count}Q", view, 4)
        offset = 4 + 8 * count
        parts = []
        for n in lens:
            offset += -offset % 64
            parts.append(view[offset : offset + n])
            offset += n
        if offset != total or not parts:
            raise ProtocolError(f"{self.what}: a streamed message's parts do not add up")
        # The buffer is this message's own: tensors are built on it, not copied.
        return self.codec.decode(parts[0], parts[1:], owned=True)

    @contextlib.contextmanager
    def raw_read(self, me: int, wait_ready: WaitFor) -> Iterator[memoryview]:
        """A view of the next chunk's payload, released to the writer when the block ends."""
        ring = self.ring
        idx = self._next_message_chunk(me, wait_ready)
        at = ring.chunk_at[idx]
        if ring.buf[at] in (STREAM, SPAN):
            raise ProtocolError(
                f"{self.what}: chunk {idx} starts a message larger than a chunk "
                "(sent by enqueue): read it with dequeue"
            )
        try:
            with ring.buf[at + MSG_OFFSET : at + ring.max_chunk_bytes] as view:
                yield view
        finally:
            ring.release(idx, me)
            self._advance()
