"""What every expert-parallel all2all manager shares: vLLM's base class and its helpers.

``All2AllManagerBase`` checks the arguments of dispatch/combine, finds the
per-rank token counts, pairs each combine with its dispatch and answers the
fault queries; a manager (``all2all.py``) supplies only how tokens move.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from shm_broadcast.config import get_config
from shm_broadcast.liveness import dead_peers

from . import checks
from .errors import (
    ClosedError,
    DesyncError,
    GroupcoordTypeError,
    GroupcoordValueError,
    unsupported,
)

__all__ = [
    "All2AllCommunicator",
    "All2AllManagerBase",
    "Cache",
    "HasMoEBufferSpec",
    "MoEBufferSpec",
    "register_communicator",
]


class All2AllCommunicator(Protocol):
    """What a manager needs from its device communicator (``DeviceCommunicatorBase``)."""

    cpu_group: Any
    device: torch.device  # where its collectives take tensors
    world_size: int
    rank_in_group: int
    ranks: list[int]  # global rank of each in-group rank
    peer_pids: dict[int, int]  # global rank -> pid of the peers on this host
    unique_name: str

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> Any: ...

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor: ...

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class MoEBufferSpec:
    """What an MoE layer tells a manager so it can size buffers ahead of the first step.

    A model module exposing ``moe_buffer_spec() -> MoEBufferSpec`` is found by
    :meth:`All2AllManagerBase.prepare_communication_buffer_for_model`.
    """

    max_tokens_per_rank: int
    hidden_size: int
    num_experts: int
    dtype: torch.dtype


@runtime_checkable
class HasMoEBufferSpec(Protocol):
    """A model module that announces its MoE buffer needs."""

    def moe_buffer_spec(self) -> MoEBufferSpec: ...


# (hidden, router_logits or topk_weights[, topk_ids][, extras]): the tensors gathered
# in the order given, then the extra tensors as a list when the caller passed some.
DispatchResult = tuple[Any, ...]


class Cache:
    """Objects made once per distinct set of keyword arguments (vLLM's handle cache).

    ``get_or_create(kwargs, func)`` returns the object ``func(**kwargs)`` made
    for equal ``kwargs`` while it is alive (entries are weak), else makes it.
    """

    def __init__(self) -> None:
        self._cache: weakref.WeakValueDictionary[tuple[tuple[str, Any], ...], Any] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.RLock()

    def get_or_create(self, kwargs: dict[str, Any], func: Any) -> Any:
        if not isinstance(kwargs, dict):
            raise GroupcoordTypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
        key = tuple(sorted(kwargs.items()))
        with self._lock:
            instance = self._cache.get(key)
            if instance is None:
                instance = func(**kwargs)
                self._cache[key] = instance
            return instance


# The device communicator over each cpu_group, so a manager built the vLLM way,
# from the group alone, talks through it (weak: a destroyed one disappears).
_COMMUNICATORS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register_communicator(communicator: Any) -> None:
    """Make ``communicator`` the one managers built on its ``cpu_group`` use."""
    _COMMUNICATORS[id(communicator.cpu_group)] = communicator


class All2AllManagerBase:
    """Common bookkeeping: argument checks, token counts, the dispatch/combine pairing.

    vLLM's constructor, ``Manager(cpu_group, tcp_store_group=None)``: the
    manager talks through the device communicator already built over
    ``cpu_group`` (every ``DeviceCommunicatorBase`` registers itself), or
    through the one passed as ``communicator=``. ``tcp_store_group`` is kept
    for the signature; groupcoord's managers need no store.
    """

    name = "base"

    def __init__(
        self,
        cpu_group: Any,
        tcp_store_group: Any = None,
        *,
        communicator: All2AllCommunicator | None = None,
    ) -> None:
        if communicator is None:
            communicator = _COMMUNICATORS.get(id(cpu_group))
            if communicator is None or communicator.cpu_group is not cpu_group:
                raise GroupcoordValueError(
                    f"{type(self).__name__}(cpu_group): no groupcoord device communicator runs "
                    "over this cpu_group; build the group with GroupCoordinator (or a "
                    "DeviceCommunicatorBase) first, or pass communicator="
                )
        self.cpu_group = cpu_group
        self.tcp_store_group = tcp_store_group
        self.communicator = communicator
        self.world_size = int(communicator.world_size)
        self.rank = int(communicator.rank_in_group)
        self.buffer_spec: MoEBufferSpec | None = None
        # Reused receive buffers of managers that keep some, keyed by (trailing
        # shape, dtype, device); filled by _allocate, dropped by _release.
        self._buffers: dict[tuple[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}
        self._stated_counts: list[int] | None = None
        # Counts of the last dispatch, waiting for their combine.
        self._pending_counts: list[int] | None = None
        # A dispatch's description -> its checksum and bytes (see _counts_for).
        self._layouts: dict[Any, tuple[int, bytes]] = {}
        self._closed = False
        self._local_only = False  # inside mask_remote_ranks()
        # The dead-rank mask at the last recovery point (construction, clean_buffers).
        self._baseline = self._dead_mask()

    # ----------------------------------------------------------------- public API
    def dispatch_router_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: Sequence[torch.Tensor] | None = None,
    ) -> DispatchResult:
        """Gather every rank's tokens; returns (hidden, logits[, extras]) in rank order."""
        return self._gather_tokens(
            [("hidden_states", hidden_states), ("router_logits", router_logits)], extra_tensors
        )

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: Sequence[torch.Tensor] | None = None,
    ) -> DispatchResult:
        """Gather every rank's tokens with their routing (vLLM 0.33's form); returns
        (hidden, topk_weights, topk_ids[, extras]) in rank order."""
        return self._gather_tokens(
            [
                ("hidden_states", hidden_states),
                ("topk_weights", topk_weights),
                ("topk_ids", topk_ids),
            ],
            extra_tensors,
        )

    def allocate_combine_input(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor | None:
        """None: these managers combine from any tensor, so the caller allocates as usual."""
        self._check_open("allocate_combine_input")
        return None

    def combine_into_output(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor:
        """:meth:`combine` written into ``output`` (this rank's tokens); returns ``output``."""
        return checks.write_into(output, self.combine(hidden_states, is_sequence_parallel))

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """Sum every rank's expert output and return this rank's own rows."""
        self._check_open("combine")
        counts = self._stated_counts or self._pending_counts
        if counts is None:
            raise GroupcoordValueError(
                f"{self.name} all2all: combine needs the token counts of a preceding dispatch "
                "(or a token_counts() block); none is pending"
            )
        if not isinstance(hidden_states, torch.Tensor):
            raise GroupcoordTypeError(
                f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}"
            )
        if hidden_states.dim() < 1 or hidden_states.shape[0] != sum(counts):
            raise GroupcoordValueError(
                f"hidden_states must have {sum(counts)} rows (all ranks' tokens {counts}), "
                f"got shape {tuple(hidden_states.shape)}"
            )
        if sum(counts) == 0:
            out = hidden_states.new_empty(hidden_states.shape)
        elif self._local_only:
            out = hidden_states.clone()  # only this rank's rows were dispatched
        else:
            if get_config().debug_desync:
                self._agree_on_combine(hidden_states, counts)
            out = self._combine(hidden_states.contiguous(), counts)
        self._pending_counts = None
        return out

    @contextlib.contextmanager
    def token_counts(self, counts: Sequence[int]) -> Iterator[None]:
        """State every rank's token count for a block (skips the per-dispatch count gather)."""
        checked = [int(c) for c in counts]
        if len(checked) != self.world_size or any(c < 0 for c in checked):
            raise GroupcoordValueError(
                f"counts must hold {self.world_size} non-negative token counts, got {list(counts)}"
            )
        previous = self._stated_counts
        self._stated_counts = checked
        try:
            yield
        finally:
            self._stated_counts = previous

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Size buffers from the model's MoE layers (modules with ``moe_buffer_spec()``)."""
        self._check_open("prepare_communication_buffer_for_model")
        specs = [m.moe_buffer_spec() for m in model.modules() if isinstance(m, HasMoEBufferSpec)]
        if not specs:
            return
        dtypes = {s.dtype for s in specs}
        if len(dtypes) != 1:
            raise GroupcoordValueError(
                f"model: MoE layers disagree on dtype: {sorted(map(str, dtypes))}"
            )
        spec = MoEBufferSpec(
            max_tokens_per_rank=max(s.max_tokens_per_rank for s in specs),
            hidden_size=max(s.hidden_size for s in specs),
            num_experts=max(s.num_experts for s in specs),
            dtype=specs[0].dtype,
        )
        self.buffer_spec = spec
        self._allocate(spec)

    def destroy(self) -> None:
        """Release buffers; the manager refuses further calls."""
        self._release()
        self._pending_counts = None
        self._closed = True

    def clean_buffers(self) -> None:
        """After a fault: drop reusable buffers and a dispatch still waiting for its
        combine, and record the current dead-rank mask as the new recovery point
        (what :meth:`query_fault` compares against)."""
        self._release()
        self._pending_counts = None
        self._baseline = self._dead_mask()

    # ---- fault queries (vLLM's EP fault-tolerance hooks) ---------------------------

    # Whether an engine may run its EP fault-recovery flow over this manager. These
    # managers see dead peers (query_active_mask) but a dispatch that meets one raises
    # PeerDiedError naming it instead of skipping it: False, like vLLM's default.
    support_fault_tolerance = False

    def _dead_mask(self) -> torch.Tensor:
        comm = self.communicator
        dead = set(dead_peers(comm.peer_pids))
        return torch.tensor([int(r in dead) for r in comm.ranks], dtype=torch.int32)

    def query_active_mask(self) -> torch.Tensor:
        """int32 CPU tensor, one entry per EP rank (vLLM's convention): 1 where the
        rank is masked, 0 where it is live. A rank is masked when its process on
        this host is gone, or (every peer) inside :meth:`mask_remote_ranks`. Peers
        on other hosts count as live: the next collective with a dead one raises
        naming it. Built on the CPU, as a fault probe must not touch the device."""
        mask = self._dead_mask()
        if self._local_only:
            mask.fill_(1)
            mask[self.rank] = 0
        return mask

    def query_fault(self) -> torch.Tensor:
        """Scalar bool tensor: True when a rank died since the last recovery point."""
        return torch.tensor(bool(torch.any(self._dead_mask() != self._baseline)))

    @contextlib.contextmanager
    def mask_remote_ranks(self) -> Iterator[None]:
        """Run dispatch/combine on this rank alone for a block (a warm-up or dummy
        run while peers are not taking part): dispatch returns this rank's own
        tokens, combine its own rows, and nothing is sent. Local, not collective."""
        previous = self._local_only
        self._local_only = True
        try:
            yield
        finally:
            self._local_only = previous

    def checkpoint_prepare(self) -> None:
        """Drop the reusable buffers before a checkpoint (:meth:`checkpoint_restore`
        re-allocates them from the model's announced spec)."""
        self._release()
        self._pending_counts = None

    def checkpoint_restore(self) -> None:
        self._check_open("checkpoint_restore")
        if self.buffer_spec is not None:
            self._allocate(self.buffer_spec)

    def set_num_sms(self, num_sms: int) -> None:
        """Accepted and checked; these managers run no SM-resident kernels to limit."""
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
            raise GroupcoordValueError(f"num_sms must be an int >= 1, got {num_sms!r}")

    def max_sms_used(self) -> int | None:
        """None: these managers occupy no SMs (they call the communicator's collectives)."""
        return None

    get_handle = unsupported("get_handle", "handles of vendor all2all kernels (DeepEP, pplx, ...)")

    # Elastic EP: vLLM builds standby groups of the new size, calls stage_ep_size()
    # on the standby EP group's manager, switches to those groups, then commits.
    # Managers that connect ranks incrementally (NIXL EP) connect the new ranks
    # masked at stage and unmask them at commit. A groupcoord manager is built for
    # its group's size and membership and holds nothing sized by other ranks, so
    # it is complete at construction: both steps only check it is open.

    def stage_ep_size(self) -> None:
        """Elastic EP's first step: nothing to prepare (see above); not collective."""
        self._check_open("stage_ep_size")

    def commit_ep_size(self) -> None:
        """Elastic EP's second step: nothing to switch (see above); not collective."""
        self._check_open("commit_ep_size")

    # ----------------------------------------------------------- for subclasses
    def _dispatch(self, tensors: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _combine(self, hidden_states: torch.Tensor, counts: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _allocate(self, spec: MoEBufferSpec) -> None:
        """Hook: reserve buffers for ``spec`` (default: nothing to reserve)."""

    def _release(self) -> None:
        """Drop the reusable buffers."""
        self._buffers.clear()

    # ------------------------------------------------------------------ helpers
    def _gather_tokens(
        self,
        named: list[tuple[str, torch.Tensor]],
        extra_tensors: Sequence[torch.Tensor] | None,
    ) -> DispatchResult:
        self._check_open("dispatch")
        extras = self._check_dispatch_args(named, extra_tensors)
        hidden_states = named[0][1]
        tensors = [t for _, t in named] + extras
        names = [n for n, _ in named] + [f"extra_tensors[{i}]" for i in range(len(extras))]
        if self._local_only:
            counts = [0] * self.world_size
            counts[self.rank] = hidden_states.shape[0]
            gathered = [t.clone() for t in tensors]  # nothing leaves this rank
        else:
            counts = self._counts_for(hidden_states.shape[0], names, tensors)
            # No rank has a token: every rank knows it, so all skip the collective.
            gathered = (
                [t.new_empty(t.shape) for t in tensors]
                if sum(counts) == 0
                else self._dispatch(tensors, counts)
            )
        self._pending_counts = counts
        fixed = tuple(gathered[: len(named)])
        if extra_tensors is None:
            return fixed  # type: ignore[return-value]
        return (*fixed, gathered[len(named) :])  # type: ignore[return-value]

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise ClosedError(f"{self.name} all2all manager: {operation} after destroy()")

    def _check_dispatch_args(
        self,
        named: list[tuple[str, torch.Tensor]],
        extra_tensors: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        extras = list(extra_tensors) if extra_tensors is not None else []
        named = named + [(f"extra_tensors[{i}]", t) for i, t in enumerate(extras)]
        for arg, tensor in named:
            checks.tensor(tensor, arg)  # before the token counts' exchange: nothing sent
        hidden_states = named[0][1]
        if hidden_states.dim() != 2:
            raise GroupcoordValueError(
                f"hidden_states must be 2-D [tokens, hidden], got shape {tuple(hidden_states.shape)}"
            )
        tokens = hidden_states.shape[0]
        for arg, tensor in named[1:]:
            if tensor.dim() < 1 or tensor.shape[0] != tokens:
                raise GroupcoordValueError(
                    f"{arg} must have {tokens} rows like hidden_states, got shape {tuple(tensor.shape)}"
                )
            if tensor.device != hidden_states.device:
                raise GroupcoordValueError(
                    f"{arg} is on {tensor.device}, hidden_states on {hidden_states.device}"
                )
        spec = self.buffer_spec
        if spec is not None and hidden_states.shape[1] > spec.hidden_size:
            raise GroupcoordValueError(
                f"hidden_states has hidden size {hidden_states.shape[1]}, more than the "
                f"{spec.hidden_size} the model's MoE layers announced"
            )
        return extras

    def _counts_for(
        self, local_tokens: int, names: list[str], tensors: list[torch.Tensor]
    ) -> list[int]:
        """Every rank's token count, from one small all-gather that also carries a
        checksum of what each rank dispatches (each tensor's dtype and dims after the
        first): ranks whose tensors differ raise ``DesyncError`` naming both, on every
        rank, before any token moves. The broadcasts and all-gathers that follow
        would pair pieces of different sizes: Gloo aborts the process on that, and
        NCCL checks nothing. Counts stated with ``token_counts()`` skip the
        exchange, unless ``debug_desync`` is on: then the stated counts are
        checked too (the same on every rank, and each rank's own)."""
        stated = self._stated_counts
        if stated is not None:
            if stated[self.rank] != local_tokens:
                raise GroupcoordValueError(
                    f"hidden_states has {local_tokens} rows but token_counts() states "
                    f"{stated[self.rank]} for rank {self.rank}"
                )
            if not get_config().debug_desync:
                return list(stated)

        def describe() -> str:
            return "dispatches " + ", ".join(
                f"{n} {str(t.dtype).removeprefix('torch.')}{list(t.shape[1:])}"
                for n, t in zip(names, tensors)
            )

        key = (tuple(names), tuple((t.dtype, t.shape[1:]) for t in tensors))
        if stated is None:
            hint = (
                "every rank must dispatch tensors of the same dtypes and sizes after the first dim"
            )
            return self._agree("dispatch", local_tokens, key, describe, hint)
        counts = tuple(stated)
        # Each rank checked its own entry above: counts every rank states alike are right.
        return self._agree(
            "dispatch",
            local_tokens,
            (key, counts),
            lambda: f"{describe()} with token_counts({list(counts)})",
            "every rank must dispatch the same tensors and state the same token counts "
            "(debug_desync check)",
        )

    def _agree_on_combine(self, hidden_states: torch.Tensor, counts: list[int]) -> None:
        """``debug_desync``'s check of a combine: every rank combines a tensor of the
        same dtype and shape for the same counts (a rank that dispatches meanwhile,
        or combines another shape, raises ``DesyncError`` naming both)."""
        dtype, shape = hidden_states.dtype, list(hidden_states.shape)
        self._agree(
            "combine",
            0,
            ("combine", dtype, tuple(shape), tuple(counts)),
            lambda: (
                f"combines hidden_states {str(dtype).removeprefix('torch.')}{shape} "
                f"for token counts {counts}"
            ),
            "every rank must make the same dispatch and combine calls, in the same order, "
            "with tensors of the same dtype and shape (debug_desync check)",
        )

    def _agree(
        self,
        operation: str,
        tokens: int,
        key: Any,
        describe: Callable[[], str],
        hint: str,
    ) -> list[int]:
        """Every rank's ``tokens``, from one small all-gather that carries a checksum
        of what each rank is about to do (``describe()``, made once per ``key``):
        when the checksums differ every rank gathers the descriptions and raises
        ``DesyncError`` naming both, before anything else moves."""
        known = self._layouts.get(key)
        if known is None:  # made once per kind of call (2 us against 5)
            text = describe().encode()
            if len(self._layouts) >= 64:
                self._layouts.clear()
            known = self._layouts[key] = (zlib.crc32(text), text)
        checksum, said_here = known
        device = self.communicator.device  # (a CUDA group's collectives take CUDA tensors)
        mine = torch.tensor([tokens, checksum, len(said_here)], dtype=torch.int64, device=device)
        table = self.communicator.all_gather(mine, dim=0).view(-1, 3).tolist()
        if any(row[1] != checksum for row in table):
            # Every rank sees the same table: all gather the descriptions and raise alike.
            lengths = [row[2] for row in table]
            data = torch.frombuffer(bytearray(said_here), dtype=torch.uint8).to(device)
            joined = self.communicator.all_gatherv(data, dim=0, sizes=lengths)
            assert isinstance(joined, torch.Tensor)
            raw = bytes(joined.cpu().numpy())
            starts = self._offsets(lengths)
            said = [raw[a:b].decode() for a, b in itertools.pairwise(starts)]
            other = next(r for r, row in enumerate(table) if row[1] != checksum)
            if said[other].split()[0] != said[self.rank].split()[0]:
                hint = "the ranks' dispatch and combine calls are out of step"
            raise DesyncError(
                f"{self.name} all2all: {operation}: rank {self.rank} {said[self.rank]}, "
                f"rank {other} {said[other]}: {hint}"
            )
        return [row[0] for row in table]

    @staticmethod
    def _offsets(counts: list[int]) -> list[int]:
        return [0, *itertools.accumulate(counts)]
