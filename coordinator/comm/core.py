"""The state every :class:`~coordinator.comm.comm.Comm` is built on: identity,
the usable/broken/closed states, how one operation runs (``_run``: check, then
the shared-memory lane or c10d works handed to the completer) and teardown.

The operations themselves live in ``reductions`` and ``ops``; ``comm`` puts
the class together. Helpers (windows, batches, split, object collectives)
depend on these parts, never on ``comm``, so nothing imports in a circle.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import msgspec
import torch
import torch.distributed as dist

from device_communicators import c10d_calls, checks
from device_communicators.cpu_communicator import CpuCommunicator, ShmTransport
from device_communicators.shm_all_reduce import ShmAllReduce
from device_communicators.shm_phases import (
    Traffic,
    call_code,
    closing_reason,
    describe_call,
    sent_after_its_stamp,
)
from device_communicators.shm_reduce import settle_torch_pool
from device_communicators.shm_small import SmallCalls
from shm_broadcast.config import get_config, resolve_timeout
from shm_broadcast.forked import owned_here

from ..errors import (
    ClosedError,
    DesyncError,
    GroupcoordTypeError,
    GroupcoordValueError,
)
from ..failures import ends_part_way
from .lanes import ShmLane
from .p2p_lanes import Kind, P2PLanes
from .reduce_ops import ReduceOp
from .work import Completer, Work, translate_error

_Launch = Callable[[datetime.timedelta], Sequence[Any]]
# What a call over Gloo is, for ``CommCore._agree``: the operation (one of
# ``shm_phases.OPERATIONS``), dtype, reduce operator (its name), root and the
# element count every rank must bring.
Call = tuple[str, torch.dtype | None, str | None, int, int]
_Fast = Callable[[ShmAllReduce], None]


class CommOptions(msgspec.Struct, frozen=True):
    """What a communicator was built with (``Comm.get_options()``)."""

    name: str
    backend: str
    device: str
    rank: int
    size: int
    timeout_s: float
    hints: dict[str, str]
    store_prefix: str


def timeout_seconds(
    timeout: float | datetime.timedelta | None, default: float, argument: str = "timeout"
) -> float:
    if timeout is None:
        return default
    try:
        return resolve_timeout(timeout)
    except ValueError as exc:
        raise GroupcoordValueError(f"{argument}: {exc}") from exc


# What a forked child may still read of its parent's communicator (shm_broadcast.forked).
_DESCRIPTIVE = (
    "_rank", "_size", "_name", "_device", "get_rank", "get_size", "get_name", "get_device",
    "get_backend",
)  # fmt: skip


class CommCore:
    """Identity, state and the one way an operation runs; see :class:`Comm`."""

    def __init__(
        self,
        pg: Any,
        base_store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        name: str,
        device: torch.device,
        timeout_s: float,
        hints: dict[str, str],
        owns_pg: bool = True,
    ) -> None:
        settle_torch_pool()  # before the lane's thread and the caller's race torch's rebuild
        # c10d's stubs lack the backend's collective methods, hence Any.
        self._pg: Any = pg
        self._owns_pg = owns_pg  # False when borrowed from an existing group (adapters.py)
        self._base_store = base_store
        self._prefix = prefix
        self._store = dist.PrefixStore(prefix + "/kv", base_store)
        self._rank = rank
        self._size = size
        self._name = name
        self._device = device
        self._timeout_s = timeout_s
        self._hints = hints
        self._completer = Completer(name)
        self._closed: str | None = None
        self._broken: str | None = None
        self._broken_by: BaseException | None = None
        self._split_count = 0
        self._agreed = 0  # calls checked by _agree, numbered in its errors
        self._barrier_count = 0
        self._windows: list[Any] = []  # Window objects (they only need close())
        self._local_pids: dict[int, int] = {}  # comm rank -> pid, peers with our host key
        # The device communicator over this comm's group (``Comm._connect_local``).
        self._communicator: CpuCommunicator | None = None
        self._lane: ShmLane | None = None  # None: no shared-memory path for this comm
        self._p2p: P2PLanes | None = None  # send/recv/batches (``Comm._connect_local``)
        self._done: dict[str, Work] = {}  # the finished work lean calls return, by operation
        # Sends less receives posted: the shared-memory path's call stamps carry it
        # (``Comm._connect_local``), and so does the debug_desync check (_agree).
        self._traffic = Traffic()
        # Held by a collective of several steps (an object collective's lengths, then
        # its bytes; a check of the call, then its data over Gloo) from its first step
        # to its last's launch, so another thread's call of the same kind cannot come
        # between them. Calls of one step need not take it (the lane, or Gloo's issue
        # order, keeps each whole); threads racing calls of different kinds pair them
        # as they come, as in torch.
        self._call_lock = threading.RLock()
        self._on_failure = self._weak_failure_marker(self)
        owned_here(self, f"communicator {name!r}", _DESCRIPTIVE)

    # -- identity ----------------------------------------------------------
    def get_rank(self) -> int:
        return self._rank

    def get_size(self) -> int:
        return self._size

    def get_name(self) -> str:
        return self._name

    def get_device(self) -> torch.device:
        return self._device

    def get_backend(self) -> str:
        return "gloo"

    def get_options(self) -> CommOptions:
        return CommOptions(
            name=self._name,
            backend="gloo",
            device=str(self._device),
            rank=self._rank,
            size=self._size,
            timeout_s=self._timeout_s,
            hints=dict(self._hints),
            store_prefix=self._prefix,
        )

    def __repr__(self) -> str:
        return f"Comm({self._name!r}, rank {self._rank} of {self._size})"

    # -- plumbing ----------------------------------------------------------
    def _others(self) -> list[int]:
        return [r for r in range(self._size) if r != self._rank]

    def _check_usable(self, op: str) -> None:
        if self._closed is not None:
            raise ClosedError(f"communicator {self._name!r} was {self._closed}; {op} refused")
        if self._broken is not None:
            raise ClosedError(
                f"communicator {self._name!r}: {self._broken}, so ranks may "
                f"disagree on what comes next; abort() it and create a new one ({op} refused)"
            )

    @staticmethod
    def _weak_failure_marker(comm: CommCore) -> Callable[[str, bool], None]:
        """What a work or lane calls, ``(op, late)``, when a peer was late (the op's
        deadline passed) or died: mark the comm broken.

        It holds the comm weakly. A work's callbacks may be the last thing
        released on one of Gloo's own threads; if they held the comm, the
        process group's destructor would run there and try to join the very
        thread it runs on (std::terminate, "Resource deadlock avoided").
        Finishing steps likewise capture plain values, never the comm.
        """
        ref = weakref.ref(comm)

        def mark(op: str, late: bool) -> None:
            alive = ref()
            if alive is not None:
                alive._broken = f"{op} {'timed out' if late else 'lost a peer'} earlier"

        return mark

    @staticmethod
    def _weak_desync_marker(comm: CommCore) -> Callable[[str | None], str]:
        """The shared-memory path's desync hook: when the ranks' calls can no longer
        be brought back in step (``reason``), every rank closes the whole comm, its
        Gloo and point-to-point paths too (held weakly, like the markers beside it)."""
        ref = weakref.ref(comm)

        def mark(reason: str | None) -> str:
            alive = ref()
            if reason is not None and alive is not None:
                alive._broken = "closed by a desync on every rank"
            return ""  # the error names the closing already

        return mark

    def _tensor(self, value: Any, argument: str) -> torch.Tensor:
        return checks.tensor(value, argument, self._device, contiguous=True)

    def _tensors(self, value: Any, argument: str, length: int | None) -> list[torch.Tensor]:
        return checks.tensor_list(value, argument, self._device, length, contiguous=True)

    def _per_rank(self, value: Any, argument: str, like: torch.Tensor) -> list[torch.Tensor]:
        """``value`` checked as one tensor per rank, each of ``like``'s dtype and shape."""
        tensors = self._tensors(value, argument, self._size)
        checks.same_dtype(like, tensors, argument)
        checks.same_shape(tensors, like, argument)
        return tensors

    @staticmethod
    def _op(op: Any, dtype: torch.dtype, argument: str) -> ReduceOp:
        if not isinstance(op, ReduceOp):
            raise GroupcoordTypeError(f"op must be a coordinator.comm.ReduceOp, got {op!r}")
        op.check_dtype(dtype, argument)
        return op

    def _agree(
        self,
        call: Call,
        td: datetime.timedelta,
        counts: Sequence[int] = (),
        check: Callable[[list[list[int]]], None] | None = None,
    ) -> list[list[int]]:
        """Check that every rank makes ``call`` over Gloo, and return every rank's
        ``counts`` (``2 * size`` at most), before anything moves: ranks whose calls
        differ raise ``DesyncError`` on every rank, naming both, before Gloo meets the
        difference (it aborts the process on a part's size that is not the one its
        receiver posted, and adds up other dtypes' bytes silently). One blocking
        all-gather of a fixed-width record (the call's code, its element count, the
        comm's traffic, the counts). With ``counts`` (the calls whose sizes are data:
        ``all_gather_v``, the ``_v`` all-to-alls) the element counts may differ by
        rank; ``check(table)`` raises ``DesyncError`` where they do not fit together.
        A difference in the calls or the counts closes the comm on every rank, as do
        messages sent in it and not yet received, as on the shared-memory path
        (``PhaseLines._check_agreement``, ``closing_reason``)."""
        operation, dtype, reduce_op, root, count = call
        code = call_code(operation, dtype, reduce_op, root)
        traffic = self._traffic
        mine = torch.zeros(4 + 2 * self._size, dtype=torch.int64)
        mine[0], mine[1] = code, count
        mine[2], mine[3] = traffic.messages, traffic.unordered()
        mine[4 : 4 + len(counts)] = torch.tensor(counts, dtype=torch.int64)
        table = torch.empty(self._size, mine.numel(), dtype=torch.int64)
        c10d_calls.all_gather(self._pg, list(table.unbind(0)), mine, td).wait()
        rows = table.tolist()
        seq = self._agreed
        self._agreed += 1
        # Every rank saw the same table: every rank raises, or none.
        other = next(
            (
                rank
                for rank, row in enumerate(rows)
                if row[0] != code or (not counts and row[1] != count)
            ),
            None,
        )
        in_flight = sum(row[2] for row in rows)
        sent = None
        if in_flight and not any(row[3] for row in rows) and not sent_after_its_stamp(0, in_flight):
            # Whether the calls agree or not (see PhaseLines._check_agreement).
            sent = {rank: row[2] for rank, row in enumerate(rows)}
        agreed = [row[4 : 4 + len(counts)] for row in rows]
        called = f"{describe_call(code, count)} as call #{seq} checked over Gloo"
        message = None
        if other is not None:
            message = (
                f"communicator {self._name!r}: rank {self._rank} called {called}, "
                f"rank {other} called {describe_call(rows[other][0], rows[other][1])}"
            )
        elif sent is not None:
            message = f"communicator {self._name!r}: every rank called {called}"
        elif check is not None:
            try:
                check(agreed)
            except DesyncError as exc:
                message = str(exc)
        if message is None:
            return agreed
        # Calls or counts that differ, or messages unreceived: closed on every rank.
        differ: list[int] | None = None if other is None and sent is not None else []
        closing = closing_reason(f"communicator {self._name!r}", None, sent, differ)
        self._broken = "closed by a desync on every rank"
        raise DesyncError(f"{message}; {closing}")

    def _run(
        self,
        op: str,
        peers: Sequence[int],
        timeout: float | datetime.timedelta | None,
        async_op: bool,
        hints: Mapping[str, str] | None,
        launch: _Launch,
        finish: Callable[[], None] | None = None,
        completes_in_wait: bool = False,
        fast: _Fast | None = None,
        call: Call | None = None,
    ) -> Work:
        """Check, then run ``fast`` on the shared-memory back end (synchronous calls it
        takes; it checks every call against the peers') or launch the c10d work(s),
        hand them to the completer, maybe wait. With ``debug_desync`` on, ``call`` is
        checked against the peers' first (:meth:`_agree`)."""
        work = self._new_work(op, peers, timeout, async_op, hints)
        try:
            if fast is not None:
                assert self._lane is not None  # fast is only offered with a lane
                self._lane.run_shm(work, fast, async_op)
                return work
            td = datetime.timedelta(seconds=work.timeout_s)
            try:
                with self._call_lock:  # a check, then the data: whole
                    if call is not None and get_config().debug_desync:
                        self._agree(call, td)
                    c10d_works = launch(td)
            except RuntimeError as exc:
                raise translate_error(work, exc) from exc
            if async_op:
                self._completer.track(work, c10d_works, finish, completes_in_wait)
            else:
                Completer.run_inline(work, c10d_works, finish)
                work.wait()
        except BaseException as exc:
            self._ended_part_way(op, exc)
            raise
        return work

    def _ended_part_way(self, op: str, exc: BaseException) -> None:
        """A signal handler's ``KeyboardInterrupt`` or ``SystemExit`` (anything but an
        ``Exception``) left ``op`` part-way, between two of its steps (a header and its
        data, the checked counts and the parts): this rank's next call would take a
        step its peers sent for this one (Gloo aborts the process on a size it did
        not expect), so the comm refuses every call after it."""
        if self._broken is None or self._broken_by is not None:
            if ends_part_way(exc, self._broken_by):
                self._broken_by = exc
                self._broken = f"{op} ended part-way on this rank with {type(exc).__name__}"

    def _new_work(
        self,
        op: str,
        peers: Sequence[int],
        timeout: float | datetime.timedelta | None,
        async_op: bool,
        hints: Mapping[str, str] | None,
    ) -> Work:
        """The work of one operation, after the checks every operation makes."""
        checks.flag(async_op, "async_op")
        checks.hints(hints)
        timeout_s = timeout_seconds(timeout, self._timeout_s)
        self._check_usable(op)
        work = Work(self._name, op, peers, timeout_s, on_failure=self._on_failure)
        work.local_pids = self._local_pids
        return work

    def _point_to_point(
        self,
        kind: Kind,
        tensor: torch.Tensor,
        peer: int,
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | datetime.timedelta | None,
    ) -> Work:
        """A send or receive, on its peer's lane (over the pair's channel or Gloo)."""
        assert self._p2p is not None  # set at creation
        work = self._new_work(kind, [peer], timeout, async_op, hints)
        try:
            self._p2p.run(work, kind, tensor, peer, async_op)
        except BaseException as exc:
            self._ended_part_way(kind, exc)
            raise
        return work

    def _lean(self, op: str, call: Callable[[SmallCalls], object], *tensors: Any) -> Work | None:
        """A small synchronous call on the shared-memory back end's lean path
        (``device_communicators.shm_small``): ``call(small_calls)`` writes the result
        in place. None: not such a call (``tensors`` not dense, the lane busy, the
        comm not usable), and the general path checks and runs it."""
        lane = self._lane
        if lane is None or self._closed is not None or self._broken is not None:
            return None
        for t in tensors:
            if (
                type(t) is not torch.Tensor
                or t.layout is not torch.strided
                or not t.is_contiguous()
            ):
                return None
        small = lane.shm.small
        if lane.run_now(op, self._timeout_s, lambda: call(small)) is None:
            return None
        # A finished work never changes again, so one per operation serves every call.
        work = self._done.get(op)
        if work is None:
            work = self._done[op] = Work.completed(self._name, op, self._others())
        return work

    def _shm_now(
        self,
        op: str,
        fast: _Fast | None,
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | datetime.timedelta | None,
        *tensors: Any,
    ) -> Work | None:
        """A checked synchronous call (no per-call timeout or hints) that the
        shared-memory back end takes (``fast``, None where it does not) run on the
        caller's thread (``_lean``) rather than handed to the lane; None: not such a
        call, nothing ran, and the caller goes the general way (``_run``)."""
        lane = self._lane
        if (
            fast is None
            or lane is None
            or not (async_op is False and hints is None and timeout is None)
        ):
            return None

        def run(small: SmallCalls) -> bool:
            fast(lane.shm)
            return True

        return self._lean(op, run, *tensors)

    def _shm_takes(self, tensor: torch.Tensor, op: ReduceOp | str) -> bool:
        """Whether the communicator's chains pick its shared-memory back end for
        ``tensor``: the all-reduce chain for a reduction (``op`` a ReduceOp), the
        transport chain for a copy (``op`` the operation's name, e.g. "broadcast").

        The chains' choices depend on the group, dtype and operator only, so ranks
        that agree on the call agree on the path (and the back end checks they agree).
        """
        communicator = self._communicator
        if self._lane is None or communicator is None:
            return False
        if isinstance(op, str):
            return isinstance(communicator.transports.select(op, tensor), ShmTransport)
        chosen = communicator.all_reduce_chain.select(tensor, op.c10d_op())
        return chosen is communicator.shm_all_reduce

    # -- teardown ----------------------------------------------------------
    def abort(self) -> None:
        """Stop at once (not collective): pending works become ABORTED, windows unmap."""
        if self._closed is not None:
            return
        self._closed = "aborted"
        self._pg.abort()
        self._completer.abort_outstanding()
        self._close_local(abandon="aborted")

    def finalize(self) -> None:
        """Orderly close (not collective): let queued works finish, unmap windows,
        then shut the process group down. Works still running are waited for."""
        if self._closed is not None:
            return
        self._closed = "finalized"
        self._completer.drain()
        self._close_local()
        if self._owns_pg:
            self._pg.shutdown()

    def _close_local(self, abandon: str | None = None) -> None:
        """Unmap the windows and the shared-memory back end (``abandon``: its call in
        progress gives up first)."""
        if self._p2p is not None:
            self._p2p.close(abandon)
        windows, self._windows = self._windows, []
        for window in windows:
            window.close()
        if self._lane is not None:
            self._lane.close(abandon)  # it releases the communicator once no call is inside
        elif self._communicator is not None:
            self._communicator.destroy()

    def is_closed(self) -> bool:
        return self._closed is not None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """``finalize()`` after a clean block, ``abort()`` after an exception."""
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
