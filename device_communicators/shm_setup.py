"""The shared-memory collectives' segment and calls: set-up, bookkeeping, sleep mode, teardown.

:class:`ShmBase` opens the segment of one control line per rank and two
sets of slots (``shm_slots``) through the CPU group (collective; disabled
with a reason when the ranks do not share this node's shared memory), stamps
each call's fingerprint and advances the generation, runs the barrier of an
empty call, and unmaps on sleep, close or a peer's failure. The collectives
that run on it are :class:`~.shm_all_reduce.ShmAllReduce`'s; the lean path of
small calls is :mod:`.shm_small`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from shm_broadcast.config import get_config, resolve_timeout
from shm_broadcast.threads import only_caller, other_callers

from .all_reduce_backends import SUSPENDED, AllReduceBackend
from .errors import (
    ClosedError,
    CrossedCallsError,
    DesyncError,
    GroupcoordTimeoutError,
    GroupcoordValueError,
    PeerDiedError,
)
from .peer_reads import PeerReadError, PeerReads, TimedWays, WayTurn, agree_on_peer_reads
from .shm_phases import (
    LINE,
    QUEUE_CALLS,
    READ_DIRECTLY,
    VARYING_COUNTS,
    PhaseLines,
    Traffic,
    call_code,
    closing_reason,
    describe_call,
    elsewhere_code,
    queue_code,
)
from .shm_slots import SlotSegment, align_up, open_slot_segment
from .shm_small import SmallCalls

logger = logging.getLogger("groupcoord.device_communicators")

# Large tensors go through in pieces of at most this (each its own generation):
# pieces that stay in L2 beat one big pass through DRAM by 1.5-3x here even
# with a barrier per piece (16 MiB at world 2: 4.2 ms with 1 MiB pieces against
# 4.7-9 ms with one 16 MiB piece).
PIPELINE_PIECE_BYTES = 1024 * 1024


_Method = TypeVar("_Method", bound=Callable[..., Any])


# Every shared-memory group of this process: a long wait in one looks for peers
# stuck in another that wait for this rank (_check_crossed).
_LIVE: weakref.WeakSet[ShmBase] = weakref.WeakSet()


def _others_of(lines: PhaseLines) -> tuple[ShmBase | None, list[ShmBase]]:
    """The group whose control lines are ``lines``, and this process's other usable
    shared-memory groups (``None`` and [] where ranks cannot be told apart by pid).
    Only groups this process is the member of: a forked child's copies of its
    parent's groups are not its own to join."""
    pid = os.getpid()
    owners = [
        b
        for b in list(_LIVE)
        if b._lines is not None
        and b._failure is None
        and b._lines.pids
        and b._lines.pids[b.rank_in_group] == pid
    ]
    here = next((b for b in owners if b._lines is lines), None)
    if here is None or not lines.pid_checks:
        return None, []
    return here, [
        b for b in owners if b is not here and b._lines is not None and b._lines.pid_checks
    ]


def _in_next_call(there: ShmBase, pid: int, alone: bool) -> int | None:
    """Process ``pid``'s in-group rank in group ``there`` when it waits at the first
    barrier of that group's next call (which needs this rank), asleep with no other
    thread in its process that could make a call if ``alone``; else None."""
    there_lines = there._lines
    assert there_lines is not None
    if pid not in there_lines.pids:
        return None
    r = there_lines.pids.index(pid)
    next_first = 2 * there.generation + 1
    if (
        there_lines.waits_alone_at(r, next_first)
        if alone
        else there_lines.phase_of(r) == next_first
    ):
        return r
    return None


def _behind_by_pid(lines: PhaseLines, phase: int) -> dict[int, int]:
    """The ranks a wait at ``phase`` on ``lines`` needs, pid -> global rank (groups
    number their ranks their own ways; a pid is the same process in every group)."""
    return {lines.pids[lines.ranks.index(g)]: g for g in lines.behind(phase)}


