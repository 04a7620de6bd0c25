"""CpuCommunicator (and so DeviceCommunicatorBase) with real forked ranks over Gloo.

Every rank's inputs are a pure function of its rank, so each rank rebuilds all
ranks' inputs locally and checks the collective against that reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.launch import init_gloo, run_ranks
from device_communicators.errors import (
    ClosedError,
    DesyncError,
    GroupcoordTypeError,
    GroupcoordValueError,
)


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash(shape) % 1000 + 7919 * rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, shape, generator=gen, dtype=dtype)


def desync_message(
    call: Any, *args: Any, what: str = "calls that differ by rank were accepted", **kwargs: Any
) -> str:
    """``call(*args, **kwargs)``, which must raise ``DesyncError``: its message. A
    method of a ``CpuCommunicator`` is made on a communicator of its own over the
    same group (the mismatch closes that one on every rank); anything else as it is."""
    from device_communicators import CpuCommunicator

    owner = getattr(call, "__self__", None)
    if not isinstance(owner, CpuCommunicator):
        try:
            call(*args, **kwargs)
        except DesyncError as exc:
            return str(exc)
        raise AssertionError(what)
    fresh = CpuCommunicator(owner.cpu_group, unique_name=f"{owner.unique_name}-desync")
    try:
        try:
            getattr(fresh, call.__name__)(*args, **kwargs)
        except DesyncError as exc:
            if fresh.shm_all_reduce.disabled_reason is None:  # (Gloo's checks close nothing)
                with pytest.raises(ClosedError, match="is closed on every rank"):
                    fresh.all_reduce(torch.ones(1))
            return str(exc)
        raise AssertionError(what)
    finally:
        fresh.destroy()


def make_comm(rank: int, world: int, name: str = "test", shm: bool = True):
    import torch.distributed as dist

    from device_communicators import CpuCommunicator
    from shm_broadcast.config import set_config

    init_gloo(rank, world)
    set_config(disable_shm_all_reduce=not shm, disable_shm_p2p=not shm)
    comm = CpuCommunicator(dist.group.WORLD, unique_name=name)
    assert (comm.shm_all_reduce.disabled_reason is None) == shm
    return comm


def _public_api_and_members(rank: int, world: int) -> dict:
    import device_communicators as dc

    comm = make_comm(rank, world)
    try:
        assert isinstance(comm, dc.DeviceCommunicatorBase)
        assert comm.device == torch.device("cpu")
        assert comm.device_group is comm.cpu_group
        assert comm.all2all_manager is None
        return {
            "rank": comm.rank,
            "rank_in_group": comm.rank_in_group,
            "world_size": comm.world_size,
            "ranks": comm.ranks,
            "chain": comm.all_reduce_chain.names(),
        }
    finally:
        comm.destroy()


def test_members_and_backend_order() -> None:
    out = run_ranks(_public_api_and_members, 2)
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["rank_in_group"] for o in out] == [0, 1]
    assert all(o["world_size"] == 2 and o["ranks"] == [0, 1] for o in out)
    assert out[0]["chain"] == ["shm", "torch.distributed(gloo)"]


def _collectives(rank: int, world: int, shm: bool) -> bool:
    comm = make_comm(rank, world, shm=shm)
    try:
        # all_reduce: every dtype, non-contiguous, empty, scalar.
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.float16):
            x = data(rank, (6, 5), dtype)
            got = comm.all_reduce(x.t())
            parts = [data(r, (6, 5), dtype).t() for r in range(world)]
            widen = dtype in (torch.float16, torch.bfloat16)
            want = parts[0].float() if widen else parts[0].clone()
            for p in parts[1:]:
                want = want + (p.float() if widen else p)
            if shm or not dtype.is_floating_point:
                assert torch.equal(got, want.to(dtype)), dtype
            else:  # Gloo sums in its own order (and in fp16/bf16): equal up to rounding
                torch.testing.assert_close(got, want.to(dtype), rtol=2e-2, atol=2e-2)
        assert comm.all_reduce(torch.empty(0, 3)).shape == (0, 3)
        scalar = comm.all_reduce(torch.tensor(float(rank)))
        assert scalar.shape == () and scalar.item() == sum(range(world))

        # all_gather on every dim, non-contiguous input, empty tensors.
        for dim in (0, 1, 2, -1, -2):
            x = data(rank, (2, 3, 4))
            want = torch.cat([data(r, (2, 3, 4)) for r in range(world)], dim=dim)
            assert torch.equal(comm.all_gather(x, dim=dim), want), dim
        xt = data(rank, (4, 3)).t()
        want = torch.cat([data(r, (4, 3)).t() for r in range(world)], dim=-1)
        assert torch.equal(comm.all_gather(xt), want)
        assert comm.all_gather(torch.empty(0, 2), dim=0).shape == (0, 2)
        assert comm.all_gather(torch.empty(2, 0), dim=0).shape == (2 * world, 0)

        # all_gatherv: lengths differ per rank (rank 1 holds none), sizes known or not.
        def rows(r: int) -> int:
            return 0 if r == 1 else r + 2

        sizes = [rows(r) for r in range(world)]
        for dim in (0, 1, -1):
            shape = [3, 3, 3]
            shape[dim] = rows(rank)
            x = data(rank, tuple(shape))
            allx = []
            for r in range(world):
                s = [3, 3, 3]
                s[dim] = rows(r)
                allx.append(data(r, tuple(s)))
            want = torch.cat(allx, dim=dim)
            assert torch.equal(comm.all_gatherv(x, dim=dim), want), dim
            assert torch.equal(comm.all_gatherv(x, dim=dim, sizes=sizes), want), dim
        pair = [data(rank, (rows(rank), 2)), data(rank, (rows(rank),), torch.int64)]
        got = comm.all_gatherv(pair, dim=0)
        assert isinstance(got, list) and len(got) == 2
        assert torch.equal(got[0], torch.cat([data(r, (rows(r), 2)) for r in range(world)]))
        want_i = torch.cat([data(r, (rows(r),), torch.int64) for r in range(world)])
        assert torch.equal(got[1], want_i)

        # gather: unequal lengths, to a non-zero dst, None elsewhere.
        x = data(rank, (2, rows(rank)))
        got = comm.gather(x, dst=world - 1, dim=-1)
        if rank == world - 1:
            assert got is not None
            assert torch.equal(got, torch.cat([data(r, (2, rows(r))) for r in range(world)], -1))
        else:
            assert got is None

        # reduce_scatter / reduce_scatterv.
        x = data(rank, (3, 4 * world), torch.int64)
        total = sum(data(r, (3, 4 * world), torch.int64) for r in range(world))
        assert isinstance(total, torch.Tensor)
        got = comm.reduce_scatter(x, dim=-1)
        assert torch.equal(got, total[:, 4 * rank : 4 * rank + 4])
        rs_sizes = [2 * r + 1 for r in range(world)]
        x = data(rank, (sum(rs_sizes), 2), torch.int64)
        total = sum(data(r, (sum(rs_sizes), 2), torch.int64) for r in range(world))
        assert isinstance(total, torch.Tensor)
        start = sum(rs_sizes[:rank])
        got = comm.reduce_scatterv(x, dim=0, sizes=rs_sizes)
        assert torch.equal(got, total[start : start + rs_sizes[rank]])

        # Dtypes Gloo has no type for ("Invalid scalar type", taken for a lost peer)
        # move on both paths: as the dtype of their width Gloo has on Gloo's.
        def bits(t: torch.Tensor) -> torch.Tensor:  # torch compares few of these
            return t.contiguous().view(torch.uint8)

        odd_dtypes = (torch.float8_e4m3fn, torch.int16, torch.uint32, torch.uint64, torch.complex32)
        for dtype in odd_dtypes:
            mine, every = (
                data(rank, (3, 2)).to(dtype),
                [data(r, (3, 2)).to(dtype) for r in range(world)],
            )
            assert torch.equal(bits(comm.all_gather(mine, dim=1)), bits(torch.cat(every, 1))), dtype
            parts = comm.all_gatherv(mine[: rows(rank)], dim=0)
            assert torch.equal(
                bits(parts), bits(torch.cat([p[: rows(r)] for r, p in enumerate(every)]))
            )
            got = comm.gather(mine, dst=0, dim=0)
            assert got is None if rank else torch.equal(bits(got), bits(torch.cat(every))), dtype
            target = mine.clone()
            comm.broadcast(target, src=world - 1)
            assert torch.equal(bits(target), bits(every[-1])), dtype
            if rank % 2 == 0:
                comm.send(mine)
                got = comm.recv((3, 2), dtype)
            else:
                got = comm.recv((3, 2), dtype)
                comm.send(mine)
            assert torch.equal(bits(got), bits(every[(rank - 1) % world])), dtype
        # The wide unsigned dtypes sum on shared memory (wrapping); Gloo cannot sum them
        # and says so at the call site.
        wide = torch.full((4,), 2**32 - 1 - rank, dtype=torch.int64).to(torch.uint32)
        if shm:
            want = (sum(2**32 - 1 - r for r in range(world)) % 2**32) * 4
            assert comm.all_reduce(wide).to(torch.int64).sum().item() == want
        else:
            with pytest.raises(GroupcoordTypeError, match="Gloo cannot reduce torch.uint32"):
                comm.all_reduce(wide)

        # broadcast from a non-zero rank into a non-contiguous tensor.
        base = torch.zeros(4, 3) if rank else data(99, (4, 3))
        target = base.t()
        if rank == world - 1:
            target.copy_(data(7, (3, 4)))
        returned = comm.broadcast(target, src=world - 1)
        assert returned is target and torch.equal(target, data(7, (3, 4)))

        # send/recv around the ring with the default peers.
        # Gloo's send blocks until the peer receives: odd ranks receive first.
        if rank % 2 == 0:
            comm.send(data(rank, (2, 2)) + rank)
            got = comm.recv((2, 2), torch.float32)
        else:
            got = comm.recv((2, 2), torch.float32)
            comm.send(data(rank, (2, 2)) + rank)
        prev = (rank - 1) % world
        assert torch.equal(got, data(prev, (2, 2)) + prev)
        # A pair's first message opens its channel through torch's store, which
        # rank 0 hosts: it must not exit while another pair is still opening one.
        torch.distributed.barrier()
        return True
    finally:
        comm.destroy()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("path", ["shm", "gloo"])
def test_every_collective_matches_the_local_reference(world: int, path: str) -> None:
    assert run_ranks(_collectives, world, path == "shm", timeout=90) == [True] * world


def _bad_then_good(rank: int, world: int) -> list[str]:
    from torch.distributed import ReduceOp

    comm = make_comm(rank, world)
    x = torch.ones(4, 2 * world)
    z = torch.full((4,), 1 + 2j)
    bad_calls = [
        (lambda: comm.all_reduce([1, 2]), GroupcoordTypeError, "input_"),  # type: ignore[arg-type]
        (lambda: comm.all_gather(x, dim=2), GroupcoordValueError, "dim=2"),
        (lambda: comm.all_gather(torch.tensor(1.0)), GroupcoordValueError, "dim"),
        (lambda: comm.all_gatherv(x, sizes=[1]), GroupcoordValueError, "sizes"),
        (lambda: comm.all_gatherv(x, sizes=[5] * world), GroupcoordValueError, "sizes"),
        (lambda: comm.all_gatherv([]), GroupcoordValueError, "input_"),
        (
            lambda: comm.reduce_scatter(torch.ones(4, 2 * world + 1)),
            GroupcoordValueError,
            "divisible",
        ),
        (lambda: comm.reduce_scatterv(x, dim=-1, sizes=[1] * world), GroupcoordValueError, "sizes"),
        (lambda: comm.gather(x, dst=world), GroupcoordValueError, "dst"),
        (lambda: comm.gather(x, dst=-1), GroupcoordValueError, "dst"),
        (lambda: comm.broadcast(x, src=world), GroupcoordValueError, "src"),
        (lambda: comm.broadcast(x, src="0"), GroupcoordTypeError, "src"),  # type: ignore[arg-type]
        (lambda: comm.send(x, dst=rank), GroupcoordValueError, "dst"),
        (lambda: comm.recv((2,), "float"), GroupcoordTypeError, "dtype"),  # type: ignore[arg-type]
        (lambda: comm.recv((-1,), torch.float32), GroupcoordValueError, "size"),
        (lambda: comm.all_gather(x, dim=1.0), GroupcoordTypeError, "dim"),  # type: ignore[arg-type]
        # Layouts and lazy views a path that moves memory cannot take: these raised
        # "peer rank(s) [] died" or returned the memory's values (conj(1+2j) as 1+2j).
        (lambda: comm.all_reduce(torch.eye(2).to_sparse_csr()), GroupcoordTypeError, "layout"),
        (lambda: comm.all_gather(z.conj()), GroupcoordValueError, "lazy conjugate"),
        (lambda: comm.all_reduce(z.conj().imag), GroupcoordValueError, "lazy negative"),
        (lambda: comm.broadcast(z.conj(), src=0), GroupcoordValueError, "lazy conjugate"),
        # Reduce ops: what it is, and what the dtype allows (Gloo raised its own
        # RuntimeError, or a pybind TypeError for a string).
        (lambda: comm.all_reduce(x, op="sum"), GroupcoordTypeError, "op must be"),  # type: ignore[arg-type]
        (lambda: comm.all_reduce(x, op=ReduceOp.BAND), GroupcoordTypeError, "integer or bool"),
        (lambda: comm.all_reduce(x.int(), op=ReduceOp.AVG), GroupcoordTypeError, "floating"),
        (lambda: comm.all_reduce(x.cfloat(), op=ReduceOp.MAX), GroupcoordValueError, "SUM or AVG"),
    ]
    if world > 1:
        bad_calls.append((lambda: comm.send(x, dst=world + 3), GroupcoordValueError, "dst"))
    messages = []
    try:
        for call, kind, needle in bad_calls:
            try:
                call()
            except kind as exc:
                assert needle in str(exc), f"{needle!r} not in {exc}"
                messages.append(str(exc))
            else:
                raise AssertionError(f"no {kind.__name__} for a call naming {needle}")
            # The group is still usable after every refused call.
            got = comm.all_reduce(torch.full((3,), float(rank)))
            assert torch.equal(got, torch.full((3,), float(sum(range(world)))))
        got = comm.all_gatherv(torch.ones(rank + 1, 2), dim=0)
        assert got.shape == (sum(r + 1 for r in range(world)), 2)
        return messages
    finally:
        comm.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_a_bad_call_raises_at_the_call_site_and_the_group_stays_usable(world: int) -> None:
    messages = run_ranks(_bad_then_good, world, timeout=90)
    assert len(messages[0]) >= 16


def _mismatched_shapes(rank: int, world: int) -> str:
    from device_communicators.errors import GroupcoordValueError

    comm = make_comm(rank, world)
    try:
        x = torch.ones(rank + 1, 3 + rank)  # other dims differ: cannot concatenate
        try:
            comm.all_gatherv(x, dim=0)
        except GroupcoordValueError as exc:
            message = str(exc)
        else:
            raise AssertionError("mismatched shapes were accepted")
        # The ranks' calls differ: the path closes on every rank (one may have
        # skipped a call and met the next).
        with pytest.raises(ClosedError, match="is closed on every rank"):
            comm.all_reduce(torch.ones(2))
        return message
    finally:
        comm.destroy()


def test_all_gatherv_with_incompatible_shapes_fails_alike_on_every_rank() -> None:
    messages = run_ranks(_mismatched_shapes, 2, timeout=60)
    # Both sides named, each rank's own shape said (the stamps' layouts differ).
    for rank, message in enumerate(messages):
        assert "all_gather(float32[3]) of parts" in message, message
        assert "all_gather(float32[8]) of parts" in message, message
        assert f"this rank's part: shape ({rank + 1}, {3 + rank})" in message, message


class RecordingManager:
    """A stand-in all2all manager that records what the communicator forwards."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def dispatch_router_logits(self, hidden_states, router_logits, is_sequence_parallel, extras):
        self.calls.append(f"dispatch {tuple(hidden_states.shape)} {is_sequence_parallel}")
        return hidden_states * 2, router_logits

    def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel, extras):
        self.calls.append(f"dispatch top-k {tuple(topk_ids.shape)} {is_sequence_parallel}")
        return hidden_states * 3, topk_weights, topk_ids

    def combine(self, hidden_states, is_sequence_parallel):
        self.calls.append(f"combine {is_sequence_parallel}")
        return hidden_states + 1

    def prepare_communication_buffer_for_model(self, model) -> None:
        self.calls.append(f"prepare {type(model).__name__}")

    def destroy(self) -> None:
        self.calls.append("destroy")


