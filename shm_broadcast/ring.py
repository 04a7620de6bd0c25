"""ShmRingBuffer: one shared-memory segment of chunks with per-chunk flags.

Layout (offsets from the segment start)::

    0     control block: magic, geometry, writer pid, shutdown flag, reader pids
    flags max_chunks x (1 + n_reader) bytes: [written, read_0, read_1, ...] per chunk
    data  max_chunks x chunk_stride bytes, page aligned

Protocol, per chunk. Writer: wait until the chunk is free (never written, or
every reader flag set), clear ``written``, fill the data, clear every reader
flag, then set ``written``. Reader ``r``: wait until its own flag is clear
*and* ``written`` is set (reading its own flag first), read the data, then set
its own flag. Readers only ever write their own flag.

Memory ordering. The protocol needs: the data stores become visible before
the ``written`` store (writer), the flag loads happen before the data loads
(reader), and a reader's data loads finish before its flag store. On x86-64
(TSO) plain stores are seen in program order and loads are not reordered with
older loads nor stores with older loads, so plain byte stores through a
memoryview are enough; CPython performs them in program order (each is an
opaque call the C compiler cannot move). On weaker machines (Arm, POWER,
RISC-V) we call ``atomic_thread_fence(seq_cst)`` from libatomic (a real
``dmb ish`` / ``sync``) at the three points above; if libatomic is missing we
fall back to an uncontended lock acquire/release, whose barriers order memory
in practice, and log that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import struct
import threading
from collections.abc import Callable

from .errors import GroupcoordValueError, ProtocolError
from .liveness import pid_namespace, process_alive
from .segments import ShmSegment

__all__ = [
    "ShmRingBuffer",
    "memory_fence",
    "needs_fence",
    "pid_namespace",
    "process_alive",
    "to_bytes_big",
]

logger = logging.getLogger("groupcoord.shm_broadcast")

_MAGIC = 0x47435242  # "GCRB"
_VERSION = 1
# magic, version, n_reader, max_chunks, max_chunk_bytes, writer_pid, pid_ns, shutdown
_CONTROL = struct.Struct("<IIIIQQQQ")
_PID = struct.Struct("<Q")
_PAGE = 4096
# A reader that detached cleanly writes this in its pid slot.
READER_DETACHED = 2**64 - 1


def _make_fence() -> tuple[bool, Callable[[], None]]:
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return False, lambda: None
    path = ctypes.util.find_library("atomic")
    if path:
        fence = ctypes.CDLL(path).atomic_thread_fence
        fence.argtypes = [ctypes.c_int]
        fence.restype = None
        return True, lambda: fence(5)  # memory_order_seq_cst
    logger.warning("libatomic not found: using a lock acquire/release as the memory fence")
    lock = threading.Lock()

    def lock_fence() -> None:
        lock.acquire()
        lock.release()

    return True, lock_fence


needs_fence, memory_fence = _make_fence()


def to_bytes_big(value: int, size: int) -> bytes:
    """``value`` as ``size`` big-endian bytes (vLLM's helper)."""
    return value.to_bytes(size, byteorder="big")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class ShmRingBuffer:
    """``max_chunks`` chunks of ``max_chunk_bytes`` plus flags for ``n_reader`` local readers."""

    def __init__(self, segment: ShmSegment, n_reader: int, max_chunks: int, max_chunk_bytes: int):
        self.segment = segment
        self.n_reader = n_reader
        self.max_chunks = max_chunks
        self.max_chunk_bytes = max_chunk_bytes
        self.name = segment.name
        self.flags_offset = _round_up(_CONTROL.size + _PID.size * n_reader, 64)
        self.flag_stride = 1 + n_reader
        self.data_offset = _round_up(self.flags_offset + self.flag_stride * max_chunks, _PAGE)
        self.chunk_stride = _round_up(max_chunk_bytes, 64)
        self.buf = segment.buf
        # Precomputed per-chunk offsets keep the hot path free of arithmetic.
        self.written_at = [self.flags_offset + i * self.flag_stride for i in range(max_chunks)]
        self.chunk_at = [self.data_offset + i * self.chunk_stride for i in range(max_chunks)]
        self._all_read = b"\x01" * n_reader
        self._none_read = b"\x00" * n_reader

    @staticmethod
    def nbytes_for(n_reader: int, max_chunks: int, max_chunk_bytes: int) -> int:
        flags_offset = _round_up(_CONTROL.size + _PID.size * n_reader, 64)
        data_offset = _round_up(flags_offset + (1 + n_reader) * max_chunks, _PAGE)
        return data_offset + max_chunks * _round_up(max_chunk_bytes, 64)

    @classmethod
    def create(cls, n_reader: int, max_chunk_bytes: int, max_chunks: int) -> ShmRingBuffer:
        """Create the segment (writer side); refuses sizes /dev/shm cannot hold."""
        for arg, value, low in (
            ("n_reader", n_reader, 1),
            ("max_chunk_bytes", max_chunk_bytes, 256),
            ("max_chunks", max_chunks, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GroupcoordValueError(f"{arg} must be an int >= {low}, got {value!r}")
        segment = ShmSegment.create(cls.nbytes_for(n_reader, max_chunks, max_chunk_bytes), "ring")
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
            return cls(segment, n_reader, max_chunks, max_chunk_bytes)
        except BaseException:
            segment.close()
            segment.unlink()
            raise

    @classmethod
    def attach(cls, name: str) -> ShmRingBuffer:
        """Map an existing ring by segment name (reader side); geometry comes from it."""
        segment = ShmSegment.attach(name)
        try:
            magic, version, n_reader, max_chunks, max_chunk_bytes, *_ = _CONTROL.unpack_from(
                segment.buf, 0
            )
            if magic != _MAGIC or version != _VERSION:
                raise ProtocolError(f"{name} is not a version-{_VERSION} groupcoord ring")
            ring = cls(segment, n_reader, max_chunks, max_chunk_bytes)
            if segment.size < cls.nbytes_for(n_reader, max_chunks, max_chunk_bytes):
                raise ProtocolError(f"{name} is smaller than its geometry says")
            return ring
        except BaseException:
            segment.close()
            raise

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

    def reader_pid(self, reader: int) -> int:
        return _PID.unpack_from(self.buf, _CONTROL.size + _PID.size * reader)[0]

    def set_reader_pid(self, reader: int, pid: int) -> None:
        _PID.pack_into(self.buf, _CONTROL.size + _PID.size * reader, pid)

    # -- flags (hot path) -----------------------------------------------------

    def chunk_free(self, idx: int) -> bool:
        """Writer: may chunk ``idx`` be overwritten (never written, or read by all)?"""
        at = self.written_at[idx]
        buf = self.buf
        return buf[at] == 0 or buf[at + 1 : at + self.flag_stride] == self._all_read

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
        buf[at + 1 : at + self.flag_stride] = self._none_read
        buf[at] = 1

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
        self.buf[self.written_at[idx] + 1 + reader] = 1

    def close(self) -> None:
        """Unmap (both sides). The creator also calls :meth:`unlink`."""
        self.buf = memoryview(b"")
        self.segment.close()

    def unlink(self) -> None:
        self.segment.unlink()
