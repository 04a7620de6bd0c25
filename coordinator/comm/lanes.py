"""The order in which a communicator's shared-memory operations run.

A shared-memory collective is a sequence of barriers between ranks, and a
message on a channel is matched in the order it was sent, so a rank must run
such calls in the order it issued them, whether each was issued
asynchronously or not (one rank may wait where its peer does not). A
:class:`Lane` keeps that order: asynchronous calls go to one worker thread,
in order; a synchronous call runs on the caller's thread when nothing is
queued before it (the common, fast case) and waits its turn otherwise.

A communicator has one :class:`ShmLane` for its collectives and one lane per
(direction, peer) for its point-to-point calls (``p2p_lanes``), so a receive
waiting on a peer never holds up a collective or a send.

The collectives' back end is released (``close``, given by its owner: the
device communicator's ``destroy``) only when no call is inside it: ``close``
from an abort first makes the call in progress give up
(``ShmAllReduce.abandon``), and whichever thread leaves the back end last
releases it.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from device_communicators.shm_all_reduce import ShmAllReduce
from shm_broadcast.threads import register_helper_thread

from ..errors import GroupcoordTimeoutError, PeerDiedError
from .work import Work

LaneCall = Callable[[Work], None]
Run = Callable[[ShmAllReduce], None]
T = TypeVar("T")
_SETTLE_GRACE_S = 0.5


def _is_idle(lane: weakref.ref[Lane]) -> bool:
    """Whether ``lane`` has nothing queued or running (gone: nothing either)."""
    alive = lane()
    return alive is None or alive.idle


class Lane:
    """Runs calls (``call(work)``, which settles ``work``) in issue order.

    A call's work tells its comm when a peer was late or died (``Work._failed``).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        # Held while a call runs: two threads of the caller that issue at once run
        # their calls one after the other, never together (one channel, one set of slots).
        self._running = threading.Lock()
        self._queued: list[Work] = []  # issued asynchronously, not yet finished
        self._closing = False
        self._jobs: queue.SimpleQueue[tuple[Work, LaneCall] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # Hooks for a lane that owns a resource; each runs under the lock.
    def _admit(self) -> bool:
        """Whether a call may start now (and counts it in)."""
        return not self._closing

    def _left(self) -> None:
        """A call has left."""

    def _closed(self, abandon: str | None) -> None:
        """close() has stopped the lane taking calls."""

    @property
    def idle(self) -> bool:
        """Nothing is queued: a synchronous call now runs on the caller's thread."""
        return not self._queued

    def run(self, work: Work, call: LaneCall, async_op: bool) -> None:
        """Run ``call`` for ``work`` (settling it), now or in turn."""
        if not async_op and self.run_if_idle(work, call):
            return
        with self._lock:
            self._queued.append(work)
            self._start_thread()  # under the lock: one worker, whoever comes first
        # The lane ends the call by the op's deadline with the precise error (the
        # ranks that did not arrive); wait() gives it that moment to arrive.
        work.settle_grace_s = _SETTLE_GRACE_S
        self._jobs.put((work, call))
        if not async_op:
            work.wait()

    def run_if_idle(self, work: Work, call: LaneCall) -> bool:
        """Run ``call`` for ``work`` on the caller's thread when nothing is queued
        before it; False: something is, and nothing ran."""
        with self._lock:
            if self._queued:
                return False
            admitted = self._admit()
        if admitted:
            self._settle(work, call, inline=True)
        else:
            work.abort()  # closed meanwhile
            work.wait()  # raises that
        return True

    def _settle(self, work: Work, call: LaneCall, inline: bool) -> None:
        try:
            with self._running:
                call(work)
        except (GroupcoordTimeoutError, PeerDiedError) as exc:
            work._failed(exc)  # TIMED_OUT for a timeout; the comm is told
            if inline:
                raise
            work._finish(exc)
        except Exception as exc:  # noqa: BLE001 - handed to the caller through wait()
            if inline:
                raise
            work._finish(exc)
        else:
            work._finish(None)
        finally:
            self._leave(work)

    def _leave(self, work: Work | None) -> None:
        with self._lock:
            if work is not None and work in self._queued:
                self._queued.remove(work)
            self._left()

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._serve, name=f"groupcoord-{self._name}", daemon=True
        )
        # Idle, the thread cannot free a wait of this process's callers (threads.py).
        register_helper_thread(self._thread, functools.partial(_is_idle, weakref.ref(self)))
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, call = job
            with self._lock:
                admitted = self._admit()
            if not admitted:
                work.abort()  # closed before its turn came
                continue
            self._settle(work, call, inline=False)

    def close(self, abandon: str | None = None) -> None:
        """Stop taking calls. Without ``abandon`` the queued works finish first (each
        within its deadline); with it (an abort) they become ABORTED."""
        if abandon is None:
            with self._lock:
                queued = list(self._queued)
            for work in queued:
                work._wait_done(max(0.0, work.deadline - time.monotonic()) + 1.0)
        with self._lock:
            queued = list(self._queued)
            self._closing = True
            self._closed(abandon)
        for work in queued:
            work.abort()
        self._jobs.put(None)


class ShmLane(Lane):
    """The lane of one ``ShmAllReduce``: its calls are ``Run`` callables on it."""

    def __init__(
        self,
        name: str,
        shm: ShmAllReduce,
        on_failure: Callable[[str, bool], None],
        close: Callable[[], None],
    ) -> None:
        super().__init__(f"{name}-shm")
        # Told (op, late) when a peer was late or died in a call run without a
        # work (run_now); a work tells its own.
        self._on_failure = on_failure
        self.shm = shm
        self._release = close  # releases shm (and whatever else its owner holds)
        self._inside = 0  # calls running in the back end right now

    def _admit(self) -> bool:
        if self._closing:
            return False
        self._inside += 1  # close() cannot unmap under this call now
        return True

    def _left(self) -> None:
        self._inside -= 1
        if self._closing and self._inside == 0:
            self._release()  # under the lock: close() cannot abandon an unmapped one

    def _closed(self, abandon: str | None) -> None:
        if self._inside == 0:
            self._release()
        elif abandon is not None:
            self.shm.abandon(abandon)

    def run_shm(self, work: Work, run: Run, async_op: bool) -> None:
        """Run ``run(shm)`` for ``work``, now or in turn."""
        self.run(work, functools.partial(self._on_shm, run), async_op)

    def _on_shm(self, run: Run, work: Work) -> None:
        # The op's deadline counts from its issue, however long it queued.
        self.shm.set_timeout(work.timeout_s, deadline=work.deadline)
        run(self.shm)

    def run_now(self, op: str, timeout_s: float, call: Callable[[], T | None]) -> T | None:
        """``call()`` on the caller's thread, its waits bounded by ``timeout_s``, when
        nothing is queued before it (a small synchronous call's lean path), else None
        without calling it."""
        with self._lock:
            if self._queued or not self._admit():
                return None
        try:
            with self._running:  # whole: a call may take several steps (all_gather_v)
                self.shm.set_timeout(timeout_s)
                return call()
        except (GroupcoordTimeoutError, PeerDiedError) as exc:
            self._on_failure(op, isinstance(exc, GroupcoordTimeoutError))
            raise
        finally:
            self._leave(None)
