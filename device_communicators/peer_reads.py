"""Reading a peer rank's memory straight into ours: Linux cross-memory attach.

Through the slots, a large all-gather copies every byte twice: its owner into
its slot, then each reader out of the slot. ``process_vm_readv`` lets the
kernel copy from the owner's tensor into the reader's result in one pass, as
MPICH does for large messages on one node. Measured on a 2-core EPYC VM, world
2: 1 MiB all-gather 790-860 us through the slots, 340-570 us this way.

A reduction reads the peers' rows it reduces into a small scratch buffer, a
chunk at a time, and sums each chunk while it is in cache: a reduce-scatter
reads only its own rows (from a share of 512 KiB a rank; 2-16 MiB: 1.4-1.8x
faster than through the slots at world 2); an all-reduce is a
reduce-scatter into each rank's own result, then reads of the other ranks'
reduced slices from their results. A read has a fixed cost (about 6 us more
than a ``memmove`` here) and moves about 7 GB/s even from cache, where a
``memmove`` moves 25, so with more ranks than cores, where CPU time is what
counts, the slots stay the path for all-reduces below
``DIRECT_ALL_REDUCE_MIN_BYTES``. A broadcast over 256 KiB may be read
directly (the root copies nothing) only when every rank has a core: with
more ranks than cores the slots, where the root copies the next piece in
while the others copy the last one out, were faster at every size measured
(see ``docs/cpu_communicator.md``). Where these rules would read directly,
the group times the slots against the reads now and then and takes the
faster (``TimedWays``). Calls the lean path (``shm_small``) takes, up to
256 KiB, are never read directly.

The kernel allows the call only to a process that may ptrace the target:
the same user, and, where Yama's ``ptrace_scope`` is 1 or more, not between
sibling ranks; a container without ``CAP_SYS_PTRACE`` may refuse it too. So
the set-up does not assume it: every rank posts a token's address, reads each
peer's token through the call, and the ranks take this path only if every
read of every rank returned the right bytes (otherwise the slots serve, and
the reason is logged). ``GROUPCOORD_DISABLE_PEER_READS=1`` keeps every rank
on the slots.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import time
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from shm_broadcast.gloo_errors import gloo_errors
from shm_broadcast.liveness import process_alive

from .errors import GroupcoordError, PeerDiedError

__all__ = [
    "DIRECT_ALL_REDUCE_MIN_BYTES",
    "FIRST_CYCLE",
    "GATHER_CHUNK_BYTES",
    "READ_SCRATCH_BYTES",
    "RETIME_EVERY",
    "SCATTER_SHARE_MIN_BYTES",
    "PeerReadError",
    "PeerReads",
    "TimedWays",
    "WayTurn",
    "agree_on_peer_reads",
    "probe_this_machine",
]

# What is read directly when allowed: an all-gather part over the lean path's
# 256 KiB (``shm_small.LEAN_MAX_BYTES``), or a reduce-scatter whose share (each
# rank's rows) is at least this. Neither may overlap the lean path: it copies
# through the slots, and a rank whose call the lean path declines (a strided
# input, say) must meet the same protocol on the general path as its peers on
# the lean one. Below this share the slots were faster. Slots' time / direct
# time, both ways alternating within each run (2-core EPYC VM, 2026-11-25, 2-3
# runs): world 2, inputs of 384-512 KiB 0.59-0.94, 768 KiB 0.84-1.11, 1 MiB
# 1.02-1.42, 2 MiB 1.51-1.83; world 4, 384 KiB-1 MiB 0.61-0.86, 2 MiB 1.02-1.07,
# 4 MiB 1.38.
SCATTER_SHARE_MIN_BYTES = 512 * 1024
# An all-reduce past one-shot (over 256 KiB) is read directly when every rank
# has a core (world 2 on 2 cores: 512 KiB 392-397 -> 329-336 us, 1 MiB 545-728
# -> 478-484, 2 MiB 1,478-1,826 -> 820-879, 4 MiB 2,476-3,234 -> 1,797-1,877);
# with more ranks than cores, only from this size: a read takes more CPU time
# than the slots' copies (~6 us more than a memmove, and 4-5 GB/s against 15-20
# from cache), and four ranks on two cores were 10-50% slower read directly at
# 512 KiB-1 MiB, even at 2 MiB, 5-15% faster at 4 MiB.
DIRECT_ALL_REDUCE_MIN_BYTES = 4 * 1024 * 1024
# A reduction reads the peers' rows a chunk at a time into a scratch buffer, and
# sums each chunk before the next. The peers' chunks of one step fill this much
# (a Zen 1 core's L2): at world 2, 1-4 MiB reduce-scatters took 15-25% less
# time with 512 KiB chunks than with 256 KiB; at world 4, 512 KiB chunks (1.5
# MiB of scratch) were slower again, and this rule's 170 KiB measured even with
# 256 KiB; 32 KiB chunks made a 1 MiB reduce-scatter 3x slower (each read has
# a fixed cost, each chunk a few torch calls).
READ_SCRATCH_BYTES = 512 * 1024
# An all-gather reads each peer's part this much at a time, and copies this
# rank's own part at the same pace: each chunk of a rank's input is then read
# by its peers and by its own copy at about the same time, while it is still
# in the shared cache. The whole own part first, then the peers' parts, took
# 1.2-1.3x the time (world 2, 16 MiB per rank, 2-core EPYC VM, alternating
# runs: 7.5-8.3 ms against 5.9-6.7 with 256 KiB-1 MiB chunks, 7.2 with 2 MiB,
# 9.4 with 4 MiB).
GATHER_CHUNK_BYTES = 1024 * 1024
# A call the rules above would read directly (an all-gather, broadcast,
# all-reduce, reduce or reduce-scatter) goes the way, reads or slots, that was
# faster when last timed: on the 2-core EPYC VM the slot path is bimodal by run
# (world 2, 1 MiB broadcast 84-105 us in some runs, 222-242 in others; read
# directly 157-190 in every run; all-reduces and reduce-scatters through the
# slots 0.57-0.86 of the direct time in one session, 1.1-1.4 in another), so
# each fixed rule was up to 2x off in some runs. So the ways are timed in
# cycles of calls of a kind and size class, the first FIRST_CYCLE calls long,
# each twice the one before up to RETIME_EVERY (an early decision, made on a
# cold and noisy start, is soon checked again). In each cycle calls 1-4 go
# through the slots and 5-8 read directly, the last two of each timed (the
# first two warm the way up: both sets of slots go cold while the other way
# runs); call 9 (read directly) shares the times, and every rank keeps the way
# that was faster until the next timing. A call's time is from when the last
# rank started it to when the last rank finished it (one clock for the whole
# host), so neither a late rank nor a rank that returns before its peers are
# done (a broadcast's root, through the slots) counts; a way's time is the
# lower of its two calls'. The slot path's mode changes within a run too (a
# world-2 1 MiB broadcast went from 60-74 to 350 us a call between two buffers
# of one run), so only the last timing counts. Call 0 of a size, which pays for
# fresh result pages, reads directly. At most 5 calls a cycle take the slower
# way (from the fifth cycle, 2% of the time when it is 2x slower).
FIRST_CYCLE = 32
RETIME_EVERY = 256
# Calls 1, 2, ... of each cycle: (read directly?, which timing it is or -1).
_TIMING_STEPS = (
    (False, -1), (False, -1), (False, 0), (False, 1), (True, -1), (True, -1), (True, 2), (True, 3)
)  # fmt: skip
_SHARE_STEP = len(_TIMING_STEPS) + 1
_TIMINGS = 4


def _cycle_step(calls: int) -> int:
    """Where a kind's call number ``calls`` falls in its timing cycle (cycles of
    FIRST_CYCLE calls, doubling up to RETIME_EVERY, then RETIME_EVERY each)."""
    start, length = 0, FIRST_CYCLE
    while length < RETIME_EVERY:
        if calls - start < length:
            return calls - start
        start += length
        length *= 2
    return (calls - start) % RETIME_EVERY


class WayTurn:
    """One call's way (``direct``: read the peers' memory; else the slots) and its
    part in timing them: a timed one records when it started and finished here
    (:meth:`finish`); one that ``shares`` (read directly) has its frame post
    :meth:`shared` after its addresses and hand every rank's posts to
    :meth:`agree` after its first barrier. Every call reports passing its first
    barrier (:meth:`passed_first_barrier`): only then has it counted."""

    __slots__ = ("direct", "shares", "_kind", "_which", "_started")

    def __init__(self, kind: _WayKind, direct: bool, which: int = -1, shares: bool = False):
        self._kind = kind
        self.direct, self.shares, self._which = direct, shares, which
        self._started = time.monotonic_ns() if which >= 0 else 0

    def passed_first_barrier(self) -> None:
        """The ranks' calls agree (same kind and size): count it."""
        self._kind.calls += 1

    def finish(self) -> None:
        """The call is done here: a timed one records its start and end."""
        if self._which >= 0:
            self._kind.times[2 * self._which] = self._started
            self._kind.times[2 * self._which + 1] = time.monotonic_ns()

    def shared(self) -> tuple[int, ...]:
        """What this rank posts: start and end of its timed calls (slots twice, then
        direct twice), in ns of the host's monotonic clock (0: not timed)."""
        return tuple(self._kind.times)

    def agree(self, posted: Sequence[Sequence[int]]) -> None:
        """Every rank's :meth:`shared`, the same on every rank: the way from here on."""
        kind = self._kind
        if any(t <= 0 for times in posted for t in times):
            return  # a rank lacks a time (cannot happen in step): keep the way
        took = [
            max(
                max(times[2 * j + 1] for times in posted) - max(times[2 * j] for times in posted), 1
            )
            for j in range(_TIMINGS)
        ]
        kind.slots_ns, kind.direct_ns = min(took[0], took[1]), min(took[2], took[3])
        kind.direct = kind.direct_ns <= kind.slots_ns
        kind.agreements += 1


