"""Rank layout of the parallel groups: a pure function of the sizes.

TP varies fastest, then PP, then DP; an outer factor (``world`` larger than
``tp * pp * dp``) makes independent replicas, each with its own groups. EP
spans DP x TP within one PP stage. Same layout as vLLM, so ranks keep their
meaning when an engine moves over.
"""

from __future__ import annotations

import dataclasses

from shm_broadcast.errors import GroupcoordValueError

RankGroups = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Global ranks of every group of each kind (``ep`` is None when EP is off)."""

    world: RankGroups
    tp: RankGroups
    pp: RankGroups
    dp: RankGroups
    ep: RankGroups | None

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of kind ``kind`` ("world", "tp", "pp", "dp", "ep") holding ``rank``."""
        groups = getattr(self, kind)
        if groups is None:
            raise GroupcoordValueError(f"kind={kind!r}: expert parallelism is not enabled")
        for ranks in groups:
            if rank in ranks:
                return ranks
        raise GroupcoordValueError(f"rank={rank} is in no {kind} group")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GroupcoordValueError(f"{name} must be a positive int, got {value!r}")


def _groups(world: int, shape: tuple[int, int, int, int], axes: tuple[int, ...]) -> RankGroups:
    """Ranks 0..world-1 laid out as ``shape`` (replica, dp, pp, tp), grouped along ``axes``.

    A group is every rank that agrees on all the axes not in ``axes``; the
    rank order inside a group follows ``axes`` (last one fastest).
    """
    strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    fixed = [a for a in range(4) if a not in axes]
    groups: list[tuple[int, ...]] = []
    for outer in _product([shape[a] for a in fixed]):
        base = sum(i * strides[a] for i, a in zip(outer, fixed))
        groups.append(
            tuple(
                base + sum(i * strides[a] for i, a in zip(inner, axes))
                for inner in _product([shape[a] for a in axes])
            )
        )
    assert sum(len(g) for g in groups) == world
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
    enable_expert_parallel: bool = False,
) -> GroupLayout:
    """Every TP, PP, DP (and EP) group of a world of ``world_size`` ranks."""
    tp, pp, dp = tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size
    for name, value in (
        ("world_size", world_size),
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("data_parallel_size", dp),
    ):
        _positive(name, value)
    if world_size % (tp * pp * dp):
        raise GroupcoordValueError(
            f"world_size={world_size} is not a multiple of tensor_model_parallel_size * "
            f"pipeline_model_parallel_size * data_parallel_size = {tp}*{pp}*{dp} = {tp * pp * dp}"
        )
    shape = (world_size // (tp * pp * dp), dp, pp, tp)
    return GroupLayout(
        world=(tuple(range(world_size)),),
        tp=_groups(world_size, shape, (3,)),
        pp=_groups(world_size, shape, (2,)),
        dp=_groups(world_size, shape, (1,)),
        ep=_groups(world_size, shape, (1, 3)) if enable_expert_parallel else None,
    )
