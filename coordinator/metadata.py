"""A tensor dict on the wire: encoded once, by the codec, with a list of the
tensors that travel on their own.

A tensor dict (str keys; tensors of any dtype, empty ones included, mixed
with plain values) goes through ``shm_broadcast.codec`` as one message,
``[values, separate]``. ``values`` is the dict itself: CPU tensors small
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

from shm_broadcast.codec import EncodedMessage, dtype_name, encode_message, loads, torch_dtype

from .errors import GroupcoordTypeError, ProtocolError

__all__ = ["Described", "SeparateTensor", "checked", "decode", "describe", "encode", "rebuild"]


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
    inline_max_bytes: int | None,
    slices: Callable[[str, torch.Tensor], int] | None = None,
) -> tuple[Described, list[torch.Tensor]]:
    """The dict to encode and the tensors that must travel separately, in key order.

    CPU tensors up to ``inline_max_bytes`` (every CPU tensor with None) stay in
    the dict; ``slices(key, tensor)`` gives N > 0 for tensors that go as 1/N
    slices (never inside). Raises ``GroupcoordTypeError`` for a non-dict or a
    non-str key before anything is sent.
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
            n = slices(key, value) if slices is not None else 0
            on_cpu = value.is_cpu
            if (
                n
                or not on_cpu
                or (inline_max_bytes is not None and value.nbytes > inline_max_bytes)
            ):
                device = "cpu" if on_cpu else value.device.type
                separate[key] = SeparateTensor(value.dtype, tuple(value.shape), device, n)
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
        return encode_message([described.values, wire])
    except GroupcoordTypeError as exc:
        for key, value in described.values.items():
            try:
                encode_message(value)
            except GroupcoordTypeError as inner:
                raise GroupcoordTypeError(f"tensor_dict[{key!r}]: {inner}") from exc
        raise


def decode(data: bytes | memoryview) -> Described:
    """A described dict from the bytes of :func:`encode` (``ProtocolError`` if malformed)."""
    return checked(loads(data))


def checked(message: Any) -> Described:
    """The described dict a decoded message holds; ``ProtocolError`` if it holds none."""
    if not (
        isinstance(message, list)
        and len(message) == 2
        and isinstance(message[0], dict)
        and isinstance(message[1], list)
    ):
        raise ProtocolError(f"expected a tensor dict message, got {type(message).__qualname__}")
    values, wire = message
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
