"""Reducing operations of a communicator: all_reduce, reduce, reduce_scatter
(single, v) and barrier. On CPU, all_reduce and reduce_scatter take the
shared-memory lane when the back end takes the tensor (see ``CommCore._run``).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from device_communicators import c10d_calls, checks
from device_communicators.shm_all_reduce import ShmAllReduce
from device_communicators.shm_phases import split_code
from device_communicators.shm_reduce import OneTorchThread
from device_communicators.shm_small import SmallCalls

from .core import CommCore
from .reduce_ops import ReduceOp
from .work import Work


class Reductions(CommCore):
    """The reducing operations of :class:`~coordinator.comm.comm.Comm`."""

    # -- collectives -------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        if op is ReduceOp.SUM and async_op is False and hints is None and timeout is None:
            done = self._lean("all_reduce", lambda small: small.all_reduce(tensor, tensor), tensor)
            if done is not None:
                return done
        tensor = self._tensor(tensor, "tensor")
        op = self._op(op, tensor.dtype, "tensor")

        def launch(td: datetime.timedelta) -> list[Any]:
            if op.factor is not None:
                tensor.mul_(op.factor)
            return [c10d_calls.all_reduce(self._pg, tensor, op.c10d_op(), td)]

        finish = functools.partial(op.finish, tensor, self._size)

        def fast(shm: ShmAllReduce) -> None:
            shm.all_reduce(op.premultiply(tensor), op.c10d_op(), out=tensor, called=op.name)
            finish()

        return self._run(
            "all_reduce",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            finish,
            fast=fast if self._shm_takes(tensor, op) else None,
            call=("all_reduce", tensor.dtype, op.name, 0, tensor.numel()),
        )

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Reduce into ``tensor`` on ``root``; other ranks' tensors are scratch afterwards."""
        if op is ReduceOp.SUM and async_op is False and hints is None and timeout is None:
            done = self._lean("reduce", lambda small: small.reduce(tensor, root, tensor), tensor)
            if done is not None:
                return done
        tensor = self._tensor(tensor, "tensor")
        root = checks.rank(root, "root", self._size)
        op = self._op(op, tensor.dtype, "tensor")

        def launch(td: datetime.timedelta) -> list[Any]:
            if op.factor is not None:
                tensor.mul_(op.factor)
            return [c10d_calls.reduce(self._pg, tensor, root, op.c10d_op(), td)]

        size, is_root = self._size, self._rank == root

        def finish() -> None:
            if is_root:
                op.finish(tensor, size)

        def fast(shm: ShmAllReduce) -> None:
            shm.reduce(op.premultiply(tensor), root, op.c10d_op(), out=tensor, called=op.name)
            finish()

        return self._run(
            "reduce",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            finish,
            fast=fast if self._shm_takes(tensor, op) else None,
            call=("reduce", tensor.dtype, op.name, root, tensor.numel()),
        )

    def _reduce_scatter(
        self,
        name: str,
        output: torch.Tensor,
        inputs: Callable[[], list[torch.Tensor]],
        op: ReduceOp,
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | datetime.timedelta | None,
        joined: Callable[[], torch.Tensor],
        lo: int,
        total: int,
        split: int = 0,
    ) -> Work:
        """``inputs()``: the per-rank parts (the Gloo path); ``joined()``: them as one
        flat tensor in rank order, of which this rank's result is ``[lo, lo + numel)``
        (the shared-memory path), ``total`` elements. Each path builds only what it
        uses."""
        flat_out = output if output.dim() == 1 else output.view(-1)

        def launch(td: datetime.timedelta) -> list[Any]:
            sent = [op.premultiply(t) for t in inputs()]  # copies for PREMUL_SUM only
            return [c10d_calls.reduce_scatter(self._pg, flat_out, sent, op.c10d_op(), td)]

        finish = functools.partial(op.finish, flat_out, self._size)

        def fast(shm: ShmAllReduce) -> None:
            # On one torch thread, as the back end's own copies: a 1 MiB cat split
            # over torch's pool fought the peer ranks for the cores (2 cores, world 2:
            # 3-6 ms a call; the call itself takes 0.3-0.6 ms).
            with OneTorchThread(total * output.element_size()):
                src = op.premultiply(joined())
            shm.reduce_range(
                src,
                lo,
                lo + output.numel(),
                op.c10d_op(),
                out=flat_out,
                split=split,
                called=op.name,
            )
            finish()

        return self._run(
            name,
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            finish,
            completes_in_wait=True,  # Gloo's reduce_scatter work has no future
            fast=fast if self._shm_takes(output, op) else None,
            call=("reduce_scatter", output.dtype, op.name, split, total),
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        output = self._tensor(output, "output")
        inputs = self._per_rank(input_list, "input_list", output)
        op = self._op(op, output.dtype, "output")
        return self._reduce_scatter(
            "reduce_scatter",
            output,
            lambda: [t.reshape(-1) for t in inputs],
            op,
            async_op,
            hints,
            timeout,
            joined=lambda: torch.cat([t.reshape(-1) for t in inputs]),
            lo=self._rank * output.numel(),
            total=self._size * output.numel(),
        )

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        if op is ReduceOp.SUM and async_op is False and hints is None and timeout is None:
            done = self._lean(
                "reduce_scatter_single",
                lambda small: small.reduce_scatter(input, 0, output, flat=True),
                input,
                output,
            )
            if done is not None:
                return done
        output = self._tensor(output, "output")
        input = self._tensor(input, "input")
        checks.dtype_match(output, input, "output", "input")
        checks.numel(input, self._size * output.numel(), "input", "size * output.numel()")
        if checks.overlap(output, input, (self._size, self._rank)):
            input = input.clone()  # written while the peers still read it
        op = self._op(op, output.dtype, "output")
        n = output.numel()
        return self._reduce_scatter(
            "reduce_scatter_single",
            output,
            lambda: list(input.view(self._size, n).unbind(0)),
            op,
            async_op,
            hints,
            timeout,
            joined=lambda: input if input.dim() == 1 else input.reshape(-1),
            lo=self._rank * n,
            total=input.numel(),
        )

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Reduce-scatter where rank ``i`` receives ``input_list[i]``-sized results."""
        if (
            op is ReduceOp.SUM
            and async_op is False
            and hints is None
            and timeout is None
            and type(input_list) is list
        ):
            # On the caller's thread, as the small calls: the parts joined, then the
            # lean reduce-scatter of that cut (4 KiB at world 2: 199 -> 94 us).
            done = self._lean(
                "reduce_scatter_v",
                lambda small: self._lean_scatter_v(small, output, input_list),
                output,
                *input_list,
            )
            if done is not None:
                return done
        output = self._tensor(output, "output")
        inputs = self._tensors(input_list, "input_list", self._size)
        checks.same_dtype(output, inputs, "input_list")
        checks.numel(
            inputs[self._rank], output.numel(), f"input_list[{self._rank}]", "this rank's output"
        )
        op = self._op(op, output.dtype, "output")
        flat = [t.view(-1) for t in inputs]
        return self._reduce_scatter(
            "reduce_scatter_v",
            output,
            lambda: flat,
            op,
            async_op,
            hints,
            timeout,
            joined=lambda: torch.cat(flat),
            lo=sum(t.numel() for t in flat[: self._rank]),
            total=sum(t.numel() for t in flat),
            split=split_code([t.numel() for t in flat]),  # ranks that cut differently raise
        )

    def _lean_scatter_v(
        self, small: SmallCalls, output: torch.Tensor, inputs: list[torch.Tensor]
    ) -> bool | None:
        """A synchronous SUM ``reduce_scatter_v`` on the lean path (a 1-D cut of the
        joined parts, stamped as the general path stamps it); None, with nothing run,
        for arguments the general path checks (and raises for)."""
        counts = [t.numel() for t in inputs]
        if (
            len(inputs) != self._size
            or counts[self._rank] != output.numel()
            or any(t.dtype != output.dtype or not t.is_cpu for t in inputs)
            or not output.is_cpu
            or not self._shm_takes(output, ReduceOp.SUM)
        ):
            return None
        joined = torch.cat([t.view(-1) for t in inputs])
        flat_out = output if output.dim() == 1 else output.view(-1)
        return small.reduce_scatter_v(joined, 0, counts, out=flat_out) is not None or None

    def barrier(
        self,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Return once every rank has called it (on the shared-memory back end when the
        ranks share a node: checked as a barrier against what the peers called)."""
        lane = self._lane
        if async_op is False and hints is None and timeout is None and lane is not None:
            # On the caller's thread, as the small calls (22 -> 8 us at world 2 here).
            done = self._lean("barrier", lambda small: lane.shm.barrier() or True)
            if done is not None:
                return done

        def launch(td: datetime.timedelta) -> list[Any]:
            return [c10d_calls.barrier(self._pg, td)]

        def fast(shm: ShmAllReduce) -> None:
            shm.barrier()

        return self._run(
            "barrier",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            fast=fast if self._lane is not None else None,
            call=("barrier", None, None, 0, 0),
        )
