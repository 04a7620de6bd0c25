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
when any rank fails. The ranks are started by the project's one launcher
(:mod:`coordinator.launch`), which names the failed rank and its error, tells
the cause from its echoes and ends every rank it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ...launch import failure_report, report_failure, start_ranks
from .model import model_config


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


def _rank(rank: int, world: int, args: argparse.Namespace) -> int:
    from .rank import run_rank

    # A failure reaches the launcher before this rank's teardown, which may wait on dead peers.
    return run_rank(args, rank, world, on_failure=report_failure)


def launch(args: argparse.Namespace, world: int) -> int:
    """Start ``world`` ranks, wait for them, name the cause if any fails."""
    import torch

    from shm_broadcast.segments import cleanup_stale_segments

    # The parent forks; it must not own an OpenMP pool a child could inherit mid-use.
    torch.set_num_threads(1)
    print(
        f"demo: starting {world} CPU ranks (tp={args.tp} pp={args.pp} dp={args.dp} "
        f"ep={'on' if args.ep else 'off'}) on 127.0.0.1",
        flush=True,
    )
    try:
        outcomes = start_ranks(_rank, world, args, timeout=args.timeout).outcomes()
    finally:
        cleanup_stale_segments()  # what killed ranks left in /dev/shm
    if all(o.kind == "ok" for o in outcomes):
        return max(int(o.value) for o in outcomes)  # rank 0's verdict on the check
    headline, cause, lines = failure_report(outcomes, args.timeout)
    text = [f"\ndemo FAILED: {headline}"]
    if cause is not None and cause.traceback:
        text += [f"--- rank {cause.rank} traceback ---", cause.traceback.rstrip()]
    text += [f"--- {line}" for line in lines]
    print("\n".join(text), file=sys.stderr, flush=True)
    return 1
