"""coordinator.comm collectives and P2P on real forked ranks (world 2 and 4), sync and async."""

from __future__ import annotations

import functools
import operator
import re
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from two_threads import in_two_threads

from coordinator.comm import Comm, ReduceOp, Work, WorkStatus, new_comm
from coordinator.errors import (
    ClosedError,
    DesyncError,
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
)
from coordinator.launch import run_ranks


def _done(work: Work, async_op: bool) -> None:
    if async_op:
        work.wait()
    assert work.is_completed()
    assert work.status is WorkStatus.COMPLETED


def _collectives(comm: Comm, async_op: bool) -> None:
    r, w = comm.get_rank(), comm.get_size()
    total = w * (w + 1) // 2

    t = torch.full((3,), float(r + 1))
    _done(comm.all_reduce(t, ReduceOp.SUM, async_op=async_op), async_op)
    assert t.tolist() == [total] * 3

    t = torch.full((2,), float(r + 1))
    _done(comm.reduce(t, w - 1, ReduceOp.MAX, async_op=async_op), async_op)
    if r == w - 1:
        assert t.tolist() == [w, w]

    t = torch.arange(4.0) if r == 1 else torch.zeros(4)
    _done(comm.broadcast(t, 1, async_op=async_op), async_op)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]

    outs = [torch.empty(2) for _ in range(w)]
    _done(comm.all_gather(outs, torch.full((2,), float(r)), async_op=async_op), async_op)
    assert [o.tolist() for o in outs] == [[i, i] for i in range(w)]

    out = torch.empty(w, 2)
    _done(comm.all_gather_single(out, torch.full((2,), float(r)), async_op=async_op), async_op)
    assert out.tolist() == [[i, i] for i in range(w)]

    outs = [torch.empty(i + 1, dtype=torch.int32) for i in range(w)]
    inp = torch.full((r + 1,), r, dtype=torch.int32)
    _done(comm.all_gather_v(outs, inp, async_op=async_op), async_op)
    assert [o.tolist() for o in outs] == [[i] * (i + 1) for i in range(w)]

    res = torch.empty(2)
    ins = [torch.full((2,), float(r + 1 + 10 * i)) for i in range(w)]
    _done(comm.reduce_scatter(res, ins, ReduceOp.SUM, async_op=async_op), async_op)
    assert res.tolist() == [total + 10 * w * r] * 2

    res = torch.empty(2)
    inp = torch.arange(2.0 * w) + r
    _done(comm.reduce_scatter_single(res, inp, ReduceOp.SUM, async_op=async_op), async_op)
    expect = [sum(2 * r + k + q for q in range(w)) for k in range(2)]
    assert res.tolist() == expect

    res = torch.empty(r + 1)
    ins = [torch.full((i + 1,), float(r + 1)) for i in range(w)]
    _done(comm.reduce_scatter_v(res, ins, ReduceOp.SUM, async_op=async_op), async_op)
    assert res.tolist() == [total] * (r + 1)

    ins = [torch.full((r + j + 1,), 10.0 * r + j) for j in range(w)]
    outs = [torch.empty(j + r + 1) for j in range(w)]
    _done(comm.all_to_all(outs, ins, async_op=async_op), async_op)
    assert [o.tolist() for o in outs] == [[10.0 * j + r] * (j + r + 1) for j in range(w)]

    inp = torch.tensor([100.0 * r + j for j in range(w) for _ in range(2)])
    out = torch.empty(2 * w)
    _done(comm.all_to_all_single(out, inp, async_op=async_op), async_op)
    assert out.tolist() == [100.0 * j + r for j in range(w) for _ in range(2)]

    # Uneven, including empty blocks: rank r sends (r + j) % 3 rows of width 2 to rank j.
    in_splits = [(r + j) % 3 for j in range(w)]
    out_splits = [(j + r) % 3 for j in range(w)]
    inp = torch.cat([torch.full((n, 2), 100.0 * r + j) for j, n in enumerate(in_splits)])
    out = torch.full((sum(out_splits), 2), -1.0)
    work = comm.all_to_all_v_single(out, inp, out_splits, in_splits, async_op=async_op)
    _done(work, async_op)
    expect_v = torch.cat([torch.full((n, 2), 100.0 * j + r) for j, n in enumerate(out_splits)])
    assert torch.equal(out, expect_v)

    outs_g = [torch.empty(3) for _ in range(w)] if r == 0 else None
    _done(comm.gather(outs_g, torch.full((3,), float(r)), 0, async_op=async_op), async_op)
    if outs_g is not None:
        assert [o.tolist() for o in outs_g] == [[i] * 3 for i in range(w)]

    out = torch.empty(2)
    ins_s = [torch.full((2,), 7.0 * i) for i in range(w)] if r == w - 1 else None
    _done(comm.scatter(out, ins_s, w - 1, async_op=async_op), async_op)
    assert out.tolist() == [7.0 * r] * 2

    right, left = (r + 1) % w, (r - 1) % w
    got = torch.empty(3)
    if async_op:
        ws = comm.send(torch.full((3,), float(r)), right, async_op=True)
        wr = comm.recv(got, left, async_op=True)
        _done(ws, True)
        _done(wr, True)
    elif r % 2 == 0:
        comm.send(torch.full((3,), float(r)), right)
        comm.recv(got, left)
    else:
        comm.recv(got, left)
        comm.send(torch.full((3,), float(r)), right)
    assert got.tolist() == [float(left)] * 3

    _done(comm.barrier(async_op=async_op), async_op)


