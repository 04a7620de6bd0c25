"""MessageQueue: one writer, many readers, in order, nothing lost.

Local readers (same node) read a :class:`ShmRingBuffer`. A message fits one
chunk, or spans several consecutive chunks (contiguous in the segment, so it
is decoded in place), or, larger than the whole ring, streams through the
chunks in order while the readers copy it out. Remote readers get every
message over TCP (:mod:`.tcp_channel`: MACs, credit flow control). Every wait
has a deadline; a dead peer raises :class:`PeerDiedError`;
:meth:`MessageQueue.shutdown` wakes a waiting reader. Local readers also
connect a ZeroMQ ``ipc://`` socket to the writer: ``wait_until_ready``'s
handshake runs over it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import math
import os
import re
import secrets
import socket
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from .codec import (
    MESSAGE_PREFIX,
    Codec,
    EncodedMessage,
    dumps,
    frames_as_buffers,
    loads,
    read_message,
    write_message,
)
from .config import get_config, resolve_timeout
from .errors import (
    ClosedError,
    GroupcoordTimeoutError,
    GroupcoordValueError,
    NotSupportedError,
    PeerDiedError,
    ProtocolError,
)
from .group_io import all_gather_bytes, broadcast_bytes, group_rank_and_size
from .ring import READER_DETACHED, ShmRingBuffer, pid_namespace, process_alive
from .segments import unlink_segment
from .tcp_channel import KIND_READY, TcpReader, TcpWriter
from .topology import in_the_same_node_as
from .waiting import wait_until

__all__ = ["Handle", "MessageQueue", "cleanup_stale_ipc_files"]

logger = logging.getLogger("groupcoord.shm_broadcast")

# First byte of a chunk: what the chunk holds. The message itself starts
# _MSG_OFFSET bytes in, so its frames are 64-byte aligned.
_INLINE = 1
# A message larger than the ring: its bytes stream through the chunks in
# order, each chunk filled and published as the writer gets to it (readers
# copy each out as it comes). The first chunk holds the stream's length (u64
# after the kind byte); the stream is [u32 parts][u64 length per part][parts],
# the parts being the codec's header and frames.
_STREAM = 2
_RAW = 3  # bytes written through acquire_write
# A message larger than a chunk that fits the ring: it starts at its first
# chunk's _MSG_OFFSET and runs on through the next chunks (contiguous in the
# segment); the first chunk says how many (uint32 after the kind byte). Only
# the first chunk has a kind byte: the others are message bytes throughout.
_SPAN = 4
# Chunks at the ring's end that a span skipped to start contiguous at chunk 0.
_PAD = 5
_SPAN_COUNT = struct.Struct("<I")
_STREAM_LEN = struct.Struct("<Q")
_MSG_OFFSET = 64
_READY = b"READY"
_IPC_PREFIX = "groupcoord_mq_"
_IPC_RE = re.compile(r"^groupcoord_mq_groupcoord_(\d+)_ring_[0-9a-f]+\.sock$")
# An unbounded enqueue/dequeue (timeout=None) logs that it still waits this often.
_IDLE_NOTICE_S = 60.0


class Handle(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a reader needs to join a queue (plain data; travels without pickle)."""

    name: str
    n_reader: int
    local_reader_ranks: list[int]
    writer_rank: int
    writer_pid: int
    writer_host: str
    max_chunk_bytes: int
    max_chunks: int
    buffer_name: str | None
    local_address: str | None
    remote_address: str | None
    key: bytes
    window: int
    allow_pickle: bool

    # vLLM 0.33's field names, read from ours.
    @property
    def buffer_handle(self) -> tuple[int, int, int, str] | None:
        """(local readers, chunk bytes, chunks, ring name), or None without local readers."""
        if self.buffer_name is None:
            return None
        return (
            len(self.local_reader_ranks),
            self.max_chunk_bytes,
            self.max_chunks,
            self.buffer_name,
        )

    @property
    def local_subscribe_addr(self) -> str | None:
        return self.local_address

    @property
    def remote_subscribe_addr(self) -> str | None:
        return self.remote_address

    @property
    def remote_addr_ipv6(self) -> bool:
        return self.remote_address is not None and "[" in self.remote_address

    @property
    def local_notify_addr(self) -> str | None:
        """None: local readers are woken through the ring, not a notify socket."""
        return None

    @property
    def tensor_arena_handle(self) -> None:
        """None: there is no separate tensor arena (see ``enable_shm_tensor_arena``)."""
        return None


