"""POSIX shared-memory segments that are never left behind.

Every segment groupcoord creates is named ``groupcoord_<pid>_<tag>_<token>`` in
the configured shm directory (``/dev/shm`` on Linux). The creator unlinks it on
``unlink()``, on error and at interpreter exit (after which no thread of the
process may create one: it would outlive the clean-up); :func:`cleanup_stale_segments`
removes those whose creator pid is gone (a SIGKILLed writer, say), and
:func:`sweep_stale_segments` runs it before the first segment a process creates.

We do not use ``multiprocessing.shared_memory``: its resource tracker unlinks
segments when an *attaching* process exits, and it cannot reserve the pages up
front. Here creation reserves every page with ``posix_fallocate`` so a full
tmpfs is refused at creation with a clear message instead of a SIGBUS later.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import multiprocessing.util
import os
import re
import secrets
import threading
from collections.abc import Callable
from typing import TypeVar

from .config import get_config
from .errors import ClosedError, GroupcoordValueError, ShmSpaceError
from .liveness import pid_namespace, process_alive

logger = logging.getLogger("groupcoord.shm_broadcast")
T = TypeVar("T")

SEGMENT_PREFIX = "groupcoord_"
# groupcoord_<creator pid>_<tag>_<random>[n<creator pid namespace>]: the namespace
# tells whether the pid can be checked from here (containers sharing /dev/shm,
# e.g. docker --ipc=host, have pids of their own).
_NAME_RE = re.compile(r"^groupcoord_(\d+)_[A-Za-z0-9]+_[0-9a-f]+(?:n(\d+))?$")

_owned_lock = threading.Lock()
_owned: dict[str, int] = {}  # segment name -> creating pid
# The process whose exit cleanup (_cleanup_at_exit) has run: it creates no more.
_exited_pid: int | None = None
_swept_pid: int | None = None  # the process that last ran sweep_stale_segments


def shm_path(name: str) -> str:
    return os.path.join(get_config().shm_dir, name)


def shm_free_bytes(shm_dir: str | None = None) -> int:
    """Bytes free in the shm directory (``shm_dir``, default the configured one) right now."""
    st = os.statvfs(get_config().shm_dir if shm_dir is None else shm_dir)
    return st.f_bavail * st.f_frsize


def check_shm_free_space(
    required_bytes: int,
    shm_path: str | None = None,
    *,
    allocation_name: str = "shared-memory allocation",
) -> None:
    """Raise :class:`ShmSpaceError` (an ``OSError``) when ``shm_path`` (default the
    configured shm directory) has fewer than ``required_bytes`` free (vLLM's name)."""
    where = get_config().shm_dir if shm_path is None else shm_path
    free = shm_free_bytes(where)
    if required_bytes > free:
        raise ShmSpaceError(
            f"cannot create a {required_bytes} byte {allocation_name}: {where} has only "
            f"{free} bytes free (enlarge it, e.g. docker --shm-size, or ask for a smaller buffer)"
        )


def smaller_where_no_room(
    make: Callable[[int], T], usual: int, small: int, what: str, unit: str
) -> tuple[T, int]:
    """``make(usual)``, or where shared memory has no room for it (``ShmSpaceError``:
    a container's 64 MiB /dev/shm) ``make(small)``, logged; and the size taken. How
    our own buffers (a queue's ring, a group's slots) shrink to fit; ``ShmSpaceError``
    when even the small one does not fit. ``unit`` names the size in the log."""
    try:
        return make(usual), usual
    except ShmSpaceError as exc:
        if small >= usual:
            raise
        logger.warning(
            "%s: %s; taking %d %s instead of %d (give /dev/shm more room, e.g. "
            "docker --shm-size=1g)",
            what,
            exc,
            small,
            unit,
            usual,
        )
        return make(small), small


class ShmSegment:
    """One mapped segment; ``buf`` is a writable memoryview over all of it."""

    def __init__(self, name: str, mapping: mmap.mmap, created: bool) -> None:
        self.name = name
        self.size = len(mapping)
        self.created = created
        self.views_outstanding = False
        self._mmap: mmap.mmap | None = mapping
        self.buf: memoryview = memoryview(mapping)

    @classmethod
    def create(cls, nbytes: int, tag: str = "seg") -> ShmSegment:
        """Create, reserve and map a new segment of ``nbytes`` bytes."""
        if nbytes <= 0:
            raise GroupcoordValueError(f"segment size must be positive, got {nbytes}")
        if not tag.isalnum():
            raise GroupcoordValueError(f"segment tag must be alphanumeric, got {tag!r}")
        if _swept_pid != os.getpid():
            sweep_stale_segments()  # first, so that what a killed run left frees its room
        check_shm_free_space(nbytes, allocation_name="shared-memory segment")
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{tag}_{secrets.token_hex(6)}n{pid_namespace()}"
        path = shm_path(name)
        _hook_exit()
        with _owned_lock:  # the name is made and owned in one step the exit cleanup sees whole
            if _exited_pid == os.getpid():
                # A thread still running after the exit cleanup (a daemon, between
                # atexit and the interpreter's end) would leave this one behind.
                raise ClosedError(f"this process is exiting: no new {tag} segment")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            _owned[name] = os.getpid()
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise ShmSpaceError(
                    f"cannot reserve {nbytes} bytes of shared memory in "
                    f"{get_config().shm_dir}: {exc.strerror}"
                ) from exc
            mapping = mmap.mmap(fd, nbytes)
        except BaseException:
            _unlink_name(name)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping, created=True)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        """Map an existing segment by name."""
        if not _NAME_RE.match(name):
            raise GroupcoordValueError(f"not a groupcoord segment name: {name!r}")
        fd = os.open(shm_path(name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mapping, created=False)

    def close(self) -> None:
        """Drop our mapping (idempotent); memory stays mapped while views of it live.

        ``torch.frombuffer(seg.buf)`` keeps a reference to ``buf`` but no buffer
        export, so releasing ``buf`` here would let ``mmap.close()`` unmap memory
        under live tensors (a segfault on the next read). We only drop our own
        reference: if a tensor or array still holds ``buf`` (or a slice of it),
        its export makes ``mmap.close()`` refuse and the OS unmaps the pages
        when the last view dies.
        """
        if self._mmap is None:
            return
        self.buf = memoryview(b"")
        try:
            self._mmap.close()
        except BufferError:
            self.views_outstanding = True
        self._mmap = None

    def unlink(self) -> None:
        """Remove the name (creator only; idempotent)."""
        _unlink_name(self.name)

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.created:
            self.unlink()


def _unlink_name(name: str) -> None:
    with _owned_lock:
        _owned.pop(name, None)
    try:
        os.unlink(shm_path(name))
    except FileNotFoundError:
        return


def unlink_segment(name: str) -> None:
    """Remove a segment by name, e.g. one a dead writer left (idempotent)."""
    if not _NAME_RE.match(name):
        raise GroupcoordValueError(f"not a groupcoord segment name: {name!r}")
    _unlink_name(name)


def cleanup_owned_segments() -> int:
    """Unlink every segment this process created and still holds; returns how many."""
    pid = os.getpid()
    with _owned_lock:
        names = [n for n, owner in _owned.items() if owner == pid]
    for name in names:
        _unlink_name(name)
    return len(names)


def cleanup_stale_segments() -> list[str]:
    """Unlink our segments whose creating process no longer exists. Only segments
    made in this pid namespace are judged: another's pids mean nothing here."""
    removed: list[str] = []
    try:
        entries = os.listdir(get_config().shm_dir)
    except FileNotFoundError:
        return removed
    here = str(pid_namespace())
    for entry in entries:
        match = _NAME_RE.match(entry)
        if match and match.group(2) == here and not process_alive(int(match.group(1))):
            try:
                _unlink_name(entry)
            except PermissionError:  # another user's, in a sticky /dev/shm: theirs to remove
                logger.debug("cannot remove %s of a dead process: not ours", entry)
                continue
            removed.append(entry)
    return removed


def sweep_stale_segments() -> list[str]:
    """:func:`cleanup_stale_segments` with a warning naming what it removed: run by
    ``init_distributed_environment`` and before the first segment a process creates,
    so what a killed run left neither lingers nor takes the room this one needs."""
    global _swept_pid
    _swept_pid = os.getpid()
    removed = cleanup_stale_segments()
    if removed:
        logger.warning(
            "removed %d shared-memory segment(s) of dead processes: %s", len(removed), removed
        )
    return removed


def list_segments() -> list[str]:
    """Names of all groupcoord segments present now (any creator)."""
    try:
        entries = os.listdir(get_config().shm_dir)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if _NAME_RE.match(e))


def _cleanup_at_exit() -> None:
    """This process's exit: unlink what it owns, and refuse to create segments from
    here on (a thread that goes on running would otherwise leave them behind)."""
    global _exited_pid
    with _owned_lock:
        _exited_pid = os.getpid()
    cleanup_owned_segments()


atexit.register(_cleanup_at_exit)
_exit_hook_pid: int | None = None


def _hook_exit() -> None:
    """Once per process that creates a segment: unlink what it still owns at
    multiprocessing's exit too, which a worker it started runs instead of atexit
    (lowest priority: after the hooks that deliver pending messages)."""
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        multiprocessing.util.Finalize(None, _cleanup_at_exit, exitpriority=0)
