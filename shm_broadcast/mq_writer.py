"""The writer's end of a :class:`~shm_broadcast.message_queue.MessageQueue`: its
handle, the readiness handshake, ``enqueue`` and the raw ``acquire_write``, and
its wait for a chunk every local reader has read."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import zmq

from .array_frames import lone_tensor_meta
from .codec import EncodedMessage, frames_as_buffers
from .errors import ClosedError, GroupcoordTimeoutError, GroupcoordValueError, PeerDiedError
from .mq_end import NO_DEADLINE, READY, QueueEnd, deadline_of
from .mq_handle import Handle
from .ring import READER_DETACHED, process_alive
from .waiting import StallCheck, wait_until

# What most messages are, and no tensor: enqueue asks no more (100 ns a message).
_PLAIN = frozenset({dict, list, tuple, str, bytes, int, float, bool, type(None)})


class WriterEnd(QueueEnd):
    """What only the writer does."""

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
            self._local_sock.send(READY)
        if self._tcp_writer is not None:
            self._tcp_writer.wait_ready(deadline, timeout_s, self._check_open)

    def enqueue(
        self,
        obj: Any,
        timeout: float | datetime.timedelta | None = None,
        *,
        stall_check: StallCheck | None = None,
    ) -> None:
        """Send ``obj`` to every reader; waits while readers are behind: at most
        ``timeout``, or (None, vLLM's semantics) as long as they live, with a notice.

        ``obj`` may be a message ``codec.encode_message`` already encoded; it is
        sent as is (readers get the object it encodes).

        ``stall_check``: called with the local readers (their ranks) that have not
        read a chunk this call waits for, and the wait's own test (is the chunk
        free?), at the readers' liveness checks, until
        the first chunk of ``obj`` is written; it may raise to end the wait (a
        group's, when they wait for this rank in a collective:
        ``ShmBase.check_queue_wait``)."""
        if self.role != "writer":
            raise GroupcoordValueError(f"{self.what}: enqueue on a {self.role} (rank {self.rank})")
        if self._closed:
            self._check_open()
        cursor = self._cursor
        timeout_s, deadline = NO_DEADLINE if timeout is None else deadline_of(timeout)
        lock = self._call_lock  # the codec's turn too: one call at a time
        # Taken at once (the common case) unless this thread holds it or another does.
        if lock._is_owned() or not lock.acquire(False):  # type: ignore[attr-defined]
            self._take_turn("enqueue", deadline, timeout_s)
        try:
            self._in_call = True
            # A lone plain CPU tensor to local readers only: its bytes, no codec.
            meta = None
            if cursor is not None and self._tcp_writer is None and type(obj) not in _PLAIN:
                meta = lone_tensor_meta(obj)
            # Encoding refuses bad objects before anything is sent.
            msg = (
                obj
                if meta is not None or isinstance(obj, EncodedMessage)
                else self._codec.encode(obj)
            )
            self._notice = None if timeout is not None else "enqueue"
            body: list[Any] | None = None
            if cursor is not None:
                self._waiting = (cursor.chunks, deadline, timeout_s, stall_check)
                wait_free = self._wait_free
                if meta is not None:
                    if cursor.write_tensor(obj, meta, wait_free):
                        return
                    msg = self._codec.encode(obj)
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
            self._in_call = False  # before any Python call: see _take_turn
            self._call_lock.release()
            self._end_call()

    def _wait_free(self, idx: int) -> None:
        """``enqueue``'s wait for chunk ``idx`` (its state in ``_waiting``): the stall
        check applies while nothing of the message is written (the cursor has not
        moved)."""
        start, deadline, timeout_s, stall_check = self._waiting
        assert self._cursor is not None
        check = stall_check if self._cursor.chunks == start else None
        self._writer_wait_chunk(idx, deadline, timeout_s, stall_check=check)

    @contextlib.contextmanager
    def acquire_write(
        self, timeout: float | datetime.timedelta | None = None
    ) -> Iterator[memoryview]:
        """vLLM's raw write: a writable view of the next chunk's payload
        (``max_chunk_bytes - 64`` bytes), published to the local readers when the
        block ends (not when it raises). Waits for the chunk as ``enqueue`` does.
        Raw bytes reach local readers only: a queue with remote readers refuses."""
        cursor = self._raw_cursor("acquire_write", "writer")
        timeout_s, deadline = deadline_of(timeout)
        self._take_turn("acquire_write", deadline, timeout_s)
        self._notice = None if timeout is not None else "acquire_write"
        try:
            self._in_call = True
            with cursor.raw_write(
                lambda idx: self._writer_wait_chunk(idx, deadline, timeout_s, "acquire_write")
            ) as view:
                yield view
        finally:
            self._in_call = False  # before any Python call: see _take_turn
            self._call_lock.release()
            self._end_call()

    def takes_without_waiting(self, tensor_bytes: list[int]) -> bool:
        """Writer with only local readers: whether ``enqueue`` of lone CPU tensors of
        these byte counts, in order, would return without waiting for a reader."""
        cursor = self._cursor
        if self.role != "writer" or cursor is None or self._tcp_writer is not None:
            return False
        return cursor.free_for(tensor_bytes)

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
        self,
        idx: int,
        deadline: float,
        timeout_s: float,
        operation: str = "enqueue",
        stall_check: StallCheck | None = None,
    ) -> None:
        ring = self._ring
        assert ring is not None

        def missing() -> list[int]:
            return [self.local_reader_ranks[r] for r in ring.readers_missing(idx)]

        def check() -> None:
            dead = []
            for r in range(self.n_local_reader):
                pid = ring.reader_pid(r) or self._reader_pids[r]
                if pid == READER_DETACHED:
                    raise ClosedError(
                        f"{self.what}: reader rank {self.local_reader_ranks[r]} shut down"
                    )
                if pid and not process_alive(pid):
                    dead.append(self.local_reader_ranks[r])
            if dead:
                raise PeerDiedError(self.what, operation, dead, "reader process is gone")
            if stall_check is not None:
                stall_check(missing(), lambda: ring.chunk_free(idx))

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
