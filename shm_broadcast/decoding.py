"""Decoding one message: msgpack header back into values, frames back into tensors.

The receiving half of :class:`~shm_broadcast.codec.Codec`. Each msgpack
extension code (:mod:`.framing`) has one method; a class a message names is
rebuilt only through :mod:`.safe_types`, and no module is ever imported.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from . import framing as wire
from .array_frames import (
    decode_ndarray,
    decode_tensor,
    numpy_dtype,
    torch_dtype,
)
from .errors import GroupcoordError, ProtocolError, UndeclaredTypeError
from .safe_types import imported_struct, safe_type
from .std_values import rebuild

__all__ = ["MessageDecoder"]

# What crafted or corrupted bytes can make the decoding steps raise (a bad
# dtype name, a shape that does not fit, an int literal that is not one, deep
# nesting ...). Decoding turns each into ProtocolError, the one error callers
# expect from bad input. An opted-in pickle payload is trusted and not wrapped.
_MALFORMED = (
    msgspec.DecodeError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    ArithmeticError,  # OverflowError, and decimal.InvalidOperation for a bad Decimal
    AttributeError,
    RuntimeError,
    RecursionError,
    struct.error,
)
_EXT_TENSOR = wire.EXT_TENSOR


class MessageDecoder:
    """Decodes headers (and their frames); one instance per thread (per-call state)."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self._dec = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._in_frames: Sequence[memoryview] = ()
        self._frames_owned = False
        self._decoders: dict[int, Callable[[memoryview], Any]] = {
            wire.EXT_TUPLE: self._decode_tuple,
            wire.EXT_STRUCT: self._decode_struct,
            wire.EXT_PAIRS: self._decode_pairs,
            wire.EXT_BYTES_FRAME: self._decode_bytes_frame,
            wire.EXT_NDARRAY: self._decode_ndarray,
            wire.EXT_NPSCALAR: self._decode_npscalar,
            wire.EXT_BIGINT: _decode_bigint,
            wire.EXT_TORCH_DTYPE: _decode_torch_dtype,
            wire.EXT_TORCH_DEVICE: _decode_torch_device,
            wire.EXT_TORCH_SIZE: self._decode_torch_size,
            wire.EXT_DATACLASS: self._decode_dataclass,
            wire.EXT_ENUM: self._decode_enum,
            wire.EXT_NAMEDTUPLE: self._decode_namedtuple,
            wire.EXT_SET: self._decode_set,
            wire.EXT_FROZENSET: self._decode_frozenset,
            wire.EXT_STD: self._decode_std,
            wire.EXT_SURROGATE_STR: _decode_surrogate_str,
            wire.EXT_PICKLE: self._decode_pickle,
        }

    def decode(
        self, header: bytes | memoryview, frames: Sequence[memoryview] = (), *, owned: bool = False
    ) -> Any:
        """Decode a header whose frames are given. Frame bytes are copied out, unless
        ``owned``: the frames are the caller's to give away (a buffer it made for
        this message), and tensors are built on them without a copy."""
        self._in_frames = frames
        self._frames_owned = owned
        try:
            return self.decode_header_only(header)
        finally:
            self._in_frames = ()
            self._frames_owned = False

    def decode_header_only(self, header: bytes | memoryview) -> Any:
        """Decode a message that has no frames (the common small-object case)."""
        try:
            return self._dec.decode(header)
        except UndeclaredTypeError as exc:
            exc.outline = _outline(header)
            exc.taken = True
            raise  # names the class and the fix
        except _MALFORMED as exc:
            error = ProtocolError(f"cannot decode message: {type(exc).__name__}: {exc}")
            error.outline = _outline(header)
            error.taken = True
            raise error from exc
        except GroupcoordError as exc:  # a value in it refused (a frame, a dtype)
            exc.taken = True
            raise

    def _frame(self, idx: Any) -> memoryview:
        if type(idx) is not int or not 0 <= idx < len(self._in_frames):
            raise ProtocolError(f"message refers to frame {idx!r} of {len(self._in_frames)}")
        return self._in_frames[idx]

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_TENSOR:  # the hot path, straight there
            return decode_tensor(data, self._in_frames, self._frames_owned)
        decoder = self._decoders.get(code)
        if decoder is None:
            raise ProtocolError(f"unknown msgpack extension type {code}")
        return decoder(data)

    def _decode_tuple(self, data: memoryview) -> Any:
        return tuple(self._dec.decode(data))

    def _decode_struct(self, data: memoryview) -> Any:
        module, qualname, values = self._dec.decode(data)
        return imported_struct(module, qualname, values)

    def _decode_pairs(self, data: memoryview) -> Any:
        flat = self._dec.decode(data)
        return dict(zip(flat[::2], flat[1::2]))

    def _decode_bytes_frame(self, data: memoryview) -> Any:
        return bytes(self._frame(self._dec.decode(data)))

    def _decode_ndarray(self, data: memoryview) -> Any:
        descr, shape, idx = self._dec.decode(data)
        return decode_ndarray(descr, shape, self._frame(idx))

    def _decode_npscalar(self, data: memoryview) -> Any:
        import numpy as np

        descr, raw = self._dec.decode(data)
        return np.frombuffer(raw, dtype=numpy_dtype(descr))[0]

    def _decode_torch_size(self, data: memoryview) -> Any:
        import torch

        return torch.Size(self._dec.decode(data))

    def _decode_dataclass(self, data: memoryview) -> Any:
        key, values = self._dec.decode(data)
        return safe_type(key, "dataclass").rebuild(values)

    def _decode_enum(self, data: memoryview) -> Any:
        key, value = self._dec.decode(data)
        return safe_type(key, "enum")(value)

    def _decode_namedtuple(self, data: memoryview) -> Any:
        key, values = self._dec.decode(data)
        return safe_type(key, "NamedTuple")(*values)

    def _decode_set(self, data: memoryview) -> Any:
        return set(self._dec.decode(data))

    def _decode_frozenset(self, data: memoryview) -> Any:
        return frozenset(self._dec.decode(data))

    def _decode_std(self, data: memoryview) -> Any:
        return rebuild(self._dec.decode(data))

    def _decode_pickle(self, data: memoryview) -> Any:
        if not self.allow_pickle:
            raise ProtocolError(
                "message holds a pickled object but this side has allow_pickle=False"
            )
        return pickle.loads(data)  # noqa: S301 - explicit opt-in by both sides


def _outline(header: bytes | memoryview) -> Any:
    """``header`` as plain values, its extension values left undecoded (see
    ``ProtocolError.outline``); None when it is not msgpack at all."""
    try:
        return msgspec.msgpack.decode(header)
    except _MALFORMED:  # bad UTF-8, nesting too deep ...: no outline either
        return None


def _decode_bigint(data: memoryview) -> Any:
    return int(bytes(data))


def _decode_surrogate_str(data: memoryview) -> Any:
    return bytes(data).decode("utf-8", "surrogatepass")


def _decode_torch_dtype(data: memoryview) -> Any:
    return torch_dtype(bytes(data).decode()[6:])


def _decode_torch_device(data: memoryview) -> Any:
    import torch

    return torch.device(bytes(data).decode())
