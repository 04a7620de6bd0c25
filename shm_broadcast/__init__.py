"""Single-writer multi-reader message queue over shared memory and ZeroMQ."""

from __future__ import annotations

from .config import GroupcoordConfig, get_config, override, set_config
from .errors import (
    BackendUnavailableError,
    ClosedError,
    GroupcoordError,
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
    PeerDiedError,
    ProtocolError,
    ShmSpaceError,
)
from .segments import ShmSegment, cleanup_owned_segments, cleanup_stale_segments

__all__ = [
    "BackendUnavailableError",
    "ClosedError",
    "GroupcoordConfig",
    "GroupcoordError",
    "GroupcoordTimeoutError",
    "GroupcoordTypeError",
    "GroupcoordValueError",
    "PeerDiedError",
    "ProtocolError",
    "ShmSegment",
    "ShmSpaceError",
    "cleanup_owned_segments",
    "cleanup_stale_segments",
    "get_config",
    "override",
    "set_config",
]
