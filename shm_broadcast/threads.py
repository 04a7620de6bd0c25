"""Which threads of this process may make a groupcoord call: what lets a wait
know that ranks wait for each other for ever.

Ranks that wait for each other in two calls (a queue read against a
collective, two groups' calls in different orders; rows 71-74 of
docs/RELIABILITY.md) are stuck for certain only when no other thread of
their processes can make the call that would free them. A thread that
waits asks :func:`only_caller`: every other live Python thread of the
process is either one the program declared a bystander
(:func:`declare_bystander_thread`: a watchdog, a death monitor, a logging
or metrics thread) or a worker of groupcoord's own with nothing queued (a
``Comm``'s lane, registered by :func:`register_helper_thread`), which runs
calls only when a caller queues them. Any other thread may yet make the
call, so with one the waits go on to their timeout.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

__all__ = ["declare_bystander_thread", "only_caller", "other_callers", "register_helper_thread"]

logger = logging.getLogger("groupcoord.shm_broadcast")

_BYSTANDERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
# thread -> whether it has nothing to do now (holds no reference to the thread)
_HELPERS: weakref.WeakKeyDictionary[threading.Thread, Callable[[], bool]] = (
    weakref.WeakKeyDictionary()
)


def declare_bystander_thread(thread: threading.Thread | None = None) -> None:
    """Declare that ``thread`` (default: the calling thread) never makes a
    groupcoord call: no collective, queue or point-to-point call of any group.

    A process's waits can then tell, despite that thread, when its ranks wait
    for each other for ever (say a worker in its TP group's queue while the
    driver is in the world group's barrier), and raise ``DesyncError`` or
    ``CrossedCallsError`` in about a second instead of waiting out the
    timeout. An engine worker's watchdog or death-monitor thread is the case.
    A declared thread that makes a call anyway is counted as a caller again
    from that call on (with a warning); until then the declaration is
    trusted, and a wait could end a call that thread was about to free.
    """
    target = threading.current_thread() if thread is None else thread
    if not isinstance(target, threading.Thread):
        raise TypeError(f"thread must be a threading.Thread, got {type(thread).__name__}")
    _BYSTANDERS.add(target)


def register_helper_thread(thread: threading.Thread, idle: Callable[[], bool]) -> None:
    """groupcoord's own worker ``thread`` makes calls only for work queued to it:
    while ``idle()`` says nothing is queued or running, it cannot free a wait."""
    _HELPERS[thread] = idle


def only_caller() -> bool:
    """Whether no Python thread of this process but the calling one can make a
    groupcoord call now (see the module's note). Called by a thread that waits
    in a call: a declared bystander doing so loses its declaration."""
    if threading.active_count() == 1:
        return True
    me = threading.current_thread()
    if me in _BYSTANDERS:
        _BYSTANDERS.discard(me)
        logger.warning(
            "thread %r was declared a bystander (declare_bystander_thread) but makes a "
            "groupcoord call: it counts as a caller from now on",
            me.name,
        )
    return not other_callers()


def other_callers() -> list[str]:
    """The names of the live Python threads of this process, but the calling one,
    that could make a groupcoord call now (see :func:`only_caller`)."""
    me = threading.current_thread()
    names = []
    for thread in threading.enumerate():
        if thread is me or thread in _BYSTANDERS:
            continue
        idle = _HELPERS.get(thread)
        if idle is None or not idle():
            names.append(thread.name)
    return names
