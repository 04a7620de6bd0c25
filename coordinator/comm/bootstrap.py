"""Where a new communicator finds its rank, size and rendezvous store.

Rank and size come from the launcher (``torchrun`` and our test harness set
``RANK`` and ``WORLD_SIZE``) when the caller does not pass them. The store is
torch's default store when ``torch.distributed`` is initialised, otherwise one
``TCPStore`` per MASTER_ADDR:MASTER_PORT for the whole process (only one
server can bind a port, so every communicator shares it). Each communicator
lives under its own ``PrefixStore`` so it never touches torch's default group.
These are launcher variables, not groupcoord settings, which is why they are
read here rather than through ``shm_broadcast.config``.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch.distributed as dist

from ..errors import GroupcoordValueError

_stores_lock = threading.Lock()
_stores: dict[tuple[str, int], dist.Store] = {}
_name_counts: dict[str, int] = {}


def _launcher_int(variable: str, argument: str) -> int:
    raw = os.environ.get(variable)
    if raw is None:
        raise GroupcoordValueError(
            f"{argument} was not given and the launcher did not set {variable} "
            "(run under torchrun or pass rank= and size=)"
        )
    try:
        return int(raw)
    except ValueError as exc:
        raise GroupcoordValueError(f"{variable}={raw!r} is not an integer") from exc


def rank_and_size(rank: int | None, size: int | None) -> tuple[int, int]:
    rank = _launcher_int("RANK", "rank") if rank is None else rank
    size = _launcher_int("WORLD_SIZE", "size") if size is None else size
    for value, argument in ((rank, "rank"), (size, "size")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise GroupcoordValueError(f"{argument} must be an int, got {value!r}")
    if size < 1 or not 0 <= rank < size:
        raise GroupcoordValueError(f"rank={rank} size={size}: need 0 <= rank < size")
    return rank, size


def default_store(rank: int, size: int, timeout_s: float) -> dist.Store:
    """torch's default store if initialised, else a shared TCPStore from MASTER_*."""
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    host = os.environ.get("MASTER_ADDR")
    if host is None:
        raise GroupcoordValueError(
            "store was not given and MASTER_ADDR is not set (run under torchrun or pass store=)"
        )
    port = _launcher_int("MASTER_PORT", "store")
    with _stores_lock:
        store = _stores.get((host, port))
        if store is None:
            # Under torchrun the elastic agent already serves a store on
            # MASTER_PORT; every rank is then a client (as torch's env:// does).
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(
                host,
                port,
                size,
                is_master=rank == 0 and not agent_store,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
            _stores[(host, port)] = store
    return store


def unique_prefix(name: str) -> str:
    """Store prefix for the next communicator called ``name`` in this process.

    Ranks create communicators in the same order (as with torch's new_group),
    so the counter agrees across ranks and two comms with one name never share keys.
    """
    with _stores_lock:
        count = _name_counts.get(name, 0)
        _name_counts[name] = count + 1
    # An agent store outlives worker restarts: keep each attempt's keys apart.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"groupcoord/comm/attempt{attempt}/{name}/{count}"
