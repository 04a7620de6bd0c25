"""Per-rank control lines in shared memory: phase counters, doorbells, liveness.

The control region of a shared-memory collective holds one 64-byte line per
rank (one cache line, so spinning ranks never share one): an int64 phase
counter only that rank writes, its pid, its pid namespace, an int32 "asleep"
flag and an int32 doorbell (a futex word). A rank *publishes* a phase by
storing its counter; a rank *waits* until every counter has reached a phase:
it yields the core in a loop for a while, then sleeps on its doorbell, which
the next rank to publish rings. Every wait is bounded and, while asleep,
checks that the peers it waits for are alive.

Memory ordering (x86-64 only; callers refuse other machines): stores reach
other cores in program order and loads are not reordered with older loads,
so data stored before a counter is seen by whoever sees the counter. The
sleep/wake handshake also needs StoreLoad order and so a full fence on both
sides (``memory_fence``).
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence

import torch

from shm_broadcast.array_frames import WIRE_DTYPES, dtype_code
from shm_broadcast.liveness import pid_namespace
from shm_broadcast.liveness import process_alive as pid_alive
from shm_broadcast.threads import only_caller
from shm_broadcast.waiting import (
    futex_available,
    futex_wait,
    futex_wake,
    memory_fence,
    wait_until,
)

from .errors import ClosedError, DesyncError, GroupcoordTimeoutError, PeerDiedError, PeerLeftError

LINE = 64
_QWORDS = LINE // 8  # int64 index stride between lines
_DWORDS = LINE // 4  # int32 index stride between lines
# The counter of a rank that left (``PhaseLines.leave``): below every phase, so no
# wait passes on it, and its waiting peers raise PeerLeftError.
_LEFT = -1
_PID = 1  # int64 index within a line
_PIDNS = 3  # int64 index within a line
_ASLEEP = 4  # int32 index within a line (bytes 16..19)
# The asleep word's value while its rank waits past its first sleep and its process
# runs no other thread that could make a call (1 otherwise; ``threads.only_caller``):
# nothing of that process can act until the wait ends (``PhaseLines.waits_alone_at``).
_ASLEEP_ALONE = 3
_BELL = 5  # int32 index within a line (bytes 20..23)
# The fingerprint of the rank's calls: two slots of two int64s (bytes 32..63),
# used by call parity, since a peer can be at most one call ahead of a rank
# that has not checked yet (it cannot pass the next call's first barrier).
# Per slot: operation/dtype/reduce-op/root packed; call number << 53 | another
# thread << 52 | messages << 43 | queue broadcasts << 35 | other groups << 34 |
# count: the call number's low 10 bits only, so the word stays a positive int64
# for ever (a field reaching bit 63 overflowed it and every later call raised);
# whether this rank's one-way calls of the group came from another thread than
# this call's; the low 9 bits of the point-to-point messages this rank sent less
# those it received in the group, the low 8 of the group's message-queue
# broadcasts it made (both ``Traffic``); whether this
# rank's process has other groups (``groups_alive``): none of these is part of
# the call, see _check_agreement; the element count below 2**34.
_FP_SLOTS = (6, 4)  # by call parity: even calls, odd calls
_COUNT_BITS = 34
_COUNT_MASK = (1 << _COUNT_BITS) - 1
_OTHER_GROUPS = 1 << _COUNT_BITS
_QUEUE_SHIFT = _COUNT_BITS + 1
_QUEUE_MASK = 0xFF
_MESSAGES_MASK = 0x1FF
_MESSAGES_SHIFT = _QUEUE_SHIFT + 8
_QUEUE_FIELD = _QUEUE_MASK << _QUEUE_SHIFT
_MESSAGES_FIELD = _MESSAGES_MASK << _MESSAGES_SHIFT
_OTHER_THREAD = 1 << (_MESSAGES_SHIFT + 9)
_TRAFFIC_FIELDS = _QUEUE_FIELD | _MESSAGES_FIELD | _OTHER_THREAD | _OTHER_GROUPS
_CALL_SHIFT = _MESSAGES_SHIFT + 10
_CALL_MASK = (1 << (63 - _CALL_SHIFT)) - 1
# A code with this bit is a call whose ranks may bring different element counts
# (a gather of parts of different lengths, an all_to_all_v): the counts are not
# compared, the rest of the code (a gather's: with a checksum of the parts'
# layout) is.
VARYING_COUNTS = 1 << 48
# A call whose ranks read each other's memory (``peer_reads.TimedWays`` picks the
# way per call): ranks whose ways ever differed raise, never read garbage.
READ_DIRECTLY = 1 << 49

# A call whose result reads every rank's tensor in this rank's shape (a
# ``GroupCoordinator`` all-gather, gather or reduce-scatter, whose contract is
# "equally shaped"): a 13-bit checksum of the shape laid out in the slots (and of the
# dim a reduce-scatter moved to the front) above the other fields, so ranks whose
# shapes differ but whose element counts match raise instead of returning each
# other's elements in the wrong places. 0 for a 1-D layout (the count says it all)
# and for a flat call (a ``Comm``'s: torch's semantics need only the counts).
LAYOUT_SHIFT = 50
_LAYOUT_BITS = 0x1FFF
LAYOUT_MASK = _LAYOUT_BITS << LAYOUT_SHIFT
_LAYOUT_CODES: dict[tuple[tuple[int, ...], int], int] = {}
_SIZES_CHECKSUMS: dict[tuple[int, ...], int] = {}

OPERATIONS = (
    "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "reduce", "gather",
    "all_to_all", "scatter", "all_to_all_v", "queue", "elsewhere",
)  # fmt: skip
# A group's calls through its message queue and its point-to-point channels: a rank
# stuck in one on peers that wait for it in a collective stamps ``queue_code``
# (``ShmBase.check_queue_wait``).
QUEUE_CALLS = (
    "broadcast_object", "broadcast_tensor_dict", "recv_object", "recv_tensor_dict", "recv",
    "send_object", "send_tensor_dict", "send",
)  # fmt: skip
_WRITING = 0x100  # in a queue call's reduce-op field: the writer's side
_REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "PREMUL_SUM")


# Codes already made (every call stamps one; a few kinds of calls repeat).
_CALL_CODES: dict[tuple[str, torch.dtype | None, object, int], int] = {}


def call_code(operation: str, dtype: torch.dtype | None, reduce_op: object, root: int) -> int:
    """Operation, dtype, reduce op and root of a call, packed into one int64."""
    key = (operation, dtype, reduce_op, root)
    try:
        code = _CALL_CODES.get(key)
    except TypeError:  # an operator object that cannot be hashed: not cached
        return _make_code(operation, dtype, reduce_op, root)
    if code is None:
        code = _make_code(operation, dtype, reduce_op, root)
        if len(_CALL_CODES) < 4096:
            _CALL_CODES[key] = code
    return code


def _make_code(operation: str, dtype: torch.dtype | None, reduce_op: object, root: int) -> int:
    op_name = str(reduce_op).rsplit(".", 1)[-1].upper() if reduce_op is not None else ""
    op_code = _REDUCE_OPS.index(op_name) + 1 if op_name in _REDUCE_OPS else 0
    return (
        (OPERATIONS.index(operation) << 40)
        | ((dtype_code(dtype) + 1 if dtype is not None else 0) << 32)
        | (op_code << 16)
        | (root & 0xFFFF)
    )


def queue_code(operation: str, peer: int, writing: bool) -> int:
    """The fingerprint of ``operation`` (one of ``QUEUE_CALLS``) waiting in a message
    queue or channel, to write (``writing``) or to read: ``peer`` is the in-group
    rank of the queue's writer (a broadcast's, a receive's source) or, for a send,
    the receiver."""
    field = QUEUE_CALLS.index(operation) | (_WRITING if writing else 0)
    return call_code("queue", None, None, peer) | (field << 16)


_QUEUE_OPERATION = OPERATIONS.index("queue")


def _stands_in(code: int) -> bool:
    """Whether ``code`` is a ``queue_code``: a rank stuck in a one-way call that
    joined its peers' collective in its place."""
    return (code >> 40) & 0xFF == _QUEUE_OPERATION


