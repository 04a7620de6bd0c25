"""Exception types of the coordinator (re-exports the common ones)."""

from __future__ import annotations

from device_communicators.errors import (
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
)

__all__ = [
    "AlreadyInitializedError",
    "BackendUnavailableError",
    "ClosedError",
    "CrossedCallsError",
    "DesyncError",
    "GroupcoordError",
    "GroupcoordTimeoutError",
    "GroupcoordTypeError",
    "GroupcoordValueError",
    "NotInitializedError",
    "NotSupportedError",
    "PeerDiedError",
    "PeerLeftError",
    "ProtocolError",
    "TransportError",
]


class AlreadyInitializedError(GroupcoordError, RuntimeError):
    """A second initialisation that disagrees with the first."""


class NotInitializedError(GroupcoordError, RuntimeError):
    """A group or state was used before it was initialised."""
