"""Shared-memory all-reduce (CpuCommunicator) against torch.distributed.all_reduce on Gloo.

Both run in the same forked ranks on 127.0.0.1, interleaved batch by batch, on
fp32 tensors from 4 KiB to 64 MiB at world 2 and 4. Ours is out-of-place (it
returns a new tensor, as the communicator API does). ``gloo`` is the plain
in-place ``dist.all_reduce(x)`` (spared the output allocation, which costs
tens of ms at 64 MiB on a VM); ``gloo_oop`` is ``dist.all_reduce(x.clone())``,
the like-for-like out-of-place call. ``speedup`` = gloo / shm. Each rank runs
torch with one thread. Numbers are medians over batches of back-to-back
calls, after warm-up.

``--ops all_gather broadcast reduce_scatter`` measures the CpuCommunicator's
shm all-gather (dim 0; ``gloo_oop`` gathers and concatenates into one tensor
like ours), broadcast (both in place) and reduce-scatter (Gloo has none: its
``gloo`` column is the in-place all-reduce a Gloo user would run, ``gloo_oop``
that plus the slice) the same way; sizes are bytes per rank.

    python benchmarks/bench_all_reduce.py            # full sweep, all_reduce
    python benchmarks/bench_all_reduce.py --quick    # < 60 s
    python benchmarks/bench_all_reduce.py --plot     # also a PNG
    python benchmarks/bench_all_reduce.py --quick --ops all_reduce all_gather broadcast
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from coordinator.launch import free_port, run_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402 - after the path set-up above
    environment,
    human_bytes,
    init_gloo_rank,
    median,
    plot_lines,
    prepare_parent,
    print_table,
    reproduce_command,
    write_json,
)

FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
COLUMNS = [
    "op",
    "world",
    "size",
    "shm_us",
    "gloo_us",
    "speedup",
    "gloo_oop_us",
    "speedup_oop",
    "shm_GBps",
    "gloo_GBps",
]


def _implementations(op: str, comm: Any, x: Any) -> tuple[Any, Any, Any]:
    """(ours, gloo in place, gloo out of place) for one op, after a correctness check."""
    import torch
    import torch.distributed as dist

    world = comm.world_size
    if op == "all_reduce":
        want = x.clone()
        dist.all_reduce(want)
        # Orders differ (Gloo's ring vs our slot order): equal up to rounding.
        torch.testing.assert_close(comm.all_reduce(x), want, rtol=1e-5, atol=1e-5)
        return (
            lambda: comm.all_reduce(x),
            lambda: dist.all_reduce(x),
            lambda: dist.all_reduce(x.clone()),  # a fresh result, input untouched: like ours
        )
    if op == "all_gather":
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        assert torch.equal(comm.all_gather(x, dim=0), torch.cat(parts))
        return (
            lambda: comm.all_gather(x, dim=0),
            lambda: dist.all_gather(parts, x),  # into preallocated parts, no concatenation
            lambda: torch.cat(_gathered(x, world)),  # one result tensor: like ours
        )
    if op == "broadcast":
        y = x.clone()
        comm.broadcast(y, src=0)
        z = x.clone()
        dist.broadcast(z, src=0)
        assert torch.equal(y, z)
        return (
            lambda: comm.broadcast(x, src=0),
            lambda: dist.broadcast(x, src=0),
            lambda: dist.broadcast(x, src=0),  # both are in place
        )
    if op == "reduce_scatter":
        rows = x.numel() // world
        mine = slice(comm.rank_in_group * rows, (comm.rank_in_group + 1) * rows)
        want = x.clone()
        dist.all_reduce(want)
        torch.testing.assert_close(comm.reduce_scatter(x, dim=0), want[mine], rtol=1e-5, atol=1e-5)
        # Gloo has no reduce-scatter: its users all-reduce and keep their slice.
        return (
            lambda: comm.reduce_scatter(x, dim=0),
            lambda: dist.all_reduce(x),
            lambda: _all_reduced(x)[mine].clone(),
        )
    raise ValueError(f"unknown op {op!r}")


def _all_reduced(x: Any) -> Any:
    import torch.distributed as dist

    out = x.clone()
    dist.all_reduce(out)
    return out


def _gathered(x: Any, world: int) -> list[Any]:
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return parts


def _measure(
    op: str,
    world: int,
    nbytes: int,
    ours: Any,
    gloo: Any,
    gloo_oop: Any,
    budget: float,
    batches: int,
) -> dict[str, Any]:
    """Median seconds per call of each implementation, interleaved batch by batch."""
    import torch
    import torch.distributed as dist

    # Rank 0 picks the iteration count so every rank runs the same number.
    start = time.perf_counter()
    gloo()
    once = time.perf_counter() - start
    iters_t = torch.tensor([max(2, min(300, int(budget / max(once, 1e-6))))])
    dist.broadcast(iters_t, src=0)
    iters = int(iters_t.item())
    impls = (("shm", ours), ("gloo", gloo), ("gloo_oop", gloo_oop))
    for _, fn in impls:
        for _ in range(min(iters, 20)):
            fn()  # warm-up: page faults, caches, both ranks in step
    samples: dict[str, list[float]] = {name: [] for name, _ in impls}
    for _ in range(batches):
        for name, fn in impls:
            dist.barrier()
            for _ in range(min(iters, 5)):
                # Untimed: after the barrier (or the other implementation's
                # batch) the ranks wake at different times; start in step.
                fn()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - start) / iters)
    shm_s, gloo_s = median(samples["shm"]), median(samples["gloo"])
    oop_s = median(samples["gloo_oop"])
    return {
        "op": op,
        "world": world,
        "size": human_bytes(nbytes),
        "bytes": nbytes,
        "shm_us": shm_s * 1e6,
        "gloo_us": gloo_s * 1e6,
        "gloo_oop_us": oop_s * 1e6,
        "speedup": gloo_s / shm_s,
        "speedup_oop": oop_s / shm_s,
        "shm_GBps": nbytes / shm_s / 1e9,
        "gloo_GBps": nbytes / gloo_s / 1e9,
        "iters": iters,
        "batches": batches,
    }


def _rank_main(
    rank: int, world: int, port: int, ops: list[str], sizes: list[int], quick: bool
) -> list[dict[str, Any]]:
    """One rank's sweep; rank 0 returns the rows (every rank measures the same calls)."""
    import torch
    import torch.distributed as dist

    from device_communicators import CpuCommunicator

    init_gloo_rank(rank, world, port, timeout_s=120)
    comm = CpuCommunicator(dist.group.WORLD, unique_name="bench")
    budget = 0.03 if quick else 0.1  # seconds per batch
    batches = 3 if quick else 7
    rows = []
    try:
        for op in ops:
            for nbytes in sizes:
                x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
                ours, gloo, gloo_oop = _implementations(op, comm, x)
                rows.append(_measure(op, world, nbytes, ours, gloo, gloo_oop, budget, batches))
    finally:
        comm.destroy()
        dist.destroy_process_group()
    return rows if rank == 0 else []


