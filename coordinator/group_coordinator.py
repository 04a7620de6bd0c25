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
import importlib
import os
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from device_communicators import checks
from device_communicators.base_device_communicator import DeviceCommunicatorBase
from shm_broadcast.codec import dumps, loads
from shm_broadcast.config import get_config, resolve_timeout
from shm_broadcast.group_io import all_gather_bytes, broadcast_bytes
from shm_broadcast.liveness import dead_peers, host_key
from shm_broadcast.p2p_channels import P2PChannels

from . import custom_ops, tensor_dicts
from .errors import (
    ClosedError,
    DesyncError,
    GroupcoordError,
    GroupcoordTypeError,
    GroupcoordValueError,
    NotSupportedError,
)
from .failures import absent_ranks, classify

# Device kind -> (module, class) of its communicator, imported on first use
# so CUDA code is only loaded where a CUDA group exists.
_COMMUNICATORS: dict[str, tuple[str, str]] = {
    "cpu": ("device_communicators.cpu_communicator", "CpuCommunicator"),
    "cuda": ("device_communicators.cuda_communicator", "CudaCommunicator"),
}

_name_counters: dict[str, int] = defaultdict(int)


def _unique_name(name: str) -> str:
    """ "tp" -> "tp:0", then "tp:1" ...: the key of the group's custom ops."""
    unique = f"{name}:{_name_counters[name]}"
    _name_counters[name] += 1
    return unique


def get_device_communicator_cls(device: torch.device) -> type[DeviceCommunicatorBase]:
    """The communicator class for groups whose tensors live on ``device``."""
    entry = _COMMUNICATORS.get(device.type)
    if entry is None:
        raise GroupcoordValueError(
            f"device={device}: no communicator for device kind {device.type!r} "
            f"(known: {', '.join(sorted(_COMMUNICATORS))})"
        )
    cls: type[DeviceCommunicatorBase] = getattr(importlib.import_module(entry[0]), entry[1])
    return cls


@dataclasses.dataclass
class GraphCaptureContext:
    """What ``graph_capture`` yields: the capture stream (None on CPU)."""

    stream: Any = None


class Handle(Protocol):
    """What vLLM's asynchronous sends and receives return."""

    def is_completed(self) -> bool: ...

    def wait(self) -> None: ...


