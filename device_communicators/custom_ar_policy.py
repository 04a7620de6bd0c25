"""When custom all-reduce may run, which tensors it takes, and which kernel it uses.

Pure decisions on plain data (a description of the group's placement, a
description of a tensor), so they are tested without a GPU. The CUDA code in
``custom_all_reduce.py`` gathers the facts; this module judges them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .errors import GroupcoordValueError

__all__ = [
    "ALGO_SETTINGS",
    "MAX_BLOCKS",
    "ONESHOT_MAX_BYTES_UP_TO_4",
    "ONESHOT_MAX_BYTES_UP_TO_8",
    "PACK_BYTES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_WORLD_SIZES",
    "THREADS_PER_BLOCK",
    "Decision",
    "GroupTopology",
    "RankPlacement",
    "TensorDescription",
    "check_enablement",
    "check_settings",
    "choose_algorithm",
    "describe_tensor",
    "launch_config",
    "should_custom_ar",
]

SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
PACK_BYTES = 16  # every kernel thread moves 16-byte packs
ONESHOT_MAX_BYTES_UP_TO_4 = 512 * 1024
ONESHOT_MAX_BYTES_UP_TO_8 = 256 * 1024
# Must match kMaxBlocks / __launch_bounds__ in custom_all_reduce.cu.
MAX_BLOCKS = 36
THREADS_PER_BLOCK = 512
ALGO_SETTINGS = ("auto", "oneshot", "twoshot")


@dataclasses.dataclass(frozen=True)
class Decision:
    """Yes, or no with the reason (for logs and ``python -m coordinator info``)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


_YES = Decision(True)


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """Where one rank of the group runs: its host and its GPU (PCI bus id)."""

    node: str
    device: str


@dataclasses.dataclass(frozen=True)
class GroupTopology:
    """What custom all-reduce needs to know about a group, in rank order.

    ``nvlink_connected``: every pair of distinct GPUs has an NVLink path (NVML).
    ``peer_access``: every rank's GPU can access every other rank's GPU
    (``cudaDeviceCanAccessPeer``); ranks sharing one GPU trivially can.
    """

    ranks: tuple[RankPlacement, ...]
    nvlink_connected: bool
    peer_access: bool

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def check_settings(world_size: int, *, disabled_by_user: bool) -> Decision:
    """The part of :func:`check_enablement` that needs no facts about the GPUs."""
    if disabled_by_user:
        return Decision(False, "disabled by GROUPCOORD_DISABLE_CUSTOM_ALL_REDUCE")
    if world_size == 1:
        return Decision(False, "world size 1: nothing to reduce")
    if world_size not in SUPPORTED_WORLD_SIZES:
        return Decision(False, f"world size {world_size} not in {SUPPORTED_WORLD_SIZES}")
    return _YES


def check_enablement(topology: GroupTopology, *, disabled_by_user: bool) -> Decision:
    """Whether custom all-reduce may be set up for this group, and if not, why."""
    world = topology.world_size
    settings = check_settings(world, disabled_by_user=disabled_by_user)
    if not settings:
        return settings
    nodes = sorted({p.node for p in topology.ranks})
    if len(nodes) > 1:
        return Decision(False, f"ranks span {len(nodes)} nodes ({', '.join(nodes)})")
    # Without NVLink between every pair, reads of every peer's buffer go over
    # PCIe and custom all-reduce loses to NCCL's ring, except for two GPUs.
    if world > 2 and not topology.nvlink_connected:
        return Decision(False, f"world size {world} needs fully connected NVLink; it is not")
    if not topology.peer_access:
        return Decision(False, "GPUs of this group cannot access each other (peer access)")
    return _YES


@dataclasses.dataclass(frozen=True)
class TensorDescription:
    """The facts of a tensor that decide whether custom all-reduce can take it."""

    device_type: str
    dtype: str
    nbytes: int
    weakly_contiguous: bool


def describe_tensor(tensor: Any) -> TensorDescription:
    """Describe a torch tensor (read-only attribute access, no device work).

    Weakly contiguous: the tensor's elements are the dense tail of its storage
    starting at its offset, so one pointer and a byte count describe them.
    """
    element_size = tensor.element_size()
    nbytes = tensor.numel() * element_size
    weak = tensor.is_contiguous() or (
        tensor.untyped_storage().nbytes() - tensor.storage_offset() * element_size == nbytes
        and _is_dense(tensor)
    )
    return TensorDescription(
        device_type=tensor.device.type,
        dtype=str(tensor.dtype).removeprefix("torch."),
        nbytes=nbytes,
        weakly_contiguous=weak,
    )


def _is_dense(tensor: Any) -> bool:
    # A view with a storage tail of the right size but gaps (e.g. a transpose)
    # is not dense; contiguity of the flattened view is what the kernel needs.
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def should_custom_ar(description: TensorDescription, *, max_bytes: int) -> Decision:
    """Whether custom all-reduce takes this tensor; if not, the next back end does."""
    if description.device_type != "cuda":
        return Decision(False, f"tensor on {description.device_type}, not cuda")
    if description.dtype not in SUPPORTED_DTYPES:
        return Decision(False, f"dtype {description.dtype} not in {SUPPORTED_DTYPES}")
    if description.nbytes == 0:
        return Decision(False, "empty tensor")
    if description.nbytes % PACK_BYTES:
        return Decision(False, f"{description.nbytes} bytes is not a multiple of {PACK_BYTES}")
    if not description.weakly_contiguous:
        return Decision(False, "tensor is not weakly contiguous")
    if description.nbytes >= max_bytes:
        return Decision(False, f"{description.nbytes} bytes >= max {max_bytes}")
    return _YES


def choose_algorithm(nbytes: int, world_size: int, setting: str = "auto") -> str:
    """ "oneshot" or "twoshot" for one call; ``setting`` (config) can pin one."""
    if setting not in ALGO_SETTINGS:
        raise GroupcoordValueError(
            f"custom_all_reduce_algo: expected one of {ALGO_SETTINGS}, got {setting!r}"
        )
    if world_size not in SUPPORTED_WORLD_SIZES:
        raise GroupcoordValueError(
            f"world_size: expected one of {SUPPORTED_WORLD_SIZES}, got {world_size}"
        )
    if setting != "auto":
        return setting
    # One-shot moves (world-1) x the data per rank but has a single barrier
    # round; it wins while latency dominates, later for fewer ranks.
    if world_size <= 4 and nbytes < ONESHOT_MAX_BYTES_UP_TO_4:
        return "oneshot"
    if world_size <= 8 and nbytes < ONESHOT_MAX_BYTES_UP_TO_8:
        return "oneshot"
    return "twoshot"


def launch_config(nbytes: int) -> tuple[int, int]:
    """(blocks, threads per block); identical on every rank for the same size,
    which the per-block barrier counters rely on."""
    if nbytes <= 0 or nbytes % PACK_BYTES:
        raise GroupcoordValueError(f"nbytes: expected a positive multiple of 16, got {nbytes}")
    packs = nbytes // PACK_BYTES
    blocks = min(MAX_BLOCKS, (packs + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK)
    return blocks, THREADS_PER_BLOCK
