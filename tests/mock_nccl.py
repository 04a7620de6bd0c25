"""A stand-in ``libnccl`` for CI: every function of nccl.h as a ctypes callback.

``MockNccl().library()`` returns a real :class:`NcclLibrary` bound to Python
callbacks instead of the shared object, so ``PyNcclCommunicator`` runs its
own marshalling code unchanged. The callbacks' C prototypes below are written
from nccl.h, independently of ``pynccl_wrapper.NCCL_FUNCTIONS``: an argument
type that is wrong in our table (a 32-bit count, a missing stream) arrives
here garbled or shifted and the tests see it.

Each call is recorded as a :class:`Call` with the argument names of nccl.h.
For a one-rank communicator the mock also moves the data the way NCCL does at
world 1 (a collective copies ``count`` elements of the dtype's size from the
send to the receive buffer; a grouped send/recv to self copies at
``ncclGroupEnd``), so wrong counts, pointers or dtype enums change results.
``fail_next(name, code, message)`` makes the next call of ``name`` fail with
``code`` and sets the text ``ncclGetLastError`` returns.
"""

from __future__ import annotations

import ctypes
import dataclasses
import types
from typing import Any

from device_communicators.pynccl_wrapper import NcclLibrary

# nccl.h's enums, restated on purpose (not imported): the tests compare ours to these.
NCCL_H_DATA_TYPES = {
    "ncclInt8": 0,
    "ncclUint8": 1,
    "ncclInt32": 2,
    "ncclUint32": 3,
    "ncclInt64": 4,
    "ncclUint64": 5,
    "ncclFloat16": 6,
    "ncclFloat32": 7,
    "ncclFloat64": 8,
    "ncclBfloat16": 9,
    "ncclFloat8e4m3": 10,
    "ncclFloat8e5m2": 11,
}
ELEMENT_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}
NCCL_H_RED_OPS = {"ncclSum": 0, "ncclProd": 1, "ncclMax": 2, "ncclMin": 3, "ncclAvg": 4}
RESULT_TEXT = {0: b"no error", 4: b"invalid argument", 5: b"invalid usage"}

_int, _size, _ptr = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


# name -> (return type, [(argument name, C type)]), as declared in nccl.h.
# const char* results are declared as void* here: the mock hands out the
# address of a buffer it keeps alive, and the caller reads it as a string.
PROTOTYPES: dict[str, tuple[Any, list[tuple[str, Any]]]] = {
    "ncclGetVersion": (_int, [("version", ctypes.POINTER(_int))]),
    "ncclGetErrorString": (_ptr, [("result", _int)]),
    "ncclGetLastError": (_ptr, [("comm", _ptr)]),
    "ncclGetUniqueId": (_int, [("uniqueId", ctypes.POINTER(_UniqueId))]),
    "ncclCommInitRank": (
        _int,
        [("comm", ctypes.POINTER(_ptr)), ("nranks", _int), ("commId", _UniqueId), ("rank", _int)],
    ),
    "ncclCommDestroy": (_int, [("comm", _ptr)]),
    "ncclCommAbort": (_int, [("comm", _ptr)]),
    "ncclAllReduce": (
        _int,
        [
            ("sendbuff", _ptr),
            ("recvbuff", _ptr),
            ("count", _size),
            ("datatype", _int),
            ("op", _int),
            ("comm", _ptr),
            ("stream", _ptr),
        ],
    ),
    "ncclReduce": (
        _int,
        [
            ("sendbuff", _ptr),
            ("recvbuff", _ptr),
            ("count", _size),
            ("datatype", _int),
            ("op", _int),
            ("root", _int),
            ("comm", _ptr),
            ("stream", _ptr),
        ],
    ),
    "ncclAllGather": (
        _int,
        [
            ("sendbuff", _ptr),
            ("recvbuff", _ptr),
            ("sendcount", _size),
            ("datatype", _int),
            ("comm", _ptr),
            ("stream", _ptr),
        ],
    ),
    "ncclReduceScatter": (
        _int,
        [
            ("sendbuff", _ptr),
            ("recvbuff", _ptr),
            ("recvcount", _size),
            ("datatype", _int),
            ("op", _int),
            ("comm", _ptr),
            ("stream", _ptr),
        ],
    ),
    "ncclBroadcast": (
        _int,
        [
            ("sendbuff", _ptr),
            ("recvbuff", _ptr),
            ("count", _size),
            ("datatype", _int),
            ("root", _int),
            ("comm", _ptr),
            ("stream", _ptr),
        ],
    ),
    "ncclSend": (
        _int,
        [
            ("sendbuff", _ptr),
            ("count", _size),
            ("datatype", _int),
            ("peer", _int),
            ("comm", _ptr),
            ("stream", _ptr),
        ],
    ),
    "ncclRecv": (
        _int,
        [
            ("recvbuff", _ptr),
            ("count", _size),
            ("datatype", _int),
            ("peer", _int),
            ("comm", _ptr),
            ("stream", _ptr),
        ],
    ),
    "ncclGroupStart": (_int, []),
    "ncclGroupEnd": (_int, []),
}

