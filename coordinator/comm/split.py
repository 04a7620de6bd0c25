"""``Comm.split``: carve a child communicator out of a parent, collectively.

Every parent rank passes the list of ranks it wants to share a child with
(empty: it joins none) and the child's name. The lists, with a checksum of
each name, are all-gathered over the parent as one int64 tensor, so every
rank sees every request and reaches the same verdict: either all groups are
consistent (each member of a list passed that same list and name) and each
child is built on its own store prefix, or every rank raises the same error
naming the disagreement, instead of some ranks hanging.
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Mapping, Sequence

import torch

from device_communicators import checks

from ..errors import GroupcoordTypeError, GroupcoordValueError
from .core import timeout_seconds
from .ops import CommOps


def _check_ranks(ranks: Sequence[int], me: int, size: int) -> list[int]:
    if not isinstance(ranks, list | tuple):
        raise GroupcoordTypeError(f"ranks must be a list of ints, got {type(ranks).__name__}")
    checked = [checks.rank(r, f"ranks[{i}]", size) for i, r in enumerate(ranks)]
    if len(set(checked)) != len(checked):
        raise GroupcoordValueError(f"ranks {checked} lists a rank twice")
    if checked and me not in checked:
        raise GroupcoordValueError(
            f"ranks {checked} does not include this rank ({me}); pass [] to join no child"
        )
    return checked


def _requests(
    parent: CommOps, mine: list[int], name: str, timeout: float | datetime.timedelta | None
) -> tuple[list[list[int]], list[str]]:
    """Every rank's list and the name it gives its child. Each row carries the
    name's checksum and length; only when members' checksums differ do the names
    themselves travel (a second all-gather every rank makes alike)."""
    size = parent.get_size()
    said = name.encode()
    row = torch.full((size + 2,), -1, dtype=torch.int64)
    row[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    row[size], row[size + 1] = zlib.crc32(said), len(said)
    table = torch.empty((size, size + 2), dtype=torch.int64)
    parent.all_gather_single(table, row, timeout=timeout)
    rows = table.tolist()
    requests = [[r for r in row[:size] if r >= 0] for row in rows]
    names = [name] * size  # as far as this rank can tell: the checksums agree
    if any(row[size] != rows[0][size] for row in rows):
        width = max(row[size + 1] for row in rows)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: len(said)] = torch.frombuffer(bytearray(said), dtype=torch.uint8)
        joined = torch.empty((size, width), dtype=torch.uint8)
        parent.all_gather_single(joined, padded, timeout=timeout)
        names = [bytes(joined[i, : row[size + 1]].tolist()).decode() for i, row in enumerate(rows)]
    return requests, names


def _disagreement(requests: list[list[int]], names: list[str]) -> str | None:
    for i, wanted in enumerate(requests):
        for member in wanted:
            if requests[member] != wanted:
                return (
                    f"rank {i} asked for {wanted} but rank {member} asked for "
                    f"{requests[member]}; every member of a child must pass the same list"
                )
            if names[member] != names[i]:
                return (
                    f"rank {i} named the child of {wanted} {names[i]!r} but rank {member} "
                    f"named it {names[member]!r}; every member of a child must pass the same name"
                )
    return None


def split_members(
    parent: CommOps,
    ranks: Sequence[int],
    name: str,
    hints: Mapping[str, str] | None,
    timeout: float | datetime.timedelta | None,
) -> tuple[str, list[int], float, dict[str, str]] | None:
    """The child this rank joins, as (store prefix, its members' ranks in the parent
    in child order, timeout, hints); None when it joins none. ``Comm.split`` builds
    the child from it."""
    if not isinstance(name, str) or not name:
        raise GroupcoordValueError(f"name must be a non-empty str, got {name!r}")
    checked_hints = checks.hints(hints)
    timeout_s = timeout_seconds(timeout, parent._timeout_s)
    me = parent.get_rank()
    mine = _check_ranks(ranks, me, parent.get_size())
    requests, names = _requests(parent, mine, name, timeout)
    seq = parent._split_count
    parent._split_count += 1
    problem = _disagreement(requests, names)
    if problem is not None:
        raise GroupcoordValueError(f"split {name!r} of {parent.get_name()!r}: {problem}")
    if not mine:
        return None
    members = "-".join(str(r) for r in mine)
    prefix = f"{parent._prefix}/split{seq}/{name}/{members}"
    return prefix, mine, timeout_s, {**parent._hints, **checked_hints}
