"""Fresh CPU tensors that fault in fast: transparent huge pages for big ones.

An out-of-place collective returns a new tensor, and a reader copies a large
message into a new buffer; a big new tensor is fresh memory from the kernel
(glibc maps every block over 32 MiB afresh), and on a VM every 4 KiB page
costs a fault: a 64 MiB all-reduce result cost ~30 ms before any byte moved,
a 64 MiB decode 32 ms. Asking for transparent huge pages
(``madvise(MADV_HUGEPAGE)``, honoured when THP is in ``madvise`` or
``always`` mode) cuts that to ~7-12 ms here. It is only a hint: when the
kernel ignores it nothing changes but speed.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14
# Below this the result is likely reused from malloc's heap, already faulted in.
HUGE_PAGE_MIN_BYTES = 4 * 1024 * 1024


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_madvise = _load_madvise()


def empty_output(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, with huge pages asked for when big."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if _madvise is None or nbytes < HUGE_PAGE_MIN_BYTES:
        return out
    address = out.data_ptr()
    start = (address + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        # A hint only: a refusal (THP off, old kernel) leaves ordinary pages.
        _madvise(start, end - start, _MADV_HUGEPAGE)
    return out
