"""Benchmark the MessageQueue against torch.distributed.broadcast_object_list (Gloo).

One writer with 1 and 3 readers (world 2 and 4, forked ranks on this machine):
a small-object stream (a dict of a few ints and a short string) and 64 B,
4 KiB, 1 MiB, 16 MiB payloads as ``bytes`` and as tensors. For each case:
throughput (msgs/s, GB/s delivered per reader; median of 5 timed rounds after
warm-up), one-way latency p50/p99 (a
timestamp inside the message, messages spaced so none waits in the queue), and
Gloo's ``broadcast_object_list`` in the same world and run, with the ratio.
Two more rows force every reader onto the TCP path (remote readers). The
"engine step" row sends what an engine broadcasts every step: a dataclass
shaped like a scheduler output (10 fields: ids, nested lists, a dict, a set)
plus 4 small tensors (input ids, positions, slot mapping, sequence lengths),
declared with ``add_safe_types``; Gloo pickles the same object.

vLLM 0.33's ``MessageQueue`` is a second peer when vllm is installed
(``bash scripts/setup_vllm_peer.sh``; else the table says why the column is
empty, ``--no-vllm`` leaves it out): the same cases in the same ranks, its
timed rounds alternating with ours, the same ring geometry (its own
GroupCoordinator's 4 MiB x 6 ring in the "default ring" rows), every reader
remote in the TCP rows. "vs vllm" = ours / vLLM msgs/s. vLLM's remote readers
have no flow control and lose messages when the writer runs ahead ("vllm
lost"); its TCP rows count what was delivered.

    python benchmarks/bench_mq.py            # full run
    python benchmarks/bench_mq.py --quick    # < 60 s
    python benchmarks/bench_mq.py --plot     # also bench_results/mq.png
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from coordinator.launch import free_port, run_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402 - after the path set-up above
    environment,
    human_bytes,
    init_gloo_rank,
    median,
    percentile,
    plot_lines,
    prepare_parent,
    print_table,
    reproduce_command,
    write_json,
)

SIZES = [64, 4 << 10, 1 << 20, 16 << 20]


@dataclasses.dataclass
class EngineStep:
    """The shape of a scheduler output an engine broadcasts to its workers each step."""

    step: int
    req_ids: list[str]
    new_req_prompts: list[list[int]]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: list[str]
    num_common_prefix_blocks: list[int]
    use_spec_decode: bool
    grammar_bitmask: bytes | None
    input_ids: Any
    positions: Any
    slot_mapping: Any
    seq_lens: Any


def _engine_step() -> EngineStep:
    import torch

    reqs = [f"req-{i}" for i in range(16)]
    return EngineStep(
        step=1234,
        req_ids=reqs,
        new_req_prompts=[list(range(i, i + 12)) for i in range(2)],
        num_scheduled_tokens={r: 16 for r in reqs},
        total_num_scheduled_tokens=256,
        finished_req_ids={"req-99", "req-98"},
        preempted_req_ids=[],
        num_common_prefix_blocks=[0, 3],
        use_spec_decode=False,
        grammar_bitmask=None,
        input_ids=torch.arange(256, dtype=torch.int32),
        positions=torch.arange(256, dtype=torch.int64),
        slot_mapping=torch.arange(256, dtype=torch.int64) + 4096,
        seq_lens=torch.full((16,), 300, dtype=torch.int32),
    )


ROUNDS = 5  # throughput is the median of this many timed rounds


def _cases(quick: bool) -> list[dict[str, Any]]:
    """(name, kind, size, messages for ours, messages for Gloo, latency samples)."""
    scale = 0.25 if quick else 1.0
    cases = [
        {
            "name": "small-object",
            "kind": "object",
            "size": 0,
            "n": 40_000,
            "gloo": 2_000,
            "lat": 2_000,
        }
    ]
    for size in SIZES:
        n, gloo, lat = {
            64: (40_000, 2_000, 2_000),
            4 << 10: (20_000, 2_000, 2_000),
            1 << 20: (400, 100, 100),
            16 << 20: (40, 12, 20),
        }[size]
        for kind in ("bytes", "tensor"):
            cases.append(
                {
                    "name": f"{kind} {human_bytes(size)}",
                    "kind": kind,
                    "size": size,
                    "n": n,
                    "gloo": gloo,
                    "lat": lat,
                }
            )
    cases.append(
        {"name": "engine step", "kind": "step", "size": 0, "n": 20_000, "gloo": 2_000, "lat": 2_000}
    )
    # Remote readers: every message over ZeroMQ TCP with MACs and credits.
    cases.append(dict(cases[0], name="small-object TCP", tcp=True, n=20_000))
    cases.append(
        {
            "name": "tensor 1 MiB TCP",
            "kind": "tensor",
            "size": 1 << 20,
            "n": 200,
            "gloo": 50,
            "lat": 50,
            "tcp": True,
        }
    )
    # The queue a GroupCoordinator builds (GROUPCOORD_MQ_MAX_CHUNK_BYTES x
    # GROUPCOORD_MQ_MAX_CHUNKS, 4 MiB x 10): a 16 MiB message spans chunks of
    # the ring, a 64 MiB one is larger than the ring and goes over ZeroMQ.
    for size, n, gloo, lat in ((16 << 20, 40, 12, 20), (64 << 20, 12, 6, 8)):
        cases.append(
            {
                "name": f"tensor {human_bytes(size)} default ring",
                "kind": "tensor",
                "size": size,
                "n": n,
                "gloo": gloo,
                "lat": lat,
                "defaults": True,
            }
        )
    for case in cases:
        for key in ("n", "gloo", "lat"):
            case[key] = max(int(case[key] * scale), 8)
    return cases


def _payload(kind: str, size: int) -> Any:
    import torch

    if kind == "step":
        return _engine_step()
    if kind == "object":
        return {"request": 12345, "step": 7, "tokens": 512, "flags": 3, "name": "req-12345"}
    if kind == "bytes":
        return os.urandom(size)
    return torch.randint(0, 255, (size,), dtype=torch.uint8)


def _tcp_queue(group: Any, rank: int, world: int, chunk: int, chunks: int) -> Any:
    """Every reader forced onto the TCP path (as if on other nodes), over 127.0.0.1."""
    from shm_broadcast.codec import dumps, loads
    from shm_broadcast.group_io import broadcast_bytes
    from shm_broadcast.message_queue import MessageQueue

    if rank == 0:
        mq = MessageQueue(world - 1, 0, [], chunk, chunks, "127.0.0.1")
        broadcast_bytes(group, dumps(mq.export_handle()))
    else:
        mq = MessageQueue.create_from_handle(loads(broadcast_bytes(group, None)), rank)
    mq.wait_until_ready()
    return mq


def _spin_until(t: float) -> None:
    while time.perf_counter() < t:
        os.sched_yield()


# vLLM's remote readers sit behind an XPUB socket with no flow control: once a
# reader is about 1,000 messages behind, messages to it are dropped (measured:
# 5,000 sent as fast as they go, 4,406 delivered). A reader that waits for every
# message then waits for ever, so on a ``lossy`` queue a reader ends a round when
# nothing has come for LOSS_WAIT_S, counts what it missed, and the round's time
# ends at its last delivery.
LOSS_WAIT_S = 1.0


def _dequeue(mq: Any, count: int, lossy: bool) -> tuple[int, float]:
    """Dequeue ``count`` messages: (how many came, perf_counter after the last)."""
    if not lossy:
        for _ in range(count):
            mq.dequeue()
        return count, time.perf_counter()
    got, last = 0, time.perf_counter()
    for _ in range(count):
        try:
            mq.dequeue(timeout=LOSS_WAIT_S)
        except TimeoutError:
            break
        got += 1
        last = time.perf_counter()
    return got, last


def _measure_queues(
    queues: list[tuple[Any, bool]], payload: Any, case: dict[str, Any], rank: int
) -> list[tuple[float, list[float], int]]:
    """For each (queue, lossy): (median seconds per delivered message, one-way
    latencies seen by this rank, messages lost by all readers). Ours and vLLM's
    queue make the same ``enqueue``/``dequeue`` calls in the same loops, and their
    timed rounds alternate (each goes first in every other round), so a slow
    spell of the machine falls on both rather than on one."""
    import torch
    import torch.distributed as dist

    # Throughput: the writer streams n messages in ROUNDS rounds; each round
    # lasts until the last reader has all of it; the median round counts.
    n = case["n"]
    warm_up = min(200, n)
    for mq, lossy in queues:
        if rank == 0:
            for _ in range(warm_up):
                mq.enqueue(payload)
        else:
            _dequeue(mq, warm_up, lossy)
    per_round = max(n // ROUNDS, 1)
    rounds: list[list[float]] = [[] for _ in queues]
    lost = [0 for _ in queues]
    for round_ in range(ROUNDS):
        order = list(range(len(queues)))
        if round_ % 2:
            order.reverse()
        for q in order:
            mq, lossy = queues[q]
            dist.barrier()
            t0 = time.perf_counter()
            got, end = per_round, 0.0
            if rank == 0:
                for _ in range(per_round):
                    mq.enqueue(payload)
                end = time.perf_counter()
            else:
                got, end = _dequeue(mq, per_round, lossy)
            lost[q] += per_round - got
            seconds = torch.tensor([(end - t0) / max(got, 1)], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            rounds[q].append(seconds.item())

    results = []
    for q, (mq, lossy) in enumerate(queues):
        s_per_msg = median(rounds[q])
        # Latency: a timestamp travels with the payload; messages are spaced so
        # each finds the queue empty. perf_counter is CLOCK_MONOTONIC: one clock
        # for every process on the machine.
        gap = max(2.0 * s_per_msg, 50e-6)
        lat = []
        dist.barrier()
        for _ in range(case["lat"]):
            if rank == 0:
                mq.enqueue((time.perf_counter(), payload))
                _spin_until(time.perf_counter() + gap)
            else:
                try:
                    sent, _ = mq.dequeue(timeout=LOSS_WAIT_S) if lossy else mq.dequeue()
                except TimeoutError:
                    lost[q] += 1
                    continue
                lat.append(time.perf_counter() - sent)
        total_lost = torch.tensor([lost[q]])
        dist.all_reduce(total_lost)
        results.append((s_per_msg, lat, int(total_lost)))
    return results


def vllm_missing() -> str | None:
    """Why vLLM's queue cannot be the peer column here, or None. Asked in the parent
    without importing vllm (the forking parent stays light); the ranks import it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (bash scripts/setup_vllm_peer.sh)"
    return None


