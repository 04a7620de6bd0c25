"""A tensor dict on the wire: encoded once, by the codec, with a list of the
tensors that travel on their own.

A tensor dict (str keys; tensors of any dtype, empty ones included, mixed
with plain values) goes through ``shm_broadcast.codec`` as one message,
``[TENSOR_DICT, values, separate]``. ``values`` is the dict itself: CPU tensors small
enough to ride inside (all of them on the message-queue path, where the codec
writes them straight into shared memory) become frames of the message. Every
other tensor holds its key's place as ``None`` and is described in
``separate``, one flat list of plain values (which the codec passes through
without a walk): ``key, dtype name, device type, slices, ndim, *shape`` per
tensor. Those tensors travel afterwards as their own transfers (Gloo, NCCL or
a shared-memory channel), in key order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from device_communicators import checks
from shm_broadcast.codec import EncodedMessage, dtype_name, encode_message, loads, torch_dtype
from shm_broadcast.p2p_channels import TENSOR_OBJECT

from .errors import DesyncError, GroupcoordTypeError, ProtocolError

__all__ = [
    "OBJECT_LIST",
    "TENSOR_DICT",
    "Described",
    "SeparateTensor",
    "checked",
    "decode",
    "describe",
    "dropped",
    "encode",
    "expect",
    "object_message",
    "received_object",
    "rebuild",
]

# The first item of a tensor dict's message and of broadcast_object_list's, so a
# receive that meets the message of another kind of call (a plain object, a
# tensor dict, an object list) raises instead of returning the other call's.
TENSOR_DICT = "groupcoord:tensor_dict"
OBJECT_LIST = "groupcoord:object_list"
_SENT = {
    TENSOR_DICT: "a tensor dict (send_tensor_dict or broadcast_tensor_dict)",
    OBJECT_LIST: "an object list (broadcast_object_list)",
    TENSOR_OBJECT: "a tensor as an object (send_object)",
}


def expect(message: Any, kind: str | None, called: str, src: int) -> Any:
    """``message`` when it is of ``kind`` (None: a plain object, ``send_object``'s
    or ``broadcast_object``'s), else ``DesyncError``: ``called`` (who called what),
    then what in-group rank ``src`` sent."""
    got = None
    if type(message) is list and message and type(message[0]) is str and message[0] in _SENT:
        got = message[0]
    if got == kind:
        return message
    if got is not None:
        sent = _SENT[got]
    elif isinstance(message, torch.Tensor):  # over the channels, send's and send_object's
        sent = "a tensor (send, or an object that is one)"
    else:
        sent = "an object (send_object or broadcast_object)"
    raise DesyncError(f"{called}, and rank {src} sent {sent}: the ranks' calls are out of step")


def object_message(obj: Any) -> Any:
    """What ``send_object`` sends for ``obj``: a tensor goes marked (see
    ``p2p_channels.TENSOR_OBJECT``), anything else as itself."""
    return [TENSOR_OBJECT, obj] if isinstance(obj, torch.Tensor) else obj


def received_object(message: Any, called: str, src: int) -> Any:
    """The object of :func:`object_message`'s ``message``; ``send``'s tensor or another
    kind of call's message is a ``DesyncError`` (see :func:`expect`)."""
    if type(message) is list and len(message) == 2 and message[0] == TENSOR_OBJECT:
        return message[1]
    if isinstance(message, torch.Tensor):
        raise DesyncError(
            f"{called}, and rank {src} sent a {dtype_name(message.dtype)}[{message.numel()}] "
            "tensor (send): the ranks' calls are out of step"
        )
    return expect(message, None, called, src)


class SeparateTensor(NamedTuple):
    """A tensor that travels after the dict's message."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str  # the sender's device type: "cpu", "cuda", ...
    # N > 0: each of N peers sent its 1/N slice; the receiver all-gathers the whole.
    slices: int = 0


class Described(NamedTuple):
    """A tensor dict ready to encode, or just decoded."""

    values: dict[str, Any]  # None where a separate tensor goes
    separate: dict[str, SeparateTensor]  # in key order: the order the tensors travel


def describe(
    tensor_dict: Mapping[str, Any],
    device: torch.device,
    inline_max_bytes: int | None,
    slices: Callable[[str, torch.Tensor], int] | None = None,
) -> tuple[Described, list[torch.Tensor]]:
    """The dict to encode and the tensors that must travel separately, in key order.

    CPU tensors up to ``inline_max_bytes`` (every CPU tensor with None) stay in
    the dict; ``slices(key, tensor)`` gives N > 0 for tensors that go as 1/N
    slices (never inside). Raises before anything is sent for a non-dict, a
    non-str key, or a tensor no transfer can carry (``checks.dict_tensor``: sparse,
    nested, on a device other than the CPU and the group's ``device``), which
    used to fail after the dict's message had gone, leaving the receivers waiting
    for its tensors.
    """
    if not isinstance(tensor_dict, Mapping):
        raise GroupcoordTypeError(
            f"tensor_dict must be a dict, got {type(tensor_dict).__qualname__}"
        )
    values: dict[str, Any] = {}
    separate: dict[str, SeparateTensor] = {}
    tensors: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if not isinstance(key, str):
            raise GroupcoordTypeError(f"tensor_dict keys must be str, got {key!r}")
        if isinstance(value, torch.Tensor):
            checks.dict_tensor(value, f"tensor_dict[{key!r}]", device)
            n = slices(key, value) if slices is not None else 0
            on_cpu = value.is_cpu
            if (
                n
                or not on_cpu
                or (inline_max_bytes is not None and value.nbytes > inline_max_bytes)
            ):
                kind = "cpu" if on_cpu else value.device.type
                separate[key] = SeparateTensor(value.dtype, tuple(value.shape), kind, n)
                tensors.append(value)
                value = None
        values[key] = value
    return Described(values, separate), tensors


def encode(described: Described) -> EncodedMessage:
    """The one encoding of a described dict; a value the codec refuses is named by key."""
    wire: list[Any] = []
    for key, t in described.separate.items():
        wire += (key, dtype_name(t.dtype), t.device, t.slices, len(t.shape), *t.shape)
    try:
        return encode_message([TENSOR_DICT, described.values, wire])
    except GroupcoordTypeError as exc:
        for key, value in described.values.items():
            try:
                encode_message(value)
            except GroupcoordTypeError as inner:
                raise GroupcoordTypeError(f"tensor_dict[{key!r}]: {inner}") from exc
        raise


def decode(data: bytes | memoryview, called: str, src: int) -> Described:
    """A described dict from the bytes of :func:`encode` (``ProtocolError`` if malformed,
    ``DesyncError`` naming ``called`` if another kind of call sent them)."""
    return checked(loads(data), called, src)


def checked(message: Any, called: str, src: int) -> Described:
    """The described dict a decoded message holds: ``DesyncError`` (see
    :func:`expect`) for another kind of message, ``ProtocolError`` if malformed."""
    expect(message, TENSOR_DICT, called, src)
    if not (len(message) == 3 and isinstance(message[1], dict) and isinstance(message[2], list)):
        raise ProtocolError("malformed tensor dict message")
    _, values, wire = message
    if not all(isinstance(k, str) for k in values):
        raise ProtocolError("tensor dict message has a key that is not a str")
    separate: dict[str, SeparateTensor] = {}
    at = 0
    while at < len(wire):
        spec = wire[at : at + 5]
        try:
            key, name, device, n, ndim = spec
            shape = tuple(wire[at + 5 : at + 5 + ndim])
            ok = (
                values.get(key, 0) is None
                and key not in separate
                and type(name) is str
                and type(device) is str
                and type(n) is int
                and n >= 0
                and len(shape) == ndim
                and all(type(s) is int and s >= 0 for s in shape)
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ProtocolError(f"tensor dict message: malformed tensor description {spec!r}")
        separate[key] = SeparateTensor(torch_dtype(name), shape, device, n)
        at += 5 + ndim
    return Described(values, separate)


def dropped(exc: ProtocolError) -> Described | None:
    """What a tensor dict whose message did not decode (``exc``: a class this side has
    not declared, say) sends after its message, so the receiver can take those
    transfers before it raises: then its pair or group stays in step, and its next
    receive gets the next dict. None when the message was no tensor dict's, or
    not msgpack at all (nothing can be known of what follows)."""
    return tensor_dict_in(exc.outline)


def tensor_dict_in(message: Any) -> Described | None:
    """The described dict ``message`` holds when it is a well-formed tensor dict's
    message, else None."""
    try:
        return checked(message, "", 0)
    except (ProtocolError, DesyncError):
        return None


def rebuild(
    described: Described, receive: Callable[[SeparateTensor], torch.Tensor]
) -> dict[str, Any]:
    """The tensor dict; ``receive(item)`` fetches each separate tensor, in key order."""
    values, separate = described
    if not separate:
        return values
    return {
        key: receive(separate[key]) if key in separate else value for key, value in values.items()
    }
