"""Hand-built codec messages for the hostile-bytes tests (the layout of shm_broadcast.codec).

``u32 header_len | u32 n_frames | u64 frame_len * n | header | pad | frame0 | pad | frame1 ...``
with frames at multiples of ``FRAME_ALIGN``; the header is msgpack whose
extension types carry tuples, tensors, arrays, Structs and (opt-in) pickles.
"""

from __future__ import annotations

import pathlib
import struct
from collections.abc import Sequence

import msgspec

from shm_broadcast.codec import FRAME_ALIGN, EncodedMessage

EXT_PICKLE = 12  # the codec's extension code for an opt-in pickle


def wire(header: bytes, frames: Sequence[bytes] = ()) -> bytes:
    """One message in the codec's single-buffer layout."""
    out = bytearray(struct.pack("<II", len(header), len(frames)))
    for frame in frames:
        out += struct.pack("<Q", len(frame))
    out += header
    for frame in frames:
        out += bytes(-len(out) % FRAME_ALIGN)
        out += frame
    return bytes(out)


def tensor_header(code: int, frame: int, *dims: int) -> bytes:
    """A tensor's extension body: u8 dtype code | u32 frame index | u64 per dim."""
    return struct.pack(f"<BI{len(dims)}Q", code, frame, *dims)


def ext(code: int, payload: object) -> bytes:
    """A header holding one extension value whose body is ``payload`` in msgpack."""
    body = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, body))


class CreatesFile:
    """Unpickling this creates a file: the visible proof that wire bytes ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def pickle_bomb(path: str) -> bytes:
    """A codec message whose only value is a pickle that would create ``path``."""
    return wire(pickle_bomb_message(path).header)


def pickle_bomb_message(path: str) -> EncodedMessage:
    """:func:`pickle_bomb` as an encoded message (what the group's object broadcasts send)."""
    import pickle

    return EncodedMessage(ext(EXT_PICKLE, pickle.dumps(CreatesFile(path))), [], [], [])
