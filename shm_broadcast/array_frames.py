"""Tensors and numpy arrays as frames: the dtype names on the wire, a byte view
of a tensor's own memory for sending, and the one copy that rebuilds it.

torch and numpy are imported only when a tensor or array is met, so a
pure-Python scheduler can use the codec without paying for torch.
"""

from __future__ import annotations

import ctypes
from typing import Any

from .errors import GroupcoordTypeError, ProtocolError

__all__ = ["dtype_name", "torch_dtype"]

_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> name on the wire, filled on first use
_DTYPES_BY_NAME: dict[str, Any] = {}  # the reverse, filled on first use
# Quantized dtypes carry scales and zero points beside their bytes: not sendable as a frame.
_QUANTIZED = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")

# Decoded tensors at least this big get their memory from torch, not a bytearray.
_LARGE_DECODE_BYTES = 64 * 1024


def dtype_name(dtype: Any) -> str:
    """A torch dtype's name on the wire ("float32"); :func:`torch_dtype` reverses it."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype)[6:]
        if name in _QUANTIZED:
            raise GroupcoordTypeError(f"cannot encode a quantized tensor ({dtype})")
        _DTYPE_NAMES[dtype] = name
    return name


def torch_dtype(name: str) -> Any:
    """The torch dtype a wire name stands for; ``ProtocolError`` for an unknown one."""
    dtype = _DTYPES_BY_NAME.get(name)
    if dtype is None:
        import torch

        dtype = getattr(torch, name, None) if type(name) is str else None
        if not isinstance(dtype, torch.dtype) or name in _QUANTIZED:
            raise ProtocolError(f"unknown torch dtype {name!r}")
        _DTYPES_BY_NAME[name] = dtype
    return dtype


def plain_cpu_tensor(t: Any) -> Any:
    """``t`` as a dense CPU tensor with no autograd, conjugate or negative bit (each
    step taken only when needed: this is the hot path of small-tensor messages)."""
    import torch

    if t.layout is not torch.strided:
        raise GroupcoordTypeError(f"cannot encode a tensor with layout {t.layout}")
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def memory_view(address: int, nbytes: int) -> memoryview:
    """A uint8 view of ``nbytes`` at ``address`` (no copy): its owner must outlive it."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def decode_tensor(name: str, shape: list[int], frame: memoryview, owned: bool = False) -> Any:
    """The tensor a frame holds: one copy out of ``frame``, or none when ``owned``
    (the frame is a buffer made for this message, which the tensor then keeps)."""
    import torch

    dtype = torch_dtype(name)
    nbytes = len(frame)
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize != nbytes:
        raise ProtocolError(
            f"tensor {name}{shape} needs {numel * dtype.itemsize} bytes, got {nbytes}"
        )
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if owned:
        flat = torch.frombuffer(frame, dtype=dtype)  # the tensor keeps the buffer alive
    elif nbytes >= _LARGE_DECODE_BYTES:
        # Through torch's allocator: glibc recycles its large blocks, while a
        # fresh bytearray of MiBs page-faults on every call (8 x 8 MiB measured
        # 23 ms as bytearrays, 2 ms as torch.empty).
        import numpy as np

        from .host_memory import empty_output

        raw = empty_output((nbytes,), torch.uint8)
        raw.numpy()[:] = np.frombuffer(frame, dtype=np.uint8)
        flat = raw.view(dtype)
    else:
        flat = torch.frombuffer(bytearray(frame), dtype=dtype)
    return flat if len(shape) == 1 else flat.view(shape)


def ndarray_descr(dtype: Any) -> Any:
    """A numpy dtype's description on the wire (refusing object dtypes)."""
    import numpy as np

    if dtype.hasobject:
        raise GroupcoordTypeError("cannot encode a numpy object array or scalar without pickle")
    return np.lib.format.dtype_to_descr(dtype)


def numpy_dtype(descr: Any) -> Any:
    import numpy as np

    try:
        return np.lib.format.descr_to_dtype(_descr_from_wire(descr))
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"bad numpy dtype description {descr!r}") from exc


def _descr_from_wire(descr: Any) -> Any:
    """Undo msgpack's tuple -> list in a numpy descr (structured dtypes nest)."""
    if not isinstance(descr, list):
        return descr
    fields = []
    for field in descr:
        name = tuple(field[0]) if isinstance(field[0], list) else field[0]
        rest = [_descr_from_wire(field[1])]
        if len(field) > 2:
            rest.append(tuple(field[2]))
        fields.append((name, *rest))
    return fields


def decode_ndarray(descr: Any, shape: list[int], frame: memoryview) -> Any:
    import numpy as np

    dtype = numpy_dtype(descr)
    count = 1
    for dim in shape:
        count *= dim
    if count * dtype.itemsize != len(frame):
        raise ProtocolError(
            f"array {dtype}{shape} needs {count * dtype.itemsize} bytes, got {len(frame)}"
        )
    if count == 0:
        return np.empty(tuple(shape), dtype=dtype)
    # One copy into a bytearray the (writable) array then owns.
    return np.frombuffer(bytearray(frame), dtype=dtype).reshape(shape)
