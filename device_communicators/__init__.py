"""Device communicators: one per device kind, plus all-reduce and all2all back ends."""

from __future__ import annotations

from .all_reduce_backends import AllReduceBackend, AllReduceChain, TorchDistributedAllReduce
from .base_device_communicator import DeviceCommunicatorBase
from .cpu_communicator import CpuCommunicator
from .errors import NotSupportedError
from .shm_all_reduce import ShmAllReduce

__all__ = [
    "AllReduceBackend",
    "AllReduceChain",
    "CpuCommunicator",
    "DeviceCommunicatorBase",
    "NotSupportedError",
    "ShmAllReduce",
    "TorchDistributedAllReduce",
]
