"""Exception types of the device communicators (re-exports the common ones)."""

from __future__ import annotations

from shm_broadcast.errors import (
    BackendUnavailableError,
    ClosedError,
    GroupcoordError,
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
    PeerDiedError,
    ProtocolError,
)

__all__ = [
    "BackendUnavailableError",
    "ClosedError",
    "GroupcoordError",
    "GroupcoordTimeoutError",
    "GroupcoordTypeError",
    "GroupcoordValueError",
    "NotSupportedError",
    "PeerDiedError",
    "ProtocolError",
]


class NotSupportedError(GroupcoordError, NotImplementedError):
    """An optional capability that this back end lacks; names both."""

    def __init__(self, capability: str, backend: str) -> None:
        self.capability = capability
        self.backend = backend
        super().__init__(f"{capability} is not implemented for back end {backend}")