def elsewhere_code(waiting: int) -> int:
    """The fingerprint a rank stamps in this group when it joins its call from a call
    of another group that waits for a peer stuck here (``ShmBase``'s crossed-wait
    check): that call's operation and dtype (``waiting``: its code). Ranks joining
    from the same call stamp alike, so a rank's error names the call it differs
    from; the join moves no data, so joiners that meet only each other harm nothing."""
    operation = (waiting >> 40) & 0xFF
    return (OPERATIONS.index("elsewhere") << 40) | (waiting & (0xFF << 32)) | (operation << 16)


def layout_code(shape: Sequence[int], dim: int = 0) -> int:
    """The fingerprint's layout field for a tensor of ``shape`` laid out in the slots
    as it is (``dim`` 0) or with ``dim`` moved to the front (see ``LAYOUT_SHIFT``)."""
    if len(shape) <= 1 and dim == 0:
        return 0
    key = (tuple(shape), dim)
    code = _LAYOUT_CODES.get(key)
    if code is None:
        code = (zlib.crc32(repr(key).encode()) % _LAYOUT_BITS + 1) << LAYOUT_SHIFT
        if len(_LAYOUT_CODES) < 4096:
            _LAYOUT_CODES[key] = code
    return code


def varying_gather_code(dtype: torch.dtype, dst: int, layout: str) -> int:
    """A gather to in-group rank ``dst`` (-1: an all-gather) whose parts may differ in
    length along one dim: the ranks' ``layout`` (the dim and every other dim) must
    agree, as a 16-bit checksum in the reduce-op field; their element counts need not.
    An all-gather whose caller gave every part's length stamps them too, as
    ``sizes_checksum`` in the root field (``SmallCalls.gather_v``)."""
    checksum = zlib.crc32(layout.encode()) & 0xFFFF
    base = (
        call_code("all_gather", dtype, None, 0)
        if dst < 0
        else call_code("gather", dtype, None, dst)
    )
    return base | VARYING_COUNTS | (checksum << 16)


