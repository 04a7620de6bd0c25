"""The device communicator base: vLLM's collective API over ``torch.distributed``.

``DeviceCommunicatorBase`` keeps vLLM's constructor, members and method
signatures; every ``src``/``dst`` is an index within the group. Its defaults
are plain ``torch.distributed`` calls on the device group (Gloo on CPU), and
subclasses put faster all-reduce back ends in front of the torch one (see
``all_reduce_backends``). Arguments are checked before anything is sent, so
a bad call raises on the caller and leaves the group usable. Every
``torch.distributed`` call runs under ``shm_broadcast.gloo_errors``: a Gloo
timeout or lost peer raises ``GroupcoordTimeoutError``/``PeerDiedError``
naming the group, the call and the peer (point-to-point) or the peers that
could be missing (collectives; only the dead ones when a pid shows them).
"""

from __future__ import annotations

import datetime
import os
import threading
import zlib
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from shm_broadcast.config import get_config, resolve_timeout
from shm_broadcast.gloo_errors import gloo_errors
from shm_broadcast.liveness import host_key
from shm_broadcast.p2p_channels import P2PChannels

from . import c10d_calls, checks
from .all2all import create_all2all_manager
from .all2all_base import All2AllManagerBase, Cache, register_communicator
from .all_reduce_backends import AllReduceBackend, AllReduceChain, TorchDistributedAllReduce
from .errors import DesyncError, GroupcoordTypeError, GroupcoordValueError, NotSupportedError
from .padded_parts import check_lengths
from .shm_reduce import OneTorchThread
from .shm_small import SmallCalls, VaryingParts
from .transports import ChannelTransport, TorchTransport, Transport, TransportChain

__all__ = ["All2AllManagerBase", "Cache", "DeviceCommunicatorBase"]


