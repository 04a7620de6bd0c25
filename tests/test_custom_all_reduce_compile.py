"""The custom all-reduce kernel source compiles, for real, without a GPU.

NVRTC (through CuPy's low-level binding) builds one cubin per architecture
holding every algo x dtype x world-size instantiation; the cubin's ELF symbol
table is read back to check each entry point is there. nvcc builds the same
source when a toolkit is on the machine.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess

import pytest

from device_communicators.errors import GroupcoordValueError
from device_communicators.nvrtc_compile import (
    KernelCompileError,
    compile_cubin,
    compile_custom_all_reduce,
    kernel_name,
    kernel_names,
    nvrtc_version,
)

nvrtc = pytest.importorskip(
    "cupy_backends.cuda.libs.nvrtc", reason="CuPy not installed (pip install groupcoord[cuda])"
)

ARCHS = ("sm_80", "sm_90")


def elf_function_symbols(image: bytes) -> set[str]:
    """Names of the STT_FUNC symbols of a 64-bit little-endian ELF (a cubin)."""
    assert image[:4] == b"\x7fELF" and image[4] == 2, "not an ELF64 image"
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)
    ]
    names: set[str] = set()
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize):
            st_name, st_info = struct.unpack_from("<IB", image, pos)
            if st_info & 0xF == 2:  # STT_FUNC
                end = image.index(b"\0", strtab_offset + st_name)
                names.add(image[strtab_offset + st_name : end].decode())
    return names


def elf_sections(image: bytes) -> dict[str, bytes]:
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)
    ]
    names_at = sections[shstrndx][4]
    out = {}
    for name_off, *_rest in sections:
        end = image.index(b"\0", names_at + name_off)
        offset, size = _rest[3], _rest[4]
        out[image[names_at + name_off : end].decode()] = image[offset : offset + size]
    return out


def kernel_param_sizes(image: bytes, kernel: str) -> list[int]:
    """Parameter sizes by ordinal from the cubin's EIATTR_KPARAM_INFO records."""
    info = elf_sections(image)[f".nv.info.{kernel}"]
    sizes: dict[int, int] = {}
    pos = 0
    while pos < len(info):
        fmt, attr = info[pos], info[pos + 1]
        if fmt == 4:  # EIFMT_SVAL: u16 length, then the value
            (length,) = struct.unpack_from("<H", info, pos + 2)
            if attr == 0x17:  # EIATTR_KPARAM_INFO: index, ordinal, offset, flags (size << 18)
                _index, ordinal, _offset, flags = struct.unpack_from("<IHHI", info, pos + 4)
                sizes[ordinal] = flags >> 18
            pos += 4 + length
        else:  # EIFMT_NVAL / EIFMT_BVAL / EIFMT_HVAL: 4 bytes with padding
            pos += 4
    return [sizes[i] for i in range(len(sizes))]


def test_launch_arguments_match_the_compiled_kernel_parameters(tmp_path):
    import ctypes

    from device_communicators.custom_all_reduce import kernel_args

    image = compile_custom_all_reduce("sm_90", cache_dir=str(tmp_path)).cubin
    for world in (2, 8):
        args = kernel_args(0x1000, [0x2000 + r for r in range(world)], 1, 0x3000, 64)
        ours = [ctypes.sizeof(a) for a in args]
        for algo in ("oneshot", "twoshot"):
            for dtype in ("float32", "float16", "bfloat16"):
                name = kernel_name(algo, dtype, world)
                assert kernel_param_sizes(image, name) == ours == [8, 64, 8, 8, 4, 4], name


def test_kernel_names_cover_every_instantiation():
    names = kernel_names()
    assert len(names) == len(set(names)) == 2 * 3 * 4
    assert kernel_name("oneshot", "bfloat16", 4) == "gc_allreduce_oneshot_bf16_w4"
    with pytest.raises(GroupcoordValueError, match="world_size"):
        kernel_name("oneshot", "float32", 3)
    with pytest.raises(GroupcoordValueError, match="dtype"):
        kernel_name("twoshot", "float64", 2)
    with pytest.raises(GroupcoordValueError, match="algo"):
        kernel_name("threeshot", "float32", 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_every_instantiation_and_caches(arch, tmp_path):
    first = compile_custom_all_reduce(arch, cache_dir=str(tmp_path))
    assert not first.cache_hit
    assert first.nvrtc_version == nvrtc_version()
    assert os.path.dirname(first.path) == str(tmp_path)
    assert arch in os.path.basename(first.path)
    symbols = elf_function_symbols(first.cubin)
    missing = sorted(set(kernel_names()) - symbols)
    assert not missing, f"{arch}: entry points missing from the cubin: {missing}"
    # The second compile is a cache hit that returns the same bytes.
    second = compile_custom_all_reduce(arch, cache_dir=str(tmp_path))
    assert second.cache_hit and second.path == first.path and second.cubin == first.cubin


def test_cache_key_changes_with_source_and_arch(tmp_path):
    source = 'extern "C" __global__ void gc_probe(int* p) { *p = 1; }\n'
    a80 = compile_cubin(source, "sm_80", cache_dir=str(tmp_path))
    a90 = compile_cubin(source, "sm_90", cache_dir=str(tmp_path))
    changed = compile_cubin(source + "// changed\n", "sm_80", cache_dir=str(tmp_path))
    assert len({a80.path, a90.path, changed.path}) == 3
    assert not changed.cache_hit
    assert "gc_probe" in elf_function_symbols(a90.cubin)


def test_compile_errors_carry_the_nvrtc_log(tmp_path):
    with pytest.raises(KernelCompileError, match="undefined_thing"):
        compile_cubin(
            "__global__ void k() { undefined_thing(); }", "sm_80", cache_dir=str(tmp_path)
        )
    assert not list(tmp_path.iterdir()), "a failed compile must not leave a cache entry"
    with pytest.raises(GroupcoordValueError, match="arch"):
        compile_cubin("", "compute_80", cache_dir=str(tmp_path))


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on this machine")
@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_instantiation(arch, tmp_path):
    source = os.path.join(
        os.path.dirname(__import__("device_communicators").__file__), "custom_all_reduce.cu"
    )
    out = tmp_path / f"custom_ar_{arch}.cubin"
    assert NVCC is not None
    proc = subprocess.run(
        [NVCC, "-cubin", f"-arch={arch}", "-std=c++17", "-o", str(out), source],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    missing = sorted(set(kernel_names()) - elf_function_symbols(out.read_bytes()))
    assert not missing, f"nvcc {arch}: entry points missing: {missing}"