def _check_crossed(lines: PhaseLines, phase: int) -> None:
    """Run at the liveness checks of a wait at ``phase`` on ``lines``: when a rank
    this wait needs sleeps at the first barrier of another group's next call, which
    needs this rank, and neither process runs another thread that could make a
    call (``threads.only_caller``), the two wait
    for each other for ever. The ranks waiting in the group that sorts first
    (by name and ranks) act, so one side does: they join the other group's call
    (``ShmBase._cross_into``)."""
    if not only_caller():
        return
    here, others = _others_of(lines)
    for there in others:
        assert here is not None
        if (here.what, here.ranks) < (there.what, there.ranks):
            behind = _behind_by_pid(lines, phase)
            stuck = [g for pid, g in behind.items() if _in_next_call(there, pid, True) is not None]
            if stuck:
                here._cross_into(there, stuck)


def _locate_peers(lines: PhaseLines, phase: int) -> str:
    """For a timed-out wait at ``phase``: which of the ranks it needed wait for this
    rank in another group's call instead ("" when none does, as far as this
    process's groups show), and which threads kept that from being raised at
    once, e.g. ``; rank 1 waits for this rank in xb:0's barrier() (raised only
    now: this process's thread(s) ['monitor'] could still make a call ...)``."""
    _, others = _others_of(lines)
    notes = []
    mine = other_callers()
    for there in others:
        assert there._lines is not None
        for pid, g in _behind_by_pid(lines, phase).items():
            r = _in_next_call(there, pid, False)
            if r is not None:
                call = describe_call(*there._lines.stamp_of(r, there._lines.calls + 1))
                note = f"rank {g} waits for this rank in {there.what}'s {call}"
                blockers = [f"this process's thread(s) {mine}"] if mine else []
                if _in_next_call(there, pid, True) is None:
                    blockers.append(f"rank {g}'s process's other thread(s)")
                if blockers:
                    note += (
                        f" (raised only now: {' and '.join(blockers)} could still make a call;"
                        " declare_bystander_thread() declares a thread that never does)"
                    )
                notes.append(note)
    return "".join(f"; {note}" for note in notes)


def one_at_a_time(method: _Method) -> _Method:
    """Run a collective of a :class:`ShmBase` under its ``call_lock``: two threads
    of one rank calling at once take turns, as on a Gloo group (in the order
    they take the lock, which the ranks must agree on, as with torch), instead
    of writing the same slots and control line."""

    @functools.wraps(method)
    def serialized(self: ShmBase, *args: Any, **kwargs: Any) -> Any:
        with self.call_lock:
            return method(self, *args, **kwargs)

    return serialized  # type: ignore[return-value]


class _DesyncGuard:
    """Wraps the part of a call that publishes and waits: when anything but a
    ``DesyncError`` (which every rank raises in step) ends it, the call ended
    part-way on this rank (a timeout, a dead peer, a failed read, or whatever the
    caller's signal handler raised: KeyboardInterrupt, SystemExit), and the owner
    leaves (``ShmBase._ended_part_way``).

    A plain class rather than ``contextlib.contextmanager``: it is entered on
    every call, and a generator-based manager costs about a microsecond more.
    """

    __slots__ = ("owner",)

    def __init__(self, owner: ShmBase) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        self.owner._unarrived = False  # the call's waits are covered from here

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, DesyncError):
            self.owner._ended_part_way(exc)


