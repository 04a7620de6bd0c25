"""Expert-parallel dispatch/combine over real forked ranks.

Each rank holds its own tokens (uneven counts, some zero), the experts are
split over the ranks, and dispatch -> local experts -> combine must give every
rank the same output a single process computes with all experts.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.launch import init_gloo, run_ranks

HIDDEN = 8
EXPERTS = 4
TOP_K = 2


def _expert_weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    router = torch.randn(HIDDEN, EXPERTS, generator=gen)
    experts = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    return router, experts


def _tokens(rank: int, count: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(count, HIDDEN, generator=gen)


def _moe(
    hidden: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor, owned: range
) -> torch.Tensor:
    """Top-k MoE output of ``hidden`` using only the experts in ``owned``."""
    weights, ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    out = torch.zeros_like(hidden)
    for e in owned:
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            out.index_add_(0, rows, (hidden[rows] @ experts[e]) * weights[rows, slot, None])
    return out


def _communicator(world_size: int):
    import torch.distributed as dist

    from device_communicators.base_device_communicator import DeviceCommunicatorBase

    return DeviceCommunicatorBase(dist.group.WORLD, unique_name="ep")


def _dispatch_combine_rank(rank: int, world_size: int, backend: str, counts: list[int]):
    from device_communicators.all2all import create_all2all_manager

    init_gloo(rank, world_size)
    manager = create_all2all_manager(backend, _communicator(world_size))
    router, experts = _expert_weights()
    per_rank = EXPERTS // world_size
    owned = range(rank * per_rank, (rank + 1) * per_rank)
    outputs = []
    for step in range(2):  # twice: buffers and pending counts are reused cleanly
        mine = _tokens(rank, counts[rank]) * (step + 1)
        logits = mine @ router
        ids = torch.arange(counts[rank], dtype=torch.int64) + 1000 * rank
        hidden, all_logits, extras = manager.dispatch_router_logits(
            mine, logits, extra_tensors=[ids]
        )
        expected_ids = torch.cat(
            [torch.arange(c, dtype=torch.int64) + 1000 * r for r, c in enumerate(counts)]
        )
        assert torch.equal(extras[0], expected_ids), (extras[0], expected_ids)
        partial = _moe(hidden, all_logits, experts, owned)
        outputs.append(manager.combine(partial))
    manager.destroy()
    return [o.tolist() for o in outputs]


CASES = [
    (2, [3, 5]),
    (2, [0, 4]),
    (4, [2, 0, 7, 1]),
    (4, [0, 0, 0, 0]),
]


@pytest.mark.parametrize("backend", ["naive", "allgather_reducescatter"])
@pytest.mark.parametrize("world_size,counts", CASES)
def test_dispatch_combine_equals_single_process_moe(backend, world_size, counts):
    results = run_ranks(_dispatch_combine_rank, world_size, backend, counts, timeout=90)
    router, experts = _expert_weights()
    for rank, outputs in enumerate(results):
        for step, got in enumerate(outputs):
            mine = _tokens(rank, counts[rank]) * (step + 1)
            want = _moe(mine, mine @ router, experts, range(EXPERTS))
            got_t = torch.tensor(got, dtype=torch.float32).reshape(counts[rank], HIDDEN)
            torch.testing.assert_close(got_t, want, rtol=1e-5, atol=1e-5)


def _two_tensor(*shape: int) -> torch.Tensor:
    """A wrapper subclass (like DTensor): no memory of its own to move."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.zeros(shape), torch.ones(shape))


