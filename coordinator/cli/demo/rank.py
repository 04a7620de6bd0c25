"""One rank of the demo: join the groups, run the model steps, report to world rank 0.

This is the shape of an engine worker's loop: the driver broadcasts the step's
inputs over the TP group's message queue, each stage receives activations from
the previous one, runs its layers and sends on; the last stage holds logits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable

import msgspec
import torch

from ... import parallel_state as ps
from .model import (
    ATOL,
    RTOL,
    ModelConfig,
    Stage,
    model_config,
    reference_logits,
    step_input_ids,
    step_num_tokens,
)
from .report import (
    TABLE_COLUMNS,
    TABLE_NOTE,
    CommMeter,
    RankReport,
    format_table,
    logits_record,
    logits_tensor,
    mean_row,
    step_rows,
    write_plot,
)


class MeteredOps:
    """The model's communication over groupcoord's groups, timed per kind."""

    def __init__(self, meter: CommMeter, use_ep: bool) -> None:
        self.meter = meter
        self.tp = ps.get_tp_group()
        self.ep = ps.get_ep_group() if use_ep else None
        self.use_ep = use_ep
        self.tp_size = self.tp.world_size
        self.tp_rank = self.tp.rank_in_group
        self.ep_size = self.ep.world_size if self.ep is not None else 1
        self.ep_rank = self.ep.rank_in_group if self.ep is not None else 0

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        with self.meter.measure("all_reduce", x.nbytes):
            return self.tp.all_reduce(x)

    def tp_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        with self.meter.measure("all_gather", x.nbytes):
            return self.tp.all_gather(x, dim=dim)

    def tp_all_gatherv(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        with self.meter.measure("all_gather", x.nbytes):
            out = self.tp.all_gatherv(x, dim=0, sizes=sizes)
        assert isinstance(out, torch.Tensor)  # one tensor in, one out
        return out

    def ep_dispatch(
        self, hidden: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.ep is not None
        with self.meter.measure("dispatch_combine", hidden.nbytes + logits.nbytes):
            out = self.ep.dispatch_router_logits(hidden, logits, is_sequence_parallel=True)
        return out[0], out[1]

    def ep_combine(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.ep is not None
        with self.meter.measure("dispatch_combine", hidden.nbytes):
            return self.ep.combine(hidden, is_sequence_parallel=True)


def run_rank(
    args: argparse.Namespace,
    rank: int,
    world: int,
    on_failure: Callable[[BaseException], None] | None = None,
) -> int:
    """Run the demo as global ``rank``; returns the exit status (0: check passed).

    A failure is handed to ``on_failure`` (the launcher's pipe) before the
    groups are torn down, so the launcher learns of it even if teardown
    waits on a dead peer; without a launcher (torchrun) it is printed.
    """
    from shm_broadcast.config import set_config

    torch.set_num_threads(1)
    if args.all2all is not None:
        set_config(all2all_backend=args.all2all)
    try:
        ps.init_distributed_environment(
            world_size=world, rank=rank, distributed_init_method="env://", backend="gloo"
        )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            data_parallel_size=args.dp,
            enable_expert_parallel=args.ep,
        )
        report = _run_steps(args, rank)
        reports = _gather_reports(report)
        return _finish(args, reports) if rank == 0 else 0
    except BaseException as exc:
        if on_failure is not None:
            on_failure(exc)
        else:
            print(f"demo: rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def _run_steps(args: argparse.Namespace, rank: int) -> RankReport:
    cfg = model_config(args)
    tp, pp, dp = ps.get_tp_group(), ps.get_pp_group(), ps.get_dp_group()
    meter = CommMeter()
    ops = MeteredOps(meter, args.ep)
    stage = Stage(cfg, ops, pp.rank_in_group, pp.world_size)
    if args.ep:
        ps.get_ep_group().prepare_communication_buffer_for_model(stage)
    report = RankReport(
        rank=rank,
        tp_rank=tp.rank_in_group,
        pp_rank=pp.rank_in_group,
        dp_rank=dp.rank_in_group,
        steps=[],
        logits=[],
        backends=_describe_backends(args.ep) if args.backend_report else [],
    )
    is_driver = stage.is_first and tp.rank_in_group == 0
    world = ps.get_world_group()
    for step in range(args.steps):
        # Untimed: every rank starts the step together, so step times compare.
        world.barrier()
        num_tokens = step_num_tokens(cfg, args.tokens, step)
        record = meter.start_step(step, num_tokens)
        start = time.perf_counter()
        if args.fail_rank == rank and args.fail_step == step:
            _inject_failure(args.fail_mode, rank, step)
        with torch.inference_mode():
            if stage.is_first:
                inputs = None
                if is_driver:
                    ids = step_input_ids(cfg, step, dp.rank_in_group, num_tokens)
                    inputs = {"step": step, "input_ids": ids}
                with meter.measure("mq", ids.nbytes if is_driver else 0):
                    inputs = tp.broadcast_object(inputs)
                x = inputs["input_ids"]
            else:
                with meter.measure("p2p", 0):
                    received = pp.recv_tensor_dict(all_gather_group=tp)
                assert received is not None  # None only on the sending rank
                x = received["hidden"]
            out = stage(x, ops)
            if not stage.is_last:
                with meter.measure("p2p", out.nbytes // tp.world_size):
                    pp.send_tensor_dict({"hidden": out, "step": step}, all_gather_group=tp)
        record.total_s = time.perf_counter() - start
        report.steps.append(record)
        if stage.is_last and tp.rank_in_group == 0:
            report.logits.append(logits_record(step, dp.rank_in_group, out))
            if dp.rank_in_group == 0:
                print(
                    f"[demo] step {step + 1}/{args.steps}: {num_tokens} tokens, "
                    f"{record.total_s * 1e3:.1f} ms",
                    flush=True,
                )
    return report


def _inject_failure(mode: str, rank: int, step: int) -> None:
    """``--fail-rank``: raise (a Python error), die by SIGKILL (a crash, no report) or hang."""
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        # Stuck without dying: peers must notice through their deadlines.
        while True:
            time.sleep(1.0)
    raise RuntimeError(f"injected failure (--fail-rank {rank} --fail-step {step})")


def _describe_backends(use_ep: bool) -> list[str]:
    groups = [("world", ps.get_world_group()), ("tp", ps.get_tp_group())]
    groups += [("pp", ps.get_pp_group()), ("dp", ps.get_dp_group())]
    if use_ep:
        groups.append(("ep", ps.get_ep_group()))
    lines = []
    for name, group in groups:
        comm = group.device_communicator
        parts = [f"{name}: ranks {list(group.ranks)}"]
        if comm is None:
            parts.append("device communicator: none (torch.distributed on the CPU group)")
        else:
            parts.append(f"device communicator: {type(comm).__name__}")
            parts.append(f"all-reduce back ends: {' > '.join(comm.all_reduce_chain.names())}")
            manager = comm.all2all_manager
            if manager is not None:
                parts.append(f"all2all: {manager.name}")
        parts.append(f"message queue: {'yes' if group.mq_broadcaster is not None else 'no'}")
        lines.append("; ".join(parts))
    return lines


def _gather_reports(report: RankReport) -> list[RankReport]:
    """Every rank's report on every rank, as msgpack bytes over the world CPU group."""
    from shm_broadcast.group_io import all_gather_bytes

    parts = all_gather_bytes(ps.get_world_group().cpu_group, msgspec.msgpack.encode(report))
    decoder = msgspec.msgpack.Decoder(RankReport)
    return [decoder.decode(p) for p in parts]


def check_logits(
    cfg: ModelConfig, reports: list[RankReport], use_ep: bool, expected: int
) -> tuple[bool, str]:
    """Compare every reported step's logits with the single-process model: (ok, verdict)."""
    worst = 0.0
    checked = 0
    for r in reports:
        for rec in r.logits:
            ids = step_input_ids(cfg, rec.step, rec.replica, rec.tokens)
            want = reference_logits(cfg, ids, use_ep)
            got = logits_tensor(rec)
            diff = float((got - want).abs().max())
            worst = max(worst, diff)
            checked += 1
            if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                return False, (
                    f"demo CHECK FAILED: step {rec.step} replica {rec.replica}: logits differ "
                    f"from the single-process model by up to {diff:.3g} "
                    f"(tolerance rtol={RTOL:g} atol={ATOL:g})"
                )
    if checked != expected:
        return False, f"demo CHECK FAILED: got logits of {checked} steps, expected {expected}"
    return True, (
        f"demo check passed: {checked} step outputs match the single-process model "
        f"(max abs diff {worst:.3g}; tolerance rtol={RTOL:g} atol={ATOL:g})"
    )


def _finish(args: argparse.Namespace, reports: list[RankReport]) -> int:
    cfg = model_config(args)
    if args.backend_report:
        # Ranks of one group describe it the same way: print each group once.
        print("\nback ends per group:")
        for line in dict.fromkeys(line for r in reports for line in r.backends):
            print(f"  {line}")
    rows = step_rows(reports)
    print()
    mean = mean_row(rows)
    print(format_table(rows + ([mean] if mean else []), TABLE_COLUMNS))
    print(f"({TABLE_NOTE})")
    ok, verdict = check_logits(cfg, reports, args.ep, args.steps * args.dp)
    print(verdict)
    if not ok:
        return 1
    if args.plot:
        title = f"groupcoord demo: tp={args.tp} pp={args.pp} dp={args.dp} ep={args.ep}"
        write_plot(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return 0
