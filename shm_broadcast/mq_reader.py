"""A reader's end of a :class:`~shm_broadcast.message_queue.MessageQueue`:
``dequeue`` and the raw ``acquire_read`` (from the ring, or over TCP for a
remote reader), the wait for the next chunk, and what it reports when the
writer is late or gone."""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from typing import Any

import zmq

from .codec import Codec
from .config import get_config, resolve_timeout
from .errors import (
    ClosedError,
    GroupcoordTimeoutError,
    GroupcoordValueError,
    PeerDiedError,
    ProtocolError,
)
from .mq_end import NO_DEADLINE, READY, QueueEnd, deadline_of
from .mq_handle import remove_ipc_file
from .ring import pid_namespace, process_alive
from .segments import unlink_segment
from .tcp_frames import KIND_READY
from .waiting import StallCheck, wait_until


class ReaderEnd(QueueEnd):
    """What only a reader does."""

    def _local_reader_wait_ready(self, deadline: float, timeout_s: float) -> None:
        assert self._local_sock is not None
        while not self._local_sock.poll(20, zmq.POLLIN):
            if time.monotonic() > deadline:
                raise self._reader_timeout("wait_until_ready", timeout_s, "no READY yet")
            self._check_writer_alive("wait_until_ready")
        msg = self._local_sock.recv()
        if msg != READY:
            raise ProtocolError(f"{self.what}: expected READY, got {len(msg)} other bytes")

    @contextlib.contextmanager
    def acquire_read(
        self, timeout: float | datetime.timedelta | None = None, indefinite: bool = False
    ) -> Iterator[memoryview]:
        """vLLM's raw read: a view of the next chunk's payload, released to the
        writer when the block ends. Waits as ``dequeue`` does (``timeout=None``:
        as long as the writer lives). A message larger than a chunk (sent by
        ``enqueue``) is refused here and left for ``dequeue``."""
        cursor = self._raw_cursor("acquire_read", "local reader")
        timeout_s, deadline = deadline_of(timeout)
        self._take_turn("acquire_read", deadline, timeout_s)
        self._notice = None if indefinite or timeout is not None else "acquire_read"
        try:
            self._in_call = True
            with cursor.raw_read(
                self._local_index,
                lambda idx: self._reader_wait_chunk(idx, deadline, timeout_s, "acquire_read"),
            ) as view:
                yield view
        finally:
            self._in_call = False  # before any Python call: see _take_turn
            self._call_lock.release()
            self._end_call()

    def dequeue(
        self,
        timeout: float | datetime.timedelta | None = None,
        indefinite: bool = False,
        *,
        into: memoryview | None = None,
        stall_check: StallCheck | None = None,
    ) -> Any:
        """Next object from the writer, in order.

        With a ``timeout`` (seconds or a timedelta) it waits at most that long. With
        None (vLLM's semantics) it waits as long as the writer lives: an idle engine
        worker is not an error, a dead writer raises :class:`PeerDiedError` within
        ``peer_check_interval_s``. A notice is logged every ``_IDLE_NOTICE_S`` of
        waiting unless ``indefinite`` is True.

        ``into``: a writable buffer the caller owns. A message that is one tensor of
        exactly ``len(into)`` bytes is copied there by a local reader, and the tensor
        returned is built on it (no buffer of its own, no second copy).

        ``stall_check``: called with ``[writer_rank]`` and the wait's own test (has
        the chunk come?) at the writer's liveness checks while a local reader
        waits; it may raise to end the wait (a group's, when the writer waits for
        this rank in a collective: ``ShmBase.check_queue_wait``).
        """
        if self._closed:
            self._check_open()
        timeout_s, deadline = NO_DEADLINE if timeout is None else deadline_of(timeout)
        lock = self._call_lock
        # Taken at once (the common case) unless this thread holds it or another does.
        if lock._is_owned() or not lock.acquire(False):  # type: ignore[attr-defined]
            self._take_turn("dequeue", deadline, timeout_s)
        self._notice = None if indefinite or timeout is not None else "dequeue"
        try:
            self._in_call = True
            if self.role == "local reader":
                assert self._cursor is not None
                self._waiting = (deadline, timeout_s, stall_check)
                return self._cursor.read(self._local_index, self._wait_ready, into)
            if self.role == "remote reader":
                return self._dequeue_remote(deadline, timeout_s)
            raise GroupcoordValueError(f"{self.what}: dequeue on the writer (rank {self.rank})")
        finally:
            self._in_call = False  # before any Python call: see _take_turn
            self._call_lock.release()
            self._end_call()

    def drop_unread(self) -> int:
        """Read and discard what the writer has published and this local reader has
        not read; the number of messages. A group calls it when its ranks' calls
        were found out of step (``DesyncError``): a broadcast this rank made another
        call instead of reading would otherwise be what its next read returns. The
        writer published it before it reached the call that found the mismatch, so
        every such message is visible here. 0 on another end or a shut queue."""
        if self.role != "local reader" or self._closed:
            return 0
        assert self._ring is not None and self._cursor is not None
        dropped = 0
        while self._cursor.message_ready(self._local_index):
            self.dequeue(timeout=get_config().timeout_s)  # published: no wait but a stream's
            dropped += 1
        return dropped

    def _wait_ready(self, idx: int) -> None:
        """``dequeue``'s wait for chunk ``idx`` (its state in ``_waiting``)."""
        deadline, timeout_s, stall_check = self._waiting
        self._reader_wait_chunk(idx, deadline, timeout_s, stall_check=stall_check)

    def _reader_wait_chunk(
        self,
        idx: int,
        deadline: float,
        timeout_s: float,
        operation: str = "dequeue",
        stall_check: StallCheck | None = None,
    ) -> None:
        ring = self._ring
        assert ring is not None
        me = self._local_index

        def quick() -> None:
            self._check_open()
            if ring.shutdown_flag:
                raise ClosedError(
                    f"{self.what}: the writer shut the queue down (rank {self.writer_rank})"
                )

        def slow() -> None:
            self._check_writer_alive(operation)
            if stall_check is not None:
                stall_check([self.writer_rank], lambda: ring.ready(idx, me))

        wait_until(
            lambda: ring.ready(idx, me),
            deadline,
            quick_check=quick,
            slow_check=self._with_notice(slow),
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
