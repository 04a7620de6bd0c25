"""Tensor-dict metadata as msgspec Structs: what travels ahead of the tensors.

A tensor dict (str keys; tensors of any dtype, empty ones included, mixed
with plain values) is described by one :class:`TensorDictMeta`. Small CPU
tensors ride inside it (``inline``), so a dict of small tensors costs one
message; larger ones follow as separate tensor transfers, in key order.
Plain values are encoded with ``shm_broadcast.codec`` (no pickle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from shm_broadcast.codec import dumps, loads

from .errors import GroupcoordTypeError, ProtocolError


class TensorMeta(msgspec.Struct, tag="tensor", array_like=True, frozen=True):
    """One tensor: dtype name ("float32"), shape, device type ("cpu"), and how it travels."""

    dtype: str
    shape: tuple[int, ...]
    device: str
    # The tensor's bytes when it rides inside the metadata (small CPU tensors).
    inline: bytes | None = None
    # N > 0: each of N peers sent its 1/N slice; the receiver all-gathers the whole.
    slices: int = 0


class ValueMeta(msgspec.Struct, tag="value", array_like=True, frozen=True):
    """A plain (non-tensor) value, encoded with ``shm_broadcast.codec``."""

    payload: bytes


class TensorDictMeta(msgspec.Struct, array_like=True, frozen=True):
    """Keys in order and, for each, the tensor description or the value."""

    keys: list[str]
    items: list[TensorMeta | ValueMeta]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TensorDictMeta)
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def encode_meta(meta: TensorDictMeta) -> bytes:
    return _ENCODER.encode(meta)


def decode_meta(data: bytes | memoryview) -> TensorDictMeta:
    try:
        meta = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"tensor-dict metadata does not decode: {exc}") from exc
    if len(meta.keys) != len(meta.items):
        raise ProtocolError(
            f"tensor-dict metadata has {len(meta.keys)} keys but {len(meta.items)} items"
        )
    return meta


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype {name!r} in tensor-dict metadata") from None


def describe(
    tensor_dict: Mapping[str, Any],
    inline_max_bytes: int,
    slices: Callable[[str, torch.Tensor], int] | None = None,
) -> tuple[TensorDictMeta, list[torch.Tensor]]:
    """Metadata for ``tensor_dict`` and the tensors that must travel separately.

    ``slices(key, tensor)`` gives N > 0 for tensors that go as 1/N slices
    (they never ride inline); other CPU tensors up to ``inline_max_bytes`` ride inline.
    Raises ``GroupcoordTypeError`` naming the offending key before anything is sent.
    """
    if not isinstance(tensor_dict, Mapping):
        raise GroupcoordTypeError(
            f"tensor_dict must be a dict, got {type(tensor_dict).__qualname__}"
        )
    keys: list[str] = []
    items: list[TensorMeta | ValueMeta] = []
    separate: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if not isinstance(key, str):
            raise GroupcoordTypeError(f"tensor_dict keys must be str, got {key!r}")
        keys.append(key)
        if not isinstance(value, torch.Tensor):
            try:
                items.append(ValueMeta(dumps(value)))
            except TypeError as exc:
                raise GroupcoordTypeError(f"tensor_dict[{key!r}]: {exc}") from exc
            continue
        meta = TensorMeta(
            str(value.dtype).removeprefix("torch."), tuple(value.shape), value.device.type
        )
        n = slices(key, value) if slices is not None else 0
        if n:
            items.append(msgspec.structs.replace(meta, slices=n))
            separate.append(value)
        elif (
            value.device.type == "cpu" and value.numel() * value.element_size() <= inline_max_bytes
        ):
            items.append(msgspec.structs.replace(meta, inline=tensor_bytes(value)))
        else:
            items.append(meta)
            separate.append(value)
    return TensorDictMeta(keys, items), separate


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of the tensor's elements in row-major order, as bytes."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(meta: TensorMeta, data: bytes) -> torch.Tensor:
    dtype = dtype_from_name(meta.dtype)
    if not data:
        return torch.empty(meta.shape, dtype=dtype)
    # bytearray: the tensor owns writable memory independent of the message.
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(meta.shape)


def rebuild(meta: TensorDictMeta, receive: Callable[[TensorMeta], torch.Tensor]) -> dict[str, Any]:
    """The tensor dict; ``receive(tensor_meta)`` fetches each separate tensor in order."""
    out: dict[str, Any] = {}
    for key, item in zip(meta.keys, meta.items):
        if isinstance(item, ValueMeta):
            out[key] = loads(item.payload)
        elif item.inline is not None:
            out[key] = tensor_from_bytes(item, item.inline)
        else:
            out[key] = receive(item)
    return out
