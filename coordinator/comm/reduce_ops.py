"""Reduction operators of :mod:`coordinator.comm` and how each maps onto Gloo.

Gloo reduces natively with SUM, PRODUCT, MIN, MAX, BAND, BOR and BXOR. Two
operators are emulated so that they mean the same on every torch version:
``AVG`` runs a SUM and then divides the result by the group size (floating
and complex dtypes only: an integer average would silently truncate), and
``PREMUL_SUM(factor)`` multiplies the input by ``factor`` and then runs a SUM
(Gloo refuses c10d's PREMUL_SUM outright).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..errors import GroupcoordTypeError

_BITWISE = frozenset({"BAND", "BOR", "BXOR"})
_FLOAT_ONLY = frozenset({"AVG", "PREMUL_SUM"})


class RedOpType(enum.Enum):
    """The kinds of reduction (torchcomms' ``RedOpType``); ``ReduceOp.type``."""

    SUM = "SUM"
    PRODUCT = "PRODUCT"
    MIN = "MIN"
    MAX = "MAX"
    BAND = "BAND"
    BOR = "BOR"
    BXOR = "BXOR"
    PREMUL_SUM = "PREMUL_SUM"
    AVG = "AVG"


class ReduceOp:
    """One reduction: the class constants, :meth:`PREMUL_SUM`, or ``ReduceOp(RedOpType.X)``."""

    __slots__ = ("name", "factor")

    SUM: ClassVar[ReduceOp]
    PRODUCT: ClassVar[ReduceOp]
    MIN: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]
    AVG: ClassVar[ReduceOp]
    BAND: ClassVar[ReduceOp]
    BOR: ClassVar[ReduceOp]
    BXOR: ClassVar[ReduceOp]

    def __init__(self, opType: RedOpType | str, factor: float | None = None) -> None:  # noqa: N803 - torchcomms' name
        kind = RedOpType(opType.value if isinstance(opType, RedOpType) else opType)
        if kind is RedOpType.PREMUL_SUM and factor is None:
            raise GroupcoordTypeError("PREMUL_SUM needs a factor: use ReduceOp.PREMUL_SUM(factor)")
        self.name = kind.value
        self.factor = factor

    @property
    def type(self) -> RedOpType:
        return RedOpType(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReduceOp) and (self.name, self.factor) == (
            other.name,
            other.factor,
        )

    def __hash__(self) -> int:
        return hash((self.name, self.factor))

    @staticmethod
    def PREMUL_SUM(factor: float | torch.Tensor) -> ReduceOp:  # noqa: N802 - the name c10d users know
        """Sum of ``factor * x`` over ranks; ``factor`` a number or a one-element tensor."""
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1 or factor.is_complex():
                raise GroupcoordTypeError(
                    f"PREMUL_SUM factor tensor must hold one real number, got "
                    f"{factor.dtype}{list(factor.shape)}"
                )
            factor = float(factor.item())
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise GroupcoordTypeError(
                f"PREMUL_SUM factor must be a number or a one-element tensor, "
                f"got {type(factor).__name__}"
            )
        return ReduceOp(RedOpType.PREMUL_SUM, float(factor))

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
        if self.name in _FLOAT_ONLY and not (dtype.is_floating_point or dtype.is_complex):
            raise GroupcoordTypeError(
                f"{argument}: {self!r} needs a floating or complex dtype, got {dtype}"
            )

    def premultiply(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor to send: scaled for PREMUL_SUM (a new tensor), else itself."""
        if self.factor is None:
            return tensor
        return tensor * self.factor

    def finish(self, result: torch.Tensor, group_size: int) -> None:
        """Complete an emulated reduction in place on the reduced result."""
        if self.name == "AVG":  # a complex one's parts apart, as GroupCoordinator's AVG
            (torch.view_as_real(result) if result.is_complex() else result).div_(group_size)


ReduceOp.SUM = ReduceOp(RedOpType.SUM)
ReduceOp.PRODUCT = ReduceOp(RedOpType.PRODUCT)
ReduceOp.MIN = ReduceOp(RedOpType.MIN)
ReduceOp.MAX = ReduceOp(RedOpType.MAX)
ReduceOp.AVG = ReduceOp(RedOpType.AVG)
ReduceOp.BAND = ReduceOp(RedOpType.BAND)
ReduceOp.BOR = ReduceOp(RedOpType.BOR)
ReduceOp.BXOR = ReduceOp(RedOpType.BXOR)
