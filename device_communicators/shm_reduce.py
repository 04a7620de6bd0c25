"""The arithmetic of the shared-memory path: which dtypes and reduce ops it takes,
the fixed-order combine that gives every rank identical bits, and the rule
that keeps its copies off torch's thread pool.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.distributed import ReduceOp

from . import checks
from .errors import GroupcoordTypeError, GroupcoordValueError

__all__ = [
    "CLONE_MAX_BYTES",
    "ONE_SHOT_MAX_BYTES",
    "PARALLEL_MIN_BYTES",
    "PLAIN_ADD_DTYPES",
    "SHM_DTYPES",
    "TORCH_GRAIN",
    "OneTorchThread",
    "combine",
    "refused_op",
    "settle_torch_pool",
]

# Integers wrap and bools add as "or" (multiply as "and") as on Gloo. Complex tensors
# reduce by sum or average (as torch.distributed allows). Gloo reduces neither int16
# nor unsigned dtypes wider than a byte (c10d_calls refuses them there).
SHM_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.bool, torch.complex64, torch.complex128,
    torch.complex32, torch.uint16, torch.uint32, torch.uint64,
)  # fmt: skip
_HALF = (torch.float16, torch.bfloat16)
# Dtypes torch has too little arithmetic for, reduced as the dtype of their width
# that has it: complex32 as its fp16 parts; the unsigned ones as signed integers,
# whose sums, products and bitwise results have the same bits, and whose order is
# the signed order of the bits with the top one flipped (MIN and MAX).
_CARRIERS = {
    torch.complex32: torch.float16,
    torch.uint16: torch.int16,
    torch.uint32: torch.int32,
    torch.uint64: torch.int64,
}
# The dtypes whose SUM of two parts is one plain torch.add (no fp32 accumulation,
# no "or" for bool, no carrier): the lean path's two-rank case calls it directly.
PLAIN_ADD_DTYPES = frozenset(SHM_DTYPES) - {*_HALF, torch.bool, *_CARRIERS}

_OPS: dict[object, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
    ReduceOp.AVG: torch.add,  # then one division (combine)
}


def combine(
    parts: list[torch.Tensor], out: torch.Tensor | None, op: ReduceOp.RedOpType
) -> torch.Tensor:
    """parts[0] op parts[1] op ..., in that order, into ``out`` or a new tensor (fp16
    and bf16 sums and products accumulate in fp32): every rank gets identical bits."""
    carrier = _CARRIERS.get(parts[0].dtype)
    if carrier is not None:
        carried = [p.view(carrier) for p in parts]
        if op in (ReduceOp.MIN, ReduceOp.MAX):  # unsigned (complex32 has no order)
            top = torch.iinfo(carrier).min  # the top bit alone
            ordered = combine([c ^ top for c in carried], None, op)
            ordered ^= top
            result = ordered if out is None else out.view(carrier).copy_(ordered)
        else:
            result = combine(carried, None if out is None else out.view(carrier), op)
        return result.view(parts[0].dtype)
    if op == ReduceOp.AVG:
        return _average(parts, out)
    fn = _OPS[op]
    if parts[0].dtype is torch.bool and op == ReduceOp.SUM:
        fn = torch.bitwise_or  # the same bits as torch's bool add, 16-28x faster
    if parts[0].dtype in _HALF and op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        acc = parts[0].float()
        for part in parts[1:]:
            fn(acc, part, out=acc)
        if out is None:
            return acc.to(parts[0].dtype)
        return out.copy_(acc)
    # Letting the first op allocate the result is 2 us cheaper than torch.empty first.
    out = fn(parts[0], parts[1]) if out is None else fn(parts[0], parts[1], out=out)
    for part in parts[2:]:
        fn(out, part, out=out)
    return out


def _average(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """The sum in rank order, then one division by the rank count (fp16 and bf16 in
    fp32 throughout), as Gloo's AVG does."""
    if parts[0].dtype in _HALF:
        acc = parts[0].float()
        for part in parts[1:]:
            acc.add_(part)
        acc.div_(len(parts))
        return acc.to(parts[0].dtype) if out is None else out.copy_(acc)
    total = combine(parts, out, ReduceOp.SUM)
    # A complex sum's parts divided apart (as Gloo does on the real view): torch's
    # complex division by a real rounds differently.
    (torch.view_as_real(total) if total.is_complex() else total).div_(len(parts))
    return total


