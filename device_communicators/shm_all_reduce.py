"""Shared-memory all-reduce (and all-gather, broadcast) for CPU ranks on one node.

One segment holds a control line per rank (``shm_phases.PhaseLines``) and
two sets of data slots, one slot per rank. An all-reduce writes this rank's
input into its slot of set ``generation % 2``, publishes the phase, waits
for every peer's phase, and then either

* one-shot (small pieces): every rank reduces all slots itself, or
* two-shot (large pieces): rank k reduces slice k of all slots into slot 0
  (in place), publishes a second phase, and every rank copies slot 0 out.

The reduction order is fixed (slot 0, then 1, 2 ...), and in two-shot each
element is computed once, so every rank's result is bit-identical. fp16 and
bf16 sums and products accumulate in fp32. ``reduce_range`` (reduce-scatter)
is one-shot restricted to the caller's rows; ``all_gather`` and
``broadcast_`` use the same slots and generations as plain byte copies (any
dtype): write, publish, wait for all, read.

Why two sets and no "done" flag suffice: call g writes set g%2, which call
g-2 used. A rank starts call g only after call g-1 saw every rank's first
phase of g-1, and a rank publishes that phase only after it has finished
call g-2, reads included. So nobody writes a set while a slow peer still
reads it, and back-to-back calls never wait on a peer's copy-out.

Control lines, publishing a phase, bounded waits (yield, then a futex
sleep) and peer liveness live in ``shm_phases``; creating, attaching and
mapping the segment in ``shm_slots``; set-up, per-call bookkeeping, sleep
mode and teardown in ``shm_setup``. Memory ordering: this runs
only on x86-64 (refused elsewhere), where stores reach other cores in
program order and loads are not reordered with older loads. Data is written
with torch copies or ``memmove`` (regular stores; glibc ends any
non-temporal memcpy loop with an ``sfence``) before the counter store, and a reader loads the counter
before the data, so a reader that sees the counter also sees the data.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch
from torch.distributed import ReduceOp

from shm_broadcast.host_memory import empty_output

from .errors import DesyncError, GroupcoordValueError
from .peer_reads import (
    DIRECT_ALL_REDUCE_MIN_BYTES,
    GATHER_CHUNK_BYTES,
    READ_SCRATCH_BYTES,
    SCATTER_SHARE_MIN_BYTES,
    PeerReads,
    WayTurn,
)
from .shm_phases import LINE, PhaseLines, check_all_to_all_counts, layout_code
from .shm_reduce import (
    CLONE_MAX_BYTES,
    ONE_SHOT_MAX_BYTES,
    SHM_DTYPES,
    OneTorchThread,
    combine,
    refused_op,
)
from .shm_setup import ShmBase, one_at_a_time
from .shm_slots import align_up
from .shm_small import LEAN_MAX_BYTES

# An all-gather through the slots goes in pieces of this (one generation each),
# copied by address: each piece of a rank's input, its slot and its rows of the
# result stay in L2 together. World 2 (4 / 16 MiB) and 4 (4 / 16 MiB), 2-core
# EPYC VM, three rounds each: 512 KiB pieces 1.01-1.18 / 5.0-5.9 ms and 4.8 /
# 16.7 ms, against 1.1-1.46 / 5.6-6.9 and 5.5-5.7 / 18.7-21 ms with 1 MiB pieces
# and 1.4-1.9 / 6.1-7.6 and 6.3-6.8 / 21.8-22.5 ms with the torch copies of 1
# MiB pieces before; 256 KiB pieces fell between, 128 KiB behind.
GATHER_PIECE_BYTES = 512 * 1024


def _check_out(out: torch.Tensor, dtype: torch.dtype, numel: int) -> None:
    """A caller's ``out`` must be what the call writes (a direct read writes its bytes)."""
    if not out.is_contiguous() or out.dtype != dtype or out.numel() != numel or not out.is_cpu:
        raise GroupcoordValueError(
            f"out: expected a contiguous CPU {dtype} tensor of {numel} elements, got "
            f"{out.dtype} of shape {tuple(out.shape)} on {out.device}"
            + ("" if out.is_contiguous() else ", not contiguous")
        )


