"""The one place groupcoord calls a c10d process group's collectives.

Each function starts one operation on ``pg`` and returns c10d's work handle
(a CPU ``send``/``recv``: one that waits for its header and data, below):
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

import ctypes
import datetime
import time
from collections.abc import Callable
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

from shm_broadcast.array_frames import WIRE_DTYPES, dtype_code, torch_dtype

from .errors import DesyncError, GroupcoordValueError

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


# Point to point. A receive into a larger tensor than was sent completes with the
# tail untouched and no error (Gloo checks only that a message fits its buffer),
# and one of another dtype of the same bytes reinterprets them: both silent. So a
# CPU tensor travels with a 16-byte header of its dtype code and element count,
# which the receiver checks; a mismatch raises DesyncError naming both sides,
# with what was sent consumed (the pair stays in step). Up to INLINE_MAX_BYTES
# the header and the data are one message (copied through a buffer: a second
# message cost 15-80 us more at 4-64 KiB on Gloo here); larger, the header is a
# message of its own and the data lands in place. A message larger than the
# buffer it is received into is still Gloo's to refuse: it aborts the receiving
# process ("Received data size doesn't match expected size"), which only an
# inline message (a tensor of up to 64 KiB) sent to a receive of more than
# 64 KiB, which waits for a header alone, can meet. A device tensor goes
# alone (reading a header back would wait for the device). Both ends of a pair
# must be groupcoord's: a plain torch.distributed.recv would take the header.
INLINE_MAX_BYTES = 64 * 1024
_HEADER = 16
# Buffers of finished messages, by size, for the next ones: Gloo moved a fresh
# buffer 30-100 us slower than one it had used before (4 KiB, world 2, here).
_SPARE: dict[int, list[torch.Tensor]] = {}
_SPARE_SIZES = 64  # sizes kept at most (a workload repeats a few); then start over
_SPARE_EACH = 4  # buffers kept per size


def _buffer(size: int) -> torch.Tensor:
    spare = _SPARE.get(size)
    if spare:
        try:
            return spare.pop()
        except IndexError:  # another thread took the last one
            pass
    return torch.empty(size, dtype=torch.uint8)


def _give_back(buf: torch.Tensor) -> None:
    size = buf.numel()
    spare = _SPARE.get(size)
    if spare is None:
        if len(_SPARE) >= _SPARE_SIZES:
            _SPARE.clear()
        spare = _SPARE.setdefault(size, [])
    if len(spare) < _SPARE_EACH:
        spare.append(buf)


def _framing(tensor: torch.Tensor, receive: bool) -> tuple[int, bool, torch.Tensor]:
    """``tensor``'s byte count, whether its data travels with its header, and the
    buffer of the header (and of the data, when it does). An inline receive takes
    any inline message (``INLINE_MAX_BYTES`` of room), so a sender's larger inline
    tensor is a DesyncError too, not Gloo's abort."""
    nbytes = tensor.nbytes
    inline = nbytes <= INLINE_MAX_BYTES
    room = (INLINE_MAX_BYTES if receive else nbytes) if inline else 0
    return nbytes, inline, _buffer(_HEADER + room)


def send(pg: Any, tensor: torch.Tensor, dst: int) -> Any:
    """Send ``tensor`` (contiguous) to in-group rank ``dst``, with its header on CPU."""
    wire = _wire(tensor)
    if not tensor.is_cpu:
        return pg.send([wire], dst, P2P_TAG)
    nbytes, inline, buf = _framing(tensor, receive=False)
    at = buf.data_ptr()
    ctypes.c_int64.from_address(at).value = dtype_code(tensor.dtype)
    ctypes.c_int64.from_address(at + 8).value = tensor.numel()
    if inline:
        ctypes.memmove(at + _HEADER, tensor.data_ptr(), nbytes)
        return _Messages([pg.send([buf], dst, P2P_TAG)], buf)
    return _Messages([pg.send([buf], dst, P2P_TAG), pg.send([wire], dst, P2P_TAG)], buf)


def recv(pg: Any, tensor: torch.Tensor, src: int, what: str = "") -> Any:
    """Receive into ``tensor`` (contiguous) from in-group rank ``src``; on CPU the
    work's ``wait()`` raises ``DesyncError`` (``what``: the group, for its message)
    when the sender's dtype or element count differ."""
    wire = _wire(tensor)
    if not tensor.is_cpu:
        return pg.recv([wire], src, P2P_TAG)
    nbytes, inline, buf = _framing(tensor, receive=True)
    header = buf.data_ptr()
    # No header yet (a reused buffer holds an old one): a message shorter than a
    # header (not one of ours) leaves these, and says so.
    ctypes.c_int64.from_address(header).value = -1
    ctypes.c_int64.from_address(header + 8).value = -1
    works = [pg.recv([buf], src, P2P_TAG)]
    if not inline:
        works.append(pg.recv([wire], src, P2P_TAG))

    def check(buf: torch.Tensor) -> None:
        at = buf.data_ptr()
        code = ctypes.c_int64.from_address(at).value
        numel = ctypes.c_int64.from_address(at + 8).value
        if code == dtype_code(tensor.dtype) and numel == tensor.numel():
            if inline and nbytes:
                ctypes.memmove(tensor.data_ptr(), at + _HEADER, nbytes)
            return
        known = 0 <= code < len(WIRE_DTYPES) and numel >= 0
        if known:
            sent = f"a {WIRE_DTYPES[code]}[{numel}] tensor"
            sent_bytes = numel * torch_dtype(WIRE_DTYPES[code]).itemsize
            if inline and sent_bytes > INLINE_MAX_BYTES:  # its data follows alone: consume it
                pg.recv([torch.empty(sent_bytes, dtype=torch.uint8)], src, P2P_TAG).wait()
        else:
            sent = "a message without a tensor header (not a groupcoord send)"
        mine = str(tensor.dtype).removeprefix("torch.")
        raise DesyncError(
            f"{what + ': ' if what else ''}rank {pg.rank()} called recv({mine}[{tensor.numel()}]) "
            f"from rank {src}, which sent {sent}: the ranks' point-to-point calls are out of step"
        )

    return _Messages(works, buf, check)


class _Messages:
    """A c10d work of one or two messages (the header, with or before the data) that
    completes when each has; a receive's ``check`` runs then."""

    __slots__ = ("_works", "_keep", "_check", "_error")

    def __init__(
        self,
        works: list[Any],
        keep: torch.Tensor,
        check: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self._keep: torch.Tensor | None
        self._works, self._keep, self._check = works, keep, check
        self._error: DesyncError | None = None

    def wait(self, timeout: Timeout = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self._works:
            if end is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=max(end - time.monotonic(), 0.001)))
        keep, self._keep = self._keep, None
        if keep is None:  # waited before: the same answer
            if self._error is not None:
                raise self._error
            return True
        try:
            if self._check is not None:
                self._check(keep)
        except DesyncError as exc:
            self._error = exc
            raise
        finally:
            _give_back(keep)  # every message is done with it (a failed wait keeps it)
        return True
