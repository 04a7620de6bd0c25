"""Spawned ranks for the GPU tests (fork after CUDA initialisation is not allowed).

``run_spawned(fn, world_size, *args)`` is ``coordinator.launch.run_ranks`` with
``start_method="spawn"``: fresh interpreters with MASTER_ADDR/MASTER_PORT/
RANK/WORLD_SIZE set, results in rank order, and a rank that raises, dies or
outlives ``timeout`` fails the test naming it.
The parent never touches CUDA: ``gpu_count()`` asks NVML through torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from coordinator.launch import run_ranks


def gpu_count() -> int:
    # device_count() answers from NVML when it can, without initialising CUDA
    # in the pytest process (is_available() may initialise it).
    return torch.cuda.device_count()


def device_for(rank: int) -> torch.device:
    """Rank r on GPU r, or every rank on the one GPU of a single-GPU machine."""
    return torch.device("cuda", rank % torch.cuda.device_count())


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0):
    """The results of ``fn(rank, world_size, *args)`` on spawned ranks, in rank order
    (the package's launcher; NCCL kept on the loopback interface)."""
    env = {"NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo")}
    return run_ranks(fn, world_size, *args, timeout=timeout, env=env, start_method="spawn")
