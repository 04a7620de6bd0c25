"""Rank-side code of the hostile-wire tests: attackers, a fake TCP writer, pickle payloads.

Everything that opens ZeroMQ sockets runs here, in forked ranks: the pytest
process itself must stay free of ZeroMQ contexts and threads (it forks).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch.distributed as dist
from fake_writer import fake_remote_writer

from coordinator.launch import init_gloo

from ._wire import CreatesFile


def _good(seq: int) -> dict[str, Any]:
    return {"seq": seq, "pad": b"g" * (seq % 50)}


# ---- attacker frames at the real writer's ROUTER socket (hypothesis-driven) ----------


def attack_writer(rank: int, world: int, examples: int) -> dict[str, int]:
    """Rank 0 writes to remote reader rank 1 while an attacker socket floods the writer."""
    import zmq
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shm_broadcast.codec import dumps, loads
    from shm_broadcast.group_io import broadcast_bytes
    from shm_broadcast.message_queue import MessageQueue
    from shm_broadcast.tcp_frames import KIND_ACK, pack_frames

    init_gloo(rank, world)
    pg = dist.group.WORLD
    if rank == 0:
        mq = MessageQueue(1, 0, [], 4096, 4, "127.0.0.1")
        handle = loads(broadcast_bytes(pg, dumps(mq.export_handle()), 0))
    else:
        handle = loads(broadcast_bytes(pg, None, 0))
        mq = MessageQueue.create_from_handle(handle, 1)
    mq.wait_until_ready(timeout=60)
    try:
        if rank == 1:
            seq = 0
            while True:
                msg = mq.dequeue(timeout=60)
                if msg == "END":
                    return {"delivered": seq, "reader_bad_frames": mq.bad_frames}
                assert msg == _good(seq), f"message {seq} lost, reordered or changed: {msg!r}"
                seq += 1
        ctx = zmq.Context()
        attacker = ctx.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(handle.remote_address)
        sent = {"attacks": 0, "good": 0}

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            st.one_of(
                st.lists(st.binary(max_size=80), min_size=1, max_size=5),  # malformed
                st.just([b"A"]),  # truncated envelope
                # oversized: 256 KiB-1 MiB of noise (made here: hypothesis draws bytes slowly)
                st.integers(256 << 10, 1 << 20).map(lambda n: [random.Random(n).randbytes(n)]),
                st.integers(0, 2**64 - 1).map(  # a real reader's ACK replayed from elsewhere
                    lambda n: pack_frames(handle.key, KIND_ACK, n % 1000, [bytes(16)])
                ),
                st.integers(0, 255).map(  # forged: right shape, MAC made with another key
                    lambda k: pack_frames(bytes([k]) * 32, KIND_ACK, 1, [bytes(16)])
                ),
            )
        )
        def attack(frames: list[bytes]) -> None:
            attacker.send_multipart(frames)
            sent["attacks"] += 1
            if sent["attacks"] % 7 == 0:
                mq.enqueue(_good(sent["good"]), timeout=30)
                sent["good"] += 1

        attack()
        # Let the last attack frames arrive; enqueue drains and checks everything waiting.
        time.sleep(0.5)
        mq.enqueue("END", timeout=30)
        attacker.close()
        ctx.term()
        return {**sent, "writer_bad_frames": mq.bad_frames}
    finally:
        dist.barrier()
        mq.shutdown()


# ---- a fake writer sending hostile frames to a real TCP reader -------------------------


def _hostile(rng: random.Random, key: bytes, seq: int, last_valid: list[Any]) -> list[Any]:
    from shm_broadcast.tcp_frames import KIND_MESSAGE, pack_frames

    kind = rng.randrange(5)
    if kind == 0:  # malformed: random frames
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    if kind == 1:  # forged: the right shape, MAC from another key
        return pack_frames(rng.randbytes(32), KIND_MESSAGE, seq, [b"\x00" * 16])
    if kind == 2:  # truncated: a valid frame cut short
        frames = list(last_valid) if last_valid else [b"M" * 30]
        frames[0] = bytes(frames[0])[: rng.randrange(1, max(2, len(bytes(frames[0]))))]
        return frames
    if kind == 3:  # oversized: 512 KiB of noise in one frame
        return [rng.randbytes(512 << 10)]
    return list(last_valid) if last_valid else [b"R"]  # replayed: the previous good message


def fake_writer_to_reader(rank: int, world: int, n_events: int, seed: int, path: str) -> Any:
    """Rank 0 plays the writer by hand (it knows the key); rank 1 is a real remote reader."""

    from shm_broadcast.codec import Codec, dumps, frames_as_buffers, loads
    from shm_broadcast.group_io import broadcast_bytes
    from shm_broadcast.message_queue import MessageQueue
    from shm_broadcast.tcp_frames import (
        KIND_HELLO,
        KIND_MESSAGE,
        KIND_READY,
        pack_frames,
        unpack_frames,
    )

    init_gloo(rank, world)
    pg = dist.group.WORLD
    rng = random.Random(seed)
    # The writer's plan (g = good message, h = hostile frames, b = pickle bomb), then "END".
    plan = [rng.choice("gggghhhb") for _ in range(n_events)]
    if rank == 1:
        handle = loads(broadcast_bytes(pg, None, 0))
        mq = MessageQueue.create_from_handle(handle, 1)
        results: list[str] = []
        try:
            mq.wait_until_ready(timeout=60)
            good = 0
            # Read until the closing message, so every hostile frame before it was seen.
            while len(results) <= n_events:  # bounded even if the stream goes wrong
                try:
                    msg = mq.dequeue(timeout=30)
                except Exception as exc:  # noqa: BLE001 - recorded, judged by the test
                    kind = "b" if "allow_pickle" in str(exc) else "?"
                    results.append(f"{kind}:{type(exc).__name__}:{exc}")
                    continue
                if msg == "END":
                    break
                results.append("g:ok" if msg == _good(good) else f"g:WRONG {msg!r}")
                good += 1
            return {
                "results": results,
                "bad_frames": mq.bad_frames,
                "bomb_file": os.path.exists(path),
            }
        finally:
            dist.barrier()
            mq.shutdown()
    ctx, router, handle = fake_remote_writer("fake", max_chunk_bytes=4096, max_chunks=4)
    key = handle.key
    broadcast_bytes(pg, dumps(handle), 0)
    reader = None
    while reader is None:  # the reader's HELLO (heartbeats come from another socket)
        ident, *parts = router.recv_multipart()
        verified = unpack_frames(key, parts)
        if verified is not None and verified[0] == KIND_HELLO:
            reader = ident
    router.send_multipart([reader, *pack_frames(key, KIND_READY, 0, [b""])])
    pickling = Codec(allow_pickle=True)
    plain = Codec()
    seq, good, last_valid = 0, 0, []
    for step in plan:
        if step == "h":
            router.send_multipart([reader, *_hostile(rng, key, seq + 1, last_valid)])
            continue
        seq += 1
        if step == "b":  # a peer that pickles anyway: the reader must refuse to unpickle
            body = frames_as_buffers(pickling.encode([CreatesFile(path), b"x" * 100]))
        else:
            body = frames_as_buffers(plain.encode(_good(good)))
            good += 1
        last_valid = pack_frames(key, KIND_MESSAGE, seq, [bytes(b) for b in body])
        router.send_multipart([reader, *last_valid])
    end = frames_as_buffers(plain.encode("END"))
    router.send_multipart([reader, *pack_frames(key, KIND_MESSAGE, seq + 1, end)])
    dist.barrier()
    router.close()
    ctx.term()
    return {"hostile": plan.count("h"), "bombs": plan.count("b"), "good": good}


# ---- pickle payloads through every object path ----------------------------------------


def pickle_through_queue(rank: int, world: int, path: str) -> Any:
    """The writer pickles anyway (a hostile or misconfigured peer): one chunk, spanning
    chunks, streamed through the ring, and TCP."""
    from groupcoord_benchmarks import _mq_soak as _mq

    from shm_broadcast.codec import Codec

    init_gloo(rank, world)
    mq = _mq.build_queue(rank)
    try:
        if rank == _mq.WRITER:
            mq._codec = Codec(allow_pickle=True)  # bypass the writer's own refusal
            mq.enqueue([CreatesFile(path)])  # inline in a ring chunk
            mq.enqueue([CreatesFile(path), b"x" * (_mq.CHUNK_BYTES * 2)])  # spans chunks
            big = b"x" * (_mq.CHUNK_BYTES * _mq.CHUNKS * 2)
            mq.enqueue([CreatesFile(path), big])  # larger than the ring: streamed
            mq.enqueue({"after": "bombs"})
            return None
        outcomes = []
        for _ in range(3):
            try:
                mq.dequeue(timeout=30)
                outcomes.append("decoded")
            except Exception as exc:  # noqa: BLE001 - judged by the test
                outcomes.append(f"{type(exc).__name__}: {exc}")
        outcomes.append(repr(mq.dequeue(timeout=30)))
        return {"outcomes": outcomes, "file": os.path.exists(path), "role": mq.role}
    finally:
        dist.barrier()
        mq.shutdown()


def pickle_through_groups(rank: int, world: int, path: str, port: int) -> Any:
    """Hostile rank 0 sends a pickle where GroupCoordinator/StatelessProcessGroup expect objects."""
    from coordinator.group_coordinator import GroupCoordinator
    from coordinator.stateless_group import StatelessProcessGroup
    from shm_broadcast.codec import Codec, loads

    from ._wire import pickle_bomb, pickle_bomb_message

    init_gloo(rank, world)
    bomb = pickle_bomb(path)
    g = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="pk")
    s = StatelessProcessGroup.create("127.0.0.1", port, rank, world, timeout=30)
    outcomes: dict[str, str] = {}

    def refused(label: str, call: Any) -> None:
        try:
            call()
            outcomes[label] = "decoded"
        except Exception as exc:  # noqa: BLE001 - judged by the test
            outcomes[label] = f"{type(exc).__name__}: {exc}"

    try:
        if rank == 0:
            bomb_message = pickle_bomb_message(path)
            g._broadcast_bytes("broadcast_object", bomb_message, 0)  # as broadcast_object does
            g._broadcast_bytes("broadcast_object_list", bomb_message, 0)  # ... and the list form
            # As send_object does to a peer on this node: through the pair's channel ...
            assert g._p2p_channels.open_to(1, "send_object")
            channel = g._p2p_channels._writers[1]
            channel._codec = Codec(allow_pickle=True)  # bypass the sender's own refusal
            channel.enqueue(CreatesFile(path))
            g._traffic.count_message(sent=True)  # as send_object counts it
            g._send_bytes(bomb, 1, "send_object")  # ... and over Gloo to one elsewhere
            s.store.set("p2p/0/1/0", bomb)  # as send_obj does
            s.store.set("bcast/0/0", bomb)  # as broadcast_obj does
        else:
            refused("GroupCoordinator.broadcast_object", lambda: g.broadcast_object(src=0))
            refused(
                "GroupCoordinator.broadcast_object_list", lambda: g.broadcast_object_list([None])
            )
            refused("GroupCoordinator.recv_object", lambda: g.recv_object(src=0))
            refused(
                "GroupCoordinator.recv_object over Gloo",
                lambda: loads(g._recv_bytes(0, "recv_object")),
            )
            refused("StatelessProcessGroup.recv_obj", lambda: s.recv_obj(src=0))
            refused("StatelessProcessGroup.broadcast_obj", lambda: s.broadcast_obj(None, src=0))
        # The same groups then complete good calls.
        assert g.broadcast_object("fine" if rank == 0 else None, src=0) == "fine"
        assert s.all_gather_obj(rank) == list(range(world))
        outcomes["file"] = str(os.path.exists(path))
        return outcomes
    finally:
        dist.barrier()
        s.store = None
        g.destroy()