class _WayKind:
    """The timings of one kind and size class of copy collective; all but ``times``
    (this rank's own clock readings) the same on every rank."""

    __slots__ = ("calls", "direct", "times", "slots_ns", "direct_ns", "agreements")

    def __init__(self, direct: bool) -> None:
        self.calls = 0  # calls that passed their first barrier: in step on every rank
        self.direct = direct
        self.times = [0] * (2 * _TIMINGS)
        self.slots_ns = self.direct_ns = 0  # agreed at the last timing
        self.agreements = 0


class TimedWays:
    """Which way each call that the rules would read directly goes (see
    ``RETIME_EVERY``): one per shared-memory group, the kinds of call apart. The ranks' calls run in step
    (each call's first barrier checks they agree), so each rank's count of a kind's
    calls, and with it which call is timed or shares, is the same everywhere, and
    every rank derives the way from the same shared numbers. The way is part of
    the call's fingerprint too, so ranks that ever chose apart would raise
    ``DesyncError``, not read where nothing was written."""

    def __init__(self) -> None:
        self._kinds: dict[tuple[str, int], _WayKind] = {}

    def turn(self, operation: str, nbytes: int) -> WayTurn:
        """The way of the next ``operation`` of ``nbytes`` a rank (size classes: powers
        of two); read directly before the first timing."""
        key = (operation, nbytes.bit_length())
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = _WayKind(direct=True)
        step = _cycle_step(kind.calls)
        if 1 <= step <= len(_TIMING_STEPS):
            direct, which = _TIMING_STEPS[step - 1]
            return WayTurn(kind, direct, which)
        if step == _SHARE_STEP:
            return WayTurn(kind, direct=True, shares=True)
        return WayTurn(kind, kind.direct)

    def state(self, operation: str, nbytes: int) -> dict[str, object] | None:
        """Such calls' way and agreed timings (None: none made yet)."""
        kind = self._kinds.get((operation, nbytes.bit_length()))
        if kind is None:
            return None
        return {
            name: getattr(kind, name)
            for name in ("calls", "direct", "slots_ns", "direct_ns", "agreements")
        }


