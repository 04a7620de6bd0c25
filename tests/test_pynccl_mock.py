"""PyNcclCommunicator's marshalling against a recording mock of libnccl (no GPU).

Ranks are real forked processes with a Gloo group (the unique id travels over
it). Inside a rank the mock replaces the GPU: tensors live on the CPU, the
"current stream" is a recorded handle, and the mock moves data as NCCL does at
world 1, so results and the recorded arguments (nccl.h's names) are checked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from mock_nccl import NCCL_H_DATA_TYPES, NCCL_H_RED_OPS, MockNccl
from torch.distributed import ReduceOp

from coordinator.launch import init_gloo, run_ranks

STREAM = 0xC0FFEE
LIB = "mock-libnccl.so"


class FakeStream:
    cuda_stream = STREAM

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def mocked_communicator(world: int, version_code: int = 22809) -> Iterator[tuple[Any, MockNccl]]:
    """A PyNcclCommunicator over the default group, bound to a fresh mock."""
    import torch.distributed as dist

    from device_communicators import pynccl_setup, pynccl_wrapper
    from device_communicators.pynccl import PyNcclCommunicator

    mock = MockNccl(version_code)
    pynccl_wrapper._LIBRARIES[LIB] = mock.library(LIB)
    pynccl_setup._as_device = lambda device: torch.device("cpu")  # this process only (a rank)
    torch.cuda.current_stream = lambda device=None: FakeStream()  # type: ignore[assignment]
    torch.cuda.is_available = lambda: False  # also on a GPU machine: no device to enter
    comm = PyNcclCommunicator(
        dist.group.WORLD, "cuda:0", library_path=LIB, strict=True, allow_single_rank=world == 1
    )
    try:
        yield comm, mock
    finally:
        comm.destroy()
        dist.destroy_process_group()


# ---- world 1: enums, counts, pointers, stream, data ---------------------------------------

TORCH_TO_NCCL_H = {
    torch.int8: "ncclInt8",
    torch.uint8: "ncclUint8",
    torch.int32: "ncclInt32",
    torch.int64: "ncclInt64",
    torch.float16: "ncclFloat16",
    torch.float32: "ncclFloat32",
    torch.float64: "ncclFloat64",
    torch.bfloat16: "ncclBfloat16",
}
OPS_TO_NCCL_H = {
    ReduceOp.SUM: "ncclSum",
    ReduceOp.PRODUCT: "ncclProd",
    ReduceOp.MAX: "ncclMax",
    ReduceOp.MIN: "ncclMin",
    ReduceOp.AVG: "ncclAvg",
}


def _padded_out(like: torch.Tensor, pad: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """An output view followed by sentinel elements that a wrong count would overwrite."""
    buf = torch.full((like.numel() + pad,), 77, dtype=like.dtype)
    return buf[: like.numel()].view(like.shape), buf[like.numel() :]


def world1_all_reduce(rank: int, world: int) -> list[str]:
    init_gloo(rank, world)
    failures = []
    with mocked_communicator(world) as (comm, mock):
        init = mock.named("ncclCommInitRank")[0].args
        if (init["nranks"], init["rank"]) != (1, 0) or not init["commId"].startswith(b"mock-id"):
            failures.append(f"init args {init}")
        for dtype, nccl_name in TORCH_TO_NCCL_H.items():
            for op, op_name in OPS_TO_NCCL_H.items():
                x = (torch.arange(300) % 50 + 1).to(dtype)  # 300: a narrowed count shows
                out, sentinel = _padded_out(x)
                comm.all_reduce(x, out, op=op)
                call = mock.calls[-1]
                expected = {
                    "sendbuff": x.data_ptr(),
                    "recvbuff": out.data_ptr(),
                    "count": 300,
                    "datatype": NCCL_H_DATA_TYPES[nccl_name],
                    "op": NCCL_H_RED_OPS[op_name],
                    "comm": comm.comm,
                    "stream": STREAM,
                }
                if call.name != "ncclAllReduce" or call.args != expected:
                    failures.append(f"{dtype} {op_name}: {call.name} {call.args} != {expected}")
                if not torch.equal(out, x) or not (sentinel == 77).all():
                    failures.append(f"{dtype} {op_name}: data {out.tolist()} {sentinel.tolist()}")
    return failures


def test_all_reduce_passes_nccl_h_enums_counts_pointers_and_stream():
    assert run_ranks(world1_all_reduce, 1) == [[]]


def world1_other_ops(rank: int, world: int) -> list[str]:
    from device_communicators.errors import GroupcoordTypeError

    init_gloo(rank, world)
    failures = []
    with mocked_communicator(world) as (comm, mock):
        x = torch.arange(12, dtype=torch.float16)
        out, sentinel = _padded_out(x)
        comm.all_gather(out, x)
        args = mock.calls[-1].args
        if (args["sendcount"], args["datatype"]) != (12, NCCL_H_DATA_TYPES["ncclFloat16"]):
            failures.append(f"all_gather args {args}")
        if not torch.equal(out, x) or not (sentinel == 77).all():
            failures.append("all_gather data")
        out, sentinel = _padded_out(x)
        comm.reduce_scatter(out, x, op=ReduceOp.MAX)
        args = mock.calls[-1].args
        if (args["recvcount"], args["op"]) != (12, NCCL_H_RED_OPS["ncclMax"]):
            failures.append(f"reduce_scatter args {args}")
        b = torch.arange(5, dtype=torch.int64)
        comm.broadcast(b, src=0)
        args = mock.calls[-1].args
        if args["sendbuff"] != b.data_ptr() or args["recvbuff"] != b.data_ptr() or args["root"]:
            failures.append(f"broadcast is not in place at root 0: {args}")
        # float8 moves as bytes; reducing it needs NCCL's own float8 type (2.24+).
        f8 = torch.zeros(4, dtype=torch.float8_e4m3fn)
        comm.all_gather(torch.empty(4, dtype=torch.float8_e4m3fn), f8)
        if mock.calls[-1].args["datatype"] != NCCL_H_DATA_TYPES["ncclUint8"]:
            failures.append("float8 all_gather is not sent as uint8")
        comm.all_reduce(f8)
        if mock.calls[-1].args["datatype"] != NCCL_H_DATA_TYPES["ncclFloat8e4m3"]:
            failures.append("float8 all_reduce does not use ncclFloat8e4m3")
        calls_before = len(mock.calls)
        try:  # NCCL 2.28 answers ncclInvalidArgument for AVG on float8: refused by us first
            comm.all_reduce(f8, op=ReduceOp.AVG)
            failures.append("float8 AVG was not refused")
        except GroupcoordTypeError as exc:
            if "does not average" not in str(exc) or len(mock.calls) != calls_before:
                failures.append(
                    f"float8 AVG refusal: {exc}, {len(mock.calls) - calls_before} calls"
                )
        # Send/recv to self only completes inside a group.
        src, dst = torch.arange(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)
        comm.batch_send_recv(sends=[(src, 0)], recvs=[(dst, 0)])
        names = [c.name for c in mock.calls[-4:]]
        if names != ["ncclGroupStart", "ncclSend", "ncclRecv", "ncclGroupEnd"]:
            failures.append(f"batch_send_recv calls {names}")
        if [c.group_depth for c in mock.calls[-3:-1]] != [1, 1]:
            failures.append("send/recv not inside the group")
        if not torch.equal(dst, src):
            failures.append(f"send/recv to self moved {dst.tolist()}")
    return failures


def test_gather_scatter_broadcast_float8_and_grouped_send_recv():
    assert run_ranks(world1_other_ops, 1) == [[]]


def world1_errors(rank: int, world: int) -> dict[str, Any]:
    from device_communicators.errors import GroupcoordTypeError
    from device_communicators.pynccl_wrapper import NcclError

    init_gloo(rank, world)
    seen: dict[str, Any] = {}
    with mocked_communicator(world, version_code=22304) as (comm, mock):
        mock.fail_next("ncclAllReduce", 5, "rank 3 called ncclAllGather")
        try:
            comm.all_reduce(torch.ones(4))
        except NcclError as exc:
            seen["message"] = str(exc)
            seen["code"] = exc.code
        seen["usable_after"] = torch.equal(comm.all_reduce(torch.ones(4)), torch.ones(4))
        # A failure inside a grouped op still closes the group.
        mock.fail_next("ncclBroadcast", 4, "bad root")
        try:
            comm.all_gatherv(torch.empty(3, 2), torch.ones(3, 2), [3])
        except NcclError as exc:
            seen["grouped"] = str(exc)
        seen["depth_after"] = mock.group_depth
        try:  # NCCL 2.23 has no float8 reduction: refused before any call
            comm.all_reduce(torch.zeros(2, dtype=torch.float8_e5m2))
        except GroupcoordTypeError as exc:
            seen["float8_old"] = str(exc)
        handle = comm.comm
    seen["destroyed"] = [c.args["comm"] == handle for c in mock.named("ncclCommDestroy")]
    return seen


def test_errors_carry_nccl_strings_and_groups_stay_balanced():
    seen = run_ranks(world1_errors, 1)[0]
    assert seen["code"] == 5
    assert "ncclInvalidUsage" in seen["message"] and "invalid usage" in seen["message"]
    assert "rank 3 called ncclAllGather" in seen["message"]
    assert seen["usable_after"]
    assert "bad root" in seen["grouped"] and "ncclInvalidArgument" in seen["grouped"]
    assert seen["depth_after"] == 0
    assert "NCCL >= 2.24" in seen["float8_old"]
    assert seen["destroyed"] == [True]  # destroy() once, with the handle init returned


# ---- world 2: the v-collectives' per-root calls -------------------------------------------


def world2_v_ops(rank: int, world: int) -> dict[str, Any]:
    init_gloo(rank, world)
    with mocked_communicator(world) as (comm, mock):
        sizes = [2, 3]
        inp = torch.zeros(sizes[rank], 4)
        out = torch.zeros(sum(sizes), 4)
        comm.all_gatherv(out, inp, sizes)
        gatherv = [(c.name, c.group_depth, dict(c.args)) for c in mock.calls[-4:]]
        big = torch.zeros(sum(sizes), 4)
        mine = torch.zeros(sizes[rank], 4)
        comm.reduce_scatterv(mine, big, sizes, op=ReduceOp.MIN)
        scatterv = [(c.name, c.group_depth, dict(c.args)) for c in mock.calls[-4:]]
        init = dict(mock.named("ncclCommInitRank")[0].args)
        return {
            "gatherv": gatherv,
            "scatterv": scatterv,
            "ptrs": [inp.data_ptr(), out.data_ptr(), big.data_ptr(), mine.data_ptr()],
            "init": (init["nranks"], init["rank"], init["commId"][:7]),
        }


def test_v_collectives_issue_one_call_per_root_inside_one_group():
    results = run_ranks(world2_v_ops, 2)
    row_bytes = 4 * 4  # 4 float32 per row
    for rank, r in enumerate(results):
        inp, out, big, mine = r["ptrs"]
        assert r["init"] == (2, rank, b"mock-id")
        names = [name for name, _, _ in r["gatherv"]]
        assert names == ["ncclGroupStart", "ncclBroadcast", "ncclBroadcast", "ncclGroupEnd"]
        first, second = r["gatherv"][1][2], r["gatherv"][2][2]
        assert (first["root"], first["count"], first["recvbuff"]) == (0, 8, out)
        assert (second["root"], second["count"], second["recvbuff"]) == (1, 12, out + 2 * row_bytes)
        own = first if rank == 0 else second
        assert own["sendbuff"] == inp  # the root sends its own rows
        assert all(depth == 1 for _, depth, _ in r["gatherv"][1:3])
        names = [name for name, _, _ in r["scatterv"]]
        assert names == ["ncclGroupStart", "ncclReduce", "ncclReduce", "ncclGroupEnd"]
        first, second = r["scatterv"][1][2], r["scatterv"][2][2]
        assert (first["root"], first["count"], first["sendbuff"]) == (0, 8, big)
        assert (second["root"], second["count"], second["sendbuff"]) == (1, 12, big + 2 * row_bytes)
        assert first["op"] == second["op"] == NCCL_H_RED_OPS["ncclMin"]
        assert first["recvbuff"] == second["recvbuff"] == mine


def test_every_mock_prototype_has_a_row_of_our_table_with_as_many_arguments():
    from mock_nccl import PROTOTYPES

    from device_communicators.pynccl_wrapper import NCCL_FUNCTIONS

    rows = {row.name: row for row in NCCL_FUNCTIONS}
    assert set(PROTOTYPES) <= set(rows)
    for fn, (_, params) in PROTOTYPES.items():
        assert len(rows[fn].argtypes) == len(params), fn


def test_vllms_ncclLibrary_names_run_on_the_one_binding() -> None:
    """vLLM's NCCLLibrary spelling (ctypes arguments, nccl.h names) reaches the same
    calls as ours: checked against the recording mock, in process."""
    import ctypes

    from device_communicators.pynccl_wrapper import (
        NcclDataType,
        NCCLLibrary,
        NcclRedOp,
        ncclUniqueId,
    )

    mock = MockNccl(22809)
    lib = NCCLLibrary(library=mock.library())
    assert lib.ncclGetVersion() == "2.28.9" and lib.ncclGetRawVersion() == 22809
    assert lib.ncclGetErrorString(3) == lib.lib.error_string(3)
    uid = lib.ncclGetUniqueId()
    assert isinstance(uid, ncclUniqueId)
    raw = ctypes.string_at(ctypes.addressof(uid), 128)
    assert raw.startswith(b"mock-id")
    again = lib.unique_id_from_bytes(raw)
    assert ctypes.string_at(ctypes.addressof(again), 128) == raw
    comm = lib.ncclCommInitRank(1, uid, 0)
    assert isinstance(comm, ctypes.c_void_p) and comm.value
    assert mock.named("ncclCommInitRank")[-1].args["commId"].rstrip(b"\0") == b"mock-id"
    src = torch.arange(4, dtype=torch.float32) + 1
    dst = torch.zeros(4)
    ptr, stream = ctypes.c_void_p, ctypes.c_void_p(STREAM)
    lib.ncclAllReduce(
        ptr(src.data_ptr()),
        ptr(dst.data_ptr()),
        4,
        NcclDataType.FLOAT32,
        NcclRedOp.SUM,
        comm,
        stream,
    )
    assert torch.equal(dst, src)  # one rank: the sum is the input
    call = mock.named("ncclAllReduce")[-1]
    assert (call.args["count"], call.args["stream"], call.args["comm"]) == (4, STREAM, comm.value)
    out = torch.zeros(4)
    lib.ncclBroadcast(
        ptr(src.data_ptr()), ptr(out.data_ptr()), 4, NcclDataType.FLOAT32, 0, comm, stream
    )
    assert torch.equal(out, src)
    lib.ncclGroupStart()
    lib.ncclGroupEnd()
    lib.ncclCommDestroy(comm)
    assert [c.name for c in mock.calls][-3:] == [
        "ncclGroupStart",
        "ncclGroupEnd",
        "ncclCommDestroy",
    ]


# ---- vLLM 0.33's other PyNcclCommunicator methods ------------------------------------------


def world1_vllm_methods(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from device_communicators.errors import NotSupportedError
    from device_communicators.pynccl import PyNcclCommunicator

    init_gloo(rank, world)
    seen: dict[str, Any] = {}
    with mocked_communicator(world) as (comm, mock):
        src = torch.arange(6, dtype=torch.float32) + 1
        out, sentinel = _padded_out(src)
        comm.reduce(out, src, root=0, op=ReduceOp.MAX)
        call = mock.named("ncclReduce")[-1].args
        seen["reduce"] = (call["count"], call["root"], call["op"], call["stream"])
        seen["reduce_data"] = torch.equal(out, src) and bool((sentinel == 77).all())
        rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        got = torch.zeros(3, 4)
        comm.scatter(got, rows, [3], root=0)
        seen["scatter"] = [c.name for c in mock.calls[-4:]]
        seen["scatter_data"] = torch.equal(got, rows)
        a, b = torch.arange(3.0), torch.zeros(3)
        comm.batch_isend_irecv([dist.P2POp(dist.isend, a, 0), dist.P2POp(dist.irecv, b, 0)])
        seen["batch"] = [c.name for c in mock.calls[-4:]]
        seen["batch_data"] = torch.equal(a, b)
        try:
            comm.batch_isend_irecv([("send", a, 0)])
        except ValueError as exc:
            seen["bad_op"] = str(exc)
        try:
            comm.register_comm_window_raw(0, 8)
        except NotSupportedError as exc:
            seen["register_comm_window_raw"] = str(exc)
        # Sleep mode: the NCCL communicator is destroyed, then made again from a new id.
        inits = len(mock.named("ncclCommInitRank"))
        comm.suspend()
        seen["suspended"] = (comm.available, comm.reason, mock.calls[-1].name)
        comm.suspend()  # a second suspend does nothing
        comm.resume()
        seen["resumed"] = (comm.available, len(mock.named("ncclCommInitRank")) - inits)
        seen["resumed_works"] = torch.equal(comm.all_reduce(src), src)
        # vLLM's group-less start: the same library, an id made beforehand.
        uid = comm.nccl.get_unique_id()
        other = PyNcclCommunicator.from_unique_id_bytes(uid, 0, 1, "cuda:0", library_path=LIB)
        try:
            seen["from_id"] = (other.available, other.group, other.world_size)
            seen["from_id_init"] = mock.named("ncclCommInitRank")[-1].args["commId"][:7]
            seen["from_id_works"] = torch.equal(other.all_reduce(src), src)
        finally:
            other.destroy()
    return seen


def test_reduce_scatter_batch_isend_irecv_and_from_unique_id_bytes():
    seen = run_ranks(world1_vllm_methods, 1)[0]
    assert seen["reduce"] == (6, 0, NCCL_H_RED_OPS["ncclMax"], STREAM)
    assert seen["reduce_data"]
    assert seen["scatter"] == ["ncclGroupStart", "ncclSend", "ncclRecv", "ncclGroupEnd"]
    assert seen["scatter_data"]
    assert seen["batch"] == ["ncclGroupStart", "ncclSend", "ncclRecv", "ncclGroupEnd"]
    assert seen["batch_data"]
    assert "p2p_ops[0]" in seen["bad_op"]
    assert "not supported by groupcoord" in seen["register_comm_window_raw"]
    available, reason, last_call = seen["suspended"]
    assert (available, last_call) == (False, "ncclCommDestroy")
    assert "suspended" in reason
    assert seen["resumed"] == (True, 1)
    assert seen["resumed_works"]
    assert seen["from_id"] == (True, None, 1)
    assert seen["from_id_init"] == b"mock-id"
    assert seen["from_id_works"]


def world2_scatter(rank: int, world: int) -> list[tuple[str, int, int]]:
    init_gloo(rank, world)
    with mocked_communicator(world) as (comm, mock):
        sizes = [1, 2]
        out = torch.zeros(sizes[rank], 4)
        before = len(mock.calls)
        comm.scatter(out, torch.zeros(3, 4) if rank == 1 else torch.empty(0), sizes, root=1)
        return [
            (c.name, c.args.get("peer", -1), c.args.get("count", -1)) for c in mock.calls[before:]
        ]


def test_scatter_sends_each_rank_its_rows_from_the_root():
    start, end = ("ncclGroupStart", -1, -1), ("ncclGroupEnd", -1, -1)
    results = run_ranks(world2_scatter, 2)
    # Rank 0 only receives its one row (4 floats) from root 1.
    assert results[0] == [start, ("ncclRecv", 1, 4), end]
    # The root sends rows [0:1] to rank 0 and [1:3] to itself, and receives its own.
    assert results[1] == [start, ("ncclSend", 0, 4), ("ncclSend", 1, 8), ("ncclRecv", 1, 8), end]


# ---- the CUDA communicator's NCCL transport: shapes around the calls ---------------------------------


def world1_hook_shapes(rank: int, world: int) -> list[str]:
    from device_communicators.cuda_communicator import (
        nccl_all_gather_stacked,
        nccl_all_gatherv,
        nccl_reduce_scatter,
    )

    init_gloo(rank, world)
    failures = []
    with mocked_communicator(world) as (comm, mock):
        x = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
        strided = x.transpose(0, 2)  # non-contiguous: sent as a contiguous copy
        stacked = nccl_all_gather_stacked(comm, strided)
        if stacked.shape != (1, 4, 3, 2) or not torch.equal(stacked[0], strided):
            failures.append(f"all_gather_stacked gave {tuple(stacked.shape)}")
        for dim in range(3):
            n = x.shape[dim]
            gathered = nccl_all_gatherv(comm, x, dim, [n])
            if not torch.equal(gathered, x) or not gathered.is_contiguous():
                failures.append(f"all_gatherv along {dim} gave {tuple(gathered.shape)}")
            reduced = nccl_reduce_scatter(comm, x, dim, [n])
            call = mock.calls[-1]
            if call.name != "ncclReduceScatter" or call.args["recvcount"] != 24:
                failures.append(f"reduce_scatter along {dim}: {call.name} {dict(call.args)}")
            if not torch.equal(reduced, x) or not reduced.is_contiguous():
                failures.append(f"reduce_scatter along {dim} gave {tuple(reduced.shape)}")
    return failures


def test_cuda_hooks_shape_what_nccl_moves_along_every_dim():
    assert run_ranks(world1_hook_shapes, 1) == [[]]


def world2_hook_calls(rank: int, world: int) -> dict[str, Any]:
    from device_communicators.cuda_communicator import nccl_all_gatherv, nccl_reduce_scatter

    init_gloo(rank, world)
    with mocked_communicator(world) as (comm, mock):
        x = torch.zeros(3, 5)  # rows along dim 1: 5 = 2 + 3, or 4 + 4 with (3, 8)
        out = nccl_reduce_scatter(comm, x, 1, [2, 3])
        uneven = ([c.name for c in mock.calls[-4:]], tuple(out.shape))
        out = nccl_reduce_scatter(comm, torch.zeros(3, 8), 1, [4, 4])
        even = ([mock.calls[-1].name], tuple(out.shape))
        out = nccl_all_gatherv(comm, torch.zeros(3, [2, 3][rank]), 1, [2, 3])
        gatherv = ([c.name for c in mock.calls[-4:]], tuple(out.shape))
        return {"uneven": uneven, "even": even, "gatherv": gatherv}


def test_cuda_hooks_pick_the_even_or_the_v_call():
    results = run_ranks(world2_hook_calls, 2)
    for rank, r in enumerate(results):
        assert r["uneven"] == (
            ["ncclGroupStart", "ncclReduce", "ncclReduce", "ncclGroupEnd"],
            (3, [2, 3][rank]),
        )
        assert r["even"] == (["ncclReduceScatter"], (3, 4))
        assert r["gatherv"] == (
            ["ncclGroupStart", "ncclBroadcast", "ncclBroadcast", "ncclGroupEnd"],
            (3, 5),
        )


def world2_cuda_communicator(rank: int, world: int) -> dict[str, Any]:
    """CudaCommunicator's public collectives reach pynccl through its hooks (the
    communicator built on CPU tensors: the mock stands in for the GPU)."""
    import torch.distributed as dist

    from device_communicators import pynccl_setup, pynccl_wrapper
    from device_communicators.base_device_communicator import DeviceCommunicatorBase
    from device_communicators.cuda_communicator import CudaCommunicator
    from shm_broadcast.config import override

    init_gloo(rank, world)
    mock = MockNccl()
    pynccl_wrapper._LIBRARIES[LIB] = mock.library(LIB)
    pynccl_setup._as_device = lambda device: torch.device("cpu")
    torch.cuda.current_stream = lambda device=None: FakeStream()  # type: ignore[assignment]
    torch.cuda.is_available = lambda: False
    comm = CudaCommunicator.__new__(CudaCommunicator)  # its __init__ insists on a CUDA device
    # Custom all-reduce off: on a GPU machine it would otherwise try the real device.
    with override(nccl_so_path=LIB, disable_custom_all_reduce=True):
        DeviceCommunicatorBase.__init__(comm, dist.group.WORLD, torch.device("cpu"), None, "tp:0")
    seen: dict[str, Any] = {
        "pynccl": comm.pynccl.available,
        "ca": comm.custom_all_reduce.reason,
        "transports": [t.name for t in comm.transports.transports],
        "control": [t.name for t in comm.control_transports.transports],
    }

    def calls(fn: Any) -> tuple[list[str], Any]:
        before = len(mock.calls)
        out = fn()
        names = [c.name for c in mock.calls[before:] if not c.name.startswith("ncclGroup")]
        return names, None if out is None else tuple(out.shape)

    x = torch.zeros(3, 4)
    seen["all_gather"] = calls(lambda: comm.all_gather(x, dim=1))
    seen["all_gatherv"] = calls(lambda: comm.all_gatherv(torch.zeros(2 + rank, 4), 0, [2, 3]))
    seen["reduce_scatter"] = calls(lambda: comm.reduce_scatter(x, dim=1))
    seen["reduce_scatterv"] = calls(lambda: comm.reduce_scatterv(torch.zeros(5, 4), 0, [2, 3]))
    seen["broadcast"] = calls(lambda: comm.broadcast(x, src=1))
    if rank == 0:
        seen["send"] = calls(lambda: comm.send(x, dst=1))
    else:
        seen["recv"] = calls(lambda: comm.recv((3, 4), torch.float32, src=0))
    comm.destroy()
    dist.destroy_process_group()
    return seen


def test_cuda_communicator_public_calls_reach_pynccl_through_its_transport_chain():
    results = run_ranks(world2_cuda_communicator, 2)
    for rank, seen in enumerate(results):
        assert seen["pynccl"] and "DISABLE_CUSTOM_ALL_REDUCE" in seen["ca"]
        # pynccl first, c10d after; control exchanges (CPU tensors) stay on cpu_group.
        assert seen["transports"] == ["pynccl", "torch.distributed(gloo)"]
        assert seen["control"] == ["torch.distributed(gloo)"]
        assert seen["all_gather"] == (["ncclAllGather"], (3, 8))
        assert seen["all_gatherv"] == (["ncclBroadcast", "ncclBroadcast"], (5, 4))
        assert seen["reduce_scatter"] == (["ncclReduceScatter"], (3, 2))
        assert seen["reduce_scatterv"] == (["ncclReduce", "ncclReduce"], ([2, 3][rank], 4))
        assert seen["broadcast"] == (["ncclBroadcast"], (3, 4))
        assert seen.get("send", seen.get("recv")) == (
            ["ncclSend"] if rank == 0 else ["ncclRecv"],
            None if rank == 0 else (3, 4),
        )
