"""Object collectives over a :class:`Comm` that cannot run code on receipt.

Objects are encoded with ``shm_broadcast.codec`` (msgspec msgpack: plain data,
msgspec Structs, tensors and numpy arrays). Anything else is refused at the
sender, and a received message that carries a pickle is refused at the
receiver, unless that side passes ``weights_only=False``: the safe behaviour of
``torch.load(weights_only=True)`` is the default, with no way for a peer to
opt a receiver in. Signatures are torchcomms' (``torchcomms.objcol``), the
comm first; ``send_object_list`` takes ``weights_only`` as a keyword.
"""

from __future__ import annotations

import datetime
from typing import Any

from device_communicators import checks
from shm_broadcast import codec

from ..errors import GroupcoordTypeError, GroupcoordValueError
from ..failures import PartWay
from . import bytes_io
from .ops import CommOps

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]


def _check_list(value: Any, argument: str, length: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise GroupcoordTypeError(f"{argument} must be a list, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise GroupcoordValueError(f"{argument} must have {length} entries, got {len(value)}")
    return value


def _fill(target: list[Any], values: list[Any], argument: str) -> None:
    if not isinstance(values, list) or len(values) != len(target):
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise GroupcoordValueError(f"{argument} has {len(target)} slots but {got} objects arrived")
    target[:] = values


def all_gather_object(
    comm: CommOps,
    object_list: list[Any],
    obj: Any,
    timeout: float | datetime.timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Fill ``object_list`` (one slot per rank) with every rank's ``obj``."""
    pickle = _pickle_allowed(weights_only)
    _check_list(object_list, "object_list", comm.get_size())
    msg = codec.encode_message(obj, allow_pickle=pickle)
    with PartWay(comm._ended_part_way, "all_gather_object", comm._call_lock):
        gathered = bytes_io.all_gather_messages(comm, msg, timeout)
    object_list[:] = [codec.loads(view, allow_pickle=pickle) for view in gathered]


def gather_object(
    comm: CommOps,
    obj: Any,
    root: int,
    object_gather_list: list[Any] | None = None,
    timeout: float | datetime.timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Rank ``root`` fills ``object_gather_list`` with every rank's ``obj``."""
    pickle = _pickle_allowed(weights_only)
    root = checks.rank(root, "root", comm.get_size())
    if comm.get_rank() == root:
        _check_list(object_gather_list, "object_gather_list", comm.get_size())
    msg = codec.encode_message(obj, allow_pickle=pickle)
    with PartWay(comm._ended_part_way, "gather_object", comm._call_lock):
        gathered = bytes_io.gather_messages(comm, msg, root, timeout)
    if gathered is not None and object_gather_list is not None:
        object_gather_list[:] = [codec.loads(view, allow_pickle=pickle) for view in gathered]


def broadcast_object_list(
    comm: CommOps,
    object_list: list[Any],
    root: int,
    timeout: float | datetime.timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Copy ``root``'s ``object_list`` into every rank's list of the same length."""
    pickle = _pickle_allowed(weights_only)
    root = checks.rank(root, "root", comm.get_size())
    _check_list(object_list, "object_list")
    mine = comm.get_rank() == root
    msg = codec.encode_message(list(object_list), allow_pickle=pickle) if mine else None
    with PartWay(comm._ended_part_way, "broadcast_object_list", comm._call_lock):
        received = bytes_io.broadcast_message(comm, msg, root, timeout)
    if not mine:
        _fill(object_list, codec.loads(received, allow_pickle=pickle), "object_list")


def send_object_list(
    comm: CommOps,
    object_list: list[Any],
    dst: int,
    timeout: float | datetime.timedelta | None = None,
    *,
    weights_only: bool = True,
) -> None:
    """Send ``object_list`` to ``dst`` (``weights_only=False``: unsupported types are
    pickled, for a receiver that also passes ``weights_only=False``)."""
    pickle = _pickle_allowed(weights_only)
    dst = checks.rank(dst, "dst", comm.get_size(), self_rank=comm.get_rank())
    _check_list(object_list, "object_list")
    msg = codec.encode_message(list(object_list), allow_pickle=pickle)
    with PartWay(comm._ended_part_way, "send_object_list"):
        bytes_io.send_message(comm, msg, dst, timeout)


def recv_object_list(
    comm: CommOps,
    object_list: list[Any],
    src: int,
    timeout: float | datetime.timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Fill ``object_list`` with what ``src`` sent (same number of objects)."""
    pickle = _pickle_allowed(weights_only)
    src = checks.rank(src, "src", comm.get_size(), self_rank=comm.get_rank())
    _check_list(object_list, "object_list")
    with PartWay(comm._ended_part_way, "recv_object_list"):
        received = bytes_io.recv_message(comm, src, timeout)
    _fill(object_list, codec.loads(received, allow_pickle=pickle), "object_list")


def scatter_object_list(
    comm: CommOps,
    root: int,
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    timeout: float | datetime.timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Rank ``i`` receives ``scatter_object_input_list[i]`` (from ``root``) in output slot 0."""
    pickle = _pickle_allowed(weights_only)
    root = checks.rank(root, "root", comm.get_size())
    _check_list(scatter_object_output_list, "scatter_object_output_list")
    if not scatter_object_output_list:
        raise GroupcoordValueError("scatter_object_output_list needs at least one slot")
    msgs = None
    if comm.get_rank() == root:
        inputs = _check_list(
            scatter_object_input_list, "scatter_object_input_list", comm.get_size()
        )
        msgs = [codec.encode_message(obj, allow_pickle=pickle) for obj in inputs]
    with PartWay(comm._ended_part_way, "scatter_object_list", comm._call_lock):
        received = bytes_io.scatter_messages(comm, msgs, root, timeout)
    scatter_object_output_list[0] = codec.loads(received, allow_pickle=pickle)


def _pickle_allowed(weights_only: Any) -> bool:
    """torchcomms' ``weights_only=True`` (the default) restricts what a receiver may
    rebuild; here it means no pickle at all (the codec's types only). ``False``
    lets unsupported types travel as pickle, a trust both sides must opt into."""
    return not checks.flag(weights_only, "weights_only")
