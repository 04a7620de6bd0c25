"""What every operation of a ``GroupCoordinator`` stands on: the group's members
and process groups, its communicators and message queue, set-up and
``destroy``, and the two wrappers every call goes through (``_collective``,
``_p2p``), which turn a transport failure into an error naming the group, the
operation and the ranks that did not arrive or died."""

from __future__ import annotations

import datetime
import functools
import importlib
import logging
import os
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from device_communicators import checks
from device_communicators.base_device_communicator import DeviceCommunicatorBase
from device_communicators.shm_phases import QUEUE_CALLS, Traffic, closing_reason, groups_alive
from device_communicators.shm_reduce import settle_torch_pool
from device_communicators.shm_small import SmallCalls
from shm_broadcast.config import (
    ALL2ALL_SETTINGS,
    CUDA_SETTINGS,
    GROUP_SETTINGS,
    describe_settings,
    get_config,
    resolve_timeout,
)
from shm_broadcast.errors import ShmSpaceError
from shm_broadcast.forked import owned_here
from shm_broadcast.liveness import dead_peers, host_key
from shm_broadcast.p2p_channels import P2PChannels
from shm_broadcast.waiting import StallCheck

from . import custom_ops
from .errors import (
    ClosedError,
    DesyncError,
    GroupcoordError,
    GroupcoordTimeoutError,
    GroupcoordValueError,
    NotSupportedError,
    PeerDiedError,
)
from .failures import PartWay, absent_ranks, classify, ends_part_way
from .meeting import meet

logger = logging.getLogger("groupcoord.coordinator")

# Device kind -> (module, class) of its communicator, imported on first use
# so CUDA code is only loaded where a CUDA group exists.
_COMMUNICATORS: dict[str, tuple[str, str]] = {
    "cpu": ("device_communicators.cpu_communicator", "CpuCommunicator"),
    "cuda": ("device_communicators.cuda_communicator", "CudaCommunicator"),
}

_name_counters: dict[str, int] = defaultdict(int)
# Held while a thread of this process builds c10d groups (``building``). c10d
# names a group by its place in the order its groups are built, so two threads
# building at once would give one group different names on different ranks: its
# connections cross (a sum with another group's rank) or hang past the timeout.
# An RLock for its owner check only (a build never takes it twice: see building).
_BUILDING = threading.RLock()
_builder = [""]  # what the thread holding _BUILDING builds ("" outside building's try)
# What a forked child may still read of its parent's group (shm_broadcast.forked).
_DESCRIPTIVE = (
    "unique_name", "rank", "ranks", "world_size", "rank_in_group", "local_rank", "device",
    "first_rank", "last_rank", "is_first_rank", "is_last_rank", "next_rank", "prev_rank",
)  # fmt: skip


@contextmanager
def building(what: str) -> Iterator[NotSupportedError | None]:
    """Around building c10d groups (``what``): holds ``_BUILDING`` and yields None,
    or yields the error to raise when another thread of this process holds it (at
    once, without waiting). An exception a signal handler raises can land just
    after the lock was taken, before the ``try`` below: the lock is then this
    thread's with no build of it under way (``_builder`` empty), and this thread's
    next build takes it back (every later build raised this error before)."""
    if _BUILDING._is_owned() and not _builder[0]:  # type: ignore[attr-defined]
        _BUILDING.release()
    if _BUILDING._is_owned() or not _BUILDING.acquire(blocking=False):  # type: ignore[attr-defined]
        yield NotSupportedError(
            "building groups from two threads at once",
            "groupcoord",
            f"{what}: another thread of this process is building {_builder[0]} now; "
            "c10d names a group by the order groups are built in, so build them one at "
            "a time, in the same order on every rank",
        )
        return
    try:
        _builder[0] = what
        yield None
    finally:
        _builder[0] = ""  # (no Python call before the release)
        _BUILDING.release()


