"""Exchange bytes over a process group without pickle.

A *group* is either a ``torch.distributed`` ProcessGroup (Gloo: bytes travel
as uint8 tensors, length first) or any object with ``rank``, ``world_size``,
``broadcast_obj(obj, src)`` and ``all_gather_obj(obj)`` (see
:class:`ObjectGroup`; the coordinator's ``StatelessProcessGroup`` is one).
``src`` is always the rank *within* the group. torch is imported only for a
torch group. On a torch group a Gloo timeout or lost peer raises
``GroupcoordTimeoutError``/``PeerDiedError`` naming ``what`` and ``operation``
(the caller's object and call; see :mod:`.gloo_errors`).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, runtime_checkable

from .errors import GroupcoordTypeError, GroupcoordValueError
from .gloo_errors import gloo_errors

__all__ = ["ObjectGroup", "all_gather_bytes", "broadcast_bytes", "group_rank_and_size"]


@runtime_checkable
class ObjectGroup(Protocol):
    """A process group that moves plain objects (bytes at least) by itself."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast_obj(self, obj: Any, src: int) -> Any: ...

    def all_gather_obj(self, obj: Any) -> list[Any]: ...


def _torch_group(pg: Any) -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(pg, dist.ProcessGroup)


def group_rank_and_size(pg: Any) -> tuple[int, int]:
    """This process's rank within ``pg`` and the group's size."""
    if _torch_group(pg):
        import torch.distributed as dist

        return dist.get_rank(pg), dist.get_world_size(pg)
    if isinstance(pg, ObjectGroup):
        return pg.rank, pg.world_size
    raise GroupcoordTypeError(
        f"pg must be a torch.distributed ProcessGroup or an ObjectGroup "
        f"(rank, world_size, broadcast_obj, all_gather_obj), got {type(pg).__qualname__}"
    )


def _check_src(src: int, world_size: int) -> None:
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world_size:
        raise GroupcoordValueError(f"src={src!r} is not a rank in a group of {world_size}")


def broadcast_bytes(
    pg: Any,
    data: bytes | None,
    src: int = 0,
    *,
    what: str = "process group",
    operation: str = "broadcast_bytes",
) -> bytes:
    """Rank ``src`` of ``pg`` sends ``data``; every rank returns it."""
    rank, world_size = group_rank_and_size(pg)
    _check_src(src, world_size)
    mine: bytes | None = None
    if rank == src:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise GroupcoordTypeError(
                f"data must be bytes on the source rank, got {type(data).__qualname__}"
            )
        mine = bytes(data)
    if not _torch_group(pg):
        out = pg.broadcast_obj(mine, src=src)
        if not isinstance(out, bytes):
            raise GroupcoordTypeError(f"group returned {type(out).__qualname__}, expected bytes")
        return out
    import torch
    import torch.distributed as dist

    global_src = dist.get_global_rank(pg, src)
    length = torch.tensor([len(mine) if mine is not None else 0], dtype=torch.int64)
    with gloo_errors(what, operation, pg):
        dist.broadcast(length, src=global_src, group=pg)
    n = int(length.item())
    if n == 0:
        return b""
    if mine is not None:
        payload = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    else:
        payload = torch.empty(n, dtype=torch.uint8)
    with gloo_errors(what, operation, pg):
        dist.broadcast(payload, src=global_src, group=pg)
    return mine if mine is not None else payload.numpy().tobytes()


def all_gather_bytes(
    pg: Any, data: bytes, *, what: str = "process group", operation: str = "all_gather_bytes"
) -> list[bytes]:
    """Every rank contributes ``data``; all return the list in group-rank order."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise GroupcoordTypeError(f"data must be bytes, got {type(data).__qualname__}")
    rank, world_size = group_rank_and_size(pg)
    if not _torch_group(pg):
        out = pg.all_gather_obj(bytes(data))
        if len(out) != world_size or not all(isinstance(x, bytes) for x in out):
            raise GroupcoordTypeError("group returned something other than one bytes per rank")
        return list(out)
    import torch
    import torch.distributed as dist

    mine = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.empty(1, dtype=torch.int64) for _ in range(world_size)]
    with gloo_errors(what, operation, pg):
        dist.all_gather(lengths, mine, group=pg)
    sizes = [int(t.item()) for t in lengths]
    longest = max(sizes)
    if longest == 0:
        return [b""] * world_size
    # Gloo's all_gather needs equal shapes: pad to the longest, then cut.
    padded = torch.zeros(longest, dtype=torch.uint8)
    if len(data):
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    with gloo_errors(what, operation, pg):
        dist.all_gather(outs, padded, group=pg)
    return [out[:n].numpy().tobytes() for out, n in zip(outs, sizes)]
