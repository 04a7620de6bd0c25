"""What nccl.h says, for ctypes: C types, enums, result names and the function table.

The table (:data:`NCCL_FUNCTIONS`) is the only place that knows NCCL's C
signatures; ``pynccl_wrapper.NcclLibrary`` binds it when it loads the
library. Nothing here loads anything or imports torch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
from typing import Any

__all__ = [
    "NCCL_FUNCTIONS",
    "NCCL_RESULT_NAMES",
    "NCCL_UNIQUE_ID_BYTES",
    "NcclDataType",
    "NcclFunction",
    "NcclRedOp",
    "ncclComm_t",
    "ncclUniqueId",
    "ncclWindow_t",
]

NCCL_UNIQUE_ID_BYTES = 128

# C type aliases, named as in nccl.h so each row of the table reads like the header.
ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
ncclWindow_t = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class NcclDataType(enum.IntEnum):
    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    # Added in NCCL 2.24; older libraries answer ncclInvalidArgument.
    FLOAT8E4M3 = 10
    FLOAT8E5M2 = 11


class NcclRedOp(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


# ncclResult_t values (nccl.h). ncclTimeout (8) is recent; an older library
# answers "unknown result code" for it, which check() still reports.
NCCL_RESULT_NAMES: dict[int, str] = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}


@dataclasses.dataclass(frozen=True)
class NcclFunction:
    """One row of the binding table: a C function and its signature."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]
    required: bool = True


_P = ctypes.POINTER
NCCL_FUNCTIONS: tuple[NcclFunction, ...] = (
    NcclFunction("ncclGetVersion", ncclResult_t, (_P(ctypes.c_int),)),
    NcclFunction("ncclGetErrorString", ctypes.c_char_p, (ncclResult_t,)),
    NcclFunction("ncclGetLastError", ctypes.c_char_p, (ncclComm_t,)),
    NcclFunction("ncclGetUniqueId", ncclResult_t, (_P(ncclUniqueId),)),
    NcclFunction(
        "ncclCommInitRank", ncclResult_t, (_P(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int)
    ),
    NcclFunction("ncclCommDestroy", ncclResult_t, (ncclComm_t,)),
    NcclFunction("ncclCommAbort", ncclResult_t, (ncclComm_t,)),
    NcclFunction(
        "ncclAllReduce",
        ncclResult_t,
        (
            buffer_type,
            buffer_type,
            ctypes.c_size_t,
            ncclDataType_t,
            ncclRedOp_t,
            ncclComm_t,
            cudaStream_t,
        ),
    ),
    NcclFunction(
        "ncclReduce",
        ncclResult_t,
        (
            buffer_type,
            buffer_type,
            ctypes.c_size_t,
            ncclDataType_t,
            ncclRedOp_t,
            ctypes.c_int,
            ncclComm_t,
            cudaStream_t,
        ),
    ),
    NcclFunction(
        "ncclAllGather",
        ncclResult_t,
        (buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclComm_t, cudaStream_t),
    ),
    NcclFunction(
        "ncclReduceScatter",
        ncclResult_t,
        (
            buffer_type,
            buffer_type,
            ctypes.c_size_t,
            ncclDataType_t,
            ncclRedOp_t,
            ncclComm_t,
            cudaStream_t,
        ),
    ),
    NcclFunction(
        "ncclBroadcast",
        ncclResult_t,
        (
            buffer_type,
            buffer_type,
            ctypes.c_size_t,
            ncclDataType_t,
            ctypes.c_int,
            ncclComm_t,
            cudaStream_t,
        ),
    ),
    NcclFunction(
        "ncclSend",
        ncclResult_t,
        (buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t),
    ),
    NcclFunction(
        "ncclRecv",
        ncclResult_t,
        (buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t),
    ),
    NcclFunction("ncclGroupStart", ncclResult_t, ()),
    NcclFunction("ncclGroupEnd", ncclResult_t, ()),
    # Optional: symmetric-memory windows (2.27+) and NCCL's allocator (2.19+).
    NcclFunction(
        "ncclCommWindowRegister",
        ncclResult_t,
        (ncclComm_t, buffer_type, ctypes.c_size_t, _P(ncclWindow_t), ctypes.c_int),
        required=False,
    ),
    NcclFunction(
        "ncclCommWindowDeregister", ncclResult_t, (ncclComm_t, ncclWindow_t), required=False
    ),
    NcclFunction("ncclMemAlloc", ncclResult_t, (_P(buffer_type), ctypes.c_size_t), required=False),
    NcclFunction("ncclMemFree", ncclResult_t, (buffer_type,), required=False),
)
