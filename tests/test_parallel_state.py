"""parallel_state with real forked ranks: TP2xPP2, TP2xDP2 with EP, re-init and teardown."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from coordinator import parallel_state as ps
from coordinator.errors import AlreadyInitializedError, NotInitializedError
from coordinator.launch import run_ranks
from shm_broadcast.segments import list_segments


def _tp2_pp2(rank: int, world_size: int) -> dict:
    ps.init_distributed_environment(backend="gloo", timeout=60)  # env:// as under torchrun
    ps.init_distributed_environment(backend="gloo")  # a second call is a no-op
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(2, 2)
    ps.initialize_model_parallel(2, 2)  # same sizes: no-op
    ps.ensure_model_parallel_initialized(2, 2)
    tp, pp, dp = ps.get_tp_group(), ps.get_pp_group(), ps.get_dp_group()
    assert ps.get_world_group().ranks == [0, 1, 2, 3]
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3])
    assert pp.ranks == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert dp.ranks == [rank]
    assert ps.get_tensor_model_parallel_world_size() == 2
    assert ps.get_tensor_model_parallel_rank() == rank % 2
    assert ps.get_pipeline_model_parallel_world_size() == 2
    assert ps.get_pipeline_model_parallel_rank() == rank // 2
    # Only TP has a message queue.
    assert tp.mq_broadcaster is not None and pp.mq_broadcaster is None
    assert ps.get_world_group().mq_broadcaster is None
    # Every group vLLM builds exists; EP spans DP x PCP x TP but has no all2all manager
    # unless expert parallelism was asked for.
    ep = ps.get_ep_group()
    assert ep.ranks == tp.ranks and ep.device_communicator is not None
    assert ep.device_communicator.all2all_manager is None
    assert ps.get_eplb_group() is ep
    assert ps.get_pcp_group().ranks == [rank] and ps.get_dcp_group().ranks == [rank]
    assert ps.get_dcp_world_size_and_rank() == (1, 0)
    assert ps.get_inner_dp_world_group().ranks == [0, 1, 2, 3]
    assert ps.get_node_count() == 1
    assert ps.is_global_first_rank() == (rank == 0)

    step = {"step": 3, "ids": [rank // 2, 9]} if tp.rank_in_group == 0 else None
    got = tp.broadcast_object(step)
    assert got == {"step": 3, "ids": [rank // 2, 9]}
    x = torch.full((4,), float(rank))
    assert tp.all_reduce(x).tolist() == [float(sum(tp.ranks))] * 4

    # A pipeline step: stage 0 sends its (TP-replicated) activations to stage 1.
    if pp.is_first_rank:
        acts = {"hidden": torch.arange(8.0).reshape(2, 4) + 100 * (rank // 2), "n": 2}
        pp.send_tensor_dict(acts, all_gather_group=tp)
        received = None
    else:
        received = pp.recv_tensor_dict(all_gather_group=tp)
        assert received is not None
        assert torch.equal(received["hidden"], torch.arange(8.0).reshape(2, 4))
        assert received["n"] == 2

    with ps.graph_capture(torch.device("cpu")) as ctx:
        assert ctx.stream is None

    assert ps.in_the_same_node_as(ps.get_world_group()) == [True] * 4
    with pytest.raises(AlreadyInitializedError, match=r"tp=2, pp=2, pcp=1, dcp=1, dp=1"):
        ps.initialize_model_parallel(4, 1)
    with pytest.raises(AlreadyInitializedError):
        ps.ensure_model_parallel_initialized(4, 1)

    # Destroy and rebuild with other sizes.
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(NotInitializedError):
        ps.get_tp_group()
    ps.initialize_model_parallel(4, 1)
    assert ps.get_tp_group().ranks == [0, 1, 2, 3]
    assert ps.get_tp_group().all_reduce(torch.ones(2)).tolist() == [4.0, 4.0]
    ps.destroy_distributed_environment()
    assert not dist.is_initialized()
    with pytest.raises(NotInitializedError):
        ps.get_world_group()
    return {"segments_after": [s for s in list_segments() if f"_{os.getpid()}_" in s]}


def test_tp2_pp2_groups_methods_reinit_and_teardown() -> None:
    results = run_ranks(_tp2_pp2, 4, timeout=90)
    assert all(r["segments_after"] == [] for r in results)


def _tp2_dp2_ep(rank: int, world_size: int) -> None:
    ps.init_distributed_environment(
        world_size, rank, f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank, "gloo"
    )
    ps.initialize_model_parallel(2, 1, data_parallel_size=2, enable_expert_parallel=True)
    tp, dp, ep = ps.get_tp_group(), ps.get_dp_group(), ps.get_ep_group()
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3])
    assert dp.ranks == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert ep.ranks == [0, 1, 2, 3]
    assert ep.device_communicator is not None
    assert ep.device_communicator.all2all_manager is not None
    # Ranks hold different token counts (rank 3 none); experts are the identity,
    # so combine returns each token summed over the 4 ranks that saw it.
    counts = [3, 1, 2, 0]
    hidden = torch.arange(counts[rank] * 4, dtype=torch.float32).reshape(-1, 4) + 10 * rank
    logits = torch.full((counts[rank], 2), float(rank))
    all_hidden, all_logits = ep.dispatch_router_logits(hidden, logits)
    want = torch.cat(
        [
            torch.arange(c * 4, dtype=torch.float32).reshape(-1, 4) + 10 * r
            for r, c in enumerate(counts)
        ]
    )
    assert torch.equal(all_hidden, want)
    assert all_logits[:, 0].tolist() == [float(r) for r, c in enumerate(counts) for _ in range(c)]
    assert torch.equal(ep.combine(all_hidden), hidden * 4)
    # DP all-reduce across replicas.
    assert dp.all_reduce(torch.tensor([float(rank)])).item() == float(sum(dp.ranks))
    ps.destroy_distributed_environment()
    assert not dist.is_initialized()


def test_tp2_dp2_with_expert_parallel_and_explicit_init_method() -> None:
    run_ranks(_tp2_dp2_ep, 4, timeout=90)


def test_initialize_model_parallel_before_init_raises() -> None:
    with pytest.raises(NotInitializedError, match="init_distributed_environment"):
        ps.initialize_model_parallel(1, 1)


def _reinit_on_one_port(rank: int, world_size: int) -> list[float]:
    # vLLM's tests tear everything down and initialise again in the same
    # process; torch's own tcp:// rendezvous fails or hangs when the port is the
    # same (stale keys, a server torn down while peers still reach it).
    method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    sums = []
    for round_ in range(3):
        ps.init_distributed_environment(world_size, rank, method, rank, "gloo", timeout=30)
        ps.initialize_model_parallel(world_size)
        sums.append(ps.get_tp_group().all_reduce(torch.tensor([float(round_)])).item())
        if rank == 0:
            time.sleep(0.3)  # the others start the next round before rank 0 tears down
        ps.destroy_distributed_environment()
        assert not dist.is_initialized()
    return sums


@pytest.mark.parametrize("world", [2, 4])
def test_init_destroy_init_on_one_port(world: int) -> None:
    for sums in run_ranks(_reinit_on_one_port, world, timeout=90):
        assert sums == [0.0, world * 1.0, world * 2.0]


def test_init_method_arguments_are_checked() -> None:
    from coordinator.comm.bootstrap import default_group_store

    with pytest.raises(ValueError, match="needs rank and world_size"):
        default_group_store("tcp://127.0.0.1:29511", -1, 2, 5.0)
    with pytest.raises(ValueError, match="need 0 <= rank < size"):
        default_group_store("tcp://127.0.0.1:29511", 2, 2, 5.0)
    # Methods we do not resolve are left to torch's rendezvous.
    assert default_group_store("file:///tmp/rendezvous", 0, 1, 5.0) is None
    assert default_group_store("tcp://127.0.0.1:29511?rank=0", 0, 1, 5.0) is None


def _different_layouts(rank: int, world_size: int) -> str:
    method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    ps.init_distributed_environment(world_size, rank, method, rank, "gloo", timeout=30)
    start = time.monotonic()
    # Rank 3 asks for TP 4 where the others ask for TP 2 x PP 2: each would
    # build other groups and wait on the others until the deadline.
    with pytest.raises(ValueError) as info:
        ps.initialize_model_parallel(4 if rank == 3 else 2, 1 if rank == 3 else 2)
    assert time.monotonic() - start < 5
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(2, 2)  # then the same sizes everywhere work
    assert ps.get_tp_group().all_reduce(torch.ones(1)).item() == 2.0
    ps.destroy_distributed_environment()
    return str(info.value)


def test_ranks_asking_for_different_layouts_get_an_error_naming_them() -> None:
    for message in run_ranks(_different_layouts, 4, timeout=90):
        assert "rank(s) [0, 1, 2]: tp=2, pp=2" in message
        assert "rank(s) [3]: tp=4, pp=1" in message
