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
it; reductions of complex tensors other than a sum or an average are
refused, since reducing the real and imaginary parts apart would be a wrong
answer. On the CPU a dtype Gloo lacks (float8, int16, the wider unsigned and
the sub-byte ones) is copied as the dtype of its width that Gloo has, and
refused with a clear error by a reduction.
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

from . import checks
from .errors import DesyncError, GroupcoordTypeError, GroupcoordValueError

__all__ = [
    "P2P_TAG",
    "dense",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "recv_bytes",
    "recv_blocking",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "send_bytes",
]

P2P_TAG = 0  # one tag for every send/recv, so Gloo keeps them in FIFO order per pair

Timeout = datetime.timedelta | None


# The dtypes Gloo moves and reduces: no int16, no unsigned one wider than a byte, no
# float8 or sub-byte one ("Invalid scalar type", even for a broadcast).
_GLOO_DTYPES = frozenset(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    + (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool)
)
# A copy moves bytes: a dtype Gloo lacks travels as the one of its width it has.
_SAME_WIDTH = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as c10d takes it: contiguous, with no conjugate or negative bit (a
    lazy view's values: a tensor dict's, which the entry checks do not refuse),
    copied only where needed. A caller that receives into a copy copies it back."""
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous()


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What c10d moves for ``tensor``: itself, the real view of a complex one, or (on
    the CPU, Gloo's) a dtype Gloo lacks as the dtype of its width that it has."""
    if tensor.is_conj() or tensor.is_neg():
        # c10d would move the memory, not the values (or refuse, for a complex one).
        raise GroupcoordValueError(
            "tensor is a lazy conjugate or negative view, which c10d would move as its "
            "memory: call resolve_conj() / resolve_neg() first"
        )
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    if not tensor.is_cpu or tensor.dtype in _GLOO_DTYPES:
        return tensor
    if tensor.is_quantized:
        raise GroupcoordTypeError(
            f"a quantized tensor ({tensor.dtype}) cannot travel: send its int_repr() "
            "and its quantization parameters"
        )
    return tensor.view(_SAME_WIDTH[tensor.element_size()])


def _wires(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_wire(t) for t in tensors]


