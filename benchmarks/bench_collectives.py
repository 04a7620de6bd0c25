"""GroupCoordinator collectives vs plain torch.distributed over Gloo, same ranks, same run.

Ops: all_reduce, all_gather, reduce_scatter, reduce_scatterv (uneven cuts;
torch's side an all-reduce, then this rank's rows), broadcast (one tensor from rank
0, in place), broadcast_tensor_dict (8 tensors plus plain values), broadcast_object
(a dict holding ``size`` bytes; Gloo's side ``broadcast_object_list``, which pickles;
ours goes through the group's message queue unless ``--no-mq``), send/recv_tensor_dict and send_recv (one tensor: ``send``
then ``recv``), rank 0 -> 1 -> 0 ping-pongs timed per one-way trip, and
ring_exchange (every rank sends its tensor right and receives its left
neighbour's, all in flight at once: ours is a ``coordinator.comm`` batch,
torch's ``dist.batch_isend_irecv``), barrier, gather (to rank 0), reduce
(SUM to rank 0), all_to_all (equal blocks), all_to_all_v (the same with
explicit split sizes) and scatter (from rank 0; ours is ``Comm.reduce``,
``Comm.all_to_all_single``, ``Comm.all_to_all_v_single`` and ``Comm.scatter``
for these, which ``GroupCoordinator`` lacks). Sizes are total bytes per rank. The torch side is what an engine would
write without groupcoord: ``dist.all_reduce``, ``dist.all_gather_single``,
``dist.reduce_scatter_single``, ``dist.broadcast``, ``broadcast_object_list`` of the metadata then
one ``broadcast`` per tensor, ``send_object_list`` then one ``send`` per
tensor, and ``dist.send``/``dist.recv`` into a fresh tensor.

    python benchmarks/bench_collectives.py --quick
    python benchmarks/bench_collectives.py --worlds 2,4 --plot

The same all_reduce, all_gather, reduce_scatter, broadcast and send_recv also run
through the torchcomms-style ``coordinator.comm.Comm`` on the group (``comm_us``;
``comm_vs_group`` = Comm time / GroupCoordinator time, 1.0 = same speed).

Numbers are medians over batches after a warm one; a batch is as many calls as
take about 50 ms (at most the byte budget), the same rule for ours, Gloo's
and MPI's (``_timing.py``); ours, Gloo's and Comm's batches take turns (the
order rotating), so drift over the run reaches each alike (MPI runs in its
own processes, before); ratio = torch time / ours.

``--threads default,1`` runs each world with torch's default intra-op threads
and with one (``threads`` column). ``--interleave`` puts an engine step's
other work between calls (a 256x256 matmul on torch's default threads and a
small Gloo all-reduce) on both sides: times then include that work (its own
time alone is ``work_us``), the case where a thread pool left spinning by
torch ops competes with the collective. MPI (mpi4py over MPICH's shared-memory transport, started with
``mpiexec``; the ``bench`` extra installs both) is a third column for
all_reduce, all_gather, reduce_scatter, broadcast and send_recv: ``mpi_us`` and ``mpi_ratio`` = MPI
time / ours (> 1: ours is faster); without it the column says why it is empty.

Every side's inputs are on ordinary 4 KiB pages, as torch allocates an
engine's tensors: MPI's numpy arrays too (``NUMPY_MADVISE_HUGEPAGE=0``; numpy
otherwise asks for transparent huge pages from 4 MiB, which made MPI's 4 and 16
MiB all_gather 1.5-1.8x faster here, 2026-11-29: a kernel read of huge pages
pins 512 times fewer pages). ``--huge-pages`` puts every side's inputs of 4 MiB
and more on huge pages instead (ours and Gloo's through ``empty_output``'s
hint, MPI's by numpy's default): both ways compare the same memory. Our results
come from ``empty_output`` either way (huge pages from 4 MiB where the kernel
grants them), Gloo's and MPI's outputs are allocated once, as a caller would.

``--instructions`` counts instead of timing: the CPU instructions one
``GroupCoordinator`` call of each of ``INSTRUCTION_OPS`` (those of ``--ops``;
4 KiB unless ``--sizes``) executes on rank 0 of a world of 2, rank 0 under
valgrind's callgrind (``_callgrind.py``) and rank 1 running natively. Rank 0,
some 50 times slower there, is the last to arrive at every barrier, so its
count is its own work, without waiting: the per-call cost of the lean path
that decides small calls, a number the host's load does not move (about 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from coordinator.launch import free_port, run_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _callgrind import count_instructions, missing_tools, run_phases  # noqa: E402
from _common import (  # noqa: E402 - after the path set-up above
    environment,
    human_bytes,
    init_gloo_rank,
    plot_lines,
    prepare_parent,
    print_table,
    reproduce_command,
    write_json,
)
from _timing import per_call_seconds_each  # noqa: E402

OPS = [
    "all_reduce",
    "all_gather",
    "all_gatherv",
    "reduce_scatter",
    "reduce_scatterv",
    "broadcast",
    "broadcast_tensor_dict",
    "broadcast_object",
    "send_recv_tensor_dict",
    "send_recv",
    "ring_exchange",
    "barrier",
    "gather",
    "reduce",
    "all_to_all",
    "all_to_all_v",
    "scatter",
]
FULL_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 256 << 10, 16 << 20]
DICT_TENSORS = 8


def _iters_for(nbytes: int, quick: bool) -> tuple[int, int]:
    """(most calls a batch, batches): a batch moves at most the byte budget."""
    budget = (8 << 20) if quick else (64 << 20)
    iters = max(2, min(2000 if quick else 10000, budget // max(nbytes, 1)))
    return iters, (3 if quick else 5)


def _rank_main(
    rank: int,
    world: int,
    port: int,
    sizes: list[int],
    ops: list[str],
    quick: bool,
    use_mq: bool,
    threads: str,
    interleave: bool,
    huge_pages: bool,
) -> list[dict[str, Any]]:
    """One rank's sweep; rank 0 returns the rows."""
    import torch
    import torch.distributed as dist

    from coordinator.comm import comm_from_group
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.host_memory import empty_output

    # 1800 s: torch's default process-group timeout, which this benchmark used.
    init_gloo_rank(rank, world, port, timeout_s=1800)  # torch's default threads
    if threads != "default":
        torch.set_num_threads(int(threads))
    group = GroupCoordinator(
        [list(range(world))],
        rank,
        "gloo",
        True,
        use_message_queue_broadcaster=use_mq,
        group_name="bench",
    )
    # The baseline runs on its own Gloo group so neither side sees the other's state.
    plain = dist.new_group(list(range(world)), backend="gloo")
    comm = comm_from_group(group)
    rows = []

    def agree(value: int) -> int:
        box = torch.tensor([value])
        dist.broadcast(box, 0, group=plain)
        return int(box)

    a, b, small = torch.randn(256, 256), torch.randn(256, 256), torch.ones(16)

    def work() -> None:  # the rest of an engine step, between two collectives
        torch.mm(a, b)
        dist.all_reduce(small, group=plain)

    def with_work(fn: Callable[[], Any]) -> Callable[[], Any]:
        def both() -> None:
            work()
            fn()

        return both

    for op in ops:
        for nbytes in sizes:
            n = max(nbytes // 4, world * DICT_TENSORS)
            n -= n % (world * DICT_TENSORS)
            x = torch.randn(n)
            if huge_pages:  # the result pool's buffers ask for huge pages from 4 MiB
                x = empty_output((n,), x.dtype).copy_(x)
            iters, batches = _iters_for(nbytes, quick)
            ours, theirs, through_comm = _pair(op, group, plain, comm, x, rank, world)
            if interleave:
                ours, theirs = with_work(ours), with_work(theirs)
                through_comm = with_work(through_comm) if through_comm else None
            # Ours, Gloo's (and Comm's, and the work alone) take turns batch by batch.
            fns = [ours, theirs] + ([through_comm] if through_comm else [])
            fns += [work] if interleave else []
            times = per_call_seconds_each(fns, agree, iters, batches)
            t_ours, t_torch = times[0], times[1]
            t_comm = times[2] if through_comm else None
            t_work = times[-1] if interleave else None
            rows.append(
                {
                    "world": world,
                    "threads": threads,
                    "interleaved": interleave,
                    "op": op,
                    "bytes": n * 4,
                    "size": human_bytes(n * 4),
                    "ours_us": t_ours * 1e6,
                    "torch_us": t_torch * 1e6,
                    "ratio": t_torch / t_ours,
                    "ours_GBps": n * 4 / t_ours / 1e9,
                    "comm_us": None if t_comm is None else t_comm * 1e6,
                    "comm_vs_group": None if t_comm is None else t_comm / t_ours,
                    "work_us": None if t_work is None else t_work * 1e6,
                }
            )
    comm.finalize()
    group.destroy()
    dist.destroy_process_group()
    return rows if rank == 0 else []


def _pair(
    op: str, group: Any, plain: Any, comm: Any, x: Any, rank: int, world: int
) -> tuple[Any, Any, Any]:
    """(ours, torch, Comm or None) closures doing the same work for ``op``."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        buf = x.clone()
        return (
            (lambda: group.all_reduce(x)),
            (lambda: dist.all_reduce(buf, group=plain)),
            (lambda: comm.all_reduce(buf)),
        )
    if op == "all_gather":
        out = torch.empty(x.numel() * world)
        return (
            (lambda: group.all_gather(x, dim=0)),
            (lambda: dist.all_gather_single(out, x, group=plain)),
            (lambda: comm.all_gather_single(out, x)),
        )
    if op == "all_gatherv":  # sizes given (equal here), which are checked against the parts
        out = torch.empty(x.numel() * world)
        sizes = [x.numel()] * world
        outs = list(out.chunk(world))
        return (
            (lambda: group.all_gatherv(x, 0, sizes)),
            (lambda: dist.all_gather_single(out, x, group=plain)),
            (lambda: comm.all_gather_v(outs, x)),
        )
    if op == "reduce_scatter":
        out = torch.empty(x.numel() // world)
        return (
            (lambda: group.reduce_scatter(x, dim=0)),
            (lambda: dist.reduce_scatter_single(out, x, group=plain)),
            (lambda: comm.reduce_scatter_single(out, x)),
        )
    if op == "reduce_scatterv":
        # Uneven cuts (rank 0 keeps half a share less, the last rank half a share
        # more; equal ones make a plain reduce_scatter). The torch side is what an
        # engine writes without groupcoord: an all-reduce, then its own rows.
        share = x.numel() // world
        sizes = [share] * world
        sizes[0] -= share // 2
        sizes[-1] += share // 2
        start = sum(sizes[:rank])
        buf = x.clone()
        out = torch.empty(sizes[rank])
        inputs = list(x.split(sizes))
        return (
            (lambda: group.reduce_scatterv(x, 0, sizes)),
            (
                lambda: (
                    buf.copy_(x),
                    dist.all_reduce(buf, group=plain),
                    buf.narrow(0, start, sizes[rank]).clone(),
                )
            ),
            (lambda: comm.reduce_scatter_v(out, inputs)),
        )
    if op == "broadcast":
        buf = x.clone()
        return (
            (lambda: group.broadcast(x, src=0)),
            (lambda: dist.broadcast(buf, 0, group=plain)),
            (lambda: comm.broadcast(buf, 0)),
        )
    parts = list(x.chunk(DICT_TENSORS))
    tensor_dict: dict[str, Any] = {f"t{i}": p.clone() for i, p in enumerate(parts)}
    tensor_dict["step"] = 1
    tensor_dict["ids"] = [1, 2, 3]
    if op == "broadcast_tensor_dict":

        def ours_b() -> None:
            group.broadcast_tensor_dict(tensor_dict if rank == 0 else None, src=0)

        def torch_b() -> None:
            # What an engine writes by hand: metadata as an object, then each tensor.
            meta = [
                [
                    (k, v.shape, v.dtype) if isinstance(v, torch.Tensor) else (k, v)
                    for k, v in tensor_dict.items()
                ]
            ]
            dist.broadcast_object_list(meta if rank == 0 else [None], src=0, group=plain)
            bufs = [
                tensor_dict[f"t{i}"] if rank == 0 else torch.empty_like(parts[i])
                for i in range(DICT_TENSORS)
            ]
            for b in bufs:
                dist.broadcast(b, src=0, group=plain)

        return ours_b, torch_b, None
    if op == "broadcast_object":
        obj = {"step": 1, "ids": [1, 2, 3], "data": bytes(x.numel() * x.element_size())}
        return (
            (lambda: group.broadcast_object(obj if rank == 0 else None, src=0)),
            # torch.distributed's way to send an object: pickled, a size then the bytes.
            (lambda: dist.broadcast_object_list([obj if rank == 0 else None], 0, group=plain)),
            None,
        )
    if op == "send_recv":
        if rank > 1:
            return (lambda: None), (lambda: None), (lambda: None)
        peer = 1 - rank

        def ours_t() -> None:
            if rank == 0:
                group.send(x, dst=1)
                group.recv(x.shape, x.dtype, src=1)
            else:
                group.send(group.recv(x.shape, x.dtype, src=0), dst=0)

        def torch_t() -> None:
            # A fresh receive buffer per message, as group.recv returns one.
            if rank == 0:
                dist.send(x, dst=peer, group=plain)
                dist.recv(torch.empty_like(x), src=peer, group=plain)
            else:
                got = torch.empty_like(x)
                dist.recv(got, src=peer, group=plain)
                dist.send(got, dst=peer, group=plain)

        # Comm receives into a buffer the caller owns (torchcomms' recv), reused.
        into = torch.empty_like(x)

        def comm_t() -> None:
            if rank == 0:
                comm.send(x, 1)
                comm.recv(into, 1)
            else:
                comm.recv(into, 0)
                comm.send(into, 0)

        return ours_t, torch_t, comm_t
    if op == "barrier":
        return (
            (lambda: group.barrier()),
            (lambda: dist.barrier(group=plain)),
            (lambda: comm.barrier()),
        )
    if op == "gather":  # to rank 0
        parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
        joined = torch.empty(world * x.numel())
        return (
            (lambda: group.gather(x, 0, 0)),
            (lambda: dist.gather(x, parts, dst=0, group=plain)),
            (lambda: comm.gather_single(joined, x, 0)),
        )
    if op == "all_to_all_v":
        # Explicit split sizes (equal here), which the ranks exchange and check first.
        splits = [x.numel() // world] * world
        got = torch.empty_like(x)
        return (
            (lambda: comm.all_to_all_v_single(got, x, splits, splits)),
            (lambda: dist.all_to_all_single(got, x, splits, splits, group=plain)),
            None,
        )
    if op in ("reduce", "all_to_all", "scatter"):
        # No GroupCoordinator call: ours is the Comm's (SUM to rank 0; equal blocks;
        # from rank 0, one x-sized part per rank).
        buf, out = x.clone(), torch.empty_like(x)
        if op == "reduce":
            return (lambda: comm.reduce(buf, 0)), (lambda: dist.reduce(buf, 0, group=plain)), None
        if op == "scatter":
            parts = [x] * world if rank == 0 else None
            return (
                (lambda: comm.scatter(out, parts, 0)),
                (lambda: dist.scatter(out, parts, src=0, group=plain)),
                None,
            )
        return (
            (lambda: comm.all_to_all_single(out, x)),
            (lambda: dist.all_to_all_single(out, x, group=plain)),
            None,
        )
    if op == "ring_exchange":
        # Each rank sends right and receives left, all in flight at once: ours is a
        # Comm batch (the GroupCoordinator has none), torch's dist.batch_isend_irecv.
        right, left = (rank + 1) % world, (rank - 1) % world
        got = torch.empty_like(x)

        def ours_x() -> None:
            batch = comm.batch_op_create()
            batch.send(x, right)
            batch.recv(got, left)
            batch.issue()

        def torch_x() -> None:
            ops = [
                dist.P2POp(dist.isend, x, right, group=plain),
                dist.P2POp(dist.irecv, got, left, group=plain),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return ours_x, torch_x, None
    if op == "send_recv_tensor_dict":
        if rank > 1:
            return (lambda: None), (lambda: None), None

        def ours_p() -> None:
            if rank == 0:
                group.send_tensor_dict(tensor_dict, dst=1)
                group.recv_tensor_dict(src=1)
            else:
                got = group.recv_tensor_dict(src=0)
                group.send_tensor_dict(got, dst=0)

        def torch_send(peer: int) -> None:
            meta = [
                [
                    (k, v.shape, v.dtype) if isinstance(v, torch.Tensor) else (k, v)
                    for k, v in tensor_dict.items()
                ]
            ]
            dist.send_object_list(meta, dst=peer, group=plain)
            for i in range(DICT_TENSORS):
                dist.send(tensor_dict[f"t{i}"], dst=peer, group=plain)

        def torch_recv(peer: int) -> None:
            meta: list[Any] = [None]
            dist.recv_object_list(meta, src=peer, group=plain)
            for i in range(DICT_TENSORS):
                dist.recv(torch.empty_like(parts[i]), src=peer, group=plain)

        def torch_p() -> None:
            if rank == 0:
                torch_send(1)
                torch_recv(1)
            else:
                torch_recv(0)
                torch_send(0)

        return ours_p, torch_p, None
    raise ValueError(f"unknown op {op!r}")


MPI_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")


def mpi_rows(
    world: int, sizes: list[int], ops: list[str], quick: bool, huge_pages: bool = False
) -> list[dict] | str:
    """MPI's times for the same ops and sizes, or why there are none. Its numpy
    buffers are on huge pages only with ``huge_pages`` (numpy asks for them from
    4 MiB by default; NUMPY_MADVISE_HUGEPAGE=0 keeps ordinary pages, as torch's)."""
    wanted = [op for op in ops if op in MPI_OPS]
    if not wanted:
        return "no op MPI has here"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'groupcoord[bench]')"
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or ""
    if not mpiexec:
        return "no mpiexec (the mpich wheel of the bench extra provides one)"
    iters, batches = _iters_for(1, quick)
    command = [
        mpiexec, "-n", str(world), sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_peer.py"),
        "--ops", ",".join(wanted), "--sizes", ",".join(map(str, sizes)),
        "--budget", str((8 << 20) if quick else (64 << 20)),
        "--max-iters", str(iters), "--batches", str(batches),
    ]  # fmt: skip
    try:
        env = dict(os.environ, NUMPY_MADVISE_HUGEPAGE="1" if huge_pages else "0")
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=600, check=False, env=env
        )
    except subprocess.TimeoutExpired:
        return "mpiexec timed out"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"mpiexec failed ({done.returncode}): {tail[0]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_world(
    world: int,
    sizes: list[int],
    ops: list[str],
    quick: bool,
    use_mq: bool,
    timeout: float,
    threads: str = "default",
    interleave: bool = False,
    huge_pages: bool = False,
) -> list[dict]:
    port = free_port()
    rows: list[dict] = run_ranks(
        _rank_main,
        world,
        port,
        sizes,
        ops,
        quick,
        use_mq,
        threads,
        interleave,
        huge_pages,
        timeout=timeout,
    )[0]
    # send/recv is a round trip: report the one-way time.
    for row in rows:
        if row["op"] in ("send_recv", "send_recv_tensor_dict"):
            row["ours_us"] /= 2
            row["torch_us"] /= 2
            row["ours_GBps"] *= 2
            if row["comm_us"] is not None:
                row["comm_us"] /= 2
    return rows


