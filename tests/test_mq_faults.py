"""MessageQueue under faults: timeouts, SIGKILLed peers, forged TCP frames."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import pytest
import zmq
from fake_writer import fake_remote_writer
from ready_flags import mark, wait_for
from test_mq_queue import local_pair, make_queue

from coordinator.launch import start_ranks
from shm_broadcast.codec import Codec, frames_as_buffers
from shm_broadcast.errors import GroupcoordTimeoutError, PeerDiedError
from shm_broadcast.message_queue import Handle, MessageQueue
from shm_broadcast.segments import list_segments
from shm_broadcast.tcp_channel import WINDOW_MESSAGES
from shm_broadcast.tcp_frames import KIND_MESSAGE, pack_frames

SHORT_HEARTBEAT = 2.0


def _fast_peer_checks():
    from shm_broadcast.config import set_config

    set_config(heartbeat_timeout_s=SHORT_HEARTBEAT, peer_check_interval_s=0.2)


def _timeout_rank(rank, world_size, n_local):
    import torch.distributed as dist

    mq = make_queue(rank, world_size, n_local, max_chunks=2)
    result = None
    if rank == 0:
        with pytest.raises(GroupcoordTimeoutError) as info:
            # The ring holds 2, the TCP credit window WINDOW_MESSAGES: both run out.
            for i in range(WINDOW_MESSAGES + 100):
                mq.enqueue(i, timeout=0.5)
        result = (str(info.value), info.value.missing, isinstance(info.value, TimeoutError))
    dist.barrier()  # readers read nothing until the writer timed out
    if rank != 0:
        with pytest.raises(GroupcoordTimeoutError) as info:
            for _ in range(WINDOW_MESSAGES + 100):
                mq.dequeue(timeout=0.5)
        result = (str(info.value), info.value.missing)
    dist.barrier()
    mq.shutdown()
    return result


@pytest.mark.parametrize("n_local", [2, 0], ids=["ring", "tcp"])
def test_timeouts_name_queue_role_and_missing_ranks(n_local):
    group = start_ranks(_timeout_rank, 3, n_local, timeout=60)
    writer, r1, r2 = group.collect()
    message, missing, is_timeout = writer
    assert is_timeout
    assert missing == [1, 2]
    assert "MessageQueue" in message and "enqueue" in message and "writer" in message
    assert "[1, 2]" in message and "0.5 s" in message
    for rank, (message, missing) in ((1, r1), (2, r2)):
        assert missing == [0]
        assert (
            "dequeue" in message
            and f"rank {rank}" in message
            and "waiting for ranks [0]" in message
        )
        assert "the writer has not written" in message


def _no_writer_rank(rank, world_size):
    handle = Handle(
        name="nowriter",
        n_reader=1,
        local_reader_ranks=[],
        writer_rank=0,
        writer_pid=os.getpid(),
        writer_host="h",
        max_chunk_bytes=1024,
        max_chunks=2,
        buffer_name=None,
        local_address=None,
        remote_address="tcp://127.0.0.1:1",  # nobody listens
        key=b"k" * 32,
        window=16,
        allow_pickle=False,
    )
    mq = MessageQueue.create_from_handle(handle, 3)
    start = time.monotonic()
    with pytest.raises(GroupcoordTimeoutError) as info:
        mq.dequeue(timeout=0.3)
    took = time.monotonic() - start
    mq.shutdown()
    return str(info.value), took


def test_reader_without_a_writer_times_out():
    ((message, took),) = start_ranks(_no_writer_rank, 1, timeout=30).collect()
    assert "MessageQueue nowriter: dequeue timed out after 0.3 s" in message
    assert "remote reader rank 3" in message and "waiting for ranks [0]" in message
    assert took < 2.0


def _killed_writer_rank(rank, world_size, n_local, flag_dir):
    _fast_peer_checks()
    mq = make_queue(rank, world_size, n_local)
    if rank == 0:
        mark(flag_dir, "ready")
        i = 0
        while True:  # until SIGKILLed mid-stream
            mq.enqueue(i, timeout=60)
            i += 1
    got = []
    with pytest.raises(PeerDiedError) as info:
        while True:
            got.append(mq.dequeue(timeout=60))
    assert got == list(range(len(got)))
    return time.monotonic(), info.value.dead, len(got)


@pytest.mark.parametrize("n_local", [2, 0], ids=["ring", "tcp"])
def test_sigkilled_writer_is_detected_by_readers(n_local):
    with tempfile.TemporaryDirectory() as flag_dir:
        group = start_ranks(_killed_writer_rank, 3, n_local, flag_dir, timeout=60)
        wait_for(flag_dir, "ready")
        time.sleep(0.3)
        killed_at = time.monotonic()
        group.kill(0)
        results = group.collect(killed=[0])
    for detected_at, dead, count in results[1:]:
        assert dead == [0]
        assert detected_at - killed_at < 5.0
        assert count > 0
    # The readers unlinked the dead writer's ring.
    assert not [s for s in list_segments() if s.startswith(f"groupcoord_{group.pid(0)}_")]


def _killed_reader_rank(rank, world_size, n_local, flag_dir):
    _fast_peer_checks()
    mq = make_queue(rank, world_size, n_local)
    if rank == 0:
        with pytest.raises(PeerDiedError) as info:
            for i in range(10**9):
                mq.enqueue(i, timeout=60)
        detected_at = time.monotonic()
        mq.shutdown()
        return detected_at, info.value.dead
    if rank == 2:
        mq.dequeue(timeout=30)
        mark(flag_dir, "ready")
        time.sleep(60)  # SIGKILLed here
    # rank 1 keeps reading until the writer gives up
    with pytest.raises((PeerDiedError, Exception)):
        while True:
            mq.dequeue(timeout=30)
    mq.shutdown()
    return None


@pytest.mark.parametrize("n_local", [2, 0], ids=["ring", "tcp"])
def test_sigkilled_reader_is_detected_by_the_writer(n_local):
    with tempfile.TemporaryDirectory() as flag_dir:
        group = start_ranks(_killed_reader_rank, 3, n_local, flag_dir, timeout=60)
        wait_for(flag_dir, "ready")
        killed_at = time.monotonic()
        group.kill(2)
        results = group.collect(killed=[2])
    detected_at, dead = results[0]
    assert dead == [2]
    assert detected_at - killed_at < 5.0


def _forged_to_writer_rank(rank, world_size):
    import torch.distributed as dist

    mq = make_queue(rank, world_size, 0)
    forged = 0
    if rank == 2:
        # A stranger on the writer's TCP port: garbage, and frames with a wrong key.
        handle = mq._handle
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)
        rogue.connect(handle.remote_address)
        rogue.send_multipart([b"garbage"])
        body = (1).to_bytes(8, "little") + bytes(8)  # "I am reader rank 1"
        for kind in (b"H", b"A", b"B"):
            rogue.send_multipart(pack_frames(b"wrong" * 6, kind, 1, [body]))
        forged = 4
        time.sleep(0.5)
        rogue.close(linger=0)
        ctx.term()
    dist.barrier()
    if rank == 0:
        for i in range(50):
            mq.enqueue(("after", i), timeout=30)
        result = mq.bad_frames
    else:
        got = [mq.dequeue(timeout=30) for _ in range(50)]
        assert got == [("after", i) for i in range(50)]
        result = forged
    dist.barrier()
    mq.shutdown()
    return result


def test_forged_frames_to_the_writer_are_dropped_and_counted():
    group = start_ranks(_forged_to_writer_rank, 3, timeout=60)
    bad_frames, _, forged = group.collect()
    assert bad_frames == forged == 4


def _forged_to_reader_rank(rank, world_size):
    # This rank plays the writer's TCP end itself to send a forged frame.
    ctx, router, handle = fake_remote_writer("forged", max_chunk_bytes=1024, max_chunks=2)
    key = handle.key
    reader = MessageQueue.create_from_handle(handle, 1)
    while True:  # the reader's HELLO (its heartbeat thread may speak first)
        assert router.poll(10_000)
        ident, envelope = router.recv_multipart()
        if envelope[:1] == b"H":
            break
    codec = Codec()

    def send(obj, seq, mac_key):
        body = frames_as_buffers(codec.encode(obj))
        router.send_multipart([ident, *pack_frames(mac_key, KIND_MESSAGE, seq, body)])

    send("forged", 1, b"not the key")
    # A genuine MAC over "genuine", with the payload swapped for another.
    genuine = pack_frames(key, KIND_MESSAGE, 1, frames_as_buffers(codec.encode("genuine")))
    altered = bytes(genuine[0][:25]) + codec.encode("altered").header
    router.send_multipart([ident, altered])
    send("genuine", 1, key)
    send("genuine", 1, key)  # a replay: right MAC, old sequence number
    send("second", 2, key)
    got = [reader.dequeue(timeout=10), reader.dequeue(timeout=10)]
    bad = reader.bad_frames
    reader.shutdown()
    router.close(linger=0)
    ctx.term()
    return got, bad


def test_forged_frames_to_a_reader_are_dropped_and_counted():
    ((got, bad),) = start_ranks(_forged_to_reader_rank, 1, timeout=30).collect()
    assert got == ["genuine", "second"]
    assert bad == 3  # wrong key, altered payload, replay


_WRITER_THAT_RETURNS = """
import sys
from shm_broadcast.codec import dumps
from shm_broadcast.message_queue import MessageQueue

