"""What the CUDA path finds on this machine, as (what, value) rows for ``groupcoord info``.

Read-only and safe without a GPU: every probe that fails becomes the row's
value (the library's or runtime's own words), nothing raises. It does not
create an NCCL unique id (that starts NCCL's bootstrap thread).
"""

from __future__ import annotations

import shutil

from shm_broadcast.config import get_config

from . import cuda_ipc
from .custom_ar_policy import GroupTopology, RankPlacement, check_enablement, check_settings
from .errors import BackendUnavailableError
from .nvrtc_compile import cuda_include_dirs, nvrtc_version
from .pynccl_wrapper import find_nccl_library, load_nccl_library

__all__ = ["describe"]


def _gpu_rows() -> tuple[list[tuple[str, str]], list[str]]:
    reason = cuda_ipc.cuda_unavailable_reason()
    if reason:
        return [("CUDA devices", f"0 ({reason})")], []
    count = cuda_ipc.device_count()
    buses = [cuda_ipc.pci_bus_id(i) for i in range(count)]
    return [("CUDA devices", f"{count} ({', '.join(buses)})")], buses


def _nccl_rows(buses: list[str]) -> list[tuple[str, str]]:
    try:
        nccl = load_nccl_library()
    except BackendUnavailableError as exc:
        return [("NCCL library", f"not loaded from {find_nccl_library()}: {exc.reason}")]
    if get_config().disable_pynccl:
        pynccl = "no: disabled by GROUPCOORD_DISABLE_PYNCCL"
    elif not buses:
        pynccl = "no: no CUDA device"
    else:
        pynccl = "yes, for groups of more than one rank"
    return [
        ("NCCL library", nccl.path),
        ("NCCL version", nccl.version),
        ("pynccl", pynccl),
    ]


def _nvrtc_rows() -> list[tuple[str, str]]:
    try:
        major, minor = nvrtc_version()
        version = f"{major}.{minor}"
    except BackendUnavailableError as exc:
        version = f"unavailable: {exc.reason}"
    try:
        headers = ", ".join(cuda_include_dirs())
    except BackendUnavailableError as exc:
        headers = f"unavailable: {exc.reason}"
    return [
        ("NVRTC version", version),
        ("CUDA headers", headers),
        ("nvcc", shutil.which("nvcc") or "not found (not needed: kernels compile with NVRTC)"),
        ("kernel cache", get_config().kernel_cache_dir),
    ]


def _custom_ar_row(buses: list[str]) -> tuple[str, str]:
    """Would custom all-reduce be enabled for a group of all local GPUs, and if not why."""
    cfg = get_config()
    what = "custom all-reduce"
    if not buses:
        return what, "no: no CUDA device"
    settings = check_settings(len(buses), disabled_by_user=cfg.disable_custom_all_reduce)
    if not settings:
        return what, f"no: {settings.reason}"
    nvlink = all(cuda_ipc.nvml_p2p_ok(a, b, "nvlink") for a in buses for b in buses)
    peer = all(cuda_ipc.nvml_p2p_ok(a, b, "read") in (True, None) for a in buses for b in buses)
    topology = GroupTopology(tuple(RankPlacement("local", b) for b in buses), nvlink, peer)
    decision = check_enablement(topology, disabled_by_user=False)
    group = f"for a group of all {len(buses)} local GPUs"
    if not decision:
        return what, f"no {group}: {decision.reason}"
    return (
        what,
        f"yes {group} (pending the IPC probe at start-up), algo {cfg.custom_all_reduce_algo}",
    )


def describe() -> list[tuple[str, str]]:
    """(what, value) rows: GPUs, NCCL, NVRTC, whether custom all-reduce would run."""
    gpu_rows, buses = _gpu_rows()
    return [
        *gpu_rows,
        *_nccl_rows(buses),
        *_nvrtc_rows(),
        _custom_ar_row(buses),
    ]