def sizes_checksum(sizes: Sequence[int]) -> int:
    """A 16-bit checksum of a list of sizes, never 0 (the root field of a fingerprint;
    cached: 0.2 us a call against 1 us to compute)."""
    key = tuple(sizes)
    checksum = _SIZES_CHECKSUMS.get(key)
    if checksum is None:
        checksum = zlib.crc32(",".join(map(str, key)).encode()) % 0xFFFF + 1
        if len(_SIZES_CHECKSUMS) < 4096:
            _SIZES_CHECKSUMS[key] = checksum
    return checksum


def split_code(sizes: list[int]) -> int:
    """A reduce-scatter's cut of its rows among the ranks, as the 16-bit root field
    of its fingerprint: 0 for equal parts (the cut every plain reduce-scatter makes),
    else a checksum of the sizes (never 0)."""
    if all(n == sizes[0] for n in sizes):
        return 0
    return sizes_checksum(sizes)


def check_all_to_all_counts(what: str, table: list[list[int]]) -> None:
    """Raise ``DesyncError`` naming the first pair of ranks that disagree in ``table``
    (row ``r``: the elements rank ``r`` sends to each rank, then those it expects
    from each): the same table on every rank, so every rank raises."""
    world = len(table)
    for r in range(world):
        for q in range(world):
            if table[r][q] != table[q][world + r]:
                raise DesyncError(
                    f"{what}: all_to_all_v: rank {r} sends {table[r][q]} elements to "
                    f"rank {q}, which expects {table[q][world + r]} from it"
                )


class Traffic:
    """A group's one-way calls on this rank, which its call stamps carry: the
    broadcasts through its message queue this rank wrote or read, and the
    point-to-point messages it sent in the group less those it took. Neither waits
    for the other side, so a rank whose broadcast or send met another call there
    would make the group's next calls pair one rank's call with another's next one:
    at every collective the ranks' counts must show every broadcast read and every
    message taken (``PhaseLines._check_agreement``; Gloo's ``debug_desync`` check
    reads the counts here too). A ``Comm`` counts its sends and receives here too,
    as it posts them (``coordinator/comm/p2p_lanes.py``)."""

    __slots__ = ("queue_calls", "messages", "thread", "bits", "_lock")

    def __init__(self) -> None:
        self.queue_calls = 0
        self.messages = 0
        self.thread = 0  # the thread of the last of them
        self.bits = 0  # their low bits, as the stamps carry them
        self._lock = threading.Lock()  # count_message: a Comm's threads

    def count_queue_call(self) -> None:
        """A broadcast through the group's message queue, written or read here."""
        self.queue_calls += 1
        self._update()

    def count_message(self, sent: bool) -> None:
        """A point-to-point call sent a message to a peer of the group (``sent``), or
        took one from a peer (a receive that refuses what came has taken it; one
        that raised before anything came has not). Under the lock: a ``Comm``'s
        threads may count at once."""
        with self._lock:
            self.messages += 1 if sent else -1
            self._update()

    def unordered(self) -> bool:
        """Whether this rank's traffic may fall on either side of a collective this
        thread makes now: the last one-way call was made on another thread (the
        stamps' ``_OTHER_THREAD``)."""
        return bool(self.bits) and self.thread != threading.get_ident()

    def _update(self) -> None:
        self.thread = threading.get_ident()
        self.bits = ((self.queue_calls & _QUEUE_MASK) << _QUEUE_SHIFT) | (
            (self.messages & _MESSAGES_MASK) << _MESSAGES_SHIFT
        )


# _OTHER_GROUPS while this process has more than one group (``groups_alive``).
_other_groups = 0


def groups_alive(count: int) -> None:
    """This process now has ``count`` groups (``GroupCoordinator``): with more than
    one, a rank may call another group's collective where its peers call one of
    this group's, which leaves this group's calls a whole call apart, so the
    stamps say so and a mismatch closes the group (``PhaseLines._check_agreement``)."""
    global _other_groups
    _other_groups = _OTHER_GROUPS if count > 1 else 0


def sent_after_its_stamp(reads_ahead: int, in_flight: int) -> bool:
    """Whether the traffic a call's stamps carry shows a one-way call made after
    its sender's stamp: a reader that had read more of the group's queue
    broadcasts than the queue's writer (in-group rank 0) had written
    (``reads_ahead`` > 0), or more point-to-point messages taken than sent
    (``in_flight``, their sum of sent less taken, < 0). Only a call made on
    another thread than the stamping one does that, where that rank had made no
    one-way call before to mark it (``_OTHER_THREAD``): it may fall on either
    side of this collective, so the traffic tells nothing, as with that mark."""
    return reads_ahead > 0 or in_flight < 0


def _signed(value: int, mask: int) -> int:
    """A difference of counts kept modulo ``mask + 1``, as a signed number."""
    value &= mask
    return value - (mask + 1) if value > mask // 2 else value


