"""The members of a new group meet through the store before its blocking connect,
so that a dead member is told from a slow one.

c10d's Gloo connect (``dist.new_group``, ``ProcessGroupGloo``) blocks until every
member has connected: for the group's whole timeout (300 s by default) when one
never does, then it raises torch's ``DistStoreError`` naming a store key. A member
that died before it got there (an error while loading a model, a SIGKILL) thus
stalled the others in ``GroupCoordinator(...)``, ``initialize_model_parallel`` or
``new_comm`` for the full timeout. Here each member first says it has arrived and
waits for the others' arrival, polling the store; between polls it checks the
members still missing whose process it can see (their pid on this host, from the
store's pid table or from the caller): a dead one raises ``PeerDiedError`` at
once, and a member that never comes raises ``GroupcoordTimeoutError`` naming it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from shm_broadcast.liveness import host_key, process_alive

from .errors import GroupcoordTimeoutError, PeerDiedError

__all__ = ["meet", "publish_pid"]

# rank -> "pid:host key" of the process that last published it, in ranks numbered
# as the store's users number them (torch's global ranks, the launcher's RANK).
_PID_TABLE = "groupcoord/pid/"
logger = logging.getLogger("groupcoord.coordinator")
_FIRST_POLL_S = 0.001
_MAX_POLL_S = 0.05


def publish_pid(store: dist.Store, rank: int) -> None:
    """Enter this process in the store's pid table under ``rank``."""
    store.set(f"{_PID_TABLE}{rank}", f"{os.getpid()}:{host_key()}")


def meet(
    store: dist.Store,
    key: str,
    rank: int,
    members: Sequence[int],
    what: str,
    timeout_s: float,
    known_pids: Mapping[int, int] | None = None,
    post: str | None = None,
) -> dict[int, str]:
    """Collective among ``members`` (``rank`` is this process's): return once every
    member has arrived at ``key``. Members whose process is known to be gone raise
    ``PeerDiedError``; at ``timeout_s``, those still missing are named in a
    ``GroupcoordTimeoutError``. ``known_pids`` (member -> pid, on this host): the
    processes to watch; by default the members are numbered as the store's pid
    table and this rank enters it. With a ``post`` (what this rank says it is
    building), the posts of the members whose post differs from this one come
    back, by member, for the caller to name.

    Each member appends ``rank:digest;`` to one list, so a poll is one read of the
    store whatever the number of members (a rank of a world of 64 reads one key,
    not 63); a member's whole post is read only when its digest differs."""
    if known_pids is None:
        publish_pid(store, rank)
    digest = "" if post is None else hashlib.blake2b(post.encode(), digest_size=8).hexdigest()
    if post is not None:
        store.set(f"{key}/{rank}", post)  # before the arrival that points to it
    # (torch's stubs lack Store.append; every store has it: TCP, file, hash, prefix)
    store.append(f"{key}/arrived", f"{rank}:{digest};")  # type: ignore[attr-defined]
    wanted = set(members) - {rank}
    deadline = time.monotonic() + timeout_s
    pids: dict[int, tuple[int, int]] = {}  # the pid table's entries read so far
    arrived = _wait_for(
        store, f"{key}/arrived", wanted, what, deadline, timeout_s, known_pids, pids
    )
    differ = {r: store.get(f"{key}/{r}").decode() for r in sorted(wanted) if arrived[r] != digest}
    if differ:
        # Every member finds a post unlike its own (were its own like every other,
        # all would be alike), so each says it has read them and waits for the rest
        # before it raises: the store's host (rank 0 under tcp://) must not exit
        # while a peer still reads.
        store.append(f"{key}/read", f"{rank}:;")  # type: ignore[attr-defined]
        try:
            _wait_for(store, f"{key}/read", wanted, what, deadline, timeout_s, known_pids, pids)
        except (dist.DistError, PeerDiedError, GroupcoordTimeoutError) as exc:
            # This rank has what it needs; the caller raises the difference. (The
            # host leaves only once every member read, so a store gone now is it.)
            logger.debug("%s: the meeting ended while peers confirmed their reads: %s", what, exc)
    return differ


def _wait_for(
    store: dist.Store,
    listed: str,
    wanted: set[int],
    what: str,
    deadline: float,
    timeout_s: float,
    known_pids: Mapping[int, int] | None,
    pids: dict[int, tuple[int, int]],
) -> dict[int, str]:
    """Poll the list ``listed`` (``rank:digest;`` entries) until every rank of
    ``wanted`` is on it: rank -> digest. A rank whose process is gone raises
    ``PeerDiedError``; at ``deadline``, those still missing are named in a
    ``GroupcoordTimeoutError``."""
    poll_s = _FIRST_POLL_S
    while True:
        arrived = _arrivals(store.get(listed))
        waiting = sorted(wanted - arrived.keys())
        if not waiting:
            return arrived
        dead = _dead(store, waiting, known_pids, pids)
        if dead:
            raise PeerDiedError(what, "connect", dead, "before it joined the group")
        if time.monotonic() >= deadline:
            raise GroupcoordTimeoutError(
                what, "connect", timeout_s, waiting, detail="not yet at the group's creation"
            )
        time.sleep(poll_s)
        poll_s = min(poll_s * 2, _MAX_POLL_S)


def _arrivals(listed: bytes) -> dict[int, str]:
    """The arrival list (``rank:digest;`` each) as rank -> digest."""
    out = {}
    for entry in listed.decode().split(";")[:-1]:
        r, _, digest = entry.partition(":")
        out[int(r)] = digest
    return out


def _dead(
    store: dist.Store,
    missing: list[int],
    known_pids: Mapping[int, int] | None,
    pids: dict[int, tuple[int, int]],
) -> list[int]:
    """The ``missing`` members whose process on this host is gone (``pids``: the pid
    table's entries already read, which do not change while the members meet)."""
    if known_pids is not None:
        return [r for r in missing if r in known_pids and not process_alive(known_pids[r])]
    here = host_key()
    dead = []
    for r in missing:
        if r not in pids:
            entry = f"{_PID_TABLE}{r}"
            if not store.check([entry]):
                continue  # never published: nothing to watch
            pid, host = (int(part) for part in store.get(entry).decode().split(":"))
            pids[r] = (pid, host)
        pid, host = pids[r]
        if host == here and not process_alive(pid):
            dead.append(r)
    return dead