INSTRUCTION_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
INSTRUCTION_CALLS = 2_000


def _instruction_rank(rank: int, port: int, folder: str, sizes: list[int], ops: list[str]) -> None:
    """One rank of ``--instructions``: the same phases on both ranks, rank 0 (under
    valgrind) handing over to the parent around them (``_callgrind.py``)."""
    import torch

    from coordinator.group_coordinator import GroupCoordinator

    init_gloo_rank(rank, 2, port, timeout_s=600)
    group = GroupCoordinator(
        [[0, 1]], rank, "gloo", True, use_message_queue_broadcaster=False, group_name="bench"
    )
    if rank == 1 and group._small is not None:
        # Rank 1 waits ~0.5 ms a call for rank 0 under valgrind: it must not fall
        # asleep, or rank 0 would count the doorbell's system call in every call.
        lines = group._small.owner._lines
        assert lines is not None
        lines.spin_s = 3600.0
    calls: dict[str, Callable[[torch.Tensor], object]] = {
        "all_reduce": group.all_reduce,
        "all_gather": lambda t: group.all_gather(t, 0),
        "reduce_scatter": lambda t: group.reduce_scatter(t, 0),
        "broadcast": lambda t: group.broadcast(t, 0),
    }
    phases: list[tuple[str, Callable[[], object], int]] = [
        ("nothing", lambda: None, INSTRUCTION_CALLS)
    ]
    for op in ops:
        for size in sizes:
            tensor = torch.ones(size // 4)
            name = f"{op} {human_bytes(size)}"
            phases.append((name, lambda f=calls[op], t=tensor: f(t), INSTRUCTION_CALLS))
    run_phases(folder, phases, measured=rank == 0, warm_up=100)
    group.destroy()


def count_call_instructions(sizes: list[int], ops: list[str]) -> list[dict[str, Any]] | str:
    """Rank 0's instructions per call of each op and size at world 2 (the loop's own
    cost taken off), or why they cannot be counted here."""
    missing = missing_tools()
    if missing is not None:
        return missing
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:

        def rank_command(rank: int) -> list[str]:
            return [
                sys.executable, os.path.abspath(__file__), "--instructions-rank", str(rank),
                "--instructions-at", f"{port}:{folder}",
                "--sizes", ",".join(map(str, sizes)), "--ops", ",".join(ops),
            ]  # fmt: skip

        peer = subprocess.Popen(rank_command(1), stdout=subprocess.DEVNULL)
        try:
            counted = count_instructions(rank_command(0), folder, peers=[peer])
            peer.wait(timeout=120)
        finally:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
    return [{"call": name, "instructions": n} for name, n in counted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument(
        "--sizes", default="", help="comma-separated bytes per rank (default 4K..64M)"
    )
    parser.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    parser.add_argument("--quick", action="store_true", help="few sizes and iterations (< 90 s)")
    parser.add_argument(
        "--no-mq", action="store_true", help="build the group without a message queue"
    )
    parser.add_argument("--json", default="bench_results/collectives.json")
    parser.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    parser.add_argument("--timeout", type=float, default=900.0, help="per world size, seconds")
    parser.add_argument(
        "--threads", default="default", help="torch intra-op threads per rank: default, 1, or both"
    )
    parser.add_argument(
        "--interleave", action="store_true", help="an engine step's other work between calls"
    )
    parser.add_argument("--no-mpi", action="store_true", help="leave the MPI column out")
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="inputs of 4 MiB and more on transparent huge pages, ours and MPI's alike",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count rank 0's instructions per call under valgrind instead of timing",
    )
    parser.add_argument("--instructions-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--instructions-at", help=argparse.SUPPRESS)  # port:folder
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    counting = args.instructions or args.instructions_rank is not None
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else [4 << 10]
        if counting
        else (QUICK_SIZES if args.quick else FULL_SIZES)
    )
    ops = args.ops.split(",")
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"--ops: unknown {unknown}; known: {OPS}")
    if counting:
        ops = [op for op in ops if op in INSTRUCTION_OPS]
        if not ops:
            parser.error(f"--instructions counts {list(INSTRUCTION_OPS)}; --ops names none")
    if args.instructions_rank is not None:
        port, folder = args.instructions_at.split(":", 1)
        _instruction_rank(args.instructions_rank, int(port), folder, sizes, ops)
        return 0
    command = reproduce_command(None if argv is None else [sys.argv[0], *argv])
    if args.instructions:
        counted = count_call_instructions(sizes, ops)
        if isinstance(counted, str):
            print(f"cannot count instructions: {counted}")
            return 2
        print_table(counted, ["call", "instructions"])
        print(
            "\nCPU instructions per GroupCoordinator call on rank 0 of 2 (callgrind), the "
            "measuring loop's own taken off."
        )
        print(f"reproduce: {command}")
        return 0
    print(f"# {command}", flush=True)
    default_threads = prepare_parent()
    print(f"# threads 'default': torch's default here, {default_threads}", flush=True)
    rows: list[dict] = []
    columns = [
        "world", "threads", "op", "size", "ours_us", "torch_us", "ratio", "mpi_us", "mpi_ratio",
        "ours_GBps", "comm_us", "comm_vs_group", "work_us",
    ]  # fmt: skip
    thread_modes = args.threads.split(",")
    for world in worlds:
        mpi: list[dict] | str = "left out (--no-mpi)" if args.no_mpi else ""
        if args.interleave:
            mpi = "not with --interleave (MPI runs without the interleaved work)"
        elif not args.no_mpi:
            mpi = mpi_rows(world, sizes, ops, args.quick, args.huge_pages)
        if isinstance(mpi, str):
            print(f"# world {world}: no MPI column: {mpi}", flush=True)
        mpi_us = {} if isinstance(mpi, str) else {(r["op"], r["bytes"]): r["mpi_us"] for r in mpi}
        for threads in thread_modes:
            got = run_world(
                world,
                sizes,
                ops,
                args.quick,
                not args.no_mq,
                args.timeout,
                threads,
                args.interleave,
                args.huge_pages,
            )
            for row in got:
                t_mpi = mpi_us.get((row["op"], row["bytes"]))
                if t_mpi is not None:
                    row["mpi_us"] = t_mpi
                    row["mpi_ratio"] = t_mpi / row["ours_us"]
            rows.extend(got)
        if len(worlds) > 1:
            print(f"# world {world} done", flush=True)
    print_table(rows, columns)
    path = write_json(args.json, {"command": command, "environment": environment(), "rows": rows})
    print(f"# wrote {path}")
    if args.plot:
        series = {}
        for world in worlds:
            for op in ops:
                pts = [r for r in rows if r["world"] == world and r["op"] == op]
                if pts:
                    series[f"{op} w{world}"] = (
                        [r["bytes"] for r in pts],
                        [r["ratio"] for r in pts],
                    )
        png = plot_lines(
            os.path.splitext(args.json)[0] + ".png",
            series,
            title="groupcoord vs torch.distributed (Gloo): speed-up",
            xlabel="bytes per rank",
            ylabel="torch time / ours",
            logy=True,
        )
        print(f"# wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
