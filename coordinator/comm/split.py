"""``Comm.split``: carve a child communicator out of a parent, collectively.

Every parent rank passes the list of ranks it wants to share a child with
(empty: it joins none). The lists are all-gathered over the parent as one
int64 tensor, so every rank sees every request and reaches the same verdict:
either all groups are consistent (each member of a list passed that same
list) and each child is built on its own store prefix, or every rank raises
the same error naming the disagreement, instead of some ranks hanging.
"""

from __future__ import annotations

import datetime
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
    parent: CommOps, mine: list[int], timeout: float | datetime.timedelta | None
) -> list[list[int]]:
    size = parent.get_size()
    row = torch.full((size,), -1, dtype=torch.int64)
    row[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    table = torch.empty((size, size), dtype=torch.int64)
    parent.all_gather_single(table, row, timeout=timeout)
    return [[r for r in table[i].tolist() if r >= 0] for i in range(size)]


def _disagreement(requests: list[list[int]]) -> str | None:
    for i, wanted in enumerate(requests):
        for member in wanted:
            if requests[member] != wanted:
                return (
                    f"rank {i} asked for {wanted} but rank {member} asked for "
                    f"{requests[member]}; every member of a child must pass the same list"
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
    requests = _requests(parent, mine, timeout)
    seq = parent._split_count
    parent._split_count += 1
    problem = _disagreement(requests)
    if problem is not None:
        raise GroupcoordValueError(f"split {name!r} of {parent.get_name()!r}: {problem}")
    if not mine:
        return None
    members = "-".join(str(r) for r in mine)
    prefix = f"{parent._prefix}/split{seq}/{name}/{members}"
    return prefix, mine, timeout_s, {**parent._hints, **checked_hints}
