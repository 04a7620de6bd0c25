"""The one place groupcoord calls a c10d process group's collectives.

Each function starts one operation on ``pg`` and returns c10d's work handle:
``DeviceCommunicatorBase`` waits on it at once (inside ``gloo_errors``),
``coordinator.comm`` hands it to a :class:`~coordinator.comm.work.Work`. The
calls go to the process group object itself, not through
``torch.distributed``'s registry, so they take in-group ranks and work on a
registered ``ProcessGroup`` and on a standalone Gloo backend alike (a
``Comm`` builds its own), and every call carries its own deadline
(``timeout``; None keeps the group's).

A complex tensor travels as its real view, as ``torch.distributed`` sends
it; reductions of complex tensors other than a sum are refused, since
reducing the real and imaginary parts apart would be a wrong answer.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from torch.distributed import ReduceOp

from .errors import GroupcoordValueError

__all__ = [
    "P2P_TAG",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]

P2P_TAG = 0  # one tag for every send/recv, so Gloo keeps them in FIFO order per pair

Timeout = datetime.timedelta | None


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What c10d moves for ``tensor``: itself, or the real view of a complex one."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _wires(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_wire(t) for t in tensors]


def _reducible(tensor: torch.Tensor, op: ReduceOp.RedOpType) -> torch.Tensor:
    if tensor.is_complex() and op != ReduceOp.SUM:
        raise GroupcoordValueError(
            f"op={op}: a {tensor.dtype} tensor can only be reduced with SUM "
            "(its real and imaginary parts would be reduced apart)"
        )
    return _wire(tensor)


def _with_timeout(opts: Any, timeout: Timeout) -> Any:
    if timeout is not None:
        opts.timeout = timeout
    return opts


def all_reduce(pg: Any, tensor: torch.Tensor, op: ReduceOp.RedOpType, timeout: Timeout) -> Any:
    """Reduce ``tensor`` in place over ``pg``."""
    opts = _with_timeout(AllreduceOptions(), timeout)
    opts.reduceOp = op
    return pg.allreduce([_reducible(tensor, op)], opts)


def reduce(
    pg: Any, tensor: torch.Tensor, root: int, op: ReduceOp.RedOpType, timeout: Timeout
) -> Any:
    """Reduce into ``tensor`` on in-group rank ``root``."""
    opts = _with_timeout(ReduceOptions(), timeout)
    opts.reduceOp = op
    opts.rootRank = root
    opts.rootTensor = 0
    return pg.reduce([_reducible(tensor, op)], opts)


def reduce_scatter(
    pg: Any,
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    op: ReduceOp.RedOpType,
    timeout: Timeout,
) -> Any:
    """``output`` = the sum over ranks of their ``inputs[rank]``."""
    opts = _with_timeout(ReduceScatterOptions(), timeout)
    opts.reduceOp = op
    return pg.reduce_scatter([_reducible(output, op)], [[_reducible(t, op) for t in inputs]], opts)


def all_gather(pg: Any, outputs: list[torch.Tensor], tensor: torch.Tensor, timeout: Timeout) -> Any:
    """``outputs[i]`` = in-group rank ``i``'s ``tensor``."""
    return pg.allgather(
        [_wires(outputs)], [_wire(tensor)], _with_timeout(AllgatherOptions(), timeout)
    )


def broadcast(pg: Any, tensor: torch.Tensor, root: int, timeout: Timeout) -> Any:
    """Overwrite ``tensor`` with in-group rank ``root``'s."""
    opts = _with_timeout(BroadcastOptions(), timeout)
    opts.rootRank = root
    opts.rootTensor = 0
    return pg.broadcast([_wire(tensor)], opts)


def gather(
    pg: Any,
    outputs: list[torch.Tensor] | None,
    tensor: torch.Tensor,
    root: int,
    timeout: Timeout,
) -> Any:
    """Every rank's ``tensor`` into ``outputs`` on ``root`` (None elsewhere)."""
    opts = _with_timeout(GatherOptions(), timeout)
    opts.rootRank = root
    return pg.gather([_wires(outputs)] if outputs else [], [_wire(tensor)], opts)


def scatter(
    pg: Any,
    output: torch.Tensor,
    inputs: list[torch.Tensor] | None,
    root: int,
    timeout: Timeout,
) -> Any:
    """``inputs[i]`` on ``root`` into rank ``i``'s ``output``."""
    opts = _with_timeout(ScatterOptions(), timeout)
    opts.rootRank = root
    return pg.scatter([_wire(output)], [_wires(inputs)] if inputs else [], opts)


def all_to_all(
    pg: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    timeout: Timeout,
) -> Any:
    """Rows of ``input`` to each rank by ``input_splits`` (empty: equal blocks)."""
    if input.is_complex():  # split sizes count rows, which the real view keeps
        input, output = _wire(input), _wire(output)
    opts = _with_timeout(AllToAllOptions(), timeout)
    return pg.alltoall_base(output, input, output_splits, input_splits, opts)


def barrier(pg: Any, timeout: Timeout) -> Any:
    return pg.barrier(_with_timeout(BarrierOptions(), timeout))


def send(pg: Any, tensor: torch.Tensor, dst: int) -> Any:
    """Send ``tensor`` (contiguous) to in-group rank ``dst``."""
    return pg.send([_wire(tensor)], dst, P2P_TAG)


def recv(pg: Any, tensor: torch.Tensor, src: int) -> Any:
    """Receive into ``tensor`` (contiguous) from in-group rank ``src``."""
    return pg.recv([_wire(tensor)], src, P2P_TAG)
