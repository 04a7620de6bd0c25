"""ShmAllReduce with real forked ranks: results, bit-identity, pieces, refusals, faults."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import torch

from coordinator.launch import init_gloo, run_ranks, start_ranks

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.bool,
]  # fmt: skip
OPS = ["SUM", "PRODUCT", "MIN", "MAX"]


def rank_input(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every rank's input is a pure function of (rank, seed), so any rank can rebuild all."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        # Near 1 so that products over four ranks stay finite in fp16.
        return (torch.rand(numel, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if dtype == torch.uint8:  # products and sums wrap, as on Gloo
        return torch.randint(0, 256, (numel,), generator=gen, dtype=dtype)
    if dtype == torch.int8:
        return torch.randint(-128, 128, (numel,), generator=gen, dtype=dtype)
    return torch.randint(-3, 4, (numel,), generator=gen, dtype=dtype)


def reference(world: int, numel: int, dtype: torch.dtype, op: str, seed: int = 0) -> torch.Tensor:
    """Reduce in slot order (rank 0, 1, ...), fp16/bf16 sums and products in fp32."""
    parts = [rank_input(r, numel, dtype, seed) for r in range(world)]
    combine = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum}[
        op
    ]
    widen = dtype in (torch.float16, torch.bfloat16) and op in ("SUM", "PRODUCT")
    acc = parts[0].float() if widen else parts[0].clone()
    for p in parts[1:]:
        acc = combine(acc, p.float() if widen else p)
    return acc.to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def make_shm(**kwargs):
    import torch.distributed as dist

    from device_communicators.shm_all_reduce import ShmAllReduce

    return ShmAllReduce(dist.group.WORLD, **kwargs)


def _every_dtype_and_op(rank: int, world: int) -> list[str]:
    from torch.distributed import ReduceOp

    init_gloo(rank, world)
    shm = make_shm(unique_name="t")
    assert shm.disabled_reason is None
    digests = []
    try:
        # 1000 elements: one-shot; 40000 fp32/fp64 elements: above the one-shot size.
        for numel in (1, 1000, 40000):
            for dtype in DTYPES:
                for op in OPS:
                    x = rank_input(rank, numel, dtype, seed=numel)
                    before = x.clone()
                    out = shm.all_reduce(x, getattr(ReduceOp, op))
                    assert torch.equal(x, before), "input was modified"
                    want = reference(world, numel, dtype, op, seed=numel)
                    assert out.dtype == dtype and out.shape == x.shape
                    assert torch.equal(out, want), f"{numel} {dtype} {op}: {out[:4]} vs {want[:4]}"
                    digests.append(digest(out))
    finally:
        shm.close()
    return digests


@pytest.mark.parametrize("world", [2, 4])
def test_every_dtype_and_op_matches_fixed_order_reference(world: int) -> None:
    digests = run_ranks(_every_dtype_and_op, world, timeout=90)
    assert all(d == digests[0] for d in digests), "ranks got different bits"


BITWISE = ["BAND", "BOR", "BXOR"]
# What the shared-memory path took from Gloo: bytes and bools by every op, any
# integer dtype by a bitwise op, floating dtypes by an average, complex dtypes by
# a sum or an average.
FROM_GLOO = [(d, OPS + BITWISE) for d in (torch.int8, torch.uint8, torch.bool)] + [
    (torch.int32, BITWISE),
    (torch.int64, BITWISE),
    (torch.float32, ["AVG"]),
    (torch.float64, ["AVG"]),
    (torch.bfloat16, ["AVG"]),
    (torch.complex64, ["SUM", "AVG"]),
    (torch.complex128, ["SUM", "AVG"]),
    (torch.complex32, ["SUM", "AVG"]),  # as its fp16 parts
]


def _same_bits_as_gloo(rank: int, world: int) -> int:
    import warnings

    import torch.distributed as dist
    from torch.distributed import ReduceOp

    warnings.simplefilter("ignore", UserWarning)  # complex32 is "experimental"
    init_gloo(rank, world)
    shm = make_shm(unique_name="bits")
    checked = 0
    try:
        # One-shot, and past 256 KiB (read directly or two-shot through the slots).
        for numel in (1000, 300_000):
            for dtype, ops in FROM_GLOO:
                for op in ops:
                    # Floating ones hold small whole numbers: sums exact in any order.
                    if dtype.is_complex:
                        parts = rank_input(rank, 2 * numel, torch.int64, seed=numel)
                        x = parts.view(numel, 2).to(dtype.to_real()).view(dtype).view(-1)
                    elif dtype.is_floating_point:
                        x = rank_input(rank, numel, torch.int64, seed=numel).to(dtype)
                    else:
                        x = rank_input(rank, numel, dtype, seed=numel)
                    assert shm.refusal(x, getattr(ReduceOp, op)) is None, (dtype, op)
                    ours = shm.all_reduce(x, getattr(ReduceOp, op))
                    gloo = x.clone()
                    dist.all_reduce(gloo, getattr(ReduceOp, op))
                    if dtype is torch.complex32:  # torch cannot compare these
                        ours, gloo = torch.view_as_real(ours), torch.view_as_real(gloo)
                    assert torch.equal(ours, gloo), f"{numel} {dtype} {op}"
                    checked += 1
    finally:
        shm.close()
    return checked


def test_reductions_taken_from_gloo_give_gloos_bits() -> None:
    """int8, uint8 and bool reductions, bitwise ones of any integer, averages and sums
    of complex tensors take the shared-memory path (fingerprinted: ranks that disagree
    raise) with Gloo's answers: integers wrap, bools add as "or"."""
    want = 2 * sum(len(ops) for _, ops in FROM_GLOO)
    assert run_ranks(_same_bits_as_gloo, 3, timeout=120) == [want] * 3


UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
UNSIGNED_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _unsigned(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values across the dtype's whole range (its signed twin's bits)."""
    signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
    info = torch.iinfo(signed[dtype])
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(info.min, info.max, (numel,), generator=gen, dtype=signed[dtype]).view(
        dtype
    )


def _unsigned_as_numpy(rank: int, world: int) -> int:
    import numpy as np
    from torch.distributed import ReduceOp

    init_gloo(rank, world)
    shm = make_shm(unique_name="unsigned")
    ufuncs = {
        "SUM": np.add,
        "PRODUCT": np.multiply,
        "MIN": np.minimum,
        "MAX": np.maximum,
        "BAND": np.bitwise_and,
        "BOR": np.bitwise_or,
        "BXOR": np.bitwise_xor,
    }
    checked = 0
    try:
        for numel in (1000, 300_000):  # one-shot, and past 256 KiB
            for dtype in UNSIGNED:
                everyone = np.stack(
                    [_unsigned(r, numel, dtype, numel).numpy() for r in range(world)]
                )
                for op in UNSIGNED_OPS:
                    x = _unsigned(rank, numel, dtype, numel)
                    ours = shm.all_reduce(x, getattr(ReduceOp, op))
                    want = ufuncs[op].reduce(everyone, axis=0, dtype=everyone.dtype)
                    assert ours.dtype == dtype and np.array_equal(ours.numpy(), want), (numel, op)
                    checked += 1
    finally:
        shm.close()
    return checked


def test_wide_unsigned_reductions_wrap_as_numpy_does() -> None:
    """Gloo reduces no unsigned dtype wider than a byte; the shared-memory path sums,
    multiplies and combines their bits as their signed twins (the same bits: numpy's
    wrapping arithmetic is the reference), and orders them as the twins of their bits
    with the top one flipped (MIN and MAX, refused until 2026-11-28; the values span
    the whole range, so a signed order would pick wrong ones)."""
    want = 2 * len(UNSIGNED) * len(UNSIGNED_OPS)
    assert run_ranks(_unsigned_as_numpy, 3, timeout=120) == [want] * 3


def _pieces(rank: int, world: int, one_shot_max: int) -> list[str]:
    import device_communicators.shm_all_reduce as mod

    mod.ONE_SHOT_MAX_BYTES = one_shot_max
    init_gloo(rank, world)
    shm = make_shm(max_bytes=256)  # 64 fp32 per piece: many pieces, odd tails
    assert shm.max_bytes == 256
    out_digests = []
    try:
        for numel in (63, 64, 65, 1000, 4097):
            x = rank_input(rank, numel, torch.float32, seed=numel).view(-1)
            start_gen = shm.generation
            out = shm.all_reduce(x)
            assert shm.generation - start_gen == -(-numel // 64), "one generation per piece"
            assert torch.equal(out, reference(world, numel, torch.float32, "SUM", seed=numel))
            out_digests.append(digest(out))
    finally:
        shm.close()
    return out_digests


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["one_shot", "two_shot"])
def test_tensor_larger_than_the_buffer_goes_in_pieces(world: int, mode: str) -> None:
    digests = run_ranks(_pieces, world, 1 << 30 if mode == "one_shot" else 0, timeout=90)
    assert all(d == digests[0] for d in digests)


def _large_default_pieces(rank: int, world: int) -> bool:
    init_gloo(rank, world)
    shm = make_shm()
    try:
        numel = 300_000  # 1.2 MB fp32: a full 1 MiB two-shot piece and a tail
        x = rank_input(rank, numel, torch.float32, seed=7).view(30, 10_000)[:, ::2]
        out = shm.all_reduce(x)  # non-contiguous view
        assert out.shape == x.shape and out.is_contiguous()
        parts = [
            rank_input(r, numel, torch.float32, seed=7).view(30, 10_000)[:, ::2]
            for r in range(world)
        ]
        want = parts[0].clone()
        for p in parts[1:]:
            want = want + p
        assert torch.equal(out, want)
    finally:
        shm.close()
    return True


def test_large_non_contiguous_tensor_with_default_pieces() -> None:
    assert run_ranks(_large_default_pieces, 2, timeout=90) == [True, True]


def _back_to_back(rank: int, world: int, wait_mode: str) -> int:
    import random

    init_gloo(rank, world)
    shm = make_shm(max_bytes=4096)
    if wait_mode == "sleep_at_once":
        shm._lines.spin_s = 0.0  # every wait that is not over at once sleeps on the futex
    elif wait_mode == "no_futex":
        shm._lines.use_futex = False
    rng = random.Random(rank)
    try:
        for i in range(300):
            numel = (i * 37) % 3000 + 1
            if rng.random() < 0.05:
                time.sleep(0.002)  # a slow rank must not break double buffering
            x = torch.full((numel,), float(rank + i))
            out = shm.all_reduce(x)
            want = float(sum(r + i for r in range(world)))
            assert torch.equal(out, torch.full((numel,), want)), f"call {i}"
        return shm.generation
    finally:
        shm.close()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wait_mode", ["default", "sleep_at_once", "no_futex"])
def test_back_to_back_calls_with_uneven_pace(world: int, wait_mode: str) -> None:
    gens = run_ranks(_back_to_back, world, wait_mode, timeout=90)
    assert len(set(gens)) == 1 and gens[0] >= 300


def _refusals(rank: int, world: int) -> list[str]:

    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from device_communicators.cpu_communicator import CpuCommunicator
    from shm_broadcast.errors import GroupcoordTypeError

    init_gloo(rank, world)
    comm = CpuCommunicator(dist.group.WORLD, unique_name="refuse")
    shm = comm.shm_all_reduce
    try:
        reasons = []
        other = torch.full((5,), rank + 1.0).to(torch.float8_e4m3fn)
        assert not shm.can_handle(other)
        reasons.append(str(shm.refusal(other)))
        # The chain hands what shm refuses to Gloo, which cannot reduce it either and
        # says so before sending anything (it said "Invalid scalar type", which the
        # coordinator took for a lost peer); the communicator stays usable.
        assert comm.all_reduce_chain.select(other).name == "torch.distributed(gloo)"
        with pytest.raises(GroupcoordTypeError, match="Gloo cannot reduce torch.float8_e4m3fn"):
            comm.all_reduce(other)
        wide = torch.full((5,), rank + 1, dtype=torch.uint32)
        reasons.append(str(shm.refusal(wide, ReduceOp.MAX)))  # taken (refused until 11-28)
        assert comm.all_reduce(wide).tolist() == [3] * 5
        assert comm.all_reduce(wide, op=ReduceOp.MAX).tolist() == [2] * 5
        z = torch.ones(3, dtype=torch.complex64)
        reasons.append(str(shm.refusal(z, ReduceOp.MAX)))
        reasons.append(str(shm.refusal(z.real, ReduceOp.BAND)))
        x = torch.tensor([6, 3], dtype=torch.int32) * (rank + 1)
        reasons.append(str(shm.refusal(x, ReduceOp.AVG)))
        reasons.append(str(shm.refusal(z.real, dist._make_nccl_premul_sum(2.0))))
        # Copies take every dtype with a code in the call's fingerprint: all but quantized.
        q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
        reasons.append(str(shm.copy_refusal(q)))
        assert shm.copy_refusal(torch.ones(2).to(torch.float8_e5m2)) is None
        assert comm.all_reduce_chain.select(x, ReduceOp.BAND) is shm
        assert torch.equal(
            comm.all_reduce(x, op=ReduceOp.BAND), torch.tensor([6 & 12, 3 & 6]).int()
        )
        assert shm.can_handle(torch.zeros(3))
        assert comm.all_reduce_chain.select(torch.zeros(3)) is shm
        return reasons
    finally:
        comm.destroy()


def test_shm_refuses_what_it_cannot_take_and_gloo_takes_it() -> None:
    reasons = run_ranks(_refusals, 2, timeout=60)[0]
    assert "torch.float8_e4m3fn is not one of" in reasons[0]
    assert reasons[1] == "None"
    assert "complex64 tensor can only be reduced with SUM or AVG" in reasons[2]
    assert "BAND: needs an integer or bool dtype, got torch.float32" in reasons[3]
    assert "AVG: needs a floating or complex dtype" in reasons[4] and "torch.int32" in reasons[4]
    assert "is not one of" in reasons[5] and "AVG" in reasons[5]
    assert reasons[6] == "dtype torch.qint8 is quantized"


def _disabled(rank: int, world: int) -> str | None:
    import torch.distributed as dist

    from device_communicators.cpu_communicator import CpuCommunicator
    from shm_broadcast.config import set_config

    init_gloo(rank, world)
    set_config(disable_shm_all_reduce=True)
    comm = CpuCommunicator(dist.group.WORLD)
    try:
        x = torch.ones(4)
        assert comm.all_reduce_chain.select(x).name == "torch.distributed(gloo)"
        assert torch.equal(comm.all_reduce(x), torch.full((4,), 2.0))
        return comm.shm_all_reduce.disabled_reason
    finally:
        comm.destroy()


def test_disabled_by_config_falls_back_to_gloo() -> None:
    reasons = run_ranks(_disabled, 2, timeout=60)
    assert "disabled" in str(reasons[0])
    assert reasons[1] is not None


def _one_rank_disabled(rank: int, world: int) -> str | None:
    from shm_broadcast.config import set_config

    init_gloo(rank, world)
    if rank == 1:
        set_config(disable_shm_all_reduce=True)
    shm = make_shm()
    try:
        return shm.disabled_reason
    finally:
        shm.close()


def test_ranks_agree_to_disable_when_one_cannot_take_part() -> None:
    reasons = run_ranks(_one_rank_disabled, 2, timeout=60)
    assert "[1]" in str(reasons[0]) and "disabled" in str(reasons[1])


def _segment_unlinked_early(rank: int, world: int) -> bool:
    from shm_broadcast.segments import list_segments

    init_gloo(rank, world)
    shm = make_shm()
    try:
        assert shm._slots is not None
        name = shm._slots.segment.name
        # Rank 0 drops the name before its constructor returns; the others
        # know it is gone once a collective with rank 0 has completed.
        assert torch.equal(shm.all_reduce(torch.ones(3)), torch.full((3,), float(world)))
        assert name not in list_segments(), "the name must be gone once everyone mapped it"
        return True
    finally:
        shm.close()


def test_segment_is_unlinked_as_soon_as_every_rank_attached() -> None:
    assert run_ranks(_segment_unlinked_early, 2, timeout=60) == [True, True]


def _peer_never_joins(rank: int, world: int) -> tuple[str, list[int], float]:
    import torch.distributed as dist

    from device_communicators.errors import ClosedError, GroupcoordTimeoutError

    init_gloo(rank, world)
    shm = make_shm(timeout_s=1.5, unique_name="late")
    try:
        if rank == world - 1:
            dist.barrier()  # never calls all_reduce; waits for the others to give up
            return "", [], 0.0
        start = time.monotonic()
        try:
            shm.all_reduce(torch.ones(8))
        except GroupcoordTimeoutError as exc:
            elapsed = time.monotonic() - start
            try:
                shm.all_reduce(torch.ones(8))
                raise AssertionError("a broken shm all-reduce must not be reused")
            except ClosedError:
                pass
            dist.barrier()
            return str(exc), exc.missing, elapsed
        raise AssertionError("all_reduce did not time out")
    finally:
        shm.close()


@pytest.mark.parametrize("world", [2, 4])
def test_timeout_names_the_rank_that_never_joined(world: int) -> None:
    results = run_ranks(_peer_never_joins, world, timeout=60)
    for message, missing, elapsed in results[:-1]:
        assert missing == [world - 1]
        assert message.startswith("late: all_reduce timed out after 1.5 s")
        assert f"waiting for ranks [{world - 1}]" in message and "shared-memory" in message
        assert 1.4 <= elapsed < 5.0


def _peer_dies(rank: int, world: int) -> tuple[list[int], float]:
    from device_communicators.errors import PeerDiedError

    init_gloo(rank, world)
    shm = make_shm(timeout_s=60, unique_name="dies")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        shm.all_reduce(torch.ones(8))
    except PeerDiedError as exc:
        return exc.dead, time.monotonic() - start
    finally:
        shm.close()
    raise AssertionError("all_reduce did not notice the dead peer")


def test_dead_peer_is_reported_within_seconds() -> None:
    group = start_ranks(_peer_dies, 2, timeout=60)
    dead, elapsed = group.collect(killed=[1])[0]
    assert dead == [1]
    assert elapsed < 5.0


def test_futex_wait_returns_on_changed_value_and_on_timeout() -> None:
    import ctypes

    from shm_broadcast import waiting

    assert waiting.futex_available()
    word = ctypes.c_int32(5)
    start = time.monotonic()
    waiting.futex_wait(ctypes.addressof(word), 4, 5.0)  # value differs: returns at once
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    waiting.futex_wait(ctypes.addressof(word), 5, 0.05)  # nobody wakes it: the timeout does
    assert 0.04 <= time.monotonic() - start < 2.0
    waiting.futex_wake(ctypes.addressof(word))  # waking nobody is fine
    waiting.memory_fence()


def _gather_and_broadcast(rank: int, world: int) -> bool:
    init_gloo(rank, world)
    shm = make_shm(max_bytes=256)  # many pieces for anything but tiny tensors
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
            for shape in ((), (0,), (3,), (37, 5), (100, 9)):
                mine = torch.arange(max(1, int(torch.tensor(shape).prod())) if shape else 1) + rank
                mine = (
                    mine.reshape(shape).to(dtype) if shape != (0,) else torch.empty(0, dtype=dtype)
                )
                got = shm.all_gather(mine)
                assert got.shape == (world, *mine.shape) and got.dtype == dtype
                for r in range(world):
                    theirs = (torch.arange(got[r].numel()) + r).reshape(mine.shape).to(dtype)
                    assert torch.equal(got[r], theirs), (dtype, shape, r)
                # Broadcast from the last rank into a non-contiguous view.
                base = torch.zeros((*mine.shape, 2), dtype=dtype)
                target = base[..., 1]
                if rank == world - 1:
                    target.copy_(mine)
                assert shm.broadcast_(target, world - 1) is target
                want = (torch.arange(mine.numel()) + world - 1).reshape(mine.shape).to(dtype)
                assert torch.equal(target, want), (dtype, shape)
                assert not base[..., 0].any()  # only the view's elements were written
        return True
    finally:
        shm.close()


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_broadcast_through_the_slots_any_dtype_in_pieces(world: int) -> None:
    assert run_ranks(_gather_and_broadcast, world, timeout=90) == [True] * world


def _gathered_rows(rank: int, world: int) -> list[str]:
    from shm_broadcast.config import set_config

    set_config(disable_peer_reads=True)  # the slots at every size
    init_gloo(rank, world)
    shm = make_shm()  # 1 MiB slots
    wrong = []
    try:
        # Two pieces (GATHER_PIECE_BYTES) of a result too large to clone; five pieces.
        for rows, cols in ((400, 500), (600_001, 1)):

            def part(r: int, rows: int = rows, cols: int = cols) -> torch.Tensor:
                return torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 1e6 * r

            every = torch.stack([part(r) for r in range(world)])
            # A transposed (strided) input: this rank's row is copied from it.
            got = shm.all_gather(part(rank).t())
            if not torch.equal(got, every.transpose(1, 2)):
                wrong.append(f"strided {rows}x{cols}")
            # torch's in-place idiom: the input is this rank's row of ``out``.
            out = torch.full_like(every, -1.0)
            out[rank] = part(rank)
            if shm.all_gather(out[rank], out=out) is not out or not torch.equal(out, every):
                wrong.append(f"in place {rows}x{cols}")
            # A gather to the last rank: the others return None and leave ``out`` alone.
            out = torch.full_like(every, -1.0)
            got = shm.gather(part(rank), world - 1, out=out)
            if rank == world - 1 and (got is not out or not torch.equal(out, every)):
                wrong.append(f"gather {rows}x{cols}")
            if rank != world - 1 and (got is not None or not bool((out == -1).all())):
                wrong.append(f"gather {rows}x{cols}: a non-root's out")
        return wrong
    finally:
        shm.close()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_rows_through_the_slots_strided_and_in_place(world: int) -> None:
    """Each rank's own row of an all-gather through the slots is copied from its input
    (not read back from its slot): a strided input, and an input that is already its
    row of ``out``, come out right; a gather writes only the root's ``out``."""
    assert run_ranks(_gathered_rows, world, timeout=90) == [[]] * world


