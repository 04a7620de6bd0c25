"""Collectives as ``torch.library`` custom ops, so ``torch.compile`` traces them.

Each op is out-of-place and names its group by the group's unique name
("tp:0"); the implementation looks the live ``GroupCoordinator`` up in a
registry of weak references. Fake implementations give output shapes from
the arguments alone, so a compiled function with collectives traces into one
graph without breaks. Eager callers skip the dispatcher (it costs more than a
small shared-memory all-reduce); the coordinator calls these ops only while
``torch.compile`` is tracing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .errors import NotInitializedError

_GROUPS: dict[str, weakref.ReferenceType[Any]] = {}


def register_group(unique_name: str, group: Any) -> None:
    _GROUPS[unique_name] = weakref.ref(group)


def unregister_group(unique_name: str) -> None:
    _GROUPS.pop(unique_name, None)


def live_groups() -> int:
    """How many groups of this process are registered and alive."""
    return sum(1 for ref in _GROUPS.values() if ref() is not None)


def lookup_group(unique_name: str) -> Any:
    ref = _GROUPS.get(unique_name)
    group = ref() if ref is not None else None
    if group is None:
        raise NotInitializedError(f"group {unique_name!r} does not exist (destroyed or never made)")
    return group


def _fresh(out: torch.Tensor, input_: torch.Tensor) -> torch.Tensor:
    # A custom op's output may not alias its input.
    return out.clone() if out is input_ or out.data_ptr() == input_.data_ptr() else out


@torch.library.custom_op("groupcoord::all_reduce", mutates_args=())
def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return _fresh(lookup_group(group_name)._all_reduce_eager(tensor), tensor)


def all_reduce_fake(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


all_reduce.register_fake(all_reduce_fake)


@torch.library.custom_op("groupcoord::all_gather", mutates_args=())
def all_gather(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    return _fresh(lookup_group(group_name)._all_gather_eager(tensor, dim), tensor)


def all_gather_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] *= world_size
    return tensor.new_empty(shape)


all_gather.register_fake(all_gather_fake)


@torch.library.custom_op("groupcoord::all_gatherv", mutates_args=())
def all_gatherv(tensor: torch.Tensor, dim: int, sizes: list[int], group_name: str) -> torch.Tensor:
    out = lookup_group(group_name)._all_gatherv_eager(tensor, dim, list(sizes))
    return _fresh(out, tensor)


@all_gatherv.register_fake
def _(tensor: torch.Tensor, dim: int, sizes: list[int], group_name: str) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = sum(sizes)
    return tensor.new_empty(shape)


@torch.library.custom_op("groupcoord::reduce_scatter", mutates_args=())
def reduce_scatter(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    return _fresh(lookup_group(group_name)._reduce_scatter_eager(tensor, dim), tensor)


def reduce_scatter_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] //= world_size
    return tensor.new_empty(shape)


reduce_scatter.register_fake(reduce_scatter_fake)


@torch.library.custom_op("groupcoord::reduce_scatterv", mutates_args=())
def reduce_scatterv(
    tensor: torch.Tensor, dim: int, sizes: list[int], rank_in_group: int, group_name: str
) -> torch.Tensor:
    out = lookup_group(group_name)._reduce_scatterv_eager(tensor, dim, list(sizes))
    return _fresh(out, tensor)


@reduce_scatterv.register_fake
def _(
    tensor: torch.Tensor, dim: int, sizes: list[int], rank_in_group: int, group_name: str
) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = sizes[rank_in_group]
    return tensor.new_empty(shape)


@torch.library.custom_op("groupcoord::broadcast", mutates_args=())
def broadcast(tensor: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    # Out of place: the op broadcasts into a copy and returns it.
    return lookup_group(group_name)._broadcast_eager(tensor.clone(), src)


@broadcast.register_fake
def _(tensor: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)
