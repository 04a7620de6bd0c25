"""The wire layout of one encoded message: a msgpack header plus raw frames.

Layout (``write_message`` / ``read_message``; ``message_bytes`` makes the same
layout as one ``bytes``)::

    u32 header_len | u32 n_frames | u64 frame_len * n_frames | header | pad | frame0 | pad | frame1 ...

Frames start at multiples of :data:`FRAME_ALIGN` from the message start, so a
frame in a page-aligned chunk is aligned for every dtype. A frame is copied
straight from the tensor's memory into the destination (a shared-memory
chunk, say), with no intermediate buffer.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from .array_frames import LARGE_DECODE_BYTES
from .errors import ProtocolError

__all__ = [
    "FRAME_ALIGN",
    "MESSAGE_PREFIX",
    "EncodedMessage",
    "frames_as_buffers",
    "message_bytes",
    "read_message",
    "write_message",
]

FRAME_ALIGN = 64

# Ext type codes (msgpack allows 0..127 for applications).
EXT_TUPLE = 1
EXT_STRUCT = 2
EXT_TENSOR = 3
EXT_NDARRAY = 4
EXT_NPSCALAR = 5
EXT_BIGINT = 6
EXT_PAIRS = 7  # a dict whose keys msgpack maps cannot hold directly (tuples ...)
EXT_BYTES_FRAME = 8
EXT_TORCH_DTYPE = 9
EXT_TORCH_DEVICE = 10
EXT_TORCH_SIZE = 11
EXT_PICKLE = 12
EXT_DATACLASS = 13
EXT_ENUM = 14
EXT_SET = 15
EXT_FROZENSET = 16
EXT_NAMEDTUPLE = 17
EXT_STD = 18  # a standard-library value (slice, datetime, UUID ...): std_values.py
EXT_SURROGATE_STR = 19  # a str UTF-8 cannot hold (lone surrogates): "surrogatepass" bytes

_PREFIX = struct.Struct("<II")
MESSAGE_PREFIX = _PREFIX  # u32 header_len, u32 n_frames: starts every written message
_FRAME_LEN = struct.Struct("<Q")
_PREFIX_BYTES = _PREFIX.size
_FRAME_LEN_BYTES = _FRAME_LEN.size
_ALIGN_MASK = FRAME_ALIGN - 1
_FRAME_LENS: dict[int, struct.Struct] = {}  # frame count -> the layout of their lengths


def _frame_lens(count: int) -> struct.Struct:
    layout = _FRAME_LENS.get(count)
    if layout is None:
        layout = _FRAME_LENS[count] = struct.Struct(f"<{count}Q")
    return layout


def _align(n: int) -> int:
    return (n + FRAME_ALIGN - 1) & ~(FRAME_ALIGN - 1)


class EncodedMessage:
    """Header plus frames of one encoded object; ``nbytes`` is its wire size."""

    __slots__ = ("header", "frames", "frame_lens", "nbytes", "keepalive")

    def __init__(
        self,
        header: bytes,
        frames: Sequence[Any],
        frame_lens: Sequence[int],
        keepalive: Sequence[Any],
    ) -> None:
        self.header = header
        # The tensors whose memory the frames point into, kept alive with them.
        self.keepalive = keepalive
        # Each frame is a contiguous uint8 memoryview or bytes; an int, the
        # address of contiguous memory a keepalive object owns; or a
        # (non-contiguous) tensor / ndarray that write_message copies strided.
        self.frames = frames
        self.frame_lens = frame_lens
        size = _PREFIX_BYTES + len(header)
        if frame_lens:
            size += _FRAME_LEN_BYTES * len(frame_lens)
            for n in frame_lens:
                size += (-size & _ALIGN_MASK) + n
        self.nbytes = size


def write_message(
    msg: EncodedMessage, dest: memoryview, offset: int = 0, address: int | None = None
) -> int:
    """Write ``msg`` at ``dest[offset:]``; return bytes written. ``address`` is
    where ``dest[0]`` lives, if the caller knows (a mapped segment)."""
    if offset + msg.nbytes > len(dest):
        raise ValueError(f"a message of {msg.nbytes} bytes does not fit at {offset} of {len(dest)}")
    frames = msg.frames
    header = msg.header
    lens = msg.frame_lens
    _PREFIX.pack_into(dest, offset, len(header), len(frames))
    pos = offset + _PREFIX.size
    if lens:
        _frame_lens(len(lens)).pack_into(dest, pos, *lens)
        pos += _FRAME_LEN.size * len(lens)
    end = pos + len(header)
    dest[pos:end] = header
    for frame, n in zip(frames, lens):
        start = end + (-(end - offset) & (FRAME_ALIGN - 1))
        end = start + n
        if n == 0:
            continue
        if type(frame) is int:
            if address is None:
                address = _address_of(dest)
            ctypes.memmove(address + start, frame, n)
        elif type(frame) is memoryview or type(frame) is bytes:
            dest[start:end] = frame
        else:
            _copy_strided(frame, dest[start:end])
    return end - offset


def _address_of(dest: memoryview) -> int:
    holder = ctypes.c_char.from_buffer(dest)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # the export ends here: the address is used only while dest is


def _copy_strided(src: Any, dest: memoryview) -> None:
    """Copy a non-contiguous tensor/array straight into ``dest`` (no temporary)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(src, np.ndarray):
        np.ndarray(src.shape, dtype=src.dtype, buffer=dest)[...] = src
        return
    import torch

    target = torch.frombuffer(dest, dtype=torch.uint8).view(src.dtype).view(src.shape)
    target.copy_(src)