mq = MessageQueue(2, 1, [1], 1 << 16, 4, "127.0.0.1")  # a local and a remote reader
sys.stdout.write(dumps(mq.export_handle()).hex() + "\\n")
sys.stdout.flush()
mq.wait_until_ready(timeout=30)
mq.enqueue({"step": 1}, timeout=30)
# The script ends here without shutdown(), as an engine's main often does.
"""


def test_a_writer_that_exits_without_shutdown_shuts_its_queue_down():
    import subprocess
    import sys

    from shm_broadcast.codec import loads
    from shm_broadcast.errors import ClosedError

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER_THAT_RETURNS], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        handle = loads(bytes.fromhex(writer.stdout.readline().strip()))
        readers = [MessageQueue.create_from_handle(handle, rank) for rank in (1, 2)]
        for reader in readers:
            reader.wait_until_ready(timeout=30)
        assert [r.dequeue(timeout=30) for r in readers] == [{"step": 1}, {"step": 1}]
        assert writer.wait(timeout=20) == 0  # ZeroMQ does not hold the exit up
        for reader in readers:
            start = time.monotonic()
            # Told the queue ended (the exit hook shut it down), not a dead writer.
            with pytest.raises(ClosedError, match="shut"):
                reader.dequeue(timeout=10)
            assert time.monotonic() - start < 5
            reader.shutdown()
        assert not [s for s in list_segments() if f"_{writer.pid}_" in s]
    finally:
        writer.kill()
        writer.wait()


_QUEUES_IN_A_CYCLE = """
import gc, time
from shm_broadcast.message_queue import MessageQueue

