"""msgspec msgpack codec for everything groupcoord sends: plain data and tensors, no pickle.

Supported, round-tripping exactly: None, bool, int (any size), float, str,
bytes, list, tuple (stays a tuple), dict (any supported hashable keys), set,
frozenset, msgspec Structs, torch tensors (every dtype, any shape,
non-contiguous), torch dtypes / devices / ``torch.Size``, numpy arrays and
numpy scalars; and dataclasses, enums and NamedTuples, which the receiver
rebuilds only when it declared them with :func:`add_safe_types`.
Anything else raises :class:`GroupcoordTypeError` naming the type, unless the
caller passes ``allow_pickle=True`` on both sides.

An encoded message is a small msgpack *header* plus *frames*: the raw bytes of
each tensor / array / large bytes value, which :func:`write_message` copies
straight from the tensor's memory into the destination (a shared-memory chunk,
say) without an intermediate buffer. Decoding copies frame bytes into fresh
tensors, so decoded values stay valid after the source buffer is reused.

Wire layout of one message (``write_message`` / ``read_message``; ``dumps``
/ ``loads`` use the same layout in a single ``bytes``)::

    u32 header_len | u32 n_frames | u64 frame_len * n_frames | header | pad | frame0 | pad | frame1 ...

Frames start at multiples of :data:`FRAME_ALIGN` from the message start, so a
frame in a page-aligned chunk is aligned for every dtype.

torch is imported only when a tensor is encoded or decoded, so a pure-Python
scheduler can use this module without paying for torch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import pickle
import struct
import sys
import threading
from collections.abc import Sequence
from itertools import islice
from typing import Any

import msgspec

from .errors import GroupcoordTypeError, ProtocolError, UndeclaredTypeError

__all__ = [
    "FRAME_ALIGN",
    "MESSAGE_PREFIX",
    "Codec",
    "EncodedMessage",
    "add_safe_types",
    "dtype_name",
    "dumps",
    "encode_message",
    "frames_as_buffers",
    "loads",
    "message_bytes",
    "read_message",
    "torch_dtype",
    "write_message",
]

FRAME_ALIGN = 64
# bytes values at least this large travel as their own frame (one copy on
# each side instead of two through the msgpack header).
BYTES_FRAME_THRESHOLD = 32 * 1024

_PREFIX = struct.Struct("<II")
MESSAGE_PREFIX = _PREFIX  # u32 header_len, u32 n_frames: starts every written message
_FRAME_LEN = struct.Struct("<Q")

# Ext type codes (msgpack allows 0..127 for applications).
_EXT_TUPLE = 1
_EXT_STRUCT = 2
_EXT_TENSOR = 3
_EXT_NDARRAY = 4
_EXT_NPSCALAR = 5
_EXT_BIGINT = 6
_EXT_PAIRS = 7  # a dict whose keys msgpack maps cannot hold directly (tuples ...)
_EXT_BYTES_FRAME = 8
_EXT_TORCH_DTYPE = 9
_EXT_TORCH_DEVICE = 10
_EXT_TORCH_SIZE = 11
_EXT_PICKLE = 12
_EXT_DATACLASS = 13
_EXT_ENUM = 14
_EXT_SET = 15
_EXT_FROZENSET = 16
_EXT_NAMEDTUPLE = 17

# Classes a receiver may rebuild from a message (dataclasses, enums, NamedTuples),
# declared by the receiving process with add_safe_types; keyed by module:qualname.
_SAFE_TYPES: dict[str, type] = {}
_SAFE_LOCK = threading.Lock()


def _type_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_INIT_FIELDS: dict[type, tuple[str, ...]] = {}


def _init_fields(cls: type) -> tuple[str, ...]:
    """The names a dataclass's constructor takes, in order (asked once per class)."""
    names = _INIT_FIELDS.get(cls)
    if names is None:
        names = _INIT_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    return names


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make")


