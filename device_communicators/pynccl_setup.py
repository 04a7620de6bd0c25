"""The life of a ``PyNcclCommunicator``: set-up, argument checks, sleep mode, teardown.

``PyNcclBase`` bootstraps NCCL over a CPU group (rank 0 makes the unique id,
which travels as 128 raw bytes, no pickle), agrees with every rank on one
refusal when it cannot work, checks the arguments of every call, and frees
and re-creates the NCCL communicator for sleep mode; the collectives are in
``pynccl.py``. Also here: the torch dtype and reduce-op tables NCCL's enums
come from.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Self

import torch
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
)
from .nccl_abi import NcclDataType, NcclRedOp
from .pynccl_wrapper import NcclError, NcclLibrary, load_nccl_library

__all__ = ["PyNcclBase", "nccl_data_type", "nccl_red_op"]

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


class PyNcclBase:
    """Set-up, checks, sleep mode and teardown of :class:`~device_communicators.pynccl.PyNcclCommunicator`."""

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
    ) -> Self:
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
        """The first collective, at construction (``PyNcclCommunicator`` runs one)."""
        raise NotImplementedError

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
