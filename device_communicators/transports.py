"""Moving back ends as an ordered list, per operation: the first that takes a tensor runs.

All-reduce has its chain (``all_reduce_backends``); the operations that move
tensors (all-gather, all-gatherv, reduce-scatter, broadcast, send, recv)
have this one. A communicator holds ``[*fast, torch]``: ``[shared memory,
shared-memory channels, torch]`` on CPU, ``[pynccl, torch]`` on CUDA, and
``[shared-memory channels, torch]`` in the torch communicator of a group
without a device communicator (vLLM's world group). Each transport says, per
operation and tensor, whether it takes the call and if not why, so the base
class's public methods check the arguments once and hand the call to
``select(op, tensor)`` with no subclass overriding anything. The last entry
takes every operation, so selection never fails.

As with all-reduce, a refusal may depend only on what every rank agrees on
(the group, dtype, shape, configuration), never on local state such as a
tensor's contiguity, or ranks would pick different transports.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import torch
from torch.distributed import ProcessGroup

from shm_broadcast.p2p_channels import P2PChannels

from . import c10d_calls
from .errors import GroupcoordValueError

logger = logging.getLogger("groupcoord.device_communicators")

OPERATIONS = ("all_gather", "all_gatherv", "gather", "reduce_scatter", "broadcast", "send", "recv")

# What a transport that lacks an operation says.
NOT_OFFERED = "does not offer this operation"


class Transport:
    """One way to move tensors; it implements the operations it does not refuse.

    Every method is called only after ``refusal(op, tensor)`` returned None
    for its operation, with arguments the communicator already checked:
    in-group ranks, ``dim`` normalised, ``sizes`` one per rank.
    """

    name = "transport"
    # Whether it also serves the communicator's control exchanges (small CPU
    # tensors on cpu_group: lengths, pids), i.e. it lives on cpu_group.
    control = False

    def refusal(self, op: str, tensor: torch.Tensor) -> str | None:
        """None when this transport takes ``op`` on ``tensor``; otherwise why not."""
        raise NotImplementedError

    def all_gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's equally shaped ``tensor``, stacked: ``(world, *shape)``."""
        raise NotImplementedError

    def all_gatherv_exact(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """Every rank's ``tensor`` joined along ``dim``, rank r holding ``sizes[r]`` rows."""
        raise NotImplementedError

    def gather_stacked(self, tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
        """``all_gather_stacked``'s result on rank ``dst``; None on the others."""
        raise NotImplementedError

    def reduce_scatter_sizes(
        self, input_: torch.Tensor, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        """This rank's ``sizes[rank]`` rows along ``dim`` of the group's sum of ``input_``."""
        raise NotImplementedError

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``src``'s; returns ``tensor``."""
        raise NotImplementedError

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    def recv(self, shape: torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor:
        """What ``src`` sent, as a tensor of ``shape`` and ``dtype`` on the chain's
        device: a transport that receives into memory allocates it here, one that
        decodes a fresh tensor (the shared-memory channel) allocates nothing."""
        raise NotImplementedError


class Named(Protocol):
    name: str


N = TypeVar("N", bound=Named)


def first_taker(
    entries: Sequence[N],
    refusal: Callable[[N], str | None],
    owner: str,
    what: str,
    tensor: torch.Tensor,
) -> N:
    """The first of ``entries`` whose ``refusal`` is None (how every back-end chain
    picks); when none takes the call, an error listing each one's reason."""
    reasons = []
    for entry in entries:
        reason = refusal(entry)
        if reason is None:
            return entry
        reasons.append(f"{entry.name}: {reason}")
    raise GroupcoordValueError(
        f"no back end of {owner or 'this communicator'} takes {what} a {tensor.dtype} "
        f"tensor of shape {tuple(tensor.shape)}: " + "; ".join(reasons)
    )


class Owner(Protocol):
    """What :class:`TorchTransport` uses of its communicator (``DeviceCommunicatorBase``)."""

    world_size: int
    rank_in_group: int

    def _gloo(
        self, operation: str, peer: int | None = None, group: ProcessGroup | None = None
    ) -> AbstractContextManager[None]: ...

    @property
    def _deadline(self) -> datetime.timedelta: ...

    def _gather_padded(
        self, tensor: torch.Tensor, dim: int, sizes: list[int], dst: int | None
    ) -> torch.Tensor | None: ...

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor: ...


class TransportChain:
    """An ordered list of transports; ``select`` returns the first that takes a call."""

    def __init__(self, transports: Sequence[Transport], owner: str = "") -> None:
        if not transports:
            raise GroupcoordValueError("transports: a chain needs at least one transport")
        self.transports = list(transports)
        self.owner = owner
        logger.info(
            "%s transports, in order: %s", owner or "communicator", [t.name for t in transports]
        )

    def select(self, op: str, tensor: torch.Tensor) -> Transport:
        for transport in self.transports:  # every call's path: no closure until none takes it
            if transport.refusal(op, tensor) is None:
                return transport
        return first_taker(
            self.transports, lambda t: t.refusal(op, tensor), self.owner, f"{op} of", tensor
        )

    def explain(self, op: str, tensor: torch.Tensor) -> list[tuple[str, str | None]]:
        """(transport, reason it refuses or None) for each entry, for logs and ``info``."""
        return [(t.name, t.refusal(op, tensor)) for t in self.transports]


class TorchTransport(Transport):
    """c10d on ``group`` (the device group; the CPU group for control exchanges):
    takes every operation. All-gatherv pads each part to the longest and cuts it
    back, through the communicator's all-gather chain; reduce-scatter is the
    communicator's all-reduce, then this rank's rows (Gloo has no reduce-scatter:
    more bytes, but exact, and the best all-reduce the group has)."""

    def __init__(self, comm: Owner, group: ProcessGroup, *, control: bool = False) -> None:
        # Weak: the communicator holds this transport, and a cycle would leave the
        # process group to the garbage collector, which may run on one of Gloo's
        # own threads, where the group's destructor joins that very thread
        # (std::terminate). Without the cycle, the group goes when its owner drops it.
        self.comm = weakref.proxy(comm)
        self.group = group
        self.control = control
        self.name = f"torch.distributed({group.name()})"

    def refusal(self, op: str, tensor: torch.Tensor) -> str | None:
        return None

    def all_gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        out = torch.empty(
            (comm.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
        )
        operation = "all_gather (sizes)" if self.control else "all_gather"
        with comm._gloo(operation, group=self.group):
            c10d_calls.all_gather(
                self.group, list(out.unbind(0)), c10d_calls.dense(tensor), comm._deadline
            ).wait()
        return out

    def all_gatherv_exact(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        out = self.comm._gather_padded(tensor, dim, sizes, dst=None)
        assert out is not None  # every rank gets the result of an all-gather
        return out

    def gather_stacked(self, tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
        comm = self.comm
        out = None
        if comm.rank_in_group == dst:
            out = torch.empty(
                (comm.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
            )
        parts = None if out is None else list(out.unbind(0))
        with comm._gloo("gather", group=self.group):
            c10d_calls.gather(
                self.group, parts, c10d_calls.dense(tensor), dst, comm._deadline
            ).wait()
        return out

    def reduce_scatter_sizes(
        self, input_: torch.Tensor, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        rank = self.comm.rank_in_group
        total = self.comm.all_reduce(input_)
        return total.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        work = c10d_calls.dense(tensor)
        with self.comm._gloo("broadcast", group=self.group):
            c10d_calls.broadcast(self.group, work, src, self.comm._deadline).wait()
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        with self.comm._gloo("send", peer=dst, group=self.group):
            c10d_calls.send(self.group, c10d_calls.dense(tensor), dst).wait()

    def recv(self, shape: torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.comm.device)
        with self.comm._gloo("recv", peer=src, group=self.group):
            c10d_calls.recv_blocking(self.group, out, src, self.comm.what).wait()
        return out


class ChannelTransport(Transport):
    """``send``/``recv`` through the communicator's shared-memory channel to each peer
    on this node (the queue its tensor dicts use, so they stay in order with them):
    10-20x less latency than Gloo's TCP pair for a small tensor. A pair with no
    channel (a peer on another node, ``disable_shm_p2p``, a ring that did not fit
    in /dev/shm) goes over ``fallback``: both ends of a pair agree through the
    store, so the choice never splits a pair. The receiver checks the dtype and
    element count it asked for against what came and names both on a mismatch."""

    name = "shared-memory channels"

    def __init__(self, channels: P2PChannels, ranks: list[int], fallback: Transport) -> None:
        self.channels = channels
        self.ranks = ranks
        self.fallback = fallback

    def refusal(self, op: str, tensor: torch.Tensor) -> str | None:
        if op not in ("send", "recv"):
            return NOT_OFFERED
        if not self.channels.peers:  # pairs without a channel fall back inside; so may all
            return "no peer on this node to open a channel to (or disable_shm_p2p is set)"
        return None if tensor.is_cpu else f"tensor is on {tensor.device}, not the CPU"

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        peer = self.ranks[dst]
        if self.channels.open_to(peer, "send"):
            self.channels.send_tensor(peer, tensor, "send", first=True)
        else:
            self.fallback.send(tensor, dst)

    def recv(self, shape: torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor:
        peer = self.ranks[src]
        if self.channels.open_from(peer, "recv"):
            # The decoded tensor owns its memory: nothing to allocate or copy into.
            return self.channels.recv_tensor(peer, dtype, shape, "recv")
        return self.fallback.recv(shape, dtype, src)
