"""Rank functions of the GPU tests (module level, so spawned ranks can import them).

Inputs are deterministic per (rank, case); references are computed locally
from every rank's inputs, summing in fp32 in rank order like the kernels, so
custom all-reduce results are compared bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from gpu_harness import device_for
from multiproc import init_gloo

MiB = 1024 * 1024


def make_input(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + 31 * numel + seed)
    return torch.randn(numel, generator=gen).to(dtype)


def integer_input(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Small integers: every reduction order gives the same exact result."""
    gen = torch.Generator().manual_seed(104729 * rank + numel + seed)
    return torch.randint(-8, 9, (numel,), generator=gen).to(dtype)


def fp32_rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float().clone()
    for p in parts[1:]:
        acc += p.float()
    return acc.to(parts[0].dtype)


def _setup(rank: int, world: int) -> torch.device:
    device = device_for(rank)
    torch.cuda.set_device(device)
    init_gloo(rank, world, timeout_s=120.0)
    return device


# ---- custom all-reduce ------------------------------------------------------------


def custom_ar_eager(rank: int, world: int, cases: list[tuple[str, int, str]]) -> list[str] | str:
    from device_communicators.custom_all_reduce import CustomAllreduce

    device = _setup(rank, world)
    failures: list[str] = []
    try:
        ca = CustomAllreduce(dist.group.WORLD, device)
        if ca.disabled:  # e.g. no NVLink between 4 GPUs: the test skips with this reason
            return f"custom all-reduce disabled here: {ca.reason}"
        for dtype_name, numel, algo in cases:
            dtype = getattr(torch, dtype_name)
            ca.algo_setting = algo
            parts = [make_input(r, numel, dtype) for r in range(world)]
            expected = fp32_rank_order_sum(parts)
            mine = parts[rank].to(device)
            out = ca.all_reduce(mine)
            torch.cuda.synchronize(device)
            if not torch.equal(out.cpu(), expected):
                bad = (out.cpu().float() - expected.float()).abs().max().item()
                failures.append(f"{dtype_name} x{numel} {algo}: max error {bad}")
            if not torch.equal(mine.cpu(), parts[rank]):
                failures.append(f"{dtype_name} x{numel} {algo}: input was modified")
        # A transposed (weakly contiguous) input keeps its layout in the output.
        parts = [make_input(r, 64 * 32, torch.bfloat16).view(64, 32) for r in range(world)]
        out = ca.all_reduce(parts[rank].to(device).t())
        torch.cuda.synchronize(device)
        if not torch.equal(out.cpu(), fp32_rank_order_sum(parts).t()):
            failures.append("transposed bf16 input")
        ca.close()
    finally:
        dist.destroy_process_group()
    return failures


def custom_ar_graph(rank: int, world: int, numels: list[int], dtype_name: str) -> list[str] | str:
    from device_communicators.custom_all_reduce import CustomAllreduce

    device = _setup(rank, world)
    dtype = getattr(torch, dtype_name)
    failures: list[str] = []
    try:
        ca = CustomAllreduce(dist.group.WORLD, device)
        if ca.disabled:  # e.g. no NVLink between 4 GPUs: the test skips with this reason
            return f"custom all-reduce disabled here: {ca.reason}"
        static_in = [torch.zeros(n, dtype=dtype, device=device) for n in numels]
        graph = torch.cuda.CUDAGraph()
        with ca.capture():
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for x in static_in:  # warm-up inside capture mode: the eager path
                    ca.all_reduce(x)
            torch.cuda.current_stream(device).wait_stream(side)
            with torch.cuda.graph(graph):
                outs = [ca.all_reduce(x) for x in static_in]
        assert ca._registered == len(numels), ca._registered
        for step in range(3):
            expected = []
            for x, n in zip(static_in, numels):
                parts = [make_input(r, n, dtype, seed=step) for r in range(world)]
                x.copy_(parts[rank])
                expected.append(fp32_rank_order_sum(parts))
            graph.replay()
            torch.cuda.synchronize(device)
            for i, (out, exp) in enumerate(zip(outs, expected)):
                if not torch.equal(out.cpu(), exp):
                    failures.append(f"replay {step}, call {i} ({numels[i]} elements) differs")
        # Eager calls still work after graph registration.
        parts = [make_input(r, 4096, dtype, seed=99) for r in range(world)]
        out = ca.all_reduce(parts[rank].to(device))
        torch.cuda.synchronize(device)
        if not torch.equal(out.cpu(), fp32_rank_order_sum(parts)):
            failures.append("eager call after capture differs")
        del graph
        ca.close()
    finally:
        dist.destroy_process_group()
    return failures


