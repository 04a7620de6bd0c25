"""Reduction operators of :mod:`coordinator.comm` and how each maps onto Gloo.

Gloo reduces natively with SUM, PRODUCT, MIN, MAX, BAND, BOR and BXOR. Two
operators are emulated so that they mean the same on every torch version:
``AVG`` runs a SUM and then divides the result by the group size (floating
dtypes only: an integer average would silently truncate), and
``PREMUL_SUM(factor)`` multiplies the input by ``factor`` and then runs a SUM
(Gloo refuses c10d's PREMUL_SUM outright).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..errors import GroupcoordTypeError

_BITWISE = frozenset({"BAND", "BOR", "BXOR"})
_FLOAT_ONLY = frozenset({"AVG", "PREMUL_SUM"})


@dataclasses.dataclass(frozen=True)
class ReduceOp:
    """One reduction; use the class constants or :meth:`PREMUL_SUM`."""

    name: str
    factor: float | None = None

    SUM: ClassVar[ReduceOp]
    PRODUCT: ClassVar[ReduceOp]
    MIN: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]
    AVG: ClassVar[ReduceOp]
    BAND: ClassVar[ReduceOp]
    BOR: ClassVar[ReduceOp]
    BXOR: ClassVar[ReduceOp]

    @staticmethod
    def PREMUL_SUM(factor: float) -> ReduceOp:  # noqa: N802 - the name c10d users know
        """Sum of ``factor * x`` over ranks."""
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise GroupcoordTypeError(
                f"PREMUL_SUM factor must be a Python int or float, got {type(factor).__name__}"
            )
        return ReduceOp("PREMUL_SUM", float(factor))

    def __repr__(self) -> str:
        if self.factor is not None:
            return f"ReduceOp.PREMUL_SUM({self.factor:g})"
        return f"ReduceOp.{self.name}"

    def c10d_op(self) -> Any:
        """The Gloo operator that actually runs (SUM for the emulated ones)."""
        if self.name in _FLOAT_ONLY:
            return dist.ReduceOp.SUM
        return getattr(dist.ReduceOp, self.name)

    def check_dtype(self, dtype: torch.dtype, argument: str) -> None:
        """Refuse a dtype this operator cannot reduce, naming the argument."""
        if self.name in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
            raise GroupcoordTypeError(
                f"{argument}: {self!r} needs an integer or bool dtype, got {dtype}"
            )
        if self.name in _FLOAT_ONLY and not dtype.is_floating_point:
            raise GroupcoordTypeError(f"{argument}: {self!r} needs a floating dtype, got {dtype}")

    def premultiply(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor to send: scaled for PREMUL_SUM (a new tensor), else itself."""
        if self.factor is None:
            return tensor
        return tensor * self.factor

    def finish(self, result: torch.Tensor, group_size: int) -> None:
        """Complete an emulated reduction in place on the reduced result."""
        if self.name == "AVG":
            result.div_(group_size)


ReduceOp.SUM = ReduceOp("SUM")
ReduceOp.PRODUCT = ReduceOp("PRODUCT")
ReduceOp.MIN = ReduceOp("MIN")
ReduceOp.MAX = ReduceOp("MAX")
ReduceOp.AVG = ReduceOp("AVG")
ReduceOp.BAND = ReduceOp("BAND")
ReduceOp.BOR = ReduceOp("BOR")
ReduceOp.BXOR = ReduceOp("BXOR")
