"""Spawned ranks for the GPU tests (fork after CUDA initialisation is not allowed).

``run_spawned(fn, world_size, *args)`` starts ``world_size`` fresh interpreters
(multiprocessing "spawn") with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set,
runs ``fn(rank, world_size, *args)`` in each and returns their results in
rank order; a rank that raises or outlives ``timeout`` fails the test.
The parent never touches CUDA: ``gpu_count()`` asks NVML through torch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from coordinator.launch import free_port

_SPAWN = mp.get_context("spawn")


def gpu_count() -> int:
    # device_count() answers from NVML when it can, without initialising CUDA
    # in the pytest process (is_available() may initialise it).
    return torch.cuda.device_count()


def device_for(rank: int) -> torch.device:
    """Rank r on GPU r, or every rank on the one GPU of a single-GPU machine."""
    return torch.device("cuda", rank % torch.cuda.device_count())


def _child(conn: Connection, fn: Callable[..., Any], rank: int, world: int, port: int, args: Any):
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        }
    )
    try:
        conn.send(("ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0):
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = _SPAWN.Pipe(duplex=False)
        proc = _SPAWN.Process(target=_child, args=(child, fn, rank, world_size, port, args))
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        pending = dict(enumerate(conns))
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending.values()), timeout=1.0):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value = conn.recv()
                except EOFError:
                    errors.append(f"rank {rank} died (exit code {procs[rank].exitcode})")
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    errors.append(f"rank {rank} raised:\n{value}")
        if pending:
            errors.append(f"ranks {sorted(pending)} did not finish within {timeout} s")
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world_size)]
