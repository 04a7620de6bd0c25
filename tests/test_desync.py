"""Desync detection on the shared-memory collectives (always on): ranks that make
different calls as the same call get a DesyncError on every rank, naming both
sides, before any result is returned; the group then closes on every rank (one
rank may have skipped a call, and the calls after it would pair a call apart)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from coordinator.launch import init_gloo, run_ranks
from device_communicators.shm_phases import LAYOUT_SHIFT, layout_code


def _shape(shape: tuple[int, ...], dim: int = 0) -> str:
    """How the fingerprint names a call's shape (a checksum)."""
    return f"shape #{layout_code(shape, dim) >> LAYOUT_SHIFT:04x}"


# (name, what rank 0 does, what the other ranks do, both sides as the error names them)
CASES = {
    "size": (
        lambda g: g.all_reduce(torch.ones(4096)),
        lambda g: g.all_reduce(torch.ones(8192)),
        ("all_reduce(float32[4096], SUM)", "all_reduce(float32[8192], SUM)"),
    ),
    "operation": (
        lambda g: g.all_reduce(torch.ones(64)),
        lambda g: g.all_gather(torch.ones(64), dim=0),
        ("all_reduce(float32[64], SUM)", "all_gather(float32[64])"),
    ),
    "dtype": (
        lambda g: g.broadcast(torch.ones(32, dtype=torch.float32), src=0),
        lambda g: g.broadcast(torch.ones(32, dtype=torch.int32), src=0),
        ("broadcast(float32[32], src=0)", "broadcast(int32[32], src=0)"),
    ),
    "reduce op": (
        lambda g: g.device_communicator.all_reduce(torch.ones(16), op=ReduceOp.SUM),
        lambda g: g.device_communicator.all_reduce(torch.ones(16), op=ReduceOp.MAX),
        ("all_reduce(float32[16], SUM)", "all_reduce(float32[16], MAX)"),
    ),
    # Bitwise operators and complex sums went to Gloo, which aborted on these.
    "bitwise size": (
        lambda g: g.device_communicator.all_reduce(torch.ones(4096).int(), op=ReduceOp.BAND),
        lambda g: g.device_communicator.all_reduce(torch.ones(8192).int(), op=ReduceOp.BAND),
        ("all_reduce(int32[4096], BAND)", "all_reduce(int32[8192], BAND)"),
    ),
    "bitwise op": (
        lambda g: g.device_communicator.all_reduce(torch.ones(16).int(), op=ReduceOp.BAND),
        lambda g: g.device_communicator.all_reduce(torch.ones(16).int(), op=ReduceOp.BOR),
        ("all_reduce(int32[16], BAND)", "all_reduce(int32[16], BOR)"),
    ),
    "average or sum": (
        lambda g: g.device_communicator.all_reduce(torch.ones(16), op=ReduceOp.AVG),
        lambda g: g.device_communicator.all_reduce(torch.ones(16), op=ReduceOp.SUM),
        ("all_reduce(float32[16], AVG)", "all_reduce(float32[16], SUM)"),
    ),
    "complex or real": (
        lambda g: g.all_reduce(torch.ones(4096, dtype=torch.complex64)),
        lambda g: g.all_reduce(torch.ones(8192)),
        ("all_reduce(complex64[4096], SUM)", "all_reduce(float32[8192], SUM)"),
    ),
    # Copies take any dtype: each has its own code in the fingerprint (these shared
    # one, "another dtype", and returned the other rank's bytes as their own).
    "unsigned width": (
        lambda g: g.all_gather(torch.ones(16, dtype=torch.uint32), dim=0),
        lambda g: g.all_gather(torch.ones(16, dtype=torch.uint64), dim=0),
        ("all_gather(uint32[16])", "all_gather(uint64[16])"),
    ),
    "float8 format": (
        lambda g: g.broadcast(torch.ones(16).to(torch.float8_e4m3fn), src=0),
        lambda g: g.broadcast(torch.ones(16).to(torch.float8_e5m2), src=0),
        ("broadcast(float8_e4m3fn[16], src=0)", "broadcast(float8_e5m2[16], src=0)"),
    ),
    "root": (
        lambda g: g.broadcast(torch.ones(8), src=0),
        lambda g: g.broadcast(torch.ones(8), src=1),
        ("broadcast(float32[8], src=0)", "broadcast(float32[8], src=1)"),
    ),
    # A barrier is a call of its own, not an all-reduce of nothing.
    "barrier": (
        lambda g: g.barrier(),
        lambda g: g.all_reduce(torch.ones(1)),
        ("barrier()", "all_reduce(float32[1], SUM)"),
    ),
    "reduce destination": (
        lambda g: g.device_communicator.shm_all_reduce.reduce(torch.ones(16), 0),
        lambda g: g.device_communicator.shm_all_reduce.reduce(torch.ones(16), 1),
        ("reduce(float32[16], SUM, dst=0)", "reduce(float32[16], SUM, dst=1)"),
    ),
    "lean reduce destination": (
        lambda g: g.device_communicator.small_calls.reduce(torch.ones(16), 0),
        lambda g: g.device_communicator.small_calls.reduce(torch.ones(16), 1),
        ("reduce(float32[16], SUM, dst=0)", "reduce(float32[16], SUM, dst=1)"),
    ),
    "lean gather destination": (
        lambda g: g.device_communicator.small_calls.gather(torch.ones(16), 0),
        lambda g: g.device_communicator.small_calls.gather(torch.ones(16), 1),
        ("gather(float32[16], dst=0)", "gather(float32[16], dst=1)"),
    ),
    "gather destination": (
        lambda g: g.gather(torch.ones(16), dst=0),
        lambda g: g.gather(torch.ones(16), dst=1),
        ("gather(float32[16], dst=0)", "gather(float32[16], dst=1)"),
    ),
    "all_to_all or all_gather": (
        lambda g: g.device_communicator.shm_all_reduce.all_to_all(torch.ones(16), torch.empty(16)),
        lambda g: g.device_communicator.shm_all_reduce.all_gather(torch.ones(16)),
        ("all_to_all(float32[16])", "all_gather(float32[16])"),
    ),
    "scatter source": (
        lambda g: g.device_communicator.shm_all_reduce.scatter(
            torch.empty(8), [torch.ones(8)] * g.world_size, 0
        ),
        lambda g: g.device_communicator.shm_all_reduce.scatter(
            torch.empty(8), [torch.ones(8)] * g.world_size, 1
        ),
        ("scatter(float32[8], src=0)", "scatter(float32[8], src=1)"),
    ),
    # As many elements in another shape: each rank read the others' in its own.
    "shape": (
        lambda g: g.all_gather(torch.ones(4, 8), dim=1),
        lambda g: g.all_gather(torch.ones(8, 4), dim=1),
        (
            f"all_gather(float32[32], {_shape((4, 8))})",
            f"all_gather(float32[32], {_shape((8, 4))})",
        ),
    ),
    "large shape": (  # 512 KiB: the general path
        lambda g: g.all_gather(torch.ones(256, 512), dim=1),
        lambda g: g.all_gather(torch.ones(512, 256), dim=1),
        (
            f"all_gather(float32[131072], {_shape((256, 512))})",
            f"all_gather(float32[131072], {_shape((512, 256))})",
        ),
    ),
    "reduce_scatter shape": (
        lambda g: g.reduce_scatter(torch.ones(4, 8), dim=0),
        lambda g: g.reduce_scatter(torch.ones(8, 4), dim=0),
        (
            f"reduce_scatter(float32[32], SUM, {_shape((4, 8))})",
            f"reduce_scatter(float32[32], SUM, {_shape((8, 4))})",
        ),
    ),
    # The general path sums rows moved to the front: another dim is another layout.
    "large reduce_scatter dim": (
        lambda g: g.reduce_scatter(torch.ones(512, 256), dim=0),
        lambda g: g.reduce_scatter(torch.ones(512, 256), dim=1),
        (
            f"reduce_scatter(float32[131072], SUM, {_shape((512, 256))})",
            f"reduce_scatter(float32[131072], SUM, {_shape((512, 256), 1)})",
        ),
    ),
    # A list's tensors are gathered one call each: the shorter list's next gather
    # met the longer one's next tensor and returned it (the first call now carries
    # the list's length).
    "list length": (
        lambda g: g.all_gatherv([torch.ones(2, 3), torch.ones(2, 3)], 0, [2] * g.world_size),
        lambda g: g.all_gatherv([torch.ones(2, 3)], 0, [2] * g.world_size),
        ("all_gather(float32[6], sizes #", f"all_gather(float32[6], {_shape((2, 3))})"),
    ),
    "gather or all_gather": (
        lambda g: g.device_communicator.shm_all_reduce.gather(torch.ones(16), 0),
        lambda g: g.device_communicator.shm_all_reduce.all_gather(torch.ones(16)),
        ("gather(float32[16], dst=0)", "all_gather(float32[16])"),
    ),
}


# Caught on the Gloo path only by the debug check (on shared memory the rank whose
# sizes disagree with the parts raises GroupcoordValueError, tests/test_cpu_communicator.py).
GLOO_ONLY_CASES = {
    "all_gatherv sizes": (
        lambda g: g.all_gatherv(torch.ones(2, 3), 0, [2] * g.world_size),
        lambda g: g.all_gatherv(torch.ones(2, 3), 0, [1] + [2] * (g.world_size - 1)),
        (
            "all_gatherv(float32[*, 3], dim=0, sizes=[2, 2",
            "all_gatherv(float32[*, 3], dim=0, sizes=[1, 2",
        ),
    ),
}

