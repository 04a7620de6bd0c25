"""All-reduce latency on GPUs: custom all-reduce vs pynccl vs torch.distributed (NCCL).

Each rank is a spawned process on its own GPU (or, for custom all-reduce
only, two ranks may share one GPU through IPC). Every call is timed with CUDA
events on the current stream; the table shows medians after warm-up, the
bus bandwidth (2(n-1)/n x bytes / time) and custom/torch and pynccl/torch
ratios. Without a GPU it says so and exits 0.

    python benchmarks/bench_cuda_allreduce.py --world 2 --quick
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402 - after the path set-up above
    environment,
    free_port,
    human_bytes,
    init_gloo_rank,
    median,
    plot_lines,
    print_table,
    reproduce_command,
    run_ranks,
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
    pynccl = PyNcclCommunicator(dist.group.WORLD, device) if one_gpu_per_rank else None
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
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
    if gpus < args.world:
        print(f"{gpus} GPU(s) for {args.world} ranks: only custom all-reduce (ranks share GPUs)")
    top = 4 * MiB if args.quick else 64 * MiB
    sizes, n = [], 4 * KiB
    while n <= top:
        sizes.append(n)
        n *= 4
    args.sizes = sizes
    if args.quick:
        args.iters, args.warmup = min(args.iters, 50), min(args.warmup, 5)
    # spawn: a CUDA context does not survive fork.
    try:
        per_rank = run_ranks(
            _measure, args.world, free_port(), args, timeout=1800, start_method="spawn"
        )
    except (RuntimeError, TimeoutError) as exc:
        print(exc, file=sys.stderr)
        return 1
    rows = per_rank[0]
    factor = 2 * (args.world - 1) / args.world
    for row in rows:
        for key in ("custom", "pynccl"):
            if f"{key}_us" in row and "torch_us" in row:
                row[f"{key}/torch"] = row[f"{key}_us"] / row["torch_us"]
        best = min(row.get(k, float("inf")) for k in ("custom_us", "pynccl_us", "torch_us"))
        if best != float("inf"):
            row["best_busbw_GBps"] = factor * row["bytes"] / best / 1e3
    columns = ["size", "custom_us", "pynccl_us", "torch_us", "custom/torch", "pynccl/torch"]
    print_table(rows, [*columns, "best_busbw_GBps"])
    write_json(args.json, {"command": reproduce_command(), "env": environment(), "rows": rows})
    if args.plot:
        series = {}
        for key in ("custom_us", "pynccl_us", "torch_us"):
            pts = [(r["bytes"], r[key]) for r in rows if key in r]
            if pts:
                series[key.removesuffix("_us")] = ([p[0] for p in pts], [p[1] for p in pts])
        plot_lines(
            args.plot, series, title="all-reduce latency (bf16)", xlabel="bytes", ylabel="us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
