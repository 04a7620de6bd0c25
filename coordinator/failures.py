"""What went wrong in a failed collective: which ranks never arrived, timeout or death.

Only a failing collective pays for this. Peers on this host are checked by
pid first (their pids were exchanged when the group was built): a dead one
is named at once. Otherwise each rank that reached the collective posts its
arrival to torch's default TCPStore under the collective's sequence number
(every rank of a group counts the same calls), then waits a short grace for
the others' posts; those that never post did not arrive (absent, slow, or
on another host and dead). The success path costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import torch.distributed as dist

from shm_broadcast.gloo_errors import failure_kind
from shm_broadcast.liveness import dead_peers

from .errors import GroupcoordError, GroupcoordTimeoutError, PeerDiedError, TransportError


def ends_part_way(exc: BaseException, noted: BaseException | None) -> bool:
    """Whether ``exc`` marks a call as ended part-way on this rank, out of step with
    its peers for good: anything that is not an ``Exception`` (a signal handler's
    ``KeyboardInterrupt`` or ``SystemExit``: an ``Exception`` of ours is raised in
    step, or names what failed), unless another one was ``noted`` first (the same
    one leaving an enclosing call is, so that call is named)."""
    return not isinstance(exc, Exception) and (noted is None or noted is exc)


class PartWay:
    """Around a call of several steps (a length, then its bytes; a header, then its
    data): whatever leaves the block is handed to ``mark(operation, exc)``, which
    decides whether the call ended part-way (a plain class: no generator per call).
    With a ``lock``, the block holds it: no other thread's call comes between the
    steps."""

    __slots__ = ("lock", "mark", "operation")

    def __init__(
        self,
        mark: Callable[[str, BaseException], None],
        operation: str,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        self.mark, self.operation, self.lock = mark, operation, lock

    def __enter__(self) -> None:
        if self.lock is not None:
            self.lock.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is not None:
                self.mark(self.operation, exc)
        finally:
            if self.lock is not None:
                self.lock.__exit__(kind, exc, tb)


def absent_ranks(
    group_name: str,
    seq: int,
    rank_in_group: int,
    ranks: list[int],
    timeout_s: float,
    local_pids: dict[int, int],
) -> tuple[list[int] | None, bool]:
    """(global ranks that did not arrive at collective ``seq``, whether they are known dead).

    A dead local peer ends the wait at once. The list is None when the store
    cannot be reached (its host died) and no local peer is dead; empty when
    every rank arrived (they all failed in this call).
    """
    dead = dead_peers(local_pids)
    if dead:
        return dead, True
    try:
        store = dist.PrefixStore(
            f"groupcoord/{group_name}/arrived/{seq}/",
            dist.distributed_c10d._get_default_store(),
        )
        store.set(str(rank_in_group), "1")
        # Ranks that arrived within the grace of this one fail within it too;
        # a rank later than that did not arrive within the deadline.
        deadline = time.monotonic() + min(5.0, max(0.5, timeout_s / 2))
        while True:
            dead = dead_peers(local_pids)
            if dead:
                return dead, True
            missing = [r for i, r in enumerate(ranks) if not store.check([str(i)])]
            if not missing or time.monotonic() > deadline:
                return missing, False
            time.sleep(0.05)
    except RuntimeError:
        dead = dead_peers(local_pids)
        return (dead, True) if dead else (None, False)


def classify(
    what: str,
    operation: str,
    timeout_s: float,
    missing: list[int] | None,
    exc: BaseException,
    known_dead: bool = False,
) -> GroupcoordError:
    """A dead peer, a timeout or the transport's own failure, from what we know
    (``missing``: as :func:`absent_ranks` says) and the transport's message (first
    line)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    kind = failure_kind(exc)
    if missing is None:
        text += "; which ranks is unknown (the store did not answer)"
        missing = []
    elif not known_dead and kind is None:
        # No transport words say a peer went, and none is known dead: not a dead
        # peer (which this used to report). Every rank reached the call and failed
        # in it, or this rank failed on its own (a torch op the call ran, say)
        # while the others did not (they returned, or met another call).
        if not missing:
            return TransportError(
                f"{what}: {operation} failed on every rank alike, none dead or late: {text}"
            )
        return TransportError(
            f"{what}: {operation} failed on this rank: {text} (no peer is known dead; "
            f"rank(s) {missing} did not fail in this call)"
        )
    if known_dead:
        return PeerDiedError(what, operation, missing, detail=text)
    if kind == "timeout":
        return GroupcoordTimeoutError(what, operation, timeout_s, missing, detail=text)
    return PeerDiedError(what, operation, missing, detail=text)
