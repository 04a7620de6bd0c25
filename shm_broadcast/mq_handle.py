"""What a reader needs to join a MessageQueue, and the queue's socket addresses.

A :class:`Handle` is plain data (a msgspec Struct): the writer exports it and
it travels to the readers without pickle. Local readers connect a ZeroMQ
``ipc://`` socket named after the ring for ``wait_until_ready``'s handshake;
its file is removed by the writer on shutdown, by a reader that finds the
writer dead, or by :func:`cleanup_stale_ipc_files` when its creator is gone.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile

import msgspec

from .liveness import pid_namespace, process_alive

__all__ = ["Handle", "cleanup_stale_ipc_files", "default_ip", "ipc_path", "remove_ipc_file"]

_IPC_PREFIX = "groupcoord_mq_"
# Named after the ring: groupcoord_<creator pid>_ring_<token>n<pid namespace>.
_IPC_RE = re.compile(r"^groupcoord_mq_groupcoord_(\d+)_ring_[0-9a-f]+n(\d+)\.sock$")


class Handle(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a reader needs to join a queue (plain data; travels without pickle)."""

    name: str
    n_reader: int
    local_reader_ranks: list[int]
    writer_rank: int
    writer_pid: int
    writer_host: str
    max_chunk_bytes: int
    max_chunks: int
    buffer_name: str | None
    local_address: str | None
    remote_address: str | None
    key: bytes
    window: int
    allow_pickle: bool

    # vLLM 0.33's field names, read from ours.
    @property
    def buffer_handle(self) -> tuple[int, int, int, str] | None:
        """(local readers, chunk bytes, chunks, ring name), or None without local readers."""
        if self.buffer_name is None:
            return None
        return (
            len(self.local_reader_ranks),
            self.max_chunk_bytes,
            self.max_chunks,
            self.buffer_name,
        )

    @property
    def local_subscribe_addr(self) -> str | None:
        return self.local_address

    @property
    def remote_subscribe_addr(self) -> str | None:
        return self.remote_address

    @property
    def remote_addr_ipv6(self) -> bool:
        return self.remote_address is not None and "[" in self.remote_address

    @property
    def local_notify_addr(self) -> str | None:
        """None: local readers are woken through the ring, not a notify socket."""
        return None

    @property
    def tensor_arena_handle(self) -> None:
        """None: there is no separate tensor arena (see ``enable_shm_tensor_arena``)."""
        return None


def default_ip() -> str:
    """This host's outward interface address (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def ipc_path(ring_name: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{_IPC_PREFIX}{ring_name}.sock")


def remove_ipc_file(address: str | None) -> None:
    if address and address.startswith("ipc://"):
        try:
            os.unlink(address[len("ipc://") :])
        except FileNotFoundError:
            return


def cleanup_stale_ipc_files() -> list[str]:
    """Remove handshake socket files whose creating process is gone (named after its ring)."""
    removed = []
    namespace = pid_namespace()
    folder = tempfile.gettempdir()
    for entry in os.listdir(folder):
        match = _IPC_RE.match(entry)
        # A pid of another pid namespace cannot be judged from here: left alone.
        if match and int(match.group(2)) == namespace and not process_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(folder, entry))
            except FileNotFoundError:
                continue
            removed.append(entry)
    return removed
