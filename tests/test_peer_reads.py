"""Large all-gathers that read each peer's input straight from its memory
(``process_vm_readv``), the set-up probe all ranks agree on, and its failures."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from coordinator.launch import init_gloo, run_ranks
from device_communicators.peer_reads import GATHER_CHUNK_BYTES

# (shape, dtype, transposed): every part is over the lean path's 256 KiB.
CASES = [
    ((65537,), torch.float32, False),  # 256 KiB + 4: the smallest part read directly
    ((300, 1001), torch.bfloat16, False),  # odd element count
    ((513, 129), torch.int64, True),  # a non-contiguous input
    ((300000,), torch.bool, False),
    ((3 * 262144 + 5,), torch.float32, False),  # 3 MiB: more than one slot piece
    ((40000,), torch.complex64, False),
]


def _part(rank: int, shape: tuple[int, ...], dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank * 7919 + len(shape))
    values = torch.randint(0, 1000, shape, generator=gen)
    part = values.to(dtype) if dtype != torch.bool else values % 2 == 1
    return part.t() if transposed else part


def _shm_counting_reads(
    rank: int, world: int, disable: bool, timed: bool = False
) -> tuple[Any, list[int]]:
    """A ShmAllReduce over the world (peer reads off when ``disable``) and the list
    every direct read appends its peer's in-group rank to. Large all-gathers and
    broadcasts take the fixed rule's way (read directly where allowed) unless
    ``timed``: then the timed choice decides, as shipped."""
    import torch.distributed as dist

    from device_communicators.shm_all_reduce import ShmAllReduce
    from shm_broadcast.config import set_config

    set_config(disable_peer_reads=disable)
    init_gloo(rank, world)
    shm = ShmAllReduce(dist.group.WORLD, unique_name="pr")
    assert shm.disabled_reason is None
    if not timed:
        shm.timed_ways = None
    if disable:
        assert shm.peer_reads is None
        assert "GROUPCOORD_DISABLE_PEER_READS" in (shm.peer_reads_reason or "")
    reads: list[int] = []
    if shm.peer_reads is not None:
        plain_read = shm.peer_reads.read
        shm.peer_reads.read = lambda *a: reads.append(a[0]) or plain_read(*a)  # type: ignore[method-assign]
    return shm, reads


def _ranks_or_skip(fn: Any, world: int, disable: bool, timeout: float) -> list[Any]:
    """The ranks' results; the test skips when peer reads were wanted but the machine
    refused them (a rank's result, or its first item, is then the reason)."""
    results = run_ranks(fn, world, disable, timeout=timeout)
    reasons = [r[0] if isinstance(r, tuple) else r for r in results]
    if not disable and any(reasons):
        pytest.skip(f"process_vm_readv not allowed here: {reasons}")
    return results


def _gathers(rank: int, world: int, disable: bool) -> str | None:
    shm, reads = _shm_counting_reads(rank, world, disable)
    try:
        if not disable and shm.peer_reads is None:
            return shm.peer_reads_reason  # not allowed on this machine: the test skips
        chunks = 0  # reads from each peer a call: a part is read a chunk at a time
        for shape, dtype, transposed in CASES:
            mine = _part(rank, shape, dtype, transposed)
            kept = mine.clone()
            chunks += -(-mine.numel() * mine.element_size() // GATHER_CHUNK_BYTES)
            for out in (None, torch.empty((world, *mine.shape), dtype=dtype)):
                got = shm.all_gather(mine, out=out)
                assert got.shape == (world, *mine.shape) and got.dtype == dtype
                assert out is None or got is out
                for r in range(world):
                    assert torch.equal(got[r], _part(r, shape, dtype, transposed)), (shape, r)
                # The call returns only after every peer has read this input: changing
                # it at once must not reach a peer's result (checked above next time).
                if dtype == torch.bool:
                    mine.logical_not_()
                else:
                    mine.add_(1)
                mine.copy_(kept)
        expected = 0 if disable else (world - 1) * 2 * chunks
        assert len(reads) == expected, (len(reads), expected)
        assert sorted(set(reads)) == ([] if disable else [r for r in range(world) if r != rank])
        return None
    finally:
        shm.close()


@pytest.mark.parametrize("disable", [False, True], ids=["peer-reads", "slots"])
@pytest.mark.parametrize("world", [2, 4])
def test_large_all_gathers_are_exact_read_directly_or_through_the_slots(
    world: int, disable: bool
) -> None:
    _ranks_or_skip(_gathers, world, disable, 120)


def _one_rank_cannot(rank: int, world: int) -> tuple[str | None, bool]:
    import device_communicators.peer_reads as peer_reads

    if rank == 1:  # as if this rank's C library had no process_vm_readv
        peer_reads._load_readv = lambda: None  # type: ignore[assignment]
    init_gloo(rank, world)
    import torch.distributed as dist

    from device_communicators.shm_all_reduce import ShmAllReduce

    shm = ShmAllReduce(dist.group.WORLD, unique_name="pr")
    try:
        mine = torch.full((300000,), float(rank))
        got = shm.all_gather(mine)
        exact = all(torch.equal(got[r], torch.full((300000,), float(r))) for r in range(world))
        return shm.peer_reads_reason, exact and shm.peer_reads is None
    finally:
        shm.close()


def test_every_rank_reads_through_the_slots_when_one_rank_cannot_read_directly() -> None:
    results = run_ranks(_one_rank_cannot, 3, timeout=60)
    assert all(ok for _, ok in results), results
    assert results[1][0] == "this C library has no process_vm_readv"
    assert results[0][0] == results[2][0] == "ranks [1] cannot read their peers"


def _different_sizes(rank: int, world: int) -> list[str]:
    from device_communicators.errors import ClosedError, DesyncError
    from device_communicators.shm_all_reduce import ShmAllReduce

    init_gloo(rank, world)
    import torch.distributed as dist

    messages = []
    calls = (
        lambda shm: shm.all_gather(torch.ones(20000 + 10000 * rank)),
        # An all-reduce read directly (rank 0, 4 MiB) against a one-shot one through
        # the slots (rank 1, 256 KiB).
        lambda shm: shm.all_reduce(torch.ones(1 << 20 if rank == 0 else 1 << 16)),
    )
    for i, call in enumerate(calls):  # a path each: a mismatch closes it on every rank
        shm = ShmAllReduce(dist.group.WORLD, unique_name=f"pr{i}")
        try:
            with pytest.raises(DesyncError) as caught:
                call(shm)
            messages.append(str(caught.value))
            with pytest.raises(ClosedError, match="is closed on every rank"):
                shm.all_gather(torch.full((20000,), float(rank)))
        finally:
            shm.close()
    return messages


def test_ranks_that_call_different_sizes_raise_before_any_read_and_close_the_path() -> None:
    results = run_ranks(_different_sizes, 2, timeout=60)
    for gather, reduce in results:
        assert "all_gather(float32[20000])" in gather and "all_gather(float32[30000])" in gather
        assert "all_reduce(float32[1048576], SUM)" in reduce
        assert "all_reduce(float32[65536], SUM)" in reduce


def test_a_read_from_a_dead_process_names_every_dead_rank_and_a_bad_address_fails_clearly() -> None:
    import ctypes

    from device_communicators.errors import GroupcoordError, PeerDiedError
    from device_communicators.peer_reads import PeerReads, _load_readv

    readv = _load_readv()
    if readv is None:
        pytest.skip("no process_vm_readv in this C library")
    gone = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)  # reaped: the pid names no process now
        gone.append(pid)
    box = ctypes.c_int64(41)
    got = ctypes.c_int64(0)
    reads = PeerReads(readv, [os.getpid(), *gone], [5, 6, 7], "tp:0")
    try:
        reads.read(0, ctypes.addressof(got), ctypes.addressof(box), 8, "all_gather")
    except GroupcoordError as exc:
        pytest.skip(f"process_vm_readv not allowed here: {exc}")
    assert got.value == 41  # reading this very process works
    # Reading rank 7 fails; every rank that is gone is named (rank 6 may be why 7 left).
    with pytest.raises(PeerDiedError, match=r"tp:0: all_gather failed: peer rank\(s\) \[6, 7\]"):
        reads.read(2, ctypes.addressof(got), ctypes.addressof(box), 8, "all_gather")
    # A bad address of a living rank: with ranks gone, their death is the news (the
    # peer most often freed its memory because its call failed on that death) ...
    with pytest.raises(PeerDiedError, match=r"tp:0: all_gather failed: peer rank\(s\) \[6, 7\]"):
        reads.read(0, ctypes.addressof(got), 0x10, 8, "all_gather")
    # ... and with every rank alive, the read's own failure.
    alone = PeerReads(readv, [os.getpid()], [5], "tp:0")
    with pytest.raises(
        GroupcoordError, match=r"tp:0: all_gather: reading 8 bytes at 0x10 of rank 5"
    ):
        alone.read(0, ctypes.addressof(got), 0x10, 8, "all_gather")


def _reductions(rank: int, world: int, disable: bool) -> tuple[str | None, list[str]]:
    """Large reduce-scatters (uneven ranges, one empty) and all-reduces (out of place
    and in place) against the fixed-order reference; digests of the all-reduces."""
    from test_shm_all_reduce import digest, rank_input, reference
    from torch.distributed import ReduceOp

    from device_communicators.peer_reads import (
        DIRECT_ALL_REDUCE_MIN_BYTES,
        SCATTER_SHARE_MIN_BYTES,
    )

    shm, reads = _shm_counting_reads(rank, world, disable)
    digests = []
    try:
        if not disable and shm.peer_reads is None:
            return shm.peer_reads_reason, []
        # A reduce-scatter is read directly from a share of SCATTER_SHARE_MIN_BYTES
        # (world x 512 KiB of input): the first two are just over, the last under.
        for dtype, numel in (
            (torch.float32, world * 131072 + 1),
            (torch.bfloat16, world * 262144 + 3),
            (torch.float32, world * 131072 - 16),
        ):
            cuts = [0, numel // 5, numel // 5, (3 * numel) // 5, numel][: world + 1]
            cuts[world] = numel  # rank 1's range is empty at world >= 3
            lo, hi = cuts[rank], cuts[rank + 1]
            before = len(reads)
            for op in ("SUM", "MAX", "PRODUCT"):
                x = rank_input(rank, numel, dtype, seed=numel)
                got = shm.reduce_range(x, lo, hi, getattr(ReduceOp, op))
                want = reference(world, numel, dtype, op, seed=numel)[lo:hi]
                assert torch.equal(got, want), (dtype, op, lo, hi)
            direct = numel * dtype.itemsize >= world * SCATTER_SHARE_MIN_BYTES
            assert (len(reads) > before) == (direct and not disable and hi > lo), (dtype, numel)
        # Past one-shot an all-reduce is read directly when every rank has a core.
        before = len(reads)
        want = reference(world, 70001, torch.float32, "SUM", seed=3)
        got = shm.all_reduce(rank_input(rank, 70001, torch.float32, seed=3))
        assert torch.equal(got, want)
        cores = shm.peer_reads.cores if shm.peer_reads is not None else 0
        assert (len(reads) > before) == (not disable and world <= cores), (world, cores)
        numel = DIRECT_ALL_REDUCE_MIN_BYTES // 4 + 3  # just over: read directly
        for dtype, op in ((torch.float32, "SUM"), (torch.bfloat16, "SUM"), (torch.int64, "MIN")):
            want = reference(world, numel, dtype, op, seed=5)
            x = rank_input(rank, numel, dtype, seed=5)
            got = shm.all_reduce(x, getattr(ReduceOp, op))
            assert torch.equal(x, rank_input(rank, numel, dtype, seed=5)), "input modified"
            assert torch.equal(got, want), (dtype, op)
            assert shm.all_reduce(x, getattr(ReduceOp, op), out=x) is x  # in place
            assert torch.equal(x, want), (dtype, op, "in place")
            digests.append(digest(got))
        if disable:
            assert not reads
        else:  # every rank read every peer, in both kinds of call
            assert sorted(set(reads)) == [r for r in range(world) if r != rank]
        return None, digests
    finally:
        shm.close()


@pytest.mark.parametrize("disable", [False, True], ids=["peer-reads", "slots"])
@pytest.mark.parametrize("world", [2, 4])
def test_large_reductions_match_the_fixed_order_reference_read_directly_or_not(
    world: int, disable: bool
) -> None:
    results = _ranks_or_skip(_reductions, world, disable, 180)
    assert all(digests == results[0][1] for _, digests in results)  # bit-identical


def _lean_and_general(rank: int, world: int) -> list[bool]:
    from test_shm_small import _group

    group = _group(rank, world, "pr-lean")
    try:
        exact = []
        # Up to 256 KiB a part the lean path copies through the slots; a rank whose
        # call it declines (here: rank 1 calls the general path itself) must meet
        # the same protocol, not a direct read. Over 256 KiB both read an all-gather
        # directly; a reduce-scatter that size both take through the slots.
        for n in (16385, 40000, 65536, 65537):
            x = torch.arange(float(n)) + 1000 * rank
            got = group.all_gather(x, 0) if rank == 0 else group._all_gather_eager(x, 0)
            want = torch.cat([torch.arange(float(n)) + 1000 * r for r in range(world)])
            exact.append(torch.equal(got, want))
        for n in (40000 // world, 65536 // world, 65536 // world + 1):
            x = torch.arange(float(world * n)) + rank
            got = group.reduce_scatter(x, 0) if rank == 0 else group._reduce_scatter_eager(x, 0)
            full = sum(torch.arange(float(world * n)) + r for r in range(world))
            exact.append(torch.equal(got, full.chunk(world)[rank]))
        return exact
    finally:
        group.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_a_lean_rank_and_a_general_rank_meet_on_one_protocol_at_every_size(world: int) -> None:
    for exact in run_ranks(_lean_and_general, world, timeout=60):
        assert all(exact), exact


def _bad_outputs(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from device_communicators.errors import GroupcoordValueError
    from device_communicators.shm_all_reduce import ShmAllReduce

    init_gloo(rank, world)
    shm = ShmAllReduce(dist.group.WORLD, unique_name="pr")
    try:
        x = torch.full((70000,), float(rank))  # over 256 KiB: read directly where allowed
        messages = []
        for call in (
            lambda: shm.all_gather(x, out=torch.empty(world * 70000 - 1)),
            lambda: shm.all_gather(x, out=torch.empty(70000, world).t()),
            lambda: shm.all_reduce(torch.ones(1 << 20), out=torch.empty(1 << 19)),
            lambda: shm.reduce_range(x, 0, 10, out=torch.empty(10, dtype=torch.float64)),
        ):
            with pytest.raises(GroupcoordValueError, match="^out: expected a contiguous") as bad:
                call()
            messages.append(str(bad.value))
        # Refused before the call was stamped: the ranks are still in step.
        got = shm.all_gather(x)
        assert all(torch.equal(got[r], torch.full((70000,), float(r))) for r in range(world))
        return messages
    finally:
        shm.close()


def test_a_wrong_out_is_refused_before_the_call_and_the_group_stays_usable() -> None:
    for messages in run_ranks(_bad_outputs, 2, timeout=60):
        assert "of 140000 elements, got torch.float32 of shape (139999,)" in messages[0]
        assert "not contiguous" in messages[1]
        assert "torch.float32 tensor of 10 elements, got torch.float64" in messages[3]


def _broadcasts(rank: int, world: int, disable: bool) -> str | None:
    shm, reads = _shm_counting_reads(rank, world, disable)
    try:
        if not disable and shm.peer_reads is None:
            return shm.peer_reads_reason
        src = world - 1
        for shape, dtype, transposed in CASES:
            want = _part(src, shape, dtype, transposed)
            # Into a strided view of a bigger tensor: only the view's elements change.
            base = torch.zeros((*want.shape, 2), dtype=dtype)
            target = base[..., 1]
            if rank == src:
                target.copy_(want)
            assert shm.broadcast_(target, src) is target
            assert torch.equal(target, want), (shape, dtype)
            assert not base[..., 0].any()
        # Read directly only when every rank has a core (else the slots' pipeline).
        assert shm.peer_reads is None or shm.peer_reads.cores == os.cpu_count()
        direct = not disable and rank != src and world <= (os.cpu_count() or 1)
        expected = len(CASES) if direct else 0
        assert len(reads) == expected and set(reads) <= {src}, (reads, expected)
        return None
    finally:
        shm.close()


@pytest.mark.parametrize("disable", [False, True], ids=["peer-reads", "slots"])
@pytest.mark.parametrize("world", [2, 4])
def test_large_broadcasts_read_the_root_directly_when_every_rank_has_a_core(
    world: int, disable: bool
) -> None:
    _ranks_or_skip(_broadcasts, world, disable, 120)


CALLS = 107  # three timing cycles (at calls 0, 32 and 96) and a call after them
TIMED_OPS = ("all_gather", "broadcast", "all_reduce", "reduce_scatter")


def _timed_ways(
    rank: int, world: int, slow: str
) -> tuple[str | None, dict[str, list[bool]], dict[str, Any]]:
    """Each call the fixed rule reads directly, of one size, with one way (``slow``)
    made 50 ms slower on every rank: by operation, whether each call read directly
    here, and the way and agreed timings every rank ended with (None: not timed)."""
    import time

    shm, reads = _shm_counting_reads(rank, world, False, timed=True)
    try:
        if shm.peer_reads is None:
            return shm.peer_reads_reason, {}, {}
        plain = shm._first_arrive

        def first_arrive(lines: Any, phase: int, turn: Any) -> None:
            plain(lines, phase, turn)
            if turn is not None and turn.direct == (slow == "direct"):
                time.sleep(0.05)

        shm._first_arrive = first_arrive
        # 1.6 MiB a rank: past the lean path and one slot piece, and a reduce-scatter
        # share of over 512 KiB at worlds 2 and 3 (an all-reduce is read directly at
        # world 3 on 2 cores only from 4 MiB: not timed there).
        numel = 400000
        lo, hi = rank * numel // world, (rank + 1) * numel // world
        ways: dict[str, list[bool]] = {op: [] for op in TIMED_OPS}
        for i in range(CALLS):
            x = torch.full((numel,), float(rank + i))
            for op in TIMED_OPS:
                before = len(reads)
                if op == "all_gather":
                    got = shm.all_gather(x)
                elif op == "broadcast":
                    got = shm.broadcast_(x.clone(), 0)
                elif op == "all_reduce":
                    got = shm.all_reduce(x)
                else:
                    got = shm.reduce_range(x, lo, hi)
                ways[op].append(len(reads) > before)
                if op == "all_gather":
                    want = torch.stack([torch.full((numel,), float(r + i)) for r in range(world)])
                elif op == "broadcast":
                    want = torch.full((numel,), float(i))
                else:
                    want = torch.full((numel,), float(sum(r + i for r in range(world))))
                    want = want if op == "all_reduce" else want[lo:hi]
                assert torch.equal(got, want), (op, i)
        assert shm.timed_ways is not None
        states = {op: shm.timed_ways.state(op, numel * 4) for op in TIMED_OPS}
        return None, ways, states
    finally:
        shm.close()


@pytest.mark.parametrize("slow", ["direct", "slots"])
@pytest.mark.parametrize("world", [2, 3])
def test_large_calls_take_the_way_timed_faster_on_every_rank(world: int, slow: str) -> None:
    from device_communicators.peer_reads import FIRST_CYCLE

    results = run_ranks(_timed_ways, world, slow, timeout=180)
    if any(reason for reason, _, _ in results):
        pytest.skip(f"process_vm_readv not allowed here: {results}")
    # In each cycle (32 calls, then 64, 128, ...), calls 1-4 go through the slots
    # and 5-9 read directly (the last two of each way timed, 9 sharing the times);
    # the rest take the faster way, but for the very first, the fixed rule's.
    fast = slow == "slots"
    timing = [False] * 4 + [True] * 5
    cycles = [FIRST_CYCLE, 2 * FIRST_CYCLE, CALLS - 3 * FIRST_CYCLE]
    expected = [item for n in cycles for item in [fast, *timing] + [fast] * (n - 10)]
    expected[0] = True
    # With more ranks than cores (world 3 here) a broadcast, and an all-reduce
    # under 4 MiB, take the slots untimed.
    cores = os.cpu_count() or 1
    untimed = {"broadcast", "all_reduce"} if world > cores else set()
    for rank, (_, ways, states) in enumerate(results):
        assert states == results[0][2]  # every rank decided alike, from the same numbers
        for op in TIMED_OPS:
            if op in untimed:
                assert states[op] is None and not any(ways[op]), op
                continue
            if op != "broadcast" or rank != 0:  # the root of a broadcast reads nothing
                assert ways[op] == expected, op
            state = states[op]
            assert state["direct"] is fast and state["agreements"] == 3, (op, state)
            assert state["calls"] == CALLS
            slower, faster = (
                (state["direct_ns"], state["slots_ns"])
                if slow == "direct"
                else (state["slots_ns"], state["direct_ns"])
            )
            assert slower > faster + 40_000_000, (op, state)  # the 50 ms


def _ways_apart(rank: int, world: int) -> str:
    from device_communicators.errors import DesyncError

    shm, _ = _shm_counting_reads(rank, world, False, timed=rank == 0)
    try:
        if shm.peer_reads is None:
            return f"skip: {shm.peer_reads_reason}"
        # Rank 0 times its second call of a size through the slots; rank 1 reads
        # directly (the fixed rule).
        shm.all_gather(torch.ones(300000))
        with pytest.raises(DesyncError) as apart:
            shm.all_gather(torch.ones(300000))
        shm.timed_ways = None  # now alike: the group goes on, in step
        got = shm.all_gather(torch.full((300000,), float(rank)))
        assert all(torch.equal(got[r], torch.full((300000,), float(r))) for r in range(world))
        return str(apart.value)
    finally:
        shm.close()


def test_ranks_whose_ways_differ_raise_instead_of_copying_what_was_never_written() -> None:
    results = run_ranks(_ways_apart, 2, timeout=60)
    if any(r.startswith("skip: ") for r in results):
        pytest.skip(f"process_vm_readv not allowed here: {results}")
    for text in results:
        assert "rank 0 called all_gather(float32[300000]) as call #2" in text, text
        assert "rank 1 called all_gather(float32[300000]) read directly as call #2" in text, text


def test_groupcoord_info_probe_reports_why_ranks_could_not_read_each_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import device_communicators.peer_reads as peer_reads

    here = peer_reads.probe_this_machine()
    assert here is None or "process_vm_readv" in here or "read" in here

    def refuse(self: object, r: int, *args: object) -> None:
        raise peer_reads.PeerReadError("probe: read: Operation not permitted")

    monkeypatch.setattr(peer_reads.PeerReads, "read", refuse)  # the forked child inherits it
    assert peer_reads.probe_this_machine() == "probe: read: Operation not permitted"
    monkeypatch.setattr(peer_reads, "_load_readv", lambda: None)
    assert peer_reads.probe_this_machine() == "this C library has no process_vm_readv"


def test_the_scratch_rows_fit_every_dtype_at_every_world_size() -> None:
    from device_communicators.peer_reads import READ_SCRATCH_BYTES
    from device_communicators.shm_all_reduce import ShmAllReduce

    for world in range(2, 10):
        shm = ShmAllReduce.__new__(ShmAllReduce)  # only the geometry: no group needed
        shm.world_size = world
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex128, torch.uint8):
            rows = shm._scratch(dtype)
            assert rows.shape[0] == world and rows.dtype == dtype and rows.is_contiguous()
            assert 0 < rows.shape[1] * dtype.itemsize * (world - 1) <= READ_SCRATCH_BYTES


def _dies_mid_call(rank: int, world: int, op: str) -> tuple[list[int], float, int]:
    import os
    import signal
    import threading
    import time

    import torch.distributed as dist

    from device_communicators.errors import PeerDiedError
    from device_communicators.shm_all_reduce import ShmAllReduce

    init_gloo(rank, world)
    shm = ShmAllReduce(dist.group.WORLD, timeout_s=60, unique_name="pr-dies")
    if shm.peer_reads is None:
        return [], 0.0, -1  # the test skips
    x = torch.ones(1 << 20)  # 4 MiB: read directly
    call = {"all_gather": shm.all_gather, "all_reduce": shm.all_reduce}[op]
    if rank == 1:  # dies somewhere inside one of its calls, wherever that is
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
    calls = 0
    start = time.monotonic()
    try:
        while True:
            call(x)
            calls += 1
            start = time.monotonic()
    except PeerDiedError as exc:
        return exc.dead, time.monotonic() - start, calls
    finally:
        shm.close()


@pytest.mark.parametrize("op", ["all_gather", "all_reduce"])
def test_a_peer_killed_during_direct_reads_is_reported_within_seconds(op: str) -> None:
    from coordinator.launch import start_ranks

    dead, elapsed, calls = start_ranks(_dies_mid_call, 2, op, timeout=60).collect(killed=[1])[0]
    if calls < 0:
        pytest.skip("process_vm_readv not allowed here")
    assert dead == [1] and calls > 0
    assert elapsed < 5.0  # from the last call that returned


def test_a_way_is_timed_from_the_last_start_to_the_last_end_and_kept_till_the_next_timing() -> None:
    from device_communicators.peer_reads import FIRST_CYCLE, TimedWays

    ways = TimedWays()

    def run(calls: int) -> list[tuple[bool, bool]]:
        """``calls`` calls of one kind that all pass their first barrier: (way, shares)."""
        seen = []
        for _ in range(calls):
            turn = ways.turn("broadcast", 1 << 20)
            seen.append((turn.direct, turn.shares))
            turn.passed_first_barrier()
            turn.finish()
        return seen

    seen = run(9)
    assert seen == [(True, False)] + [(False, False)] * 4 + [(True, False)] * 4
    turn = ways.turn("broadcast", 1 << 20)
    assert turn.direct and turn.shares
    # Two ranks' (start, end) of their timed calls: slots twice, then direct twice.
    # Rank 1 started every call 5 us late; each call ended on both ranks alike.
    us = 1000
    rank0 = tuple(
        10**9 + t * us for t in (0, 90, 100, 180, 200, 400, 500, 650)
    )  # the host's monotonic clock, in ns
    rank1 = tuple(t + 5 * us if i % 2 == 0 else t for i, t in enumerate(rank0))
    turn.agree([rank0, rank1])
    state = ways.state("broadcast", 1 << 20)
    assert state is not None
    # slots: min(90 - 5, 180 - 105) = 75 us; direct: min(400 - 205, 650 - 505) = 145 us
    assert (state["slots_ns"], state["direct_ns"]) == (75 * us, 145 * us)
    assert state["direct"] is False and state["agreements"] == 1
    turn.passed_first_barrier()
    assert [way for way, _ in run(FIRST_CYCLE - 10)] == [False] * (FIRST_CYCLE - 10)
    # The next cycle (twice as long) times again; a rank without a time keeps the way.
    seen = run(9)
    assert seen == [(False, False)] * 5 + [(True, False)] * 4
    turn = ways.turn("broadcast", 1 << 20)
    assert turn.shares
    turn.agree([rank0, (0,) * 8])
    assert ways.state("broadcast", 1 << 20)["direct"] is False  # type: ignore[index]
    # Another size class is a kind of its own, read directly until timed.
    assert ways.turn("broadcast", 1 << 22).direct and ways.state("broadcast", 1 << 22)
