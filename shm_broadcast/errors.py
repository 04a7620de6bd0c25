"""Exception types shared by every groupcoord package.

All derive from :class:`GroupcoordError`; each also derives from the built-in
exception a caller would naturally catch (``TimeoutError``, ``ConnectionError``,
``ValueError`` ...). ``device_communicators.errors`` and ``coordinator.errors``
re-export these and add their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class GroupcoordError(Exception):
    """Base of every exception groupcoord raises on purpose."""

    # A receive's: raised after it took its message (from a ring, a channel or the
    # wire): a message that did not decode, or a ``DesyncError`` refusing what came.
    # A group counts the message as received (``shm_phases.Traffic``).
    taken: bool = False


class GroupcoordTimeoutError(GroupcoordError, TimeoutError):
    """A bounded wait passed its deadline.

    ``what`` names the queue or group, ``operation`` the call, ``role`` the side
    that waited and ``missing`` the ranks that did not arrive (read, write, join).
    ``transport_error`` is the transport's own exception when one was translated.
    """

    transport_error: BaseException | None = None

    def __init__(
        self,
        what: str,
        operation: str,
        timeout_s: float,
        missing: Iterable[int] = (),
        role: str = "",
        detail: str = "",
    ) -> None:
        self.what = what
        self.operation = operation
        self.timeout_s = timeout_s
        self.missing = sorted(missing)
        self.role = role
        parts = [f"{what}: {operation} timed out after {timeout_s:g} s"]
        if role:
            parts.append(f"as {role}")
        if self.missing:
            parts.append(f"waiting for ranks {self.missing}")
        message = " ".join(parts)
        if detail:
            message += f" ({detail})"
        super().__init__(message)


class PeerDiedError(GroupcoordError, ConnectionError):
    """A peer process this side was waiting on is gone (pid or heartbeat).

    ``transport_error`` is the transport's own exception when one was translated.
    """

    transport_error: BaseException | None = None

    def __init__(self, what: str, operation: str, dead: Iterable[int], detail: str = "") -> None:
        self.what = what
        self.operation = operation
        self.dead = sorted(dead)
        message = f"{what}: {operation} failed: peer rank(s) {self.dead} died"
        if not self.dead:  # the transport lost a peer, and nothing names one
            message = (
                f"{what}: {operation} failed: a peer closed its connection, though none is "
                "known dead (a call of its own may have failed first and closed its end)"
            )
        if detail:
            message += f" ({detail})"
        super().__init__(message)


class PeerLeftError(PeerDiedError):
    """A peer this side was waiting on is alive but out of the group for good: a call
    of its own ended part-way there (interrupted, timed out, failed), so it will not
    take part again. ``dead`` names those ranks."""

    def __init__(self, what: str, operation: str, left: Iterable[int], detail: str = "") -> None:
        super().__init__(what, operation, left, detail)
        message = (
            f"{what}: {operation} failed: peer rank(s) {self.dead} left the group part-way "
            "through a call of theirs and will not take part again"
        )
        self.args = (f"{message} ({detail})" if detail else message,)


class ProtocolError(GroupcoordError):
    """Bytes that do not decode, or a peer that broke the protocol."""

    # When the bytes were a message but a value in it could not be rebuilt (an
    # undeclared class, a constructor that refused its fields): the message as
    # plain values, extension values left as ``msgspec.msgpack.Ext``, so that the
    # caller can still take what travels after it (a tensor dict's tensors).
    outline: Any = None


class GroupcoordValueError(GroupcoordError, ValueError):
    """An argument with a bad value (shape, size, rank, dim ...)."""


class DesyncError(GroupcoordValueError):
    """Ranks of a group called different collectives (operation, dtype, size, op or
    root) as the same call; raised on every rank before any result is returned."""

    # A point-to-point receive's: the message that came instead, when it was not a
    # tensor (decoded, or its bytes), so a caller that knows more of the protocol
    # can take what its sender sends after it (a tensor dict's tensors).
    received: Any = None


class GroupcoordTypeError(GroupcoordError, TypeError):
    """An argument of a type that cannot work (dtype, object kind ...)."""


class UndeclaredTypeError(ProtocolError, GroupcoordTypeError):
    """A received message holds a class the receiver has not declared with
    ``add_safe_types``: refused (a hostile message, or a missing declaration)."""


class ShmSpaceError(GroupcoordError, OSError):
    """Shared memory cannot hold the segment asked for."""


class BackendUnavailableError(GroupcoordError, RuntimeError):
    """A back end cannot run here; ``reason`` says why (no GPU, no library ...)."""

    def __init__(self, backend: str, reason: str) -> None:
        self.backend = backend
        self.reason = reason
        super().__init__(f"{backend} is unavailable: {reason}")


class TransportError(GroupcoordError, RuntimeError):
    """A call failed with no peer dead or late: the transport (Gloo, NCCL) failed
    a collective every rank reached, or the call failed on this rank alone (a
    torch op it ran) while its peers did not. The message names the group, the
    operation, the error and the ranks that did not fail with it."""


class ClosedError(GroupcoordError, RuntimeError):
    """The object was shut down or destroyed and cannot be used any more."""


class CrossedCallsError(ClosedError):
    """Two ranks each wait for the other in a collective of a different group (they
    make the two groups' calls in different orders). Raised from the call of one
    group, which is closed on this rank; the other group raised ``DesyncError`` on
    every rank and stays usable. The message names both calls and both groups."""


class NotSupportedError(GroupcoordError, NotImplementedError):
    """An optional capability that this back end lacks; names both."""

    def __init__(self, capability: str, backend: str, message: str = "") -> None:
        self.capability = capability
        self.backend = backend
        super().__init__(message or f"{capability} is not implemented for back end {backend}")

    @classmethod
    def by_groupcoord(cls, name: str, why: str) -> NotSupportedError:
        """The one error for a vLLM 0.33 name that groupcoord keeps but does not implement."""
        return cls(name, "groupcoord", f"{name} is not supported by groupcoord: {why}")


def unsupported(name: str, why: str) -> Any:
    """A stand-in for a contract function we do not implement: it raises
    :meth:`NotSupportedError.by_groupcoord` and says so in ``__groupcoord_unsupported__``
    (the compatibility table reads it)."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError.by_groupcoord(name, why)

    stand_in.__name__ = stand_in.__qualname__ = name.rsplit(".", 1)[-1]
    stand_in.__doc__ = f"Not supported by groupcoord: {why}"
    stand_in.__groupcoord_unsupported__ = why  # type: ignore[attr-defined]
    return stand_in
