"""Standard-library value types on the wire: slices, ranges, complex numbers,
bytearrays, dates and times, UUIDs, Decimals, OrderedDicts and deques.

What pickle would carry for an engine and msgpack has no type for: a
multimodal input's ``slice`` placeholders, a request's arrival ``datetime``,
its ``UUID``. Each travels as one extension value, ``[tag, parts]``, and is
rebuilt by its own constructor from plain parts, so a round trip gives an equal
value of the same type. Only these exact classes (a subclass is refused, as is
a time zone other than a fixed-offset ``datetime.timezone``: rebuilding a
``zoneinfo`` zone reads the system's zone files).
"""

from __future__ import annotations

import collections
import datetime
import decimal
import uuid
from collections.abc import Callable
from typing import Any

from .errors import GroupcoordTypeError, ProtocolError

__all__ = ["STD_TYPES", "rebuild", "std_parts"]

_Walk = Callable[[Any], Any]

_TAGS: dict[type, int] = {
    slice: 0,
    range: 1,
    complex: 2,
    bytearray: 3,
    datetime.datetime: 4,
    datetime.date: 5,
    datetime.time: 6,
    datetime.timedelta: 7,
    uuid.UUID: 8,
    decimal.Decimal: 9,
    collections.OrderedDict: 10,
    collections.deque: 11,
}
STD_TYPES = frozenset(_TAGS)


def _zone(tz: datetime.tzinfo | None) -> Any:
    """A fixed-offset zone as [offset in microseconds, name or None]; None: naive."""
    if tz is None:
        return None
    if type(tz) is not datetime.timezone:
        raise GroupcoordTypeError(
            f"cannot encode a time with tzinfo {type(tz).__module__}.{type(tz).__qualname__} "
            "without pickle: only naive times and datetime.timezone offsets are supported"
        )
    offset = tz.utcoffset(None)
    name = tz.tzname(None)
    default = datetime.timezone(offset).tzname(None)
    return [offset // datetime.timedelta(microseconds=1), None if name == default else name]


def _unzone(parts: Any) -> datetime.timezone | None:
    if parts is None:
        return None
    micros, name = parts
    offset = datetime.timedelta(microseconds=micros)
    return datetime.timezone(offset) if name is None else datetime.timezone(offset, name)


def std_parts(obj: Any, walk: _Walk) -> list[Any]:
    """``[tag, parts]`` for a value of one of ``STD_TYPES``; ``walk`` rewrites
    the values a slice or container holds."""
    t = type(obj)
    tag = _TAGS[t]
    parts: Any
    if t is slice or t is range:
        parts = [walk(obj.start), walk(obj.stop), walk(obj.step)]
    elif t is complex:
        parts = [obj.real, obj.imag]
    elif t is bytearray:
        parts = bytes(obj)
    elif t is datetime.datetime:
        parts = [
            [obj.year, obj.month, obj.day, obj.hour, obj.minute, obj.second, obj.microsecond],
            obj.fold,
            _zone(obj.tzinfo),
        ]
    elif t is datetime.date:
        parts = [obj.year, obj.month, obj.day]
    elif t is datetime.time:
        parts = [[obj.hour, obj.minute, obj.second, obj.microsecond], obj.fold, _zone(obj.tzinfo)]
    elif t is datetime.timedelta:
        parts = [obj.days, obj.seconds, obj.microseconds]
    elif t is uuid.UUID:
        parts = obj.bytes
    elif t is decimal.Decimal:
        parts = str(obj)
    elif t is collections.OrderedDict:
        parts = [walk(v) for item in obj.items() for v in item]
    else:  # deque
        parts = [[walk(v) for v in obj], obj.maxlen]
    return [tag, parts]


def _rebuild_datetime(parts: Any) -> datetime.datetime:
    (year, month, day, hour, minute, second, micro), fold, zone = parts
    zone = _unzone(zone)
    return datetime.datetime(year, month, day, hour, minute, second, micro, zone, fold=fold)


def _rebuild_time(parts: Any) -> datetime.time:
    (hour, minute, second, micro), fold, zone = parts
    return datetime.time(hour, minute, second, micro, _unzone(zone), fold=fold)


def _typed(parts: Any, kind: type, what: str) -> Any:
    """``parts`` when it is a ``kind`` (crafted bytes could make bytearray(10**12))."""
    if type(parts) is not kind:
        raise ProtocolError(f"{what} travels as {kind.__name__}, got {type(parts).__name__}")
    return parts


_REBUILD: tuple[Callable[[Any], Any], ...] = (
    lambda p: slice(*p),
    lambda p: range(*p),
    lambda p: complex(*p),
    lambda p: bytearray(_typed(p, bytes, "a bytearray")),
    _rebuild_datetime,
    lambda p: datetime.date(*p),
    _rebuild_time,
    lambda p: datetime.timedelta(*p),
    lambda p: uuid.UUID(bytes=_typed(p, bytes, "a UUID")),
    lambda p: decimal.Decimal(_typed(p, str, "a Decimal")),
    lambda p: collections.OrderedDict(zip(p[::2], p[1::2])),
    lambda p: collections.deque(*p),
)


def rebuild(value: Any) -> Any:
    """The value ``[tag, parts]`` describes (decoded parts: plain values)."""
    tag, parts = value
    if type(tag) is not int or not 0 <= tag < len(_REBUILD):
        raise ProtocolError(f"unknown standard-library value tag {tag!r}")
    return _REBUILD[tag](parts)
