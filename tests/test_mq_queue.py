"""MessageQueue with real forked processes: order, messages larger than a chunk, TCP readers, group constructors."""

from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np
import pytest
import torch

from coordinator.launch import init_gloo, run_ranks
from shm_broadcast.codec import dumps, encode_message, loads
from shm_broadcast.errors import ClosedError, GroupcoordValueError
from shm_broadcast.group_io import broadcast_bytes
from shm_broadcast.message_queue import Handle, MessageQueue


def make_queue(rank, world_size, n_local, max_chunk_bytes=1 << 14, max_chunks=8, **kw):
    """Rank 0 writes; ranks 1..n_local read the ring, the rest read over TCP (127.0.0.1)."""
    import torch.distributed as dist

    init_gloo(rank, world_size)
    if rank == 0:
        mq = MessageQueue(
            world_size - 1,
            n_local,
            list(range(1, n_local + 1)),
            max_chunk_bytes,
            max_chunks,
            "127.0.0.1",
            **kw,
        )
        broadcast_bytes(dist.group.WORLD, dumps(mq.export_handle()))
    else:
        handle = loads(broadcast_bytes(dist.group.WORLD, None))
        mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=30)
    return mq


def local_pair(max_chunks: int = 4, tcp: bool = False) -> tuple[MessageQueue, MessageQueue]:
    """A writer and its one reader (64 KiB chunks), both in this process: local, or
    remote (TCP)."""
    if tcp:
        writer = MessageQueue(1, 0, [], 1 << 16, max_chunks, "127.0.0.1")
    else:
        writer = MessageQueue(1, 1, [1], 1 << 16, max_chunks)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 1)
    joining = threading.Thread(target=reader.wait_until_ready, kwargs={"timeout": 30})
    joining.start()
    writer.wait_until_ready(timeout=30)
    joining.join()
    return writer, reader


def mixed_message(i):
    """Small dicts, tuples, tensors, and every 97th one too large for a chunk."""
    kind = i % 5
    if i % 97 == 0:
        return ("big", i, torch.full((6000,), i, dtype=torch.int32))  # 24 KB > 16 KiB chunk
    if kind == 0:
        return {"i": i, "s": "x" * (i % 13), "t": (i, -i)}
    if kind == 1:
        return torch.arange(i % 50, dtype=torch.float32) + i
    if kind == 2:
        return [i, b"b" * (i % 100), None, 1.5]
    if kind == 3:
        return np.full((3, 2), i, dtype=np.int64)
    return ("tuple", i)


def check_message(i, got):
    want = mixed_message(i)
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), i
    elif isinstance(want, np.ndarray):
        assert np.array_equal(got, want), i
    elif isinstance(want, tuple) and want[0] == "big":
        assert got[:2] == want[:2] and torch.equal(got[2], want[2]), i
    else:
        assert type(got) is type(want) and got == want, (i, got, want)


def _ordering_rank(rank, world_size, n_local, count, rewind_span=None):
    import torch.distributed as dist

    from shm_broadcast import ring_messages

    if rewind_span is not None:  # the writer goes back to chunk 0 whenever it may
        ring_messages.REWIND_MIN_BYTES = 0
        ring_messages.REWIND_SPAN_BYTES = rewind_span
    mq = make_queue(rank, world_size, n_local)
    if rank == 0:
        rewinds = 0
        cursor = mq._cursor
        rewind = cursor._rewind_if_empty

        def counting(nbytes: int) -> None:
            nonlocal rewinds
            before = cursor.chunks
            rewind(nbytes)
            rewinds += cursor.chunks != before

        cursor._rewind_if_empty = counting
        for i in range(count):
            msg = mixed_message(i)
            # Every third message goes already encoded (as tensor dicts do):
            # readers must get the same object whichever path it takes.
            mq.enqueue(encode_message(msg) if i % 3 == 0 else msg, timeout=60)
            while rewind_span is not None and i % 10 == 0 and not mq.all_read():
                time.sleep(0.0005)  # now and then the readers catch up: a REWIND next
        result = count if rewind_span is None else rewinds
    else:
        kept = []
        for i in range(count):
            got = mq.dequeue(timeout=60)
            check_message(i, got)
            kept.append(got)
        # Every chunk was reused many times since: decoded values must not change.
        for i, got in enumerate(kept):
            check_message(i, got)
        result = len(kept)
    dist.barrier()
    mq.shutdown()
    return result


def test_order_kept_over_10000_mixed_messages_with_three_local_readers():
    assert run_ranks(_ordering_rank, 4, 3, 10_000, timeout=120) == [10_000] * 4


