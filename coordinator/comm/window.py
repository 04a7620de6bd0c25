"""One-sided windows over shared memory for the ranks of a communicator on one node.

Each rank's window is one ``ShmSegment``: ``size`` 8-byte signal counters
(slot ``s`` is written only by rank ``s``), ``signal_size`` 8-byte value slots
for the older value-based API, then the data, 64-byte aligned. Registration is
collective: segment names travel as msgspec msgpack over the comm (no pickle),
every rank maps every peer's segment, the ranks confirm, and then each creator
unlinks its own name at once: the mappings stay valid, and nothing can be left
in /dev/shm even if a rank is killed later.

Memory ordering of ``put`` then ``signal`` against the peer's ``wait_signal``:
the put is a ``copy_`` (C memcpy) that returns before the signal's 8-byte
aligned store is executed by a later bytecode; both are opaque C calls the
compiler cannot reorder. On x86-64 (TSO) stores become visible in program
order and loads are not reordered with older loads, so a reader that sees the
new counter also sees the data. On weaker machines (Arm, POWER) we issue
``shm_broadcast.waiting.memory_fence`` (``atomic_thread_fence(seq_cst)``) after
the data and before the signal store, and after the signal load before the
caller reads the data. Counters only grow and each has one writer, so no
atomic read-modify-write is needed; value slots are plain 8-byte stores
(last writer wins).
"""

from __future__ import annotations

import datetime
import enum
import math
import operator
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from device_communicators import checks
from shm_broadcast import codec
from shm_broadcast.config import get_config
from shm_broadcast.liveness import dead_peers
from shm_broadcast.segments import ShmSegment
from shm_broadcast.waiting import memory_fence, needs_fence, wait_until

from ..errors import (
    BackendUnavailableError,
    ClosedError,
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
    PeerDiedError,
)
from . import bytes_io
from .core import timeout_seconds
from .ops import CommOps
from .work import Work

_ALIGN = 64


class SignalCmpOp(enum.Enum):
    """How ``Window.wait_signal`` compares a signal slot with the value (torchcomms'
    ``SignalCmpOp``); the lower-case names (``"eq"``, ...) are accepted too."""

    EQ = "eq"
    NE = "ne"
    GE = "ge"
    GT = "gt"
    LE = "le"
    LT = "lt"


_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "ge": operator.ge,
    "gt": operator.gt,
    "le": operator.le,
    "lt": operator.lt,
}


class _SegmentInfo(msgspec.Struct, frozen=True):
    name: str
    pid: int
    data_nbytes: int
    signal_size: int
    dtype: str


class _Mapped:
    """One rank's segment as this process sees it."""

    def __init__(self, segment: ShmSegment, info: _SegmentInfo, size: int) -> None:
        self.segment = segment
        self.info = info
        header = _header_bytes(size, info.signal_size)
        self.counters = segment.buf[: 8 * size].cast("Q")
        self.values = segment.buf[8 * size : 8 * (size + info.signal_size)].cast("Q")
        self.data = (
            # From a slice, not ``segment.buf`` itself: the slice keeps the
            # mapping's buffer exported, so closing the segment leaves it mapped
            # while any tensor view lives (instead of a use-after-unmap crash).
            torch.frombuffer(segment.buf[header : header + info.data_nbytes], dtype=torch.uint8)
            if info.data_nbytes
            else torch.empty(0, dtype=torch.uint8)
        )

    def close(self) -> None:
        self.counters.release()
        self.values.release()
        self.data = torch.empty(0, dtype=torch.uint8)
        self.segment.close()


