"""vLLM 0.33 call sites, unchanged but for the import prefix: a worker's start-up,
the model layers' collectives, MoE dispatch/combine, and the message queue as
vLLM's multiprocess executor drives it (idle workers, shutdown, a dead writer)."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
from ready_flags import mark, wait_for

from coordinator import communication_op as comm_op
from coordinator import parallel_state as ps
from coordinator.launch import init_gloo, run_ranks, start_ranks
from coordinator.utils import divide, ensure_divisibility, get_pp_indices


def _worker_start_up(rank: int, world: int) -> dict:
    method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    # vLLM's worker: positional arguments, a timedelta timeout.
    ps.init_distributed_environment(
        world, rank, method, rank, "gloo", datetime.timedelta(seconds=60)
    )
    ps.ensure_model_parallel_initialized(world, 1, 1, 1)
    try:
        x = torch.arange(8.0).reshape(2, 4) + rank
        got = {
            "all_reduce": comm_op.tensor_model_parallel_all_reduce(x).tolist(),
            "all_gather": comm_op.tensor_model_parallel_all_gather(x, dim=-1).shape[-1],
            "reduce_scatter": comm_op.tensor_model_parallel_reduce_scatter(
                torch.ones(2, 4 * world), dim=-1
            ).tolist(),
            "gather": comm_op.tensor_model_parallel_gather(x, dst=0, dim=0),
            "dict": comm_op.broadcast_tensor_dict(
                {"ids": torch.tensor([7, 8]), "n": 2} if rank == 0 else None, src=0
            ),
            # Every group vLLM builds exists after init, of size 1 where the parallelism is off.
            "sizes": [
                g().world_size
                for g in (
                    ps.get_ep_group,
                    ps.get_pcp_group,
                    ps.get_dcp_group,
                    ps.get_dp_group,
                    ps.get_inner_dp_world_group,
                )
            ],
            "ep_all2all": ps.get_ep_group().device_communicator.all2all_manager is not None,
            # No EP: expert weights are sharded over the EP group's ranks, so ETP is it.
            "etp_is_ep": ps.get_etp_group() is ps.get_ep_group(),
            # No DP: this rank has no DP peer on its node.
            "engram": (ps.get_engram_dp_group(), ps.get_engram_dp_size()),
        }
        if got["gather"] is not None:
            got["gather"] = got["gather"].shape[0]
        got["dict"] = {"ids": got["dict"]["ids"].tolist(), "n": got["dict"]["n"]}
        return got
    finally:
        ps.destroy_distributed_environment()


@pytest.mark.parametrize("world", [2, 4])
def test_worker_start_up_and_model_layer_collectives(world):
    results = run_ranks(_worker_start_up, world, timeout=90)
    expected_sum = [
        [float(sum(i + r for r in range(world))) for i in range(j, j + 4)] for j in (0, 4)
    ]
    for rank, got in enumerate(results):
        assert got["all_reduce"] == expected_sum
        assert got["all_gather"] == 4 * world
        assert got["reduce_scatter"] == [[float(world)] * 4] * 2
        assert got["gather"] == (2 * world if rank == 0 else None)
        assert got["dict"] == {"ids": [7, 8], "n": 2}
        assert got["sizes"] == [world, 1, 1, 1, world]
        assert got["ep_all2all"] is False  # positional (tp, pp, pcp, dcp): EP stays off
        assert got["etp_is_ep"] is True
        assert got["engram"] == (None, 1)


def _moe_round(rank: int, world: int, counts: list[int]) -> dict:
    method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    ps.init_distributed_environment(world, rank, method, rank, "gloo")
    ps.initialize_model_parallel(1, 1, data_parallel_size=world, enable_expert_parallel=True)
    try:
        ep = ps.get_ep_group()
        n = counts[rank]
        hidden = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + 100 * rank
        weights = torch.full((n, 2), rank + 0.5)
        ids = (torch.arange(n * 2, dtype=torch.int64).reshape(n, 2) + rank) % world
        out = ep.dispatch(hidden, weights, ids)
        assert isinstance(out, tuple) and len(out) == 3, type(out)
        all_hidden, all_weights, all_ids = out
        # This rank owns expert ``rank``: it keeps the tokens whose first choice is it.
        mine = (all_ids[:, 0] == rank).to(all_hidden.dtype).unsqueeze(1)
        partial = all_hidden * mine
        result = torch.empty_like(hidden)
        returned = ep.combine_into_output(partial, result)
        return {
            "hidden": all_hidden.tolist(),
            "weights": all_weights[:, 0].tolist(),
            "ids": all_ids.tolist(),
            "combined_ok": returned is result and torch.equal(result, hidden),
            # EP on: each rank holds whole experts, its ETP group is itself alone.
            "etp": (ps.get_etp_group().world_size, ps.get_etp_group().ranks),
            # One node: the engram DP group is the DP group.
            "engram_is_dp": ps.get_engram_dp_group() is ps.get_dp_group(),
            "engram_size": ps.get_engram_dp_size(),
        }
    finally:
        ps.destroy_distributed_environment()


@pytest.mark.parametrize(
    "counts", [[3, 0], [2, 1, 0, 3], [0, 0, 0, 0]], ids=["w2-uneven", "w4-uneven", "w4-empty"]
)
def test_moe_dispatch_returns_vllm_0_33_triple_and_combine_restores_tokens(counts):
    world = len(counts)
    results = run_ranks(_moe_round, world, counts, timeout=90)
    want_hidden = torch.cat(
        [
            torch.arange(c * 4, dtype=torch.float32).reshape(c, 4) + 100 * r
            for r, c in enumerate(counts)
        ]
    ).tolist()
    want_weights = [r + 0.5 for r, c in enumerate(counts) for _ in range(c)]
    for rank, got in enumerate(results):
        assert got["hidden"] == want_hidden
        assert got["weights"] == want_weights
        assert len(got["ids"]) == sum(counts)
        assert got["combined_ok"]
        assert got["etp"] == (1, [rank])
        assert got["engram_is_dp"] and got["engram_size"] == world


def _our_mappings() -> set[str]:
    """Names of this process's mapped shared-memory all-reduce segments."""
    with open("/proc/self/maps") as fh:
        return {
            line.split()[5].rsplit("/", 1)[-1]
            for line in fh
            if "_allreduce_" in line and len(line.split()) > 5
        }


