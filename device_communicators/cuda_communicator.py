"""``CudaCommunicator``: custom all-reduce, then pynccl, then torch.distributed.

All-reduce goes through the ordered back-end chain of the base class:
:class:`CustomAllreduce` (small tensors, one node, peer access), then
:class:`PyNcclAllReduce`, then ``torch.distributed`` on the device group.
all_gather(v), reduce_scatter(v), broadcast, send and recv use pynccl when it
is available (it runs on the caller's current stream and can be captured in
a CUDA graph) and the base class's torch.distributed calls otherwise.
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

from . import checks
from .all_reduce_backends import AllReduceBackend
from .base_device_communicator import DeviceCommunicatorBase
from .custom_all_reduce import CustomAllreduce
from .errors import GroupcoordTypeError, GroupcoordValueError, NotSupportedError
from .pynccl import PyNcclCommunicator, nccl_data_type, nccl_red_op

__all__ = ["CudaCommunicator", "PyNcclAllReduce"]


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

    # ---- collectives through pynccl ------------------------------------------------
    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if not self.pynccl.available:
            return super().all_gather(input_, dim)
        checks.tensor(input_, "input_", self.device)
        dim = checks.dim(input_, dim)
        src = input_.contiguous()
        out = torch.empty((self.world_size, *src.shape), dtype=src.dtype, device=src.device)
        self.pynccl.all_gather(out, src)
        return torch.cat(out.unbind(0), dim=dim)

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        if not self.pynccl.available:
            return super().all_gatherv(input_, dim, sizes)
        tensors = input_ if isinstance(input_, list) else [input_]
        if not tensors:
            raise GroupcoordValueError("input_: all_gatherv needs at least one tensor")
        dims = []
        for i, t in enumerate(tensors):
            checks.tensor(t, f"input_[{i}]" if isinstance(input_, list) else "input_", self.device)
            dims.append(checks.dim(t, dim))
        if sizes is not None:
            checks.sizes(sizes, "sizes", self.world_size)
            per_tensor = [list(sizes) for _ in tensors]
        else:
            per_tensor = self._discover_sizes(tensors, dims)
        results = []
        for t, d, s in zip(tensors, dims, per_tensor):
            moved = t.movedim(d, 0).contiguous()
            if moved.shape[0] != s[self.rank_in_group]:
                raise GroupcoordValueError(
                    f"sizes[{self.rank_in_group}]={s[self.rank_in_group]} but input_ has "
                    f"{moved.shape[0]} along dim {d}"
                )
            out = torch.empty((sum(s), *moved.shape[1:]), dtype=t.dtype, device=t.device)
            self.pynccl.all_gatherv(out, moved, s)
            results.append(out.movedim(0, d).contiguous())
        return results if isinstance(input_, list) else results[0]

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if not self.pynccl.available:
            return super().reduce_scatter(input_, dim)
        checks.tensor(input_, "input_", self.device)
        dim = checks.dim(input_, dim)
        if input_.shape[dim] % self.world_size:
            raise GroupcoordValueError(
                f"input_ has {input_.shape[dim]} along dim {dim}, not divisible by the "
                f"group's world size {self.world_size}"
            )
        moved = input_.movedim(dim, 0).contiguous()
        chunk = moved.shape[0] // self.world_size
        out = torch.empty((chunk, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
        self.pynccl.reduce_scatter(out, moved)
        return out.movedim(0, dim).contiguous()

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        if not self.pynccl.available or sizes is None:
            return super().reduce_scatterv(input_, dim, sizes)
        checks.tensor(input_, "input_", self.device)
        dim = checks.dim(input_, dim)
        checks.sizes(sizes, "sizes", self.world_size)
        if sum(sizes) != input_.shape[dim]:
            raise GroupcoordValueError(
                f"sizes sum to {sum(sizes)} but input_ has {input_.shape[dim]} along dim {dim}"
            )
        moved = input_.movedim(dim, 0).contiguous()
        mine = sizes[self.rank_in_group]
        out = torch.empty((mine, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
        self.pynccl.reduce_scatterv(out, moved, sizes)
        return out.movedim(0, dim).contiguous()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not self.pynccl.available:
            return super().broadcast(tensor, src)
        checks.tensor(tensor, "tensor", self.device)
        checks.rank(src, "src", self.world_size)
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.pynccl.broadcast(work, src)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        if not self.pynccl.available:
            return super().send(tensor, dst)
        checks.tensor(tensor, "tensor", self.device)
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        checks.rank(dst, "dst", self.world_size, self.rank_in_group)
        self.pynccl.send(tensor.contiguous(), dst)
        return None

    def recv(
        self,
        size: torch.Size | tuple[int, ...] | list[int],
        dtype: torch.dtype,
        src: int | None = None,
    ) -> torch.Tensor:
        if not self.pynccl.available:
            return super().recv(size, dtype, src)
        if not isinstance(dtype, torch.dtype):
            raise GroupcoordTypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        checks.rank(src, "src", self.world_size, self.rank_in_group)
        out = torch.empty(torch.Size(size), dtype=dtype, device=self.device)
        self.pynccl.recv(out, src)
        return out
