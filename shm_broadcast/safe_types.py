"""Which classes a message may name, and how the codec finds them again.

A receiver rebuilds a dataclass, enum or NamedTuple only when its process
declared the class with :func:`add_safe_types` (named after
``torch.serialization.add_safe_globals``); a msgspec Struct only when its
class is already imported. Nothing here ever imports a module a message names.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
import threading
from collections.abc import Sequence
from types import MemberDescriptorType
from typing import Any

import msgspec

from .errors import GroupcoordTypeError, ProtocolError, UndeclaredTypeError

__all__ = ["add_safe_types"]

# Classes a receiver may rebuild from a message, keyed by module:qualname
# (a dataclass by its DataclassPlan).
_SAFE_TYPES: dict[str, Any] = {}
_SAFE_LOCK = threading.Lock()


def wire_module(cls: type) -> str:
    """The module a class is named by on the wire.

    A ``multiprocessing`` child started by spawn or forkserver (how vLLM starts
    its workers) runs the parent's main script as ``__mp_main__`` and also
    lists it as ``sys.modules["__main__"]``: a class the script defines is
    ``__main__.X`` in the parent and ``__mp_main__.X`` in the child. The wire
    says ``__main__`` for both, so the class has one name in every process.
    """
    module = cls.__module__
    return "__main__" if module == "__mp_main__" else module


def type_key(cls: type) -> str:
    """A class's name on the wire."""
    return f"{wire_module(cls)}:{cls.__qualname__}"


def is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make")


