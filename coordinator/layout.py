"""Rank layout of the parallel groups: a pure function of the sizes.

The same layout as vLLM 0.33, so ranks keep their meaning when an engine
moves over: global ranks are laid out as (replica, DP, PP, PCP, TP), TP
varying fastest. An outer factor (``world`` larger than ``dp*pp*pcp*tp``)
makes independent replicas, each with its own groups. PCP groups run across
TP, EP spans DP x PCP x TP within one PP stage (always built, as in vLLM),
and DCP splits each TP group into consecutive blocks (it adds no ranks).
"""

from __future__ import annotations

import dataclasses
import math

from shm_broadcast.errors import GroupcoordValueError

RankGroups = tuple[tuple[int, ...], ...]

# Axes of the rank layout.
REPLICA, DP, PP, PCP, TP = range(5)


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Global ranks of every group of each kind."""

    world: RankGroups
    tp: RankGroups
    pp: RankGroups
    dp: RankGroups
    ep: RankGroups
    pcp: RankGroups
    dcp: RankGroups
    inner_dp_world: RankGroups  # every rank of one replica (vLLM's inner DP world)

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of kind ``kind`` (a field name, e.g. "tp") holding ``rank``."""
        if kind not in {f.name for f in dataclasses.fields(self)}:
            raise GroupcoordValueError(f"kind={kind!r} is not a group kind of the layout")
        for ranks in getattr(self, kind):
            if rank in ranks:
                return ranks
        raise GroupcoordValueError(f"rank={rank} is in no {kind} group")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GroupcoordValueError(f"{name} must be a positive int, got {value!r}")


def _groups(shape: tuple[int, ...], axes: tuple[int, ...]) -> RankGroups:
    """Ranks laid out as ``shape`` (row-major), grouped along ``axes``.

    A group is every rank that agrees on all the axes not in ``axes``; the
    rank order inside a group follows ``axes`` (last one fastest).
    """
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    fixed = [a for a in range(len(shape)) if a not in axes]
    groups: list[tuple[int, ...]] = []
    for outer in _product([shape[a] for a in fixed]):
        base = sum(i * strides[a] for i, a in zip(outer, fixed))
        groups.append(
            tuple(
                base + sum(i * strides[a] for i, a in zip(inner, axes))
                for inner in _product([shape[a] for a in axes])
            )
        )
    return tuple(groups)


def _product(sizes: list[int]) -> list[tuple[int, ...]]:
    """All index tuples for ``sizes`` in row-major order (last index fastest)."""
    out: list[tuple[int, ...]] = [()]
    for size in sizes:
        out = [prefix + (i,) for prefix in out for i in range(size)]
    return out


def compute_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    *,
    prefill_context_model_parallel_size: int = 1,
    decode_context_model_parallel_size: int = 1,
) -> GroupLayout:
    """Every group of each kind in a world of ``world_size`` ranks."""
    tp, pp, dp = tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size
    pcp, dcp = prefill_context_model_parallel_size, decode_context_model_parallel_size
    for name, value in (
        ("world_size", world_size),
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("data_parallel_size", dp),
        ("prefill_context_model_parallel_size", pcp),
        ("decode_context_model_parallel_size", dcp),
    ):
        _positive(name, value)
    replica = tp * pp * dp * pcp
    if world_size % replica:
        raise GroupcoordValueError(
            f"world_size={world_size} is not a multiple of tensor_model_parallel_size * "
            f"pipeline_model_parallel_size * data_parallel_size * "
            f"prefill_context_model_parallel_size = {tp}*{pp}*{dp}*{pcp} = {replica}"
        )
    if tp % dcp:
        raise GroupcoordValueError(
            f"decode_context_model_parallel_size={dcp} must divide "
            f"tensor_model_parallel_size={tp} (DCP splits each TP group)"
        )
    shape = (world_size // replica, dp, pp, pcp, tp)
    return GroupLayout(
        world=(tuple(range(world_size)),),
        tp=_groups(shape, (TP,)),
        pp=_groups(shape, (PP,)),
        dp=_groups(shape, (DP,)),
        ep=_groups(shape, (DP, PCP, TP)),
        pcp=_groups(shape, (PCP,)),
        dcp=tuple(tuple(range(start, start + dcp)) for start in range(0, world_size, dcp)),
        inner_dp_world=_groups(shape, (DP, PP, PCP, TP)),
    )
