"""Where the CUDA path finds its pieces, for CUDA 12 and CUDA 13 layouts (no GPU needed).

Seen on the project's H100 image (CUDA 13): headers in nvidia/cu13/include
(no nvidia/cuda_runtime), libnccl in nvidia/nccl/lib (the same place the cu12
wheel uses), a toolkit in /usr/local/cuda.
"""

from __future__ import annotations

import os

import pytest

from device_communicators import nvrtc_compile
from device_communicators.errors import BackendUnavailableError


def make_include(root: str) -> str:
    include = os.path.join(root, "include")
    os.makedirs(include)
    for header in ("cuda_fp16.h", "cuda_bf16.h"):
        open(os.path.join(include, header), "w").close()
    return include


@pytest.fixture()
def no_wheels(monkeypatch):
    monkeypatch.setattr(nvrtc_compile, "_wheel_include_dirs", lambda: [])
    monkeypatch.setattr(nvrtc_compile, "_TOOLKIT_DEFAULT", "/nonexistent-cuda")
    for name in nvrtc_compile._TOOLKIT_ENV:
        monkeypatch.delenv(name, raising=False)


def test_wheel_headers_come_first_cu12_then_cu13_layout(tmp_path, monkeypatch, no_wheels):
    cu12 = str(tmp_path / "nvidia" / "cuda_runtime")
    cu13 = make_include(str(tmp_path / "nvidia" / "cu13"))
    os.makedirs(cu12)  # a cu12 runtime package without headers is skipped
    toolkit = make_include(str(tmp_path / "toolkit"))
    monkeypatch.setattr(
        nvrtc_compile,
        "_wheel_include_dirs",
        lambda: [os.path.join(cu12, "include"), cu13],
    )
    monkeypatch.setenv("CUDA_HOME", os.path.dirname(toolkit))
    assert nvrtc_compile.cuda_include_dirs() == [cu13]


def test_a_toolkit_is_used_when_no_wheel_has_headers(tmp_path, monkeypatch, no_wheels):
    toolkit = make_include(str(tmp_path / "cuda-13.0"))
    monkeypatch.setenv("CUDA_PATH", os.path.dirname(toolkit))
    assert nvrtc_compile.cuda_include_dirs() == [toolkit]


def test_nothing_found_names_every_place_looked_and_both_extras(no_wheels):
    with pytest.raises(BackendUnavailableError) as info:
        nvrtc_compile.cuda_include_dirs()
    message = str(info.value)
    assert "/nonexistent-cuda/include" in message
    assert "groupcoord[cuda]" in message and "groupcoord[cuda13]" in message
