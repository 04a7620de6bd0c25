"""The argument checks of every public entry point, in one place.

``GroupCoordinator``, the device communicators, ``Comm``, ``StatelessProcessGroup``
and PyNccl all check their arguments with these functions, before anything is
sent, so a bad call leaves the group usable and the same mistake gets the same
answer everywhere. Each check raises :class:`GroupcoordTypeError` (wrong type)
or :class:`GroupcoordValueError` (wrong value) naming the argument and what
was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shm_broadcast.array_frames import not_its_values

from .errors import GroupcoordTypeError, GroupcoordValueError

__all__ = [
    "dict_tensor",
    "dim",
    "dtype_match",
    "flag",
    "hints",
    "numel",
    "overlap",
    "rank",
    "reduce_op",
    "same_dtype",
    "same_shape",
    "sizes",
    "split_sizes",
    "tensor",
    "traced_tensor",
    "tensor_list",
    "write_into",
]


def traced_tensor(value: Any, argument: str) -> torch.Tensor:
    """``value`` if it is a dense tensor: the checks of :func:`tensor` that
    torch.compile can trace, for an entry point that may run under it and hands the
    tensor on to a communicator, which checks it in full."""
    if not isinstance(value, torch.Tensor):
        raise GroupcoordTypeError(f"{argument} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout is not torch.strided:
        raise GroupcoordTypeError(
            f"{argument} must be a dense (strided) tensor, got layout {value.layout}"
        )
    return value


def tensor(
    value: Any, argument: str, device: torch.device | None = None, *, contiguous: bool = False
) -> torch.Tensor:
    """``value`` if it is a dense tensor whose memory holds its values (on ``device``:
    same type, and same index unless CPU; contiguous when asked, as in-place
    transports need), detached when it requires grad: a collective is not
    differentiable, and autograd recording its copies into shared memory made the
    path's cached views require grad (every later reduction raised). An
    ``nn.Parameter`` (or subclass: an engine's weights) is detached too, to the
    plain tensor the other ranks may pass: the lean path takes only plain tensors,
    and a rank that left it for a Parameter made another call than its peers. The
    detached tensor shares ``value``'s memory, so in-place calls still fill
    ``value``."""
    traced_tensor(value, argument)
    if type(value) is not _Tensor:
        problem = not_its_values(type(value))
        if problem is not None:
            raise GroupcoordTypeError(f"{argument} is {problem}")
    _not_nested(value, argument)
    if value.is_conj() or value.is_neg():
        # Its memory holds other values than it reads as: every path that moves
        # memory (shared memory, c10d) would return those (torch.distributed refuses
        # a conjugate view too).
        kind = "conjugate" if value.is_conj() else "negative"
        raise GroupcoordValueError(
            f"{argument} is a lazy {kind} view, whose memory does not hold its values: "
            f"pass {argument}.resolve_conj() (or .resolve_neg())"
        )
    if device is not None and not _on_device(value, device):
        raise GroupcoordValueError(
            f"{argument} is on {value.device} but this group works on {device}"
        )
    if contiguous and not value.is_contiguous():
        raise GroupcoordValueError(f"{argument} must be contiguous (call .contiguous() first)")
    if value.requires_grad or (type(value) is not _Tensor and isinstance(value, _Parameter)):
        return value.detach()  # (Parameter's isinstance is Python: plain tensors skip it)
    return value


def _not_nested(value: torch.Tensor, argument: str) -> None:
    if value.is_nested:
        raise GroupcoordTypeError(
            f"{argument} is a nested tensor, which has no one shape: pass its components "
            "(unbind()) or a padded tensor"
        )


def dict_tensor(value: torch.Tensor, argument: str, device: torch.device) -> None:
    """A tensor a tensor dict may carry: dense (not sparse, not mkldnn), not nested, and
    on the CPU or the group's ``device`` (a CPU group's dict takes no CUDA or meta
    tensor), checked before any of the dict is sent."""
    traced_tensor(value, argument)
    _not_nested(value, argument)
    if not value.is_cpu and not _on_device(value, device):
        where = "CPU tensors only" if device.type == "cpu" else f"tensors on the CPU and {device}"
        raise GroupcoordValueError(f"{argument} is on {value.device}, but this group moves {where}")


def _on_device(value: torch.Tensor, device: torch.device) -> bool:
    # Every call's path: reading value.device costs ~0.5 us, device.type 0.25 us,
    # comparing with a CPU device 0.02 us.
    if device == _CPU or device.type == "cpu":
        return value.is_cpu
    # cuda:1 vs cuda:0 matters; "cpu" vs "cpu:0" does not.
    here = value.device
    return here.type == device.type and (device.index is None or here.index == device.index)


def tensor_list(
    value: Any,
    argument: str,
    device: torch.device | None,
    length: int | None,
    *,
    contiguous: bool = False,
) -> list[torch.Tensor]:
    """``value`` as a list of checked tensors (``length`` of them when given)."""
    if not isinstance(value, list | tuple):
        raise GroupcoordTypeError(
            f"{argument} must be a list of tensors, got {type(value).__name__}"
        )
    if length is not None and len(value) != length:
        raise GroupcoordValueError(
            f"{argument} must hold one tensor per rank ({length}), got {len(value)}"
        )
    return [
        tensor(t, f"{argument}[{i}]", device, contiguous=contiguous) for i, t in enumerate(value)
    ]


def dim(value: torch.Tensor, d: Any, argument: str = "dim") -> int:
    """``d`` as a non-negative dimension of ``value`` (a 0-d tensor has none)."""
    if isinstance(d, bool) or not isinstance(d, int):
        raise GroupcoordTypeError(f"{argument} must be an int, got {d!r}")
    if not -value.dim() <= d < value.dim():
        raise GroupcoordValueError(
            f"{argument}={d} is out of range for a tensor with {value.dim()} dims"
        )
    return d % value.dim()


def rank(
    value: Any, argument: str, size: int, self_rank: int | None = None, what: str = "this group"
) -> int:
    """``value`` if it is a rank of a group of ``size`` (and not ``self_rank`` when given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise GroupcoordTypeError(f"{argument} must be an int rank, got {value!r}")
    if not 0 <= value < size:
        raise GroupcoordValueError(
            f"{argument}={value} is not a rank of {what} (out of range for size {size})"
        )
    if self_rank is not None and value == self_rank:
        raise GroupcoordValueError(f"{argument}={value} is this rank itself")
    return value


_REDUCE_OP_TYPES = (dist.ReduceOp, dist.ReduceOp.RedOpType)
_Parameter = torch.nn.Parameter
_Tensor = torch.Tensor
_CPU = torch.device("cpu")
_BITWISE_OPS = (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)


def reduce_op(value: Any, dtype: torch.dtype, argument: str = "op") -> Any:
    """``value`` if it is a ``torch.distributed.ReduceOp`` that can reduce ``dtype``:
    bitwise ops take integers and bool, AVG floating and complex dtypes, and a
    complex tensor reduces by SUM or AVG only (its real and imaginary parts would
    be reduced apart)."""
    if not isinstance(value, _REDUCE_OP_TYPES):
        raise GroupcoordTypeError(
            f"{argument} must be a torch.distributed.ReduceOp, got {type(value).__name__}"
        )
    inexact = dtype.is_floating_point or dtype.is_complex
    if value in _BITWISE_OPS and inexact:
        raise GroupcoordTypeError(
            f"{argument}={value}: needs an integer or bool dtype, got {dtype}"
        )
    if value == dist.ReduceOp.AVG and not inexact:
        raise GroupcoordTypeError(
            f"{argument}={value}: needs a floating or complex dtype (an integer mean would "
            f"truncate), got {dtype}"
        )
    if dtype.is_complex and value not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise GroupcoordValueError(
            f"{argument}={value}: a {dtype} tensor can only be reduced with SUM or AVG "
            "(its real and imaginary parts would be reduced apart)"
        )
    return value


def overlap(
    output: torch.Tensor, input: torch.Tensor, rank_part: tuple[int, int] | None = None
) -> bool:
    """Whether ``output`` shares memory with ``input`` (both contiguous), which a call
    that writes one while the peers still read the other cannot take as it is (wrong
    values, or a broken call, until the twenty-eighth session): the caller copies the
    input first. ``rank_part=(size, rank)``: the in-place idiom of torch.distributed,
    the smaller tensor exactly part ``rank`` of ``size`` equal parts of the larger
    (all_gather's input, reduce_scatter's output), which every path takes as it is."""
    o, i = output.data_ptr(), input.data_ptr()
    if not (output.nbytes and input.nbytes and o < i + input.nbytes and i < o + output.nbytes):
        return False
    if rank_part is None:
        return True
    size, rank = rank_part
    part, whole = (input, output) if input.nbytes < output.nbytes else (output, input)
    exact = part.nbytes * size == whole.nbytes
    return not (exact and part.data_ptr() == whole.data_ptr() + rank * part.nbytes)


def sizes(value: Any, argument: str, size: int) -> list[int]:
    """``value`` as one non-negative int per rank."""
    if not isinstance(value, list | tuple):
        raise GroupcoordTypeError(f"{argument} must be a list of ints, got {type(value).__name__}")
    if len(value) != size:
        raise GroupcoordValueError(
            f"{argument} must have one entry per rank ({size}), got {len(value)}"
        )
    for i, s in enumerate(value):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise GroupcoordValueError(f"{argument}[{i}]={s!r} must be a non-negative int")
    return list(value)


def equal_split(sizes: Any, tensor: torch.Tensor, dim: Any, world: int) -> bool:
    """Whether a ``reduce_scatterv``'s ``sizes`` cut ``tensor`` along ``dim`` into
    ``world`` equal parts (None: the equal cut), which makes it a ``reduce_scatter``:
    the same fingerprint (an equal cut stamps none) and its lean path."""
    if sizes is None:
        return True
    return (
        type(sizes) is list
        and len(sizes) == world
        and type(dim) is int
        and -tensor.dim() <= dim < tensor.dim()
        and type(sizes[0]) is int
        and sizes.count(sizes[0]) == world
        and sizes[0] * world == tensor.shape[dim]
    )


def split_sizes(value: Any, argument: str, size: int, total: int, of: str) -> list[int]:
    """:func:`sizes` that also add up to ``total``, the length of ``of`` being split."""
    out = sizes(value, argument, size)
    if sum(out) != total:
        raise GroupcoordValueError(f"{argument} sums to {sum(out)} but {of} has {total}")
    return out


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


def write_into(output: Any, result: torch.Tensor) -> torch.Tensor:
    """``result`` copied into the caller's ``output`` (the ``*_into_output`` methods),
    which must match it; returns ``output``."""
    tensor(output, "output")
    if output.shape != result.shape or output.dtype != result.dtype:
        raise GroupcoordValueError(
            f"output must be {result.dtype}{list(result.shape)}, got "
            f"{output.dtype}{list(output.shape)}"
        )
    return output.copy_(result)


def group_ranks(group: Any, global_ranks: list[int] | None) -> list[int]:
    """The global ranks of ``group``'s members, in in-group order.

    A group in torch's registry answers itself (``global_ranks``, when given,
    must agree); a standalone Gloo backend (a ``coordinator.comm`` communicator
    builds one) is numbered by ``global_ranks``.
    """
    try:
        registered: list[int] | None = dist.get_process_group_ranks(group)
    except KeyError:  # not in torch's registry
        registered = None
    if global_ranks is None:
        if registered is None:
            raise GroupcoordValueError(
                "cpu_group is not a group torch.distributed knows; pass global_ranks "
                "(the global rank of each of its members, in order)"
            )
        return registered
    given = list(global_ranks)
    if registered is not None and given != registered:
        raise GroupcoordValueError(f"global_ranks={given} but cpu_group holds ranks {registered}")
    if len(given) != group.size():
        raise GroupcoordValueError(
            f"global_ranks={given} names {len(given)} ranks, cpu_group has {group.size()}"
        )
    return given