def _all2all_delegation(rank: int, world: int) -> list[str]:
    from device_communicators.errors import NotSupportedError

    comm = make_comm(rank, world)
    h = torch.ones(3, 2)
    for call in (lambda: comm.dispatch_router_logits(h, h), lambda: comm.combine(h)):
        try:
            call()
        except NotSupportedError as exc:
            assert "CpuCommunicator" in str(exc)
        else:
            raise AssertionError("dispatch/combine without a manager must raise")
    comm.prepare_communication_buffer_for_model(torch.nn.Linear(2, 2))  # no manager: no-op
    manager = RecordingManager()
    comm.set_all2all_manager(manager)
    out, _ = comm.dispatch_router_logits(h, h, is_sequence_parallel=True)
    assert torch.equal(out, h * 2)
    ids = torch.zeros(3, 1, dtype=torch.int64)
    out, weights, got_ids = comm.dispatch(h, h, ids)
    assert torch.equal(out, h * 3) and got_ids is ids
    assert torch.equal(comm.combine(h), h + 1)
    comm.prepare_communication_buffer_for_model(torch.nn.Linear(2, 2))
    comm.destroy()
    assert comm.all2all_manager is None
    return manager.calls


def test_dispatch_and_combine_go_through_the_all2all_manager() -> None:
    calls = run_ranks(_all2all_delegation, 2, timeout=60)[0]
    assert calls == [
        "dispatch (3, 2) True",
        "dispatch top-k (3, 1) False",
        "combine False",
        "prepare Linear",
        "destroy",
    ]


