"""msgspec msgpack codec for everything groupcoord sends: plain data and tensors, no pickle.

Supported, round-tripping exactly: None, bool, int (any size), float, str,
bytes, list, tuple (stays a tuple), dict (any supported hashable keys), set,
frozenset, msgspec Structs, torch tensors (every dtype, any shape,
non-contiguous, but for the sub-byte integer dtypes torch cannot copy
strided: ``UNCOPYABLE_DTYPES``), torch dtypes / devices / ``torch.Size``, numpy arrays and
numpy scalars, the standard-library values of :mod:`.std_values` (slice,
range, complex, bytearray, datetime family, UUID, Decimal, OrderedDict,
deque); and dataclasses, enums and NamedTuples, which the receiver
rebuilds only when it declared them with :func:`add_safe_types`.
Anything else raises :class:`GroupcoordTypeError` naming the type, unless the
caller passes ``allow_pickle=True`` on both sides.

An encoded message is a small msgpack *header* plus *frames*: the raw bytes of
each tensor / array / large bytes value (the layout: :mod:`.framing`).
Decoding copies frame bytes into fresh tensors, so decoded values stay valid
after the source buffer is reused.

The encoder looks at each value's type once per class: the first value of a
class picks the method that rewrites it, later ones go straight there.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import pickle
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from itertools import chain, islice
from operator import countOf
from typing import Any

import msgspec

from . import framing as wire
from .array_frames import (
    DTYPE_CODES,
    UNCOPYABLE_DTYPES,
    dtype_code,
    dtype_name,
    ndarray_descr,
    not_its_values,
    plain_cpu_tensor,
    tensor_meta,
    torch_dtype,
)
from .decoding import MessageDecoder
from .errors import GroupcoordTypeError
from .framing import (
    FRAME_ALIGN,
    MESSAGE_PREFIX,
    EncodedMessage,
    frames_as_buffers,
    message_bytes,
    read_message,
    write_message,
)
from .safe_types import (
    add_safe_types,
    dataclass_fields,
    is_namedtuple,
    type_key,
    wire_module,
)
from .std_values import STD_TYPES, std_parts

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

# bytes values at least this large travel as their own frame (one copy on
# each side instead of two through the msgpack header).
BYTES_FRAME_THRESHOLD = 32 * 1024

_Ext = msgspec.msgpack.Ext
_SIMPLE = frozenset({type(None), bool, int, float, str})
_SIMPLE_KEYS = frozenset({type(None), bool, int, float, str, bytes})
_EMPTY: Any = object()  # what next() gives for a list of empty lists
_NO_FRAMES: tuple[()] = ()  # a message without frames shares this (nothing appends to it)


class Codec:
    """Encoder/decoder pair; one instance per thread (it keeps per-call state)."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self._enc = msgspec.msgpack.Encoder()
        self._decoder = MessageDecoder(allow_pickle)
        self._frames: list[Any] = []
        self._frame_lens: list[int] = []
        self._keepalive: list[Any] = []
        self._slow = False
        self._strided: Any = None  # torch.strided, once a tensor was met
        # type -> the method that rewrites its values (see _walker_for)
        self._walkers: dict[type, Callable[[Any], Any]] = {
            dict: self._walk_dict,
            list: self._walk_list,
            tuple: self._walk_tuple,
            bytes: self._walk_bytes,
            set: self._walk_set,
            frozenset: self._walk_set,
        }
        # dataclass -> (wire name, constructor fields, getter of their values)
        self._dataclasses: dict[type, tuple[str, tuple[str, ...], Callable[[Any], Any]]] = {}

    # -- encoding ---------------------------------------------------------

    def encode(self, obj: Any) -> EncodedMessage:
        """Encode ``obj`` into a header and zero-copy frames (the lists start empty:
        ``__init__`` and this method's ``finally`` leave them so)."""
        try:
            try:
                header = self._enc.encode(self._walk(obj))
            except (OverflowError, UnicodeEncodeError):
                # An int beyond 64 bits, or a str with a lone surrogate (JSON's
                # "\ud800" decodes to one): redo the (rare) slow walk that wraps them.
                self._frames = []
                self._frame_lens = []
                self._keepalive = []
                self._slow = True
                header = self._enc.encode(self._walk(obj))
            if not self._frames:  # the common small message: no lists to hand over
                return EncodedMessage(header, _NO_FRAMES, _NO_FRAMES, _NO_FRAMES)
            return EncodedMessage(header, self._frames, self._frame_lens, self._keepalive)
        finally:
            if self._frames:  # handed over with the message (or an error): fresh ones
                self._frames = []
                self._frame_lens = []
                self._keepalive = []
            self._slow = False

    def _walk(self, obj: Any) -> Any:
        """Return ``obj`` with every non-msgpack value replaced by an Ext (lazy copy)."""
        t = type(obj)
        if t in _SIMPLE:
            if self._slow:
                if t is int and not (-(2**63) <= obj < 2**64):
                    return _Ext(wire.EXT_BIGINT, str(obj).encode())
                if t is str and not _utf8(obj):
                    return _Ext(wire.EXT_SURROGATE_STR, obj.encode("utf-8", "surrogatepass"))
            return obj
        walker = self._walkers.get(t)
        if walker is None:
            walker = self._walkers[t] = self._walker_for(t)
        return walker(obj)

    def _walker_for(self, t: type) -> Callable[[Any], Any]:
        """The method that rewrites values of class ``t`` (asked once per class)."""
        if issubclass(t, msgspec.Struct):
            return self._walk_struct
        if issubclass(t, enum.Enum):
            return self._walk_enum
        if dataclasses.is_dataclass(t):
            try:
                self._dataclasses[t] = _dataclass_spec(t)
            except GroupcoordTypeError as exc:  # it cannot travel by its fields
                return _walk_pickled if self.allow_pickle else _refuser(str(exc))
            return self._walk_dataclass
        if is_namedtuple(t):
            return self._walk_namedtuple
        if t in STD_TYPES:
            return self._walk_std
        torch = sys.modules.get("torch")
        if torch is not None:
            if issubclass(t, torch.Tensor):
                problem = not_its_values(t)
                if problem is None:
                    self._strided = torch.strided
                    return self._walk_tensor
                if self.allow_pickle:
                    return _walk_pickled
                return _refuser(
                    f"cannot encode {problem}, or create the queue with allow_pickle=True"
                )
            if t is torch.dtype:
                return _walk_torch_dtype
            if t is torch.device:
                return _walk_torch_device
            if t is torch.Size:
                return self._walk_torch_size
        np = sys.modules.get("numpy")
        if np is not None:
            if issubclass(t, np.ndarray):
                return self._walk_ndarray
            if issubclass(t, np.generic):
                return self._walk_npscalar
        if self.allow_pickle:
            return _walk_pickled
        return _refuse

    def _walk_dict(self, d: dict[Any, Any]) -> Any:
        # Fast path (C-speed type scan): a dict of plain scalars needs no rewrite.
        if (
            not self._slow
            and _SIMPLE.issuperset(map(type, d.values()))
            and _SIMPLE_KEYS.issuperset(map(type, d))
        ):
            return d
        new: dict[Any, Any] | None = None
        simple_keys = _SIMPLE_KEYS
        slow = self._slow
        for i, (k, v) in enumerate(d.items()):
            if type(k) not in simple_keys or (slow and self._walk(k) is not k):
                return self._walk_pairs(d)  # keys a map cannot hold as they are
            v2 = v if type(v) in _SIMPLE and not slow else self._walk(v)
            if new is None:
                if v2 is v:
                    continue
                new = dict(islice(d.items(), i))
            new[k] = v2
        return d if new is None else new

    def _walk_pairs(self, d: dict[Any, Any]) -> Any:
        flat: list[Any] = []
        for k, v in d.items():
            flat.append(self._walk(k))
            flat.append(self._walk(v))
        return _Ext(wire.EXT_PAIRS, self._enc.encode(flat))

    def _walk_list(self, items: Collection[Any]) -> Collection[Any]:
        if self._slow:
            return [self._walk(v) for v in items]
        # C-speed type scans: a list of plain scalars, or of lists of them (token
        # ids per request), needs no rewrite. One type throughout (the common
        # case) is one countOf pass, 13 ns a value against 17-27 for the set test.
        if type(items) is list and items:
            first = items[0]
            kind = type(first)
            if kind in _SIMPLE and countOf(map(type, items), kind) == len(items):
                return items
            if kind is list and countOf(map(type, items), list) == len(items):
                flat = chain.from_iterable(items)
                head = next(flat, _EMPTY)
                if head is _EMPTY or (
                    type(head) in _SIMPLE
                    and countOf(map(type, flat), type(head)) == sum(map(len, items)) - 1
                ):
                    return items
        if _SIMPLE.issuperset(map(type, items)):  # mixed plain scalars
            return items
        walk = self._walk
        return [v if type(v) in _SIMPLE else walk(v) for v in items]

    def _walk_tuple(self, obj: tuple[Any, ...]) -> Any:
        return _Ext(wire.EXT_TUPLE, self._enc.encode(self._walk_list(obj)))

    def _walk_bytes(self, obj: bytes) -> Any:
        if len(obj) >= BYTES_FRAME_THRESHOLD:
            idx = self._add_frame(memoryview(obj), len(obj))
            return _Ext(wire.EXT_BYTES_FRAME, self._enc.encode(idx))
        return obj

    def _walk_set(self, obj: set[Any] | frozenset[Any]) -> Any:
        code = wire.EXT_SET if type(obj) is set else wire.EXT_FROZENSET
        return _Ext(code, self._enc.encode(self._walk_list(obj)))

    def _walk_struct(self, obj: msgspec.Struct) -> Any:
        cls = type(obj)
        values = self._walk_list([getattr(obj, name) for name in cls.__struct_fields__])
        key = [wire_module(cls), cls.__qualname__, values]
        return _Ext(wire.EXT_STRUCT, self._enc.encode(key))

    def _walk_enum(self, obj: enum.Enum) -> Any:
        return _Ext(wire.EXT_ENUM, self._enc.encode([type_key(type(obj)), self._walk(obj.value)]))

    def _walk_dataclass(self, obj: Any) -> Any:
        key, fields, getter = self._dataclasses[type(obj)]  # made with its walker
        try:
            values = getter(obj)
        except AttributeError:  # an init=False field never set: it travels unset
            fields = tuple(name for name in fields if hasattr(obj, name))
            values = [getattr(obj, name) for name in fields]
        # One pass that builds the field map: the hot path of an engine's step
        # (a plain value goes as is, anything else straight to its class's
        # walker, or through _walk the first time a class is met).
        walk = self._walk
        walker_of = self._walkers.get
        simple = _SIMPLE if not self._slow else ()
        named = {
            name: v if (t := type(v)) in simple else (walker_of(t) or walk)(v)
            for name, v in zip(fields, values)
        }
        return _Ext(wire.EXT_DATACLASS, self._enc.encode([key, named]))

    def _walk_namedtuple(self, obj: tuple[Any, ...]) -> Any:
        fields = self._walk_list(obj)
        return _Ext(wire.EXT_NAMEDTUPLE, self._enc.encode([type_key(type(obj)), fields]))

    def _walk_std(self, obj: Any) -> Any:
        return _Ext(wire.EXT_STD, self._enc.encode(std_parts(obj, self._walk)))

    def _add_frame(self, frame: Any, nbytes: int) -> int:
        self._frames.append(frame)
        self._frame_lens.append(nbytes)
        return len(self._frames) - 1

    def _walk_tensor(self, t: Any) -> Any:
        # Hot path of small-tensor messages: every step is inlined and skipped
        # when not needed (about 1.3 µs for a plain contiguous CPU tensor).
        try:
            shape = t.shape
        except RuntimeError as exc:
            if t.is_nested:
                raise GroupcoordTypeError(
                    "cannot encode a nested tensor, which has no one shape: send its "
                    "components (unbind()) or a padded tensor"
                ) from exc
            raise
        if (
            t.requires_grad
            or not t.is_cpu
            or t.is_conj()
            or t.is_neg()
            or t.layout is not self._strided
        ):
            t = plain_cpu_tensor(t)
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            code = dtype_code(t.dtype)
        nbytes = t.nbytes
        frames = self._frames
        if not nbytes:
            frames.append(b"")
        elif t.is_contiguous():
            # The address of the tensor's own memory (no copy), kept alive with the message.
            frames.append(t.data_ptr())
            self._keepalive.append(t)
        else:
            if dtype_name(t.dtype) in UNCOPYABLE_DTYPES:
                raise GroupcoordTypeError(
                    f"cannot encode a non-contiguous {t.dtype} tensor: torch copies no "
                    "tensor of this dtype element by element (send one made contiguous "
                    "before it was sliced or transposed)"
                )
            frames.append(t)  # copied strided straight into the destination
        self._frame_lens.append(nbytes)
        return _Ext(wire.EXT_TENSOR, tensor_meta(code, len(frames) - 1, shape))

    def _walk_torch_size(self, size: Any) -> Any:
        return _Ext(wire.EXT_TORCH_SIZE, self._enc.encode(list(size)))

    def _walk_ndarray(self, a: Any) -> Any:
        import numpy as np

        descr = ndarray_descr(a.dtype)
        frame: Any = a.reshape(-1).view(np.uint8).data if a.flags.c_contiguous else a
        if a.nbytes == 0:
            frame = b""
        idx = self._add_frame(frame, a.nbytes)
        return _Ext(wire.EXT_NDARRAY, self._enc.encode([descr, list(a.shape), idx]))

    def _walk_npscalar(self, s: Any) -> Any:
        descr = ndarray_descr(s.dtype)
        return _Ext(wire.EXT_NPSCALAR, self._enc.encode([descr, s.tobytes()]))

    # -- decoding (MessageDecoder) ------------------------------------------

    def decode(
        self, header: bytes | memoryview, frames: Sequence[memoryview] = (), *, owned: bool = False
    ) -> Any:
        """Decode a header whose frames are given. Frame bytes are copied out, unless
        ``owned``: the frames are the caller's to give away (a buffer it made for
        this message), and tensors are built on them without a copy."""
        return self._decoder.decode(header, frames, owned=owned)

    def decode_header_only(self, header: bytes | memoryview) -> Any:
        """Decode a message that has no frames (the common small-object case)."""
        return self._decoder.decode_header_only(header)