# torch splits an elementwise op (and a concatenation) over its intra-op pool
# from this many elements (at::internal::GRAIN_SIZE); below it the op runs on
# the calling thread.
TORCH_GRAIN = 32768
# Below this many bytes no copy or op is split, whatever the dtype.
PARALLEL_MIN_BYTES = TORCH_GRAIN
# Pieces up to this size are reduced by every rank (one barrier); larger ones
# are split so each rank reduces 1/world of them (two barriers, less work each,
# but a second pass over lines another core wrote). Measured on a 2-core EPYC
# VM (2026-11-25), all_reduce one-shot / two-shot, worlds 2 and 4: 128 KiB
# 153 / 235 and 343 / 635 us, 256 KiB 223-230 / 291-304 and 514 / 766 us,
# 512 KiB even, 1-2 MiB two-shot ahead (by up to 15% at world 2, 18-36% at 4).
ONE_SHOT_MAX_BYTES = 256 * 1024
# An all-gather result below this comes from torch's allocator (malloc hands a
# loop the same block again): 9 µs against 15 µs through the result pool for
# 512 KiB. Larger ones come from the pool (no fresh pages at every call).
CLONE_MAX_BYTES = 1024 * 1024


_settled_in_pid = 0


def settle_torch_pool() -> None:
    """Rebuild torch's thread pool in this thread, once per process.

    After a fork, torch rebuilds its pool on the first call that asks for it,
    and that rebuild races: when two threads of a forked child make their
    first parallel op at once, one of them can fail with "Invalid thread
    pool!" (torch's ParallelOpenMP.cpp; 34 of 300 forks here, each with two
    threads running torch.full((65536,), 1.0)). A rank is often a forked child
    and may call a group from several threads, so the group's constructor
    does the rebuild first, on the thread that builds it.
    """
    global _settled_in_pid
    pid = os.getpid()
    if _settled_in_pid != pid:
        torch.set_num_threads(torch.get_num_threads())
        _settled_in_pid = pid


class OneTorchThread:
    """Torch's intra-op pool at one thread for the block (when ``active``).

    The copies and sums of the shared-memory path are memory-bound. Split over
    torch's OpenMP pool they fight the peer ranks for the cores (each rank's
    pool wants every core), and the pool's idle threads spin on a core a peer
    needs to arrive. Measured on 2 cores, world 2, torch's default threads:
    16 MiB all_reduce 122 ms -> 4.3 ms, all_gather 50 ms -> 8.6 ms. Switching
    costs about 0.3 us, so small calls (which torch does not split) skip it.
    Process-wide while it lasts: another Python thread's torch ops run on one
    thread meanwhile.
    """

    __slots__ = ("active", "saved")

    def __init__(self, nbytes: int) -> None:
        self.active = nbytes >= PARALLEL_MIN_BYTES
        self.saved = 1

    def __enter__(self) -> None:
        if self.active:
            self.saved = torch.get_num_threads()
            if self.saved != 1:
                torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.active and self.saved != 1:
            torch.set_num_threads(self.saved)


def refused_op(op: object, dtype: torch.dtype) -> str | None:
    """Why the path cannot reduce ``dtype`` with ``op``, or None: an operator it lacks
    (a PREMUL_SUM object), or one the dtype does not allow (``checks.reduce_op``).
    What it refuses goes to c10d, which reduces it or says why not."""
    if op not in _OPS:
        return f"reduce op {op} is not one of {[str(o).rsplit('.', 1)[-1] for o in _OPS]}"
    try:
        checks.reduce_op(op, dtype)
    except (GroupcoordTypeError, GroupcoordValueError) as exc:
        return str(exc)
    return None