def _reduce_ops(comm: Comm) -> None:
    r, w = comm.get_rank(), comm.get_size()
    values = [float(q + 2) for q in range(w)]
    cases = {
        ReduceOp.SUM: sum(values),
        ReduceOp.PRODUCT: functools.reduce(operator.mul, values),
        ReduceOp.MIN: min(values),
        ReduceOp.MAX: max(values),
        ReduceOp.AVG: sum(values) / w,
        ReduceOp.PREMUL_SUM(0.5): 0.5 * sum(values),
    }
    for op, expected in cases.items():
        t = torch.full((4,), values[r], dtype=torch.float64)
        comm.all_reduce(t, op)
        assert t.tolist() == pytest.approx([expected] * 4), op
        # reduce_scatter runs the same emulation through a different path.
        res = torch.empty(1, dtype=torch.float64)
        comm.reduce_scatter_single(res, torch.full((w,), values[r], dtype=torch.float64), op)
        assert res.item() == pytest.approx(expected), op
    bits = [(1 << q) | 8 for q in range(w)]
    for op, fold in (
        (ReduceOp.BAND, operator.and_),
        (ReduceOp.BOR, operator.or_),
        (ReduceOp.BXOR, operator.xor),
    ):
        t = torch.full((2,), bits[r], dtype=torch.int32)
        comm.all_reduce(t, op, async_op=True).wait()
        assert t.tolist() == [functools.reduce(fold, bits)] * 2, op
    t = torch.full((2,), values[r])
    comm.reduce(t, 0, ReduceOp.AVG)
    if r == 0:
        assert t.tolist() == pytest.approx([sum(values) / w] * 2)
    # Complex tensors average and premultiply as torch.distributed lets them (refused
    # until 2026-11-28), on the shared-memory path and over Gloo (reduce_scatter's).
    z = torch.full((3,), complex(values[r], -values[r]), dtype=torch.complex64)
    comm.all_reduce(z, ReduceOp.AVG)
    assert z.tolist() == pytest.approx([complex(sum(values), -sum(values)) / w] * 3)
    z = torch.full((w,), complex(values[r], 1.0), dtype=torch.complex128)
    out = torch.empty(1, dtype=torch.complex128)
    comm.reduce_scatter_single(out, z, ReduceOp.PREMUL_SUM(2.0))
    assert out.item() == pytest.approx(complex(2 * sum(values), 2.0 * w))


def _bad_input_leaves_comm_usable(comm: Comm) -> None:
    r, w = comm.get_rank(), comm.get_size()
    cases = [
        (
            GroupcoordTypeError,
            "needs a floating or complex dtype",
            lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), ReduceOp.AVG),
        ),
        (
            GroupcoordTypeError,
            "integer or bool",
            lambda: comm.all_reduce(torch.ones(2), ReduceOp.BXOR),
        ),
        (GroupcoordTypeError, "op must be", lambda: comm.all_reduce(torch.ones(2), "sum")),
        (GroupcoordTypeError, "tensor must be a torch.Tensor", lambda: comm.all_reduce([1.0])),
        (GroupcoordValueError, "contiguous", lambda: comm.all_reduce(torch.ones(4, 4).t())),
        (GroupcoordValueError, "meta", lambda: comm.all_reduce(torch.empty(2, device="meta"))),
        # A lazy conjugate moved as memory gave the unconjugated values (shared memory).
        (
            GroupcoordValueError,
            "lazy conjugate view",
            lambda: comm.all_reduce(torch.full((2,), 1 + 2j).conj()),
        ),
        (
            GroupcoordValueError,
            "lazy conjugate view",
            lambda: comm.all_gather_single(
                torch.empty(2 * w, dtype=torch.complex64), torch.full((2,), 1 + 2j).conj()
            ),
        ),
        (
            GroupcoordTypeError,
            "layout torch.sparse_csr",
            lambda: comm.all_reduce(torch.eye(2).to_sparse_csr()),
        ),
        (
            GroupcoordValueError,
            "output has",
            lambda: comm.all_gather_single(torch.empty(3), torch.empty(2)),
        ),
        (
            GroupcoordTypeError,
            "dtype",
            lambda: comm.all_gather_single(torch.empty(2 * w, dtype=torch.int32), torch.empty(2)),
        ),
        (
            GroupcoordValueError,
            "tensor_list must hold",
            lambda: comm.all_gather([torch.empty(1)], torch.empty(1)),
        ),
        (
            GroupcoordValueError,
            "input_split_sizes sums",
            lambda: comm.all_to_all_v_single(torch.empty(w), torch.empty(w + 1), [1] * w, [1] * w),
        ),
        (
            GroupcoordValueError,
            "output_split_sizes must have",
            lambda: comm.all_to_all_v_single(torch.empty(2), torch.empty(2), [2], [2]),
        ),
        (GroupcoordValueError, "dst=", lambda: comm.send(torch.ones(1), r)),
        (GroupcoordValueError, "src=", lambda: comm.recv(torch.ones(1), w)),
        (GroupcoordValueError, "root=", lambda: comm.broadcast(torch.ones(1), -1)),
        (GroupcoordValueError, "timeout", lambda: comm.barrier(timeout=0)),
        (GroupcoordTypeError, "async_op", lambda: comm.barrier(async_op=1)),
        (GroupcoordTypeError, "hints", lambda: comm.barrier(hints={"a": 1})),
    ]
    for kind, text, call in cases:
        with pytest.raises(kind, match=text):
            call()
    t = torch.ones(2)
    comm.all_reduce(t)
    assert t.tolist() == [w, w]