def _default_ip() -> str:
    """This host's outward interface address (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _ipc_path(ring_name: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{_IPC_PREFIX}{ring_name}.sock")


def _remove_ipc_file(address: str | None) -> None:
    if address and address.startswith("ipc://"):
        try:
            os.unlink(address[len("ipc://") :])
        except FileNotFoundError:
            return


def cleanup_stale_ipc_files() -> list[str]:
    """Remove handshake socket files whose creating process is gone (named after its ring)."""
    removed = []
    folder = tempfile.gettempdir()
    for entry in os.listdir(folder):
        match = _IPC_RE.match(entry)
        if match and not process_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(folder, entry))
            except FileNotFoundError:
                continue
            removed.append(entry)
    return removed


def _close_zmq(ctx: zmq.Context, owned: list[Any]) -> None:
    """Close a queue's ZeroMQ sockets (and TCP ends, heartbeat threads included)
    without lingering, then terminate its context. Run when a queue that was
    never shut down is garbage-collected: the sockets are held here, so they
    cannot be collected first, leaving ``zmq_ctx_term`` waiting forever for a
    socket whose close never comes (seen as a rank hung inside a GC pass)."""
    for item in owned:
        if isinstance(item, zmq.Socket):
            if not item.closed:
                item.close(linger=0)
        else:
            item.close()
    owned.clear()
    ctx.term()


# Every queue of this process that is not shut down yet (weak: a dropped queue leaves).
_live_queues: weakref.WeakSet[MessageQueue] = weakref.WeakSet()


def _shut_down_open_queues() -> None:
    """At interpreter exit: shut down the queues this process left open, without
    lingering, so ZeroMQ contexts never hold the exit up and readers are told
    the queue ended (a ``ClosedError``) instead of finding a dead writer. A
    forked child's queues belong to its parent and are left alone."""
    for mq in list(_live_queues):
        if mq._owner_pid == os.getpid():
            mq._shutdown_now()


