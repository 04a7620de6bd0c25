"""``PyNcclCommunicator``: NCCL collectives on torch CUDA tensors, on the current stream.

Our own NCCL communicator (not torch.distributed's NCCL group) so that
collectives can be captured in CUDA graphs and run on whatever stream the
caller is on. It bootstraps over a CPU group: rank 0 makes the unique id and
it travels as 128 raw bytes (no pickle). When it cannot work (one rank,
disabled in the config, library missing, no GPU, init error) it is built
disabled with the reason; ``strict=True`` raises instead. ``allow_single_rank=True``
builds a one-rank communicator (NCCL accepts it), which the GPU tests use to
prove the ctypes binding and stream handling on a single GPU. It is never
destroyed at garbage collection (NCCL teardown from a finalizer, possibly
after CUDA was torn down at exit, can hang or crash); call :meth:`destroy`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from shm_broadcast.config import get_config
from shm_broadcast.group_io import all_gather_bytes, broadcast_bytes, group_rank_and_size

from . import checks
from .all_reduce_backends import SUSPENDED
from .errors import (
    BackendUnavailableError,
    ClosedError,
    GroupcoordTypeError,
    GroupcoordValueError,
    unsupported,
)
from .pynccl_wrapper import NcclDataType, NcclError, NcclLibrary, NcclRedOp, load_nccl_library

__all__ = [
    "PyNcclCommunicator",
    "defer_comm_warmup_on_rocm",
    "nccl_data_type",
    "nccl_red_op",
    "register_nccl_symmetric_ops",
]

logger = logging.getLogger("groupcoord.device_communicators")

_DTYPES: dict[torch.dtype, NcclDataType] = {
    torch.int8: NcclDataType.INT8,
    torch.uint8: NcclDataType.UINT8,
    torch.int32: NcclDataType.INT32,
    torch.int64: NcclDataType.INT64,
    torch.float16: NcclDataType.FLOAT16,
    torch.float32: NcclDataType.FLOAT32,
    torch.float64: NcclDataType.FLOAT64,
    torch.bfloat16: NcclDataType.BFLOAT16,
}
_FLOAT8: dict[torch.dtype, NcclDataType] = {
    torch.float8_e4m3fn: NcclDataType.FLOAT8E4M3,
    torch.float8_e5m2: NcclDataType.FLOAT8E5M2,
}
_FLOAT8_REDUCE_MIN_VERSION = 22400  # ncclFloat8e4m3/e5m2 appeared in NCCL 2.24
_OPS: dict[Any, NcclRedOp] = {
    ReduceOp.SUM: NcclRedOp.SUM,
    ReduceOp.PRODUCT: NcclRedOp.PROD,
    ReduceOp.MAX: NcclRedOp.MAX,
    ReduceOp.MIN: NcclRedOp.MIN,
    ReduceOp.AVG: NcclRedOp.AVG,
}


def nccl_data_type(dtype: torch.dtype, *, reduction: bool, version_code: int = 0) -> int:
    """NCCL's type for ``dtype``. float8 moves as bytes (uint8) when nothing is
    summed; a reduction needs NCCL's own float8 types (2.24+)."""
    if dtype in _DTYPES:
        return int(_DTYPES[dtype])
    if dtype in _FLOAT8:
        if not reduction:
            return int(NcclDataType.UINT8)
        if version_code >= _FLOAT8_REDUCE_MIN_VERSION:
            return int(_FLOAT8[dtype])
        raise GroupcoordTypeError(f"dtype {dtype}: reducing float8 needs NCCL >= 2.24")
    raise GroupcoordTypeError(f"dtype {dtype} has no NCCL equivalent")


