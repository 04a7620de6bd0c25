"""Custom all-reduce for CUDA ranks on one node: IPC-shared buffers and our own kernels.

Every rank allocates a signal buffer (barrier flags + two-shot scratch) and a
staging buffer, shares them with its peers through CUDA IPC handles exchanged
over the CPU group, and runs the one-shot or two-shot kernel of
``custom_all_reduce.cu`` (compiled at run time by NVRTC) that reads the
peers' buffers directly.

Eager calls copy the input into the staging buffer (RankData slot 0). Inside
:meth:`CustomAllreduce.capture`, a call made while the stream is being
captured records the input's own pointer in a fresh RankData slot instead (no
copy in the graph); when the capture context exits, all ranks exchange the
IPC handles of those captured buffers and fill the slots before any replay.

Set-up (collective: ranks agree on one reason before any rank disables) and
teardown are in :mod:`.custom_all_reduce_setup`. Written for real hardware;
without a GPU it disables with the CUDA runtime's reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from shm_broadcast.group_io import all_gather_bytes, group_rank_and_size

from . import cuda_ipc
from .custom_all_reduce_setup import (
    MAX_RANKS,
    RANK_DATA_BYTES,
    RANK_DATA_SLOTS,
    CustomAllreduceBase,
)
from .custom_ar_policy import (
    PACK_BYTES,
    choose_algorithm,
    describe_tensor,
    launch_config,
    should_custom_ar,
)
from .errors import (
    BackendUnavailableError,
    GroupcoordValueError,
    NotSupportedError,
    ProtocolError,
)

__all__ = ["CustomAllreduce", "kernel_args"]

logger = logging.getLogger("groupcoord.device_communicators")


def kernel_args(
    rank_data: int, signals: list[int], rank: int, out_ptr: int, packs: int
) -> tuple[Any, ...]:
    """The parameters of every ``gc_allreduce_*`` kernel, as ctypes values.

    (const RankData*, RankSignals by value, Signal* self, T* result, int rank,
    int size). cuLaunchKernel reads each from its own address with the size the
    cubin records, and copies them at the call (also while a stream is being
    captured), so short-lived values are fine. The sizes are checked against
    the compiled cubin's parameter table in the tests.
    """
    padding = [None] * (MAX_RANKS - len(signals))
    return (
        ctypes.c_void_p(rank_data),
        (ctypes.c_void_p * MAX_RANKS)(*signals, *padding),
        ctypes.c_void_p(signals[rank]),
        ctypes.c_void_p(out_ptr),
        ctypes.c_int(rank),
        ctypes.c_int(packs),
    )


class CustomAllreduce(CustomAllreduceBase):
    """All-reduce (SUM) of float32/float16/bfloat16 CUDA tensors below ``max_size`` bytes."""

    # ---- AllReduceBackend ---------------------------------------------------------
    def refusal(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM) -> str | None:
        if self.disabled:
            return self.reason
        if op != ReduceOp.SUM:
            return f"only SUM, not {op}"
        if tensor.device != self.device:
            return f"tensor on {tensor.device}, communicator on {self.device}"
        decision = should_custom_ar(describe_tensor(tensor), max_bytes=self.max_size)
        return None if decision else decision.reason

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        return self.refusal(inp) is None

    def all_reduce(
        self,
        inp: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        registered: bool = False,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
    ) -> torch.Tensor:
        """Sum ``inp`` over the group on the current stream, into ``out`` (a new tensor
        when None). ``registered=False`` copies ``inp`` into the shared staging
        buffer first; ``registered=True`` (inside :meth:`capture`, while the stream
        is being captured) reads ``inp`` where it is, through the IPC handles
        registered when the capture ends."""
        reason = self.refusal(inp, op)
        if reason is not None:
            raise GroupcoordValueError(f"custom all-reduce cannot take this tensor: {reason}")
        nbytes = inp.numel() * inp.element_size()
        if out is None:
            # empty_like keeps a dense tensor's strides, so the output's bytes line
            # up with the input's even for a permuted (weakly contiguous) layout.
            out = torch.empty_like(inp)
        elif out.shape != inp.shape or out.dtype != inp.dtype or out.device != inp.device:
            raise GroupcoordValueError(
                f"out must match inp ({inp.dtype}{list(inp.shape)} on {inp.device}), "
                f"got {out.dtype}{list(out.shape)} on {out.device}"
            )
        elif out.stride() != inp.stride():
            raise GroupcoordValueError(
                "out must have inp's strides (its bytes are written as inp's)"
            )
        stream = torch.cuda.current_stream(self.device).cuda_stream
        slot = self._graph_slot(inp) if registered else None
        if registered and slot is None and not self._capturing:
            raise GroupcoordValueError(
                "registered=True: only inputs captured inside capture() are registered"
            )
        if slot is None:
            cuda_ipc.memcpy_d2d_async(self._staging[self.rank], inp.data_ptr(), nbytes, stream)
            slot = 0
        dtype = str(inp.dtype).removeprefix("torch.")
        algo = choose_algorithm(nbytes, self.world_size, self.algo_setting)
        self._launch(self._functions[(algo, dtype)], slot, out.data_ptr(), nbytes, stream)
        return out

    def custom_all_reduce(self, input: torch.Tensor) -> torch.Tensor | None:
        """vLLM's entry: the sum, or None when this back end should not take ``input``
        (the caller then uses NCCL). While a graph is being captured inside
        :meth:`capture` the input is registered, not copied."""
        if self.refusal(input) is not None:
            return None
        return self.reduce_in_chain(input, ReduceOp.SUM)

    def reduce_in_chain(self, tensor: torch.Tensor, op: ReduceOp.RedOpType) -> torch.Tensor:
        return self.all_reduce(
            tensor, op=op, registered=self._capturing and torch.cuda.is_current_stream_capturing()
        )

    def should_custom_all_gather(self, inp: torch.Tensor) -> bool:
        """False: no all-gather kernel here; NCCL gathers."""
        return False

    def custom_all_gather(self, inp: torch.Tensor) -> torch.Tensor | None:
        """None: no all-gather kernel here (the caller uses NCCL)."""
        return None

    def should_custom_reduce_scatter(self, inp: torch.Tensor) -> bool:
        """False: no reduce-scatter kernel here; NCCL reduce-scatters."""
        return False

    def should_mnnvl_multimem_reduce_scatter(self, inp: torch.Tensor) -> bool:
        """False: no multi-node NVLink multimem kernels here."""
        return False

    def custom_reduce_scatter(self, inp: torch.Tensor) -> torch.Tensor | None:
        """None: no reduce-scatter kernel here (the caller uses NCCL)."""
        return None

    # ---- vLLM's shared-buffer helpers -------------------------------------------------
    @staticmethod
    def create_shared_buffer(
        size_in_bytes: int, group: Any = None, uncached: bool | None = False
    ) -> list[int]:
        """Collective: a zeroed device buffer of ``size_in_bytes`` on every rank of
        ``group`` (default: the world), shared over CUDA IPC; returns every rank's
        pointer in rank order, this rank's own included. Free it with
        :meth:`free_shared_buffer`. Ranks agree first, so all raise together."""
        if uncached:
            raise NotSupportedError.by_groupcoord(
                "create_shared_buffer(uncached=True)", "uncached (fine-grained) allocations"
            )
        if isinstance(size_in_bytes, bool) or not isinstance(size_in_bytes, int):
            raise GroupcoordValueError(f"size_in_bytes must be an int, got {size_in_bytes!r}")
        if size_in_bytes <= 0:
            raise GroupcoordValueError(f"size_in_bytes must be positive, got {size_in_bytes}")
        group = dist.group.WORLD if group is None else group
        rank, _world = group_rank_and_size(group)
        reasons = [
            r.decode() for r in all_gather_bytes(group, cuda_ipc.cuda_unavailable_reason().encode())
        ]
        refused = [(r, why) for r, why in enumerate(reasons) if why]
        if refused:
            r, why = refused[0]
            raise BackendUnavailableError(
                "CustomAllreduce.create_shared_buffer", f"rank {r}: {why}"
            )
        ptr = cuda_ipc.malloc_zeroed(size_in_bytes)
        handles = all_gather_bytes(group, cuda_ipc.ipc_handle(ptr))
        return [ptr if r == rank else cuda_ipc.open_ipc_handle(h) for r, h in enumerate(handles)]

    @staticmethod
    def free_shared_buffer(pointers: list[int], group: Any = None, rank: int | None = None) -> None:
        """Undo :meth:`create_shared_buffer` on this rank: close the peers' mappings
        and free its own buffer (``pointers[rank]``)."""
        if rank is None:
            rank = group_rank_and_size(dist.group.WORLD if group is None else group)[0]
        for r, ptr in enumerate(pointers):
            if r == rank:
                cuda_ipc.free(ptr)
            else:
                cuda_ipc.close_ipc_handle(ptr)

    def _graph_slot(self, tensor: torch.Tensor) -> int | None:
        """A RankData slot for a call being captured; None to use the staging copy."""
        if not torch.cuda.is_current_stream_capturing():
            return None  # warm-up runs inside capture(): eager, same allocations
        if 1 + len(self._graph_inputs) >= RANK_DATA_SLOTS:
            logger.warning("custom all-reduce: graph slots exhausted, captured call copies")
            return None
        self._graph_inputs.append(tensor.data_ptr())
        return len(self._graph_inputs)

    def _launch(self, function: int, slot: int, out_ptr: int, nbytes: int, stream: int) -> None:
        from cupy_backends.cuda.api import driver

        blocks, threads = launch_config(nbytes)
        args = kernel_args(
            self._rank_data + slot * RANK_DATA_BYTES,
            self._signals,
            self.rank,
            out_ptr,
            nbytes // PACK_BYTES,
        )
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        driver.launchKernel(
            function, blocks, 1, 1, threads, 1, 1, 0, stream, ctypes.addressof(params), 0
        )

    # ---- CUDA graphs ----------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Enter capture mode; on exit, share the captured inputs' buffers with peers.

        Every rank must enter and leave it together (the exit is collective) and
        capture the same sequence of all-reduce calls.
        """
        if self._capturing:
            raise GroupcoordValueError("custom all-reduce is already in capture mode")
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
            if not self.disabled and self._auto_register:
                self.register_graph_buffers()

    def register_graph_buffers(self) -> None:
        """Collective: fill the RankData slots of calls captured since the last time.

        A rank that cannot export its buffers (e.g. torch's expandable segments,
        which CUDA IPC cannot share) makes every rank raise the same error, so
        no rank replays a graph whose slots were never filled.
        """
        new = self._graph_inputs[self._registered :]
        entries: list[tuple[bytes, int]] = []
        local = self._local_step("exporting captured buffers", self._export, new, entries)
        gathered = all_gather_bytes(self.group, msgspec.msgpack.encode((local, entries)))
        per_rank = [
            msgspec.msgpack.decode(g, type=tuple[str, list[tuple[bytes, int]]]) for g in gathered
        ]
        for r, (reason, _entries) in enumerate(per_rank):
            if reason:
                raise BackendUnavailableError(
                    "custom all-reduce", f"rank {r}: {reason}; do not replay the captured graphs"
                )
        counts = [len(e) for _reason, e in per_rank]
        if len(set(counts)) != 1:
            raise ProtocolError(
                f"ranks captured different numbers of custom all-reduce calls: {counts}"
            )
        rows = []
        for i, own_ptr in enumerate(new):
            row = []
            for r in range(self.world_size):
                if r == self.rank:
                    row.append(own_ptr)
                else:
                    handle, offset = per_rank[r][1][i]
                    row.append(self._open(handle) + offset)
            rows.append(row)
        if rows:
            self._write_rank_data(1 + self._registered, rows)
        self._registered += len(new)
        logger.info("custom all-reduce: registered %d captured buffers", len(new))

    @staticmethod
    def _export(pointers: list[int], entries: list[tuple[bytes, int]]) -> None:
        """(IPC handle of the allocation, offset in it) for each captured input."""
        handles: dict[int, bytes] = {}
        for ptr in pointers:
            base, _size = cuda_ipc.allocation_base(ptr)
            if base not in handles:
                handles[base] = cuda_ipc.ipc_handle(base)
            entries.append((handles[base], ptr - base))
