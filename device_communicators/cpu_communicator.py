"""The CPU communicator: shared memory first for every collective it can take.

``CpuCommunicator`` is ``DeviceCommunicatorBase`` on a Gloo device group with
:class:`~device_communicators.shm_all_reduce.ShmAllReduce` in front of the
``torch.distributed`` all-reduce; all-gather (hence all_gatherv and the size
exchange of gather), reduce-scatter(v) and broadcast use its slots too.
When the ranks do not share a node (or the shm path is disabled) the shm
back end is built disabled and says why, and Gloo takes everything.
"""

from __future__ import annotations

import math

import torch
from torch.distributed import ProcessGroup

from .all_reduce_backends import AllReduceBackend
from .base_device_communicator import DeviceCommunicatorBase
from .shm_all_reduce import ShmAllReduce


class CpuCommunicator(DeviceCommunicatorBase):
    """Collectives of one group of CPU ranks (Gloo plus shared-memory all-reduce)."""

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        use_all2all: bool = False,
    ) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)

    def _fast_all_reduce_backends(self) -> list[AllReduceBackend]:
        self.shm_all_reduce = ShmAllReduce(self.cpu_group, unique_name=self.unique_name)
        return [self.shm_all_reduce]

    def _local_peer_pids(self) -> dict[int, int]:
        # The shm set-up exchanged pids; a failed Gloo call can then name the dead peer.
        return self.shm_all_reduce.peer_pids()

    # all_gather, all_gatherv, gather's size exchange and broadcast go through
    # the same shared-memory slots when the shm path is up (any dtype: bytes
    # are copied). The condition depends only on the group, never on the
    # tensor's layout, so every rank takes the same path.

    def _all_gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.shm_all_reduce.copy_refusal(tensor) is None:
            return self.shm_all_reduce.all_gather(tensor)
        return super()._all_gather_stacked(tensor)

    def _all_gather_control(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.shm_all_reduce.copy_refusal(tensor) is None:
            return self.shm_all_reduce.all_gather(tensor)
        return super()._all_gather_control(tensor)

    def _reduce_then_slice(
        self, input_: torch.Tensor, dim: int, start: int, length: int
    ) -> torch.Tensor:
        # reduce_scatter(v): each rank reduces only its own rows, in shared memory.
        if self.shm_all_reduce.refusal(input_) is not None:
            return super()._reduce_then_slice(input_, dim, start, length)
        moved = input_.movedim(dim, 0)
        inner = math.prod(moved.shape[1:])
        flat = moved.contiguous().view(-1)
        part = self.shm_all_reduce.reduce_range(flat, start * inner, (start + length) * inner)
        return part.view(length, *moved.shape[1:]).movedim(0, dim).contiguous()

    def _broadcast_(self, input_: torch.Tensor, src: int) -> torch.Tensor:
        if self.shm_all_reduce.copy_refusal(input_) is None:
            return self.shm_all_reduce.broadcast_(input_, src)
        return super()._broadcast_(input_, src)
