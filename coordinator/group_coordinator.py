"""``GroupCoordinator``: one parallel group (world, TP, PP, DP or EP) of ranks.

vLLM's class, kept name for name: members, methods, arguments, in-group
``src``/``dst``. Each coordinator owns a Gloo CPU group for control, a
device group for tensors (the same Gloo group on CPU), a device
communicator for the fast tensor paths and, for TP, a shared-memory message
queue that broadcasts objects. On top of vLLM it checks arguments before
anything is sent, bounds every wait, names the ranks that did not arrive
when a collective fails, and moves objects and metadata without pickle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from device_communicators import checks
from device_communicators.shm_phases import closing_reason, sent_after_its_stamp
from device_communicators.shm_small import SmallCalls
from shm_broadcast.config import get_config
from shm_broadcast.group_io import all_gather_bytes

from . import custom_ops, tensor_dicts
from .errors import DesyncError, GroupcoordTypeError, GroupcoordValueError, NotSupportedError
from .group_base import building, desync_cleanup, get_device_communicator_cls
from .group_messaging import COMPLETED, GroupMessaging, Handle

# Bound once: every eager collective asks it first (two module lookups fewer a call).
_is_compiling = torch.compiler.is_compiling

__all__ = ["GraphCaptureContext", "GroupCoordinator", "Handle", "get_device_communicator_cls"]


@dataclasses.dataclass
class GraphCaptureContext:
    """What ``graph_capture`` yields: the capture stream (None on CPU)."""

    stream: Any = None


class GroupCoordinator(GroupMessaging):
    """A group of processes and every collective over it (see the module docstring).

    ``group_ranks`` lists every group of this kind (all ranks call the
    constructor with the same list); the caller's group is the one holding
    its rank. ``timeout`` (keyword only; seconds or a timedelta) overrides the configured
    deadline for this group's waits.
    """

    # ---- graph capture ------------------------------------------------------------

    @contextlib.contextmanager
    def graph_capture(
        self, graph_capture_context: GraphCaptureContext | None = None
    ) -> Iterator[GraphCaptureContext]:
        """Capture context: a side stream on CUDA; on CPU it yields and changes nothing."""
        context = graph_capture_context or GraphCaptureContext()
        if self.device.type != "cuda":
            yield context
            return
        from device_communicators.cuda_communicator import CudaCommunicator

        if isinstance(self.device_communicator, CudaCommunicator):
            # Side stream plus the custom all-reduce's capture mode (its
            # buffers are registered when the block exits; collective).
            with self.device_communicator.graph_capture(context.stream) as stream:
                context.stream = stream
                yield context
            return
        if context.stream is None:
            context.stream = torch.cuda.Stream(device=self.device)
        # The capture stream must see everything queued on the current one.
        context.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(context.stream):
            yield context

    # ---- tensor collectives ---------------------------------------------------------

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum over the group; out of place (``input_`` is unchanged)."""
        if self.world_size == 1:
            checks.traced_tensor(input_, "input_")
            return input_
        if _is_compiling():
            return torch.ops.groupcoord.all_reduce(input_, self.unique_name)
        small = self._lean()
        if small is not None:
            # An engine's most common call: the communicator's lean path, one call deep.
            out = small.all_reduce(input_)
            if out is not None:
                self._collective_seq += 1
                return out
        return self._all_reduce_eager(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's equally shaped ``input_`` concatenated along ``dim``."""
        if self.world_size > 1 and not _is_compiling():
            small = self._lean()
            if small is not None:
                out = small.all_gather(input_, dim)
                if out is not None:
                    self._collective_seq += 1
                    return out
            return self._all_gather_eager(input_, dim)  # the communicator checks the arguments
        dim = checks.dim(checks.traced_tensor(input_, "input_"), dim)
        if self.world_size == 1:
            return input_
        return torch.ops.groupcoord.all_gather(input_, dim, self.world_size, self.unique_name)

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather of tensors whose lengths along ``dim`` differ by rank (exact result).

        ``sizes`` (one per rank) are discovered with a small all-gather when None.
        A list of tensors gathers each and returns a list.
        """
        if self.world_size == 1:
            return input_
        if _is_compiling():
            if sizes is None:
                raise GroupcoordValueError(
                    "sizes: all_gatherv under torch.compile needs the sizes (shapes must be static)"
                )
            if isinstance(input_, list):
                return [self._traced_all_gatherv(t, dim, sizes) for t in input_]
            return self._traced_all_gatherv(input_, dim, sizes)
        small = self._lean()
        if small is not None and small.equal_parts(input_, dim, sizes):
            return self.all_gather(input_, dim)  # equal parts: an all-gather (see there)
        return self._all_gatherv_eager(input_, dim, sizes)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group, then keep this rank's equal slice along ``dim``."""
        if self.world_size > 1 and not _is_compiling():
            small = self._lean()
            if small is not None:
                out = small.reduce_scatter(input_, dim)
                if out is not None:
                    self._collective_seq += 1
                    return out
            return self._reduce_scatter_eager(input_, dim)  # the communicator checks the arguments
        dim = checks.dim(checks.traced_tensor(input_, "input_"), dim)
        if self.world_size == 1:
            return input_
        return torch.ops.groupcoord.reduce_scatter(input_, dim, self.world_size, self.unique_name)

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """Sum over the group, then keep ``sizes[rank]`` rows along ``dim`` (equal when None)."""
        dim = checks.dim(checks.traced_tensor(input_, "input_"), dim)
        if self.world_size == 1:
            return input_
        if _is_compiling() and sizes is not None:
            return torch.ops.groupcoord.reduce_scatterv(
                input_, dim, list(sizes), self.rank_in_group, self.unique_name
            )
        if _is_compiling() or checks.equal_split(sizes, input_, dim, self.world_size):
            return self.reduce_scatter(input_, dim)  # equal parts: the plain call
        return self._reduce_scatterv_eager(input_, dim, sizes)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``input_`` concatenated along ``dim`` on in-group rank ``dst``; None elsewhere."""
        self._check_index(dst, "dst")
        dim = checks.dim(checks.traced_tensor(input_, "input_"), dim)
        if self.world_size == 1:
            return input_
        # Lengths along dim may differ by rank; the rest must not.
        return self._checked(
            "gather",
            lambda: f"{_shape_of(input_, dim)}, dst={dst}",
            self._tensor_comm().gather,
            input_,
            dst,
            dim,
        )

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``input_`` on every rank, in place (out of place under torch.compile)."""
        if self.world_size > 1 and not _is_compiling():
            # The lean path takes only valid arguments; the checks below are for the rest.
            small = self._lean()
            if small is not None and small.broadcast(input_, src) is not None:
                self._collective_seq += 1
                return input_
        self._check_index(src, "src")
        checks.traced_tensor(input_, "input_")
        if self.world_size == 1:
            return input_
        if _is_compiling():
            return torch.ops.groupcoord.broadcast(input_, src, self.unique_name)
        return self._broadcast_eager(input_, src)

    def _lean(self) -> SmallCalls | None:
        """The communicator's lean path for small calls, unless ``debug_desync`` wants
        every call checked through :meth:`_in_step` first."""
        small = self._small
        return None if small is None or get_config().debug_desync else small

    def _all_reduce_eager(self, input_: torch.Tensor) -> torch.Tensor:
        return self._checked(
            "all_reduce", lambda: _shape_of(input_), self._tensor_comm().all_reduce, input_
        )

    def _all_gather_eager(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        return self._checked(
            "all_gather",
            lambda: f"{_shape_of(input_)}, dim={dim}",
            self._tensor_comm().all_gather,
            input_,
            dim,
        )

    def _all_gatherv_eager(
        self, input_: torch.Tensor | list[torch.Tensor], dim: int, sizes: list[int] | None
    ) -> Any:
        # Lengths along dim may differ by rank; given sizes may not.
        comm = self._tensor_comm()
        return self._checked(
            "all_gatherv",
            lambda: f"{_shape_of(input_, dim)}, dim={dim}, sizes={sizes}",
            comm.all_gatherv,
            input_,
            dim,
            sizes,
        )

    def _reduce_scatter_eager(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        comm = self._tensor_comm()
        return self._checked(
            "reduce_scatter",
            lambda: f"{_shape_of(input_)}, dim={dim}",
            comm.reduce_scatter,
            input_,
            dim,
        )

    def _reduce_scatterv_eager(
        self, input_: torch.Tensor, dim: int, sizes: list[int] | None
    ) -> torch.Tensor:
        comm = self._tensor_comm()
        return self._checked(
            "reduce_scatterv",
            lambda: f"{_shape_of(input_)}, dim={dim}, sizes={sizes}",
            comm.reduce_scatterv,
            input_,
            dim,
            sizes,
        )

    def _broadcast_eager(self, input_: torch.Tensor, src: int) -> torch.Tensor:
        return self._checked(
            "broadcast",
            lambda: f"{_shape_of(input_)}, src={src}",
            self._tensor_comm().broadcast,
            input_,
            src,
        )

    def _checked(self, operation: str, call: Callable[[], str], fn: Any, *args: Any) -> Any:
        """Collective ``fn(*args)``, shown to the peers first when ``debug_desync`` is
        on (:meth:`_in_step`, ``call`` says what it is): the two steps are one call,
        whole (no other thread's call comes between them)."""
        if not get_config().debug_desync:
            return self._collective(operation, fn, *args)
        with self._whole(operation):
            self._in_step(operation, call)
            return self._collective(operation, fn, *args)

    def _in_step(self, operation: str, call: Callable[[], str]) -> None:
        """For ``debug_desync`` (:meth:`_checked`): every rank shows the others the call
        it is about to make (a checksum; the calls themselves only when they differ)
        and its one-way traffic in the group so far (as the shared-memory path's
        stamps do: ``PhaseLines._check_agreement``). Ranks that disagree all raise
        DesyncError naming both sides; traffic out of balance closes the group."""
        seq = self._desync_seq
        self._desync_seq += 1
        mine = f"{operation}({call()})"
        traffic = self._traffic
        several = custom_ops.live_groups() > 1  # (see shm_phases.groups_alive)
        stamp = torch.tensor(
            [
                zlib.crc32(mine.encode()),
                traffic.queue_calls,
                traffic.messages,
                traffic.unordered(),
                several,
            ],
            dtype=torch.int64,
        )
        stamps = torch.empty((self.world_size, 5), dtype=torch.int64)
        parts = list(stamps.unbind(0))
        self._collective(operation, dist.all_gather, parts, stamp, self.cpu_group)
        same_call = bool((stamps[:, 0] == stamp[0]).all())
        counts = stamps[:, 1].tolist()
        in_flight = int(stamps[:, 2].sum())
        balanced = len(set(counts)) == 1 and not in_flight
        unordered = bool(stamps[:, 3].any()) or sent_after_its_stamp(
            max(counts) - counts[0], in_flight
        )
        if same_call and (balanced or unordered):
            return  # (see PhaseLines._check_agreement)
        # Every rank saw the same table, so every rank takes this path.
        gathered = self._collective(operation, all_gather_bytes, self.cpu_group, mine.encode())
        calls = [c.decode() for c in gathered]
        me = self.rank_in_group
        other = next((r for r, theirs in enumerate(calls) if theirs != mine), None)
        if other is None:
            message = f"{self.unique_name}: every rank called {mine} as call #{seq} of the group"
        else:
            message = (
                f"{self.unique_name}: rank {me} called {mine} as call #{seq} of the group, "
                f"rank {other} called {calls[other]}"
            )
        message += " (debug_desync check)"
        most, fewest = counts.index(max(counts)), counts.index(min(counts))
        queue = (most, fewest, counts[most] - counts[fewest]) if most != fewest else None
        sent = dict(enumerate(stamps[:, 2].tolist())) if in_flight else None
        elsewhere = None
        if other is not None:
            elsewhere = [r for r, flag in enumerate(stamps[:, 4].tolist()) if flag]
        closing = closing_reason(self.unique_name, queue, sent, elsewhere)
        if closing is not None:
            message = f"{message}; {closing}"
        note = ""
        mq = self.mq_broadcaster
        if mq is not None:  # every rank drops, then goes on (no new broadcast sooner)
            note = desync_cleanup(mq, self)(None)
            self._collective(operation, dist.barrier, self.cpu_group)
        if closing is not None:
            self._failure = message  # after the barrier, which a closed group refuses
        raise DesyncError(message + note)

    def _traced_all_gatherv(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> Any:
        dim = checks.dim(checks.traced_tensor(tensor, "input_"), dim)
        return torch.ops.groupcoord.all_gatherv(tensor, dim, list(sizes), self.unique_name)

    # ---- tensor dicts ---------------------------------------------------------------

    def broadcast_tensor_dict(
        self,
        tensor_dict: Mapping[str, Any] | None = None,
        src: int = 0,
        group: ProcessGroup | None = None,
        metadata_group: ProcessGroup | None = None,
    ) -> dict[str, Any] | None:
        """``src``'s dict of tensors and plain values on every rank.

        Metadata (and small CPU tensors, inline) go in one message, through
        the message queue when the group has one (then every CPU tensor rides
        in it); other tensors follow as broadcasts. ``src`` gets its own dict back.
        """
        self._check_index(src, "src")
        if self.world_size == 1:
            return dict(tensor_dict) if tensor_dict is not None else None
        # Through a CPU group's queue the dict is one message (every tensor rides
        # in it), which keeps the queue end's turns: its read may wait as long as
        # the writer lives, and holding the call lock through it would stall
        # another thread's collective that the writer waits in (as broadcast_object).
        one_message = (
            self.mq_broadcaster is not None
            and src == 0
            and metadata_group is None
            and self.device.type == "cpu"
        )
        with self._whole("broadcast_tensor_dict", lock=not one_message):
            return tensor_dicts.broadcast(self, tensor_dict, src, group, metadata_group)

    def send_tensor_dict(
        self,
        tensor_dict: Mapping[str, Any],
        dst: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[str, bool] | None = None,
    ) -> None:
        """Send a dict of tensors and plain values to in-group rank ``dst`` (default: next).

        With an ``all_gather_group`` (e.g. TP, when the dict is replicated
        across it), each peer sends only its 1/N slice of a tensor and the
        receiver's group all-gathers the whole; ``all_gather_tensors[key]``
        forces it on or off per tensor (default: on when divisible by N).
        """
        if self.world_size == 1:
            return None
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        self._check_peer(dst, "dst")
        _check_all_gather_group(all_gather_group)
        with self._whole("send_tensor_dict", lock=False):
            tensor_dicts.send(self, tensor_dict, dst, all_gather_group, all_gather_tensors)
        return None

    def recv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[str, bool] | None = None,
    ) -> dict[str, Any] | None:
        """The dict that in-group rank ``src`` (default: previous) sent with ``send_tensor_dict``.

        Which tensors came sliced is in the metadata (the sender decided);
        ``all_gather_tensors`` is accepted for vLLM compatibility.
        """
        if self.world_size == 1:
            return None
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        self._check_peer(src, "src")
        _check_all_gather_group(all_gather_group)
        with self._whole("recv_tensor_dict", lock=False):
            return tensor_dicts.recv(self, src, all_gather_group)

    def isend_tensor_dict(
        self,
        tensor_dict: Mapping[str, Any],
        dst: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[str, bool] | None = None,
    ) -> list[Handle]:
        """:meth:`send_tensor_dict`; the send is complete when this returns, so the
        handles are complete. A dict that fits the pair's shared-memory ring is
        buffered there; a larger one returns once the receiver has read all but
        the ring's last 64 MiB (docs/coordinator.md)."""
        self.send_tensor_dict(tensor_dict, dst, all_gather_group, all_gather_tensors)
        return [COMPLETED]

    def irecv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[str, bool] | None = None,
    ) -> tuple[dict[str, Any] | None, list[Handle], list[Callable[[], None]]]:
        """(dict, handles, post-processing steps) as vLLM returns them; the dict has
        arrived when this returns, so the handles are complete and no step is left."""
        received = self.recv_tensor_dict(src, all_gather_group, all_gather_tensors)
        return received, [COMPLETED], []

    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum of a CPU tensor over the CPU (Gloo) group."""
        moved = checks.tensor(tensor, "tensor")  # detached: the same memory
        if self.world_size > 1:
            self._collective(
                "cpu_all_reduce_", dist.all_reduce, moved, ReduceOp.SUM, self.cpu_group
            )
        return tensor

    def reduce_scatterv_into_output(
        self,
        input_: torch.Tensor,
        output: torch.Tensor,
        dim: int = -1,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce_scatterv` written into ``output``; returns ``output``."""
        return checks.write_into(output, self.reduce_scatterv(input_, dim, sizes))

    def make_sibling_device_group(self, group_desc: str | None = None) -> ProcessGroup:
        """A second device process group over the same ranks (made by these ranks only)."""
        with building(f"a sibling of group {self.unique_name}") as refused:
            if refused is not None:
                raise refused
            return dist.new_group(
                self.ranks,
                backend=dist.get_backend(self.device_group),
                timeout=datetime.timedelta(seconds=self.timeout_s),
                use_local_synchronization=True,
                group_desc=group_desc,
            )

    # ---- control --------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait until every rank of the group is here (bounded by the deadline): the
        device communicator's barrier (shared memory on CPU), else the CPU group's."""
        if self.world_size == 1:
            return
        if self.device_communicator is not None:
            self._checked("barrier", str, self.device_communicator.barrier)
        else:
            self._checked("barrier", str, dist.barrier, self.cpu_group)

    def _moe(self, operation: str, alone: Any, *args: Any) -> Any:
        """An EP call through the device communicator's all2all manager; a group of
        one rank answers ``alone()`` (what the exchange would give)."""
        if self.device_communicator is None:
            if self.world_size == 1:
                return alone()
            raise NotSupportedError(operation, f"group {self.unique_name} (no device communicator)")
        return self._collective(operation, getattr(self.device_communicator, operation), *args)

    def dispatch_router_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Any:
        """Every EP rank's tokens and router logits, in rank order (before top-k)."""

        def alone() -> Any:
            if extra_tensors is None:
                return hidden_states, router_logits
            return hidden_states, router_logits, list(extra_tensors)

        args = (hidden_states, router_logits, is_sequence_parallel, extra_tensors)
        return self._moe("dispatch_router_logits", alone, *args)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Any:
        """Every EP rank's tokens with their top-k routing: (hidden, topk_weights,
        topk_ids[, extras]) in rank order, as vLLM 0.33 returns them."""

        def alone() -> Any:
            if extra_tensors is None:
                return hidden_states, topk_weights, topk_ids
            return hidden_states, topk_weights, topk_ids, list(extra_tensors)

        args = (hidden_states, topk_weights, topk_ids, is_sequence_parallel, extra_tensors)
        return self._moe("dispatch", alone, *args)

    def combine(self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False) -> Any:
        """Sum expert outputs back to the tokens' home ranks."""
        return self._moe("combine", lambda: hidden_states, hidden_states, is_sequence_parallel)

    def allocate_combine_input(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor | None:
        """A buffer the manager wants expert outputs in, or None (allocate as usual)."""
        if self.device_communicator is None:
            return None
        return self.device_communicator.allocate_combine_input(
            shape, dtype, device, is_sequence_parallel
        )

    def combine_into_output(
        self, hidden_states: torch.Tensor, output: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """:meth:`combine` written into ``output``; returns ``output``."""
        return self._moe(
            "combine_into_output",
            lambda: output.copy_(hidden_states),
            hidden_states,
            output,
            is_sequence_parallel,
        )

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        if self.device_communicator is not None:
            self.device_communicator.prepare_communication_buffer_for_model(model)


def _shape_of(tensor: Any, free_dim: int | None = None) -> str:
    """How a debug_desync check names a call's tensor: ``float32[4, 8]``; a list's
    tensors in brackets (a list of one as that tensor: the same call); ``free_dim``'s
    length as ``*`` (it may differ by rank)."""
    if isinstance(tensor, list) and len(tensor) == 1:
        return _shape_of(tensor[0], free_dim)
    if isinstance(tensor, list):
        return f"[{', '.join(_shape_of(t, free_dim) for t in tensor)}]"
    if not isinstance(tensor, torch.Tensor):  # checked later, by the communicator
        return type(tensor).__name__
    sizes: list[Any] = list(tensor.shape)
    if type(free_dim) is int and -len(sizes) <= free_dim < len(sizes):
        sizes[free_dim] = "*"
    return f"{str(tensor.dtype).removeprefix('torch.')}[{', '.join(map(str, sizes))}]"


def _check_all_gather_group(group: Any) -> None:
    if group is not None and not isinstance(group, GroupCoordinator):
        raise GroupcoordTypeError(
            f"all_gather_group must be a GroupCoordinator, got {type(group).__name__}"
        )
