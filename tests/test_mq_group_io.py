"""group_io (bytes over a group, no pickle) and topology (who shares /dev/shm)."""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest

from coordinator.launch import init_gloo, run_ranks
from shm_broadcast.errors import GroupcoordTypeError, GroupcoordValueError
from shm_broadcast.group_io import ObjectGroup, all_gather_bytes, broadcast_bytes
from shm_broadcast.topology import in_the_same_node_as


class StoreGroup:
    """A minimal ObjectGroup over a TCPStore (bytes only), as a second kind of group."""

    def __init__(self, rank: int, world_size: int, port: int) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.store = dist.TCPStore(
            "127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=30)
        )
        self.seq = 0

    def broadcast_obj(self, obj, src):
        self.seq += 1
        key = f"b{self.seq}"
        if self.rank == src:
            self.store.set(key, obj)
            return obj
        return self.store.get(key)

    def all_gather_obj(self, obj):
        self.seq += 1
        self.store.set(f"g{self.seq}/{self.rank}", obj)
        return [self.store.get(f"g{self.seq}/{r}") for r in range(self.world_size)]

    def close(self):
        """Rank 0 hosts the store: it leaves only after every rank is done with it."""
        self.store.set(f"done/{self.rank}", b"1")
        if self.rank == 0:
            self.store.wait([f"done/{r}" for r in range(self.world_size)])


def _exchange(pg, rank):
    out = {}
    for src in range(pg_size(pg)):
        data = f"from {src}".encode() * (src + 1) if my_rank(pg) == src else None
        out[f"bcast{src}"] = broadcast_bytes(pg, data, src=src)
    out["empty"] = broadcast_bytes(pg, b"" if my_rank(pg) == 0 else None, src=0)
    out["gather"] = all_gather_bytes(pg, bytes([rank]) * rank)  # rank 0 sends b""
    out["big"] = broadcast_bytes(pg, bytes(range(256)) * 4096 if my_rank(pg) == 0 else None)
    return out


def pg_size(pg):
    import torch.distributed as dist

    return pg.world_size if isinstance(pg, ObjectGroup) else dist.get_world_size(pg)


def my_rank(pg):
    import torch.distributed as dist

    return pg.rank if isinstance(pg, ObjectGroup) else dist.get_rank(pg)


def _gloo_rank(rank, world_size):
    import torch.distributed as dist

    init_gloo(rank, world_size)
    results = {"world": _exchange(dist.group.WORLD, rank)}
    sub = dist.new_group([1, 2])  # collective over all ranks
    if rank in (1, 2):
        # src is the rank within the subgroup: 1 means global rank 2.
        results["sub"] = broadcast_bytes(sub, b"sub" if rank == 2 else None, src=1)
    with pytest.raises(GroupcoordValueError, match="src=5"):
        broadcast_bytes(dist.group.WORLD, b"x", src=5)
    with pytest.raises(GroupcoordTypeError):
        broadcast_bytes(dist.group.WORLD, "not bytes", src=rank)  # type: ignore[arg-type]
    # The group is still usable after the refused calls.
    results["after"] = broadcast_bytes(dist.group.WORLD, b"ok" if rank == 0 else None)
    return results


def _check_exchange(out, world_size):
    for src in range(world_size):
        assert out[f"bcast{src}"] == f"from {src}".encode() * (src + 1)
    assert out["empty"] == b""
    assert out["gather"] == [bytes([r]) * r for r in range(world_size)]
    assert out["big"] == bytes(range(256)) * 4096


def test_bytes_over_a_gloo_group_and_subgroup():
    results = run_ranks(_gloo_rank, 3, timeout=90)
    for rank, res in enumerate(results):
        _check_exchange(res["world"], 3)
        assert res["after"] == b"ok"
        if rank in (1, 2):
            assert res["sub"] == b"sub"


def _store_rank(rank, world_size, port):
    pg = StoreGroup(rank, world_size, port)
    try:
        return _exchange(pg, rank)
    finally:
        pg.close()


def test_bytes_over_an_object_group():
    from coordinator.launch import free_port

    for res in run_ranks(_store_rank, 3, free_port(), timeout=90):
        _check_exchange(res, 3)


def test_non_group_is_refused():
    with pytest.raises(GroupcoordTypeError, match="ProcessGroup or an ObjectGroup"):
        broadcast_bytes(object(), b"x")


def _topology_rank(rank, world_size, other_dir):
    import torch.distributed as dist

    from shm_broadcast.config import set_config

    init_gloo(rank, world_size)
    full = in_the_same_node_as(dist.group.WORLD, source_rank=0)
    from_last = in_the_same_node_as(dist.group.WORLD, source_rank=world_size - 1)
    # Rank 2 now looks for shared memory elsewhere: as if on another node.
    if rank == 2:
        set_config(shm_dir=other_dir)
    split = in_the_same_node_as(dist.group.WORLD, source_rank=0)
    return full, from_last, split


def test_in_the_same_node_as_detects_shared_and_unshared_memory():
    with tempfile.TemporaryDirectory() as other_dir:
        results = run_ranks(_topology_rank, 3, other_dir, timeout=90)
        assert os.listdir(other_dir) == []
    for full, from_last, split in results:
        assert full == [True, True, True]
        assert from_last == [True, True, True]
        assert split == [True, True, False]


def _sources_differ(rank, world_size):
    import torch.distributed as dist

    from shm_broadcast.errors import DesyncError
    from shm_broadcast.message_queue import MessageQueue

    init_gloo(rank, world_size)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    said = []
    for call in (
        lambda: in_the_same_node_as(group, source_rank=rank),
        lambda: MessageQueue.create_from_process_group(group, 1 << 16, 4, writer_rank=rank),
    ):
        with pytest.raises(DesyncError) as raised:
            call()
        said.append(str(raised.value))
    assert in_the_same_node_as(group, source_rank=1) == [True, True]  # the group goes on
    return said


def test_ranks_naming_different_sources_raise_naming_both():
    # Until 2026-11-29 each rank sent as the source (a writer_rank each, say)
    # and they waited on each other until the group's timeout (30 min here).
    for rank, (topology, queue) in enumerate(run_ranks(_sources_differ, 2, timeout=60)):
        other = 1 - rank
        assert (
            f"rank {rank} of the group passed source_rank={rank}, rank {other} source_rank={other}"
            in topology
        )
        assert (
            f"create_from_process_group: rank {rank} of the group passed writer_rank={rank}"
            in queue
        )
