"""MessageQueue's group constructors: one collective call builds a queue over a group.

``MessageQueue.create_from_process_group`` (one writer, the rest read) and
``create_from_process_group_single_reader`` (every rank writes a queue one
rank reads) find which ranks share the writer's node, build the queue, and
pass its :class:`Handle` to the readers over the group (Gloo, or a
``StatelessProcessGroup``), without pickle. ``MessageQueue``'s static
methods of the same names call them with ``cls``, the queue class (not
imported here: this module is below ``message_queue``).
"""

from __future__ import annotations

from typing import Any

from .codec import dumps, loads
from .errors import GroupcoordValueError, ShmSpaceError
from .group_io import all_gather_bytes, broadcast_bytes, group_rank_and_size
from .mq_handle import Handle
from .ring import in_a_ring_that_fits
from .topology import in_the_same_node_as

__all__ = ["create_from_process_group", "create_from_process_group_single_reader"]

# What the writer sends instead of a handle when its ring does not fit.
_REFUSED = "ring refused"


def create_from_process_group(
    cls: Any,
    pg: Any,
    max_chunk_bytes: int,
    max_chunks: int,
    writer_rank: int = 0,
    external_writer_handle: Handle | None = None,
    blocking: bool = True,
    *,
    allow_pickle: bool = False,
    connect_ip: str | None = None,
    small_ring_fallback: bool = False,
) -> Any:
    """Collective over ``pg``: ``writer_rank`` (in-group) writes, every other rank reads.

    Ranks that share /dev/shm with the writer read the ring; the rest use
    TCP. With ``external_writer_handle`` every rank joins that queue as a
    reader instead. A ring that does not fit in /dev/shm raises
    ``ShmSpaceError`` on every rank (a reader's names the writer); with
    ``small_ring_fallback`` (a ``GroupCoordinator``'s own queue) the writer first
    tries a small ring (``ring.in_a_ring_that_fits``), whose geometry the readers
    take from its handle.
    """
    rank, world_size = group_rank_and_size(pg)
    if not 0 <= writer_rank < world_size:
        raise GroupcoordValueError(f"writer_rank={writer_rank} is not in a group of {world_size}")
    # Errors of the set-up collectives name this call (the queue has no name yet).
    names = {"what": "MessageQueue", "operation": "create_from_process_group"}
    same_node = in_the_same_node_as(pg, writer_rank, argument="writer_rank", **names)
    mq: Any = None
    data: bytes | None = None
    refused: ShmSpaceError | None = None
    if rank == writer_rank:
        if external_writer_handle is not None:
            mq = cls.create_from_handle(external_writer_handle, rank)
            handle = external_writer_handle
            data = dumps(handle)
        else:
            local = [r for r in range(world_size) if same_node[r] and r != writer_rank]

            def make(chunks: int) -> Any:
                return cls(
                    world_size - 1,
                    len(local),
                    local,
                    max_chunk_bytes,
                    chunks,
                    connect_ip,
                    allow_pickle=allow_pickle,
                    writer_rank=writer_rank,
                )

            try:
                if small_ring_fallback:
                    mq = in_a_ring_that_fits(make, max_chunk_bytes, max_chunks, "MessageQueue")
                else:
                    mq = make(max_chunks)
            except ShmSpaceError as exc:
                # The ring does not fit in /dev/shm: the readers hear why and raise
                # the same error, instead of waiting for a handle that never comes.
                refused = exc
                data = dumps({_REFUSED: str(exc)})
            else:
                data = dumps(mq.export_handle())
    try:
        handle = loads(broadcast_bytes(pg, data, writer_rank, **names))
    except BaseException:
        if mq is not None:
            mq.shutdown()  # the writer's ring must not outlive a failed set-up
        raise
    if refused is not None:
        raise refused
    if type(handle) is dict and _REFUSED in handle:
        raise ShmSpaceError(
            f"writer rank {writer_rank} could not create the queue: {handle[_REFUSED]}"
        )
    if mq is None:
        mq = cls.create_from_handle(handle, rank)
    if blocking:
        mq.wait_until_ready()
    return mq


def create_from_process_group_single_reader(
    cls: Any,
    pg: Any,
    max_chunk_bytes: int,
    max_chunks: int,
    reader_rank: int = 0,
    blocking: bool = False,
    *,
    allow_pickle: bool = False,
    connect_ip: str | None = None,
) -> tuple[Any, list[Handle]]:
    """Collective: every rank writes its own one-reader queue read by ``reader_rank``.

    Returns ``(my queue, handles)``; ``handles`` (one per rank, in group
    order) is filled only on ``reader_rank``, which joins each with
    ``cls.create_from_handle(handle, reader_rank)``. Then every
    writer calls ``wait_until_ready()`` and the reader does so on each
    joined queue. Keep ``blocking=False`` (the default) unless the reader
    joins from another thread: a writer waiting here waits for a reader
    that can only join after this call returns (bounded by the timeout).
    When some rank's ring does not fit in /dev/shm, every rank raises
    ``ShmSpaceError`` naming those ranks (and drops its own queue).
    """
    rank, world_size = group_rank_and_size(pg)
    if not 0 <= reader_rank < world_size:
        raise GroupcoordValueError(f"reader_rank={reader_rank} is not in a group of {world_size}")
    names = {"what": "MessageQueue", "operation": "create_from_process_group_single_reader"}
    same_node = in_the_same_node_as(pg, reader_rank, argument="reader_rank", **names)
    mq: Any = None
    try:
        mq = cls(
            1,
            1 if same_node[rank] else 0,
            [reader_rank] if same_node[rank] else [],
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            allow_pickle=allow_pickle,
            writer_rank=rank,
        )
        mine = dumps(mq.export_handle())
    except ShmSpaceError as exc:
        # Every rank hears which rings did not fit, and every rank raises.
        mine = dumps({_REFUSED: str(exc)})
    try:
        gathered = [loads(g) for g in all_gather_bytes(pg, mine, **names)]
        refused = {r: g[_REFUSED] for r, g in enumerate(gathered) if type(g) is dict}
        if refused:
            raise ShmSpaceError(
                "the queues of ranks "
                f"{sorted(refused)} could not be created: {next(iter(refused.values()))}"
            )
        handles = gathered if rank == reader_rank else []
        if blocking:
            mq.wait_until_ready()
    except BaseException:
        if mq is not None:
            mq.shutdown()
        raise
    return mq, handles
