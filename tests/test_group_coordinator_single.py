"""A group of one rank answers every call locally, in the same shapes as larger groups."""

from __future__ import annotations

import torch

from coordinator.group_coordinator import GroupCoordinator
from coordinator.launch import init_gloo, run_ranks


def _single_rank_group(rank: int, world_size: int) -> list[str]:
    init_gloo(rank, world_size)
    group = GroupCoordinator([[0]], rank, "gloo", False, group_name="ep")
    hidden, logits = torch.ones(3, 4), torch.zeros(3, 2)
    extra = torch.arange(3.0)
    plain = group.dispatch_router_logits(hidden, logits)
    with_extra = group.dispatch_router_logits(hidden, logits, extra_tensors=[extra])
    combined = group.combine(hidden)
    summed = group.all_reduce(hidden)
    group.destroy()
    return [
        f"plain={len(plain)}",
        f"extra={len(with_extra)}:{type(with_extra[2]).__name__}:{len(with_extra[2])}",
        f"combine_same={combined is hidden}",
        f"all_reduce_equal={bool(torch.equal(summed, hidden))}",
    ]


def test_single_rank_dispatch_matches_the_managers_shape() -> None:
    # The all2all managers answer (hidden, logits) or (hidden, logits, [extras]).
    assert run_ranks(_single_rank_group, 1, timeout=60.0) == [
        [
            "plain=2",
            "extra=3:list:1",
            "combine_same=True",
            "all_reduce_equal=True",
        ]
    ]