def _reduce_scatter_both_paths(comm: Comm) -> None:
    # On the comm's shared-memory path and on Gloo's (a comm built with the path off,
    # as between nodes), with multi-dimensional outputs, which each path flattens its
    # own way; complex32 goes as its fp16 parts on both.
    from shm_broadcast.config import override

    with override(disable_shm_all_reduce=True):
        gloo = new_comm("gloo", "cpu", "ops-gloo", timeout=30)
    r, w = comm.get_rank(), comm.get_size()
    try:
        for each in (comm, gloo):
            for dtype in (torch.float32, torch.complex64, torch.complex32):
                assert each._shm_takes(torch.ones(1, dtype=dtype), ReduceOp.SUM) == (each is comm)
                ins = [torch.full((2, 3), r + 10 * i, dtype=dtype) for i in range(w)]
                res = torch.empty((2, 3), dtype=dtype)
                each.reduce_scatter(res, ins, ReduceOp.SUM)
                assert res.tolist() == [[sum(range(w)) + 10 * w * r] * 3] * 2, dtype
                single = torch.empty((2, 3), dtype=dtype)
                each.reduce_scatter_single(single, torch.cat(ins).reshape(w * 2, 3), ReduceOp.SUM)
                assert single.tolist() == res.tolist(), dtype
    finally:
        gloo.finalize()


def _every_op(rank: int, world_size: int) -> str:
    warnings.simplefilter("ignore", UserWarning)  # complex32 is "experimental"
    comm = new_comm("gloo", "cpu", "ops", timeout=30, hints={"purpose": "test"})
    assert (comm.get_rank(), comm.get_size(), comm.get_name()) == (rank, world_size, "ops")
    assert comm.get_backend() == "gloo" and comm.get_device() == torch.device("cpu")
    assert comm.get_options().hints == {"purpose": "test"}
    _collectives(comm, async_op=False)
    _collectives(comm, async_op=True)
    _reduce_ops(comm)
    _reduce_scatter_both_paths(comm)
    _bad_input_leaves_comm_usable(comm)
    for _ in range(3):  # later barriers also clean up the keys of earlier ones
        comm.monitored_barrier(timeout=20)
    comm.finalize()
    with pytest.raises(ClosedError, match="finalized"):
        comm.barrier()
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_op_sync_and_async_every_reduce_op(world_size: int) -> None:
    assert run_ranks(_every_op, world_size, timeout=90) == ["ok"] * world_size


def _independent_completion(rank: int, world_size: int) -> str:
    comm = new_comm("gloo", "cpu", "indep", timeout=20)
    t = torch.ones(2)
    got = torch.zeros(1)
    if rank == 0:
        # The recv is satisfied only after this rank sends, which it does only
        # after the all_reduce is seen complete: the two works must not queue.
        pending_recv = comm.recv(got, 1, async_op=True)
        reduced = comm.all_reduce(t, async_op=True)
        reduced.wait(timeout=10)
        assert not pending_recv.is_completed()
        # A shorter wait() gives up alone: the op stays in flight and usable.
        with pytest.raises(GroupcoordTimeoutError, match="still in flight"):
            pending_recv.wait(timeout=0.2)
        assert pending_recv.status is WorkStatus.INPROGRESS
        comm.send(torch.tensor([5.0]), 1)
        pending_recv.wait()
        assert got.item() == 6.0
    else:
        comm.all_reduce(t)
        comm.recv(got, 0)
        comm.send(got + 1, 0)
    assert t.tolist() == [2.0, 2.0]
    return "ok"


def test_async_works_complete_independently() -> None:
    assert run_ranks(_independent_completion, 2, timeout=60) == ["ok", "ok"]


def _drop_right_after_wait(rank: int, world_size: int) -> str:
    t = torch.ones(1)
    for _ in range(20):
        comm = new_comm("gloo", "cpu", "drop", timeout=30)
        for _ in range(20):
            comm.all_reduce(t, async_op=True).wait()
        del comm  # may leave a Gloo thread holding the last work callback
    time.sleep(0.2)
    return "ok"


