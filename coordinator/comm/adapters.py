"""Communicators over groups that already exist: a torch ProcessGroup or a GroupCoordinator.

The communicator borrows the group's Gloo backend instead of connecting a new
one, so an engine can use work handles, windows, split and the object
collectives on the groups ``parallel_state`` built. Ranks are in-group ranks.
``finalize()`` leaves a borrowed group running; ``abort()`` aborts it, since
after a timeout its ranks no longer agree on what comes next anyway.
Like any collective set-up, every rank of the group must make the call.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from device_communicators import checks
from shm_broadcast.config import resolve_timeout

from ..errors import GroupcoordTypeError, GroupcoordValueError
from .bootstrap import unique_prefix
from .comm import Comm
from .core import timeout_seconds

if TYPE_CHECKING:
    from ..group_coordinator import GroupCoordinator


def comm_from_process_group(
    pg: dist.ProcessGroup,
    name: str,
    timeout: float | datetime.timedelta | None = None,
    store: dist.Store | None = None,
    hints: Mapping[str, str] | None = None,
) -> Comm:
    """A communicator on ``pg``'s Gloo backend (every rank of ``pg`` calls this).

    ``store`` (for split and the monitored barrier) defaults to torch's
    default store.
    """
    if not isinstance(pg, dist.ProcessGroup):
        raise GroupcoordTypeError(f"pg must be a torch ProcessGroup, got {type(pg).__name__}")
    if not isinstance(name, str) or not name:
        raise GroupcoordValueError(f"name must be a non-empty str, got {name!r}")
    checked_hints = checks.hints(hints)
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except RuntimeError as exc:
        raise GroupcoordValueError(f"pg has no Gloo (CPU) backend: {exc}") from exc
    if store is None:
        if not dist.is_initialized():
            raise GroupcoordValueError(
                "store was not given and torch.distributed is not initialised"
            )
        store = dist.distributed_c10d._get_default_store()
    timeout_s = timeout_seconds(timeout, resolve_timeout(None))
    comm = Comm(
        backend,
        store,
        unique_prefix(f"borrowed-{name}"),
        pg.rank(),
        pg.size(),
        name,
        torch.device("cpu"),
        timeout_s,
        checked_hints,
        owns_pg=False,
    )
    comm._connect_local()
    return comm


def comm_from_group(
    group: GroupCoordinator,
    timeout: float | datetime.timedelta | None = None,
    hints: Mapping[str, str] | None = None,
) -> Comm:
    """A communicator on a GroupCoordinator's CPU group, named after the group.

    Its deadline defaults to the group's own.
    """
    return comm_from_process_group(
        group.cpu_group,
        group.unique_name,
        timeout if timeout is not None else group.timeout_s,
        hints=hints,
    )