def add_safe_types(types: Sequence[type]) -> None:
    """Declare classes this process may rebuild when it decodes a message: dataclasses
    (frozen, slots, nested, with defaults), ``enum.Enum``/``IntEnum``/``Flag`` and
    ``typing.NamedTuple`` classes (named after ``torch.serialization.add_safe_globals``).

    Decoding calls nothing but a declared class's constructor (or, for an enum, its
    value lookup) and never imports a module. Sending needs no declaration; an
    undeclared class in a received message raises ``GroupcoordTypeError`` naming it.
    msgspec Structs, sets and frozensets need none.
    """
    checked = []
    for cls in types:
        if not isinstance(cls, type) or not (
            dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum) or _is_namedtuple(cls)
        ):
            raise GroupcoordTypeError(
                f"add_safe_types: {cls!r} is not a dataclass, enum or NamedTuple class"
            )
        checked.append(cls)
    with _SAFE_LOCK:
        for cls in checked:
            _SAFE_TYPES[_type_key(cls)] = cls


def _safe_type(key: str, kind: str) -> Any:
    cls = _SAFE_TYPES.get(key)
    if cls is None:
        module, _, qualname = key.partition(":")
        raise UndeclaredTypeError(
            f"the message holds {kind} {module}.{qualname}, which this process has not "
            f"declared safe to rebuild: call shm_broadcast.add_safe_types([{qualname}]) "
            "on the receiving side first"
        )
    return cls


_Ext = msgspec.msgpack.Ext
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
    OverflowError,
    AttributeError,
    RuntimeError,
    RecursionError,
    struct.error,
)
_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> name on the wire, filled on first use
_DTYPES_BY_NAME: dict[str, Any] = {}  # the reverse, filled on first use
_SIMPLE = frozenset({type(None), bool, int, float, str})
_SIMPLE_KEYS = frozenset({type(None), bool, int, float, str, bytes})


def _align(n: int) -> int:
    return (n + FRAME_ALIGN - 1) & ~(FRAME_ALIGN - 1)


class EncodedMessage:
    """Header plus frames of one encoded object; ``nbytes`` is its wire size."""

    __slots__ = ("header", "frames", "frame_lens", "nbytes", "keepalive")

    def __init__(
        self, header: bytes, frames: list[Any], frame_lens: list[int], keepalive: list[Any]
    ) -> None:
        self.header = header
        # The tensors whose memory the frames point into, kept alive with them.
        self.keepalive = keepalive
        # Each frame is a contiguous uint8 memoryview, or a (non-contiguous)
        # tensor / ndarray that write_message copies strided into place.
        self.frames = frames
        self.frame_lens = frame_lens
        size = _PREFIX.size + _FRAME_LEN.size * len(frames) + len(header)
        for n in frame_lens:
            size = _align(size) + n
        self.nbytes = size