def _sleep_mode(rank: int, world: int) -> dict:
    method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    ps.init_distributed_environment(world, rank, method, rank, "gloo")
    ps.initialize_model_parallel(world, 1, 1, 1)
    try:
        tp = ps.get_tp_group()
        comm = tp.device_communicator
        x = torch.arange(4096.0) * (rank + 1)
        want = torch.arange(4096.0) * sum(range(1, world + 1))

        def state() -> dict:
            return {
                "backend": comm.all_reduce_chain.select(x).name,
                "mapped": len(_our_mappings()) > 0,
                "all_reduce_ok": torch.equal(tp.all_reduce(x), want),
                "all_gather_ok": tp.all_gather(x.view(1, -1), dim=0).shape == (world, 4096),
            }

        got = {"before": state(), "names_before": _our_mappings()}
        ps.suspend_device_comms()
        ps.suspend_device_comms()  # a second suspend does nothing
        got["suspended"] = state()
        ps.resume_device_comms()
        got["resumed"] = state()
        got["fresh_segment"] = not (_our_mappings() & got.pop("names_before"))
        ps.checkpoint_prepare_distributed_state()
        got["checkpointed"] = state()
        ps.checkpoint_restore_distributed_state()
        got["restored"] = state()
        return got
    finally:
        ps.destroy_distributed_environment()


@pytest.mark.parametrize("world", [2, 4])
def test_sleep_mode_releases_shared_memory_and_collectives_stay_correct(world):
    up = {"backend": "shm", "mapped": True, "all_reduce_ok": True, "all_gather_ok": True}
    asleep = {
        "backend": "torch.distributed(gloo)",
        "mapped": False,
        "all_reduce_ok": True,
        "all_gather_ok": True,
    }
    for got in run_ranks(_sleep_mode, world, timeout=90):
        assert got == {
            "before": up,
            "suspended": asleep,
            "resumed": up,
            "fresh_segment": True,
            "checkpointed": asleep,
            "restored": up,
        }


