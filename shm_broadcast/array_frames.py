"""Tensors and numpy arrays as frames: a tensor's binary header on the wire
(dtype code, frame index, dims), dtype names, and the one copy that rebuilds it.

torch and numpy are imported only when a tensor or array is met, so a
pure-Python scheduler can use the codec without paying for torch.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

from .errors import GroupcoordTypeError, ProtocolError

__all__ = ["dtype_name", "not_its_values", "torch_dtype"]

_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> name on the wire, filled on first use
_DTYPES_BY_NAME: dict[str, Any] = {}  # the reverse, filled on first use
# Quantized dtypes carry scales and zero points beside their bytes: not sendable as a frame.
_QUANTIZED = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
# Sub-byte integer dtypes torch cannot copy element-wise ("copy_kernel" not
# implemented): a tensor of one travels only as its contiguous bytes.
UNCOPYABLE_DTYPES = frozenset(f"{kind}{bits}" for kind in ("int", "uint") for bits in range(1, 8))

# Decoded tensors at least this big get their memory from torch, not a bytearray;
# a message's frames smaller than this together are copied out as one bytearray.
LARGE_DECODE_BYTES = 64 * 1024

# A tensor on the wire: u8 dtype code | u32 frame index | u64 per dim. The code
# is the dtype's index in this table, which is part of the wire format: append
# only. A dtype the local torch lacks decodes to a ProtocolError.
WIRE_DTYPES = (
    "float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128",
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
)  # fmt: skip
DTYPE_CODES: dict[Any, int] = {}  # torch dtype -> its code, filled on first use
_BY_CODE: list[Any] = []  # code -> torch dtype (None where this torch lacks it)
_TENSOR_META: dict[int, struct.Struct] = {}  # ndim -> layout of the tensor's header
_TENSOR_META_BY_SIZE: dict[int, struct.Struct] = {}  # its byte size -> the same
_META_1D = struct.Struct("<BIQ")  # the common case, packed without building a tuple of dims


def not_its_values(cls: type) -> str | None:
    """Why tensors of class ``cls`` (a ``torch.Tensor`` subclass) may not be moved as
    their memory, or None: a subclass that runs torch's ops in Python
    (``__torch_dispatch__``: DTensor, FakeTensor, FunctionalTensor, the quantized and
    wrapper subclasses) need not hold its values in its memory (a wrapper has none,
    its ``data_ptr()`` is 0). ``nn.Parameter`` and subclasses that only override
    ``__torch_function__`` do."""
    import torch

    if getattr(cls, "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__:
        return None
    return (
        f"a {cls.__module__}.{cls.__qualname__}, a tensor subclass that runs torch's ops "
        "in Python (__torch_dispatch__): its memory does not hold its values; pass the "
        "plain tensor it holds (a DTensor's to_local(), for one)"
    )


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


def dtype_code(dtype: Any) -> int:
    """A torch dtype's code on the wire (the encoder keeps the answers in ``DTYPE_CODES``)."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        name = dtype_name(dtype)
        if name not in WIRE_DTYPES:
            raise GroupcoordTypeError(
                f"cannot encode a tensor of dtype {dtype}: not in the wire table"
            )
        code = DTYPE_CODES[dtype] = WIRE_DTYPES.index(name)
    return code


def tensor_meta(code: int, frame: int, shape: Any) -> bytes:
    """The wire header of a tensor: dtype code, frame index, shape."""
    if len(shape) == 1:
        return _META_1D.pack(code, frame, shape[0])
    layout = _TENSOR_META.get(len(shape))
    if layout is None:
        layout = _TENSOR_META[len(shape)] = struct.Struct("<BI" + "Q" * len(shape))
    return layout.pack(code, frame, *shape)


