"""All-reduce back ends as an ordered list: the first that can take a tensor runs.

A communicator holds an :class:`AllReduceChain`, e.g. ``[ShmAllReduce,
TorchDistributedAllReduce]`` on CPU or ``[custom, pynccl, torch]`` on CUDA.
Each back end says whether it can take a given tensor and op, and if not,
why (the reason is logged and shown by ``describe``). The last entry is always
a back end that takes everything, so selection needs no if-chain and no
fallback logic in the caller.
"""

from __future__ import annotations

import datetime
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch
from torch.distributed import ProcessGroup, ReduceOp

from shm_broadcast.gloo_errors import gloo_errors

from . import c10d_calls
from .errors import GroupcoordValueError
from .transports import first_taker

logger = logging.getLogger("groupcoord.device_communicators")

# The reduce ops groupcoord's own back ends implement; torch.distributed takes more.
SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)

# The refusal of a back end between ``suspend()`` and ``resume()``.
SUSPENDED = "suspended (sleep mode) until resume()"


class AllReduceBackend(ABC):
    """One way to all-reduce a tensor across a group.

    ``all_reduce`` is out-of-place: it returns a new tensor and leaves its
    argument unchanged. It is only called after ``refusal`` returned None for
    the same tensor and op. ``refusal`` must depend only on what every rank
    of a collective agrees on (dtype, shape, op, configuration), never on
    local state such as contiguity, or ranks would pick different back ends
    and wait on each other forever.
    """

    name: str = "backend"

    @abstractmethod
    def refusal(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM) -> str | None:
        """None when this back end can take ``tensor``; otherwise the reason it cannot."""

    def can_handle(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM) -> bool:
        return self.refusal(tensor, op) is None

    @abstractmethod
    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce ``tensor`` over the group; returns the result as a new tensor."""

    def reduce_in_chain(self, tensor: torch.Tensor, op: ReduceOp.RedOpType) -> torch.Tensor:
        """What the chain calls once this back end accepted ``tensor``: its
        ``all_reduce``, unless the back end picks something per call (the custom
        all-reduce registers, rather than copies, an input being graph-captured)."""
        return self.all_reduce(tensor, op=op)

    def suspend(self) -> None:
        """Sleep mode: release what :meth:`resume` can re-create (shared memory, an
        NCCL communicator) and refuse tensors until then. Local; the communicator
        runs a barrier first. Default: nothing to release."""
        return None

    def resume(self, group: ProcessGroup) -> None:
        """Re-create what :meth:`suspend` released: collective over ``group`` (the
        communicator's Gloo group), every rank in the same order. Default: nothing."""
        return None

    def close(self) -> None:
        """Release what the back end holds (idempotent)."""
        return None


class TorchDistributedAllReduce(AllReduceBackend):
    """c10d's all-reduce on a process group (Gloo, NCCL): takes everything.

    A Gloo timeout or lost peer raises our errors naming ``what`` (the group)
    and ``peers`` (global ranks; by default torch's registry is asked);
    ``pids`` (global rank -> pid, this host) names the dead ones. ``timeout_s``
    is each call's deadline (None: the group's own).
    """

    name = "torch.distributed"

    def __init__(
        self,
        group: ProcessGroup,
        what: str = "",
        pids: Mapping[int, int] | None = None,
        *,
        peers: list[int] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.group = group
        self.name = f"torch.distributed({group.name()})"
        self.what = what or self.name
        self.pids = pids
        self.peers = peers
        self.timeout_s = timeout_s
        self._deadline = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

    def refusal(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM) -> str | None:
        return None

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> torch.Tensor:
        # clone(contiguous) so the caller's tensor is untouched and c10d gets dense memory.
        out = tensor.clone(memory_format=torch.contiguous_format)
        with gloo_errors(
            self.what, "all_reduce", self.group, self.peers, self.pids, timeout_s=self.timeout_s
        ):
            c10d_calls.all_reduce(self.group, out, op, self._deadline).wait()
        return out


class AllReduceChain:
    """An ordered list of back ends; ``all_reduce`` runs the first that can."""

    def __init__(self, backends: Sequence[AllReduceBackend], owner: str = "") -> None:
        if not backends:
            raise GroupcoordValueError("backends: an all-reduce chain needs at least one back end")
        self.backends: list[AllReduceBackend] = list(backends)
        self.owner = owner
        logger.info("%s all-reduce back ends, in order: %s", owner or "communicator", self.names())

    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    def select(
        self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> AllReduceBackend:
        """The first back end that can take ``tensor`` and ``op``."""
        return first_taker(
            self.backends, lambda b: b.refusal(tensor, op), self.owner, "all-reduce of", tensor
        )

    def explain(
        self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> list[tuple[str, str | None]]:
        """(back end, reason it refuses or None) for each entry, for logs and ``info``."""
        return [(b.name, b.refusal(tensor, op)) for b in self.backends]

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> torch.Tensor:
        return self.select(tensor, op).reduce_in_chain(tensor, op)

    def suspend(self) -> None:
        for backend in self.backends:
            backend.suspend()

    def resume(self, group: ProcessGroup) -> None:
        for backend in self.backends:
            backend.resume(group)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
