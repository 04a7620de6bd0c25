"""Moving dicts of tensors and plain values over a ``GroupCoordinator``.

The bodies of ``broadcast_tensor_dict``, ``send_tensor_dict`` and
``recv_tensor_dict``. A dict is encoded once by the codec (``metadata``):
small CPU tensors (every CPU tensor on the message-queue path) ride inside it,
so a dict of small tensors costs one message; the others travel after it.
With an ``all_gather_group`` each sending peer moves only its 1/N slice of a
tensor and the receiving group rebuilds it with an all-gather; the sender's
choice is recorded per tensor in the message, so the two ends cannot disagree.
Point-to-point dicts between ranks on one node go through the group's
shared-memory channels (``p2p_channels``) unless ``disable_shm_p2p`` is set;
other peers use Gloo sends. The coordinator has checked ``src``/``dst`` and
the group arguments already.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from device_communicators import c10d_calls
from device_communicators.shm_phases import Traffic
from shm_broadcast.codec import EncodedMessage, message_bytes
from shm_broadcast.p2p_channels import P2PChannels

from .errors import GroupcoordTypeError, GroupcoordValueError, ProtocolError
from .metadata import (
    Described,
    SeparateTensor,
    checked,
    decode,
    describe,
    dropped,
    encode,
    rebuild,
)


class Group(Protocol):
    """What these functions use of a ``GroupCoordinator`` (structural, so this
    module never imports the coordinator that calls it)."""

    ranks: list[int]
    rank_in_group: int
    world_size: int
    unique_name: str
    device: torch.device
    cpu_group: ProcessGroup
    device_group: ProcessGroup
    mq_broadcaster: Any
    _p2p_channels: P2PChannels
    _traffic: Traffic

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...
    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor: ...
    def _mq_broadcast(self, obj: Any, operation: str) -> Any: ...
    def _collective(self, operation: str, fn: Any, *args: Any) -> Any: ...
    def _p2p(self, operation: str, peer: int, fn: Any, *args: Any) -> Any: ...
    def _wait_all(self, operation: str, works: list[Any]) -> None: ...
    def _send_bytes(self, payload: bytes, dst: int, operation: str) -> None: ...
    def _recv_bytes(self, src: int, operation: str) -> bytes: ...
    def _taking(self, receive: Callable[..., Any], *args: Any) -> Any: ...
    def _called(self, operation: str, src: int) -> str: ...
    def _broadcast_bytes(
        self, operation: str, msg: EncodedMessage | None, src: int, pg: ProcessGroup | None = None
    ) -> bytes | memoryview: ...


# CPU tensors up to this size ride inside the dict's message: one message instead
# of one per tensor, which is what makes small dicts fast.
INLINE_TENSOR_MAX_BYTES = 64 * 1024


def broadcast(
    group: Group,
    tensor_dict: Mapping[str, Any] | None,
    src: int,
    tensor_group: ProcessGroup | None,
    metadata_group: ProcessGroup | None,
) -> dict[str, Any]:
    """``src``'s dict on every rank of ``group`` (``src`` gets its own dict back)."""
    via_mq = group.mq_broadcaster is not None and src == 0 and metadata_group is None
    if group.rank_in_group == src:
        own, meta_pg, tensors_pg = _routes(group, tensor_group, metadata_group)
        if tensor_dict is None:
            raise GroupcoordTypeError("tensor_dict is required on the source rank")
        if via_mq:
            # The queue's codec writes CPU tensors straight into shared
            # memory, so all of them ride inside; only device tensors follow.
            described, tensors = describe(tensor_dict, group.device, None)
            group._mq_broadcast(encode(described), "broadcast_tensor_dict")
        else:
            described, tensors = describe(tensor_dict, group.device, INLINE_TENSOR_MAX_BYTES)
            group._broadcast_bytes("broadcast_tensor_dict", encode(described), src, metadata_group)
        if own:
            for t in tensors:
                group.broadcast(c10d_calls.dense(t), src)
            return dict(tensor_dict)
        works = [
            dist.broadcast(
                c10d_calls.dense(t),
                src=group.ranks[src],
                group=meta_pg if t.is_cpu else tensors_pg,
                async_op=True,
            )
            for t in tensors
        ]
        group._wait_all("broadcast_tensor_dict", works)
        return dict(tensor_dict)
    called = group._called("broadcast_tensor_dict", src)
    try:
        if via_mq:
            described = checked(group._mq_broadcast(None, "broadcast_tensor_dict"), called, src)
        else:
            data = group._broadcast_bytes("broadcast_tensor_dict", None, src, metadata_group)
            described = decode(data, called, src)
    except ProtocolError as exc:
        # The message did not decode here (an undeclared class): take the tensors
        # the source sends after it, so the group stays in step, then raise.
        left = dropped(exc)
        if left is not None:
            receive_broadcast(group, left, src, tensor_group, metadata_group)
        raise
    return receive_broadcast(group, described, src, tensor_group, metadata_group)


