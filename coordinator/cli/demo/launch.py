"""``groupcoord demo`` (or ``python -m coordinator demo``): a TP x PP (x DP, x EP) model runner on CPU ranks, checked.

The command starts ``tp * pp * dp`` ranks itself (forked, Gloo on 127.0.0.1)
or, when ``RANK``/``WORLD_SIZE`` are set, runs as one rank under ``torchrun``.
Each rank initialises groupcoord's groups and runs its shard of the demo model
(:mod:`coordinator.cli.demo.model`) for a few steps, the way an engine worker does:

* the driver (TP rank 0 of the first stage, per DP replica) broadcasts each
  step's input dict through the TP group's message queue;
* stages hand activations on with ``send_tensor_dict``/``recv_tensor_dict``
  using the TP group as ``all_gather_group`` (each TP rank moves 1/TP);
* row-parallel layers all-reduce over TP; MoE layers use EP dispatch/combine.

World rank 0 gathers every rank's timings and the last stage's logits, checks
the logits against the same model run in one process (same seed) and prints
a per-step table. Exit status: 0 when the check passes, 1 on a mismatch or
when any rank fails (the launcher names the rank and its error and ends every
rank it started).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from .model import model_config


class RankFailure(msgspec.Struct):
    """What a failed rank tells the launcher (msgpack over a pipe, never pickle)."""

    rank: int
    error: str
    traceback: str
    when: float  # time.time() of the failure: the earliest one is the cause
    timed_out: bool = False  # a deadline passed: the rank waited on someone else


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="groupcoord demo",
        description="Run a small TP x PP (x EP) decoder across CPU ranks and check it "
        "against the same model in one process.",
    )
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--ep", action="store_true", help="split MoE experts over the EP group")
    p.add_argument(
        "--all2all",
        choices=["naive", "allgather_reducescatter"],
        default=None,
        help="EP all2all manager (default: GROUPCOORD_ALL2ALL_BACKEND)",
    )
    p.add_argument("--steps", type=int, default=5, help="model steps (default 5)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per step (default 16)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--ffn", type=int, default=128, help="MLP/expert inner size (default 128)")
    p.add_argument("--layers", type=int, default=4, help="decoder blocks (default 4)")
    p.add_argument("--experts", type=int, default=4, help="MoE experts (default 4)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--seed", type=int, default=0, help="weights and inputs seed (default 0)")
    p.add_argument("--plot", metavar="PNG", help="write the per-step time breakdown here")
    p.add_argument(
        "--backend-report",
        action="store_true",
        help="print each rank's groups, communicators and back ends",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="whole-run deadline, seconds (default 300)"
    )
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fail-step", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--fail-mode", choices=["raise", "kill", "hang"], default="raise", help=argparse.SUPPRESS
    )
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, or None."""
    for name in ("tp", "pp", "dp", "steps", "tokens"):
        if getattr(args, name) < 1:
            return f"--{name} must be at least 1, got {getattr(args, name)}"
    if args.timeout <= 0:
        return f"--timeout must be positive, got {args.timeout}"
    ep = args.tp * args.dp if args.ep else 1
    try:
        model_config(args).check(args.tp, args.pp, ep)
    except ValueError as exc:
        return f"model sizes: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"demo: {problem}", file=sys.stderr)
        return 2
    world = args.tp * args.pp * args.dp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            print(
                f"demo: WORLD_SIZE={os.environ['WORLD_SIZE']} but tp*pp*dp={world}",
                file=sys.stderr,
            )
            return 2
        from .rank import run_rank

        # torchrun ends the other ranks with SIGTERM when one fails; turn it into
        # SystemExit so teardown runs and this rank's shared memory is unlinked.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return run_rank(args, int(os.environ["RANK"]), world)
    return launch(args, world)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Linux: have the kernel SIGTERM this rank if the launcher dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        print(f"demo: prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}", file=sys.stderr)


def _child(args: argparse.Namespace, rank: int, world: int, port: int, conn: Connection) -> None:
    _die_with_parent()
    # SIGTERM (launcher gone) becomes SystemExit so teardown unlinks shared memory.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    code = 1
    reported = False

    def report(exc: BaseException) -> None:
        nonlocal reported
        if reported:
            return
        reported = True
        failure = RankFailure(
            rank,
            f"{type(exc).__name__}: {exc}",
            "".join(traceback.format_exception(exc)),
            time.time(),
            timed_out=isinstance(exc, TimeoutError),
        )
        conn.send_bytes(msgspec.msgpack.encode(failure))

    try:
        from .rank import run_rank

        code = run_rank(args, rank, world, on_failure=report)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the launcher
        report(exc)
    finally:
        from shm_broadcast.segments import cleanup_owned_segments

        conn.close()
        cleanup_owned_segments()
        sys.stdout.flush()
        sys.stderr.flush()
    # os._exit: the forked child must not run the parent's atexit handlers.
    os._exit(code)


