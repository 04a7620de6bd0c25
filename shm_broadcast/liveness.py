"""Is a peer process still there? One answer for every layer of groupcoord.

Pids compare only between processes of one host and one pid namespace; callers
check :func:`pid_namespace` (and the host) before judging a peer by its pid.
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Iterable, Mapping

__all__ = ["dead_peers", "host_key", "pid_namespace", "process_alive"]


# The kernel's per-task flag "getting shut down" (PF_EXITING, include/linux/sched.h),
# set as a process starts to exit: a SIGKILLed rank tears its memory down for
# tens to hundreds of milliseconds after that (a 2 GiB one here: 311 ms in states
# R and D before Z), closing its sockets meanwhile, so a peer's Gloo call fails
# while the process still looks alive by its state letter.
_PF_EXITING = 0x4


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a process that has begun to exit (``_PF_EXITING``) or
    a zombie (exited, not yet reaped by its parent) is dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user: look at its state below
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no procfs: the signal probe is all we have
    # The fields after the parenthesised command name (which may hold ") "): the
    # state letter first, the flags seventh.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[0] not in (b"Z", b"X") and not int(fields[6]) & _PF_EXITING


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 if unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def host_key() -> int:
    """Equal for two processes exactly when their pids compare (same host, boot and pid
    namespace): the identity every layer exchanges before judging a peer by its pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return zlib.crc32(f"{socket.gethostname()}|{boot}|{pid_namespace()}".encode())


def dead_peers(local_pids: Mapping[int, int], among: Iterable[int] | None = None) -> list[int]:
    """The ranks (keys of ``local_pids``: rank -> pid of a peer with this host key) whose
    process is gone, limited to ``among`` when given; sorted."""
    ranks = local_pids.keys() if among is None else [r for r in among if r in local_pids]
    return sorted(r for r in ranks if not process_alive(local_pids[r]))
