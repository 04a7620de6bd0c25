"""The NCCL ctypes binding against the real ``libnccl`` of the nvidia-nccl-cu12 wheel.

Needs no GPU: loading, version, error strings and unique ids work without a
driver. Skips (with the reason) only when the cuda extra is not installed.
"""

from __future__ import annotations

import ctypes
import os

import pytest

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


@needs_wheel
def test_unique_id_is_128_bytes_and_fresh(nccl: NcclLibrary):
    assert os.environ.get("NCCL_SOCKET_IFNAME") == "lo"
    first = nccl.get_unique_id()
    second = nccl.get_unique_id()
    assert isinstance(first, bytes) and len(first) == NCCL_UNIQUE_ID_BYTES
    assert first != second
    uid = nccl.unique_id_from_bytes(first)
    assert ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES) == first
    with pytest.raises(GroupcoordValueError, match="data"):
        nccl.unique_id_from_bytes(first[:-1])


@needs_wheel
def test_optional_symbols_are_looked_up_not_required(nccl: NcclLibrary):
    # NCCL 2.32 has all of them; the binding must have bound each one it found.
    assert nccl.has("ncclMemAlloc") and nccl.has("ncclCommWindowRegister")
    assert not nccl.has("ncclNoSuchFunction")