# ---- pynccl -------------------------------------------------------------------------


def _check(failures: list[str], what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.shape != expected.shape or not torch.equal(got.cpu(), expected.cpu()):
        failures.append(
            f"{what}: got {tuple(got.shape)} {got.flatten()[:6].tolist()}, "
            f"expected {tuple(expected.shape)} {expected.flatten()[:6].tolist()}"
        )


def pynccl_ops(rank: int, world: int) -> list[str]:
    from torch.distributed import ReduceOp

    from device_communicators.pynccl import PyNcclCommunicator

    device = _setup(rank, world)
    failures: list[str] = []
    try:
        comm = PyNcclCommunicator(dist.group.WORLD, device)
        assert comm.available, comm.reason
        n = 1024
        parts = [integer_input(r, n, torch.float32) for r in range(world)]
        total = sum(parts)
        mine = parts[rank].to(device)
        _check(failures, "all_reduce sum", comm.all_reduce(mine), total)
        _check(
            failures,
            "all_reduce max",
            comm.all_reduce(mine, op=ReduceOp.MAX),
            torch.stack(parts).max(0).values,
        )
        _check(failures, "all_reduce avg", comm.all_reduce(mine, op=ReduceOp.AVG), total / world)
        bf = [p.to(torch.bfloat16) for p in parts]
        _check(
            failures,
            "all_reduce bf16",
            comm.all_reduce(bf[rank].to(device)),
            sum(b.float() for b in bf).to(torch.bfloat16),
        )
        out = torch.empty(world * n, device=device)
        comm.all_gather(out, mine)
        _check(failures, "all_gather", out, torch.cat(parts))
        f8 = [p.to(torch.float8_e4m3fn) for p in parts]
        out8 = torch.empty(world * n, dtype=torch.float8_e4m3fn, device=device)
        comm.all_gather(out8, f8[rank].to(device))
        _check(
            failures, "all_gather float8", out8.view(torch.uint8), torch.cat(f8).view(torch.uint8)
        )
        sizes = [3 + 2 * r for r in range(world)]
        rows = [
            integer_input(r, sizes[r] * 4, torch.float32).view(sizes[r], 4) for r in range(world)
        ]
        outv = torch.empty(sum(sizes), 4, device=device)
        comm.all_gatherv(outv, rows[rank].to(device), sizes)
        _check(failures, "all_gatherv", outv, torch.cat(rows))
        rs = torch.empty(n // world, device=device)
        comm.reduce_scatter(rs, mine)
        _check(failures, "reduce_scatter", rs, total.view(world, -1)[rank])
        big = [integer_input(r, sum(sizes) * 4, torch.float32).view(-1, 4) for r in range(world)]
        rsv = torch.empty(sizes[rank], 4, device=device)
        comm.reduce_scatterv(rsv, big[rank].to(device), sizes)
        start = sum(sizes[:rank])
        _check(failures, "reduce_scatterv", rsv, sum(big)[start : start + sizes[rank]])
        b = mine.clone()
        comm.broadcast(b, src=world - 1)
        _check(failures, "broadcast", b, parts[world - 1])
        if world >= 2:
            if rank == 0:
                comm.send(mine, dst=1)
            elif rank == 1:
                got = torch.empty(n, device=device)
                comm.recv(got, src=0)
                _check(failures, "send/recv", got, parts[0])
        ring = torch.empty(n, device=device)
        comm.batch_send_recv(sends=[(mine, (rank + 1) % world)], recvs=[(ring, (rank - 1) % world)])
        _check(failures, "batched ring exchange", ring, parts[(rank - 1) % world])
        torch.cuda.synchronize(device)
        comm.destroy()
    finally:
        dist.destroy_process_group()
    return failures


# ---- CudaCommunicator -------------------------------------------------------------------


def cuda_communicator_ops(rank: int, world: int) -> dict[str, Any]:
    from device_communicators.cuda_communicator import CudaCommunicator

    device = _setup(rank, world)
    failures: list[str] = []
    try:
        nccl_group = dist.new_group(list(range(world)), backend="nccl")
        comm = CudaCommunicator(dist.group.WORLD, device, nccl_group, unique_name="tp:0")
        chosen = {}
        small = make_input(rank, 4096, torch.bfloat16).to(device)
        large = make_input(rank, 4 * MiB, torch.bfloat16).to(device)  # 8 MiB: above custom AR max
        ints = integer_input(rank, 64, torch.int64).to(device)
        for name, t in (("small bf16", small), ("8 MiB bf16", large), ("int64", ints)):
            chosen[name] = comm.all_reduce_chain.select(t).name
        parts = [make_input(r, 4096, torch.bfloat16) for r in range(world)]
        _check(failures, "all_reduce (custom)", comm.all_reduce(small), fp32_rank_order_sum(parts))
        iparts = [integer_input(r, 64, torch.int64) for r in range(world)]
        _check(failures, "all_reduce (pynccl int64)", comm.all_reduce(ints), sum(iparts))
        x = [integer_input(r, 6 * 4, torch.float32).view(6, 4) for r in range(world)]
        _check(
            failures,
            "all_gather dim 1",
            comm.all_gather(x[rank].to(device), dim=1),
            torch.cat(x, 1),
        )
        v = [integer_input(r, 4 * (r + 1), torch.float32).view(4, r + 1) for r in range(world)]
        _check(
            failures,
            "all_gatherv dim 1 (discovered sizes)",
            comm.all_gatherv(v[rank].to(device), dim=1),
            torch.cat(v, 1),
        )
        y = [
            integer_input(r, 4 * 2 * world, torch.float32).view(4, 2 * world) for r in range(world)
        ]
        _check(
            failures,
            "reduce_scatter dim 1",
            comm.reduce_scatter(y[rank].to(device), dim=1),
            sum(y)[:, 2 * rank : 2 * rank + 2],
        )
        sizes = [1 + r for r in range(world)]
        z = [
            integer_input(r, sum(sizes) * 3, torch.float32).view(sum(sizes), 3)
            for r in range(world)
        ]
        start = sum(sizes[:rank])
        _check(
            failures,
            "reduce_scatterv",
            comm.reduce_scatterv(z[rank].to(device), dim=0, sizes=sizes),
            sum(z)[start : start + sizes[rank]],
        )
        b = x[rank].to(device)
        _check(failures, "broadcast", comm.broadcast(b, src=0), x[0])
        if rank == 0:
            comm.send(x[0].to(device), dst=1)
        elif rank == 1:
            _check(failures, "send/recv", comm.recv((6, 4), torch.float32, src=0), x[0])
        # Graph capture through the communicator: custom all-reduce in the graph.
        static = torch.zeros(4096, dtype=torch.bfloat16, device=device)
        graph = torch.cuda.CUDAGraph()
        with comm.graph_capture() as stream:
            with torch.cuda.stream(stream):
                comm.all_reduce(static)
            with torch.cuda.graph(graph, stream=stream):
                out = comm.all_reduce(static)
        parts = [make_input(r, 4096, torch.bfloat16, seed=5) for r in range(world)]
        static.copy_(parts[rank])
        graph.replay()
        torch.cuda.synchronize(device)
        _check(failures, "graph replay", out, fp32_rank_order_sum(parts))
        del graph
        comm.destroy()
        return {"failures": failures, "chosen": chosen, "describe": comm.describe()}
    finally:
        dist.destroy_process_group()