def _header_bytes(size: int, signal_size: int) -> int:
    raw = 8 * (size + signal_size)
    return (raw + _ALIGN - 1) // _ALIGN * _ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Window:
    """Created by ``Comm.new_window()``; register a tensor (collective) to use it."""

    def __init__(self, comm: CommOps) -> None:
        self._comm = comm
        self._maps: list[_Mapped] = []
        self._registered: torch.Tensor | None = None
        self._dtype = torch.uint8
        self._sent: list[int] = []
        self._consumed: list[int] = []

    # -- registration ------------------------------------------------------
    def tensor_register(self, tensor: torch.Tensor, signal_size: int = 256) -> None:
        """Collective: back this rank's window with a shared copy of ``tensor``.

        Puts from peers land in the shared copy (``get_tensor()``);
        ``tensor_deregister()`` copies the final contents back into ``tensor``.
        """
        tensor = checks.tensor(tensor, "tensor", self._comm.get_device(), contiguous=True)
        self._register(tensor.numel() * tensor.element_size(), tensor.dtype, signal_size)
        self._registered = tensor
        if tensor.numel():
            self._local.data.view(tensor.dtype).copy_(tensor.view(-1))
        self._comm.barrier()  # nobody puts before every initial copy is in place

    def window_allocate(
        self, window_size: int, cpu_buf: bool = False, signal_size: int = 256
    ) -> torch.Tensor:
        """Collective: a zeroed window of ``window_size`` bytes; returns it as uint8."""
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 0:
            raise GroupcoordValueError(
                f"window_size must be a non-negative int, got {window_size!r}"
            )
        checks.flag(cpu_buf, "cpu_buf")  # every window here is in host memory
        self._register(window_size, torch.uint8, signal_size)
        return self._local.data

    def _register(self, nbytes: int, dtype: torch.dtype, signal_size: int) -> None:
        comm = self._comm
        comm._check_usable("tensor_register")
        if self._maps:
            raise GroupcoordValueError("this window already has a tensor; deregister it first")
        if isinstance(signal_size, bool) or not isinstance(signal_size, int) or signal_size < 1:
            raise GroupcoordValueError(f"signal_size must be a positive int, got {signal_size!r}")
        size, me = comm.get_size(), comm.get_rank()
        own = ShmSegment.create(_header_bytes(size, signal_size) + nbytes, tag="win")
        maps: list[_Mapped] = []
        try:
            own.buf[: _header_bytes(size, signal_size)] = bytes(_header_bytes(size, signal_size))
            info = _SegmentInfo(own.name, os.getpid(), nbytes, signal_size, _dtype_name(dtype))
            infos = [
                msgspec.convert(codec.loads(view), _SegmentInfo)
                for view in bytes_io.all_gather_messages(comm, codec.encode_message(info))
            ]
            failed = ""
            for rank, peer in enumerate(infos):
                if rank == me:
                    maps.append(_Mapped(own, info, size))
                    continue
                try:
                    maps.append(_Mapped(ShmSegment.attach(peer.name), peer, size))
                except OSError as exc:
                    failed = f"rank {me} cannot map rank {rank}'s window: {exc}"
                    break
            verdicts = [
                codec.loads(view)
                for view in bytes_io.all_gather_messages(comm, codec.encode_message(failed))
            ]
        except BaseException:
            for mapped in maps:
                mapped.close()
            own.close()
            own.unlink()
            raise
        # Every rank has mapped every segment (or given up): the names can go.
        own.unlink()
        problems = [v for v in verdicts if v]
        if problems:
            for mapped in maps:
                mapped.close()
            own.close()
            raise BackendUnavailableError(
                "shared-memory window", "; ".join(problems) + " (ranks must share one node)"
            )
        dtypes = [peer.dtype for peer in infos]
        if len(set(dtypes)) > 1:  # every rank sees the same list, so all refuse alike
            for mapped in maps:
                mapped.close()
            raise GroupcoordTypeError(
                f"ranks registered windows of different dtypes {dtypes}; use one dtype "
                "(or window_allocate for a byte window)"
            )
        self._maps = maps
        self._dtype = dtype
        self._sent = [0] * size
        self._consumed = [0] * size

    def tensor_deregister(self) -> None:
        """Collective: wait for every rank, copy the window back, unmap everything."""
        self._require()
        self._comm.barrier()  # no peer is still putting into this rank's window
        if self._registered is not None and self._registered.numel():
            self._registered.view(-1).copy_(self._local.data.view(self._registered.dtype))
        self.close()

    def close(self) -> None:
        """Unmap without talking to peers (used by ``Comm.abort``); idempotent."""
        maps, self._maps = self._maps, []
        for mapped in maps:
            mapped.close()
        self._registered = None

    # -- views -------------------------------------------------------------
    @property
    def _local(self) -> _Mapped:
        return self._maps[self._comm.get_rank()]

    def _require(self) -> None:
        if not self._maps:
            raise ClosedError("window has no registered tensor (call tensor_register first)")

    def get_size(self) -> int:
        """Bytes in this rank's window."""
        self._require()
        return self._local.info.data_nbytes

    def map_remote_tensor(self, rank: int) -> torch.Tensor:
        """A 1-D tensor aliasing ``rank``'s window memory (its registered dtype)."""
        self._require()
        rank = checks.rank(rank, "rank", self._comm.get_size())
        return self._maps[rank].data.view(self._dtype)

    def get_tensor(
        self,
        rank: int | None = None,
        sizes: list[int] | tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """The local window (shaped like the registered tensor), or, the older form,
        a ``sizes``/``dtype`` view of ``rank``'s window starting ``offset`` elements in."""
        self._require()
        if rank is None and sizes is None and dtype is None:
            if self._registered is not None:
                return self._local.data.view(self._dtype).view(self._registered.shape)
            return self._local.data
        rank = checks.rank(
            self._comm.get_rank() if rank is None else rank, "rank", self._comm.get_size()
        )
        dtype = self._dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise GroupcoordTypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(sizes) if sizes is not None else (-1,)
        if (
            any(isinstance(s, bool) or not isinstance(s, int) or s < -1 for s in shape)
            or shape.count(-1) > 1
            or isinstance(offset, bool)
            or not isinstance(offset, int)
        ):
            raise GroupcoordValueError(
                f"sizes={list(shape)} offset={offset!r}: sizes must be ints >= 0 (one may be "
                "-1, the rest of the window) and offset an int"
            )
        item = torch.empty(0, dtype=dtype).element_size()
        window = self._maps[rank].info.data_nbytes
        start = offset * item
        known = math.prod(s for s in shape if s != -1)  # elements of the given sizes
        if -1 in shape:  # the rest of the window, in whole rows of the others
            rest = max(window - start, 0) // item
            if known == 0 or rest % known:
                raise GroupcoordValueError(
                    f"sizes={list(shape)} dtype={dtype} offset={offset}: the -1 must take the "
                    f"rest of rank {rank}'s window ({rest} elements) in whole rows of {known}"
                )
            shape = tuple(rest // known if s == -1 else s for s in shape)
            known = rest
        end = start + known * item
        if offset < 0 or end > window:
            raise GroupcoordValueError(
                f"sizes={list(shape)} dtype={dtype} offset={offset} runs past rank {rank}'s "
                f"window of {window} bytes"
            )
        return self._maps[rank].data[start:end].view(dtype).view(shape)

    # -- one-sided operations ------------------------------------------------
    def put(
        self,
        tensor: torch.Tensor,
        dst_rank: int,
        target_disp: int = 0,
        async_op: bool = False,
    ) -> Work:
        """Copy ``tensor`` into ``dst_rank``'s window, ``target_disp`` elements in."""
        self._require()
        tensor = checks.tensor(tensor, "tensor", self._comm.get_device(), contiguous=True)
        dst_rank = checks.rank(dst_rank, "dst_rank", self._comm.get_size())
        checks.flag(async_op, "async_op")
        if self._registered is not None and tensor.dtype != self._dtype:
            raise GroupcoordTypeError(
                f"tensor has dtype {tensor.dtype} but the window holds {self._dtype}"
            )
        offset = target_disp
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise GroupcoordValueError(f"target_disp must be a non-negative int, got {offset!r}")
        start = offset * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        capacity = self._maps[dst_rank].info.data_nbytes
        if end > capacity:
            raise GroupcoordValueError(
                f"put of {tensor.numel()} elements at target_disp={offset} runs past "
                f"rank {dst_rank}'s window ({capacity} bytes)"
            )
        if tensor.numel():
            self._maps[dst_rank].data[start:end].view(tensor.dtype).copy_(tensor.view(-1))
        return Work.completed(self._comm.get_name(), "put", [dst_rank])

    def signal(
        self,
        signal_disp: int | None = None,
        signal_val: int | None = None,
        dst_rank: int | None = None,
        async_op: bool = False,
    ) -> Work:
        """Store ``signal_val`` in value slot ``signal_disp`` of ``dst_rank``
        (torchcomms' signature).

        Without ``signal_disp``/``signal_val`` (the counter form,
        ``signal(dst_rank=r)``): tell ``dst_rank`` that this rank's earlier puts
        to it are complete; ``wait_signal(peer_rank=...)`` on its side returns then.
        """
        self._require()
        if dst_rank is None:
            raise GroupcoordValueError("signal needs dst_rank")
        dst_rank = checks.rank(dst_rank, "dst_rank", self._comm.get_size())
        checks.flag(async_op, "async_op")
        if signal_disp is not None or signal_val is not None:
            return self._signal_value(dst_rank, signal_disp, signal_val)
        me = self._comm.get_rank()
        count = self._sent[dst_rank] + 1
        if needs_fence:
            memory_fence()  # the put's data stores before the counter store
        self._maps[dst_rank].counters[me] = count
        self._sent[dst_rank] = count
        return Work.completed(self._comm.get_name(), "signal", [dst_rank])

    def _signal_value(self, dst_rank: int, disp: int | None, value: int | None) -> Work:
        slots = self._maps[dst_rank].values
        disp = self._slot(disp, len(slots), dst_rank)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
            raise GroupcoordValueError(f"signal_val must be an int in [0, 2**64), got {value!r}")
        if needs_fence:
            memory_fence()
        slots[disp] = value
        return Work.completed(self._comm.get_name(), "signal", [dst_rank])

    @staticmethod
    def _slot(disp: Any, n: int, rank: int) -> int:
        if isinstance(disp, bool) or not isinstance(disp, int) or not 0 <= disp < n:
            raise GroupcoordValueError(
                f"signal_disp={disp!r} is outside rank {rank}'s {n} signal slots"
            )
        return disp

    def wait_signal(
        self,
        signal_disp: int | None = None,
        signal_val: int | None = None,
        cmp_op: SignalCmpOp | str = SignalCmpOp.EQ,
        async_op: bool = False,
        *,
        peer_rank: int | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Wait until local value slot ``signal_disp`` compares ``cmp_op`` (eq, ne,
        ge, gt, le, lt) against ``signal_val`` (torchcomms' signature).

        The counter form, ``wait_signal(peer_rank=r)``: wait for ``r``'s next
        ``signal(dst_rank=...)``; its puts before it are then visible.
        """
        self._require()
        checks.flag(async_op, "async_op")
        timeout_s = timeout_seconds(timeout, self._comm._timeout_s)
        if signal_disp is not None or signal_val is not None:
            ready, peers = self._value_ready(signal_disp, signal_val, cmp_op)
        else:
            if peer_rank is None:
                raise GroupcoordValueError(
                    "wait_signal needs peer_rank (or signal_disp/signal_val)"
                )
            peer = checks.rank(peer_rank, "peer_rank", self._comm.get_size())
            ready, peers = self._counter_ready(peer), [peer]
        watched = self._watch_peers(ready, peers)
        work = Work.polled(self._comm.get_name(), "wait_signal", peers, timeout_s, watched)
        if not async_op:
            if not wait_until(watched, work.deadline):
                raise GroupcoordTimeoutError(
                    f"window of communicator {self._comm.get_name()!r}",
                    "wait_signal",
                    timeout_s,
                    missing=peers,
                    detail="no signal arrived from the listed ranks",
                )
            work.is_completed()
        return work

    def _counter_ready(self, peer: int) -> Callable[[], bool]:
        target = self._consumed[peer] + 1
        counters = self._local.counters
        state = {"done": False}

        def ready() -> bool:
            if state["done"]:
                return True
            if counters[peer] < target:
                return False
            if needs_fence:
                memory_fence()  # the counter load before the caller's data loads
            self._consumed[peer] = target
            state["done"] = True
            return True

        return ready

    def _value_ready(
        self, disp: int | None, value: int | None, cmp_op: SignalCmpOp | str
    ) -> tuple[Callable[[], bool], list[int]]:
        slots = self._local.values
        disp = self._slot(disp, len(slots), self._comm.get_rank())
        if isinstance(value, bool) or not isinstance(value, int):
            raise GroupcoordValueError(f"signal_val must be an int, got {value!r}")
        if isinstance(cmp_op, SignalCmpOp):
            cmp_op = cmp_op.value
        if cmp_op not in _COMPARE:
            raise GroupcoordValueError(
                f"cmp_op must be a SignalCmpOp or one of {sorted(_COMPARE)}, got {cmp_op!r}"
            )
        compare = _COMPARE[cmp_op]

        def ready() -> bool:
            if not compare(slots[disp], value):
                return False
            if needs_fence:
                memory_fence()
            return True

        return ready, self._comm._others()

    def _watch_peers(self, ready: Callable[[], bool], peers: list[int]) -> Callable[[], bool]:
        """``ready`` plus a pid check every peer_check_interval_s: a dead peer raises."""
        interval = get_config().peer_check_interval_s
        pids = {rank: self._maps[rank].info.pid for rank in peers}
        state = {"next": time.monotonic() + interval}

        def watched() -> bool:
            if ready():
                return True
            now = time.monotonic()
            if now >= state["next"]:
                state["next"] = now + interval
                dead = dead_peers(pids)
                if dead:
                    raise PeerDiedError(
                        f"window of communicator {self._comm.get_name()!r}", "wait_signal", dead
                    )
            return False

        return watched
