"""Rank functions of the GPU tests (module level, so spawned ranks can import them).

Inputs are deterministic per (rank, case); references are computed locally
from every rank's inputs, summing in fp32 in rank order like the kernels, so
custom all-reduce results are compared bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from gpu_harness import device_for

from coordinator.launch import init_gloo

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
                    ca.custom_all_reduce(x)
            torch.cuda.current_stream(device).wait_stream(side)
            with torch.cuda.graph(graph):
                # vLLM's entry: registers the captured inputs instead of copying them.
                outs = [ca.custom_all_reduce(x) for x in static_in]
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


# ---- pynccl at world 1: the ctypes binding and stream handling on one GPU -------------------

WORLD1_DTYPES = (
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
)
SENTINEL = 77


def _padded(like: torch.Tensor, extra: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """An output view followed by sentinel elements: a wrong count or dtype size
    (the ABI mistakes a world-1 call can show) overwrites them."""
    buf = torch.full((like.numel() + extra,), SENTINEL, dtype=like.dtype, device=like.device)
    return buf[: like.numel()].view(like.shape), buf[like.numel() :]


def _exact(failures: list[str], what: str, out: torch.Tensor, ref: torch.Tensor, pad: Any) -> None:
    torch.cuda.synchronize()
    _check(failures, what, out, ref)
    if pad is not None and not bool((pad == SENTINEL).all()):
        failures.append(f"{what}: wrote past the end of its output")


def pynccl_world1(rank: int, world: int) -> dict[str, Any]:
    """Every op of the table through PyNcclCommunicator on one rank (NCCL accepts it)."""
    from torch.distributed import ReduceOp

    from device_communicators.errors import GroupcoordTypeError
    from device_communicators.pynccl import PyNcclCommunicator

    device = _setup(rank, world)
    failures: list[str] = []
    try:
        comm = PyNcclCommunicator(dist.group.WORLD, device, strict=True, allow_single_rank=True)
        assert comm.nccl is not None
        n = 1031  # odd: a count rounded to a vector width shows
        ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG]
        dtypes: list[torch.dtype] = list(WORLD1_DTYPES)
        if comm.nccl.version_code >= 22400:
            dtypes += [torch.float8_e4m3fn, torch.float8_e5m2]
        for dtype in dtypes:
            x = integer_input(0, n, torch.float32).abs().to(dtype).to(device)
            for op in ops:
                if dtype.is_floating_point is False and op == ReduceOp.AVG:
                    continue  # NCCL's ncclAvg is for floating types
                out, pad = _padded(x)
                if op == ReduceOp.AVG and dtype.itemsize == 1:  # float8: NCCL refuses AVG
                    try:
                        comm.all_reduce(x, out, op=op)
                        failures.append(f"all_reduce {dtype} AVG was not refused")
                    except GroupcoordTypeError as exc:
                        if "does not average" not in str(exc):
                            failures.append(f"all_reduce {dtype} AVG: unclear refusal {exc}")
                    continue
                try:
                    comm.all_reduce(x, out, op=op)
                except Exception as exc:  # noqa: BLE001 - reported per case
                    failures.append(f"all_reduce {dtype} {op}: {exc}")
                    continue
                _exact(
                    failures,
                    f"all_reduce {dtype} {op}",
                    out.view(torch.uint8),
                    x.view(torch.uint8),
                    pad,
                )
        x = integer_input(0, n, torch.float32).to(device)
        out, pad = _padded(x)
        comm.all_gather(out, x)
        _exact(failures, "all_gather", out, x, pad)
        out, pad = _padded(x)
        comm.reduce_scatter(out, x)
        _exact(failures, "reduce_scatter", out, x, pad)
        rows = integer_input(0, 5 * 3, torch.float32).view(5, 3).to(device)
        outv = torch.zeros(5, 3, device=device)
        comm.all_gatherv(outv, rows, [5])
        _exact(failures, "all_gatherv", outv, rows, None)
        outv = torch.zeros(5, 3, device=device)
        comm.reduce_scatterv(outv, rows, [5])
        _exact(failures, "reduce_scatterv", outv, rows, None)
        b = x.clone()
        comm.broadcast(b, src=0)
        _exact(failures, "broadcast", b, x, None)
        got = torch.zeros_like(x)
        comm.batch_send_recv(sends=[(x, 0)], recvs=[(got, 0)])
        _exact(failures, "send/recv to self (grouped)", got, x, None)
        # Several collectives in one NCCL group.
        y = integer_input(0, 64, torch.float16).to(device)
        out_x, out_y = torch.empty_like(x), torch.empty_like(y)
        comm.group_start()
        comm.all_reduce(x, out_x)
        comm.all_reduce(y, out_y)
        comm.group_end()
        _exact(failures, "grouped all_reduce (1)", out_x, x, None)
        _exact(failures, "grouped all_reduce (2)", out_y, y, None)
        # Stream handling: the op must queue behind work on the caller's stream.
        side = torch.cuda.Stream(device)
        z = torch.zeros(n, device=device)
        out_z = torch.empty_like(z)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # tens of ms of GPU time ahead of the fill
            z.fill_(3.0)
            comm.all_reduce(z, out_z)  # current stream: side
        side.synchronize()
        _exact(failures, "all_reduce on the caller's stream", out_z, torch.full((n,), 3.0), None)
        out_z.zero_()
        explicit = torch.cuda.Stream(device)
        with torch.cuda.stream(explicit):
            torch.cuda._sleep(50_000_000)
            z.fill_(4.0)
        comm.all_reduce(z, out_z, stream=explicit)  # stream= overrides the current one
        explicit.synchronize()
        _exact(failures, "all_reduce on stream=", out_z, torch.full((n,), 4.0), None)
        # Captured in a CUDA graph, replayed with new inputs.
        static_in = torch.zeros(n, device=device)
        static_out = torch.zeros(n, device=device)
        static_gather = torch.zeros(n, device=device)
        graph = torch.cuda.CUDAGraph()
        warm = torch.cuda.Stream(device)
        warm.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(warm):
            comm.all_reduce(static_in, static_out)
        torch.cuda.current_stream(device).wait_stream(warm)
        with torch.cuda.graph(graph):
            comm.all_reduce(static_in, static_out)
            comm.all_gather(static_gather, static_out)
        for step in range(3):
            new = integer_input(0, n, torch.float32, seed=step + 1).to(device)
            static_in.copy_(new)
            graph.replay()
            _exact(failures, f"graph replay {step} all_reduce", static_out, new, None)
            _exact(failures, f"graph replay {step} all_gather", static_gather, new, None)
        del graph
        version = comm.nccl.version
        comm.destroy()
    finally:
        dist.destroy_process_group()
    return {"failures": failures, "nccl": version, "dtypes": [str(d) for d in dtypes]}


def pynccl_shared_gpu(rank: int, world: int) -> dict[str, Any]:
    """Several ranks on one GPU: NCCL either works or every rank disables with one reason."""
    from device_communicators.pynccl import PyNcclCommunicator

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_gloo(rank, world, timeout_s=120.0)
    try:
        comm = PyNcclCommunicator(dist.group.WORLD, device)
        result: dict[str, Any] = {"available": comm.available, "reason": comm.reason}
        if comm.available:
            parts = [integer_input(r, 256, torch.float32) for r in range(world)]
            result["ok"] = torch.equal(comm.all_reduce(parts[rank].to(device)).cpu(), sum(parts))
            comm.destroy()
        return result
    finally:
        dist.destroy_process_group()


# ---- GroupCoordinator on CUDA -------------------------------------------------------------


def coordinator_world1(rank: int, world: int) -> list[str]:
    """parallel_state on one GPU: every op is the identity, graph capture works."""
    from coordinator import parallel_state as ps

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    failures: list[str] = []
    ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", 0, "nccl")
    try:
        ps.initialize_model_parallel(1, 1)
        tp = ps.get_tp_group()
        if tp.device != device:
            failures.append(f"tp group on {tp.device}")
        x = integer_input(0, 6 * 8, torch.bfloat16).view(6, 8).to(device)
        _check(failures, "all_reduce", tp.all_reduce(x), x)
        _check(failures, "all_gather", tp.all_gather(x, dim=1), x)
        _check(failures, "all_gatherv", tp.all_gatherv(x, dim=0, sizes=[6]), x)
        _check(failures, "reduce_scatter", tp.reduce_scatter(x, dim=0), x)
        _check(failures, "reduce_scatterv", tp.reduce_scatterv(x, dim=0, sizes=[6]), x)
        gathered = tp.gather(x, dst=0, dim=0)
        if gathered is None:
            failures.append("gather returned None on its destination")
        else:
            _check(failures, "gather", gathered, x)
        _check(failures, "broadcast", tp.broadcast(x, src=0), x)
        got = tp.broadcast_tensor_dict({"h": x, "step": 3}, src=0)
        if got is None or got["step"] != 3 or not torch.equal(got["h"], x):
            failures.append(f"broadcast_tensor_dict gave {got}")
        graph = torch.cuda.CUDAGraph()
        static = torch.zeros(64, device=device)
        with ps.graph_capture(device) as ctx:
            if ctx.stream is None or ctx.stream == torch.cuda.default_stream(device):
                failures.append("graph_capture did not give a side stream")
            with torch.cuda.graph(graph, stream=ctx.stream):
                out = tp.all_reduce(static) * 2
        static.copy_(torch.arange(64.0, device=device))
        graph.replay()
        torch.cuda.synchronize()
        _check(failures, "captured all_reduce replay", out, torch.arange(64.0) * 2)
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    return failures


def coordinator_shared_gpu(rank: int, world: int) -> dict[str, Any]:
    """GroupCoordinator with several ranks on one GPU: custom all-reduce only
    (NCCL refuses two ranks on one device), eager and in a captured graph."""
    from coordinator.group_coordinator import GroupCoordinator

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_gloo(rank, world, timeout_s=120.0)
    failures: list[str] = []
    group = GroupCoordinator([list(range(world))], 0, "nccl", True, group_name="tp")
    try:
        comm = group.device_communicator
        assert comm is not None
        describe = dict(comm.describe())  # type: ignore[attr-defined]
        parts = [make_input(r, 4096, torch.bfloat16) for r in range(world)]
        mine = parts[rank].to(device)
        _check(failures, "eager all_reduce", group.all_reduce(mine), fp32_rank_order_sum(parts))
        static = torch.zeros(4096, dtype=torch.bfloat16, device=device)
        graph = torch.cuda.CUDAGraph()
        with group.graph_capture() as ctx:
            group.all_reduce(static)  # warm-up on the capture stream
            with torch.cuda.graph(graph, stream=ctx.stream):
                out = group.all_reduce(static)
        for step in range(3):
            parts = [make_input(r, 4096, torch.bfloat16, seed=10 + step) for r in range(world)]
            static.copy_(parts[rank])
            graph.replay()
            torch.cuda.synchronize()
            _check(failures, f"replay {step}", out, fp32_rank_order_sum(parts))
        del graph
        return {"failures": failures, "describe": describe}
    finally:
        group.destroy()
        dist.destroy_process_group()


def coordinator_cuda_settings_differ(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 turns the custom all-reduce off, its peers don't: making the CUDA
    group raises DesyncError naming both values on every rank. With the setting
    agreed again the same ranks make the group and all-reduce through it."""
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import override

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_gloo(rank, world, timeout_s=120.0)
    out: dict[str, Any] = {"refused": "", "failures": []}
    try:
        with override(disable_custom_all_reduce=rank == 1):
            GroupCoordinator([list(range(world))], 0, "nccl", True, group_name="tp").destroy()
        out["refused"] = "made"
    except Exception as exc:  # noqa: BLE001 - the test judges it
        out["refused"] = f"{type(exc).__name__}: {exc}"
    group = GroupCoordinator([list(range(world))], 0, "nccl", True, group_name="tp")
    try:
        parts = [make_input(r, 4096, torch.bfloat16) for r in range(world)]
        got = group.all_reduce(parts[rank].to(device))
        _check(out["failures"], "all_reduce after", got, fp32_rank_order_sum(parts))
    finally:
        group.destroy()
        dist.destroy_process_group()
    return out


