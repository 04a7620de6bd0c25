"""The lean path of small calls (device_communicators.shm_small) on real forked ranks:
the same results and protocol as the general path, and everything else left to it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.errors import ClosedError, DesyncError
from coordinator.launch import init_gloo, run_ranks


def _group(rank: int, world: int, name: str) -> Any:
    import torch.distributed as dist

    from coordinator.group_coordinator import GroupCoordinator

    if not dist.is_initialized():
        init_gloo(rank, world)
    return GroupCoordinator([list(range(world))], rank, "gloo", True, group_name=name)


def _no_general_path(*args: object) -> None:
    raise AssertionError("a small call left the lean path")


def _lean_small_sums(rank: int, world: int) -> bool:
    group = _group(rank, world, "lean")
    try:
        shm = group.device_communicator.shm_all_reduce
        eager, group._all_reduce_eager = group._all_reduce_eager, _no_general_path
        total = sum(range(1, world + 1))
        threads = torch.get_num_threads()
        for x in (
            torch.full((1024,), rank + 1.0),
            torch.full((3, 4), rank + 1, dtype=torch.int64).t(),
            torch.tensor(rank + 1.0, dtype=torch.bfloat16),
            torch.full((7,), rank + 1.0, dtype=torch.float64),
            torch.full((16384,), rank + 1.0),  # 64 KiB
            torch.full((32767,), rank + 1, dtype=torch.int64),  # 256 KiB: the largest piece
            # As many elements as torch splits over its pool: summed on one thread.
            torch.full((65536,), rank + 1.0),
            torch.full((65536,), rank + 1.0, dtype=torch.bfloat16),
            torch.full((256, 256), rank + 1.0).t(),
            torch.full((32767,), rank + 1.0, dtype=torch.bfloat16),  # one under torch's grain
            torch.full((4,), rank + 1 + 1j, dtype=torch.complex64),
        ):
            before = shm.generation
            got = group.all_reduce(x)
            assert shm.generation == before + 1, "one generation, one barrier"
            want = (
                torch.full_like(x, total)
                if not x.is_complex()
                else torch.full_like(x, total + world * 1j)
            )
            assert torch.equal(got, want) and got.shape == x.shape
            assert torch.get_num_threads() == threads, "the pool's size is given back"
        # Bools sum as "or", as on Gloo.
        flags = torch.tensor([rank == 0, False, True])
        assert group.all_reduce(flags).tolist() == [True, False, True]
        # Not small or not a plain tensor: the general path.
        group._all_reduce_eager = eager
        big = group.all_reduce(torch.ones(65537))  # over 256 KiB
        assert torch.equal(big, torch.full((65537,), float(world)))
        with pytest.raises(TypeError, match="input_ must be a torch.Tensor"):
            group.all_reduce([1.0, 2.0])
        return True
    finally:
        group.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_small_sums_take_the_lean_path_and_others_the_general_one(world: int) -> None:
    assert run_ranks(_lean_small_sums, world, timeout=60) == [True] * world


def _rank_tensor(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) * (rank + 2) + rank).to(dtype).view(shape)


# (shape, dim, dtype, strided): an engine's shapes, every shm dtype, views with odd strides.
_CASES = [
    ((1024,), 0, torch.float32, False),
    ((1024,), -1, torch.float32, False),
    ((6, 12), -1, torch.float32, False),
    ((6, 12), 0, torch.bfloat16, False),
    ((2, 6, 4), 1, torch.float16, False),
    ((12, 6), 0, torch.int64, True),  # a transposed view: copied with copy_, not memmove
    ((6, 12), 1, torch.int32, True),
    ((6,), 0, torch.float64, False),
    # Gathered results of torch's grain and more, joined by memmove (blocks of the result).
    ((8192,), 0, torch.bfloat16, False),
    ((1, 8192), 1, torch.float16, False),
    # 128-192 KiB: a reduce-scatter sums this rank's part only, under torch's grain.
    ((16384,), 0, torch.float32, False),
]


def _tensor_for(rank: int, shape: tuple[int, ...], dtype: torch.dtype, strided: bool) -> Any:
    if strided:
        return _rank_tensor(rank, shape[::-1], dtype).t()
    return _rank_tensor(rank, shape, dtype)


def _lean_gathers_and_scatters(rank: int, world: int) -> bool:
    group = _group(rank, world, "lean-ag-rs")
    try:
        shm = group.device_communicator.shm_all_reduce
        ag, group._all_gather_eager = group._all_gather_eager, _no_general_path
        rs, group._reduce_scatter_eager = group._reduce_scatter_eager, _no_general_path
        for shape, dim, dtype, strided in _CASES:
            shape = tuple(s * world if i == (dim % len(shape)) else s for i, s in enumerate(shape))
            x = _tensor_for(rank, shape, dtype, strided)
            everyone = [_tensor_for(r, shape, dtype, strided) for r in range(world)]
            before = shm.generation
            got = group.all_gather(x, dim)
            assert shm.generation == before + 1, "one generation, one barrier"
            want = torch.cat(everyone, dim)
            assert got.is_contiguous() and got.dtype == dtype
            assert torch.equal(got, want), (shape, dim, dtype)
            plan = group._small._plans[1][(dtype, x.shape, dim)]
            assert (plan.blocks is not None) == (x.numel() * world >= 32768), shape
            before = shm.generation
            got = group.reduce_scatter(x, dim)
            assert shm.generation == before + 1
            wide = dtype in (torch.float16, torch.bfloat16)
            total = everyone[0].float() if wide else everyone[0].clone()
            for t in everyone[1:]:
                total = total + (t.float() if wide else t)
            want = total.to(dtype).chunk(world, dim)[rank]
            assert got.is_contiguous() and got.dtype == dtype
            assert torch.equal(got, want), (shape, dim, dtype)
        # What the lean path does not take goes the general way, which checks it.
        group._all_gather_eager, group._reduce_scatter_eager = ag, rs
        with pytest.raises(ValueError, match="dim=1 is out of range"):
            group.all_gather(torch.ones(4), 1)
        with pytest.raises(TypeError, match="dim must be an int"):
            group.reduce_scatter(torch.ones(4), "0")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="not divisible"):
            group.reduce_scatter(torch.ones(world * 2 + 1), 0)
        big = torch.full((65537,), float(rank))  # over 256 KiB: the general path
        assert torch.equal(
            group.all_gather(big, 0).view(world, -1)[:, 0], torch.arange(float(world))
        )
        # The group is in step after the refusals: a lean call still agrees everywhere.
        assert torch.equal(group.all_gather(torch.tensor([rank]), 0), torch.arange(world))
        return True
    finally:
        group.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_small_gathers_and_scatters_take_the_lean_path_with_exact_results(world: int) -> None:
    assert run_ranks(_lean_gathers_and_scatters, world, timeout=60) == [True] * world


def _mixed_paths(rank: int, world: int) -> list[str]:
    group = _group(rank, world, "lean-mixed")
    try:
        x = torch.arange(8.0) + 100 * rank
        # Rank 0 takes the lean path, the others the general one: one protocol.
        if rank == 0:
            got = group.all_gather(x, 0)
            summed = group.reduce_scatter(x, 0)
        else:
            got = group._all_gather_eager(x, 0)
            summed = group._reduce_scatter_eager(x, 0)
        assert torch.equal(got, torch.cat([torch.arange(8.0) + 100 * r for r in range(world)]))
        full = sum(torch.arange(8.0) + 100 * r for r in range(world))
        assert torch.equal(summed, full.chunk(world)[rank])
    finally:
        group.destroy()
    # A lean rank that disagrees with a general one is told so, naming both sides;
    # the group then closes on every rank (a group for each mismatch).
    errors = []
    mine = torch.ones(1024 if rank == 0 else 65537)  # 4 KiB lean, over 256 KiB general
    # world x 40000 floats: 312 KiB, over the lean path's 256 KiB at world 2.
    rows = torch.ones(world * (256 if rank == 0 else 40000))
    for i, call in enumerate(
        (lambda g: g.all_gather(mine, 0), lambda g: g.reduce_scatter(rows, 0))
    ):
        group = _group(rank, world, f"lean-mixed{i}")
        try:
            with pytest.raises(DesyncError) as caught:
                call(group)
            errors.append(str(caught.value))
            with pytest.raises(ClosedError, match="is closed on every rank"):
                group.all_reduce(torch.ones(3))
        finally:
            group.destroy()
    return errors


def test_lean_and_general_ranks_meet_and_disagreements_name_both_sides() -> None:
    for errors in run_ranks(_mixed_paths, 2, timeout=60):
        assert "all_gather(float32[1024])" in errors[0]
        assert "all_gather(float32[65537])" in errors[0]
        assert "reduce_scatter(float32[512], SUM)" in errors[1]
        assert "reduce_scatter(float32[80000], SUM)" in errors[1]


def _comm_lean(rank: int, world: int) -> bool:
    from coordinator.comm import ReduceOp, WorkStatus, new_comm

    comm = new_comm("gloo", "cpu", "lean-comm", timeout=20)
    try:
        assert comm._lane is not None
        shm = comm._lane.shm
        x = torch.full((1024,), rank + 1.0)
        before = shm.generation
        work = comm.all_reduce(x)
        assert shm.generation == before + 1 and work.status is WorkStatus.COMPLETED
        assert work.wait() and torch.equal(x, torch.full((1024,), world * (world + 1) / 2))
        out = torch.empty(world * 3, dtype=torch.int64)
        before = shm.generation
        comm.all_gather_single(out, torch.arange(3) + 10 * rank)
        assert shm.generation == before + 1
        assert out.tolist() == [10 * r + i for r in range(world) for i in range(3)]
        part = torch.empty(2)
        before = shm.generation
        comm.reduce_scatter_single(part, torch.arange(2.0 * world))
        assert shm.generation == before + 1
        root = torch.arange(5, dtype=torch.int8) + rank
        before = shm.generation
        general, shm.broadcast_ = shm.broadcast_, _no_general_path
        assert comm.broadcast(root, world - 1).wait()
        shm.broadcast_ = general
        assert shm.generation == before + 1
        assert root.tolist() == [i + world - 1 for i in range(5)]
        assert part.tolist() == [world * (2.0 * rank + i) for i in range(2)]
        before = shm.generation
        work = comm.barrier()  # on the caller's thread, one arrival
        assert work.status is WorkStatus.COMPLETED and shm.generation == before + 1
        # all_gather_v: parts of other lengths, one barrier, straight into the outputs.
        outs = [torch.full((r + 1,), -1.0) for r in range(world)]
        before = shm.generation
        assert comm.all_gather_v(outs, torch.full((rank + 1,), float(rank))).wait()
        assert shm.generation == before + 1
        assert [t.tolist() for t in outs] == [[float(r)] * (r + 1) for r in range(world)]
        lazy = [torch.zeros(r + 1, dtype=torch.complex64).conj() for r in range(world)]
        with pytest.raises(ValueError, match="conjugate"):
            comm.all_gather_v(lazy, torch.ones(rank + 1, dtype=torch.complex64))
        # Not for the lean path: other ops, other shapes, bad arguments (still refused).
        y = torch.full((4,), rank + 1.0)
        comm.all_reduce(y, ReduceOp.MAX)
        assert y.tolist() == [float(world)] * 4
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_reduce(torch.ones(4, 4).t())
        with pytest.raises(ValueError, match="output"):
            comm.all_gather_single(torch.empty(world * 3 + 1), torch.ones(3))
        # Behind an asynchronous call the lean path steps aside: the lane keeps the order.
        first = torch.full((1024,), 1.0)
        pending = comm.all_reduce(first, async_op=True)
        second = torch.full((1024,), 2.0)
        comm.all_reduce(second)
        pending.wait()
        assert first[0].item() == world and second[0].item() == 2 * world
        return True
    finally:
        comm.finalize()


@pytest.mark.parametrize("world", [2, 3])
def test_comm_small_calls_take_the_lean_path_in_place(world: int) -> None:
    assert run_ranks(_comm_lean, world, timeout=60) == [True] * world


def _lean_broadcasts(rank: int, world: int) -> bool:
    group = _group(rank, world, "lean-bcast")
    try:
        shm = group.device_communicator.shm_all_reduce
        eager, group._broadcast_eager = group._broadcast_eager, _no_general_path
        src = world - 1
        for shape, dtype, strided in (
            ((1024,), torch.float32, False),
            ((3, 5), torch.int8, True),  # any dtype: bytes are copied
            ((), torch.bool, False),
            ((65536,), torch.float32, False),  # 256 KiB: the largest piece
            ((256, 256), torch.bfloat16, True),
        ):
            mine = _rank_tensor(rank, shape, dtype)
            target = mine.t() if strided else mine
            before = shm.generation
            assert group.broadcast(target, src) is target
            assert shm.generation == before + 1, "one generation, one barrier"
            want = _rank_tensor(src, shape, dtype)
            assert torch.equal(target, want.t() if strided else want), (shape, dtype)
        # Over 256 KiB, or empty: the general path, which meets a lean rank's protocol.
        group._broadcast_eager = eager
        big = _rank_tensor(rank, (65537,), torch.float32)
        assert torch.equal(group.broadcast(big, 0), _rank_tensor(0, (65537,), torch.float32))
        assert group.broadcast(torch.empty(0), 0).numel() == 0
        small = _rank_tensor(rank, (100,), torch.int64)
        got = group.broadcast(small, 0) if rank == 0 else group._broadcast_eager(small, 0)
        assert torch.equal(got, _rank_tensor(0, (100,), torch.int64))
        # Bad arguments, which the lean path (tried first) leaves to the checks.
        with pytest.raises(ValueError, match="src"):
            group.broadcast(small, world)
        with pytest.raises(ValueError, match="src"):
            group.broadcast(small, -1)
        with pytest.raises(TypeError, match="src"):
            group.broadcast(small, True)
        with pytest.raises(TypeError, match="input_"):
            group.broadcast(small.tolist(), 0)  # type: ignore[arg-type]
        # Ranks that name different roots are told so, naming both; the group closes.
        with pytest.raises(DesyncError) as caught:
            group.broadcast(torch.ones(8), rank % 2)
        for side in ("broadcast(float32[8], src=0)", "broadcast(float32[8], src=1)"):
            assert side in str(caught.value)
        with pytest.raises(ClosedError, match="is closed on every rank"):
            group.broadcast(small, 0)
        return True
    finally:
        group.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_small_broadcasts_take_the_lean_path_any_dtype_and_meet_the_general_one(
    world: int,
) -> None:
    assert run_ranks(_lean_broadcasts, world, timeout=60) == [True] * world


def _odd_input_kinds(rank: int, world: int, kind: str) -> list[str]:
    """Rank 0's input requires grad or is an ``nn.Parameter`` (which the lean path
    leaves to the general one); the other ranks' are plain: the same answers."""
    group = _group(rank, world, "lean-kinds")
    wrong = []

    def odd(t: torch.Tensor) -> torch.Tensor:
        if rank != 0:
            return t
        if kind == "requires grad":
            return t.clone().requires_grad_(True)
        return torch.nn.Parameter(t.clone(), requires_grad=False)

    calls = {  # name: (the call on this rank's tensor, the right answer from the total)
        "reduce_scatter dim 1": (
            lambda t: group.reduce_scatter(odd(t), 1),
            lambda total, parts: total.chunk(world, 1)[rank],
        ),
        "reduce_scatter dim 0": (
            lambda t: group.reduce_scatter(odd(t.t().contiguous()), 0),
            lambda total, parts: total.t().chunk(world, 0)[rank],
        ),
        "all_gather dim 1": (
            lambda t: group.all_gather(odd(t), 1),
            lambda total, parts: torch.cat(parts, 1),
        ),
        "all_gatherv dim 1": (
            lambda t: group.all_gatherv(odd(t), 1),
            lambda total, parts: torch.cat(parts, 1),
        ),
        "all_reduce": (lambda t: group.all_reduce(odd(t)), lambda total, parts: total),
    }
    try:
        for rows, cols in ((4, 8), (256, 512)):  # lean-sized, and over its 256 KiB
            x = torch.arange(rows * cols * world, dtype=torch.float32).view(rows, cols * world)
            parts = [x * (r + 1) for r in range(world)]
            total = x * sum(range(1, world + 1))
            for name, (call, want) in calls.items():
                got = call(parts[rank])
                assert isinstance(got, torch.Tensor)
                if not torch.equal(got.detach(), want(total, parts)):
                    wrong.append(f"{name} {tuple(x.shape)}")
        return wrong
    finally:
        group.destroy()


@pytest.mark.parametrize("kind", ["requires grad", "parameter"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_whose_input_the_lean_path_leaves_gets_the_same_answers(
    world: int, kind: str
) -> None:
    # Rank 0 took the general path, which laid a reduce-scatter along dim 1 out in
    # shared memory another way than the lean path of the others: every rank summed
    # mismatched elements, silently.
    assert run_ranks(_odd_input_kinds, world, kind, timeout=90) == [[]] * world
