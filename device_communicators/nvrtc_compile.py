"""Run-time compilation of groupcoord's CUDA kernels with NVRTC, cached on disk.

Uses CuPy's low-level NVRTC binding, which needs no GPU or driver (CuPy's
high-level ``RawModule`` asks for the current device), and the CUDA headers
of the CUDA runtime wheel (CUDA 12 or 13) or a toolkit. A cubin is cached under
``kernel_cache_dir`` keyed by the SHA-256 of source + options, the target
architecture and the NVRTC version, so a changed kernel or compiler never
loads a stale binary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import tempfile
from importlib import resources
from types import ModuleType

from shm_broadcast.config import get_config

from .errors import BackendUnavailableError, GroupcoordError, GroupcoordValueError

__all__ = [
    "ALGORITHMS",
    "DTYPE_SUFFIXES",
    "KERNEL_SOURCE_NAME",
    "WORLD_SIZES",
    "CompiledKernels",
    "KernelCompileError",
    "compile_custom_all_reduce",
    "compile_cubin",
    "cuda_include_dirs",
    "kernel_name",
    "kernel_names",
    "kernel_source",
    "nvrtc_version",
]

KERNEL_SOURCE_NAME = "custom_all_reduce.cu"
ALGORITHMS = ("oneshot", "twoshot")
# torch dtype name -> suffix of the extern "C" entry points in the .cu file.
DTYPE_SUFFIXES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
WORLD_SIZES = (2, 4, 6, 8)
_BASE_OPTIONS = ("-std=c++17", "-DNDEBUG")


class KernelCompileError(GroupcoordError, RuntimeError):
    """NVRTC rejected the source; carries the compiler log."""

    def __init__(self, arch: str, log: str) -> None:
        self.arch = arch
        self.log = log
        super().__init__(f"NVRTC failed to compile {KERNEL_SOURCE_NAME} for {arch}:\n{log}")


def kernel_name(algo: str, dtype: str, world_size: int) -> str:
    """Symbol of one instantiation, e.g. ``gc_allreduce_oneshot_bf16_w4``."""
    if algo not in ALGORITHMS:
        raise GroupcoordValueError(f"algo: expected one of {ALGORITHMS}, got {algo!r}")
    if dtype not in DTYPE_SUFFIXES:
        raise GroupcoordValueError(
            f"dtype: expected one of {sorted(DTYPE_SUFFIXES)}, got {dtype!r}"
        )
    if world_size not in WORLD_SIZES:
        raise GroupcoordValueError(f"world_size: expected one of {WORLD_SIZES}, got {world_size}")
    return f"gc_allreduce_{algo}_{DTYPE_SUFFIXES[dtype]}_w{world_size}"


def kernel_names() -> list[str]:
    """Every instantiation the .cu file defines (algo x dtype x world size)."""
    return [
        kernel_name(algo, dtype, world)
        for algo in ALGORITHMS
        for dtype in DTYPE_SUFFIXES
        for world in WORLD_SIZES
    ]


def kernel_source() -> str:
    return resources.files(__package__).joinpath(KERNEL_SOURCE_NAME).read_text()


def _nvrtc() -> ModuleType:
    """CuPy's low-level NVRTC module (moved between CuPy releases)."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        return nvrtc
    except ImportError:
        pass
    try:
        from cupy.cuda import nvrtc  # type: ignore[no-redef]

        return nvrtc
    except ImportError as exc:
        raise BackendUnavailableError(
            "nvrtc", f"CuPy is not installed ({exc}); pip install cupy-cuda12x (or cupy-cuda13x)"
        ) from exc


def nvrtc_version() -> tuple[int, int]:
    major, minor = _nvrtc().getVersion()
    return int(major), int(minor)


# Where CUDA's headers live, first match wins: the CUDA 12 runtime wheel
# (nvidia/cuda_runtime/include), the CUDA 13 wheels (nvidia/cu13/include),
# then a toolkit ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda).
_WHEEL_HEADER_PACKAGES = ("nvidia.cuda_runtime", "nvidia.cu13")
_TOOLKIT_ENV = ("CUDA_HOME", "CUDA_PATH")
_TOOLKIT_DEFAULT = "/usr/local/cuda"


