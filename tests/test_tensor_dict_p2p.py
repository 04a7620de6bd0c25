"""send/recv_tensor_dict between ranks on one node: the shared-memory channels and Gloo.

Every case runs with real forked ranks. ``mode`` picks the path: ``shm``
(the default geometry), ``shm-split`` (tiny chunks, so tensors and metadata
travel in pieces) or ``gloo`` (``disable_shm_p2p``). The rank functions set
the config in code: forked ranks inherit the parent's already-read config.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import pytest
import torch
from ready_flags import mark, wait_for

from coordinator.errors import (
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
    PeerDiedError,
)
from coordinator.group_coordinator import GroupCoordinator
from coordinator.launch import init_gloo, run_ranks, start_ranks
from shm_broadcast import p2p_channels
from shm_broadcast.config import from_env, set_config
from shm_broadcast.segments import list_segments


def _setup(mode: str) -> None:
    set_config(disable_shm_p2p=mode == "gloo")
    if mode == "shm-split":
        # Chunks of 8 KiB: every larger tensor and big metadata stream in pieces.
        p2p_channels.P2P_CHUNK_BYTES = 4096 + 4096 + 256


def _group(rank: int, world: int, mode: str, **kwargs: Any) -> GroupCoordinator:
    _setup(mode)
    init_gloo(rank, world)
    return GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="pp", **kwargs)


def _sample(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 70, generator=g)  # 84 KB: not inline
    return {
        "step": seed,
        "names": ("a", "b"),
        "none": None,
        "f32": torch.randn(5, 3, generator=g),
        "bf16": torch.randn(40_000, generator=g).to(torch.bfloat16),  # 80 KB, separate
        "f16": torch.randn(7, generator=g).half(),
        "i8": torch.randint(-100, 100, (33_000,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (70_000,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(70_001, generator=g) > 0.5,
        "c64": torch.randn(9_000, generator=g, dtype=torch.complex64),
        "f8": torch.randn(70_000, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(10_000, dtype=torch.int64) * seed,
        "empty": torch.empty(0, 4, dtype=torch.int64),
        "empty_big_shape": torch.empty(100_000, 0),
        "scalar": torch.tensor(3.5 + seed),
        "view": big.t(),  # non-contiguous, separate
        "slice": big[::2, 1:],  # non-contiguous, separate
        "strided_small": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous, inline
    }


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            out = got[key]
            assert out.dtype == value.dtype and out.shape == value.shape, key
            raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (out, value)]
            assert torch.equal(raw[0], raw[1]), key
        else:
            assert got[key] == value, key


def _round_trips(rank: int, world: int, mode: str) -> dict[str, Any]:
    g = _group(rank, world, mode)
    held = []
    # Both directions, several times; every received dict is kept (the ring
    # is reused meanwhile) and checked at the end.
    for step in range(3):
        if rank == 0:
            g.send_tensor_dict(_sample(step), dst=1)
            held.append((step + 100, g.recv_tensor_dict(src=1)))
        else:
            got = g.recv_tensor_dict(src=0)
            held.append((step, got))
            g.send_tensor_dict(_sample(step + 100), dst=0)
    for seed, got in held:
        _same(got, _sample(seed))
    # Received tensors own writable memory.
    held[0][1]["i64"].add_(1)
    assert torch.equal(held[0][1]["i64"], _sample(held[0][0])["i64"] + 1)
    used = bool(g._p2p_channels._writers) and bool(g._p2p_channels._readers)
    mine = [s for s in list_segments() if s.split("_")[1] == str(os.getpid())]
    g.barrier()
    g.destroy()
    left = [s for s in list_segments() if s.split("_")[1] == str(os.getpid())]
    return {"used": used, "segments": len(mine), "left": left}


@pytest.mark.parametrize("mode", ["shm", "shm-split", "gloo"])
def test_tensor_dicts_round_trip_exactly(mode: str) -> None:
    results = run_ranks(_round_trips, 2, mode, timeout=90)
    for r in results:
        # Each rank wrote to its peer through its own ring, unless disabled ...
        assert r["used"] == (mode != "gloo")
        # ... whose name the receiver unlinked once it had mapped the ring: nothing
        # is in /dev/shm even while the rings are in use, nor after destroy().
        assert r["segments"] == 0
        assert r["left"] == []


def test_disable_shm_p2p_reads_its_environment_variable() -> None:
    assert from_env({"GROUPCOORD_DISABLE_SHM_P2P": "1"}).disable_shm_p2p is True
    assert from_env({}).disable_shm_p2p is False


def _tp2_pp2(rank: int, world: int, mode: str) -> tuple[GroupCoordinator, GroupCoordinator]:
    """The TP and PP groups of TP2 x PP2 on world 4: stages (0, 1) and (2, 3)."""
    _setup(mode)
    init_gloo(rank, world)
    tp = GroupCoordinator([[0, 1], [2, 3]], rank, "gloo", True, group_name="tp")
    pp = GroupCoordinator([[0, 2], [1, 3]], rank, "gloo", True, group_name="pp")
    return tp, pp


def _pipeline_slices(rank: int, world: int, mode: str) -> Any:
    """TP2 x PP2: stage 0 (ranks 0,1) sends 1/2 slices to stage 1 (ranks 2,3)."""
    tp, pp = _tp2_pp2(rank, world, mode)
    out: Any = None
    if pp.is_first_rank:
        me = float(tp.rank_in_group)
        pp.send_tensor_dict(
            {"sliced": torch.full((4, 3000), me), "odd": torch.full((3,), me), "tag": "x"},
            all_gather_group=tp,
        )
        out = bool(pp._p2p_channels._writers)
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp)
        assert got is not None
        # First half came from TP peer 0, second from TP peer 1: only slices travelled.
        assert torch.equal(got["sliced"][:2], torch.zeros(2, 3000))
        assert torch.equal(got["sliced"][2:], torch.ones(2, 3000))
        assert got["odd"].tolist() == [float(rank - 2)] * 3 and got["tag"] == "x"
        out = bool(pp._p2p_channels._readers)
    # The sender's ring goes with its group: destroy only once the peer received.
    pp.barrier()
    tp.destroy()
    pp.destroy()
    return out


@pytest.mark.parametrize("mode", ["shm", "shm-split"])
def test_all_gather_group_slices_travel_through_shared_memory(mode: str) -> None:
    assert run_ranks(_pipeline_slices, 4, mode, timeout=90) == [True] * 4


def _slices_the_receiver_did_not_expect(rank: int, world: int, mode: str) -> Any:
    """TP2 x PP2: stage 0 sends 1/2 slices; stage 1 receives without an
    all_gather_group (refused), then the next dict."""
    set_config(timeout_s=20.0)
    tp, pp = _tp2_pp2(rank, world, mode)
    out: Any = None
    if pp.is_first_rank:
        sliced = {"a": torch.full((4, 3000), 1.0), "b": torch.full((8,), 2.0), "tag": "x"}
        pp.send_tensor_dict(sliced, all_gather_group=tp)
        pp.send_tensor_dict({"next": torch.full((5000,), 7.0)})
    else:
        with pytest.raises(GroupcoordValueError, match="sliced tensors 2 ways"):
            pp.recv_tensor_dict()
        got = pp.recv_tensor_dict()  # the pair is still in step
        assert got is not None and list(got) == ["next"]
        out = torch.equal(got["next"], torch.full((5000,), 7.0))
    pp.barrier()
    tp.destroy()
    pp.destroy()
    return out


@pytest.mark.parametrize("mode", ["shm", "gloo"])
def test_a_receiver_without_the_senders_all_gather_group_raises_and_stays_in_step(
    mode: str,
) -> None:
    # Until 2026-11-28 the receiver raised once the description came and left the
    # slices in flight: its next receive took the first slice for a dict's
    # description (DesyncError), and so on until they were used up.
    assert run_ranks(_slices_the_receiver_did_not_expect, 4, mode, timeout=90) == [
        None, None, True, True]  # fmt: skip


def _killed_sender(rank: int, world: int, attached: bool, flag_dir: str) -> float:
    g = _group(rank, world, "shm", timeout=60.0)
    if attached:
        # One dict first, so the receiver has joined the ring when the sender dies.
        if rank == 0:
            g.send_tensor_dict({"x": torch.ones(100_000)}, dst=1)
        else:
            g.recv_tensor_dict(src=0)
    if rank == 0:
        mark(flag_dir, "sender up")
        time.sleep(60)  # killed by the test
    with pytest.raises(PeerDiedError) as info:
        g.recv_tensor_dict(src=0)
    assert info.value.dead == [0] and "recv_tensor_dict" in str(info.value)
    named_at = time.time()
    g.destroy()
    return named_at


@pytest.mark.parametrize("attached", [True, False], ids=["attached", "before-first-send"])
def test_a_killed_sender_is_named_within_5_s(attached: bool, tmp_path) -> None:
    group = start_ranks(_killed_sender, 2, attached, str(tmp_path), timeout=60)
    wait_for(str(tmp_path), "sender up")
    time.sleep(1.0)  # rank 1 waits in recv_tensor_dict by now
    killed_at = time.time()
    group.kill(0)
    named_at = group.collect(killed=[0])[1]
    assert named_at - killed_at < 5.0


def _late_receiver(rank: int, world: int) -> int:
    # A dict larger than the pair's ring (4 x 16 MiB) streams through it; the
    # receiver is busy elsewhere for 2 s first (a pipeline stage in a long step).
    g = _group(rank, world, "shm", timeout=30.0)
    big = {"h": torch.arange(24 << 20, dtype=torch.float32)}  # 96 MiB
    if rank == 0:
        g.send_tensor_dict(big, dst=1)
        received = 0
    else:
        time.sleep(2.0)
        got = g.recv_tensor_dict(src=0)
        assert got is not None and torch.equal(got["h"], big["h"])
        received = got["h"].numel()
    g.destroy()
    return received


def test_a_dict_larger_than_the_ring_waits_for_a_late_receiver() -> None:
    # The sender used to wait in 0.5 s slices, and a slice that ran out cut
    # the stream: ClosedError for the sender, PeerDiedError for the receiver.
    assert run_ranks(_late_receiver, 2, timeout=90) == [0, 24 << 20]


def _sender_to_a_dead_receiver(rank: int, world: int, flag_dir: str) -> float:
    g = _group(rank, world, "shm", timeout=60.0)
    if rank == 1:
        mark(flag_dir, "receiver up")
        time.sleep(60)  # killed by the test before it ever receives
    wait_for(flag_dir, "receiver killed")
    big = {"h": torch.ones(24 << 20)}  # more than the ring: the sender must wait
    with pytest.raises(PeerDiedError) as info:
        g.send_tensor_dict(big, dst=1)
    assert info.value.dead == [1] and "send_tensor_dict" in str(info.value)
    named_at = time.time()
    g.destroy()
    return named_at


def test_a_receiver_killed_before_it_attached_is_named_within_5_s(tmp_path) -> None:
    group = start_ranks(_sender_to_a_dead_receiver, 2, str(tmp_path), timeout=60)
    wait_for(str(tmp_path), "receiver up")
    group.kill(1)
    group.procs[1].join(10)
    killed_at = time.time()
    mark(str(tmp_path), "receiver killed")
    named_at = group.collect(killed=[1])[0]
    assert named_at - killed_at < 5.0


def _waits_time_out(rank: int, world: int) -> str:
    g = _group(rank, world, "shm", timeout=1.5)
    message = ""
    if rank == 1:
        # Nobody sends: the receiver's wait names the sender.
        with pytest.raises(GroupcoordTimeoutError) as info:
            g.recv_tensor_dict(src=0)
        assert info.value.missing == [0]
        message = str(info.value)
    # The world group's deadline (30 s), not the group's 1.5 s one.
    torch.distributed.barrier()
    if rank == 0:
        # More messages than the ring holds and nobody receives: the sender's wait names rank 1.
        ring = p2p_channels.P2P_CHUNK_BYTES * p2p_channels.P2P_MAX_CHUNKS
        big = {f"t{i}": torch.ones(ring // 8) for i in range(4)}
        with pytest.raises(GroupcoordTimeoutError) as info:
            g.send_tensor_dict(big, dst=1)
        assert info.value.missing == [1]
        message = str(info.value)
    # The world group's deadline (30 s), not the group's 1.5 s one.
    torch.distributed.barrier()
    g.destroy()
    return message


def test_waits_time_out_naming_the_peer() -> None:
    receiver, sender = run_ranks(_waits_time_out, 2, timeout=60)[::-1]
    assert "recv_tensor_dict timed out after 1.5 s" in receiver and "[0]" in receiver
    assert "send_tensor_dict timed out after 1.5 s" in sender and "[1]" in sender


def _no_room(rank: int, world: int) -> Any:
    g = _group(rank, world, "shm")
    # A ring far larger than /dev/shm: the sender cannot create it.
    p2p_channels.P2P_CHUNK_BYTES = 1 << 40
    if rank == 0:
        g.send_tensor_dict(_sample(1), dst=1)
        g.send_tensor_dict(_sample(2), dst=1)
        fell_back = g._p2p_channels._gloo_to == {1}
    else:
        _same(g.recv_tensor_dict(src=0), _sample(1))
        _same(g.recv_tensor_dict(src=0), _sample(2))
        fell_back = g._p2p_channels._gloo_from == {0}
    g.barrier()
    g.destroy()
    return fell_back


def test_a_ring_that_does_not_fit_falls_back_to_gloo_on_both_ends() -> None:
    assert run_ranks(_no_room, 2, timeout=60) == [True, True]


def _little_room(rank: int, world: int) -> tuple[int, bool]:
    from shm_broadcast.segments import shm_free_bytes

    g = _group(rank, world, "shm")
    # The usual ring is more than /dev/shm has free (as in a 64 MiB container):
    # the pair gets a small one, which a dict larger than it streams through.
    p2p_channels.P2P_MAX_CHUNKS = shm_free_bytes() // p2p_channels.P2P_CHUNK_BYTES + 16
    big = {"x": torch.arange(5 << 20, dtype=torch.float32), "step": 3}  # 20 MiB
    if rank == 0:
        g.send_tensor_dict(_sample(1), dst=1)
        g.send_tensor_dict(big, dst=1)
        mq, ok = g._p2p_channels._writers[1], True
    else:
        _same(g.recv_tensor_dict(src=0), _sample(1))
        got = g.recv_tensor_dict(src=0)
        mq, ok = g._p2p_channels._readers[0], torch.equal(got["x"], big["x"]) and got["step"] == 3
    chunks = mq.max_chunks
    g.barrier()
    g.destroy()
    return chunks, ok


def test_a_pair_with_little_shared_memory_gets_a_small_ring() -> None:
    from shm_broadcast.ring import SMALL_RING_BYTES

    small = SMALL_RING_BYTES // p2p_channels.P2P_CHUNK_BYTES
    assert run_ranks(_little_room, 2, timeout=60) == [(small, True)] * 2


def _send_and_leave(rank: int, port: int, delay_s: float, results: Any) -> None:
    """A worker as vLLM's tests start one: plain multiprocessing, no groupcoord
    launcher; the sender returns (and its process ends) right after sending."""
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        group = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="pp")
        sample = _sample(7)
        if rank == 0:
            group.send_tensor_dict(sample, dst=1)
            results.put((rank, "sent", os.getpid()))
            # Dropped without destroy() and collected: what it sent is still delivered.
            del group
            gc.collect()
            return
        time.sleep(delay_s)  # the sender is gone or going by now
        got = group.recv_tensor_dict(src=0)
        same = all(
            torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
            for k, v in sample.items()
        )
        results.put((rank, "same" if same else "different", os.getpid()))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}", os.getpid()))


@pytest.mark.parametrize("delay_s", [0.0, 1.5])
def test_a_dict_is_delivered_after_its_sender_returns_and_exits(delay_s: float) -> None:
    import multiprocessing as mp

    from coordinator.launch import free_port

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_send_and_leave, args=(r, port, delay_s, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        outcome = {}
        for _ in procs:
            rank, what, pid = results.get(timeout=60)
            outcome[rank] = (what, pid)
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert outcome[0][0] == "sent" and outcome[1][0] == "same", outcome
    assert [p.exitcode for p in procs] == [0, 0]
    # multiprocessing's exit skips atexit: still nothing of theirs is left behind.
    pids = {str(pid) for _, pid in outcome.values()}
    assert [s for s in list_segments() if s.split("_")[1] in pids] == []


def _mixed_point_to_point(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Tensors, a dict and an object one way, a tensor back: one channel, in order."""
    g = _group(rank, world, mode)
    step = _sample(7)
    if rank == 0:
        g.send(step["view"])  # default dst: the next rank; not contiguous
        g.send_tensor_dict(step, dst=1)
        g.send_object({"ids": [1, 2, 3], "done": False}, dst=1)
        g.send(step["bf16"], dst=1)
        reply = g.recv(torch.Size([5, 3]), torch.float32, src=1)
        assert torch.equal(reply, step["f32"] * 2)
    else:
        view = g.recv(step["view"].shape, step["view"].dtype)  # default src: the previous
        assert torch.equal(view, step["view"])
        _same(g.recv_tensor_dict(src=0), step)
        assert g.recv_object(src=0) == {"ids": [1, 2, 3], "done": False}
        bf16 = g.recv(40_000, torch.bfloat16, src=0)  # vLLM callers pass a count too
        assert torch.equal(bf16, step["bf16"])
        bf16.add_(1)  # what came owns writable memory
        g.send(step["f32"] * 2, dst=0)
    channels = g._p2p_channels
    shared = g.device_communicator is not None and channels is g.device_communicator.p2p_channels
    used = bool(channels._writers) and bool(channels._readers)
    g.barrier()
    g.destroy()
    return {"shared": shared, "used": used}