def _import_vllm_queue() -> Any:
    """vLLM's MessageQueue class, imported at a rank's start so that every case,
    ours and vLLM's, runs in the same process state (the import takes ~2 s)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    return MessageQueue


def _vllm_queue(
    queue_class: Any,
    group: Any,
    rank: int,
    world: int,
    case: dict[str, Any],
    chunk: int,
    chunks: int,
) -> Any:
    """vLLM 0.33's queue for the same case: the same ring geometry, its own
    GroupCoordinator's (4 MiB x 6) for the default-ring rows, every reader remote
    for the TCP rows."""
    import torch.distributed as dist

    if case.get("defaults"):
        chunk, chunks = 1 << 22, 6  # vllm/distributed/parallel_state.py
    if not case.get("tcp"):
        return queue_class.create_from_process_group(group, chunk, chunks)
    box: list[Any] = [None]
    if rank == 0:
        mq = queue_class(world - 1, 0, None, chunk, chunks, connect_ip="127.0.0.1")
        box[0] = mq.export_handle()
    dist.broadcast_object_list(box, src=0, group=group)  # vLLM's handle is a dataclass
    if rank != 0:
        mq = queue_class.create_from_handle(box[0], rank)
    mq.wait_until_ready()
    return mq


def _bench_rank(
    rank: int, world: int, port: int, cases: list[dict[str, Any]], with_vllm: bool
) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from shm_broadcast.config import get_config
    from shm_broadcast.message_queue import MessageQueue

    vllm = _import_vllm_queue() if with_vllm else None
    init_gloo_rank(rank, world, port, timeout_s=300)
    group = dist.group.WORLD
    results = []
    for case in cases:
        size = case["size"]
        # A chunk holds the largest message of the case: every message rides the ring.
        chunk = max(1 << 16, size + (1 << 16))
        chunks = 10 if size <= (1 << 20) else 4
        if case.get("defaults"):
            cfg = get_config()
            chunk, chunks = cfg.mq_max_chunk_bytes, cfg.mq_max_chunks
        if case.get("tcp"):
            mq = _tcp_queue(group, rank, world, chunk, chunks)
        else:
            mq = MessageQueue.create_from_process_group(group, chunk, chunks)
        payload = _payload(case["kind"], size) if rank == 0 else None
        out: dict[str, Any] = {}
        queues = [(mq, False)]
        if vllm is not None:
            # vLLM's remote readers can lose messages (see LOSS_WAIT_S).
            peer = _vllm_queue(vllm, group, rank, world, case, chunk, chunks)
            queues.append((peer, bool(case.get("tcp"))))
        measured = _measure_queues(queues, payload, case, rank)
        out["ours_s_per_msg"], out["lat"], lost = measured[0]
        assert lost == 0, f"our queue lost {lost} messages"
        if vllm is not None:
            out["vllm_s_per_msg"], out["vllm_lat"], out["vllm_lost"] = measured[1]
        for mq, _ in queues:
            mq.shutdown()

        # Gloo's broadcast_object_list (pickle + two broadcasts) in the same world.
        gloo_lat = []
        for _ in range(min(20, case["gloo"])):
            dist.broadcast_object_list([payload], src=0, group=group)
        per_round = max(case["gloo"] // ROUNDS, 1)
        rounds = []
        for _ in range(ROUNDS):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(per_round):
                t1 = time.perf_counter()
                objs = [payload]
                dist.broadcast_object_list(objs, src=0, group=group)
                gloo_lat.append(time.perf_counter() - t1)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rounds.append(elapsed.item() / per_round)
        out["gloo_s_per_msg"] = median(rounds)
        out["gloo_lat"] = gloo_lat
        results.append(out)
    dist.destroy_process_group()
    return results


def run_world(
    world: int, cases: list[dict[str, Any]], timeout: float, with_vllm: bool
) -> list[list[dict[str, Any]]]:
    """Fork ``world`` ranks, run every case, return each rank's measurements."""
    from shm_broadcast import add_safe_types

    add_safe_types([EngineStep])  # before the ranks fork: every rank may rebuild it
    return run_ranks(_bench_rank, world, free_port(), cases, with_vllm, timeout=timeout)


