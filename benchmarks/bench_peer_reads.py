"""Direct reads of the peers' memory against the shared-memory slots, in one run.

Whether a large CPU collective reads the peers' memory (``process_vm_readv``)
or copies through the shared slots: where the size rules
(``device_communicators/peer_reads.py``; docs/cpu_communicator.md, "Reading
the peers' memory directly") would read directly, the group times both ways
now and then and takes the faster (``peer_reads.TimedWays``). Two separate
runs of ``bench_collectives.py``, one with ``GROUPCOORD_DISABLE_PEER_READS=1``,
do not settle such a choice on a shared host: whole runs move (on the 2-core
EPYC VM a 512 KiB world-2 broadcast through the slots took 44-62 µs in some
runs and 119-137 µs in others). Here the ways are timed in the same ranks on
the same buffers: every round times a batch as shipped ("rule"), a batch
with peer reads off ("slots") and a batch by the size rules alone, untimed
("fixed": read directly wherever they allow), all ranks switching together,
the order rotating every round (``_timing.batch_seconds_each``, as
``bench_collectives.py`` alternates ours and Gloo's). Reported: the median of
the rounds for each, ``slots_vs_rule`` = slots time / rule time (above 1: the
rule's choice is faster), ``fixed_vs_rule`` likewise, how many rounds the
rule beat the slots, whether any call read directly (``path``) and the way
the timing settled on (``timed``; empty where the size rules take the
slots). Where two columns run the same way, their ratio shows the noise
floor (mostly 0.97-1.04 on the 2-core EPYC VM, but 0.82 with one side
winning 8 of 8 rounds once, on identical code): trust a ratio well clear of
it. The timing itself costs a short run such as this one up to 11 of a
size's first 96 calls on the losing way.

    python benchmarks/bench_peer_reads.py --quick
    python benchmarks/bench_peer_reads.py --worlds 2,4 --sizes 393216,1048576,4194304 --ops broadcast --rounds 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402 - after the path set-up above
    environment,
    human_bytes,
    init_gloo_rank,
    prepare_parent,
    print_table,
    reproduce_command,
    write_json,
)
from _timing import batch_seconds_each  # noqa: E402

from coordinator.launch import free_port, run_ranks  # noqa: E402

OPS = ["all_gather", "reduce_scatter", "all_reduce", "broadcast"]
SIZES = [393216, 1048576, 4194304, 16777216]
QUICK_SIZES = [393216, 4194304]
COLUMNS = [
    "world", "op", "size", "path", "timed", "rule_us", "slots_us", "fixed_us", "slots_vs_rule",
    "fixed_vs_rule", "rule_won",
]  # fmt: skip


def _call(group: Any, op: str, x: Any) -> Callable[[], Any]:
    """The timed call: ``op`` of ``x`` on ``group`` (dim 0; broadcast from rank 0)."""
    if op == "all_gather":
        return lambda: group.all_gather(x, 0)
    if op == "reduce_scatter":
        return lambda: group.reduce_scatter(x, 0)
    if op == "all_reduce":
        return lambda: group.all_reduce(x)
    return lambda: group.broadcast(x, 0)


def _rank_main(
    rank: int, world: int, port: int, sizes: list[int], ops: list[str], rounds: int
) -> list[dict[str, Any]] | str:
    """One rank's sweep: rank 0 returns the rows (or why there are none)."""
    import torch
    import torch.distributed as dist

    from coordinator.group_coordinator import GroupCoordinator

    init_gloo_rank(rank, world, port, timeout_s=600)
    group = GroupCoordinator(
        [list(range(world))], rank, "gloo", True, use_message_queue_broadcaster=False
    )
    shm = group.device_communicator.shm_all_reduce  # type: ignore[union-attr]
    reads, timed_ways = shm.peer_reads, shm.timed_ways
    if reads is None:
        group.destroy()
        return f"no direct reads here: {shm.peer_reads_reason or shm.disabled_reason}"

    def agree(value: int) -> int:
        box = torch.tensor([value])
        dist.broadcast(box, 0)
        return int(box)

    rows = []
    for op in ops:
        for nbytes in sizes:
            call = _call(group, op, torch.randn(nbytes // 4))

            def as_shipped(call: Callable[[], Any] = call) -> None:
                shm.peer_reads, shm.timed_ways = reads, timed_ways
                call()

            def slots_only(call: Callable[[], Any] = call) -> None:
                shm.peer_reads = None
                call()

            def fixed_rule(call: Callable[[], Any] = call) -> None:
                shm.peer_reads, shm.timed_ways = reads, None
                call()

            before = reads.reads_made
            max_iters = max(2, (64 << 20) // (nbytes * world))
            rule_times, slot_times, fixed_times = batch_seconds_each(
                [as_shipped, slots_only, fixed_rule], agree, max_iters, rounds
            )
            fixed = statistics.median(fixed_times)
            shm.peer_reads, shm.timed_ways = reads, timed_ways
            direct = reads.reads_made > before
            # Did any rank read directly (a broadcast's root never does)?
            flag = torch.tensor([int(direct)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            direct = bool(flag)
            rule, slots = statistics.median(rule_times), statistics.median(slot_times)
            won = sum(a < b for a, b in zip(rule_times, slot_times))
            state = timed_ways.state(op, nbytes) if timed_ways else None
            rows.append(
                {
                    "world": world,
                    "op": op,
                    "bytes": nbytes,
                    "size": human_bytes(nbytes),
                    "path": "direct" if direct else "slots",
                    "timed": "" if state is None else "direct" if state["direct"] else "slots",
                    "rule_us": rule * 1e6,
                    "slots_us": slots * 1e6,
                    "fixed_us": fixed * 1e6,
                    "slots_vs_rule": slots / rule,
                    "fixed_vs_rule": fixed / rule,
                    "rule_won": f"{won}/{rounds}",
                }
            )
    group.destroy()
    dist.destroy_process_group()
    return rows if rank == 0 else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--sizes", default="", help="comma-separated bytes per rank")
    parser.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds (default 8)")
    parser.add_argument("--quick", action="store_true", help="two sizes, four rounds")
    parser.add_argument("--json", default="bench_results/peer_reads.json")
    parser.add_argument("--timeout", type=float, default=900.0, help="per world size, seconds")
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"--ops: unknown {unknown}; known: {OPS}")
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else (QUICK_SIZES if args.quick else SIZES)
    )
    rounds = 4 if args.quick and args.rounds == 8 else args.rounds
    command = reproduce_command(None if argv is None else [sys.argv[0], *argv])
    print(f"# {command}", flush=True)
    prepare_parent()
    rows: list[dict[str, Any]] = []
    for world in (int(w) for w in args.worlds.split(",")):
        got = run_ranks(_rank_main, world, free_port(), sizes, ops, rounds, timeout=args.timeout)
        if isinstance(got[0], str):
            print(f"# world {world}: {got[0]}", flush=True)
            continue
        rows.extend(got[0])
    print_table(rows, COLUMNS)
    path = write_json(args.json, {"command": command, "environment": environment(), "rows": rows})
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
