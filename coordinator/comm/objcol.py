"""Object collectives over a :class:`Comm` that cannot run code on receipt.

Objects are encoded with ``shm_broadcast.codec`` (msgspec msgpack: plain data,
msgspec Structs, tensors and numpy arrays). Anything else is refused at the
sender, and a received message that carries a pickle is refused at the
receiver, unless that side passes ``allow_pickle=True``: the safe behaviour of
``torch.load(weights_only=True)`` is the default, with no way for a peer to
opt a receiver in. Signatures follow ``torch.distributed`` with the comm first.
"""

from __future__ import annotations

from typing import Any

from device_communicators import checks
from shm_broadcast import codec

from ..errors import GroupcoordTypeError, GroupcoordValueError
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
    timeout: float | None = None,
    allow_pickle: bool = False,
) -> None:
    """Fill ``object_list`` (one slot per rank) with every rank's ``obj``."""
    _check_list(object_list, "object_list", comm.get_size())
    data = codec.dumps(obj, allow_pickle=allow_pickle)
    gathered = bytes_io.all_gather_bytes(comm, data, timeout)
    object_list[:] = [codec.loads(b, allow_pickle=allow_pickle) for b in gathered]


def gather_object(
    comm: CommOps,
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int = 0,
    timeout: float | None = None,
    allow_pickle: bool = False,
) -> None:
    """Rank ``dst`` fills ``object_gather_list`` with every rank's ``obj``."""
    dst = checks.rank(dst, "dst", comm.get_size())
    if comm.get_rank() == dst:
        _check_list(object_gather_list, "object_gather_list", comm.get_size())
    data = codec.dumps(obj, allow_pickle=allow_pickle)
    gathered = bytes_io.gather_bytes(comm, data, dst, timeout)
    if gathered is not None and object_gather_list is not None:
        object_gather_list[:] = [codec.loads(b, allow_pickle=allow_pickle) for b in gathered]


def broadcast_object_list(
    comm: CommOps,
    object_list: list[Any],
    src: int = 0,
    timeout: float | None = None,
    allow_pickle: bool = False,
) -> None:
    """Copy ``src``'s ``object_list`` into every rank's list of the same length."""
    src = checks.rank(src, "src", comm.get_size())
    _check_list(object_list, "object_list")
    data = (
        codec.dumps(list(object_list), allow_pickle=allow_pickle)
        if comm.get_rank() == src
        else None
    )
    received = bytes_io.broadcast_bytes(comm, data, src, timeout)
    if comm.get_rank() != src:
        _fill(object_list, codec.loads(received, allow_pickle=allow_pickle), "object_list")


def send_object_list(
    comm: CommOps,
    object_list: list[Any],
    dst: int,
    timeout: float | None = None,
    allow_pickle: bool = False,
) -> None:
    dst = checks.rank(dst, "dst", comm.get_size(), self_rank=comm.get_rank())
    _check_list(object_list, "object_list")
    bytes_io.send_bytes(
        comm, codec.dumps(list(object_list), allow_pickle=allow_pickle), dst, timeout
    )


def recv_object_list(
    comm: CommOps,
    object_list: list[Any],
    src: int,
    timeout: float | None = None,
    allow_pickle: bool = False,
) -> None:
    """Fill ``object_list`` with what ``src`` sent (same number of objects)."""
    src = checks.rank(src, "src", comm.get_size(), self_rank=comm.get_rank())
    _check_list(object_list, "object_list")
    received = bytes_io.recv_bytes(comm, src, timeout)
    _fill(object_list, codec.loads(received, allow_pickle=allow_pickle), "object_list")


def scatter_object_list(
    comm: CommOps,
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    timeout: float | None = None,
    allow_pickle: bool = False,
) -> None:
    """Rank ``i`` receives ``scatter_object_input_list[i]`` in output slot 0."""
    src = checks.rank(src, "src", comm.get_size())
    _check_list(scatter_object_output_list, "scatter_object_output_list")
    if not scatter_object_output_list:
        raise GroupcoordValueError("scatter_object_output_list needs at least one slot")
    items = None
    if comm.get_rank() == src:
        inputs = _check_list(
            scatter_object_input_list, "scatter_object_input_list", comm.get_size()
        )
        items = [codec.dumps(obj, allow_pickle=allow_pickle) for obj in inputs]
    received = bytes_io.scatter_bytes(comm, items, src, timeout)
    scatter_object_output_list[0] = codec.loads(received, allow_pickle=allow_pickle)