class DeviceCommunicatorBase:
    """Collectives of one group on one device kind.

    ``cpu_group`` is a Gloo group used for control; ``device_group`` carries
    the tensors (it defaults to ``cpu_group``, right for CPU tensors).
    """

    # The shared-memory channels to peers on this node that ``send``/``recv`` use,
    # when this communicator has them (the CPU one); a GroupCoordinator sends its
    # tensor dicts and objects through the same ones.
    p2p_channels: P2PChannels | None = None

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        global_ranks: list[int] | None = None,
        global_world_size: int | None = None,
        use_all2all: bool = False,
        *,
        timeout_s: float | None = None,
        peer_pids: dict[int, int] | None = None,
        p2p_channels: P2PChannels | None = None,
    ) -> None:
        """``peer_pids`` (global rank -> pid of the peers on this host, as
        ``_local_peer_pids`` finds them): given by a caller that has them, so that
        building makes no collective call and may happen on one rank's first
        ``send``. ``p2p_channels``: ``send``/``recv`` of CPU tensors go through them
        to peers on this node (a GroupCoordinator without a device communicator
        gives its own, which carry its objects and tensor dicts)."""
        # The deadline of this group's waits (GroupCoordinator passes its own);
        # None: GROUPCOORD_TIMEOUT_S.
        self.timeout_s = resolve_timeout(timeout_s)
        if p2p_channels is not None:
            self.p2p_channels = p2p_channels
        self.cpu_group = cpu_group
        self.device = device if device is not None else torch.device("cpu")
        self.device_group = device_group if device_group is not None else cpu_group
        self.unique_name = unique_name
        self.world_size = cpu_group.size()
        self.ranks: list[int] = checks.group_ranks(cpu_group, global_ranks)
        self.rank_in_group = cpu_group.rank()
        self.rank = self.ranks[self.rank_in_group]
        self.all2all_manager: Any = None
        self.suspended = False  # between suspend() and resume()
        # The lean path of small all_reduce/all_gather/reduce_scatter calls
        # (shm_small.SmallCalls), when a fast back end offers one.
        self.small_calls: SmallCalls | None = None
        # Under which a group's calls from several threads of this rank take turns,
        # whole (the lean path's, when there is one): GroupCoordinator holds it.
        self.call_lock: Any = threading.RLock()
        self._recv_like: dict[torch.dtype, torch.Tensor] = {}  # see _like
        register_communicator(self)  # managers built from cpu_group alone find this one
        # Errors start with the group's name, like the coordinator's own errors.
        self.what = unique_name or type(self).__name__
        fast = self._fast_all_reduce_backends()
        # The moving operations' chains: this device's fast transports, then c10d.
        # Control exchanges (lengths, pids: small CPU tensors) use the fast
        # transports that live on cpu_group, then c10d on cpu_group.
        owner = f"{type(self).__name__}({unique_name or 'unnamed'})"
        moving = self._fast_transports()
        self.transports = TransportChain(
            [*moving, TorchTransport(self, self.device_group)], owner=owner
        )
        self.control_transports = TransportChain(
            [*(t for t in moving if t.control), TorchTransport(self, self.cpu_group, control=True)],
            owner=f"{owner} control",
        )
        # Global rank -> pid of peers on this host: a failed call names the dead ones.
        self.peer_pids: dict[int, int] = {}  # what errors of the exchange below can use
        self.peer_pids = dict(peer_pids) if peer_pids is not None else self._local_peer_pids()
        self.all_reduce_chain = AllReduceChain(
            [
                *fast,
                TorchDistributedAllReduce(
                    self.device_group,
                    self.what,
                    self.peer_pids,
                    peers=[r for r in self.ranks if r != self.rank],
                    timeout_s=self.timeout_s,
                ),
            ],
            owner=owner,
        )
        if (
            global_world_size is not None
            and dist.is_initialized()
            and global_world_size != dist.get_world_size()
        ):
            raise GroupcoordValueError(
                f"global_world_size={global_world_size} but the world has "
                f"{dist.get_world_size()} ranks"
            )
        if use_all2all:
            try:
                self.set_all2all_manager(create_all2all_manager(get_config().all2all_backend, self))
            except BaseException:
                self.destroy()  # the back ends built above hold shared memory
                raise

    # ---- hooks for subclasses -------------------------------------------------

    def _fast_all_reduce_backends(self) -> list[AllReduceBackend]:
        """Back ends tried before ``torch.distributed``, in order (none here)."""
        return []

    def _fast_transports(self) -> list[Transport]:
        """Transports tried before c10d for the moving operations, in order: here the
        shared-memory channels for ``send``/``recv`` when this communicator has them."""
        if self.p2p_channels is None:
            return []
        fallback = TorchTransport(self, self.device_group)
        return [ChannelTransport(self.p2p_channels, self.ranks, fallback)]

    def _local_peer_pids(self) -> dict[int, int]:
        """Pids of the peers whose pids this process can judge (same host key: host,
        boot and pid namespace), by global rank: one small all-gather over ``cpu_group``."""
        if self.world_size == 1:
            return {}
        mine = torch.tensor([host_key(), os.getpid()], dtype=torch.int64)
        table = self._all_gather_control(mine).tolist()
        here = host_key()
        return {
            self.ranks[i]: int(pid)
            for i, (host, pid) in enumerate(table)
            if host == here and i != self.rank_in_group
        }

    @property
    def backend_name(self) -> str:
        return type(self).__name__

    def set_all2all_manager(self, manager: Any) -> None:
        """Attach the manager that ``dispatch``/``combine`` delegate to."""
        self.all2all_manager = manager

    # ---- collectives ------------------------------------------------------------

    def all_reduce(
        self, input_: torch.Tensor, *, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce over the group; returns a new tensor, ``input_`` is unchanged."""
        input_ = checks.tensor(input_, "input_", self.device)
        checks.reduce_op(op, input_.dtype)
        return self.all_reduce_chain.all_reduce(input_, op)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's equally shaped ``input_`` along ``dim``."""
        input_ = checks.tensor(input_, "input_", self.device)
        dim = checks.dim(input_, dim)
        stacked = self._all_gather_stacked(input_)
        # (world, ..., n_dim, ...) -> (..., world * n_dim, ...), rank-major along dim.
        shape = list(input_.shape)
        shape[dim] *= self.world_size
        if dim == 0:
            return stacked.reshape(shape)  # already rank-major: a view, no copy
        return stacked.movedim(0, dim).reshape(shape)

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather where ranks may hold different lengths along ``dim``.

        ``sizes[i]`` is rank i's length along ``dim``; when None the lengths are
        discovered: on the shared-memory path in each tensor's own barrier
        (``SmallCalls.gather_v``, which also moves parts that fit a slot), else with
        one small all-gather (on Gloo even when ``sizes`` are given). Given ``sizes``
        are checked: their form and this rank's own entry before anything is sent
        (bad input); on CPU they travel with the lengths (a checksum in the
        shared-memory stamp, in the small all-gather's fingerprint on Gloo), so ranks
        whose ``sizes`` differ all raise ``DesyncError`` before anything moves, the
        group staying usable, and once every tensor has moved they are compared with
        the parts' true lengths too; on NCCL they are trusted. The result is exact
        (no padding). A list of tensors gathers each and returns a list.
        """
        small = self.small_calls
        if small is not None and small.equal_parts(input_, dim, sizes):
            return self._as_all_gather(small, input_, dim)
        if small is not None and type(input_) is torch.Tensor:
            # The lean way: gather_v takes a tensor it can move as it is (else None, and
            # the checks below say what is wrong). The common ``sizes`` pass a look at
            # this rank's own entry; anything else gets the full check, which raises.
            if sizes is not None and not (
                type(sizes) is list
                and len(sizes) == self.world_size
                and -input_.dim() <= dim < input_.dim()
                and sizes[self.rank_in_group] == input_.shape[dim]
            ):
                self._check_own_size(input_, checks.dim(input_, dim), dim, sizes)
            done = small.gather_v(input_, dim, sizes=sizes)
            if done is not None:
                joined = self._gathered(input_, dim, done)
                self._check_gatherv(dim, sizes, done.lengths)
                return joined
        given = input_ if isinstance(input_, list) else [input_]
        if not given:
            raise GroupcoordValueError("input_: all_gatherv needs at least one tensor")
        tensors, dims = [], []
        for i, t in enumerate(given):
            name = f"input_[{i}]" if isinstance(input_, list) else "input_"
            tensors.append(checks.tensor(t, name, self.device))
            dims.append(checks.dim(t, dim))
        if sizes is not None:
            for t, d in zip(tensors, dims):
                self._check_own_size(t, d, dim, sizes)
        # The first of several tensors goes as a gather_v stamped with their number
        # too: ranks whose lists differ in length raise before anything moves
        # (each tensor's own call is checked as usual). Without it the shorter list's
        # next gather met the longer list's next tensor and returned it.
        listed = len(tensors) if small is not None and len(tensors) > 1 else 0
        moved = [
            self._all_gatherv_one(small, t, d, sizes, listed if i == 0 else 0)
            for i, (t, d) in enumerate(zip(tensors, dims))
        ]
        # The other ranks' entries, once every tensor moved: a rank with a wrong one
        # that stopped half-way through the list left its peers in the next gather.
        for (_, lengths), d in zip(moved, dims):
            self._check_gatherv(d, sizes, lengths)
        out = [t for t, _ in moved]
        return out if isinstance(input_, list) else out[0]

    def _check_own_size(self, tensor: torch.Tensor, d: int, dim: int, sizes: list[int]) -> None:
        """``sizes`` well formed, and its entry for this rank ``tensor``'s length along
        ``d`` (``dim`` as the caller gave it): checked before anything is sent."""
        checks.sizes(sizes, "sizes", self.world_size)
        if tensor.shape[d] != sizes[self.rank_in_group]:
            raise GroupcoordValueError(
                f"sizes[{self.rank_in_group}]={sizes[self.rank_in_group]} but this "
                f"rank's input_ has {tensor.shape[d]} along dim {dim}"
            )

    def _all_gatherv_one(
        self,
        small: SmallCalls | None,
        tensor: torch.Tensor,
        dim: int,
        sizes: list[int] | None,
        listed: int = 0,
    ) -> tuple[torch.Tensor, list[int]]:
        """One tensor's all_gatherv and the lengths its parts had (unchecked);
        ``listed``: the number of tensors in the caller's list, for the first one
        (``SmallCalls.gather_v`` stamps it)."""
        if not listed and small is not None and small.equal_parts(tensor, dim, sizes):
            assert sizes is not None  # equal_parts says so
            return self._as_all_gather(small, tensor, dim), list(sizes)
        done = None if small is None else small.gather_v(tensor, dim, sizes=sizes, listed=listed)
        if done is not None:
            return self._gathered(tensor, dim, done), done.lengths
        if sizes is not None and not tensor.is_cpu:
            # A device's lengths could only be read back through a wait for the
            # device: trusted (GROUPCOORD_DEBUG_DESYNC compares them across ranks).
            return self._move_parts(tensor, dim, sizes), sizes
        # Gloo moves the parts padded to the longest: ranks whose sizes named another
        # longest posted buffers of other sizes, and Gloo's transport aborted the
        # process. The true lengths come first (one small all-gather).
        (lengths,) = self._discover_sizes([tensor], [dim], sizes)
        return self._move_parts(tensor, dim, lengths), lengths

    def _as_all_gather(self, small: SmallCalls, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """An all_gatherv of equal parts (``SmallCalls.equal_parts``) as the all-gather
        it is: the lean path, else the general all-gather (stamped alike)."""
        joined = small.all_gather(tensor, dim)
        return joined if joined is not None else self.all_gather(tensor, dim)

    def _gathered(self, tensor: torch.Tensor, dim: int, done: VaryingParts) -> torch.Tensor:
        """The result of an all_gatherv whose lengths the shared-memory call told every
        rank: moved in it, or now by those lengths."""
        out = done.result if done.moved else self._move_parts(tensor, dim, done.lengths)
        assert out is not None  # every rank receives
        return out

    def _check_gatherv(self, dim: int, sizes: Any, lengths: list[int]) -> None:
        """Raise when the caller's ``sizes`` are not the parts' true ``lengths``. Ranks
        whose ``sizes`` differ raised in the call already (they travel with it as a
        checksum), so this catches only sizes whose checksums collided."""
        if sizes is not None and list(sizes) != lengths:
            check_lengths("sizes={}", sizes, lengths, f" along dim {dim}")

    def _move_parts(self, tensor: torch.Tensor, dim: int, lengths: list[int]) -> torch.Tensor:
        return self.transports.select("all_gatherv", tensor).all_gatherv_exact(tensor, dim, lengths)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group, then keep this rank's equal 1/world slice along ``dim``."""
        input_ = checks.tensor(input_, "input_", self.device)
        dim = checks.dim(input_, dim)
        if input_.shape[dim] % self.world_size:
            raise GroupcoordValueError(
                f"input_ has {input_.shape[dim]} along dim {dim}, not divisible by the "
                f"group's world size {self.world_size}"
            )
        small = self.small_calls
        if small is not None:
            # A call the lean path takes must go its way on this rank too: it sums the
            # tensor as laid out, the general way the rows moved to the front, and a
            # rank of each (one whose input required grad) summed mismatched elements.
            done = small.reduce_scatter(input_, dim)
            if done is not None:
                return done
        chunk = input_.shape[dim] // self.world_size
        return self._reduce_scatter_sizes(input_, dim, [chunk] * self.world_size)

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """Like ``reduce_scatter`` with rank i keeping ``sizes[i]`` rows along ``dim``."""
        input_ = checks.tensor(input_, "input_", self.device)
        if checks.equal_split(sizes, input_, dim, self.world_size):
            # Equal parts: the plain call, lean path included (4 KiB at world 2:
            # 109 -> 14 us).
            return self.reduce_scatter(input_, dim)
        dim = checks.dim(input_, dim)
        cut = checks.sizes(sizes, "sizes", self.world_size)
        if sum(cut) != input_.shape[dim]:
            raise GroupcoordValueError(
                f"sizes sum to {sum(cut)} but input_ has {input_.shape[dim]} along dim {dim}"
            )
        small = self.small_calls
        if small is not None:
            # As in reduce_scatter: a call the lean path takes goes its way on every
            # rank (it lays the tensor out as it is, the general way moves dim first).
            done = small.reduce_scatter_v(input_, dim, cut)
            if done is not None:
                return done
        return self._reduce_scatter_sizes(input_, dim, cut)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``input_`` along ``dim`` on ``dst``; None elsewhere.

        Ranks may hold different lengths along ``dim`` (discovered, exact result):
        on the shared-memory path in the gather's own barrier (``SmallCalls.gather_v``,
        which also moves parts that fit a slot), else by a small all-gather first.
        """
        input_ = checks.tensor(input_, "input_", self.device)
        dim = checks.dim(input_, dim)
        checks.rank(dst, "dst", self.world_size)
        small = self.small_calls
        done = None if small is None else small.gather_v(input_, dim, dst)
        if done is None:
            (sizes,) = self._discover_sizes([input_], [dim])
        elif done.moved:
            return done.result
        else:
            sizes = done.lengths
        return self._gather_padded(input_, dim, sizes, dst=dst)

    def barrier(self) -> None:
        """Return once every rank of the group has called it (on the CPU group)."""
        with self._gloo("barrier", group=self.cpu_group):
            dist.barrier(self.cpu_group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s; returns ``tensor``."""
        moved = checks.tensor(tensor, "tensor", self.device)  # detached: the same memory
        checks.rank(src, "src", self.world_size)
        if self.world_size > 1:
            self.transports.select("broadcast", moved).broadcast_(moved, src)
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

    def get_symmetric_memory_buffer(
        self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """None, vLLM's answer when no symmetric-memory buffer is available (callers
        then allocate a plain tensor): groupcoord registers none."""
        return None

    def batch_isend_irecv(self, p2p_ops: list) -> None:
        """Run ``torch.distributed.P2POp`` sends and receives together and wait for all."""
        if not p2p_ops:
            return
        with self._gloo("batch_isend_irecv"):
            # vLLM's API: P2POps name global peers, so this one goes through the registry.
            for work in dist.batch_isend_irecv(p2p_ops):
                work.wait()

    # ---- sleep mode and checkpoints ---------------------------------------------

    def suspend(self) -> None:
        """Sleep mode: the fast back ends release what they hold (the shared-memory
        all-reduce segment, the NCCL communicator); until :meth:`resume` every
        collective of this communicator runs on ``torch.distributed`` (correct,
        slower). Collective: every rank of the group calls it (a barrier first,
        so a rank that does not raises a timeout naming the group)."""
        if self.suspended:
            return
        with self._gloo("suspend", group=self.cpu_group):
            c10d_calls.barrier(self.cpu_group, self._deadline).wait()
        self.all_reduce_chain.suspend()
        self.suspended = True

    def resume(self) -> None:
        """Re-create what :meth:`suspend` released (collective, like the constructor)."""
        if not self.suspended:
            return
        self.all_reduce_chain.resume(self.cpu_group)
        self.suspended = False

    def checkpoint_prepare(self) -> None:
        """Release the reclaimable state before a checkpoint: :meth:`suspend`, and the
        all2all manager's buffers. Collective."""
        self.suspend()
        if self.all2all_manager is not None:
            self.all2all_manager.checkpoint_prepare()

    def checkpoint_restore(self) -> None:
        """Undo :meth:`checkpoint_prepare` (collective)."""
        self.resume()
        if self.all2all_manager is not None:
            self.all2all_manager.checkpoint_restore()

    # ---- the moving operations' chains ------------------------------------------

    def _all_gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.transports.select("all_gather", tensor).all_gather_stacked(tensor)

    def _all_gather_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """``_all_gather_stacked`` of a small CPU tensor over ``cpu_group`` (metadata)."""
        return self.control_transports.select("all_gather", tensor).all_gather_stacked(tensor)

    def _reduce_scatter_sizes(
        self, input_: torch.Tensor, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        transport = self.transports.select("reduce_scatter", input_)
        return transport.reduce_scatter_sizes(input_, dim, sizes)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to in-group rank ``dst`` (default: the next rank)."""
        tensor = checks.tensor(tensor, "tensor", self.device)
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        checks.rank(dst, "dst", self.world_size, self.rank_in_group)
        self.transports.select("send", tensor).send(tensor, dst)

    def recv(
        self,
        size: torch.Size | tuple[int, ...] | list[int],
        dtype: torch.dtype,
        src: int | None = None,
    ) -> torch.Tensor:
        """Receive a tensor of ``size`` and ``dtype`` from ``src`` (default: the previous rank)."""
        if not isinstance(dtype, torch.dtype):
            raise GroupcoordTypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        try:
            shape = torch.Size(size)
        except TypeError as exc:
            raise GroupcoordTypeError(f"size must be a sequence of ints, got {size!r}") from exc
        if shape and min(shape) < 0:
            raise GroupcoordValueError(f"size must not be negative, got {tuple(shape)}")
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        checks.rank(src, "src", self.world_size, self.rank_in_group)
        return self.transports.select("recv", self._like(dtype)).recv(shape, dtype, src)

    def _like(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor of ``dtype`` on this device: what the chain's refusals look
        at for a ``recv``, whose result the chosen transport makes (one per dtype,
        kept: a fresh ``torch.empty`` costs 2 us, a tenth of a small recv)."""
        like = self._recv_like.get(dtype)
        if like is None:
            like = self._recv_like[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return like

    # ---- expert parallelism -----------------------------------------------------

    def _all2all(self, operation: str) -> Any:
        if self.all2all_manager is None:
            raise NotSupportedError(f"{operation} (no all2all manager set)", self.backend_name)
        return self.all2all_manager

    def dispatch_router_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Any:
        return self._all2all("dispatch_router_logits").dispatch_router_logits(
            hidden_states, router_logits, is_sequence_parallel, extra_tensors
        )

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Any:
        return self._all2all("dispatch").dispatch(
            hidden_states, topk_weights, topk_ids, is_sequence_parallel, extra_tensors
        )

    def combine(self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False) -> Any:
        return self._all2all("combine").combine(hidden_states, is_sequence_parallel)

    def allocate_combine_input(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor | None:
        return self._all2all("allocate_combine_input").allocate_combine_input(
            shape, dtype, device, is_sequence_parallel
        )

    def combine_into_output(
        self, hidden_states: torch.Tensor, output: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        return self._all2all("combine_into_output").combine_into_output(
            hidden_states, output, is_sequence_parallel
        )

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        if self.all2all_manager is not None:
            self.all2all_manager.prepare_communication_buffer_for_model(model)

    def abandon(self, reason: str) -> None:
        """From another thread: end the call in progress at once (it raises
        ``ClosedError`` naming ``reason``) where a back end can, before ``destroy``.
        None here can: a c10d wait ends when its peers' does, or at its timeout."""

    def destroy(self) -> None:
        """Release back ends and the all2all manager (idempotent)."""
        self.all_reduce_chain.close()
        if self.all2all_manager is not None:
            self.all2all_manager.destroy()
            self.all2all_manager = None

    # ---- helpers ------------------------------------------------------------------

    def _gloo(
        self, operation: str, peer: int | None = None, group: ProcessGroup | None = None
    ) -> AbstractContextManager[None]:
        """Translate Gloo failures of ``operation`` (with in-group ``peer`` if point-to-point)."""
        others = [r for r in self.ranks if r != self.rank]
        return gloo_errors(
            self.what,
            operation,
            self.device_group if group is None else group,
            others if peer is None else [self.ranks[peer]],
            self.peer_pids,
            timeout_s=self.timeout_s,
        )

    @property
    def _deadline(self) -> datetime.timedelta:
        """Each torch call's own deadline: this group's."""
        return datetime.timedelta(seconds=self.timeout_s)

    def _discover_sizes(
        self, tensors: list[torch.Tensor], dims: list[int], sizes: list[int] | None = None
    ) -> list[list[int]]:
        """Each tensor's length along its dim on every rank, in one small all-gather.

        A fingerprint of the dtype, of the other dims and of the ``sizes`` the caller
        gave (if any) travels along, so ranks whose tensors cannot be concatenated,
        or whose ``sizes`` differ, all raise the same clear error.
        """
        rows = []
        given = None if sizes is None else list(sizes)  # a tuple and a list say the same
        for t, d in zip(tensors, dims):
            others = [s for i, s in enumerate(t.shape) if i != d]
            # crc32, not hash(): str hashes differ between processes (PYTHONHASHSEED).
            fingerprint = zlib.crc32(f"{t.dtype}|{t.dim()}|{others}|{given}".encode())
            rows.append([t.shape[d], fingerprint])
        mine = torch.tensor(rows, dtype=torch.int64)
        table = self._all_gather_control(mine).tolist()  # [rank][tensor][length, fingerprint]
        out = []
        for i, t in enumerate(tensors):
            lengths = [table[r][i][0] for r in range(self.world_size)]
            own = table[self.rank_in_group][i][1]
            others = [r for r in range(self.world_size) if table[r][i][1] != own]
            if others:
                said = "" if given is None else f", sizes={given}"
                raise DesyncError(
                    f"input_: ranks {[self.ranks[r] for r in others]} disagree with rank "
                    f"{self.ranks[self.rank_in_group]} on the dtype, the dims other than "
                    f"{dims[i]} or the sizes given (this rank: {t.dtype}, shape "
                    f"{tuple(t.shape)}{said}; the parts' lengths along dim {dims[i]}: "
                    f"{lengths}); cannot concatenate"
                )
            out.append(lengths)
        return out

    def _gather_padded(
        self,
        tensor: torch.Tensor,
        dim: int,
        sizes: list[int],
        dst: int | None,
    ) -> torch.Tensor | None:
        """Gather (to ``dst``, or to all when None) tensors whose lengths along ``dim`` are ``sizes``.

        c10d's Gloo collectives need equal shapes, so each part travels padded
        to the longest and is cut back to its length on arrival; a part that is
        already the longest travels as it is. ``sizes`` must be every rank's true
        lengths (exchanged, or on a device trusted from the caller). The copies run with torch's pool at one thread (``OneTorchThread``): split
        over the pool they fought the peer ranks for the cores, and a 1 MiB
        gather to rank 0 at world 2 took 2.6 ms against Gloo's 1.3.
        """
        longest = max(sizes)
        moved = tensor.movedim(dim, 0)
        row = moved.shape[1:]
        with OneTorchThread(tensor.nbytes if tensor.is_cpu else 0):
            if moved.shape[0] == longest:
                padded = moved.contiguous()
            else:
                padded = moved.new_empty((longest, *row))
                padded[: moved.shape[0]] = moved
                # Zeros after the part, as bytes: torch fills no bits* or float4
                # tensor of 32 KiB or more (NotImplementedError on this rank alone).
                padded[moved.shape[0] :].view(torch.uint8).zero_()
            parts: torch.Tensor | None
            if dst is None:
                parts = self._all_gather_stacked(padded)
            else:
                parts = self.transports.select("gather", padded).gather_stacked(padded, dst)
            if parts is None:
                return None
            if all(n == longest for n in sizes):
                joined = parts.reshape(len(sizes) * longest, *row)
            else:
                joined = torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)
            return joined.movedim(0, dim).contiguous()
