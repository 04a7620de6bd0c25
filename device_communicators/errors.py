"""Exception types of the device communicators (re-exports the common ones)."""

from __future__ import annotations

from shm_broadcast.errors import (
    BackendUnavailableError,
    ClosedError,
    CrossedCallsError,
    DesyncError,
    GroupcoordError,
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
    NotSupportedError,
    PeerDiedError,
    PeerLeftError,
    ProtocolError,
    TransportError,
    unsupported,
)

__all__ = [
    "BackendUnavailableError",
    "ClosedError",
    "CrossedCallsError",
    "DesyncError",
    "GroupcoordError",
    "GroupcoordTimeoutError",
    "GroupcoordTypeError",
    "GroupcoordValueError",
    "NotSupportedError",
    "PeerDiedError",
    "PeerLeftError",
    "ProtocolError",
    "TransportError",
    "unsupported",
]