def test_order_kept_when_the_writer_starts_again_at_chunk_zero_whenever_the_ring_is_empty():
    # A REWIND chunk before every message written into an empty ring (not at chunk
    # 0): the writer's check races the readers' releases.
    results = run_ranks(_ordering_rank, 4, 2, 3_000, 1, timeout=120)  # 2 ring, 1 TCP
    assert results[1:] == [3_000] * 3
    assert results[0] >= 250, results[0]  # REWINDs written


def test_order_kept_with_local_and_remote_readers():
    # rank 1 reads the ring, ranks 2 and 3 read over TCP; messages spanning chunks included.
    assert run_ranks(_ordering_rank, 4, 1, 3_000, timeout=120) == [3_000] * 4


def _threads_rank(rank, world_size, n_local, count):
    """Two threads of each rank use one end at once: the writer's enqueue, the
    readers' dequeue. Before each end took one call at a time, two writer threads
    lost a message and left writer and reader waiting on each other."""
    import torch.distributed as dist

    mq = make_queue(rank, world_size, n_local, max_chunk_bytes=1 << 12, max_chunks=4)
    got: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for i in range(count):
                if rank == 0:
                    mq.enqueue({"thread": thread, "i": i, "pad": "x" * (i % 700)}, timeout=60)
                else:
                    msg = mq.dequeue(timeout=60)
                    assert msg["pad"] == "x" * (msg["i"] % 700)
                    got.append((msg["thread"], msg["i"]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    dist.barrier()
    mq.shutdown()
    if rank == 0:
        return None
    # Every message once (two reader threads: the order they record is their own).
    return sorted(got) == [(t, i) for t in (0, 1) for i in range(count)]


@pytest.mark.parametrize("n_local", [1, 0], ids=["shared memory", "TCP"])
def test_threads_of_a_rank_take_turns_on_one_end(n_local):
    assert run_ranks(_threads_rank, 2, n_local, 2_000, timeout=120) == [None, True]


def _turn_timeout_rank(rank, world_size):
    import torch.distributed as dist

    from shm_broadcast.errors import GroupcoordTimeoutError

    mq = make_queue(rank, world_size, 1)
    said = ""
    if rank == 0:
        dist.barrier()  # the reader's first thread is waiting by now
        time.sleep(0.8)
        mq.enqueue("late", timeout=30)
    else:
        first: list = []
        waiting = threading.Thread(target=lambda: first.append(mq.dequeue(timeout=30)))
        waiting.start()
        time.sleep(0.2)
        dist.barrier()
        try:
            mq.dequeue(timeout=0.3)  # its turn never comes before its deadline
        except GroupcoordTimeoutError as exc:
            said = str(exc)
        waiting.join()
        assert first == ["late"]
    dist.barrier()
    mq.shutdown()
    return said


def test_a_call_waiting_for_another_threads_call_keeps_its_own_deadline():
    _, said = run_ranks(_turn_timeout_rank, 2, timeout=60)
    assert "dequeue timed out after 0.3 s" in said and "another thread's call" in said


def _slow_remote_rank(rank, world_size, count):
    import torch.distributed as dist

    mq = make_queue(rank, world_size, 0, max_chunks=4)
    if rank == 0:
        start = time.monotonic()
        for i in range(count):
            mq.enqueue(i, timeout=60)
        result = time.monotonic() - start
    else:
        got = []
        for i in range(count):
            if i % 1000 == 0:
                time.sleep(0.05 * rank)  # readers of different slowness
            got.append(mq.dequeue(timeout=60))
        assert got == list(range(count))
        result = len(got)
    dist.barrier()
    mq.shutdown()
    return result


def test_burst_to_slow_remote_readers_loses_nothing():
    out = run_ranks(_slow_remote_rank, 4, 20_000, timeout=120)
    assert out[1:] == [20_000] * 3


def _refusal_rank(rank, world_size):
    import torch.distributed as dist

    mq = make_queue(rank, world_size, 1)
    if rank == 0:
        with pytest.raises(TypeError, match="defaultdict"):
            mq.enqueue({"bad": collections.defaultdict(list)})
        with pytest.raises(TypeError, match="lock"):
            mq.enqueue([threading.Lock()])
        mq.enqueue("still works")
        with pytest.raises(GroupcoordValueError):
            mq.dequeue()
        result = "writer"
    else:
        result = mq.dequeue(timeout=30)
        with pytest.raises(GroupcoordValueError):
            mq.enqueue(1)
    dist.barrier()
    mq.shutdown()
    return result


def test_unknown_types_are_refused_and_the_queue_stays_usable():
    assert run_ranks(_refusal_rank, 3, timeout=60) == ["writer", "still works", "still works"]


def _pickle_rank(rank, world_size):
    import torch.distributed as dist

    mq = make_queue(rank, world_size, 1, allow_pickle=True)
    if rank == 0:
        mq.enqueue({"counts": collections.defaultdict(list, a=[1, 2])})
        result = None
    else:
        got = mq.dequeue(timeout=30)
        assert got == {"counts": {"a": [1, 2]}}, got
        result = type(got["counts"]).__name__  # the launcher itself carries no pickle
    dist.barrier()
    mq.shutdown()
    return result


def test_allow_pickle_queue_carries_other_types():
    assert run_ranks(_pickle_rank, 3, timeout=60)[1:] == ["defaultdict"] * 2


def _group_rank(rank, world_size, writer_rank):
    pg_kind = os.environ.get("PG_KIND")
    import torch.distributed as dist

    init_gloo(rank, world_size)
    mq = MessageQueue.create_from_process_group(
        dist.group.WORLD, 1 << 12, 4, writer_rank=writer_rank
    )
    assert mq.role == ("writer" if rank == writer_rank else "local reader")
    got = []
    for i in range(50):
        obj = {"step": i, "data": torch.ones(i)} if rank == writer_rank else None
        got.append(mq.broadcast_object(obj)["step"])
    big = mq.broadcast_object(b"z" * 20000 if rank == writer_rank else None)
    dist.barrier()
    mq.shutdown()
    return pg_kind, got, len(big)


def test_create_from_process_group_and_broadcast_object():
    for res in run_ranks(_group_rank, 3, 1, timeout=60):
        assert res[1] == list(range(50)) and res[2] == 20000


def _single_reader_rank(rank, world_size):
    import torch.distributed as dist

    init_gloo(rank, world_size)
    mq, handles = MessageQueue.create_from_process_group_single_reader(
        dist.group.WORLD, 1 << 12, 4, reader_rank=0
    )
    readers = []
    if rank == 0:
        assert len(handles) == world_size and all(isinstance(h, Handle) for h in handles)
        readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
    mq.wait_until_ready(timeout=30)
    for r in readers:
        r.wait_until_ready(timeout=30)
    mq.enqueue({"from": rank})
    got = [r.dequeue(timeout=30)["from"] for r in readers]
    dist.barrier()
    for r in readers:
        r.shutdown()
    mq.shutdown()
    return got


def test_single_reader_queues_from_every_rank():
    assert run_ranks(_single_reader_rank, 3, timeout=60)[0] == [0, 1, 2]


def _single_reader_ring_too_big_rank(rank, world_size):
    import torch.distributed as dist

    from shm_broadcast.errors import ShmSpaceError
    from shm_broadcast.segments import shm_free_bytes

    init_gloo(rank, world_size)
    # Rank 2 (a writer, not the reader) asks for a ring larger than /dev/shm's room.
    chunk = shm_free_bytes() // 2 + 4096 if rank == 2 else 1 << 12
    with pytest.raises(ShmSpaceError) as raised:
        MessageQueue.create_from_process_group_single_reader(
            dist.group.WORLD, chunk, 2, reader_rank=0
        )
    dist.barrier()  # every rank came back: none waits for the others
    return str(raised.value)


def test_single_reader_queues_whose_ring_does_not_fit_are_refused_on_every_rank():
    for message in run_ranks(_single_reader_ring_too_big_rank, 3, timeout=60):
        assert "the queues of ranks [2] could not be created" in message, message


def _shutdown_wakes_rank(rank, world_size, n_local):
    import torch.distributed as dist

    mq = make_queue(rank, world_size, n_local)
    result = None
    if rank == 0:
        mq.enqueue("last", timeout=30)
    else:
        assert mq.dequeue(timeout=30) == "last"
    if rank == 1:
        # A reader idle in dequeue on one thread; shutdown() from another wakes it.
        caught = []

        def idle():
            try:
                mq.dequeue(timeout=60)
            except ClosedError:
                caught.append(time.monotonic())

        t = threading.Thread(target=idle)
        t.start()
        time.sleep(0.3)
        stop = time.monotonic()
        mq.shutdown()
        t.join(10)
        assert not t.is_alive() and caught
        result = caught[0] - stop
        with pytest.raises(ClosedError):
            mq.dequeue(timeout=1)
    dist.barrier()
    if rank == 0:
        time.sleep(0.3)
        mq.shutdown()
    if rank == 2:
        # The writer's shutdown ends a reader waiting in dequeue, promptly.
        start = time.monotonic()
        with pytest.raises(ClosedError, match="shut"):
            mq.dequeue(timeout=30)
        result = time.monotonic() - start
        mq.shutdown()
    return result


@pytest.mark.parametrize("n_local", [2, 0], ids=["ring", "tcp"])
def test_shutdown_wakes_an_idle_reader_promptly(n_local):
    results = run_ranks(_shutdown_wakes_rank, 3, n_local, timeout=60)
    assert results[1] < 1.0, f"reader woke {results[1]:.3f} s after its shutdown()"
    assert results[2] < 2.0, f"reader woke {results[2]:.3f} s after the writer's shutdown()"


def test_bad_arguments_are_refused():
    with pytest.raises(GroupcoordValueError, match="n_local_reader"):
        MessageQueue(1, 2)
    with pytest.raises(GroupcoordValueError, match="local_reader_ranks"):
        MessageQueue(2, 2, [1, 1])
    with pytest.raises(GroupcoordValueError, match="connect_ip"):
        MessageQueue(1, 0, connect_ip="*")
    with pytest.raises(GroupcoordValueError, match="max_chunk_bytes"):
        MessageQueue(1, 1, max_chunk_bytes=0)


def _object_group_rank(rank, world_size, port):
    from test_mq_group_io import StoreGroup

    pg = StoreGroup(rank, world_size, port)
    try:
        mq = MessageQueue.create_from_process_group(pg, 1 << 12, 4, writer_rank=2)
        got = [mq.broadcast_object(("step", i) if rank == 2 else None) for i in range(20)]
        role = mq.role
        # Every rank is done reading before the writer goes.
        pg.all_gather_obj(b"done")
        mq.shutdown()
    finally:
        pg.close()
    return role, got


def test_create_from_an_object_group():
    from coordinator.launch import free_port

    results = run_ranks(_object_group_rank, 3, free_port(), timeout=60)
    assert [r[0] for r in results] == ["local reader", "local reader", "writer"]
    for _, got in results:
        assert got == [("step", i) for i in range(20)]


def _external_writer_rank(rank, world_size):
    import torch.distributed as dist

    # Rank 0 writes a queue whose readers are ranks 1 and 2; the subgroup {1, 2}
    # then joins it through create_from_process_group(external_writer_handle=...).
    init_gloo(rank, world_size)
    sub = dist.new_group([1, 2])
    if rank == 0:
        mq = MessageQueue(2, 2, [0, 1], 1 << 12, 4, writer_rank=0)
        broadcast_bytes(dist.group.WORLD, dumps(mq.export_handle()))
        mq.wait_until_ready(timeout=30)
        for i in range(10):
            mq.enqueue(i)
        dist.barrier()
        mq.shutdown()
        return None
    handle = loads(broadcast_bytes(dist.group.WORLD, None))
    # Within the subgroup, ranks are 0 and 1: the handle's local reader ranks.
    mq = MessageQueue.create_from_process_group(
        sub, 1 << 12, 4, writer_rank=0, external_writer_handle=handle
    )
    got = [mq.dequeue(timeout=30) for _ in range(10)]
    dist.barrier()
    mq.shutdown()
    return got


def test_external_writer_handle_joins_every_rank_as_reader():
    results = run_ranks(_external_writer_rank, 3, timeout=60)
    assert results[1:] == [list(range(10))] * 2


def _too_big_rank(rank, world_size):
    from shm_broadcast.errors import ShmSpaceError
    from shm_broadcast.segments import shm_free_bytes

    with pytest.raises(ShmSpaceError, match="free"):
        MessageQueue(1, 1, max_chunk_bytes=shm_free_bytes() // 2 + 4096, max_chunks=2)
    return True


def test_a_ring_larger_than_free_shared_memory_is_refused():
    assert run_ranks(_too_big_rank, 1, timeout=30) == [True]


def _group_ring_too_big_rank(rank, world_size):
    import torch.distributed as dist

    from shm_broadcast.errors import ShmSpaceError
    from shm_broadcast.segments import shm_free_bytes

    init_gloo(rank, world_size)
    # Only the writer's size counts (the readers take the geometry from its handle).
    chunk = shm_free_bytes() // 2 + 4096 if rank == 1 else 1 << 12
    with pytest.raises(ShmSpaceError) as raised:
        MessageQueue.create_from_process_group(dist.group.WORLD, chunk, 2, writer_rank=1)
    # Every rank is free and in step: a queue that fits is built right after.
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, 1 << 12, 4, writer_rank=1)
    got = [mq.broadcast_object(i if rank == 1 else None) for i in range(3)]
    mq.shutdown()
    return str(raised.value), got


def test_a_group_queue_whose_ring_does_not_fit_is_refused_on_every_rank():
    """The writer cannot reserve its ring: it raises ShmSpaceError, and the readers,
    told so in place of the handle, raise it too (naming the writer) instead of
    waiting for a queue that will not come."""
    results = run_ranks(_group_ring_too_big_rank, 3, timeout=60)
    for rank, (message, got) in enumerate(results):
        assert "free" in message or "No space" in message, message
        assert ("writer rank 1 could not create the queue" in message) == (rank != 1), message
        assert got == [0, 1, 2]


def _stateless_group_rank(rank, world_size, port):
    from coordinator.stateless_group import StatelessProcessGroup

    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, timeout=30)
    try:
        mq = MessageQueue.create_from_process_group(pg, 1 << 12, 4, writer_rank=0)
        got = [mq.broadcast_object({"i": i} if rank == 0 else None) for i in range(20)]
        pg.barrier()
        mq.shutdown()
    finally:
        pg.close()
    return got


def test_create_from_the_coordinators_stateless_process_group():
    from coordinator.launch import free_port

    for got in run_ranks(_stateless_group_rank, 3, free_port(), timeout=60):
        assert got == [{"i": i} for i in range(20)]


@pytest.mark.long
@pytest.mark.timeout(900)
def test_long_mixed_stream_to_local_and_remote_readers():
    # --long: 200,000 mixed messages (some spanning chunks) to 3 ring + 1 TCP reader.
    assert run_ranks(_ordering_rank, 5, 3, 200_000, timeout=800) == [200_000] * 5


def test_recv_decodes_a_codec_message_from_a_socket_and_times_out() -> None:
    import zmq

    from shm_broadcast import memory_fence, to_bytes_big
    from shm_broadcast.codec import encode_message, frames_as_buffers
    from shm_broadcast.errors import GroupcoordTimeoutError

    assert to_bytes_big(258, 4) == b"\x00\x00\x01\x02"
    memory_fence()  # callable on every platform
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://mq-recv")
        b.connect("inproc://mq-recv")
        sent = {"step": 3, "t": torch.arange(5)}
        a.send_multipart(frames_as_buffers(encode_message(sent)))
        got = MessageQueue.recv(b, timeout=5)
        assert got["step"] == 3 and torch.equal(got["t"], sent["t"])
        start = time.monotonic()
        with pytest.raises(GroupcoordTimeoutError, match="recv"):
            MessageQueue.recv(b, timeout=0.2)
        assert time.monotonic() - start < 2
        a.close(linger=0)
        b.close(linger=0)
    finally:
        ctx.term()


def test_shm_ring_buffer_with_vllms_constructor_handle_and_views() -> None:
    from shm_broadcast import ShmRingBuffer

    ring = ShmRingBuffer(2, 4096, 3)  # n_reader, max_chunk_bytes, max_chunks: creates
    try:
        assert ring.handle() == (2, 4096, 3, ring.name)
        other = ShmRingBuffer(*ring.handle())  # vLLM's way to map it elsewhere
        try:
            with ring.get_data(1) as data:
                assert len(data) == 4096
                data[:5] = b"hello"
            with other.get_data(1) as seen:
                assert bytes(seen[:5]) == b"hello"
            with ring.get_metadata(2) as flags:
                assert len(flags) == 1 + 2  # written, then one flag per reader
                flags[0] = 1
            with other.get_metadata(2) as flags:
                assert bytes(flags) == b"\x01\x00\x00"
            # Each chunk's flags on a cache line of its own: a reader's release of one
            # chunk and the writer's publish of the next store to different lines.
            starts = [ring.address + at for at in ring.written_at]
            assert all(at % 64 == 0 for at in starts), starts
        finally:
            other.close()
        with pytest.raises(GroupcoordValueError, match="not the"):
            ShmRingBuffer(3, 4096, 3, name=ring.name)  # geometry differs from the ring's
        with pytest.raises(GroupcoordValueError, match="current_idx"):
            with ring.get_data(3):
                pass
    finally:
        ring.close()
        ring.unlink()


def _raw_chunks_rank(rank, world_size):
    import torch.distributed as dist

    from shm_broadcast.errors import GroupcoordTimeoutError, ProtocolError

    mq = make_queue(rank, world_size, world_size - 1, max_chunk_bytes=1024, max_chunks=3)
    got: list = []
    try:
        if rank == 0:
            with pytest.raises(GroupcoordValueError, match="writer"):
                with mq.acquire_read(timeout=1):
                    pass
            for i in range(10):  # more than max_chunks: chunks are reused
                with mq.acquire_write(timeout=30) as buf:
                    assert len(buf) == 1024 - 64
                    buf[:4] = i.to_bytes(4, "little")
            with pytest.raises(RuntimeError, match="caller"):
                with mq.acquire_write(timeout=30) as buf:
                    buf[:4] = b"\xff\xff\xff\xff"
                    raise RuntimeError("the caller failed: nothing is published")
            mq.enqueue({"after": "raw"}, timeout=30)  # the codec path still works
            with mq.acquire_write(timeout=30) as buf:
                buf[:4] = (99).to_bytes(4, "little")
        else:
            for _ in range(10):
                with mq.acquire_read(timeout=30) as buf:
                    got.append(int.from_bytes(buf[:4], "little"))
            got.append(mq.dequeue(timeout=30))
            with pytest.raises(ProtocolError, match="acquire_read"):
                mq.dequeue(timeout=30)  # a raw chunk: refused, and released
            with pytest.raises(GroupcoordTimeoutError, match="acquire_read"):
                with mq.acquire_read(timeout=0.2):
                    pass
    finally:
        dist.barrier()
        mq.shutdown()
    return got


def test_acquire_write_and_acquire_read_move_raw_chunks_in_order():
    results = run_ranks(_raw_chunks_rank, 3, timeout=60)
    assert results[0] == []
    for got in results[1:]:
        assert got == [*range(10), {"after": "raw"}]


def test_raw_chunks_are_refused_where_remote_readers_cannot_see_them():
    mq = MessageQueue(2, 1, [1], 1 << 12, 2, "127.0.0.1")  # one local, one remote reader
    try:
        with pytest.raises(GroupcoordValueError, match="remote readers"):
            with mq.acquire_write(timeout=1):
                pass
    finally:
        mq.shutdown()


def test_spin_condition_spins_while_busy_sleeps_when_idle_and_wakes_on_notify():
    import zmq

    from shm_broadcast import SpinCondition

    ctx = zmq.Context()
    address = "inproc://spin-condition-test"
    writer = SpinCondition(False, ctx, address)
    reader = SpinCondition(True, ctx, address, busy_loop_s=0.05)
    try:
        time.sleep(0.1)  # the subscription reaches the PUB socket
        reader.record_read()
        start = time.monotonic()
        reader.wait(timeout_ms=2000)  # busy: a yield, back at once (not after 2 s)
        assert time.monotonic() - start < 0.5
        time.sleep(0.06)  # now idle
        start = time.monotonic()
        reader.wait(timeout_ms=200)  # nobody notifies: the timeout ends it
        assert 0.15 < time.monotonic() - start < 2.0
        woke = []

        def idle_wait():
            reader.wait(timeout_ms=10_000)
            woke.append(time.monotonic())

        # Each wait must end after (not before) the notify or cancel that ends it,
        # and long before its 10 s timeout.
        t = threading.Thread(target=idle_wait)
        t.start()
        time.sleep(0.2)
        notified = time.monotonic()
        writer.notify()
        t.join(5)
        assert woke and 0 <= woke[0] - notified < 2.0
        t = threading.Thread(target=idle_wait)
        t.start()
        time.sleep(0.2)
        cancelled = time.monotonic()
        reader.cancel()
        t.join(5)
        assert len(woke) == 2 and 0 <= woke[1] - cancelled < 2.0
        with pytest.raises(GroupcoordValueError, match="writer"):
            reader.notify()
    finally:
        writer.close()
        reader.close()
        ctx.term()


_STREAM_SIZES = [3000, 6000, 15000, 20000, 9000, 100, 12000, 7000]  # bytes, 4 KiB chunks
_CHUNK = 1 << 12


def _stream_message(i: int) -> dict:
    n = _STREAM_SIZES[i % len(_STREAM_SIZES)]
    return {"i": i, "t": torch.arange(n // 4, dtype=torch.int32) + i}


def _two_tensors() -> dict:
    return {"a": torch.arange(100_000), "b": torch.arange(70_000, dtype=torch.float32)}


def _streaming_rank(rank, world_size, count):
    import torch.distributed as dist

    # 4 chunks of 4 KiB: a message of 2-4 chunks streams through them, the reader
    # copying each chunk out as it is published; a 20000-byte one is larger than
    # the ring and the writer waits for chunks as it goes.
    mq = make_queue(rank, world_size, 2, max_chunk_bytes=_CHUNK, max_chunks=4)
    result = 0
    if rank == 0:
        cursor = mq._cursor  # the writer's place in the ring
        stream = cursor.write_stream
        streamed = []

        def counting(*args):
            streamed.append(1)
            return stream(*args)

        cursor.write_stream = counting
        for i in range(count):
            mq.enqueue(_stream_message(i), timeout=60)
        result = len(streamed)
        mq.enqueue(_two_tensors(), timeout=60)
    else:
        for i in range(count):
            got = mq.dequeue(timeout=60)
            want = _stream_message(i)
            assert got["i"] == i and torch.equal(got["t"], want["t"]), i
        result = count
        # Each tensor of a streamed message owns its memory: holding one does
        # not hold the other's (nor the whole message's).
        got = mq.dequeue(timeout=60)
        a, b = got["a"], got["b"]
        assert torch.equal(a, _two_tensors()["a"]) and torch.equal(b, _two_tensors()["b"])
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        assert a.untyped_storage().nbytes() < 2 * a.nbytes
    dist.barrier()
    mq.shutdown()
    return result


def test_messages_larger_than_a_chunk_stream_through_the_ring_in_order():
    count = 200
    results = run_ranks(_streaming_rank, 4, count, timeout=120)  # 2 ring readers, 1 over TCP
    larger = sum(1 for i in range(count) if _STREAM_SIZES[i % len(_STREAM_SIZES)] > _CHUNK)
    assert results == [larger, count, count, count]


def _admission_rank(rank, world_size):
    import torch.distributed as dist

    from shm_broadcast.errors import GroupcoordTimeoutError

    mq = make_queue(rank, world_size, 1, max_chunk_bytes=_CHUNK, max_chunks=4)
    if rank == 0:
        mq.enqueue(_stream_message(1), timeout=10)  # 6000 bytes: 2 chunks
        mq.enqueue(_stream_message(9), timeout=10)  # 2 more: the ring is full
        dist.barrier()  # the reader takes the first: 2 chunks free
        dist.barrier()
        # 9000 bytes need 3 chunks and 2 are free: it waits for all 3 before
        # writing any, so the timeout leaves nothing half-sent.
        with pytest.raises(GroupcoordTimeoutError):
            mq.enqueue(_stream_message(4), timeout=0.3)
        assert not mq._cursor.broken
        dist.barrier()
        mq.enqueue(_stream_message(4), timeout=10)
        got = None
    else:
        dist.barrier()
        got = [mq.dequeue(timeout=10)["i"]]
        dist.barrier()
        dist.barrier()
        got += [mq.dequeue(timeout=10)["i"] for _ in range(2)]
    dist.barrier()
    mq.shutdown()
    return got


def test_a_timeout_before_a_streamed_message_leaves_the_queue_usable():
    assert run_ranks(_admission_rank, 2, timeout=60) == [None, [1, 9, 4]]


def _rewinding_pair(
    monkeypatch: pytest.MonkeyPatch, span: int = 40_000
) -> tuple[MessageQueue, MessageQueue]:
    """An in-process pair (eight 64 KiB chunks) whose writer rewinds once messages
    of 20,000 bytes or more add up to ``span`` bytes since chunk 0."""
    from shm_broadcast import ring_messages

    monkeypatch.setattr(ring_messages, "REWIND_MIN_BYTES", 20_000)
    monkeypatch.setattr(ring_messages, "REWIND_SPAN_BYTES", span)
    return local_pair(max_chunks=8)


def _rewind_sample(i: int) -> object:
    """About 30 KB each, as a lone tensor, an inline dict, or (every third) a
    100 KB tensor streamed through two 64 KiB chunks."""
    if i % 3 == 0:
        return torch.full((25_000,), i, dtype=torch.int32)
    if i % 3 == 1:
        return torch.full((7_500,), i, dtype=torch.int32)
    return {"i": i, "b": bytes([i % 256]) * 30_000}


def _same(got: object, want: object) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    return got == want


def test_a_writer_whose_reader_keeps_up_starts_again_at_chunk_zero(monkeypatch):
    # Past REWIND_SPAN_BYTES since chunk 0, a message into an empty ring starts at
    # chunk 0 again (the chunks stay in cache); with the reader behind, ring order.
    writer, reader = _rewinding_pair(monkeypatch)
    cursor = writer._cursor
    try:
        places = []
        for i in range(30):  # one at a time: the ring is empty before each
            writer.enqueue(_rewind_sample(i), timeout=5)
            places.append(cursor.idx)
            assert _same(reader.dequeue(timeout=5), _rewind_sample(i)), i
        assert max(places) <= 3 < cursor.chunks - 30  # without REWINDs: all 8 chunks
        for i in range(30, 35):  # a burst: the reader is behind (7 of the 8 chunks)
            writer.enqueue(_rewind_sample(i), timeout=1)
        for i in range(30, 35):
            assert _same(reader.dequeue(timeout=5), _rewind_sample(i)), i
        writer.enqueue(_rewind_sample(35), timeout=5)
        assert cursor.idx <= 2  # empty again: from chunk 0
        assert reader.drop_unread() == 1  # sees the message past the REWIND
        with writer.acquire_write(timeout=5) as view:
            view[:3] = b"raw"
        with reader.acquire_read(timeout=5) as view:
            assert bytes(view[:3]) == b"raw"
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_rewind_takes_no_room_from_a_burst_that_follows_it(monkeypatch):
    # The REWIND chunk is still unread when the writer comes round to it: it steps
    # over it, so the ring holds as many messages without a reader as before.
    from shm_broadcast.errors import GroupcoordTimeoutError

    writer, reader = _rewinding_pair(monkeypatch)
    cursor = writer._cursor
    one_chunk = torch.arange(7_500, dtype=torch.int32)  # 30,000 bytes
    try:
        writer.enqueue(one_chunk, timeout=5)
        reader.dequeue(timeout=5)
        writer.enqueue(one_chunk + 1, timeout=5)  # REWIND in chunk 1, this in chunk 0
        # Chunk 1's REWIND is unread as chunk 0 is published: the next is chunk 2.
        assert (cursor.idx, cursor.left_rewind) == (2, None)
        assert writer.takes_without_waiting([one_chunk.nbytes] * 6)
        assert not writer.takes_without_waiting([one_chunk.nbytes] * 7)
        for i in range(2, 8):  # chunks 2-7, stepping over the unread REWIND
            writer.enqueue(one_chunk + i, timeout=1)
        assert (cursor.idx, cursor.left_rewind) == (0, None)
        with pytest.raises(GroupcoordTimeoutError):  # all 8 hold what is unread
            writer.enqueue(one_chunk + 8, timeout=0.2)
        for i in range(1, 8):
            assert torch.equal(reader.dequeue(timeout=5), one_chunk + i), i
        writer.enqueue(one_chunk + 8, timeout=5)
        assert torch.equal(reader.dequeue(timeout=5), one_chunk + 8)
    finally:
        writer.shutdown()
        reader.shutdown()


def test_no_rewind_while_a_reader_is_behind_a_rewind_it_has_passed(monkeypatch):
    # The chunk before the writer's place is a REWIND it stepped over, which the
    # reader has read, but the reader has not read what came after it: the ring is
    # not empty, so the next message goes on in ring order (a rewind would put it
    # behind the unread chunks and make the one after it wait).
    writer, reader = _rewinding_pair(monkeypatch, span=80_000)
    cursor = writer._cursor
    one_chunk = torch.arange(7_500, dtype=torch.int32)  # 30,000 bytes
    try:
        for i in range(2):  # chunks 0 and 1, read
            writer.enqueue(one_chunk + i, timeout=5)
            assert torch.equal(reader.dequeue(timeout=5), one_chunk + i)
        writer.enqueue(one_chunk + 2, timeout=5)  # REWIND in chunk 2, this in chunk 0
        writer.enqueue(one_chunk + 3, timeout=5)  # chunk 1, stepping over chunk 2
        assert cursor.idx == 3
        assert torch.equal(reader.dequeue(timeout=5), one_chunk + 2)  # reads the REWIND
        writer.enqueue(one_chunk + 4, timeout=5)  # chunk 3: chunk 1 is unread
        assert cursor.idx == 4
        writer.enqueue(one_chunk + 5, timeout=1)
        for i in range(3, 6):
            assert torch.equal(reader.dequeue(timeout=5), one_chunk + i), i
    finally:
        writer.shutdown()
        reader.shutdown()


def test_an_end_interrupted_as_it_steps_over_a_rewind_shuts_its_end(monkeypatch):
    # Between the REWIND chunk's publish (writer) or release (reader) and the
    # cursor's move to chunk 0: the end is one chunk off what the ring says.
    from test_mq_faults import interrupt_once_after_the_step

    writer, reader = _rewinding_pair(monkeypatch)
    try:
        for _ in range(2):
            writer.enqueue(_rewind_sample(1), timeout=5)
            reader.dequeue(timeout=5)
        interrupt_once_after_the_step(writer)  # the next step is the REWIND's
        with pytest.raises(KeyboardInterrupt):
            writer.enqueue(_rewind_sample(1), timeout=5)
        with pytest.raises(ClosedError, match="part-way"):
            writer.enqueue(_rewind_sample(1), timeout=5)
        # A REWIND with no message after it: the reader follows it and finds none.
        with pytest.raises(ClosedError, match="writer shut the queue down"):
            reader.dequeue(timeout=5)
    finally:
        writer.shutdown()
        reader.shutdown()
    writer, reader = _rewinding_pair(monkeypatch)
    try:
        for i in range(3):
            writer.enqueue(_rewind_sample(1), timeout=5)
            if i < 2:
                reader.dequeue(timeout=5)
        interrupt_once_after_the_step(reader)  # its next step is over the REWIND
        with pytest.raises(KeyboardInterrupt):
            reader.dequeue(timeout=5)
        with pytest.raises(ClosedError, match="part-way"):
            reader.dequeue(timeout=5)
    finally:
        writer.shutdown()
        reader.shutdown()