def test_dropping_a_comm_right_after_async_waits_is_safe() -> None:
    # Regression: callbacks that held the comm let the process group's
    # destructor run on a Gloo thread and std::terminate the rank.
    assert run_ranks(_drop_right_after_wait, 2, timeout=60) == ["ok", "ok"]


def _shared_memory_path(rank: int, world_size: int) -> str:
    comm = new_comm("gloo", "cpu", "shm-path", timeout=20)
    # Rank 0 issues asynchronously, the others synchronously: one path for both,
    # in issue order, or the calls would pair up with the wrong transport.
    values = [torch.full((1000,), float(rank + i)) for i in range(3)]
    if rank == 0:
        works = [comm.all_reduce(v, ReduceOp.AVG, async_op=True) for v in values]
        gathered = torch.empty(world_size * 5, dtype=torch.int64)
        comm.all_gather_single(gathered, torch.arange(5) + 10 * rank)  # behind the async ones
        for work in works:
            work.wait()
    else:
        for v in values:
            comm.all_reduce(v, ReduceOp.AVG)
        gathered = torch.empty(world_size * 5, dtype=torch.int64)
        comm.all_gather_single(gathered, torch.arange(5) + 10 * rank)
    mean_rank = (world_size - 1) / 2
    assert [v[0].item() for v in values] == [mean_rank + i for i in range(3)]
    assert gathered.view(world_size, 5)[:, 0].tolist() == [10 * r for r in range(world_size)]
    # A reduce_scatter_v issued asynchronously on rank 0 (the lane, the general way)
    # meets the others' synchronous one (the lean path): both stamped alike.
    cut = [r + 1 for r in range(world_size)]
    got = torch.empty(cut[rank])
    parts = [torch.full((n,), float(rank + 1)) for n in cut]
    comm.reduce_scatter_v(got, parts, async_op=rank == 0).wait()
    assert got.tolist() == [world_size * (world_size + 1) / 2] * cut[rank]
    # Bitwise operators and complex sums take the path too, checked alike.
    bits = torch.tensor([6, 3], dtype=torch.int32) << rank
    comm.all_reduce(bits, ReduceOp.BOR)
    want = [functools.reduce(operator.or_, (v << r for r in range(world_size))) for v in (6, 3)]
    assert bits.tolist() == want

    # The path is the shared-memory back end: its desync check names both sides,
    # which Gloo would not (it would return a wrong sum or hang). A mismatch closes
    # its comm on every rank, so each below has a comm of its own.
    def mismatched(call: Callable[[Any], Any], name: str) -> str:
        other = new_comm("gloo", "cpu", name, timeout=20)
        try:
            with pytest.raises(DesyncError) as caught:
                call(other)
            with pytest.raises(ClosedError, match="closed by a desync on every rank"):
                other.barrier()
            return str(caught.value)
        finally:
            other.abort()

    mine = torch.ones(4096 if rank == 0 else 8192)
    raised = mismatched(lambda c: c.all_reduce(mine), "shm-path-size")
    assert "float32[4096]" in raised and "float32[8192]" in raised
    # So do ranks that cut a reduce_scatter_v's rows differently (same element count).
    cut = [1] * (world_size - 1) + [9 - world_size]
    ins = [torch.ones(n) for n in (cut if rank == 0 else cut[::-1])]
    raised = mismatched(
        lambda c: c.reduce_scatter_v(torch.empty(ins[rank].numel()), ins), "shm-path-cut"
    )
    assert re.search(r"float32\[8\], SUM, sizes #.*sizes #", raised), raised
    # An operator the comm emulates (AVG: a sum, then a division) is fingerprinted as
    # itself: against a SUM it raises instead of returning an average on one rank.
    mine_op = ReduceOp.AVG if rank == 0 else ReduceOp.SUM
    for i, call in enumerate(
        (
            lambda c: c.all_reduce(torch.ones(4), mine_op),
            lambda c: c.reduce(torch.ones(300_000), 0, mine_op),
            lambda c: c.reduce_scatter_single(torch.empty(4), torch.ones(4 * world_size), mine_op),
        )
    ):
        raised = mismatched(call, f"shm-path-op{i}")
        assert "], AVG" in raised and "], SUM" in raised
    z = torch.ones(4, dtype=torch.complex64) if rank == 0 else torch.ones(8)
    assert "complex64[4]" in mismatched(lambda c: c.all_reduce(z), "shm-path-complex")
    # One stack: the comm runs on the device communicator a GroupCoordinator uses on
    # CPU, and finalize() releases it (through the lane, once no call is inside).
    from device_communicators import CpuCommunicator

    communicator = comm._communicator
    assert isinstance(communicator, CpuCommunicator)
    assert comm._lane is not None and comm._lane.shm is communicator.shm_all_reduce
    comm.finalize()
    assert communicator.shm_all_reduce.disabled_reason == "closed"
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_comm_collectives_share_the_coordinators_shared_memory_path(world_size: int) -> None:
    assert run_ranks(_shared_memory_path, world_size, timeout=60) == ["ok"] * world_size


