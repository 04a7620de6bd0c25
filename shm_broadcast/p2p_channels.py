"""Shared-memory channels for point-to-point tensor dicts between ranks on one node.

One single-reader :class:`~shm_broadcast.message_queue.MessageQueue` per
ordered (sender, receiver) pair, created lazily by the sender on its first
send to that peer. The sender publishes the queue's handle in torch's default
TCPStore under a key unique to the group and the pair; the receiver attaches
on its first receive from that sender. Neither side waits for the other to
set up (the ring holds up to 64 MiB before anyone reads), so no order of
first calls can deadlock; every wait is bounded by the group's deadline and
a dead peer is named by pid.

Any size goes as one queue message, always in shared memory: a message
larger than a chunk streams through the ring, the receiver copying each
512 KiB chunk out while the sender fills the next, so the copy in and the
copy out overlap (a one-chunk message is copied in, then out). One that
fits the ring is sent without the receiver (it waits for nothing but free
chunks); a larger one returns once the receiver has taken all but the last
ring's worth. Decoded tensors own their memory, so the ring is reused while
the receiver still holds what it got.

Memory: ``P2P_CHUNK_BYTES * P2P_MAX_CHUNKS`` of /dev/shm (64 MiB) per
ordered pair that actually exchanged a dict,
released by ``close()`` (``GroupCoordinator.destroy``). Where /dev/shm has
less room, the pair gets a ring of about 8 MiB (``ring.in_a_ring_that_fits``),
which large dicts stream through; a ring
that does not fit even so is not an error: the sender marks the pair "gloo"
in the store and both ends use Gloo sends for it.

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
import ctypes
import logging
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .codec import EncodedMessage, dumps, loads
from .errors import (
    ClosedError,
    DesyncError,
    GroupcoordTimeoutError,
    PeerDiedError,
    ProtocolError,
)
from .liveness import process_alive
from .message_queue import Handle, MessageQueue
from .ring import in_a_ring_that_fits
from .segments import unlink_segment

__all__ = [
    "Limit",
    "P2P_LINGER_S",
    "P2P_CHUNK_BYTES",
    "P2P_MAX_CHUNKS",
    "P2PChannels",
    "TENSOR_OBJECT",
    "deliver_pending_sends",
]

# An object that is a tensor (send_object's) travels as [TENSOR_OBJECT, tensor],
# so a receive tells it from send's tensor: recv_object meeting send's tensor, or
# recv meeting send_object's, is a DesyncError here as over Gloo.
TENSOR_OBJECT = "groupcoord:tensor_object"

# Ring geometry per pair: small chunks, so a large message streams in pieces
# whose copy in and copy out overlap; many of them, so the sender can run
# 64 MiB ahead. One-way times of one tensor, world 2 ping-pong, 2026-11-23
# (7 batches each, in the same session): 4 x 16 MiB chunks, a large message
# copied in whole then out whole: 4 MiB 0.65-1.0 ms, 16 MiB 2.8-5.0 ms,
# 64 MiB 9.7-13.7 ms; 128 x 512 KiB streamed: 0.45-0.6, 2.2-3.3, 7.6-9.5 ms.
# Chunks of 256 KiB or 1 MiB measured the same within noise, 2 MiB slower.
P2P_CHUNK_BYTES = 512 * 1024
P2P_MAX_CHUNKS = 128
logger = logging.getLogger("groupcoord.shm_broadcast")
# Stored instead of a handle when the sender's ring did not fit in /dev/shm.
_USE_GLOO = b"gloo"
# At close or exit, how long a sender waits at most for a living receiver that
# neither reads nor shuts its end (bounded, so an exit never hangs on a peer).
P2P_LINGER_S = 30.0
# The channels of this process that have sent something and are not closed (see
# deliver_pending_sends). Held strongly: a group dropped without destroy() still
# delivers what it sent before the process exits.
_senders: set[P2PChannels] = set()
_LAST_LOOK_S = 0.001
_exit_hook_pid: int | None = None


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


class Limit(NamedTuple):
    """How long one call may wait: ``timeout_s`` (what an error reports) ending at
    ``deadline`` (monotonic; earlier when the call queued first)."""

    timeout_s: float
    deadline: float

    @classmethod
    def of(cls, timeout_s: float) -> Limit:
        return cls(timeout_s, time.monotonic() + timeout_s)

    def left(self) -> float:
        """Seconds to the deadline; one short look once it has passed."""
        return max(self.deadline - time.monotonic(), _LAST_LOOK_S)


class P2PChannels:
    """The shared-memory channels of one group, to and from its peers on this node.

    ``peers`` maps the global ranks usable this way (same node, same pid
    namespace) to their pids. Ranks are global ranks throughout. ``store``
    carries the rings' handles (default: torch's default store, looked up at
    first use). Threads may share a pair's channel: it is made once, each
    message is whole, and a caller that sends or receives several messages as
    one unit (a tensor dict) holds :meth:`turn` for the pair and direction.
    """

    def __init__(
        self,
        name: str,
        rank: int,
        peers: dict[int, int],
        timeout_s: float,
        store: dist.Store | None = None,
    ) -> None:
        self.name = name
        self.rank = rank
        self.peers = dict(peers)
        self.timeout_s = timeout_s
        self._store = store
        self._writers: dict[int, MessageQueue] = {}
        self._readers: dict[int, MessageQueue] = {}
        # Pairs whose ring did not fit in /dev/shm: they use Gloo (both ends know).
        self._gloo_to: set[int] = set()
        self._gloo_from: set[int] = set()
        self._closed = False
        self.pid = os.getpid()  # a forked child must not close its parent's channels
        # Each pair and direction's turn (see turn(); also held while its queue is
        # made: two threads' writers under one store key lost one thread's messages).
        self._turns: dict[tuple[int, bool], threading.RLock] = {}
        self._turns_lock = threading.Lock()
        # Called (operation, [peer], writing, the wait's own test) while a receive
        # waits on its sender, or a call's first send waits for room before anything
        # of it is written (the owner's check that the peer is not waiting for this
        # rank in a collective); may raise.
        self.stall_check: Callable[[str, list[int], bool, Callable[[], bool]], None] | None = None

    def turn(self, peer: int, sending: bool) -> threading.RLock:
        """The lock a caller holds while it sends to (or receives from) ``peer`` the
        messages of one unit, so other threads' messages do not come between them."""
        key = (peer, sending)
        lock = self._turns.get(key)
        if lock is None:
            with self._turns_lock:
                lock = self._turns.setdefault(key, threading.RLock())
        return lock

    def open_to(self, dst: int, operation: str) -> bool:
        """Whether dicts to ``dst`` go through shared memory (creates the channel on first use)."""
        if self._closed or dst not in self.peers or dst in self._gloo_to:
            return False
        return self._writer(dst, operation) is not None

    def open_from(self, src: int, operation: str, limit: Limit | None = None) -> bool:
        """Whether dicts from ``src`` come through shared memory (joins the channel on
        first use, waiting for the sender to open it within ``limit``)."""
        if self._closed or src not in self.peers or src in self._gloo_from:
            return False
        return self._reader(src, operation, limit) is not None

    def _limit(self, limit: Limit | None) -> Limit:
        return limit if limit is not None else Limit.of(self.timeout_s)

    def store(self) -> dist.Store:
        """The store the rings' handles go through."""
        return self._store if self._store is not None else _default_store()

    def _key(self, src: int, dst: int) -> str:
        return f"groupcoord/p2p/{self.name}/{src}->{dst}"

    def _store_call(self, operation: str, peer: int, fn: Any, *args: Any) -> Any:
        """A call on the default TCPStore, which a pair's first message needs (the
        handle of its ring). It fails when the store's host has gone: a dead peer is
        named as such; with the peer alive, the store's host is what went away."""
        try:
            return fn(*args)
        except RuntimeError as exc:
            if not process_alive(self.peers[peer]):
                raise PeerDiedError(
                    self.name, operation, [peer], f"pid {self.peers[peer]} is gone"
                ) from exc
            raise ClosedError(
                f"{self.name}: {operation} with rank {peer} (alive) could not open the pair's "
                "shared-memory channel: torch's TCPStore did not answer (its host, rank 0 "
                f"under torchrun, has likely exited): {exc}"
            ) from exc

    # ---- sender -------------------------------------------------------------

    def _writer(self, dst: int, operation: str) -> MessageQueue | None:
        mq = self._writers.get(dst)
        if mq is not None:
            return mq
        with self.turn(dst, True):  # this direction's lock: other pairs go on meanwhile
            if dst in self._gloo_to:
                return None
            return self._new_writer(dst, operation)

    def _new_writer(self, dst: int, operation: str) -> MessageQueue | None:
        mq = self._writers.get(dst)  # another thread's, made while this one waited
        if mq is not None:
            return mq
        if self._closed:
            raise ClosedError(f"{self.name}: shared-memory channels are closed")
        store = self.store()
        key = self._key(self.rank, dst)
        try:
            mq = in_a_ring_that_fits(
                lambda chunks: MessageQueue(
                    1,
                    1,
                    [dst],
                    P2P_CHUNK_BYTES,
                    chunks,
                    name=f"{self.name}:p2p{self.rank}to{dst}",
                    writer_rank=self.rank,
                    reader_pids=[self.peers[dst]],
                ),
                P2P_CHUNK_BYTES,
                P2P_MAX_CHUNKS,
                f"{self.name}: dicts to rank {dst}",
            )
        except OSError as exc:
            if isinstance(exc, (PeerDiedError, GroupcoordTimeoutError)):
                raise  # OSErrors too, but about a peer, not this machine's memory
            # A small /dev/shm (containers often have 64 MiB; ShmSpaceError is an
            # OSError), or none that can be written: this pair keeps using Gloo,
            # and the receiver learns it from the store.
            logger.warning("%s: %s; dicts to rank %d go over Gloo", self.name, exc, dst)
            self._store_call(operation, dst, store.set, key, _USE_GLOO)
            self._gloo_to.add(dst)
            return None
        try:
            self._store_call(operation, dst, store.set, key, dumps(mq.export_handle()))
            self._keep(self._writers, dst, mq)
        except BaseException:
            mq.shutdown()
            raise
        _senders.add(self)
        _hook_exit()
        return mq

    def _keep(self, queues: dict[int, MessageQueue], peer: int, mq: MessageQueue) -> None:
        """Record a new queue, unless close() ran meanwhile (on another thread): then
        the caller shuts it."""
        if self._closed:
            raise ClosedError(f"{self.name}: shared-memory channels are closed")
        queues[peer] = mq

    def _put(
        self,
        mq: MessageQueue,
        obj: Any,
        dst: int,
        operation: str,
        limit: Limit | None,
        first: bool,
    ) -> None:
        # One wait to the deadline: a message larger than the ring streams
        # through it, and a stream cut by a timeout cannot resume (a receiver
        # busy elsewhere for a while is not an error). The queue knows the
        # receiver's pid, attached or not, and ends the wait if it dies. The
        # call's ``first`` message is checked while it waits for room (the queue
        # checks only until its first chunk is written: nothing of the call sent).
        # No limit: the group's timeout from now (the common call builds no Limit).
        timeout_s = self.timeout_s if limit is None else limit.timeout_s
        check = self.stall_check if first else None
        try:
            mq.enqueue(
                obj,
                timeout=timeout_s if limit is None else limit.left(),
                stall_check=None
                if check is None
                else lambda peers, ready: check(operation, peers, True, ready),
            )
        except (GroupcoordTimeoutError, PeerDiedError) as exc:
            waiting_for = "the receiver has not read the shared-memory channel"
            raise self._named(exc, dst, operation, timeout_s, "sender", waiting_for) from exc

    def _named(
        self,
        exc: GroupcoordTimeoutError | PeerDiedError,
        peer: int,
        operation: str,
        timeout_s: float,
        role: str,
        waiting_for: str,
    ) -> GroupcoordTimeoutError | PeerDiedError:
        """The queue's ``exc`` as this group's error, naming the operation and the peer."""
        if isinstance(exc, PeerDiedError):
            return PeerDiedError(self.name, operation, [peer], str(exc))
        return GroupcoordTimeoutError(
            self.name, operation, timeout_s, [peer], f"{role} rank {self.rank}", waiting_for
        )

    def send_message(self, dst: int, msg: EncodedMessage, operation: str) -> None:
        """Send an encoded object (a tensor dict's head), whatever its size: one
        larger than a chunk streams through the ring. It is its call's first message."""
        self._put(self._writers[dst], msg, dst, operation, None, True)

    def sends_without_waiting(
        self, dst: int, tensor_bytes: list[int], operation: str, create: bool = True
    ) -> bool:
        """Whether tensors of these byte counts sent to ``dst`` now, in order, all go
        into the pair's ring without waiting for the receiver (the channel opened,
        if need be, unless not ``create``: then False for a channel not yet open,
        so a caller outside the thread that sends to ``dst`` never opens it beside
        that thread): a caller may then send them all before receiving anything."""
        if not create:
            mq = self._writers.get(dst)
            return mq is not None and not self._closed and mq.takes_without_waiting(tensor_bytes)
        return self.open_to(dst, operation) and self._writers[dst].takes_without_waiting(
            tensor_bytes
        )

    def send_tensor(
        self,
        dst: int,
        tensor: torch.Tensor,
        operation: str,
        limit: Limit | None = None,
        *,
        first: bool = False,
    ) -> None:
        """Send one tensor (after ``open_to``) within ``limit`` (default: the group's
        timeout from now); ``first``: the first message of its call (see ``_put``)."""
        # The codec copies it (strided or not) straight into the ring.
        self._put(self._writers[dst], tensor, dst, operation, limit, first)

    # ---- receiver -----------------------------------------------------------

    def _reader(self, src: int, operation: str, limit: Limit | None) -> MessageQueue | None:
        mq = self._readers.get(src)
        if mq is not None:
            return mq
        with self.turn(src, False):
            if src in self._gloo_from:
                return None
            return self._new_reader(src, operation, limit)

    def _new_reader(self, src: int, operation: str, limit: Limit | None) -> MessageQueue | None:
        mq = self._readers.get(src)  # another thread's, joined while this one waited
        if mq is not None:
            return mq
        if self._closed:
            raise ClosedError(f"{self.name}: shared-memory channels are closed")
        store = self.store()
        key = self._key(src, self.rank)
        limit = self._limit(limit)
        deadline = limit.deadline
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
                    limit.timeout_s,
                    [src],
                    f"receiver rank {self.rank}",
                    "the sender has not opened its shared-memory channel",
                )
            if self.stall_check is not None:
                self.stall_check(
                    operation,
                    [src],
                    False,
                    lambda: self._store_call(operation, src, store.check, [key]),
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
                "(the sender destroyed the group before this rank received), or the "
                f"sender made it in another directory ({exc.filename} is not there: "
                "GROUPCOORD_SHM_DIR must be the same on every rank of a host)"
            ) from exc
        # This rank is the ring's only reader: once mapped, its name has done its job.
        if handle.buffer_name is not None:
            unlink_segment(handle.buffer_name)
        try:
            self._keep(self._readers, src, mq)
        except BaseException:
            mq.shutdown()
            raise
        return mq

    def _get(
        self,
        mq: MessageQueue,
        src: int,
        operation: str,
        limit: Limit | None,
        into: memoryview | None = None,
    ) -> Any:
        timeout_s = self.timeout_s if limit is None else limit.timeout_s
        check = self.stall_check
        try:
            return mq.dequeue(
                timeout=timeout_s if limit is None else limit.left(),
                into=into,
                stall_check=None
                if check is None
                else lambda peers, ready: check(operation, peers, False, ready),
            )
        except (GroupcoordTimeoutError, PeerDiedError) as exc:
            waiting_for = "nothing arrived on the shared-memory channel"
            raise self._named(exc, src, operation, timeout_s, "receiver", waiting_for) from exc

    def recv_message(self, src: int, operation: str) -> Any:
        """The object :meth:`send_message` sent."""
        return self._get(self._readers[src], src, operation, None)

    def recv_tensor(
        self,
        src: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        operation: str,
        limit: Limit | None = None,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tensor ``src`` sent with :meth:`send_tensor`, shaped ``shape``; a tensor
        of another dtype or size, or anything else, is a ``DesyncError`` naming both
        sides (the message is consumed: the channel stays in step). ``into`` (dense,
        ``shape`` and ``dtype``): the bytes land there when the sizes match (the
        tensor returned is then built on its memory; after a ``DesyncError`` it holds
        whatever came)."""
        sink = None
        if into is not None and into.numel():
            raw = (ctypes.c_ubyte * into.nbytes).from_address(into.data_ptr())
            sink = memoryview(raw).cast("B")  # ctypes says "<B", which slicing refuses
        got = self._get(self._readers[src], src, operation, limit, sink)
        numel = 1
        for s in shape:
            numel *= s
        if not isinstance(got, torch.Tensor) or got.dtype != dtype or got.numel() != numel:
            if isinstance(got, torch.Tensor):
                sent = f"a {_short(got.dtype)}[{got.numel()}] tensor"
            elif type(got) is list and got[:1] == [TENSOR_OBJECT]:
                sent = "a tensor as an object (send_object)"
            else:
                sent = f"a {type(got).__name__}, not a tensor"
            error = DesyncError(
                f"{self.name}: rank {self.rank} called {operation}({_short(dtype)}[{numel}]) "
                f"from rank {src}, which sent {sent}: the ranks' point-to-point calls "
                "are out of step"
            )
            error.received = got
            error.taken = True
            raise error
        # A reshape costs 2 us even when it changes nothing: only when it must.
        return got if got.shape == shape else got.reshape(shape)

    # ---- both ---------------------------------------------------------------

    def close(self, linger: bool = True) -> None:
        """Shut every channel down once each receiver has read what this rank sent
        it (or shut its end, or died; at most ``P2P_LINGER_S``); idempotent. Without
        ``linger`` (an abort) at once: a call waiting on another thread raises
        ``ClosedError``."""
        self._closed = True
        if linger:
            self._linger()
        _senders.discard(self)
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
