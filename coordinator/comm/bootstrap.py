"""Where a new communicator, and torch's default group made by
``init_distributed_environment``, find their rank, size and rendezvous store.

Rank and size come from the launcher (``torchrun`` and our test harness set
``RANK`` and ``WORLD_SIZE``) when the caller does not pass them. The store is
torch's default store when ``torch.distributed`` is initialised, otherwise one
``TCPStore`` per MASTER_ADDR:MASTER_PORT for the whole process (only one
server can bind a port, so every communicator shares it). Each communicator
lives under its own ``PrefixStore`` so it never touches torch's default group,
and so does each initialisation of the default group (:func:`default_group_store`).
These are launcher variables, not groupcoord settings, which is why they are
read here rather than through ``shm_broadcast.config``.
"""

from __future__ import annotations

import datetime
import os
import threading
import urllib.parse

import torch.distributed as dist

from ..errors import GroupcoordValueError

_stores_lock = threading.Lock()
_stores: dict[tuple[str, int], dist.Store] = {}
_name_counts: dict[str, int] = {}
# A forked child's copies of its parent's stores: the parent's sockets and a
# server thread the child does not have. Kept here, never used or destroyed.
_parents_stores: list[dist.Store] = []
_default_address: tuple[str, int] | None = None  # of the last default group's store


def _forget_parents_stores() -> None:
    global _stores_lock, _default_address
    _parents_stores.extend(_stores.values())
    _stores.clear()
    _default_address = None
    _stores_lock = threading.Lock()  # the parent may have held it while forking


os.register_at_fork(after_in_child=_forget_parents_stores)


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
    return host_store(host, _launcher_int("MASTER_PORT", "store"), rank, size, timeout_s)


def host_store(host: str, port: int, rank: int, size: int, timeout_s: float) -> dist.Store:
    """This process's one TCPStore for ``host:port`` (rank 0 serves it, unless the
    elastic agent does), made on first use and kept until :func:`drop_store`.

    Keeping it is what makes a second rendezvous on the same port work: a
    server torn down and rebuilt on one port races the other ranks' clients,
    which may still reach the old one.
    """
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


def drop_store(host: str, port: int) -> None:
    """Forget the store of ``host:port`` (its server stops once nothing holds it)."""
    with _stores_lock:
        _stores.pop((host, port), None)


def unique_prefix(name: str, kind: str = "comm") -> str:
    """Store prefix for the next ``kind`` called ``name`` in this process.

    Ranks create communicators (and default groups) in the same order, as with
    torch's new_group, so the counter agrees across ranks and two of one name
    never share keys.
    """
    with _stores_lock:
        count = _name_counts.get(f"{kind}/{name}", 0)
        _name_counts[f"{kind}/{name}"] = count + 1
    # An agent store outlives worker restarts: keep each attempt's keys apart.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"groupcoord/{kind}/attempt{attempt}/{name}/{count}"


def default_group_store(
    init_method: str, rank: int, world_size: int, timeout_s: float
) -> tuple[dist.Store, int, int] | None:
    """(store, rank, world size) for torch's default group from vLLM's
    ``init_distributed_environment`` arguments (-1: the launcher's RANK and
    WORLD_SIZE), or None for an init method torch should resolve itself.

    ``env://`` and ``tcp://host:port`` use this process's store of that
    address (:func:`host_store`) under a prefix of its own for each
    initialisation, so init, destroy and init again on one port work (torch's
    own rendezvous reads the first round's stale keys, or meets a server
    being torn down). A store of an address no longer used is dropped.
    """
    global _default_address
    if init_method == "env://":
        absent = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if absent:
            raise GroupcoordValueError(
                f"distributed_init_method='env://' needs {' and '.join(absent)} in the "
                "environment (torchrun sets them), or pass e.g. 'tcp://host:port'"
            )
        host, port = os.environ["MASTER_ADDR"], _launcher_int("MASTER_PORT", "port")
        rank, world_size = rank_and_size(
            None if rank == -1 else rank, None if world_size == -1 else world_size
        )
    else:
        url = urllib.parse.urlparse(init_method)
        try:
            port_or_none = url.port
        except ValueError:
            port_or_none = None
        if url.scheme != "tcp" or url.query or not url.hostname or port_or_none is None:
            return None  # file://, a query string: torch's rendezvous
        if rank == -1 or world_size == -1:
            raise GroupcoordValueError(
                f"distributed_init_method={init_method!r} needs rank and world_size "
                f"(got rank={rank}, world_size={world_size})"
            )
        host, port = url.hostname, port_or_none
        rank, world_size = rank_and_size(rank, world_size)
    if _default_address not in (None, (host, port)):
        drop_store(*_default_address)
    _default_address = (host, port)
    store = host_store(host, port, rank, world_size, timeout_s)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    prefix = unique_prefix("default_pg", kind="init")
    return dist.PrefixStore(prefix, store), rank, world_size
