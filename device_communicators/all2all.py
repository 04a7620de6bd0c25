"""Expert-parallel all2all managers: move tokens to the expert owners and back.

A mixture-of-experts layer whose experts are split over the ranks of the EP
group needs, on every rank, the tokens of all ranks with their routing
(vLLM 0.33's ``dispatch(hidden, topk_weights, topk_ids)``, or
``dispatch_router_logits(hidden, router_logits)`` before top-k) and, after
the local experts ran, each token's partial outputs summed back on the rank
that owns the token (``combine``). Two managers do this over a device
communicator:

* ``naive``: each rank broadcasts its own tokens in turn; combine all-reduces
  the full expert output and keeps its own rows. Simple, W broadcasts.
* ``allgather_reducescatter``: one grouped ``all_gatherv`` of the hidden
  states, router logits and any extra tensors with per-rank token counts;
  combine is one ``reduce_scatterv``. Less traffic than naive on combine.

Ranks may hold different token counts, including zero. The counts are found
with one small all-gather per dispatch and kept for the matching combine,
unless the caller states them for a block with :meth:`All2AllManagerBase.token_counts`
(an engine that already knows them, like vLLM's DP metadata, saves that call).
Dispatch gathers over the whole EP group in both the sequence-parallel and the
plain case; see ``docs/demo.md`` for what that means for TP ranks.
"""

from __future__ import annotations

import torch

from .all2all_base import All2AllCommunicator, All2AllManagerBase, MoEBufferSpec
from .errors import GroupcoordValueError, NotSupportedError

__all__ = [
    "AgRsAll2AllManager",
    "AllGatherReduceScatterAll2AllManager",
    "NaiveAll2AllManager",
    "create_all2all_manager",
    "known_all2all_backends",
]


class NaiveAll2AllManager(All2AllManagerBase):
    """Each rank broadcasts its tokens in turn; combine = all-reduce, then own rows."""

    name = "naive"

    def _allocate(self, spec: MoEBufferSpec) -> None:
        rows = spec.max_tokens_per_rank * self.world_size
        device = self.communicator.device
        for width in (spec.hidden_size, spec.num_experts):
            key = ((width,), spec.dtype, device)
            self._buffers[key] = torch.empty((rows, width), dtype=spec.dtype, device=device)

    def _receive_buffer(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        key = (tuple(like.shape[1:]), like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is not None and buffer.shape[0] >= rows:
            # Valid until the next dispatch, which is after the matching combine.
            return buffer[:rows]
        return torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)

    def _dispatch(self, tensors: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
        offsets = self._offsets(counts)
        out = []
        for tensor in tensors:
            buffer = self._receive_buffer(tensor, offsets[-1])
            buffer[offsets[self.rank] : offsets[self.rank + 1]].copy_(tensor)
            for src, count in enumerate(counts):
                if count == 0:
                    continue  # every rank knows the counts, so all skip the same broadcasts
                piece = buffer[offsets[src] : offsets[src + 1]]
                received = self.communicator.broadcast(piece, src=src)
                if received.data_ptr() != piece.data_ptr():
                    piece.copy_(received)
            out.append(buffer)
        return out

    def _combine(self, hidden_states: torch.Tensor, counts: list[int]) -> torch.Tensor:
        offsets = self._offsets(counts)
        summed = self.communicator.all_reduce(hidden_states)
        return summed[offsets[self.rank] : offsets[self.rank + 1]].contiguous()


class AllGatherReduceScatterAll2AllManager(All2AllManagerBase):
    """One grouped all_gatherv on dispatch, one reduce_scatterv on combine."""

    name = "allgather_reducescatter"

    def _dispatch(self, tensors: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
        gathered = self.communicator.all_gatherv(
            [t.contiguous() for t in tensors], dim=0, sizes=counts
        )
        return list(gathered)

    def _combine(self, hidden_states: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self.communicator.reduce_scatterv(hidden_states, dim=0, sizes=counts)


# vLLM's name for it.
AgRsAll2AllManager = AllGatherReduceScatterAll2AllManager

_MANAGERS: dict[str, type[All2AllManagerBase]] = {
    NaiveAll2AllManager.name: NaiveAll2AllManager,
    AllGatherReduceScatterAll2AllManager.name: AllGatherReduceScatterAll2AllManager,
}


def known_all2all_backends() -> list[str]:
    """Names accepted by :func:`create_all2all_manager` (and ``GROUPCOORD_ALL2ALL_BACKEND``)."""
    return sorted(_MANAGERS)


# vLLM's vendor kernels (GPU libraries groupcoord does not wrap), by name prefix.
VENDOR_ALL2ALL_PREFIXES = ("deepep", "pplx", "flashinfer", "mori", "nixl")


def create_all2all_manager(name: str, communicator: All2AllCommunicator) -> All2AllManagerBase:
    """The all2all manager called ``name`` over ``communicator`` (the EP group's)."""
    cls = _MANAGERS.get(name)
    if cls is None and name.startswith(VENDOR_ALL2ALL_PREFIXES):
        raise NotSupportedError.by_groupcoord(
            f"all2all backend {name}",
            f"vendor all2all kernels are not wrapped; use {' or '.join(known_all2all_backends())}",
        )
    if cls is None:
        raise GroupcoordValueError(
            f"all2all backend {name!r} is unknown; known backends: {', '.join(known_all2all_backends())}"
        )
    return cls(communicator.cpu_group, communicator=communicator)
