"""NCCL through ctypes: one table of C functions, one ``check``, library discovery.

The table (``nccl_abi.NCCL_FUNCTIONS``) is the only place that knows NCCL's C
signatures; :class:`NcclLibrary` loads ``libnccl.so.2`` once per path, binds
the table and offers thin methods that take plain integers (device pointers,
counts, enum values, stream handles). Nothing here imports torch, so the
library, its version, error strings and unique ids can be inspected on a
machine without a GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from typing import Any

from shm_broadcast.config import get_config

from .errors import BackendUnavailableError, GroupcoordError, GroupcoordValueError
from .nccl_abi import (
    NCCL_FUNCTIONS,
    NCCL_RESULT_NAMES,
    NCCL_UNIQUE_ID_BYTES,
    NcclDataType,
    NcclFunction,
    NcclRedOp,
    ncclComm_t,
    ncclUniqueId,
    ncclWindow_t,
)

__all__ = [
    "NCCLLibrary",
    "NCCL_FUNCTIONS",
    "NCCL_RESULT_NAMES",
    "NCCL_UNIQUE_ID_BYTES",
    "NcclDataType",
    "NcclError",
    "NcclFunction",
    "NcclLibrary",
    "NcclRedOp",
    "find_nccl_library",
    "load_nccl_library",
    "parse_nccl_version",
]

_WHEEL_RELATIVE_PATH = os.path.join("lib", "libnccl.so.2")
_LOADER_NAME = "libnccl.so.2"


class NcclError(GroupcoordError, RuntimeError):
    """A non-zero ``ncclResult_t``, with NCCL's own error string and last error."""

    def __init__(self, function: str, code: int, error_string: str, last_error: str) -> None:
        self.function = function
        self.code = code
        self.result_name = NCCL_RESULT_NAMES.get(code, f"ncclResult({code})")
        self.error_string = error_string
        self.last_error = last_error
        message = f"{function} failed: {self.result_name}: {error_string}"
        if last_error:
            message += f" (last error: {last_error})"
        super().__init__(message)


def parse_nccl_version(code: int) -> str:
    """``ncclGetVersion``'s integer as "major.minor.patch" (both encodings of nccl.h)."""
    if code <= 0:
        raise GroupcoordValueError(f"code: NCCL version code must be positive, got {code}")
    # NCCL_VERSION(X,Y,Z) is X*1000+Y*100+Z up to 2.8 and X*10000+Y*100+Z after.
    if code >= 10000:
        major, rest = divmod(code, 10000)
    else:
        major, rest = divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def _wheel_library_path() -> str | None:
    """``libnccl.so.2`` inside the ``nvidia-nccl-cu12`` or ``nvidia-nccl-cu13`` wheel
    (both install ``nvidia/nccl/lib/libnccl.so.2``), if installed.

    ``nvidia`` is a namespace package spread over several wheels, so the
    ``nccl`` portion is found through its import spec, not ``nvidia.__file__``.
    """
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, _WHEEL_RELATIVE_PATH)
        if os.path.exists(candidate):
            return candidate
    return None


def find_nccl_library() -> str:
    """Where to load NCCL from: the configured path, then the wheel, then the loader.

    The configured path (``GROUPCOORD_NCCL_SO_PATH``) wins even if it is wrong,
    so a mistake there is reported rather than silently replaced.
    """
    configured = get_config().nccl_so_path
    if configured:
        return configured
    return _wheel_library_path() or _LOADER_NAME