@pytest.mark.parametrize("mode", ["shm", "shm-split", "gloo"])
def test_tensors_objects_and_dicts_share_one_channel_in_order(mode: str) -> None:
    for got in run_ranks(_mixed_point_to_point, 2, mode, timeout=90):
        # The group's tensor dicts and objects use its CPU communicator's channels,
        # which send/recv use: one ring per pair (none with shm p2p off).
        assert got == {"shared": True, "used": mode != "gloo"}


def _both_send_first_after_a_ping_pong(rank: int, world: int) -> int:
    g = _group(rank, world, "shm")
    peer = 1 - rank
    try:
        one = torch.full((256 * 1024,), float(rank))  # 1 MiB: the ring rewinds (REWIND)
        for _ in range(12):  # a ping-pong: each pair's writer goes back to chunk 0
            if rank == 0:
                g.send(one, dst=peer)
                g.recv(one.shape, one.dtype, src=peer)
            else:
                g.send(g.recv(one.shape, one.dtype, src=peer), dst=peer)
        # Then both send 40 MiB before either receives: a pair's 64 MiB ring holds
        # it without the receiver, a rewind or not.
        sent = [torch.full((1024 * 1024,), float(10 * rank + i)) for i in range(10)]
        for t in sent:
            g.send(t, dst=peer)
        got = [g.recv(sent[0].shape, sent[0].dtype, src=peer) for _ in range(10)]
        assert all(bool((t == 10 * peer + i).all()) for i, t in enumerate(got))
        g.barrier()
        return len(got)
    finally:
        g.destroy()


