"""Fresh CPU tensors that cost no page faults: a small pool of result buffers.

An out-of-place collective returns a new tensor, and a reader copies a large
message into a new buffer. A big new tensor is fresh memory from the kernel
(glibc maps every block over 32 MiB afresh, and often smaller ones), and on a
VM every fresh page costs a fault and a zeroing: writing a fresh 32 MiB
all-gather result cost ~5 ms here even on huge pages, as long as the copy of
the data itself. So results of 256 KiB and more come from a pool that keeps
buffers of each size class, as many as a caller held at once: a buffer is
handed out again only when nothing else holds it any more (no tensor, view,
array or storage object of the caller's: torch's storage use count and the
storage object's reference count are both back to the pool's own), so a
result the caller still holds is never written. An engine step that gathers
the same shapes each step reuses the same two buffers, the receiver of a dict
of eight 8 MiB tensors the same eight (sixteen if it holds one dict while the
next arrives); a caller that keeps every result gets fresh ones once the
class is full. The pool holds at most ``POOL_CAP_BYTES`` (least recently used size
classes go first); :func:`release_cached_outputs` empties it
(``destroy_distributed_environment`` calls it).

Fresh buffers of 4 MiB and more ask for transparent huge pages
(``madvise(MADV_HUGEPAGE)``, honoured when THP is in ``madvise`` or
``always`` mode): a 64 MiB first touch drops from ~30 ms to ~7-12 ms here.
It is only a hint: when the kernel ignores it nothing changes but speed.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import OrderedDict

import torch

__all__ = [
    "HUGE_PAGE_MIN_BYTES",
    "POOL_CAP_BYTES",
    "POOL_MIN_BYTES",
    "cached_output_bytes",
    "empty_output",
    "release_cached_outputs",
]

_HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14
# Below this the result is likely reused from malloc's heap, already faulted in.
HUGE_PAGE_MIN_BYTES = 4 * 1024 * 1024
# Smaller results are cheap to allocate; bigger ones come from the pool. Above
# glibc's 128 KiB mmap threshold a block is often fresh pages: eight 512 KiB
# tensors copied into fresh ones took 1.5 ms here, into pooled ones 0.17 ms.
POOL_MIN_BYTES = 256 * 1024
# Idle or not, the pool references at most this much memory.
POOL_CAP_BYTES = 512 * 1024 * 1024
# Buffers kept per size class: as many as a caller holds at once (a tensor
# dict's same-size tensors, held while the next dict arrives), up to this many
# and half the pool's bytes. Two per class (one result held, the next one)
# measured 6 of a 64 MiB dict's 8 tensors on fresh pages at every receive.
_PER_CLASS_MAX = 64


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
_storage_use_count = torch._C._storage_Use_Count


def _fresh_storage(nbytes: int) -> torch.UntypedStorage:
    storage = torch.empty((nbytes,), dtype=torch.uint8).untyped_storage()
    if _madvise is not None and nbytes >= HUGE_PAGE_MIN_BYTES:
        address = storage.data_ptr()
        start = (address + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
        end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            # A hint only: a refusal (THP off, old kernel) leaves ordinary pages.
            _madvise(start, end - start, _MADV_HUGEPAGE)
    return storage


def _size_class(nbytes: int) -> int:
    """Round up to an eighth of the power of two below (at least 1 MiB): shapes that
    differ by a few rows step to step share buffers, at most 1/8 wasted."""
    step = max(POOL_MIN_BYTES, (1 << (nbytes.bit_length() - 1)) // 8)
    return -(-nbytes // step) * step


def _holders(storage: torch.UntypedStorage) -> tuple[int, int]:
    """Who holds ``storage``: (tensors and C++ holders, Python references)."""
    return _storage_use_count(storage._cdata), sys.getrefcount(storage)


class _OutputPool:
    """Size class -> the storages kept for it, least recently used class first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._classes: OrderedDict[int, list[torch.UntypedStorage]] = OrderedDict()
        self._idle: tuple[int, int] | None = None  # _holders() of a buffer nobody holds
        self.nbytes = 0

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """A storage of at least ``nbytes`` that nothing outside the pool holds."""
        size = _size_class(nbytes)
        if size > POOL_CAP_BYTES // 2:
            return _fresh_storage(nbytes)
        with self._lock:
            kept = self._classes.get(size, [])
            for storage in kept:
                # Same frame shape as where _idle was measured: the list, this
                # name, _holders' argument, getrefcount's argument.
                if _holders(storage) == self._idle and storage.nbytes() == size:
                    self._classes.move_to_end(size)
                    return storage
            if len(kept) >= _PER_CLASS_MAX or (len(kept) + 1) * size > POOL_CAP_BYTES // 2:
                return _fresh_storage(nbytes)
            self._evict(POOL_CAP_BYTES - size, spare=size)
            if self.nbytes + size > POOL_CAP_BYTES:
                return _fresh_storage(nbytes)  # what is left is in use
            kept = self._classes.setdefault(size, kept)
            self._classes.move_to_end(size)
            storage = _fresh_storage(size)
            kept.append(storage)
            self.nbytes += size
            if self._idle is None:
                self._idle = _holders(storage)
            return storage

    def _evict(self, keep_at_most: int, spare: int | None = None) -> None:
        """Forget whole size classes, least recently used first, all but ``spare``."""
        for size in list(self._classes):
            if self.nbytes <= keep_at_most:
                return
            if size != spare:
                self.nbytes -= size * len(self._classes.pop(size))

    def reset_lock(self) -> None:
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._evict(0)


_POOL = _OutputPool()
# A child forked while another thread held the lock would wait on it forever.
os.register_at_fork(after_in_child=_POOL.reset_lock)


def empty_output(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor like ``torch.empty(shape, dtype=dtype)`` that no one else
    holds; from the pool when it is ``POOL_MIN_BYTES`` (256 KiB) or more."""
    strides = []
    numel = 1
    for n in reversed(shape):
        strides.append(numel)
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes < POOL_MIN_BYTES:
        # Unpacked: torch parses a torch.Size or tuple argument 1.5-3.5 us slower.
        return torch.empty(*shape, dtype=dtype) if shape else torch.empty((), dtype=dtype)
    storage = _POOL.storage(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides[::-1])


def cached_output_bytes() -> int:
    """Bytes the result pool references (buffers in use by callers included)."""
    return _POOL.nbytes


def release_cached_outputs() -> None:
    """Forget every pooled buffer: idle ones go back to the system now, ones a
    caller still holds when the caller drops them."""
    _POOL.clear()