# Where each collective reads its element count, and whether it copies at world 1.
_COUNT_ARG = {
    "ncclAllReduce": "count",
    "ncclReduce": "count",
    "ncclAllGather": "sendcount",
    "ncclReduceScatter": "recvcount",
    "ncclBroadcast": "count",
}


@dataclasses.dataclass
class Call:
    name: str
    args: dict[str, Any]
    group_depth: int  # ncclGroupStart nesting when the call was made


class MockNccl:
    """Records every call; moves data for one-rank communicators (see module docs)."""

    def __init__(self, version_code: int = 22809) -> None:
        self.version_code = version_code
        self.calls: list[Call] = []
        self.group_depth = 0
        self.nranks: dict[int, int] = {}  # comm handle -> nranks
        self._next_comm = 0x1000
        self._failures: dict[str, tuple[int, bytes]] = {}
        self._last_error = b""
        self._strings: list[ctypes.Array[ctypes.c_char]] = []  # results handed out stay alive
        self._pending: list[Call] = []  # grouped sends/recvs, matched at ncclGroupEnd
        self._callbacks = {name: self._bind(name, *proto) for name, proto in PROTOTYPES.items()}

    def library(self, path: str = "mock-libnccl.so") -> NcclLibrary:
        return NcclLibrary(path, types.SimpleNamespace(**self._callbacks))

    def fail_next(self, name: str, code: int, message: str) -> None:
        self._failures[name] = (code, message.encode())

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    # -- plumbing -------------------------------------------------------------------
    def _bind(self, name: str, restype: Any, params: list[tuple[str, Any]]) -> Any:
        prototype = ctypes.CFUNCTYPE(restype, *(ctype for _, ctype in params))
        handler = getattr(self, "_" + name, None)

        def callback(*values: Any) -> Any:
            args = dict(zip((p for p, _ in params), values))
            call = Call(name, args, self.group_depth)
            if name not in ("ncclGetErrorString", "ncclGetLastError", "ncclGetVersion"):
                self.calls.append(call)
            if name in self._failures:
                code, self._last_error = self._failures.pop(name)
                return code
            if handler is not None:
                return handler(call)
            return self._collective(call)

        return prototype(callback)

    def _string(self, text: bytes) -> int:
        buf = ctypes.create_string_buffer(text)
        self._strings.append(buf)
        return ctypes.addressof(buf)

    def _copy(self, dst: int | None, src: int | None, count: int, datatype: int) -> None:
        if dst and src and dst != src:
            ctypes.memmove(dst, src, count * ELEMENT_BYTES[datatype])

    # -- nccl.h ---------------------------------------------------------------------
    def _ncclGetVersion(self, call: Call) -> int:
        call.args["version"][0] = self.version_code
        return 0

    def _ncclGetErrorString(self, call: Call) -> int:
        return self._string(RESULT_TEXT.get(call.args["result"], b"unknown result code"))

    def _ncclGetLastError(self, call: Call) -> int:
        return self._string(self._last_error)

    def _ncclGetUniqueId(self, call: Call) -> int:
        ctypes.memmove(call.args["uniqueId"], b"mock-id".ljust(128, b"\0"), 128)
        return 0

    def _ncclCommInitRank(self, call: Call) -> int:
        call.args["commId"] = bytes(call.args["commId"].internal)
        self._next_comm += 0x10
        call.args["comm"][0] = self._next_comm
        self.nranks[self._next_comm] = call.args["nranks"]
        return 0

    def _ncclCommDestroy(self, call: Call) -> int:
        return 0 if self.nranks.pop(call.args["comm"], None) is not None else 4

    _ncclCommAbort = _ncclCommDestroy

    def _ncclGroupStart(self, call: Call) -> int:
        self.group_depth += 1
        return 0

    def _ncclGroupEnd(self, call: Call) -> int:
        if self.group_depth == 0:
            self._last_error = b"ncclGroupEnd without ncclGroupStart"
            return 5
        self.group_depth -= 1
        if self.group_depth == 0:
            sends = [c for c in self._pending if c.name == "ncclSend"]
            recvs = [c for c in self._pending if c.name == "ncclRecv"]
            for send, recv in zip(sends, recvs):
                self._copy(
                    recv.args["recvbuff"],
                    send.args["sendbuff"],
                    send.args["count"],
                    send.args["datatype"],
                )
            self._pending.clear()
        return 0

    def _point_to_point(self, call: Call) -> int:
        if self.nranks.get(call.args["comm"]) == 1:
            if self.group_depth == 0:  # a lone send to oneself would never complete
                self._last_error = b"send/recv to self outside a group"
                return 5
            self._pending.append(call)
        return 0

    _ncclSend = _point_to_point
    _ncclRecv = _point_to_point

    def _collective(self, call: Call) -> int:
        args = call.args
        if args["datatype"] not in ELEMENT_BYTES:
            self._last_error = b"bad datatype"
            return 4
        if self.nranks.get(args["comm"]) == 1:
            count = args[_COUNT_ARG[call.name]]
            self._copy(args["recvbuff"], args["sendbuff"], count, args["datatype"])
        return 0
