"""A lone plain CPU tensor crosses the ring as its bytes (the ``TENSOR`` chunk):
exact round trips, the tensors it does not take go through the codec, and a
corrupt chunk is refused without breaking the queue."""

from __future__ import annotations

import pytest
import torch
from test_mq_queue import make_queue

from coordinator.launch import run_ranks
from shm_broadcast.errors import ProtocolError
from shm_broadcast.ring_messages import MSG_OFFSET, TENSOR


def _samples() -> list[tuple[torch.Tensor, bool]]:
    """(tensor, whether it goes as a TENSOR chunk) in the order sent."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=g)
    return [
        (torch.arange(4, dtype=torch.float32), True),
        (torch.tensor(2.5), True),  # 0-d
        (torch.empty(0, 3, dtype=torch.int64), True),
        (torch.randn(1, 2, 1, 2, 1, 2, generator=g).to(torch.bfloat16), True),  # 6-d
        (torch.ones(1, 1, 1, 1, 1, 1, 2), False),  # 7-d: its header does not fit
        (torch.rand(33, generator=g) > 0.5, True),
        (torch.randint(-9, 9, (3, 4), generator=g, dtype=torch.int8), True),
        (torch.randn(3, generator=g, dtype=torch.complex64), True),
        (base.t(), False),  # not contiguous
        (base[1:3], True),  # contiguous view at an offset
        (torch.ones(3, requires_grad=True), False),
        (torch.randn(2, generator=g, dtype=torch.complex64).conj(), False),
        (torch.nn.Parameter(torch.ones(2), requires_grad=False), False),  # a subclass
        (torch.zeros(5000), False),  # larger than the 16 KiB chunk: streamed
    ]


def _round_trips(rank: int, world_size: int) -> list[bool]:
    import torch.distributed as dist

    mq = make_queue(rank, world_size, 1, max_chunk_bytes=1 << 14, max_chunks=4)
    samples = _samples()
    taken: list[bool] = []
    if rank == 0:
        cursor = mq._cursor
        write_tensor = cursor.write_tensor

        def counting(*args):
            done = write_tensor(*args)
            taken.append(done)
            return done

        cursor.write_tensor = counting
        for tensor, _ in samples:
            before = len(taken)
            mq.enqueue(tensor, timeout=30)
            if len(taken) == before:
                taken.append(False)  # not offered: the codec sent it
    else:
        for tensor, _ in samples:
            got = mq.dequeue(timeout=30)
            want = tensor.detach().resolve_conj()
            assert type(got) is torch.Tensor and got.dtype == want.dtype
            assert got.shape == want.shape and torch.equal(got, want), want
            assert got.is_contiguous() and not got.requires_grad
        # Received tensors own their memory: the ring's chunks are reused.
        first = mq.dequeue(timeout=30)
        second = mq.dequeue(timeout=30)
        assert torch.equal(first, torch.full((4,), 1.0)) and torch.equal(
            second, torch.full((4,), 2.0)
        )
    result = list(taken)
    if rank == 0:
        mq.enqueue(torch.full((4,), 1.0), timeout=30)
        mq.enqueue(torch.full((4,), 2.0), timeout=30)
    dist.barrier()
    mq.shutdown()
    return result


def test_lone_tensors_round_trip_exactly_and_only_plain_ones_skip_the_codec() -> None:
    taken = run_ranks(_round_trips, 2, timeout=60)[0]
    assert taken == [expected for _, expected in _samples()]


def _corrupt(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    mq = make_queue(rank, world_size, 1, max_chunk_bytes=1 << 12, max_chunks=4)
    message = ""
    if rank == 0:
        cursor = mq._cursor
        buf, at, idx = cursor._begin(TENSOR, lambda i: None, 0)
        buf[at + MSG_OFFSET] = 200  # a header longer than its room
        cursor._publish(idx)
        mq.enqueue(torch.arange(3), timeout=30)
    else:
        with pytest.raises(ProtocolError) as info:
            mq.dequeue(timeout=30)
        message = str(info.value)
        assert torch.equal(mq.dequeue(timeout=30), torch.arange(3))
    dist.barrier()
    mq.shutdown()
    return message


def test_a_corrupt_tensor_chunk_is_refused_and_the_queue_goes_on() -> None:
    assert "out of bounds" in run_ranks(_corrupt, 2, timeout=60)[1]


def _into_and_room(rank: int, world_size: int) -> list[bool]:
    import torch.distributed as dist

    mq = make_queue(rank, world_size, 1, max_chunk_bytes=1 << 12, max_chunks=4)
    one_chunk, streamed = torch.arange(8.0), torch.arange(2000.0)  # 32 B; 8000 B: 3 chunks
    seen: list[bool] = []
    if rank == 0:
        # An empty ring of four 4 KiB chunks takes one chunk plus three streamed ones.
        seen.append(mq.takes_without_waiting([32, 8000]))
        seen.append(mq.takes_without_waiting([32, 32, 8000]))  # five chunks: no
        for tensor in (one_chunk, streamed):
            mq.enqueue(tensor, timeout=30)
        # Every chunk written, none read yet: the next message would wait.
        seen.append(mq.takes_without_waiting([32]))
        dist.barrier()
        dist.barrier()  # the reader has read both
        seen.append(mq.takes_without_waiting([32, 8000]))
        for tensor in (one_chunk, streamed):
            mq.enqueue(tensor, timeout=30)
    else:
        dist.barrier()  # both messages are in the ring
        for tensor in (one_chunk, streamed):
            into = torch.empty_like(tensor)
            got = mq.dequeue(timeout=30, into=memoryview(into.numpy()).cast("B"))
            # Landed in the caller's buffer: the tensor returned shares its memory.
            seen.append(got.data_ptr() == into.data_ptr() and torch.equal(into, tensor))
        dist.barrier()
        # A buffer of another size is not used: the message gets one of its own.
        other = torch.empty(7)
        got = mq.dequeue(timeout=30, into=memoryview(other.numpy()).cast("B"))
        seen.append(got.data_ptr() != other.data_ptr() and torch.equal(got, one_chunk))
        seen.append(torch.equal(mq.dequeue(timeout=30), streamed))
    dist.barrier()
    mq.shutdown()
    return seen


def test_dequeue_into_a_callers_buffer_and_the_writers_room_check() -> None:
    writer, reader = run_ranks(_into_and_room, 2, timeout=60)
    assert writer == [True, False, False, True]
    assert reader == [True, True, True, True]
