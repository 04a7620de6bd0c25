"""Set-up and teardown of the custom all-reduce (:class:`CustomAllreduceBase`).

Every rank allocates a signal buffer (barrier flags + two-shot scratch) and a
staging buffer, shares them with its peers through CUDA IPC handles exchanged
over the CPU group, loads the kernels of ``custom_all_reduce.cu`` (compiled at
run time by NVRTC) and proves peer access by reading each peer's token through
its mapping. Set-up is collective: every rank reaches each decision point, and
ranks agree on one reason before any rank disables, so no rank waits on a peer
that gave up. The calls themselves are in :mod:`.custom_all_reduce`.
"""

from __future__ import annotations

import logging
import socket
import struct
from typing import Any

import msgspec
import torch

from shm_broadcast.config import get_config
from shm_broadcast.group_io import all_gather_bytes, group_rank_and_size
from shm_broadcast.topology import in_the_same_node_as

from . import cuda_ipc
from .all_reduce_backends import AllReduceBackend
from .custom_ar_policy import (
    ALGO_SETTINGS,
    PACK_BYTES,
    GroupTopology,
    RankPlacement,
    check_enablement,
    check_settings,
)
from .errors import (
    GroupcoordError,
    GroupcoordValueError,
    NotSupportedError,
    ProtocolError,
)
from .nvrtc_compile import DTYPE_SUFFIXES, compile_custom_all_reduce, kernel_name

__all__ = ["CustomAllreduceBase"]

logger = logging.getLogger("groupcoord.device_communicators")

SIGNAL_RESERVED_BYTES = 4096  # static_assert(sizeof(Signal) <= 4096) in the .cu file
RANK_DATA_BYTES = 64  # struct RankData: 8 device pointers
RANK_DATA_SLOTS = 8 * 1024 * 1024 // RANK_DATA_BYTES  # slot 0 eager, the rest graphs
MAX_RANKS = 8
_PROBE_MAGIC = 0x6763617270726F62  # "gcarprob"