def _weak_closer(group: GroupBase) -> Callable[[str], None]:
    """What the group's shared-memory path runs when this rank leaves it (a
    timeout, a dead peer, a call ended part-way): the group closes too, its
    lean calls (``shm_small``) having gone around ``_collective``. It holds the
    group weakly (the communicator holds the hook)."""
    owner = weakref.ref(group)

    def close(reason: str) -> None:
        alive = owner()
        if alive is not None:
            alive._close_here(f"its shared-memory path closed ({reason})")

    return close


def desync_cleanup(mq: Any, group: GroupBase) -> Callable[[str | None], str]:
    """What ``group`` runs on every rank when its ranks' calls are found out of step
    (before the ``DesyncError``), given why the ranks can no longer be brought back
    in step (None: the group stays usable): then the group closes on this rank (its
    later calls raise ``ClosedError`` naming why). A queue broadcast that a reader's
    rank made another call instead of reading (``broadcast_tensor_dict``,
    ``broadcast_object`` from rank 0) is dropped, or that rank's next read would
    return it as the next broadcast's. It holds the queue and a weak reference to
    the group (no cycle through the communicator). Returns the note the error ends
    with."""
    owner = weakref.ref(group)

    def drop(closing: str | None) -> str:
        dropped = mq.drop_unread() if mq is not None else 0  # before the queue shuts
        closed = owner() if closing is not None else None
        if closed is not None and closing is not None:
            closed._close_here(closing)
        if not dropped:
            return ""
        return (
            f"; {dropped} message-queue broadcast(s) from rank 0 that this rank had not "
            "read were dropped"
        )

    return drop


def _unique_name(name: str) -> str:
    """ "tp" -> "tp:0", then "tp:1" ...: the key of the group's custom ops."""
    unique = f"{name}:{_name_counters[name]}"
    _name_counters[name] += 1
    return unique


def get_device_communicator_cls(device: torch.device) -> type[DeviceCommunicatorBase]:
    """The communicator class for groups whose tensors live on ``device``."""
    entry = _COMMUNICATORS.get(device.type)
    if entry is None:
        raise GroupcoordValueError(
            f"device={device}: no communicator for device kind {device.type!r} "
            f"(known: {', '.join(sorted(_COMMUNICATORS))})"
        )
    cls: type[DeviceCommunicatorBase] = getattr(importlib.import_module(entry[0]), entry[1])
    return cls