w = MessageQueue(2, 1, [1], 1 << 12, 4, "127.0.0.1")  # a ring reader and a TCP reader
h = w.export_handle()
readers = [MessageQueue.create_from_handle(h, rank) for rank in (1, 2)]
for q in (w, *readers):
    q.cycle = q  # never shut down, and only the cyclic garbage collector can free it
del w, readers, q
gc.collect()
print("collected", flush=True)
"""


def test_queues_collected_without_shutdown_do_not_hang_the_collector():
    # Before: the cyclic GC cleared the sockets' weak references first, so the
    # context's finaliser waited forever in zmq_ctx_term for sockets it could
    # no longer close (a rank hung inside an unrelated allocation).
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _QUEUES_IN_A_CYCLE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr


def test_handshake_socket_files_of_dead_writers_are_swept():
    import subprocess
    import sys

    from shm_broadcast.liveness import pid_namespace
    from shm_broadcast.mq_handle import cleanup_stale_ipc_files, ipc_path

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(gone.stdout)
    ns = pid_namespace()
    names = {
        "dead": f"groupcoord_{dead_pid}_ring_0badc0ffee00n{ns}",
        "alive": f"groupcoord_{os.getpid()}_ring_0badc0ffee01n{ns}",
        "other_namespace": f"groupcoord_{dead_pid}_ring_0badc0ffee02n{ns + 1}",
    }
    paths = {k: ipc_path(v) for k, v in names.items()}
    assert all(os.path.dirname(p) == tempfile.gettempdir() for p in paths.values())
    try:
        for p in paths.values():
            open(p, "w").close()
        removed = cleanup_stale_ipc_files()
        assert os.path.basename(paths["dead"]) in removed
        assert not os.path.exists(paths["dead"])
        assert os.path.exists(paths["alive"])  # its writer (this process) lives
        assert os.path.exists(paths["other_namespace"])  # cannot be judged from here
    finally:
        for p in paths.values():
            if os.path.exists(p):
                os.unlink(p)


class _TakenThenInterrupted:
    """An end's call lock whose first acquire takes the real lock and then raises
    KeyboardInterrupt: what an exception from a signal handler does when it lands
    just after ``acquire()`` returned, before the call's try block (the interpreter
    runs pending handlers as a call returns)."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.fired = False

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        got = self.lock.acquire(*args, **kwargs)
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return got

    def release(self) -> None:
        self.lock.release()

    def _is_owned(self) -> bool:
        return self.lock._is_owned()