def _subgroup(rank: int, world: int) -> list | None:
    import torch.distributed as dist

    from device_communicators import CpuCommunicator

    init_gloo(rank, world)
    group = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    comm = CpuCommunicator(group, unique_name="sub")
    try:
        assert comm.ranks == [1, 2, 3] and comm.rank_in_group == rank - 1
        # src/dst are in-group indices: src=0 is global rank 1.
        x = torch.full((2,), float(rank))
        comm.broadcast(x, src=0)
        assert torch.equal(x, torch.full((2,), 1.0))
        got = comm.gather(torch.full((1,), float(rank)), dst=2, dim=0)
        summed = comm.all_reduce(torch.full((2,), float(rank)))
        assert torch.equal(summed, torch.full((2,), 6.0))
        assert comm.shm_all_reduce.disabled_reason is None
        return [comm.rank_in_group, None if got is None else got.tolist()]
    finally:
        comm.destroy()


def test_subgroup_uses_in_group_indices() -> None:
    out = run_ranks(_subgroup, 4, timeout=90)
    assert out[0] is None
    assert out[1] == [0, None] and out[2] == [1, None]
    assert out[3] == [2, [1.0, 2.0, 3.0]]


def _tensor_dicts(rank: int, world: int, shm: bool) -> dict:
    comm = make_comm(rank, world, shm=shm)
    try:
        peer = 1 - rank
        sent = {
            "ids": torch.arange(5) + 10 * rank,
            "hidden": data(rank, (512, 1024)),  # 2 MiB: more than a chunk
            "step": 3 + rank,
            "names": ["a", "b"],
        }
        for _ in range(2):  # in order, and the channel is reused
            if rank == 0:
                comm.send_tensor_dict(sent, dst=peer)
                got = comm.recv_tensor_dict(src=peer)
            else:
                got = comm.recv_tensor_dict(src=peer)
                comm.send_tensor_dict(sent, dst=peer)
        want = {
            "ids": torch.arange(5) + 10 * peer,
            "hidden": data(peer, (512, 1024)),
            "step": 3 + peer,
            "names": ["a", "b"],
        }
        assert set(got) == set(want)
        assert torch.equal(got["ids"], want["ids"]) and torch.equal(got["hidden"], want["hidden"])
        assert got["step"] == want["step"] and got["names"] == want["names"]
        with pytest.raises(GroupcoordValueError, match="dst"):
            comm.send_tensor_dict(sent, dst=rank)  # itself
        return {"shm_channels": bool(comm.p2p_channels._writers)}
    finally:
        comm.destroy()


