"""Small collectives through the shared-memory slots in one flat call.

An engine makes many small collectives per step (a per-layer all-reduce of
a few KiB, the logits' all-gather, a sequence-parallel reduce-scatter), and
what those cost is Python and torch overhead, not bytes. ``SmallCalls`` runs
a SUM all-reduce, a SUM reduce, an all-gather or a reduce-scatter of a dense CPU tensor
of up to ``LEAN_MAX_BYTES`` (256 KiB, the one-shot size) with exactly the
protocol and fingerprint of
``ShmAllReduce``'s general path (one generation, one barrier, the same
stamp), so a rank on this path and a rank on the general one meet as usual.
What a call needs beyond its tensor is worked out once per (dtype, shape,
dim) and kept in a :class:`_Plan`: the fingerprint, the byte count, the
address of this rank's slot in each set and every view the call reads. A
call is then: stamp, one ``memmove`` in (a ``copy_`` for a strided tensor),
publish, wait, one torch op out (a large gather whose parts are blocks of
the result: a ``memmove`` per rank instead). A call whose torch work torch
would split over its thread pool (``TORCH_GRAIN`` elements) runs with the
pool at one thread, as the general path does; smaller ones skip the switch.
A broadcast (any dtype) has a plan per (dtype, shape, src) whose slot is the
root's: the root copies in, everyone publishes and waits, the others copy
out. Anything it does not take (it returns None) goes the general way, which
raises the errors for bad arguments.

4-256 KiB at worlds 2 and 4 on the 2-core machine
(``benchmarks/bench_collectives.py``): see ``docs/cpu_communicator.md`` for
the numbers before and after.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeGuard

import torch
from torch.distributed import ReduceOp

from shm_broadcast.host_memory import empty_output

from .errors import ClosedError, DesyncError
from .shm_phases import (
    LAYOUT_MASK,
    PhaseLines,
    call_code,
    layout_code,
    sizes_checksum,
    split_code,
    varying_gather_code,
)
from .shm_reduce import (
    CLONE_MAX_BYTES,
    ONE_SHOT_MAX_BYTES,
    PLAIN_ADD_DTYPES,
    SHM_DTYPES,
    TORCH_GRAIN,
    OneTorchThread,
    combine,
)
from .shm_slots import SlotSegment

__all__ = ["SmallCalls", "VaryingParts"]

_SHM_DTYPES = frozenset(SHM_DTYPES)
# The largest piece on this path: what the general path, too, reduces one-shot.
LEAN_MAX_BYTES = ONE_SHOT_MAX_BYTES
_PLAN_ENTRIES = 512  # plans kept per operation (a workload repeats a few shapes)
_memmove = ctypes.memmove
_STRIDED = torch.strided


class _Owner(Protocol):
    """The ``ShmAllReduce`` whose slots, generations and failure state the calls share."""

    what: str
    rank_in_group: int
    call_lock: Any  # a threading.RLock: one call at a time, whole
    generation: int
    _failure: str | None
    _lines: PhaseLines | None

    def _ended_part_way(self, exc: BaseException) -> None: ...

    def _counts_disagree(self, exc: DesyncError) -> DesyncError: ...


class _Plan:
    """What one kind of call (operation, dtype, shape, dim) needs, for both slot sets."""

    __slots__ = (
        "operation", "code", "count", "nbytes", "mine", "address", "reads", "out_shape", "dim",
        "pair", "blocks", "one_thread", "root", "inner", "same", "complex",
    )  # fmt: skip

    def __init__(
        self,
        operation: str,
        code: int,
        tensor: torch.Tensor,
        slots: SlotSegment,
        rank: int,
        reads: tuple[Any, Any],
        out_shape: torch.Size,
        dim: int = 0,
        op_numel: int = 0,
    ) -> None:
        self.operation = operation  # what the control line says while the call runs
        self.code = code
        self.count = tensor.numel()
        self.nbytes = self.count * tensor.element_size()
        # This rank's slot in each set: as an address (memmove) and as a view
        # shaped like the tensor (copy_ from a strided one).
        self.address = (slots.address(0, rank), slots.address(1, rank))
        self.mine = tuple(slots.shaped(s, rank, tensor.dtype, tensor.shape) for s in (0, 1))
        self.reads = reads
        self.out_shape = out_shape  # the result's
        self.dim = dim  # an all-gather's: the axis the ranks' tensors are joined on
        # Two ranks and a dtype whose sum is a plain add: one torch.add makes the result.
        self.pair = slots.world_size == 2 and tensor.dtype in PLAIN_ADD_DTYPES
        # A large all-gather whose result is the ranks' slots one after the
        # other: every slot's address, by set (see _gather_plan).
        self.blocks: tuple[list[int], list[int]] | None = None
        # The call's torch op (``op_numel`` elements) or a strided input's copy in
        # (``count``) is one torch would split over its pool: the call runs with the
        # pool at one thread (about 0.5 us; small calls skip it).
        self.one_thread = max(op_numel, self.count) >= TORCH_GRAIN
        self.root = -1  # a reduce's or gather's destination (-1: every rank receives)
        self.inner = 0  # a gather_v's elements per unit of length along ``dim``
        # A gather_v whose part fits a slot: every rank's count and length when all
        # parts are as long as this one (the common call, taken without a check each).
        self.same: tuple[list[int], list[int]] | None = None
        # Only a complex tensor can carry a lazy conjugate bit (torch asserts it).
        self.complex = tensor.dtype.is_complex


def _as_is(t: torch.Tensor) -> bool:
    """Whether the path may move ``t``'s memory as it is: no lazy conjugate or negative
    bit (memory that does not hold its values) and no autograd to record the copies."""
    return not (t.is_conj() or t.is_neg() or t.requires_grad)


def _takes(plan: _Plan, out: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``out`` can hold the result: its shape and dtype, dense."""
    return (
        type(out) is torch.Tensor
        and out.shape == plan.out_shape
        and out.dtype == tensor.dtype
        and out.is_cpu
        and out.is_contiguous()
        and _as_is(out)
    )