def test_both_ranks_send_40_mib_before_receiving_after_a_ping_pong() -> None:
    # A sender runs up to its pair's ring ahead of the receiver: the writer's going
    # back to chunk 0 after the ping-pong takes none of that room.
    assert run_ranks(_both_send_first_after_a_ping_pong, 2, timeout=30) == [10, 10]


def _recv_of_another_size(rank: int, world: int, mode: str) -> str:
    from shm_broadcast.errors import DesyncError

    g = _group(rank, world, mode)
    big = list(range(30000))  # encodes to more than 64 KiB: its bytes follow their header
    try:
        if rank == 0:
            g.send(torch.arange(8.0), dst=1)
            g.send(torch.arange(6, dtype=torch.int32), dst=1)
            g.send_object("not a tensor", dst=1)
            g.send_object(big, dst=1)
            g.send_tensor_dict({"step": 3}, dst=1)
            # To receives of more than 64 KiB (Gloo aborted on both until 2026-11-27):
            g.send(torch.arange(1000.0), dst=1)  # a message of up to 64 KiB
            g.send(torch.arange(200000.0), dst=1)  # a larger tensor
            g.send(torch.arange(3.0), dst=1)
            g.send(torch.arange(70000.0), dst=1)  # past 64 KiB: its data follows alone
            g.send(torch.arange(5.0), dst=1)
            g.send_object(torch.arange(2.0), dst=1)  # an object that is a tensor
            g.send_object(torch.arange(7.0), dst=1)
            g.send(torch.arange(4.0), dst=1)
            g.barrier()
            return ""
        raised = []
        calls: list[Any] = [
            lambda: g.recv((16,), torch.float32, src=0),
            lambda: g.recv((6,), torch.float32, src=0),
            lambda: g.recv((2,), torch.int64, src=0),
            lambda: g.recv((4,), torch.float32, src=0),
            lambda: g.recv((4,), torch.float32, src=0),
            lambda: g.recv((100000,), torch.float32, src=0),
            lambda: g.recv((100000,), torch.float32, src=0),
        ]
        calls += [
            lambda: g.recv_object(src=0),
            lambda: g.recv_object(src=0),
            lambda: g.recv_tensor_dict(src=0),
            lambda: g.recv((2,), torch.float32, src=0),
        ]
        for call in calls:
            with pytest.raises(DesyncError) as info:
                call()
            raised.append(str(info.value))
        assert torch.equal(g.recv_object(src=0), torch.arange(7.0))
        # Each mismatched message was consumed: the channel is still in step.
        assert g.recv((2, 2), torch.float32, src=0).tolist() == [[0.0, 1.0], [2.0, 3.0]]
        g.barrier()
        return "\n".join(raised)
    finally:
        g.destroy()