class Codec:
    """Encoder/decoder pair; one instance per thread (it keeps per-call state)."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._frames: list[Any] = []
        self._frame_lens: list[int] = []
        self._keepalive: list[Any] = []
        self._in_frames: Sequence[memoryview] = ()
        self._frames_owned = False
        self._bigints = False

    # -- encoding ---------------------------------------------------------

    def encode(self, obj: Any) -> EncodedMessage:
        """Encode ``obj`` into a header and zero-copy frames."""
        self._frames = []
        self._frame_lens = []
        self._keepalive = []
        self._bigints = False
        try:
            try:
                header = self._enc.encode(self._walk(obj))
            except OverflowError:
                # An int beyond 64 bits: redo the (rare) slow walk that wraps them.
                self._frames = []
                self._frame_lens = []
                self._bigints = True
                header = self._enc.encode(self._walk(obj))
            return EncodedMessage(header, self._frames, self._frame_lens, self._keepalive)
        finally:
            self._frames = []
            self._frame_lens = []
            self._keepalive = []

    def _walk(self, obj: Any) -> Any:
        """Return ``obj`` with every non-msgpack value replaced by an Ext (lazy copy)."""
        t = type(obj)
        if t in _SIMPLE:
            if t is int and self._bigints and not (-(2**63) <= obj < 2**64):
                return _Ext(_EXT_BIGINT, str(obj).encode())
            return obj
        if t is dict:
            return self._walk_dict(obj)
        if t is list:
            return self._walk_list(obj)
        if t is tuple:
            return _Ext(_EXT_TUPLE, self._enc.encode(self._walk_list(list(obj))))
        if t is bytes:
            if len(obj) >= BYTES_FRAME_THRESHOLD:
                idx = self._add_frame(memoryview(obj), len(obj))
                return _Ext(_EXT_BYTES_FRAME, self._enc.encode(idx))
            return obj
        if isinstance(obj, msgspec.Struct):
            return self._walk_struct(obj)
        if t is set or t is frozenset:
            code = _EXT_SET if t is set else _EXT_FROZENSET
            return _Ext(code, self._enc.encode(self._walk_list(list(obj))))
        if isinstance(obj, enum.Enum):
            return _Ext(_EXT_ENUM, self._enc.encode([_type_key(t), self._walk(obj.value)]))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            values = {name: self._walk(getattr(obj, name)) for name in _init_fields(t)}
            return _Ext(_EXT_DATACLASS, self._enc.encode([_type_key(t), values]))
        if isinstance(obj, tuple) and _is_namedtuple(t):
            fields = self._walk_list(list(obj))
            return _Ext(_EXT_NAMEDTUPLE, self._enc.encode([_type_key(t), fields]))
        torch = sys.modules.get("torch")
        if torch is not None:
            if isinstance(obj, torch.Tensor):
                return self._walk_tensor(obj)
            if t is torch.dtype:
                return _Ext(_EXT_TORCH_DTYPE, str(obj).encode())
            if t is torch.device:
                return _Ext(_EXT_TORCH_DEVICE, str(obj).encode())
            if t is torch.Size:
                return _Ext(_EXT_TORCH_SIZE, self._enc.encode(list(obj)))
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(obj, np.ndarray):
                return self._walk_ndarray(obj)
            if isinstance(obj, np.generic):
                return self._walk_npscalar(obj)
        if self.allow_pickle:
            return _Ext(_EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        raise GroupcoordTypeError(
            f"cannot encode an object of type {t.__module__}.{t.__qualname__} without pickle; "
            "supported: None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, "
            "dataclasses, enums, NamedTuples, msgspec.Struct, torch.Tensor, numpy.ndarray "
            "(or create the queue with allow_pickle=True)"
        )

    def _walk_dict(self, d: dict[Any, Any]) -> Any:
        # Fast path (C-speed type scan): a dict of plain scalars needs no rewrite.
        if (
            not self._bigints
            and _SIMPLE.issuperset(map(type, d.values()))
            and _SIMPLE_KEYS.issuperset(map(type, d))
        ):
            return d
        new: dict[Any, Any] | None = None
        simple_keys = _SIMPLE_KEYS
        for i, (k, v) in enumerate(d.items()):
            if type(k) not in simple_keys:
                return self._walk_pairs(d)
            v2 = v if type(v) in _SIMPLE and not self._bigints else self._walk(v)
            k2 = k if not self._bigints else self._walk(k)
            if new is None:
                if v2 is v and k2 is k:
                    continue
                new = dict(islice(d.items(), i))
            new[k2] = v2
        return d if new is None else new

    def _walk_pairs(self, d: dict[Any, Any]) -> Any:
        flat: list[Any] = []
        for k, v in d.items():
            flat.append(self._walk(k))
            flat.append(self._walk(v))
        return _Ext(_EXT_PAIRS, self._enc.encode(flat))

    def _walk_list(self, items: list[Any]) -> list[Any]:
        if not self._bigints and _SIMPLE.issuperset(map(type, items)):
            return items
        new: list[Any] | None = None
        for i, v in enumerate(items):
            v2 = v if type(v) in _SIMPLE and not self._bigints else self._walk(v)
            if new is None:
                if v2 is v:
                    continue
                new = items[:i]
            new.append(v2)
        return items if new is None else new

    def _walk_struct(self, obj: msgspec.Struct) -> Any:
        cls = type(obj)
        values = self._walk_list([getattr(obj, name) for name in cls.__struct_fields__])
        return _Ext(_EXT_STRUCT, self._enc.encode([cls.__module__, cls.__qualname__, values]))

    def _add_frame(self, frame: Any, nbytes: int) -> int:
        self._frames.append(frame)
        self._frame_lens.append(nbytes)
        return len(self._frames) - 1

    def _walk_tensor(self, t: Any) -> Any:
        import torch

        if t.layout is not torch.strided:
            raise GroupcoordTypeError(f"cannot encode a tensor with layout {t.layout}")
        if t.is_quantized:
            raise GroupcoordTypeError(f"cannot encode a quantized tensor ({t.dtype})")
        # Each step below is skipped when not needed: this is the hot path of
        # small-tensor messages.
        if t.requires_grad:
            t = t.detach()
        if not t.is_cpu:
            t = t.cpu()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        nbytes = t.nbytes
        frame: Any
        if not t.is_contiguous():
            frame = t  # copied strided straight into the destination
        elif nbytes:
            # A byte view of the tensor's own memory (no copy); the tensor is
            # kept alive by the message for as long as the view is used.
            frame = memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
            self._keepalive.append(t)
        else:
            frame = b""
        idx = self._add_frame(frame, nbytes)
        return _Ext(_EXT_TENSOR, self._enc.encode([dtype_name(t.dtype), list(t.shape), idx]))

    def _walk_ndarray(self, a: Any) -> Any:
        import numpy as np

        if a.dtype.hasobject:
            raise GroupcoordTypeError("cannot encode a numpy array of dtype object without pickle")
        descr = np.lib.format.dtype_to_descr(a.dtype)
        frame: Any = a.reshape(-1).view(np.uint8).data if a.flags.c_contiguous else a
        if a.nbytes == 0:
            frame = b""
        idx = self._add_frame(frame, a.nbytes)
        return _Ext(_EXT_NDARRAY, self._enc.encode([descr, list(a.shape), idx]))

    def _walk_npscalar(self, s: Any) -> Any:
        import numpy as np

        if s.dtype.hasobject:
            raise GroupcoordTypeError("cannot encode a numpy object scalar without pickle")
        descr = np.lib.format.dtype_to_descr(s.dtype)
        return _Ext(_EXT_NPSCALAR, self._enc.encode([descr, s.tobytes()]))

    # -- decoding ---------------------------------------------------------

    def decode(
        self, header: bytes | memoryview, frames: Sequence[memoryview] = (), *, owned: bool = False
    ) -> Any:
        """Decode a header whose frames are given. Frame bytes are copied out, unless
        ``owned``: the frames are the caller's to give away (a buffer it made for
        this message), and tensors are built on them without a copy."""
        self._in_frames = frames
        self._frames_owned = owned
        try:
            return self._dec.decode(header)
        except UndeclaredTypeError:
            raise  # names the class and the fix
        except _MALFORMED as exc:
            raise ProtocolError(f"cannot decode message: {type(exc).__name__}: {exc}") from exc
        finally:
            self._in_frames = ()
            self._frames_owned = False

    def decode_header_only(self, header: bytes | memoryview) -> Any:
        """Decode a message that has no frames (the common small-object case)."""
        try:
            return self._dec.decode(header)
        except UndeclaredTypeError:
            raise  # names the class and the fix
        except _MALFORMED as exc:
            raise ProtocolError(f"cannot decode message: {type(exc).__name__}: {exc}") from exc

    def _frame(self, idx: Any) -> memoryview:
        if type(idx) is not int or not 0 <= idx < len(self._in_frames):
            raise ProtocolError(f"message refers to frame {idx!r} of {len(self._in_frames)}")
        return self._in_frames[idx]

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_TUPLE:
            return tuple(self._dec.decode(data))
        if code == _EXT_TENSOR:
            name, shape, idx = self._dec.decode(data)
            return _decode_tensor(name, shape, self._frame(idx), self._frames_owned)
        if code == _EXT_STRUCT:
            module, qualname, values = self._dec.decode(data)
            return _decode_struct(module, qualname, values)
        if code == _EXT_PAIRS:
            flat = self._dec.decode(data)
            return dict(zip(flat[::2], flat[1::2]))
        if code == _EXT_BYTES_FRAME:
            return bytes(self._frame(self._dec.decode(data)))
        if code == _EXT_NDARRAY:
            descr, shape, idx = self._dec.decode(data)
            return _decode_ndarray(descr, shape, self._frame(idx))
        if code == _EXT_NPSCALAR:
            import numpy as np

            descr, raw = self._dec.decode(data)
            return np.frombuffer(raw, dtype=_numpy_dtype(descr))[0]
        if code == _EXT_BIGINT:
            return int(bytes(data))
        if code == _EXT_TORCH_DTYPE:
            return torch_dtype(bytes(data).decode()[6:])
        if code == _EXT_TORCH_DEVICE:
            import torch

            return torch.device(bytes(data).decode())
        if code == _EXT_TORCH_SIZE:
            import torch

            return torch.Size(self._dec.decode(data))
        if code == _EXT_DATACLASS:
            key, values = self._dec.decode(data)
            return _safe_type(key, "dataclass")(**values)
        if code == _EXT_ENUM:
            key, value = self._dec.decode(data)
            return _safe_type(key, "enum")(value)
        if code == _EXT_NAMEDTUPLE:
            key, values = self._dec.decode(data)
            return _safe_type(key, "NamedTuple")(*values)
        if code == _EXT_SET:
            return set(self._dec.decode(data))
        if code == _EXT_FROZENSET:
            return frozenset(self._dec.decode(data))
        if code == _EXT_PICKLE:
            if not self.allow_pickle:
                raise ProtocolError(
                    "message holds a pickled object but this side has allow_pickle=False"
                )
            return pickle.loads(data)  # noqa: S301 - explicit opt-in by both sides
        raise ProtocolError(f"unknown msgpack extension type {code}")


def dtype_name(dtype: Any) -> str:
    """A torch dtype's name on the wire ("float32"); :func:`torch_dtype` reverses it."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)[6:]
    return name