class PeerReadError(GroupcoordError):
    """A read of a peer's memory failed (not because the peer died): this rank's
    group is unusable afterwards, as after a timeout."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_READV: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]


def _load_readv() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _READV
    if _READV is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "process_vm_readv", None)
        if fn is None:
            return None
        fn.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        fn.restype = ctypes.c_ssize_t
        _READV = fn
    return _READV


class PeerReads:
    """Copies from the peers' memory, by their pids (set up by :func:`agree_on_peer_reads`)."""

    def __init__(
        self,
        readv: ctypes._CFuncPtr,  # type: ignore[name-defined]
        pids: list[int],
        ranks: list[int],
        what: str,
        cores: int = 1,
    ):
        self._readv = readv
        self.pids = pids
        self.ranks = ranks
        self.what = what
        # The machine's CPU count, the same on every rank (agreed at set-up): with
        # more ranks than cores a read's extra CPU time costs more than it saves.
        self.cores = cores
        # One pair of iovecs reused by every read (a call is never re-entered: the
        # collectives run one at a time per group).
        self._local = _Iovec()
        self._remote = _Iovec()
        self._local_ref = ctypes.byref(self._local)
        self._remote_ref = ctypes.byref(self._remote)
        self.reads_made = 0  # tells which calls read directly (benchmarks/bench_peer_reads.py)

    def read(self, r: int, local: int, remote: int, nbytes: int, operation: str) -> None:
        """Copy ``nbytes`` at address ``remote`` of in-group rank ``r`` to ``local`` here."""
        pid = self.pids[r]
        self.reads_made += 1
        while nbytes > 0:
            self._local.base, self._local.len = local, nbytes
            self._remote.base, self._remote.len = remote, nbytes
            got = self._readv(pid, self._local_ref, 1, self._remote_ref, 1, 0)
            if got <= 0:
                code = ctypes.get_errno() if got < 0 else 0
                # Name every rank that is gone: the peer may have exited (ESRCH), or
                # freed the memory under the read (EFAULT), only because another
                # died first (its own call raised), and the first death is what the
                # caller needs to hear about.
                dead = {self.ranks[i] for i, p in enumerate(self.pids) if not process_alive(p)}
                if code == errno.ESRCH:
                    dead.add(self.ranks[r])
                if dead:
                    raise PeerDiedError(self.what, operation, dead, "peer read")
                raise PeerReadError(
                    f"{self.what}: {operation}: reading {nbytes} bytes at {remote:#x} of rank "
                    f"{self.ranks[r]} (pid {pid}) failed: {os.strerror(code) if code else 'no bytes'}"
                )
            local += got
            remote += got
            nbytes -= got


