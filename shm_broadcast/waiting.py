"""How a process waits on shared memory: the one wait loop, futex sleep and wake,
and the one memory fence.

Every wait on a flag or counter another process writes (the queue's ring, the
shared-memory collectives' control lines, a window's signals, an async
operation) goes through :func:`wait_until`: it yields the core for a short
while (``SPIN_S``), then sleeps, either on a futex the writer rings (the
caller passes ``sleep``) or in short growing naps. It never busy-polls: on a
machine with fewer cores than ranks a pure spin starves the very process it
waits for (50 busy polls before each yield measured 25% slower at 4 KiB,
world 2, on a loaded 2-core machine, and no faster when it was quiet). Peer checks run on a slower clock than the ready test, and the
deadline is checked on every sleep.

Futex words are shared (not ``FUTEX_PRIVATE``): the word lives in a segment
several processes map. A sleeper and its waker follow one handshake, on both
sides a store, a full fence, then a load::

    sleeper: read bell; asleep = 1; fence; if not ready: futex_wait(bell)
    waker:   publish;   fence; if asleep: bell += 1; futex_wake(bell)

so either the waker sees "asleep" or the sleeper sees the published state,
and a ring between the sleeper's read of the bell and its wait makes the
wait return at once (the value changed).

Memory ordering. x86-64 (TSO) keeps stores in order and loads in order, so
the data-then-flag protocols need no fence there (``needs_fence`` is False);
only the sleep/wake handshake needs StoreLoad order, which
:func:`memory_fence` (a full barrier on every machine) gives. On weaker
machines (Arm, POWER, RISC-V) ``needs_fence`` is True and the protocols call
:func:`memory_fence` at their release/acquire points.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import platform
import threading
import time
from collections.abc import Callable

from .config import get_config

__all__ = [
    "SPIN_S",
    "StallCheck",
    "futex_available",
    "futex_wait",
    "futex_wake",
    "memory_fence",
    "needs_fence",
    "wait_until",
]

logger = logging.getLogger("groupcoord.shm_broadcast")

# What a queue or channel wait calls at its liveness checks to find the peers
# it waits on waiting for this rank elsewhere (``ShmBase.check_queue_wait``):
# with those peers' ranks and the wait's own test, which it asks once more
# before it acts (what was awaited may have come just before they went to wait).
StallCheck = Callable[[list[int], Callable[[], bool]], None]

# Yield-spin this long before sleeping: a peer a few to a few hundred
# microseconds behind is met without a sleep, a long idle wait stops using a
# core. Measured on 2 loaded cores, 1 writer + 3 readers of small tensors:
# 2 ms of spinning gave 10-15k msgs/s (waiting readers starve the writer),
# 0.5 ms gave ~60k.
SPIN_S = 0.0005
_FIRST_NAP_S = 0.00005
_MAX_NAP_S = 0.0005
_FIRST_CHECK_S = 0.05  # the first peer check of a wait, then peer_check_interval_s

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
needs_fence = not _X86


def _make_fence() -> Callable[[], None]:
    if not _X86:
        path = ctypes.util.find_library("atomic")
        if path:
            fence = ctypes.CDLL(path).atomic_thread_fence
            fence.argtypes = [ctypes.c_int]
            fence.restype = None
            return lambda: fence(5)  # memory_order_seq_cst: dmb ish / sync
        logger.warning("libatomic not found: using a lock acquire/release as the memory fence")
    # CPython's lock acquire and release are lock-prefixed atomic instructions
    # (glibc semaphores): full barriers on x86-64. The lock is never contended.
    lock = threading.Lock()

    def lock_fence() -> None:
        lock.acquire()
        lock.release()

    return lock_fence


memory_fence = _make_fence()
memory_fence.__doc__ = "A full memory barrier (StoreLoad included), as vLLM's ``memory_fence``."


# ---- futex ---------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "AMD64": 202}.get(platform.machine())
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()


def futex_available() -> bool:
    """Whether futex calls work here (Linux x86-64 with a loadable libc)."""
    return _syscall is not None


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``address`` equals ``expected``, at most ``timeout_s``.

    Returns on a wake, on a changed value, on the timeout or on a signal; the
    caller re-checks its condition in every case.
    """
    assert _syscall is not None and _SYS_FUTEX is not None
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    rc = _syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_int(expected),
        ctypes.byref(ts),
        None,
        ctypes.c_int(0),
    )
    if rc == -1:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(err, f"futex wait failed: {errno.errorcode.get(err, err)}")


def futex_wake(address: int) -> None:
    """Wake every task sleeping on the int32 at ``address``."""
    assert _syscall is not None and _SYS_FUTEX is not None
    rc = _syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(_WAKE_ALL),
        None,
        None,
        ctypes.c_int(0),
    )
    if rc == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake failed: {errno.errorcode.get(err, err)}")


# ---- the wait loop -------------------------------------------------------------------


def wait_until(
    ready: Callable[[], bool],
    deadline: float,
    *,
    quick_check: Callable[[], None] | None = None,
    slow_check: Callable[[], None] | None = None,
    on_timeout: Callable[[], BaseException] | None = None,
    sleep: Callable[[float], None] | None = None,
    spin_s: float = SPIN_S,
) -> bool:
    """Wait until ``ready()`` or the monotonic ``deadline``; True once ready.

    ``quick_check`` (a flag: shut down? abandoned?) runs every few polls and
    ``slow_check`` (are the peers alive?) every ``peer_check_interval_s``;
    either stops the wait by raising. At the deadline ``on_timeout()`` is
    raised, or without one False is returned. After ``spin_s`` of yielding the
    wait sleeps: ``sleep(at_most_s)`` when given (a futex the writer rings; it
    is never asked to sleep past the next check or the deadline), else naps
    of 50 us growing to 0.5 ms.
    """
    if ready():
        return True
    interval = get_config().peer_check_interval_s
    start = time.monotonic()
    next_slow = start + min(interval, _FIRST_CHECK_S)
    nap = _FIRST_NAP_S
    spins = 0
    spinning = True
    yield_ = os.sched_yield
    while not ready():
        spins += 1
        if spinning and spins & 31:
            yield_()
            continue
        now = time.monotonic()
        if now >= deadline:
            if ready():
                return True
            if on_timeout is None:
                return False
            raise on_timeout()
        if quick_check is not None:
            quick_check()
        if now >= next_slow:
            if slow_check is not None:
                slow_check()
            next_slow = now + interval
        if spinning and now - start < spin_s:
            yield_()
            continue
        spinning = False
        if sleep is not None:
            sleep(max(min(next_slow, deadline) - now, 1e-4))
        else:
            time.sleep(nap)
            nap = min(nap * 2, _MAX_NAP_S)
    return True
