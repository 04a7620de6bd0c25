"""How a queue's messages sit in a ring's chunks: in one chunk, or streamed.

The first byte of a chunk says what it holds; the message itself starts
``MSG_OFFSET`` bytes in, so its frames are 64-byte aligned:

* ``INLINE``: the whole encoded message in this chunk.
* ``STREAM``: a message larger than a chunk. Its bytes run through as many
  chunks as it needs, in ring order, each published as soon as the writer has
  filled it, while readers copy each out as it is published: the copy in and
  the copy out overlap, chunk by chunk. A message that fits the ring waits
  until all the chunks it needs are free before any is written, so a timeout
  leaves nothing half-sent; one larger than the ring waits chunk by chunk.
  The first chunk holds the stream's length (uint64 at byte 8); the stream is
  ``[u32 parts][u64 length per part][parts]``, the parts being the codec's
  header and frames, each 64-byte aligned. A reader copies each part into a
  buffer of its own, so a decoded tensor holds its own memory only.
* ``TENSOR``: a lone plain CPU tensor that fits the chunk, without the codec:
  at ``MSG_OFFSET`` the header's length (u8) and the tensor's byte count
  (u64), then the codec's binary tensor header (dtype code, shape); its bytes
  start 64 bytes further. A small ``send``/``recv`` is mostly this path.
* ``RAW``: bytes written through ``MessageQueue.acquire_write``.
* ``REWIND``: no message; the next one starts in chunk 0. When the messages
  of ``REWIND_MIN_BYTES`` or more written since the cursor was last at chunk
  0 add up to ``REWIND_SPAN_BYTES`` and every reader has read everything, the
  writer starts the next such message at chunk 0 again instead of the next
  chunk in ring order: a ping-pong, or a queue whose readers keep up, keeps
  reusing a few MiB of chunks, which stay in the CPU's caches, where a 64 MiB
  ring written in order is DRAM-bound on both sides.

A rewind costs no room. When the writer comes round to the ``REWIND`` chunk
it left and some reader has not read it yet (a burst right after the
rewind), it steps over it instead of waiting, so whatever fitted the ring
without a reader still does; the chunk before it says which (byte
``NEXT_AT``: 0 in order, 1 stepped over). Both ends remember the ``REWIND``
they passed last, so only that chunk's reader looks at the byte.

A :class:`RingCursor` is one queue end's position in the ring. Waiting for a
chunk is the queue's business (deadlines, liveness, notices): each call gets
a ``wait`` callback that returns once chunk ``idx`` is free (writer) or
written (reader), or raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
from collections.abc import Callable, Iterator
from typing import Any

from .array_frames import LARGE_DECODE_BYTES, decode_tensor, large_buffer
from .codec import MESSAGE_PREFIX, Codec, EncodedMessage, read_message, write_message
from .errors import ProtocolError
from .ring import ShmRingBuffer

__all__ = ["MSG_OFFSET", "REWIND_MIN_BYTES", "REWIND_SPAN_BYTES", "RingCursor"]

INLINE = 1
STREAM = 2
RAW = 3
TENSOR = 6
REWIND = 7
# Messages this large count towards, and may start, a rewind (see REWIND): a
# smaller one touches little of its chunk, which stays cached anyway.
REWIND_MIN_BYTES = 64 * 1024
# How many bytes of such messages a writer lets pass through the ring before
# it starts again at chunk 0, if the ring is empty then.
REWIND_SPAN_BYTES = 2 << 20
# The byte of a chunk that says whether the REWIND chunk after it was stepped over.
NEXT_AT = 1
MSG_OFFSET = 64
_TENSOR_HEAD = struct.Struct("<BQ")  # the tensor header's length, the tensor's bytes
_STREAM_LEN = struct.Struct("<Q")
_PART_COUNT = struct.Struct("<I")
_STREAM_ALLOWANCE = 4096  # a streamed tensor's bytes beyond its data, at most

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
        self.chunks = 0  # chunks written or read so far (idx wraps; this does not)
        self.span = 0  # writer: bytes of large messages written since idx was last 0
        # The REWIND chunk this end passed last, until it comes round to it again.
        self.left_rewind: int | None = None
        self.last = 0  # writer: the chunk it published last (readers release in order)
        self.capacity = ring.max_chunk_bytes - MSG_OFFSET  # message bytes in one chunk
        self.broken = False
        # Set just before a chunk is published (writer) or released (reader) and
        # cleared once the cursor has moved on: still set when the call has ended, an
        # exception (a signal handler's) came between the two, and the cursor is
        # one chunk behind what the ring says: the queue must close (MessageQueue's
        # _end_call), or the next message is written over a published one, or read
        # from a chunk the writer has not reached (read out of order, silently).
        self.in_step = False

    def _following(self, idx: int, rewind: bool, writing: bool) -> int:
        """The chunk after chunk ``idx`` for this end: 0 after a ``REWIND`` (which
        it then remembers), else the next in ring order, or the one after that when
        the next is the ``REWIND`` it passed last and the writer steps over it. The
        writer decides (some reader has not read that ``REWIND`` yet) and says so in
        byte ``NEXT_AT`` of chunk ``idx``, which its readers read (before release)."""
        ring = self.ring
        if rewind:
            self.left_rewind = idx
            return 0
        nxt = idx + 1 if idx + 1 < ring.max_chunks else 0
        if nxt != self.left_rewind:
            return nxt
        self.left_rewind = None
        at = ring.chunk_at[idx] + NEXT_AT
        if writing:
            over = not ring.chunk_free(nxt)
            ring.buf[at] = over
        else:
            over = bool(ring.buf[at])
        return (nxt + 1) % ring.max_chunks if over else nxt

    def _publish(self, idx: int, rewind: bool = False) -> None:
        """Writer: chunk ``idx`` is complete; let the readers see it and move on."""
        ring = self.ring
        nxt = idx + 1 if idx + 1 < ring.max_chunks else 0
        if rewind or nxt == self.left_rewind:  # else the common case, inline
            nxt = self._following(idx, rewind, True)
        self.in_step = True
        ring.publish(idx)
        self.last = idx
        self.idx = nxt
        if not nxt:
            self.span = 0
        self.chunks += 1
        self.in_step = False

    def _release(self, idx: int, me: int, rewind: bool = False) -> None:
        """Reader ``me``: done with chunk ``idx``; move on."""
        ring = self.ring
        nxt = idx + 1 if idx + 1 < ring.max_chunks else 0
        if rewind or nxt == self.left_rewind:  # else the common case, inline
            nxt = self._following(idx, rewind, False)
        self.in_step = True
        ring.release(idx, me)
        self.idx = nxt
        self.chunks += 1
        self.in_step = False

    def _ahead(self, count: int) -> list[int]:
        """Writer: the ``count`` chunks from here that messages would take now."""
        ring = self.ring
        out = [self.idx]
        rewind_left = self.left_rewind
        while len(out) < count:
            nxt = (out[-1] + 1) % ring.max_chunks
            if nxt == rewind_left:
                rewind_left = None
                if not ring.chunk_free(nxt):  # stepped over (see _following)
                    nxt = (nxt + 1) % ring.max_chunks
            out.append(nxt)
        return out

    def free_for(self, tensor_bytes: list[int]) -> bool:
        """Writer: whether lone tensors of these byte counts, written in order from
        here, would find every chunk they need free (no wait for a reader). Only the
        writer takes chunks, so the answer holds until it writes."""
        ring = self.ring
        needed = 0
        for n in tensor_bytes:
            # A tensor chunk's bytes start MSG_OFFSET into the message; a larger one
            # streams with a table and the codec's header (well under a KiB).
            fits_one = n <= self.capacity - MSG_OFFSET
            needed += 1 if fits_one else -(-(n + _STREAM_ALLOWANCE) // self.capacity)
        if needed > ring.max_chunks:
            return False
        return all(ring.chunk_free(idx) for idx in self._ahead(needed))

    # ---- writer ---------------------------------------------------------------

    def _rewind_if_empty(self, nbytes: int) -> None:
        """Writer, before a message of ``nbytes`` (``REWIND_MIN_BYTES`` or more):
        past ``REWIND_SPAN_BYTES`` since chunk 0, when every reader has read
        everything (the chunk published last is free: readers release in the order
        of publishing; not ``idx - 1``, which may be a ``REWIND`` stepped over),
        publish a ``REWIND`` and go back to chunk 0."""
        idx = self.idx
        self.span += nbytes
        ring = self.ring
        if idx == 0 or self.span <= REWIND_SPAN_BYTES or not ring.chunk_free(self.last):
            return
        ring.begin_write(idx)[ring.chunk_at[idx]] = REWIND
        self._publish(idx, rewind=True)
        self.span = nbytes

    def write(self, msg: EncodedMessage, wait_free: WaitFor) -> bool:
        """Write ``msg`` in one chunk; False (nothing written) when it is larger than
        a chunk: then :meth:`write_stream` it."""
        if msg.nbytes > self.capacity:
            return False
        buf, at, idx = self._begin(INLINE, wait_free, msg.nbytes)
        if msg.frames:
            write_message(msg, buf, at + MSG_OFFSET, self.ring.address)
        else:
            header = msg.header
            pos = at + MSG_OFFSET
            MESSAGE_PREFIX.pack_into(buf, pos, len(header), 0)
            buf[pos + 8 : pos + 8 + len(header)] = header
        self._publish(idx)
        return True

    def write_tensor(self, tensor: Any, meta: bytes, wait_free: WaitFor) -> bool:
        """Write a lone plain CPU tensor (``meta``: its wire header, from
        ``lone_tensor_meta``) as its bytes; False (nothing written) when it does not
        fit one chunk that way: then encode it."""
        nbytes = tensor.nbytes
        if nbytes > self.capacity - MSG_OFFSET or _TENSOR_HEAD.size + len(meta) > MSG_OFFSET:
            return False
        buf, at, idx = self._begin(TENSOR, wait_free, nbytes)
        pos = at + MSG_OFFSET
        _TENSOR_HEAD.pack_into(buf, pos, len(meta), nbytes)
        start = pos + _TENSOR_HEAD.size
        buf[start : start + len(meta)] = meta
        if nbytes:
            ctypes.memmove(self.ring.address + pos + MSG_OFFSET, tensor.data_ptr(), nbytes)
        self._publish(idx)
        return True

    def _begin(self, kind: int, wait_free: WaitFor, nbytes: int) -> tuple[memoryview, int, int]:
        """Open the next chunk for a message of ``nbytes``, once free, marked
        ``kind``: (the ring's buffer, the chunk's offset in it, its index)."""
        if nbytes >= REWIND_MIN_BYTES:
            self._rewind_if_empty(nbytes)
        idx = self.idx
        ring = self.ring
        if not ring.chunk_free(idx):
            wait_free(idx)
        buf = ring.begin_write(idx)
        at = ring.chunk_at[idx]
        buf[at] = kind
        return buf, at, idx

    def write_stream(self, parts: list[Any], wait_free: WaitFor) -> None:
        """Stream a message larger than a chunk (``parts``: header, then frames)."""
        ring = self.ring
        views = [memoryview(p).cast("B") for p in parts]
        table = struct.pack(f"<I{len(views)}Q", len(views), *(len(v) for v in views))
        # Each part starts 64-byte aligned in the stream (a reader finds it there).
        segments = []
        total = 0
        for v in [memoryview(table), *views]:
            pad = -total % 64
            if pad:
                segments.append(memoryview(bytes(pad)))
            segments.append(v)
            total += pad + len(v)
        count = -(-total // self.capacity)
        if total >= REWIND_MIN_BYTES:
            self._rewind_if_empty(total)
        if count <= ring.max_chunks:
            # It fits the ring: every chunk it needs is free before any is written.
            for idx in self._ahead(count):
                if not ring.chunk_free(idx):
                    wait_free(idx)
        first = True
        try:
            while segments:
                idx = self.idx
                if not ring.chunk_free(idx):
                    wait_free(idx)
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
                self._publish(idx)
        except BaseException:
            if not first:
                ring.set_shutdown()
                self.broken = True
            raise

    @contextlib.contextmanager
    def raw_write(self, wait_free: WaitFor) -> Iterator[memoryview]:
        """A writable view of the next chunk's payload, published when the block ends
        (not when it raises)."""
        buf, at, idx = self._begin(RAW, wait_free, 0)
        with buf[at + MSG_OFFSET : at + self.ring.max_chunk_bytes] as view:
            yield view
        self._publish(idx)

    # ---- reader ----------------------------------------------------------------

    def _wait_written(self, me: int, wait_ready: WaitFor) -> int:
        """The next chunk, once written: its index."""
        idx = self.idx
        if not self.ring.ready(idx, me):
            wait_ready(idx)
        return idx

    def _wait_message(self, me: int, wait_ready: WaitFor) -> int:
        """The chunk the next message starts in, once written: a ``REWIND`` chunk on
        the way is released and the wait goes on at chunk 0."""
        ring = self.ring
        while True:
            idx = self.idx
            if not ring.ready(idx, me):
                wait_ready(idx)
            if ring.buf[ring.chunk_at[idx]] != REWIND:
                return idx
            self._release(idx, me, rewind=True)

    def message_ready(self, me: int) -> bool:
        """Reader: whether a message is published and unread (no wait, no move)."""
        ring = self.ring
        idx = self.idx
        if ring.ready(idx, me) and ring.buf[ring.chunk_at[idx]] == REWIND:
            idx = 0  # a writer rewinds only to a chunk this reader has read
        return ring.ready(idx, me)

    def read(self, me: int, wait_ready: WaitFor, into: memoryview | None = None) -> Any:
        """The next message for local reader ``me``, decoded; a lone tensor of
        ``len(into)`` bytes lands in ``into`` (see ``MessageQueue.dequeue``)."""
        ring = self.ring
        idx = self._wait_message(me, wait_ready)
        buf = ring.buf
        at = ring.chunk_at[idx]
        kind = buf[at]
        if kind == STREAM:
            return self._read_stream(me, wait_ready, into)
        try:
            if kind == INLINE:
                pos = at + MSG_OFFSET
                header_len, n_frames = MESSAGE_PREFIX.unpack_from(buf, pos)
                if n_frames == 0:
                    return self.codec.decode_header_only(buf[pos + 8 : pos + 8 + header_len])
                return read_message(self.codec, buf, pos)
            if kind == TENSOR:
                return self._read_tensor(buf, at + MSG_OFFSET, into)
            if kind == RAW:
                raise ProtocolError(
                    f"{self.what}: chunk {idx} holds raw bytes written with acquire_write: "
                    "read them with acquire_read"
                )
            raise ProtocolError(f"{self.what}: chunk {idx} has unknown kind {kind}")
        finally:
            # Released even when decoding failed, so the queue stays usable.
            self._release(idx, me)

    def _read_tensor(self, buf: memoryview, pos: int, into: memoryview | None) -> Any:
        meta_len, nbytes = _TENSOR_HEAD.unpack_from(buf, pos)
        start = pos + _TENSOR_HEAD.size
        if start + meta_len > pos + MSG_OFFSET or nbytes > self.capacity - MSG_OFFSET:
            raise ProtocolError(f"{self.what}: a tensor chunk's header is out of bounds")
        data = pos + MSG_OFFSET
        with buf[start : start + meta_len] as meta, buf[data : data + nbytes] as frame:
            if into is not None and nbytes == len(into) and nbytes:
                into[:] = frame
                return decode_tensor(meta, (into,), owned=True)
            return decode_tensor(meta, (frame,), owned=False)

    def _read_stream(self, me: int, wait_ready: WaitFor, into: memoryview | None) -> Any:
        """Copy a streamed message's parts out as its chunks arrive (releasing each),
        each part into a buffer of its own (a lone tensor's: ``into``, when it is that
        size), then decode them."""
        ring = self.ring
        total = _STREAM_LEN.unpack_from(ring.buf, ring.chunk_at[self.idx] + 8)[0]
        stream = _StreamIn(self, me, wait_ready, total)
        try:
            (count,) = _PART_COUNT.unpack(stream.take(_PART_COUNT.size))
            lens = struct.unpack(f"<{count}Q", stream.take(8 * count)) if count else ()
            at = _PART_COUNT.size + 8 * count
            # [header, one frame] of exactly into's size: the frame goes there.
            sink = into if count == 2 and into is not None and lens[1] == len(into) else None
            parts = []
            for i, n in enumerate(lens):
                stream.skip(-at % 64)
                at += -at % 64 + n
                parts.append(stream.take(n, sink if i == 1 else None))
            stream.finish()
        except BaseException:
            stream.abandon()
            self.broken = True
            raise
        if not parts:
            raise ProtocolError(f"{self.what}: a streamed message has no header")
        # Each part is a buffer of its own: tensors are built on it, not copied.
        return self.codec.decode(parts[0], parts[1:], owned=True)

    @contextlib.contextmanager
    def raw_read(self, me: int, wait_ready: WaitFor) -> Iterator[memoryview]:
        """A view of the next chunk's payload, released to the writer when the block ends."""
        ring = self.ring
        idx = self._wait_message(me, wait_ready)
        at = ring.chunk_at[idx]
        if ring.buf[at] == STREAM:
            raise ProtocolError(
                f"{self.what}: chunk {idx} starts a message larger than a chunk "
                "(sent by enqueue): read it with dequeue"
            )
        try:
            with ring.buf[at + MSG_OFFSET : at + ring.max_chunk_bytes] as view:
                yield view
        finally:
            self._release(idx, me)