def _reducible(tensor: torch.Tensor, op: ReduceOp.RedOpType) -> torch.Tensor:
    checks.reduce_op(op, tensor.dtype)
    refused = tensor.is_cpu and tensor.dtype not in _GLOO_DTYPES
    # A complex tensor reduces as its real view; _wire says why a quantized one cannot.
    if refused and not tensor.is_complex() and not tensor.is_quantized:
        raise GroupcoordTypeError(
            f"op={op}: Gloo cannot reduce {tensor.dtype} (the shared-memory path, between "
            "ranks on one node, reduces int16 and the wider unsigned dtypes by SUM, "
            "PRODUCT, MIN, MAX and the bitwise ops): cast it to one of "
            f"{sorted(str(d) for d in _GLOO_DTYPES)} first"
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
    # Split sizes count rows, which every wire view keeps.
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
# message of its own and the data lands in place. The bytes of an object
# (``send_bytes``: ``send_object``, a tensor dict's description) travel the same
# way with BYTES_CODE for a dtype and their length for a count, so a tensor
# receive meeting them, or an object receive meeting a tensor, raises too, and
# consumes it. A message larger than the buffer it is received into is still
# Gloo's to refuse: it aborts the receiving process ("Received data size doesn't
# match expected size"). So a receive (``recv_blocking``, ``recv_bytes``) takes
# the header with room for any inline data, and receives larger data only once
# the header has said what comes: Gloo aborts on none of its mismatches. Its
# caller waits at once (``GroupCoordinator``; ``Comm``'s asynchronous receives
# wait on their pair's lane thread, ``coordinator/comm/p2p_lanes.py``): Gloo's
# sends wait until their receive is posted, and nothing else would post the
# data's buffer while the caller is busy elsewhere. A device tensor goes alone
# (reading a header back would wait for the device). Both ends of a pair must be
# groupcoord's: a plain torch.distributed.recv would take the header.
INLINE_MAX_BYTES = 64 * 1024
_HEADER = 16
BYTES_CODE = 1 << 16  # a header's "dtype" for an object's bytes (no dtype has it)
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


def _send_framed(
    pg: Any,
    dst: int,
    code: int,
    count: int,
    nbytes: int,
    source: int | bytes,
    data: Callable[[], torch.Tensor],
) -> Any:
    """One message unit: the header (``code``, ``count``), with the ``nbytes`` at
    ``source`` (an address or bytes) when they fit inline, else before ``data``
    (a tensor of them) as a message of its own."""
    inline = nbytes <= INLINE_MAX_BYTES
    buf = _buffer(_HEADER + (nbytes if inline else 0))
    at = buf.data_ptr()
    ctypes.c_int64.from_address(at).value = code
    ctypes.c_int64.from_address(at + 8).value = count
    if not inline:
        return _Messages([pg.send([buf], dst, P2P_TAG), pg.send([data()], dst, P2P_TAG)], buf)
    if nbytes:
        ctypes.memmove(at + _HEADER, source, nbytes)
    return _Messages([pg.send([buf], dst, P2P_TAG)], buf)


def send(pg: Any, tensor: torch.Tensor, dst: int) -> Any:
    """Send ``tensor`` (contiguous) to in-group rank ``dst``, with its header on CPU."""
    wire = _wire(tensor)
    if not tensor.is_cpu:
        return pg.send([wire], dst, P2P_TAG)
    code, nbytes = dtype_code(tensor.dtype), tensor.nbytes
    return _send_framed(pg, dst, code, tensor.numel(), nbytes, tensor.data_ptr(), lambda: wire)


def send_bytes(pg: Any, payload: bytes, dst: int) -> Any:
    """Send ``payload`` to in-group rank ``dst``, for :func:`recv_bytes`."""
    n = len(payload)
    return _send_framed(
        pg, dst, BYTES_CODE, n, n, payload,
        lambda: torch.frombuffer(bytearray(payload), dtype=torch.uint8),
    )  # fmt: skip


def _clear_header(buf: torch.Tensor) -> None:
    # No header yet (a reused buffer holds an old one): a message shorter than a
    # header (not one of ours) leaves these, and says so.
    at = buf.data_ptr()
    ctypes.c_int64.from_address(at).value = -1
    ctypes.c_int64.from_address(at + 8).value = -1


def _header(buf: torch.Tensor) -> tuple[int, int]:
    at = buf.data_ptr()
    return ctypes.c_int64.from_address(at).value, ctypes.c_int64.from_address(at + 8).value


def _sent(
    pg: Any, src: int, buf: torch.Tensor, code: int, count: int, end: float | None
) -> tuple[str, bytes | None]:
    """What a header (in ``buf``) that is not the one expected says was sent, and
    an object's bytes if that is what came; when its data follows as a message of
    its own, that message is received, so the pair stays in step."""
    if code == BYTES_CODE and count >= 0:
        sent, nbytes = f"an object's {count} bytes (send_object or send_tensor_dict)", count
    elif 0 <= code < len(WIRE_DTYPES) and count >= 0:
        sent = f"a {WIRE_DTYPES[code]}[{count}] tensor"
        nbytes = count * torch_dtype(WIRE_DTYPES[code]).itemsize
    else:
        return "a message without a tensor header (not a groupcoord send)", None
    if nbytes <= INLINE_MAX_BYTES:  # it came with the header
        data = ctypes.string_at(buf.data_ptr() + _HEADER, nbytes) if code == BYTES_CODE else None
        return sent, data
    rest = torch.empty(nbytes, dtype=torch.uint8)
    _wait(pg.recv([rest], src, P2P_TAG), end)
    return sent, rest.numpy().tobytes() if code == BYTES_CODE else None


def _called(tensor: torch.Tensor) -> str:
    return f"recv({str(tensor.dtype).removeprefix('torch.')}[{tensor.numel()}])"


def _out_of_step(what: str, pg: Any, called: str, src: int, sent: str) -> DesyncError:
    return DesyncError(
        f"{what + ': ' if what else ''}rank {pg.rank()} called {called} from rank {src}, "
        f"which sent {sent}: the ranks' point-to-point calls are out of step"
    )


def recv_blocking(pg: Any, tensor: torch.Tensor, src: int, what: str = "") -> Any:
    """Receive into ``tensor`` (contiguous) from in-group rank ``src``, for a caller
    that waits on the work at once: the work's ``wait()`` receives the header, and
    the data only once the header says what came, so no message can be too large
    for its buffer, and any mismatch raises ``DesyncError`` (``what``: the group,
    for its message) and is consumed (Gloo aborts on none)."""
    if not tensor.is_cpu:
        return pg.recv([_wire(tensor)], src, P2P_TAG)
    code, count = dtype_code(tensor.dtype), tensor.numel()
    return _HeaderFirst(pg, src, code, count, tensor, _called(tensor), what)


def recv_bytes(pg: Any, src: int, operation: str, what: str = "") -> bytes:
    """What in-group rank ``src`` sent with :func:`send_bytes` (waits for it). A
    tensor sent instead raises ``DesyncError`` naming both sides (``operation``:
    this rank's call, ``what``: the group), and is consumed."""
    work = _HeaderFirst(pg, src, BYTES_CODE, -1, None, operation, what)
    work.wait()
    assert work.payload is not None
    return work.payload


def _wait(work: Any, end: float | None) -> None:
    """``work.wait()`` until the monotonic ``end`` (None: the group's own timeout)."""
    if end is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=max(end - time.monotonic(), 0.001)))