@pytest.mark.parametrize("shm", [True, False])
def test_send_and_recv_tensor_dict_as_vllms_cpu_communicator(shm: bool) -> None:
    out = run_ranks(_tensor_dicts, 2, shm)
    assert [o["shm_channels"] for o in out] == [shm, shm]


def _standalone_backend(rank: int, world: int, shm: bool) -> dict:
    """A CpuCommunicator over a Gloo backend torch's registry does not know (what a
    ``coordinator.comm`` communicator builds): every path works with in-group ranks."""
    import datetime
    import os

    import torch.distributed as dist

    from device_communicators import CpuCommunicator
    from shm_broadcast.config import set_config

    init_gloo(rank, world)
    set_config(disable_shm_all_reduce=not shm, disable_shm_p2p=not shm)
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore("standalone", dist.distributed_c10d._get_default_store()),
        rank,
        world,
        datetime.timedelta(seconds=30),
    )
    with pytest.raises(GroupcoordValueError, match="global_ranks"):
        CpuCommunicator(pg)  # no registry to ask: the numbering must be given
    comm = CpuCommunicator(pg, unique_name="standalone", global_ranks=list(range(world)))
    try:
        assert (comm.shm_all_reduce.disabled_reason is None) == shm
        assert comm.ranks == list(range(world)) and comm.rank == rank
        # Errors can name a dead peer whether or not the shared-memory path is up.
        assert comm.peer_pids == {r: pid for r, pid in enumerate(_pids(comm)) if r != rank}
        peer = 1 - rank
        z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)
        assert torch.equal(comm.all_reduce(z), torch.tensor([3 + 6j, 9 - 3j]))
        with pytest.raises(GroupcoordValueError, match="only be reduced with SUM"):
            from device_communicators import c10d_calls

            c10d_calls.all_reduce(pg, z, dist.ReduceOp.MAX, None)
        x = data(rank, (3, 4))
        # The moving operations' chain: shared memory (when up, for what it offers),
        # then c10d; the control exchanges use the same, both on cpu_group.
        from device_communicators.transports import NOT_OFFERED

        names = ["shared memory", "shared-memory channels", "torch.distributed(gloo)"]
        assert [t.name for t in comm.transports.transports] == names
        assert [t.name for t in comm.control_transports.transports] == [names[0], names[2]]
        (_, shm_reason), (_, channel_reason), (_, torch_reason) = comm.transports.explain(
            "all_gather", x
        )
        assert (shm_reason is None) == shm and torch_reason is None
        assert channel_reason == NOT_OFFERED
        assert comm.transports.explain("send", x)[0][1] == NOT_OFFERED
        # One tensor to a peer on this node: its channel, unless shm p2p is off.
        assert comm.transports.select("send", x).name == names[1 if shm else 2]
        gathered = comm.all_gather(x, dim=0)
        assert torch.equal(gathered, torch.cat([data(r, (3, 4)) for r in range(world)]))
        assert torch.equal(comm.broadcast(x.clone(), src=1), data(1, (3, 4)))
        got = comm.gather(x, dst=0, dim=1)
        if rank == 0:
            assert got is not None
            assert torch.equal(got, torch.cat([data(r, (3, 4)) for r in range(world)], dim=1))
        else:
            assert got is None
        part = comm.reduce_scatter(torch.ones(4, 2) * (rank + 1), dim=0)
        assert torch.equal(part, torch.full((2, 2), 3.0))
        if rank == 0:
            comm.send(x, dst=peer)
        else:
            assert torch.equal(comm.recv(x.shape, x.dtype, src=peer), data(peer, (3, 4)))
        return {"pid": os.getpid()}
    finally:
        comm.destroy()
        pg.shutdown()