class _StreamIn:
    """A reader's pass over one stream: its bytes in order, chunk by chunk, each
    chunk released once every byte of it has been taken."""

    def __init__(self, cursor: RingCursor, me: int, wait_ready: WaitFor, total: int) -> None:
        self.cursor = cursor
        self.me = me
        self.wait_ready = wait_ready
        self.left = total  # stream bytes not yet in a chunk view
        self.idx = cursor.idx  # the chunk ``view`` lies in (already written)
        ring = cursor.ring
        pos = ring.chunk_at[self.idx] + MSG_OFFSET
        self.view = self._open(pos)

    def _open(self, pos: int) -> memoryview:
        n = min(self.cursor.capacity, self.left)
        self.left -= n
        return self.cursor.ring.buf[pos : pos + n]

    def _next_chunk(self) -> None:
        """Release the chunk taken in full; wait for the next one."""
        cursor = self.cursor
        self.view.release()
        if self.left <= 0:
            raise ProtocolError(f"{cursor.what}: a streamed message's parts run past its end")
        cursor._release(self.idx, self.me)
        self.idx = cursor._wait_written(self.me, self.wait_ready)
        self.view = self._open(cursor.ring.chunk_at[self.idx] + MSG_OFFSET)

    def _copy(self, dest: memoryview | None, n: int) -> None:
        done = 0
        while done < n:
            if not len(self.view):
                self._next_chunk()
            k = min(len(self.view), n - done)
            if dest is not None:
                dest[done : done + k] = self.view[:k]
            rest = self.view[k:]
            self.view.release()
            self.view = rest
            done += k

    def take(self, n: int, dest: memoryview | None = None) -> memoryview:
        """The next ``n`` bytes, in ``dest`` or a buffer of their own (pooled when large)."""
        if dest is None:
            dest = large_buffer(n) if n >= LARGE_DECODE_BYTES else memoryview(bytearray(n))
        self._copy(dest, n)
        return dest

    def skip(self, n: int) -> None:
        self._copy(None, n)

    def finish(self) -> None:
        """Release the last chunk; the stream must end exactly here."""
        cursor = self.cursor
        unread = self.left + len(self.view)
        self.view.release()
        if unread:
            raise ProtocolError(f"{cursor.what}: a streamed message's parts do not add up")
        cursor._release(self.idx, self.me)

    def abandon(self) -> None:
        """After a failure: drop the view into the ring (the queue is broken anyway)."""
        self.view.release()