def _misuse_rank(rank: int, world_size: int, backend: str):
    from device_communicators.all2all import create_all2all_manager
    from device_communicators.errors import (
        ClosedError,
        GroupcoordTypeError,
        GroupcoordValueError,
    )

    init_gloo(rank, world_size)
    manager = create_all2all_manager(backend, _communicator(world_size))
    messages = []
    bad_calls = [
        lambda: manager.dispatch_router_logits(torch.zeros(3), torch.zeros(3, 2)),
        lambda: manager.dispatch_router_logits(torch.zeros(3, 4), torch.zeros(2, 2)),
        lambda: manager.dispatch_router_logits(torch.zeros(3, 4), "logits"),
        lambda: manager.dispatch_router_logits(
            torch.zeros(3, 4), torch.zeros(3, 2), extra_tensors=[torch.zeros(5)]
        ),
        lambda: manager.combine(torch.zeros(3, 4)),  # no dispatch pending
        lambda: manager.dispatch_router_logits(_two_tensor(3, 4), torch.zeros(3, 2)),
    ]
    for call in bad_calls:
        try:
            call()
        except (GroupcoordValueError, GroupcoordTypeError) as exc:
            messages.append(str(exc))
        else:
            raise AssertionError("bad call did not raise")
    # The group is still usable: a good pair right after the bad calls.
    n = rank + 1
    hidden, logits = manager.dispatch_router_logits(
        torch.full((n, 4), float(rank)), torch.zeros(n, 2)
    )
    assert hidden.shape == (sum(range(1, world_size + 1)), 4)
    try:
        manager.combine(torch.zeros(n, 4))  # wrong row count: needs all ranks' tokens
    except GroupcoordValueError as exc:
        messages.append(str(exc))
    out = manager.combine(hidden)
    assert torch.equal(out, torch.full((n, 4), float(rank) * world_size))
    # Stated counts skip discovery and are checked against the local rows.
    counts = list(range(1, world_size + 1))
    with manager.token_counts(counts):
        hidden, _ = manager.dispatch_router_logits(torch.ones(n, 4), torch.zeros(n, 2))
        assert hidden.shape[0] == sum(counts)
        assert torch.equal(manager.combine(hidden), torch.full((n, 4), float(world_size)))
        try:
            manager.dispatch_router_logits(torch.ones(n + 1, 4), torch.zeros(n + 1, 2))
        except GroupcoordValueError as exc:
            messages.append(str(exc))
    manager.destroy()
    try:
        manager.dispatch_router_logits(torch.ones(n, 4), torch.zeros(n, 2))
    except ClosedError as exc:
        messages.append(str(exc))
    try:
        manager.stage_ep_size()
    except ClosedError as exc:
        messages.append(str(exc))
    return messages


@pytest.mark.parametrize("backend", ["naive", "allgather_reducescatter"])
def test_bad_calls_raise_and_leave_manager_usable(backend):
    results = run_ranks(_misuse_rank, 2, backend, timeout=60)
    for messages in results:
        assert len(messages) == 10, messages
        assert "hidden_states must be 2-D" in messages[0]
        assert "router_logits must have 3 rows" in messages[1]
        assert "router_logits must be a torch.Tensor" in messages[2]
        assert "extra_tensors[0] must have 3 rows" in messages[3]
        assert "preceding dispatch" in messages[4]
        assert "hidden_states is a torch.testing._internal.two_tensor.TwoTensor" in messages[5]
        assert "must have 3 rows" in messages[6]
        assert "token_counts() states" in messages[7]
        assert "after destroy()" in messages[8]
        assert "stage_ep_size after destroy()" in messages[9]


def _prepared_rank(rank: int, world_size: int):
    from device_communicators.all2all import create_all2all_manager
    from device_communicators.all2all_base import MoEBufferSpec

    class TinyMoE(torch.nn.Module):
        def moe_buffer_spec(self) -> MoEBufferSpec:
            return MoEBufferSpec(
                max_tokens_per_rank=4, hidden_size=6, num_experts=3, dtype=torch.float32
            )

    init_gloo(rank, world_size)
    comm = _communicator(world_size)
    manager = create_all2all_manager("naive", comm)
    comm.set_all2all_manager(manager)
    comm.prepare_communication_buffer_for_model(
        torch.nn.Sequential(torch.nn.Linear(2, 2), TinyMoE())
    )
    assert manager.buffer_spec is not None and manager.buffer_spec.hidden_size == 6
    hidden, logits = comm.dispatch_router_logits(
        torch.full((rank + 1, 6), float(rank)), torch.zeros(rank + 1, 3)
    )
    reused = hidden.untyped_storage().nbytes() == 4 * world_size * 6 * 4
    out = comm.combine(hidden)
    try:
        comm.dispatch_router_logits(torch.zeros(1, 7), torch.zeros(1, 3))
        too_wide = ""
    except ValueError as exc:
        too_wide = str(exc)
    comm.destroy()
    return reused, out.tolist(), too_wide


