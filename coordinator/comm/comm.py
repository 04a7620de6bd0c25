"""The :class:`Comm` communicator: collectives and point-to-point with work handles.

Every operation has one shape: tensors first, then ``async_op``, ``hints`` and
``timeout``, and it returns a :class:`~coordinator.comm.work.Work`. Arguments
are checked before anything is sent. Each communicator owns a Gloo process
group built on its own store prefix, so it never touches torch's default
group, and one completer thread that finishes its works in issue order.

All-reduce, reduce-scatter, all-gather and broadcast take the same
shared-memory back end as ``GroupCoordinator``
(:class:`~device_communicators.shm_all_reduce.ShmAllReduce`, with its desync
check) when every rank is on this node and the back end takes the tensor; the
choice depends only on the group, the dtype and the operator, never on
``async_op``, so every rank makes the same one. Those calls run in issue
order through the communicator's :class:`~coordinator.comm.shm_lane.ShmLane`
(asynchronous ones on its thread); everything else runs on Gloo.
"""

from __future__ import annotations

import datetime
import functools
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from device_communicators import checks
from device_communicators.shm_all_reduce import ShmAllReduce
from shm_broadcast.config import resolve_timeout
from shm_broadcast.liveness import dead_peers, host_key

from ..errors import (
    BackendUnavailableError,
    ClosedError,
    GroupcoordTimeoutError,
    GroupcoordTypeError,
    GroupcoordValueError,
)
from .bootstrap import default_store, rank_and_size, unique_prefix
from .reduce_ops import ReduceOp
from .shm_lane import ShmLane
from .work import Completer, Work, translate_error

if TYPE_CHECKING:
    from .batch import P2PBatch
    from .window import Window

_P2P_TAG = 0  # one tag for send/recv and batches, so Gloo keeps them in FIFO order per pair
_Launch = Callable[[datetime.timedelta], Sequence[Any]]
_Fast = Callable[[ShmAllReduce], None]


class CommOptions(msgspec.Struct, frozen=True):
    """What a communicator was built with (``Comm.get_options()``)."""

    name: str
    backend: str
    device: str
    rank: int
    size: int
    timeout_s: float
    hints: dict[str, str]
    store_prefix: str


def _timeout_s(timeout: float | None, default: float, argument: str = "timeout") -> float:
    if timeout is None:
        return default
    try:
        return resolve_timeout(timeout)
    except ValueError as exc:
        raise GroupcoordValueError(f"{argument}: {exc}") from exc


def new_comm(
    backend: str = "gloo",
    device: str | torch.device = "cpu",
    name: str = "comm",
    timeout: float | None = None,
    store: dist.Store | None = None,
    hints: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    size: int | None = None,
) -> Comm:
    """Create a communicator over every rank of the launch (collective).

    ``rank``/``size`` default to the launcher's RANK/WORLD_SIZE and ``store``
    to a TCPStore at MASTER_ADDR:MASTER_PORT (or torch's default store).
    """
    if backend != "gloo":
        raise BackendUnavailableError(
            backend, "coordinator.comm runs on Gloo here (CPU tensors); pass backend='gloo'"
        )
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise GroupcoordValueError(f"device={device!r} is not a torch device: {exc}") from exc
    if torch_device.type != "cpu":
        raise GroupcoordValueError(f"device={device!r}: the gloo backend runs on 'cpu'")
    torch_device = torch.device("cpu")  # CPU tensors report no index: compare like with like
    if not isinstance(name, str) or not name:
        raise GroupcoordValueError(f"name must be a non-empty str, got {name!r}")
    checks.hints(hints)
    timeout_s = _timeout_s(timeout, resolve_timeout(None))
    rank, size = rank_and_size(rank, size)
    base_store = default_store(rank, size, timeout_s) if store is None else store
    return Comm._create(
        base_store, unique_prefix(name), rank, size, name, torch_device, timeout_s, hints
    )


