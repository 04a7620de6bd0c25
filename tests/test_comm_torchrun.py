"""new_comm() with no arguments under a real torchrun launch (agent-served store).

Run as a script, this file is the worker; the test starts it with torchrun.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def _worker() -> None:
    from coordinator.comm import all_gather_object, new_comm

    with new_comm() as comm:  # rank, size and store all come from torchrun's environment
        t = torch.full((2,), float(comm.get_rank() + 1))
        comm.all_reduce(t)
        ranks: list = [None] * comm.get_size()
        all_gather_object(comm, ranks, {"rank": comm.get_rank(), "pid": os.getpid()})
        assert [r["rank"] for r in ranks] == list(range(comm.get_size()))
        print(f"rank {comm.get_rank()} sum {t[0].item():g}", flush=True)


def test_new_comm_under_torchrun() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 sum 3" in done.stdout and "rank 1 sum 3" in done.stdout, done.stdout


if __name__ == "__main__":
    _worker()