def _rooted_on_shared_memory(rank: int, world: int, peer_reads: bool) -> list[str]:
    from shm_broadcast.config import set_config

    # Small pieces (64 KiB): the larger sizes take many pieces on the slots.
    set_config(disable_peer_reads=not peer_reads, shm_all_reduce_max_bytes=64 * 1024)
    comm = new_comm("gloo", "cpu", "rooted", timeout=30)
    assert comm._lane is not None  # the shared-memory back end serves these calls
    wrong = []
    w = world
    for n in (16, 100_000, 700_000):  # one-shot; past one-shot; past peer-read sizes
        root = n % world
        mine = torch.arange(n, dtype=torch.float32) + 1000 * rank
        out = torch.full((world * n,), -1.0)
        # Small: lean on every rank but 0 (a per-call timeout sends it the general way).
        comm.gather_single(out, mine, root, timeout=30 if rank == 0 else None)
        everyone = torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(w)])
        if rank == root and not torch.equal(out, everyone):
            wrong.append(f"gather_single {n}")
        if rank != root and not bool((out == -1.0).all()):
            wrong.append(f"gather_single {n} wrote a non-root's output")
        parts = [torch.empty(n) for _ in range(w)] if rank == root else None
        comm.gather(parts, mine, root, timeout=30 if rank == 1 else None)  # rank 1: general
        if parts is not None and not torch.equal(torch.cat(parts), everyone):
            wrong.append(f"gather {n}")
        parts = [torch.full((n,), -1.0) for _ in range(w)]
        comm.all_gather(parts, mine, timeout=30 if rank == 0 else None)
        if not torch.equal(torch.cat(parts), everyone):
            wrong.append(f"all_gather {n}")
        # SUM: a small one takes the lean path, except on rank 0 (a per-call timeout
        # sends it the general way): the two paths meet on one protocol.
        t = mine.clone()
        comm.reduce(t, root, ReduceOp.SUM, timeout=30 if rank == 0 else None)
        if rank == root and not torch.equal(t, everyone.view(w, n).sum(0)):
            wrong.append(f"reduce SUM {n}")
        t = mine.clone()
        comm.reduce(t, root, ReduceOp.AVG)
        if rank == root and not torch.allclose(t, everyone.view(w, n).mean(0)):
            wrong.append(f"reduce AVG {n}")
        t = mine.clone()
        comm.reduce(t, root, ReduceOp.PREMUL_SUM(0.5), async_op=True).wait()
        if rank == root and not torch.allclose(t, everyone.view(w, n).sum(0) * 0.5):
            wrong.append(f"reduce PREMUL_SUM {n}")
        comm.barrier()
    # scatter: part r of the root's inputs lands in rank r's output.
    for n in (16, 100_000, 700_000):
        root = (n + 1) % w
        parts = [torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(w)]
        out = torch.full((n,), -1.0)
        # Asynchronous (small), or synchronous: lean but on rank 0 (a per-call timeout).
        late = 30 if rank == 0 and n > 16 else None
        comm.scatter(
            out, parts if rank == root else None, root, async_op=n == 16, timeout=late
        ).wait()
        if not torch.equal(out, parts[rank]):
            wrong.append(f"scatter {n}")
    # all_to_all_v_single: rank r sends (r + q) * k rows to rank q (none to itself at
    # k = 0 rows), rows of 3; small, past a slot, past the direct-read size.
    for k in (1, 9_000, 60_000):
        sends = [(rank + q) * k for q in range(w)]
        recvs = [(r + rank) * k for r in range(w)]
        inp = torch.cat([torch.full((n, 3), float(100 * rank + q)) for q, n in enumerate(sends)])
        out = torch.full((sum(recvs), 3), -1.0)
        comm.all_to_all_v_single(out, inp, recvs, sends, async_op=k == 1).wait()
        want = torch.cat([torch.full((n, 3), float(100 * r + rank)) for r, n in enumerate(recvs)])
        if not torch.equal(out, want):
            wrong.append(f"all_to_all_v_single {k}")
    outs = [torch.empty(r + 1) for r in range(w)]
    comm.all_to_all(outs, [torch.full((rank + 1,), float(q)) for q in range(w)])
    if [t.tolist() for t in outs] != [[float(rank)] * (r + 1) for r in range(w)]:
        wrong.append("all_to_all lists")
    # all_to_all_single: block r of each rank's input lands in block (sender) of rank r's.
    for n, dtype in ((w, torch.bfloat16), (w * 24_000, torch.float32), (w * 50_001, torch.int64)):
        inp = (torch.arange(n) + 1_000_000 * rank).to(dtype).view(w, -1)
        out = torch.empty_like(inp)
        comm.all_to_all_single(out, inp, async_op=n > w).wait()
        block = n // w
        want = torch.cat(
            [torch.arange(rank * block, (rank + 1) * block) + 1_000_000 * r for r in range(w)]
        )
        if not torch.equal(out.view(-1), want.to(dtype)):
            wrong.append(f"all_to_all_single {n} {dtype}")
    comm.finalize()
    return wrong