@pytest.mark.parametrize("mode", ["shm", "shm-split", "gloo"])
def test_a_recv_that_disagrees_with_the_send_names_both_and_the_channel_goes_on(mode):
    """On Gloo too (each tensor travels with its dtype and element count, an
    object's bytes with their own mark; a smaller message used to fill the head of
    the result and leave the rest uninitialised; an object met by a tensor
    receive, or a tensor by an object receive, left the pair out of step or made
    Gloo abort the receiving process, and so did a receive of more than 64 KiB
    met by a smaller message or a larger tensor)."""
    raised = run_ranks(_recv_of_another_size, 2, mode, timeout=60)[1].splitlines()
    assert "called recv(float32[16]) from rank 0, which sent a float32[8] tensor" in raised[0]
    assert "called recv(float32[6]) from rank 0, which sent a int32[6] tensor" in raised[1]
    if mode == "gloo":
        # What came is named by its size: the bytes are not decoded.
        assert "called recv(int64[2]) from rank 0, which sent an object's 21 bytes" in raised[2]
        assert "called recv(float32[4]) from rank 0, which sent an object's" in raised[3]
        assert "(send_object or send_tensor_dict)" in raised[4]
        assert "called recv_object from rank 0, which sent a float32[3] tensor" in raised[7]
        assert "called recv_object from rank 0, which sent a float32[70000] tensor" in raised[8]
        assert "called recv_tensor_dict from rank 0, which sent a float32[5] tensor" in raised[9]
        assert "called recv(float32[2]) from rank 0, which sent an object's" in raised[10]
    else:
        assert "called recv(int64[2]) from rank 0, which sent a str, not a tensor" in raised[2]
        assert "called recv(float32[4]) from rank 0, which sent a list, not a tensor" in raised[3]
        # An object that is a tensor is told from send's (both returned it until 2026-11-28).
        sent = "called recv_object from rank 0, and rank 0 sent a float32[{}] tensor (send)"
        assert sent.format(3) in raised[7], raised[7]
        assert sent.format(70000) in raised[8], raised[8]
        assert "called recv_tensor_dict from rank 0, and rank 0 sent a tensor" in raised[9]
        assert "called recv(float32[2]) from rank 0, which sent a tensor as an object" in raised[10]
    big_recv = "called recv(float32[100000]) from rank 0, which sent a float32"
    assert f"{big_recv}[1000] tensor" in raised[5], raised[5]
    assert f"{big_recv}[200000] tensor" in raised[6], raised[6]
    assert all(line.startswith("pp:0: rank 1") for line in raised), raised