def test_utils_as_vllm():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="not divisible"):
        ensure_divisibility(10, 4)
    assert [get_pp_indices(22, r, 4) for r in range(4)] == [(0, 5), (5, 11), (11, 17), (17, 22)]
    assert get_pp_indices(10, 1, 2, partition=[3, 7]) == (3, 10)


# ---- the message queue as vLLM's executor drives it -----------------------------------


def _queue(rank: int, world: int):
    from shm_broadcast.message_queue import MessageQueue

    init_gloo(rank, world)
    import torch.distributed as dist

    return MessageQueue.create_from_process_group(dist.group.WORLD, 1 << 20, 4, writer_rank=0)


def _idle_then_shutdown(rank: int, world: int) -> dict:
    from shm_broadcast.config import override
    from shm_broadcast.errors import ClosedError

    with override(timeout_s=1.0):  # the configured deadline: the idle reader must outlast it
        mq = _queue(rank, world)
        if rank == 0:
            time.sleep(2.5)
            mq.enqueue({"step": 1})
            time.sleep(1.0)
            mq.shutdown()  # what the executor does at exit: wakes the idle workers
            return {}
        start = time.monotonic()
        first = mq.dequeue()
        waited = time.monotonic() - start
        start = time.monotonic()
        try:
            mq.dequeue(indefinite=True)
            woke = "no error"
        except ClosedError as exc:
            woke = f"{type(exc).__mro__[1:4]} {exc}"
        woke_after = time.monotonic() - start
        mq.shutdown()
        return {"first": first, "waited": waited, "woke": woke, "woke_after": woke_after}


def test_an_idle_worker_outlasts_the_deadline_and_shutdown_wakes_it():
    reader = run_ranks(_idle_then_shutdown, 2, timeout=60)[1]
    assert reader["first"] == {"step": 1}
    assert reader["waited"] > 2.0  # more than the 1 s configured deadline
    assert "RuntimeError" in reader["woke"] and "shut" in reader["woke"]
    assert reader["woke_after"] < 2.0


def _idle_reader_cpu(rank: int, world: int) -> dict:
    mq = _queue(rank, world)
    try:
        if rank == 0:
            for _ in range(3):
                time.sleep(0.8)  # the reader idles in dequeue() meanwhile
                mq.enqueue(time.monotonic())
            time.sleep(0.2)
            return {}
        cpu = time.process_time()
        delays = []
        for _ in range(3):
            sent = mq.dequeue()
            delays.append(time.monotonic() - sent)
        return {"cpu_s": time.process_time() - cpu, "delays": delays}
    finally:
        mq.shutdown()


def test_an_idle_reader_sleeps_and_the_next_message_wakes_it():
    reader = run_ranks(_idle_reader_cpu, 2, timeout=60)[1]
    # 2.4 s idle: sleeping on the ring's bell costs ~0.02 s of CPU; the old
    # 100 us polling loop cost 0.6 s (a quarter of a core).
    assert reader["cpu_s"] < 0.25, reader
    # Woken by the message, not by a poll of peer liveness (0.5 s apart).
    assert max(reader["delays"]) < 0.1, reader


def _reader_of_a_killed_writer(rank: int, world: int, flag_dir: str) -> dict:
    from shm_broadcast.errors import PeerDiedError

    mq = _queue(rank, world)
    if rank == 0:
        mark(flag_dir, "queue up")
        time.sleep(60)  # killed by the test while the reader idles
        return {}
    try:
        mq.dequeue()
    except PeerDiedError as exc:
        return {"detected_at": time.monotonic(), "message": str(exc)}
    finally:
        mq.shutdown()
    return {"detected_at": None}


def test_a_reader_idling_on_a_killed_writer_raises_peer_died_within_seconds(tmp_path):
    group = start_ranks(_reader_of_a_killed_writer, 2, str(tmp_path), timeout=60)
    wait_for(str(tmp_path), "queue up")
    time.sleep(1.0)  # the reader is idle in dequeue() by now
    killed_at = time.monotonic()
    group.kill(0)
    reader = group.collect(killed=[0])[1]
    assert reader["detected_at"] is not None
    assert reader["detected_at"] - killed_at < 5.0
    assert "writer" in reader["message"]