# Plans by (dtype, shape, dim) for each kind of call (all_reduce: dim 0; a broadcast
# or reduce: its root; a reduce_scatterv: (dim, *sizes)); None: such calls take the
# general path. The _FLAT kinds are the gathers and reduce-scatter of a caller whose
# ranks need only equal element counts (a Comm's), fingerprinted without the shape.
_SUM, _GATHER, _SCATTER, _BROADCAST, _REDUCE, _GATHER_TO = 0, 1, 2, 3, 4, 5
_FLAT_GATHER, _FLAT_SCATTER, _FLAT_GATHER_TO, _GATHER_V, _SCATTER_V = 6, 7, 8, 9, 10
_Plans = dict[tuple, "_Plan | None"]


class VaryingParts(NamedTuple):
    """What :meth:`SmallCalls.gather_v` did: ``moved`` (every part fit its slot and
    ``result`` is the joined tensor, None on a gather's other ranks) and every rank's
    length along the dim (known on every rank either way)."""

    moved: bool
    result: torch.Tensor | None
    lengths: list[int]


_UNSEEN: Any = object()


def _never(*args: Any) -> Any:
    """The maker and runner in the slot of a kind that keeps its own (gather_v)."""
    raise AssertionError("gather_v does not go through _call")


def _flat(maker: Callable[[torch.Tensor, int], _Plan | None]) -> Callable[..., _Plan | None]:
    """``maker`` of plans fingerprinted without the shape (the _FLAT kinds)."""

    def make(tensor: torch.Tensor, dim: int) -> _Plan | None:
        plan = maker(tensor, dim)
        if plan is not None:
            plan.code &= ~LAYOUT_MASK
        return plan

    return make