def test_prepare_buffers_from_model_moe_layers():
    results = run_ranks(_prepared_rank, 2, timeout=60)
    for rank, (reused, out, too_wide) in enumerate(results):
        assert reused, "naive dispatch did not use the buffer sized by prepare"
        assert out == [[float(rank) * 2] * 6] * (rank + 1)
        assert "hidden size 7" in too_wide


def test_unknown_backend_lists_known_ones():
    from device_communicators.all2all import create_all2all_manager, known_all2all_backends
    from device_communicators.errors import GroupcoordValueError

    assert known_all2all_backends() == ["allgather_reducescatter", "naive"]
    with pytest.raises(
        GroupcoordValueError, match="known backends: allgather_reducescatter, naive"
    ):
        create_all2all_manager("alltoall_typo", object())  # type: ignore[arg-type]
    # vLLM's vendor back ends are named and refused with the one uniform error.
    for vendor in ("deepep_low_latency", "pplx", "flashinfer_all2allv", "mori", "nixl_ep"):
        with pytest.raises(NotImplementedError, match=f"{vendor}.* not supported by groupcoord"):
            create_all2all_manager(vendor, object())  # type: ignore[arg-type]


def _coordinator_rank(rank: int, world_size: int, backend: str, counts: list[int]):
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import override

    init_gloo(rank, world_size)
    with override(all2all_backend=backend):
        ep = GroupCoordinator(
            [list(range(world_size))], rank, "gloo", True, group_name="ep", use_all2all=True
        )
    try:
        assert ep.device_communicator is not None
        assert ep.device_communicator.all2all_manager.name == backend
        router, experts = _expert_weights()
        per_rank = EXPERTS // world_size
        mine = _tokens(rank, counts[rank])
        hidden, logits = ep.dispatch_router_logits(mine, mine @ router)
        partial = _moe(hidden, logits, experts, range(rank * per_rank, (rank + 1) * per_rank))
        return ep.combine(partial).tolist()
    finally:
        ep.destroy()


@pytest.mark.parametrize("backend", ["naive", "allgather_reducescatter"])
def test_ep_group_coordinator_uses_configured_manager(backend):
    """GroupCoordinator(use_all2all=True) builds the configured manager on its CPU communicator."""
    counts = [4, 0, 3, 1]
    results = run_ranks(_coordinator_rank, 4, backend, counts, timeout=90)
    router, experts = _expert_weights()
    for rank, got in enumerate(results):
        mine = _tokens(rank, counts[rank])
        want = _moe(mine, mine @ router, experts, range(EXPERTS))
        got_t = torch.tensor(got, dtype=torch.float32).reshape(counts[rank], HIDDEN)
        torch.testing.assert_close(got_t, want, rtol=1e-5, atol=1e-5)


