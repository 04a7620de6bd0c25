"""What a forked child may not use: its parent's groups, communicators and queues.

A process forked from a rank shares the rank's shared memory, sockets and
generation counters. Its calls on the rank's objects took part in the rank's
collectives and read its messages: at world 2, a child's ``all_reduce`` paired
with the peer's next call, which returned the child's values while the rank got
another sum, and no error anywhere. So every such object is registered here
(:func:`owned_here`) and, in a forked child, turned into one whose every use
raises :class:`ClosedError` naming the process it belongs to. What only
describes it (its name, ranks, size) stays readable, and closing it does nothing
in the child: it is the parent's to close. Nothing the parent owns is touched
(the objects keep their state, so no finaliser runs early either).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any

from .errors import ClosedError

__all__ = ["owned_here"]

# Methods that end an object: in a forked child they do nothing.
_CLOSERS = ("destroy", "close", "shutdown", "finalize", "abort")

_owned: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # obj -> its name
_readable: dict[type, frozenset[str]] = {}  # class -> what stays readable in a child
_child_classes: dict[type, type] = {}  # class -> its forked-child stand-in


def owned_here(obj: Any, what: str, readable: Iterable[str]) -> None:
    """Register ``obj`` (a group, communicator or queue of this process, named
    ``what`` in errors): in a child forked from here, every attribute but
    ``readable`` (and the dunders) raises."""
    _readable.setdefault(type(obj), frozenset(readable))
    _owned[obj] = what


def _child_class(cls: type) -> type:
    stand_in = _child_classes.get(cls)
    if stand_in is not None:
        return stand_in
    readable = _readable[cls] | set(_CLOSERS)

    def __getattribute__(self: Any, name: str) -> Any:
        if name in readable or name.startswith("__"):
            return object.__getattribute__(self, name)
        what, owner = object.__getattribute__(self, "__forked_from__")
        raise ClosedError(
            f"{what} belongs to process {owner}; this process ({os.getpid()}) was "
            f"forked from it and may not use it ({name}): make groups and queues of "
            "its own, or use it in the parent"
        )

    def closed(self: Any, *args: Any, **kwargs: Any) -> None:
        """The parent's to close: nothing to do in a forked child."""

    namespace: dict[str, Any] = {name: closed for name in _CLOSERS if hasattr(cls, name)}
    namespace["__getattribute__"] = __getattribute__
    stand_in = type(f"Forked{cls.__name__}", (cls,), namespace)
    _child_classes[cls] = stand_in
    return stand_in


def _disown_in_child() -> None:
    parent = os.getppid()
    for obj, what in list(_owned.items()):
        object.__setattr__(obj, "__forked_from__", (what, parent))
        obj.__class__ = _child_class(type(obj))
    _owned.clear()


os.register_at_fork(after_in_child=_disown_in_child)