def _pids(comm) -> list[int]:
    """Every rank's pid, gathered over the communicator itself."""
    import os

    mine = torch.tensor([os.getpid()], dtype=torch.int64)
    return [int(p) for p in comm.all_gather(mine, dim=0).tolist()]


@pytest.mark.parametrize("shm", [True, False])
def test_a_standalone_gloo_backend_works_with_global_ranks(shm: bool) -> None:
    out = run_ranks(_standalone_backend, 2, shm)
    assert out[0]["pid"] != out[1]["pid"]


def test_a_chain_that_no_back_end_takes_says_why_each_refused() -> None:
    from device_communicators.all_reduce_backends import AllReduceBackend, AllReduceChain
    from device_communicators.transports import NOT_OFFERED, Transport, TransportChain

    class Refuses(AllReduceBackend):
        name = "picky"

        def refusal(self, tensor, op=None):
            return f"no {tensor.dtype}"

        def all_reduce(self, tensor, *, op=None):
            raise AssertionError("never called after a refusal")

    class Offers(Transport):
        name = "gather-only"

        def refusal(self, op, tensor):
            return None if op == "all_gather" else NOT_OFFERED

    x = torch.ones(2, dtype=torch.int8)
    with pytest.raises(GroupcoordValueError, match=r"all-reduce of a torch.int8 .*picky: no"):
        AllReduceChain([Refuses()], owner="tp").select(x)
    chain = TransportChain([Offers()], owner="tp")
    assert chain.select("all_gather", x).name == "gather-only"
    with pytest.raises(GroupcoordValueError, match="broadcast of .*gather-only: does not offer"):
        chain.select("broadcast", x)


def _freed_without_the_collector(rank: int, world: int) -> bool:
    """Dropping a communicator frees it (and a standalone group it holds) at once: no
    reference cycle leaves them to the garbage collector, which may run on one of
    Gloo's threads, where the group's destructor would join itself (std::terminate)."""
    import datetime
    import gc
    import weakref

    import torch.distributed as dist

    from coordinator.comm import new_comm
    from device_communicators import CpuCommunicator

    init_gloo(rank, world)
    gc.disable()
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore("freed", dist.distributed_c10d._get_default_store()),
        rank,
        world,
        datetime.timedelta(seconds=30),
    )
    comm = CpuCommunicator(pg, unique_name="freed", global_ranks=list(range(world)))
    comm.all_gather(torch.ones(2), dim=0)  # through both chains' entries
    gone = weakref.ref(comm)
    comm.destroy()
    del comm
    with new_comm("gloo", "cpu", "freed-comm", rank=rank, size=world) as outer:
        outer.all_reduce(torch.ones(3))
        inner = weakref.ref(outer._communicator)
    del outer
    freed = gone() is None and inner() is None
    gc.enable()
    return freed