def agree_on_peer_reads(
    group: ProcessGroup,
    ranks: list[int],
    rank_in_group: int,
    pids: list[int] | None,
    what: str,
    local_reason: str | None,
) -> tuple[PeerReads | None, str | None]:
    """Probe ``process_vm_readv`` between every pair; all ranks agree (collective).

    ``pids``: every rank's pid as this rank sees it, or None when they do not
    compare (other pid namespaces). Returns the reader, or None and why not.
    The same two small all-gathers run on every rank whatever happens locally.
    """
    readv = _load_readv() if local_reason is None else None
    if local_reason is None and readv is None:
        local_reason = "this C library has no process_vm_readv"
    if local_reason is None and pids is None:
        local_reason = "the ranks are in different pid namespaces"
    token = secrets.randbits(62) + 1
    box = ctypes.c_int64(token)
    mine = torch.tensor([ctypes.addressof(box), token, os.cpu_count() or 1], dtype=torch.int64)
    posted = [torch.empty_like(mine) for _ in ranks]
    others = [r for i, r in enumerate(ranks) if i != rank_in_group]
    with gloo_errors(what, "peer-read set-up", group, peers=others):
        group.allgather([posted], [mine]).wait()
    reader: PeerReads | None = None
    if local_reason is None:
        assert readv is not None and pids is not None
        # Every rank posted the same machine's CPU count, or the lowest counts.
        reader = PeerReads(readv, pids, ranks, what, min(int(p[2]) for p in posted))
        for r, (address, expected, _) in enumerate(p.tolist() for p in posted):
            if r == rank_in_group:
                continue
            got = ctypes.c_int64(0)
            try:
                reader.read(r, ctypes.addressof(got), address, 8, "peer-read set-up")
            except GroupcoordError as exc:
                local_reason = f"process_vm_readv is not allowed here ({exc})"
                break
            if got.value != expected:
                local_reason = f"rank {ranks[r]}'s token read back wrong (pids do not match?)"
                break
    ok = torch.tensor([0 if local_reason is None else 1], dtype=torch.int32)
    everyone = [torch.empty_like(ok) for _ in ranks]
    with gloo_errors(what, "peer-read set-up", group, peers=others):
        group.allgather([everyone], [ok]).wait()
    del box  # the peers have read it (the all-gather above is after their reads)
    declined = [ranks[i] for i, t in enumerate(everyone) if int(t.item())]
    if declined:
        return None, local_reason or f"ranks {declined} cannot read their peers"
    return reader, None


def probe_this_machine() -> str | None:
    """Why ranks started here could not read each other's memory, or None when they
    can (for ``groupcoord info``). A forked child reads this process: like a sibling
    rank, it is not this process's ancestor, which Yama's ``ptrace_scope`` 1 asks."""
    readv = _load_readv()
    if readv is None:
        return "this C library has no process_vm_readv"
    token = ctypes.c_int64(secrets.randbits(62) + 1)
    parent = os.getpid()
    into, out = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report one line, then leave without any clean-up
        try:
            reason = ""
            try:
                got = ctypes.c_int64(0)
                reader = PeerReads(readv, [parent], [0], "probe")
                reader.read(0, ctypes.addressof(got), ctypes.addressof(token), 8, "read")
                if got.value != token.value:
                    reason = "the bytes read back differ"
            except GroupcoordError as exc:
                reason = str(exc)
            os.write(out, reason.encode()[:4000] or b"ok")
        finally:
            os._exit(0)  # whatever happened: never back into the caller's code
    os.close(out)
    try:
        answer = os.read(into, 4096).decode(errors="replace")
    finally:
        os.close(into)
        os.waitpid(pid, 0)
    return None if answer == "ok" else answer or "the probe process gave no answer"