def run_world(
    world: int, ops: list[str], sizes: list[int], quick: bool, timeout: float
) -> list[dict[str, Any]]:
    """Fork ``world`` ranks, run the sweep, return rank 0's rows."""
    port = free_port()
    return list(run_ranks(_rank_main, world, port, ops, sizes, quick, timeout=timeout)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations (< 60 s)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--ops",
        nargs="+",
        default=["all_reduce"],
        choices=["all_reduce", "all_gather", "broadcast", "reduce_scatter"],
    )
    parser.add_argument("--json", default="bench_results/bench_all_reduce.json")
    parser.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    prepare_parent()  # the ranks get torch's default threads
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    command = reproduce_command(None if argv is None else [sys.argv[0], *argv])
    print(f"# {command}", flush=True)
    rows: list[dict[str, Any]] = []
    for world in args.worlds:
        rows.extend(run_world(world, args.ops, sizes, args.quick, args.timeout))
    print_table(rows, COLUMNS)
    path = write_json(
        args.json,
        {"benchmark": "all_reduce", "command": command, "env": environment(), "rows": rows},
    )
    print(f"# wrote {path}")
    if args.plot:
        series = {}
        for op in args.ops:
            for world in args.worlds:
                mine = [r for r in rows if r["world"] == world and r["op"] == op]
                xs = [r["bytes"] for r in mine]
                series[f"{op} shm, world {world}"] = (xs, [r["shm_us"] for r in mine])
                series[f"{op} gloo, world {world}"] = (xs, [r["gloo_us"] for r in mine])
        png = plot_lines(
            os.path.splitext(args.json)[0] + ".png",
            series,
            title="latency by size (fp32, CPU ranks on one node)",
            xlabel="bytes per rank",
            ylabel="microseconds per call",
        )
        print(f"# wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