# The same mismatches on the Gloo path (shared memory off) with the debug check on,
# as GroupCoordinator names them ("reduce op" calls the communicator directly).
GLOO_DEBUG_SIDES = {
    "all_gatherv sizes": GLOO_ONLY_CASES["all_gatherv sizes"][2],
    "size": ("all_reduce(float32[4096])", "all_reduce(float32[8192])"),
    "list length": (
        "all_gatherv([float32[*, 3], float32[*, 3]], dim=0",
        "all_gatherv(float32[*, 3], dim=0",
    ),
    "operation": ("all_reduce(float32[64])", "all_gather(float32[64], dim=0)"),
    "dtype": ("broadcast(float32[32], src=0)", "broadcast(int32[32], src=0)"),
    "root": ("broadcast(float32[8], src=0)", "broadcast(float32[8], src=1)"),
    "barrier": ("barrier()", "all_reduce(float32[1])"),
    "shape": ("all_gather(float32[4, 8], dim=1)", "all_gather(float32[8, 4], dim=1)"),
}


def _mismatch(rank: int, world: int, case: str, gloo_debug: bool = False) -> dict:
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import DesyncError

    if gloo_debug:
        set_config(disable_shm_all_reduce=True, debug_desync=True)
    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="dsy")
    try:
        mine, others, _ = {**CASES, **GLOO_ONLY_CASES}[case]
        call = mine if rank == 0 else others
        start = time.monotonic()
        try:
            call(group)
            raised = ""
        except DesyncError as exc:
            raised = str(exc)
        took = time.monotonic() - start
        # The group is closed afterwards on every rank: one rank may have skipped a
        # call rather than made one in place of another, and the calls after it
        # would then pair a call apart (same-shaped ones silently).
        after = _refused(lambda: group.all_reduce(torch.full((100,), float(rank))))
        return {"raised": raised, "took": took, "after": after, "is_value_error": True}
    finally:
        group.destroy()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_that_disagree_all_raise_naming_both_sides(case, world):
    results = run_ranks(_mismatch, world, case, timeout=60)
    rank0_side, other_side = CASES[case][2]
    for rank, got in enumerate(results):
        assert got["raised"], f"rank {rank} returned a result for a mismatched call"
        assert got["took"] < 1.0, got["took"]
        assert rank0_side in got["raised"] and other_side in got["raised"], got["raised"]
        assert "dsy" in got["raised"] and "call #" in got["raised"]
        assert "dsy:0 is closed on every rank" in got["raised"], got["raised"]
        assert "dsy:0 is unusable after an earlier failure" in got["after"], got["after"]


def test_desync_error_is_a_value_error():
    from shm_broadcast.errors import DesyncError

    assert issubclass(DesyncError, ValueError)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", sorted(GLOO_DEBUG_SIDES))
def test_debug_desync_catches_the_same_on_the_gloo_path(case, world):
    results = run_ranks(_mismatch, world, case, True, timeout=60)
    rank0_side, other_side = GLOO_DEBUG_SIDES[case]
    for rank, got in enumerate(results):
        assert got["raised"], f"rank {rank} returned a result for a mismatched call"
        assert rank0_side in got["raised"] and other_side in got["raised"], got["raised"]
        assert "dsy" in got["raised"] and "call #" in got["raised"]
        assert "dsy:0 is closed on every rank" in got["raised"], got["raised"]
        assert "dsy:0 is unusable after an earlier failure" in got["after"], got["after"]


def _gloo_parts_that_do_not_join(rank: int, world: int) -> tuple[str, str]:
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import DesyncError

    set_config(disable_shm_all_reduce=True)  # Gloo, debug_desync off
    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="dsy")
    try:
        with pytest.raises(DesyncError) as raised:  # the part-length exchange's check
            group.all_gatherv(torch.ones(rank + 1, 3 + rank), dim=0)
        return str(raised.value), _refused(lambda: group.all_reduce(torch.ones(4)))
    finally:
        group.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_a_gloo_groups_parts_that_cannot_join_close_it_on_every_rank(world):
    # Until 2026-11-30 the group went on after this check (and an EP manager's
    # debug_desync check) on the Gloo path, where the shared-memory path's checks
    # close it (row 95): a rank may have skipped a call, and the same-shaped calls
    # after it would pair a call apart.
    for rank, (raised, after) in enumerate(run_ranks(_gloo_parts_that_do_not_join, world)):
        assert f"this rank: torch.float32, shape ({rank + 1}, {3 + rank})" in raised, raised
        assert "cannot concatenate" in raised and "dsy:0 is closed on every rank" in raised
        assert "dsy:0 is unusable after an earlier failure" in after, after


CALLS_PAST_WRAP = (1 << 19) + 3  # the call number's stamp holds 19 bits


def _many_calls(rank: int, world: int) -> dict:
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.errors import DesyncError

    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="long")
    try:
        x = torch.ones(4)
        for _ in range(CALLS_PAST_WRAP):
            y = group.all_reduce(x)
        try:
            group.all_reduce(torch.ones(4096 if rank == 0 else 8192))
            raised = ""
        except DesyncError as exc:
            raised = str(exc)
        return {"last": y.tolist(), "raised": raised}
    finally:
        group.destroy()


def test_a_group_keeps_working_and_checking_past_two_to_the_19_calls():
    # The stamp once held 20 bits of the call number and overflowed its int64 at
    # call 2**19: every call after it raised (a few thousand engine steps).
    results = run_ranks(_many_calls, 2, timeout=240)
    for got in results:
        assert got["last"] == [2.0] * 4
        assert "all_reduce(float32[4096], SUM)" in got["raised"], got["raised"]
        assert "all_reduce(float32[8192], SUM)" in got["raised"], got["raised"]
    numbers = {int(n) for n in re.findall(r"as call #(\d+)", results[0]["raised"])}
    assert len(numbers) == 1 and numbers.pop() > CALLS_PAST_WRAP, results[0]["raised"]


