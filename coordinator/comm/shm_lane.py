"""The order in which a communicator's shared-memory operations run.

A shared-memory collective is a sequence of barriers between ranks, so a rank
must run its calls in the order it issued them, whether each was issued
asynchronously or not (one rank may wait where its peer does not). The lane
keeps that order: asynchronous calls go to one worker thread, in order; a
synchronous call runs on the caller's thread when nothing is queued before
it (the common, fast case) and waits its turn otherwise.

The back end is released (``close``, given by its owner: the device
communicator's ``destroy``) only when no call is inside it: ``close`` from
an abort first makes the call in progress give up (``ShmAllReduce.abandon``),
and whichever thread leaves the back end last releases it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from device_communicators.shm_all_reduce import ShmAllReduce

from ..errors import GroupcoordTimeoutError, PeerDiedError
from .work import Work

Run = Callable[[ShmAllReduce], None]
T = TypeVar("T")
_SETTLE_GRACE_S = 0.5


class ShmLane:
    """Runs ``Run`` callables on one ``ShmAllReduce`` in issue order."""

    def __init__(
        self,
        name: str,
        shm: ShmAllReduce,
        on_failure: Callable[[str], None],
        close: Callable[[], None],
    ) -> None:
        self._name = name
        self.shm = shm
        self._release = close  # releases shm (and whatever else its owner holds)
        self._on_failure = on_failure  # told the op name when a peer is late or dead
        self._lock = threading.Lock()
        self._queued: list[Work] = []  # issued asynchronously, not yet finished
        self._inside = 0  # calls running in the back end right now
        self._close_when_idle = False
        self._jobs: queue.SimpleQueue[tuple[Work, Run] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, work: Work, run: Run, async_op: bool) -> None:
        """Run ``run`` for ``work`` (settling it), now or in turn."""
        with self._lock:
            behind_others = bool(self._queued)
            if async_op or behind_others:
                self._queued.append(work)
            else:
                self._inside += 1  # close() cannot unmap under this call now
        if not (async_op or behind_others):
            self._settle(work, run, inline=True)
            return
        # The lane ends the call by the op's deadline with the precise error (the
        # ranks that did not arrive); wait() gives it that moment to arrive.
        work.settle_grace_s = _SETTLE_GRACE_S
        self._start_thread()
        self._jobs.put((work, run))
        if not async_op:
            work.wait()

    def run_now(self, op: str, timeout_s: float, call: Callable[[], T | None]) -> T | None:
        """``call()`` on the caller's thread, its waits bounded by ``timeout_s``, when
        nothing is queued before it (a small synchronous call's lean path), else None
        without calling it."""
        with self._lock:
            if self._queued or self._close_when_idle:
                return None
            self._inside += 1
        try:
            self.shm.set_timeout(timeout_s)
            return call()
        except (GroupcoordTimeoutError, PeerDiedError):
            self._on_failure(op)
            raise
        finally:
            self._leave(None)

    def _settle(self, work: Work, run: Run, inline: bool) -> None:
        try:
            # The op's deadline counts from its issue, however long it queued.
            self.shm.set_timeout(work.timeout_s, deadline=work.deadline)
            run(self.shm)
        except (GroupcoordTimeoutError, PeerDiedError) as exc:
            if isinstance(exc, GroupcoordTimeoutError):
                work._expire()  # TIMED_OUT, and the comm is told through the work
            self._on_failure(work.op)
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
            self._inside -= 1
            if work is not None and work in self._queued:
                self._queued.remove(work)
            if self._close_when_idle and self._inside == 0:
                self._release()  # under the lock: close() cannot abandon an unmapped one

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._serve, name=f"groupcoord-{self._name}-shm", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, run = job
            with self._lock:
                closing = self._close_when_idle
                if not closing:
                    self._inside += 1
            if closing:
                work.abort()  # closed before its turn came
                continue
            self._settle(work, run, inline=False)

    def close(self, abandon: str | None = None) -> None:
        """Stop taking calls and unmap once none is inside. Without ``abandon`` the
        queued works finish first (each within its deadline); with it (an abort) they
        become ABORTED and the call in progress gives up at once."""
        if abandon is None:
            with self._lock:
                queued = list(self._queued)
            for work in queued:
                work._wait_done(max(0.0, work.deadline - time.monotonic()) + 1.0)
        with self._lock:
            queued = list(self._queued)
            self._close_when_idle = True
            if self._inside == 0:
                self._release()
            elif abandon is not None:
                self.shm.abandon(abandon)
        for work in queued:
            work.abort()
        self._jobs.put(None)