class Comm:
    """A communicator over ``size`` ranks; create with :func:`new_comm` or :meth:`split`."""

    def __init__(
        self,
        pg: Any,
        base_store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        name: str,
        device: torch.device,
        timeout_s: float,
        hints: dict[str, str],
        owns_pg: bool = True,
    ) -> None:
        # c10d's stubs lack the backend's collective methods, hence Any.
        self._pg: Any = pg
        self._owns_pg = owns_pg  # False when borrowed from an existing group (adapters.py)
        self._base_store = base_store
        self._prefix = prefix
        self._store = dist.PrefixStore(prefix + "/kv", base_store)
        self._rank = rank
        self._size = size
        self._name = name
        self._device = device
        self._timeout_s = timeout_s
        self._hints = hints
        self._completer = Completer(name)
        self._closed: str | None = None
        self._broken: str | None = None
        self._split_count = 0
        self._barrier_count = 0
        self._windows: list[Window] = []
        self._local_pids: dict[int, int] = {}  # comm rank -> pid, peers with our host key
        self._lane: ShmLane | None = None  # None: no shared-memory path for this comm
        self._on_timeout = self._weak_timeout_marker(self)

    @classmethod
    def _create(
        cls,
        base_store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        name: str,
        device: torch.device,
        timeout_s: float,
        hints: Mapping[str, str] | None,
    ) -> Comm:
        checked_hints = checks.hints(hints)
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix + "/pg", base_store),
                rank,
                size,
                datetime.timedelta(seconds=timeout_s),
            )
        except RuntimeError as exc:
            raise GroupcoordTimeoutError(
                f"communicator {name!r}",
                "connect",
                timeout_s,
                missing=[r for r in range(size) if r != rank],
                detail=f"could not connect all ranks: {exc}",
            ) from exc
        comm = cls(pg, base_store, prefix, rank, size, name, device, timeout_s, checked_hints)
        comm._connect_local()
        return comm

    def _connect_local(self) -> None:
        """Collective, once at creation: share (host key, pid) so errors can name dead
        peers, then build the shared-memory back end (disabled, with its reason, when
        the ranks do not share this node)."""
        mine = torch.tensor([host_key(), os.getpid()], dtype=torch.int64)
        table = torch.empty((self._size, 2), dtype=torch.int64)
        self.all_gather_single(table, mine)
        here = host_key()
        self._local_pids = {
            r: int(pid)
            for r, (host, pid) in enumerate(table.tolist())
            if host == here and r != self._rank
        }
        shm = ShmAllReduce(
            self._pg,
            timeout_s=self._timeout_s,
            unique_name=f"communicator {self._name!r}",
            ranks=list(range(self._size)),
        )
        if shm.disabled_reason is None:  # the same verdict on every rank
            self._lane = ShmLane(self._name, shm, self._weak_failure_marker(self))

    # -- identity ----------------------------------------------------------
    def get_rank(self) -> int:
        return self._rank

    def get_size(self) -> int:
        return self._size

    def get_name(self) -> str:
        return self._name

    def get_device(self) -> torch.device:
        return self._device

    def get_backend(self) -> str:
        return "gloo"

    def get_options(self) -> CommOptions:
        return CommOptions(
            name=self._name,
            backend="gloo",
            device=str(self._device),
            rank=self._rank,
            size=self._size,
            timeout_s=self._timeout_s,
            hints=dict(self._hints),
            store_prefix=self._prefix,
        )

    def __repr__(self) -> str:
        return f"Comm({self._name!r}, rank {self._rank} of {self._size})"

    # -- plumbing ----------------------------------------------------------
    def _others(self) -> list[int]:
        return [r for r in range(self._size) if r != self._rank]

    def _check_usable(self, op: str) -> None:
        if self._closed is not None:
            raise ClosedError(f"communicator {self._name!r} was {self._closed}; {op} refused")
        if self._broken is not None:
            raise ClosedError(
                f"communicator {self._name!r}: {self._broken} timed out earlier, so ranks may "
                f"disagree on what comes next; abort() it and create a new one ({op} refused)"
            )

    @staticmethod
    def _weak_failure_marker(comm: Comm) -> Callable[[str], None]:
        """What the shared-memory lane calls when a peer was late or died (held weakly,
        like the timeout marker below)."""
        ref = weakref.ref(comm)

        def mark(op: str) -> None:
            alive = ref()
            if alive is not None:
                alive._broken = op

        return mark

    @staticmethod
    def _weak_timeout_marker(comm: Comm) -> Callable[[Work], None]:
        """What a work calls when its deadline passes: mark the comm broken.

        It holds the comm weakly. A work's callbacks may be the last thing
        released on one of Gloo's own threads; if they held the comm, the
        process group's destructor would run there and try to join the very
        thread it runs on (std::terminate, "Resource deadlock avoided").
        Finishing steps likewise capture plain values, never the comm.
        """
        ref = weakref.ref(comm)

        def mark(work: Work) -> None:
            alive = ref()
            if alive is not None:
                alive._broken = work.op

        return mark

    def _tensor(self, value: Any, argument: str) -> torch.Tensor:
        return checks.tensor(value, argument, self._device, contiguous=True)

    def _tensors(self, value: Any, argument: str, length: int | None) -> list[torch.Tensor]:
        return checks.tensor_list(value, argument, self._device, length, contiguous=True)

    @staticmethod
    def _op(op: Any, dtype: torch.dtype, argument: str) -> ReduceOp:
        if not isinstance(op, ReduceOp):
            raise GroupcoordTypeError(f"op must be a coordinator.comm.ReduceOp, got {op!r}")
        op.check_dtype(dtype, argument)
        return op

    def _run(
        self,
        op: str,
        peers: Sequence[int],
        timeout: float | None,
        async_op: bool,
        hints: Mapping[str, str] | None,
        launch: _Launch,
        finish: Callable[[], None] | None = None,
        completes_in_wait: bool = False,
        fast: _Fast | None = None,
    ) -> Work:
        """Check, then run ``fast`` on the shared-memory back end (synchronous calls it
        takes) or launch the c10d work(s), hand them to the completer, maybe wait."""
        checks.flag(async_op, "async_op")
        checks.hints(hints)
        timeout_s = _timeout_s(timeout, self._timeout_s)
        self._check_usable(op)
        if fast is not None:
            assert self._lane is not None  # fast is only offered with a lane
            work = Work(self._name, op, peers, timeout_s, on_timeout=self._on_timeout)
            self._lane.run(work, fast, async_op)
            return work
        work = Work(self._name, op, peers, timeout_s, on_timeout=self._on_timeout)
        local_pids = self._local_pids
        work.find_dead = functools.partial(dead_peers, local_pids)
        try:
            c10d_works = launch(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise translate_error(work, exc) from exc
        if async_op:
            self._completer.track(work, c10d_works, finish, completes_in_wait)
        else:
            Completer.run_inline(work, c10d_works, finish)
            work.wait()
        return work

    def _shm_takes(self, tensor: torch.Tensor, op: ReduceOp | None = None) -> bool:
        """Whether the shared-memory back end takes ``tensor`` (and ``op``).

        Its refusals depend on the group, dtype and operator only, so ranks that
        agree on the call agree on the path (and the back end checks they agree).
        """
        if self._lane is None:
            return False
        shm = self._lane.shm
        if op is None:
            return shm.copy_refusal(tensor) is None
        return shm.refusal(tensor, op.c10d_op()) is None

    # -- collectives -------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        tensor = self._tensor(tensor, "tensor")
        op = self._op(op, tensor.dtype, "tensor")

        def launch(td: datetime.timedelta) -> list[Any]:
            if op.factor is not None:
                tensor.mul_(op.factor)
            opts = AllreduceOptions()
            opts.reduceOp = op.c10d_op()
            opts.timeout = td
            return [self._pg.allreduce([tensor], opts)]

        finish = functools.partial(op.finish, tensor, self._size)

        def fast(shm: ShmAllReduce) -> None:
            shm.all_reduce(op.premultiply(tensor), op.c10d_op(), out=tensor)
            finish()

        return self._run(
            "all_reduce",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            finish,
            fast=fast if self._shm_takes(tensor, op) else None,
        )

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """Reduce into ``tensor`` on ``root``; other ranks' tensors are scratch afterwards."""
        tensor = self._tensor(tensor, "tensor")
        root = checks.rank(root, "root", self._size)
        op = self._op(op, tensor.dtype, "tensor")

        def launch(td: datetime.timedelta) -> list[Any]:
            if op.factor is not None:
                tensor.mul_(op.factor)
            opts = ReduceOptions()
            opts.reduceOp = op.c10d_op()
            opts.rootRank = root
            opts.rootTensor = 0
            opts.timeout = td
            return [self._pg.reduce([tensor], opts)]

        size, is_root = self._size, self._rank == root

        def finish() -> None:
            if is_root:
                op.finish(tensor, size)

        return self._run("reduce", self._others(), timeout, async_op, hints, launch, finish)

    def broadcast(
        self,
        tensor: torch.Tensor,
        root: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        tensor = self._tensor(tensor, "tensor")
        root = checks.rank(root, "root", self._size)

        def launch(td: datetime.timedelta) -> list[Any]:
            opts = BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            opts.timeout = td
            return [self._pg.broadcast([tensor], opts)]

        def fast(shm: ShmAllReduce) -> None:
            shm.broadcast_(tensor, root)

        return self._run(
            "broadcast",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            fast=fast if self._shm_takes(tensor) else None,
        )

    def _allgather(
        self,
        op: str,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | None,
        stacked: torch.Tensor | None = None,
    ) -> Work:
        """``outputs[i]`` gets rank ``i``'s ``tensor``; ``stacked`` (when given) is one
        contiguous tensor holding every output in rank order, for the shm path."""

        def launch(td: datetime.timedelta) -> list[Any]:
            opts = AllgatherOptions()
            opts.timeout = td
            return [self._pg.allgather([outputs], [tensor], opts)]

        def fast(shm: ShmAllReduce) -> None:
            if stacked is not None:
                shm.all_gather(tensor, out=stacked)
                return
            for output, part in zip(outputs, shm.all_gather(tensor).unbind(0)):
                output.copy_(part)

        return self._run(
            op,
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            fast=fast if self._shm_takes(tensor) else None,
        )

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        tensor = self._tensor(tensor, "tensor")
        outputs = self._tensors(tensor_list, "tensor_list", self._size)
        checks.same_dtype(tensor, outputs, "tensor_list")
        checks.same_shape(outputs, tensor, "tensor_list")
        return self._allgather("all_gather", outputs, tensor, async_op, hints, timeout)

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """Gather every rank's ``input`` into ``output``, concatenated in rank order."""
        input = self._tensor(input, "input")
        output = self._tensor(output, "output")
        checks.dtype_match(output, input, "output", "input")
        checks.numel(output, self._size * input.numel(), "output", "size * input.numel()")
        stacked = output.view(self._size, input.numel())
        return self._allgather(
            "all_gather_single",
            list(stacked.unbind(0)),
            input.view(-1),
            async_op,
            hints,
            timeout,
            stacked=stacked,
        )

    def all_gather_v(
        self,
        output_list: list[torch.Tensor],
        input: torch.Tensor,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """All-gather where rank ``i`` contributes ``output_list[i].numel()`` elements."""
        input = self._tensor(input, "input")
        outputs = self._tensors(output_list, "output_list", self._size)
        checks.same_dtype(input, outputs, "output_list")
        checks.numel(
            outputs[self._rank], input.numel(), f"output_list[{self._rank}]", "this rank's input"
        )
        # Gloo's allgather needs equal sizes: pad every part to the longest
        # (all lengths are known from output_list), then copy the parts out.
        longest = max(t.numel() for t in outputs)
        padded = torch.zeros(longest, dtype=input.dtype)
        padded[: input.numel()] = input.view(-1)
        staged = [torch.empty(longest, dtype=input.dtype) for _ in outputs]

        def finish() -> None:
            for out, part in zip(outputs, staged):
                out.view(-1).copy_(part[: out.numel()])

        def launch(td: datetime.timedelta) -> list[Any]:
            opts = AllgatherOptions()
            opts.timeout = td
            return [self._pg.allgather([staged], [padded], opts)]

        return self._run("all_gather_v", self._others(), timeout, async_op, hints, launch, finish)

    def _reduce_scatter(
        self,
        name: str,
        output: torch.Tensor,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | None,
        joined: torch.Tensor | None = None,
    ) -> Work:
        """``joined`` (when given) is ``inputs`` as one flat tensor, for the shm path."""

        def launch(td: datetime.timedelta) -> list[Any]:
            sent = [op.premultiply(t) for t in inputs]  # copies for PREMUL_SUM only
            opts = ReduceScatterOptions()
            opts.reduceOp = op.c10d_op()
            opts.timeout = td
            return [self._pg.reduce_scatter([output], [sent], opts)]

        finish = functools.partial(op.finish, output, self._size)
        rank = self._rank

        def fast(shm: ShmAllReduce) -> None:
            # Every rank's parts, flat and in rank order; this rank reduces only its own.
            flat = torch.cat([t.reshape(-1) for t in inputs]) if joined is None else joined
            flat = op.premultiply(flat)
            lo = sum(t.numel() for t in inputs[:rank])
            shm.reduce_range(flat, lo, lo + output.numel(), op.c10d_op(), out=output.view(-1))
            finish()

        return self._run(
            name,
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            finish,
            completes_in_wait=True,  # Gloo's reduce_scatter work has no future
            fast=fast if self._shm_takes(output, op) else None,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        output = self._tensor(output, "output")
        inputs = self._tensors(input_list, "input_list", self._size)
        checks.same_dtype(output, inputs, "input_list")
        checks.same_shape(inputs, output, "input_list")
        op = self._op(op, output.dtype, "output")
        return self._reduce_scatter("reduce_scatter", output, inputs, op, async_op, hints, timeout)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        output = self._tensor(output, "output")
        input = self._tensor(input, "input")
        checks.dtype_match(output, input, "output", "input")
        checks.numel(input, self._size * output.numel(), "input", "size * output.numel()")
        op = self._op(op, output.dtype, "output")
        inputs = list(input.view(self._size, output.numel()).unbind(0))
        return self._reduce_scatter(
            "reduce_scatter_single",
            output.view(-1),
            inputs,
            op,
            async_op,
            hints,
            timeout,
            joined=input.view(-1),
        )

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """Reduce-scatter where rank ``i`` receives ``input_list[i]``-sized results."""
        output = self._tensor(output, "output")
        inputs = self._tensors(input_list, "input_list", self._size)
        checks.same_dtype(output, inputs, "input_list")
        checks.numel(
            inputs[self._rank], output.numel(), f"input_list[{self._rank}]", "this rank's output"
        )
        op = self._op(op, output.dtype, "output")
        flat = [t.view(-1) for t in inputs]
        return self._reduce_scatter(
            "reduce_scatter_v", output.view(-1), flat, op, async_op, hints, timeout
        )

    def _alltoall_base(
        self,
        name: str,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | None,
        finish: Callable[[], None] | None = None,
    ) -> Work:
        def launch(td: datetime.timedelta) -> list[Any]:
            opts = AllToAllOptions()
            opts.timeout = td
            return [self._pg.alltoall_base(output, input, output_splits, input_splits, opts)]

        return self._run(name, self._others(), timeout, async_op, hints, launch, finish)

    def all_to_all(
        self,
        output_list: list[torch.Tensor],
        input_list: list[torch.Tensor],
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """Send ``input_list[i]`` to rank ``i``; receive rank ``i``'s into ``output_list[i]``.

        Sizes may differ per peer; each ``output_list[i]`` must match what rank
        ``i`` sends. Runs as one alltoall over flat staging buffers.
        """
        inputs = self._tensors(input_list, "input_list", self._size)
        outputs = self._tensors(output_list, "output_list", self._size)
        checks.same_dtype(inputs[0], inputs[1:], "input_list")
        checks.same_dtype(inputs[0], outputs, "output_list")
        staged_in = torch.cat([t.view(-1) for t in inputs])
        staged_out = torch.empty(sum(t.numel() for t in outputs), dtype=inputs[0].dtype)

        def finish() -> None:
            offset = 0
            for t in outputs:
                t.view(-1).copy_(staged_out[offset : offset + t.numel()])
                offset += t.numel()

        return self._alltoall_base(
            "all_to_all",
            staged_out,
            staged_in,
            [t.numel() for t in outputs],
            [t.numel() for t in inputs],
            async_op,
            hints,
            timeout,
            finish,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """Equal split along dim 0: block ``i`` of ``input`` goes to rank ``i``."""
        input = self._tensor(input, "input")
        output = self._tensor(output, "output")
        checks.dtype_match(output, input, "output", "input")
        for tensor, argument in ((input, "input"), (output, "output")):
            if tensor.dim() == 0 or tensor.shape[0] % self._size:
                raise GroupcoordValueError(
                    f"{argument} dim 0 ({tuple(tensor.shape)}) must divide evenly "
                    f"among {self._size} ranks"
                )
        if output.shape != input.shape:
            raise GroupcoordValueError(
                f"output shape {tuple(output.shape)} must equal input shape {tuple(input.shape)}"
            )
        return self._alltoall_base(
            "all_to_all_single", output, input, [], [], async_op, hints, timeout
        )

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """Uneven all-to-all along dim 0: ``input_split_sizes[i]`` rows go to rank ``i``."""
        input = self._tensor(input, "input")
        output = self._tensor(output, "output")
        checks.dtype_match(output, input, "output", "input")
        if input.dim() == 0 or output.dim() == 0:
            raise GroupcoordValueError("input and output need at least one dimension")
        if input.shape[1:] != output.shape[1:]:
            raise GroupcoordValueError(
                f"input rows {tuple(input.shape[1:])} and output rows "
                f"{tuple(output.shape[1:])} must have the same shape"
            )
        out_splits = checks.split_sizes(
            output_split_sizes, "output_split_sizes", self._size, output.shape[0], "output's dim 0"
        )
        in_splits = checks.split_sizes(
            input_split_sizes, "input_split_sizes", self._size, input.shape[0], "input's dim 0"
        )
        return self._alltoall_base(
            "all_to_all_v_single", output, input, out_splits, in_splits, async_op, hints, timeout
        )

    def gather(
        self,
        output_list: list[torch.Tensor] | None,
        input: torch.Tensor,
        root: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """Gather every rank's ``input`` into ``output_list`` on ``root`` (ignored elsewhere)."""
        input = self._tensor(input, "input")
        root = checks.rank(root, "root", self._size)
        outputs: list[torch.Tensor] = []
        if self._rank == root:
            outputs = self._tensors(output_list, "output_list", self._size)
            checks.same_dtype(input, outputs, "output_list")
            checks.same_shape(outputs, input, "output_list")

        def launch(td: datetime.timedelta) -> list[Any]:
            opts = GatherOptions()
            opts.rootRank = root
            opts.timeout = td
            return [self._pg.gather([outputs] if outputs else [], [input], opts)]

        return self._run("gather", self._others(), timeout, async_op, hints, launch)

    def scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor] | None,
        root: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        """Send ``input_list[i]`` from ``root`` into rank ``i``'s ``output``."""
        output = self._tensor(output, "output")
        root = checks.rank(root, "root", self._size)
        inputs: list[torch.Tensor] = []
        if self._rank == root:
            inputs = self._tensors(input_list, "input_list", self._size)
            checks.same_dtype(output, inputs, "input_list")
            checks.same_shape(inputs, output, "input_list")

        def launch(td: datetime.timedelta) -> list[Any]:
            opts = ScatterOptions()
            opts.rootRank = root
            opts.timeout = td
            return [self._pg.scatter([output], [inputs] if inputs else [], opts)]

        return self._run("scatter", self._others(), timeout, async_op, hints, launch)

    def barrier(
        self,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        def launch(td: datetime.timedelta) -> list[Any]:
            opts = BarrierOptions()
            opts.timeout = td
            return [self._pg.barrier(opts)]

        return self._run("barrier", self._others(), timeout, async_op, hints, launch)

    # -- point to point ----------------------------------------------------
    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        tensor = self._tensor(tensor, "tensor")
        dst = checks.rank(dst, "dst", self._size, self_rank=self._rank)
        return self._run(
            "send",
            [dst],
            timeout,
            async_op,
            hints,
            lambda td: [self._pg.send([tensor], dst, _P2P_TAG)],
            completes_in_wait=True,
        )

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Work:
        tensor = self._tensor(tensor, "tensor")
        src = checks.rank(src, "src", self._size, self_rank=self._rank)
        return self._run(
            "recv",
            [src],
            timeout,
            async_op,
            hints,
            lambda td: [self._pg.recv([tensor], src, _P2P_TAG)],
            completes_in_wait=True,
        )

    def batch_op_create(self) -> P2PBatch:
        """A batch of sends and receives that are all put in flight together."""
        from .batch import P2PBatch

        return P2PBatch(self)

    # -- sub-communicators, windows, barriers --------------------------------
    def split(
        self,
        ranks: Sequence[int],
        name: str,
        hints: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Comm | None:
        """Collective over this comm: join the child made of ``ranks`` (in that order)."""
        from .split import split

        return split(self, ranks, name, hints, timeout)

    def new_window(self) -> Window:
        """A shared-memory window over this comm's ranks (all on one node)."""
        from .window import Window

        self._check_usable("new_window")
        window = Window(self)
        self._windows.append(window)
        return window

    def monitored_barrier(self, timeout: float | None = None) -> None:
        """A barrier whose timeout names the ranks that did not arrive."""
        from .monitored_barrier import monitored_barrier

        monitored_barrier(self, timeout)

    # -- teardown ----------------------------------------------------------
    def abort(self) -> None:
        """Stop at once (not collective): pending works become ABORTED, windows unmap."""
        if self._closed is not None:
            return
        self._closed = "aborted"
        self._pg.abort()
        self._completer.abort_outstanding()
        self._close_local(abandon="aborted")

    def finalize(self) -> None:
        """Orderly close (not collective): let queued works finish, unmap windows,
        then shut the process group down. Works still running are waited for."""
        if self._closed is not None:
            return
        self._closed = "finalized"
        self._completer.drain()
        self._close_local()
        if self._owns_pg:
            self._pg.shutdown()

    def _close_local(self, abandon: str | None = None) -> None:
        """Unmap the windows and the shared-memory back end (``abandon``: its call in
        progress gives up first)."""
        windows, self._windows = self._windows, []
        for window in windows:
            window.close()
        if self._lane is not None:
            self._lane.close(abandon)

    def is_closed(self) -> bool:
        return self._closed is not None

    def __enter__(self) -> Comm:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """``finalize()`` after a clean block, ``abort()`` after an exception."""
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
