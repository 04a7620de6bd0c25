"""The :class:`Comm` communicator: collectives and point-to-point with work handles.

Every operation has one shape: tensors first, then ``async_op``, ``hints`` and
``timeout``, and it returns a :class:`~coordinator.comm.work.Work`. Arguments
are checked before anything is sent. Each communicator owns a Gloo process
group built on its own store prefix, so it never touches torch's default
group, and one completer thread that finishes its works in issue order.

All-reduce, reduce-scatter, all-gather and broadcast take the same
shared-memory back end as ``GroupCoordinator``
(:class:`~device_communicators.shm_all_reduce.ShmAllReduce`, with its desync
check) when every rank is on this node and the back end takes the tensor; the
choice depends only on the group, the dtype and the operator, never on
``async_op``, so every rank makes the same one. Those calls run in issue
order through the communicator's :class:`~coordinator.comm.lanes.ShmLane`
(asynchronous ones on its thread). Send, receive and batches go through
shared-memory channels to peers on the same node, one lane per (direction,
peer) (:mod:`~coordinator.comm.p2p_lanes`); everything else runs on Gloo.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from device_communicators import checks
from device_communicators.cpu_communicator import CpuCommunicator
from shm_broadcast.config import GROUP_SETTINGS, describe_settings, resolve_timeout

from ..errors import (
    BackendUnavailableError,
    DesyncError,
    GroupcoordTimeoutError,
    GroupcoordValueError,
    NotSupportedError,
)
from ..meeting import meet
from .batch import P2PBatch
from .bootstrap import default_store, rank_and_size, unique_prefix
from .core import CommOptions, timeout_seconds
from .lanes import ShmLane
from .monitored_barrier import monitored_barrier
from .ops import CommOps
from .p2p_lanes import P2PLanes
from .split import split_members
from .window import Window

__all__ = ["Comm", "CommOptions", "new_comm"]


def new_comm(
    backend: str = "gloo",
    device: str | torch.device = "cpu",
    name: str = "comm",
    abort_process_on_timeout_or_error: bool | None = None,
    timeout: float | datetime.timedelta | None = None,
    high_priority_stream: bool | None = None,
    store: dist.Store | None = None,
    hints: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    size: int | None = None,
) -> Comm:
    """Create a communicator over every rank of the launch (collective); torchcomms'
    signature.

    ``rank``/``size`` default to the launcher's RANK/WORLD_SIZE and ``store``
    to a TCPStore at MASTER_ADDR:MASTER_PORT (or torch's default store).
    ``high_priority_stream`` has no meaning on CPU (no streams) and is ignored.
    ``abort_process_on_timeout_or_error=True`` is refused: a timeout or a dead
    peer raises ``GroupcoordTimeoutError``/``PeerDiedError`` naming the ranks
    instead, and ``abort()`` ends the communicator without ending the process.
    """
    for flag_name, flag in (
        ("abort_process_on_timeout_or_error", abort_process_on_timeout_or_error),
        ("high_priority_stream", high_priority_stream),
    ):
        if flag is not None:
            checks.flag(flag, flag_name)
    if abort_process_on_timeout_or_error:
        raise NotSupportedError.by_groupcoord(
            "abort_process_on_timeout_or_error=True",
            "a timeout or dead peer raises an error naming the ranks; call abort() to stop",
        )
    if backend != "gloo":
        raise BackendUnavailableError(
            backend, "coordinator.comm runs on Gloo here (CPU tensors); pass backend='gloo'"
        )
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise GroupcoordValueError(f"device={device!r} is not a torch device: {exc}") from exc
    if torch_device.type != "cpu":
        raise GroupcoordValueError(f"device={device!r}: the gloo backend runs on 'cpu'")
    torch_device = torch.device("cpu")  # CPU tensors report no index: compare like with like
    if not isinstance(name, str) or not name:
        raise GroupcoordValueError(f"name must be a non-empty str, got {name!r}")
    checks.hints(hints)
    timeout_s = timeout_seconds(timeout, resolve_timeout(None))
    rank, size = rank_and_size(rank, size)
    base_store = default_store(rank, size, timeout_s) if store is None else store
    return Comm._create(
        base_store, unique_prefix(name), rank, size, name, torch_device, timeout_s, hints
    )


class Comm(CommOps):
    """A communicator over ``size`` ranks; create with :func:`new_comm` or :meth:`split`."""

    @classmethod
    def _create(
        cls,
        base_store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        name: str,
        device: torch.device,
        timeout_s: float,
        hints: Mapping[str, str] | None,
        known_pids: Mapping[int, int] | None = None,
    ) -> Comm:
        checked_hints = checks.hints(hints)
        # Before c10d's connect, which waits out the timeout for a dead member.
        what = f"communicator {name!r}"
        # Each rank posts the settings that change which way a call goes (the
        # debug check over Gloo, the channels for send/recv): ranks that differ
        # would part at their first such call and wait out the timeout.
        mine = describe_settings(GROUP_SETTINGS)
        differ = meet(
            base_store, f"{prefix}/meet", rank, range(size), what, timeout_s, known_pids, mine
        )
        if differ:
            r, theirs = min(differ.items())
            raise DesyncError(
                f"{what}: rank {rank} has {mine}, rank {r} {theirs}: every rank of a "
                "communicator must set these GROUPCOORD_* settings alike"
            )
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix + "/pg", base_store),
                rank,
                size,
                datetime.timedelta(seconds=timeout_s),
            )
        except RuntimeError as exc:
            raise GroupcoordTimeoutError(
                f"communicator {name!r}",
                "connect",
                timeout_s,
                missing=[r for r in range(size) if r != rank],
                detail=f"could not connect all ranks: {exc}",
            ) from exc
        comm = cls(pg, base_store, prefix, rank, size, name, device, timeout_s, checked_hints)
        comm._connect_local()
        return comm

    def _connect_local(self) -> None:
        """Collective, once at creation: the device communicator over this comm's Gloo
        group (a ``CpuCommunicator``, as a ``GroupCoordinator`` builds), whose
        shared-memory back end serves the fast paths (disabled, with its reason, when
        the ranks do not share this node) and whose peer pids let errors name dead
        peers. The communicator numbers ranks as this comm does."""
        communicator = CpuCommunicator(
            self._pg,
            unique_name=f"communicator {self._name!r}",
            timeout_s=self._timeout_s,
            global_ranks=list(range(self._size)),
            p2p_store=dist.PrefixStore(self._prefix + "/p2p", self._base_store),
        )
        self._communicator = communicator
        self._local_pids = communicator.peer_pids
        shm = communicator.shm_all_reduce
        if shm.disabled_reason is None:  # the same verdict on every rank
            shm.set_traffic(self._traffic)
            shm.set_desync_hook(self._weak_desync_marker(self))
            self._lane = ShmLane(self._name, shm, self._on_failure, close=communicator.destroy)
        # Every pair's calls go through its lanes, over the pair's channel or Gloo.
        self._p2p = P2PLanes(
            self._name,
            communicator.p2p_channels,
            self._pg,
            self._traffic,
        )

    def unsafe_get_backend(self) -> Any:
        """The c10d Gloo process group underneath (an escape hatch, as in torchcomms:
        calls on it bypass this communicator's checks, lane and timeouts)."""
        return self._pg

    def window_allocate(
        self, window_size: int, cpu_buf: bool = False, signal_size: int = 256
    ) -> Window:
        """Collective: a new window with a zeroed buffer of ``window_size`` bytes."""
        window = self.new_window()
        window.window_allocate(window_size, cpu_buf, signal_size)
        return window

    def batch_op_create(self) -> P2PBatch:
        """A batch of sends and receives that are all put in flight together."""
        return P2PBatch(self)

    # -- sub-communicators, windows, barriers --------------------------------
    def split(
        self,
        ranks: Sequence[int],
        name: str,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Comm | None:
        """Collective over this comm: join the child made of ``ranks`` (in that order)."""
        child = split_members(self, ranks, name, hints, timeout)
        if child is None:
            return None
        prefix, members, timeout_s, child_hints = child
        # The members' processes this rank can watch while they join, as child ranks.
        pids = {i: self._local_pids[r] for i, r in enumerate(members) if r in self._local_pids}
        rank = members.index(self.get_rank())
        return Comm._create(
            self._base_store,
            prefix,
            rank,
            len(members),
            name,
            self._device,
            timeout_s,
            child_hints,
            pids,
        )

    def new_window(self) -> Window:
        """A shared-memory window over this comm's ranks (all on one node)."""
        self._check_usable("new_window")
        window = Window(self)
        self._windows.append(window)
        return window

    def monitored_barrier(self, timeout: float | datetime.timedelta | None = None) -> None:
        """A barrier whose timeout names the ranks that did not arrive."""
        monitored_barrier(self, timeout)
