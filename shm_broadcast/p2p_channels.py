"""Shared-memory channels for point-to-point tensor dicts between ranks on one node.

One single-reader :class:`~shm_broadcast.message_queue.MessageQueue` per
ordered (sender, receiver) pair, created lazily by the sender on its first
send to that peer. The sender publishes the queue's handle in torch's default
TCPStore under a key unique to the group and the pair; the receiver attaches
on its first receive from that sender. Neither side waits for the other to
set up (the ring holds ``P2P_MAX_CHUNKS`` messages before anyone reads), so
no order of first calls can deadlock; every wait is bounded by the group's
deadline and a dead peer is named by pid.

Every message fits in one ring chunk: a tensor or a dict's head larger than
a chunk goes as consecutive pieces, so nothing ever takes the queue's ZeroMQ
overflow path (which would need a subscription handshake and costs a copy
through a socket). Decoded tensors own their memory, so the ring is reused
while the receiver still holds what it got.

Memory: ``P2P_MAX_CHUNKS * max(mq_max_chunk_bytes, 16 MiB)`` of /dev/shm
(64 MiB by default) per ordered pair that actually exchanged a dict,
released by ``close()`` (``GroupCoordinator.destroy``). A ring that does not
fit in /dev/shm is not an error: the sender marks the pair "gloo" in the
store and both ends use Gloo sends for it.

A sent dict is delivered even if the sender returns and exits at once (as
vLLM's test workers do; Gloo delivers too): ``close()`` and the process's exit
(``atexit``, and multiprocessing's exit for forked workers, which skip
``atexit``) first wait until each receiver has read what it was sent, has shut
its end, or died, for at most ``P2P_LINGER_S`` (and the group's timeout). The
receiver unlinks the ring's name as soon as it has mapped it (it is the only
party that ever attaches), so nothing stays in /dev/shm however either ends.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .codec import EncodedMessage, dumps, loads, message_bytes
from .config import get_config
from .errors import (
    ClosedError,
    GroupcoordTimeoutError,
    PeerDiedError,
    ProtocolError,
    ShmSpaceError,
)
from .liveness import process_alive
from .message_queue import Handle, MessageQueue
from .segments import unlink_segment

__all__ = [
    "P2P_LINGER_S",
    "P2P_MAX_CHUNKS",
    "P2P_MIN_CHUNK_BYTES",
    "P2PChannels",
    "deliver_pending_sends",
    "piece_bytes",
]

# Ring geometry per pair. Chunks are at least 16 MiB: a tensor that fits in
# one travels with one copy in and one out, while a split one pays a third
# copy into its destination. Four chunks let the writer run ahead; measured
# (world 2 ping-pong, 8 x 8 MiB tensors one way): 4 x 16 MiB 6.2 ms, 2 x 16 MiB
# 17 ms, 4 x 4 MiB (tensors split) 20 ms, Gloo 20 ms.
P2P_MAX_CHUNKS = 4
P2P_MIN_CHUNK_BYTES = 16 * 1024 * 1024
logger = logging.getLogger("groupcoord.shm_broadcast")
# Stored instead of a handle when the sender's ring did not fit in /dev/shm.
_USE_GLOO = b"gloo"
# Room in a chunk for the queue's and the codec's headers around one piece.
_HEADROOM = 4096
# Enqueue waits in slices this long, checking the receiver's pid in between
# (the queue only watches readers that have attached).
_SLICE_S = 0.5
# At close or exit, how long a sender waits at most for a living receiver that
# neither reads nor shuts its end (bounded, so an exit never hangs on a peer).
P2P_LINGER_S = 30.0
# The channels of this process that have sent something (see deliver_pending_sends).
_senders: weakref.WeakSet[P2PChannels] = weakref.WeakSet()
_exit_hook_pid: int | None = None


def deliver_pending_sends() -> None:
    """Close every channel this process sent on, after its receivers read what was
    sent (bounded, see the module doc). Runs at exit; idempotent."""
    for channels in list(_senders):
        if channels.pid == os.getpid():
            channels.close()


def _hook_exit() -> None:
    """Once per process: run deliver_pending_sends at interpreter exit and at
    multiprocessing's exit of a forked worker (which skips atexit)."""
    global _exit_hook_pid
    if _exit_hook_pid == os.getpid():
        return
    _exit_hook_pid = os.getpid()
    atexit.register(deliver_pending_sends)
    multiprocessing.util.Finalize(None, deliver_pending_sends, exitpriority=100)


def piece_bytes(max_chunk_bytes: int) -> int:
    """The largest payload one message of a ring with these chunks carries (both sides agree)."""
    return max(64, max_chunk_bytes - _HEADROOM)


