"""Gloo's failures as groupcoord errors naming the group, the call and the peers.

``torch.distributed`` on Gloo reports a deadline passed or a vanished peer as
a bare ``RuntimeError`` ("Timed out waiting 500ms for recv operation to
complete", "Connection closed by peer"). Every ``torch.distributed`` call in
``shm_broadcast`` and ``device_communicators`` runs inside :func:`gloo_errors`,
which turns those two kinds into :class:`GroupcoordTimeoutError` and
:class:`PeerDiedError`. The peers named are the ones that could be missing:
the one peer of a point-to-point call; for a collective the group's other
ranks, or only those known dead when their pids are known (same host and pid
namespace). Any other ``RuntimeError`` (c10d refusing an argument) passes
through unchanged. The translated error keeps Gloo's exception in
``transport_error`` so a layer that knows more (the coordinator's arrival
records) can diagnose it again. The success path costs one ``try``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .config import get_config
from .errors import GroupcoordError, GroupcoordTimeoutError, PeerDiedError
from .liveness import dead_peers

__all__ = ["failure_kind", "gloo_errors", "group_timeout_s", "translate_gloo_error"]

# Gloo and c10d texts for a peer whose connection went away.
_PEER_GONE = ("closed by peer", "connection reset", "broken pipe", "connection refused")
_GLOO_WAIT = re.compile(r"timed out waiting (\d+)\s*ms", re.IGNORECASE)


def failure_kind(exc: BaseException) -> str | None:
    """``"timeout"`` or ``"peer gone"`` from a transport error's text, else None."""
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(marker in text for marker in _PEER_GONE):
        return "peer gone"
    return None


def group_timeout_s(pg: Any, exc: BaseException | None = None) -> float:
    """The deadline ``pg``'s calls run under, seconds (its options, Gloo's text, or the config)."""
    try:
        import torch

        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        pass  # not a Gloo group, or a torch without these internals
    found = _GLOO_WAIT.search(str(exc)) if exc is not None else None
    return int(found.group(1)) / 1000 if found else get_config().timeout_s


def _other_ranks(pg: Any) -> list[int]:
    import torch.distributed as dist

    me = dist.get_rank()
    return [r for r in dist.get_process_group_ranks(pg) if r != me]


def translate_gloo_error(
    exc: BaseException,
    what: str,
    operation: str,
    pg: Any,
    peers: Iterable[int] | None = None,
    pids: Mapping[int, int] | None = None,
    *,
    timeout_s: float | None = None,
) -> GroupcoordError | None:
    """Our error for Gloo's ``exc``, or None when it is neither a timeout nor a lost peer.

    ``peers`` (global ranks) are those the call waited on, by default the
    group's other ranks; ``pids`` maps global ranks on this host (same pid
    namespace) to their pids, so the dead among ``peers`` can be named.
    ``timeout_s``: the call's own deadline, when it had one (else ``pg``'s).
    """
    if isinstance(exc, GroupcoordError):
        return None
    kind = failure_kind(exc)
    if kind is None:
        return None
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    waited = sorted(peers) if peers is not None else _other_ranks(pg)
    dead = dead_peers(pids, waited) if pids else []
    error: GroupcoordError
    if dead:
        error = PeerDiedError(what, operation, dead, detail=first)
    elif kind == "timeout":
        seconds = group_timeout_s(pg, exc) if timeout_s is None else timeout_s
        error = GroupcoordTimeoutError(what, operation, seconds, waited, detail=first)
    else:
        if len(waited) > 1:
            first += "; which of these ranks is unknown (no pid on this host shows it dead)"
        error = PeerDiedError(what, operation, waited, detail=first)
    error.transport_error = exc
    return error


@contextlib.contextmanager
def gloo_errors(
    what: str,
    operation: str,
    pg: Any,
    peers: Iterable[int] | None = None,
    pids: Mapping[int, int] | None = None,
    *,
    timeout_s: float | None = None,
) -> Iterator[None]:
    """Run torch.distributed calls on ``pg``; Gloo timeouts and lost peers raise our errors.

    Arguments as in :func:`translate_gloo_error`.
    """
    try:
        yield
    except RuntimeError as exc:
        error = translate_gloo_error(exc, what, operation, pg, peers, pids, timeout_s=timeout_s)
        if error is None:
            raise
        raise error from exc