def launch(args: argparse.Namespace, world: int) -> int:
    """Fork ``world`` ranks, supervise them, end them all on the first failure."""
    import torch

    # The parent forks; it must not own an OpenMP pool a child could inherit mid-use.
    torch.set_num_threads(1)
    ctx = mp.get_context("fork")
    port = _free_port()
    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    print(
        f"demo: starting {world} CPU ranks (tp={args.tp} pp={args.pp} dp={args.dp} "
        f"ep={'on' if args.ep else 'off'}) on 127.0.0.1:{port}",
        flush=True,
    )
    for rank in range(world):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(args, rank, world, port, child_end), daemon=True)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns[parent_end] = rank
    try:
        return _supervise(procs, conns, time.monotonic() + args.timeout, args.timeout)
    finally:
        _end_all(procs)


# After the first failure, how long to wait for other ranks' reports: a peer of
# the failed rank often fails a moment later ("connection closed"), and the
# user needs to see the cause, not the echoes.
FAILURE_GRACE_S = 1.0


def _supervise(
    procs: list[Any], conns: dict[Connection, int], deadline: float, timeout: float
) -> int:
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    failures: list[RankFailure] = []  # reported through the pipe
    deaths: list[RankFailure] = []  # ended abnormally without a report (killed, crashed)
    first_failure_at: float | None = None
    while sentinels:
        now = time.monotonic()
        limit = deadline if first_failure_at is None else first_failure_at + FAILURE_GRACE_S
        if now >= limit:
            break
        for obj in wait([*conns, *sentinels], timeout=limit - now):
            if obj in conns:
                conns.pop(obj)  # type: ignore[call-overload]
                failure = _read_failure(obj)  # type: ignore[arg-type]
                if failure is not None:
                    failures.append(failure)
            elif obj in sentinels:
                rank = sentinels.pop(obj)  # type: ignore[call-overload]
                procs[rank].join()
                code = procs[rank].exitcode
                # A rank that reported then exited left its report in the pipe.
                for conn in [c for c, r in conns.items() if r == rank]:
                    del conns[conn]
                    failure = _read_failure(conn) if conn.poll(0) else None
                    if failure is not None:
                        failures.append(failure)
                if code != 0 and not any(f.rank == rank for f in failures):
                    deaths.append(RankFailure(rank, _describe_exit(code), "", time.time()))
        if first_failure_at is None and (failures or deaths):
            first_failure_at = time.monotonic()
    if failures or deaths:
        _report_failures(failures, deaths, procs)
        return 1
    if sentinels:
        print(
            f"demo FAILED: ranks {sorted(sentinels.values())} did not finish within "
            f"{timeout:g} s (--timeout); ending every rank",
            file=sys.stderr,
        )
        return 1
    return 0


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} without reporting an error"
    return f"exited with code {code} (see its output above)"


def _read_failure(conn: Connection) -> RankFailure | None:
    try:
        data = conn.recv_bytes()
    except (EOFError, OSError):
        return None  # the rank closed its end without a failure: it finished
    return msgspec.msgpack.decode(data, type=RankFailure)


def _report_failures(
    failures: list[RankFailure], deaths: list[RankFailure], procs: list[Any]
) -> None:
    # A rank that died without a word is the likelier cause: its peers' errors
    # ("connection closed", "peer died") are what its death looks like to them.
    deaths.sort(key=lambda f: f.when)
    failures.sort(key=lambda f: f.when)
    events = deaths + failures
    reported = {f.rank for f in events}
    silent = [r for r, p in enumerate(procs) if p.is_alive() and r not in reported]
    lines: list[str] = []
    if not deaths and silent and all(f.timed_out for f in failures):
        # Everyone who spoke timed out waiting: the ranks that never spoke are stuck.
        lines.append(
            f"\ndemo FAILED: rank(s) {silent} stopped responding; their peers' deadlines passed"
        )
        cause = None
    else:
        cause = events[0]
        if cause.traceback:
            lines += [
                f"\ndemo FAILED: rank {cause.rank} raised {cause.error}",
                f"--- rank {cause.rank} traceback ---",
                cause.traceback.rstrip(),
            ]
        else:
            lines.append(f"\ndemo FAILED: rank {cause.rank} {cause.error}")
    for f in events:
        if f is not cause:
            what = f"raised {f.error.splitlines()[0][:200]}" if f.traceback else f.error
            lines.append(f"--- {'then ' if cause else ''}rank {f.rank} {what}")
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    lines.append(f"--- ending the ranks still running: {alive} ---")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _end_all(procs: list[Any]) -> None:
    """Kill every rank still running, reap them, and remove what killed ranks left in /dev/shm."""
    from shm_broadcast.segments import cleanup_stale_segments

    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(10)
    cleanup_stale_segments()