def closing_reason(
    what: str,
    queue: tuple[int, int, int] | None,
    sent: dict[int, int] | None,
    elsewhere: list[int] | None = None,
    stood_in: list[int] | None = None,
) -> str | None:
    """Why group ``what`` closes on every rank after a call's stamps (``PhaseLines.
    _check_agreement``, and Gloo's ``debug_desync`` check), or None: ``queue``, (a
    rank, another, how many more broadcasts the first made through the group's
    message queue); ``sent``, each rank's point-to-point messages sent in the group
    less those it took, when they do not add up to 0; ``elsewhere``, where the
    ranks' calls differ (None where they agree), the ranks whose processes have
    other groups; ``stood_in``, the ranks that joined the call from a one-way
    call they were stuck in (``queue_code``).

    Calls that differ always close the group: no rank can tell one call made in
    place of another (after which the ranks' next calls pair as meant) from a
    call one rank skipped or made once more (after which every call pairs with
    the peers' next one, and same-shaped ones return each other's data). Until
    2026-11-29 only ranks with other groups closed it: a Comm of three ranks, one
    of which skipped an all_reduce, raised DesyncError at the next two calls and
    then returned wrong sums at the third (a sweep of world 3)."""
    reasons = []
    if stood_in:
        reasons.append(
            f"rank(s) {stood_in} waited in a one-way call that its peer met with a "
            "collective, so one side made a call the other did not make (a receive "
            "too many, a send too few, or one half of a batch matched)"
        )
    if queue is not None:
        more, fewer, ahead = queue
        reasons.append(
            f"before this call rank {more} had made {ahead} more broadcast(s) through "
            f"the group's message queue than rank {fewer}"
        )
    if sent is not None:
        counts = ", ".join(f"rank {r} {n:+d}" for r, n in sent.items())
        reasons.append(
            f"before this call {sum(sent.values())} point-to-point message(s) sent in "
            f"the group had not been received (sent less received: {counts})"
        )
    if reasons:
        reasons[-1] += (
            ": a one-way call met another call on the other side, or is to be read "
            "only after this call"
        )
    if elsewhere is not None:
        reasons.append(
            "the ranks' calls differ, and a rank may have skipped a call or made one "
            "more, not one in place of another"
            + (
                f" (rank(s) {elsewhere} have other groups, where one may have made a call "
                "in place of one of this group's, or the other way round)"
                if elsewhere
                else ""
            )
        )
    if not reasons:
        return None
    return (
        f"{'; '.join(reasons)}; so the ranks' calls may be out of step by whole calls, "
        f"which same-shaped calls would not show: {what} is closed on every rank "
        "(create it anew)"
    )


def _describe_stamp(stamp: tuple[int, int], near: int) -> str:
    """The call of a stamp, numbered as the call nearest ``near`` (this rank's call
    number) whose low bits the stamp holds."""
    code, word = stamp
    count = word & _COUNT_MASK
    offset = ((word >> _CALL_SHIFT) - near) & _CALL_MASK
    if offset > _CALL_MASK // 2:
        offset -= _CALL_MASK + 1
    return f"{describe_call(code, count)} as call #{near + offset}"


def describe_call(code: int, count: int) -> str:
    """E.g. ``all_reduce(float32[4096], SUM)``, ``broadcast(uint8[100], src=1)``,
    ``all_gather(float32[32], shape #01c4)`` or ``all_gather(float32[300000]) read
    directly``."""
    operation = OPERATIONS[(code >> 40) & 0xFF]
    wire = (code >> 32) & 0xFF  # the dtype's code in the wire table, plus one
    dtype = WIRE_DTYPES[wire - 1] if wire else "none"
    op_code, root = (code >> 16) & 0xFFFF, code & 0xFFFF
    extra = ""
    if operation == "barrier":
        return "barrier()"
    if operation == "elsewhere":
        other = OPERATIONS[op_code]
        call = "barrier()" if other == "barrier" else f"{other}({dtype}[{count}])"
        return f"{call} in another group, waiting there for a rank of this one"
    if operation == "queue":
        name = QUEUE_CALLS[op_code & 0xFF]
        if name.startswith("recv"):
            return f"{name}(src={root}) waiting on its shared-memory channel"
        if name.startswith("send"):
            return f"{name}(dst={root}) waiting for room in its shared-memory channel"
        way = "writing" if op_code & _WRITING else "reading"
        return f"{name}(src={root}) {way} the message queue"
    if operation in ("all_reduce", "reduce_scatter", "reduce"):
        extra = f", {_REDUCE_OPS[op_code - 1] if op_code else 'op?'}"
        if operation == "reduce":
            extra += f", dst={root}"
        elif root:  # a reduce-scatter's split_code
            extra += f", sizes #{root:04x}"
    elif operation in ("broadcast", "scatter"):
        extra = f", src={root}"
    elif operation == "gather":
        extra = f", dst={root}"
    layout = (code >> LAYOUT_SHIFT) & _LAYOUT_BITS
    if layout:
        extra += f", shape #{layout:04x}"
    way = " read directly" if code & READ_DIRECTLY else ""
    if code & VARYING_COUNTS and operation != "all_to_all_v":
        # A gather's parts' layout (dim, other dims) as a checksum.
        if operation == "all_gather" and root:  # the lengths the caller gave
            extra += f", sizes #{root:04x}"
        return f"{operation}({dtype}[{count}]{extra}){way} of parts laid out #{op_code:04x}"
    return f"{operation}({dtype}[{count}]{extra}){way}"


