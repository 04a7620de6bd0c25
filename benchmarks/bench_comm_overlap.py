"""Compute overlapped with an async coordinator.comm all_reduce, against doing them in turn.

Each rank runs an all_reduce of ``--mib`` MiB over a ``coordinator.comm``
Gloo communicator and some compute, four ways: communication alone, compute
alone, both in sequence (blocking all_reduce, then compute) and overlapped
(``async_op=True``, compute, then ``work.wait()``). Two kinds of compute,
each sized to take about as long as the all_reduce (where overlap can at
best halve the time): ``matmul`` (square matmuls on one torch thread, CPU
work that competes with Gloo's threads for the cores) and ``sleep`` (the host
idles, as it does while a GPU computes). gain = sequential / overlapped;
ideal = sequential / max(comm, compute). ``torch_overlapped`` is the same
overlap with ``torch.distributed.all_reduce(async_op=True)`` on torch's
default Gloo group, measured in the same rounds, as the baseline.

    python benchmarks/bench_comm_overlap.py --quick
    python benchmarks/bench_comm_overlap.py --world 2 --mib 16 --iters 20

Numbers are medians over iterations after warm-up; on a loaded shared machine
the Gloo threads and the matmuls compete for the same cores, which caps the
matmul gain (two ranks busy on two cores leave Gloo no idle core).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from coordinator.launch import free_port, run_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402 - after the path set-up above
    environment,
    init_gloo_rank,
    median,
    prepare_parent,
    print_table,
    reproduce_command,
    write_json,
)

MATMUL_N = 256


def _interleaved(
    variants: dict[str, Callable[[], Any]], sync: Callable[[], None], iters: int
) -> dict[str, float]:
    """Median seconds of each variant; one run of every variant per round, so
    load that comes and goes on a shared machine hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(iters + 2):  # two warm-up rounds
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: median(values) for name, values in times.items()}


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    # coordinator.comm finds its rendezvous in the torchrun variables.
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    os.environ["WORLD_SIZE"] = str(world)
    import torch
    import torch.distributed as dist

    from coordinator.comm import new_comm

    # torch's default group is the baseline; the comm then shares its store.
    init_gloo_rank(rank, world, port, timeout_s=120)
    comm = new_comm("gloo", "cpu", "overlap", timeout=120)
    data = torch.ones(int(args.mib * (1 << 20)) // 4)
    a = torch.randn(MATMUL_N, MATMUL_N)
    b = torch.randn(MATMUL_N, MATMUL_N)

    def sync() -> None:
        comm.barrier()

    def matmuls(count: int) -> None:
        for _ in range(count):
            torch.mm(a, b)

    calib = _interleaved(
        {"comm": lambda: comm.all_reduce(data), "mm": lambda: matmuls(8)}, sync, args.iters
    )
    # Every rank must run the same amount of compute: agree on rank 0's choice.
    chosen = torch.tensor([max(1, round(calib["comm"] / (calib["mm"] / 8))), calib["comm"] * 1e6])
    comm.broadcast(chosen, 0)
    n_matmuls, sleep_s = int(chosen[0].item()), chosen[1].item() / 1e6
    computes: dict[str, Callable[[], None]] = {
        # CPU work on the cores the Gloo threads also need.
        "matmul": lambda: matmuls(n_matmuls),
        # The host idles, as it does while a GPU computes.
        "sleep": lambda: time.sleep(sleep_s),
    }
    results = []
    for kind in args.compute.split(","):
        compute = computes[kind]

        def sequential(compute: Callable[[], None] = compute) -> None:
            comm.all_reduce(data)
            compute()

        def overlapped(compute: Callable[[], None] = compute) -> None:
            work = comm.all_reduce(data, async_op=True)
            compute()
            work.wait()

        def torch_overlapped(compute: Callable[[], None] = compute) -> None:
            work = dist.all_reduce(data, async_op=True)
            compute()
            work.wait()

        medians = _interleaved(
            {
                "comm": lambda: comm.all_reduce(data),
                "compute": compute,
                "sequential": sequential,
                "overlapped": overlapped,
                "torch_overlapped": torch_overlapped,
            },
            sync,
            args.iters,
        )
        results.append(
            {
                "rank": rank,
                "compute": kind,
                "matmuls": n_matmuls if kind == "matmul" else 0,
                **{f"{name}_ms": value * 1e3 for name, value in medians.items()},
            }
        )
    comm.finalize()
    dist.destroy_process_group()
    return results


def run(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """Fork ``args.world`` ranks; return each rank's rows."""
    return run_ranks(_rank_main, args.world, free_port(), args, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", type=float, default=16.0, help="all_reduce size per rank")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="4 MiB, 10 iterations")
    parser.add_argument(
        "--compute",
        default="matmul,sleep",
        help="matmul (CPU work competing for the cores), sleep (host idle, as under GPU compute)",
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", default="bench_results/comm_overlap.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.iters = 4.0, 10
    prepare_parent()  # the ranks get torch's default threads
    per_rank = [row for rank_rows in run(args) for row in rank_rows]
    rows = []
    for kind in args.compute.split(","):
        mine = [r for r in per_rank if r["compute"] == kind]
        row = {
            "compute": kind,
            "world": args.world,
            "MiB": args.mib,
            "comm_ms": median([r["comm_ms"] for r in mine]),
            "compute_ms": median([r["compute_ms"] for r in mine]),
            "sequential_ms": max(r["sequential_ms"] for r in mine),
            "overlapped_ms": max(r["overlapped_ms"] for r in mine),
            "torch_overlapped_ms": max(r["torch_overlapped_ms"] for r in mine),
        }
        row["gain"] = row["sequential_ms"] / row["overlapped_ms"]
        row["ideal_gain"] = row["sequential_ms"] / max(row["comm_ms"], row["compute_ms"])
        rows.append(row)
    print_table(rows, list(rows[0]))
    for row in rows:
        print(f"{row['compute']}: overlap gain {row['gain']:.2f}x (ideal {row['ideal_gain']:.2f}x)")
    path = write_json(
        args.json,
        {
            "summary": rows,
            "per_rank": per_rank,
            "command": reproduce_command(),
            "env": environment(),
        },
    )
    print(f"wrote {path}")
    print(f"reproduce: {reproduce_command()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
