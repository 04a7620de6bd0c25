"""Argument checks run before anything is sent, so a bad call leaves the comm usable.

Each check raises :class:`GroupcoordTypeError` or :class:`GroupcoordValueError`
naming the argument (``tensor``, ``output_split_sizes`` ...) and what was wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import GroupcoordTypeError, GroupcoordValueError


def tensor(value: Any, argument: str, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise GroupcoordTypeError(f"{argument} must be a torch.Tensor, got {type(value).__name__}")
    if value.device != device:
        raise GroupcoordValueError(
            f"{argument} is on {value.device} but the communicator runs on {device}"
        )
    if not value.is_contiguous():
        raise GroupcoordValueError(f"{argument} must be contiguous (call .contiguous() first)")
    if value.is_sparse:
        raise GroupcoordTypeError(f"{argument} must be a dense tensor")
    return value


def tensor_list(
    value: Any, argument: str, device: torch.device, length: int | None
) -> list[torch.Tensor]:
    if not isinstance(value, list | tuple):
        raise GroupcoordTypeError(
            f"{argument} must be a list of tensors, got {type(value).__name__}"
        )
    if length is not None and len(value) != length:
        raise GroupcoordValueError(
            f"{argument} must hold one tensor per rank ({length}), got {len(value)}"
        )
    return [tensor(t, f"{argument}[{i}]", device) for i, t in enumerate(value)]


def same_dtype(reference: torch.Tensor, others: Sequence[torch.Tensor], argument: str) -> None:
    for i, other in enumerate(others):
        if other.dtype != reference.dtype:
            raise GroupcoordTypeError(
                f"{argument}[{i}] has dtype {other.dtype}, expected {reference.dtype}"
            )


def dtype_match(a: torch.Tensor, b: torch.Tensor, a_name: str, b_name: str) -> None:
    if a.dtype != b.dtype:
        raise GroupcoordTypeError(
            f"{a_name} has dtype {a.dtype} but {b_name} has dtype {b.dtype}; they must match"
        )


def numel(value: torch.Tensor, expected: int, argument: str, why: str) -> None:
    if value.numel() != expected:
        raise GroupcoordValueError(
            f"{argument} has {value.numel()} elements, expected {expected} ({why})"
        )


def same_shape(tensors: Sequence[torch.Tensor], reference: torch.Tensor, argument: str) -> None:
    for i, t in enumerate(tensors):
        if t.shape != reference.shape:
            raise GroupcoordValueError(
                f"{argument}[{i}] has shape {tuple(t.shape)}, expected {tuple(reference.shape)}"
            )


def rank(value: Any, argument: str, size: int, self_rank: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GroupcoordTypeError(f"{argument} must be an int rank, got {type(value).__name__}")
    if not 0 <= value < size:
        raise GroupcoordValueError(f"{argument}={value} is out of range for a group of {size}")
    if self_rank is not None and value == self_rank:
        raise GroupcoordValueError(f"{argument}={value} is this rank itself")
    return value


def split_sizes(value: Any, argument: str, size: int, total: int, dim0_name: str) -> list[int]:
    if not isinstance(value, list | tuple):
        raise GroupcoordTypeError(f"{argument} must be a list of ints, got {type(value).__name__}")
    if len(value) != size:
        raise GroupcoordValueError(
            f"{argument} must have one entry per rank ({size}), got {len(value)}"
        )
    sizes = []
    for i, s in enumerate(value):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise GroupcoordValueError(f"{argument}[{i}]={s!r} must be a non-negative int")
        sizes.append(s)
    if sum(sizes) != total:
        raise GroupcoordValueError(
            f"{argument} sums to {sum(sizes)} but {dim0_name} has {total} rows along dim 0"
        )
    return sizes


def hints(value: Any, argument: str = "hints") -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise GroupcoordTypeError(f"{argument} must be a mapping of str to str")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise GroupcoordTypeError(f"{argument} must map str to str, got {key!r}: {item!r}")
    return dict(value)


def flag(value: Any, argument: str) -> bool:
    if not isinstance(value, bool):
        raise GroupcoordTypeError(f"{argument} must be a bool, got {type(value).__name__}")
    return value
