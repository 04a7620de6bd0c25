"""``CudaCommunicator``: custom all-reduce, then pynccl, then torch.distributed.

All-reduce goes through the ordered back-end chain of the base class:
:class:`CustomAllreduce` (small tensors, one node, peer access), then
:class:`PyNcclAllReduce`, then ``torch.distributed`` on the device group.
all_gather(v), reduce_scatter(v), broadcast, send and recv are the base
class's public methods (arguments checked there, once); their transport
chain is :class:`NcclTransport` (while pynccl is available: on the caller's
current stream, capturable in a CUDA graph), then c10d on the device group.
:meth:`CudaCommunicator.capture` puts custom all-reduce in graph-capture mode;
:meth:`CudaCommunicator.graph_capture` adds the side stream around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed import ProcessGroup, ReduceOp

from shm_broadcast.config import get_config

from .all_reduce_backends import AllReduceBackend
from .base_device_communicator import DeviceCommunicatorBase
from .custom_all_reduce import CustomAllreduce
from .errors import GroupcoordTypeError, GroupcoordValueError, NotSupportedError
from .pynccl import PyNcclCommunicator, nccl_data_type, nccl_red_op
from .transports import NOT_OFFERED, Transport

__all__ = ["CudaCommunicator", "NcclTransport", "PyNcclAllReduce"]


class PyNcclAllReduce(AllReduceBackend):
    """The pynccl communicator as an all-reduce back end (any size, NCCL's ops)."""

    name = "pynccl"

    def __init__(self, pynccl: PyNcclCommunicator) -> None:
        self.pynccl = pynccl

    def refusal(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM) -> str | None:
        if not self.pynccl.available:
            return self.pynccl.reason or "not available"
        if tensor.device != self.pynccl.device:
            return f"tensor on {tensor.device}, communicator on {self.pynccl.device}"
        try:
            nccl_red_op(op, tensor.dtype)
            assert self.pynccl.nccl is not None
            nccl_data_type(tensor.dtype, reduction=True, version_code=self.pynccl.nccl.version_code)
        except (GroupcoordTypeError, GroupcoordValueError) as exc:
            return str(exc)
        return None

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM
    ) -> torch.Tensor:
        return self.pynccl.all_reduce(tensor.contiguous(), op=op)

    def suspend(self) -> None:
        self.pynccl.suspend()

    def resume(self, group: ProcessGroup) -> None:
        self.pynccl.resume()  # through the group it was built over

    def close(self) -> None:
        self.pynccl.destroy()


class CudaCommunicator(DeviceCommunicatorBase):
    """Collectives of one group of CUDA ranks."""

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        global_ranks: list[int] | None = None,
        global_world_size: int | None = None,
        tcp_store_group: Any = None,
        use_all2all: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> None:
        if tcp_store_group is not None:
            raise NotSupportedError.by_groupcoord(
                "CudaCommunicator(tcp_store_group=...)",
                "communicators over a StatelessProcessGroup (elastic EP)",
            )
        if device is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            device = torch.device("cuda", index)
        if torch.device(device).type != "cuda":
            raise GroupcoordValueError(f"device must be a CUDA device, got {device}")
        super().__init__(
            cpu_group,
            torch.device(device),
            device_group,
            unique_name,
            global_ranks,
            global_world_size,
            use_all2all,
            timeout_s=timeout_s,
        )

    def _fast_all_reduce_backends(self) -> list[AllReduceBackend]:
        # Called by the base constructor once cpu_group and device are set.
        self.custom_all_reduce = CustomAllreduce(
            self.cpu_group, self.device, get_config().custom_all_reduce_max_bytes
        )
        self.pynccl = PyNcclCommunicator(self.cpu_group, self.device)
        return [self.custom_all_reduce, PyNcclAllReduce(self.pynccl)]

    def _fast_transports(self) -> list[Transport]:
        return [NcclTransport(self.pynccl)]

    @property
    def ca_comm(self) -> CustomAllreduce | None:
        """vLLM's name for the custom all-reduce: None where it is disabled."""
        return None if self.custom_all_reduce.disabled else self.custom_all_reduce

    @property
    def pynccl_comm(self) -> PyNcclCommunicator | None:
        """vLLM's name for the PyNccl communicator: None where it is unavailable."""
        return self.pynccl if self.pynccl.available else None

    def describe(self) -> list[tuple[str, str]]:
        """(back end, "enabled" or why not) in the order all-reduce tries them."""
        return [
            ("custom_all_reduce", self.custom_all_reduce.reason or "enabled"),
            ("pynccl", self.pynccl.reason or "enabled"),
            ("torch.distributed", "enabled (takes everything)"),
        ]

    # ---- graph capture ----------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Custom all-reduce's capture mode (buffers registered on exit; collective)."""
        if self.custom_all_reduce.disabled:
            yield
            return
        with self.custom_all_reduce.capture():
            yield

    @contextlib.contextmanager
    def graph_capture(self, stream: torch.cuda.Stream | None = None) -> Iterator[Any]:
        """A side stream that first waits on the current one, with capture mode on."""
        stream = stream if stream is not None else torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), self.capture():
            yield stream

    def custom_all_gather(self, input_: torch.Tensor) -> torch.Tensor | None:
        """None: no custom all-gather kernel here (vLLM's callers then use all_gather)."""
        return None

    def custom_reduce_scatter(self, input_: torch.Tensor) -> torch.Tensor | None:
        """None: no custom reduce-scatter kernel here (callers then use reduce_scatter)."""
        return None