class P2PChannels:
    """The shared-memory channels of one group, to and from its peers on this node.

    ``peers`` maps the global ranks usable this way (same node, same pid
    namespace) to their pids. Ranks are global ranks throughout.
    """

    def __init__(self, name: str, rank: int, peers: dict[int, int], timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.peers = dict(peers)
        self.timeout_s = timeout_s
        self._writers: dict[int, MessageQueue] = {}
        self._readers: dict[int, MessageQueue] = {}
        # Pairs whose ring did not fit in /dev/shm: they use Gloo (both ends know).
        self._gloo_to: set[int] = set()
        self._gloo_from: set[int] = set()
        self._closed = False
        self.pid = os.getpid()  # a forked child must not close its parent's channels

    def open_to(self, dst: int, operation: str) -> bool:
        """Whether dicts to ``dst`` go through shared memory (creates the channel on first use)."""
        if self._closed or dst not in self.peers or dst in self._gloo_to:
            return False
        return self._writer(dst, operation) is not None

    def open_from(self, src: int, operation: str) -> bool:
        """Whether dicts from ``src`` come through shared memory (joins the channel on first use)."""
        if self._closed or src not in self.peers or src in self._gloo_from:
            return False
        return self._reader(src, operation) is not None

    def _key(self, src: int, dst: int) -> str:
        return f"groupcoord/p2p/{self.name}/{src}->{dst}"

    def _store_call(self, operation: str, peer: int, fn: Any, *args: Any) -> Any:
        """A call on the default TCPStore; its failure (its host died, often the peer) names the peer."""
        try:
            return fn(*args)
        except RuntimeError as exc:
            gone = not process_alive(self.peers[peer])
            detail = (
                f"pid {self.peers[peer]} is gone" if gone else f"the store did not answer: {exc}"
            )
            raise PeerDiedError(self.name, operation, [peer], detail) from exc

    # ---- sender -------------------------------------------------------------

    def _writer(self, dst: int, operation: str) -> MessageQueue | None:
        mq = self._writers.get(dst)
        if mq is not None:
            return mq
        if self._closed:
            raise ClosedError(f"{self.name}: shared-memory channels are closed")
        store = dist.distributed_c10d._get_default_store()
        key = self._key(self.rank, dst)
        try:
            mq = MessageQueue(
                1,
                1,
                [dst],
                max(get_config().mq_max_chunk_bytes, P2P_MIN_CHUNK_BYTES),
                P2P_MAX_CHUNKS,
                name=f"{self.name}:p2p{self.rank}to{dst}",
                writer_rank=self.rank,
            )
        except ShmSpaceError as exc:
            # A small /dev/shm (containers often have 64 MiB): this pair keeps
            # using Gloo, and the receiver learns it from the store.
            logger.warning("%s: %s; dicts to rank %d go over Gloo", self.name, exc, dst)
            self._store_call(operation, dst, store.set, key, _USE_GLOO)
            self._gloo_to.add(dst)
            return None
        try:
            self._store_call(operation, dst, store.set, key, dumps(mq.export_handle()))
        except BaseException:
            mq.shutdown()
            raise
        self._writers[dst] = mq
        _senders.add(self)
        _hook_exit()
        return mq

    def _put(self, mq: MessageQueue, obj: Any, dst: int, operation: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            wait = min(_SLICE_S, deadline - time.monotonic())
            try:
                mq.enqueue(obj, timeout=max(wait, 0.001))
                return
            except GroupcoordTimeoutError as exc:
                if not process_alive(self.peers[dst]):
                    raise PeerDiedError(
                        self.name, operation, [dst], f"receiver pid {self.peers[dst]} is gone"
                    ) from exc
                if time.monotonic() >= deadline:
                    raise GroupcoordTimeoutError(
                        self.name,
                        operation,
                        self.timeout_s,
                        [dst],
                        f"sender rank {self.rank}",
                        "the receiver has not read the shared-memory channel",
                    ) from exc
            except PeerDiedError as exc:
                raise PeerDiedError(self.name, operation, [dst], str(exc)) from exc

    def send_message(self, dst: int, msg: EncodedMessage, operation: str) -> None:
        """Send an encoded object (a tensor dict's head); it must not be an int."""
        mq = self._writers[dst]
        if msg.nbytes <= piece_bytes(mq.max_chunk_bytes):
            self._put(mq, msg, dst, operation)
            return
        # Too big for one chunk: its length, then its bytes in pieces.
        payload = message_bytes(msg)
        self._put(mq, len(payload), dst, operation)
        self.send_tensor(dst, torch.frombuffer(bytearray(payload), dtype=torch.uint8), operation)

    def send_tensor(self, dst: int, tensor: torch.Tensor, operation: str) -> None:
        mq = self._writers[dst]
        limit = piece_bytes(mq.max_chunk_bytes)
        if tensor.numel() * tensor.element_size() <= limit:
            # The codec copies it (strided or not) straight into the chunk.
            self._put(mq, tensor, dst, operation)
            return
        flat = tensor.reshape(-1)
        step = limit // tensor.element_size()
        for start in range(0, flat.numel(), step):
            self._put(mq, flat[start : start + step], dst, operation)

    # ---- receiver -----------------------------------------------------------

    def _reader(self, src: int, operation: str) -> MessageQueue | None:
        mq = self._readers.get(src)
        if mq is not None:
            return mq
        if self._closed:
            raise ClosedError(f"{self.name}: shared-memory channels are closed")
        store = dist.distributed_c10d._get_default_store()
        key = self._key(src, self.rank)
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        # The sender publishes the handle on its first send; until then, poll.
        while not self._store_call(operation, src, store.check, [key]):
            if not process_alive(self.peers[src]):
                raise PeerDiedError(
                    self.name, operation, [src], f"sender pid {self.peers[src]} is gone"
                )
            if time.monotonic() >= deadline:
                raise GroupcoordTimeoutError(
                    self.name,
                    operation,
                    self.timeout_s,
                    [src],
                    f"receiver rank {self.rank}",
                    "the sender has not opened its shared-memory channel",
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        data = self._store_call(operation, src, store.get, key)
        self._store_call(operation, src, store.delete_key, key)
        if data == _USE_GLOO:
            self._gloo_from.add(src)
            return None
        handle = loads(data)
        if not isinstance(handle, Handle):
            raise ProtocolError(f"{self.name}: store key {key} holds no queue handle")
        try:
            mq = MessageQueue.create_from_handle(handle, self.rank)
        except FileNotFoundError as exc:
            raise ClosedError(
                f"{self.name}: {operation} from rank {src}: its channel is gone "
                "(the sender destroyed the group before this rank received)"
            ) from exc
        # This rank is the ring's only reader: once mapped, its name has done its job.
        if handle.buffer_name is not None:
            unlink_segment(handle.buffer_name)
        self._readers[src] = mq
        return mq

    def _get(self, mq: MessageQueue, src: int, operation: str) -> Any:
        try:
            return mq.dequeue(timeout=self.timeout_s)
        except GroupcoordTimeoutError as exc:
            raise GroupcoordTimeoutError(
                self.name,
                operation,
                self.timeout_s,
                [src],
                f"receiver rank {self.rank}",
                "nothing arrived on the shared-memory channel",
            ) from exc
        except PeerDiedError as exc:
            raise PeerDiedError(self.name, operation, [src], str(exc)) from exc

    def recv_message(self, src: int, operation: str) -> Any:
        """The object :meth:`send_message` sent."""
        mq = self._readers[src]
        got = self._get(mq, src, operation)
        if type(got) is not int:
            return got
        if got < 0:
            raise ProtocolError(f"{self.name}: rank {src} announced a message of {got} bytes")
        return loads(self.recv_tensor(src, torch.uint8, (got,), operation).numpy().data)

    def recv_tensor(
        self, src: int, dtype: torch.dtype, shape: tuple[int, ...], operation: str
    ) -> torch.Tensor:
        mq = self._readers[src]
        limit = piece_bytes(mq.max_chunk_bytes)
        numel = 1
        for s in shape:
            numel *= s
        if numel * dtype.itemsize <= limit:
            got = self._get(mq, src, operation)
            _check_piece(self.name, src, got, dtype, numel)
            return got.reshape(shape)  # type: ignore[no-any-return]
        out = torch.empty(numel, dtype=dtype)
        step = limit // dtype.itemsize
        for start in range(0, numel, step):
            piece = self._get(mq, src, operation)
            _check_piece(self.name, src, piece, dtype, min(step, numel - start))
            out[start : start + step].copy_(piece)
        return out.view(shape)

    # ---- both ---------------------------------------------------------------

    def close(self) -> None:
        """Shut every channel down once each receiver has read what this rank sent
        it (or shut its end, or died; at most ``P2P_LINGER_S``); idempotent."""
        self._closed = True
        self._linger()
        queues = list(self._writers.values()) + list(self._readers.values())
        self._writers.clear()
        self._readers.clear()
        for mq in queues:
            mq.shutdown()

    def _linger(self) -> None:
        deadline = time.monotonic() + min(P2P_LINGER_S, self.timeout_s)
        for dst, mq in self._writers.items():
            pause = 0.001
            while not mq.all_read() and process_alive(self.peers[dst]):
                if time.monotonic() >= deadline:
                    logger.warning(
                        "%s: rank %d has not read what rank %d sent it; closing anyway",
                        self.name,
                        dst,
                        self.rank,
                    )
                    break
                time.sleep(pause)
                pause = min(pause * 2, 0.05)


def _check_piece(name: str, src: int, got: Any, dtype: torch.dtype, numel: int) -> None:
    if not isinstance(got, torch.Tensor) or got.dtype != dtype or got.numel() != numel:
        what = (
            f"{got.dtype}[{got.numel()}]" if isinstance(got, torch.Tensor) else type(got).__name__
        )
        raise ProtocolError(
            f"{name}: expected a {dtype} piece of {numel} elements from rank {src}, got {what}"
        )
