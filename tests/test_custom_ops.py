"""Collective custom ops: fake shapes, lookup errors, and torch.compile without graph breaks."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from coordinator import custom_ops  # noqa: F401  (registers torch.ops.groupcoord)
from coordinator.errors import NotInitializedError
from coordinator.group_coordinator import GroupCoordinator
from coordinator.launch import init_gloo, run_ranks


def test_fake_implementations_give_output_shapes_without_a_group() -> None:
    ops = torch.ops.groupcoord
    with FakeTensorMode():
        x = torch.empty(4, 6)
        assert ops.all_reduce(x, "nowhere:0").shape == (4, 6)
        assert ops.all_gather(x, 1, 3, "nowhere:0").shape == (4, 18)
        assert ops.all_gatherv(x, 0, [4, 1, 0], "nowhere:0").shape == (5, 6)
        assert ops.reduce_scatter(x, 1, 2, "nowhere:0").shape == (4, 3)
        assert ops.reduce_scatterv(x, 0, [1, 3], 1, "nowhere:0").shape == (3, 6)
        assert ops.broadcast(x, 0, "nowhere:0").shape == (4, 6)


def test_an_unknown_group_name_raises_not_initialized() -> None:
    with pytest.raises(NotInitializedError, match="'nowhere:0' does not exist"):
        torch.ops.groupcoord.all_reduce(torch.ones(2), "nowhere:0")


def _compiled(rank: int, world_size: int) -> list[str]:
    init_gloo(rank, world_size)
    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="tp")
    graphs: list[str] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(str(gm.graph))
        return gm.forward

    def layer(x: torch.Tensor) -> torch.Tensor:
        y = g.all_reduce(x * 2)
        z = g.all_gather(y, dim=0)
        w = g.reduce_scatter(z, dim=0)
        v = g.all_gatherv(w, dim=1, sizes=[3] * world_size)
        u = g.reduce_scatterv(v, dim=1, sizes=[3] * world_size)
        return g.broadcast(u + 1, src=0)

    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) + rank
    eager = layer(x.clone())
    compiled = torch.compile(layer, fullgraph=True, backend=record)
    traced = compiled(x.clone())
    assert torch.equal(traced, eager)
    g.destroy()
    return graphs


def test_torch_compile_traces_every_collective_into_one_graph() -> None:
    graphs = run_ranks(_compiled, 2, timeout=90)[0]
    assert len(graphs) == 1  # fullgraph=True would have raised on a break
    for op in (
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_gatherv",
        "reduce_scatterv",
        "broadcast",
    ):
        assert f"target=torch.ops.groupcoord.{op}]" in graphs[0], op