def _split_mismatch(rank: int, world: int) -> dict:
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.errors import DesyncError

    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="dsy-split")
    try:
        rows = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)
        # Equal parts given explicitly meet a plain reduce_scatter (the same cut).
        equal = [8 // world] * world
        if rank == 0:
            part = group.reduce_scatterv(rows, dim=0, sizes=equal)
        else:
            part = group.reduce_scatter(rows, dim=0)
        want = (rows * world).chunk(world)[rank]
        # The same call, but rank 0 cuts the rows unlike the others.
        ones = [1] * (world - 1)
        sizes = ones + [9 - world] if rank == 0 else [9 - world] + ones
        try:
            group.reduce_scatterv(rows, dim=0, sizes=sizes)
            raised = ""
        except DesyncError as exc:
            raised = str(exc)
        return {"raised": raised, "equal_ok": torch.equal(part, want)}
    finally:
        group.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_cut_a_reduce_scatterv_differently_all_raise(world):
    for rank, got in enumerate(run_ranks(_split_mismatch, world, timeout=60)):
        raised = got["raised"]
        assert raised, f"rank {rank} reduced rows of its own choosing"
        codes = re.findall(
            r"reduce_scatter\(float32\[32\], SUM, sizes #([0-9a-f]{4}), shape #[0-9a-f]{4}\)",
            raised,
        )
        assert len(codes) == 2 and codes[0] != codes[1], raised
        assert got["equal_ok"]


# A coordinator.comm communicator over Gloo (ranks on several nodes, or shared
# memory off) with the debug check on: (what rank 0 does, what the others do,
# both sides as the error names them).
COMM_CASES = {
    "size": (
        lambda c: c.all_reduce(torch.ones(4096)),
        lambda c: c.all_reduce(torch.ones(8192)),
        ("all_reduce(float32[4096], SUM)", "all_reduce(float32[8192], SUM)"),
    ),
    "dtype": (
        lambda c: c.broadcast(torch.ones(32), 0),
        lambda c: c.broadcast(torch.ones(32, dtype=torch.int32), 0),
        ("broadcast(float32[32], src=0)", "broadcast(int32[32], src=0)"),
    ),
    "average or sum": (
        lambda c: c.all_reduce(torch.ones(16), _comm_op("AVG")),
        lambda c: c.all_reduce(torch.ones(16), _comm_op("SUM")),
        ("all_reduce(float32[16], AVG)", "all_reduce(float32[16], SUM)"),
    ),
    "root": (
        lambda c: c.reduce(torch.ones(8), 0),
        lambda c: c.reduce(torch.ones(8), 1),
        ("reduce(float32[8], SUM, dst=0)", "reduce(float32[8], SUM, dst=1)"),
    ),
    "operation": (
        lambda c: c.all_to_all_single(torch.empty(8), torch.ones(8)),
        lambda c: c.all_gather_single(torch.empty(8 * c.get_size()), torch.ones(8)),
        ("all_to_all(float32[8])", "all_gather(float32[8])"),
    ),
    "barrier": (
        lambda c: c.barrier(),
        lambda c: c.all_reduce(torch.ones(1)),
        ("barrier()", "all_reduce(float32[1], SUM)"),
    ),
    "cut": (
        lambda c: c.reduce_scatter_v(torch.empty(2), [torch.ones(2)] * c.get_size()),
        lambda c: c.reduce_scatter_v(
            torch.empty(1), [torch.ones(2)] + [torch.ones(1)] * (c.get_size() - 1)
        ),
        ("reduce_scatter(float32[", ", SUM, sizes #"),
    ),
}


def _comm_op(name: str):
    from coordinator.comm import ReduceOp as CommReduceOp

    return getattr(CommReduceOp, name)


def _comm_mismatch(rank: int, world: int, case: str) -> dict:
    from coordinator.comm import new_comm
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import DesyncError

    set_config(disable_shm_all_reduce=True, debug_desync=True)
    comm = new_comm("gloo", "cpu", "cdsy", timeout=30)
    try:
        mine, others, _ = COMM_CASES[case]
        try:
            (mine if rank == 0 else others)(comm)
            raised = ""
        except DesyncError as exc:
            raised = str(exc)
        # Closed on every rank: a skipped call would leave the next ones a call apart.
        after = _refused(lambda: comm.all_reduce(torch.full((100,), float(rank))))
        return {"raised": raised, "after": after}
    finally:
        comm.abort()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", sorted(COMM_CASES))
def test_debug_desync_checks_a_comm_over_gloo(case, world):
    """Gloo would abort the process on most of these and sum float32 bytes as int32
    silently: with the debug check each raises on every rank naming both calls."""
    results = run_ranks(_comm_mismatch, world, case, timeout=60)
    rank0_side, other_side = COMM_CASES[case][2]
    for rank, got in enumerate(results):
        assert got["raised"], f"rank {rank} returned a result for a mismatched call"
        assert rank0_side in got["raised"] and other_side in got["raised"], got["raised"]
        assert "cdsy" in got["raised"] and "call #" in got["raised"], got["raised"]
        assert "communicator 'cdsy' is closed on every rank" in got["raised"], got["raised"]
        assert "closed by a desync on every rank" in got["after"], got["after"]


def _refused(call: Callable[[], Any]) -> str:
    """The ``ClosedError`` that ``call()`` raised, as text, or "returned"."""
    from shm_broadcast.errors import ClosedError

    try:
        call()
    except ClosedError as exc:
        return str(exc)
    return "returned"


def _queue_group(
    rank: int, world: int, name: str, gloo_debug: bool, timeout_s: float = 10.0
) -> Any:
    """A group of every rank with a message queue, calls timing out after
    ``timeout_s``; ``gloo_debug``: its collectives and sends over Gloo, with
    ``debug_desync``. Joins torch.distributed's default group first, once."""
    import torch.distributed as dist

    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config

    if gloo_debug:
        set_config(disable_shm_all_reduce=True, disable_shm_p2p=True, debug_desync=True)
    set_config(timeout_s=timeout_s)
    if not dist.is_initialized():
        init_gloo(rank, world)
    return GroupCoordinator(
        [list(range(world))], rank, "gloo", True, use_message_queue_broadcaster=True,
        group_name=name,
    )  # fmt: skip


def _queue_broadcast_met_by_another_call(
    rank: int, world: int, case: str, gloo_debug: bool
) -> list[str]:
    """Rank 0 broadcasts through the group's queue where (some of) the others make
    another call; then every rank reduces a value that changes each call, twice,
    and broadcasts once more. Returns what each call returned or raised."""
    from shm_broadcast.errors import GroupcoordError

    group = _queue_group(rank, world, "stale", gloo_debug)
    last = world - 1
    if case == "unread":
        # The last rank makes a plain broadcast instead of reading step 1; the
        # others read it, and then reduce with rank 0.
        calls = {
            0: [lambda: group.broadcast_tensor_dict({"step": 1, "t": torch.ones(4)}, src=0),
                lambda: group.all_reduce(torch.ones(4))],
            last: [lambda: group.broadcast(torch.ones(4), src=0)],
        }.get(rank, [lambda: group.broadcast_tensor_dict(None, src=0),
                     lambda: group.all_reduce(torch.ones(4))])  # fmt: skip
    else:
        # Rank 0 broadcasts its dict (through the queue); the others take the same
        # call for one from the last rank (a broadcast of its own, no queue).
        src = 0 if rank == 0 else last
        calls = [
            lambda: group.broadcast_tensor_dict(
                {"t": torch.ones(4)} if rank == src else None, src=src
            )
        ]
    for step in (1, 2):  # then the same calls everywhere, whose sums tell them apart
        calls.append(lambda step=step: group.all_reduce(torch.full((4,), float(step))))
    calls.append(lambda: group.broadcast_object("next" if rank == 0 else None, src=0))
    seen = []
    for call in calls:
        try:
            got = call()
            seen.append(f"ret {got.tolist() if isinstance(got, torch.Tensor) else got}")
        except GroupcoordError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    group.destroy()
    return seen


def _sums(seen: list[str], world: int) -> list[str]:
    """The all_reduce results among ``seen`` that are no step's right sum."""
    right = {f"ret {[float(world * step)] * 4}" for step in (1, 2)}
    return [
        s
        for s in seen
        if s.startswith("ret [") and s not in right and s != "ret [1.0, 1.0, 1.0, 1.0]"
    ]


@pytest.mark.parametrize("gloo_debug", [False, True], ids=["shm", "gloo-debug"])
@pytest.mark.parametrize(("case", "world"), [("unread", 2), ("unread", 3), ("another source", 3)])
def test_a_queue_broadcast_met_by_another_call_closes_the_group_on_every_rank(
    case, world, gloo_debug
):
    """A queue broadcast is one-way: its writer returns, while a reader that made
    another call instead raises DesyncError with the others at the writer's next
    call. The ranks' calls were then a whole call apart ("another source": the
    writer's second all_reduce met the others' first: it returned [4.0] * 4 at
    world 3, its 2.0 plus their 1.0s, with no error), so every rank
    closes the group, the reader dropping the broadcast it never read: each call
    after raises ClosedError naming why, and none returns a wrong value."""
    results = run_ranks(_queue_broadcast_met_by_another_call, world, case, gloo_debug, timeout=60)
    for rank, seen in enumerate(results):
        assert not _sums(seen, world), (rank, seen)
    for rank, seen in enumerate(results):
        raised = [s for s in seen if s.startswith("DesyncError")]
        assert len(raised) == 1, (rank, seen)
        assert "closed on every rank" in raised[0], (rank, raised)
        after = seen[seen.index(raised[0]) + 1 :]
        assert after and all(s.startswith("ClosedError") for s in after), (rank, seen)
        assert all("closed on every rank" in s for s in after), (rank, seen)
        # Before the error, a rank's calls returned their own values.
        for s in seen[: seen.index(raised[0])]:
            assert s.startswith("ret") and "5.0" not in s, (rank, seen)
    # The reader that never read the broadcast dropped it.
    dropped = "message-queue broadcast(s) from rank 0 that this rank had not read"
    unread = [world - 1] if case == "unread" else list(range(1, world))
    for rank, seen in enumerate(results):
        assert any(dropped in s for s in seen) == (rank in unread), (rank, seen)


def _one_way_met_by_a_collective(rank: int, world: int, call: str, gloo_debug: bool) -> list:
    """Rank 0 makes one-way ``call`` (to rank 1, or a queue broadcast) where the
    others reduce; then every rank reduces twice more, a value per step. Returns
    what each call returned (its first element) or raised."""

    group = _queue_group(rank, world, "oneway", gloo_debug)
    x = torch.ones(64)
    one_way = {
        "send": lambda: group.send(x, dst=1),
        "send_object": lambda: group.send_object({"x": 1}, dst=1),
        "send_tensor_dict": lambda: group.send_tensor_dict({"x": x}, dst=1),
        "broadcast_object": lambda: group.broadcast_object({"x": 1}, src=0),
        "broadcast_tensor_dict": lambda: group.broadcast_tensor_dict({"x": x}, src=0),
    }[call]
    seen = _one_way_steps(rank, one_way, group.all_reduce)
    group.destroy()
    return seen


def _one_way_steps(rank: int, one_way: Callable[[], Any], reduce: Callable[[Any], Any]) -> list:
    """Step 1: rank 0 makes ``one_way`` where the others ``reduce``; steps 2 and 3:
    every rank reduces, a value per step. What each call returned (its first
    element) or raised."""
    from shm_broadcast.errors import GroupcoordError

    seen: list = []
    for step in (1, 2, 3):
        try:
            if step == 1 and rank == 0:
                one_way()
                seen.append("one-way")
            else:
                seen.append(reduce(torch.full((64,), float(step)))[0].item())
        except GroupcoordError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def _closed_by_the_one_way_call(results: list, why: str, closed: str) -> None:
    """No rank returned a sum (the only right one, step 1's, is the one-way call's);
    each raised one DesyncError saying ``why`` and ``closed``, then ClosedError."""
    for rank, seen in enumerate(results):
        assert not [v for v in seen if isinstance(v, float)], (rank, seen)
        raised = [v for v in seen if isinstance(v, str) and v.startswith("DesyncError")]
        assert len(raised) == 1 and why in raised[0] and closed in raised[0], (rank, seen)
        after = seen[seen.index(raised[0]) + 1 :]
        assert after and all(v.startswith("ClosedError") for v in after), (rank, seen)


@pytest.mark.parametrize(
    ("call", "world", "gloo_debug"),
    [("send", 2, False), ("send_object", 2, False), ("send_tensor_dict", 2, False),
     ("broadcast_object", 2, False), ("broadcast_object", 3, False),
     ("broadcast_tensor_dict", 2, False), ("broadcast_object", 2, True),
     ("broadcast_tensor_dict", 3, True)],
)  # fmt: skip
def test_a_one_way_call_met_by_a_same_shaped_collective_closes_the_group(call, world, gloo_debug):
    """A send through a shared-memory channel, or a queue broadcast, returns on its
    own: where the others reduced instead, rank 0's next all_reduce met their
    first, and both returned 3.0 where 1.0 and 2.0 were due (world 2), with no
    error (docs/RELIABILITY.md row 85). No stamp field differed: only the message
    sent and not received tells it. Now that call raises DesyncError on every rank
    saying so, the group closes, and every later call raises ClosedError: no rank
    gets a wrong value. (A send over Gloo waits for its receiver: not one-way.)"""
    results = run_ranks(_one_way_met_by_a_collective, world, call, gloo_debug, timeout=60)
    why = "more broadcast(s)" if call.startswith("broadcast") else "had not been received"
    _closed_by_the_one_way_call(results, why, "oneway:0 is closed on every rank")


def _comm_one_way_met_by_a_collective(rank: int, world: int, call: str, gloo: bool) -> list:
    """The same with a ``Comm``: rank 0 sends to rank 1 where the others reduce
    (after one message each way, which opens the pair's rings), then every rank
    reduces twice more. Returns what each call returned (its first element) or
    raised."""
    from coordinator.comm import new_comm, send_object_list
    from shm_broadcast.config import set_config

    if gloo:  # the collectives over Gloo, checked by debug_desync; sends still one-way
        set_config(disable_shm_all_reduce=True, debug_desync=True)
    comm = new_comm("gloo", "cpu", "oneway", timeout=10)
    x = torch.ones(64)
    if call == "async send, pair's first":
        pass  # posted with no ring open yet: it goes to its lane's thread
    elif rank == 0:
        comm.send(x, 1)
    elif rank == 1:
        comm.recv(torch.empty(64), 0)

    posted: list[Any] = []  # works of asynchronous sends not waited for

    def batch() -> None:
        sends = comm.batch_op_create()
        sends.send(x, 1)
        sends.issue()

    one_way = {
        "send": lambda: comm.send(x, 1),
        "async send": lambda: comm.send(x, 1, async_op=True).wait(),
        # Not waited for here: its lane's thread opens the pair's ring meanwhile.
        "async send, pair's first": lambda: posted.append(comm.send(x, 1, async_op=True)),
        "batch": batch,
        "send_object_list": lambda: send_object_list(comm, [{"x": 1}], 1),
    }[call]

    def reduce(total: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(total)
        return total

    seen = _one_way_steps(rank, one_way, reduce)
    for work in posted:  # done before the abort: a ring still being made would be left
        work.wait()
    comm.abort()
    return seen


@pytest.mark.parametrize(
    ("call", "world", "gloo"),
    [("send", 2, False), ("async send", 2, False), ("batch", 3, False),
     ("send_object_list", 2, False), ("send", 2, True), ("async send", 3, True),
     ("async send, pair's first", 2, False), ("async send, pair's first", 2, True)],
)  # fmt: skip
def test_a_comm_send_met_by_a_same_shaped_collective_closes_the_comm(call, world, gloo):
    """A ``Comm``'s sends were not counted (docs/RELIABILITY.md row 87): where the
    others reduced instead, rank 0's next all_reduce met their first and both
    returned 3.0 and 5.0 where 1.0, 2.0 and 3.0 were due, with no error. Now the
    communicator counts its sends and receives as a group does, and the first
    collective after the unreceived send raises DesyncError on every rank and
    closes the comm: no rank gets a wrong value. An asynchronous send still on its
    lane's thread (the pair's first, before its ring is open) was left out of the
    comparison until 2026-11-29, and a Comm sweep (seed 149 over Gloo) returned
    wrong sums: now every send and receive counts when it is posted."""
    results = run_ranks(_comm_one_way_met_by_a_collective, world, call, gloo, timeout=60)
    _closed_by_the_one_way_call(
        results, "had not been received", "communicator 'oneway' is closed on every rank"
    )


def _reduced(comm: Any, total: torch.Tensor) -> float | str:
    """``comm.all_reduce(total)``'s first element, or the error it raised as text."""
    from shm_broadcast.errors import GroupcoordError

    try:
        comm.all_reduce(total)
    except GroupcoordError as exc:
        return f"{type(exc).__name__}: {exc}"
    return total[0].item()


def _comm_send_then_another_collective(rank: int, world: int, gloo: bool) -> list:
    """Rank 0 sends to rank 1 and reduces 16 floats where rank 1 reduces 64; then
    every rank reduces 64 floats. What each call returned (its first element) or
    raised."""
    from coordinator.comm import new_comm
    from shm_broadcast.config import set_config

    if gloo:
        set_config(disable_shm_all_reduce=True, debug_desync=True)
    comm = new_comm("gloo", "cpu", "differ", timeout=10)
    if rank == 0:
        comm.send(torch.ones(8), 1)
    seen = [_reduced(comm, torch.ones(n)) for n in (16 if rank == 0 else 64, 64)]
    comm.abort()
    return seen


@pytest.mark.parametrize("gloo", [False, True])
def test_a_comm_send_met_by_another_collective_closes_the_comm(gloo):
    """An unreceived send closes the comm at the first collective after it whether
    or not the ranks' calls agree there. Over Gloo (debug_desync) a collective
    whose calls differed raised DesyncError and kept the comm, its traffic
    uncompared, until 2026-11-29: a Comm sweep (seed 8 over Gloo) then returned
    sums of two steps from later same-shaped all-reduces."""
    results = run_ranks(_comm_send_then_another_collective, 2, gloo, timeout=60)
    for rank, seen in enumerate(results):
        assert seen[0].startswith("DesyncError"), (rank, seen)
        assert "had not been received" in seen[0] and "closed on every rank" in seen[0], (
            rank,
            seen,
        )
        assert seen[1].startswith("ClosedError"), (rank, seen)


def _comm_receive_that_met_a_collective(rank: int, world: int) -> list:
    """Rank 0 issues a batch (a send to rank 1 and a receive from it) where rank 1
    broadcasts: the batch's receive waits on rank 1, which waits on rank 0 in the
    broadcast, and both raise DesyncError (the receive joined the broadcast, having
    taken nothing). Then both reduce, then rank 0 sends a fresh value that rank 1
    receives. Returns what each call returned or raised."""
    from coordinator.comm import new_comm
    from shm_broadcast.errors import GroupcoordError

    comm = new_comm("gloo", "cpu", "stale", timeout=10)
    seen: list = []
    steps = ["exchange", "all_reduce", "send"]
    for step in steps:
        try:
            if step == "exchange" and rank == 0:
                batch = comm.batch_op_create()
                batch.send(torch.full((4096,), 1.0), 1)
                batch.recv(torch.empty(4096), 1)
                batch.issue()
            elif step == "exchange":
                comm.broadcast(torch.zeros(4096), 0)
            elif step == "all_reduce":
                total = torch.ones(4)
                comm.all_reduce(total)
                seen.append(total[0].item())
                continue
            elif rank == 0:
                comm.send(torch.full((4096,), 3.0), 1)
            else:
                got = torch.empty(4096)
                comm.recv(got, 0)
                seen.append(got[0].item())
                continue
            seen.append(step)
        except GroupcoordError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    comm.abort()
    return seen


def test_a_comm_receive_that_raised_before_anything_came_is_not_counted():
    """The send of a batch whose receive met a collective stays in the pair's
    channel, unreceived: a Comm that counted the receive as it was posted found
    the traffic in balance, and rank 1's next receive returned that stale message
    (1.0) for rank 0's fresh one (3.0), no error (a random sweep of a Comm's
    sends, receives, batches and collectives, docs/RELIABILITY.md row 87). The
    receive, stuck on a peer in a collective, joins it, and that closes the comm
    on both ranks (row 90); a receive that raised before anything came gives its
    count back."""
    results = run_ranks(_comm_receive_that_met_a_collective, 2, timeout=60)
    for rank, seen in enumerate(results):
        assert not [v for v in seen if isinstance(v, float)], (rank, seen)
        assert seen[0].startswith("DesyncError"), (rank, seen)
        assert "communicator 'stale' is closed on every rank" in seen[0], (rank, seen)
        assert all(v.startswith("ClosedError") for v in seen[1:]), (rank, seen)


def _comm_batch_half_matched(rank: int, world: int) -> list:
    """Rank 0 issues a batch (a send to rank 1 and a receive from it) where rank 1
    only receives: rank 1 takes the batch's send and goes on to reduce, twice, while
    the batch's receive waits; rank 1 reduces once more, where rank 0's reduce
    after the batch would meet it. Returns what each call returned (its first
    element) or raised."""
    from coordinator.comm import new_comm
    from shm_broadcast.errors import GroupcoordError

    comm = new_comm("gloo", "cpu", "half", timeout=10)
    seen: list = []
    try:
        if rank == 0:
            batch = comm.batch_op_create()
            batch.send(torch.full((64,), 1.0), 1)
            batch.recv(torch.empty(64), 1)
            batch.issue().wait()
            seen.append("exchanged")
        else:
            got = torch.empty(64)
            comm.recv(got, 0)
            seen.append(got[0].item())
    except GroupcoordError as exc:
        seen.append(f"{type(exc).__name__}: {exc}")
    steps = (2, 3) if rank == 0 else (2, 3, 4)
    seen += [_reduced(comm, torch.full((64,), float(step + rank))) for step in steps]
    comm.abort()
    return seen


def test_a_batch_half_matched_then_stuck_closes_the_comm():
    """Rank 0's batch sends and receives where rank 1 only receives: rank 1 took the
    send and reduced; the batch's receive, waiting on rank 1, joined that reduce and
    both raised DesyncError, the traffic in balance, and the comm stayed usable.
    Rank 0's next reduce then met rank 1's next one, a call further on, and both
    returned the sum of two steps' values with no error (a random sweep of a
    Comm's calls, seed 23). A rank that joins its peers' collective from a one-way
    call it is stuck in now closes the comm (or group) on every rank: which side
    made a call the other did not is not known."""
    results = run_ranks(_comm_batch_half_matched, 2, timeout=60)
    for rank, seen in enumerate(results):
        raised = [v for v in seen if isinstance(v, str) and v.startswith("DesyncError")]
        assert len(raised) == 1 and "waited in a one-way call" in raised[0], (rank, seen)
        assert "closed on every rank" in raised[0], (rank, seen)
        after = seen[seen.index(raised[0]) + 1 :]
        assert after and all(v.startswith("ClosedError") for v in after), (rank, seen)
    assert results[1][0] == 1.0, results  # the receive that took the batch's send


def _sent_from_another_thread(rank: int, world: int, how: str) -> dict:
    """Rank 0's second thread reduces; 0.5 s later its main thread sends rank 1 an
    object (its first one-way call of the group), which rank 1 receives, then
    reduces: a right program whose send falls after rank 0's reduce was stamped."""
    import threading

    from coordinator.comm import new_comm, recv_object_list, send_object_list
    from shm_broadcast.config import set_config

    if how.endswith("over Gloo"):
        set_config(disable_shm_all_reduce=True, debug_desync=True)
    if how.startswith("group"):
        group = _queue_group(rank, world, "late_send", False)
        send = lambda: group.send_object("late", dst=1)  # noqa: E731
        receive = lambda: group.recv_object(src=0)  # noqa: E731
        reduce, close = group.all_reduce, group.destroy
    else:
        comm = new_comm("gloo", "cpu", "late_send", timeout=10)

        def send() -> None:
            send_object_list(comm, ["late"], 1)

        def receive() -> Any:
            got: list = [None]
            recv_object_list(comm, got, 0)
            return got[0]

        def reduce(t: torch.Tensor) -> torch.Tensor:
            comm.all_reduce(t)
            return t

        close = comm.finalize
    sums: list = []
    if rank == 0:
        side = threading.Thread(target=lambda: sums.append(reduce(torch.ones(4)).tolist()))
        side.start()
        time.sleep(0.5)
        send()
        side.join()
        got = "late"
    else:
        got = receive()
        sums.append(reduce(torch.ones(4)).tolist())
    sums.append(reduce(torch.ones(4)).tolist())
    close()
    return {"got": got, "sums": sums}


@pytest.mark.parametrize("how", ["group", "group over Gloo", "comm", "comm over Gloo"])
def test_a_send_made_after_a_collective_on_another_thread_is_no_desync(how):
    """Rank 0 had made no one-way call before, so its reduce's stamp carried no mark
    of another thread's traffic, and rank 1's, which had taken the message, showed
    more taken than sent: the reduce raised DesyncError and closed the group (seen
    when a test of a queue broadcast made from a second thread ran in a fresh
    group). More taken than sent (or read than written) can only come from a call
    made after its sender's stamp, on another thread: the traffic is not compared
    then."""
    for rank, got in enumerate(run_ranks(_sent_from_another_thread, 2, how, timeout=60)):
        assert got == {"got": "late", "sums": [[2.0] * 4] * 2}, (rank, got)


def _writer_in_a_collective(rank: int, world: int, case: str) -> dict:
    """Rank 0 makes a collective while rank 1 (and in "both read", rank 2) waits to
    read a queue broadcast from it; the other ranks make rank 0's collective."""
    import threading

    from shm_broadcast.errors import DesyncError

    group = _queue_group(rank, world, "qstall", False, timeout_s=30.0)
    big = torch.ones(4 << 20)  # 16 MiB: a call of several generations
    reads = {"barrier": [1], "all_reduce": [1], "both read": [1, 2]}[case]
    raised, started = "", time.monotonic()
    try:
        if rank in reads and case == "all_reduce":
            group.broadcast_object(None, src=0)
        elif rank in reads:
            group.broadcast_tensor_dict(None, src=0)
        elif case == "all_reduce":
            group.all_reduce(big)
        else:
            group.barrier()
    except DesyncError as exc:
        raised = str(exc)
    took = time.monotonic() - started
    # A rank waited for a broadcast that the writer did not make: which side made
    # a call the other did not is unknown, so the group is closed on every rank.
    after = _refused(lambda: group.all_reduce(torch.ones(4)))
    group.destroy()
    group = _queue_group(rank, world, "qstall2", False, timeout_s=30.0)
    # A writer with a second thread is waited for: that thread may write yet (here
    # rank 0's main thread writes 1 s after its other thread entered the all_reduce,
    # which rank 1 makes once it has read).
    if rank == 0:
        side = threading.Thread(target=lambda: group.all_reduce(torch.ones(4)))
        side.start()
        time.sleep(1.0)
        group.broadcast_object("late", src=0)
        side.join()
        late = "late"
    else:
        late = group.broadcast_object(None, src=0)
        group.all_reduce(torch.ones(4))
    group.destroy()
    return {"raised": raised, "took": took, "after": after, "late": late}


@pytest.mark.parametrize("case", ["barrier", "all_reduce", "both read"])
def test_a_reader_waiting_on_a_writer_that_waits_for_it_in_a_collective_raises(case):
    """A rank waiting in a queue read while the writer waits for it in a collective
    of the group: both waited until the writer's timeout (300 s by default) and the
    reader then heard only that the writer had died (when it exited). Now every rank
    raises DesyncError naming both calls within about a second, and the group closes
    on every rank: one side made a call the other did not, and same-shaped calls
    after it would pair shifted (until 2026-11-29 the group stayed usable, and a
    random sweep then returned wrong sums; see
    test_a_batch_half_matched_then_stuck_closes_the_comm)."""
    world = 2 if case == "barrier" else 3
    results = run_ranks(_writer_in_a_collective, world, case, timeout=90)
    writer_call = {"barrier": "barrier()", "all_reduce": "all_reduce(float32[4194304], SUM)"}
    read = "broadcast_object" if case == "all_reduce" else "broadcast_tensor_dict"
    for rank, got in enumerate(results):
        assert writer_call.get(case, "barrier()") in got["raised"], (rank, got)
        assert f"{read}(src=0) reading the message queue" in got["raised"], (rank, got)
        assert got["took"] < 10.0, (rank, got)
        assert "waited in a one-way call" in got["raised"], (rank, got)
        assert "closed on every rank" in got["raised"], (rank, got)
        assert "is unusable" in got["after"], (rank, got)
        assert got["late"] == "late", (rank, got)


def _queue_end_left_by_a_gloo_timeout(rank: int, world: int, waiting: str) -> dict:
    """Over Gloo (where no stall check ends a queue wait), one rank makes a
    collective the other does not: the rank in the collective times out after 2 s
    and stays alive; the other waits on the group's queue, as the reader of a
    broadcast rank 0 never makes ("reader") or as rank 0 writing a third broadcast
    into a full queue of two chunks rank 1 never reads ("writer")."""
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import GroupcoordError

    set_config(mq_max_chunks=2)
    group = _queue_group(rank, world, "qgloo", True, timeout_s=2.0)
    in_collective = 0 if waiting == "reader" else 1
    raised, started = "", time.monotonic()
    try:
        if rank == in_collective:
            group.all_reduce(torch.ones(4))
        elif waiting == "reader":
            group.broadcast_object(None, src=0)
        else:
            for step in range(3):
                group.broadcast_object(step, src=0)
    except GroupcoordError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    time.sleep(5.0 if rank == in_collective else 0.0)  # alive well past the other's end
    group.destroy()
    return {"raised": raised, "took": took}


@pytest.mark.parametrize("waiting", ["reader", "writer"])
def test_a_queue_wait_on_a_rank_whose_group_closed_ends_at_once(waiting):
    """A rank whose group closed (here its Gloo collective timed out) shuts its end
    of the group's queue, and a peer waiting on that end raises ClosedError naming
    the group: until 2026-11-29 the peer waited as long as that rank lived (an
    engine that catches the error: for ever), the queue's reads having no deadline."""
    results = run_ranks(_queue_end_left_by_a_gloo_timeout, 2, waiting, timeout=90)
    in_collective = 0 if waiting == "reader" else 1
    for rank, got in enumerate(results):
        if rank == in_collective:
            assert got["raised"].startswith("GroupcoordTimeoutError: qgloo:0: all_reduce"), got
            continue
        assert got["raised"].startswith("ClosedError: qgloo:0: broadcast_object ended"), got
        shut = "the writer shut the queue down" if waiting == "reader" else "rank 1 shut down"
        assert shut in got["raised"], got
        assert got["took"] < 6.0, got  # its peer's timeout (3 s here), not its exit (8 s)


def _readers_in_a_collective(rank: int, world: int) -> dict:
    """Rank 0 broadcasts through a queue of 2 chunks 3 times while rank 1 makes a
    collective instead of reading; at world 3 rank 2 reads all it can."""
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import DesyncError

    set_config(timeout_s=30.0, mq_max_chunks=2)
    init_gloo(rank, world)
    group = GroupCoordinator(
        [list(range(world))], rank, "gloo", True, use_message_queue_broadcaster=True,
        group_name="wstall",
    )  # fmt: skip
    raised, read, started = "", [], time.monotonic()
    try:
        if rank == 0:
            for step in range(3):  # the third waits for rank 1 to free a chunk
                group.broadcast_tensor_dict({"step": step, "t": torch.ones(8)}, src=0)
        elif rank == 1:
            group.all_reduce(torch.ones(4))
        else:
            for _ in range(3):  # reads two; waits for the third, never written
                read.append(group.broadcast_tensor_dict(None, src=0)["step"])
    except DesyncError as exc:
        raised = str(exc)
    took = time.monotonic() - started
    # The ranks' calls are whole calls apart: the group is closed.
    after = _refused(lambda: group.broadcast_tensor_dict({"step": 9} if rank == 0 else None, src=0))
    group.destroy()
    return {"raised": raised, "took": took, "read": read, "after": after}


@pytest.mark.parametrize("world", [2, 3])
def test_a_writer_waiting_on_readers_that_wait_for_it_in_a_collective_raises(world):
    """The writer's queue full of broadcasts rank 1 made a collective instead of
    reading: rank 1 waited for rank 0 in the collective until its timeout and rank 0
    for a free chunk as long as rank 1 lived. Now every rank raises DesyncError
    naming both within about a second, and rank 1 drops the two broadcasts it never
    read. Rank 0 had made two broadcasts that rank 1 did not, so the ranks' calls
    are whole calls apart: the group closes on every rank (see
    test_a_queue_broadcast_met_by_another_call_closes_the_group_on_every_rank)."""
    results = run_ranks(_readers_in_a_collective, world, timeout=90)
    writing = "broadcast_tensor_dict(src=0) writing the message queue"
    for rank, got in enumerate(results):
        assert writing in got["raised"], (rank, got)
        # Rank 2, which waits to read, names rank 0, the first call unlike its own.
        other = "reading the message queue" if rank == 2 else "all_reduce(float32[4], SUM)"
        assert other in got["raised"], (rank, got)
        dropped = "2 message-queue broadcast(s) from rank 0 that this rank had not read"
        assert (dropped in got["raised"]) == (rank == 1), (rank, got["raised"])
        assert got["took"] < 10.0, (rank, got)
        assert "closed on every rank" in got["raised"], (rank, got)
        assert "unusable after an earlier failure" in got["after"], (rank, got)
    if world == 3:
        assert results[2]["read"] == [0, 1], results[2]


def _receiver_while_sender_in_a_collective(rank: int, world: int, call: str, opened: bool) -> dict:
    """Rank 0 waits to receive from rank 1, which makes a barrier instead of sending;
    with ``opened`` the pair's channel carried a message before (the wait is then in
    the channel's read, else in waiting for the sender to open it)."""
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import DesyncError

    set_config(timeout_s=30.0)
    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="pstall")
    receive = {
        "recv_tensor_dict": lambda: group.recv_tensor_dict(src=1)["x"],
        "recv_object": lambda: group.recv_object(src=1),
        "recv": lambda: group.recv(torch.Size([3]), torch.float32, src=1),
    }[call]
    send = {
        "recv_tensor_dict": lambda v: group.send_tensor_dict({"x": v}, dst=0),
        "recv_object": lambda v: group.send_object(v, dst=0),
        "recv": lambda v: group.send(v, dst=0),
    }[call]
    value = torch.arange(3.0) if call != "recv_object" else [1, 2, 3]
    if opened:
        if rank == 1:
            send(value)
        else:
            receive()
    raised, started = "", time.monotonic()
    try:
        if rank == 0:
            receive()
        else:
            group.barrier()
    except DesyncError as exc:
        raised = str(exc)
    took = time.monotonic() - started
    # Closed on both ranks: the next send or receive raises at once.
    after = _refused(lambda: send(value) if rank == 1 else receive())
    group.destroy()
    return {"raised": raised, "took": took, "after": after}


@pytest.mark.parametrize(
    ("call", "opened"),
    [
        ("recv_tensor_dict", False),
        ("recv_tensor_dict", True),
        ("recv_object", True),
        ("recv", True),
    ],
)
def test_a_receiver_waiting_on_a_sender_that_waits_for_it_in_a_collective_raises(call, opened):
    """A rank waiting to receive from a peer that waits for it in a barrier of the
    group: both waited until the timeout. Now both raise DesyncError naming both
    calls at once, and the group closes on both (a send too few or a receive too
    many: the ranks' calls after it would pair shifted)."""
    results = run_ranks(_receiver_while_sender_in_a_collective, 2, call, opened, timeout=90)
    for rank, got in enumerate(results):
        assert f"{call}(src=1) waiting on its shared-memory channel" in got["raised"], (rank, got)
        assert "barrier()" in got["raised"], (rank, got)
        assert got["took"] < 10.0, (rank, got)
        assert "waited in a one-way call" in got["raised"], (rank, got)
        assert "is unusable" in got["after"], (rank, got)


def _sender_while_receiver_in_a_collective(rank: int, world: int, call: str, where: str) -> dict:
    """Rank 0 sends to rank 1 until the pair's channel is full, while rank 1 makes a
    barrier instead of receiving (of the same group, or of another: ``where``); then
    rank 1 receives what was sent, and one more (``where`` another group: the
    same group's barrier met sends not received, and closed it)."""
    from shm_broadcast.errors import DesyncError

    group, other = _two_groups(rank, world, ("sstall", "sworld"), 30.0)
    barrier = group.barrier if where == "same group" else other.barrier
    send = {
        "send_tensor_dict": lambda i: group.send_tensor_dict({"i": torch.full((4,), i)}, dst=1),
        "send_object": lambda i: group.send_object({"i": i}, dst=1),
        "send": lambda i: group.send(torch.full((4,), float(i)), dst=1),
    }[call]
    receive = {
        "send_tensor_dict": lambda: int(group.recv_tensor_dict(src=0)["i"][0]),
        "send_object": lambda: group.recv_object(src=0)["i"],
        "send": lambda: int(group.recv(torch.Size([4]), torch.float32, src=0)[0]),
    }[call]
    raised, sent, started = "", 0, time.monotonic()
    try:
        if rank == 0:
            for i in range(1000):  # more messages than the ring has chunks
                send(i)
                sent += 1
        else:
            barrier()
    except DesyncError as exc:
        raised = str(exc)
    took = time.monotonic() - started
    # The group whose barrier met the sends closed on both ranks: the same group's
    # (sends not received), or the other's (a call of one group in place of one
    # of the other's, since these ranks have two).
    closed, kept = (group, other) if where == "same group" else (other, group)
    after = _refused(lambda: closed.all_reduce(torch.ones(2)))
    got: list[int] = list(range(sent))
    if where == "other group" and rank == 0:
        send(-1)  # the last one, after every message a send returned for
    elif where == "other group":
        got = []
        while (i := receive()) != -1:
            got.append(i)
    n = int(kept.all_reduce(torch.tensor([float(sent)])).item())  # rank 0's count
    total = kept.all_reduce(torch.ones(2)).tolist()
    group.destroy()
    other.destroy()
    in_order = where == "same group" or got == list(range(n))  # (nothing received there)
    return {"raised": raised, "took": took, "sent": n, "in order": in_order,
            "after": after, "sum": total}  # fmt: skip


@pytest.mark.parametrize("where", ["same group", "other group"])
@pytest.mark.parametrize("call", ["send_tensor_dict", "send_object", "send"])
def test_a_sender_waiting_for_room_on_a_receiver_in_a_collective_raises(call, where):
    """A rank whose sends filled the pair's channel while the receiver waits for it
    in a barrier (of the group, or of another group of both ranks: a pipeline stage
    already at the world group's shut-down barrier): the next send waited for room
    until the timeout. Now, before any of that call is written, both raise
    DesyncError naming both calls, and the group of the barrier closes on both
    ranks, saying why. The same group's barrier met sends not received, which its
    ranks cannot tell from sends made in place of its calls (docs/RELIABILITY.md
    row 85); another group's was met by a call of this one (row 86), and the sends
    that returned are then received after it, in order, and this group reduces."""
    results = run_ranks(_sender_while_receiver_in_a_collective, 2, call, where, timeout=90)
    for rank, got in enumerate(results):
        assert f"{call}(dst=1) waiting for room in its shared-memory channel" in got["raised"], (
            rank,
            got,
        )
        assert "barrier()" in got["raised"], (rank, got)
        assert got["took"] < 10.0, (rank, got)
        assert 0 < got["sent"] < 1000 and got["in order"], (rank, got)
        assert "closed on every rank" in got["raised"], (rank, got)
        assert "is unusable" in got["after"] and got["sum"] == [2.0, 2.0], (rank, got)
        if where == "same group":
            closing = f"{got['sent']} point-to-point message(s) sent in the group had not been"
            assert closing in got["raised"], (rank, got)


def _late_stall_check(rank: int, world: int, case: str) -> dict:
    """Rank 1 waits for what rank 0 sends (a message, or a queue broadcast), then
    both make a barrier. Rank 1's stall check is slowed down by a second, as a
    preempted process's would be between its wait's test and the check: rank 0 has
    sent and fallen asleep in the barrier by the time it looks."""
    group = _queue_group(rank, world, "late", False)
    if case == "open channel" and rank == 0:  # the first message opens the pair's ring
        group.send_object("opening", dst=1)
    elif case == "open channel":
        group.recv_object(src=0)
    seen = ""
    if rank == 0:
        time.sleep(0.3)  # rank 1 is waiting by now
        if case == "queue":
            group.broadcast_object("step", src=0)
        else:
            group.send_object("step", dst=1)
    else:
        channels = group.device_communicator.p2p_channels
        if case == "queue":
            check = group._queue_checks["broadcast_object"]

            def late_queue(peers: list[int], ready: Any) -> None:
                time.sleep(1.0)
                check(peers, ready)

            group._queue_checks["broadcast_object"] = late_queue
            seen = group.broadcast_object(None, src=0)
        else:
            check_channel = channels.stall_check

            def late(operation: str, peers: list[int], writing: bool, ready: Any) -> None:
                time.sleep(1.0)
                check_channel(operation, peers, writing, ready)

            channels.stall_check = late
            seen = group.recv_object(src=0)
    group.barrier()
    total = group.all_reduce(torch.ones(2)).tolist()
    group.destroy()
    return {"seen": seen, "sum": total}


@pytest.mark.parametrize("case", ["first message", "open channel", "queue"])
def test_a_wait_whose_peer_sent_before_its_barrier_is_no_desync(case):
    """Until 2026-11-29 a receive (or a queue read) whose stall check ran after
    its sender had sent and gone to sleep in the group's next barrier took the
    sender for one waiting on it there: it joined the barrier and both ranks
    raised DesyncError on a right program (seen once in the full suite, TP 2 x
    PP 2 sending slices, under load). The check now asks the wait's own test once
    more after it saw the peer waiting, and the receive returns what came."""
    results = run_ranks(_late_stall_check, 2, case, timeout=60)
    assert results[1]["seen"] == "step", results
    assert all(r["sum"] == [2.0, 2.0] for r in results), results


def _two_groups(rank: int, world: int, names: tuple[str, str], timeout_s: float) -> tuple:
    """Two groups of every rank, named ``names``, after ``set_config(timeout_s=)``."""
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config

    set_config(timeout_s=timeout_s)
    init_gloo(rank, world)
    ranks = [list(range(world))]
    return tuple(GroupCoordinator(ranks, rank, "gloo", True, group_name=n) for n in names)


def _crossed_groups(rank: int, world: int, names: tuple[str, str]) -> dict:
    """Groups ``a`` and ``b`` of every rank: rank 1 makes b's barrier, the others a's
    all_reduce; then each rank makes an all_reduce on each group."""
    from shm_broadcast.errors import GroupcoordError

    a, b = _two_groups(rank, world, names, 30.0)
    started = time.monotonic()
    try:
        if rank == 1:
            b.barrier()
        else:
            a.all_reduce(torch.ones(4))
        raised = "returned"
    except GroupcoordError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    after = {}
    for name, group in (("a", a), ("b", b)):
        try:
            after[name] = group.all_reduce(torch.ones(2)).tolist()
        except GroupcoordError as exc:
            after[name] = f"{type(exc).__name__}: {exc}"
    a.destroy()
    b.destroy()
    return {"raised": raised, "took": took, "after": after}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("a_first", [True, False], ids=["a-sorts-first", "b-sorts-first"])
def test_ranks_waiting_for_each_other_in_two_groups_raise_naming_both(world, a_first):
    """Rank 1 in group b's barrier, the others in group a's all_reduce: each waited
    for the other until the timeout. Now the ranks waiting in the group whose name
    sorts first join the other group's call: that group raises DesyncError on every
    rank and closes (its ranks have another group, where a call made in place of
    one of its own leaves its calls a whole call apart), and the joiners raise
    CrossedCallsError, which closes the group they waited in on their ranks (its
    other ranks then hear they left)."""
    names = ("xa", "xb") if a_first else ("xb", "xa")
    results = run_ranks(_crossed_groups, world, names, timeout=90)
    waiters = [1] if not a_first else [r for r in range(world) if r != 1]
    joined, kept = ("b", "a") if a_first else ("a", "b")  # the group the waiters joined
    for rank, got in enumerate(results):
        assert got["took"] < 10.0, (rank, got)
        if rank in waiters:
            assert got["raised"].startswith("CrossedCallsError: "), (rank, got)
            assert "in different orders" in got["raised"], (rank, got)
            assert got["after"][kept].startswith("ClosedError: "), (rank, got)
        else:
            assert got["raised"].startswith("DesyncError: "), (rank, got)
            assert got["after"][kept].startswith("PeerLeftError: "), (rank, got)
        assert "barrier()" in got["raised"] and "all_reduce(float32[4]" in got["raised"], got
        assert "in another group, waiting there for a rank of this one" in got["raised"], got
        assert got["after"][joined].startswith("ClosedError: "), (rank, got)
        assert "closed on every rank" in got["after"][joined], (rank, got)


def _crossed_with_a_thread(rank: int, world: int) -> str:
    """Rank 0 in group xa's all_reduce (timeout 3 s), rank 1 in group xb's barrier
    with a second thread (so neither side may act on the crossing; timeout 20 s)."""
    import threading

    from shm_broadcast.errors import GroupcoordError

    a, b = _two_groups(rank, world, ("xa", "xb"), 3.0 if rank == 0 else 20.0)
    idle = threading.Event()
    side = threading.Thread(target=idle.wait, name="side")
    side.start()
    try:
        if rank == 0:
            a.all_reduce(torch.ones(4))
        else:
            b.barrier()
        return "returned"
    except GroupcoordError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        idle.set()
        side.join()


def test_a_timeout_names_the_call_of_another_group_its_peer_waits_in():
    """Where the crossing cannot be acted on (a process with a second thread), the
    wait ends at its timeout as before, and the error says where the peer waits."""
    got = run_ranks(_crossed_with_a_thread, 2, timeout=90)[0]
    assert got.startswith("GroupcoordTimeoutError: xa:0: all_reduce timed out after 3 s"), got
    assert "rank 1 waits for this rank in xb:0's barrier() (raised only now: " in got, got
    # Both processes run a second thread; the error names this one's and the fix.
    assert "this process's thread(s) ['side']" in got, got
    assert "rank 1's process's other thread(s) could still make a call" in got, got
    assert "declare_bystander_thread()" in got, got


def _crossed_beside_a_thread(rank: int, world: int, how: str) -> dict:
    """Rank 0 in group xa's all_reduce, rank 1 in group xb's barrier, each process
    with another thread: a declared bystander blocked on an event, or a Comm's
    lane thread left idle by an asynchronous all_reduce."""
    import threading

    from coordinator import comm_from_group
    from shm_broadcast import declare_bystander_thread
    from shm_broadcast.errors import GroupcoordError

    a, b = _two_groups(rank, world, ("xa", "xb"), 20.0)
    done, declared = threading.Event(), threading.Event()

    def bystander() -> None:
        declare_bystander_thread()
        declared.set()
        done.wait()

    side = threading.Thread(target=bystander, name="death-monitor")
    comm = None
    if how == "bystander":
        side.start()
        declared.wait()
    else:
        comm = comm_from_group(a)
        comm.all_reduce(torch.ones(2), async_op=True).wait()
    threads = sorted(t.name for t in threading.enumerate())
    started = time.monotonic()
    try:
        if rank == 0:
            a.all_reduce(torch.ones(4))
        else:
            b.barrier()
        raised = "returned"
    except GroupcoordError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    done.set()
    if side.is_alive():
        side.join()
    if comm is not None:
        comm.finalize()
    a.destroy()
    b.destroy()
    return {"raised": raised, "took": took, "threads": threads}


@pytest.mark.parametrize("how", ["bystander", "idle lane"])
def test_ranks_crossed_beside_a_thread_that_makes_no_calls_raise(how):
    """A second thread used to keep every such wait to its timeout, since it might
    make the call that frees it. A thread declared with declare_bystander_thread (an
    engine worker's death monitor) and a Comm's lane with nothing queued cannot,
    so the crossing raises as in a one-thread process."""
    results = run_ranks(_crossed_beside_a_thread, 2, how, timeout=90)
    for rank, got in enumerate(results):
        assert len(got["threads"]) == 2, (rank, got)
        assert got["took"] < 10.0, (rank, got)
        want = "CrossedCallsError: " if rank == 0 else "DesyncError: "
        assert got["raised"].startswith(want), (rank, got)
        assert "barrier()" in got["raised"] and "all_reduce(float32[4]" in got["raised"], got


def _who_may_call() -> dict:
    """only_caller() from the main thread beside a blocked thread, declared or not;
    then after the declared thread itself waits in a call (asks only_caller)."""
    import logging
    import threading

    from shm_broadcast import declare_bystander_thread
    from shm_broadcast.threads import only_caller

    got: dict = {"alone": only_caller()}
    done = threading.Event()
    side = threading.Thread(target=done.wait)
    side.start()
    got["beside an undeclared thread"] = only_caller()
    declare_bystander_thread(side)
    got["beside a bystander"] = only_caller()
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("groupcoord.shm_broadcast").addHandler(handler)
    asked = threading.Thread(target=only_caller, name="calls-after-all")
    declare_bystander_thread(asked)
    asked.start()
    asked.join()
    got["warned"] = warnings
    got["beside it, after it called"] = only_caller()
    with pytest.raises(TypeError, match="threading.Thread"):
        declare_bystander_thread(42)  # type: ignore[arg-type]
    done.set()
    side.join()
    return got


def test_a_bystander_thread_that_makes_a_call_counts_as_a_caller_again():
    got = run_ranks(lambda rank, world: _who_may_call(), 1, timeout=60)[0]
    assert got["alone"] and not got["beside an undeclared thread"], got
    assert got["beside a bystander"], got
    assert len(got["warned"]) == 1 and "'calls-after-all' was declared" in got["warned"][0], got
    # The thread that called has ended; the first bystander still counts as one.
    assert got["beside it, after it called"], got


def _driver_in_the_world_barrier(rank: int, world: int) -> dict:
    """An engine's shut-down gone wrong: rank 0 (the driver) makes the world group's
    barrier while the workers wait for its next step in the TP group's queue."""
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import DesyncError

    set_config(timeout_s=30.0)
    init_gloo(rank, world)
    ranks = [list(range(world))]
    world_group = GroupCoordinator(ranks, rank, "gloo", True, group_name="wworld")
    tp = GroupCoordinator(
        ranks, rank, "gloo", True, use_message_queue_broadcaster=True, group_name="wtp"
    )
    started, raised = time.monotonic(), ""
    try:
        if rank == 0:
            world_group.barrier()
        else:
            tp.broadcast_tensor_dict(None, src=0)
    except DesyncError as exc:
        raised = str(exc)
    took = time.monotonic() - started
    step = tp.broadcast_tensor_dict({"step": 7} if rank == 0 else None, src=0)["step"]
    total = tp.all_reduce(torch.ones(2)).tolist()
    closed = _refused(lambda: world_group.all_reduce(torch.ones(2)))
    tp.destroy()
    world_group.destroy()
    return {"raised": raised, "took": took, "step": step, "sum": total, "closed": closed}


@pytest.mark.parametrize("world", [2, 3])
def test_a_reader_waiting_on_a_writer_in_another_groups_collective_raises(world):
    """Until 2026-11-29 the driver's barrier timed out (300 s by default) and the
    workers heard only that it died. Now the workers join the world group's barrier
    as their queue read: every rank raises DesyncError naming both calls. The TP
    group stays usable (nothing of it was read); the world group closes on every
    rank, since a call of another group made in place of one of its own leaves
    its calls a whole call apart (row 86 of docs/RELIABILITY.md)."""
    results = run_ranks(_driver_in_the_world_barrier, world, timeout=90)
    for rank, got in enumerate(results):
        assert "wworld:0" in got["raised"] and "barrier()" in got["raised"], (rank, got)
        assert "broadcast_tensor_dict(src=0) reading the message queue" in got["raised"], got
        assert "wworld:0 is closed on every rank" in got["raised"], (rank, got)
        assert got["took"] < 10.0, (rank, got)
        assert got["step"] == 7 and got["sum"] == [float(world)] * 2, (rank, got)
        assert "is unusable" in got["closed"], (rank, got)


def _asleep_word_between_sleeps(rank: int, world: int) -> dict:
    """Rank 0's view of a world-2 control region in which rank 1 never arrives."""
    from device_communicators.shm_phases import PhaseLines
    from shm_broadcast.errors import GroupcoordTimeoutError

    region = memoryview(bytearray(PhaseLines.nbytes(2)))
    lines = PhaseLines(region, [0, 1], 0, "unit", 0.3, 0.1)
    lines.register_self()
    lines.read_peers()
    before = lines.waits_alone_at(0, 1)
    lines._counters[0] = 1  # published phase 1; between two sleeps of its wait:
    lines._sleep(1, 0.001)
    between = lines.waits_alone_at(0, 1)
    try:
        lines.arrive(1)  # the whole wait, until the 0.3 s timeout
        timed_out = False
    except GroupcoordTimeoutError:
        timed_out = True
    after = lines.waits_alone_at(0, 1)
    lines.release()
    return {"before": before, "between": between, "timed_out": timed_out, "after": after}


def test_a_waiting_rank_shows_it_waits_alone_between_its_sleeps_too():
    """The mark stays set from a wait's first sleep to its end. When it was cleared
    at every wake-up, a reader whose checks kept time with the writer's wake-ups
    (both every peer_check_interval_s from about the same start) found the writer
    awake at each one: a queue stall took 29 s to be found instead of 0.05 s."""
    got = run_ranks(_asleep_word_between_sleeps, 1, timeout=60)[0]
    assert got == {"before": False, "between": True, "timed_out": True, "after": False}, got


def _released_peer_makes_the_same_call(rank: int, world: int) -> str:
    """Rank 0 in ya's all_reduce, rank 1 in yb's barrier; rank 0 (ya sorts first)
    joins yb and is slowed by 0.5 s after the join. Rank 1, released by the join's
    DesyncError, at once makes the very all_reduce rank 0 was waiting in."""
    from shm_broadcast.errors import DesyncError, GroupcoordError

    a, b = _two_groups(rank, world, ("ya", "yb"), 30.0)
    shm_b = b.device_communicator.shm_all_reduce
    join = shm_b._empty_barrier

    def slow_join(lines: object) -> None:
        try:
            join(lines)
        finally:
            time.sleep(0.5)

    shm_b._empty_barrier = slow_join
    first = ""
    try:
        if rank == 0:
            a.all_reduce(torch.ones(4))
            return "returned"
        try:
            b.barrier()
        except DesyncError as exc:  # the join; then the call rank 0 waited in
            first = f"{type(exc).__name__}, then "
        return f"{first}returned {a.all_reduce(torch.ones(4)).tolist()}"
    except GroupcoordError as exc:
        return f"{first}{type(exc).__name__}"
    finally:
        a.destroy()
        b.destroy()


def test_a_crossed_call_leaves_its_group_before_its_peer_is_released():
    """Rank 1's next call in ya must not meet rank 0's abandoned all_reduce there:
    with rank 0 leaving ya only after its join of yb, rank 1's same all_reduce passed
    the barrier on rank 0's stamp and returned a sum that rank 0 reported failed."""
    assert run_ranks(_released_peer_makes_the_same_call, 2, timeout=90) == [
        "CrossedCallsError",
        "DesyncError, then PeerLeftError",
    ]


def _object_call_meets_a_tensor_dict(rank: int, world: int, p2p: str, shm: bool) -> list[str]:
    """The last rank broadcasts (``p2p``: rank 0 sends to rank 1) a tensor dict with a
    tensor too large to ride in its message, where the others receive an object
    (``p2p`` "tensor": a tensor of that tensor's size and dtype); then every rank
    reduces values that change by call, and receives the next message."""
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import GroupcoordError

    set_config(timeout_s=10.0, disable_shm_p2p=not shm)
    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="odict")
    big = {"x": torch.arange(100_000.0), "k": 1}  # 400 KB: sent after the message
    last = world - 1
    if p2p:  # rank 0 sends, rank 1 receives
        sends = rank == 0
        receive = {
            "object": lambda: group.recv_object(src=0),
            "tensor": lambda: group.recv((100_000,), torch.float32, src=0),
        }[p2p]
        calls = [
            (lambda: group.send_tensor_dict(big, dst=1)) if sends else receive,
            (lambda: group.send_object("next", dst=1))
            if sends
            else (lambda: group.recv_object(src=0)),
        ]
    else:
        calls = [
            (lambda: group.broadcast_tensor_dict(big, src=last))
            if rank == last
            else (lambda: group.broadcast_object(None, src=last)),
            lambda: group.broadcast_object("next" if rank == 0 else None, src=0),
        ]
    reduces = [lambda v=v: group.all_reduce(torch.full((4,), v)) for v in (1.0, 2.0)]
    seen = []
    for call in [calls[0], *reduces, calls[1]]:
        try:
            got = call()
            shown = type(got).__name__ if isinstance(got, dict) else got
            seen.append(f"ret {got.tolist() if isinstance(got, torch.Tensor) else shown}")
        except GroupcoordError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    group.destroy()
    return seen