@pytest.mark.parametrize("peer_reads", [True, False], ids=["peer-reads", "slots"])
@pytest.mark.parametrize("world", [2, 3])
def test_rooted_calls_barrier_and_all_to_all_on_shared_memory_at_every_size(
    world, peer_reads
) -> None:
    assert run_ranks(_rooted_on_shared_memory, world, peer_reads, timeout=120) == [[]] * world


def _all_to_all_v_in_tiny_slots(rank: int, world: int, cap: int) -> list[int]:
    from shm_broadcast.config import set_config

    # Slots no larger than a rank's counts (two int64s a rank): they set the
    # slots' floor, and the data goes through in rounds of a slot each.
    set_config(shm_all_reduce_max_bytes=cap, disable_peer_reads=True)
    comm = new_comm("gloo", "cpu", "tiny", timeout=30)
    wrong = []
    for k in (0, 1, 300):
        sends = [(rank + q) * k for q in range(world)]
        recvs = [(r + rank) * k for r in range(world)]
        inp = torch.cat([torch.full((n, 3), float(100 * rank + q)) for q, n in enumerate(sends)])
        out = torch.full((sum(recvs), 3), -1.0)
        comm.all_to_all_v_single(out, inp, recvs, sends)
        want = torch.cat([torch.full((n, 3), float(100 * r + rank)) for r, n in enumerate(recvs)])
        if not torch.equal(out, want):
            wrong.append(k)
    comm.finalize()
    return wrong


@pytest.mark.parametrize(("world", "cap"), [(3, 1), (5, 64)])
def test_all_to_all_v_through_the_smallest_slots(world: int, cap: int) -> None:
    assert run_ranks(_all_to_all_v_in_tiny_slots, world, cap, timeout=120) == [[]] * world


def _each_closes(calls: list[Callable[[Any], Any]], name: str) -> tuple[list[str], list[str]]:
    """Each of ``calls`` (ranks that disagree) on a comm of its own: the
    ``DesyncError`` each raised, and what a barrier after it raised (a mismatch
    closes its comm on every rank)."""
    from shm_broadcast.errors import DesyncError

    messages, after = [], []
    for i, call in enumerate(calls):
        comm = new_comm("gloo", "cpu", f"{name}{i}", timeout=30)
        try:
            with pytest.raises(DesyncError) as caught:
                call(comm)
            messages.append(str(caught.value))
            with pytest.raises(ClosedError) as closed:
                comm.barrier()
            after.append(str(closed.value))
        finally:
            comm.abort()
    return messages, after


def _splits_disagree(rank: int, world: int, shm: bool) -> tuple[list[str], list[str]]:
    from shm_broadcast.config import set_config

    set_config(disable_shm_all_reduce=not shm)
    inp, out = torch.ones(2, 3), torch.empty(2, 3)
    # Rank 1 sends both rows to itself; rank 0 expects one of them. On Gloo the
    # sizes did not match what the receiver posted, and Gloo aborted the process.
    sends = [1, 1] if rank == 0 else [0, 2]
    calls: list[Callable[[Any], Any]] = [
        lambda c: c.all_to_all_v_single(out, inp, [1, 1], sends).wait(),
        lambda c: c.all_to_all_v_single(out, inp, [1, 1], sends, async_op=True).wait(),
    ]
    # The list form, parts of different sizes per peer.
    outs = [torch.empty(1), torch.empty(1)]
    ins = [torch.ones(1), torch.ones(1)] if rank == 0 else [torch.ones(0), torch.ones(2)]
    calls.append(lambda c: c.all_to_all(outs, ins))
    # Different calls whose sizes are data: an all_gather_v against an all_to_all_v.
    calls.append(
        lambda c: (
            c.all_gather_v([torch.empty(2, 3) for _ in range(world)], inp)
            if rank == 0
            else c.all_to_all_v_single(out, inp, [1, 1], [1, 1])
        )
    )
    # Splits that agree, dtypes that do not: on shared memory rank 0 returned rank 1's
    # float64 bytes read as float32s.
    dtype = torch.float32 if rank == 0 else torch.float64
    inp2, out2 = torch.ones(2, 3, dtype=dtype), torch.empty(2, 3, dtype=dtype)
    calls.append(lambda c: c.all_to_all_v_single(out2, inp2, [1, 1], [1, 1]))
    calls.append(lambda c: c.all_to_all(list(out2.unbind(0)), list(inp2.unbind(0))))
    return _each_closes(calls, "splits")


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_all_to_all_v_with_splits_that_disagree_raises_on_every_rank(shm: bool) -> None:
    for messages, after in run_ranks(_splits_disagree, 2, shm, timeout=60):
        for message in messages[:2]:
            assert "rank 1 sends 0 elements to rank 0, which expects 3 from it" in message
        assert "rank 1 sends 0 elements to rank 0, which expects 1 from it" in messages[2]
        # Both sides named.
        assert "rank 0 called all_gather(float32[6]" in messages[3], messages[3]
        assert "rank 1 called all_to_all_v(float32[" in messages[3], messages[3]
        for message in messages[4:]:
            assert "all_to_all_v(float32[" in message, message
            assert "all_to_all_v(float64[" in message, message
        assert all("closed by a desync on every rank" in a for a in after), after