class GroupBase:
    """A group's members, process groups and helpers (``GroupCoordinator`` is one)."""

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        torch_distributed_backend: str | dist.Backend,
        use_device_communicator: bool,
        use_message_queue_broadcaster: bool = False,
        group_name: str | None = None,
        use_all2all: bool = False,
        *,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise GroupcoordValueError(
                "torch.distributed is not initialised: call init_distributed_environment first"
            )
        settle_torch_pool()
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.timeout_s = resolve_timeout(timeout)
        my_ranks = _check_group_ranks(group_ranks, self.rank, dist.get_world_size())
        self.unique_name = _unique_name(group_name or "anonymous")
        backend = str(torch_distributed_backend)
        deadline = datetime.timedelta(seconds=self.timeout_s)
        device_group: ProcessGroup | None = None
        cpu_group: ProcessGroup | None = None
        # What the ranks must agree on besides the layout: a rank with another
        # communicator or queue would meet its peers at other set-up steps.
        settings = GROUP_SETTINGS + (ALL2ALL_SETTINGS if use_all2all else ())
        if backend != "gloo":
            settings += CUDA_SETTINGS
        options = (
            f"use_device_communicator={bool(use_device_communicator)}, "
            f"use_message_queue_broadcaster={bool(use_message_queue_broadcaster)}, "
            f"use_all2all={bool(use_all2all)}; {describe_settings(settings)}"
        )
        with building(f"group {self.unique_name}") as refused:
            self._meet(group_ranks, backend, options, refused)
            # Every rank creates every group, in the same order: c10d requires it.
            for ranks in group_ranks:
                dev = dist.new_group(list(ranks), backend=backend, timeout=deadline)
                # On Gloo one group serves both roles; a second would only add sockets.
                cpu = (
                    dev
                    if backend == "gloo"
                    else dist.new_group(list(ranks), backend="gloo", timeout=deadline)
                )
                if list(ranks) == my_ranks:
                    device_group, cpu_group = dev, cpu
        assert device_group is not None and cpu_group is not None
        self.ranks: list[int] = list(my_ranks)
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)
        self.cpu_group: ProcessGroup = cpu_group
        self.device_group: ProcessGroup = device_group
        self.device = (
            torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
        )
        self.use_device_communicator = use_device_communicator
        self._collective_seq = 0
        self._desync_seq = 0  # calls checked by debug_desync
        self.node_count = 1  # hosts among the group's ranks (set by _exchange_pids)
        # Host identity (liveness.host_key) of each in-group rank (set by _exchange_pids).
        self.host_keys: list[int] = []
        self._destroyed = False
        # Why this rank's calls are out of step with its peers' (see _ended_with).
        self._failure: str | None = None
        self._failed_by: BaseException | None = None
        self._plain_comm: DeviceCommunicatorBase | None = None
        # Calls from several threads of this rank take turns, each whole: a call of
        # several steps (a length, then its bytes) must not have another thread's
        # call come between its steps, or the ranks pair steps of different calls
        # (Gloo aborts the process on a size it did not expect). The device
        # communicator's lock once it is built, so its lean path takes turns too.
        self._call_lock: Any = threading.RLock()
        self.device_communicator: DeviceCommunicatorBase | None = None
        # The device communicator's lean path for small calls (shm_small.SmallCalls).
        self._small: SmallCalls | None = None
        self.mq_broadcaster: Any = None
        # Queue broadcasts and point-to-point messages of this rank, which the
        # collectives check (shm_phases.Traffic; the shared-memory path's stamps
        # carry it, and so does the Gloo path's debug_desync check).
        self._traffic = Traffic()
        # The queue calls' stall checks (ShmBase.check_queue_wait), by operation.
        self._queue_checks: dict[str, StallCheck] = {}
        # Peers on this host, rank -> pid: a failed call names a dead one at once.
        self._local_pids: dict[int, int] = {}
        self._p2p_channels = P2PChannels(self.unique_name, self.rank, {}, self.timeout_s)
        try:
            self._local_pids = self._exchange_pids()
            if not get_config().disable_shm_p2p:
                # Tensor dicts to and from peers on this node go through shared memory.
                self._p2p_channels.peers = dict(self._local_pids)
            self._build_helpers(use_device_communicator, use_message_queue_broadcaster, use_all2all)
        except BaseException:
            # Leave nothing half-built behind (process groups, shared memory).
            self.destroy()
            raise
        custom_ops.register_group(self.unique_name, self)
        groups_alive(custom_ops.live_groups())  # (the stamps say so: see groups_alive)
        owned_here(self, f"group {self.unique_name}", _DESCRIPTIVE)

    def _meet(
        self,
        group_ranks: list[list[int]],
        backend: str,
        options: str,
        refused: NotSupportedError | None,
    ) -> None:
        """Meet every rank of the layout through the store before c10d's connect
        (which waits out the timeout for a dead member), each saying how it builds
        the groups: the layout, the backend, ``options`` and the names c10d will
        give them. c10d names each ``new_group`` by its place in the sequence, so
        ranks whose ``group_ranks`` (or backend) differ would be joined into groups
        they do not think they are in (two groups that each agree within, built
        from different layouts, share a name and cross their connections: a wrong
        sum, or a connect that hangs past the timeout), or wait out the timeout;
        ranks whose options differ would meet at other set-up steps. Here every
        rank that finds another's post different raises ``DesyncError`` naming
        both, so every rank raises and none connects. A rank ``refused`` the
        building (another of its threads builds groups) meets the others with that
        reason, so they raise at once too, and raises ``refused``."""
        everyone = sorted({r for ranks in group_ranks for r in ranks})
        if len(everyone) == 1:
            return
        # The name c10d gives the first of these groups: the same on every rank
        # unless the ranks built other groups before, or in another order.
        first = dist.distributed_c10d._world.group_count
        last = first + len(group_ranks) * (1 if backend == "gloo" else 2) - 1
        layout = [list(ranks) for ranks in group_ranks]
        mine = f"{layout} on {backend} with {options} (c10d's groups #{first}-#{last})"
        if refused is not None:
            mine = f"nothing ({refused})"
        store = dist.distributed_c10d._get_default_store()
        key = f"groupcoord/meet/{self.unique_name}"
        count = store.add(f"{key}/count/{self.rank}", 1)  # the same on every rank
        differ = meet(
            store,
            f"{key}/{count}",
            self.rank,
            everyone,
            self.unique_name,
            self.timeout_s,
            post=mine,
        )
        if refused is not None:
            raise refused
        if differ:
            r, theirs = min(differ.items())
            raise DesyncError(
                f"{self.unique_name}: rank {self.rank} builds the groups from "
                f"group_ranks={mine}, rank {r} from {theirs}: every rank must pass the "
                "same group_ranks, backend and options, set the same GROUPCOORD_* settings "
                "named here, and build its groups in the same order"
            )

    def _exchange_pids(self) -> dict[int, int]:
        if self.world_size == 1:
            self.host_keys = [host_key()]
            return {}
        mine = torch.tensor([os.getpid(), host_key()], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(everyone, mine, group=self.cpu_group)
        here = int(mine[1])
        self.host_keys = [int(t[1]) for t in everyone]
        self.node_count = len(set(self.host_keys))
        return {
            r: int(t[0])
            for r, t in zip(self.ranks, everyone)
            if r != self.rank and int(t[1]) == here
        }

    def _build_helpers(self, use_comm: bool, use_mq: bool, use_all2all: bool) -> None:
        if use_comm and self.world_size > 1:
            cls = get_device_communicator_cls(self.device)
            self.device_communicator = cls(
                cpu_group=self.cpu_group,
                device=self.device,
                device_group=self.device_group,
                unique_name=self.unique_name,
                use_all2all=use_all2all,
                timeout_s=self.timeout_s,
            )
        if self.device_communicator is not None:
            self._call_lock = self.device_communicator.call_lock
            self._small = self.device_communicator.small_calls
            channels = self.device_communicator.p2p_channels
            if channels is not None:
                # One channel per pair for the group: its tensor dicts, objects and
                # tensors (send/recv, through the communicator) keep one order and
                # one ring.
                self._p2p_channels.close()
                self._p2p_channels = channels
        if use_mq and self.world_size > 1:
            try:
                self.mq_broadcaster = self.create_mq_broadcaster()
            except ShmSpaceError as exc:
                # A small /dev/shm (a container's 64 MiB): every rank raised this, so
                # every rank goes on without the queue, and broadcasts of objects and
                # tensor dicts take the group's collectives (shared-memory slots if
                # they fit, else Gloo).
                logger.warning(
                    "%s: %s; objects and tensor dicts are broadcast without a message "
                    "queue (give /dev/shm more room, e.g. docker --shm-size=1g)",
                    self.unique_name,
                    exc,
                )
        shm = getattr(self.device_communicator, "shm_all_reduce", None)
        if shm is None:
            return
        # The shared-memory path's stamps carry the group's one-way traffic, and a
        # mismatch it finds cleans up the group on every rank (desync_cleanup).
        shm.set_desync_hook(desync_cleanup(self.mq_broadcaster, self))
        shm.set_on_leave(_weak_closer(self))
        shm.set_traffic(self._traffic)
        if self.mq_broadcaster is not None:
            writing = self.rank_in_group == 0
            self._queue_checks = {
                op: functools.partial(shm.check_queue_wait, op, writing)
                for op in QUEUE_CALLS
                if op.startswith("broadcast")  # what goes through the group's queue
            }

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.unique_name}, ranks={self.ranks}, rank={self.rank})"

    # ---- message queues -----------------------------------------------------------

    def create_mq_broadcaster(
        self, writer_rank: int = 0, external_writer_handle: Any = None, blocking: bool = True
    ) -> Any:
        """A message queue from in-group rank ``writer_rank`` to the rest of the group,
        with the configured ring, or a small one where /dev/shm has no room for it."""
        from shm_broadcast import mq_groups
        from shm_broadcast.message_queue import MessageQueue

        cfg = get_config()
        return mq_groups.create_from_process_group(
            MessageQueue,
            self.cpu_group,
            cfg.mq_max_chunk_bytes,
            cfg.mq_max_chunks,
            writer_rank=writer_rank,
            external_writer_handle=external_writer_handle,
            blocking=blocking,
            small_ring_fallback=True,
        )

    def create_single_reader_mq_broadcasters(
        self, reader_rank_in_group: int = 0, blocking: bool = False
    ) -> Any:
        """Queues from every rank to in-group rank ``reader_rank_in_group``."""
        from shm_broadcast.message_queue import MessageQueue

        self._check_index(reader_rank_in_group, "reader_rank_in_group")
        cfg = get_config()
        return MessageQueue.create_from_process_group_single_reader(
            self.cpu_group,
            cfg.mq_max_chunk_bytes,
            cfg.mq_max_chunks,
            reader_rank=reader_rank_in_group,
            blocking=blocking,
        )

    # ---- ranks --------------------------------------------------------------------

    @property
    def first_rank(self) -> int:
        """Global rank of the group's first process."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the group's last process."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """Global rank of the next process in the group (wrapping)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous process in the group (wrapping)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def destroy(self) -> None:
        """Release the queue, communicators and process groups (idempotent)."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._call_lock.acquire(blocking=False):
            self._call_lock.release()
        elif self.device_communicator is not None:
            # Another thread is inside a call (waiting for a peer, say): end it now
            # rather than wait out its timeout to close what it uses.
            self.device_communicator.abandon("ended: the group was destroyed by another thread")
        custom_ops.unregister_group(self.unique_name)
        groups_alive(custom_ops.live_groups())
        self._p2p_channels.close()
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.shutdown()
            self.mq_broadcaster = None
        for comm in (self.device_communicator, self._plain_comm):
            if comm is not None:
                comm.destroy()
        self.device_communicator = None
        self._small = None
        self._plain_comm = None
        if dist.is_initialized():
            if self.device_group is not self.cpu_group:
                dist.destroy_process_group(self.device_group)
            dist.destroy_process_group(self.cpu_group)

    # ---- helpers ----------------------------------------------------------------------

    def _tensor_comm(self) -> DeviceCommunicatorBase:
        if self.device_communicator is not None:
            return self.device_communicator
        if self._destroyed:
            raise ClosedError(f"{self.unique_name} was destroyed")
        if self._plain_comm is None:
            with self._call_lock:  # built once, by the first call's thread
                if self._plain_comm is None:
                    # Groups built without a device communicator still move tensors:
                    # torch.distributed calls, and send/recv of CPU tensors through
                    # the channels that carry the group's objects. Built from what the
                    # group knows, with no collective call: the first call may be one
                    # rank's send (a world group's ranks 0 and 1, the others elsewhere).
                    self._plain_comm = DeviceCommunicatorBase(
                        self.cpu_group,
                        self.device,
                        self.device_group,
                        self.unique_name,
                        timeout_s=self.timeout_s,
                        peer_pids=self._local_pids,
                        p2p_channels=self._p2p_channels,
                    )
        return self._plain_comm

    def _check_index(self, index: int, name: str) -> None:
        checks.rank(index, name, self.world_size, what=f"group {self.unique_name}")

    def _check_peer(self, index: int, name: str) -> None:
        checks.rank(index, name, self.world_size, self.rank_in_group, f"group {self.unique_name}")

    def _ended_with(self, operation: str, exc: BaseException) -> None:
        """``exc`` ended ``operation`` on this rank. Two kinds leave this rank's calls
        out of step with its peers' for good, and its later calls over the group
        raise ``ClosedError`` naming why:

        - a timeout or a dead peer (``GroupcoordTimeoutError``, ``PeerDiedError``):
          the peers may have gone on to calls this rank never met, with a message
          sent for one of them still in its channel (until 2026-11-29 this rank's
          next receive took it for its own: a wrong value, silently), and Gloo
          closes a pair whose call timed out;
        - anything that is not an ``Exception`` (a signal handler's
          ``KeyboardInterrupt`` or ``SystemExit``, raised between two steps of a
          protocol, say a length and its bytes): its next call would take a step
          the peers sent for this one (Gloo aborts the process on a size it did
          not expect)."""
        if isinstance(exc, (GroupcoordTimeoutError, PeerDiedError)):
            late = "timed out" if isinstance(exc, GroupcoordTimeoutError) else "lost a peer"
            self._close_here(
                f"its {operation} {late}, so its ranks may disagree on what comes next"
            )
        elif ends_part_way(exc, self._failed_by):
            self._failed_by = exc  # named over an earlier reason: the enclosing call is
            self._close_here(
                f"its {operation} ended part-way on this rank with {type(exc).__name__}, "
                "out of step with its peers",
                replace=True,
            )

    def _close_here(self, reason: str, replace: bool = False) -> None:
        """Later calls over the group on this rank raise ``ClosedError`` naming
        ``reason`` (the first one given, unless ``replace``); build a new group to
        go on. This rank's end of the group's message queue shuts down, so a peer
        waiting on it (a reader for the next broadcast, the writer for room) ends
        at once with ``ClosedError`` instead of waiting while this process lives."""
        if self._failure is None or replace:
            self._failure = reason
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.shutdown()

    def _whole(self, operation: str, lock: bool = True) -> PartWay:
        """Around a call of several steps, or one that goes outside ``_collective`` and
        ``_p2p`` (the message queue's broadcasts): refused once the group is out of
        step, and closed when it ends in a way that leaves the ranks out of step
        (``_ended_with``).
        With ``lock`` it holds the call lock throughout; a call whose steps all go
        through one channel that keeps its own turns does not: a point-to-point
        pair's (a rank's send and receive may overlap), or one message of the queue
        (whose read may wait as long as the writer lives)."""
        if self._failure is not None:
            self._check_usable()
        return PartWay(self._ended_with, operation, self._call_lock if lock else None)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ClosedError(
                f"{self.unique_name} is unusable after an earlier failure: {self._failure}"
            )

    def _collective(self, operation: str, fn: Any, *args: Any) -> Any:
        """Run one collective; a transport failure says which ranks did not arrive."""
        if self._failure is not None:
            self._check_usable()
        try:
            with self._call_lock:
                out = fn(*args)
        except BaseException as exc:
            error = self._failure_of(operation, exc)
            self._ended_with(operation, error)
            if isinstance(error, DesyncError) and self._failure is None:
                error = self._closed_by(error)
            if error is exc:
                raise
            raise error from exc
        self._collective_seq += 1
        return out

    def _closed_by(self, error: DesyncError) -> DesyncError:
        """A collective's own check found the ranks' calls or counts differ (every rank
        raises alike: they compare one gathered table), where its path closed nothing:
        a Gloo part-length exchange, an EP manager's ``debug_desync`` check. The group
        closes on this rank, as the shared-memory path's checks close it (row 95 of
        docs/RELIABILITY.md): a rank may have skipped a call, and same-shaped calls
        would then pair a call apart. The error it raises says so."""
        reason = closing_reason(self.unique_name, None, None, elsewhere=[])
        assert reason is not None  # (calls that differ always give one)
        self._close_here(reason)
        return DesyncError(f"{error}; {reason}")

    def _p2p(self, operation: str, peer: int, fn: Any, *args: Any) -> Any:
        """Run one point-to-point transfer with in-group ``peer``; failures name the peer."""
        if self._failure is not None:
            self._check_usable()
        try:
            return fn(*args)
        except BaseException as exc:
            error = exc
            if isinstance(exc, RuntimeError) and not isinstance(exc, GroupcoordError):
                peer_rank = self.ranks[peer]
                pid = self._local_pids.get(peer_rank)
                dead = pid is not None and bool(dead_peers({peer_rank: pid}))
                error = classify(
                    self.unique_name, operation, self.timeout_s, [peer_rank], exc, known_dead=dead
                )
            self._ended_with(operation, error)
            if error is exc:
                raise
            raise error from exc

    def _wait_all(self, operation: str, works: list[Any]) -> None:
        self._collective(operation, lambda: [w.wait() for w in works])

    def _failure_of(self, operation: str, exc: BaseException) -> BaseException:
        """What a collective that ``exc`` ended raises: ours and bad arguments as they
        are (raised before any send), except that a Gloo failure the communicator
        translated, like any other transport failure, is diagnosed here: the
        arrival records name exactly who did not come (and keep the collective
        count in step with the other ranks)."""
        if isinstance(exc, (GroupcoordError, ValueError, TypeError)):
            gloo = getattr(exc, "transport_error", None)
            return self._diagnose(operation, gloo) if isinstance(gloo, RuntimeError) else exc
        if isinstance(exc, RuntimeError):
            return self._diagnose(operation, exc)
        return exc

    def _diagnose(self, operation: str, exc: RuntimeError) -> GroupcoordError:
        seq = self._collective_seq
        self._collective_seq += 1
        missing, dead = absent_ranks(
            self.unique_name, seq, self.rank_in_group, self.ranks, self.timeout_s, self._local_pids
        )
        return classify(self.unique_name, operation, self.timeout_s, missing, exc, known_dead=dead)


def _check_group_ranks(group_ranks: Any, rank: int, world_size: int) -> list[int]:
    """The caller's group from ``group_ranks``, after checking the whole list."""
    if not isinstance(group_ranks, (list, tuple)) or not group_ranks:
        raise GroupcoordValueError(
            f"group_ranks must be a non-empty list of lists, got {group_ranks!r}"
        )
    seen: set[int] = set()
    mine: list[int] | None = None
    for ranks in group_ranks:
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise GroupcoordValueError(f"group_ranks: {ranks!r} is not a non-empty list of ranks")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise GroupcoordValueError(
                    f"group_ranks: {r!r} is not a rank of the world ({world_size})"
                )
            if r in seen:
                raise GroupcoordValueError(f"group_ranks: rank {r} appears in more than one place")
            seen.add(r)
        if list(ranks) != sorted(ranks):
            # torch.distributed numbers a group's members in increasing global rank
            # order: rank_in_group (the place in this list) would then name another
            # process than the group's own numbering, in every send, recv and gather.
            raise GroupcoordValueError(
                f"group_ranks: {list(ranks)!r} is not in increasing order, and "
                "torch.distributed numbers a group's members by global rank: list it as "
                f"{sorted(ranks)!r}"
            )
        if rank in ranks:
            mine = list(ranks)
    if mine is None:
        raise GroupcoordValueError(f"group_ranks: this rank ({rank}) is in none of {group_ranks!r}")
    return mine