def test_a_call_interrupted_as_it_takes_the_lock_leaves_the_end_usable():
    # The lock stayed held: every later enqueue (or dequeue) waited to its deadline
    # ("another thread's call on this end of the queue did not end"), for ever
    # with timeout=None (vLLM's semantics).
    writer, reader = local_pair()
    try:
        for end, call in (
            (writer, lambda: writer.enqueue({"step": 1}, timeout=5)),
            (reader, lambda: reader.dequeue(timeout=5)),
        ):
            real = end._call_lock
            end._call_lock = _TakenThenInterrupted(real)
            with pytest.raises(KeyboardInterrupt):
                call()
            end._call_lock = real
        start = time.monotonic()
        writer.enqueue({"step": 2}, timeout=5)
        assert reader.dequeue(timeout=5) == {"step": 2}  # nothing of step 1 was sent
        assert time.monotonic() - start < 1
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_call_made_inside_a_running_call_of_its_thread_is_refused_at_once():
    # From a callback of the call (or a signal handler): it waited for its own
    # thread to its deadline, then blamed "another thread's call".
    from shm_broadcast.errors import GroupcoordValueError

    writer, reader = local_pair(max_chunks=2)
    try:
        writer.enqueue(1, timeout=5)
        writer.enqueue(2, timeout=5)  # the ring is full: the next enqueue waits

        def inside(ranks: list[int], ready: Any) -> None:
            writer.enqueue("inside", timeout=5)

        start = time.monotonic()
        with pytest.raises(GroupcoordValueError, match="one call at a time"):
            writer.enqueue(3, timeout=5, stall_check=inside)
        assert time.monotonic() - start < 2
        assert [reader.dequeue(timeout=5) for _ in range(2)] == [1, 2]
        writer.enqueue(4, timeout=5)  # the end goes on
        assert reader.dequeue(timeout=5) == 4
    finally:
        writer.shutdown()
        reader.shutdown()


def interrupt_once_after_the_step(end: MessageQueue) -> None:
    """The end's next chunk publish (writer) or release (reader) is followed by a
    KeyboardInterrupt before its cursor moves on: an exception from a signal
    handler landing between the two (Python runs pending handlers as a call
    returns)."""
    ring = end._cursor.ring
    step = "publish" if end.role == "writer" else "release"
    real = getattr(ring, step)

    def interrupted(*args: Any) -> None:
        delattr(ring, step)  # the class's method again
        real(*args)
        raise KeyboardInterrupt

    setattr(ring, step, interrupted)


