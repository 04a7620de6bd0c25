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
    "lengths",
    "message_buffer",
    "message_view",
    "read_lengths",
]

OBJECT_DTYPE = torch.bits8
LENGTH_BYTES = 8  # one int64 per length


def lengths(values: list[int]) -> torch.Tensor:
    """Byte counts as :data:`OBJECT_DTYPE` (``LENGTH_BYTES`` elements each)."""
    return torch.tensor(values, dtype=torch.int64).view(OBJECT_DTYPE)


def read_lengths(tensor: torch.Tensor) -> list[int]:
    """What :func:`lengths` made, back as ints."""
    return [int(n) for n in tensor.view(torch.int64).tolist()]


def message_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a 1-d tensor of :data:`OBJECT_DTYPE` (or uint8) as the view
    ``codec.loads`` reads, no copy; the view keeps the tensor alive."""
    return tensor.view(torch.uint8).numpy().data


def message_buffer(nbytes: int, msg: EncodedMessage | None) -> tuple[torch.Tensor, memoryview]:
    """A buffer of ``nbytes`` that moves an encoded message: the tensor of
    :data:`OBJECT_DTYPE` to move and the view ``codec.loads`` reads, with the
    sender's ``msg`` written in (None on a receiver), zeros after it when
    ``nbytes`` is longer (a gather's or scatter's parts travel as long as the
    longest: no stale bytes of this process leave it). Pooled
    (``host_memory.empty_output``): a large object costs no copy into fresh,
    page-faulting memory (a 16 MiB one spent 20 of its 30 ms broadcast so, joined
    into bytes and copied again into a tensor). What ``codec.loads`` decodes from
    the view owns its memory, so the buffer is reused once the view is dropped."""
    buffer = empty_output((nbytes,), torch.uint8)
    view = message_view(buffer)
    if msg is not None:
        write_message(msg, view, 0, buffer.data_ptr())
        if nbytes > msg.nbytes:
            buffer[msg.nbytes :].zero_()
    return buffer.view(OBJECT_DTYPE), view