def torch_dtype(name: str) -> Any:
    """The torch dtype a wire name stands for; ``ProtocolError`` for an unknown one."""
    dtype = _DTYPES_BY_NAME.get(name)
    if dtype is None:
        import torch

        dtype = getattr(torch, name, None) if type(name) is str else None
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"unknown torch dtype {name!r}")
        _DTYPES_BY_NAME[name] = dtype
    return dtype


# Decoded tensors at least this big get their memory from torch, not a bytearray.
_LARGE_DECODE_BYTES = 64 * 1024


def _decode_tensor(name: str, shape: list[int], frame: memoryview, owned: bool = False) -> Any:
    import torch

    dtype = torch_dtype(name)
    nbytes = len(frame)
    itemsize = dtype.itemsize
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * itemsize != nbytes:
        raise ProtocolError(f"tensor {name}{shape} needs {numel * itemsize} bytes, got {nbytes}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if owned:
        flat = torch.frombuffer(frame, dtype=dtype)  # the tensor keeps the buffer alive
    # One copy out of the (reusable) source buffer into memory the tensor owns.
    elif nbytes >= _LARGE_DECODE_BYTES:
        # Through torch's allocator: glibc recycles its large blocks, while a
        # fresh bytearray of MiBs page-faults on every call (8 x 8 MiB measured
        # 23 ms as bytearrays, 2 ms as torch.empty).
        import numpy as np

        raw = torch.empty(nbytes, dtype=torch.uint8)
        raw.numpy()[:] = np.frombuffer(frame, dtype=np.uint8)
        flat = raw.view(dtype)
    else:
        flat = torch.frombuffer(bytearray(frame), dtype=dtype)
    return flat if len(shape) == 1 else flat.view(shape)


def _numpy_dtype(descr: Any) -> Any:
    import numpy as np

    try:
        return np.lib.format.descr_to_dtype(_descr_from_wire(descr))
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"bad numpy dtype description {descr!r}") from exc