def _reduce_ranges(rank: int, world: int) -> bool:
    from torch.distributed import ReduceOp

    init_gloo(rank, world)
    shm = make_shm(max_bytes=256)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for numel in (0, 5, 1000):
                # Uneven ranges, one of them empty, covering [0, numel).
                cuts = sorted({0, numel, numel // 3, numel // 3, (2 * numel) // 3})
                bounds = (cuts + [numel] * world)[: world + 1]
                lo, hi = bounds[rank], bounds[rank + 1]
                x = rank_input(rank, numel, dtype, seed=numel + 1)
                for op in ("SUM", "MAX"):
                    got = shm.reduce_range(x, lo, hi, getattr(ReduceOp, op))
                    want = reference(world, numel, dtype, op, seed=numel + 1)[lo:hi]
                    assert torch.equal(got, want), (dtype, numel, op)
        return True
    finally:
        shm.close()


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_range_is_the_matching_slice_of_the_all_reduce(world: int) -> None:
    assert run_ranks(_reduce_ranges, world, timeout=90) == [True] * world


def _other_node(rank: int, world: int) -> str | None:
    import torch.distributed as dist

    import device_communicators.shm_slots as mod
    from device_communicators import CpuCommunicator

    init_gloo(rank, world)
    if rank == world - 1:
        # As on another node: rank 0's segment does not exist in this /dev/shm.
        def attach(name: str) -> None:
            raise FileNotFoundError(2, "No such file or directory", name)

        mod.ShmSegment.attach = attach  # type: ignore[method-assign,assignment]
    comm = CpuCommunicator(dist.group.WORLD, unique_name="split")
    try:
        x = torch.full((4,), float(rank + 1))
        assert comm.all_reduce_chain.select(x).name == "torch.distributed(gloo)"
        want = float(sum(range(1, world + 1)))
        assert torch.equal(comm.all_reduce(x), torch.full((4,), want))
        assert comm.all_gather(x, dim=0).shape == (4 * world,)
        comm.broadcast(x, src=0)
        assert torch.equal(x, torch.ones(4))
        return comm.shm_all_reduce.disabled_reason
    finally:
        comm.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_on_another_node_sends_every_rank_to_gloo(world: int) -> None:
    reasons = run_ranks(_other_node, world, timeout=90)
    assert all(r is not None for r in reasons)
    assert "cannot attach" in str(reasons[world - 1])
    assert f"[{world - 1}]" in str(reasons[0])


def _foreign_pid_namespace(rank: int, world: int) -> bool:
    import device_communicators.shm_phases as phases

    init_gloo(rank, world)
    if rank == 1:
        phases.pid_namespace = lambda: 4242  # as if in another container
    shm = make_shm()
    try:
        # Pids from another namespace mean nothing here: no liveness verdicts.
        assert torch.equal(shm.all_reduce(torch.ones(2)), torch.full((2,), float(world)))
        return shm._lines.pid_checks
    finally:
        shm.close()


def test_peer_pids_are_not_judged_across_pid_namespaces() -> None:
    assert run_ranks(_foreign_pid_namespace, 2, timeout=60) == [False, False]


def _small_calls_on_shaped_views(rank: int, world: int) -> bool:
    # The one-piece paths copy through views shaped like the tensor: strided
    # inputs, 0-d tensors and caller-given outputs must all come out right.
    init_gloo(rank, world)
    shm = make_shm()
    try:
        total = float(sum(range(1, world + 1)))
        for x in (
            torch.full((6, 4), float(rank + 1)).t(),  # non-contiguous
            torch.tensor(float(rank + 1)),  # 0-d
            torch.full((3, 5), float(rank + 1), dtype=torch.bfloat16)[:, ::2],
        ):
            before = x.clone()
            got = shm.all_reduce(x)
            assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
            assert torch.equal(got, torch.full_like(before, total)), got
            assert torch.equal(x, before), "input was modified"
            out = torch.empty(x.shape, dtype=x.dtype)
            assert shm.all_reduce(x, out=out) is out and torch.equal(out, got)
        inplace = torch.full((8,), float(rank + 1))
        assert shm.all_reduce(inplace, out=inplace) is inplace
        assert torch.equal(inplace, torch.full((8,), total))
        mine = (torch.arange(12.0).reshape(3, 4) + 100 * rank).t()  # non-contiguous
        want = torch.stack([(torch.arange(12.0).reshape(3, 4) + 100 * r).t() for r in range(world)])
        assert torch.equal(shm.all_gather(mine), want)
        flat = torch.empty(world * 12)
        assert shm.all_gather(mine, out=flat) is flat
        assert torch.equal(flat.view(world, 4, 3), want)
        # The same shapes again: the cached views serve the second round.
        assert torch.equal(shm.all_gather(mine), want)
        return True
    finally:
        shm.close()


@pytest.mark.parametrize("world", [2, 3])
def test_small_calls_take_strided_and_zero_dim_tensors_and_given_outputs(world: int) -> None:
    assert run_ranks(_small_calls_on_shaped_views, world, timeout=60) == [True] * world


def _small_shm_slots(rank: int, world: int) -> tuple[int, list[bool]]:
    from shm_broadcast import segments
    from shm_broadcast.errors import ShmSpaceError

    def one_mib_free(nbytes: int, *args: object, **kwargs: object) -> None:
        # /dev/shm as a container with 1 MiB left would have it.
        if nbytes > 1 << 20:
            raise ShmSpaceError(f"cannot create a {nbytes} byte segment: 1048576 bytes free")

    segments.check_shm_free_space = one_mib_free
    init_gloo(rank, world)
    shm = make_shm(unique_name="small")
    try:
        assert shm.disabled_reason is None, shm.disabled_reason
        ok = []
        for numel in (1000, 300_000):  # one slot; many pieces of the small slots
            x = rank_input(rank, numel, torch.float64, seed=numel)
            ok.append(
                torch.equal(shm.all_reduce(x), reference(world, numel, torch.float64, "SUM", numel))
            )
            parts = [rank_input(r, numel, torch.float64, seed=numel) for r in range(world)]
            ok.append(torch.equal(shm.all_gather(x), torch.stack(parts)))
        return shm.max_bytes, ok
    finally:
        shm.close()


def test_slots_shrink_where_shared_memory_is_small() -> None:
    """Rank 0 cannot create the usual slots (2 x world x 1 MiB): it takes small ones,
    whose size the peers read from the handle; small and large calls stay exact."""
    from device_communicators.shm_slots import SMALL_SLOT_BYTES

    results = run_ranks(_small_shm_slots, 3, timeout=90)
    assert results == [(SMALL_SLOT_BYTES, [True] * 4)] * 3
