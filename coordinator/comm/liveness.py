"""Which peers of a communicator are still alive, for error messages that name the dead.

At creation every rank shares (host id, pid). When Gloo reports a closed
connection we cannot tell from its text which rank went away, but for peers on
this host a look at /proc can: a pid that is gone or a zombie (killed, not yet
reaped by its parent) is dead. Peers on other hosts cannot be checked this way.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Iterable

from shm_broadcast.liveness import process_alive as pid_alive


def host_id() -> int:
    """A number equal on every process of this host (crc32 of the hostname)."""
    return zlib.crc32(socket.gethostname().encode())


class PeerLiveness:
    """Pids of the peers on this host, by comm rank."""

    def __init__(self, local_pids: dict[int, int]) -> None:
        self.local_pids = local_pids

    def dead(self, ranks: Iterable[int]) -> list[int]:
        """The ranks among ``ranks`` known to be dead (only same-host ones can be known)."""
        return [r for r in ranks if r in self.local_pids and not pid_alive(self.local_pids[r])]