def nccl_red_op(op: Any, dtype: torch.dtype | None = None) -> int:
    """NCCL's op for ``op`` on ``dtype``; NCCL 2.28 answers ncclInvalidArgument
    for AVG on float8 (seen on an H100), so that is refused here, by name."""
    if op not in _OPS:
        raise GroupcoordValueError(f"op {op!r}: NCCL supports SUM, PRODUCT, MAX, MIN, AVG")
    if op == ReduceOp.AVG and dtype in _FLOAT8:
        raise GroupcoordTypeError(f"op AVG: NCCL does not average {dtype}; use SUM and divide")
    return int(_OPS[op])


def _as_device(device: int | str | torch.device) -> torch.device:
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise GroupcoordValueError(f"device must be a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", 0)
    return device


def defer_comm_warmup_on_rocm() -> bool:
    """Whether a new communicator skips its warm-up all-reduce until first use (vLLM
    does on ROCm). groupcoord runs NCCL on CUDA only and always warms up in the
    constructor, so a failure shows at start-up: False."""
    return False


register_nccl_symmetric_ops = unsupported(
    "register_nccl_symmetric_ops", "NCCL symmetric-memory ops"
)


class PyNcclCommunicator:
    """NCCL over one group; ``available`` says whether it works, ``reason`` why not."""

    def __init__(
        self,
        group: Any,
        device: int | str | torch.device,
        library_path: str | None = None,
        *,
        strict: bool = False,
        allow_single_rank: bool = False,
    ) -> None:
        self._fields(group, *group_rank_and_size(group), device, strict, allow_single_rank)
        local = self._local_refusal(library_path)
        # Every rank must take the same path or the others would wait in
        # ncclCommInitRank for a rank that gave up: agree on one reason first.
        refusal = self._agree(local)
        if refusal:
            self._disable(refusal)
            return
        unique_id = self._make_unique_id() if self.rank == 0 else None
        unique_id = broadcast_bytes(group, unique_id, src=0)
        if not unique_id:
            self._disable("rank 0 could not make an NCCL unique id (see its log)")
            return
        self._init_comm(unique_id)

    @classmethod
    def from_unique_id_bytes(
        cls,
        unique_id_bytes: bytes,
        rank: int,
        world_size: int,
        device: int | str | torch.device,
        library_path: str | None = None,
    ) -> PyNcclCommunicator:
        """vLLM's group-less start: every rank passes the same unique id (rank 0's
        ``NcclLibrary.get_unique_id()``, shared however the caller likes). With no
        group to agree on a refusal, any failure raises (strict)."""
        if not isinstance(unique_id_bytes, bytes | bytearray) or not unique_id_bytes:
            raise GroupcoordTypeError(
                f"unique_id_bytes must be the non-empty bytes of an NCCL unique id, "
                f"got {type(unique_id_bytes).__name__}"
            )
        for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GroupcoordValueError(f"{name} must be an int >= {low}, got {value!r}")
        checks.rank(rank, "rank", world_size)
        self = cls.__new__(cls)
        self._fields(None, rank, world_size, device, True, True)
        refusal = self._local_refusal(library_path)
        if refusal:
            self._disable(refusal)
        self._init_comm(bytes(unique_id_bytes))
        return self

    def _fields(
        self,
        group: Any,
        rank: int,
        world_size: int,
        device: int | str | torch.device,
        strict: bool,
        allow_single_rank: bool,
    ) -> None:
        self.group = group
        self.rank, self.world_size = rank, world_size
        self.device = _as_device(device)
        self.nccl: NcclLibrary | None = None
        self.comm: int | None = None
        self.available = False
        self.disabled = True
        self.reason = ""
        self._strict = strict
        self._allow_single_rank = allow_single_rank
        self._closed = False
        self._suspended = False

    def _init_comm(self, unique_id: bytes) -> None:
        assert self.nccl is not None
        try:
            with self._on_device():
                self.comm = self.nccl.comm_init_rank(self.world_size, unique_id, self.rank)
        except NcclError as exc:
            self._disable(f"ncclCommInitRank on {self.device} failed: {exc}")
            return
        self.available = True
        self.disabled = False
        self._warm_up()
        logger.info(
            "pynccl ready: NCCL %s from %s, rank %d/%d on %s",
            self.nccl.version,
            self.nccl.path,
            self.rank,
            self.world_size,
            self.device,
        )

    # -- set-up ---------------------------------------------------------------
    def _local_refusal(self, library_path: str | None) -> str:
        if get_config().disable_pynccl:
            return "disabled by GROUPCOORD_DISABLE_PYNCCL"
        if self.world_size == 1 and not self._allow_single_rank:
            return "world size 1: nothing to communicate"
        try:
            self.nccl = load_nccl_library(library_path)
        except BackendUnavailableError as exc:
            return exc.reason
        return ""

    def _make_unique_id(self) -> bytes:
        # On failure rank 0 sends empty bytes so every rank disables together
        # instead of the others waiting for an id that never comes.
        assert self.nccl is not None
        try:
            return self.nccl.get_unique_id()
        except NcclError as exc:
            logger.warning("pynccl: ncclGetUniqueId failed: %s", exc)
            return b""

    def _agree(self, local: str) -> str:
        reasons = [r.decode() for r in all_gather_bytes(self.group, local.encode())]
        if not any(reasons):
            return ""
        first = next(i for i, r in enumerate(reasons) if r)
        return local or f"rank {first}: {reasons[first]}"

    def _disable(self, reason: str) -> None:
        self.reason = reason
        logger.info("pynccl disabled on rank %d: %s", self.rank, reason)
        if self._strict:
            raise BackendUnavailableError("pynccl", reason)

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        # Without a CUDA build of torch there is no device to enter; NCCL then
        # reports the missing driver itself, which is the message we want.
        if torch.cuda.is_available():
            with torch.cuda.device(self.device):
                yield
        else:
            yield

    def _warm_up(self) -> None:
        data = torch.zeros(1, device=self.device)
        self.all_reduce(data)
        torch.cuda.current_stream(self.device).synchronize()

    # -- checks -----------------------------------------------------------------
    def _require(self) -> int:
        if self._closed:
            raise ClosedError("pynccl communicator was destroyed")
        if self.comm is None or self.nccl is None:
            raise BackendUnavailableError("pynccl", self.reason or "not initialised")
        return self.comm

    def _check(self, tensor: Any, name: str) -> None:
        checks.tensor(tensor, name, self.device, contiguous=True)

    def _check_peer(self, peer: int, name: str) -> None:
        checks.rank(peer, name, self.world_size)

    def _check_sizes(self, sizes: Sequence[int], total: int, name: str) -> None:
        checks.split_sizes(sizes, name, self.world_size, total, "the tensor's dim 0")

    def _stream(self, stream: Any) -> int:
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        return int(stream.cuda_stream)

    def _dtype(self, tensor: torch.Tensor, reduction: bool) -> int:
        assert self.nccl is not None
        return nccl_data_type(
            tensor.dtype, reduction=reduction, version_code=self.nccl.version_code
        )

    # -- collectives ------------------------------------------------------------
    def all_reduce(
        self,
        in_tensor: torch.Tensor,
        out_tensor: torch.Tensor | None = None,
        op: Any = ReduceOp.SUM,
        stream: Any = None,
    ) -> torch.Tensor:
        """Out-of-place all-reduce; returns ``out_tensor`` (allocated when None)."""
        comm = self._require()
        self._check(in_tensor, "in_tensor")
        if out_tensor is None:
            out_tensor = torch.empty_like(in_tensor)
        self._check(out_tensor, "out_tensor")
        if out_tensor.shape != in_tensor.shape or out_tensor.dtype != in_tensor.dtype:
            raise GroupcoordValueError("out_tensor must match in_tensor's shape and dtype")
        nccl_op, dtype = nccl_red_op(op, in_tensor.dtype), self._dtype(in_tensor, reduction=True)
        assert self.nccl is not None
        self.nccl.all_reduce(
            in_tensor.data_ptr(),
            out_tensor.data_ptr(),
            in_tensor.numel(),
            dtype,
            nccl_op,
            comm,
            self._stream(stream),
        )
        return out_tensor

    def all_gather(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, stream: Any = None
    ) -> None:
        comm = self._require()
        self._check(input_tensor, "input_tensor")
        self._check(output_tensor, "output_tensor")
        if output_tensor.numel() != input_tensor.numel() * self.world_size:
            raise GroupcoordValueError("output_tensor must hold world_size x input_tensor")
        assert self.nccl is not None
        self.nccl.all_gather(
            input_tensor.data_ptr(),
            output_tensor.data_ptr(),
            input_tensor.numel(),
            self._dtype(input_tensor, reduction=False),
            comm,
            self._stream(stream),
        )

    def all_gatherv(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: Sequence[int],
        stream: Any = None,
    ) -> None:
        """Rank i contributes ``sizes[i]`` rows (dim 0); one broadcast per root, grouped."""
        comm = self._require()
        self._check(input_tensor, "input_tensor")
        self._check(output_tensor, "output_tensor")
        self._check_sizes(sizes, output_tensor.shape[0], "sizes")
        if input_tensor.shape[0] != sizes[self.rank]:
            raise GroupcoordValueError(
                f"input_tensor has {input_tensor.shape[0]} rows, sizes[{self.rank}]={sizes[self.rank]}"
            )
        assert self.nccl is not None
        dtype, handle = self._dtype(input_tensor, reduction=False), self._stream(stream)
        row = math.prod(output_tensor.shape[1:])  # elements per row; 1 for 1-D
        self.nccl.group_start()
        try:
            offset = 0
            for root, n in enumerate(sizes):
                part = output_tensor[offset : offset + n]
                send = input_tensor if root == self.rank else part
                self.nccl.broadcast(
                    send.data_ptr(), part.data_ptr(), n * row, dtype, root, comm, handle
                )
                offset += n
        finally:
            self.nccl.group_end()

    def reduce_scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        op: Any = ReduceOp.SUM,
        stream: Any = None,
    ) -> None:
        comm = self._require()
        self._check(input_tensor, "input_tensor")
        self._check(output_tensor, "output_tensor")
        if input_tensor.numel() != output_tensor.numel() * self.world_size:
            raise GroupcoordValueError("input_tensor must hold world_size x output_tensor")
        assert self.nccl is not None
        self.nccl.reduce_scatter(
            input_tensor.data_ptr(),
            output_tensor.data_ptr(),
            output_tensor.numel(),
            self._dtype(input_tensor, reduction=True),
            nccl_red_op(op, input_tensor.dtype),
            comm,
            self._stream(stream),
        )

    def reduce_scatterv(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: Sequence[int],
        op: Any = ReduceOp.SUM,
        stream: Any = None,
    ) -> None:
        """Rank i keeps the reduced ``sizes[i]`` rows (dim 0); one reduce per root, grouped."""
        comm = self._require()
        self._check(input_tensor, "input_tensor")
        self._check(output_tensor, "output_tensor")
        self._check_sizes(sizes, input_tensor.shape[0], "sizes")
        if output_tensor.shape[0] != sizes[self.rank]:
            raise GroupcoordValueError(
                f"output_tensor has {output_tensor.shape[0]} rows, sizes[{self.rank}]={sizes[self.rank]}"
            )
        assert self.nccl is not None
        dtype = self._dtype(input_tensor, reduction=True)
        nccl_op = nccl_red_op(op, input_tensor.dtype)
        handle = self._stream(stream)
        row = math.prod(input_tensor.shape[1:])
        self.nccl.group_start()
        try:
            offset = 0
            for root, n in enumerate(sizes):
                part = input_tensor[offset : offset + n]
                self.nccl.reduce(
                    part.data_ptr(),
                    output_tensor.data_ptr(),
                    n * row,
                    dtype,
                    nccl_op,
                    root,
                    comm,
                    handle,
                )
                offset += n
        finally:
            self.nccl.group_end()

    def reduce(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        root: int,
        op: Any = ReduceOp.SUM,
        stream: Any = None,
    ) -> None:
        """Reduce ``input_tensor`` over the ranks into ``root``'s ``output_tensor``."""
        comm = self._require()
        self._check(input_tensor, "input_tensor")
        self._check(output_tensor, "output_tensor")
        self._check_peer(root, "root")
        if output_tensor.numel() != input_tensor.numel():
            raise GroupcoordValueError("output_tensor must hold as many elements as input_tensor")
        assert self.nccl is not None
        self.nccl.reduce(
            input_tensor.data_ptr(),
            output_tensor.data_ptr(),
            input_tensor.numel(),
            self._dtype(input_tensor, reduction=True),
            nccl_red_op(op, input_tensor.dtype),
            root,
            comm,
            self._stream(stream),
        )

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: Sequence[int],
        root: int = 0,
        stream: Any = None,
    ) -> None:
        """``root`` gives rank i its ``sizes[i]`` rows (dim 0) of ``input_tensor``, into
        each rank's ``output_tensor``: sends and receives in one NCCL group."""
        self._require()
        self._check(output_tensor, "output_tensor")
        self._check_peer(root, "root")
        self._check_sizes(sizes, sum(sizes) if isinstance(sizes, list | tuple) else 0, "sizes")
        if output_tensor.shape[0] != sizes[self.rank]:
            raise GroupcoordValueError(
                f"output_tensor has {output_tensor.shape[0]} rows, sizes[{self.rank}]={sizes[self.rank]}"
            )
        ops: list[tuple[str, torch.Tensor, int]] = []
        if self.rank == root:
            self._check(input_tensor, "input_tensor")
            self._check_sizes(sizes, input_tensor.shape[0], "sizes")
            offsets = [0, *itertools.accumulate(sizes)]
            ops = [
                ("send", input_tensor[offsets[peer] : offsets[peer + 1]], peer)
                for peer in range(self.world_size)
                if sizes[peer]
            ]
        if sizes[self.rank]:
            ops.append(("recv", output_tensor, root))
        self._grouped_p2p(ops, stream)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        comm = self._require()
        self._check(tensor, "tensor")
        self._check_peer(src, "src")
        assert self.nccl is not None
        ptr = tensor.data_ptr()
        self.nccl.broadcast(
            ptr,
            ptr,
            tensor.numel(),
            self._dtype(tensor, reduction=False),
            src,
            comm,
            self._stream(stream),
        )

    def send(self, tensor: torch.Tensor, dst: int, stream: Any = None) -> None:
        comm = self._require()
        self._check(tensor, "tensor")
        self._check_peer(dst, "dst")
        assert self.nccl is not None
        self.nccl.send(
            tensor.data_ptr(),
            tensor.numel(),
            self._dtype(tensor, reduction=False),
            dst,
            comm,
            self._stream(stream),
        )

    def recv(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        comm = self._require()
        self._check(tensor, "tensor")
        self._check_peer(src, "src")
        assert self.nccl is not None
        self.nccl.recv(
            tensor.data_ptr(),
            tensor.numel(),
            self._dtype(tensor, reduction=False),
            src,
            comm,
            self._stream(stream),
        )

    def group_start(self) -> None:
        self._require()
        assert self.nccl is not None
        self.nccl.group_start()

    def group_end(self) -> None:
        self._require()
        assert self.nccl is not None
        self.nccl.group_end()

    def batch_send_recv(
        self,
        sends: Sequence[tuple[torch.Tensor, int]] = (),
        recvs: Sequence[tuple[torch.Tensor, int]] = (),
        stream: Any = None,
    ) -> None:
        """All sends and receives in one NCCL group, so a ring exchange cannot deadlock."""
        self._grouped_p2p(
            [("send", t, p) for t, p in sends] + [("recv", t, p) for t, p in recvs], stream
        )

    def batch_isend_irecv(self, p2p_ops: list, stream: Any = None) -> None:
        """vLLM's form: ``torch.distributed.P2POp`` s (``isend``/``irecv``, in-group
        peer), issued in order in one NCCL group."""
        if not isinstance(p2p_ops, list | tuple):
            raise GroupcoordTypeError(
                f"p2p_ops must be a list of P2POp, got {type(p2p_ops).__name__}"
            )
        ops: list[tuple[str, torch.Tensor, int]] = []
        for i, p2p in enumerate(p2p_ops):
            fn = getattr(p2p, "op", None)
            kind = "send" if fn is dist.isend else "recv" if fn is dist.irecv else None
            if kind is None:
                raise GroupcoordValueError(
                    f"p2p_ops[{i}] must be a torch.distributed.P2POp of isend or irecv, got {p2p!r}"
                )
            peer = getattr(p2p, "group_peer", None)
            ops.append((kind, p2p.tensor, p2p.peer if peer is None else peer))
        self._grouped_p2p(ops, stream)

    def _grouped_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int]], stream: Any) -> None:
        for i, (kind, tensor, peer) in enumerate(ops):
            self._check(tensor, f"{kind}s[{i}].tensor")
            self._check_peer(peer, f"{kind}s[{i}].{'dst' if kind == 'send' else 'src'}")
        self.group_start()
        try:
            for kind, tensor, peer in ops:
                (self.send if kind == "send" else self.recv)(tensor, peer, stream)
        finally:
            self.group_end()

    # -- sleep mode ---------------------------------------------------------------
    def suspend(self) -> None:
        """Free the NCCL communicator (and the device memory NCCL holds for it) after
        the work queued on the current stream; until :meth:`resume` the
        communicator is unavailable and callers fall back (``CudaCommunicator`` to
        torch.distributed). Every rank calls it."""
        if self.comm is None or self.nccl is None or self._closed:
            return
        if self.group is None:
            raise GroupcoordValueError(
                "suspend: a communicator built from_unique_id_bytes has no group to "
                "re-create itself through on resume; destroy() it and build a new one"
            )
        torch.cuda.current_stream(self.device).synchronize()
        comm, self.comm = self.comm, None
        self.nccl.comm_destroy(comm)
        self.available = False
        self.disabled = True
        self.reason = SUSPENDED
        self._suspended = True

    def resume(self) -> None:
        """Re-create the communicator suspended by :meth:`suspend`: rank 0 makes a new
        unique id and every rank joins (collective over the group)."""
        if not self._suspended or self._closed:
            return
        self._suspended = False
        self.reason = ""
        unique_id = self._make_unique_id() if self.rank == 0 else None
        unique_id = broadcast_bytes(self.group, unique_id, src=0)
        if not unique_id:
            self._disable("rank 0 could not make an NCCL unique id on resume (see its log)")
            return
        self._init_comm(unique_id)

    register_comm_window = unsupported(
        "register_comm_window", "NCCL symmetric-memory window registration"
    )
    register_comm_window_raw = unsupported(
        "register_comm_window_raw", "NCCL symmetric-memory window registration"
    )
    deregister_comm_window = unsupported(
        "deregister_comm_window", "NCCL symmetric-memory window registration"
    )

    # -- teardown ---------------------------------------------------------------
    def destroy(self) -> None:
        """Destroy the NCCL communicator (idempotent). Every rank must call it."""
        if self.comm is not None and self.nccl is not None and not self._closed:
            comm, self.comm = self.comm, None
            self.nccl.comm_destroy(comm)
        self._closed = True
        self.available = False

    def abort(self) -> None:
        """Abort in-flight work and free the communicator (after a peer failure)."""
        if self.comm is not None and self.nccl is not None and not self._closed:
            comm, self.comm = self.comm, None
            self.nccl.comm_abort(comm)
        self._closed = True
        self.available = False