def summarize(
    world: int, cases: list[dict[str, Any]], per_rank: list[list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    rows = []
    for i, case in enumerate(cases):
        readers = [per_rank[r][i] for r in range(1, world)]
        lat = [x for r in readers for x in r["lat"]]
        gloo_lat = [x for r in readers for x in r["gloo_lat"]]
        msgs = 1.0 / per_rank[0][i]["ours_s_per_msg"]
        gloo_msgs = 1.0 / per_rank[0][i]["gloo_s_per_msg"]
        nbytes = case["size"]
        vllm: dict[str, Any] = dict.fromkeys(("vllm msgs/s", "vllm p50 us", "vs vllm", "vllm lost"))
        if "vllm_s_per_msg" in per_rank[0][i]:
            vllm_msgs = 1.0 / per_rank[0][i]["vllm_s_per_msg"]
            vllm_lat = [x for r in readers for x in r["vllm_lat"]]
            vllm = {
                "vllm msgs/s": vllm_msgs,
                "vllm p50 us": median(vllm_lat) * 1e6,
                "vs vllm": msgs / vllm_msgs,
                "vllm lost": per_rank[0][i]["vllm_lost"],
            }
        rows.append(
            {
                "readers": world - 1,
                "case": case["name"],
                "bytes": nbytes,
                "msgs/s": msgs,
                "GB/s": msgs * nbytes / 1e9,
                "p50 us": median(lat) * 1e6,
                "p99 us": percentile(lat, 99) * 1e6,
                "gloo msgs/s": gloo_msgs,
                "gloo p50 us": median(gloo_lat) * 1e6,
                "ratio": msgs / gloo_msgs,
                **vllm,
            }
        )
    return rows


COLUMNS = [
    "readers",
    "case",
    "msgs/s",
    "GB/s",
    "p50 us",
    "p99 us",
    "gloo msgs/s",
    "gloo p50 us",
    "ratio",
    "vllm msgs/s",
    "vllm p50 us",
    "vs vllm",
    "vllm lost",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer messages: finishes in < 60 s")
    parser.add_argument(
        "--readers", type=int, nargs="+", default=[1, 3], help="reader counts to run"
    )
    parser.add_argument(
        "--json", default="bench_results/mq.json", help="where to write the results"
    )
    parser.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    parser.add_argument(
        "--cases", default="", help="only cases whose name contains one of these (comma-separated)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per-world deadline, seconds")
    parser.add_argument(
        "--no-vllm", action="store_true", help="leave vLLM 0.33's queue (the peer column) out"
    )
    args = parser.parse_args(argv)
    no_vllm = "left out (--no-vllm)" if args.no_vllm else vllm_missing()
    if no_vllm:
        print(f"# no vLLM column: {no_vllm}", flush=True)

    prepare_parent()  # the ranks get torch's default threads
    cases = _cases(args.quick)
    if args.cases:
        wanted = args.cases.split(",")
        cases = [c for c in cases if any(w in c["name"] for w in wanted)]
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for readers in args.readers:
        per_rank = run_world(readers + 1, cases, args.timeout, with_vllm=not no_vllm)
        rows.extend(summarize(readers + 1, cases, per_rank))
    took = time.perf_counter() - start
    print_table(rows, COLUMNS)
    print(
        f"\nmsgs/s and GB/s: delivered to every reader (bytes = payload per message); latency: one-way, "
        f"writer enqueue to reader dequeue-return; ratio = ours / Gloo broadcast_object_list msgs/s;\n"
        f"vs vllm = ours / vLLM 0.33's MessageQueue msgs/s (same ranks, same loops); vllm lost =\n"
        f"messages its remote (TCP) readers never got (no flow control: it drops them).\n"
        f"ran in {took:.1f} s on {os.cpu_count()} CPUs"
    )
    command = reproduce_command(
        ["benchmarks/bench_mq.py", *(argv if argv is not None else sys.argv[1:])]
    )
    data = {"benchmark": "mq", "command": command, "environment": environment(), "rows": rows}
    print(f"JSON: {write_json(args.json, data)}")
    if args.plot:
        series = {}
        for readers in args.readers:
            for prefix, key in (("ours", "msgs/s"), ("gloo", "gloo msgs/s")):
                for kind in ("bytes", "tensor"):
                    pts = [
                        r
                        for r in rows
                        if r["readers"] == readers
                        and r["case"].startswith(kind)
                        and not r["case"].endswith("TCP")
                    ]
                    series[f"{prefix} {kind}, {readers} reader(s)"] = (
                        [r["bytes"] for r in pts],
                        [r[key] for r in pts],
                    )
        png = os.path.splitext(args.json)[0] + ".png"
        plot_lines(
            png,
            series,
            title="MessageQueue vs Gloo broadcast_object_list",
            xlabel="payload bytes",
            ylabel="messages/s",
        )
        print(f"PNG: {png}")
    print(f"reproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
