"""All-reduce on GPUs: custom all-reduce vs pynccl vs torch.distributed (NCCL).

For each world size in ``--worlds``, ranks are spawned processes, rank r on
GPU r mod count. With one GPU per rank all three back ends run; when ranks
share a GPU only custom all-reduce does (NCCL refuses two ranks on a device),
and at world 1 only NCCL does (a copy: the floor of a collective's cost). Each
call is timed with CUDA events on the current stream: the table shows medians
after warm-up, one column per (world, back end), and the best bus bandwidth
(2(n-1)/n x bytes / time). Ranks sharing one GPU without MPS are time-sliced,
so their latency says more about the GPU's scheduler than about the kernels.
Without a GPU it says so and exits 0.

    python benchmarks/bench_cuda_allreduce.py --worlds 1,2,4 --quick
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from coordinator.launch import RankError, free_port, run_ranks

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

KiB = 1024
MiB = 1024 * KiB


def _time_calls(fn: Any, iters: int, warmup: int) -> float:
    """Median microseconds per call, each call between two CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    return median(samples)


def _measure(rank: int, world: int, port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from device_communicators.custom_all_reduce import CustomAllreduce
    from device_communicators.pynccl import PyNcclCommunicator

    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    init_gloo_rank(rank, world, port, timeout_s=300)
    one_gpu_per_rank = gpus >= world
    custom = CustomAllreduce(dist.group.WORLD, device, max_size=max(args.sizes) + 16)
    pynccl = None
    if one_gpu_per_rank:
        pynccl = PyNcclCommunicator(dist.group.WORLD, device, allow_single_rank=True)
    nccl_group = dist.new_group(list(range(world)), backend="nccl") if one_gpu_per_rank else None
    rows = []
    for nbytes in args.sizes:
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
        row: dict[str, Any] = {"bytes": nbytes, "size": human_bytes(nbytes)}
        if custom.should_custom_ar(x):
            call = functools.partial(custom.all_reduce, x)
            row["custom_us"] = _time_calls(call, args.iters, args.warmup)
        if pynccl is not None and pynccl.available:
            call = functools.partial(pynccl.all_reduce, x)
            row["pynccl_us"] = _time_calls(call, args.iters, args.warmup)
        if nccl_group is not None:
            # In place on a scratch copy: c10d's all_reduce has no out-of-place form.
            call = functools.partial(dist.all_reduce, x.clone(), group=nccl_group)
            row["torch_us"] = _time_calls(call, args.iters, args.warmup)
        rows.append(row)
    custom.close()
    if pynccl is not None:
        pynccl.destroy()
    dist.destroy_process_group()
    return rows


BACKENDS = ("custom", "pynccl", "torch")


def _merge(per_world: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per size: ``w{world} {back end}`` columns and the best bus bandwidth."""
    rows: dict[int, dict[str, Any]] = {}
    for world, world_rows in per_world.items():
        factor = 2 * (world - 1) / world if world > 1 else 1.0
        for r in world_rows:
            row = rows.setdefault(r["bytes"], {"bytes": r["bytes"], "size": r["size"]})
            for key in BACKENDS:
                if f"{key}_us" in r:
                    row[f"w{world} {key}_us"] = r[f"{key}_us"]
                    busbw = factor * r["bytes"] / r[f"{key}_us"] / 1e3
                    row[f"w{world} busbw_GBps"] = max(row.get(f"w{world} busbw_GBps", 0.0), busbw)
    return [rows[b] for b in sorted(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2", help="comma-separated world sizes")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--json", default="benchmarks/results/cuda_allreduce.json")
    parser.add_argument("--plot", default="", help="PNG path for a latency plot")
    args = parser.parse_args(argv)
    print(f"# {reproduce_command()}")
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 1:
        print("no CUDA GPU on this machine: nothing to measure (custom all-reduce needs one GPU")
        print("for two ranks; pynccl and torch.distributed NCCL need one GPU per rank).")
        return 0
    prepare_parent()  # the ranks get torch's default threads
    top = 4 * MiB if args.quick else 64 * MiB
    sizes, n = [], 4 * KiB
    while n <= top:
        sizes.append(n)
        n *= 4
    args.sizes = sizes
    if args.quick:
        args.iters, args.warmup = min(args.iters, 50), min(args.warmup, 5)
    worlds = [int(w) for w in args.worlds.split(",")]
    per_world: dict[int, list[dict[str, Any]]] = {}
    for world in worlds:
        if gpus < world:
            print(f"world {world} on {gpus} GPU(s): custom all-reduce only (ranks share GPUs)")
        # spawn: a CUDA context does not survive fork.
        try:
            per_rank = run_ranks(
                _measure, world, free_port(), args, timeout=1800, start_method="spawn"
            )
        except RankError as exc:
            print(exc, file=sys.stderr)
            return 1
        per_world[world] = per_rank[0]
    rows = _merge(per_world)
    columns = ["size"]
    for row in rows:
        columns += [c for c in row if c not in ("bytes", "size", *columns)]
    print_table(rows, columns)
    write_json(args.json, {"command": reproduce_command(), "env": environment(), "rows": rows})
    if args.plot:
        series = {}
        for column in columns[1:]:
            if column.endswith("_us"):
                pts = [(r["bytes"], r[column]) for r in rows if column in r]
                series[column.removesuffix("_us")] = ([p[0] for p in pts], [p[1] for p in pts])
        plot_lines(
            args.plot, series, title="all-reduce latency (bf16)", xlabel="bytes", ylabel="us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
