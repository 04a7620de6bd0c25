"""The CPU communicator: Gloo for everything, shared memory first for all-reduce.

``CpuCommunicator`` is ``DeviceCommunicatorBase`` on a Gloo device group with
:class:`~device_communicators.shm_all_reduce.ShmAllReduce` in front of the
``torch.distributed`` all-reduce. When the ranks do not share a node (or the
shm path is disabled) the shm back end is built disabled and says why, and
Gloo takes every tensor.
"""

from __future__ import annotations

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
    ) -> None:
        super().__init__(cpu_group, device, device_group, unique_name)

    def _fast_all_reduce_backends(self) -> list[AllReduceBackend]:
        self.shm_all_reduce = ShmAllReduce(self.cpu_group, unique_name=self.unique_name)
        return [self.shm_all_reduce]