def _descr_from_wire(descr: Any) -> Any:
    """Undo msgpack's tuple -> list in a numpy descr (structured dtypes nest)."""
    if not isinstance(descr, list):
        return descr
    fields = []
    for field in descr:
        name = tuple(field[0]) if isinstance(field[0], list) else field[0]
        rest = [_descr_from_wire(field[1])]
        if len(field) > 2:
            rest.append(tuple(field[2]))
        fields.append((name, *rest))
    return fields


def _decode_ndarray(descr: Any, shape: list[int], frame: memoryview) -> Any:
    import numpy as np

    dtype = _numpy_dtype(descr)
    count = 1
    for dim in shape:
        count *= dim
    if count * dtype.itemsize != len(frame):
        raise ProtocolError(
            f"array {dtype}{shape} needs {count * dtype.itemsize} bytes, got {len(frame)}"
        )
    if count == 0:
        return np.empty(tuple(shape), dtype=dtype)
    # One copy into a bytearray the (writable) array then owns.
    return np.frombuffer(bytearray(frame), dtype=dtype).reshape(shape)


def _decode_struct(module: str, qualname: str, values: list[Any]) -> Any:
    # Only classes already imported by this process are resolved: decoding
    # never imports a module named by the wire (that would run its code).
    mod = sys.modules.get(module)
    cls: Any = mod
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        raise ProtocolError(
            f"message holds msgspec Struct {module}.{qualname}, which is not imported here"
        )
    fields = cls.__struct_fields__
    if len(fields) != len(values):
        raise ProtocolError(
            f"Struct {module}.{qualname}: {len(values)} values for {len(fields)} fields"
        )
    return cls(**dict(zip(fields, values)))