atexit.register(_shut_down_open_queues)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise GroupcoordValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class MessageQueue:
    """Single-writer multi-reader broadcast queue (vLLM-compatible API)."""

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = 1024 * 1024 * 24,
        max_chunks: int = 10,
        connect_ip: str | None = None,
        enable_shm_tensor_arena: bool = False,
        *,
        name: str | None = None,
        allow_pickle: bool = False,
        writer_rank: int = 0,
    ) -> None:
        if enable_shm_tensor_arena:
            raise NotSupportedError.by_groupcoord(
                "MessageQueue(enable_shm_tensor_arena=True)",
                "tensors travel inside the ring's chunks (or ZeroMQ beyond a chunk); "
                "there is no separate arena",
            )
        cfg = get_config()
        _check_int("n_reader", n_reader, 0)
        _check_int("n_local_reader", n_local_reader, 0)
        if n_local_reader > n_reader:
            raise GroupcoordValueError(
                f"n_local_reader={n_local_reader} exceeds n_reader={n_reader}"
            )
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        if (
            len(local_reader_ranks) != n_local_reader
            or len(set(local_reader_ranks)) != n_local_reader
        ):
            raise GroupcoordValueError(
                f"local_reader_ranks={local_reader_ranks} must hold {n_local_reader} distinct ranks"
            )
        max_chunk_bytes = _check_int(
            "max_chunk_bytes",
            cfg.mq_max_chunk_bytes if max_chunk_bytes is None else max_chunk_bytes,
            256,
        )
        max_chunks = _check_int(
            "max_chunks", cfg.mq_max_chunks if max_chunks is None else max_chunks, 1
        )
        if connect_ip in ("*", "0.0.0.0", "::"):
            raise GroupcoordValueError(f"connect_ip must name one interface, got {connect_ip!r}")
        self.name = name or f"mq{secrets.token_hex(3)}"
        self.what = f"MessageQueue {self.name}"
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.local_reader_ranks = list(local_reader_ranks)
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.allow_pickle = allow_pickle
        self.writer_rank = writer_rank
        self.role = "writer"
        self.rank = writer_rank
        self._codec = Codec(allow_pickle=allow_pickle)
        self._closed = False
        self._released = False
        self._busy = False
        self._notice: str | None = None  # the operation of an unbounded wait, for its log
        self._key = secrets.token_bytes(32)
        self._window = max(16, max_chunks)
        self._ctx = zmq.Context()
        self._teardown = threading.RLock()
        self._zmq_owned: list[Any] = []  # closed by _close_zmq if the queue is collected open
        self._zmq_finalizer = weakref.finalize(self, _close_zmq, self._ctx, self._zmq_owned)
        self._zmq_finalizer.atexit = False  # the exit hook shuts open queues down first
        self._ring: ShmRingBuffer | None = None
        self._local_sock: zmq.Socket | None = None
        self._local_address: str | None = None
        self._tcp_writer: TcpWriter | None = None
        self._tcp_reader: TcpReader | None = None
        self._idx = 0
        self._local_index = -1
        self._handle: Handle | None = None
        self._owner_pid = os.getpid()
        _live_queues.add(self)
        try:
            if n_local_reader:
                self._ring = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
                self._local_sock = self._ctx.socket(zmq.XPUB)
                self._zmq_owned.append(self._local_sock)
                self._local_sock.setsockopt(zmq.XPUB_VERBOSE, 1)
                self._local_sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the ring instead
                self._local_sock.setsockopt(zmq.LINGER, 2000)
                cleanup_stale_ipc_files()
                self._local_address = f"ipc://{_ipc_path(self._ring.name)}"
                self._local_sock.bind(self._local_address)
            if n_reader > n_local_reader:
                self._tcp_writer = TcpWriter(
                    self._ctx,
                    connect_ip or _default_ip(),
                    self._key,
                    n_reader - n_local_reader,
                    self._window,
                    max_chunks * max_chunk_bytes,
                    self.what,
                )
                self._zmq_owned.append(self._tcp_writer)
        except BaseException:
            self._abandon()
            raise
        self._capacity = max_chunk_bytes - _MSG_OFFSET

    # -- construction -------------------------------------------------------

    def export_handle(self) -> Handle:
        """The handle readers pass to :meth:`create_from_handle` (writer only)."""
        if self.role != "writer":
            raise GroupcoordValueError(f"{self.what}: only the writer exports a handle")
        return Handle(
            name=self.name,
            n_reader=self.n_reader,
            local_reader_ranks=self.local_reader_ranks,
            writer_rank=self.writer_rank,
            writer_pid=os.getpid(),
            writer_host=socket.gethostname(),
            max_chunk_bytes=self.max_chunk_bytes,
            max_chunks=self.max_chunks,
            buffer_name=self._ring.name if self._ring else None,
            local_address=self._local_address,
            remote_address=self._tcp_writer.address if self._tcp_writer else None,
            key=self._key,
            window=self._window,
            allow_pickle=self.allow_pickle,
        )

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        """Join as a reader: a local one if ``rank`` is in the handle's local ranks."""
        if not isinstance(handle, Handle):
            raise GroupcoordValueError(f"handle must be a Handle, got {type(handle).__qualname__}")
        self = MessageQueue.__new__(MessageQueue)
        self.name = handle.name
        self.what = f"MessageQueue {handle.name}"
        self.n_reader = handle.n_reader
        self.n_local_reader = len(handle.local_reader_ranks)
        self.local_reader_ranks = list(handle.local_reader_ranks)
        self.max_chunk_bytes = handle.max_chunk_bytes
        self.max_chunks = handle.max_chunks
        self.allow_pickle = handle.allow_pickle
        self.writer_rank = handle.writer_rank
        self.rank = rank
        self._codec = Codec(allow_pickle=handle.allow_pickle)
        self._closed = False
        self._released = False
        self._busy = False
        self._notice = None
        self._key = handle.key
        self._window = handle.window
        self._ctx = zmq.Context()
        self._teardown = threading.RLock()
        self._zmq_owned = []
        self._zmq_finalizer = weakref.finalize(self, _close_zmq, self._ctx, self._zmq_owned)
        self._zmq_finalizer.atexit = False  # the exit hook shuts open queues down first
        self._ring = None
        self._local_sock = None
        self._local_address = handle.local_address
        self._tcp_writer = None
        self._tcp_reader = None
        self._idx = 0
        self._handle = handle
        self._capacity = handle.max_chunk_bytes - _MSG_OFFSET
        self._owner_pid = os.getpid()
        _live_queues.add(self)
        try:
            if rank in handle.local_reader_ranks:
                self.role = "local reader"
                self._local_index = handle.local_reader_ranks.index(rank)
                if handle.buffer_name is None or handle.local_address is None:
                    raise ProtocolError(f"{self.what}: handle has local readers but no ring")
                self._ring = ShmRingBuffer.attach(handle.buffer_name)
                self._ring.set_reader_pid(self._local_index, os.getpid())
                self._local_sock = self._ctx.socket(zmq.SUB)
                self._zmq_owned.append(self._local_sock)
                self._local_sock.setsockopt(zmq.RCVHWM, 0)
                self._local_sock.setsockopt(zmq.LINGER, 0)
                self._local_sock.setsockopt(zmq.SUBSCRIBE, b"")
                self._local_sock.connect(handle.local_address)
            else:
                self.role = "remote reader"
                self._local_index = -1
                if handle.remote_address is None:
                    raise GroupcoordValueError(
                        f"{self.what}: rank {rank} is not a local reader "
                        f"({handle.local_reader_ranks}) and the queue has no remote readers"
                    )
                self._tcp_reader = TcpReader(
                    self._ctx,
                    handle.remote_address,
                    handle.key,
                    rank,
                    handle.window,
                    self.what,
                    handle.writer_rank,
                )
                self._zmq_owned.append(self._tcp_reader)
        except BaseException:
            self._abandon()
            raise
        return self

    # -- readiness ---------------------------------------------------------

    def wait_until_ready(self, *, timeout: float | datetime.timedelta | None = None) -> None:
        """Collective: return once every reader is connected (writer) / the writer is (reader)."""
        timeout_s = resolve_timeout(timeout)
        deadline = time.monotonic() + timeout_s
        if self.role == "writer":
            self._writer_wait_ready(deadline, timeout_s)
        elif self.role == "local reader":
            self._local_reader_wait_ready(deadline, timeout_s)
        else:
            assert self._tcp_reader is not None
            kind, _ = self._tcp_reader.receive(
                deadline,
                "wait_until_ready",
                lambda: self._reader_timeout("wait_until_ready", timeout_s, "no READY yet"),
                self._check_open,
            )
            if kind != KIND_READY:
                raise ProtocolError(
                    f"{self.what}: a message arrived before READY (wait_until_ready called late)"
                )

    def _writer_wait_ready(self, deadline: float, timeout_s: float) -> None:
        if self._ring is not None:
            assert self._local_sock is not None
            ring = self._ring
            subscribed = 0
            while subscribed < self.n_local_reader or any(
                ring.reader_pid(r) == 0 for r in range(self.n_local_reader)
            ):
                if self._local_sock.poll(20, zmq.POLLIN):
                    if self._local_sock.recv()[:1] == b"\x01":
                        subscribed += 1
                    continue
                if time.monotonic() > deadline:
                    missing = [
                        self.local_reader_ranks[r]
                        for r in range(self.n_local_reader)
                        if ring.reader_pid(r) == 0
                    ]
                    raise GroupcoordTimeoutError(
                        self.what,
                        "wait_until_ready",
                        timeout_s,
                        missing,
                        "writer",
                        f"{subscribed}/{self.n_local_reader} local readers subscribed",
                    )
                self._check_open()
            # Every local reader has mapped the ring (its pid is in): the name has
            # done its job. Unlinked now, nothing is left in /dev/shm however the
            # processes end (os._exit, SIGTERM, SIGKILL); the mappings live on.
            ring.unlink()
            self._local_sock.send(_READY)
        if self._tcp_writer is not None:
            self._tcp_writer.wait_ready(deadline, timeout_s, self._check_open)

    def _local_reader_wait_ready(self, deadline: float, timeout_s: float) -> None:
        assert self._local_sock is not None
        while not self._local_sock.poll(20, zmq.POLLIN):
            if time.monotonic() > deadline:
                raise self._reader_timeout("wait_until_ready", timeout_s, "no READY yet")
            self._check_writer_alive("wait_until_ready")
        msg = self._local_sock.recv()
        if msg != _READY:
            raise ProtocolError(f"{self.what}: expected READY, got {len(msg)} other bytes")

    # -- writer ------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: float | datetime.timedelta | None = None) -> None:
        """Send ``obj`` to every reader; waits while readers are behind: at most
        ``timeout``, or (None, vLLM's semantics) as long as they live, with a notice.

        ``obj`` may be a message ``codec.encode_message`` already encoded; it is
        sent as is (readers get the object it encodes)."""
        if self.role != "writer":
            raise GroupcoordValueError(f"{self.what}: enqueue on a {self.role} (rank {self.rank})")
        if self._closed:
            self._check_open()
        # Encoding refuses bad objects before anything is sent.
        msg = obj if isinstance(obj, EncodedMessage) else self._codec.encode(obj)
        timeout_s, deadline = _deadline(timeout)
        self._notice = None if timeout is not None else "enqueue"
        self._busy = True
        try:
            body: list[Any] | None = None
            ring = self._ring
            if ring is not None and msg.nbytes > self._capacity:
                if not self._write_span(ring, msg, deadline, timeout_s):
                    body = frames_as_buffers(msg)
                    self._write_stream(ring, body, deadline, timeout_s)
            elif ring is not None:
                idx = self._idx
                if not ring.chunk_free(idx):
                    self._writer_wait_chunk(idx, deadline, timeout_s)
                buf = ring.begin_write(idx)
                at = ring.chunk_at[idx]
                buf[at] = _INLINE
                if msg.frames:
                    write_message(msg, buf, at + _MSG_OFFSET)
                else:
                    header = msg.header
                    pos = at + _MSG_OFFSET
                    MESSAGE_PREFIX.pack_into(buf, pos, len(header), 0)
                    buf[pos + 8 : pos + 8 + len(header)] = header
                ring.publish(idx)
                self._idx = idx + 1 if idx + 1 < ring.max_chunks else 0
            if self._tcp_writer is not None:
                if body is None:
                    body = frames_as_buffers(msg)
                self._tcp_writer.send_message(
                    body, msg.nbytes, deadline, timeout_s, self._check_open
                )
        finally:
            self._busy = False
            if self._closed:
                self._release()

    def _write_span(
        self, ring: ShmRingBuffer, msg: EncodedMessage, deadline: float, timeout_s: float
    ) -> bool:
        """A message larger than a chunk, written across consecutive chunks (their
        memory is contiguous) so readers decode it in place; False when it is
        larger than the whole ring."""
        count = -(-(msg.nbytes + _MSG_OFFSET) // ring.chunk_stride)
        if count > ring.max_chunks:
            return False
        idx = self._idx
        if idx + count > ring.max_chunks:
            # Not enough chunks before the ring wraps: pad them, start at chunk 0.
            for pad in range(idx, ring.max_chunks):
                if not ring.chunk_free(pad):
                    self._writer_wait_chunk(pad, deadline, timeout_s)
                ring.begin_write(pad)[ring.chunk_at[pad]] = _PAD
                ring.publish(pad)
            idx = self._idx = 0
        for j in range(idx, idx + count):
            if not ring.chunk_free(j):
                self._writer_wait_chunk(j, deadline, timeout_s)
        for j in range(idx, idx + count):
            buf = ring.begin_write(j)
        at = ring.chunk_at[idx]
        write_message(msg, buf, at + _MSG_OFFSET)
        buf[at] = _SPAN
        _SPAN_COUNT.pack_into(buf, at + 1, count)
        # The first chunk last: a reader that sees it written finds the rest written.
        for j in range(idx + 1, idx + count):
            ring.publish(j)
        ring.publish(idx)
        self._idx = (idx + count) % ring.max_chunks
        return True

    def _write_stream(
        self, ring: ShmRingBuffer, parts: list[Any], deadline: float, timeout_s: float
    ) -> None:
        """A message larger than the ring, streamed through it chunk by chunk. A
        failure half-way (a timeout, a dead reader) shuts the queue down: the
        readers could not find the next message's start."""
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
        capacity = self._capacity
        idx = self._idx
        first = True
        try:
            while segments:
                if not ring.chunk_free(idx):
                    self._writer_wait_chunk(idx, deadline, timeout_s)
                buf = ring.begin_write(idx)
                at = ring.chunk_at[idx]
                pos = at + _MSG_OFFSET
                end = pos + capacity
                if first:
                    buf[at] = _STREAM
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
                idx = idx + 1 if idx + 1 < ring.max_chunks else 0
                self._idx = idx
        except BaseException:
            if not first:
                ring.set_shutdown()
                self._closed = True
            raise

    @contextlib.contextmanager
    def acquire_write(
        self, timeout: float | datetime.timedelta | None = None
    ) -> Iterator[memoryview]:
        """vLLM's raw write: a writable view of the next chunk's payload
        (``max_chunk_bytes - 64`` bytes), published to the local readers when the
        block ends (not when it raises). Waits for the chunk as ``enqueue`` does.
        Raw bytes reach local readers only: a queue with remote readers refuses."""
        ring = self._raw_ring("acquire_write", "writer")
        timeout_s, deadline = _deadline(timeout)
        self._notice = None if timeout is not None else "acquire_write"
        self._busy = True
        try:
            idx = self._idx
            if not ring.chunk_free(idx):
                self._writer_wait_chunk(idx, deadline, timeout_s, "acquire_write")
            buf = ring.begin_write(idx)
            at = ring.chunk_at[idx]
            buf[at] = _RAW
            with buf[at + _MSG_OFFSET : at + ring.max_chunk_bytes] as view:
                yield view
            ring.publish(idx)
            self._idx = idx + 1 if idx + 1 < ring.max_chunks else 0
        finally:
            self._busy = False
            if self._closed:
                self._release()

    @contextlib.contextmanager
    def acquire_read(
        self, timeout: float | datetime.timedelta | None = None, indefinite: bool = False
    ) -> Iterator[memoryview]:
        """vLLM's raw read: a view of the next chunk's payload, released to the
        writer when the block ends. Waits as ``dequeue`` does (``timeout=None``:
        as long as the writer lives). A message ``enqueue`` sent over ZeroMQ
        (larger than a chunk) is refused here and left for ``dequeue``."""
        ring = self._raw_ring("acquire_read", "local reader")
        timeout_s, deadline = _deadline(timeout)
        self._notice = None if indefinite or timeout is not None else "acquire_read"
        self._busy = True
        try:
            me = self._local_index
            idx = self._next_message_chunk(ring, me, deadline, timeout_s, "acquire_read")
            at = ring.chunk_at[idx]
            if ring.buf[at] in (_STREAM, _SPAN):
                raise ProtocolError(
                    f"{self.what}: chunk {idx} starts a message larger than a chunk "
                    "(sent by enqueue): read it with dequeue"
                )
            try:
                with ring.buf[at + _MSG_OFFSET : at + ring.max_chunk_bytes] as view:
                    yield view
            finally:
                ring.release(idx, me)
                self._idx = idx + 1 if idx + 1 < ring.max_chunks else 0
        finally:
            self._busy = False
            if self._closed:
                self._release()

    def _raw_ring(self, operation: str, role: str) -> ShmRingBuffer:
        self._check_open()
        if self.role != role:
            raise GroupcoordValueError(
                f"{self.what}: {operation} on a {self.role} (rank {self.rank}); "
                f"it is for the {role}"
            )
        if self._ring is None or self._tcp_writer is not None:
            raise GroupcoordValueError(
                f"{self.what}: {operation} moves raw bytes through the shared-memory ring, "
                "which this queue's remote readers do not map; use enqueue/dequeue"
            )
        return self._ring

    def all_read(self) -> bool:
        """Writer: whether every local reader has read everything sent so far (a
        reader that shut down counts as done; remote readers are not tracked)."""
        ring = self._ring
        if ring is None or self.role != "writer":
            return True
        if any(ring.reader_pid(r) == READER_DETACHED for r in range(self.n_local_reader)):
            return True
        return all(ring.chunk_free(i) for i in range(ring.max_chunks))

    def _writer_wait_chunk(
        self, idx: int, deadline: float, timeout_s: float, operation: str = "enqueue"
    ) -> None:
        ring = self._ring
        assert ring is not None

        def missing() -> list[int]:
            return [self.local_reader_ranks[r] for r in ring.readers_missing(idx)]

        def check() -> None:
            dead = []
            for r in range(self.n_local_reader):
                pid = ring.reader_pid(r)
                if pid == READER_DETACHED:
                    raise ClosedError(
                        f"{self.what}: reader rank {self.local_reader_ranks[r]} shut down"
                    )
                if pid and not process_alive(pid):
                    dead.append(self.local_reader_ranks[r])
            if dead:
                raise PeerDiedError(self.what, operation, dead, "reader process is gone")

        wait_until(
            lambda: ring.chunk_free(idx),
            deadline,
            quick_check=self._check_open,
            slow_check=self._with_notice(check),
            on_timeout=lambda: GroupcoordTimeoutError(
                self.what,
                operation,
                timeout_s,
                missing(),
                "writer",
                f"chunk {idx} not yet read by every local reader",
            ),
            sleep=lambda at_most_s: ring.writer_sleep(idx, at_most_s),
        )

    # -- reader ------------------------------------------------------------

    def dequeue(
        self, timeout: float | datetime.timedelta | None = None, indefinite: bool = False
    ) -> Any:
        """Next object from the writer, in order.

        With a ``timeout`` (seconds or a timedelta) it waits at most that long. With
        None (vLLM's semantics) it waits as long as the writer lives: an idle engine
        worker is not an error, a dead writer raises :class:`PeerDiedError` within
        ``peer_check_interval_s``. A notice is logged every ``_IDLE_NOTICE_S`` of
        waiting unless ``indefinite`` is True.
        """
        self._check_open()
        timeout_s, deadline = _deadline(timeout)
        self._notice = None if indefinite or timeout is not None else "dequeue"
        self._busy = True
        try:
            if self.role == "local reader":
                return self._dequeue_local(deadline, timeout_s)
            if self.role == "remote reader":
                return self._dequeue_remote(deadline, timeout_s)
            raise GroupcoordValueError(f"{self.what}: dequeue on the writer (rank {self.rank})")
        finally:
            self._busy = False
            if self._closed:
                self._release()

    def _dequeue_local(self, deadline: float, timeout_s: float) -> Any:
        ring = self._ring
        assert ring is not None
        me = self._local_index
        idx = self._next_message_chunk(ring, me, deadline, timeout_s, "dequeue")
        at = ring.chunk_at[idx]
        buf = ring.buf
        kind = buf[at]
        count = 1
        if kind == _INLINE:
            pos = at + _MSG_OFFSET
            header_len, n_frames = MESSAGE_PREFIX.unpack_from(buf, pos)
            if n_frames == 0:
                try:
                    return self._codec.decode_header_only(buf[pos + 8 : pos + 8 + header_len])
                finally:
                    ring.release(idx, me)
                    self._idx = idx + 1 if idx + 1 < ring.max_chunks else 0
        elif kind == _SPAN:
            count = _SPAN_COUNT.unpack_from(buf, at + 1)[0]
        elif kind == _STREAM:
            return self._read_stream(ring, me, deadline, timeout_s)
        try:
            if kind == _INLINE or kind == _SPAN:
                return read_message(self._codec, ring.buf, at + _MSG_OFFSET)
            if kind == _RAW:
                raise ProtocolError(
                    f"{self.what}: chunk {idx} holds raw bytes written with acquire_write: "
                    "read them with acquire_read"
                )
            raise ProtocolError(f"{self.what}: chunk {idx} has unknown kind {kind}")
        finally:
            # Released even when decoding failed, so the queue stays usable.
            for j in range(idx, idx + count):
                ring.release(j, me)
            self._idx = (idx + count) % ring.max_chunks

    def _next_message_chunk(
        self, ring: ShmRingBuffer, me: int, deadline: float, timeout_s: float, operation: str
    ) -> int:
        """Wait for the next chunk that starts a message, releasing pad chunks."""
        while True:
            idx = self._idx
            if not ring.ready(idx, me):
                self._reader_wait_chunk(idx, deadline, timeout_s, operation)
            if ring.buf[ring.chunk_at[idx]] != _PAD:
                return idx
            ring.release(idx, me)
            self._idx = idx + 1 if idx + 1 < ring.max_chunks else 0

    def _reader_wait_chunk(
        self, idx: int, deadline: float, timeout_s: float, operation: str = "dequeue"
    ) -> None:
        ring = self._ring
        assert ring is not None
        me = self._local_index

        def quick() -> None:
            self._check_open()
            if ring.shutdown_flag:
                raise ClosedError(f"{self.what}: the writer shut the queue down")

        wait_until(
            lambda: ring.ready(idx, me),
            deadline,
            quick_check=quick,
            slow_check=self._with_notice(lambda: self._check_writer_alive(operation)),
            on_timeout=lambda: self._reader_timeout(
                operation, timeout_s, f"chunk {idx} not written"
            ),
            sleep=lambda at_most_s: ring.reader_sleep(idx, me, at_most_s),
        )

    def _read_stream(self, ring: ShmRingBuffer, me: int, deadline: float, timeout_s: float) -> Any:
        """Copy a streamed message out chunk by chunk (releasing each), then decode it.
        A failure half-way closes this reader: the next message's start is lost."""
        import torch  # the buffer comes from torch's allocator: no fresh-page faults

        idx = self._idx
        total = _STREAM_LEN.unpack_from(ring.buf, ring.chunk_at[idx] + 8)[0]
        view = torch.empty(total, dtype=torch.uint8).numpy().data
        got = 0
        capacity = self._capacity
        try:
            while got < total:
                if not ring.ready(idx, me):
                    self._reader_wait_chunk(idx, deadline, timeout_s)
                n = min(capacity, total - got)
                pos = ring.chunk_at[idx] + _MSG_OFFSET
                view[got : got + n] = ring.buf[pos : pos + n]
                got += n
                ring.release(idx, me)
                idx = idx + 1 if idx + 1 < ring.max_chunks else 0
                self._idx = idx
        except BaseException:
            self._closed = True
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
        return self._codec.decode(parts[0], parts[1:], owned=True)

    def _dequeue_remote(self, deadline: float, timeout_s: float) -> Any:
        tcp = self._tcp_reader
        assert tcp is not None
        while True:
            kind, body = tcp.receive(
                deadline,
                "dequeue",
                lambda: self._reader_timeout("dequeue", timeout_s, "nothing received over TCP"),
                self._check_open,
            )
            if kind == KIND_READY:
                continue
            try:
                return self._codec.decode(body[0], body[1:])
            finally:
                tcp.consumed()

    def _with_notice(self, check: Callable[[], None]) -> Callable[[], None]:
        """``check``, plus a log line every ``_IDLE_NOTICE_S`` of an unbounded wait."""
        operation = self._notice
        if operation is None:
            return check
        started = time.monotonic()
        next_notice = started + _IDLE_NOTICE_S

        def checked() -> None:
            nonlocal next_notice
            check()
            now = time.monotonic()
            if now >= next_notice:
                next_notice = now + _IDLE_NOTICE_S
                logger.info(
                    "%s: %s has waited %.0f s; the peers are alive, still waiting "
                    "(indefinite=True silences this)",
                    self.what,
                    operation,
                    now - started,
                )

        return checked

    def _reader_timeout(
        self, operation: str, timeout_s: float, detail: str
    ) -> GroupcoordTimeoutError:
        return GroupcoordTimeoutError(
            self.what,
            operation,
            timeout_s,
            [self.writer_rank],
            f"{self.role} rank {self.rank}",
            f"the writer has not written: {detail}",
        )

    def _check_writer_alive(self, operation: str) -> None:
        ring = self._ring
        assert ring is not None
        if ring.writer_pid_namespace != pid_namespace():
            return  # pids of another namespace cannot be checked here
        if not process_alive(ring.writer_pid):
            self._cleanup_dead_writer()
            raise PeerDiedError(
                self.what, operation, [self.writer_rank], f"writer pid {ring.writer_pid} is gone"
            )

    def _cleanup_dead_writer(self) -> None:
        """The writer cannot unlink its ring any more: do it for it."""
        assert self._ring is not None
        unlink_segment(self._ring.name)
        _remove_ipc_file(self._local_address)

    # -- both --------------------------------------------------------------

    @staticmethod
    def recv(socket: zmq.Socket, timeout: float | datetime.timedelta | None) -> Any:
        """One object from a ZeroMQ socket carrying this codec's multipart messages
        (header, then frames: what a writer sends past its ring). vLLM's helper,
        without pickle; waits at most ``timeout`` (None: until one arrives)."""
        if timeout is not None:
            timeout_s = resolve_timeout(timeout)
            if not socket.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise GroupcoordTimeoutError(
                    "MessageQueue", "recv", timeout_s, detail="nothing arrived on the socket"
                )
        header, *frames = socket.recv_multipart(copy=False)
        return Codec().decode(header.buffer, [f.buffer for f in frames])

    def broadcast_object(self, obj: Any = None) -> Any:
        """Writer: enqueue ``obj`` and return it; reader: return the next object."""
        if self.role == "writer":
            self.enqueue(obj)
            return obj
        return self.dequeue()

    @property
    def bad_frames(self) -> int:
        """TCP frames dropped because their MAC (or shape) was wrong."""
        if self._tcp_writer is not None:
            return self._tcp_writer.bad_frames
        if self._tcp_reader is not None:
            return self._tcp_reader.bad_frames
        return 0

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                f"{self.what}: the queue was shut down ({self.role} rank {self.rank})"
            )

    def shutdown(self) -> None:
        """Stop the queue; a reader waiting in ``dequeue`` (another thread) raises ClosedError.

        The writer marks the ring shut and tells remote readers, after the
        messages already sent; readers then get what is queued and then
        ClosedError. Safe to call more than once.
        """
        # Held while the ring is still used here: a call this wakes on another
        # thread releases the queue on its way out, and must wait for that.
        with self._teardown:
            if self._closed:
                return
            self._closed = True
            try:
                if self.role == "writer":
                    if self._ring is not None:
                        self._ring.set_shutdown()
                    if self._tcp_writer is not None:
                        self._tcp_writer.shutdown()
                elif self._ring is not None and self._local_index >= 0:
                    self._ring.set_reader_pid(self._local_index, READER_DETACHED)
                    # Wake this reader's own dequeue (another thread) and the writer.
                    self._ring.ring_readers()
                    self._ring.ring_writer()
            finally:
                if not self._busy:
                    self._release()

    close = shutdown

    def _shutdown_now(self) -> None:
        """:meth:`shutdown` that does not wait for queued ZeroMQ messages to leave. A
        queue some thread still waits on is only marked shut (its memory stays
        mapped until the process is gone)."""
        if self._local_sock is not None and not self._local_sock.closed:
            self._local_sock.setsockopt(zmq.LINGER, 0)
        self.shutdown()

    def _release(self) -> None:
        """Close sockets and unmap (the writer also unlinks its ring); idempotent."""
        with self._teardown:
            self._release_now()

    def _release_now(self) -> None:
        if self._released:
            return
        self._released = True
        _live_queues.discard(self)
        self._zmq_finalizer.detach()  # closed here, in order, with linger
        self._zmq_owned.clear()
        if self._tcp_writer is not None:
            self._tcp_writer.close()
            self._tcp_writer = None
        if self._tcp_reader is not None:
            self._tcp_reader.close()
            self._tcp_reader = None
        if self._local_sock is not None:
            self._local_sock.close()
            self._local_sock = None
            if self.role == "writer":
                _remove_ipc_file(self._local_address)
        if self._ring is not None:
            self._ring.close()
            if self.role == "writer":
                self._ring.unlink()
            self._ring = None
        # term() waits (up to each socket's linger) for queued messages to leave.
        self._ctx.term()

    def _abandon(self) -> None:
        """Construction failed: drop every socket at once, then unmap/unlink."""
        self._ctx.destroy(linger=0)
        self._release()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- group constructors ---------------------------------------------------

    @staticmethod
    def create_from_process_group(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        writer_rank: int = 0,
        external_writer_handle: Handle | None = None,
        blocking: bool = True,
        *,
        allow_pickle: bool = False,
        connect_ip: str | None = None,
    ) -> MessageQueue:
        """Collective over ``pg``: ``writer_rank`` (in-group) writes, every other rank reads.

        Ranks that share /dev/shm with the writer read the ring; the rest use
        TCP. With ``external_writer_handle`` every rank joins that queue as a
        reader instead.
        """
        rank, world_size = group_rank_and_size(pg)
        if not 0 <= writer_rank < world_size:
            raise GroupcoordValueError(
                f"writer_rank={writer_rank} is not in a group of {world_size}"
            )
        # Errors of the set-up collectives name this call (the queue has no name yet).
        names = {"what": "MessageQueue", "operation": "create_from_process_group"}
        same_node = in_the_same_node_as(pg, writer_rank, **names)
        mq: MessageQueue | None = None
        data: bytes | None = None
        if rank == writer_rank:
            if external_writer_handle is not None:
                mq = MessageQueue.create_from_handle(external_writer_handle, rank)
                handle = external_writer_handle
            else:
                local = [r for r in range(world_size) if same_node[r] and r != writer_rank]
                mq = MessageQueue(
                    world_size - 1,
                    len(local),
                    local,
                    max_chunk_bytes,
                    max_chunks,
                    connect_ip,
                    allow_pickle=allow_pickle,
                    writer_rank=writer_rank,
                )
                handle = mq.export_handle()
            data = dumps(handle)
        try:
            handle = loads(broadcast_bytes(pg, data, writer_rank, **names))
        except BaseException:
            if mq is not None:
                mq.shutdown()  # the writer's ring must not outlive a failed set-up
            raise
        if mq is None:
            mq = MessageQueue.create_from_handle(handle, rank)
        if blocking:
            mq.wait_until_ready()
        return mq

    @staticmethod
    def create_from_process_group_single_reader(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        reader_rank: int = 0,
        blocking: bool = False,
        *,
        allow_pickle: bool = False,
        connect_ip: str | None = None,
    ) -> tuple[MessageQueue, list[Handle]]:
        """Collective: every rank writes its own one-reader queue read by ``reader_rank``.

        Returns ``(my queue, handles)``; ``handles`` (one per rank, in group
        order) is filled only on ``reader_rank``, which joins each with
        ``MessageQueue.create_from_handle(handle, reader_rank)``. Then every
        writer calls ``wait_until_ready()`` and the reader does so on each
        joined queue. Keep ``blocking=False`` (the default) unless the reader
        joins from another thread: a writer waiting here waits for a reader
        that can only join after this call returns (bounded by the timeout).
        """
        rank, world_size = group_rank_and_size(pg)
        if not 0 <= reader_rank < world_size:
            raise GroupcoordValueError(
                f"reader_rank={reader_rank} is not in a group of {world_size}"
            )
        names = {"what": "MessageQueue", "operation": "create_from_process_group_single_reader"}
        same_node = in_the_same_node_as(pg, reader_rank, **names)
        mq = MessageQueue(
            1,
            1 if same_node[rank] else 0,
            [reader_rank] if same_node[rank] else [],
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            allow_pickle=allow_pickle,
            writer_rank=rank,
        )
        try:
            gathered = all_gather_bytes(pg, dumps(mq.export_handle()), **names)
            handles = [loads(g) for g in gathered] if rank == reader_rank else []
            if blocking:
                mq.wait_until_ready()
        except BaseException:
            mq.shutdown()
            raise
        return mq, handles


def _deadline(timeout: float | datetime.timedelta | None) -> tuple[float, float]:
    """(seconds, monotonic deadline) of a queue wait; None waits without a deadline
    (liveness checks still end it when a peer dies)."""
    if timeout is None:
        return math.inf, math.inf
    timeout_s = resolve_timeout(timeout)
    return timeout_s, time.monotonic() + timeout_s
