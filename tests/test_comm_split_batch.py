"""Comm.split (ordered, disjoint, empty, overlapping lists) and batched P2P ring exchange."""

from __future__ import annotations

import pytest
import torch

from coordinator.comm import Comm, new_comm
from coordinator.errors import ClosedError, GroupcoordValueError
from coordinator.launch import run_ranks


def _parent_ranks(child: Comm, parent_rank: int) -> list[int]:
    out = torch.empty(child.get_size(), dtype=torch.int64)
    child.all_gather_single(out, torch.tensor([parent_rank]))
    return out.tolist()


def _splits(rank: int, world_size: int) -> str:
    parent = new_comm("gloo", "cpu", "parent", timeout=30)
    w = world_size

    # Ordered: child rank order follows the list, not the parent's order.
    reversed_ranks = list(reversed(range(w)))
    child = parent.split(reversed_ranks, "reversed")
    assert child is not None and child.get_rank() == w - 1 - rank
    assert _parent_ranks(child, rank) == reversed_ranks

    # Disjoint groups, each listed in descending order.
    mine = sorted((q for q in range(w) if q % 2 == rank % 2), reverse=True)
    child = parent.split(mine, "parity", hints={"kind": "parity"})
    assert child is not None and child.get_size() == len(mine)
    assert _parent_ranks(child, rank) == mine
    assert child.get_options().hints == {"kind": "parity"}
    t = torch.tensor([float(rank)])
    child.all_reduce(t)
    assert t.item() == sum(mine)

    # Empty list: that rank joins no child.
    wanted = [] if rank == 0 else list(range(1, w))
    child = parent.split(wanted, "without0")
    if rank == 0:
        assert child is None
    else:
        assert child is not None and child.get_size() == w - 1
        # A split of a split works and is independent of the parent.
        grandchild = child.split([child.get_rank()], "alone")
        assert grandchild is not None and grandchild.get_size() == 1

    # Overlapping lists that disagree: every rank raises the same error, nobody hangs.
    wanted = [0, 1] if rank == 0 else list(range(1, w))
    with pytest.raises(GroupcoordValueError, match="rank 0 asked for \\[0, 1\\] but rank 1"):
        parent.split(wanted, "overlap")

    # Disjoint children may have names of their own (the parity split above, named
    # alike, now named by parity); members of one child that name it differently all
    # raise at once, naming both (until 2026-11-29 each waited at its own name until
    # the timeout, "not yet at the group's creation").
    child = parent.split(mine, f"parity{rank % 2}")
    assert child is not None and child.get_size() == len(mine)
    with pytest.raises(GroupcoordValueError, match="rank 0 named the child of .* 'n0' but rank 1"):
        parent.split(list(range(w)), f"n{rank}")

    # A list without the caller, and a rank listed twice, raise before anything is sent.
    with pytest.raises(GroupcoordValueError, match="does not include this rank"):
        parent.split([(rank + 1) % w], "notme")
    with pytest.raises(GroupcoordValueError, match="twice"):
        parent.split([rank, rank], "dup")
    with pytest.raises(GroupcoordValueError, match="out of range"):
        parent.split([rank, w], "range")

    # The parent is still usable after all that.
    t = torch.ones(1)
    parent.all_reduce(t)
    assert t.item() == w
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_ordered_disjoint_empty_overlapping(world_size: int) -> None:
    assert run_ranks(_splits, world_size, timeout=90) == ["ok"] * world_size


def _ring(rank: int, world_size: int) -> str:
    comm = new_comm("gloo", "cpu", "ring", timeout=30)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    n = 256 * 1024  # 1 MiB per message: blocking send-before-recv would stall here
    for async_op in (False, True):
        batch = comm.batch_op_create()
        from_left = torch.empty(n)
        from_right = torch.empty(n)
        batch.send(torch.full((n,), float(rank)), right)
        batch.send(torch.full((n,), 100.0 + rank), left)
        batch.recv(from_left, left)
        batch.recv(from_right, right)
        assert [(op.kind, op.peer) for op in batch.ops] == [
            ("send", right),
            ("send", left),
            ("recv", left),
            ("recv", right),
        ]
        work = batch.issue(async_op=async_op)
        work.wait()
        assert work.is_completed()
        assert torch.all(from_left == float(left))
        assert torch.all(from_right == 100.0 + right)
        with pytest.raises(ClosedError, match="already issued"):
            batch.issue()
    batch = comm.batch_op_create()
    with pytest.raises(GroupcoordValueError, match="dst="):
        batch.send(torch.ones(1), rank)
    assert batch.issue().is_completed()  # an empty batch is trivially done
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_batch_ring_exchange_does_not_deadlock(world_size: int) -> None:
    assert run_ranks(_ring, world_size, timeout=90) == ["ok"] * world_size