def test_a_dropped_communicator_is_freed_without_the_garbage_collector() -> None:
    assert run_ranks(_freed_without_the_collector, 2) == [True, True]


def _gathers_of_varying_lengths(rank: int, world: int) -> list[str]:
    comm = make_comm(rank, world, "gv")
    shm = comm.shm_all_reduce
    dst = world - 1
    barriers = []

    def check(shape_of: object, dim: int, dtype: torch.dtype = torch.float32) -> None:
        """Every rank's part of shape ``shape_of(r)`` gathered along ``dim`` to ``dst``."""
        parts = [data(r, shape_of(r), dtype) for r in range(world)]  # type: ignore[operator]
        before = shm.generation
        got = comm.gather(parts[rank], dst=dst, dim=dim)
        barriers.append(shm.generation - before)
        if rank == dst:
            assert got is not None
            assert torch.equal(got, torch.cat(parts, dim)), (shape_of(0), dim)
        else:
            assert got is None

    try:
        check(lambda r: (1024,), 0)  # equal parts: one barrier, no size exchange
        check(lambda r: (3, 2 + r), 1)  # lengths differ along dim 1
        check(lambda r: (2 * r, 5), 0, torch.int64)  # rank 0's part is empty
        check(lambda r: (2 * (world - 1 - r), 5), 0)  # the destination's part is empty
        check(lambda r: (4, 3 + r), -1, torch.bfloat16)
        big = 70_000 * 4 > 256 * 1024  # floats past a slot's 256 KiB
        assert big
        check(lambda r: (70_000 if r == 0 else 10,), 0)  # one part too large for a slot
        check(lambda r: (70_000 + r,), 0)  # every part too large
        check(lambda r: (0, 4), 1)  # no elements at all: lengths unknown from counts
        # all_gatherv: lengths found, or given sizes checked, in the call's one barrier.
        for given in (None, [2 + r for r in range(world)]):
            parts = [data(r, (2 + r, 3)) for r in range(world)]
            before = shm.generation
            assert torch.equal(comm.all_gatherv(parts[rank], 0, given), torch.cat(parts))
            barriers.append(shm.generation - before)
        # Ranks but 0 say rank 0's part is one row shorter than it is: an entry no
        # rank could check before, and the longest part unchanged, so the padded
        # parts still matched and those ranks cut rank 0's part short, silently.
        # Past a slot too. The sizes travel with the call (a checksum in the stamp):
        # every rank raises, naming both calls, before anything moves.
        for rows in (2, 30_000):
            sizes = [rows + r for r in range(world)]
            if rank:
                sizes[0] -= 1
            parts = [data(r, (rows + r, 3)) for r in range(world)]
            message = desync_message(comm.all_gatherv, parts[rank], 0, sizes)
            assert "sizes #" in message and "all_gather(float32" in message, message
        # A non-contiguous part, and bool.
        parts = [data(r, (5, 2 + r)).t() for r in range(world)]
        got = comm.gather(parts[rank], dst=0, dim=0)
        assert rank != 0 or torch.equal(got, torch.cat(parts, 0))
        flags = [torch.arange(r + 3) % 2 == 0 for r in range(world)]
        got = comm.gather(flags[rank], dst=0, dim=0)
        assert rank != 0 or torch.equal(got, torch.cat(flags))
        # Other dims that differ: every rank raises, naming both sides, and goes on.
        message = desync_message(
            comm.gather,
            torch.ones(2, 3 + (rank > 0)),
            dst=0,
            dim=0,
            what="parts whose other dims differ were joined",
        )
        # Layouts whose 16-bit checksums collide ("2|0|[291]", "2|0|[5000]"): the
        # counts, which no part of the other layout could hold, still tell them apart.
        collided = desync_message(
            comm.gather,
            torch.ones(1, 291 if rank == 0 else 5000),
            dst=0,
            dim=0,
            what="parts whose layouts' checksums collide were joined",
        )
        assert "the other dims differ by rank" in collided, collided
        assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(world)))
        return [str(b) for b in barriers] + [message]
    finally:
        comm.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_gather_of_parts_of_different_lengths_takes_one_barrier_on_shared_memory(
    world: int,
) -> None:
    """``gather`` and ``all_gatherv`` learn the parts' lengths in its own barrier (each rank's stamp holds
    its element count): parts that fit a slot move in that one barrier, larger ones
    afterwards with the lengths already known; incompatible parts raise on every rank."""
    results = run_ranks(_gathers_of_varying_lengths, world, timeout=120)
    for got in results:
        *barriers, message = got
        assert barriers[:5] == ["1"] * 5, barriers
        assert int(barriers[5]) > 1 and int(barriers[6]) > 1, barriers  # then the big parts
        assert barriers[8:] == ["1", "1"], barriers  # all_gatherv, sizes found and given
        assert "gather(float32[6], dst=0)" in message, message
        assert "gather(float32[8], dst=0)" in message, message
        assert "this rank's part: shape (2, " in message and "other dims may not" in message