# -- framing ----------------------------------------------------------------


def write_message(msg: EncodedMessage, dest: memoryview, offset: int = 0) -> int:
    """Write ``msg`` at ``dest[offset:]`` (room for ``msg.nbytes`` needed); return bytes written."""
    frames = msg.frames
    header = msg.header
    pos = offset
    _PREFIX.pack_into(dest, pos, len(header), len(frames))
    pos += _PREFIX.size
    for n in msg.frame_lens:
        _FRAME_LEN.pack_into(dest, pos, n)
        pos += _FRAME_LEN.size
    end = pos + len(header)
    dest[pos:end] = header
    for frame, n in zip(frames, msg.frame_lens):
        start = offset + _align(end - offset)
        end = start + n
        if n == 0:
            continue
        if isinstance(frame, memoryview):
            dest[start:end] = frame
        else:
            _copy_strided(frame, dest[start:end])
    return end - offset


def _copy_strided(src: Any, dest: memoryview) -> None:
    """Copy a non-contiguous tensor/array straight into ``dest`` (no temporary)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(src, np.ndarray):
        np.ndarray(src.shape, dtype=src.dtype, buffer=dest)[...] = src
        return
    import torch

    target = torch.frombuffer(dest, dtype=torch.uint8).view(src.dtype).view(src.shape)
    target.copy_(src)


def read_message(codec: Codec, src: memoryview, offset: int = 0) -> Any:
    """Decode a message written by :func:`write_message` at ``src[offset:]``."""
    try:
        header_len, n_frames = _PREFIX.unpack_from(src, offset)
        pos = offset + _PREFIX.size
        lens = [_FRAME_LEN.unpack_from(src, pos + i * _FRAME_LEN.size)[0] for i in range(n_frames)]
    except struct.error as exc:
        raise ProtocolError(f"truncated message prefix: {exc}") from exc
    pos += _FRAME_LEN.size * n_frames
    end = pos + header_len
    if end > len(src):
        raise ProtocolError(f"message header runs past the buffer ({end} > {len(src)})")
    header = src[pos:end]
    frames = []
    for n in lens:
        start = offset + _align(end - offset)
        end = start + n
        if end > len(src):
            raise ProtocolError(f"message frame runs past the buffer ({end} > {len(src)})")
        frames.append(src[start:end])
    try:
        return codec.decode(header, frames)
    finally:
        header.release()
        for f in frames:
            f.release()


def frames_as_buffers(msg: EncodedMessage) -> list[Any]:
    """``[header, frame0, ...]`` as contiguous buffers, for transports that keep frame
    boundaries themselves (ZeroMQ multipart); decode with ``codec.decode(parts[0], parts[1:])``."""
    return [msg.header] + [
        f if isinstance(f, (memoryview, bytes)) else _contiguous_bytes(f) for f in msg.frames
    ]


# -- single-buffer form -------------------------------------------------------

_local = threading.local()


def _codec(allow_pickle: bool) -> Codec:
    key = "pickle" if allow_pickle else "plain"
    codec = getattr(_local, key, None)
    if codec is None:
        codec = Codec(allow_pickle=allow_pickle)
        setattr(_local, key, codec)
    return codec


def encode_message(obj: Any, *, allow_pickle: bool = False) -> EncodedMessage:
    """Encode ``obj`` once into header and frames (this thread's codec): what
    ``MessageQueue.enqueue`` accepts as is, and :func:`message_bytes` joins."""
    return _codec(allow_pickle).encode(obj)


def dumps(obj: Any, *, allow_pickle: bool = False) -> bytes:
    """Encode ``obj`` into one ``bytes`` (header and frames, see module doc)."""
    return message_bytes(_codec(allow_pickle).encode(obj))


def message_bytes(msg: EncodedMessage) -> bytes:
    """An encoded message as one ``bytes``, the form :func:`loads` reads."""
    if not msg.frames:
        return _PREFIX.pack(len(msg.header), 0) + msg.header
    parts: list[Any] = [_PREFIX.pack(len(msg.header), len(msg.frames))]
    parts.extend(_FRAME_LEN.pack(n) for n in msg.frame_lens)
    parts.append(msg.header)
    pos = _PREFIX.size + _FRAME_LEN.size * len(msg.frames) + len(msg.header)
    for frame, n in zip(msg.frames, msg.frame_lens):
        parts.append(bytes(_align(pos) - pos))
        parts.append(frame if isinstance(frame, (memoryview, bytes)) else _contiguous_bytes(frame))
        pos = _align(pos) + n
    # One copy of each frame, into the joined result.
    return b"".join(parts)


def _contiguous_bytes(src: Any) -> memoryview:
    np = sys.modules.get("numpy")
    if np is not None and isinstance(src, np.ndarray):
        return np.ascontiguousarray(src).reshape(-1).view(np.uint8).data
    import torch

    return memoryview(src.contiguous().reshape(-1).view(torch.uint8).numpy())


def loads(data: bytes | bytearray | memoryview, *, allow_pickle: bool = False) -> Any:
    """Decode what :func:`dumps` produced; raises ProtocolError on malformed input."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    try:
        return read_message(_codec(allow_pickle), view)
    finally:
        view.release()
