"""A ``GroupCoordinator``'s objects and point-to-point tensors: ``broadcast_object``
(through the message queue when the group has one), ``broadcast_object_list``,
``send/recv_object`` and ``isend_object``, ``send``/``recv``; and the handle
vLLM's asynchronous sends return (ours complete before they return)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch.distributed import ProcessGroup

from device_communicators import c10d_calls, object_bytes
from shm_broadcast.codec import EncodedMessage, encode_message, loads, message_bytes
from shm_broadcast.group_io import broadcast_bytes

from . import tensor_dicts
from .errors import ClosedError, DesyncError, GroupcoordError, GroupcoordTypeError
from .group_base import GroupBase
from .metadata import OBJECT_LIST, expect, object_message, received_object, tensor_dict_in

T = TypeVar("T")


class Handle(Protocol):
    """What vLLM's asynchronous sends and receives return."""

    def is_completed(self) -> bool: ...

    def wait(self) -> None: ...


class _CompletedHandle:
    """The handle of a transfer that finished before its call returned."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


COMPLETED: Handle = _CompletedHandle()


class GroupMessaging(GroupBase):
    """Objects and tensor dicts between a group's ranks (``GroupCoordinator`` is one)."""

    # GroupCoordinator's: the CPU fast path, fingerprinted (declared for the type checker;
    # the tensor dict functions this class hands itself to use them).
    broadcast: Callable[..., torch.Tensor]
    all_gather: Callable[..., torch.Tensor]

    # ---- objects ------------------------------------------------------------------

    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank (through the message queue when the group has one)."""
        self._check_index(src, "src")
        if self.world_size == 1:
            return obj
        mine = self.rank_in_group == src
        if self.mq_broadcaster is not None and src == 0:
            # An interrupted read consumes nothing: the next call would return this
            # call's object, so it ends the group here (_ended_with). One message:
            # the queue's end keeps the threads' turns.
            with self._whole("broadcast_object", lock=False):
                got = self._mq_broadcast(obj, "broadcast_object")
        else:
            msg = encode_message(obj) if mine else None  # refuses what it cannot carry, first
            data = self._broadcast_bytes("broadcast_object", msg, src)
            got = obj if mine else loads(data)
        if mine:
            return got
        try:
            return expect(got, None, self._called("broadcast_object", src), src)
        except DesyncError:
            # The source broadcast a tensor dict: take the tensors it sends after its
            # message, so that no call of this rank meets one of them, then raise.
            described = tensor_dict_in(got)
            if described is not None:
                tensor_dicts.receive_broadcast(self, described, src)
            raise

    def _broadcast_bytes(
        self,
        operation: str,
        msg: EncodedMessage | None,
        src: int,
        pg: ProcessGroup | None = None,
    ) -> bytes | memoryview:
        """``src``'s encoded message ``msg`` on every rank, as bytes ``codec.loads``
        reads. A CPU group moves it with its own ``broadcast`` (its length, then its
        bytes in a pooled buffer, ``object_bytes.message_buffer``, as ``object_bytes``
        tensors: through shared memory when the group has it, fingerprinted, so a
        rank that called another collective, a plain broadcast of the same size
        included, raises ``DesyncError``); the view returned holds the buffer until
        the caller drops it. Otherwise, or on another ``pg``, Gloo's broadcasts."""
        if pg is not None or self.device.type != "cpu":
            payload = message_bytes(msg) if msg is not None else None
            return self._collective(operation, broadcast_bytes, pg or self.cpu_group, payload, src)
        length = object_bytes.lengths([msg.nbytes if msg is not None else 0])
        with self._whole(operation):
            self.broadcast(length, src)
            tensor, view = object_bytes.message_buffer(object_bytes.read_lengths(length)[0], msg)
            self.broadcast(tensor, src)
        return view

    def _called(self, operation: str, src: int) -> str:
        """How a ``DesyncError`` names this rank's receive of ``operation`` from ``src``."""
        if operation.startswith("broadcast"):
            return f"{self.unique_name}: rank {self.rank_in_group} called {operation}(src={src})"
        return f"{self.unique_name}: rank {self.rank_in_group} called {operation} from rank {src}"

    def _mq_broadcast(self, obj: Any, operation: str) -> Any:
        """In-group rank 0 writes ``obj`` to the queue, the others read it.

        No deadline: this is an engine worker's idle wait between requests, so
        it lasts as long as the writer (or, for the writer, the readers) live;
        a dead peer ends it with PeerDiedError, and peers that wait for this rank
        in a collective of the group instead with DesyncError (see
        docs/coordinator.md)."""
        check = self._queue_checks.get(operation)
        try:
            if self.rank_in_group == 0:
                self.mq_broadcaster.enqueue(obj, stall_check=check)
            else:
                obj = self.mq_broadcaster.dequeue(stall_check=check)
        except ClosedError as exc:
            # A peer's group closed (a call of its failed) or was destroyed: its end
            # of the queue shut down (_close_here), so this rank's closes too.
            self._close_here(f"its {operation} found a peer's end of its queue shut ({exc})")
            raise ClosedError(
                f"{self.unique_name}: {operation} ended: {exc} (the group closed or was "
                "destroyed on that rank, and is closed here too)"
            ) from exc
        except GroupcoordError as exc:
            if exc.taken:  # read, and it did not decode here
                self._traffic.count_queue_call()
            raise
        # Counted on every rank: ranks whose counts differ at a collective had a
        # broadcast met by another call, and the group closes (shm_phases.Traffic).
        self._traffic.count_queue_call()
        return obj

    def broadcast_object_list(
        self, obj_list: list[Any], src: int = 0, group: ProcessGroup | None = None
    ) -> list[Any]:
        """Replace ``obj_list``'s items with ``src``'s, in place; returns ``obj_list``."""
        if not isinstance(obj_list, list):
            raise GroupcoordTypeError(f"obj_list must be a list, got {type(obj_list).__name__}")
        self._check_index(src, "src")
        if self.world_size == 1:
            return obj_list
        mine = self.rank_in_group == src
        msg = encode_message([OBJECT_LIST, *obj_list]) if mine else None
        data = self._broadcast_bytes("broadcast_object_list", msg, src, group)
        if mine:
            return obj_list
        called = self._called("broadcast_object_list", src)
        items = expect(loads(data), OBJECT_LIST, called, src)[1:]
        if len(items) != len(obj_list):
            raise DesyncError(
                f"{called} with a list of {len(obj_list)}, and rank {src} broadcast "
                f"{len(items)} objects: the ranks' calls are out of step"
            )
        obj_list[:] = items
        return obj_list

    def send_object(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to in-group rank ``dst`` (msgspec, no pickle): through the
        pair's shared-memory channel to a peer on this node, else over Gloo."""
        self._check_peer(dst, "dst")
        msg = encode_message(object_message(obj))  # refuses what it cannot carry, first
        peer = self.ranks[dst]
        # (over Gloo: a header, then the bytes)
        with self._whole("send_object", lock=False), self._p2p_channels.turn(peer, True):
            if self._p2p_channels.open_to(peer, "send_object"):
                self._p2p_channels.send_message(peer, msg, "send_object")
            else:
                self._send_bytes(message_bytes(msg), dst, "send_object")
            self._traffic.count_message(sent=True)

    def recv_object(self, src: int) -> Any:
        """The next object that in-group rank ``src`` sent with ``send_object``."""
        self._check_peer(src, "src")
        peer = self.ranks[src]
        with self._whole("recv_object", lock=False), self._p2p_channels.turn(peer, False):
            if self._p2p_channels.open_from(peer, "recv_object"):
                got = self._taking(self._p2p_channels.recv_message, peer, "recv_object")
            else:
                got = loads(self._taking(self._recv_bytes, src, "recv_object"))
            try:
                return received_object(got, self._called("recv_object", src), src)
            except DesyncError:
                self._finish_refused(got, src)
                raise

    def _taking(self, receive: Callable[..., T], *args: Any) -> T:
        """``receive(*args)``, which takes one message from a peer of the group:
        counted (``shm_phases.Traffic``: the group's collectives check that every
        message sent was taken before them) once it returned, or raised having
        taken the message (``GroupcoordError.taken``: it did not decode, or was
        refused)."""
        try:
            got = receive(*args)
        except GroupcoordError as exc:
            if exc.taken:
                self._traffic.count_message(sent=False)
            raise
        self._traffic.count_message(sent=False)
        return got

    def _finish_refused(self, message: Any, src: int) -> None:
        """A receive from in-group rank ``src`` refused ``message`` (a ``DesyncError``;
        the caller holds the pair's receiving turn): when it is a tensor dict's,
        take the tensors its sender sends after it, so that the pair's next receive
        gets the sender's next call, not one of them. ``message`` may be its bytes."""
        if isinstance(message, bytes):
            try:
                message = loads(message)
            except GroupcoordError:  # not one of ours: nothing is known to follow
                return
        described = tensor_dict_in(message)
        if described is not None:
            tensor_dicts.drop_sent_parts(self, src, described)

    def _send_bytes(self, payload: bytes, dst: int, operation: str) -> None:
        # One message unit with a header that says "an object's bytes": a tensor
        # receive that meets it (or an object receive that meets a tensor) raises
        # DesyncError naming both sides, and the pair stays in step.
        self._p2p(
            operation, dst, lambda: c10d_calls.send_bytes(self.cpu_group, payload, dst).wait()
        )

    def _recv_bytes(self, src: int, operation: str) -> bytes:
        received: bytes = self._p2p(
            operation, src, c10d_calls.recv_bytes, self.cpu_group, src, operation, self.unique_name
        )
        return received

    # ---- asynchronous sends ----------------------------------------------------------

    def isend_object(self, obj: Any, dst: int) -> Handle:
        """:meth:`send_object`, complete when this returns."""
        self.send_object(obj, dst)
        return COMPLETED

    # ---- point to point tensors ---------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to in-group rank ``dst`` (default: next)."""
        if dst is not None:
            self._check_peer(dst, "dst")
        peer = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        with self._p2p_channels.turn(self.ranks[peer], True):  # (over Gloo: header, data)
            self._p2p("send", peer, self._tensor_comm().send, tensor, dst)
            self._traffic.count_message(sent=True)

    def recv(
        self,
        size: torch.Size | tuple[int, ...] | list[int] | int,
        dtype: torch.dtype,
        src: int | None = None,
    ) -> torch.Tensor:
        """A tensor of ``size`` and ``dtype`` from in-group rank ``src`` (default: previous)."""
        if src is not None:
            self._check_peer(src, "src")
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size,)  # vLLM callers pass a plain element count too
        peer = (self.rank_in_group - 1) % self.world_size if src is None else src
        with self._p2p_channels.turn(self.ranks[peer], False):
            try:
                out: torch.Tensor = self._taking(
                    self._p2p, "recv", peer, self._tensor_comm().recv, size, dtype, src
                )
            except DesyncError as exc:
                self._finish_refused(exc.received, peer)
                raise
        return out
