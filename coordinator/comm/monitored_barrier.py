"""A barrier that says who is missing when it times out.

Each rank sets its own arrival key in the communicator's store and waits for
everybody's. On timeout, the keys that are still absent are exactly the ranks
that did not arrive, and the error names them. Keys of barrier ``n - 1`` are
deleted by rank 0 after barrier ``n`` completes: by then every rank has left
barrier ``n - 1``'s wait, so nobody can still be looking for them.
"""

from __future__ import annotations

import datetime

from ..errors import GroupcoordTimeoutError
from .core import CommCore, timeout_seconds


def _key(seq: int, rank: int) -> str:
    return f"monitored_barrier/{seq}/{rank}"


def monitored_barrier(comm: CommCore, timeout: float | datetime.timedelta | None = None) -> None:
    """Block until every rank of ``comm`` arrives; on timeout name the absent ranks."""
    timeout_s = timeout_seconds(timeout, comm._timeout_s)
    comm._check_usable("monitored_barrier")
    store = comm._store
    seq = comm._barrier_count
    comm._barrier_count += 1
    size, rank = comm.get_size(), comm.get_rank()
    keys = [_key(seq, r) for r in range(size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # c10d's DistStoreError on timeout
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return  # everyone arrived just as the wait gave up
        raise GroupcoordTimeoutError(
            f"communicator {comm.get_name()!r}",
            "monitored_barrier",
            timeout_s,
            missing=missing,
            role=f"rank {rank}",
            detail="the listed ranks never arrived",
        ) from exc
    if rank == 0 and seq > 0:
        for r in range(size):
            store.delete_key(_key(seq - 1, r))