class _HeaderFirst:
    """The next message unit from ``src``, whose ``wait()`` takes the header (with
    room for any inline data), then the data once the header says what comes. When
    the header is ``code`` (and ``count``, unless -1) the data lands in ``into`` (a
    dense CPU tensor) or, without one, in ``payload`` as bytes; anything else is
    consumed and raises ``DesyncError`` naming ``called`` and what came."""

    def __init__(
        self,
        pg: Any,
        src: int,
        code: int,
        count: int,
        into: torch.Tensor | None,
        called: str,
        what: str,
    ) -> None:
        self._pg, self._src, self._code, self._count = pg, src, code, count
        self._into, self._called, self._what = into, called, what
        self._buf: torch.Tensor | None = _buffer(_HEADER + INLINE_MAX_BYTES)
        _clear_header(self._buf)
        self._header = pg.recv([self._buf], src, P2P_TAG)
        self.payload: bytes | None = None
        self._error: DesyncError | None = None

    def wait(self, timeout: Timeout = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        buf = self._buf
        if buf is None:  # waited before: the same answer
            if self._error is not None:
                raise self._error
            return True
        pg, src, into = self._pg, self._src, self._into
        _wait(self._header, end)
        self._buf = None
        try:
            code, count = _header(buf)
            if code != self._code or (self._count >= 0 and count != self._count) or count < 0:
                sent, payload = _sent(pg, src, buf, code, count, end)
                self._error = _out_of_step(self._what, pg, self._called, src, sent)
                self._error.received = payload  # bytes a caller may decode (a dict's)
                self._error.taken = True
                raise self._error
            nbytes = count if into is None else into.nbytes
            if nbytes <= INLINE_MAX_BYTES:  # it came with the header
                if into is None:
                    self.payload = ctypes.string_at(buf.data_ptr() + _HEADER, nbytes)
                elif nbytes:
                    ctypes.memmove(into.data_ptr(), buf.data_ptr() + _HEADER, nbytes)
                return True
            data = torch.empty(nbytes, dtype=torch.uint8) if into is None else _wire(into)
            _wait(pg.recv([data], src, P2P_TAG), end)
            if into is None:
                self.payload = data.numpy().tobytes()
            return True
        finally:
            _give_back(buf)  # the header's message is done with it (a failed wait keeps it)


class _Messages:
    """A c10d work of one or two sent messages (the header, with or before the data)
    that completes when each has; then the header's buffer is given back."""

    __slots__ = ("_works", "_keep")

    def __init__(self, works: list[Any], keep: torch.Tensor) -> None:
        self._keep: torch.Tensor | None
        self._works, self._keep = works, keep

    def wait(self, timeout: Timeout = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self._works:
            _wait(work, end)
        keep, self._keep = self._keep, None
        if keep is not None:  # every message is done with it (a failed wait keeps it)
            _give_back(keep)
        return True
