"""Process-wide parallel state: the world and every model-parallel group of this rank.

vLLM 0.33's ``parallel_state`` functions, with its names, parameter order and
defaults; our additions are keyword-only, so a positional vLLM call never binds
to them. All globals live in one :class:`ParallelState` object (in
:mod:`coordinator.parallel_groups`, with the getters this module re-exports); initialising
twice with different sizes raises :class:`AlreadyInitializedError`, and the
``destroy_*`` functions leave nothing behind (groups, queues, shared memory,
and the default process group when we created it). Works under ``torchrun``
(``env://``) and with an explicit rank, world size and init method.

Groups, as vLLM builds them (layout in :mod:`coordinator.layout`): world, TP
(with a message-queue broadcaster), DCP (likewise), PCP, PP, DP, EP (always;
its all2all manager only with ``enable_expert_parallel=True``), EPLB (the EP
group itself), ETP, engram DP and the inner DP world. A group whose
parallelism is off has one rank per group. ``suspend_device_comms`` and the
checkpoint functions release and re-create the device communicators' fast
back ends (sleep mode; see docs/coordinator.md).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from device_communicators.errors import unsupported
from shm_broadcast.config import override, resolve_timeout
from shm_broadcast.host_memory import release_cached_outputs
from shm_broadcast.segments import sweep_stale_segments
from shm_broadcast.topology import in_the_same_node_as as _same_node

from .comm.bootstrap import default_group_store
from .custom_ops import (
    all_gather_fake,
    all_reduce_fake,
    reduce_scatter_fake,
)
from .errors import AlreadyInitializedError, GroupcoordValueError
from .group_coordinator import GraphCaptureContext, GroupCoordinator, Handle
from .layout import compute_layout
from .parallel_groups import MODEL_GROUPS as _MODEL_GROUPS
from .parallel_groups import (
    ModelParallelSizes,
    ParallelState,
    agree_on_sizes,
    get_dcp_group,
    get_dcp_world_size_and_rank,
    get_dp_group,
    get_engram_dp_group,
    get_engram_dp_size,
    get_ep_group,
    get_eplb_group,
    get_etp_group,
    get_inner_dp_world_group,
    get_node_count,
    get_pcp_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    is_global_first_rank,
    is_local_first_rank,
)
from .parallel_groups import state as _state
from .stateless_group import StatelessProcessGroup

__all__ = [
    "GraphCaptureContext",
    "GroupCoordinator",
    "Handle",
    "ParallelState",
    "StatelessProcessGroup",
    "all_gather",
    "all_gather_fake",
    "all_reduce",
    "all_reduce_fake",
    "checkpoint_prepare_distributed_state",
    "checkpoint_restore_distributed_state",
    "cleanup_dist_env_and_memory",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "ensure_model_parallel_initialized",
    "get_dcp_group",
    "get_dcp_world_size_and_rank",
    "get_dp_group",
    "get_engram_dp_group",
    "get_engram_dp_size",
    "get_ep_group",
    "get_eplb_group",
    "get_etp_group",
    "get_inner_dp_world_group",
    "get_node_count",
    "get_pcp_group",
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
    "init_model_parallel_group",
    "init_world_group",
    "initialize_model_parallel",
    "is_global_first_rank",
    "is_local_first_rank",
    "model_parallel_is_initialized",
    "patched_fused_scaled_matmul_reduce_scatter",
    "patched_fused_scaled_matmul_reduce_scatter_fake",
    "reduce_scatter",
    "reduce_scatter_fake",
    "resume_device_comms",
    "set_custom_all_reduce",
    "suspend_device_comms",
]


# ---- start-up ------------------------------------------------------------------------


def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    distributed_init_method: str = "env://",
    local_rank: int = -1,
    backend: str = "nccl",
    timeout: datetime.timedelta | float | None = None,
) -> None:
    """Join torch.distributed (unless already joined) and build the world group.

    vLLM's signature and default backend (NCCL; pass ``backend="gloo"`` on CPU).
    Under ``torchrun`` the defaults read RANK, WORLD_SIZE, LOCAL_RANK and
    MASTER_ADDR/MASTER_PORT. ``timeout`` (a timedelta or seconds) bounds every
    wait of the groups made here and by ``initialize_model_parallel``.
    """
    timeout_s = resolve_timeout(timeout)
    if not dist.is_initialized():
        if backend == "nccl" and not torch.cuda.is_available():
            raise GroupcoordValueError(
                "backend='nccl' (vLLM's default) needs a CUDA device and this process has none; "
                "pass backend='gloo' for CPU ranks"
            )
        td = datetime.timedelta(seconds=timeout_s)
        method = distributed_init_method or "env://"  # torch's reading of None
        found = default_group_store(method, rank, world_size, timeout_s)
        if found is None:
            dist.init_process_group(
                backend=backend,
                init_method=method,
                world_size=world_size,
                rank=rank,
                timeout=td,
            )
        else:
            store, rank, world_size = found
            dist.init_process_group(
                backend=backend, store=store, world_size=world_size, rank=rank, timeout=td
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
    _state.owner_pid = os.getpid()
    sweep_stale_segments()  # what killed processes of ours left on this host
    _state.world = init_world_group(list(range(dist.get_world_size())), local_rank, backend)
    if not _state.exit_hook_registered:
        atexit.register(_destroy_at_exit)
        _state.exit_hook_registered = True


def init_world_group(ranks: list[int], local_rank: int, backend: str) -> GroupCoordinator:
    return GroupCoordinator(
        [list(ranks)],
        local_rank,
        backend,
        use_device_communicator=False,
        group_name="world",
        timeout=_state.timeout_s,
    )


def init_model_parallel_group(
    group_ranks: list[list[int]],
    local_rank: int,
    backend: str,
    use_message_queue_broadcaster: bool = False,
    group_name: str | None = None,
    use_device_communicator: bool = True,
    use_all2all: bool = False,
) -> GroupCoordinator:
    # set_custom_all_reduce(False) applies to the groups built after it.
    with override(disable_custom_all_reduce=not _state.custom_all_reduce):
        return GroupCoordinator(
            group_ranks,
            local_rank,
            backend,
            use_device_communicator,
            use_message_queue_broadcaster,
            group_name,
            use_all2all,
            timeout=_state.timeout_s,
        )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    prefill_context_model_parallel_size: int = 1,
    decode_context_model_parallel_size: int | None = 1,
    backend: str | None = None,
    *,
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> None:
    """Build every model-parallel group of this rank (collective over the world).

    vLLM's signature; DP size and expert parallelism, which vLLM reads from its
    config, are keyword-only here with vLLM's defaults. Ends with a barrier of
    the world group, so no rank (the store host included) leaves while others
    still build groups. Calling again with the same sizes does nothing; with
    different sizes it raises.
    """
    world = get_world_group()
    sizes = ModelParallelSizes(
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        pcp=prefill_context_model_parallel_size,
        dcp=1 if decode_context_model_parallel_size is None else decode_context_model_parallel_size,
        dp=data_parallel_size,
        expert_parallel=bool(enable_expert_parallel),
    )
    if _state.sizes is not None:
        if _state.sizes == sizes:
            return
        raise AlreadyInitializedError(
            f"model parallel groups exist with {_state.sizes}; asked for {sizes}: "
            "call destroy_model_parallel() first"
        )
    agree_on_sizes(world, sizes)
    layout = compute_layout(
        world.world_size,
        sizes.tp,
        sizes.pp,
        sizes.dp,
        prefill_context_model_parallel_size=sizes.pcp,
        decode_context_model_parallel_size=sizes.dcp,
    )
    backend = backend or _state.backend

    def group_of(ranks: list[list[int]], kind: str, **kwargs: Any) -> GroupCoordinator:
        return init_model_parallel_group(
            ranks, _state.local_rank, backend, group_name=kind, **kwargs
        )

    def group(kind: str, **kwargs: Any) -> GroupCoordinator:
        return group_of([list(g) for g in getattr(layout, kind)], kind, **kwargs)

    try:
        _state.tp = group("tp", use_message_queue_broadcaster=True)
        _state.dcp = group("dcp", use_message_queue_broadcaster=True)
        _state.pcp = group("pcp")
        _state.pp = group("pp")
        _state.dp = group("dp")
        _state.ep = group("ep", use_all2all=sizes.expert_parallel)
        _state.etp = (
            _state.ep
            if not sizes.expert_parallel
            else group_of([[r] for r in range(world.world_size)], "etp")
        )
        engram = _node_local(layout.dp, world.host_keys)
        _state.engram_dp = (
            _state.dp if engram == [list(g) for g in layout.dp] else group_of(engram, "engram_dp")
        )
        _state.inner_dp_world = group("inner_dp_world", use_device_communicator=False)
        world.barrier()
    except BaseException:
        destroy_model_parallel()
        raise
    _state.sizes = sizes


def _node_local(groups: Any, host_keys: list[int]) -> list[list[int]]:
    """Each group of ``groups`` split by host (world ``host_keys``), order kept."""
    out: list[list[int]] = []
    for g in groups:
        by_host: dict[int, list[int]] = {}
        for r in g:
            by_host.setdefault(host_keys[r], []).append(r)
        out.extend(by_host.values())
    return out


def ensure_model_parallel_initialized(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    prefill_context_model_parallel_size: int = 1,
    decode_context_model_parallel_size: int | None = 1,
    backend: str | None = None,
) -> None:
    """Initialise the groups unless they exist; if they do, their sizes must match."""
    if not model_parallel_is_initialized():
        initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            prefill_context_model_parallel_size,
            decode_context_model_parallel_size,
            backend,
        )
        return
    assert _state.sizes is not None
    asked = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        prefill_context_model_parallel_size,
        decode_context_model_parallel_size or 1,
    )
    have = (_state.sizes.tp, _state.sizes.pp, _state.sizes.pcp, _state.sizes.dcp)
    if have != asked:
        raise AlreadyInitializedError(
            f"model parallel groups exist with (tp, pp, pcp, dcp) = {have}; asked for {asked}"
        )


def set_custom_all_reduce(enable: bool) -> None:
    """Whether groups built from now on may use custom all-reduce (CUDA)."""
    _state.custom_all_reduce = bool(enable)


def model_parallel_is_initialized() -> bool:
    return _state.tp is not None and _state.pp is not None


# ---- collectives by group name (vLLM's custom-op functions) ------------------------------


def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.ops.groupcoord.all_reduce(tensor, group_name)


def all_gather(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    return torch.ops.groupcoord.all_gather(tensor, dim, world_size, group_name)


def reduce_scatter(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    return torch.ops.groupcoord.reduce_scatter(tensor, dim, world_size, group_name)


# ---- graph capture, topology ----------------------------------------------------------------


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


# ---- teardown ---------------------------------------------------------------------------


# ---- sleep mode and checkpoints ---------------------------------------------------------


def _device_communicators() -> list[Any]:
    """The device communicators of every group of this rank, once each, in build order."""
    seen: set[int] = set()
    out = []
    for name in ("world", *_MODEL_GROUPS):
        group = getattr(_state, name)
        comm = None if group is None else group.device_communicator
        if comm is not None and id(comm) not in seen:
            seen.add(id(comm))
            out.append(comm)
    return out


def suspend_device_comms() -> None:
    """Sleep mode: every group's fast back ends release their resources (NCCL
    communicators, shared-memory all-reduce segments); collectives keep working
    on torch.distributed until :func:`resume_device_comms`. Every rank calls it."""
    for comm in _device_communicators():
        comm.suspend()


def resume_device_comms() -> None:
    """Re-create what :func:`suspend_device_comms` released (every rank calls it)."""
    for comm in _device_communicators():
        comm.resume()


def checkpoint_prepare_distributed_state() -> None:
    """Release every group's reclaimable communicator state before a checkpoint
    (``DeviceCommunicatorBase.checkpoint_prepare``; every rank calls it)."""
    for comm in _device_communicators():
        comm.checkpoint_prepare()


def checkpoint_restore_distributed_state() -> None:
    """Undo :func:`checkpoint_prepare_distributed_state` (every rank calls it)."""
    for comm in _device_communicators():
        comm.checkpoint_restore()


def destroy_model_parallel() -> None:
    """Destroy every model-parallel group (safe to call when there are none)."""
    for name in reversed(_MODEL_GROUPS):
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
    release_cached_outputs()


def _destroy_at_exit() -> None:
    """The exit hook: only the process that built the groups tears them down (a
    forked child that exits normally leaves its parent's groups and queues alone)."""
    if _state.owner_pid == os.getpid():
        destroy_distributed_environment()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Tear everything down and release cached device memory (vLLM's test helper)."""
    destroy_model_parallel()
    destroy_distributed_environment()
    if shutdown_ray:
        with contextlib.suppress(ImportError):
            import ray  # type: ignore[import-not-found]

            ray.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- names of the contract that groupcoord keeps but does not implement ---------------------

patched_fused_scaled_matmul_reduce_scatter = unsupported(
    "patched_fused_scaled_matmul_reduce_scatter", "torch symmetric-memory async-TP kernels"
)
patched_fused_scaled_matmul_reduce_scatter_fake = unsupported(
    "patched_fused_scaled_matmul_reduce_scatter_fake", "torch symmetric-memory async-TP kernels"
)
