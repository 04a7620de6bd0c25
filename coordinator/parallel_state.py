"""Process-wide parallel state: the world, TP, PP, DP and EP groups of this rank.

vLLM's ``parallel_state`` functions, with their names and arguments. All
globals live in one :class:`ParallelState` object; initialising twice with
different sizes raises :class:`AlreadyInitializedError`, and the ``destroy_*``
functions leave nothing behind (groups, queues, shared memory, and the default
process group when we created it). Works under ``torchrun`` (``env://``) and
with an explicit rank, world size and init method.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from shm_broadcast.config import resolve_timeout
from shm_broadcast.topology import in_the_same_node_as as _same_node

from .errors import AlreadyInitializedError, GroupcoordValueError, NotInitializedError
from .group_coordinator import GraphCaptureContext, GroupCoordinator
from .layout import compute_layout
from .stateless_group import StatelessProcessGroup

__all__ = [
    "GraphCaptureContext",
    "ParallelState",
    "StatelessProcessGroup",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "ensure_model_parallel_initialized",
    "get_dp_group",
    "get_ep_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "graph_capture",
    "in_the_same_node_as",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
]


@dataclasses.dataclass
class ParallelState:
    """Everything this module keeps between calls."""

    world: GroupCoordinator | None = None
    tp: GroupCoordinator | None = None
    pp: GroupCoordinator | None = None
    dp: GroupCoordinator | None = None
    ep: GroupCoordinator | None = None
    # (tp, pp, dp, enable_expert_parallel) of the current model-parallel groups.
    sizes: tuple[int, int, int, bool] | None = None
    local_rank: int = 0
    backend: str = "gloo"
    timeout_s: float | None = None
    # True when init_distributed_environment created torch's default group,
    # so destroy_distributed_environment must tear it down too.
    owns_default_group: bool = False
    exit_hook_registered: bool = False


_state = ParallelState()


def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    distributed_init_method: str = "env://",
    local_rank: int = -1,
    backend: str = "gloo",
    timeout: float | None = None,
) -> None:
    """Join torch.distributed (unless already joined) and build the world group.

    Under ``torchrun`` the defaults read RANK, WORLD_SIZE, LOCAL_RANK and
    MASTER_ADDR/MASTER_PORT. ``timeout`` (seconds) bounds every wait of the
    groups made here and by ``initialize_model_parallel``.
    """
    timeout_s = resolve_timeout(timeout)
    if not dist.is_initialized():
        if distributed_init_method == "env://":
            absent = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if absent:
                raise GroupcoordValueError(
                    f"distributed_init_method='env://' needs {' and '.join(absent)} in the "
                    "environment (torchrun sets them), or pass e.g. 'tcp://host:port'"
                )
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        _state.owns_default_group = True
    if world_size not in (-1, dist.get_world_size()):
        raise AlreadyInitializedError(
            f"world_size={world_size} but torch.distributed is already running with "
            f"{dist.get_world_size()} ranks"
        )
    if local_rank == -1:
        # torchrun's LOCAL_RANK; a single-node launch without it uses the global rank.
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if _state.world is not None:
        return
    _state.local_rank = local_rank
    _state.backend = backend
    _state.timeout_s = timeout_s
    _state.world = GroupCoordinator(
        [list(range(dist.get_world_size()))],
        local_rank,
        backend,
        use_device_communicator=False,
        group_name="world",
        timeout=timeout_s,
    )
    if not _state.exit_hook_registered:
        atexit.register(destroy_distributed_environment)
        _state.exit_hook_registered = True


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    backend: str | None = None,
) -> None:
    """Build the TP, PP, DP (and EP) groups of this rank (collective over the world).

    TP varies fastest, then PP, then DP; EP spans DP x TP within a PP stage.
    Only TP gets a message-queue broadcaster. Calling again with the same
    sizes does nothing; with different sizes it raises.
    """
    world = get_world_group()
    sizes = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        data_parallel_size,
        bool(enable_expert_parallel),
    )
    if _state.sizes is not None:
        if _state.sizes == sizes:
            return
        raise AlreadyInitializedError(
            f"model parallel groups exist with (tp, pp, dp, ep) = {_state.sizes}; asked for "
            f"{sizes}: call destroy_model_parallel() first"
        )
    layout = compute_layout(world.world_size, *sizes)
    backend = backend or _state.backend
    made: list[GroupCoordinator] = []

    def group(groups: Any, name: str, use_mq: bool = False) -> GroupCoordinator:
        coordinator = GroupCoordinator(
            [list(g) for g in groups],
            _state.local_rank,
            backend,
            use_device_communicator=True,
            use_message_queue_broadcaster=use_mq,
            group_name=name,
            timeout=_state.timeout_s,
        )
        made.append(coordinator)
        return coordinator

    try:
        _state.tp = group(layout.tp, "tp", use_mq=True)
        _state.pp = group(layout.pp, "pp")
        _state.dp = group(layout.dp, "dp")
        _state.ep = group(layout.ep, "ep") if layout.ep is not None else None
    except BaseException:
        for coordinator in made:
            coordinator.destroy()
        _state.tp = _state.pp = _state.dp = _state.ep = None
        raise
    _state.sizes = sizes


def ensure_model_parallel_initialized(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    backend: str | None = None,
) -> None:
    """Initialise the groups unless they exist; if they do, their sizes must match."""
    if not model_parallel_is_initialized():
        initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size, backend=backend
        )
        return
    have = (get_tensor_model_parallel_world_size(), get_pipeline_model_parallel_world_size())
    if have != (tensor_model_parallel_size, pipeline_model_parallel_size):
        raise AlreadyInitializedError(
            f"model parallel groups exist with (tp, pp) = {have}; asked for "
            f"({tensor_model_parallel_size}, {pipeline_model_parallel_size})"
        )


def model_parallel_is_initialized() -> bool:
    return _state.tp is not None and _state.pp is not None


def _get(group: GroupCoordinator | None, what: str) -> GroupCoordinator:
    if group is None:
        raise NotInitializedError(f"the {what} group is not initialised")
    return group


def get_world_group() -> GroupCoordinator:
    return _get(_state.world, "world (call init_distributed_environment)")


def get_tp_group() -> GroupCoordinator:
    return _get(_state.tp, "tensor model parallel (call initialize_model_parallel)")


def get_pp_group() -> GroupCoordinator:
    return _get(_state.pp, "pipeline model parallel (call initialize_model_parallel)")


def get_dp_group() -> GroupCoordinator:
    return _get(_state.dp, "data parallel (call initialize_model_parallel)")


def get_ep_group() -> GroupCoordinator:
    return _get(
        _state.ep,
        "expert parallel (call initialize_model_parallel with enable_expert_parallel=True)",
    )


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    return get_pp_group().world_size


def get_pipeline_model_parallel_rank() -> int:
    return get_pp_group().rank_in_group


@contextlib.contextmanager
def graph_capture(device: torch.device) -> Iterator[GraphCaptureContext]:
    """Enter graph capture on the TP and PP groups; on CPU it changes nothing."""
    stream = torch.cuda.Stream(device=device) if torch.device(device).type == "cuda" else None
    context = GraphCaptureContext(stream)
    with get_tp_group().graph_capture(context), get_pp_group().graph_capture(context):
        yield context


def in_the_same_node_as(pg: Any, source_rank: int = 0) -> list[bool]:
    """For each rank of ``pg`` (a ProcessGroup, StatelessProcessGroup or GroupCoordinator),
    whether it shares this node's shared memory with in-group rank ``source_rank``."""
    if isinstance(pg, GroupCoordinator):
        pg = pg.cpu_group
    return _same_node(pg, source_rank)


def destroy_model_parallel() -> None:
    """Destroy the TP, PP, DP and EP groups (safe to call when there are none)."""
    for name in ("ep", "dp", "pp", "tp"):
        group = getattr(_state, name)
        if group is not None:
            setattr(_state, name, None)
            group.destroy()
    _state.sizes = None


def destroy_distributed_environment() -> None:
    """Destroy every group, then torch's default group if we created it."""
    destroy_model_parallel()
    if _state.world is not None:
        world, _state.world = _state.world, None
        world.destroy()
    if _state.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    _state.owns_default_group = False
