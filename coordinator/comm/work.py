"""Work handles: what every :class:`~coordinator.comm.Comm` operation returns.

A :class:`Work` is settled (results final, or an error recorded) by the
communicator's :class:`Completer`, which also runs the finishing step of an
emulated operation (AVG division, copy-out of a staged result) before it
marks the work done. The caller's thread never blocks unless it calls
:meth:`Work.wait`, which waits for that until the operation's own deadline.
"""

from __future__ import annotations

import datetime
import enum
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shm_broadcast.gloo_errors import translate_gloo_error
from shm_broadcast.waiting import wait_until

from ..errors import (
    ClosedError,
    GroupcoordError,
    GroupcoordTimeoutError,
    PeerDiedError,
    ProtocolError,
)

# The completer waits on a c10d work this much longer than the operation's
# deadline, so the caller's own timeout (named, with peers) fires first.
_COMPLETER_GRACE_S = 2.0


# Guards the finish of every Work against a waiter making its event at that moment.
_EVENT_LOCK = threading.Lock()


class WorkStatus(enum.Enum):
    INPROGRESS = "inprogress"
    COMPLETED = "completed"
    TIMED_OUT = "timed_out"
    ERROR = "error"
    ABORTED = "aborted"


class Work:
    """Handle on one operation; ``wait()`` returns once its results are final."""

    def __init__(
        self,
        comm_name: str,
        op: str,
        peers: Sequence[int],
        timeout_s: float,
        on_failure: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.comm_name = comm_name
        self.op = op
        self.peers = sorted(set(peers))
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        # Told (op, late) once when the op timed out (late) or lost a peer: after
        # either the ranks may disagree on what comes next (the comm closes).
        self._on_failure = on_failure
        # Done flag; the event a waiter blocks on is made only when someone has to wait
        # (most works finish inline, and an Event costs ~2 us to make).
        self._finished = False
        self._event: threading.Event | None = None
        self._error: BaseException | None = None
        self._status = WorkStatus.INPROGRESS
        self._poll: Callable[[], bool] | None = None
        # How long past the deadline wait() still waits for the work's own error
        # (set by a runner that ends the op by the deadline itself).
        self.settle_grace_s = 0.0
        # Set by the communicator: rank -> pid of the peers on this host, so a
        # failure can name the dead among them.
        self.local_pids: Mapping[int, int] | None = None
        # Called once the work is finished (a batch counts its parts with it).
        self._then: Callable[[Work], None] | None = None

    # -- how a work finishes ------------------------------------------------
    @classmethod
    def completed(cls, comm_name: str, op: str, peers: Sequence[int] = ()) -> Work:
        work = cls(comm_name, op, peers, timeout_s=1.0)
        work._finish(None)
        return work

    @classmethod
    def polled(
        cls,
        comm_name: str,
        op: str,
        peers: Sequence[int],
        timeout_s: float,
        poll: Callable[[], bool],
    ) -> Work:
        """A work that is done when ``poll()`` says so (a window signal, say)."""
        work = cls(comm_name, op, peers, timeout_s)
        work._poll = poll
        return work

    def _finish(self, error: BaseException | None) -> None:
        with _EVENT_LOCK:
            if self._finished:
                return
            self._error = error
            if self._status is WorkStatus.INPROGRESS:
                self._status = WorkStatus.COMPLETED if error is None else WorkStatus.ERROR
            self._finished = True
            event = self._event
        if event is not None:
            event.set()
        if self._then is not None:
            self._then(self)

    def _wait_done(self, seconds: float) -> bool:
        """Block until finished or ``seconds`` passed; True when finished."""
        if self._finished:
            return True
        with _EVENT_LOCK:
            if self._finished:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(seconds)

    def abort(self) -> None:
        """Mark an unfinished work ABORTED (its communicator was aborted)."""
        if self._finished:
            return
        if self.status is WorkStatus.TIMED_OUT:
            self._finish(self.timeout_error())  # stays TIMED_OUT: that is what happened
            return
        self._status = WorkStatus.ABORTED
        self._finish(ClosedError(f"{self._what()}: {self.op} aborted"))

    # -- what callers see ---------------------------------------------------
    @property
    def status(self) -> WorkStatus:
        if not self._finished:
            self._check_poll()
        if not self._finished and time.monotonic() >= self.deadline:
            self._expire()
        return self._status

    def _expire(self) -> None:
        """The op's own deadline passed unfinished: TIMED_OUT, and tell the comm once."""
        if self._status is WorkStatus.INPROGRESS:
            self._status = WorkStatus.TIMED_OUT
            if self._on_failure is not None:
                self._on_failure(self.op, True)

    def _failed(self, error: BaseException) -> None:
        """``error`` ended the op: a timeout expires it, a dead peer tells the comm."""
        if isinstance(error, GroupcoordTimeoutError):
            self._expire()
        elif isinstance(error, PeerDiedError) and self._on_failure is not None:
            self._on_failure(self.op, False)

    def is_completed(self) -> bool:
        """True once the results are final (or the work failed)."""
        self._check_poll()
        return self._finished

    def wait_blocking(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block the calling thread until done (torchcomms' name; on CPU, where no
        stream is involved, the same as :meth:`wait`)."""
        return self.wait(timeout)

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until done; raise if it failed or passed its deadline.

        ``timeout`` shortens (never extends) the wait below the op's deadline;
        if only that shorter wait runs out, the error says so and the op stays
        in flight (INPROGRESS): wait again later. Passing the op's own deadline
        makes it TIMED_OUT.
        """
        deadline = self.deadline
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if timeout is not None:
            deadline = min(deadline, time.monotonic() + timeout)
        else:
            deadline += self.settle_grace_s
        if self._poll is not None:
            self._spin(deadline)
        else:
            self._wait_done(max(0.0, deadline - time.monotonic()))
        if not self._finished:
            if time.monotonic() < self.deadline:
                raise GroupcoordTimeoutError(
                    self._what(),
                    f"wait() on {self.op}",
                    float(timeout or 0.0),
                    missing=self.peers,
                    detail="the op is still in flight until its own deadline; wait again",
                )
            self._expire()
            raise self.timeout_error()
        if self._error is not None:
            raise self._error
        return True

    def timeout_error(self) -> GroupcoordTimeoutError:
        return GroupcoordTimeoutError(
            self._what(),
            self.op,
            self.timeout_s,
            missing=self.peers,
            detail="the ranks listed are this op's peers; abort() the communicator",
        )

    def _what(self) -> str:
        return f"communicator {self.comm_name!r}"

    def _check_poll(self) -> None:
        if self._poll is not None and not self._finished and self._poll():
            self._finish(None)

    def _spin(self, deadline: float) -> None:
        wait_until(lambda: self._finished or bool(self._poll and self._poll()), deadline)
        self._check_poll()

    def __repr__(self) -> str:
        return f"Work({self.op} on {self.comm_name!r}, {self.status.value})"


def translate_error(work: Work, exc: BaseException) -> BaseException:
    """Our error for a failed c10d work (``shm_broadcast.gloo_errors``, the one
    translation), keeping Gloo's text; anything else is a ``ProtocolError``."""
    if isinstance(exc, GroupcoordError):
        return exc
    error: BaseException | None = translate_gloo_error(
        exc, work._what(), work.op, None, work.peers, work.local_pids, timeout_s=work.timeout_s
    )
    if error is None:
        error = ProtocolError(f"{work._what()}: {work.op} failed: {str(exc).strip()}")
    work._failed(error)
    error.__cause__ = exc
    return error


def _wait_all(
    work: Work, c10d_works: Sequence[Any], finish: Callable[[], None] | None, grace_s: float
) -> None:
    """Wait on every c10d work (bounded by the op's deadline), finish, settle ``work``."""
    left = max(0.0, work.deadline - time.monotonic()) + grace_s
    try:
        for c10d_work in c10d_works:
            c10d_work.wait(datetime.timedelta(seconds=left))
        if finish is not None:
            finish()
    except Exception as exc:  # noqa: BLE001 - handed to the caller through wait()
        work._finish(translate_error(work, exc))
        return
    work._finish(None)


class Completer:
    """Finishes a communicator's works without making one wait behind another.

    Most Gloo collectives return an AsyncWork with a future: its done-callback
    (on Gloo's thread) runs the finishing step and settles the Work. Gloo's
    reduce_scatter works have no future and complete only inside ``wait()``
    (``completes_in_wait``), so each asynchronous one gets its own
    short-lived daemon thread (sends and receives run on their pair's lane).
    A blocking op of either kind is finished on the caller's thread. Works never queue behind each other, so
    an async recv that waits on the peer cannot delay an unrelated
    all_reduce's completion.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._outstanding: set[Work] = set()

    @staticmethod
    def run_inline(
        work: Work, c10d_works: Sequence[Any], finish: Callable[[], None] | None
    ) -> None:
        _wait_all(work, c10d_works, finish, grace_s=0.0)

    def track(
        self,
        work: Work,
        c10d_works: Sequence[Any],
        finish: Callable[[], None] | None,
        completes_in_wait: bool,
    ) -> None:
        with self._lock:
            self._outstanding.add(work)
        if completes_in_wait:
            threading.Thread(
                target=self._wait_in_thread,
                args=(work, c10d_works, finish),
                name=f"groupcoord-{self._name}-{work.op}",
                daemon=True,
            ).start()
        else:
            self._chain_futures(work, c10d_works, finish)

    def _wait_in_thread(
        self, work: Work, c10d_works: Sequence[Any], finish: Callable[[], None] | None
    ) -> None:
        _wait_all(work, c10d_works, finish, _COMPLETER_GRACE_S)
        self._settled(work)

    def _chain_futures(
        self, work: Work, c10d_works: Sequence[Any], finish: Callable[[], None] | None
    ) -> None:
        lock = threading.Lock()
        remaining = [len(c10d_works)]

        def on_done(future: Any) -> None:
            try:
                future.value()  # re-raises the c10d error, if any
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if not last:
                    return
                if finish is not None:
                    finish()
            except Exception as exc:  # noqa: BLE001 - handed to the caller through wait()
                work._finish(translate_error(work, exc))
            else:
                work._finish(None)
            self._settled(work)

        for c10d_work in c10d_works:
            c10d_work.get_future().add_done_callback(on_done)

    def _settled(self, work: Work) -> None:
        with self._lock:
            self._outstanding.discard(work)

    def abort_outstanding(self) -> None:
        with self._lock:
            outstanding = list(self._outstanding)
        for work in outstanding:
            work.abort()

    def drain(self) -> None:
        """Wait for the outstanding works, each bounded by its own deadline."""
        with self._lock:
            outstanding = list(self._outstanding)
        for work in outstanding:
            work._wait_done(max(0.0, work.deadline - time.monotonic()) + _COMPLETER_GRACE_S)
