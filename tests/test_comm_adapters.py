"""Communicators borrowed from existing groups: a torch ProcessGroup and a GroupCoordinator."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from coordinator.comm import comm_from_group, comm_from_process_group
from coordinator.errors import GroupcoordTypeError
from coordinator.group_coordinator import GroupCoordinator
from coordinator.launch import init_gloo, run_ranks


def _borrowed(rank: int, world_size: int) -> str:
    init_gloo(rank, world_size)
    # In-group ranks: a subgroup of the odd ranks, reversed in the world.
    odds = [r for r in range(world_size) if r % 2 == 1]
    sub = dist.new_group(odds)
    if rank in odds:
        comm = comm_from_process_group(sub, "odds", timeout=30)
        assert comm.get_rank() == odds.index(rank) and comm.get_size() == len(odds)
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, async_op=True).wait()
        assert t.item() == sum(odds)
        comm.finalize()
        # The borrowed group keeps working after the communicator is done.
        t = torch.ones(1)
        dist.all_reduce(t, group=sub)
        assert t.item() == len(odds)

    group = GroupCoordinator([list(range(world_size))], rank, "gloo", False, group_name="world")
    comm = comm_from_group(group)
    assert comm.get_name() == group.unique_name
    assert comm.get_options().timeout_s == group.timeout_s
    child = comm.split(list(reversed(range(world_size))), "rev")
    assert child is not None and child.get_rank() == world_size - 1 - rank
    slots = torch.empty(world_size)
    comm.all_gather_single(slots, torch.tensor([float(rank)]))
    assert slots.tolist() == [float(r) for r in range(world_size)]
    child.finalize()
    comm.finalize()
    assert group.all_reduce(torch.ones(2)).tolist() == [world_size] * 2
    group.destroy()
    with pytest.raises(GroupcoordTypeError, match="ProcessGroup"):
        comm_from_process_group("world", "x")  # type: ignore[arg-type]
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_communicators_on_existing_groups(world_size: int) -> None:
    assert run_ranks(_borrowed, world_size, timeout=90) == ["ok"] * world_size
