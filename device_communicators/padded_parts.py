"""Parts of different lengths through a collective that needs equal sizes.

Gloo's all-gather and gather move equal byte counts, so a part shorter than the
longest travels padded to it and is cut back on arrival. Cutting by the lengths a
caller passed (``all_gatherv``'s ``sizes``, ``Comm.all_gather_v``'s
``output_list``) trusts every entry, including the other ranks', which no rank
can check before the call: an entry one row short, with the longest part
unchanged, used to cut that rank's part short on the ranks that passed it, with
no error (RELIABILITY.md, bug 14). So each part carries its true length in a
16-byte header in front of its bytes, and a receiver reads the lengths the
parts really have. A rank whose lengths disagree raises once the collective is
over (:func:`check_lengths`): every rank stays in step and the group usable.

Layout of one part: ``[int64 length][8 bytes of zeros][body][zeros to 16]``;
the body is ``longest`` rows of the part's row shape in its dtype, zero-padded.
Each part's size is a multiple of 16 bytes, so every part's body is aligned for
any dtype in a stacked ``(world, part_bytes)`` result.
"""

from __future__ import annotations

import ctypes

import torch

from .errors import GroupcoordValueError

__all__ = ["check_lengths", "pad_with_length", "part_bytes", "unpad_with_lengths"]

HEADER_BYTES = 16


def part_bytes(longest: int, row: torch.Size, dtype: torch.dtype) -> int:
    """Bytes of one part holding ``longest`` rows of shape ``row``, header included."""
    body = longest * row.numel() * dtype.itemsize
    return HEADER_BYTES + -(-body // HEADER_BYTES) * HEADER_BYTES


def pad_with_length(part: torch.Tensor, longest: int) -> torch.Tensor:
    """``part`` (a CPU tensor, its rows along dim 0, at most ``longest``) as a uint8
    tensor in the layout above. Byte copies by address: a few torch ops on tensors
    this small cost more than the copy (4 KiB: 46 us as torch ops, 13 us so)."""
    rows, row = part.shape[0], part.shape[1:]
    size = part_bytes(longest, row, part.dtype)
    buf = torch.empty(size, dtype=torch.uint8)
    at = buf.data_ptr()
    ctypes.c_int64.from_address(at).value = rows
    nbytes = rows * row.numel() * part.element_size()
    if nbytes:
        src = part if part.is_contiguous() else part.contiguous()
        ctypes.memmove(at + HEADER_BYTES, src.data_ptr(), nbytes)
    # The rest of the header and the padding: the same bytes on every rank.
    ctypes.memset(at + 8, 0, HEADER_BYTES - 8)
    ctypes.memset(at + HEADER_BYTES + nbytes, 0, size - HEADER_BYTES - nbytes)
    return buf


def unpad_with_lengths(
    stacked: torch.Tensor, longest: int, row: torch.Size, dtype: torch.dtype
) -> tuple[torch.Tensor, list[int]]:
    """Every rank's part out of ``stacked`` (a contiguous ``(world, part_bytes)`` uint8
    CPU tensor, one row per rank in the layout above): the ``(world, longest, *row)``
    padded parts (a view) and the parts' true lengths."""
    world, size = stacked.shape
    assert stacked.is_contiguous() and size == part_bytes(longest, row, dtype)
    at = stacked.data_ptr()
    lengths = [ctypes.c_int64.from_address(at + r * size).value for r in range(world)]
    nbytes = longest * row.numel() * dtype.itemsize
    body = stacked[:, HEADER_BYTES : HEADER_BYTES + nbytes].view(dtype)
    return body.unflatten(1, (longest, *row)), lengths


def check_lengths(said: str, given: list[int], lengths: list[int], along: str = "") -> None:
    """Raise ``GroupcoordValueError`` when the lengths this rank was ``given`` (``said``
    names them as the caller passed them, ``{}`` standing for them, e.g. ``"sizes={}"``)
    are not the parts' true ``lengths``. Formatted only then: every call checks."""
    if list(given) != list(lengths):
        raise GroupcoordValueError(
            f"{said.format(list(given))} but the ranks' parts have {list(lengths)}{along}"
        )