def _gather_v_counts_disagree(rank: int, world: int, shm: bool) -> list[str]:
    from shm_broadcast.config import set_config

    set_config(disable_shm_all_reduce=not shm)
    comm = new_comm("gloo", "cpu", "gatherv", timeout=30)
    wrong_calls: list[Callable[[Any], Any]] = []
    # Parts of 2, 3, 4 ... elements; big ones (past a 256 KiB slot) too; and
    # dtypes whose items are 1 or 16 bytes (the padded parts are gathered as bytes).
    for base, dtype in ((2, torch.float32), (70_000, torch.float32), (3, torch.bool),
                        (5, torch.complex128)):  # fmt: skip
        parts = [torch.full((base + r,), float(r)).to(dtype) for r in range(world)]
        outs = [torch.empty(base + r, dtype=dtype) for r in range(world)]
        comm.all_gather_v(outs, parts[rank])
        assert all(torch.equal(o, p) for o, p in zip(outs, parts))
        # Ranks but 0 think rank 0 brings one element less: the longest part is
        # unchanged, so padded parts still matched and they dropped its last element.
        # Then more than the longest part: on Gloo each rank padded to its own
        # longest entry, and Gloo aborted the process on the size it did not expect.
        # Then only rank 0 raised, and rank 0 returned: now the output_lists travel
        # with the call, and every rank raises before anything moves.
        for wrong in (-1, world + 2):
            outs = [torch.empty(base + r + (wrong if r == 0 and rank != 0 else 0), dtype=dtype)
                    for r in range(world)]  # fmt: skip
            wrong_calls.append(functools.partial(_gather_v_into, outs, parts[rank]))
    # Equal parts past a slot (gathered as they are, no padding on shared memory).
    parts = [torch.full((70_000,), float(r)) for r in range(world)]
    outs = [torch.empty(70_000) for r in range(world)]
    comm.all_gather_v(outs, parts[rank])
    assert all(torch.equal(o, p) for o, p in zip(outs, parts))
    outs = [torch.empty(70_000 - (r == 0 and rank != 0)) for r in range(world)]
    wrong_calls.append(functools.partial(_gather_v_into, outs, parts[rank]))
    comm.finalize()
    # Each disagreement closes its comm on every rank: one of its own for each.
    seen, after = _each_closes(wrong_calls, "gatherv-wrong")
    assert all("closed by a desync on every rank" in a for a in after), after
    return seen


def _gather_v_into(outs: list[torch.Tensor], part: torch.Tensor, comm: Comm) -> None:
    comm.all_gather_v(outs, part)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_v_whose_output_lists_disagree_raises_on_every_rank(
    world: int, shm: bool
) -> None:
    """The counts each rank's output_list expects travel with the call (a checksum in
    the shared-memory stamp, the counts themselves in Gloo's agreement): ranks whose
    output_lists differ all raise ``DesyncError`` naming them, and the comm closes on
    every rank (one may have skipped a call and met the next)."""
    results = run_ranks(_gather_v_counts_disagree, world, shm, timeout=90)
    want = [
        [base + wrong] + [base + r for r in range(1, world)]
        for base in (2, 70_000, 3, 5)
        for wrong in (-1, world + 2)
    ] + [[70_000 - 1] + [70_000] * (world - 1)]
    for rank, messages in enumerate(results):
        assert len(messages) == len(want), messages
        for message, counts in zip(messages, want):
            if shm:  # both sides' calls, each with its expected counts' checksum
                assert "sizes #" in message and "out of step" in message, message
                assert f"rank {rank} called all_gather(" in message, message
            else:
                assert f"rank 1's output_list holds {counts} elements by rank" in message