class ShmBase(AllReduceBackend):
    """The segment of a shared-memory group and the bookkeeping of its calls.

    Every rank of ``cpu_group`` must construct it at the same time. If the
    ranks do not all share this node's shared memory (or it is disabled, or
    there is no room), it is built disabled and ``refusal`` says why, so the
    next back end takes every tensor. ``cpu_group`` may be a group torch
    knows (its global ranks name peers in errors) or a bare Gloo backend
    that torch does not (``coordinator.comm``): then pass ``ranks``, how
    errors name its members.
    """

    name = "shm"

    def __init__(
        self,
        cpu_group: ProcessGroup,
        max_bytes: int | None = None,
        timeout_s: float | None = None,
        unique_name: str = "",
        *,
        ranks: list[int] | None = None,
    ) -> None:
        config = get_config()
        self.world_size = cpu_group.size()
        self.rank_in_group = cpu_group.rank()
        self.ranks: list[int] = (
            dist.get_process_group_ranks(cpu_group) if ranks is None else list(ranks)
        )
        if len(self.ranks) != self.world_size:
            raise GroupcoordValueError(
                f"ranks={self.ranks} names {len(self.ranks)} ranks, the group has {self.world_size}"
            )
        # Errors start with the group's name, like the coordinator's own errors.
        self.what = unique_name or "shm group"
        cap = config.shm_all_reduce_max_bytes if max_bytes is None else max_bytes
        if cap <= 0:
            raise GroupcoordValueError(f"max_bytes must be positive, got {cap}")
        # One slot holds one piece; the configured cap can only make pieces smaller,
        # never below what a call posts in a slot (an all_to_all_v's counts: two
        # int64s per rank).
        # ``max_bytes`` is what the slots took: this, or less where /dev/shm is small.
        self._wanted_bytes = self.max_bytes = align_up(
            max(min(cap, PIPELINE_PIECE_BYTES), 16 * self.world_size), LINE
        )
        self.timeout_s = resolve_timeout(timeout_s)
        self.peer_check_interval_s = config.peer_check_interval_s
        self.disabled_reason: str | None = None
        self._suspended = False
        self.generation = 0
        self._failure: str | None = None
        # A call was stamped and has not entered its waits (_DesyncGuard) yet: if the
        # next call finds it still so, the one before ended in between.
        self._unarrived = False
        self._desync_guard = _DesyncGuard(self)
        _LIVE.add(self)
        # Calls from several threads of this rank run one at a time, whole (the
        # slots, generations and control line are shared); see one_at_a_time.
        self.call_lock = threading.RLock()
        self._slots: SlotSegment | None = None
        self._lines: PhaseLines | None = None  # the slots' control lines, while mapped
        self._desync_hook: Callable[[str | None], str] | None = None  # PhaseLines.on_desync
        self._on_leave: Callable[[str], None] | None = None  # set_on_leave
        self._traffic: Traffic | None = None  # set_traffic
        # Direct reads of the peers' memory (large calls, ``peer_reads``), where allowed.
        self.peer_reads: PeerReads | None = None
        self.peer_reads_reason: str | None = "not set up"
        # Which way a call goes where the rules would read directly (timed now and
        # then); None: the rules alone (read directly), for benchmarks.
        self.timed_ways: TimedWays | None = TimedWays()
        # The lean path of small calls (shm_small), on the slots while they are up.
        self.small = SmallCalls(self)
        self._set_up(cpu_group, self._local_refusal(config.disable_shm_all_reduce))
        logger.info(
            "%s: %s", self.what, "enabled" if self.disabled_reason is None else self.disabled_reason
        )

    # ---- set-up ---------------------------------------------------------------

    def _local_refusal(self, disabled: bool) -> str | None:
        if disabled:
            return "disabled by GROUPCOORD_DISABLE_SHM_ALL_REDUCE"
        if self.world_size == 1:
            return "a single rank has nothing to reduce"
        if platform.machine() not in ("x86_64", "AMD64"):
            # The flag protocol relies on x86-64 store ordering (module docstring).
            return f"needs x86-64 memory ordering, this is {platform.machine()}"
        return None

    def _set_up(self, group: ProcessGroup, local_reason: str | None) -> None:
        self._slots, reason = open_slot_segment(
            group,
            self.ranks,
            self.rank_in_group,
            self.what,
            self._wanted_bytes,
            self.timeout_s,
            self.peer_check_interval_s,
            local_reason,
        )
        self.disabled_reason = reason
        if self._slots is not None:
            self.max_bytes = self._slots.max_bytes
        self._lines = None if self._slots is None else self._slots.lines
        if self._lines is not None:
            self._lines.on_desync = self._desync_hook
            if self._traffic is not None:
                self._lines.traffic = self._traffic
            self._lines.on_close = self._close_in_step
            self._lines.crossed_check = _check_crossed
            self._lines.locate_peers = _locate_peers
        self.small.attach(self._slots if reason is None else None)
        if self._lines is not None:  # every rank or none (the set-up agreed)
            self.peer_reads, self.peer_reads_reason = agree_on_peer_reads(
                group,
                self.ranks,
                self.rank_in_group,
                self._lines.pids if self._lines.pid_checks else None,
                self.what,
                "disabled by GROUPCOORD_DISABLE_PEER_READS"
                if get_config().disable_peer_reads
                else None,
            )
            logger.info(
                "%s: peer reads %s",
                self.what,
                "enabled" if self.peer_reads is not None else f"off: {self.peer_reads_reason}",
            )

    # ---- the back-end interface -------------------------------------------------

    def peer_pids(self) -> dict[int, int]:
        """Global rank -> pid of the other ranks, when the path is up and their pids compare."""
        lines = self._lines
        if self.disabled_reason is not None or lines is None or not lines.pid_checks:
            return {}
        return {
            r: pid
            for i, (r, pid) in enumerate(zip(self.ranks, lines.pids))
            if i != self.rank_in_group
        }

    def set_desync_hook(self, hook: Callable[[str | None], str] | None) -> None:
        """What runs on every rank when the ranks' calls are found out of step, before
        each raises ``DesyncError`` (its note ends the message), with why the path
        closes (None: it stays usable): the group's clean-up (``GroupCoordinator``
        drops the queue broadcasts its rank never read, and closes itself)."""
        self._desync_hook = hook
        if self._lines is not None:
            self._lines.on_desync = hook

    def set_on_leave(self, hook: Callable[[str], None] | None) -> None:
        """What runs, with why, when this rank's calls on the path end for good (a
        timeout, a dead peer, a call ended part-way: :meth:`_leave`): the owner
        group closes too (``GroupCoordinator``: its point-to-point channels would
        otherwise go on out of step with its peers')."""
        self._on_leave = hook

    def set_traffic(self, traffic: Traffic) -> None:
        """The owner group's one-way traffic (``shm_phases.Traffic``), which this
        path's call stamps carry: the group counts its queue broadcasts and
        point-to-point messages there."""
        self._traffic = traffic
        if self._lines is not None:
            self._lines.traffic = traffic

    def set_timeout(self, timeout_s: float, deadline: float | None = None) -> None:
        """The timeout of the calls that follow (a caller with a per-call timeout), or
        an absolute ``deadline`` (``time.monotonic()``) every wait ends by; errors
        report ``timeout_s``."""
        self.timeout_s = timeout_s
        if self._lines is not None:
            self._lines.timeout_s = timeout_s
            self._lines.deadline = deadline

    # ---- call bookkeeping -------------------------------------------------------------

    def _start(
        self,
        operation: str,
        reason: str | None,
        tensor: torch.Tensor | None,
        op: ReduceOp.RedOpType | str | None = None,
        root: int = 0,
        direct: bool = False,
        layout: int = 0,
        varying: bool = False,
        bare: tuple[int, int] | None = None,
    ) -> PhaseLines:
        """Refuse, or stamp the call's fingerprint (checked against every rank's at the
        call's first barrier: desync detection, always on). A barrier has no tensor;
        ``direct``: a call that reads the peers' memory (the way is chosen per call);
        ``layout``: the shape's field (``shm_phases.layout_code``) of a call that
        reads the ranks' tensors in this rank's shape; ``varying``: a call whose
        ranks' element counts may differ (``shm_phases.VARYING_COUNTS``); ``bare``:
        the fingerprint (code, count) of a call with no tensor, if not a barrier's."""
        if reason is not None:
            raise GroupcoordValueError(f"{self.what} cannot take this tensor: {reason}")
        if self._unarrived:
            self._unarrived = False
            self._leave(
                "its previous call raised after its fingerprint was published and before "
                "it reached its first barrier"
            )
        if self._failure is not None:
            raise ClosedError(f"{self.what} is unusable after an earlier failure: {self._failure}")
        lines = self._lines
        assert lines is not None  # enabled (no refusal) means set up
        lines.operation = operation
        if tensor is None:
            lines.stamp(*((call_code(operation, None, None, 0), 0) if bare is None else bare))
        else:
            code = call_code(operation, tensor.dtype, op, root) | layout
            if varying:
                code |= VARYING_COUNTS
            lines.stamp(code | READ_DIRECTLY if direct else code, tensor.numel())
        self._unarrived = True
        return lines

    def _ended_part_way(self, exc: BaseException) -> None:
        """A call of this rank ended with ``exc`` after it was stamped and before it
        was done here: leave (see :meth:`_leave`)."""
        if isinstance(exc, (GroupcoordTimeoutError, PeerDiedError, PeerReadError, ClosedError)):
            self._leave(str(exc))
        else:
            lines = self._lines
            call = "" if lines is None else f"{lines.operation} (call #{lines.calls}) "
            self._leave(f"its {call}ended part-way on this rank with {type(exc).__name__}: {exc}")

    def _leave(self, reason: str) -> None:
        """This rank's shared-memory calls end for good: the ranks may no longer agree
        on the generation, a peer may wait for a phase or a result this rank never
        publishes, or read a buffer it no longer holds. Later calls here raise
        ``ClosedError`` naming ``reason``; the peers' waits on this rank raise
        ``PeerLeftError`` at once (``PhaseLines.leave``), so none passes a barrier
        on a later call's phase and returns what this rank never finished."""
        if self._failure is None:
            self._failure = reason
        if self._lines is not None:
            self._lines.leave()
        if self._on_leave is not None:
            self._on_leave(reason)

    def _counts_disagree(self, exc: DesyncError) -> DesyncError:
        """The error for counts the ranks exchanged in a call they agree on, which do
        not fit together (every rank saw the same table, so every rank raises here):
        the path closes on every rank, as for calls that differ
        (``closing_reason``), since one rank may have skipped a call of the same kind
        and met the next; the owner's clean-up runs as for a desync."""
        message = f"{exc}; {closing_reason(self.what, None, None, [])}"
        note = self._desync_hook(message) if self._desync_hook is not None else ""
        self._close_in_step(message)
        return DesyncError(message + note)

    def _close_in_step(self, reason: str) -> None:
        """Every rank closes this path at the same call, for the same ``reason`` (the
        ranks' calls can no longer be brought back in step): later calls raise
        ``ClosedError`` naming it. No rank leaves (``PhaseLines.leave``): none will
        wait for another again, and a peer still on its way out of the last barrier
        would take the lowered counter for a rank gone."""
        if self._failure is None:
            self._failure = reason

    def _one_piece(
        self, lines: PhaseLines, tensor: torch.Tensor, turn: WayTurn | None = None
    ) -> tuple[SlotSegment, int]:
        """Copy ``tensor`` (one piece, any strides) into this rank's slot of the next
        set, publish, wait for every rank: returns the slots and the set now readable."""
        slots = self._slots
        assert slots is not None  # enabled means mapped
        gen = self._next_generation()
        s = gen & 1
        slots.shaped(s, self.rank_in_group, tensor.dtype, tensor.shape).copy_(tensor)
        self._first_arrive(lines, 2 * gen - 1, turn)
        return slots, s

    @staticmethod
    def _first_arrive(lines: PhaseLines, phase: int, turn: WayTurn | None) -> None:
        """A call's first barrier; a timed call's ``turn`` hears that it passed."""
        lines.arrive(phase)
        if turn is not None:
            turn.passed_first_barrier()

    def _empty_barrier(self, lines: PhaseLines) -> None:
        """An empty collective is still a collective: one barrier keeps every rank's
        calls in step (and checks them), so calls can never pair up shifted."""
        with self._desync_guard:
            gen = self._next_generation()
            lines.arrive(2 * gen - 1)

    def check_queue_wait(
        self, operation: str, writing: bool, peers: list[int], ready: Callable[[], bool]
    ) -> None:
        """Run now and then while this rank waits in the group's message queue or a
        point-to-point channel on in-group ``peers``: the writer, for a reader
        (``writing`` False); for the writer (a broadcast's, or a send's before the
        first chunk of its call is written), the readers that have not read the
        chunk it needs. ``operation``: a call of ``shm_phases.QUEUE_CALLS`` (others
        are not checked). When every one of them sleeps at the first barrier of the
        next collective of this group, or (but for a broadcast's writer) of another group of this
        process (say the world group's barrier, where it waits in a TP group's queue), and
        neither this process nor theirs runs another thread that could make a call
        (``threads.only_caller``), they wait for
        each other for ever (that collective needs this rank, which waits in the
        queue, and the other way round), unless what this rank waits for came just
        before they went to wait (``ready()``, the wait's own test, asked once more
        after theirs: until 2026-11-29 a receive whose message came in that gap
        joined its sender's barrier, and both raised ``DesyncError`` on a right
        program, now and then under load): this rank then joins that barrier with its
        queue call as its call, so every rank of that group raises ``DesyncError``
        naming both, in step, and the group closes on every rank (one side made a
        call the other did not: ``PhaseLines._check_agreement``); the queue call
        raises it too, having consumed nothing. With another thread in any of those
        processes the wait goes on (that thread may yet make the call, write or
        read)."""
        lines = self._lines
        if (
            lines is None
            or self._failure is not None
            or operation not in QUEUE_CALLS
            or not peers
            or not only_caller()
        ):
            return
        broadcast = operation.startswith("broadcast")
        code = queue_code(
            operation, self.rank_in_group if writing and broadcast else peers[0], writing
        )
        if all(lines.waits_alone_at(r, 2 * self.generation + 1) for r in peers):
            there: ShmBase = self
        elif writing and broadcast:
            # Not another group's call: the readers' unread broadcasts would stay in
            # this group's queue (a mismatch found here drops them, one there not).
            # A send's earlier messages are whole calls that returned: they stay.
            return
        else:
            _, others = _others_of(lines)
            pids = [lines.pids[r] for r in peers]
            found = next(
                (b for b in others if all(_in_next_call(b, p, True) is not None for p in pids)),
                None,
            )
            if found is None:
                return
            there = found
        if ready():  # after their waits were seen: what came before them shows now
            return
        with there.call_lock:
            there._empty_barrier(there._start(operation, None, None, bare=(code, 0)))

    def _cross_into(self, there: ShmBase, stuck: list[int]) -> None:
        """This rank's call waits for ``stuck`` (global ranks), which wait for it in
        the next call of group ``there`` (``_check_crossed``): join that call, stamped
        as this one, so every rank of ``there`` raises ``DesyncError`` and goes on in
        step; this call ends with ``CrossedCallsError``, having left this group."""
        lines = self._lines
        assert lines is not None
        code, count = lines.current_stamp()
        me = self.ranks[self.rank_in_group]
        waiting = describe_call(code, count)
        # Leave this group first: a peer released by the join must find this rank
        # gone from here, not still at this call's barrier (a next call of its own
        # there would meet this one's stamp, or, the same call, pass with it).
        lines.leave()
        note = ""
        try:
            with there.call_lock:
                joined = (elsewhere_code(code), count)
                there._empty_barrier(
                    there._start(f"{lines.operation} of {self.what}", None, None, bare=joined)
                )
        except DesyncError as exc:
            note = f"; {there.what} raised DesyncError on every rank and stays usable: {exc}"
        raise CrossedCallsError(
            f"{self.what}: rank {me} waits in {waiting} (call #{lines.calls}) for rank(s) "
            f"{stuck}, which wait for it in {there.what}'s next call: the ranks make the "
            f"two groups' calls in different orders; {self.what} is closed on this rank{note}"
        )

    def _next_generation(self) -> int:
        assert self._lines is not None
        self.generation += 1
        self._lines.generation = self.generation
        return self.generation

    @one_at_a_time
    def suspend(self) -> None:
        """Sleep mode: unmap the segment (its name is long gone, so the pages are
        freed once every rank unmapped) and refuse tensors until :meth:`resume`."""
        if self.disabled_reason is not None:
            return  # disabled, closed or already suspended: nothing mapped
        self._release()
        self.disabled_reason = SUSPENDED
        self._suspended = True

    @one_at_a_time
    def resume(self, group: ProcessGroup) -> None:
        """Map a fresh segment through ``group`` (collective, like the constructor)."""
        if not self._suspended:
            return
        self._suspended = False
        self.disabled_reason = None
        self.generation = 0
        try:
            self._set_up(group, self._local_refusal(get_config().disable_shm_all_reduce))
        except BaseException:
            self.disabled_reason = "set-up failed on resume"
            raise

    def close(self) -> None:
        """Unmap (not collective). Call it only when no call is in progress: a wait in
        another thread must end first (``abandon``)."""
        with self.call_lock:
            self.disabled_reason = self.disabled_reason or "closed"
            self._suspended = False
            self._release()

    def abandon(self, reason: str) -> None:
        """From another thread: end the call in progress (it raises ``ClosedError`` naming
        ``reason``) and refuse the ones after; then ``close`` once it returned."""
        self._failure = reason
        if self._lines is not None:
            self._lines.abandon(reason)

    def _view(self, s: int, r: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        assert self._slots is not None  # enabled means mapped
        return self._slots.view(s, r, dtype, n)

    def _release(self) -> None:
        self.small.attach(None)
        self.peer_reads = None
        self._lines = None
        if self._slots is not None:
            self._slots.close()
            self._slots = None
