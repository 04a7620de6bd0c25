"""Linux futex wait/wake on a 32-bit word in shared memory, through ctypes.

A rank that has spun for a while without its peers arriving sleeps in the
kernel on a word of the shared segment, and the rank that arrives wakes it.
A woken task is scheduled ahead of busy ones, which is what keeps latency low
on a loaded machine where a yielding spinner can lose its core for
milliseconds. The futex calls are shared (not ``FUTEX_PRIVATE``): the word is
mapped by several processes.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import threading

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


def available() -> bool:
    """Whether futex calls work here (Linux x86-64 with a loadable libc)."""
    return _syscall is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
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


def wake(address: int) -> None:
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


_fence_lock = threading.Lock()


def full_fence() -> None:
    """A full memory barrier (StoreLoad included) from Python.

    x86-64 lets a load pass an earlier store to another address; the
    sleep/wake handshake (store "I sleep", then load the peers' counters, on
    one side; store the counter, then load "who sleeps", on the other) needs
    that order kept on both sides. CPython's lock acquire and release are
    ``lock``-prefixed atomic instructions (glibc semaphores), which are full
    barriers on x86-64; this lock is never contended.
    """
    _fence_lock.acquire()
    _fence_lock.release()