def dataclass_fields(cls: type) -> tuple[str, ...]:
    """The fields a dataclass instance holds, in order: what travels.

    Raises when the constructor needs an argument that is not a field (an
    ``InitVar`` without a default, a hand-written ``__init__``): the receiver
    could not call it, and a default in its place could rebuild different
    values without a word. Raises too when a descriptor serves a field's name
    (a ``property``, a descriptor-typed field): what it reads need not be what
    storing that value again keeps (one that doubles what it stores made 6 arrive
    as 12), as with ``dataclasses.replace``.
    """
    names = tuple(f.name for f in dataclasses.fields(cls))
    described = _described_fields(cls, names)
    if described:
        raise GroupcoordTypeError(
            f"cannot send dataclass {cls.__module__}.{cls.__qualname__} without pickle: "
            f"descriptors serve its fields {described}, so the value read from one need "
            "not be what a receiver's constructor would store from it (make them plain "
            "fields, or use allow_pickle=True)"
        )
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the constructor decides
        return names
    needed = [
        p.name
        for p in params
        if p.name not in names
        and p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if needed:
        raise GroupcoordTypeError(
            f"cannot send dataclass {cls.__module__}.{cls.__qualname__} without pickle: its "
            f"constructor needs {needed}, which are not fields, so a receiver cannot "
            "rebuild it from its fields (give them defaults, or use allow_pickle=True)"
        )
    return names


class DataclassPlan:
    """How a receiver rebuilds one declared dataclass from its fields' values.

    The constructor runs (``__post_init__`` included, so attributes it sets
    that are not fields exist), with the fields it takes. When that may not
    give back the sender's values (a ``__post_init__``, fields with
    ``init=False``, a constructor not written by ``dataclasses``), every field
    is then set to the value sent, as unpickling would restore it: a field
    the sender changed after construction, or one ``__post_init__`` derives
    from an ``InitVar``, arrives as it was sent.

    Where the constructor is the one ``dataclasses`` wrote and would only store
    each field as given (no ``__post_init__``, every field in ``__init__``, a
    plain ``__new__``, ``__setattr__`` and metaclass, a ``__dict__``, no
    descriptor on a field's name), a message that names exactly the fields, in
    order, becomes the instance's ``__dict__`` without the call, as unpickling
    does: the same object, 1.5 us sooner for a 14-field engine step.
    """

    __slots__ = ("cls", "direct", "exact", "init", "known", "names")

    def __init__(self, cls: type) -> None:
        fields = dataclasses.fields(cls)
        self.cls = cls
        self.names = tuple(f.name for f in fields)
        self.known = frozenset(self.names)
        self.init = tuple(f.name for f in fields if f.init)
        init_fn = cls.__dict__.get("__init__")
        generated = getattr(getattr(init_fn, "__code__", None), "co_filename", "") == "<string>"
        self.exact = (
            generated and len(self.init) == len(self.names) and not hasattr(cls, "__post_init__")
        )
        self.direct = self.exact and _only_stores_fields(cls, self.names)

    def rebuild(self, values: dict[str, Any]) -> Any:
        if self.direct and tuple(values) == self.names:
            obj: Any = _new_object(self.cls)
            _set_attribute(obj, "__dict__", values)  # a dict decoded for this message alone
            return obj
        if self.exact:
            return self.cls(**values)
        unknown = values.keys() - self.known
        if unknown:
            raise ProtocolError(
                f"dataclass {self.cls.__qualname__} has no fields {sorted(map(str, unknown))}"
            )
        obj = self.cls(**{name: values[name] for name in self.init})
        for name in self.names:  # declared names only (an unset init=False field stays unset)
            if name in values:
                object.__setattr__(obj, name, values[name])
        return obj


_new_object = object.__new__
_set_attribute = object.__setattr__  # a frozen class's own raises


def _only_stores_fields(cls: type, names: Sequence[str]) -> bool:
    """Whether ``cls(**values)`` (its generated ``__init__``) would do no more than
    create a plain instance and store each value in its ``__dict__``."""
    frozen = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    if (
        cls.__new__ is not object.__new__
        or type(cls).__call__ is not type.__call__
        or (not frozen and cls.__setattr__ is not object.__setattr__)
        or any("__slots__" in vars(k) for k in cls.__mro__)
    ):
        return False
    return not _described_fields(cls, names)


def _described_fields(cls: type, names: Sequence[str]) -> list[str]:
    """The fields among ``names`` whose name a data descriptor of ``cls`` serves,
    a slot's own member excepted (it stores and reads the value as it is)."""
    described = []
    for name in names:
        for k in cls.__mro__:
            if name in vars(k):  # a default is a plain value; a property is not
                kind = type(vars(k)[name])
                if kind is not MemberDescriptorType and (
                    hasattr(kind, "__set__") or hasattr(kind, "__delete__")
                ):
                    described.append(name)
                break
    return described


def add_safe_types(types: Sequence[type]) -> None:
    """Declare classes this process may rebuild when it decodes a message: dataclasses
    (frozen, slots, nested, with defaults), ``enum.Enum``/``IntEnum``/``Flag`` and
    ``typing.NamedTuple`` classes (named after ``torch.serialization.add_safe_globals``).

    Decoding calls nothing but a declared class's constructor (or, for an enum, its
    value lookup; for a dataclass whose constructor would only store its fields,
    not even that), then sets a dataclass's declared fields to the values sent
    where the constructor may have changed them (:class:`DataclassPlan`), and
    never imports a module. Sending needs no declaration; an
    undeclared class in a received message raises ``GroupcoordTypeError`` naming it.
    msgspec Structs, sets and frozensets need none.
    """
    checked = []
    for cls in types:
        if not isinstance(cls, type) or not (
            dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum) or is_namedtuple(cls)
        ):
            raise GroupcoordTypeError(
                f"add_safe_types: {cls!r} is not a dataclass, enum or NamedTuple class"
            )
        checked.append(cls)
    entries = {type_key(c): DataclassPlan(c) if dataclasses.is_dataclass(c) else c for c in checked}
    with _SAFE_LOCK:
        _SAFE_TYPES.update(entries)


def safe_type(key: str, kind: str) -> Any:
    """The declared class a message names by ``key``; raises naming it and the fix."""
    cls = _SAFE_TYPES.get(key)
    if cls is None:
        module, _, qualname = key.partition(":")
        raise UndeclaredTypeError(
            f"the message holds {kind} {module}.{qualname}, which this process has not "
            f"declared safe to rebuild: call shm_broadcast.add_safe_types([{qualname}]) "
            "on the receiving side first"
        )
    return cls


def imported_struct(module: str, qualname: str, values: list[Any]) -> Any:
    """Rebuild a msgspec Struct whose class this process has already imported."""
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