def plain_cpu_tensor(t: Any) -> Any:
    """``t`` as a dense CPU tensor with no autograd, conjugate or negative bit (each
    step taken only when needed: this is the hot path of small-tensor messages)."""
    import torch

    if t.layout is not torch.strided:
        raise GroupcoordTypeError(f"cannot encode a tensor with layout {t.layout}")
    if t.is_meta:
        raise GroupcoordTypeError("cannot encode a meta tensor: it has no data")
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def lone_tensor_meta(obj: Any) -> bytes | None:
    """The wire header of ``obj`` when it is a plain tensor that can be sent as its
    bytes alone (an exact ``torch.Tensor``, dense, contiguous, on the CPU, no
    autograd, conjugate or negative bit, a dtype in the wire table); else None,
    and the codec sends it. No torch import: a tensor means torch is loaded."""
    torch = sys.modules.get("torch")
    if (
        torch is None
        or type(obj) is not torch.Tensor
        or obj.requires_grad
        or not obj.is_cpu
        or obj.layout is not torch.strided
        or not obj.is_contiguous()
        or obj.is_conj()
        or obj.is_neg()
    ):
        return None
    code = DTYPE_CODES.get(obj.dtype)
    if code is None:
        try:
            code = dtype_code(obj.dtype)
        except GroupcoordTypeError:  # not on the wire: the codec says so
            return None
    return tensor_meta(code, 0, obj.shape)


def _meta_layout(size: int) -> struct.Struct:
    """The layout of a tensor header of ``size`` bytes (cached by size)."""
    ndim, rest = divmod(size - 5, 8)
    if ndim < 0 or rest:
        raise ProtocolError(f"a tensor header of {size} bytes")
    layout = _TENSOR_META_BY_SIZE[size] = struct.Struct("<BI" + "Q" * ndim)
    return layout


def _dtype_of_code(code: int) -> Any:
    if not _BY_CODE:
        import torch

        _BY_CODE.extend(getattr(torch, name, None) for name in WIRE_DTYPES)
    dtype = _BY_CODE[code] if code < len(_BY_CODE) else None
    if dtype is None:
        raise ProtocolError(f"tensor dtype code {code} is not known to this torch")
    return dtype


def large_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` (``LARGE_DECODE_BYTES`` or more) that a received
    copy goes into: through torch's allocator and the result pool, since glibc
    recycles its large blocks while a fresh bytearray of MiBs page-faults on every
    call (8 x 8 MiB measured 23 ms as bytearrays, 2 ms as torch.empty)."""
    import torch

    from .host_memory import empty_output

    return empty_output((nbytes,), torch.uint8).numpy().data


def decode_tensor(meta: Any, frames: Any, owned: bool) -> Any:
    """The tensor a wire header (``meta``) describes, from its frame in ``frames``:
    one copy out of the frame, or none when ``owned`` (the frames are buffers made
    for this message, which the tensor then keeps). The hot path of small-tensor
    messages: one call, no helper on the common 1-D path."""
    if len(meta) == _META_1D.size:
        code, idx, numel = _META_1D.unpack(meta)
        shape = None
    else:
        layout = _TENSOR_META_BY_SIZE.get(len(meta))
        if layout is None:
            layout = _meta_layout(len(meta))
        code, idx, *shape = layout.unpack(meta)
        numel = 1
        for dim in shape:
            numel *= dim
    dtype = _BY_CODE[code] if code < len(_BY_CODE) else None
    if dtype is None:
        dtype = _dtype_of_code(code)
    if idx >= len(frames):
        raise ProtocolError(f"message refers to frame {idx} of {len(frames)}")
    frame = frames[idx]
    nbytes = len(frame)
    if numel * dtype.itemsize != nbytes:
        raise ProtocolError(
            f"tensor {dtype}{[numel] if shape is None else shape} needs "
            f"{numel * dtype.itemsize} bytes, got {nbytes}"
        )
    torch = sys.modules["torch"]  # a dtype was found: torch is loaded (no import statement's cost)
    if nbytes == 0:
        return torch.empty(numel if shape is None else shape, dtype=dtype)
    if owned:
        flat = torch.frombuffer(frame, dtype=dtype)  # the tensor keeps the buffer alive
    elif nbytes >= LARGE_DECODE_BYTES:
        copy = large_buffer(nbytes)
        copy[:] = frame
        flat = torch.frombuffer(copy, dtype=dtype)  # the tensor keeps the buffer alive
    else:
        flat = torch.frombuffer(bytearray(frame), dtype=dtype)
    if shape is None:
        return flat
    return flat.view(shape) if shape else flat.view(())


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
    except (TypeError, ValueError, KeyError, SyntaxError) as exc:
        # SyntaxError: numpy reads a comma string (",f4") with ast.literal_eval.
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