class HeaderDecoder(Protocol):
    """What :func:`read_message` decodes with (a ``Codec``)."""

    def decode(
        self, header: memoryview, frames: Sequence[memoryview] = (), *, owned: bool = False
    ) -> Any: ...


def read_message(codec: HeaderDecoder, src: memoryview, offset: int = 0) -> Any:
    """Decode a message written by :func:`write_message` at ``src[offset:]``.

    Frames that are small together (an engine step's few small tensors) are
    copied out as one bytearray the decoded tensors share: one copy, no
    allocation per tensor."""
    try:
        header_len, n_frames = _PREFIX.unpack_from(src, offset)
        pos = offset + _PREFIX.size
        if pos + _FRAME_LEN.size * n_frames > len(src):
            raise ProtocolError(f"message of {n_frames} frames runs past the buffer")
        lens = _frame_lens(n_frames).unpack_from(src, pos) if n_frames else ()
    except struct.error as exc:
        raise ProtocolError(f"truncated message prefix: {exc}") from exc
    pos += _FRAME_LEN.size * n_frames
    end = pos + header_len
    if end > len(src):
        raise ProtocolError(f"message header runs past the buffer ({end} > {len(src)})")
    spans = []
    for n in lens:
        start = end + (-(end - offset) & (FRAME_ALIGN - 1))
        end = start + n
        spans.append((start, end))
    if end > len(src):
        raise ProtocolError(f"message frame runs past the buffer ({end} > {len(src)})")
    header = src[pos : pos + header_len]
    try:
        if not spans:
            return codec.decode(header)
        first = spans[0][0]
        if end - first < LARGE_DECODE_BYTES:
            blob = memoryview(bytearray(src[first:end]))
            frames = [blob[a - first : b - first] for a, b in spans]
            return codec.decode(header, frames, owned=True)
        frames = [src[a:b] for a, b in spans]
        try:
            return codec.decode(header, frames)
        finally:
            for f in frames:
                f.release()
    finally:
        header.release()


def frames_as_buffers(msg: EncodedMessage) -> list[Any]:
    """``[header, frame0, ...]`` as contiguous buffers, for transports that keep frame
    boundaries themselves (ZeroMQ multipart); decode with ``codec.decode(parts[0], parts[1:])``."""
    return [msg.header] + [_frame_buffer(f, n) for f, n in zip(msg.frames, msg.frame_lens)]


def message_bytes(msg: EncodedMessage) -> bytes:
    """An encoded message as one ``bytes``, the form ``codec.loads`` reads."""
    if not msg.frames:
        return _PREFIX.pack(len(msg.header), 0) + msg.header
    parts: list[Any] = [_PREFIX.pack(len(msg.header), len(msg.frames))]
    parts.extend(_FRAME_LEN.pack(n) for n in msg.frame_lens)
    parts.append(msg.header)
    pos = _PREFIX.size + _FRAME_LEN.size * len(msg.frames) + len(msg.header)
    for frame, n in zip(msg.frames, msg.frame_lens):
        parts.append(bytes(_align(pos) - pos))
        parts.append(_frame_buffer(frame, n))
        pos = _align(pos) + n
    # One copy of each frame, into the joined result.
    return b"".join(parts)


def _frame_buffer(frame: Any, nbytes: int) -> Any:
    """A frame as a contiguous buffer (what a transport or ``bytes.join`` takes)."""
    if isinstance(frame, (memoryview, bytes)):
        return frame
    if type(frame) is int:
        return memoryview((ctypes.c_char * nbytes).from_address(frame)).cast("B")
    np = sys.modules.get("numpy")
    if np is not None and isinstance(frame, np.ndarray):
        return np.ascontiguousarray(frame).reshape(-1).view(np.uint8).data
    import torch

    return memoryview(frame.contiguous().reshape(-1).view(torch.uint8).numpy())
