"""SpinCondition: vLLM 0.33's spin-then-sleep wake-up over a ZeroMQ notify socket.

A reader that read recently (within ``busy_loop_s``) only yields the core in
:meth:`SpinCondition.wait`, so a busy stream is met in microseconds; one that
has been idle longer sleeps in ``poll`` on a SUB socket until the writer's
:meth:`SpinCondition.notify` (a PUB socket), the timeout, or :meth:`cancel`
from another thread. Our own :class:`MessageQueue` does not use it: its
readers sleep on a futex in the ring (:mod:`.waiting`), which needs no socket
per queue. The class is here, working, for code written against vLLM's.
"""

from __future__ import annotations

import os
import secrets
import time

import zmq

from .errors import GroupcoordValueError

__all__ = ["SpinCondition"]


class SpinCondition:
    """One side of a notify channel: the writer notifies, readers wait."""

    def __init__(
        self, is_reader: bool, context: zmq.Context, notify_address: str, busy_loop_s: float = 1
    ) -> None:
        if not isinstance(notify_address, str) or "://" not in notify_address:
            raise GroupcoordValueError(
                f"notify_address must be a ZeroMQ address like 'ipc://...', got {notify_address!r}"
            )
        if isinstance(busy_loop_s, bool) or not isinstance(busy_loop_s, (int, float)):
            raise GroupcoordValueError(f"busy_loop_s must be seconds, got {busy_loop_s!r}")
        if busy_loop_s < 0:
            raise GroupcoordValueError(f"busy_loop_s must be >= 0, got {busy_loop_s!r}")
        self.is_reader = is_reader
        self.busy_loop_s = float(busy_loop_s)
        self.last_read = time.monotonic()
        self._cancelled = False
        self._cancel_recv: zmq.Socket | None = None
        self._cancel_send: zmq.Socket | None = None
        if is_reader:
            self.local_notify_socket = context.socket(zmq.SUB)
            self.local_notify_socket.setsockopt(zmq.SUBSCRIBE, b"")
            self.local_notify_socket.connect(notify_address)
            # cancel() from another thread reaches the poll through an inproc pair.
            cancel_address = f"inproc://spin-condition-{secrets.token_hex(8)}"
            self._cancel_recv = context.socket(zmq.PAIR)
            self._cancel_recv.bind(cancel_address)
            self._cancel_send = context.socket(zmq.PAIR)
            self._cancel_send.connect(cancel_address)
        else:
            self.local_notify_socket = context.socket(zmq.PUB)
            self.local_notify_socket.setsockopt(zmq.SNDHWM, 1)  # one pending wake is enough
            self.local_notify_socket.bind(notify_address)
        for sock in (self.local_notify_socket, self._cancel_recv, self._cancel_send):
            if sock is not None:
                sock.setsockopt(zmq.LINGER, 0)

    def record_read(self) -> None:
        """Reader: a message was just read; the next waits spin for ``busy_loop_s``."""
        self.last_read = time.monotonic()

    def cancel(self) -> None:
        """Reader: end a :meth:`wait` in progress (another thread) and every later one."""
        self._cancelled = True
        if self._cancel_send is not None:
            self._cancel_send.send(b"", zmq.NOBLOCK)

    def wait(self, timeout_ms: int | None = None) -> None:
        """Reader: return after a yield while busy; once idle, after a notify, the
        timeout (None: none) or a cancel. The caller re-checks its condition."""
        if not self.is_reader:
            raise GroupcoordValueError("SpinCondition.wait is for a reader (is_reader=True)")
        if self._cancelled:
            return
        if time.monotonic() - self.last_read < self.busy_loop_s:
            os.sched_yield()
            return
        poller = zmq.Poller()
        poller.register(self.local_notify_socket, zmq.POLLIN)
        poller.register(self._cancel_recv, zmq.POLLIN)
        for sock, _ in poller.poll(timeout_ms):
            while sock.poll(0, zmq.POLLIN):  # drain: one wake per wait
                sock.recv(zmq.NOBLOCK)

    def notify(self) -> None:
        """Writer: wake the readers asleep in :meth:`wait` (dropped if one is pending)."""
        if self.is_reader:
            raise GroupcoordValueError("SpinCondition.notify is for the writer (is_reader=False)")
        # A PUB socket drops (never blocks) past its high-water mark of one: a
        # wake already queued for a subscriber is enough.
        self.local_notify_socket.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Close this side's sockets (idempotent)."""
        for sock in (self.local_notify_socket, self._cancel_recv, self._cancel_send):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