def receive_broadcast(
    group: Group,
    described: Described,
    src: int,
    tensor_group: ProcessGroup | None = None,
    metadata_group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """A broadcast tensor dict on a receiving rank, from its message (``described``):
    the tensors that follow it are received from ``src`` as :func:`broadcast`'s
    source sends them. Also run by a ``broadcast_object`` that got a tensor dict's
    message, before it raises, so its group stays in step."""
    own, meta_pg, tensors_pg = _routes(group, tensor_group, metadata_group)
    src_rank = group.ranks[src]
    works = []

    def receive(item: SeparateTensor) -> torch.Tensor:
        out = _empty(group, item)
        if own:
            return group.broadcast(out, src)
        pg = meta_pg if out.is_cpu else tensors_pg
        works.append(dist.broadcast(out, src=src_rank, group=pg, async_op=True))
        return out

    result = rebuild(described, receive)
    group._wait_all("broadcast_tensor_dict", works)
    return result


def send(
    group: Group,
    tensor_dict: Mapping[str, Any],
    dst: int,
    all_gather_group: Group | None,
    all_gather_tensors: Mapping[str, bool] | None,
) -> None:
    """Send ``tensor_dict`` to in-group rank ``dst`` (sliced over ``all_gather_group``)."""
    slices = all_gather_group.world_size if all_gather_group is not None else 1
    overrides = dict(all_gather_tensors or {})

    def slices_of(key: str, tensor: torch.Tensor) -> int:
        if slices <= 1 or tensor.numel() == 0:
            return 0
        wanted = overrides.get(key)
        if wanted and tensor.numel() % slices:
            raise GroupcoordValueError(
                f"all_gather_tensors[{key!r}] is True but tensor_dict[{key!r}] has "
                f"{tensor.numel()} elements, not divisible by all_gather_group's size {slices}"
            )
        use = tensor.numel() % slices == 0 if wanted is None else bool(wanted)
        return slices if use else 0

    # describe() and encode() raise on a bad dict before anything is sent.
    described, tensors = describe(tensor_dict, group.device, INLINE_TENSOR_MAX_BYTES, slices_of)
    msg = encode(described)
    peer = group.ranks[dst]
    # The dict and its tensors as one unit: another thread's sends to this peer wait.
    with group._p2p_channels.turn(peer, True):
        _send_parts(group, peer, dst, msg, described, tensors, all_gather_group, slices)
        group._traffic.count_message(sent=True)


def _send_parts(
    group: Group,
    peer: int,
    dst: int,
    msg: EncodedMessage,
    described: Described,
    tensors: list[torch.Tensor],
    all_gather_group: Group | None,
    slices: int,
) -> None:
    # Peers on this node: the dict and CPU tensors through a shared-memory
    # channel, in the same order as over Gloo; device tensors still use the
    # device group.
    channels = group._p2p_channels
    shm = channels if channels.open_to(peer, "send_tensor_dict") else None
    if shm is not None:
        shm.send_message(peer, msg, "send_tensor_dict")
    else:
        group._send_bytes(message_bytes(msg), dst, "send_tensor_dict")
    part = all_gather_group.rank_in_group if all_gather_group is not None else 0
    for item, tensor in zip(described.separate.values(), tensors):
        if item.slices:
            tensor = tensor.reshape(slices, -1)[part]
        if shm is not None and tensor.is_cpu:
            shm.send_tensor(peer, tensor, "send_tensor_dict")
            continue
        pg = group.cpu_group if tensor.is_cpu else group.device_group
        group._p2p("send_tensor_dict", dst, _send_waiting, pg, c10d_calls.dense(tensor), dst)


def recv(group: Group, src: int, all_gather_group: Group | None) -> dict[str, Any]:
    """The next dict in-group rank ``src`` sent with :func:`send`."""
    peer = group.ranks[src]
    # The dict and its tensors as one unit: another thread's receives from this peer wait.
    with group._p2p_channels.turn(peer, False):
        return _recv_parts(group, peer, src, all_gather_group)


def _fetcher(group: Group, src: int) -> Callable[[SeparateTensor, tuple[int, ...]], torch.Tensor]:
    """How a receiver of in-group rank ``src``'s dict takes each tensor sent after its
    message, as :func:`send` sends it (whole, or a slice in ``shape``)."""
    peer = group.ranks[src]
    channels = group._p2p_channels
    shm = channels if channels.open_from(peer, "recv_tensor_dict") else None

    def fetch(item: SeparateTensor, shape: tuple[int, ...]) -> torch.Tensor:
        if shm is not None and item.device == "cpu":
            return shm.recv_tensor(peer, item.dtype, shape, "recv_tensor_dict")
        out = _empty(group, item, shape)
        pg = group.cpu_group if out.is_cpu else group.device_group
        group._p2p(
            "recv_tensor_dict",
            src,
            lambda: c10d_calls.recv_blocking(pg, out, src, group.unique_name).wait(),
        )
        return out

    return fetch


def drop_sent_parts(group: Group, src: int, described: Described) -> None:
    """Take what in-group rank ``src`` sends after a dict's message (whole tensors or
    its slices) and drop it, so that the pair's next message is the next call's:
    for a receive that refuses the dict (``recv_object`` included), before it raises.
    The caller holds the pair's receiving turn."""
    fetch = _fetcher(group, src)
    for item in described.separate.values():
        fetch(item, (math.prod(item.shape) // item.slices,) if item.slices else item.shape)


def _recv_parts(
    group: Group, peer: int, src: int, all_gather_group: Group | None
) -> dict[str, Any]:
    channels = group._p2p_channels
    shm = channels if channels.open_from(peer, "recv_tensor_dict") else None
    fetch = _fetcher(group, src)
    called = group._called("recv_tensor_dict", src)
    try:
        if shm is not None:
            got = group._taking(shm.recv_message, peer, "recv_tensor_dict")
            described = checked(got, called, src)
        else:
            described = decode(
                group._taking(group._recv_bytes, src, "recv_tensor_dict"), called, src
            )
    except ProtocolError as exc:  # did not decode here (an undeclared class)
        left = dropped(exc)
        if left is not None:
            drop_sent_parts(group, src, left)
        raise
    slices = all_gather_group.world_size if all_gather_group is not None else 1

    for n in {i.slices for i in described.separate.values() if i.slices}:
        if all_gather_group is None or slices != n:
            drop_sent_parts(group, src, described)  # then refuse
            raise GroupcoordValueError(
                f"all_gather_group: the sender sliced tensors {n} ways, so the receiver "
                f"needs an all_gather_group of that size (got {slices}); this dict is dropped"
            )

    def receive(item: SeparateTensor) -> torch.Tensor:
        if not item.slices:
            return fetch(item, item.shape)
        assert all_gather_group is not None
        numel = 1
        for s in item.shape:
            numel *= s
        part = fetch(item, (numel // slices,))
        # Peer r sent the r-th contiguous 1/N of the flattened tensor.
        return all_gather_group.all_gather(part, dim=0).reshape(item.shape)

    return rebuild(described, receive)


def _send_waiting(pg: ProcessGroup, tensor: torch.Tensor, dst: int) -> None:
    c10d_calls.send(pg, tensor, dst).wait()


def _routes(
    group: Group, tensor_group: ProcessGroup | None, metadata_group: ProcessGroup | None
) -> tuple[bool, ProcessGroup, ProcessGroup]:
    """How a broadcast dict's separate tensors travel: whether through the group's own
    ``broadcast`` (a CPU group's: shared memory, fingerprinted, one after another),
    else c10d's broadcasts (all at once) on which group for CPU and device tensors."""
    own = group.device.type == "cpu" and tensor_group is None and metadata_group is None
    meta_pg = metadata_group if metadata_group is not None else group.cpu_group
    tensors_pg = tensor_group if tensor_group is not None else group.device_group
    return own, meta_pg, tensors_pg


def _empty(
    group: Group, item: SeparateTensor, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    device = torch.device("cpu") if item.device == "cpu" else group.device
    return torch.empty(item.shape if shape is None else shape, dtype=item.dtype, device=device)