def _threads_rank(rank: int, world: int, mode: str, count: int) -> list[str]:
    """Two threads of rank 0 send to rank 1, whose two threads receive: tensor dicts,
    then objects, then tensors (a pair's messages keep one order, so the threads of
    a phase make the same kind of call)."""
    import threading

    group = _group(rank, world, mode)
    errors: list[str] = []

    def dicts(thread: int, i: int) -> None:
        if rank == 0:
            n = 1 + (i * 7919) % 40_000  # small ones inline, large ones on their own
            x = torch.full((n,), float(thread * 100_000 + i))
            group.send_tensor_dict({"t": thread, "i": i, "x": x}, 1)
        else:
            d = group.recv_tensor_dict(0)
            assert torch.all(d["x"] == float(d["t"] * 100_000 + d["i"])), d["i"]

    def objects(thread: int, i: int) -> None:
        if rank == 0:
            group.send_object({"t": thread, "i": i, "s": "y" * (i % 999)}, 1)
        else:
            o = group.recv_object(0)
            assert o["s"] == "y" * (o["i"] % 999), o["i"]

    def tensors(thread: int, i: int) -> None:
        if rank == 0:
            group.send(torch.full((20_000,), float(thread * 100_000 + i)), 1)
        else:
            assert group.recv(torch.Size([20_000]), torch.float32, 0).unique().numel() == 1

    def work(call: Any, thread: int) -> None:
        try:
            for i in range(count):
                call(thread, i)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors.append(f"{call.__name__}, thread {thread}: {type(exc).__name__}: {exc}")

    for call in (dicts, objects, tensors):
        threads = [threading.Thread(target=work, args=(call, t)) for t in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    group.barrier()
    group.destroy()
    return errors


@pytest.mark.parametrize("mode", ["shm", "gloo"])
def test_threads_sending_to_one_peer_keep_each_message_whole(mode: str) -> None:
    # Before: two threads' first sends each made the pair's queue (one's messages
    # never arrived: the receiver timed out), and a tensor dict's parts interleaved
    # with another thread's (DesyncError "sent a list, not a tensor").
    assert run_ranks(_threads_rank, 2, mode, 150, timeout=120) == [[], []]


def _refused_then_next(rank: int, world: int, mode: str) -> list[str]:
    _setup(mode)
    init_gloo(rank, world)
    # "gloo": no device communicator either, so broadcasts go through Gloo too.
    g = GroupCoordinator([[0, 1]], rank, "gloo", mode != "gloo", group_name="d")
    got = []
    for n, bad in enumerate((torch.empty(100_000, device="meta"), torch.eye(300).to_sparse_csr())):
        good = {"x": torch.full((100_000,), float(n)), "n": n}
        if rank == 0:
            for call in (lambda d: g.broadcast_tensor_dict(d), lambda d: g.send_tensor_dict(d, 1)):
                with pytest.raises((GroupcoordTypeError, GroupcoordValueError), match="'bad'"):
                    call({"ok": 1, "bad": bad})
                call(good)
        else:
            for received in (g.broadcast_tensor_dict(None), g.recv_tensor_dict(0)):
                assert received is not None and received["n"] == good["n"]
                got.append("right" if torch.equal(received["x"], good["x"]) else "wrong")
        got.append("next")
    g.barrier()
    g.destroy()
    return got


@pytest.mark.parametrize("mode", ["shm", "gloo"])
def test_a_dict_holding_a_tensor_no_transfer_carries_is_refused_and_the_next_arrives(
    mode: str,
) -> None:
    # Until 2026-11-29 a meta or sparse CSR tensor was refused only when its turn
    # came, after the dict's message had gone: over Gloo the receiver's next
    # broadcast met the next dict's message where it waited for the tensor and
    # Gloo aborted the process (SIGABRT); through shared memory both ranks raised
    # DesyncError; a recv_tensor_dict waited out its timeout.
    results = run_ranks(_refused_then_next, 2, mode, timeout=60)
    assert results[1] == ["right", "right", "next", "right", "right", "next"]


def _shm_dirs_differ(rank: int, world: int, other_dir: str) -> str:
    from coordinator.errors import ClosedError

    if rank == 1:  # a configuration error: another directory for shared memory
        set_config(shm_dir=other_dir)
    init_gloo(rank, world)
    group = GroupCoordinator([list(range(world))], rank, "gloo", True, group_name="dirs")
    try:
        if rank == 0:
            group.send_tensor_dict({"x": torch.ones(4)}, 1)
            return ""
        with pytest.raises(ClosedError) as raised:
            group.recv_tensor_dict(0)
        return str(raised.value)
    finally:
        group.destroy()


def test_a_receiver_whose_shm_dir_differs_is_told_so(tmp_path: Any) -> None:
    # Until 2026-11-29 it said only that the sender had destroyed the group, which
    # it had not.
    message = run_ranks(_shm_dirs_differ, 2, str(tmp_path), timeout=60)[1]
    assert "GROUPCOORD_SHM_DIR must be the same on every rank of a host" in message, message
    assert not [s for s in list_segments() if "ring" in s], list_segments()
