"""MessageQueue: one writer, many readers, in order, nothing lost.

Local readers (same node) read a :class:`ShmRingBuffer`. A message fits one
chunk (decoded in place), or streams through the chunks in order while the
readers copy it out (:mod:`.ring_messages`). Remote readers get every
message over TCP (:mod:`.tcp_channel`: MACs, credit flow control). Every wait
has a deadline; a dead peer raises :class:`PeerDiedError`;
:meth:`MessageQueue.shutdown` wakes a waiting reader. Local readers also
connect a ZeroMQ ``ipc://`` socket to the writer: ``wait_until_ready``'s
handshake runs over it.
"""

from __future__ import annotations

import datetime
import os
import secrets
import time
from typing import Any

import zmq

from . import mq_groups
from .config import MIN_CHUNK_BYTES, get_config, resolve_timeout
from .errors import GroupcoordValueError, NotSupportedError, ProtocolError
from .mq_handle import Handle, cleanup_stale_ipc_files, default_ip, ipc_path
from .mq_reader import ReaderEnd
from .mq_writer import WriterEnd
from .ring import ShmRingBuffer
from .ring_messages import RingCursor
from .tcp_channel import WINDOW_MESSAGES, TcpReader, TcpWriter
from .tcp_frames import KIND_READY

__all__ = ["Handle", "MessageQueue", "cleanup_stale_ipc_files"]


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise GroupcoordValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class MessageQueue(WriterEnd, ReaderEnd):
    """Single-writer multi-reader broadcast queue (vLLM-compatible API).

    Our keyword-only additions: ``name`` (in errors and segment names),
    ``allow_pickle``, ``writer_rank``, and ``reader_pids``: the local readers'
    process ids when the writer knows them before they attach (a
    point-to-point channel does), so that a wait for a reader that has not
    attached yet ends with :class:`PeerDiedError` once its process is gone
    (otherwise only the deadline ends it).
    """

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
        reader_pids: list[int] | None = None,
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
            MIN_CHUNK_BYTES,
        )
        max_chunks = _check_int(
            "max_chunks", cfg.mq_max_chunks if max_chunks is None else max_chunks, 1
        )
        if reader_pids is not None and (
            len(reader_pids) != n_local_reader
            or any(type(pid) is not int or pid <= 0 for pid in reader_pids)
        ):
            raise GroupcoordValueError(
                f"reader_pids={reader_pids!r} must hold {n_local_reader} process ids "
                "(one per local reader, in local_reader_ranks' order)"
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
            window=max(WINDOW_MESSAGES, max_chunks),
        )
        if reader_pids is not None:
            self._reader_pids = list(reader_pids)
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

    def broadcast_object(self, obj: Any = None) -> Any:
        """Writer: enqueue ``obj`` and return it; reader: return the next object."""
        if self.role == "writer":
            self.enqueue(obj)
            return obj
        return self.dequeue()

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
