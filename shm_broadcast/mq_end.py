"""What both ends of a :class:`~shm_broadcast.message_queue.MessageQueue` share:
their state, the open check, the notice an unbounded wait logs, and teardown
on every path (``shutdown``, garbage collection of an open queue, interpreter
exit; a forked child leaves its parent's queues alone)."""

from __future__ import annotations

import atexit
import datetime
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Self

import zmq

from .codec import Codec
from .config import resolve_timeout
from .errors import ClosedError, GroupcoordTimeoutError, GroupcoordValueError
from .forked import owned_here
from .mq_handle import Handle, remove_ipc_file
from .ring import READER_DETACHED, ShmRingBuffer
from .ring_messages import RingCursor
from .tcp_channel import TcpReader, TcpWriter

logger = logging.getLogger("groupcoord.shm_broadcast")

READY = b"READY"
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


# What a forked child may still read of its parent's queue (shm_broadcast.forked);
# _owner_pid for the exit hook below.
_DESCRIPTIVE = (
    "name", "what", "n_reader", "n_local_reader", "local_reader_ranks", "max_chunk_bytes",
    "max_chunks", "allow_pickle", "writer_rank", "role", "rank", "_owner_pid",
)  # fmt: skip

# Every queue of this process that is not shut down yet (weak: a dropped queue leaves).
_live_queues: weakref.WeakSet[QueueEnd] = weakref.WeakSet()


def _shut_down_open_queues() -> None:
    """At interpreter exit: shut down the queues this process left open, without
    lingering, so ZeroMQ contexts never hold the exit up and readers are told
    the queue ended (a ``ClosedError``) instead of finding a dead writer. A
    forked child's queues belong to its parent and are left alone."""
    for mq in list(_live_queues):
        if mq._owner_pid == os.getpid():
            mq._shutdown_now()


atexit.register(_shut_down_open_queues)


class QueueEnd:
    """State and teardown of one end of a queue (the writer's or a reader's)."""

    # What an end may hold (set up empty by _set_up, filled by the constructors).
    _ring: ShmRingBuffer | None
    _cursor: RingCursor | None  # this end's place in the ring
    _local_sock: zmq.Socket | None
    _local_address: str | None
    _tcp_writer: TcpWriter | None
    _tcp_reader: TcpReader | None
    _handle: Handle | None  # the handle a reader joined with

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
        owned_here(self, self.what, _DESCRIPTIVE)
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
        # Held through each enqueue/dequeue/acquire: one call at a time on an end (its
        # codec and ring cursor keep per-call state; two threads' enqueues at once
        # lost a message and left writer and reader waiting on each other). Never
        # taken twice: an RLock for its owner check (see _take_turn).
        self._call_lock = threading.RLock()
        self._in_call = False  # set first in a call's try block, cleared in its finally
        # The running enqueue's or dequeue's deadline and stall check, for its waits
        # (the writer's _wait_free, a reader's _wait_ready).
        self._waiting: tuple[Any, ...] = ()
        self._shut_because: str | None = None  # why the end shut itself down, if it did
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
        # The writer's view of local readers not attached yet (0: unknown; see
        # MessageQueue's reader_pids): a wait for one ends once that process is gone.
        self._reader_pids = [0] * self.n_local_reader
        _live_queues.add(self)

    def _take_turn(self, operation: str, deadline: float, timeout_s: float) -> None:
        """Take ``_call_lock`` for an enqueue/dequeue/acquire, whose try block then sets
        ``_in_call``: at once, or once another thread's call ends, at most to this
        call's deadline (``enqueue`` and ``dequeue`` first try to take it at once
        themselves, when this thread does not hold it, and call this when that
        fails). An exception a signal handler raises can land just after the
        lock was taken, before the call's try block: the lock is then this
        thread's with no call of it running, and is taken back here (every later
        call waited for it to its deadline, or for ever). A call made while one of
        this thread's runs (from that signal handler, or a callback of the call) is
        refused: the end's codec and cursor are in the middle of that call. The
        call's finally block clears ``_in_call`` and releases the lock before it
        calls any Python function: Python runs pending signal handlers as such a
        function starts, and a handler's exception there would leave both set,
        so that every later call of the thread would be refused as nested."""
        lock = self._call_lock
        if lock._is_owned():  # type: ignore[attr-defined]
            if self._in_call:
                raise GroupcoordValueError(
                    f"{self.what}: {operation} called while this thread's call on this "
                    "end still runs (from a signal handler, or a callback of that "
                    "call): one call at a time"
                )
            logger.debug("%s: call lock left by an interrupted call, taken back", self.what)
            lock.release()
        if lock.acquire(False):
            return
        wait_s = deadline - time.monotonic()
        if not lock.acquire(timeout=-1 if wait_s == math.inf else max(wait_s, 0.0)):
            raise GroupcoordTimeoutError(
                self.what,
                operation,
                timeout_s,
                [],
                f"rank {self.rank}",
                "another thread's call on this end of the queue did not end",
            )

    def _end_call(self) -> None:
        """After every enqueue/dequeue/acquire, once its finally block released the
        turn: a call that ended between publishing (or releasing) a chunk and moving
        its cursor on, or a stream broken half-way, shuts this end down (its readers,
        or its writer, hear it after what was published); a send to the remote
        readers cut off part-way abandons their socket too; a shutdown from another
        thread during the call releases it now."""
        cursor, tcp = self._cursor, self._tcp_writer
        if tcp is not None and tcp.in_step and not self._closed:
            self._shut_because = (
                "an enqueue ended part-way through sending a message to the remote "
                "readers (an exception, a signal handler's, cut it off), so they "
                "could no longer be sent the same messages"
            )
            tcp.abandon()
            self.shutdown()
        elif self._tcp_reader is not None and self._tcp_reader.in_step and not self._closed:
            self._shut_because = (
                "a dequeue ended part-way through taking a message off the TCP socket "
                "(an exception, a signal handler's, cut it off), so the next message "
                "could no longer be told from the rest of that one"
            )
            self.shutdown()
        elif cursor is not None and (cursor.in_step or cursor.broken) and not self._closed:
            self._shut_because = (
                "a message larger than a chunk was cut off part-way"
                if cursor.broken
                else "a call ended part-way through a step of the ring (an exception, "
                "a signal handler's, came between a chunk's publish or release and the "
                "move to the next), so this end could no longer tell which message "
                "comes next"
            )
            self.shutdown()
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
            why = f": {self._shut_because}" if self._shut_because is not None else ""
            raise ClosedError(
                f"{self.what}: the queue was shut down ({self.role} rank {self.rank}){why}"
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
                # Released now unless a call runs (it releases the queue on its way
                # out): taking the turn shows no other thread's call is starting.
                if not self._in_call and self._call_lock.acquire(False):
                    try:
                        self._release()
                    finally:
                        self._call_lock.release()

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# deadline_of(None): what the hot paths take without the call.
NO_DEADLINE = (math.inf, math.inf)


def deadline_of(timeout: float | datetime.timedelta | None) -> tuple[float, float]:
    """(seconds, monotonic deadline) of a queue wait; None waits without a deadline
    (liveness checks still end it when a peer dies)."""
    if timeout is None:
        return NO_DEADLINE
    timeout_s = resolve_timeout(timeout)
    return timeout_s, time.monotonic() + timeout_s