def _overlapping(rank: int, world: int, shm: bool) -> list[str]:
    from shm_broadcast.config import set_config

    set_config(disable_shm_all_reduce=not shm, disable_shm_p2p=not shm)
    comm = new_comm("gloo", "cpu", "overlap", timeout=30)
    wrong = []
    try:
        for n in (4, 100_000):  # the lean path, and the general one (direct reads)
            m = world * n

            def mine(r: int, shift: int = 0, m: int = m) -> torch.Tensor:
                return torch.arange(shift, m + shift, dtype=torch.float32) + 1_000_000 * r

            # all_to_all_single: output one element past the input, and the input itself.
            want = torch.cat([mine(r)[rank * n : (rank + 1) * n] for r in range(world)])
            a = torch.cat([mine(rank), torch.zeros(1)])
            comm.all_to_all_single(a[1:], a[:-1])
            b = mine(rank)
            comm.all_to_all_single(b, b)
            # reduce_scatter_single: the output is the input's head (on rank 1 and up
            # not this rank's part, the in-place idiom), and all_gather_single likewise.
            c = mine(rank, shift=1)
            comm.reduce_scatter_single(c[:n], c, ReduceOp.SUM)
            summed = sum(mine(r, shift=1)[rank * n : (rank + 1) * n] for r in range(world))
            g = torch.zeros(m)
            g[:n] = float(rank + 1)
            comm.all_gather_single(g, g[:n].clone())  # a copy: the reference
            h = torch.zeros(m + n)
            h[n : 2 * n] = float(rank + 1)
            comm.all_gather_single(h[:m], h[n : 2 * n])  # overlaps, not this rank's part
            checks = {
                "a2a shifted": torch.equal(a[1:], want),
                "a2a same": torch.equal(b, want),
                "rs overlap": torch.equal(c[:n], summed),
                "ag overlap": torch.equal(h[:m], g),
            }
            wrong += [f"{name} n={n}" for name, ok in checks.items() if not ok]
        return wrong
    finally:
        comm.finalize()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_outputs_that_overlap_their_inputs_get_the_right_values(world: int, shm: bool) -> None:
    """An output sharing memory with the input (not torch's in-place idiom) gave wrong
    values on shared memory at world 3 and broke the call on Gloo: the input is now
    copied first, on every path."""
    assert run_ranks(_overlapping, world, shm, timeout=90) == [[]] * world


def _flat_shapes(rank: int, world: int) -> list[str]:
    comm = new_comm("gloo", "cpu", "flat", timeout=30)
    wrong = []
    try:
        for rows, cols in ((4, 6), (600, 300)):  # the lean path, and past it
            n = rows * cols * world
            # As many elements on every rank, in another shape on rank 0 (torch's rule for
            # these calls): the shared-memory path does not check shapes here.
            shape = (cols * world, rows) if rank == 0 else (rows, cols * world)
            mine = (torch.arange(n, dtype=torch.float32) + 1000 * rank).view(shape)
            flat = [torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(world)]
            # Rank 0 goes the general way (a per-call timeout), the others the lean one.
            timeout = 30 if rank == 0 else None
            out = torch.empty(world * n)
            comm.all_gather_single(out, mine, timeout=timeout)
            if not torch.equal(out, torch.cat(flat)):
                wrong.append(f"all_gather_single {shape}")
            part = torch.empty(n // world)
            comm.reduce_scatter_single(part, mine, timeout=timeout)
            if not torch.equal(part, sum(flat).chunk(world)[rank]):
                wrong.append(f"reduce_scatter_single {shape}")
            out = torch.full((world * n,), -1.0)
            comm.gather_single(out, mine, 0, timeout=timeout)
            if rank == 0 and not torch.equal(out, torch.cat(flat)):
                wrong.append(f"gather_single {shape}")
        return wrong
    finally:
        comm.finalize()


@pytest.mark.parametrize("world", [2, 3])
def test_a_comms_calls_need_only_equal_counts_not_shapes(world: int) -> None:
    # GroupCoordinator's all_gather and reduce_scatter check the ranks' shapes
    # (tests/test_desync.py, case "shape"); a Comm follows torch, which does not.
    assert run_ranks(_flat_shapes, world, timeout=120) == [[]] * world


def _threads_on_one_comm(rank: int, world: int, shm: bool) -> list[str]:
    import threading

    from coordinator.comm.objcol import all_gather_object
    from shm_broadcast.config import set_config

    set_config(disable_shm_all_reduce=not shm, timeout_s=30.0)
    comm = new_comm("gloo", "cpu", "threads", timeout=30)
    problems: list[str] = []

    def calls(k: int, phase: threading.Barrier) -> None:
        # The ranks' threads may pair up either way; each call must be one whole
        # pairing: an object's length and its bytes, a part's count and its data.
        for i in range(30):
            got: list[Any] = [None] * world
            all_gather_object(comm, got, {"k": k, "i": i, "pad": "y" * (k * 3000 + i)})
            if any(o["pad"] != "y" * (o["k"] * 3000 + o["i"]) for o in got):
                problems.append(f"all_gather_object {k}/{i}: a mixed object")
        for base in (3, 70_000):  # in the slots; padded past them
            phase.wait()
            for i in range(20):
                outs = [torch.empty(base + r) for r in range(world)]
                comm.all_gather_v(outs, torch.full((base + rank,), float(10 * rank + k)))
                for r, o in enumerate(outs):
                    if o[0].item() not in (10 * r, 10 * r + 1) or not torch.equal(
                        o, o[0].expand_as(o)
                    ):
                        problems.append(f"all_gather_v {base} {k}/{i}: rank {r}'s {o[:3]}")

    in_two_threads(calls, problems)
    comm.finalize()
    return problems


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_two_threads_making_a_comms_calls_of_several_steps_take_turns_whole(shm: bool) -> None:
    # Until 2026-11-28 an object collective's length and bytes, and over Gloo an
    # all_gather_v's counts and data, interleaved with the other thread's: the steps
    # paired across calls on the peer (DesyncError; over Gloo, Gloo aborted the process).
    assert run_ranks(_threads_on_one_comm, 2, shm, timeout=120) == [[], []]