@pytest.mark.parametrize(
    ("p2p", "shm"),
    [("", True), ("object", True), ("object", False), ("tensor", True), ("tensor", False)],
    ids=["broadcast", "recv_object", "recv_object-gloo", "recv", "recv-gloo"],
)
def test_a_receive_that_meets_a_tensor_dict_takes_its_tensors_and_stays_in_step(p2p, shm):
    """A ``broadcast_object`` (``recv_object``, ``recv``) that got a tensor dict's
    message raised DesyncError and left the dict's large tensors, sent after the
    message, to the rank's next calls: the broadcast's source was then a whole call
    ahead (its all_reduce of 1.0 met the others' broadcast of the tensor, and its
    all_reduce of 2.0 their 1.0, returning [4.0] * 4 at world 3 with no error); the
    pair's next receive took the tensor, and every receive after got the message
    before its own. Now the receiver takes those tensors before it raises, and
    every later call is right."""
    world = 2 if p2p else 3
    results = run_ranks(_object_call_meets_a_tensor_dict, world, p2p, shm, timeout=60)
    for rank, seen in enumerate(results):
        receiver = rank != world - 1 if not p2p else rank == 1
        first = seen[0]
        if receiver:
            assert first.startswith("DesyncError"), (rank, seen)
            if p2p != "tensor":  # a tensor receive names the list or bytes that came
                assert "sent a tensor dict" in first, (rank, seen)
        else:
            assert first.startswith("ret"), (rank, seen)
        sums = [f"ret {[world * s] * 4}" for s in (1.0, 2.0)]
        sent_last = p2p and rank == 0  # send_object returns None
        assert seen[1:] == [*sums, "ret None" if sent_last else "ret next"], (rank, seen)