class SmallCalls:
    """The lean path of small calls for one ``ShmAllReduce`` (see the module docstring).

    Each method returns the result, or None when the call is not a small
    call it takes (or the shared-memory path is not up): then the caller runs
    the general path with the same arguments.
    """

    def __init__(self, owner: _Owner) -> None:
        self.owner = owner
        self.slots: SlotSegment | None = None
        self._plans: tuple[_Plans, ...] = tuple({} for _ in range(11))
        self._makers: tuple[Callable[..., _Plan | None], ...] = (
            self._sum_plan, self._gather_plan, self._scatter_plan, self._copy_plan,
            self._reduce_plan, self._gather_to_plan,
            _flat(self._gather_plan), _flat(self._scatter_plan), _flat(self._gather_to_plan),
            _never, self._scatter_v_plan,  # (gather_v keeps its own plans)
        )  # fmt: skip
        self._runs = (
            self._run_sum, self._run_gather, self._run_sum, self._run_broadcast, self._run_sum,
            self._run_gather, self._run_gather, self._run_sum, self._run_gather,
            _never, self._run_sum,
        )  # fmt: skip

    def attach(self, slots: SlotSegment | None) -> None:
        """The slots to use from now on (None: the path is down); plans of the old ones go."""
        self.slots = slots
        for plans in self._plans:
            plans.clear()

    def equal_parts(self, tensor: Any, dim: Any, sizes: Any) -> TypeGuard[torch.Tensor]:
        """Whether an ``all_gatherv(tensor, dim, sizes)`` is an all-gather this path
        carries: ``sizes`` given, every entry this rank's length along ``dim``, the
        path up. It then runs as one, checked as one (the stamp holds the count and
        the shape), at about half the varying call's cost (4 KiB at world 2: 31 ->
        21 us). The answer rests on what every rank's call shares (the sizes, the
        path being up), never on what may differ by rank (a tensor the lean path
        declines takes the general all-gather, stamped alike), so the ranks of a
        valid call always meet; ranks whose sizes differ raise ``DesyncError``."""
        return (
            type(sizes) is list
            and self.slots is not None
            and len(sizes) == self.slots.world_size
            and type(tensor) is torch.Tensor
            and type(dim) is int
            and -tensor.dim() <= dim < tensor.dim()
            and not tensor.is_nested  # (no one shape)
            and sizes.count(tensor.shape[dim]) == len(sizes)
            and not tensor.is_quantized
        )

    # ---- the calls -------------------------------------------------------------------
    # ``out``: write the result there instead of a new tensor; it must have the
    # result's shape and dtype (else None). The input is copied in before anything
    # is written, so ``out`` may be the input itself. ``flat``: the ranks' tensors
    # need only as many elements, not the same shape (a Comm's calls, torch's rule).

    def all_reduce(
        self, tensor: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """A SUM all-reduce."""
        return self._call(_SUM, tensor, 0, out)

    def all_gather(
        self, tensor: torch.Tensor, dim: int, out: torch.Tensor | None = None, flat: bool = False
    ) -> torch.Tensor | None:
        """Every rank's tensor concatenated along ``dim`` (rank-major)."""
        return self._call(_FLAT_GATHER if flat else _GATHER, tensor, dim, out)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int, out: torch.Tensor | None = None, flat: bool = False
    ) -> torch.Tensor | None:
        """The SUM over the group of this rank's equal slice along ``dim``."""
        return self._call(_FLAT_SCATTER if flat else _SCATTER, tensor, dim, out)

    def reduce_scatter_v(
        self, tensor: torch.Tensor, dim: int, sizes: list[int], out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The SUM over the group of this rank's ``sizes[rank]`` rows along ``dim``
        (``sizes``: checked, summing to the rows), fingerprinted with the cut."""
        if type(dim) is not int or type(sizes) is not list:
            return None
        return self._call(_SCATTER_V, tensor, (dim, *sizes), out)

    def reduce(
        self, tensor: torch.Tensor, dst: int, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """A SUM reduce to in-group rank ``dst``, fingerprinted as one (every rank
        computes the sum, as ``ShmAllReduce.reduce`` does)."""
        return self._call(_REDUCE, tensor, dst, out)

    def gather(
        self, tensor: torch.Tensor, dst: int, out: torch.Tensor | None = None, flat: bool = False
    ) -> torch.Tensor | None:
        """:meth:`all_gather` along dim 0 on in-group rank ``dst``, fingerprinted as a
        gather to ``dst``; the other ranks copy nothing out and get ``tensor`` back."""
        return self._call(_FLAT_GATHER_TO if flat else _GATHER_TO, tensor, dst, out)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor | None:
        """In-group rank ``src``'s ``tensor`` on every rank, in place (any dtype)."""
        return self._call(_BROADCAST, tensor, src, None)

    def gather_v(
        self,
        tensor: torch.Tensor,
        dim: int,
        dst: int = -1,
        into: list[torch.Tensor] | None = None,
        sizes: list[int] | None = None,
        listed: int = 0,
    ) -> VaryingParts | None:
        """Every rank's ``tensor`` joined along ``dim`` on in-group rank ``dst`` (-1:
        on every rank), where the lengths along ``dim`` may differ by rank
        (``GroupCoordinator.gather`` and ``all_gatherv``), in one barrier: each rank's
        stamp carries its element count, which tells every rank the others' lengths,
        and the stamps' layout checksum makes ranks whose other dims (or ``dim``)
        differ raise ``DesyncError`` naming both.

        None: not taken, nothing ran (another device or layout, the path is down).
        Else every rank's length and, when every part fit its slot, the result (None
        on a gather's other ranks); when one did not, ``moved`` is False and the
        caller moves the parts another way, the lengths known on every rank.
        ``into`` (an all-gather of a 1-D ``tensor`` only): contiguous CPU tensors of
        its dtype, one per rank, that receive the parts that fit their slots instead
        (one ``memmove`` each, no torch op; the result is None), copied only when each
        has as many elements as its part: the caller checks them against the lengths.
        ``sizes`` (an all-gather's): the lengths the caller expects, this rank's own
        entry already checked; stamped as a checksum, so ranks whose ``sizes`` differ
        all raise ``DesyncError`` before anything moves, not only the ranks whose
        entries the parts' true lengths contradict. ``listed`` (an all_gatherv of a
        list's first tensor): the list's length, stamped in the same checksum, so
        ranks whose lists differ in length raise too.
        """
        assert into is None or (tensor.dim() == 1 and dst == -1)
        assert sizes is None or dst == -1
        if type(tensor) is not torch.Tensor or type(dim) is not int or type(dst) is not int:
            return None
        try:
            key = (tensor.dtype, tensor.shape, dim, dst)
        except RuntimeError:  # a nested tensor (as in _call)
            return None
        with self.owner.call_lock:
            plans = self._plans[_GATHER_V]
            plan = plans.get(key, _UNSEEN)
            if plan is _UNSEEN:
                if self.slots is None:
                    return None
                if len(plans) >= _PLAN_ENTRIES:
                    plans.clear()
                plan = plans[key] = self._gather_v_plan(tensor, dim, dst)
            if plan is None or not tensor.is_cpu or tensor.layout is not _STRIDED:
                return None
            if tensor.requires_grad or tensor.is_neg() or (plan.complex and tensor.is_conj()):
                return None  # (see _as_is) the general path says why not, or detaches it
            return self._run_gather_v(plan, tensor, into, sizes, listed)

    def _run_gather_v(
        self,
        plan: _Plan,
        tensor: torch.Tensor,
        into: list[torch.Tensor] | None,
        sizes: list[int] | None,
        listed: int,
    ) -> VaryingParts:
        slots, owner = self.slots, self.owner
        assert slots is not None and owner._lines is not None
        limit = min(LEAN_MAX_BYTES, slots.max_bytes)
        size = tensor.element_size()
        expected = 0  # the stamp's root field: the sizes given and the list's length
        if listed:
            expected = sizes_checksum([*(sizes or ()), -listed])  # (no size is negative)
        elif sizes is not None:
            expected = sizes_checksum(sizes)
        try:
            s = self._exchange(
                plan,
                tensor,
                plan.operation,
                copy_in=plan.nbytes <= limit,
                expected=expected,
            )
        except DesyncError as exc:
            first = f", the first of a list of {listed} tensors," if listed else ""
            raise DesyncError(
                f"{exc}; this rank's part{first}: shape {tuple(tensor.shape)} joined along "
                f"dim {plan.dim} (lengths along it may differ by rank, the other dims may not)"
            ) from exc
        counts = owner._lines.counts()
        if into is not None and all(n * size <= limit for n in counts):
            if counts == [t.numel() for t in into]:  # (a 1-D part's length is its count)
                for r, t in enumerate(into):
                    _memmove(t.data_ptr(), slots.address(s, r), counts[r] * size)
            return VaryingParts(True, None, counts)
        same = plan.same
        if same is not None and counts == same[0]:  # every part as long as this one
            lengths = list(same[1])
            if plan.root not in (-1, owner.rank_in_group):
                return VaryingParts(True, None, lengths)
            if not plan.one_thread:
                return VaryingParts(True, torch.cat(plan.reads[s], plan.dim), lengths)
            with OneTorchThread(plan.nbytes * len(counts)):
                return VaryingParts(True, torch.cat(plan.reads[s], plan.dim), lengths)
        inner = plan.inner  # the same on every rank (the stamps' layouts agree)
        if any(n % inner for n in counts):  # layouts whose 16-bit checksums collided
            raise owner._counts_disagree(
                DesyncError(
                    f"{owner.what}: the ranks' parts hold {counts} elements, which parts of "
                    f"this rank's layout (shape {tuple(tensor.shape)}, joined along dim "
                    f"{plan.dim}) cannot: the other dims differ by rank"
                )
            )
        lengths = [n // inner for n in counts]
        if any(n * size > limit for n in counts):
            return VaryingParts(False, None, lengths)
        if plan.root not in (-1, owner.rank_in_group):
            return VaryingParts(True, None, lengths)
        shape = list(tensor.shape)
        parts = []
        for r, n in enumerate(lengths):
            shape[plan.dim] = n
            parts.append(slots.shaped(s, r, tensor.dtype, torch.Size(shape)))
        with OneTorchThread(size * sum(counts)):
            return VaryingParts(True, torch.cat(parts, plan.dim), lengths)

    def _call(
        self, kind: int, tensor: torch.Tensor, dim: int | tuple[int, ...], out: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Run the call of ``kind`` by its plan, made on first sight; None: not a call
        the path takes (nothing ran)."""
        if type(tensor) is not torch.Tensor or (type(dim) is not int and kind != _SCATTER_V):
            return None
        try:
            key = (tensor.dtype, tensor.shape, dim)
        except RuntimeError:  # a nested tensor has no one shape: the general path says so
            return None
        with self.owner.call_lock:
            plans = self._plans[kind]
            plan = plans.get(key, _UNSEEN)
            if plan is _UNSEEN:
                if self.slots is None:  # the path is down (attach() drops every plan)
                    return None
                if len(plans) >= _PLAN_ENTRIES:
                    plans.clear()
                plan = plans[key] = self._makers[kind](tensor, dim)
            if plan is None or not tensor.is_cpu or tensor.layout is not _STRIDED:
                return None
            if tensor.requires_grad or tensor.is_neg() or (plan.complex and tensor.is_conj()):
                return None  # (see _as_is) the general path says why not, or detaches it
            if out is not None and not _takes(plan, out, tensor):
                return None
            if not plan.one_thread:
                return self._runs[kind](plan, tensor, out)
            # A torch op torch would split over its pool: keep it on this thread.
            with OneTorchThread(plan.nbytes):
                return self._runs[kind](plan, tensor, out)

    def _run_sum(self, plan: _Plan, tensor: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """An all-reduce, a reduce or a reduce-scatter (the plan's reads say which rows)."""
        parts = plan.reads[self._exchange(plan, tensor, plan.operation)]
        if not plan.pair:
            return combine(parts, out, ReduceOp.SUM)
        if out is None:
            return parts[0].add(parts[1])  # the method: 0.8 us less than torch.add's parsing
        return torch.add(parts[0], parts[1], out=out)

    def _run_gather(
        self, plan: _Plan, tensor: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        s = self._exchange(plan, tensor, plan.operation)
        if plan.root not in (-1, self.owner.rank_in_group):
            return tensor  # a gather's other rank: its part is in its slot, nothing to read
        if plan.blocks:  # a memmove per rank: no torch op
            if out is None:
                out = (
                    torch.empty(*plan.out_shape, dtype=tensor.dtype)
                    if plan.nbytes * len(plan.blocks[s]) < CLONE_MAX_BYTES
                    else empty_output(plan.out_shape, tensor.dtype)
                )
            at, nbytes = out.data_ptr(), plan.nbytes
            for address in plan.blocks[s]:
                _memmove(at, address, nbytes)
                at += nbytes
            return out
        # cat: 1.4 us at 4 KiB; a clone of a (world, *shape) view then a view of the
        # result's shape cost twice that.
        if out is None:
            return torch.cat(plan.reads[s], plan.dim)
        return torch.cat(plan.reads[s], plan.dim, out=out)

    def _run_broadcast(
        self, plan: _Plan, tensor: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        sender = self.owner.rank_in_group == plan.dim  # a broadcast plan's dim is its src
        s = self._exchange(plan, tensor, "broadcast", copy_in=sender)
        if not sender:
            if tensor.is_contiguous():
                _memmove(tensor.data_ptr(), plan.address[s], plan.nbytes)
            else:
                tensor.copy_(plan.mine[s])
        return tensor

    # ---- one call ---------------------------------------------------------------------

    def _exchange(
        self,
        plan: _Plan,
        tensor: torch.Tensor,
        operation: str,
        copy_in: bool = True,
        expected: int = 0,
    ) -> int:
        """Stamp (the plan's code, with ``expected`` in its root field), copy in
        (unless a broadcast's receiver), publish, wait for every rank: the set now
        readable."""
        owner = self.owner
        if owner._failure is not None:
            raise ClosedError(
                f"{owner.what} is unusable after an earlier failure: {owner._failure}"
            )
        lines = owner._lines
        assert lines is not None  # slots attached means mapped
        lines.operation = operation
        lines.stamp(plan.code | expected, plan.count)
        try:
            gen = owner.generation + 1
            owner.generation = lines.generation = gen
            s = gen & 1
            if copy_in and tensor.is_contiguous():
                _memmove(plan.address[s], tensor.data_ptr(), plan.nbytes)
            elif copy_in:
                plan.mine[s].copy_(tensor)
            lines.arrive(2 * gen - 1)
        except DesyncError:
            raise  # every rank raises it, in step
        except BaseException as exc:
            owner._ended_part_way(exc)  # stamped, maybe not arrived: the path is done for
            raise
        return s

    # ---- plans --------------------------------------------------------------------------

    def _fits(self, tensor: torch.Tensor) -> bool:
        """One slot's piece, reduced one-shot."""
        slots = self.slots
        assert slots is not None
        nbytes = tensor.numel() * tensor.element_size()
        return (
            tensor.dtype in _SHM_DTYPES
            and tensor.layout is torch.strided
            and 0 < nbytes <= LEAN_MAX_BYTES
            and nbytes <= slots.max_bytes
        )

    def _copy_plan(self, tensor: torch.Tensor, src: int) -> _Plan | None:
        """A broadcast's: any dtype (bytes are copied); the plan's slot is ``src``'s."""
        slots = self.slots
        assert slots is not None
        nbytes = tensor.numel() * tensor.element_size()
        if not (0 < nbytes <= LEAN_MAX_BYTES and nbytes <= slots.max_bytes):
            return None
        if not 0 <= src < slots.world_size or tensor.is_quantized:
            return None  # the general path says what is wrong, or refuses it
        code = call_code("broadcast", tensor.dtype, None, src)
        return _Plan("broadcast", code, tensor, slots, src, ((), ()), tensor.shape, src)

    def _sum_plan(self, tensor: torch.Tensor, dim: int) -> _Plan | None:
        if not self._fits(tensor):
            return None
        slots = self.slots
        assert slots is not None
        dtype, shape = tensor.dtype, tensor.shape
        reads = tuple(
            [slots.shaped(s, r, dtype, shape) for r in range(slots.world_size)] for s in (0, 1)
        )
        code = call_code("all_reduce", dtype, ReduceOp.SUM, 0)
        rank = self.owner.rank_in_group
        return _Plan(
            "all_reduce", code, tensor, slots, rank, (reads[0], reads[1]), shape, 0, tensor.numel()
        )

    def _reduce_plan(self, tensor: torch.Tensor, dst: int) -> _Plan | None:
        return self._rooted(self._sum_plan(tensor, 0), "reduce", tensor.dtype, ReduceOp.SUM, dst)

    def _gather_to_plan(self, tensor: torch.Tensor, dst: int) -> _Plan | None:
        return self._rooted(self._gather_plan(tensor, 0), "gather", tensor.dtype, None, dst)

    def _rooted(
        self, plan: _Plan | None, operation: str, dtype: torch.dtype, op: object, dst: int
    ) -> _Plan | None:
        """An all-reduce's or all-gather's ``plan`` as a call to in-group rank ``dst``,
        fingerprinted as ``operation`` to ``dst``; None for a ``dst`` out of range (the
        general path says what is wrong)."""
        slots = self.slots
        assert slots is not None
        if plan is None or not 0 <= dst < slots.world_size:
            return None
        plan.operation = operation
        plan.code = call_code(operation, dtype, op, dst) | (plan.code & LAYOUT_MASK)
        plan.root = dst
        return plan

    def _gather_v_plan(self, tensor: torch.Tensor, dim: int, dst: int) -> _Plan | None:
        """:meth:`gather_v`'s, for this rank's part; the reads are those of parts all
        as long as this one. None: a part with no elements but for its length along
        ``dim`` (the counts could not tell the lengths), or arguments the general path
        refuses with a clear error."""
        slots = self.slots
        assert slots is not None
        shape, world = tensor.shape, slots.world_size
        if not (-tensor.dim() <= dim < tensor.dim() and -1 <= dst < world):
            return None
        dim %= tensor.dim()
        others = [n for i, n in enumerate(shape) if i != dim]
        if 0 in others:
            return None
        code = varying_gather_code(tensor.dtype, dst, f"{tensor.dim()}|{dim}|{others}")
        operation = "all_gather" if dst < 0 else "gather"
        rank = self.owner.rank_in_group
        out_shape = torch.Size([n * world if i == dim else n for i, n in enumerate(shape)])
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > min(LEAN_MAX_BYTES, slots.max_bytes):
            # Too large for a slot: the call only tells the ranks each other's lengths.
            plan = _Plan(operation, code, tensor.new_empty(0), slots, rank, ((), ()), shape, dim)
            plan.count, plan.nbytes = tensor.numel(), nbytes
        else:
            reads = tuple(
                [slots.shaped(s, r, tensor.dtype, shape) for r in range(world)] for s in (0, 1)
            )
            plan = _Plan(operation, code, tensor, slots, rank, (reads[0], reads[1]), out_shape, dim)
            plan.same = ([tensor.numel()] * world, [shape[dim]] * world)
            plan.one_thread = tensor.numel() * world >= TORCH_GRAIN  # the joined result's
        plan.root, plan.inner = dst, math.prod(others)
        return plan

    def _gather_plan(self, tensor: torch.Tensor, dim: int) -> _Plan | None:
        if not self._fits(tensor) or not -tensor.dim() <= dim < tensor.dim():
            return None
        slots = self.slots
        assert slots is not None
        dtype, shape, world = tensor.dtype, tensor.shape, slots.world_size
        dim %= tensor.dim()
        # torch.cat joins a small result (1.4 us at 4 KiB against 3 us for
        # torch.empty and two ctypes memmoves); a result torch would split over its
        # pool whose parts are blocks of it (no dimension before ``dim`` longer
        # than 1) is joined by memmove instead, no torch op.
        joined = tensor.numel() * world
        in_blocks = joined >= TORCH_GRAIN and shape[:dim].numel() == 1
        reads = tuple([slots.shaped(s, r, dtype, shape) for r in range(world)] for s in (0, 1))
        out_shape = torch.Size([n * world if i == dim else n for i, n in enumerate(shape)])
        code = call_code("all_gather", dtype, None, 0) | layout_code(shape)
        rank = self.owner.rank_in_group
        op_numel = 0 if in_blocks else joined
        plan = _Plan(
            "all_gather", code, tensor, slots, rank, (reads[0], reads[1]), out_shape, dim, op_numel
        )
        if in_blocks:
            plan.blocks = ([slots.address(0, r) for r in range(world)],
                           [slots.address(1, r) for r in range(world)])  # fmt: skip
        return plan

    def _scatter_v_plan(self, tensor: torch.Tensor, spec: tuple[int, ...]) -> _Plan | None:
        """A reduce_scatterv's: ``spec`` is (dim, *sizes)."""
        dim, *sizes = spec
        return self._scatter_plan(tensor, dim, sizes)

    def _scatter_plan(
        self, tensor: torch.Tensor, dim: int, sizes: list[int] | None = None
    ) -> _Plan | None:
        """A reduce-scatter's: equal parts, or the cut ``sizes`` (a reduce_scatterv's,
        stamped as ``split_code``, as the general path stamps it)."""
        if not self._fits(tensor) or not -tensor.dim() <= dim < tensor.dim():
            return None
        slots = self.slots
        assert slots is not None
        dtype, shape, world = tensor.dtype, tensor.shape, slots.world_size
        dim %= tensor.dim()
        if sizes is None:
            if shape[dim] % world:
                return None
            sizes = [shape[dim] // world] * world
        elif len(sizes) != world or sum(sizes) != shape[dim]:
            return None  # the caller checked them; the general path says why not
        rank = self.owner.rank_in_group
        start, length = sum(sizes[:rank]), sizes[rank]
        reads = tuple(
            [slots.shaped(s, r, dtype, shape).narrow(dim, start, length) for r in range(world)]
            for s in (0, 1)
        )
        # Laid out as it is (the general path's layout of dim 0), whatever ``dim``.
        split = split_code(sizes)
        code = call_code("reduce_scatter", dtype, ReduceOp.SUM, split) | layout_code(shape)
        # The sum covers this rank's rows of the tensor.
        op_numel = reads[0][0].numel()
        return _Plan(
            "reduce_scatter",
            code,
            tensor,
            slots,
            rank,
            (reads[0], reads[1]),
            reads[0][0].shape,
            0,
            op_numel,
        )
