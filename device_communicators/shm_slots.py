"""The segment one shared-memory all-reduce group shares, from creation to unmapping.

Layout: a control line per rank (``shm_phases.PhaseLines``) and one more for
rank 0's token, page-aligned; then two sets of data slots, one slot of
``max_bytes`` per rank in each. Rank 0 creates it and drops its name as soon
as every rank has mapped it (or given up), so no crash of anyone can leave it
behind; the pages live until the last rank unmaps them.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C._distributed_c10d import BroadcastOptions
from torch.distributed import ProcessGroup

from shm_broadcast.gloo_errors import gloo_errors
from shm_broadcast.segments import ShmSegment, smaller_where_no_room

from .errors import GroupcoordError
from .shm_phases import LINE, PhaseLines

__all__ = ["SlotSegment", "open_slot_segment"]

_PAGE = 4096
_HANDLE_BYTES = 256  # fixed-size name, token and slot size broadcast at set-up
# The slots a group falls back to where /dev/shm has no room for its usual ones
# (``_create``): 2 x world x 64 KiB, 1 MiB at world 8.
SMALL_SLOT_BYTES = 64 * 1024
_VIEW_CACHE_ENTRIES = 512


def align_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


class SlotSegment:
    """A mapped segment: its control lines and typed views of its data slots."""

    def __init__(self, segment: ShmSegment, lines: PhaseLines, world_size: int, max_bytes: int):
        self.segment = segment
        self.lines = lines
        self.world_size = world_size
        self.max_bytes = max_bytes
        ctrl = control_bytes(world_size)
        # One uint8 tensor per set of slots (slot r at r * max_bytes), so a view
        # may span every slot of a set.
        self._sets = [
            torch.frombuffer(
                segment.buf,
                dtype=torch.uint8,
                count=world_size * max_bytes,
                offset=ctrl + s * world_size * max_bytes,
            )
            for s in range(2)
        ]
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        # The int64s of every slot, for a call that passes an address instead of data.
        self._words = segment.buf[ctrl : ctrl + 2 * world_size * max_bytes].cast("q")
        self._word_stride = max_bytes // 8

    # Views are cached: making a tensor view (or slice) costs about a microsecond,
    # a small call makes several, and real workloads repeat a handful of shapes.

    def _cached(self, key: tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _VIEW_CACHE_ENTRIES:
                self._views.clear()
            view = self._views[key] = make()
        return view

    def _rows(self, s: int, dtype: torch.dtype) -> torch.Tensor:
        """Set ``s`` as a (world, slot elements) matrix of ``dtype``: row r is slot r."""
        return self._cached(
            (s, dtype),
            lambda: (
                self._sets[s].view(dtype).view(self.world_size, self.max_bytes // dtype.itemsize)
            ),
        )

    def address(self, s: int, r: int) -> int:
        """Where slot ``r`` of set ``s`` starts in this process's mapping."""
        return self._sets[s].data_ptr() + r * self.max_bytes

    def post(self, s: int, r: int, values: Sequence[int]) -> None:
        """Store ``values`` as int64 numbers 0, 1, ... of slot ``r`` of set ``s``."""
        at = (s * self.world_size + r) * self._word_stride
        self._words[at : at + len(values)] = array("q", values)

    def posted(self, s: int, r: int, i: int) -> int:
        """The value :meth:`post` stored as int64 number ``i`` of slot ``r`` of set ``s``."""
        return self._words[(s * self.world_size + r) * self._word_stride + i]

    def posted_run(self, s: int, r: int, lo: int, hi: int) -> list[int]:
        """The values :meth:`post` stored as int64 numbers ``lo`` to ``hi`` - 1 of slot
        ``r`` of set ``s``."""
        at = (s * self.world_size + r) * self._word_stride
        return self._words[at + lo : at + hi].tolist()

    def view(self, s: int, r: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The first ``n`` elements of slot ``r`` of set ``s`` as ``dtype``."""
        return self._cached((s, r, dtype, n), lambda: self._rows(s, dtype)[r, :n])

    def span(self, s: int, r: int, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of slot ``r`` of set ``s`` as ``dtype``."""
        return self._cached((s, r, dtype, lo, hi), lambda: self._rows(s, dtype)[r, lo:hi])

    def shaped(self, s: int, r: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """The start of slot ``r`` of set ``s`` as a contiguous ``dtype`` tensor of ``shape``."""
        return self._cached(
            (s, r, dtype, shape), lambda: self.view(s, r, dtype, shape.numel()).view(shape)
        )

    def close(self) -> None:
        """Unmap (and unlink, if this rank made it and the name is still there)."""
        # Views into the mapping must go before it can be unmapped.
        self._views.clear()
        self._sets = []
        self._words.release()
        self.lines.release()
        _close_segment(self.segment)


def control_bytes(world_size: int) -> int:
    """The control lines' share of the segment: one line per rank, then rank 0's token."""
    return align_up((world_size + 1) * LINE, _PAGE)


def _close_segment(segment: ShmSegment) -> None:
    segment.close()
    if segment.created:
        segment.unlink()


def open_slot_segment(
    group: ProcessGroup,
    ranks: list[int],
    rank_in_group: int,
    what: str,
    max_bytes: int,
    timeout_s: float,
    peer_check_interval_s: float,
    local_reason: str | None,
) -> tuple[SlotSegment | None, str | None]:
    """Rank 0 creates the segment; everyone attaches; all agree or all disable.

    Returns the mapped segment, or None and why this group cannot use one.
    The same three small collectives run on every rank whatever happens
    locally, so a rank that cannot take part never leaves the others waiting.
    The group is not kept: a reference here could make its (Gloo) destructor
    run late, at interpreter exit, on whatever thread frees this object.
    """
    world_size = len(ranks)
    segment: ShmSegment | None = None
    lines: PhaseLines | None = None
    try:
        handle = torch.zeros(_HANDLE_BYTES, dtype=torch.uint8)
        if rank_in_group == 0 and local_reason is None:
            try:
                segment, max_bytes = _create(world_size, max_bytes, what)
                token = secrets.token_hex(8)
                segment.buf[world_size * LINE : world_size * LINE + 16] = token.encode()
                payload = f"{segment.name}|{token}|{max_bytes}".encode()
                handle[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            except (OSError, GroupcoordError) as exc:
                local_reason = f"rank 0 could not create the segment: {exc}"
        # The group's own methods: they work whether or not torch registered it.
        others = [r for i, r in enumerate(ranks) if i != rank_in_group]
        with gloo_errors(what, "shm all-reduce set-up", group, peers=others):
            options = BroadcastOptions()
            options.rootRank = 0
            group.broadcast([handle], options).wait()
        text = bytes(handle.tolist()).rstrip(b"\0").decode()
        if local_reason is None and rank_in_group != 0:
            segment, max_bytes, local_reason = _attach(text, world_size)
        if local_reason is None:
            assert segment is not None
            lines = PhaseLines(
                segment.buf[: PhaseLines.nbytes(world_size)],
                ranks,
                rank_in_group,
                what,
                timeout_s,
                peer_check_interval_s,
            )
            lines.register_self()
        ok = torch.tensor([0 if local_reason is None else 1], dtype=torch.int32)
        everyone = [torch.empty_like(ok) for _ in ranks]
        with gloo_errors(what, "shm all-reduce set-up", group, peers=others):
            group.allgather([everyone], [ok]).wait()
        if rank_in_group == 0 and segment is not None:
            # Every rank has mapped it (or given up): drop the name now.
            segment.unlink()
        declined = [ranks[i] for i, t in enumerate(everyone) if int(t.item())]
        if declined:
            raise _Declined(local_reason or f"ranks {declined} cannot use it")
        assert segment is not None and lines is not None
        lines.read_peers()
        return SlotSegment(segment, lines, world_size, max_bytes), None
    except BaseException as exc:
        # A peer that vanished mid set-up (Gloo raises), or a refusal: never keep the segment.
        if lines is not None:
            lines.release()
        if segment is not None:
            _close_segment(segment)
        if isinstance(exc, _Declined):
            return None, exc.reason
        raise


class _Declined(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _create(world_size: int, max_bytes: int, what: str) -> tuple[ShmSegment, int]:
    """Rank 0's segment with slots of ``max_bytes``; where /dev/shm has no room for
    it (a container's 64 MiB), one with slots of ``SMALL_SLOT_BYTES``: small calls
    still take the lean path, large ones go in smaller pieces. Returns the segment
    and its slots' size (the peers read it from the handle)."""
    return smaller_where_no_room(
        lambda size: ShmSegment.create(_segment_bytes(world_size, size), tag="allreduce"),
        max_bytes,
        align_up(max(SMALL_SLOT_BYTES, 16 * world_size), LINE),
        what,
        "bytes a slot",
    )


def _segment_bytes(world_size: int, max_bytes: int) -> int:
    return control_bytes(world_size) + 2 * world_size * max_bytes


def _attach(text: str, world_size: int) -> tuple[ShmSegment | None, int, str | None]:
    """The segment rank 0's handle names, its slots' size, or why not."""
    if not text:
        return None, 0, "rank 0 made no segment"
    name, token, size = text.split("|")
    max_bytes = int(size)
    try:
        segment = ShmSegment.attach(name)
    except (OSError, GroupcoordError) as exc:
        return None, 0, f"cannot attach {name} (not on rank 0's node?): {exc}"
    start = world_size * LINE
    ours = bytes(segment.buf[start : start + 16]) == token.encode()
    if not ours or segment.size < _segment_bytes(world_size, max_bytes):
        segment.close()
        return None, 0, f"{name} here is not rank 0's segment (a different shm namespace)"
    return segment, max_bytes, None
