"""ShmRingBuffer: one shared-memory segment of chunks with per-chunk flags.

Layout (offsets from the segment start)::

    0     control block: magic, geometry, writer pid, shutdown flag, reader pids
    bells readers' bell, writer's bell (int32 futex words), asleep bytes: writer, readers
    flags max_chunks x (1 + n_reader) bytes: [written, read_0, read_1, ...] per chunk
    data  max_chunks x chunk_stride bytes, page aligned

Protocol, per chunk. Writer: wait until the chunk is free (never written, or
every reader flag set), clear ``written``, fill the data, clear every reader
flag, then set ``written``. Reader ``r``: wait until its own flag is clear
*and* ``written`` is set (reading its own flag first), read the data, then set
its own flag. Readers only ever write their own flag.

Memory ordering: the data stores become visible before the ``written`` store
(writer), the flag loads happen before the data loads (reader), and a
reader's data loads finish before its flag store. x86-64 (TSO) keeps that
order with plain byte stores through a memoryview (CPython performs them in
program order: each is an opaque call the C compiler cannot move); on weaker
machines ``memory_fence`` runs at the three points (see :mod:`.waiting`).

Sleeping. A reader that has waited ``SPIN_S`` for a message sleeps on the
readers' bell, which the writer rings after publishing a chunk when a
reader's asleep byte is set; a writer waiting for a chunk to be freed sleeps
on its own bell, rung by the reader whose release frees it. So an idle reader
costs no CPU and the first message after idleness wakes it at once. The
handshake is the one :mod:`.waiting` describes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from .errors import GroupcoordValueError, ProtocolError
from .liveness import pid_namespace, process_alive
from .segments import ShmSegment, smaller_where_no_room
from .waiting import futex_available, futex_wait, futex_wake, memory_fence, needs_fence

__all__ = [
    "ShmRingBuffer",
    "memory_fence",
    "needs_fence",
    "pid_namespace",
    "process_alive",
    "to_bytes_big",
]

T = TypeVar("T")

_MAGIC = 0x47435242  # "GCRB"
_VERSION = 4  # 4: each chunk's flags on a cache line of their own
# magic, version, n_reader, max_chunks, max_chunk_bytes, writer_pid, pid_ns, shutdown
_CONTROL = struct.Struct("<IIIIQQQQ")
_PID = struct.Struct("<Q")
_PAGE = 4096
# The ring a queue of ours falls back to when its usual one does not fit in
# /dev/shm (in_a_ring_that_fits).
SMALL_RING_BYTES = 8 << 20
# The bells line: readers' bell (int32), writer's bell (int32), then one
# asleep byte for the writer and one per reader.
_READER_BELL = 0
_WRITER_BELL = 4
_WRITER_ASLEEP = 8
_READERS_ASLEEP = 9
# A reader that detached cleanly writes this in its pid slot.
READER_DETACHED = 2**64 - 1


def to_bytes_big(value: int, size: int) -> bytes:
    """``value`` as ``size`` big-endian bytes (vLLM's helper)."""
    return value.to_bytes(size, byteorder="big")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _flag_stride(n_reader: int) -> int:
    """Bytes from one chunk's flags to the next: a cache line each (flags of chunks
    the writer and a reader use at once shared a line, and each store took it from
    the other's core)."""
    return _round_up(1 + n_reader, 64)


def _offsets(n_reader: int, max_chunks: int) -> tuple[int, int, int]:
    """(bells line, flags, data) offsets of a ring's layout."""
    bells = _round_up(_CONTROL.size + _PID.size * n_reader, 64)
    flags = _round_up(bells + _READERS_ASLEEP + n_reader, 64)
    data = _round_up(flags + _flag_stride(n_reader) * max_chunks, _PAGE)
    return bells, flags, data


class ShmRingBuffer:
    """``max_chunks`` chunks of ``max_chunk_bytes`` plus flags for ``n_reader`` local readers.

    ``ShmRingBuffer(n_reader, max_chunk_bytes, max_chunks)`` creates the segment
    (the writer); with ``name`` it maps that existing ring, whose geometry must
    be the one given (vLLM's constructor). :meth:`attach` maps a ring by name
    alone, reading its geometry from the segment.
    """

    def __init__(
        self, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str | None = None
    ) -> None:
        for arg, value, low in (
            ("n_reader", n_reader, 1),
            ("max_chunk_bytes", max_chunk_bytes, 256),
            ("max_chunks", max_chunks, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GroupcoordValueError(f"{arg} must be an int >= {low}, got {value!r}")
        if name is not None:
            segment, geometry = self._map(name)
            if geometry != (n_reader, max_chunk_bytes, max_chunks):
                segment.close()
                raise GroupcoordValueError(
                    f"ring {name} holds n_reader, max_chunk_bytes, max_chunks = {geometry}, "
                    f"not the {(n_reader, max_chunk_bytes, max_chunks)} given"
                )
            self._setup(segment, *geometry)
            return
        segment = ShmSegment.create(self.nbytes_for(n_reader, max_chunks, max_chunk_bytes), "ring")
        try:
            _CONTROL.pack_into(
                segment.buf,
                0,
                _MAGIC,
                _VERSION,
                n_reader,
                max_chunks,
                max_chunk_bytes,
                os.getpid(),
                pid_namespace(),
                0,
            )
            self._setup(segment, n_reader, max_chunk_bytes, max_chunks)
        except BaseException:
            segment.close()
            segment.unlink()
            raise

    @classmethod
    def attach(cls, name: str) -> ShmRingBuffer:
        """Map an existing ring by segment name (reader side); geometry comes from it."""
        segment, geometry = cls._map(name)
        ring = cls.__new__(cls)
        ring._setup(segment, *geometry)
        return ring

    @classmethod
    def _map(cls, name: str) -> tuple[ShmSegment, tuple[int, int, int]]:
        segment = ShmSegment.attach(name)
        try:
            magic, version, n_reader, max_chunks, max_chunk_bytes, *_ = _CONTROL.unpack_from(
                segment.buf, 0
            )
            if magic != _MAGIC or version != _VERSION:
                raise ProtocolError(f"{name} is not a version-{_VERSION} groupcoord ring")
            if segment.size < cls.nbytes_for(n_reader, max_chunks, max_chunk_bytes):
                raise ProtocolError(f"{name} is smaller than its geometry says")
        except BaseException:
            segment.close()
            raise
        return segment, (n_reader, max_chunk_bytes, max_chunks)

    def _setup(
        self, segment: ShmSegment, n_reader: int, max_chunk_bytes: int, max_chunks: int
    ) -> None:
        self.segment = segment
        self.n_reader = n_reader
        self.max_chunks = max_chunks
        self.max_chunk_bytes = max_chunk_bytes
        self.name = segment.name
        self.bells_offset, self.flags_offset, self.data_offset = _offsets(n_reader, max_chunks)
        self.flag_stride = _flag_stride(n_reader)
        self.chunk_stride = _round_up(max_chunk_bytes, 64)
        self.buf = segment.buf
        # Precomputed per-chunk offsets keep the hot path free of arithmetic.
        self.written_at = [self.flags_offset + i * self.flag_stride for i in range(max_chunks)]
        self.chunk_at = [self.data_offset + i * self.chunk_stride for i in range(max_chunks)]
        self._all_read = b"\x01" * n_reader
        self._none_read = b"\x00" * n_reader
        self._bells = self.buf[self.bells_offset : self.bells_offset + 8].cast("i")
        # Views made once (a slice made per call took 65 ns of a publish's 330): each
        # chunk's readers' flags, and the readers' asleep bytes. close() releases them.
        self._read_flags = [self.buf[at + 1 : at + 1 + n_reader] for at in self.written_at]
        at = self.bells_offset + _READERS_ASLEEP
        self._readers_asleep = self.buf[at : at + n_reader]
        self._use_futex = futex_available()
        holder = ctypes.c_char.from_buffer(self.buf)
        # The address outlives the ctypes object (which would pin the mapping):
        # it is used only while the mapping is open (close() comes after the
        # last wait and the last write).
        self.address = ctypes.addressof(holder)
        self._bells_address = self.address + self.bells_offset
        del holder

    @staticmethod
    def nbytes_for(n_reader: int, max_chunks: int, max_chunk_bytes: int) -> int:
        return _offsets(n_reader, max_chunks)[2] + max_chunks * _round_up(max_chunk_bytes, 64)

    def handle(self) -> tuple[int, int, int, str]:
        """``(n_reader, max_chunk_bytes, max_chunks, name)``: what maps this ring
        elsewhere, ``ShmRingBuffer(*ring.handle())`` (vLLM's order)."""
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name)

    @contextlib.contextmanager
    def get_data(self, current_idx: int) -> Iterator[memoryview]:
        """The ``max_chunk_bytes`` of chunk ``current_idx``, as a writable view."""
        at = self.chunk_at[self._chunk_index(current_idx)]
        with self.buf[at : at + self.max_chunk_bytes] as view:
            yield view

    @contextlib.contextmanager
    def get_metadata(self, current_idx: int) -> Iterator[memoryview]:
        """Chunk ``current_idx``'s flags: ``[written, read_0, ..., read_{n-1}]``."""
        at = self.written_at[self._chunk_index(current_idx)]
        with self.buf[at : at + 1 + self.n_reader] as view:
            yield view

    def _chunk_index(self, idx: int) -> int:
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < self.max_chunks:
            raise GroupcoordValueError(
                f"current_idx must be an int in [0, {self.max_chunks}), got {idx!r}"
            )
        return idx

    # -- control block ------------------------------------------------------

    @property
    def writer_pid(self) -> int:
        return _CONTROL.unpack_from(self.buf, 0)[5]

    @property
    def writer_pid_namespace(self) -> int:
        return _CONTROL.unpack_from(self.buf, 0)[6]

    @property
    def shutdown_flag(self) -> bool:
        return self.buf[_CONTROL.size - 8] != 0

    def set_shutdown(self) -> None:
        self.buf[_CONTROL.size - 8] = 1
        memory_fence()
        self.ring_readers()

    def reader_pid(self, reader: int) -> int:
        return _PID.unpack_from(self.buf, _CONTROL.size + _PID.size * reader)[0]

    def set_reader_pid(self, reader: int, pid: int) -> None:
        _PID.pack_into(self.buf, _CONTROL.size + _PID.size * reader, pid)

    # -- flags (hot path) -----------------------------------------------------

    def chunk_free(self, idx: int) -> bool:
        """Writer: may chunk ``idx`` be overwritten (never written, or read by all)?"""
        at = self.written_at[idx]
        buf = self.buf
        return buf[at] == 0 or self._read_flags[idx] == self._all_read

    def readers_missing(self, idx: int) -> list[int]:
        """Local reader indices that have not read chunk ``idx`` yet."""
        at = self.written_at[idx] + 1
        return [r for r in range(self.n_reader) if self.buf[at + r] == 0]

    def begin_write(self, idx: int) -> memoryview:
        """Writer: take chunk ``idx`` (must be free); returns the segment buffer."""
        self.buf[self.written_at[idx]] = 0
        return self.buf

    def publish(self, idx: int) -> None:
        """Writer: the data of chunk ``idx`` is complete; let readers see it."""
        at = self.written_at[idx]
        buf = self.buf
        if needs_fence:
            memory_fence()  # data stores before the flag stores
        self._read_flags[idx][:] = self._none_read
        buf[at] = 1
        memory_fence()  # the flag store before the load of the asleep bytes
        if self._readers_asleep != self._none_read:
            self.ring_readers()

    def ready(self, idx: int, reader: int) -> bool:
        """Reader: is chunk ``idx`` written and not yet read by ``reader``?"""
        at = self.written_at[idx]
        buf = self.buf
        # Own flag first: it was cleared after ``written`` was cleared, so a
        # clear own flag followed by a set ``written`` means a new message.
        if buf[at + 1 + reader] != 0:
            return False
        if buf[at] != 1:
            return False
        if needs_fence:
            memory_fence()  # flag loads before data loads
        return True

    def release(self, idx: int, reader: int) -> None:
        """Reader: done with chunk ``idx``; the writer may reuse it once all are."""
        if needs_fence:
            memory_fence()  # data loads before the flag store
        buf = self.buf
        buf[self.written_at[idx] + 1 + reader] = 1
        memory_fence()  # the flag store before the load of the writer's asleep byte
        if buf[self.bells_offset + _WRITER_ASLEEP]:
            self.ring_writer()

    # -- sleeping and waking ------------------------------------------------

    def ring_readers(self) -> None:
        """Wake every reader asleep on the readers' bell (a publish, a shutdown)."""
        self._ring(_READER_BELL)

    def ring_writer(self) -> None:
        """Wake the writer asleep on its bell (a release, a reader leaving)."""
        self._ring(_WRITER_BELL)

    def _ring(self, bell: int) -> None:
        words = self._bells
        words[bell // 4] = (words[bell // 4] + 1) & 0x7FFFFFFF
        if self._use_futex:
            futex_wake(self._bells_address + bell)

    def reader_sleep(self, idx: int, reader: int, at_most_s: float) -> None:
        """Reader: sleep until the writer rings (or ``at_most_s``) unless chunk
        ``idx`` is ready by the time this reader is marked asleep."""
        self._sleep(
            _READER_BELL, _READERS_ASLEEP + reader, lambda: self.ready(idx, reader), at_most_s
        )

    def writer_sleep(self, idx: int, at_most_s: float) -> None:
        """Writer: sleep until a reader rings (or ``at_most_s``) unless chunk ``idx``
        is free by the time the writer is marked asleep."""
        self._sleep(_WRITER_BELL, _WRITER_ASLEEP, lambda: self.chunk_free(idx), at_most_s)

    def _sleep(self, bell: int, asleep: int, ready: Callable[[], bool], at_most_s: float) -> None:
        if not self._use_futex:
            time.sleep(min(at_most_s, 0.0002))
            return
        buf = self.buf
        value = self._bells[bell // 4]  # read first: a ring after this read wakes us
        buf[self.bells_offset + asleep] = 1
        memory_fence()  # "asleep" visible before the re-check's loads
        try:
            if not ready():
                futex_wait(self._bells_address + bell, value, at_most_s)
        finally:
            buf[self.bells_offset + asleep] = 0

    def close(self) -> None:
        """Unmap (both sides). The creator also calls :meth:`unlink`."""
        for view in (self._bells, self._readers_asleep, *self._read_flags):
            view.release()
        self.buf = memoryview(b"")
        self.segment.close()

    def unlink(self) -> None:
        self.segment.unlink()


def in_a_ring_that_fits(
    make: Callable[[int], T], max_chunk_bytes: int, max_chunks: int, what: str
) -> T:
    """``make(max_chunks)``, the queue of a ring of ``max_chunks`` chunks; where
    /dev/shm has no room for it, ``make`` of a small ring of about
    ``SMALL_RING_BYTES`` (at least 2 chunks), which messages larger than it stream
    through (``segments.smaller_where_no_room``). How our own queues (a group's
    broadcaster, a pair's channel) take a ring; one a caller sized itself is
    refused instead."""
    small = min(max_chunks, max(2, SMALL_RING_BYTES // max_chunk_bytes))
    return smaller_where_no_room(make, max_chunks, small, what, "ring chunks")[0]
