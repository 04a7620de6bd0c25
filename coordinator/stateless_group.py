"""A process group outside torch's global state, over a TCPStore.

``StatelessProcessGroup`` connects processes that must talk without joining
torch.distributed's default group (an engine and its workers, or two
engines). Objects travel as msgspec msgpack through ``shm_broadcast.codec``
(never pickle); every wait has a deadline and a timeout names the ranks that
did not arrive. Each rank deletes the keys it wrote once they are older than
``data_expiration_seconds`` (vLLM's scheme), and readers never delete; the
store host (rank 0) returns from a collective only once every rank confirmed
its result, so it may exit at once without cutting off a peer.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from device_communicators import checks
from shm_broadcast.codec import dumps, loads
from shm_broadcast.config import resolve_timeout
from shm_broadcast.forked import owned_here

from .errors import (
    ClosedError,
    DesyncError,
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
    PeerDiedError,
)


class StatelessProcessGroup:
    """``rank`` and ``world_size`` plus object send/recv, broadcast, all-gather, barrier.

    Satisfies the group protocol of ``shm_broadcast.group_io`` (rank,
    world_size, broadcast_obj, all_gather_obj), so a ``MessageQueue`` can be
    built over it.
    """

    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store: dist.Store | None = store
        self.timeout_s = timeout_s
        # Per-peer sequence numbers: both ends count the same calls, so the
        # n-th send from a to b meets the n-th recv on b from a.
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)
        self._bcast_seq: dict[int, int] = defaultdict(int)
        self._gather_seq = 0
        # vLLM's field names for the same counters.
        self.send_dst_counter = self._send_seq
        self.recv_src_counter = self._recv_seq
        self.broadcast_recv_src_counter = self._bcast_seq
        # This rank's own keys (key, time written), deleted by expire_data.
        self.data_expiration_seconds = 3600
        self.entries: collections.deque[tuple[str, float]] = collections.deque()
        # A forked child's sends would take the rank's sequence numbers (shm_broadcast.forked).
        owned_here(self, f"StatelessProcessGroup rank {rank}", ("rank", "world_size", "timeout_s"))

    @property
    def broadcast_send_counter(self) -> int:
        return self._bcast_seq[self.rank]

    @staticmethod
    def create(
        host: str,
        port: int,
        rank: int,
        world_size: int,
        data_expiration_seconds: int = 3600,
        store_timeout: int = 300,
        listen_socket: socket.socket | None = None,
        *,
        timeout: float | datetime.timedelta | None = None,
    ) -> StatelessProcessGroup:
        """Join (rank 0: host) the store at ``host:port`` and wait until every rank is there.

        vLLM's signature: ``store_timeout`` (seconds) bounds the store's own
        operations; ``listen_socket`` lets rank 0 serve on a socket it already
        bound (so no other process can take the port in between). ``timeout``
        (ours) bounds this group's waits (default: the configured deadline).
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise GroupcoordValueError(f"world_size must be a positive int, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise GroupcoordValueError(f"rank={rank!r} is not in range(world_size={world_size})")
        timeout_s = resolve_timeout(timeout)
        what = f"StatelessProcessGroup({host}:{port}, rank {rank})"
        store_kwargs: dict[str, Any] = {}
        if listen_socket is not None:
            if rank != 0:
                raise GroupcoordValueError("listen_socket: only rank 0 (the store host) serves")
            store_kwargs = {"master_listen_fd": listen_socket.detach(), "use_libuv": False}
        try:
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=rank == 0,
                timeout=datetime.timedelta(seconds=min(timeout_s, resolve_timeout(store_timeout))),
                wait_for_workers=False,
                **store_kwargs,
            )
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            # An absent store host shows up as a network error (connect timed
            # out), a present but silent one as a store error: both mean rank 0.
            raise GroupcoordTimeoutError(what, "connect", timeout_s, [0], detail=str(exc)) from exc
        group = StatelessProcessGroup(rank, world_size, store, timeout_s)
        group.data_expiration_seconds = data_expiration_seconds
        group.barrier(timeout_s)
        return group

    # ---- point to point -------------------------------------------------------

    def send_obj(self, obj: Any, dst: int) -> None:
        """Post ``obj`` for rank ``dst``; returns without waiting for it to be read."""
        self._check_peer(dst, "dst")
        payload = dumps(obj)
        key = f"p2p/{self.rank}/{dst}/{self._send_seq[dst]}"
        self._post(key, payload, "send_obj")
        self._send_seq[dst] += 1

    def recv_obj(self, src: int, *, timeout: float | None = None) -> Any:
        """The next object rank ``src`` sent to this rank."""
        self._check_peer(src, "src")
        key = f"p2p/{src}/{self.rank}/{self._recv_seq[src]}"
        self._wait([key], "recv_obj", timeout, missing=lambda: [src])
        with self._store_call("recv_obj") as store:
            obj = loads(store.get(key))
        self._recv_seq[src] += 1
        return obj

    # ---- collectives ----------------------------------------------------------

    def broadcast_obj(self, obj: Any | None, src: int, *, timeout: float | None = None) -> Any:
        """``src``'s ``obj`` on every rank (``obj`` is ignored on the others)."""
        self._check_rank(src, "src")
        if self.world_size == 1:
            return obj
        key = f"bcast/{src}/{self._bcast_seq[src]}"
        timeout = self.timeout_s if timeout is None else resolve_timeout(timeout)
        if self.rank == src:
            self._post(key, dumps(obj), "broadcast_obj")
        if self.rank != src:
            self._wait([key], "broadcast_obj", timeout, missing=lambda: [src])
            with self._store_call("broadcast_obj") as store:
                obj = loads(store.get(key))
        self._bcast_seq[src] += 1
        self._confirm(key, "broadcast_obj", timeout)
        return obj

    def all_gather_obj(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        return self._gather("all_gather_obj", "all_gather_obj()", obj, timeout)

    def barrier(self, timeout: float | datetime.timedelta = 30.0) -> None:
        """Return once every rank has called ``barrier`` (vLLM's 30 s default);
        a timeout names the absent ranks."""
        self._gather("barrier", "barrier()", None, resolve_timeout(timeout))

    # ---- tensors (through the store, as objects: for small control tensors) -----------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.send_obj(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Fill ``tensor`` with what ``src`` sent (shape and dtype must match)."""
        return _fill(tensor, self.recv_obj(src), f"recv from rank {src}")

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``src``'s ``tensor`` copied into ``tensor`` on every rank; returns it."""
        got = self.broadcast_obj(tensor if self.rank == src else None, src)
        return tensor if self.rank == src else _fill(tensor, got, f"broadcast from rank {src}")

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """Every rank's ``tensor`` reduced (SUM, PRODUCT, MAX, MIN) in rank order; new
        tensor. Ranks whose dtypes, shapes or ops differ raise ``DesyncError``."""
        if not isinstance(tensor, torch.Tensor):
            raise GroupcoordTypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if op not in _REDUCERS:
            raise GroupcoordValueError(f"op: expected SUM, PRODUCT, MAX or MIN, got {op!r}")
        name, reduce = _REDUCERS[op]
        call = f"all_reduce({str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}, {name})"
        parts = self._gather("all_reduce", call, tensor, None)
        out = parts[0].clone()
        for part in parts[1:]:
            out = reduce(out, part)
        return out

    def close(self, timeout: float | None = None) -> None:
        """Leave the group (collective): rank 0 keeps the store up until every rank has left."""
        if self.store is None:
            return
        store = self.store
        if self.world_size > 1:
            if self.rank == 0:
                timeout_s = resolve_timeout(timeout)
                deadline = time.monotonic() + timeout_s
                # Ranks leave by appending their rank to one key (so a timeout can
                # name who has not left); the store must outlive their last call.
                while len(left := self._ranks_left(store)) < self.world_size - 1:
                    if time.monotonic() > deadline:
                        missing = [r for r in range(1, self.world_size) if r not in left]
                        raise GroupcoordTimeoutError(
                            self._what(), "close", timeout_s, missing, role="store host"
                        )
                    time.sleep(0.001)
                store.delete_key("close/left")
            else:
                # append is in every TCPStore since torch 2.3; the stub lacks it.
                store.append("close/left", f"{self.rank},".encode())  # type: ignore[attr-defined]
        self.store = None

    # ---- helpers --------------------------------------------------------------

    @staticmethod
    def _ranks_left(store: dist.Store) -> set[int]:
        if not store.check(["close/left"]):
            return set()
        return {int(r) for r in store.get("close/left").decode().split(",") if r}

    def _gather(self, operation: str, call: str, obj: Any, timeout: float | None) -> list[Any]:
        """Every rank's ``obj``, in rank order. Each rank posts its ``call`` (what it
        was asked, e.g. ``all_reduce(float32[4], SUM)``) with its object, and every
        rank checks every rank's: ranks whose calls differ (a barrier against an
        all-gather, an all-reduce of other shapes or ops) all raise ``DesyncError``
        naming both, after the call, so they stay in step (a bare gather of
        objects answered them with each other's values, or a sum of other shapes)."""
        # A bad timeout is refused before anything is posted (a posted value would
        # meet the peers' next call).
        timeout = self.timeout_s if timeout is None else resolve_timeout(timeout)
        store = self._live_store()
        payload = dumps((call, obj))
        # The sequence number advances only on success: a call that timed out
        # can be retried and meets the late ranks' first attempt.
        seq = self._gather_seq
        keys = [f"gather/{seq}/{r}" for r in range(self.world_size)]
        self._post(keys[self.rank], payload, operation)
        self._wait(
            keys,
            operation,
            timeout,
            missing=lambda: [r for r, k in enumerate(keys) if not store.check([k])],
        )
        self._gather_seq += 1
        with self._store_call(operation):
            values = store.multi_get(keys)
        self._confirm(f"gather/{seq}", operation, timeout)
        records = [loads(v) for v in values]
        for r, (theirs, _) in enumerate(records):
            if theirs != call:
                raise DesyncError(
                    f"{self._what()}: rank {self.rank} called {call} as collective #{seq}, "
                    f"rank {r} called {theirs}: the ranks' calls are out of step (no result "
                    "returned)"
                )
        return [got for _, got in records]

    def _confirm(self, key: str, operation: str, timeout: float | None) -> None:
        """Every other rank reports that it has its result; the store host (rank 0)
        returns only once all have, so it may exit at once without cutting off a
        peer that still waits on its store."""
        ack = f"{key}/ack"
        with self._store_call(operation) as store:
            if self.rank != 0:
                store.add(ack, 1)
                return
            timeout_s = self.timeout_s if timeout is None else resolve_timeout(timeout)
            deadline = time.monotonic() + timeout_s
            while (done := store.add(ack, 0)) < self.world_size - 1:
                if time.monotonic() > deadline:
                    raise GroupcoordTimeoutError(
                        self._what(),
                        operation,
                        timeout_s,
                        [],
                        role="store host",
                        detail=f"{done} of {self.world_size - 1} ranks confirmed their result",
                    )
                time.sleep(0.0002)
            store.delete_key(ack)

    # ---- keys: each rank writes and expires its own; readers only read ---------------
    #
    # A rank's last store call in an operation is the read of its result, so a
    # store host (rank 0) that returns and exits first breaks nobody who already
    # has the data; its keys go away with it, the others' through expire_data.

    def _post(self, key: str, payload: bytes, operation: str) -> None:
        with self._store_call(operation) as store:
            self.expire_data()
            _set(store, key, payload)
        self.entries.append((key, time.monotonic()))

    def expire_data(self) -> None:
        """Delete this rank's own keys older than ``data_expiration_seconds``."""
        store = self._live_store()
        now = time.monotonic()
        while self.entries and now - self.entries[0][1] > self.data_expiration_seconds:
            key, _ = self.entries.popleft()
            store.delete_key(key)

    @contextlib.contextmanager
    def _store_call(self, operation: str) -> Iterator[dist.Store]:
        """The store, with a lost connection to its host reported as PeerDiedError."""
        store = self._live_store()
        try:
            yield store
        except dist.DistNetworkError as exc:
            raise PeerDiedError(
                self._what(),
                operation,
                [0],
                f"lost the TCPStore hosted by rank 0 ({exc})",
            ) from exc

    def _wait(self, keys: list[str], operation: str, timeout: float | None, missing: Any) -> None:
        timeout_s = self.timeout_s if timeout is None else resolve_timeout(timeout)
        with self._store_call(operation) as store:
            try:
                store.wait(keys, datetime.timedelta(seconds=timeout_s))
            except dist.DistNetworkError:
                raise
            except dist.DistStoreError as exc:
                raise GroupcoordTimeoutError(self._what(), operation, timeout_s, missing()) from exc

    def _live_store(self) -> dist.Store:
        if self.store is None:
            raise ClosedError(f"{self._what()} is closed")
        return self.store

    def _what(self) -> str:
        return f"StatelessProcessGroup(rank {self.rank} of {self.world_size})"

    def _check_rank(self, value: int, name: str) -> None:
        checks.rank(value, name, self.world_size)

    def _check_peer(self, value: int, name: str) -> None:
        checks.rank(value, name, self.world_size, self.rank)


# all_reduce's ops: their names (in the call each rank posts) and how they combine.
_REDUCERS: dict[Any, tuple[str, Any]] = {
    dist.ReduceOp.SUM: ("SUM", torch.add),
    dist.ReduceOp.PRODUCT: ("PRODUCT", torch.mul),
    dist.ReduceOp.MAX: ("MAX", torch.maximum),
    dist.ReduceOp.MIN: ("MIN", torch.minimum),
}


def _set(store: dist.Store, key: str, value: bytes) -> None:
    # torch's stub types the value as str; the binding takes bytes as they are.
    store.set(key, value)  # type: ignore[arg-type]


def _fill(tensor: torch.Tensor, got: Any, what: str) -> torch.Tensor:
    if not isinstance(got, torch.Tensor) or got.shape != tensor.shape or got.dtype != tensor.dtype:
        raise GroupcoordValueError(
            f"{what}: expected a {tensor.dtype}{list(tensor.shape)} tensor, got "
            f"{getattr(got, 'dtype', type(got).__name__)}{list(getattr(got, 'shape', []))}"
        )
    return tensor.copy_(got)