class NcclTransport(Transport):
    """pynccl as the transport of the moving operations, while it is available:
    on the caller's current stream, capturable in a CUDA graph."""

    name = "pynccl"

    def __init__(self, pynccl: PyNcclCommunicator) -> None:
        self.pynccl = pynccl

    def refusal(self, op: str, tensor: torch.Tensor) -> str | None:
        if op == "gather":
            return NOT_OFFERED  # NCCL has none; c10d's gather on the device group does it
        if not self.pynccl.available:
            return self.pynccl.reason or "not available"
        return None

    def all_gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        return nccl_all_gather_stacked(self.pynccl, tensor)

    def all_gatherv_exact(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        # NCCL moves each part by the sizes given: checking them would take an
        # exchange (GROUPCOORD_DEBUG_DESYNC compares them across ranks).
        return nccl_all_gatherv(self.pynccl, tensor, dim, sizes)

    def reduce_scatter_sizes(
        self, input_: torch.Tensor, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        return nccl_reduce_scatter(self.pynccl, input_, dim, sizes)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.pynccl.broadcast(work, src)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.pynccl.send(tensor.contiguous(), dst)

    def recv(self, shape: torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.pynccl.device)
        self.pynccl.recv(out, src)
        return out


# ---- NCCL calls shaped as the transport needs (arguments already checked) --------------------


def nccl_all_gather_stacked(pynccl: PyNcclCommunicator, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's equally shaped ``tensor``, stacked: ``(world, *shape)``."""
    src = tensor.contiguous()
    out = torch.empty((pynccl.world_size, *src.shape), dtype=src.dtype, device=src.device)
    pynccl.all_gather(out, src)
    return out


def nccl_all_gatherv(
    pynccl: PyNcclCommunicator, tensor: torch.Tensor, dim: int, sizes: list[int]
) -> torch.Tensor:
    """Every rank's ``tensor`` joined along ``dim``, rank r holding ``sizes[r]`` rows."""
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((sum(sizes), *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    pynccl.all_gatherv(out, moved, sizes)
    return out.movedim(0, dim).contiguous()


def nccl_reduce_scatter(
    pynccl: PyNcclCommunicator, input_: torch.Tensor, dim: int, sizes: list[int]
) -> torch.Tensor:
    """This rank's ``sizes[rank]`` rows along ``dim`` of the sum of ``input_``."""
    moved = input_.movedim(dim, 0).contiguous()
    rows = sizes[pynccl.rank]
    out = torch.empty((rows, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    if all(n == rows for n in sizes):
        pynccl.reduce_scatter(out, moved)
    else:
        pynccl.reduce_scatterv(out, moved, sizes)
    return out.movedim(0, dim).contiguous()