def _stateless_groups(rank: int, world: int, ports: list[int]) -> dict:
    import torch.distributed as dist

    from coordinator.utils import (
        stateless_destroy_torch_distributed_process_group,
        stateless_init_torch_distributed_process_group,
    )
    from shm_broadcast.errors import GroupcoordValueError

    # No default world at all: two groups side by side, as an engine's DP groups.
    assert not dist.is_initialized()
    pg, store = stateless_init_torch_distributed_process_group(
        "127.0.0.1", ports[0], rank, world, "gloo", return_store=True,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    other = stateless_init_torch_distributed_process_group(
        "127.0.0.1", ports[1], rank, world, "gloo", group_name="dp", timeout=30
    )
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=pg)
    u = torch.tensor([rank])
    dist.all_reduce(u, group=other, op=dist.ReduceOp.MAX)
    store.set(f"seen{rank}", "yes")
    with pytest.raises(GroupcoordValueError, match="gloo"):
        stateless_init_torch_distributed_process_group("127.0.0.1", ports[0], rank, world, "nccl")
    stateless_destroy_torch_distributed_process_group(other)
    stateless_destroy_torch_distributed_process_group(pg)
    return {"sum": t.tolist(), "max": u.item(), "store": store.get(f"seen{rank}").decode()}


def test_stateless_torch_process_groups_outside_the_default_world():
    from coordinator.launch import free_port

    ports = [free_port(), free_port()]
    for got in run_ranks(_stateless_groups, 2, ports, timeout=60):
        assert got == {"sum": [3.0] * 4, "max": 1, "store": "yes"}


SPAWNED_EXECUTOR = """
import dataclasses, enum, multiprocessing, sys
import msgspec, torch
from shm_broadcast import MessageQueue, add_safe_types

class Kind(enum.Enum):
    RUN = 1
    STOP = 2

@dataclasses.dataclass
class Call:
    kind: Kind
    args: tuple

class Reply(msgspec.Struct):
    rank: int
    doubled: int
    ids: torch.Tensor

def worker(rank, handle, conn):
    # In this process the script is __mp_main__: Call is __mp_main__.Call here.
    add_safe_types([Call, Kind])
    requests = MessageQueue.create_from_handle(handle, rank)
    replies = MessageQueue(1, 1)
    conn.send(replies.export_handle())
    requests.wait_until_ready()
    replies.wait_until_ready()
    while (call := requests.dequeue(timeout=30)).kind is Kind.RUN:
        replies.enqueue(Reply(rank, 2 * call.args[0], torch.arange(3) + rank))
    replies.enqueue(Kind.STOP)

if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[1])
    add_safe_types([Call, Kind])
    requests = MessageQueue(2, 2)
    workers, pipes = [], []
    for rank in range(2):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=worker, args=(rank, requests.export_handle(), theirs))
        p.start()
        workers.append(p)
        pipes.append(mine)
    replies = [MessageQueue.create_from_handle(pipe.recv(), 0) for pipe in pipes]
    requests.wait_until_ready()
    for q in replies:
        q.wait_until_ready()
    got = []
    for i in range(3):
        requests.enqueue(Call(Kind.RUN, (i,)))
        got += [(r.rank, r.doubled, r.ids.tolist()) for r in (q.dequeue(timeout=30) for q in replies)]
    requests.enqueue(Call(Kind.STOP, ()))
    assert [q.dequeue(timeout=30) for q in replies] == [Kind.STOP, Kind.STOP]
    for p in workers:
        p.join(30)
    print(got, [p.exitcode for p in workers])
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_classes_of_the_main_script_cross_to_spawned_workers_and_back(tmp_path, method):
    # vLLM starts its workers with spawn: there the script runs as __mp_main__,
    # and its classes must keep the one name the driver gives them, both ways.
    import subprocess
    import sys

    script = tmp_path / "executor.py"
    script.write_text(SPAWNED_EXECUTOR)
    proc = subprocess.run(
        [sys.executable, str(script), method],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = [(r, 2 * i, [r, r + 1, r + 2]) for i in range(3) for r in (0, 1)]
    assert proc.stdout.strip() == f"{expected} [0, 0]"
