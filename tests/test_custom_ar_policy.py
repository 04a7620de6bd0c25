"""Custom all-reduce decisions on plain-data descriptions (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from device_communicators.custom_ar_policy import (
    MAX_BLOCKS,
    GroupTopology,
    RankPlacement,
    TensorDescription,
    check_enablement,
    choose_algorithm,
    describe_tensor,
    launch_config,
    should_custom_ar,
)
from device_communicators.errors import GroupcoordValueError

MiB = 1024 * 1024


def topo(world: int, nodes: int = 1, nvlink: bool = True, peer: bool = True) -> GroupTopology:
    ranks = tuple(
        RankPlacement(f"node{r * nodes // world}", f"0000:{r:02x}:00.0") for r in range(world)
    )
    return GroupTopology(ranks, nvlink_connected=nvlink, peer_access=peer)


@pytest.mark.parametrize("world", [2, 4, 6, 8])
def test_enabled_on_one_fully_connected_node(world):
    decision = check_enablement(topo(world), disabled_by_user=False)
    assert decision and decision.reason == ""


@pytest.mark.parametrize(
    ("topology", "disabled", "reason"),
    [
        (topo(4), True, "disabled by GROUPCOORD_DISABLE_CUSTOM_ALL_REDUCE"),
        (topo(1), False, "world size 1"),
        (topo(3), False, "world size 3 not in"),
        (topo(16), False, "world size 16 not in"),
        (topo(4, nodes=2), False, "ranks span 2 nodes (node0, node1)"),
        (topo(4, nvlink=False), False, "world size 4 needs fully connected NVLink"),
        (topo(8, nvlink=False), False, "needs fully connected NVLink"),
        (topo(2, peer=False), False, "cannot access each other"),
        (topo(4, peer=False), False, "cannot access each other"),
    ],
)
def test_refusals_say_why(topology, disabled, reason):
    decision = check_enablement(topology, disabled_by_user=disabled)
    assert not decision
    assert reason in decision.reason


def test_two_gpus_without_nvlink_are_allowed_over_pcie():
    assert check_enablement(topo(2, nvlink=False), disabled_by_user=False)


def desc(nbytes=4096, dtype="float16", device="cuda", weak=True) -> TensorDescription:
    return TensorDescription(device, dtype, nbytes, weak)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_supported_tensor_is_taken(dtype):
    assert should_custom_ar(desc(dtype=dtype), max_bytes=8 * MiB)


@pytest.mark.parametrize(
    ("description", "reason"),
    [
        (desc(device="cpu"), "tensor on cpu"),
        (desc(dtype="float64"), "dtype float64"),
        (desc(dtype="int32"), "dtype int32"),
        (desc(nbytes=0), "empty"),
        (desc(nbytes=4104), "not a multiple of 16"),
        (desc(weak=False), "not weakly contiguous"),
        (desc(nbytes=8 * MiB), ">= max"),
    ],
)
def test_tensors_the_next_back_end_must_take(description, reason):
    decision = should_custom_ar(description, max_bytes=8 * MiB)
    assert not decision and reason in decision.reason


def test_just_below_max_is_taken():
    assert should_custom_ar(desc(nbytes=8 * MiB - 16), max_bytes=8 * MiB)


def test_describe_tensor_reads_layout():
    base = torch.zeros(64, 32, dtype=torch.bfloat16)
    d = describe_tensor(base)
    assert d == TensorDescription("cpu", "bfloat16", 64 * 32 * 2, True)
    # A transposed dense tensor is weakly contiguous (elementwise over its storage).
    assert describe_tensor(base.t()).weakly_contiguous
    # The tail of a storage is weakly contiguous; a strided column slice is not.
    assert describe_tensor(base[8:]).weakly_contiguous
    assert not describe_tensor(base[:, :16]).weakly_contiguous
    assert describe_tensor(base[:8]).weakly_contiguous
    assert not describe_tensor(torch.zeros(4, 1).expand(4, 8)).weakly_contiguous


@pytest.mark.parametrize(
    ("nbytes", "world", "algo"),
    [
        (512 * 1024 - 16, 2, "oneshot"),
        (512 * 1024, 2, "twoshot"),
        (512 * 1024 - 16, 4, "oneshot"),
        (512 * 1024 - 16, 6, "twoshot"),
        (256 * 1024 - 16, 8, "oneshot"),
        (256 * 1024, 8, "twoshot"),
        (4 * MiB, 4, "twoshot"),
    ],
)
def test_algorithm_by_size_and_world(nbytes, world, algo):
    assert choose_algorithm(nbytes, world) == algo


def test_setting_pins_the_algorithm_and_is_validated():
    assert choose_algorithm(16, 2, "twoshot") == "twoshot"
    assert choose_algorithm(4 * MiB, 8, "oneshot") == "oneshot"
    with pytest.raises(GroupcoordValueError, match="custom_all_reduce_algo"):
        choose_algorithm(16, 2, "fast")
    with pytest.raises(GroupcoordValueError, match="world_size"):
        choose_algorithm(16, 3)


def test_launch_config_is_bounded_and_covers_every_pack():
    assert launch_config(16) == (1, 512)
    assert launch_config(512 * 16) == (1, 512)
    assert launch_config(512 * 16 + 16) == (2, 512)
    assert launch_config(64 * MiB) == (MAX_BLOCKS, 512)
    with pytest.raises(GroupcoordValueError, match="nbytes"):
        launch_config(24)
