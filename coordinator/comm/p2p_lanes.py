"""A communicator's sends and receives: shared-memory channels between ranks on a node.

When the communicator's ranks share a node, ``Comm.send``/``recv`` and
batches go through the device communicator's
:class:`~shm_broadcast.p2p_channels.P2PChannels` (one single-reader ring per
ordered pair), about ten times less latency than Gloo's TCP pair for a
small tensor. Each (direction, peer) has its own
:class:`~coordinator.comm.lanes.Lane`, so calls to one peer keep their order
while a receive waiting on one peer never holds up a send, a receive from
another peer or a collective. A synchronous call runs on the caller's
thread, an asynchronous one on its lane's thread; a batch runs on the
caller's thread when its sends cannot wait (see :meth:`P2PLanes.run_batch`),
else every op on its lane's thread.

A pair with no channel (a peer on another node, a ring that did not fit in
/dev/shm: both ends learn it from the store) goes over Gloo inside the same
lane, so the order per pair holds whatever the transport. The receiver
checks the dtype and element count it asked for against what came and
raises ``DesyncError`` naming both sides on a mismatch (Gloo would fail or
truncate).
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from device_communicators import c10d_calls
from device_communicators.shm_phases import Traffic
from shm_broadcast.p2p_channels import Limit, P2PChannels

from ..errors import GroupcoordError, GroupcoordTimeoutError
from .lanes import Lane, LaneCall
from .work import Work, WorkStatus, translate_error

Kind = Literal["send", "recv"]


class P2PLanes:
    """The point-to-point lanes of one communicator (see the module docstring)."""

    def __init__(
        self,
        name: str,
        channels: P2PChannels,
        pg: Any,
        traffic: Traffic,
    ) -> None:
        self._name = name
        self._traffic = traffic  # every message sent or taken (Comm._mark_in_flight)
        self._channels = channels
        self._pg = pg
        self._lanes: dict[tuple[Kind, int], Lane] = {}
        self._lock = threading.Lock()

    def run(self, work: Work, kind: Kind, tensor: torch.Tensor, peer: int, async_op: bool) -> None:
        """Send ``tensor`` to, or receive it in place from, comm rank ``peer``.

        An asynchronous send that goes into the pair's open ring now (nothing
        queued before it, room for it) runs on the caller's thread and returns
        done: it waits for no one, and handing it to the lane's thread cost more
        than the copy (about 25 us a message at 4 KiB here). Another thread's send
        to the same peer may still take the room first: this one then waits for
        it, in turn (the lane runs one call at a time)."""
        lane = self._lane(kind, peer)
        call = self._call(kind, tensor, peer)
        if (
            async_op
            and kind == "send"
            and lane.idle
            and self._channels.sends_without_waiting(peer, [tensor.nbytes], work.op, create=False)
            and lane.run_if_idle(work, call)
        ):
            return
        lane.run(work, call, async_op)

    def run_batch(
        self, batch: Work, ops: Sequence[tuple[Kind, torch.Tensor, int]], async_op: bool
    ) -> None:
        """Run a batch so that no order of ops across ranks can deadlock; ``batch``
        finishes when every op has.

        A synchronous batch whose sends all go into their rings now (every peer's
        channel has room for them, nothing is queued on the lanes it uses) runs on
        the caller's thread: the sends, which wait for no one, then the receives.
        Any other batch puts every op on its lane's thread at once."""
        if not async_op and self._sends_fit(ops):
            self._run_inline(batch, ops)
            return
        parts = [self._part(batch, kind, peer) for kind, _, peer in ops]
        _join(batch, parts)
        for (kind, tensor, peer), part in zip(ops, parts):
            self._lane(kind, peer).run(part, self._call(kind, tensor, peer), async_op=True)
        if not async_op:
            batch.wait()

    def _sends_fit(self, ops: Sequence[tuple[Kind, torch.Tensor, int]]) -> bool:
        sizes: dict[int, list[int]] = {}
        for kind, tensor, peer in ops:
            if not self._lane(kind, peer).idle:
                return False
            if kind == "send":
                sizes.setdefault(peer, []).append(tensor.nbytes)
        return all(
            peer in self._channels.peers
            and self._channels.sends_without_waiting(peer, nbytes, "batch")
            for peer, nbytes in sizes.items()
        )

    def _run_inline(self, batch: Work, ops: Sequence[tuple[Kind, torch.Tensor, int]]) -> None:
        ordered = [op for op in ops if op[0] == "send"] + [op for op in ops if op[0] == "recv"]
        try:
            for kind, tensor, peer in ordered:
                part = self._part(batch, kind, peer)
                self._lane(kind, peer).run(part, self._call(kind, tensor, peer), async_op=False)
        except BaseException as exc:
            if isinstance(exc, GroupcoordTimeoutError):
                batch._expire()
            batch._finish(exc)
            raise
        batch._finish(None)

    @staticmethod
    def _part(batch: Work, kind: Kind, peer: int) -> Work:
        """The work of one op of ``batch``: its deadline is the batch's."""
        part = Work(batch.comm_name, kind, [peer], batch.timeout_s, batch._on_failure)
        part.deadline = batch.deadline
        part.local_pids = batch.local_pids
        return part

    def close(self, abandon: str | None = None) -> None:
        """Let queued calls finish (each by its deadline), or with ``abandon`` (an
        abort) shut the channels at once, which ends the calls waiting on a peer."""
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.close(abandon)
        if abandon is not None:
            self._channels.close(linger=False)

    def _lane(self, kind: Kind, peer: int) -> Lane:
        lane = self._lanes.get((kind, peer))
        if lane is None:
            with self._lock:
                lane = self._lanes.setdefault((kind, peer), Lane(f"{self._name}-{kind}{peer}"))
        return lane

    def _call(self, kind: Kind, tensor: torch.Tensor, peer: int) -> LaneCall:
        """The lane's call for one op, counted now in the traffic the comm's
        collectives compare (``shm_phases.Traffic``: messages sent less taken), on
        the caller's thread, in its order among the caller's calls, however late
        the lane runs it. A message sent before a collective is one the peer must
        have taken, or posted a receive for, before its own. Until 2026-11-29 an
        op counted once done, and an asynchronous one still in flight made the
        collective skip the comparison: a peer that made a collective where it
        should have received then paired its next same-shaped collective with this
        rank's (wrong sums, no error)."""
        self._traffic.count_message(sent=kind == "send")
        if kind == "send":
            return functools.partial(self._send, tensor, peer)
        return functools.partial(self._recv, tensor, peer)

    def _send(self, tensor: torch.Tensor, dst: int, work: Work) -> None:
        limit = Limit(work.timeout_s, work.deadline)
        if self._channels.open_to(dst, work.op):
            self._channels.send_tensor(dst, tensor, work.op, limit)
        else:
            self._gloo(work, lambda: c10d_calls.send(self._pg, tensor, dst), limit)

    def _recv(self, tensor: torch.Tensor, src: int, work: Work) -> None:
        try:
            self._take(tensor, src, work)
        except GroupcoordError as exc:
            # One that refused what came (another size) took it all the same; one
            # that raised before anything came took nothing.
            if not exc.taken:
                self._traffic.count_message(sent=True)  # undoes its count
            raise

    def _take(self, tensor: torch.Tensor, src: int, work: Work) -> None:
        limit = Limit(work.timeout_s, work.deadline)
        if self._channels.open_from(src, work.op, limit):
            got = self._channels.recv_tensor(
                src, tensor.dtype, tensor.shape, work.op, limit, into=tensor
            )
            if got.data_ptr() != tensor.data_ptr():  # came encoded (a many-dim shape)
                ctypes.memmove(tensor.data_ptr(), got.data_ptr(), got.nbytes)
        else:
            # Waited for at once, on this lane: the header is read before the data.
            post = functools.partial(c10d_calls.recv_blocking, self._pg, tensor, src, work._what())
            self._gloo(work, post, limit)

    @staticmethod
    def _gloo(work: Work, post: Callable[[], Any], limit: Limit) -> None:
        try:
            post().wait(datetime.timedelta(seconds=limit.left()))
        except RuntimeError as exc:
            raise translate_error(work, exc) from exc


def _join(batch: Work, parts: list[Work]) -> None:
    """Finish ``batch`` once every part has: with the first part's error, if any."""
    left = len(parts)
    lock = threading.Lock()

    def part_done(_part: Work) -> None:
        nonlocal left
        with lock:
            left -= 1
            if left:
                return
        if any(p._status is WorkStatus.TIMED_OUT for p in parts):
            batch._expire()
        batch._finish(next((p._error for p in parts if p._error is not None), None))

    for part in parts:
        part._then = part_done
