"""Moving dicts of tensors and plain values over a ``GroupCoordinator``.

The bodies of ``broadcast_tensor_dict``, ``send_tensor_dict`` and
``recv_tensor_dict``. Metadata is one msgspec Struct (``metadata``); small
CPU tensors ride inside it, so a dict of small tensors costs one message.
With an ``all_gather_group`` each sending peer moves only its 1/N slice of a
tensor and the receiving group rebuilds it with an all-gather; the sender's
choice is recorded per tensor in the metadata, so the two ends cannot disagree.
Point-to-point dicts between ranks on one node go through the group's
shared-memory channels (``p2p_channels``) unless ``disable_shm_p2p`` is set;
other peers use Gloo sends. The coordinator has checked ``src``/``dst`` and
the group arguments already.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shm_broadcast.group_io import broadcast_bytes

from .errors import GroupcoordTypeError, GroupcoordValueError
from .metadata import TensorMeta, decode_meta, describe, dtype_from_name, encode_meta, rebuild

if TYPE_CHECKING:
    from .group_coordinator import GroupCoordinator

# CPU tensors up to this size ride inside the metadata: one message instead
# of one per tensor, which is what makes small dicts fast.
INLINE_TENSOR_MAX_BYTES = 64 * 1024


def broadcast(
    group: GroupCoordinator,
    tensor_dict: Mapping[str, Any] | None,
    src: int,
    tensor_group: ProcessGroup | None,
    metadata_group: ProcessGroup | None,
) -> dict[str, Any]:
    """``src``'s dict on every rank of ``group`` (``src`` gets its own dict back)."""
    tensors_pg = tensor_group if tensor_group is not None else group.device_group
    meta_pg = metadata_group if metadata_group is not None else group.cpu_group
    via_mq = group.mq_broadcaster is not None and src == 0 and metadata_group is None
    src_rank = group.ranks[src]
    if group.rank_in_group == src:
        if tensor_dict is None:
            raise GroupcoordTypeError("tensor_dict is required on the source rank")
        if via_mq:
            # The queue's codec writes CPU tensors straight into shared
            # memory, so none need to ride inline or travel over Gloo.
            meta, tensors = describe(tensor_dict, -1)
            on_cpu = [t for t in tensors if t.is_cpu]
            tensors = [t for t in tensors if not t.is_cpu]
            group._mq_broadcast((encode_meta(meta), on_cpu))
        else:
            meta, tensors = describe(tensor_dict, INLINE_TENSOR_MAX_BYTES)
            payload = encode_meta(meta)
            group._collective("broadcast_tensor_dict", broadcast_bytes, meta_pg, payload, src)
        works = [
            dist.broadcast(
                t.contiguous(),
                src=src_rank,
                group=meta_pg if t.is_cpu else tensors_pg,
                async_op=True,
            )
            for t in tensors
        ]
        group._wait_all("broadcast_tensor_dict", works)
        return dict(tensor_dict)
    arrived: list[torch.Tensor] = []
    if via_mq:
        data, arrived = group._mq_broadcast(None)
    else:
        data = group._collective("broadcast_tensor_dict", broadcast_bytes, meta_pg, None, src)
    from_queue = iter(arrived)
    works = []

    def receive(item: TensorMeta) -> torch.Tensor:
        if item.device == "cpu" and via_mq:
            return next(from_queue)
        out = _empty(group, item)
        pg = meta_pg if out.is_cpu else tensors_pg
        works.append(dist.broadcast(out, src=src_rank, group=pg, async_op=True))
        return out

    result = rebuild(decode_meta(data), receive)
    group._wait_all("broadcast_tensor_dict", works)
    return result


def send(
    group: GroupCoordinator,
    tensor_dict: Mapping[str, Any],
    dst: int,
    all_gather_group: GroupCoordinator | None,
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

    # describe() raises on a bad dict before anything is sent.
    meta, tensors = describe(tensor_dict, INLINE_TENSOR_MAX_BYTES, slices_of)
    peer = group.ranks[dst]
    # Peers on this node: metadata and CPU tensors through a shared-memory
    # channel, in the same order as over Gloo; device tensors still use the
    # device group.
    channels = group._p2p_channels
    shm = channels if channels.open_to(peer, "send_tensor_dict") else None
    if shm is not None:
        shm.send_meta(peer, encode_meta(meta), "send_tensor_dict")
    else:
        group._send_bytes(encode_meta(meta), dst, "send_tensor_dict")
    part = all_gather_group.rank_in_group if all_gather_group is not None else 0
    items = [i for i in meta.items if isinstance(i, TensorMeta) and i.inline is None]
    for item, tensor in zip(items, tensors):
        if item.slices:
            tensor = tensor.reshape(slices, -1)[part]
        if shm is not None and tensor.is_cpu:
            shm.send_tensor(peer, tensor, "send_tensor_dict")
            continue
        pg = group.cpu_group if tensor.is_cpu else group.device_group
        group._p2p("send_tensor_dict", dst, dist.send, tensor.contiguous(), peer, pg)


def recv(
    group: GroupCoordinator, src: int, all_gather_group: GroupCoordinator | None
) -> dict[str, Any]:
    """The next dict in-group rank ``src`` sent with :func:`send`."""
    peer = group.ranks[src]
    channels = group._p2p_channels
    shm = channels if channels.open_from(peer, "recv_tensor_dict") else None
    if shm is not None:
        meta = decode_meta(shm.recv_meta(peer, "recv_tensor_dict"))
    else:
        meta = decode_meta(group._recv_bytes(src, "recv_tensor_dict"))
    slices = all_gather_group.world_size if all_gather_group is not None else 1
    for n in {i.slices for i in meta.items if isinstance(i, TensorMeta) and i.slices}:
        if all_gather_group is None or slices != n:
            raise GroupcoordValueError(
                f"all_gather_group: the sender sliced tensors {n} ways, so the receiver "
                f"needs an all_gather_group of that size (got {slices})"
            )

    def fetch(item: TensorMeta, shape: tuple[int, ...]) -> torch.Tensor:
        if shm is not None and item.device == "cpu":
            return shm.recv_tensor(peer, dtype_from_name(item.dtype), shape, "recv_tensor_dict")
        out = _empty(group, item, shape)
        pg = group.cpu_group if out.is_cpu else group.device_group
        group._p2p("recv_tensor_dict", src, dist.recv, out, peer, pg)
        return out

    def receive(item: TensorMeta) -> torch.Tensor:
        if not item.slices:
            return fetch(item, item.shape)
        assert all_gather_group is not None
        numel = 1
        for s in item.shape:
            numel *= s
        part = fetch(item, (numel // slices,))
        # Peer r sent the r-th contiguous 1/N of the flattened tensor.
        return all_gather_group.all_gather(part, dim=0).reshape(item.shape)

    return rebuild(meta, receive)


def _empty(
    group: GroupCoordinator, item: TensorMeta, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    device = torch.device("cpu") if item.device == "cpu" else group.device
    return torch.empty(
        item.shape if shape is None else shape, dtype=dtype_from_name(item.dtype), device=device
    )
