"""vLLM 0.33's ``vllm.distributed.utils``: divisibility helpers, tensor splits, pipeline
layer ranges, TCP stores and ``StatelessProcessGroup`` (re-exported from its module).

Differences, all listed in docs/vllm_compat.md: ``get_pp_indices`` takes an explicit
``partition`` (keyword-only) instead of reading ``VLLM_PP_LAYER_PARTITION``; the
stateless torch process-group builders make Gloo groups only.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from device_communicators import checks
from shm_broadcast.config import get_config, resolve_timeout
from shm_broadcast.errors import GroupcoordValueError

from .stateless_group import StatelessProcessGroup

__all__ = [
    "StatelessProcessGroup",
    "cpu_all_reduce_",
    "create_tcp_store",
    "divide",
    "ensure_divisibility",
    "get_cached_tcp_store_client",
    "get_cpu_distributed_timeout_or_none",
    "get_distributed_timeout_or_none",
    "get_pp_indices",
    "get_worker_rank_suffix",
    "init_gloo_process_group",
    "is_weak_contiguous",
    "sched_yield",
    "split_tensor_along_last_dim",
    "stateless_destroy_torch_distributed_process_group",
    "stateless_init_torch_distributed_process_group",
    "verify_group_size_divides_partition",
]

logger = logging.getLogger("groupcoord.coordinator")


def sched_yield() -> None:
    """Give up the CPU to another runnable thread or process."""
    os.sched_yield()


def ensure_divisibility(numerator: int, denominator: int) -> None:
    if denominator == 0 or numerator % denominator:
        raise GroupcoordValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, refusing a remainder."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def verify_group_size_divides_partition(
    input_size_per_partition: int,
    group_size: int,
    layer_name: str | None = None,
    extra_suggestion: str = "",
) -> None:
    if group_size and input_size_per_partition % group_size == 0:
        return
    where = f" of layer {layer_name}" if layer_name else ""
    raise GroupcoordValueError(
        f"the input size per partition{where} ({input_size_per_partition}) is not divisible "
        f"by the group size ({group_size}). {extra_suggestion}".rstrip()
    )


def is_weak_contiguous(inp: torch.Tensor) -> bool:
    """Dense storage in some order: contiguous, or its elements fill its storage span."""
    return inp.is_contiguous() or (
        inp.untyped_storage().nbytes() - inp.storage_offset() * inp.element_size()
        == inp.numel() * inp.element_size()
    )


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    """``num_partitions`` equal views along the last dimension (copies if asked)."""
    last = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def get_pp_indices(
    num_hidden_layers: int,
    pp_rank: int,
    pp_size: int,
    *,
    partition: Sequence[int] | None = None,
) -> tuple[int, int]:
    """[start, end) of the layers of pipeline stage ``pp_rank``.

    Even split; remainder layers go to the stages before the last, from the
    second-to-last backwards (the last stage also runs the LM head), as vLLM
    does. ``partition`` (ours) gives each stage's layer count explicitly.
    """
    if partition is not None:
        partitions = list(partition)
        if len(partitions) != pp_size or sum(partitions) != num_hidden_layers:
            raise GroupcoordValueError(
                f"partition={partitions} must list {pp_size} counts summing to {num_hidden_layers}"
            )
    else:
        partitions = [num_hidden_layers // pp_size] * pp_size
        for i in range(2, num_hidden_layers % pp_size + 2):
            partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def cpu_all_reduce_(
    tensor: torch.Tensor, group: Any, timeout: datetime.timedelta | None = None
) -> torch.Tensor:
    """In-place sum over a CPU (Gloo) group, waiting at most ``timeout``."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None
    work.wait(datetime.timedelta(seconds=resolve_timeout(timeout)))
    return tensor


