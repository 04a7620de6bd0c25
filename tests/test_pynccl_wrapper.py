"""The NCCL ctypes binding against the real ``libnccl`` of the nvidia-nccl-cu12 wheel.

Needs no GPU: loading, version, error strings and unique ids work without a
driver. Skips (with the reason) only when the cuda extra is not installed.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from coordinator.launch import init_gloo, run_ranks
from device_communicators.errors import BackendUnavailableError, GroupcoordValueError
from device_communicators.pynccl_wrapper import (
    NCCL_FUNCTIONS,
    NCCL_RESULT_NAMES,
    NCCL_UNIQUE_ID_BYTES,
    NcclError,
    NcclLibrary,
    _wheel_library_path,
    find_nccl_library,
    load_nccl_library,
    parse_nccl_version,
)
from shm_broadcast.config import override

WHEEL_PATH = _wheel_library_path()
CUDA_PRESENT = torch.cuda.device_count() > 0  # NVML-based: no CUDA init in the forking parent
needs_wheel = pytest.mark.skipif(
    WHEEL_PATH is None, reason="nvidia-nccl-cu12 not installed (pip install groupcoord[cuda])"
)


@pytest.fixture()
def nccl() -> NcclLibrary:
    assert WHEEL_PATH is not None
    return load_nccl_library(WHEEL_PATH)


def test_version_codes_parse_in_both_encodings():
    assert parse_nccl_version(23203) == "2.32.3"
    assert parse_nccl_version(21905) == "2.19.5"
    assert parse_nccl_version(2804) == "2.8.4"
    with pytest.raises(GroupcoordValueError, match="code"):
        parse_nccl_version(0)


def test_table_has_one_row_per_function_with_required_ones_first_class():
    names = [row.name for row in NCCL_FUNCTIONS]
    assert len(names) == len(set(names))
    required = {row.name for row in NCCL_FUNCTIONS if row.required}
    for name in (
        "ncclGetUniqueId",
        "ncclCommInitRank",
        "ncclAllReduce",
        "ncclSend",
        "ncclGroupEnd",
    ):
        assert name in required
    optional = {row.name for row in NCCL_FUNCTIONS if not row.required}
    assert optional == {
        "ncclCommWindowRegister",
        "ncclCommWindowDeregister",
        "ncclMemAlloc",
        "ncclMemFree",
    }


@needs_wheel
def test_discovery_prefers_config_then_wheel():
    assert find_nccl_library() == WHEEL_PATH
    with override(nccl_so_path="/nonexistent/libnccl.so.2"):
        assert find_nccl_library() == "/nonexistent/libnccl.so.2"
        with pytest.raises(BackendUnavailableError, match="cannot load /nonexistent/libnccl.so.2"):
            load_nccl_library()


@needs_wheel
def test_wheel_library_loads_and_reports_its_version(nccl: NcclLibrary):
    assert os.path.basename(nccl.path) == "libnccl.so.2"
    assert nccl.version_code >= 21800
    major, minor, patch = (int(x) for x in nccl.version.split("."))
    assert (major, minor) >= (2, 18)
    assert parse_nccl_version(nccl.version_code) == nccl.version
    # Cached per path: the second load is the same object.
    assert load_nccl_library(WHEEL_PATH) is nccl


@needs_wheel
def test_every_result_code_has_its_string(nccl: NcclLibrary):
    strings = {code: nccl.error_string(code) for code in NCCL_RESULT_NAMES}
    assert strings[0] == "no error"
    assert "cuda" in strings[1].lower()
    assert "invalid argument" in strings[4]
    assert "invalid usage" in strings[5]
    # ncclTimeout (8) has a string in NCCL 2.32.3 (the cu12 wheel) but not in
    # 2.28.9 (the cu13 wheel on the project's H100): older ones say "unknown".
    if nccl.version_code < 23200 and strings[8] == "unknown result code":
        del strings[8]
    for code, text in strings.items():
        assert text and text != "unknown result code", NCCL_RESULT_NAMES[code]
    assert len(set(strings.values())) == len(strings)
    assert nccl.error_string(99) == "unknown result code"


@needs_wheel
def test_check_raises_with_nccls_own_string(nccl: NcclLibrary):
    nccl.check("ncclNothing", 0)
    with pytest.raises(NcclError) as info:
        nccl.check("ncclAllReduce", 4)
    err = info.value
    assert err.code == 4 and err.result_name == "ncclInvalidArgument"
    assert "ncclAllReduce failed: ncclInvalidArgument: invalid argument" in str(err)


def _unique_ids(rank: int, world_size: int, path: str) -> tuple[bytes, bytes, str]:
    # ncclGetUniqueId starts NCCL's bootstrap thread: keep it out of the forking
    # pytest process by calling it in a forked rank.
    nccl = load_nccl_library(path)
    first, second = nccl.get_unique_id(), nccl.get_unique_id()
    uid = nccl.unique_id_from_bytes(first)
    round_trip = ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)
    assert round_trip == first
    return first, second, os.environ.get("NCCL_SOCKET_IFNAME", "")


@needs_wheel
def test_unique_id_is_128_bytes_and_fresh(nccl: NcclLibrary):
    ((first, second, ifname),) = run_ranks(_unique_ids, 1, WHEEL_PATH, timeout=60)
    assert ifname == "lo"
    assert isinstance(first, bytes) and len(first) == NCCL_UNIQUE_ID_BYTES
    assert first != second
    with pytest.raises(GroupcoordValueError, match="data"):
        nccl.unique_id_from_bytes(first[:-1])


@needs_wheel
def test_optional_symbols_are_looked_up_not_required(nccl: NcclLibrary):
    # NCCL 2.32 has all of them; the binding must have bound each one it found.
    assert nccl.has("ncclMemAlloc") and nccl.has("ncclCommWindowRegister")
    assert not nccl.has("ncclNoSuchFunction")


# -- PyNcclCommunicator on this machine: no driver, so it must disable cleanly ---------


def _pynccl_without_driver(rank: int, world_size: int, strict: bool) -> tuple[bool, str]:
    import torch.distributed as dist

    from device_communicators.pynccl import PyNcclCommunicator

    init_gloo(rank, world_size)
    try:
        try:
            comm = PyNcclCommunicator(dist.group.WORLD, device=rank, strict=strict)
        except BackendUnavailableError as exc:
            return False, f"raised: {exc}"
        assert comm.disabled and comm.comm is None
        with pytest.raises(BackendUnavailableError, match="ncclCommInitRank"):
            comm.all_reduce(torch.zeros(4))
        return comm.available, comm.reason
    finally:
        dist.destroy_process_group()


@needs_wheel
@pytest.mark.skipif(CUDA_PRESENT, reason="a GPU is present: tests/gpu/ covers PyNccl there")
def test_pynccl_without_driver_disables_with_nccls_message():
    results = run_ranks(_pynccl_without_driver, 2, False, timeout=90)
    for available, reason in results:
        assert not available
        assert "ncclCommInitRank on cuda:" in reason
        assert "ncclUnhandledCudaError" in reason and "unhandled cuda error" in reason
        # NCCL's last error names the CUDA failure (no driver / insufficient driver).
        assert "Cuda failure" in reason or "driver" in reason.lower(), reason


@needs_wheel
@pytest.mark.skipif(CUDA_PRESENT, reason="a GPU is present: tests/gpu/ covers PyNccl there")
def test_pynccl_strict_raises_backend_unavailable():
    results = run_ranks(_pynccl_without_driver, 2, True, timeout=90)
    for _available, message in results:
        assert message.startswith("raised: pynccl is unavailable: ncclCommInitRank")


def _pynccl_refusals(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    from device_communicators.pynccl import PyNcclCommunicator

    init_gloo(rank, world_size)
    reasons = []
    try:
        with override(disable_pynccl=True):
            reasons.append(PyNcclCommunicator(dist.group.WORLD, 0).reason)
        # Only rank 1 lacks the library: both ranks must disable, naming rank 1.
        path = "/nonexistent/libnccl.so.2" if rank == 1 else None
        reasons.append(PyNcclCommunicator(dist.group.WORLD, 0, library_path=path).reason)
    finally:
        dist.destroy_process_group()
    return reasons


@needs_wheel
def test_pynccl_refusals_agree_across_ranks():
    r0, r1 = run_ranks(_pynccl_refusals, 2, timeout=90)
    assert r0[0] == r1[0] == "disabled by GROUPCOORD_DISABLE_PYNCCL"
    assert r0[1].startswith("rank 1: cannot load /nonexistent/libnccl.so.2")
    assert r1[1].startswith("cannot load /nonexistent/libnccl.so.2")


def _pynccl_world_one(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from device_communicators.pynccl import PyNcclCommunicator

    init_gloo(rank, world_size)
    try:
        return PyNcclCommunicator(dist.group.WORLD, "cuda").reason
    finally:
        dist.destroy_process_group()


def test_pynccl_world_size_one_is_disabled():
    assert run_ranks(_pynccl_world_one, 1, timeout=60) == ["world size 1: nothing to communicate"]


def test_dtype_and_op_maps():
    import torch
    from torch.distributed import ReduceOp

    from device_communicators.errors import GroupcoordTypeError
    from device_communicators.pynccl import nccl_data_type, nccl_red_op
    from device_communicators.pynccl_wrapper import NcclDataType, NcclRedOp

    assert nccl_data_type(torch.bfloat16, reduction=True) == NcclDataType.BFLOAT16
    assert nccl_data_type(torch.float16, reduction=False) == NcclDataType.FLOAT16
    # float8 moves as bytes; summing it needs NCCL's own float8 types (2.24+).
    assert nccl_data_type(torch.float8_e4m3fn, reduction=False) == NcclDataType.UINT8
    assert (
        nccl_data_type(torch.float8_e5m2, reduction=True, version_code=23203)
        == NcclDataType.FLOAT8E5M2
    )
    with pytest.raises(GroupcoordTypeError, match="NCCL >= 2.24"):
        nccl_data_type(torch.float8_e4m3fn, reduction=True, version_code=22100)
    with pytest.raises(GroupcoordTypeError, match="complex64"):
        nccl_data_type(torch.complex64, reduction=False)
    assert nccl_red_op(ReduceOp.AVG) == NcclRedOp.AVG
    assert nccl_red_op(ReduceOp.PRODUCT) == NcclRedOp.PROD
    with pytest.raises(GroupcoordValueError, match="op"):
        nccl_red_op(ReduceOp.BAND)


def test_a_library_without_nccl_symbols_is_refused_by_name():
    import ctypes.util

    libc = ctypes.util.find_library("c") or "libc.so.6"
    with pytest.raises(BackendUnavailableError, match="lacks required NCCL functions") as info:
        load_nccl_library(libc)
    assert "ncclGetVersion" in str(info.value) and "ncclCommWindowRegister" not in str(info.value)


@needs_wheel
def test_table_matches_the_wheels_nccl_header():
    """Each row's argument count and return kind agree with nccl.h's prototype."""
    import re

    assert WHEEL_PATH is not None
    header = os.path.join(os.path.dirname(os.path.dirname(WHEEL_PATH)), "include", "nccl.h")
    text = open(header, encoding="utf-8").read()
    for row in NCCL_FUNCTIONS:
        match = re.search(rf"(ncclResult_t|const char\*)\s+{row.name}\s*\(([^;]*?)\)\s*;", text)
        assert match, f"{row.name} not declared in {header}"
        returns, params = match.group(1), match.group(2).strip()
        count = 0 if params in ("", "void") else params.count(",") + 1
        assert count == len(row.argtypes), (row.name, params)
        assert (returns == "const char*") == (row.restype is ctypes.c_char_p), row.name