def _gatherv_of_unfillable_dtypes(rank: int, world: int, shm: bool) -> list[str]:
    comm = make_comm(rank, world, "gvf", shm=shm)
    try:
        seen = []
        for dtype in (torch.float4_e2m1fn_x2, torch.bits8, torch.bits16):
            for rows in (3, 50_000):  # 50,000 rows: parts past 32 KiB, padded on Gloo
                parts = []
                for r in range(world):
                    gen = torch.Generator().manual_seed(r)
                    raw = torch.randint(0, 256, (rows + r, 4), dtype=torch.uint8, generator=gen)
                    parts.append(raw.view(dtype))
                got = comm.all_gatherv(parts[rank], 0)
                joined = torch.cat([p.view(torch.uint8) for p in parts])
                assert got.dtype == dtype and torch.equal(got.view(torch.uint8), joined)
                seen.append(f"{dtype} {rows}")
        return seen
    finally:
        comm.destroy()


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_all_gatherv_of_dtypes_torch_cannot_fill(shm: bool) -> None:
    """Parts of unequal length of float4 and bits dtypes, past 32 KiB: on Gloo
    each travels padded to the longest, and torch fills no tensor of these dtypes
    that large, so the padding (zeros) is written as bytes. Before, the ranks
    with a shorter part raised NotImplementedError alone and the rank with the
    longest went on into Gloo's all-gather, which then aborted the process."""
    results = run_ranks(_gatherv_of_unfillable_dtypes, 2, shm, timeout=120)
    assert results[0] == results[1] and len(results[0]) == 6


def _all_gatherv_sizes_on_gloo(rank: int, world: int) -> list[str]:
    comm = make_comm(rank, world, "gvg", shm=False)
    seen = []
    try:
        # Ranks but 0 say rank 0's part is one row shorter: the longest part is
        # unchanged, so the padded parts still matched and those ranks cut rank 0's
        # part short with no error (RELIABILITY bug 14 on Gloo). Each padded part now
        # carries its true length; every dtype's rows stay aligned (bool, complex128).
        for rows, dtype, dim in ((2, torch.float32, 0), (30_000, torch.float32, 0),
                                 (3, torch.bool, 1), (2, torch.complex128, -1)):  # fmt: skip
            shape = [3, 3]
            parts = []
            for r in range(world):
                shape[dim] = rows + r
                parts.append(data(r, tuple(shape)).to(dtype))
            sizes = [rows + r for r in range(world)]
            assert torch.equal(comm.all_gatherv(parts[rank], dim, sizes), torch.cat(parts, dim))
            assert torch.equal(comm.all_gatherv(parts[rank], dim), torch.cat(parts, dim))
            # Then they say rank 0's part is the longest: the longest changes, and the
            # ranks' padded parts had other sizes, which Gloo aborted the process on.
            # The sizes travel with the lengths: every rank raises before the parts move.
            for wrong in (-1, world):
                said = [rows + r for r in range(world)]
                if rank:
                    said[0] += wrong
                seen.append(desync_message(comm.all_gatherv, parts[rank], dim, said))
        assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(world)))
        return seen
    finally:
        comm.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gatherv_on_gloo_checks_given_sizes_against_the_parts(world: int) -> None:
    """Without shared memory, ``sizes`` that differ by rank travel with the true
    lengths (exchanged first): every rank raises ``DesyncError`` naming the ranks
    that differ, this rank's sizes and the true lengths, and the group stays usable."""
    results = run_ranks(_all_gatherv_sizes_on_gloo, world, timeout=120)
    for rank, messages in enumerate(results):
        assert len(messages) == 8, messages
        cases = [(rows, dim, wrong) for rows, dim in ((2, 0), (30_000, 0), (3, 1), (2, 1))
                 for wrong in (-1, world)]  # fmt: skip
        for message, (rows, dim, wrong) in zip(messages, cases):
            true = [rows + r for r in range(world)]
            said = list(true)
            if rank:
                said[0] += wrong
            others = [0] if rank else list(range(1, world))
            assert f"ranks {others} disagree with rank {rank}" in message, message
            assert f"sizes={said}; the parts' lengths along dim {dim % 2}: {true}" in message


def _anothers_entry_wrong(rank: int, world: int, shm: bool) -> list[str]:
    comm = make_comm(rank, world, "gvo", shm=shm)
    seen = []
    try:
        for rows in (2, 30_000):  # a part that fits a slot, and one that does not
            parts = [data(r, (rows + r, 3)) for r in range(world)]
            said = [rows + r for r in range(world)]
            if rank == 1:
                said[0] += 1  # rank 0's entry, wrong on rank 1 alone
            both = [parts[rank], parts[rank] + 1]
            seen.append(desync_message(comm.all_gatherv, both, 0, said))
            # Every rank stopped at the same tensor: the group is in step.
            assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(world)))
        return seen
    finally:
        comm.destroy()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("world", [2, 3])
def test_all_gatherv_of_a_list_whose_sizes_differ_raises_on_every_rank_in_step(
    world: int, shm: bool
) -> None:
    # The rank with the wrong entry raised after the list's first tensor, and its
    # peers went on to gather the second: their next call met its next one. Then
    # only that rank raised. Now the sizes travel with the first tensor's call.
    seen = run_ranks(_anothers_entry_wrong, world, shm, timeout=120)
    for messages in seen:
        assert len(messages) == 2, messages
        for message in messages:
            assert ("sizes #" if shm else "the sizes given") in message, message


def _with_comm_and_group(rank: int, world: int, name: str, body: Any, mismatch: Any) -> list[str]:
    """``body(comm, group)`` on a CpuCommunicator and a GroupCoordinator of the same
    ranks; then ``mismatch(run)`` for each one's method (ranks that disagree), which
    must raise ``DesyncError`` on every rank: their messages. Each then refuses
    every call (the ranks may be a whole call apart)."""
    from coordinator.group_coordinator import GroupCoordinator

    comm = make_comm(rank, world, name)
    group = GroupCoordinator(
        [list(range(world))],
        rank,
        "gloo",
        True,
        use_message_queue_broadcaster=False,
        group_name=f"{name}-g",
    )
    seen = []
    try:
        body(comm, group)
        for which in (comm, group):
            seen.append(desync_message(mismatch, which))
            with pytest.raises(ClosedError, match="is closed on every rank"):
                which.all_reduce(torch.ones(2))
        return seen
    finally:
        group.destroy()
        comm.destroy()