class _CompletedHandle:
    """The handle of a transfer that finished before its call returned."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


COMPLETED: Handle = _CompletedHandle()


class GroupCoordinator:
    """A group of processes and every collective over it (see the module docstring).

    ``group_ranks`` lists every group of this kind (all ranks call the
    constructor with the same list); the caller's group is the one holding
    its rank. ``timeout`` (keyword only; seconds or a timedelta) overrides the configured
    deadline for this group's waits.
    """

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        torch_distributed_backend: str | dist.Backend,
        use_device_communicator: bool,
        use_message_queue_broadcaster: bool = False,
        group_name: str | None = None,
        use_all2all: bool = False,
        *,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise GroupcoordValueError(
                "torch.distributed is not initialised: call init_distributed_environment first"
            )
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.timeout_s = resolve_timeout(timeout)
        my_ranks = _check_group_ranks(group_ranks, self.rank, dist.get_world_size())
        self.unique_name = _unique_name(group_name or "anonymous")
        backend = str(torch_distributed_backend)
        deadline = datetime.timedelta(seconds=self.timeout_s)
        device_group: ProcessGroup | None = None
        cpu_group: ProcessGroup | None = None
        # Every rank creates every group, in the same order: c10d requires it.
        for ranks in group_ranks:
            dev = dist.new_group(list(ranks), backend=backend, timeout=deadline)
            # On Gloo one group serves both roles; a second would only add sockets.
            cpu = (
                dev
                if backend == "gloo"
                else dist.new_group(list(ranks), backend="gloo", timeout=deadline)
            )
            if list(ranks) == my_ranks:
                device_group, cpu_group = dev, cpu
        assert device_group is not None and cpu_group is not None
        self.ranks: list[int] = list(my_ranks)
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)
        self.cpu_group: ProcessGroup = cpu_group
        self.device_group: ProcessGroup = device_group
        self.device = (
            torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
        )
        self.use_device_communicator = use_device_communicator
        self._collective_seq = 0
        self._desync_seq = 0  # calls checked by debug_desync
        self.node_count = 1  # hosts among the group's ranks (set by _exchange_pids)
        # Host identity (liveness.host_key) of each in-group rank (set by _exchange_pids).
        self.host_keys: list[int] = []
        self._destroyed = False
        self._plain_comm: DeviceCommunicatorBase | None = None
        self.device_communicator: DeviceCommunicatorBase | None = None
        # The device communicator's lean path for small sums (AllReduceBackend.small_sum).
        self._small_sum: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        self.mq_broadcaster: Any = None
        # Peers on this host, rank -> pid: a failed call names a dead one at once.
        self._local_pids: dict[int, int] = {}
        self._p2p_channels = P2PChannels(self.unique_name, self.rank, {}, self.timeout_s)
        try:
            self._local_pids = self._exchange_pids()
            if not get_config().disable_shm_p2p:
                # Tensor dicts to and from peers on this node go through shared memory.
                self._p2p_channels.peers = dict(self._local_pids)
            self._build_helpers(use_device_communicator, use_message_queue_broadcaster, use_all2all)
        except BaseException:
            # Leave nothing half-built behind (process groups, shared memory).
            self.destroy()
            raise
        custom_ops.register_group(self.unique_name, self)

    def _exchange_pids(self) -> dict[int, int]:
        if self.world_size == 1:
            self.host_keys = [host_key()]
            return {}
        mine = torch.tensor([os.getpid(), host_key()], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(everyone, mine, group=self.cpu_group)
        here = int(mine[1])
        self.host_keys = [int(t[1]) for t in everyone]
        self.node_count = len(set(self.host_keys))
        return {
            r: int(t[0])
            for r, t in zip(self.ranks, everyone)
            if r != self.rank and int(t[1]) == here
        }

    def _build_helpers(self, use_comm: bool, use_mq: bool, use_all2all: bool) -> None:
        if use_comm and self.world_size > 1:
            cls = get_device_communicator_cls(self.device)
            self.device_communicator = cls(
                cpu_group=self.cpu_group,
                device=self.device,
                device_group=self.device_group,
                unique_name=self.unique_name,
                use_all2all=use_all2all,
                timeout_s=self.timeout_s,
            )
        if self.device_communicator is not None:
            self._small_sum = self.device_communicator.all_reduce_chain.small_sum
        if use_mq and self.world_size > 1:
            self.mq_broadcaster = self.create_mq_broadcaster()

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.unique_name}, ranks={self.ranks}, rank={self.rank})"

    # ---- message queues -----------------------------------------------------------

    def create_mq_broadcaster(
        self, writer_rank: int = 0, external_writer_handle: Any = None, blocking: bool = True
    ) -> Any:
        """A message queue from in-group rank ``writer_rank`` to the rest of the group."""
        from shm_broadcast.message_queue import MessageQueue

        cfg = get_config()
        return MessageQueue.create_from_process_group(
            self.cpu_group,
            cfg.mq_max_chunk_bytes,
            cfg.mq_max_chunks,
            writer_rank=writer_rank,
            external_writer_handle=external_writer_handle,
            blocking=blocking,
        )

    def create_single_reader_mq_broadcasters(
        self, reader_rank_in_group: int = 0, blocking: bool = False
    ) -> Any:
        """Queues from every rank to in-group rank ``reader_rank_in_group``."""
        from shm_broadcast.message_queue import MessageQueue

        self._check_index(reader_rank_in_group, "reader_rank_in_group")
        cfg = get_config()
        return MessageQueue.create_from_process_group_single_reader(
            self.cpu_group,
            cfg.mq_max_chunk_bytes,
            cfg.mq_max_chunks,
            reader_rank=reader_rank_in_group,
            blocking=blocking,
        )

    # ---- ranks --------------------------------------------------------------------

    @property
    def first_rank(self) -> int:
        """Global rank of the group's first process."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the group's last process."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """Global rank of the next process in the group (wrapping)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous process in the group (wrapping)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

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
            checks.tensor(input_, "input_")
            return input_
        if torch.compiler.is_compiling():
            return torch.ops.groupcoord.all_reduce(input_, self.unique_name)
        small_sum = self._small_sum
        if small_sum is not None and not get_config().debug_desync:
            # An engine's most common call: the communicator's lean path, one call deep.
            out = small_sum(input_)
            if out is not None:
                self._collective_seq += 1
                return out
        return self._all_reduce_eager(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's equally shaped ``input_`` concatenated along ``dim``."""
        if self.world_size > 1 and not torch.compiler.is_compiling():
            return self._all_gather_eager(input_, dim)  # the communicator checks the arguments
        dim = checks.dim(checks.tensor(input_, "input_"), dim)
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
        if torch.compiler.is_compiling():
            if sizes is None:
                raise GroupcoordValueError(
                    "sizes: all_gatherv under torch.compile needs the sizes (shapes must be static)"
                )
            if isinstance(input_, list):
                return [self._traced_all_gatherv(t, dim, sizes) for t in input_]
            return self._traced_all_gatherv(input_, dim, sizes)
        return self._all_gatherv_eager(input_, dim, sizes)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group, then keep this rank's equal slice along ``dim``."""
        if self.world_size > 1 and not torch.compiler.is_compiling():
            return self._reduce_scatter_eager(input_, dim)  # the communicator checks the arguments
        dim = checks.dim(checks.tensor(input_, "input_"), dim)
        if self.world_size == 1:
            return input_
        return torch.ops.groupcoord.reduce_scatter(input_, dim, self.world_size, self.unique_name)

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """Sum over the group, then keep ``sizes[rank]`` rows along ``dim`` (equal when None)."""
        dim = checks.dim(checks.tensor(input_, "input_"), dim)
        if self.world_size == 1:
            return input_
        if torch.compiler.is_compiling() and sizes is not None:
            return torch.ops.groupcoord.reduce_scatterv(
                input_, dim, list(sizes), self.rank_in_group, self.unique_name
            )
        if torch.compiler.is_compiling():
            return self.reduce_scatter(input_, dim)
        return self._reduce_scatterv_eager(input_, dim, sizes)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``input_`` concatenated along ``dim`` on in-group rank ``dst``; None elsewhere."""
        self._check_index(dst, "dst")
        dim = checks.dim(checks.tensor(input_, "input_"), dim)
        if self.world_size == 1:
            return input_
        # Lengths along dim may differ by rank; the rest must not.
        self._in_step("gather", lambda: f"{_shape_of(input_.narrow(dim, 0, 0))}, dst={dst}")
        return self._collective("gather", self._tensor_comm().gather, input_, dst, dim)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``input_`` on every rank, in place (out of place under torch.compile)."""
        self._check_index(src, "src")
        checks.tensor(input_, "input_")
        if self.world_size == 1:
            return input_
        if torch.compiler.is_compiling():
            return torch.ops.groupcoord.broadcast(input_, src, self.unique_name)
        return self._broadcast_eager(input_, src)

    # The eager bodies; the custom ops in ``custom_ops`` call these too.

    def _all_reduce_eager(self, input_: torch.Tensor) -> torch.Tensor:
        self._in_step("all_reduce", lambda: _shape_of(input_))
        return self._collective("all_reduce", self._tensor_comm().all_reduce, input_)

    def _all_gather_eager(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        self._in_step("all_gather", lambda: f"{_shape_of(input_)}, dim={dim}")
        return self._collective("all_gather", self._tensor_comm().all_gather, input_, dim)

    def _all_gatherv_eager(
        self, input_: torch.Tensor | list[torch.Tensor], dim: int, sizes: list[int] | None
    ) -> Any:
        return self._collective("all_gatherv", self._tensor_comm().all_gatherv, input_, dim, sizes)

    def _reduce_scatter_eager(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        self._in_step("reduce_scatter", lambda: f"{_shape_of(input_)}, dim={dim}")
        return self._collective("reduce_scatter", self._tensor_comm().reduce_scatter, input_, dim)

    def _reduce_scatterv_eager(
        self, input_: torch.Tensor, dim: int, sizes: list[int] | None
    ) -> torch.Tensor:
        self._in_step("reduce_scatterv", lambda: f"{_shape_of(input_)}, dim={dim}, sizes={sizes}")
        comm = self._tensor_comm()
        return self._collective("reduce_scatterv", comm.reduce_scatterv, input_, dim, sizes)

    def _broadcast_eager(self, input_: torch.Tensor, src: int) -> torch.Tensor:
        self._in_step("broadcast", lambda: f"{_shape_of(input_)}, src={src}")
        return self._collective("broadcast", self._tensor_comm().broadcast, input_, src)

    def _in_step(self, operation: str, call: Callable[[], str]) -> None:
        """With ``debug_desync`` on: every rank shows the others the call it is about
        to make (a checksum; the calls themselves only when they differ); ranks that
        disagree all raise DesyncError naming both sides."""
        if not get_config().debug_desync:
            return
        seq = self._desync_seq
        self._desync_seq += 1
        mine = f"{operation}({call()})"
        digest = torch.tensor([zlib.crc32(mine.encode())], dtype=torch.int64)
        digests = torch.empty((self.world_size, 1), dtype=torch.int64)
        parts = list(digests.unbind(0))
        self._collective(operation, dist.all_gather, parts, digest, self.cpu_group)
        if bool((digests == digest).all()):
            return
        # Every rank saw the same table, so every rank takes this path.
        gathered = self._collective(operation, all_gather_bytes, self.cpu_group, mine.encode())
        for rank, theirs in enumerate(c.decode() for c in gathered):
            if theirs != mine:
                raise DesyncError(
                    f"{self.unique_name}: rank {self.rank_in_group} called {mine} as call "
                    f"#{seq} of the group, rank {rank} called {theirs} (debug_desync check)"
                )

    def _traced_all_gatherv(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> Any:
        dim = checks.dim(checks.tensor(tensor, "input_"), dim)
        return torch.ops.groupcoord.all_gatherv(tensor, dim, list(sizes), self.unique_name)

    # ---- objects ------------------------------------------------------------------

    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank (through the message queue when the group has one)."""
        self._check_index(src, "src")
        if self.world_size == 1:
            return obj
        if self.mq_broadcaster is not None and src == 0:
            return self._mq_broadcast(obj)
        payload = dumps(obj) if self.rank_in_group == src else None
        data = self._collective("broadcast_object", broadcast_bytes, self.cpu_group, payload, src)
        return loads(data)

    def _mq_broadcast(self, obj: Any) -> Any:
        """In-group rank 0 writes ``obj`` to the queue, the others read it.

        No deadline: this is an engine worker's idle wait between requests, so
        it lasts as long as the writer (or, for the writer, the readers) live;
        a dead peer ends it with PeerDiedError (see docs/coordinator.md)."""
        if self.rank_in_group == 0:
            self.mq_broadcaster.enqueue(obj)
            return obj
        return self.mq_broadcaster.dequeue()

    def broadcast_object_list(
        self, obj_list: list[Any], src: int = 0, group: ProcessGroup | None = None
    ) -> list[Any]:
        """Replace ``obj_list``'s items with ``src``'s, in place; returns ``obj_list``."""
        if not isinstance(obj_list, list):
            raise GroupcoordTypeError(f"obj_list must be a list, got {type(obj_list).__name__}")
        self._check_index(src, "src")
        if self.world_size == 1:
            return obj_list
        pg = group if group is not None else self.cpu_group
        payload = dumps(obj_list) if self.rank_in_group == src else None
        data = self._collective("broadcast_object_list", broadcast_bytes, pg, payload, src)
        obj_list[:] = loads(data)
        return obj_list

    def send_object(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to in-group rank ``dst`` (msgspec, no pickle)."""
        self._check_peer(dst, "dst")
        self._send_bytes(dumps(obj), dst, "send_object")

    def recv_object(self, src: int) -> Any:
        """The next object that in-group rank ``src`` sent with ``send_object``."""
        self._check_peer(src, "src")
        return loads(self._recv_bytes(src, "recv_object"))

    def _send_bytes(self, payload: bytes, dst: int, operation: str) -> None:
        # Length first (the receiver must size its buffer), then the payload.
        length = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
        peer = self.ranks[dst]
        self._p2p(operation, dst, dist.send, length, peer, self.cpu_group)
        if data is not None:
            self._p2p(operation, dst, dist.send, data, peer, self.cpu_group)

    def _recv_bytes(self, src: int, operation: str) -> bytes:
        length = torch.empty(1, dtype=torch.int64)
        peer = self.ranks[src]
        self._p2p(operation, src, dist.recv, length, peer, self.cpu_group)
        n = int(length.item())
        if n == 0:
            return b""
        data = torch.empty(n, dtype=torch.uint8)
        self._p2p(operation, src, dist.recv, data, peer, self.cpu_group)
        return data.numpy().tobytes()

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
        return tensor_dicts.recv(self, src, all_gather_group)

    def isend_tensor_dict(
        self,
        tensor_dict: Mapping[str, Any],
        dst: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[str, bool] | None = None,
    ) -> list[Handle]:
        """:meth:`send_tensor_dict`; the send is complete when this returns (our
        shared-memory and Gloo paths buffer it), so the handles are complete."""
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

    def isend_object(self, obj: Any, dst: int) -> Handle:
        """:meth:`send_object`, complete when this returns."""
        self.send_object(obj, dst)
        return COMPLETED

    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum of a CPU tensor over the CPU (Gloo) group."""
        checks.tensor(tensor, "tensor")
        if self.world_size == 1:
            return tensor
        self._collective("cpu_all_reduce_", dist.all_reduce, tensor, ReduceOp.SUM, self.cpu_group)
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
        return dist.new_group(
            self.ranks,
            backend=dist.get_backend(self.device_group),
            timeout=datetime.timedelta(seconds=self.timeout_s),
            use_local_synchronization=True,
            group_desc=group_desc,
        )

    # ---- point to point tensors ---------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to in-group rank ``dst`` (default: next)."""
        if dst is not None:
            self._check_peer(dst, "dst")
        peer = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        self._p2p("send", peer, self._tensor_comm().send, tensor, dst)

    def recv(
        self,
        size: torch.Size | tuple[int, ...] | list[int] | int,
        dtype: torch.dtype,
        src: int | None = None,
    ) -> torch.Tensor:
        """A tensor of ``size`` and ``dtype`` from in-group rank ``src`` (default: previous)."""
        if src is not None:
            self._check_peer(src, "src")
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size,)  # vLLM callers pass a plain element count too
        peer = (self.rank_in_group - 1) % self.world_size if src is None else src
        out: torch.Tensor = self._p2p("recv", peer, self._tensor_comm().recv, size, dtype, src)
        return out

    # ---- control --------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait until every rank of the group is here (CPU group, bounded by the deadline)."""
        if self.world_size == 1:
            return
        self._collective("barrier", dist.barrier, self.cpu_group)

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

    def destroy(self) -> None:
        """Release the queue, communicators and process groups (idempotent)."""
        if self._destroyed:
            return
        self._destroyed = True
        custom_ops.unregister_group(self.unique_name)
        self._p2p_channels.close()
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.shutdown()
            self.mq_broadcaster = None
        for comm in (self.device_communicator, self._plain_comm):
            if comm is not None:
                comm.destroy()
        self.device_communicator = None
        self._small_sum = None
        self._plain_comm = None
        if dist.is_initialized():
            if self.device_group is not self.cpu_group:
                dist.destroy_process_group(self.device_group)
            dist.destroy_process_group(self.cpu_group)

    # ---- helpers ----------------------------------------------------------------------

    def _tensor_comm(self) -> DeviceCommunicatorBase:
        if self.device_communicator is not None:
            return self.device_communicator
        if self._destroyed:
            raise ClosedError(f"{self.unique_name} was destroyed")
        if self._plain_comm is None:
            # Groups built without a device communicator still move tensors,
            # with plain torch.distributed calls.
            self._plain_comm = DeviceCommunicatorBase(
                self.cpu_group, self.device, self.device_group, self.unique_name
            )
        return self._plain_comm

    def _check_index(self, index: int, name: str) -> None:
        checks.rank(index, name, self.world_size, what=f"group {self.unique_name}")

    def _check_peer(self, index: int, name: str) -> None:
        checks.rank(index, name, self.world_size, self.rank_in_group, f"group {self.unique_name}")

    def _collective(self, operation: str, fn: Any, *args: Any) -> Any:
        """Run one collective; a transport failure says which ranks did not arrive."""
        try:
            out = fn(*args)
        except (GroupcoordError, ValueError, TypeError) as exc:
            # Ours already name what failed; bad arguments are raised before any send.
            # A Gloo failure the communicator translated is diagnosed here again:
            # the arrival records name exactly who did not come (and keep the
            # collective count in step with the other ranks).
            gloo = getattr(exc, "transport_error", None)
            if isinstance(gloo, RuntimeError):
                raise self._diagnose(operation, gloo) from gloo
            raise
        except RuntimeError as exc:
            raise self._diagnose(operation, exc) from exc
        self._collective_seq += 1
        return out

    def _p2p(self, operation: str, peer: int, fn: Any, *args: Any) -> Any:
        """Run one point-to-point transfer with in-group ``peer``; failures name the peer."""
        try:
            return fn(*args)
        except (GroupcoordError, ValueError, TypeError):
            raise
        except RuntimeError as exc:
            peer_rank = self.ranks[peer]
            dead = (
                dead_peers({peer_rank: self._local_pids[peer_rank]})
                if peer_rank in self._local_pids
                else []
            )
            raise classify(
                self.unique_name, operation, self.timeout_s, [peer_rank], exc, known_dead=bool(dead)
            ) from exc

    def _wait_all(self, operation: str, works: list[Any]) -> None:
        self._collective(operation, lambda: [w.wait() for w in works])

    def _diagnose(self, operation: str, exc: RuntimeError) -> GroupcoordError:
        seq = self._collective_seq
        self._collective_seq += 1
        missing, dead = absent_ranks(
            self.unique_name, seq, self.rank_in_group, self.ranks, self.timeout_s, self._local_pids
        )
        return classify(self.unique_name, operation, self.timeout_s, missing, exc, known_dead=dead)


def _shape_of(tensor: Any) -> str:
    if not isinstance(tensor, torch.Tensor):  # checked later, by the communicator
        return type(tensor).__name__
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _check_group_ranks(group_ranks: Any, rank: int, world_size: int) -> list[int]:
    """The caller's group from ``group_ranks``, after checking the whole list."""
    if not isinstance(group_ranks, (list, tuple)) or not group_ranks:
        raise GroupcoordValueError(
            f"group_ranks must be a non-empty list of lists, got {group_ranks!r}"
        )
    seen: set[int] = set()
    mine: list[int] | None = None
    for ranks in group_ranks:
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise GroupcoordValueError(f"group_ranks: {ranks!r} is not a non-empty list of ranks")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise GroupcoordValueError(
                    f"group_ranks: {r!r} is not a rank of the world ({world_size})"
                )
            if r in seen:
                raise GroupcoordValueError(f"group_ranks: rank {r} appears in more than one place")
            seen.add(r)
        if rank in ranks:
            mine = list(ranks)
    if mine is None:
        raise GroupcoordValueError(f"group_ranks: this rank ({rank}) is in none of {group_ranks!r}")
    return mine


def _check_all_gather_group(group: Any) -> None:
    if group is not None and not isinstance(group, GroupCoordinator):
        raise GroupcoordTypeError(
            f"all_gather_group must be a GroupCoordinator, got {type(group).__name__}"
        )
