"""Padded parts with their true lengths in front (``device_communicators.padded_parts``):
what a Gloo all-gather of parts of different lengths moves, here without ranks (the
gather is a stack of each rank's bytes)."""

from __future__ import annotations

import pytest
import torch

from device_communicators.errors import GroupcoordValueError
from device_communicators.padded_parts import (
    HEADER_BYTES,
    check_lengths,
    pad_with_length,
    part_bytes,
    unpad_with_lengths,
)

DTYPES = [torch.bool, torch.int8, torch.bfloat16, torch.float32, torch.int64, torch.complex128]


def _part(rows: int, row: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-100, 100, (rows, *row), generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row", [(), (3,), (2, 5), (0, 4)], ids=str)
def test_parts_of_different_lengths_come_back_whole_with_their_lengths(dtype, row):
    lengths = [3, 0, 7, 7, 1]
    longest = max(lengths)
    parts = [_part(n, row, dtype, seed) for seed, n in enumerate(lengths)]
    padded = [pad_with_length(p, longest) for p in parts]
    size = part_bytes(longest, torch.Size(row), dtype)
    assert size % HEADER_BYTES == 0
    for p in padded:
        assert p.dtype == torch.uint8 and p.shape == (size,)
    stacked = torch.stack(padded)  # what the all-gather of the padded parts returns
    bodies, got = unpad_with_lengths(stacked, longest, torch.Size(row), dtype)
    assert got == lengths
    assert bodies.shape == (len(lengths), longest, *row) and bodies.dtype == dtype
    for body, part, n in zip(bodies, parts, lengths):
        assert torch.equal(body[:n], part)
        assert not body[n:].any()  # the padding is zeros: the same bytes on every rank


def test_a_strided_part_is_padded_by_its_values():
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    part = base.t()  # (4, 3), not contiguous
    bodies, lengths = unpad_with_lengths(
        torch.stack([pad_with_length(part, 6)]), 6, torch.Size([3]), torch.float32
    )
    assert lengths == [4]
    assert torch.equal(bodies[0, :4], part)


def test_lengths_that_disagree_raise_naming_both():
    check_lengths("sizes=[2, 3]", [2, 3], [2, 3])
    with pytest.raises(GroupcoordValueError) as caught:
        check_lengths("sizes=[1, 3]", [1, 3], [2, 3], " along dim 0")
    assert str(caught.value) == "sizes=[1, 3] but the ranks' parts have [2, 3] along dim 0"
