"""An object's encoded bytes, and their lengths, as tensors no tensor call is taken for.

An object collective (``broadcast_object``, a ``Comm``'s ``all_gather_object``,
``send_object_list`` ...) moves a length, then bytes, with the tensor calls of
its group. As uint8 and int64 tensors they met a plain tensor call of the same
size on another rank, which then returned the length as its data with no error.
Here both travel as ``torch.bits8``, a dtype only these carry: the call's
fingerprint (shared memory), header (point to point) or debug check names its
dtype, so a rank in an object call against one in a tensor call raises
``DesyncError`` naming both.
"""

from __future__ import annotations

import torch

from shm_broadcast.codec import EncodedMessage, write_message
from shm_broadcast.host_memory import empty_output

__all__ = [
    "LENGTH_BYTES",
    "OBJECT_DTYPE",
    "from_bytes",
    "lengths",
    "message_buffer",
    "read_lengths",
    "to_bytes",
]

OBJECT_DTYPE = torch.bits8
LENGTH_BYTES = 8  # one int64 per length


def from_bytes(data: bytes) -> torch.Tensor:
    """``data`` as a 1-d tensor of :data:`OBJECT_DTYPE` (a copy)."""
    if not data:
        return torch.empty(0, dtype=OBJECT_DTYPE)
    return torch.frombuffer(bytearray(data), dtype=OBJECT_DTYPE)


def to_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a 1-d tensor of :data:`OBJECT_DTYPE`."""
    return tensor.view(torch.uint8).numpy().tobytes()


def lengths(values: list[int]) -> torch.Tensor:
    """Byte counts as :data:`OBJECT_DTYPE` (``LENGTH_BYTES`` elements each)."""
    return torch.tensor(values, dtype=torch.int64).view(OBJECT_DTYPE)


def read_lengths(tensor: torch.Tensor) -> list[int]:
    """What :func:`lengths` made, back as ints."""
    return [int(n) for n in tensor.view(torch.int64).tolist()]


def message_buffer(nbytes: int, msg: EncodedMessage | None) -> tuple[torch.Tensor, memoryview]:
    """A broadcast's buffer of an encoded message of ``nbytes``: the tensor of
    :data:`OBJECT_DTYPE` to move and the view ``codec.loads`` reads, with the
    source's ``msg`` written in (None on the receivers). Pooled
    (``host_memory.empty_output``): a large object costs no copy into fresh,
    page-faulting memory (a 16 MiB one spent 20 of its 30 ms broadcast so, joined
    into bytes and copied again into a tensor). What ``codec.loads`` decodes from
    the view owns its memory, so the buffer is reused once the view is dropped."""
    buffer = empty_output((nbytes,), torch.uint8)
    view = buffer.numpy().data
    if msg is not None:
        write_message(msg, view, 0, buffer.data_ptr())
    return buffer.view(OBJECT_DTYPE), view
