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
    assert layout.ep == ((0, 1), (2, 3), (4, 5), (6, 7))  # built as in vLLM: DP x PCP x TP
    assert layout.dcp == tuple((r,) for r in range(8))


def test_tp2_dp2_with_ep_spans_dp_times_tp() -> None:
    layout = compute_layout(4, 2, 1, 2)
    assert layout.tp == ((0, 1), (2, 3))
    assert layout.dp == ((0, 2), (1, 3))
    assert layout.pp == ((0,), (1,), (2,), (3,))
    assert layout.ep == ((0, 1, 2, 3),)


def test_tp2_pp2_dp2_ep_stays_within_a_pipeline_stage() -> None:
    layout = compute_layout(8, 2, 2, 2)
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
        ((4, 1, 1, 0), "data_parallel_size must be a positive int"),
    ],
)
def test_bad_sizes_name_the_argument(args: tuple, name: str) -> None:
    with pytest.raises(GroupcoordValueError, match=name):
        compute_layout(*args)


def test_group_of_refuses_an_unknown_kind() -> None:
    with pytest.raises(GroupcoordValueError, match="not a group kind"):
        compute_layout(2, 2).group_of("sp", 0)


def test_pcp_runs_across_tp_and_dcp_splits_tp_groups_as_in_vllm() -> None:
    # all_ranks = arange(16).reshape(-1, dp=1, pp=2, pcp=2, tp=4)
    layout = compute_layout(
        16, 4, 2, prefill_context_model_parallel_size=2, decode_context_model_parallel_size=2
    )
    assert layout.tp[:2] == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert layout.pcp[:2] == ((0, 4), (1, 5))
    assert layout.pp[:2] == ((0, 8), (1, 9))
    assert layout.dcp[:3] == ((0, 1), (2, 3), (4, 5))
    assert layout.ep == (tuple(range(8)), tuple(range(8, 16)))
    assert layout.inner_dp_world == (tuple(range(16)),)
    with pytest.raises(GroupcoordValueError, match="must divide tensor_model_parallel_size"):
        compute_layout(4, 4, decode_context_model_parallel_size=3)


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
    layout = compute_layout(world, tp, pp, dp)
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