class ShmAllReduce(ShmBase):
    """All-reduce through one shared-memory segment; a collective constructor.

    Every rank of ``cpu_group`` must construct it at the same time (see
    :class:`~.shm_setup.ShmBase` for the arguments and the disabled case).
    """

    # Peers' chunks read for a reduction (``_scratch``), made on first use.
    _scratch_bytes: torch.Tensor | None = None

    # ---- the back-end interface -------------------------------------------------

    def refusal(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM) -> str | None:
        if self.disabled_reason is not None:
            return self.disabled_reason
        if not tensor.is_cpu:
            return f"tensor is on {tensor.device}, not the CPU"
        if tensor.dtype not in SHM_DTYPES:
            return f"dtype {tensor.dtype} is not one of {[str(d) for d in SHM_DTYPES]}"
        reason = refused_op(op, tensor.dtype)
        if reason is not None:
            return reason
        return None

    @one_at_a_time
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        called: str | None = None,
    ) -> torch.Tensor:
        """The reduction as a new tensor, or written into contiguous ``out`` of the same
        shape and dtype (``tensor`` itself is fine: each piece is read before written).
        ``called``: the operator the caller was asked for and runs as ``op`` with work
        of its own ("AVG": a sum, then a division), fingerprinted in its place, so a
        rank's AVG against another's SUM raises instead of returning two answers."""
        return self._all_reduce(self.refusal(tensor, op), tensor, op, out, called=called)

    @one_at_a_time
    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        called: str | None = None,
    ) -> torch.Tensor:
        """The reduction, for in-group rank ``dst`` (checked as a reduce to ``dst``: a
        rank that calls anything else raises on every rank). Every rank computes it
        (the reduction is one-shot or split among the ranks anyway), so the others'
        result is the same; a caller may treat it as scratch. ``called``: as for
        :meth:`all_reduce`."""
        self._check_index(dst, "dst")
        return self._all_reduce(
            self.refusal(tensor, op), tensor, op, out, "reduce", dst, called=called
        )

    @one_at_a_time
    def reduce_in_chain(self, tensor: torch.Tensor, op: ReduceOp.RedOpType) -> torch.Tensor:
        # The chain took this back end because its refusal was None: not asked again.
        return self._all_reduce(None, tensor, op, None)

    @one_at_a_time
    def barrier(self) -> None:
        """Return once every rank of the group has called it (fingerprinted as a
        barrier: a rank that calls a collective here instead raises on every rank)."""
        if self.disabled_reason is not None:
            raise GroupcoordValueError(f"{self.what} cannot run a barrier: {self.disabled_reason}")
        self._empty_barrier(self._start("barrier", None, None))

    def _check_index(self, rank: int, argument: str) -> None:
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise GroupcoordValueError(
                f"{argument} must be an in-group rank in [0, {self.world_size}), got {rank!r}"
            )

    def _all_reduce(
        self,
        reason: str | None,
        tensor: torch.Tensor,
        op: ReduceOp.RedOpType,
        out: torch.Tensor | None,
        operation: str = "all_reduce",
        root: int = 0,
        called: str | None = None,
    ) -> torch.Tensor:
        if out is not None:
            _check_out(out, tensor.dtype, tensor.numel())
        numel = tensor.numel()
        nbytes = numel * tensor.element_size()
        reads = self.peer_reads
        readable = (
            reads is not None
            and nbytes > LEAN_MAX_BYTES
            and (self.world_size <= reads.cores or nbytes >= DIRECT_ALL_REDUCE_MIN_BYTES)
        )
        direct, turn = self._timed_way(operation, nbytes, readable)
        lines = self._start(operation, reason, tensor, called or op, root, direct=direct)
        if 0 < nbytes <= ONE_SHOT_MAX_BYTES and nbytes <= self.max_bytes:
            # The common small call: one piece on views shaped like the tensor
            # (no flattening, no slicing; copy_ takes any strides).
            shape, dtype = tensor.shape, tensor.dtype
            with self._desync_guard, OneTorchThread(nbytes):
                slots, s = self._one_piece(lines, tensor)
                parts = [slots.shaped(s, r, dtype, shape) for r in range(self.world_size)]
                return combine(parts, out, op)
        if out is None:
            out = empty_output(tensor.shape, tensor.dtype)
        if numel == 0:
            self._empty_barrier(lines)
            return out
        src = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        flat_out = out.view(-1)
        piece = self.max_bytes // tensor.element_size()
        with self._desync_guard, OneTorchThread(nbytes):
            if direct:
                assert reads is not None
                self._all_reduce_direct(lines, reads, src, flat_out, op, turn)
            elif numel <= piece:  # the common case: no slicing at all
                self._reduce_piece(lines, src, flat_out, op, turn)
            else:
                for start in range(0, numel, piece):
                    stop = min(start + piece, numel)
                    first = turn if start == 0 else None
                    self._reduce_piece(lines, src[start:stop], flat_out[start:stop], op, first)
        if turn is not None:
            turn.finish()
        return out

    @one_at_a_time
    def reduce_range(
        self,
        flat: torch.Tensor,
        lo: int,
        hi: int,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
        split: int = 0,
        called: str | None = None,
        layout: int = 0,
    ) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the all-reduce of 1-D ``flat`` (a reduce-scatter).

        Every rank passes an equally long ``flat`` and its own range. Each
        piece costs one barrier, and a rank reduces only its own range, so a
        reduce-scatter moves and adds 1/world of what an all-reduce does. ``out``:
        a contiguous 1-D tensor of ``hi - lo`` elements to write into. ``split``:
        a code of how the caller cut the rows among the ranks (``split_code``; 0
        for equal parts), in the call's fingerprint: ranks that cut differently
        raise ``DesyncError`` instead of each reducing rows of its own choosing.
        ``called``: as for :meth:`all_reduce`. ``layout``: the shape ``flat`` was made
        of (``shm_phases.layout_code``; 0: none to check).
        """
        # Checked before the call is stamped: a refused call leaves the ranks in step.
        if flat.dim() != 1 or not 0 <= lo <= hi <= flat.numel():
            raise GroupcoordValueError(
                f"reduce_range needs a 1-D tensor and 0 <= lo <= hi <= numel, got "
                f"shape {tuple(flat.shape)}, lo={lo}, hi={hi}"
            )
        if out is not None:
            _check_out(out, flat.dtype, hi - lo)
        n = flat.numel()
        size = flat.element_size()
        readable = n * size >= self.world_size * SCATTER_SHARE_MIN_BYTES
        direct, turn = self._timed_way(
            "reduce_scatter", n * size, readable and self.peer_reads is not None
        )
        lines = self._start(
            "reduce_scatter",
            self.refusal(flat, op),
            flat,
            called or op,
            root=split,
            direct=direct,
            layout=layout,
        )
        got = self._reduce_range(lines, flat, lo, hi, op, out, direct, turn)
        if turn is not None:
            turn.finish()
        return got

    def _reduce_range(
        self,
        lines: PhaseLines,
        flat: torch.Tensor,
        lo: int,
        hi: int,
        op: ReduceOp.RedOpType,
        out: torch.Tensor | None,
        direct: bool,
        turn: WayTurn | None,
    ) -> torch.Tensor:
        n = flat.numel()
        size = flat.element_size()
        if direct:
            if out is None:
                out = empty_output((hi - lo,), flat.dtype)
            reads, src, dst = self.peer_reads, flat.contiguous(), out
            assert reads is not None
            with self._desync_guard, OneTorchThread(n * size):
                # Each rank reads only its own rows of every peer's input.
                self._read_posted(
                    lines,
                    src.data_ptr(),
                    lambda s: self._sum_peers(reads, s, src, lo, hi, dst, op, "reduce_scatter"),
                    turn=turn,
                )
            return out
        piece = self.max_bytes // size
        if 0 < n <= piece and hi > lo:  # one piece: cached views, no slicing
            with self._desync_guard, OneTorchThread(n * size):
                _, s = self._one_piece(lines, flat, turn)
                return self._combine_slots(s, flat.dtype, lo, hi, out, op)
        if out is None:
            out = empty_output((hi - lo,), flat.dtype)
        if n == 0:
            self._empty_barrier(lines)
            return out
        me = self.rank_in_group
        with self._desync_guard, OneTorchThread(n * size):
            for a in range(0, n, piece):
                b = min(a + piece, n)
                gen = self._next_generation()
                s = gen & 1
                self._view(s, me, flat.dtype, b - a).copy_(flat[a:b])
                # One barrier per piece is enough: the next piece uses the other
                # set, and this set is rewritten only after the barrier after next.
                self._first_arrive(lines, 2 * gen - 1, turn if a == 0 else None)
                x, y = max(a, lo), min(b, hi)
                if y > x:
                    self._combine_slots(s, flat.dtype, x - a, y - a, out[x - lo : y - lo], op)
        return out

    # ---- copies through the same slots ---------------------------------------------

    def copy_refusal(self, tensor: torch.Tensor) -> str | None:
        """Like ``refusal``, for ``all_gather``/``broadcast_`` (bytes are copied, any dtype)."""
        if self.disabled_reason is not None:
            return self.disabled_reason
        if not tensor.is_cpu:
            return f"tensor is on {tensor.device}, not the CPU"
        if tensor.is_quantized:  # no code in the call's fingerprint (the wire table's)
            return f"dtype {tensor.dtype} is quantized"
        return None

    @one_at_a_time
    def all_gather(
        self, tensor: torch.Tensor, *, out: torch.Tensor | None = None, flat: bool = False
    ) -> torch.Tensor:
        """Every rank's equally shaped ``tensor`` stacked: shape ``(world, *tensor.shape)``,
        new or written into contiguous ``out`` of as many elements and ``tensor``'s dtype.
        The ranks' shapes are checked (``shm_phases.layout_code``) unless ``flat``: a
        caller whose ranks need only equal element counts (a ``Comm``)."""
        result = self._gather(tensor, out, None, flat)
        assert result is not None  # every rank receives
        return result

    @one_at_a_time
    def gather(
        self, tensor: torch.Tensor, dst: int, *, out: torch.Tensor | None = None, flat: bool = False
    ) -> torch.Tensor | None:
        """:meth:`all_gather`'s result on in-group rank ``dst`` only (None elsewhere:
        the other ranks copy nothing out); checked as a gather to ``dst``."""
        self._check_index(dst, "dst")
        return self._gather(tensor, out, dst, flat)

    def _gather(
        self, tensor: torch.Tensor, out: torch.Tensor | None, dst: int | None, flat: bool
    ) -> torch.Tensor | None:
        if out is not None:
            _check_out(out, tensor.dtype, self.world_size * tensor.numel())
        reason = self.copy_refusal(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        readable = nbytes > LEAN_MAX_BYTES and self.peer_reads is not None
        layout = 0 if flat else layout_code(tensor.shape)
        if dst is None:
            direct, turn = self._timed_way("all_gather", nbytes, readable)
            lines = self._start("all_gather", reason, tensor, direct=direct, layout=layout)
        else:  # a gather: the rules alone
            direct, turn = readable, None
            lines = self._start("gather", reason, tensor, root=dst, direct=direct, layout=layout)
        me = self.rank_in_group
        if dst is not None and dst != me:
            out = None  # a gather's other ranks copy nothing out
        elif out is None:
            # A small result is allocated fresh (it is reused from malloc's heap).
            out = (
                torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype)
                if nbytes * self.world_size < CLONE_MAX_BYTES
                else empty_output((self.world_size, *tensor.shape), tensor.dtype)
            )
        if direct:
            assert self.peer_reads is not None
            with self._desync_guard:
                self._gather_direct(lines, self.peer_reads, tensor.contiguous(), out, nbytes, turn)
            if turn is not None:
                turn.finish()
            return out
        if nbytes == 0:
            self._empty_barrier(lines)
            return out
        slots = self._slots
        assert slots is not None  # enabled means mapped
        # Byte copies by address, no torch op; a strided input is made contiguous once.
        src = tensor
        if not src.is_contiguous():
            with OneTorchThread(nbytes):
                src = tensor.contiguous()
        at, own = src.data_ptr(), None if out is None else out.data_ptr()
        piece = min(GATHER_PIECE_BYTES, self.max_bytes)
        with self._desync_guard:
            for a in range(0, nbytes, piece):
                n = min(piece, nbytes - a)
                gen = self._next_generation()
                s = gen & 1
                ctypes.memmove(slots.address(s, me), at + a, n)
                self._first_arrive(lines, 2 * gen - 1, turn if a == 0 else None)
                if own is None:
                    continue
                for r in range(self.world_size):
                    to = own + r * nbytes + a
                    if r != me:
                        ctypes.memmove(to, slots.address(s, r), n)
                    elif to != at + a:  # (torch's in-place idiom: the input is row me)
                        # This rank's row from its input: reading back the slot it had
                        # just written made the next call's copy-in 2-3x slower here.
                        ctypes.memmove(to, at + a, n)
        if turn is not None:
            turn.finish()
        return out

    @one_at_a_time
    def scatter(
        self, out: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int
    ) -> torch.Tensor:
        """In-group rank ``src``'s ``inputs[r]`` into rank ``r``'s contiguous ``out``
        (``inputs``, one tensor per rank of ``out``'s dtype and size, on ``src`` only;
        checked as a scatter from ``src``). Returns ``out``.

        Through the slots the root copies part ``r`` into rank ``r``'s slot and each
        rank copies its slot out, a piece a barrier; past the one-shot size, where
        the kernel allows it, each rank reads its part straight out of the root's
        input (one copy)."""
        self._check_index(src, "src")
        me, world = self.rank_in_group, self.world_size
        if not out.is_contiguous():
            raise GroupcoordValueError("scatter: out must be contiguous")
        parts: list[torch.Tensor] = []
        if me == src:
            if inputs is None or len(inputs) != world:
                raise GroupcoordValueError(f"scatter: the root needs {world} input tensors")
            for i, part in enumerate(inputs):
                if part.dtype != out.dtype or part.numel() != out.numel():
                    raise GroupcoordValueError(
                        f"scatter: inputs[{i}] is {part.dtype}[{part.numel()}], out is "
                        f"{out.dtype}[{out.numel()}]"
                    )
            parts = [part.contiguous() for part in inputs]
        lines = self._start("scatter", self.copy_refusal(out), out, root=src)
        nbytes = out.numel() * out.element_size()
        if nbytes == 0:
            self._empty_barrier(lines)
            return out
        slots = self._slots
        assert slots is not None  # enabled means mapped
        reads, at = self.peer_reads, out.data_ptr()
        if nbytes > LEAN_MAX_BYTES and reads is not None:
            addresses = [part.data_ptr() for part in parts] or [0]

            def read(s: int) -> None:
                if me == src:  # its own part, while the peers read theirs
                    ctypes.memmove(at, addresses[me], nbytes)
                else:
                    reads.read(src, at, slots.posted(s, src, me), nbytes, "scatter")

            with self._desync_guard:
                self._read_posted(lines, addresses[0], read, *addresses[1:])
            return out
        with self._desync_guard:
            for start in range(0, nbytes, self.max_bytes):
                size = min(self.max_bytes, nbytes - start)
                gen = self._next_generation()
                s = gen & 1
                for r, part in enumerate(parts):  # the root only
                    ctypes.memmove(slots.address(s, r), part.data_ptr() + start, size)
                lines.arrive(2 * gen - 1)
                ctypes.memmove(at + start, slots.address(s, me), size)
        return out

    @one_at_a_time
    def all_to_all(self, tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Block ``r`` of contiguous ``tensor`` (``world`` equal blocks along its flat
        memory) to in-group rank ``r``; block ``r`` of contiguous ``out`` (as large,
        same dtype) from rank ``r``. Returns ``out``, which must not be ``tensor``.

        Per piece every rank writes its part of each block into its slot, one after
        the other; after the barrier each rank copies its own part out of every
        rank's slot. One barrier a piece, as ``reduce_range`` (two sets of slots).
        Past the one-shot size, where the kernel allows it, each rank instead reads
        its block straight out of every peer's ``tensor`` (one copy, as a large
        all-gather does).
        """
        n = tensor.numel()
        world = self.world_size
        if not (tensor.is_contiguous() and out.is_contiguous() and n % world == 0):
            raise GroupcoordValueError(
                f"all_to_all needs contiguous tensors whose {n} elements split into "
                f"{world} equal blocks"
            )
        _check_out(out, tensor.dtype, n)
        if out.data_ptr() == tensor.data_ptr() and n:
            raise GroupcoordValueError("all_to_all: out must not be the input tensor")
        lines = self._start("all_to_all", self.copy_refusal(tensor), tensor)
        if n == 0:
            self._empty_barrier(lines)
            return out
        slots = self._slots
        assert slots is not None  # enabled means mapped
        block = n // world * tensor.element_size()  # bytes each rank sends each rank
        piece = max(1, self.max_bytes // world // 64 * 64)  # bytes of each block a piece
        me, src, dst = self.rank_in_group, tensor.data_ptr(), out.data_ptr()
        reads = self.peer_reads
        if block * world > LEAN_MAX_BYTES and reads is not None:
            ctypes.memmove(dst + me * block, src + me * block, block)

            def read(s: int) -> None:
                for r in range(world):
                    if r != me:
                        remote = slots.posted(s, r, 0) + me * block
                        reads.read(r, dst + r * block, remote, block, "all_to_all")

            with self._desync_guard:
                self._read_posted(lines, src, read)
            return out
        with self._desync_guard:
            for a in range(0, block, piece):
                size = min(piece, block - a)
                gen = self._next_generation()
                s = gen & 1
                mine = slots.address(s, me)
                for r in range(world):
                    ctypes.memmove(mine + r * size, src + r * block + a, size)
                lines.arrive(2 * gen - 1)
                for r in range(world):
                    ctypes.memmove(dst + r * block + a, slots.address(s, r) + me * size, size)
        return out

    @one_at_a_time
    def all_to_all_v(
        self,
        tensor: torch.Tensor,
        out: torch.Tensor,
        in_counts: Sequence[int],
        out_counts: Sequence[int],
    ) -> torch.Tensor:
        """Uneven all-to-all of flat contiguous tensors: the next ``in_counts[q]``
        elements of ``tensor`` go to in-group rank ``q``, in rank order; ``out``
        gets ``out_counts[r]`` elements from rank ``r``, in rank order. Returns
        ``out``, which must not be ``tensor``.

        Every rank posts its counts at the head of its slot, with its ``tensor``
        after them when that fits (up to the one-shot size), and the ranks meet once,
        fingerprinted as this call (dtype included). A pair whose counts disagree
        then raises ``DesyncError`` on every rank, naming it, and the ranks stay in
        step. When every rank's tensor came along, each copies its blocks out and
        is done: one barrier. Else (the same answer on every rank: it follows from
        the counts) past the one-shot size, where the kernel allows it, each rank
        reads its block straight out of every peer's ``tensor``; or in rounds of a
        slot each, every rank writes the next slot's worth of its ``tensor`` and
        copies out whatever of its blocks that holds.
        """
        world, me = self.world_size, self.rank_in_group
        counts = [int(n) for n in (*in_counts, *out_counts)]
        if len(counts) != 2 * world or min(counts, default=0) < 0:
            raise GroupcoordValueError(f"all_to_all_v needs {world} counts each way, none < 0")
        if not (tensor.is_contiguous() and out.is_contiguous()):
            raise GroupcoordValueError("all_to_all_v needs contiguous tensors")
        if tensor.numel() != sum(counts[:world]) or out.numel() != sum(counts[world:]):
            raise GroupcoordValueError(
                f"all_to_all_v: tensor has {tensor.numel()} elements for counts summing to "
                f"{sum(counts[:world])}, out {out.numel()} for {sum(counts[world:])}"
            )
        _check_out(out, tensor.dtype, out.numel())
        if out.data_ptr() == tensor.data_ptr() and out.numel():
            raise GroupcoordValueError("all_to_all_v: out must not be the input tensor")
        lines = self._start("all_to_all_v", self.copy_refusal(tensor), tensor, varying=True)
        slots = self._slots
        assert slots is not None  # enabled means mapped
        size = tensor.element_size()
        head = align_up(16 * world, LINE)  # the counts; the data starts on a line of its own
        fits = min(LEAN_MAX_BYTES, self.max_bytes - head)
        src, dst = tensor.data_ptr(), out.data_ptr()
        gen = self._next_generation()
        s = gen & 1
        slots.post(s, me, counts)
        if tensor.numel() * size <= fits:
            ctypes.memmove(slots.address(s, me) + head, src, tensor.numel() * size)
        with self._desync_guard:
            self._first_arrive(lines, 2 * gen - 1, None)
        table = [slots.posted_run(s, r, 0, 2 * world) for r in range(world)]
        try:
            check_all_to_all_counts(self.what, table)
        except DesyncError as exc:
            raise self._counts_disagree(exc) from None
        sent = [row[:world] for row in table]  # sent[r][q]: elements r sends q
        starts = [sum(sent[r][:me]) * size for r in range(world)]  # bytes: my block of r's
        into = [sum(counts[world : world + r]) * size for r in range(world)]
        largest = max(sum(row) for row in sent) * size
        if largest <= fits:  # every rank's tensor is in its slot
            for r in range(world):
                if sent[r][me]:
                    ctypes.memmove(
                        dst + into[r], slots.address(s, r) + head + starts[r], sent[r][me] * size
                    )
            return out
        lines = self._start("all_to_all_v", None, tensor, varying=True)  # in step
        reads = self.peer_reads
        if largest > LEAN_MAX_BYTES and reads is not None:
            ctypes.memmove(dst + into[me], src + starts[me], sent[me][me] * size)

            def read(s: int) -> None:
                for r in range(world):
                    if r != me and sent[r][me]:
                        remote = slots.posted(s, r, 0) + starts[r]
                        reads.read(r, dst + into[r], remote, sent[r][me] * size, "all_to_all_v")

            with self._desync_guard:
                self._read_posted(lines, src, read)
            return out
        step = self.max_bytes
        with self._desync_guard:
            for lo in range(0, largest, step):
                hi = lo + step
                gen = self._next_generation()
                s = gen & 1
                length = min(hi, sum(sent[me]) * size) - lo
                if length > 0:
                    ctypes.memmove(slots.address(s, me), src + lo, length)
                lines.arrive(2 * gen - 1)
                for r in range(world):
                    a = starts[r]
                    b = a + sent[r][me] * size
                    x, y = max(a, lo), min(b, hi)
                    if y > x:
                        ctypes.memmove(
                            dst + into[r] + (x - a), slots.address(s, r) + (x - lo), y - x
                        )
        return out

    # ---- reading the peers' memory directly (peer_reads) ----------------------------

    def _timed_way(
        self, operation: str, nbytes: int, readable: bool
    ) -> tuple[bool, WayTurn | None]:
        """Whether a call of ``nbytes`` a rank reads directly, and its turn in timing
        the ways (None: not timed). ``readable``: the fixed rule would read it
        directly (peer reads are up, and the call is large enough); only then are
        the slots timed against the reads (``peer_reads.TimedWays``)."""
        if not readable:
            return False, None
        if self.timed_ways is None:
            return True, None
        turn = self.timed_ways.turn(operation, nbytes)
        return turn.direct, turn

    def _meet_posted(
        self, lines: PhaseLines, gen: int, posts: tuple[int, ...], turn: WayTurn | None
    ) -> None:
        """Post ``posts`` (as numbers 0, 1, ...) in this rank's slot of generation
        ``gen``'s set, then the call's first barrier. A ``turn`` that shares its
        timings posts them after ``posts`` and agrees on the way with every rank's."""
        slots = self._slots
        assert slots is not None  # enabled means mapped
        s, me = gen & 1, self.rank_in_group
        shared = turn.shared() if turn is not None and turn.shares else ()
        slots.post(s, me, posts + shared)
        self._first_arrive(lines, 2 * gen - 1, turn)
        if shared and turn is not None:
            k = len(posts)
            turn.agree([slots.posted_run(s, r, k, k + len(shared)) for r in range(self.world_size)])

    def _read_posted(
        self,
        lines: PhaseLines,
        address: int,
        read: Callable[[int], None],
        *more: int,
        turn: WayTurn | None = None,
    ) -> None:
        """The frame of a direct read: post ``address`` (what this rank offers its
        peers; ``more`` addresses after it, as posts 1, 2, ...), wait for every rank,
        ``read(s)`` from the peers' posts in set ``s``, and wait again, so no rank
        returns (and lets its caller change or free what it posted) while a peer
        still reads it. The second wait runs after a failed read too: the peers are
        waiting for this rank's phase. A copy collective's ``turn`` that shares its
        timings posts them after the addresses and agrees on the way here."""
        gen = self._next_generation()
        self._meet_posted(lines, gen, (address, *more), turn)
        try:
            read(gen & 1)
        finally:
            lines.arrive(2 * gen)

    def _gather_direct(
        self,
        lines: PhaseLines,
        reads: PeerReads,
        src: torch.Tensor,
        out: torch.Tensor | None,
        nbytes: int,
        turn: WayTurn | None,
    ) -> None:
        """All-gather by reading each peer's ``src`` straight into ``out`` (one copy),
        a chunk of every peer's part, then the same chunk of this rank's own (the
        peers read it about then: ``GATHER_CHUNK_BYTES``). Without ``out`` (a
        gather's other ranks) this rank only offers ``src``."""
        slots = self._slots
        assert slots is not None  # enabled means mapped
        me = self.rank_in_group

        def read(s: int) -> None:
            if out is None:
                return
            at, own = out.data_ptr(), src.data_ptr()
            peers = [(r, slots.posted(s, r, 0)) for r in range(self.world_size) if r != me]
            for a in range(0, nbytes, GATHER_CHUNK_BYTES):
                n = min(GATHER_CHUNK_BYTES, nbytes - a)
                for r, remote in peers:
                    reads.read(r, at + r * nbytes + a, remote + a, n, "all_gather")
                ctypes.memmove(at + me * nbytes + a, own + a, n)

        self._read_posted(lines, src.data_ptr(), read, turn=turn)

    def _broadcast_direct(
        self,
        lines: PhaseLines,
        reads: PeerReads,
        work: torch.Tensor,
        src: int,
        turn: WayTurn | None,
    ) -> None:
        """Every rank but ``src`` reads ``src``'s ``work`` into its own; ``src`` copies
        nothing."""
        slots = self._slots
        assert slots is not None  # enabled means mapped
        nbytes = work.numel() * work.element_size()

        def read(s: int) -> None:
            if self.rank_in_group != src:
                reads.read(src, work.data_ptr(), slots.posted(s, src, 0), nbytes, "broadcast")

        self._read_posted(lines, work.data_ptr(), read, turn=turn)

    def _all_reduce_direct(
        self,
        lines: PhaseLines,
        reads: PeerReads,
        src: torch.Tensor,
        out: torch.Tensor,
        op: ReduceOp.RedOpType,
        turn: WayTurn | None,
    ) -> None:
        """Two-shot by reads: rank k reduces slice k of every rank's ``src`` into its own
        ``out``, then reads the other slices from the peers' ``out``. Three barriers
        (addresses posted, slices reduced, slices read), so it takes two generations.
        After a failed read no barrier is passed (the peers would read a slice never
        reduced): they time out naming this rank, whose group is then unusable."""
        slots = self._slots
        assert slots is not None  # enabled means mapped
        first = self._next_generation()
        s = first & 1
        me = self.rank_in_group
        size = src.element_size()
        self._meet_posted(lines, first, (src.data_ptr(), out.data_ptr()), turn)
        # The second generation only now the call is checked: ranks whose calls differ
        # raised above, each one generation on, and stay in step.
        last = self._next_generation()
        n = src.numel()
        chunk = align_up(-(-n // self.world_size), 16)
        lo, hi = min(me * chunk, n), min((me + 1) * chunk, n)
        self._sum_peers(reads, s, src, lo, hi, out[lo:hi], op, "all_reduce")
        lines.arrive(2 * first)
        at = out.data_ptr()
        for r in range(self.world_size):
            a, b = min(r * chunk, n), min((r + 1) * chunk, n)
            if r != me and b > a:
                remote = slots.posted(s, r, 1) + a * size
                reads.read(r, at + a * size, remote, (b - a) * size, "all_reduce")
        lines.arrive(2 * last - 1)

    def _sum_peers(
        self,
        reads: PeerReads,
        s: int,
        src: torch.Tensor,
        lo: int,
        hi: int,
        out: torch.Tensor,
        op: ReduceOp.RedOpType,
        operation: str,
    ) -> None:
        """``out`` = elements ``[lo, hi)`` of every rank's posted input combined in
        rank order, read a cache-sized chunk at a time (this rank's own from ``src``)."""
        slots = self._slots
        assert slots is not None  # enabled means mapped
        me, size = self.rank_in_group, src.element_size()
        scratch = self._scratch(src.dtype)
        step = scratch.shape[1]
        addresses = [slots.posted(s, r, 0) for r in range(self.world_size)]
        # In place (``out`` is these rows of ``src``): the own rows are copied aside
        # first, or the combine would overwrite them before it reads them.
        in_place = out.data_ptr() == src.data_ptr() + lo * size
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            parts = []
            for r in range(self.world_size):
                if r == me:
                    own = src[a:b]
                    parts.append(scratch[r, : b - a].copy_(own) if in_place else own)
                    continue
                row = scratch[r, : b - a]
                reads.read(r, row.data_ptr(), addresses[r] + a * size, (b - a) * size, operation)
                parts.append(row)
            combine(parts, out[a - lo : b - lo], op)

    def _scratch(self, dtype: torch.dtype) -> torch.Tensor:
        """A ``(world, step)`` buffer of ``dtype`` for one chunk of every rank (this
        rank's row: an in-place call's own rows), kept between calls; the peers'
        rows fill ``READ_SCRATCH_BYTES``."""
        row = READ_SCRATCH_BYTES // (self.world_size - 1) // LINE * LINE  # any dtype fits
        if self._scratch_bytes is None:
            self._scratch_bytes = torch.empty(self.world_size * row, dtype=torch.uint8)
        return self._scratch_bytes.view(dtype).view(self.world_size, row // dtype.itemsize)

    @one_at_a_time
    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` with in-group rank ``src``'s; returns ``tensor``."""
        nbytes = tensor.numel() * tensor.element_size()
        reads = self.peer_reads
        # With more ranks than cores the slots were faster in every run measured (a
        # read costs more CPU time than a memmove): only read with a core each.
        readable = reads is not None and nbytes > LEAN_MAX_BYTES and self.world_size <= reads.cores
        direct, turn = self._timed_way("broadcast", nbytes, readable)
        lines = self._start("broadcast", self.copy_refusal(tensor), tensor, root=src, direct=direct)
        if tensor.numel() == 0:
            self._empty_barrier(lines)
            return tensor
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if direct:
            assert reads is not None
            with self._desync_guard:
                self._broadcast_direct(lines, reads, work, src, turn)
        else:
            # Byte copies by address: no torch op (a tensor slice alone costs 3-5 us).
            # Over the two sets the root copies piece k+1 in while the others copy
            # piece k out.
            slots = self._slots
            assert slots is not None  # enabled means mapped
            at, sender = work.data_ptr(), self.rank_in_group == src
            with self._desync_guard:
                for start in range(0, nbytes, self.max_bytes):
                    size = min(self.max_bytes, nbytes - start)
                    gen = self._next_generation()
                    slot = slots.address(gen & 1, src)
                    if sender:
                        ctypes.memmove(slot, at + start, size)
                    # Everyone publishes and waits for everyone (not just src): the
                    # double-buffering argument needs every call to be a full barrier.
                    self._first_arrive(lines, 2 * gen - 1, turn if start == 0 else None)
                    if not sender:
                        ctypes.memmove(at + start, slot, size)
        if work is not tensor:
            tensor.copy_(work)
        if turn is not None:
            turn.finish()
        return tensor

    # ---- one piece --------------------------------------------------------------

    def _reduce_piece(
        self,
        lines: PhaseLines,
        src: torch.Tensor,
        dst: torch.Tensor,
        op: ReduceOp.RedOpType,
        turn: WayTurn | None = None,
    ) -> None:
        gen = self._next_generation()
        s = gen & 1
        n = src.numel()
        me = self.rank_in_group
        mine = self._view(s, me, src.dtype, n)
        if n * src.element_size() <= ONE_SHOT_MAX_BYTES:
            mine.copy_(src)
            self._first_arrive(lines, 2 * gen - 1, turn)
            self._combine_slots(s, src.dtype, 0, n, dst, op)
            return
        chunk = align_up(-(-n // self.world_size), 16)
        lo, hi = min(me * chunk, n), min((me + 1) * chunk, n)
        # The slice this rank reduces is read by no other rank (the slices follow
        # from n, which every rank's fingerprint agrees on): it stays out of the
        # slot and is read from the input, 1/world less copied in.
        if lo > 0:
            mine[:lo].copy_(src[:lo])
        if hi < n:
            mine[hi:].copy_(src[hi:])
        self._first_arrive(lines, 2 * gen - 1, turn)
        if hi > lo:
            reduced = self._view(s, 0, src.dtype, n)[lo:hi]
            self._combine_slots(s, src.dtype, lo, hi, reduced, op, own=src[lo:hi])
        lines.arrive(2 * gen)
        dst.copy_(self._view(s, 0, src.dtype, n))

    def _combine_slots(
        self,
        s: int,
        dtype: torch.dtype,
        lo: int,
        hi: int,
        out: torch.Tensor | None,
        op: ReduceOp.RedOpType,
        own: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """slot0 op slot1 op ... over [lo, hi), always in slot order, into ``out`` or new;
        ``own``: this rank's part, read there instead of from its slot."""
        slots = self._slots
        assert slots is not None  # enabled means mapped
        parts = [slots.span(s, r, dtype, lo, hi) for r in range(self.world_size)]
        if own is not None:
            parts[self.rank_in_group] = own
        return combine(parts, out, op)