# A waiter yields the core in a loop this long, then sleeps on its doorbell.
# Waking a sleeper costs 0.1-2 ms on a VM (the idle vCPU must be rescheduled
# by the host), so sleeping is for long waits only: 20 us here doubled the
# 4 KiB latency at world 4 on 2 cores, 1 ms matched pure yielding.
SPIN_BEFORE_SLEEP_S = 1e-3


class PhaseLines:
    """The control lines of one group, mapped from ``region`` (``world_size`` lines)."""

    def __init__(
        self,
        region: memoryview,
        ranks: list[int],
        rank_in_group: int,
        what: str,
        timeout_s: float,
        peer_check_interval_s: float,
    ) -> None:
        self.ranks = ranks
        self.world_size = len(ranks)
        self.rank_in_group = rank_in_group
        self.what = what
        self.timeout_s = timeout_s
        # An absolute deadline (time.monotonic()) for every wait, instead of
        # timeout_s from each wait's start: a caller whose operation has its own.
        self.deadline: float | None = None
        self.peer_check_interval_s = peer_check_interval_s
        # memoryview indexing is the cheapest load Python has (about 50 ns)
        # and reads memory on every access.
        self._counters = region[: self.world_size * LINE].cast("q")
        self._words = region[: self.world_size * LINE].cast("i")
        self._address_holder: torch.Tensor | None = torch.frombuffer(
            region, dtype=torch.uint8, count=self.world_size * LINE
        )
        self._address = self._address_holder.data_ptr()
        self._counter_index = [r * _QWORDS for r in range(self.world_size)]
        self._my_counter = rank_in_group * _QWORDS
        self._other_counters = [r * _QWORDS for r in range(self.world_size) if r != rank_in_group]
        self._others = [r for r in range(self.world_size) if r != rank_in_group]
        self.use_futex = futex_available()
        self.spin_s = SPIN_BEFORE_SLEEP_S
        self.pids: list[int] = []
        self.pid_checks = False
        # Named in timeout / peer-death errors; set by the caller per call.
        self.operation = ""
        self.generation = 0
        self.calls = 0  # calls stamped so far (the same on every rank while in step)
        # The group's one-way traffic on this rank, which every stamp carries (the
        # owner group's own, once it hands it over: ShmBase.set_traffic).
        self.traffic = Traffic()
        # Called when the ranks' calls are found out of step, before the DesyncError
        # (every rank raises it), with why the group closes (None: it stays usable):
        # the group's clean-up, returning a note for the message (``GroupCoordinator``
        # drops queue broadcasts its rank never read, and closes itself).
        self.on_desync: Callable[[str | None], str] | None = None
        # Called after that, on every rank, when the ranks' calls can no longer be
        # brought back in step, with the error's message: the owner closes its path.
        self.on_close: Callable[[str], None] | None = None
        # Set from another thread (an abort): the wait in progress ends with ClosedError.
        self.abandoned: str | None = None
        # Run with the liveness check of a long wait (the owner's crossed-wait check,
        # a module function: no cycle through the owner); may raise.
        self.crossed_check: Callable[[PhaseLines, int], None] | None = None
        # For a timed-out wait at a phase: where the ranks it needed wait instead, as
        # the owner's other groups show ("" when unknown; a module function too).
        self.locate_peers: Callable[[PhaseLines, int], str] | None = None
        self._check_pending = False
        self._my_stamp = [rank_in_group * _QWORDS + slot for slot in _FP_SLOTS]
        self._peer_stamps = [[r * _QWORDS + slot for r in self._others] for slot in _FP_SLOTS]

    @staticmethod
    def nbytes(world_size: int) -> int:
        return world_size * LINE

    def register_self(self) -> None:
        """Write this rank's pid and pid namespace (before the set-up collective)."""
        base = self.rank_in_group * _QWORDS
        self._counters[base + _PID] = os.getpid()
        self._counters[base + _PIDNS] = pid_namespace()

    def read_peers(self) -> None:
        """Read every rank's pid (after the set-up collective made them visible)."""
        self.pids = [self._counters[r * _QWORDS + _PID] for r in range(self.world_size)]
        # Ranks in other pid namespaces (containers sharing /dev/shm) show pids
        # we cannot see: then only the timeout can tell a dead peer, never a
        # false "peer died".
        namespaces = {self._counters[r * _QWORDS + _PIDNS] for r in range(self.world_size)}
        self.pid_checks = len(namespaces) == 1 and 0 not in namespaces

    def abandon(self, reason: str) -> None:
        """End this rank's wait in progress, if any, from another thread: it raises
        ``ClosedError`` naming ``reason`` within one sleep (the doorbell is rung)."""
        self.abandoned = reason
        if self.use_futex:
            me = self.rank_in_group
            self._words[me * _DWORDS + _BELL] = (self._words[me * _DWORDS + _BELL] + 1) & 0x7FFFFFFF
            futex_wake(self._bell_address(me))

    def leave(self) -> None:
        """This rank takes part in no call again (a call of its own ended part-way:
        its peers may be waiting at a barrier it will never reach, or about to
        read a buffer it no longer holds). Its counter becomes ``_LEFT`` and every
        doorbell rings, so each peer's wait on it raises ``PeerLeftError`` at once
        instead of passing on a later call's phase or running to its timeout."""
        self._counters[self._my_counter] = _LEFT
        if self.use_futex:
            memory_fence()
            words = self._words
            for r in self._others:
                bell = r * _DWORDS + _BELL
                words[bell] = (words[bell] + 1) & 0x7FFFFFFF
                futex_wake(self._bell_address(r))

    def release(self) -> None:
        """Drop the views into the mapping (it cannot be unmapped while they live)."""
        self._counters.release()
        self._words.release()
        self._address_holder = None

    # ---- the call's fingerprint -------------------------------------------------------

    def stamp(self, code: int, count: int) -> None:
        """Record this rank's call before its first publish; checked after the first wait."""
        self.calls = calls = self.calls + 1
        at = self._my_stamp[calls & 1]
        counters = self._counters
        counters[at] = code
        traffic = self.traffic
        bits = traffic.bits
        if bits and traffic.thread != threading.get_ident():
            bits |= _OTHER_THREAD
        counters[at + 1] = ((calls & _CALL_MASK) << _CALL_SHIFT) | bits | _other_groups | count
        self._check_pending = True

    def _check_agreement(self, phase: int, code: int, word: int) -> None:
        """A peer's stamp differs from this rank's (``code``, ``word``) after the
        call's first barrier (``phase``), when every rank's is visible (stored before
        its counter). Every rank sees the same stamps, so every rank decides alike.

        The ranks' calls differ (the counts may, where the call lets them): the call
        fails everywhere. With an ``on_desync`` hook each rank runs it, then meets
        the others once more (``phase + 1``, which no call of this generation
        reaches), so no rank goes on before every rank's clean-up is done. The
        group stays usable, unless a rank's process has other groups
        (``groups_alive``): a rank that called another group's collective in place
        of this one's (or this one's in place of another's) left this group's calls
        a whole call apart, same-shaped calls after it would pair one rank's call
        with another's next one, and no rank can tell, so the group closes.

        The traffic before the call is out of balance, whatever the calls: a rank
        made more broadcasts through the group's message queue than another, or a
        point-to-point message sent in the group was not received (the ranks'
        counts of sent less received do not add up to 0). A one-way call (a
        broadcast's writer, a send) then met another call on the other side, or is
        read only after this call. The first can make a rank's next calls pair with
        the others' previous ones (same-shaped calls would return each other's
        data), and no rank can tell the two apart, so the group closes on every
        rank (``on_close``), naming why: every message sent in a group is received,
        every broadcast read, before the group's next collective. Not while the
        calls agree where a rank's last one-way call came from another thread than
        this call's, or the counts show one made after its sender's stamp
        (``sent_after_its_stamp``): that call may come before or after this one.

        A rank stuck in a one-way call that joined this call in its place
        (``queue_code``, ``ShmBase.check_queue_wait``) closes the group too: one
        side made a call the other did not (a receive too many, a send too few,
        half a batch matched), and no rank can tell which."""
        counters = self._counters
        peers = self._peer_stamps[self.calls & 1]
        # The common difference first: the same call, message counts that differ
        # by rank (one sent, another received) and add up to 0.
        total = word >> _MESSAGES_SHIFT
        for at in peers:
            theirs = counters[at + 1]
            if counters[at] != code or (theirs ^ word) & ~_MESSAGES_FIELD:
                break
            total += theirs >> _MESSAGES_SHIFT
        else:
            if not total & _MESSAGES_MASK:
                return
        differs = -1  # the first peer whose call is another
        queue_split = -1  # the first peer whose queue broadcasts differ in number
        balances = {self.rank_in_group: (word >> _MESSAGES_SHIFT) & _MESSAGES_MASK}
        threads = word & _OTHER_THREAD
        elsewhere = [self.rank_in_group] if word & _OTHER_GROUPS else []
        for at in peers:
            theirs, their_word = counters[at], counters[at + 1]
            apart = their_word ^ word
            balances[at // _QWORDS] = (their_word >> _MESSAGES_SHIFT) & _MESSAGES_MASK
            threads |= their_word & _OTHER_THREAD
            if their_word & _OTHER_GROUPS:
                elsewhere.append(at // _QWORDS)
            if apart & _QUEUE_FIELD and queue_split < 0:
                queue_split = at
            if theirs == code and (
                not apart & ~_TRAFFIC_FIELDS or (code & VARYING_COUNTS and not apart >> _CALL_SHIFT)
            ):
                continue  # the same call
            if differs < 0:
                differs = at
        in_flight = sum(balances.values()) & _MESSAGES_MASK
        written = counters[_FP_SLOTS[self.calls & 1] + 1] >> _QUEUE_SHIFT  # by rank 0
        reads_ahead = max(
            _signed((counters[at + 1] >> _QUEUE_SHIFT) - written, _QUEUE_MASK)
            for at in (*peers, self._my_stamp[self.calls & 1])
        )
        if sent_after_its_stamp(reads_ahead, _signed(in_flight, _MESSAGES_MASK)):
            threads = _OTHER_THREAD
        if differs < 0 and (threads or (queue_split < 0 and not in_flight)):
            # Every one-way call's message taken; or a rank made one from another
            # thread than this call's, which may have come before or after this
            # call there: the traffic tells nothing, as long as the calls agree.
            return
        me = self.ranks[self.rank_in_group]
        mine = _describe_stamp((code, word), self.calls)
        if differs >= 0:
            message = (
                f"{self.what}: rank {me} called {mine}, rank {self.ranks[differs // _QWORDS]} "
                f"called {_describe_stamp((counters[differs], counters[differs + 1]), self.calls)}: "
                "the ranks' collectives are out of step (no result returned)"
            )
        else:
            message = f"{self.what}: every rank called {mine} (no result returned)"
        queue = None
        if queue_split >= 0:
            ahead = _signed(
                (counters[queue_split + 1] >> _QUEUE_SHIFT) - (word >> _QUEUE_SHIFT), _QUEUE_MASK
            )
            other = self.ranks[queue_split // _QWORDS]
            queue = (other, me, ahead) if ahead > 0 else (me, other, -ahead)
        sent = {self.ranks[r]: _signed(b, _MESSAGES_MASK) for r, b in sorted(balances.items())}
        others = [self.ranks[r] for r in sorted(elsewhere)] if differs >= 0 else None
        if differs >= 0 and all(
            not (counters[at] ^ code) & ~READ_DIRECTLY
            and not (counters[at + 1] ^ word) & ~_TRAFFIC_FIELDS
            for at in peers
        ):
            others = None  # one call made two ways (slots, direct reads): in step
        stood_in = [
            self.ranks[r]
            for r in range(self.world_size)
            if _stands_in(self.stamp_of(r, self.calls)[0])
        ]
        closing = closing_reason(self.what, queue, sent if in_flight else None, others, stood_in)
        if closing is not None:
            message = f"{message}; {closing}"
        note = ""
        if self.on_desync is not None or closing is not None:
            if self.on_desync is not None:
                note = self.on_desync(message if closing is not None else None)
            self.arrive(phase + 1)
        if closing is not None and self.on_close is not None:
            self.on_close(message)
        raise DesyncError(message + note)

    def current_stamp(self) -> tuple[int, int]:
        """This rank's stamp of its current call: (code, element count)."""
        return self.stamp_of(self.rank_in_group, self.calls)

    def stamp_of(self, r: int, call: int) -> tuple[int, int]:
        """In-group rank ``r``'s stamp of its call number ``call`` (this rank's
        current call or the next): (code, element count)."""
        at = r * _QWORDS + _FP_SLOTS[call & 1]
        return self._counters[at], self._counters[at + 1] & _COUNT_MASK

    def phase_of(self, r: int) -> int:
        """In-group rank ``r``'s counter: the last phase it published."""
        return self._counters[r * _QWORDS]

    def counts(self) -> list[int]:
        """Every rank's element count in the current call's stamp (after its first
        barrier), in rank order."""
        counters, slot = self._counters, _FP_SLOTS[self.calls & 1] + 1
        return [counters[r * _QWORDS + slot] & _COUNT_MASK for r in range(self.world_size)]

    # ---- publish and wait ---------------------------------------------------------

    def all_reached(self, phase: int) -> bool:
        counters = self._counters
        for i in self._counter_index:
            if counters[i] < phase:
                return False
        return True

    def arrive(self, phase: int) -> None:
        """Publish ``phase`` (waking any peer asleep on its doorbell), then wait until
        every rank's counter reaches it: yield-spin, then sleep. The first barrier of
        a call then checks that every rank made the same call. One flat method: every
        shared-memory collective runs it once or twice."""
        counters = self._counters
        counters[self._my_counter] = phase
        if self.use_futex:
            memory_fence()  # the counter store must be visible before we read "asleep"
            words = self._words
            for r in self._others:
                if words[r * _DWORDS + _ASLEEP]:
                    bell = r * _DWORDS + _BELL
                    words[bell] = (words[bell] + 1) & 0x7FFFFFFF
                    futex_wake(self._bell_address(r))
        for i in self._other_counters:
            if counters[i] < phase:
                self._wait_all(phase)
                break
        if self._check_pending:  # the call's first barrier: every rank's stamp is visible
            self._check_pending = False
            parity = self.calls & 1
            me = self._my_stamp[parity]
            code, word = counters[me], counters[me + 1]
            for at in self._peer_stamps[parity]:
                if counters[at] != code or counters[at + 1] != word:
                    self._check_agreement(phase, code, word)
                    break

    def _wait_all(self, phase: int) -> None:
        if self.all_reached(phase):
            return
        deadline = time.monotonic() + self.timeout_s if self.deadline is None else self.deadline
        try:
            self._wait_until(phase, deadline)
        finally:
            # Set by the wait's first sleep and kept between its sleeps (_sleep).
            self._words[self.rank_in_group * _DWORDS + _ASLEEP] = 0

    def _wait_until(self, phase: int, deadline: float) -> None:
        wait_until(
            lambda: self.all_reached(phase),
            deadline,
            quick_check=lambda: self._quick_check(phase),
            slow_check=lambda: self._slow_check(phase),
            on_timeout=lambda: GroupcoordTimeoutError(
                self.what,
                self.operation,
                self.timeout_s,
                missing=self.behind(phase),
                role=f"rank {self.ranks[self.rank_in_group]}",
                detail=f"shared-memory path, generation {self.generation}"
                + (self.locate_peers(self, phase) if self.locate_peers is not None else ""),
            ),
            sleep=lambda at_most_s: self._sleep(phase, at_most_s),
            spin_s=self.spin_s,
        )

    def _quick_check(self, phase: int) -> None:
        """End the wait if it was abandoned from another thread, or if every rank it
        still waits for left (while one that has not is due, the wait goes on: a
        timeout then names it, not a rank that gave up on it first)."""
        if self.abandoned is not None:
            raise ClosedError(f"{self.what}: {self.operation} {self.abandoned}")
        counters = self._counters
        left = False
        for i in self._other_counters:
            counter = counters[i]
            if counter == _LEFT:
                left = True
            elif counter < phase:
                return
        if left:
            # A rank leaves when its own call failed, most often because another
            # rank died: that death, when there is one, is what the caller needs to
            # hear (a rank that published this phase and then died is not waited
            # for, so the rank that left may be the only one this wait sees). A
            # rank that left and then exited left first: it is named as such.
            dead = [
                self.ranks[r]
                for r in self._others
                if self.pid_checks
                and counters[r * _QWORDS] != _LEFT
                and not pid_alive(self.pids[r])
            ]
            if dead:
                raise PeerDiedError(
                    self.what,
                    self.operation,
                    dead,
                    detail=f"shared-memory path, generation {self.generation}",
                )
            raise PeerLeftError(
                self.what,
                self.operation,
                [self.ranks[r] for r in self._others if counters[r * _QWORDS] == _LEFT],
                detail=f"shared-memory path, generation {self.generation}",
            )

    def behind(self, phase: int) -> list[int]:
        """Global ranks whose counter has not reached ``phase`` (and that did not leave)."""
        counters = [self._counters[r * _QWORDS] for r in range(self.world_size)]
        return [self.ranks[r] for r, c in enumerate(counters) if c < phase and c != _LEFT]

    def _sleep(self, phase: int, at_most_s: float) -> None:
        """Sleep until a peer rings this rank's doorbell (or ``at_most_s`` passes).

        The asleep word stays set between the sleeps of one wait (``_wait_all``
        clears it when the wait ends): a peer that arrives meanwhile rings a bell
        nobody sleeps on (harmless), and a peer looking for a rank that waits alone
        (``waits_alone_at``) finds it so at any time, not only between the wake-ups
        that would otherwise keep time with its own checks (both wake every
        ``peer_check_interval_s`` from about the same start: a reader's check met
        the writer awake for 29 s in a row once)."""
        if not self.use_futex:
            time.sleep(min(at_most_s, 0.0002))
            return
        words = self._words
        me = self.rank_in_group
        bell = words[me * _DWORDS + _BELL]  # read before re-checking: a ring after it wakes us
        words[me * _DWORDS + _ASLEEP] = _ASLEEP_ALONE if only_caller() else 1
        memory_fence()  # "asleep" must be visible before we read the counters
        if not self.all_reached(phase):
            futex_wait(self._bell_address(me), bell, max(at_most_s, 1e-4))

    def waits_alone_at(self, r: int, phase: int) -> bool:
        """In-group rank ``r`` has published ``phase`` and waits for the others past
        its first sleep, with no other thread in its process that could make a call
        (``threads.only_caller``; so nothing of it acts until that wait ends)."""
        return self.phase_of(r) == phase and self._words[r * _DWORDS + _ASLEEP] == _ASLEEP_ALONE

    def _bell_address(self, r: int) -> int:
        return self._address + r * LINE + _BELL * 4

    def _slow_check(self, phase: int) -> None:
        self._check_peers_alive(phase)
        if self.crossed_check is not None:
            self.crossed_check(self, phase)

    def _check_peers_alive(self, phase: int) -> None:
        if not self.pid_checks:
            return
        blocking = [
            r
            for r in range(self.world_size)
            if self._counters[r * _QWORDS] < phase and not pid_alive(self.pids[r])
        ]
        if blocking:
            # Every rank that is gone, not only those this wait needs: a rank that
            # arrived and then died may be why another one left (its call raised),
            # and that first death is what the caller needs to hear about.
            dead = [
                self.ranks[r]
                for r in range(self.world_size)
                if r in blocking or (r != self.rank_in_group and not pid_alive(self.pids[r]))
            ]
            raise PeerDiedError(
                self.what,
                self.operation,
                dead,
                detail=f"shared-memory path, generation {self.generation}",
            )
