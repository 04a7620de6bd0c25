"""The result-buffer pool: a buffer is handed out again only when nothing holds it."""

from __future__ import annotations

import threading

import pytest
import torch

from coordinator.launch import init_gloo, run_ranks
from shm_broadcast.host_memory import (
    HUGE_PAGE_MIN_BYTES,
    POOL_CAP_BYTES,
    POOL_MIN_BYTES,
    cached_output_bytes,
    empty_output,
    release_cached_outputs,
)

BIG = (POOL_MIN_BYTES // 4,)  # float32 elements: one pooled size class


@pytest.fixture(autouse=True)
def _empty_pool():
    release_cached_outputs()
    yield
    release_cached_outputs()


def test_empty_output_is_a_plain_fresh_tensor_of_any_size() -> None:
    for shape, dtype in (
        ((3, 5), torch.float16),
        ((HUGE_PAGE_MIN_BYTES // 4 + 7,), torch.float32),
        ((1000, 300), torch.bfloat16),
    ):
        out = empty_output(shape, dtype)
        assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
        assert out._base is None and out.storage_offset() == 0
        out.fill_(1)  # writable everywhere, huge-page hint or not
        assert bool(torch.all(out == 1))


def test_a_dropped_result_is_reused_and_small_ones_are_not_pooled() -> None:
    first = empty_output(BIG, torch.float32)
    address = first.data_ptr()
    del first
    again = empty_output(BIG, torch.float32)
    assert again.data_ptr() == address
    small = empty_output((16,), torch.float32)
    del small
    assert cached_output_bytes() == POOL_MIN_BYTES


def _holders():
    """Ways a caller keeps a result's memory alive, each given the result."""
    import torch.utils.dlpack as dlpack

    return {
        "the tensor": lambda t: t,
        "a slice": lambda t: t[1:],
        "a reshaped view": lambda t: t.view(2, -1),
        "a numpy array": lambda t: t.numpy(),
        "a memoryview": lambda t: memoryview(t.numpy()),
        "the storage object": lambda t: t.untyped_storage(),
        "a tensor over the same storage": lambda t: torch.empty(0).set_(t.untyped_storage()),
        "a dlpack capsule": dlpack.to_dlpack,
        "a tensor from dlpack": lambda t: dlpack.from_dlpack(dlpack.to_dlpack(t)),
        "a list": lambda t: [t],
    }


@pytest.mark.parametrize("how", list(_holders()))
def test_a_result_still_held_is_never_handed_out_again(how: str) -> None:
    result = empty_output(BIG, torch.float32)
    result.fill_(7)
    address = result.data_ptr()
    held = _holders()[how](result)
    del result
    # More calls than the pool keeps per class: none may land on the held memory.
    others = [empty_output(BIG, torch.float32) for _ in range(3)]
    assert all(o.data_ptr() != address for o in others)
    for o in others:
        o.fill_(-1)
    del others
    again = empty_output(BIG, torch.float32)
    assert again.data_ptr() != address
    del again
    del held  # now nothing holds it: it may come back
    reused = [empty_output(BIG, torch.float32) for _ in range(2)]
    assert address in {r.data_ptr() for r in reused}


def test_as_many_buffers_as_were_held_at_once_come_back() -> None:
    """A tensor dict's same-size tensors, held while the next dict arrives: both
    dicts' buffers stay pooled, so steady state allocates nothing fresh."""
    first = [empty_output(BIG, torch.float32) for _ in range(8)]
    second = [empty_output(BIG, torch.float32) for _ in range(8)]
    addresses = {t.data_ptr() for t in first + second}
    assert len(addresses) == 16  # nothing held is handed out twice
    del first
    third = [empty_output(BIG, torch.float32) for _ in range(8)]
    assert {t.data_ptr() for t in third} <= addresses
    del second, third
    again = [empty_output(BIG, torch.float32) for _ in range(16)]
    assert {t.data_ptr() for t in again} == addresses


def test_what_a_held_result_reads_is_never_overwritten() -> None:
    kept = []
    for step in range(6):
        out = empty_output(BIG, torch.float32)
        out.fill_(step)
        if step % 2 == 0:
            kept.append((step, out))
        del out
    for step, out in kept:
        assert torch.all(out == step)


def test_size_classes_share_buffers_and_the_pool_is_capped() -> None:
    a = empty_output((POOL_MIN_BYTES * 4 // 4,), torch.float32)
    address = a.data_ptr()
    del a
    # A few rows fewer: the same size class, the same buffer.
    b = empty_output((POOL_MIN_BYTES * 4 // 4 - 1000,), torch.float32)
    assert b.data_ptr() == address
    del b
    sizes = [POOL_CAP_BYTES // 4, POOL_CAP_BYTES // 3, POOL_CAP_BYTES // 2]
    for nbytes in sizes:
        empty_output((nbytes,), torch.uint8)
        assert cached_output_bytes() <= POOL_CAP_BYTES
    oversized = empty_output((POOL_CAP_BYTES,), torch.uint8)
    assert cached_output_bytes() <= POOL_CAP_BYTES
    del oversized
    release_cached_outputs()
    assert cached_output_bytes() == 0


def test_threads_never_get_the_same_buffer() -> None:
    errors: list[str] = []

    def worker(value: int) -> None:
        for _ in range(200):
            out = empty_output(BIG, torch.int32)
            out.fill_(value)
            if not bool(torch.all(out == value)):
                errors.append(f"thread {value} saw its result overwritten")
                return

    threads = [threading.Thread(target=worker, args=(v,)) for v in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _gather_keep_every_result(rank: int, world: int) -> bool:
    import torch.distributed as dist

    from device_communicators.shm_all_reduce import ShmAllReduce

    init_gloo(rank, world)
    shm = ShmAllReduce(dist.group.WORLD)
    try:
        kept = []
        for step in range(5):
            # 1 MiB and 3 MiB a rank: the one-piece and the piecewise paths.
            for numel in (POOL_MIN_BYTES // 4, 3 * POOL_MIN_BYTES // 4):
                out = shm.all_gather(torch.full((numel,), float(rank * 100 + step)))
                if step % 2:
                    kept.append((step, out))
                del out
        for step, out in kept:
            for r in range(world):
                assert torch.all(out[r] == r * 100 + step), (step, r)
        return True
    finally:
        shm.close()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_results_kept_across_calls_stay_intact(world: int) -> None:
    assert run_ranks(_gather_keep_every_result, world, timeout=90) == [True] * world


def _destroy_releases_the_pool(rank: int, world: int) -> bool:
    from coordinator import parallel_state as ps

    ps.init_distributed_environment(world, rank, backend="gloo")
    ps.initialize_model_parallel(world)
    n = (1 << 20) // 4  # a 1 MiB row: the gathered result comes from the pool
    out = ps.get_tp_group().all_gather(torch.full((n,), float(rank)), 0)
    assert out.shape == (world * n,)
    assert cached_output_bytes() > 0
    ps.destroy_distributed_environment()
    assert cached_output_bytes() == 0
    assert torch.equal(out.view(world, -1)[:, 0], torch.arange(world, dtype=torch.float32))
    return True


def test_destroy_distributed_environment_empties_the_pool() -> None:
    assert run_ranks(_destroy_releases_the_pool, 2, timeout=90) == [True, True]


def test_a_child_forked_while_the_pool_is_locked_can_still_allocate() -> None:
    import os
    import time

    from shm_broadcast import host_memory

    with host_memory._POOL._lock:  # as another thread of the parent might hold it
        pid = os.fork()
        if pid == 0:
            out = empty_output(BIG, torch.float32)
            os._exit(0 if out.numel() == BIG[0] else 1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the pool's lock")
