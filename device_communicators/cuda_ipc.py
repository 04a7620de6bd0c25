"""Thin CUDA helpers for custom all-reduce: raw buffers, IPC handles, peer facts.

Runtime calls go through CuPy's low-level runtime binding
(``cupy_backends.cuda.api.runtime``), which works beside torch's own CUDA
runtime because both use the device's primary context. Two things CuPy does
not expose come from ctypes: the base of the allocation holding a pointer
(``cuMemGetAddressRange``, libcuda) and NVLink / peer-to-peer status between
two GPUs by PCI bus id (NVML). Everything here needs a GPU and a driver;
``cuda_unavailable_reason`` says why not when there is none.
"""

from __future__ import annotations

import ctypes
import functools
from types import ModuleType

from .errors import BackendUnavailableError

__all__ = [
    "IPC_HANDLE_BYTES",
    "allocation_base",
    "close_ipc_handle",
    "cuda_errors",
    "cuda_unavailable_reason",
    "device_count",
    "free",
    "ipc_handle",
    "malloc_zeroed",
    "memcpy_d2d_async",
    "memcpy_d2h",
    "memcpy_h2d",
    "nvml_p2p_ok",
    "open_ipc_handle",
    "pci_bus_id",
    "set_device",
]

IPC_HANDLE_BYTES = 64


def _runtime() -> ModuleType:
    try:
        from cupy_backends.cuda.api import runtime
    except ImportError as exc:
        raise BackendUnavailableError(
            "custom all-reduce",
            f"CuPy is not installed ({exc}); pip install cupy-cuda12x (or cupy-cuda13x)",
        ) from exc
    return runtime


def cuda_unavailable_reason() -> str:
    """Empty when a CUDA device can be used here; otherwise the runtime's own words."""
    try:
        runtime = _runtime()
    except BackendUnavailableError as exc:
        return exc.reason
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as exc:
        return f"CUDA runtime: {exc}"
    return "" if count > 0 else "no CUDA device"


def cuda_errors() -> tuple[type[BaseException], ...]:
    """The exception types CuPy's runtime and driver bindings raise."""
    from cupy_backends.cuda.api import driver, runtime

    return (runtime.CUDARuntimeError, driver.CUDADriverError)


def device_count() -> int:
    return 0 if cuda_unavailable_reason() else int(_runtime().getDeviceCount())


def set_device(device_index: int) -> None:
    """Make ``device_index`` current for CuPy's runtime too (torch has its own)."""
    _runtime().setDevice(device_index)


def pci_bus_id(device_index: int) -> str:
    return str(_runtime().deviceGetPCIBusId(device_index))


def malloc_zeroed(nbytes: int) -> int:
    """A raw ``cudaMalloc`` buffer (its own allocation: IPC-shareable at offset 0), zeroed."""
    runtime = _runtime()
    ptr = int(runtime.malloc(nbytes))
    runtime.memset(ptr, 0, nbytes)
    return ptr


def free(ptr: int) -> None:
    _runtime().free(ptr)


def ipc_handle(base_ptr: int) -> bytes:
    """The 64-byte IPC handle of the allocation starting at ``base_ptr``."""
    handle = bytes(_runtime().ipcGetMemHandle(base_ptr))
    assert len(handle) == IPC_HANDLE_BYTES
    return handle


def open_ipc_handle(handle: bytes) -> int:
    runtime = _runtime()
    return int(runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess))


def close_ipc_handle(ptr: int) -> None:
    _runtime().ipcCloseMemHandle(ptr)


def memcpy_h2d(dst: int, data: bytes) -> None:
    runtime = _runtime()
    src = ctypes.create_string_buffer(data, len(data))
    runtime.memcpy(dst, ctypes.addressof(src), len(data), runtime.memcpyDefault)


def memcpy_d2h(src: int, nbytes: int) -> bytes:
    runtime = _runtime()
    dst = ctypes.create_string_buffer(nbytes)
    # memcpyDefault: with unified addressing the driver resolves a peer's
    # IPC-mapped pointer itself.
    runtime.memcpy(ctypes.addressof(dst), src, nbytes, runtime.memcpyDefault)
    return dst.raw


def memcpy_d2d_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    runtime = _runtime()
    runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToDevice, stream)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    return lib


def allocation_base(ptr: int) -> tuple[int, int]:
    """(base, size) of the ``cudaMalloc`` allocation containing ``ptr``.

    torch's caching allocator hands out pieces of larger allocations; an IPC
    handle always names a whole allocation, so peers need base + offset.
    """
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if status != 0:
        raise BackendUnavailableError(
            "custom all-reduce", f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {status}"
        )
    return base.value, size.value


# NVML, by PCI bus id so it does not depend on CUDA_VISIBLE_DEVICES ordering.
_NVML_P2P_CAPS_INDEX = {"read": 0, "nvlink": 2}
_NVML_P2P_STATUS_OK = 0


@functools.cache
def _nvml() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    lib.nvmlDeviceGetHandleByPciBusId_v2.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    lib.nvmlDeviceGetP2PStatus.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
    ]
    return lib


def nvml_p2p_ok(bus_a: str, bus_b: str, capability: str) -> bool | None:
    """NVML's P2P status ("read" or "nvlink") between two GPUs; None without NVML."""
    if bus_a == bus_b:
        return True
    lib = _nvml()
    if lib is None:
        return None
    handles = []
    for bus in (bus_a, bus_b):
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)) != 0:
            return None
        handles.append(handle)
    status = ctypes.c_int(-1)
    index = _NVML_P2P_CAPS_INDEX[capability]
    if lib.nvmlDeviceGetP2PStatus(handles[0], handles[1], index, ctypes.byref(status)) != 0:
        return None
    return status.value == _NVML_P2P_STATUS_OK