def _vllm_style_manager_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from device_communicators.all2all import AgRsAll2AllManager
    from device_communicators.base_device_communicator import All2AllManagerBase, Cache
    from device_communicators.errors import GroupcoordValueError, NotSupportedError

    init_gloo(rank, world_size)
    communicator = _communicator(world_size)
    # vLLM builds its manager from the cpu_group alone, inside its communicator.
    manager = AgRsAll2AllManager(communicator.cpu_group)
    assert isinstance(manager, All2AllManagerBase)
    assert (manager.rank, manager.world_size) == (rank, world_size)
    hidden = _tokens(rank, rank + 1)
    weights = torch.rand(rank + 1, TOP_K)
    ids = torch.randint(0, EXPERTS, (rank + 1, TOP_K))
    got_hidden, got_weights, got_ids = manager.dispatch(hidden, weights, ids)
    combined = manager.combine(got_hidden)
    result = {
        "gathered_rows": got_hidden.shape[0],
        # combine sums every rank's copy of this rank's rows: world_size x hidden.
        "combine_ok": torch.allclose(combined, hidden * world_size),
        "max_sms_used": manager.max_sms_used(),
    }
    manager.set_num_sms(16)
    with pytest.raises(GroupcoordValueError, match="num_sms"):
        manager.set_num_sms(0)
    with pytest.raises(NotSupportedError, match="not supported by groupcoord"):
        manager.get_handle({})
    # Elastic EP's two steps: the manager is already built for its group.
    manager.stage_ep_size()
    manager.commit_ep_size()
    restaged, _, _ = manager.dispatch(hidden, weights, ids)
    result["restaged_ok"] = torch.allclose(manager.combine(restaged), hidden * world_size)
    # Fault queries: every peer lives, nothing changed since the recovery point.
    result["mask"] = manager.query_active_mask().tolist()
    result["fault"] = bool(manager.query_fault())
    result["support_fault_tolerance"] = manager.support_fault_tolerance
    # A warm-up alone: only this rank's tokens, nothing sent (peers do no dispatch).
    with manager.mask_remote_ranks():
        result["masked"] = manager.query_active_mask().tolist()
        alone_hidden, alone_weights, _ = manager.dispatch(hidden, weights, ids)
        alone = manager.combine(alone_hidden * 2)
    result["alone_ok"] = torch.equal(alone_hidden, hidden) and torch.equal(alone, hidden * 2)
    result["alone_weights_ok"] = torch.equal(alone_weights, weights)
    # Checkpoints: buffers go and come back; the manager then works as before.
    manager.checkpoint_prepare()
    manager.checkpoint_restore()
    again, _, _ = manager.dispatch(hidden, weights, ids)
    result["after_checkpoint_ok"] = torch.allclose(manager.combine(again), hidden * world_size)
    manager.dispatch(hidden, weights, ids)
    manager.clean_buffers()  # drops the dispatch waiting for its combine
    with pytest.raises(GroupcoordValueError, match="token counts"):
        manager.combine(got_hidden)
    other = dist.new_group(list(range(world_size)), backend="gloo")
    with pytest.raises(GroupcoordValueError, match="no groupcoord device communicator"):
        AgRsAll2AllManager(other)
    made = []
    cache = Cache()
    first = cache.get_or_create({"a": 1}, lambda a: made.append(a) or torch.zeros(a))
    again = cache.get_or_create({"a": 1}, lambda a: made.append(a) or torch.zeros(a))
    result["cache_reused"] = first is again and made == [1]
    manager.destroy()
    communicator.destroy()
    return result


def test_a_manager_built_the_vllm_way_from_its_cpu_group():
    results = run_ranks(_vllm_style_manager_rank, 2, timeout=60)
    # Inside mask_remote_ranks every peer is masked, never the rank itself.
    assert [r.pop("masked") for r in results] == [[0, 1], [1, 0]]
    for r in results:
        assert r == {
            "gathered_rows": 1 + 2,
            "combine_ok": True,
            "max_sms_used": None,
            "cache_reused": True,
            "mask": [0, 0],
            "fault": False,
            "support_fault_tolerance": False,
            "alone_ok": True,
            "alone_weights_ok": True,
            "after_checkpoint_ok": True,
            "restaged_ok": True,
        }


def _fault_query_rank(rank: int, world_size: int) -> dict:
    import os
    import time

    import torch.distributed as dist

    from device_communicators.all2all import AgRsAll2AllManager
    from device_communicators.cpu_communicator import CpuCommunicator

    init_gloo(rank, world_size)
    # The CPU communicator's shared-memory set-up learns the peers' pids.
    communicator = CpuCommunicator(dist.group.WORLD, unique_name="ep")
    manager = AgRsAll2AllManager(communicator.cpu_group)
    dist.barrier()
    if rank == 2:
        os._exit(0)  # dies without a word
    deadline = time.monotonic() + 10
    while manager.query_active_mask()[2] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = {"mask": manager.query_active_mask().tolist(), "fault": bool(manager.query_fault())}
    manager.clean_buffers()  # the recovery point now includes the dead rank
    seen["fault_after_clean"] = bool(manager.query_fault())
    manager.destroy()
    communicator.destroy()
    return seen


def test_fault_queries_see_a_dead_peer_until_the_next_recovery_point():
    from coordinator.launch import start_ranks

    results = start_ranks(_fault_query_rank, 3, timeout=60).collect(killed=[2])
    for r in results[:2]:
        assert r == {"mask": [0, 0, 1], "fault": True, "fault_after_clean": False}


