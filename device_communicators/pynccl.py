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

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .errors import GroupcoordTypeError, GroupcoordValueError, unsupported
from .pynccl_setup import PyNcclBase, nccl_data_type, nccl_red_op

__all__ = [
    "PyNcclCommunicator",
    "defer_comm_warmup_on_rocm",
    "nccl_data_type",
    "nccl_red_op",
    "register_nccl_symmetric_ops",
]


def defer_comm_warmup_on_rocm() -> bool:
    """Whether a new communicator skips its warm-up all-reduce until first use (vLLM
    does on ROCm). groupcoord runs NCCL on CUDA only and always warms up in the
    constructor, so a failure shows at start-up: False."""
    return False


register_nccl_symmetric_ops = unsupported(
    "register_nccl_symmetric_ops", "NCCL symmetric-memory ops"
)


class PyNcclCommunicator(PyNcclBase):
    """NCCL over one group; ``available`` says whether it works, ``reason`` why not."""

    def _warm_up(self) -> None:
        data = torch.zeros(1, device=self.device)
        self.all_reduce(data)
        torch.cuda.current_stream(self.device).synchronize()

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

    register_comm_window = unsupported(
        "register_comm_window", "NCCL symmetric-memory window registration"
    )
    register_comm_window_raw = unsupported(
        "register_comm_window_raw", "NCCL symmetric-memory window registration"
    )
    deregister_comm_window = unsupported(
        "deregister_comm_window", "NCCL symmetric-memory window registration"
    )