def _wheel_include_dirs() -> list[str]:
    dirs = []
    for package in _WHEEL_HEADER_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            continue
        if spec is None or spec.submodule_search_locations is None:
            continue
        dirs += [os.path.join(loc, "include") for loc in spec.submodule_search_locations]
    return dirs


def cuda_include_dirs() -> list[str]:
    """The first directory holding cuda_fp16.h and cuda_bf16.h (see the order above)."""
    toolkits = [os.environ[name] for name in _TOOLKIT_ENV if os.environ.get(name)]
    candidates = _wheel_include_dirs()
    candidates += [os.path.join(t, "include") for t in (*toolkits, _TOOLKIT_DEFAULT)]
    for include in candidates:
        if all(os.path.exists(os.path.join(include, h)) for h in ("cuda_fp16.h", "cuda_bf16.h")):
            return [include]
    raise BackendUnavailableError(
        "nvrtc",
        "CUDA headers not found in "
        + ", ".join(candidates)
        + "; pip install groupcoord[cuda] (CUDA 12) or groupcoord[cuda13]",
    )


def _check_arch(arch: str) -> None:
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise GroupcoordValueError(f"arch: expected e.g. 'sm_80' or 'sm_90a', got {arch!r}")


@dataclasses.dataclass(frozen=True)
class CompiledKernels:
    """A cubin for one architecture and where it came from."""

    arch: str
    cubin: bytes
    path: str
    cache_hit: bool
    nvrtc_version: tuple[int, int]
    log: str = ""


def _cache_path(cache_dir: str, source: str, options: tuple[str, ...], arch: str) -> str:
    version = nvrtc_version()
    digest = hashlib.sha256()
    for part in (source, "\0".join(options), arch, f"{version[0]}.{version[1]}"):
        digest.update(part.encode())
        digest.update(b"\0")
    name = f"custom_ar_{arch}_nvrtc{version[0]}.{version[1]}_{digest.hexdigest()[:24]}.cubin"
    return os.path.join(cache_dir, name)


def _write_atomically(path: str, data: bytes) -> None:
    # Several ranks may compile at once: write a private file, then rename it
    # over the final name, so no reader ever sees a partial cubin.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp_", suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def compile_cubin(
    source: str,
    arch: str,
    *,
    name: str = KERNEL_SOURCE_NAME,
    options: tuple[str, ...] = (),
    cache_dir: str | None = None,
) -> CompiledKernels:
    """Compile ``source`` to a cubin for ``arch`` (e.g. "sm_90"), or load it from cache."""
    _check_arch(arch)
    nvrtc = _nvrtc()
    all_options = (*_BASE_OPTIONS, *options, f"--gpu-architecture={arch}")
    all_options += tuple(f"--include-path={d}" for d in cuda_include_dirs())
    cache_dir = cache_dir if cache_dir is not None else get_config().kernel_cache_dir
    path = _cache_path(cache_dir, source, all_options, arch)
    if os.path.exists(path):
        with open(path, "rb") as f:
            return CompiledKernels(arch, f.read(), path, True, nvrtc_version())
    program = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(program, list(all_options))
        except nvrtc.NVRTCError as exc:
            raise KernelCompileError(arch, nvrtc.getProgramLog(program) or str(exc)) from exc
        log = nvrtc.getProgramLog(program)
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    _write_atomically(path, cubin)
    return CompiledKernels(arch, cubin, path, False, nvrtc_version(), log.strip("\0 \n"))


def compile_custom_all_reduce(arch: str, cache_dir: str | None = None) -> CompiledKernels:
    """The all-reduce kernels (every instantiation, one translation unit) for ``arch``."""
    return compile_cubin(kernel_source(), arch, cache_dir=cache_dir)