def test_a_reader_interrupted_between_release_and_moving_on_shuts_its_end():
    # Its cursor stayed on the chunk it had released: it waited there, and once
    # the writer reused that chunk it returned message 5 before 2, 3 and 4.
    from shm_broadcast.errors import ClosedError

    writer, reader = local_pair(max_chunks=4)
    try:
        for i in range(1, 4):
            writer.enqueue(i, timeout=5)
        interrupt_once_after_the_step(reader)
        with pytest.raises(KeyboardInterrupt):
            reader.dequeue(timeout=5)  # message 1: read, released, then interrupted
        writer.enqueue(4, timeout=5)
        writer.enqueue(5, timeout=5)  # into the chunk message 1 left
        with pytest.raises(ClosedError, match="part-way"):
            reader.dequeue(timeout=5)
        with pytest.raises(ClosedError, match="reader rank 1 shut down"):
            for i in range(6, 12):  # the ring fills: the writer is told, not left waiting
                writer.enqueue(i, timeout=5)
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_writer_interrupted_between_publish_and_moving_on_shuts_its_end():
    # Its cursor stayed on the chunk it had published: its next message went into
    # that chunk once read, where the reader, one chunk on, never looked (lost).
    from shm_broadcast.errors import ClosedError

    writer, reader = local_pair(max_chunks=4)
    try:
        interrupt_once_after_the_step(writer)
        with pytest.raises(KeyboardInterrupt):
            writer.enqueue(1, timeout=5)  # published, then interrupted
        with pytest.raises(ClosedError, match="part-way"):
            writer.enqueue(2, timeout=5)
        assert reader.dequeue(timeout=5) == 1  # what was published still arrives
        with pytest.raises(ClosedError, match="writer shut the queue down"):
            reader.dequeue(timeout=5)
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_call_interrupted_while_it_waits_leaves_the_end_usable():
    # Nothing of the call had moved: the end goes on (a Ctrl-C to an idle reader
    # must not cost the queue).
    import signal

    writer, reader = local_pair()

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt):
            reader.dequeue(timeout=5)  # nothing sent: it waits
        writer.enqueue(7, timeout=5)
        assert reader.dequeue(timeout=5) == 7
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        writer.shutdown()
        reader.shutdown()


def test_a_tcp_writer_interrupted_between_two_readers_shuts_its_end():
    # Its message number did not move: the next message went out under the same
    # number, and a reader that had the first dropped it as a replay (lost, silently).
    from shm_broadcast.errors import ClosedError

    writer, reader = local_pair(tcp=True)
    tcp = writer._tcp_writer
    real = tcp._send_raw

    def sent_then_interrupted(*args: Any) -> None:
        tcp._send_raw = real
        real(*args)
        raise KeyboardInterrupt  # as if before the next reader's send

    try:
        tcp._send_raw = sent_then_interrupted
        with pytest.raises(KeyboardInterrupt):
            writer.enqueue(1, timeout=5)
        with pytest.raises(ClosedError, match="part-way through sending"):
            writer.enqueue(2, timeout=5)
        assert reader.dequeue(timeout=5) == 1
        with pytest.raises(PeerDiedError, match="connection closed"):
            reader.dequeue(timeout=10)
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_tcp_reader_interrupted_as_it_takes_a_message_shuts_its_end():
    # The message was off the socket but not counted: the next dequeue raised
    # "expected message #1, got #2 (messages were lost on the way)".
    from shm_broadcast.errors import ClosedError

    writer, reader = local_pair(tcp=True)
    tcp = reader._tcp_reader
    real = tcp._pull

    def pulled_then_interrupted() -> Any:
        got = real()
        if got is not None:
            tcp._pull = real
            raise KeyboardInterrupt
        return got

    try:
        writer.enqueue(1, timeout=5)
        writer.enqueue(2, timeout=5)
        tcp._pull = pulled_then_interrupted
        with pytest.raises(KeyboardInterrupt):
            reader.dequeue(timeout=5)
        with pytest.raises(ClosedError, match="part-way through taking"):
            reader.dequeue(timeout=5)
    finally:
        writer.shutdown()
        reader.shutdown()