def _utf8(text: str) -> bool:
    """Whether UTF-8 can hold ``text`` (msgpack's str): no lone surrogate."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _dataclass_spec(cls: type) -> tuple[str, tuple[str, ...], Callable[[Any], Sequence[Any]]]:
    """(wire name, fields, a getter of their values) of a dataclass."""
    fields = dataclass_fields(cls)
    if len(fields) >= 2:
        return type_key(cls), fields, operator.attrgetter(*fields)
    return type_key(cls), fields, lambda obj: [getattr(obj, name) for name in fields]


def _walk_torch_dtype(dtype: Any) -> Any:
    return _Ext(wire.EXT_TORCH_DTYPE, str(dtype).encode())


def _walk_torch_device(device: Any) -> Any:
    return _Ext(wire.EXT_TORCH_DEVICE, str(device).encode())


def _walk_pickled(obj: Any) -> Any:
    return _Ext(wire.EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _refuser(reason: str) -> Callable[[Any], Any]:
    """A walker that refuses every value of its class, saying ``reason``."""

    def refuse(obj: Any) -> Any:
        raise GroupcoordTypeError(reason)

    return refuse


def _refuse(obj: Any) -> Any:
    t = type(obj)
    raise GroupcoordTypeError(
        f"cannot encode an object of type {t.__module__}.{t.__qualname__} without pickle; "
        "supported: None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, "
        "dataclasses, enums, NamedTuples, msgspec.Struct, torch.Tensor, numpy.ndarray, "
        "slice, range, complex, bytearray, datetime/date/time/timedelta, UUID, Decimal, "
        "OrderedDict, deque "
        "(or create the queue with allow_pickle=True)"
    )


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
    """Encode ``obj`` into one ``bytes`` (header and frames, see :mod:`.framing`)."""
    return message_bytes(_codec(allow_pickle).encode(obj))


def loads(data: bytes | bytearray | memoryview, *, allow_pickle: bool = False) -> Any:
    """Decode what :func:`dumps` produced; raises ProtocolError on malformed input."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    try:
        return read_message(_codec(allow_pickle), view)
    finally:
        view.release()
