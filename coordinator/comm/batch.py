"""Batched point-to-point: queue sends and receives, then put them all in flight.

Every op of the batch is in flight before any is waited on, so a ring
exchange (each rank sends right, receives left) completes without the
send/recv ordering dance that blocking calls need: on shared-memory channels
each op runs on its (direction, peer) lane's thread (``p2p_lanes``); on Gloo,
which posts a send or a receive the moment it is issued and moves the bytes
on its own transport threads, the ops are all posted, then waited on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch

from device_communicators import checks

from ..errors import ClosedError, GroupcoordTypeError
from .ops import CommOps
from .work import Work

if TYPE_CHECKING:
    import datetime
    from collections.abc import Mapping


class P2POp(msgspec.Struct, frozen=True):
    """One queued operation: ``kind`` is 'send' or 'recv', ``peer`` a comm rank."""

    kind: Literal["send", "recv"]
    tensor: Any
    peer: int


class BatchP2POptions(msgspec.Struct):
    """Options of :meth:`P2PBatch.issue` (torchcomms' ``BatchP2POptions``)."""

    hints: dict[str, str] = msgspec.field(default_factory=dict)
    timeout: float | datetime.timedelta | None = None  # seconds; None: the communicator's


class P2PBatch:
    """Created by ``Comm.batch_op_create()``; issue once."""

    def __init__(self, comm: CommOps) -> None:
        self._comm = comm
        self._ops: list[P2POp] = []
        self._issued = False

    @property
    def ops(self) -> tuple[P2POp, ...]:
        return tuple(self._ops)

    def _add(
        self, kind: Literal["send", "recv"], tensor: torch.Tensor, peer: int, arg: str
    ) -> None:
        if self._issued:
            raise ClosedError("this batch was already issued; create a new one")
        comm = self._comm
        checked = checks.tensor(tensor, "tensor", comm.get_device(), contiguous=True)
        rank = checks.rank(peer, arg, comm.get_size(), self_rank=comm.get_rank())
        self._ops.append(P2POp(kind, checked, rank))

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._add("send", tensor, dst, "dst")

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._add("recv", tensor, src, "src")

    def issue(
        self,
        async_op: bool = False,
        options: BatchP2POptions | None = None,
        *,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Post every op at once; the work completes when all have (torchcomms'
        signature; ``hints``/``timeout`` also come from ``options``)."""
        if options is not None:
            if not isinstance(options, BatchP2POptions):
                raise GroupcoordTypeError(
                    f"options must be a BatchP2POptions, got {type(options).__name__}"
                )
            hints = {**options.hints, **(hints or {})}
            timeout = options.timeout if timeout is None else timeout
        if self._issued:
            raise ClosedError("this batch was already issued; create a new one")
        ops = list(self._ops)
        comm = self._comm
        if not ops:
            return Work.completed(comm.get_name(), "batch")
        checks.flag(async_op, "async_op")
        peers = sorted({op.peer for op in ops})
        assert comm._p2p is not None  # set at creation
        work = comm._new_work("batch", peers, timeout, async_op, hints)
        self._issued = True
        comm._p2p.run_batch(work, [(op.kind, op.tensor, op.peer) for op in ops], async_op)
        return work