class NcclLibrary:
    """A loaded ``libnccl`` with the table bound; use :func:`load_nccl_library`."""

    def __init__(self, path: str, lib: ctypes.CDLL) -> None:
        self.path = path
        self._lib = lib
        self._functions: dict[str, Any] = {}
        missing = []
        for row in NCCL_FUNCTIONS:
            try:
                fn = getattr(lib, row.name)
            except AttributeError:
                if row.required:
                    missing.append(row.name)
                continue
            fn.restype = row.restype
            fn.argtypes = list(row.argtypes)
            self._functions[row.name] = fn
        if missing:
            raise BackendUnavailableError(
                "pynccl", f"{path} lacks required NCCL functions {missing} (too old?)"
            )
        self.version_code = self._get_version_code()
        self.version = parse_nccl_version(self.version_code)

    def has(self, name: str) -> bool:
        """Whether an optional function of the table is present in this library."""
        return name in self._functions

    def _fn(self, name: str) -> Any:
        if name not in self._functions:
            raise BackendUnavailableError(
                "pynccl", f"{self.path} (NCCL {self.version}) lacks {name}"
            )
        return self._functions[name]

    def error_string(self, code: int) -> str:
        raw = self._functions["ncclGetErrorString"](code)
        return raw.decode("utf-8", "replace") if raw else ""

    def last_error(self, comm: int | None = None) -> str:
        raw = self._functions["ncclGetLastError"](comm)
        return raw.decode("utf-8", "replace") if raw else ""

    def check(self, function: str, code: int, comm: int | None = None) -> None:
        """Raise :class:`NcclError` for a non-zero result of ``function``."""
        if code != 0:
            raise NcclError(function, code, self.error_string(code), self.last_error(comm))

    def _call(self, name: str, *args: Any, comm: int | None = None) -> None:
        self.check(name, self._fn(name)(*args), comm)

    def _get_version_code(self) -> int:
        version = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(version))
        return version.value

    # -- bootstrap and communicators -------------------------------------------------
    def get_unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` as its 128 raw bytes (needs no GPU)."""
        uid = ncclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)

    @staticmethod
    def unique_id_from_bytes(data: bytes) -> ncclUniqueId:
        if len(data) != NCCL_UNIQUE_ID_BYTES:
            raise GroupcoordValueError(
                f"data: an ncclUniqueId is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}"
            )
        uid = ncclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), data, NCCL_UNIQUE_ID_BYTES)
        return uid

    def comm_init_rank(self, world_size: int, unique_id: bytes, rank: int) -> int:
        """``ncclCommInitRank`` under the caller's current CUDA device; returns the handle."""
        comm = ncclComm_t()
        self._call(
            "ncclCommInitRank",
            ctypes.byref(comm),
            world_size,
            self.unique_id_from_bytes(unique_id),
            rank,
        )
        if not comm.value:
            raise NcclError("ncclCommInitRank", 3, "returned a null communicator", "")
        return comm.value

    def comm_destroy(self, comm: int) -> None:
        self._call("ncclCommDestroy", comm, comm=comm)

    def comm_abort(self, comm: int) -> None:
        self._call("ncclCommAbort", comm, comm=comm)

    # -- collectives: pointers, counts and stream handles are plain integers ----------
    def all_reduce(
        self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int
    ) -> None:
        self._call("ncclAllReduce", send, recv, count, dtype, op, comm, stream, comm=comm)

    def reduce(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: int,
        op: int,
        root: int,
        comm: int,
        stream: int,
    ) -> None:
        self._call("ncclReduce", send, recv, count, dtype, op, root, comm, stream, comm=comm)

    def all_gather(
        self, send: int, recv: int, send_count: int, dtype: int, comm: int, stream: int
    ) -> None:
        self._call("ncclAllGather", send, recv, send_count, dtype, comm, stream, comm=comm)

    def reduce_scatter(
        self, send: int, recv: int, recv_count: int, dtype: int, op: int, comm: int, stream: int
    ) -> None:
        self._call("ncclReduceScatter", send, recv, recv_count, dtype, op, comm, stream, comm=comm)

    def broadcast(
        self, send: int, recv: int, count: int, dtype: int, root: int, comm: int, stream: int
    ) -> None:
        self._call("ncclBroadcast", send, recv, count, dtype, root, comm, stream, comm=comm)

    def send(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self._call("ncclSend", buf, count, dtype, peer, comm, stream, comm=comm)

    def recv(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self._call("ncclRecv", buf, count, dtype, peer, comm, stream, comm=comm)

    def group_start(self) -> None:
        self._call("ncclGroupStart")

    def group_end(self) -> None:
        self._call("ncclGroupEnd")

    # -- optional symbols -------------------------------------------------------------
    def comm_window_register(self, comm: int, buf: int, nbytes: int, flags: int = 0) -> int:
        window = ncclWindow_t()
        self._call("ncclCommWindowRegister", comm, buf, nbytes, ctypes.byref(window), flags)
        return window.value or 0

    def comm_window_deregister(self, comm: int, window: int) -> None:
        self._call("ncclCommWindowDeregister", comm, window, comm=comm)


def _address(value: Any) -> int:
    """A pointer, handle or stream as an int: vLLM's callers pass ctypes ``c_void_p``."""
    if isinstance(value, ctypes.c_void_p):
        return value.value or 0
    return int(value)


class NCCLLibrary:
    """vLLM's ``NCCLLibrary``: its class name and nccl.h-named methods, taking and
    returning ctypes values as vLLM's do, over the one binding (:class:`NcclLibrary`;
    ``library`` picks a loaded one)."""

    def __init__(self, so_file: str | None = None, *, library: NcclLibrary | None = None):
        self.lib = library if library is not None else load_nccl_library(so_file)

    def ncclGetErrorString(self, result: int) -> str:  # noqa: N802 - nccl.h's names
        return self.lib.error_string(result)

    def NCCL_CHECK(self, result: int) -> None:  # noqa: N802
        self.lib.check("NCCL call", result)

    def ncclGetRawVersion(self) -> int:  # noqa: N802
        return self.lib.version_code

    def ncclGetVersion(self) -> str:  # noqa: N802
        return self.lib.version

    def ncclGetUniqueId(self) -> ncclUniqueId:  # noqa: N802
        return self.lib.unique_id_from_bytes(self.lib.get_unique_id())

    def unique_id_from_bytes(self, data: bytes) -> ncclUniqueId:
        return self.lib.unique_id_from_bytes(data)

    def ncclCommInitRank(self, world_size: int, unique_id: ncclUniqueId, rank: int) -> Any:  # noqa: N802
        raw = ctypes.string_at(ctypes.addressof(unique_id), NCCL_UNIQUE_ID_BYTES)
        return ncclComm_t(self.lib.comm_init_rank(world_size, raw, rank))

    def ncclAllReduce(
        self,
        sendbuff: Any,
        recvbuff: Any,
        count: int,
        datatype: int,
        op: int,
        comm: Any,
        stream: Any,
    ) -> None:  # noqa: N802
        a = _address
        self.lib.all_reduce(a(sendbuff), a(recvbuff), count, datatype, op, a(comm), a(stream))

    def ncclReduce(
        self,
        sendbuff: Any,
        recvbuff: Any,
        count: int,
        datatype: int,
        op: int,
        root: int,
        comm: Any,
        stream: Any,
    ) -> None:  # noqa: N802
        a = _address
        self.lib.reduce(a(sendbuff), a(recvbuff), count, datatype, op, root, a(comm), a(stream))

    def ncclReduceScatter(
        self,
        sendbuff: Any,
        recvbuff: Any,
        count: int,
        datatype: int,
        op: int,
        comm: Any,
        stream: Any,
    ) -> None:  # noqa: N802
        a = _address
        self.lib.reduce_scatter(a(sendbuff), a(recvbuff), count, datatype, op, a(comm), a(stream))

    def ncclAllGather(
        self,
        sendbuff: Any,
        recvbuff: Any,
        count: int,
        datatype: int,
        comm: Any,
        stream: Any,
    ) -> None:  # noqa: N802
        a = _address
        self.lib.all_gather(a(sendbuff), a(recvbuff), count, datatype, a(comm), a(stream))

    def ncclSend(
        self,
        sendbuff: Any,
        count: int,
        datatype: int,
        dest: int,
        comm: Any,
        stream: Any,
    ) -> None:  # noqa: N802
        self.lib.send(_address(sendbuff), count, datatype, dest, _address(comm), _address(stream))

    def ncclRecv(
        self,
        recvbuff: Any,
        count: int,
        datatype: int,
        src: int,
        comm: Any,
        stream: Any,
    ) -> None:  # noqa: N802
        self.lib.recv(_address(recvbuff), count, datatype, src, _address(comm), _address(stream))

    def ncclBroadcast(
        self,
        sendbuff: Any,
        recvbuff: Any,
        count: int,
        datatype: int,
        root: int,
        comm: Any,
        stream: Any,
    ) -> None:  # noqa: N802
        a = _address
        self.lib.broadcast(a(sendbuff), a(recvbuff), count, datatype, root, a(comm), a(stream))

    def ncclCommDestroy(self, comm: Any) -> None:  # noqa: N802
        self.lib.comm_destroy(_address(comm))

    def ncclGroupStart(self) -> None:  # noqa: N802
        self.lib.group_start()

    def ncclGroupEnd(self) -> None:  # noqa: N802
        self.lib.group_end()

    def ncclCommWindowRegister(self, comm: Any, buff: Any, size: int, win_flags: int) -> Any:  # noqa: N802
        return ncclWindow_t(
            self.lib.comm_window_register(_address(comm), _address(buff), size, win_flags)
        )

    def ncclCommWindowDeregister(self, comm: Any, window: Any) -> None:  # noqa: N802
        self.lib.comm_window_deregister(_address(comm), _address(window))


_LIBRARIES: dict[str, NcclLibrary] = {}
_LIBRARIES_LOCK = threading.Lock()


def load_nccl_library(path: str | None = None) -> NcclLibrary:
    """Load (once per path) and bind NCCL; :class:`BackendUnavailableError` says why not."""
    path = path or find_nccl_library()
    with _LIBRARIES_LOCK:
        if path in _LIBRARIES:
            return _LIBRARIES[path]
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            hint = ""
            if path == _LOADER_NAME:
                hint = " (pip install groupcoord[cuda], or groupcoord[cuda13] for CUDA 13)"
            raise BackendUnavailableError("pynccl", f"cannot load {path}: {exc}{hint}") from exc
        library = NcclLibrary(path, lib)
        _LIBRARIES[path] = library
        return library
