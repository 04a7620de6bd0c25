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
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from . import mq_groups
from .codec import (
    Codec,
    EncodedMessage,
    frames_as_buffers,
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
from .mq_handle import Handle, cleanup_stale_ipc_files, default_ip, ipc_path, remove_ipc_file
from .ring import READER_DETACHED, ShmRingBuffer, pid_namespace, process_alive
from .ring_messages import RingCursor
from .segments import unlink_segment
from .tcp_channel import TcpReader, TcpWriter
from .tcp_frames import KIND_READY
from .waiting import wait_until

__all__ = ["Handle", "MessageQueue", "cleanup_stale_ipc_files"]

logger = logging.getLogger("groupcoord.shm_broadcast")

_READY = b"READY"
# An unbounded enqueue/dequeue (timeout=None) logs that it still waits this often.
_IDLE_NOTICE_S = 60.0


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

    # What an end may hold (set up empty by _set_up, filled by the constructors).
    _ring: ShmRingBuffer | None
    _cursor: RingCursor | None  # this end's place in the ring
    _local_sock: zmq.Socket | None
    _local_address: str | None
    _tcp_writer: TcpWriter | None
    _tcp_reader: TcpReader | None
    _handle: Handle | None  # the handle a reader joined with

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
        self._set_up(
            name or f"mq{secrets.token_hex(3)}",
            n_reader,
            local_reader_ranks,
            max_chunk_bytes,
            max_chunks,
            allow_pickle,
            writer_rank,
            role="writer",
            rank=writer_rank,
            key=secrets.token_bytes(32),
            window=max(16, max_chunks),
        )
        try:
            if n_local_reader:
                self._ring = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
                self._cursor = RingCursor(self._ring, self._codec, self.what)
                self._local_sock = self._ctx.socket(zmq.XPUB)
                self._zmq_owned.append(self._local_sock)
                self._local_sock.setsockopt(zmq.XPUB_VERBOSE, 1)
                self._local_sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the ring instead
                self._local_sock.setsockopt(zmq.LINGER, 2000)
                cleanup_stale_ipc_files()
                self._local_address = f"ipc://{ipc_path(self._ring.name)}"
                self._local_sock.bind(self._local_address)
            if n_reader > n_local_reader:
                self._tcp_writer = TcpWriter(
                    self._ctx,
                    connect_ip or default_ip(),
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

    def _set_up(
        self,
        name: str,
        n_reader: int,
        local_reader_ranks: list[int],
        max_chunk_bytes: int,
        max_chunks: int,
        allow_pickle: bool,
        writer_rank: int,
        *,
        role: str,
        rank: int,
        key: bytes,
        window: int,
    ) -> None:
        """The state both ends start from (the writer's constructor, a reader's join)."""
        self.name = name
        self.what = f"MessageQueue {name}"
        self.n_reader = n_reader
        self.n_local_reader = len(local_reader_ranks)
        self.local_reader_ranks = list(local_reader_ranks)
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.allow_pickle = allow_pickle
        self.writer_rank = writer_rank
        self.role = role
        self.rank = rank
        self._codec = Codec(allow_pickle=allow_pickle)
        self._closed = False
        self._released = False
        self._busy = False
        self._notice: str | None = None  # the operation of an unbounded wait, for its log
        self._key = key
        self._window = window
        self._ctx = zmq.Context()
        self._teardown = threading.RLock()
        self._zmq_owned: list[Any] = []  # closed by _close_zmq if the queue is collected open
        self._zmq_finalizer = weakref.finalize(self, _close_zmq, self._ctx, self._zmq_owned)
        self._zmq_finalizer.atexit = False  # the exit hook shuts open queues down first
        self._ring = None
        self._cursor = None
        self._local_sock = None
        self._local_address = None
        self._tcp_writer = None
        self._tcp_reader = None
        self._local_index = -1
        self._handle = None
        self._owner_pid = os.getpid()
        _live_queues.add(self)

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
        local = rank in handle.local_reader_ranks
        self._set_up(
            handle.name,
            handle.n_reader,
            handle.local_reader_ranks,
            handle.max_chunk_bytes,
            handle.max_chunks,
            handle.allow_pickle,
            handle.writer_rank,
            role="local reader" if local else "remote reader",
            rank=rank,
            key=handle.key,
            window=handle.window,
        )
        self._local_address = handle.local_address
        self._handle = handle
        try:
            if local:
                self._local_index = handle.local_reader_ranks.index(rank)
                if handle.buffer_name is None or handle.local_address is None:
                    raise ProtocolError(f"{self.what}: handle has local readers but no ring")
                self._ring = ShmRingBuffer.attach(handle.buffer_name)
                self._cursor = RingCursor(self._ring, self._codec, self.what)
                self._ring.set_reader_pid(self._local_index, os.getpid())
                self._local_sock = self._ctx.socket(zmq.SUB)
                self._zmq_owned.append(self._local_sock)
                self._local_sock.setsockopt(zmq.RCVHWM, 0)
                self._local_sock.setsockopt(zmq.LINGER, 0)
                self._local_sock.setsockopt(zmq.SUBSCRIBE, b"")
                self._local_sock.connect(handle.local_address)
            else:
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
            cursor = self._cursor
            if cursor is not None:

                def wait_free(idx: int) -> None:
                    self._writer_wait_chunk(idx, deadline, timeout_s)

                if not cursor.write(msg, wait_free):
                    body = frames_as_buffers(msg)
                    cursor.write_stream(body, wait_free)
            if self._tcp_writer is not None:
                if body is None:
                    body = frames_as_buffers(msg)
                self._tcp_writer.send_message(
                    body, msg.nbytes, deadline, timeout_s, self._check_open
                )
        finally:
            self._end_call()

    @contextlib.contextmanager
    def acquire_write(
        self, timeout: float | datetime.timedelta | None = None
    ) -> Iterator[memoryview]:
        """vLLM's raw write: a writable view of the next chunk's payload
        (``max_chunk_bytes - 64`` bytes), published to the local readers when the
        block ends (not when it raises). Waits for the chunk as ``enqueue`` does.
        Raw bytes reach local readers only: a queue with remote readers refuses."""
        cursor = self._raw_cursor("acquire_write", "writer")
        timeout_s, deadline = _deadline(timeout)
        self._notice = None if timeout is not None else "acquire_write"
        self._busy = True
        try:
            with cursor.raw_write(
                lambda idx: self._writer_wait_chunk(idx, deadline, timeout_s, "acquire_write")
            ) as view:
                yield view
        finally:
            self._end_call()

    @contextlib.contextmanager
    def acquire_read(
        self, timeout: float | datetime.timedelta | None = None, indefinite: bool = False
    ) -> Iterator[memoryview]:
        """vLLM's raw read: a view of the next chunk's payload, released to the
        writer when the block ends. Waits as ``dequeue`` does (``timeout=None``:
        as long as the writer lives). A message larger than a chunk (sent by
        ``enqueue``) is refused here and left for ``dequeue``."""
        cursor = self._raw_cursor("acquire_read", "local reader")
        timeout_s, deadline = _deadline(timeout)
        self._notice = None if indefinite or timeout is not None else "acquire_read"
        self._busy = True
        try:
            with cursor.raw_read(
                self._local_index,
                lambda idx: self._reader_wait_chunk(idx, deadline, timeout_s, "acquire_read"),
            ) as view:
                yield view
        finally:
            self._end_call()

    def _end_call(self) -> None:
        """After every enqueue/dequeue/acquire: a stream broken half-way closes the
        queue, and a shutdown from another thread during the call releases it now."""
        self._busy = False
        if self._cursor is not None and self._cursor.broken:
            self._closed = True
        if self._closed:
            self._release()

    def _raw_cursor(self, operation: str, role: str) -> RingCursor:
        self._check_open()
        if self.role != role:
            raise GroupcoordValueError(
                f"{self.what}: {operation} on a {self.role} (rank {self.rank}); "
                f"it is for the {role}"
            )
        if self._cursor is None or self._tcp_writer is not None:
            raise GroupcoordValueError(
                f"{self.what}: {operation} moves raw bytes through the shared-memory ring, "
                "which this queue's remote readers do not map; use enqueue/dequeue"
            )
        return self._cursor

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
            self._end_call()

    def _dequeue_local(self, deadline: float, timeout_s: float) -> Any:
        assert self._cursor is not None
        return self._cursor.read(
            self._local_index, lambda idx: self._reader_wait_chunk(idx, deadline, timeout_s)
        )

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
        remove_ipc_file(self._local_address)

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
                remove_ipc_file(self._local_address)
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

    # -- group constructors (collective; in mq_groups) -------------------------

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
        """Collective over ``pg``: ``writer_rank`` (in-group) writes, every other rank
        reads (:func:`.mq_groups.create_from_process_group`)."""
        return mq_groups.create_from_process_group(
            MessageQueue,
            pg,
            max_chunk_bytes,
            max_chunks,
            writer_rank,
            external_writer_handle,
            blocking,
            allow_pickle=allow_pickle,
            connect_ip=connect_ip,
        )

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
        """Collective: every rank writes its own queue that ``reader_rank`` reads
        (:func:`.mq_groups.create_from_process_group_single_reader`)."""
        return mq_groups.create_from_process_group_single_reader(
            MessageQueue,
            pg,
            max_chunk_bytes,
            max_chunks,
            reader_rank,
            blocking,
            allow_pickle=allow_pickle,
            connect_ip=connect_ip,
        )


def _deadline(timeout: float | datetime.timedelta | None) -> tuple[float, float]:
    """(seconds, monotonic deadline) of a queue wait; None waits without a deadline
    (liveness checks still end it when a peer dies)."""
    if timeout is None:
        return math.inf, math.inf
    timeout_s = resolve_timeout(timeout)
    return timeout_s, time.monotonic() + timeout_s