def create_tcp_store(
    host: str, port: int, listen_socket: socket.socket | None = None, **kwargs: Any
) -> dist.TCPStore:
    """A TCPStore client of ``host:port``, or its server when ``listen_socket`` (an
    already bound and listening socket, so no other process can take the port) is given."""
    if listen_socket is not None:
        kwargs.setdefault("is_master", True)
        return dist.TCPStore(
            host, port, master_listen_fd=listen_socket.detach(), use_libuv=False, **kwargs
        )
    return dist.TCPStore(host, port, **kwargs)


@functools.cache
def get_cached_tcp_store_client(host: str, port: int) -> dist.TCPStore:
    """One client per (host, port) in this process."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False)


def get_cpu_distributed_timeout_or_none() -> datetime.timedelta | None:
    """The configured deadline (``GROUPCOORD_TIMEOUT_S``) as a timedelta."""
    return datetime.timedelta(seconds=get_config().timeout_s)


get_distributed_timeout_or_none = get_cpu_distributed_timeout_or_none


def get_worker_rank_suffix(global_rank: int | None = None) -> str:
    """'dp0_pp0_tp0_dcp0_ep0_rank0' style: every parallel rank, then the global one."""
    from . import parallel_state as ps

    parts = []
    if ps.model_parallel_is_initialized():
        for name, getter in (
            ("dp", ps.get_dp_group),
            ("pp", ps.get_pp_group),
            ("tp", ps.get_tp_group),
            ("dcp", ps.get_dcp_group),
            ("ep", ps.get_ep_group),
        ):
            parts.append(f"{name}{getter().rank_in_group}")
    if global_rank is not None:
        parts.append(f"rank{global_rank}")
    return "_".join(parts)


def init_gloo_process_group(
    prefix_store: dist.PrefixStore,
    group_rank: int,
    group_size: int,
    timeout: datetime.timedelta,
) -> dist.ProcessGroup:
    """A Gloo ``ProcessGroup`` over ``prefix_store``, outside torch.distributed's
    default world (none needs to exist); ``torch.distributed`` calls take it as
    ``group=``. ``timeout`` is a timedelta or seconds."""
    checks.rank(group_rank, "group_rank", group_size)
    td = datetime.timedelta(seconds=resolve_timeout(timeout))
    pg = dist.ProcessGroup(prefix_store, group_rank, group_size)
    backend = dist.ProcessGroupGloo(prefix_store, group_rank, group_size, timeout=td)
    gloo = dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(gloo)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), gloo, backend)
    return pg


def stateless_init_torch_distributed_process_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str | None = None,
    return_store: bool = False,
    listen_socket: socket.socket | None = None,
    timeout: datetime.timedelta | None = None,
) -> dist.ProcessGroup | tuple[dist.ProcessGroup, dist.Store]:
    """vLLM's group outside the default world: its own TCPStore at ``host:port``
    (rank 0 hosts it, on ``listen_socket`` when given) and a Gloo process group
    over it, so several such groups (an engine's DP groups, say) can coexist.
    Only ``backend="gloo"``: device tensors go through ``PyNcclCommunicator``."""
    if backend != "gloo":
        raise GroupcoordValueError(
            f"backend={backend!r}: groupcoord builds stateless groups on 'gloo' only; "
            "for NCCL, bootstrap a PyNcclCommunicator over this group"
        )
    checks.rank(rank, "rank", world_size)
    td = datetime.timedelta(seconds=resolve_timeout(timeout))
    store = create_tcp_store(
        host,
        port,
        listen_socket if rank == 0 else None,
        world_size=world_size,
        is_master=rank == 0,
        timeout=td,
    )
    prefix = dist.PrefixStore(f"groupcoord/stateless/{group_name or f'{host}:{port}'}", store)
    pg = init_gloo_process_group(prefix, rank, world_size, td)
    return (pg, store) if return_store else pg


def stateless_destroy_torch_distributed_process_group(pg: dist.ProcessGroup) -> None:
    """Shut a group from :func:`stateless_init_torch_distributed_process_group` down."""
    pg.shutdown()
