"""The groups this process built, in one state object, and vLLM's getters for
them (``get_tp_group()`` ...). ``parallel_state`` builds and destroys them and
re-exports every getter; this module only reads them, and checks that every
rank asked for the same sizes (:func:`agree_on_sizes`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .errors import GroupcoordValueError, NotInitializedError
from .group_coordinator import GroupCoordinator

# In the order they are built (every rank the same): suspend_device_comms and the
# checkpoint functions walk them in this order, destroy_model_parallel in reverse.
MODEL_GROUPS = ("tp", "dcp", "pcp", "pp", "dp", "ep", "etp", "engram_dp", "inner_dp_world")


@dataclasses.dataclass(frozen=True)
class ModelParallelSizes:
    tp: int
    pp: int
    pcp: int
    dcp: int
    dp: int
    expert_parallel: bool


def agree_on_sizes(world: GroupCoordinator, sizes: ModelParallelSizes) -> None:
    """Raise on every rank, naming them, unless all asked for the same layout (ranks
    building different groups would otherwise wait on each other until the deadline)."""
    if world.world_size == 1:
        return
    fields = [f.name for f in dataclasses.fields(sizes)]
    mine = torch.tensor([int(getattr(sizes, f)) for f in fields], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in world.ranks]
    world._collective("initialize_model_parallel", dist.all_gather, everyone, mine, world.cpu_group)
    asked: dict[tuple[int, ...], list[int]] = {}
    for rank, values in zip(world.ranks, everyone):
        asked.setdefault(tuple(values.tolist()), []).append(rank)
    if len(asked) > 1:
        sides = "; ".join(
            f"rank(s) {ranks}: " + ", ".join(f"{f}={v}" for f, v in zip(fields, values))
            for values, ranks in asked.items()
        )
        raise GroupcoordValueError(
            f"initialize_model_parallel: the ranks asked for different layouts ({sides}); "
            "every rank must pass the same sizes"
        )


@dataclasses.dataclass
class ParallelState:
    """Everything this module keeps between calls."""

    world: GroupCoordinator | None = None
    tp: GroupCoordinator | None = None
    dcp: GroupCoordinator | None = None
    pcp: GroupCoordinator | None = None
    pp: GroupCoordinator | None = None
    dp: GroupCoordinator | None = None
    ep: GroupCoordinator | None = None
    etp: GroupCoordinator | None = None  # may be the EP group itself
    engram_dp: GroupCoordinator | None = None  # may be the DP group itself
    inner_dp_world: GroupCoordinator | None = None
    sizes: ModelParallelSizes | None = None
    local_rank: int = 0
    backend: str = "gloo"
    timeout_s: float | None = None
    custom_all_reduce: bool = True  # set_custom_all_reduce, read when groups are built
    # True when init_distributed_environment created torch's default group,
    # so destroy_distributed_environment must tear it down too.
    owns_default_group: bool = False
    exit_hook_registered: bool = False
    # The process that built the groups: a forked child inherits this state and the
    # exit hook, and must not tear down what its parent still uses.
    owner_pid: int = 0


state = ParallelState()


# ---- getters ----------------------------------------------------------------------------


def _get(group: GroupCoordinator | None, what: str) -> GroupCoordinator:
    if group is None:
        raise NotInitializedError(f"the {what} group is not initialised")
    return group


def get_world_group() -> GroupCoordinator:
    return _get(state.world, "world (call init_distributed_environment)")


def get_tp_group() -> GroupCoordinator:
    return _get(state.tp, "tensor model parallel (call initialize_model_parallel)")


def get_dcp_group() -> GroupCoordinator:
    return _get(state.dcp, "decode context parallel (call initialize_model_parallel)")


def get_pcp_group() -> GroupCoordinator:
    return _get(state.pcp, "prefill context parallel (call initialize_model_parallel)")


def get_pp_group() -> GroupCoordinator:
    return _get(state.pp, "pipeline model parallel (call initialize_model_parallel)")


def get_dp_group() -> GroupCoordinator:
    return _get(state.dp, "data parallel (call initialize_model_parallel)")


def get_ep_group() -> GroupCoordinator:
    return _get(state.ep, "expert parallel (call initialize_model_parallel)")


def get_eplb_group() -> GroupCoordinator:
    """The EP group: expert load balancing exchanges over the same ranks."""
    return _get(state.ep, "expert parallel load balancing (call initialize_model_parallel)")


def get_etp_group() -> GroupCoordinator:
    """The expert tensor parallel group: the ranks over which a MoE layer's expert
    weights are tensor-sharded (vLLM's FusedMoE rule). Without expert parallelism
    that is the EP group's ranks (DP x PCP x TP, and this returns the EP group);
    with ``enable_expert_parallel=True`` each rank holds whole experts and its
    ETP group is itself alone."""
    return _get(state.etp, "expert tensor parallel (call initialize_model_parallel)")


def get_engram_dp_group() -> GroupCoordinator | None:
    """This rank's DP peers on its own node (the DP group itself when every DP group
    lies within one node), or None when that is this rank alone."""
    group = _get(state.engram_dp, "engram data parallel (call initialize_model_parallel)")
    return group if group.world_size > 1 else None


def get_engram_dp_size() -> int:
    group = get_engram_dp_group()
    return 1 if group is None else group.world_size


def get_inner_dp_world_group() -> GroupCoordinator:
    return _get(state.inner_dp_world, "inner data parallel world (call initialize_model_parallel)")


def get_dcp_world_size_and_rank(enabled: bool = True) -> tuple[int, int]:
    """(size, rank) of this rank's DCP group, or (1, 0) when ``enabled`` is False."""
    if not enabled:
        return 1, 0
    dcp = get_dcp_group()
    return dcp.world_size, dcp.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    return get_pp_group().world_size


def get_pipeline_model_parallel_rank() -> int:
    return get_pp_group().rank_in_group


def get_node_count() -> int:
    """Hosts among the world's ranks (counted when the world group was built)."""
    return get_world_group().node_count


def is_global_first_rank() -> bool:
    """Rank 0 of the world, or True before torch.distributed is initialised."""
    return not dist.is_initialized() or dist.get_rank() == 0


def is_local_first_rank() -> bool:
    """Local rank 0 on this host, or True before the world group exists."""
    return state.world is None or state.world.local_rank == 0
