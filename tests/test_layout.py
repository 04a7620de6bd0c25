"""Rank layout: known layouts and the every-rank-once property."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.layout import compute_layout
from shm_broadcast.errors import GroupcoordValueError


def test_tp2_pp4_matches_the_issue_example() -> None:
    layout = compute_layout(8, 2, 4)
    assert layout.tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.pp == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert layout.dp == tuple((r,) for r in range(8))
    assert layout.ep is None


def test_tp2_dp2_with_ep_spans_dp_times_tp() -> None:
    layout = compute_layout(4, 2, 1, 2, enable_expert_parallel=True)
    assert layout.tp == ((0, 1), (2, 3))
    assert layout.dp == ((0, 2), (1, 3))
    assert layout.pp == ((0,), (1,), (2,), (3,))
    assert layout.ep == ((0, 1, 2, 3),)


def test_tp2_pp2_dp2_ep_stays_within_a_pipeline_stage() -> None:
    layout = compute_layout(8, 2, 2, 2, enable_expert_parallel=True)
    assert layout.tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.pp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.dp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.ep == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert layout.group_of("ep", 6) == (2, 3, 6, 7)


def test_an_outer_factor_makes_independent_replicas() -> None:
    layout = compute_layout(4, 2)
    assert layout.tp == ((0, 1), (2, 3))
    assert layout.dp == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((6, 4), "world_size=6 is not a multiple"),
        ((4, 0), "tensor_model_parallel_size must be a positive int"),
        ((0,), "world_size must be a positive int"),
        ((4, 1, 1, True), "data_parallel_size must be a positive int"),
    ],
)
def test_bad_sizes_name_the_argument(args: tuple, name: str) -> None:
    with pytest.raises(GroupcoordValueError, match=name):
        compute_layout(*args)


def test_group_of_refuses_ep_when_disabled() -> None:
    with pytest.raises(GroupcoordValueError, match="not enabled"):
        compute_layout(2, 2).group_of("ep", 0)


@given(
    tp=st.sampled_from([1, 2, 3]),
    pp=st.sampled_from([1, 2, 4]),
    dp=st.sampled_from([1, 2, 3]),
    replicas=st.sampled_from([1, 2]),
)
def test_every_rank_is_in_exactly_one_group_of_each_kind(
    tp: int, pp: int, dp: int, replicas: int
) -> None:
    world = tp * pp * dp * replicas
    layout = compute_layout(world, tp, pp, dp, enable_expert_parallel=True)
    assert layout.ep is not None
    for kind, groups, size in (
        ("tp", layout.tp, tp),
        ("pp", layout.pp, pp),
        ("dp", layout.dp, dp),
        ("ep", layout.ep, tp * dp),
    ):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), kind
        assert all(len(g) == size for g in groups), kind
    for rank in range(world):
        tp_group = layout.group_of("tp", rank)
        # TP is fastest: a TP group is a run of consecutive ranks.
        assert list(tp_group) == list(range(tp_group[0], tp_group[0] + tp))
        # A rank's TP peers are all in its EP group, and its EP group is one PP stage.
        assert set(tp_group) <= set(layout.group_of("ep", rank))
        stage = (rank // tp) % pp
        assert all((r // tp) % pp == stage for r in layout.group_of("ep", rank))