def _equal_parts(rank: int, world: int) -> list[str]:
    def body(comm: Any, group: Any) -> None:
        shm = comm.shm_all_reduce
        # Equal sizes: an all-gather. A part the lean path takes (two rows) and one
        # past it, along dims 0 and 1; then with rank 0's tensor requiring grad,
        # which the lean path declines on that rank alone: the ranks still meet.
        for rows in (2, 30_000):
            for dim, shape_of in ((0, lambda n: (n, 3)), (1, lambda n: (3, n))):
                parts = [data(r, shape_of(rows)) for r in range(world)]
                want = torch.cat(parts, dim)
                before = shm.generation
                assert torch.equal(comm.all_gatherv(parts[rank], dim, [rows] * world), want)
                if rows == 2:
                    assert shm.generation - before == 1  # one barrier, no length exchange
                mine = parts[rank].clone().requires_grad_(rank == 0)
                assert torch.equal(comm.all_gatherv(mine, dim, [rows] * world), want)
                got = group.all_gatherv(mine, dim, [rows] * world)
                assert torch.equal(got, want)
                both = comm.all_gatherv([parts[rank], mine + 1], dim, [rows] * world)
                assert torch.equal(both[0], want) and torch.equal(both[1], want + 1)

    # The last rank brings a row more and says so; the others say every part has
    # two rows (an all-gather on their side, a varying one on its).
    rows = [2] * world
    rows[-1] = 3
    mine = data(rank, (rows[rank], 3))
    said = rows if rank == world - 1 else [2] * world
    return _with_comm_and_group(
        rank, world, "gve", body, lambda which: which.all_gatherv(mine, 0, said)
    )


@pytest.mark.parametrize("world", [2, 3])
def test_all_gatherv_of_equal_parts_runs_as_an_all_gather(world: int) -> None:
    for messages in run_ranks(_equal_parts, world, timeout=120):
        assert len(messages) == 2, messages
        for message in messages:
            assert "all_gather(float32[6], shape #" in message, message
            assert "parts laid out" in message, message  # the other side's varying call


def _equal_cuts(rank: int, world: int) -> list[str]:
    def body(comm: Any, group: Any) -> None:
        shm = comm.shm_all_reduce
        # Equal sizes (or none): the plain reduce_scatter, lean path included, for
        # a lean-sized input and one past it, along dims 0 and 1, and with rank 0's
        # input requiring grad (the lean path declines it on that rank alone).
        for rows in (2, 30_000):
            for dim in (0, 1):
                shape = (world * rows, 3) if dim == 0 else (3, world * rows)
                parts = [data(r, shape) for r in range(world)]
                want = sum(parts).narrow(dim, rank * rows, rows)  # type: ignore[union-attr]
                for sizes in ([rows] * world, None):
                    before = shm.generation
                    got = comm.reduce_scatterv(parts[rank], dim, sizes)
                    torch.testing.assert_close(got, want)
                    if rows == 2:
                        assert shm.generation - before == 1  # the lean path's one barrier
                    mine = parts[rank].clone().requires_grad_(rank == 0)
                    torch.testing.assert_close(group.reduce_scatterv(mine, dim, sizes), want)
        # Uneven cuts (one share empty) take the lean path too, by their cut: one
        # barrier for a small input, and still with rank 0's input requiring grad.
        for dim in (0, 1):
            cut = [3 * r for r in range(world)]  # rank 0 keeps no rows
            shape = (sum(cut), 5) if dim == 0 else (5, sum(cut))
            parts = [data(r, shape) for r in range(world)]
            want = sum(parts).narrow(dim, sum(cut[:rank]), cut[rank])  # type: ignore[union-attr]
            before = shm.generation
            torch.testing.assert_close(comm.reduce_scatterv(parts[rank], dim, cut), want)
            assert shm.generation - before == 1
            mine = parts[rank].clone().requires_grad_(rank == 0)
            torch.testing.assert_close(group.reduce_scatterv(mine, dim, cut), want)
            big = [20_000 * (r + 1) for r in range(world)]  # past the lean path
            x = data(rank, (sum(big), 2) if dim == 0 else (2, sum(big)))
            got = comm.reduce_scatterv(x, dim, big)
            want = comm.all_reduce(x.clone()).narrow(dim, sum(big[:rank]), big[rank])
            torch.testing.assert_close(got, want)

    # Rank 0 cuts equally, the others do not.
    total = 2 * world
    uneven = [1] * (world - 1) + [total - (world - 1)]
    x = data(rank, (total, 3))
    said = [2] * world if rank == 0 else uneven
    return _with_comm_and_group(
        rank, world, "rse", body, lambda which: which.reduce_scatterv(x, 0, said)
    )


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatterv_of_equal_sizes_runs_as_a_reduce_scatter_and_uneven_ones_lean(
    world: int,
) -> None:
    for messages in run_ranks(_equal_cuts, world, timeout=120):
        assert len(messages) == 2, messages
        for message in messages:
            assert "reduce_scatter(float32[" in message and "sizes #" in message, message
