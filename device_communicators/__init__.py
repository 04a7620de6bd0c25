"""Device communicators: one per device kind, plus all-reduce and all2all back ends.

The CUDA classes import without a GPU or CuPy (CuPy and NCCL load on first use).
"""

from __future__ import annotations

from .all2all import (
    AllGatherReduceScatterAll2AllManager,
    NaiveAll2AllManager,
    create_all2all_manager,
    known_all2all_backends,
)
from .all2all_base import All2AllManagerBase, HasMoEBufferSpec, MoEBufferSpec
from .all_reduce_backends import AllReduceBackend, AllReduceChain, TorchDistributedAllReduce
from .base_device_communicator import DeviceCommunicatorBase
from .cpu_communicator import CpuCommunicator
from .cuda_communicator import CudaCommunicator
from .custom_all_reduce import CustomAllreduce
from .errors import NotSupportedError
from .pynccl import PyNcclCommunicator
from .shm_all_reduce import ShmAllReduce

__all__ = [
    "All2AllManagerBase",
    "AllGatherReduceScatterAll2AllManager",
    "AllReduceBackend",
    "AllReduceChain",
    "CpuCommunicator",
    "CudaCommunicator",
    "CustomAllreduce",
    "DeviceCommunicatorBase",
    "HasMoEBufferSpec",
    "MoEBufferSpec",
    "NaiveAll2AllManager",
    "NotSupportedError",
    "PyNcclCommunicator",
    "ShmAllReduce",
    "TorchDistributedAllReduce",
    "create_all2all_manager",
    "known_all2all_backends",
]