class CustomAllreduceBase(AllReduceBackend):
    """Buffers, kernels and peer mappings of a custom all-reduce; its set-up and teardown."""

    name = "custom_all_reduce"

    def __init__(
        self,
        group: Any,
        device: int | str | torch.device,
        max_size: int = 8192 * 1024,
        max_all_gather_size: int | None = None,
        max_mnnvl_all_gather_size: int | None = None,
        max_reduce_scatter_size: int | None = None,
        max_mnnvl_reduce_scatter_size: int | None = None,
        max_mnnvl_multimem_reduce_scatter_size: int | None = None,
        symm_mem_enabled: bool = False,
        *,
        register_graph_buffers: bool = True,
    ):
        """vLLM's constructor. Our kernels do all-reduce only: the all-gather and
        reduce-scatter size limits are accepted (vLLM's positions) and those
        collectives go to NCCL (``should_custom_all_gather`` and friends say
        False). ``register_graph_buffers=False`` leaves the collective
        registration after :meth:`capture` to the caller."""
        if symm_mem_enabled:
            raise NotSupportedError.by_groupcoord(
                "CustomAllreduce(symm_mem_enabled=True)", "symmetric-memory all-reduce"
            )
        cfg = get_config()
        self.group = group
        self.rank, self.world_size = group_rank_and_size(group)
        self.device = (
            torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        )
        self.max_size = max_size
        self.size_limits = {
            "max_all_gather_size": max_all_gather_size,
            "max_mnnvl_all_gather_size": max_mnnvl_all_gather_size,
            "max_reduce_scatter_size": max_reduce_scatter_size,
            "max_mnnvl_reduce_scatter_size": max_mnnvl_reduce_scatter_size,
            "max_mnnvl_multimem_reduce_scatter_size": max_mnnvl_multimem_reduce_scatter_size,
        }
        self._auto_register = register_graph_buffers
        if self.max_size <= 0 or self.max_size % PACK_BYTES or self.max_size // PACK_BYTES >= 2**31:
            raise GroupcoordValueError(
                f"max_size: expected a positive multiple of {PACK_BYTES} below 32 GiB, "
                f"got {self.max_size}"
            )
        self.disabled = True
        self.reason = ""
        self.algo_setting = cfg.custom_all_reduce_algo
        self._capturing = False
        self._graph_inputs: list[int] = []
        self._registered = 0
        self._allocations: list[int] = []
        self._opened: dict[bytes, int] = {}
        self._module = 0
        self._functions: dict[tuple[str, str], int] = {}
        self._signals: list[int] = []
        self._staging: list[int] = []
        self._rank_data = 0
        self._bus_id = ""
        self._own_handles = b""
        if self.algo_setting not in ALGO_SETTINGS:
            raise GroupcoordValueError(
                f"custom_all_reduce_algo: expected one of {ALGO_SETTINGS}, got {self.algo_setting!r}"
            )
        self.reason = self._set_up(cfg.disable_custom_all_reduce)
        if self.reason:
            self._release()
            logger.info("custom all-reduce disabled on rank %d: %s", self.rank, self.reason)
        else:
            self.disabled = False
            logger.info("custom all-reduce ready: world %d on %s", self.world_size, self.device)

    # ---- set-up -------------------------------------------------------------------
    def _set_up(self, disabled_by_user: bool) -> str:
        # Settings and world size are the same on every rank: no collective needed.
        settings = check_settings(self.world_size, disabled_by_user=disabled_by_user)
        if not settings:
            return settings.reason
        # From here each local step is followed by one agreement (an all-gather
        # that every rank reaches whatever happened locally), so the ranks'
        # collectives stay paired even when a step fails on some ranks only.
        refusal = self._agree(self._prepare_device())
        if refusal:
            return refusal
        decision = check_enablement(self._gather_topology(), disabled_by_user=False)
        if not decision:
            return decision.reason
        refusal = self._agree(self._local_step("allocating buffers", self._allocate))
        if refusal:
            return refusal
        handles = all_gather_bytes(self.group, self._own_handles)
        refusal = self._agree(self._local_step("opening peer buffers", self._open_peers, handles))
        if refusal:
            return refusal
        refusal = self._agree(self._local_step("writing the probe token", self._write_token))
        if refusal:
            return refusal
        return self._agree(self._local_step("peer-access probe", self._read_tokens))

    def _local_step(self, what: str, step: Any, *args: Any) -> str:
        """Run a local set-up step; its failure becomes this rank's refusal reason."""
        expected: tuple[type[BaseException], ...] = (
            GroupcoordError,
            OSError,
            *cuda_ipc.cuda_errors(),
        )
        try:
            step(*args)
        except expected as exc:
            return f"{what} failed: {exc}"
        return ""

    def _agree(self, local: str) -> str:
        """One all-gather: empty when every rank is fine, else the first reason (with its rank)."""
        reasons = [r.decode() for r in all_gather_bytes(self.group, local.encode())]
        for r, reason in enumerate(reasons):
            if reason:
                return local or f"rank {r}: {reason}"
        return ""

    def _prepare_device(self) -> str:
        reason = cuda_ipc.cuda_unavailable_reason()
        if reason:
            return reason
        return self._local_step("loading the kernels", self._load_kernels)

    def _load_kernels(self) -> None:
        from cupy_backends.cuda.api import driver

        index = self.device.index if self.device.index is not None else 0
        torch.cuda.set_device(index)
        cuda_ipc.set_device(index)
        self._bus_id = cuda_ipc.pci_bus_id(index)
        major, minor = torch.cuda.get_device_capability(index)
        compiled = compile_custom_all_reduce(f"sm_{major}{minor}")
        self._module = int(driver.moduleLoadData(compiled.cubin))
        for algo in ("oneshot", "twoshot"):
            for dtype in DTYPE_SUFFIXES:
                name = kernel_name(algo, dtype, self.world_size)
                self._functions[(algo, dtype)] = int(driver.moduleGetFunction(self._module, name))

    def _gather_topology(self) -> GroupTopology:
        same_node = in_the_same_node_as(self.group, source_rank=0)
        bus = self._bus_id
        buses = [b.decode() for b in all_gather_bytes(self.group, bus.encode())]
        ranks = tuple(
            RankPlacement("node of rank 0" if same else f"another node (rank {r})", buses[r])
            for r, same in enumerate(same_node)
        )
        # Each rank judges the links from its GPU; the group needs all of them.
        nvlink = all(cuda_ipc.nvml_p2p_ok(bus, other, "nvlink") for other in buses)
        # Without NVML, peer access is left to the real IPC read probe below.
        peer = all(cuda_ipc.nvml_p2p_ok(bus, other, "read") in (True, None) for other in buses)
        mine = msgspec.msgpack.encode((nvlink, peer))
        facts = [msgspec.msgpack.decode(f) for f in all_gather_bytes(self.group, mine)]
        logger.debug("custom all-reduce topology on %s: %s %s", socket.gethostname(), ranks, facts)
        return GroupTopology(
            ranks,
            nvlink_connected=all(f[0] for f in facts),
            peer_access=all(f[1] for f in facts),
        )

    def _allocate(self) -> None:
        signal = cuda_ipc.malloc_zeroed(SIGNAL_RESERVED_BYTES + self.max_size)
        self._allocations.append(signal)
        staging = cuda_ipc.malloc_zeroed(self.max_size)
        self._allocations.append(staging)
        self._rank_data = cuda_ipc.malloc_zeroed(RANK_DATA_SLOTS * RANK_DATA_BYTES)
        self._allocations.append(self._rank_data)
        self._own_handles = cuda_ipc.ipc_handle(signal) + cuda_ipc.ipc_handle(staging)

    def _open_peers(self, handles: list[bytes]) -> None:
        size = cuda_ipc.IPC_HANDLE_BYTES
        signal, staging = self._allocations[0], self._allocations[1]
        for r, pair in enumerate(handles):
            if r == self.rank:
                self._signals.append(signal)
                self._staging.append(staging)
            else:
                self._signals.append(self._open(pair[:size]))
                self._staging.append(self._open(pair[size:]))
        self._write_rank_data(0, [self._staging])

    def _write_token(self) -> None:
        cuda_ipc.memcpy_h2d(self._staging[self.rank], struct.pack("<QQ", _PROBE_MAGIC, self.rank))
        torch.cuda.synchronize(self.device)

    def _read_tokens(self) -> None:
        """The real peer-access probe: read each peer's token through its IPC mapping."""
        for r, ptr in enumerate(self._staging):
            got = struct.unpack("<QQ", cuda_ipc.memcpy_d2h(ptr, 16))
            if got != (_PROBE_MAGIC, r):
                raise ProtocolError(f"read {got} from rank {r}'s buffer over IPC, not its token")

    def _open(self, handle: bytes) -> int:
        # Opening one allocation twice in a process fails: keep one mapping per handle.
        if handle not in self._opened:
            self._opened[handle] = cuda_ipc.open_ipc_handle(handle)
        return self._opened[handle]

    def _write_rank_data(self, first_slot: int, rows: list[list[int]]) -> None:
        blob = b"".join(
            struct.pack(f"<{MAX_RANKS}Q", *row, *([0] * (MAX_RANKS - len(row)))) for row in rows
        )
        cuda_ipc.memcpy_h2d(self._rank_data + first_slot * RANK_DATA_BYTES, blob)

    # ---- teardown -----------------------------------------------------------------
    def close(self) -> None:
        if not self.disabled:
            torch.cuda.synchronize(self.device)
        self._release()
        self.disabled = True
        self.reason = self.reason or "closed"

    def _release(self) -> None:
        for ptr in self._opened.values():
            cuda_ipc.close_ipc_handle(ptr)
        self._opened.clear()
        for ptr in self._allocations:
            cuda_ipc.free(ptr)
        self._allocations.clear()
        if self._module:
            from cupy_backends.cuda.api import driver

            driver.moduleUnload(self._module)
            self._module = 0
        self._functions.clear()
        self._signals, self._staging = [], []
