"""Which ranks of a group share this node's shared memory.

``in_the_same_node_as(pg, source_rank)`` proves it instead of guessing from
host names: the source creates a small segment holding a random token, every
other rank tries to attach it and read the token back, and the results are
gathered. Host names are gathered too, for the log and the error text.
"""

from __future__ import annotations

import logging
import secrets
import socket
from typing import Any

from .codec import dumps, loads
from .errors import DesyncError, GroupcoordValueError
from .group_io import all_gather_bytes, group_rank_and_size
from .segments import ShmSegment

__all__ = ["in_the_same_node_as"]

logger = logging.getLogger("groupcoord.shm_broadcast")

_TOKEN_BYTES = 16


def in_the_same_node_as(
    pg: Any,
    source_rank: int = 0,
    *,
    what: str = "process group",
    operation: str = "in_the_same_node_as",
    argument: str = "source_rank",
) -> list[bool]:
    """For each rank of ``pg`` (group order): does it share /dev/shm with ``source_rank``?

    ``what`` and ``operation`` name the caller in a timeout or lost-peer error.
    Ranks that pass different ``source_rank``s (the caller's ``argument``) raise
    ``DesyncError`` naming both, on every rank: each used to send as the source,
    and they waited on each other until the group's timeout.
    """
    rank, world_size = group_rank_and_size(pg)
    if isinstance(source_rank, bool) or not isinstance(source_rank, int):
        raise GroupcoordValueError(f"source_rank must be an int, got {source_rank!r}")
    if not 0 <= source_rank < world_size:
        raise GroupcoordValueError(
            f"source_rank={source_rank} is not a rank in a group of {world_size}"
        )
    segment: ShmSegment | None = None
    try:
        # Every rank says which source it names; the source adds its segment.
        announce = dumps((source_rank, None, None))
        if rank == source_rank:
            token = secrets.token_bytes(_TOKEN_BYTES)
            try:
                segment = ShmSegment.create(_TOKEN_BYTES, tag="topo")
            except OSError as exc:
                # No usable shared memory here (read-only, missing, full): no rank
                # shares any with the source, and its peers are told so.
                logger.warning(
                    "%s: rank %d cannot create shared memory (%s); its peers are taken "
                    "as on other nodes",
                    what,
                    source_rank,
                    exc,
                )
            else:
                segment.buf[:_TOKEN_BYTES] = token
                announce = dumps((source_rank, segment.name, token))
        # Gathered, not broadcast: every rank sees which source each rank named.
        announced = [
            loads(a) for a in all_gather_bytes(pg, announce, what=what, operation=operation)
        ]
        for r, (theirs, _, _) in enumerate(announced):
            if theirs != source_rank:
                raise DesyncError(
                    f"{what}: {operation}: rank {rank} of the group passed "
                    f"{argument}={source_rank}, rank {r} {argument}={theirs}: every rank "
                    "must pass the same"
                )
        _, name, token = announced[source_rank]
        same = rank == source_rank or (name is not None and _can_read_token(name, token))
        gathered = all_gather_bytes(
            pg, dumps((same, socket.gethostname())), what=what, operation=operation
        )
    finally:
        # Every rank has attached and closed before the gather returns, so the
        # source can remove the segment now (or on error, right away).
        if segment is not None:
            segment.close()
            segment.unlink()
    results = [loads(g) for g in gathered]
    logger.debug("same node as rank %d: %s", source_rank, results)
    return [bool(same) for same, _host in results]


def _can_read_token(name: str, token: bytes) -> bool:
    try:
        segment = ShmSegment.attach(name)
    except OSError:
        return False
    try:
        return bytes(segment.buf[: len(token)]) == token
    finally:
        segment.close()