# ---- expert parallelism on CUDA ------------------------------------------------------------


def ep_world1(rank: int, world: int) -> list[str]:
    """Both all2all managers over a one-rank CudaCommunicator, with and without
    debug_desync: dispatch and combine hand back CUDA tensors of the right values
    (their small exchanges run on the communicator's device, not the CPU)."""
    from device_communicators.all2all import create_all2all_manager
    from device_communicators.cuda_communicator import CudaCommunicator
    from shm_broadcast.config import override

    device = _setup(rank, world)
    failures: list[str] = []
    try:
        nccl_group = dist.new_group([0], backend="nccl")
        comm = CudaCommunicator(dist.group.WORLD, device, nccl_group, unique_name="ep:0")
        hidden = integer_input(0, 5 * 8, torch.float32).view(5, 8).to(device)
        logits = integer_input(1, 5 * 4, torch.float32).view(5, 4).to(device)
        for backend in ("naive", "allgather_reducescatter"):
            for debug in (False, True):
                with override(debug_desync=debug):
                    manager = create_all2all_manager(backend, comm)
                    what = f"{backend}, debug_desync={debug}"
                    try:
                        h, lg = manager.dispatch_router_logits(hidden, logits)
                        if h.device != device:
                            failures.append(f"{what}: dispatch returned a tensor on {h.device}")
                        _check(failures, f"{what}: dispatched hidden", h, hidden.cpu())
                        _check(failures, f"{what}: dispatched logits", lg, logits.cpu())
                        _check(failures, f"{what}: combine", manager.combine(h), hidden.cpu())
                    except Exception as exc:  # noqa: BLE001 - reported as a failure
                        failures.append(f"{what}: {type(exc).__name__}: {exc}")
                    finally:
                        manager.destroy()
        comm.destroy()
    finally:
        dist.destroy_process_group()
    return failures