def _widths_differ_rank(rank: int, world_size: int, backend: str) -> tuple[str, list[float]]:
    from coordinator.errors import DesyncError
    from device_communicators.all2all import create_all2all_manager

    init_gloo(rank, world_size)
    manager = create_all2all_manager(backend, _communicator(world_size))  # Gloo alone
    width = 6 if rank == 1 else 8
    with pytest.raises(DesyncError) as raised:
        manager.dispatch_router_logits(torch.ones(3, width), torch.ones(3, 4))
    # The manager is still usable: the next dispatch and combine are right.
    hidden, _ = manager.dispatch_router_logits(torch.full((3, 8), rank + 1.0), torch.ones(3, 4))
    out = manager.combine(hidden)
    manager.destroy()
    return str(raised.value), out[:, 0].tolist()


@pytest.mark.parametrize("backend", ["naive", "allgather_reducescatter"])
def test_ranks_dispatching_tensors_of_other_widths_raise_naming_both(backend: str) -> None:
    # Until 2026-11-29 the naive manager's broadcasts over Gloo paired pieces of
    # different sizes and Gloo aborted the process (SIGABRT); NCCL checks nothing.
    results = run_ranks(_widths_differ_rank, 2, backend, timeout=60)
    for rank, (message, combined) in enumerate(results):
        mine, theirs = ("float32[6]", "float32[8]") if rank == 1 else ("float32[8]", "float32[6]")
        assert f"rank {rank} dispatches hidden_states {mine}" in message, message
        assert f"rank {1 - rank} dispatches hidden_states {theirs}" in message, message
        assert combined == [2.0 * (rank + 1)] * 3  # its own rows, summed over both ranks


def _out_of_step_in_debug_mode_rank(
    rank: int, world_size: int, backend: str, case: str
) -> tuple[str, list[float]]:
    from coordinator.errors import DesyncError
    from device_communicators.all2all import create_all2all_manager
    from shm_broadcast.config import set_config

    set_config(debug_desync=True)
    init_gloo(rank, world_size)
    manager = create_all2all_manager(backend, _communicator(world_size))  # Gloo alone
    with pytest.raises(DesyncError) as raised:
        if case == "stated counts":  # each rank right about itself, wrong about the other
            with manager.token_counts([2, 3] if rank == 0 else [3, 2]):
                manager.dispatch_router_logits(torch.ones(2, 8), torch.ones(2, 4))
        elif rank == 0:  # "dispatch or combine"
            manager.dispatch_router_logits(torch.ones(2, 8), torch.ones(2, 4))
        else:
            with manager.token_counts([2, 2]):
                manager.combine(torch.ones(4, 8))
    # The manager is still usable: the next dispatch and combine are right.
    hidden, _ = manager.dispatch_router_logits(torch.full((3, 8), rank + 1.0), torch.ones(3, 4))
    out = manager.combine(hidden)
    manager.destroy()
    return str(raised.value), out[:, 0].tolist()


@pytest.mark.parametrize("case", ["stated counts", "dispatch or combine"])
@pytest.mark.parametrize("backend", ["naive", "allgather_reducescatter"])
def test_in_debug_mode_ep_ranks_out_of_step_over_gloo_raise_naming_both(
    backend: str, case: str
) -> None:
    # Until 2026-11-29, over Gloo with debug_desync on: counts stated differently
    # returned other ranks' rows cut short or padded with garbage (naive), and a
    # dispatch against a combine waited until the group's timeout.
    results = run_ranks(_out_of_step_in_debug_mode_rank, 2, backend, case, timeout=60)
    if case == "stated counts":
        sides = [
            "dispatches hidden_states float32[8], router_logits float32[4] with token_counts([2, 3])",
            "dispatches hidden_states float32[8], router_logits float32[4] with token_counts([3, 2])",
        ]
    else:
        sides = [
            "dispatches hidden_states float32[8], router_logits float32[4]",
            "combines hidden_states float32[4, 8] for token counts [2, 2]",
        ]
    for rank, (message, combined) in enumerate(results):
        assert f"rank {rank} {sides[rank]}" in message, message
        assert f"rank {1 - rank} {sides[1 - rank]}" in message, message
        assert combined == [2.0 * (rank + 1)] * 3  # its own rows, summed over both ranks
