"""MPI's side of ``bench_collectives.py``: the same collectives through mpi4py on MPICH.

Run by ``bench_collectives.py`` under ``mpiexec -n WORLD`` (MPICH's shared-memory
transport on one machine); rank 0 prints one JSON list of rows on stdout:
``{"op", "bytes", "mpi_us"}``. Buffers are float32 numpy arrays of the same
bytes per rank as ours; all_reduce is out-of-place (``Allreduce(send, recv)``),
all_gather is ``Allgather``, reduce_scatter ``Reduce_scatter_block``, broadcast
``Bcast`` from rank 0, send_recv
a ``Send``/``Recv`` ping-pong between ranks 0 and 1 into a fresh array, timed
per one-way trip as ours is.
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
from _timing import per_call_seconds
from mpi4py import MPI


def _ping_pong(comm: MPI.Comm, x: np.ndarray, _: None) -> None:
    rank = comm.Get_rank()
    if rank == 0:
        comm.Send(x, dest=1)
        comm.Recv(np.empty_like(x), source=1)
    elif rank == 1:
        got = np.empty_like(x)
        comm.Recv(got, source=0)
        comm.Send(got, dest=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", required=True)
    parser.add_argument("--sizes", required=True, help="bytes per rank, comma-separated")
    parser.add_argument("--budget", type=int, required=True, help="bytes moved per batch")
    parser.add_argument("--max-iters", type=int, required=True)
    parser.add_argument("--batches", type=int, required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    world = comm.Get_size()

    def agree(value: int) -> int:
        return int(comm.bcast(value, root=0))

    rows = []
    for op in args.ops.split(","):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            n = max(nbytes // 4, world)
            n -= n % world
            x = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
            calls = {
                "all_reduce": (comm.Allreduce, np.empty_like(x)),
                "all_gather": (comm.Allgather, np.empty(n * world, dtype=np.float32)),
                "reduce_scatter": (comm.Reduce_scatter_block, np.empty(n // world, np.float32)),
                "send_recv": (functools.partial(_ping_pong, comm), None),
            }
            if op == "broadcast":
                fn = functools.partial(comm.Bcast, x, 0)
            elif op in calls:
                call, out = calls[op]
                fn = functools.partial(call, x, out)
            else:
                continue
            iters = max(2, min(args.max_iters, args.budget // max(n * 4, 1)))
            seconds = per_call_seconds(fn, agree, iters, args.batches)
            trips = 2 if op == "send_recv" else 1
            rows.append({"op": op, "bytes": n * 4, "mpi_us": seconds * 1e6 / trips})
    if comm.Get_rank() == 0:
        print(json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
