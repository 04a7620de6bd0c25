"""Single-writer multi-reader message queue over shared memory and ZeroMQ."""

from __future__ import annotations

from .codec import add_safe_types, dumps, loads
from .config import GroupcoordConfig, get_config, override, set_config
from .errors import (
    BackendUnavailableError,
    ClosedError,
    CrossedCallsError,
    GroupcoordError,
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
    PeerDiedError,
    PeerLeftError,
    ProtocolError,
    ShmSpaceError,
)
from .group_io import ObjectGroup, all_gather_bytes, broadcast_bytes
from .message_queue import Handle, MessageQueue, cleanup_stale_ipc_files
from .ring import ShmRingBuffer, to_bytes_big
from .segments import (
    ShmSegment,
    check_shm_free_space,
    cleanup_owned_segments,
    cleanup_stale_segments,
)
from .spin_condition import SpinCondition
from .threads import declare_bystander_thread
from .topology import in_the_same_node_as
from .waiting import memory_fence

__all__ = [
    "add_safe_types",
    "BackendUnavailableError",
    "ClosedError",
    "CrossedCallsError",
    "GroupcoordConfig",
    "GroupcoordError",
    "GroupcoordTimeoutError",
    "GroupcoordTypeError",
    "GroupcoordValueError",
    "Handle",
    "MessageQueue",
    "ObjectGroup",
    "PeerDiedError",
    "PeerLeftError",
    "ProtocolError",
    "ShmRingBuffer",
    "ShmSegment",
    "ShmSpaceError",
    "SpinCondition",
    "all_gather_bytes",
    "broadcast_bytes",
    "check_shm_free_space",
    "declare_bystander_thread",
    "cleanup_owned_segments",
    "cleanup_stale_ipc_files",
    "cleanup_stale_segments",
    "dumps",
    "get_config",
    "in_the_same_node_as",
    "loads",
    "memory_fence",
    "override",
    "set_config",
    "to_bytes_big",
]
