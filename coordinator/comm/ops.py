"""Moving operations of a communicator: broadcast, all_gather (single, v),
all_to_all (single, v), gather, scatter, send and recv. On CPU, broadcast and
all_gather take the shared-memory lane when the back end takes the tensor.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from device_communicators import c10d_calls, checks
from device_communicators.padded_parts import check_lengths, pad_with_length, unpad_with_lengths
from device_communicators.shm_all_reduce import ShmAllReduce
from device_communicators.shm_phases import check_all_to_all_counts
from device_communicators.shm_reduce import OneTorchThread
from shm_broadcast.host_memory import empty_output

from ..errors import DesyncError, GroupcoordValueError
from .reductions import Reductions
from .work import Work


class CommOps(Reductions):
    """Every operation of :class:`~coordinator.comm.comm.Comm`: what helpers
    (windows, batches, split, object collectives) are written against."""

    def broadcast(
        self,
        tensor: torch.Tensor,
        root: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        tensor = self._tensor(tensor, "tensor")
        root = checks.rank(root, "root", self._size)
        if async_op is False and hints is None and timeout is None:
            done = self._lean("broadcast", lambda small: small.broadcast(tensor, root), tensor)
            if done is not None:
                return done

        def launch(td: datetime.timedelta) -> list[Any]:
            return [c10d_calls.broadcast(self._pg, tensor, root, td)]

        def fast(shm: ShmAllReduce) -> None:
            shm.broadcast_(tensor, root)

        return self._run(
            "broadcast",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            fast=fast if self._shm_takes(tensor, "broadcast") else None,
            call=("broadcast", tensor.dtype, None, root, tensor.numel()),
        )

    def _allgather(
        self,
        op: str,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | datetime.timedelta | None,
        stacked: torch.Tensor | None = None,
    ) -> Work:
        """``outputs[i]`` gets rank ``i``'s ``tensor``; ``stacked`` (when given) is one
        contiguous tensor holding every output in rank order, for the shm path."""

        def launch(td: datetime.timedelta) -> list[Any]:
            return [c10d_calls.all_gather(self._pg, outputs, tensor, td)]

        def fast(shm: ShmAllReduce) -> None:
            if stacked is not None:
                shm.all_gather(tensor, out=stacked, flat=True)
                return
            every = shm.all_gather(tensor, flat=True)
            with OneTorchThread(every.nbytes):  # as the back end's own copies
                for output, part in zip(outputs, every.unbind(0)):
                    output.copy_(part)

        return self._run(
            op,
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            fast=fast if self._shm_takes(tensor, "all_gather") else None,
            call=("all_gather", tensor.dtype, None, 0, tensor.numel()),
        )

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        if async_op is False and hints is None and timeout is None and type(tensor_list) is list:
            done = self._lean(
                "all_gather",
                lambda small: self._lean_parts(
                    tensor_list, tensor, lambda: small.all_gather(tensor.view(-1), 0, flat=True)
                ),
                tensor,
                *tensor_list,
            )
            if done is not None:
                return done
        tensor = self._tensor(tensor, "tensor")
        outputs = self._per_rank(tensor_list, "tensor_list", tensor)
        return self._allgather("all_gather", outputs, tensor, async_op, hints, timeout)

    def _lean_parts(
        self,
        outputs: list[torch.Tensor] | None,
        tensor: torch.Tensor,
        gathered: Callable[[], torch.Tensor | None],
    ) -> bool | None:
        """A synchronous ``all_gather`` or ``gather`` into a list on the caller's thread
        (``_lean``: plain dense tensors, the lane idle): ``gathered()`` runs the lean
        call (every rank's ``tensor`` in rank order, flat; None: not taken, nothing
        ran), and each part is copied into its output (None: a gather's other
        ranks). None, with nothing run, for arguments the general path checks (and
        raises for): every output must be a CPU tensor of ``tensor``'s dtype and
        shape that autograd does not track."""
        if not tensor.is_cpu or not self._shm_takes(tensor, "all_gather"):
            return None
        if outputs is not None and (
            len(outputs) != self._size
            or any(
                t.dtype != tensor.dtype
                or t.shape != tensor.shape
                or not t.is_cpu
                or t.requires_grad
                or t.is_conj()
                or t.is_neg()
                for t in outputs
            )
        ):
            return None
        got = gathered()
        if got is None:
            return None
        if outputs is not None:
            at, nbytes = got.data_ptr(), tensor.nbytes
            for t in outputs:
                ctypes.memmove(t.data_ptr(), at, nbytes)
                at += nbytes
        return True

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Gather every rank's ``input`` into ``output``, concatenated in rank order."""
        if async_op is False and hints is None and timeout is None:
            done = self._lean(
                "all_gather_single",
                lambda small: small.all_gather(input, 0, output, flat=True),
                input,
                output,
            )
            if done is not None:
                return done
        input = self._tensor(input, "input")
        output = self._tensor(output, "output")
        checks.dtype_match(output, input, "output", "input")
        checks.numel(output, self._size * input.numel(), "output", "size * input.numel()")
        if checks.overlap(output, input, (self._size, self._rank)):
            input = input.clone()  # written while the peers still read it
        stacked = output.view(self._size, input.numel())
        return self._allgather(
            "all_gather_single",
            list(stacked.unbind(0)),
            input.view(-1),
            async_op,
            hints,
            timeout,
            stacked=stacked,
        )

    def all_gather_v(
        self,
        output_list: list[torch.Tensor],
        input: torch.Tensor,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """All-gather where rank ``i`` contributes ``output_list[i].numel()`` elements."""
        if async_op is False and hints is None and timeout is None and type(output_list) is list:
            done = self._lean(
                "all_gather_v",
                lambda small: self._lean_gather_v(output_list, input),
                input,
                *output_list,
            )
            if done is not None:
                return done
        input = self._tensor(input, "input")
        outputs = self._tensors(output_list, "output_list", self._size)
        checks.same_dtype(input, outputs, "output_list")
        checks.numel(
            outputs[self._rank], input.numel(), f"output_list[{self._rank}]", "this rank's input"
        )
        # Gloo's allgather needs equal sizes: the ranks first learn every rank's
        # true count and the counts its output_list expects, so ranks whose
        # output_lists differ all raise before anything moves; then every part
        # travels padded to the longest with its count in front (padded_parts). The
        # shared-memory path learns the counts in its first barrier, whose stamps
        # carry the expected counts (SmallCalls.gather_v), and parts that fit a slot
        # move in it.
        staged: list[Any] = []  # (every rank's padded part, longest), made when launched
        counts = [t.numel() for t in outputs]

        def launch(td: datetime.timedelta) -> list[Any]:
            call = ("all_gather", input.dtype, None, 0, input.numel())
            rows = self._agree(call, td, [input.numel(), *counts], self._check_gather_v)
            lengths = [row[0] for row in rows]
            longest = max(lengths)
            padded, stacked = self._padded_parts(input, longest)
            staged[:] = [stacked, longest]
            return [c10d_calls.all_gather(self._pg, list(stacked.unbind(0)), padded, td)]

        return self._run(
            "all_gather_v",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            lambda: self._unpad_into(outputs, input.dtype, *staged),
            fast=(
                (lambda shm: self._shm_gather_v(shm, outputs, input))
                if self._shm_takes(input, "all_gather")
                else None
            ),
        )

    def _lean_gather_v(self, outputs: list[torch.Tensor], input: torch.Tensor) -> bool | None:
        """A synchronous ``all_gather_v`` on the caller's thread (``_lean``: plain dense
        tensors, the lane idle); None, with nothing run, for arguments the general
        path checks (and raises for)."""
        lane = self._lane
        assert lane is not None  # _lean runs this only with a lane
        if (
            len(outputs) != self._size
            or not input.is_cpu
            or outputs[self._rank].numel() != input.numel()
            or any(
                t.dtype != input.dtype or not t.is_cpu or t.is_conj() or t.is_neg() for t in outputs
            )
            or not self._shm_takes(input, "all_gather")
        ):
            return None
        self._shm_gather_v(lane.shm, outputs, input)
        return True

    def _shm_gather_v(
        self, shm: ShmAllReduce, outputs: list[torch.Tensor], input: torch.Tensor
    ) -> None:
        """``all_gather_v`` on the shared-memory back end: the counts (and parts that fit
        a slot) in one barrier, larger parts padded to the true longest after it."""
        counts = [t.numel() for t in outputs]
        # Parts that fit their slots go straight into the (contiguous) outputs.
        done = shm.small.gather_v(input.reshape(-1), 0, into=outputs, sizes=counts)
        if done is not None and done.moved:
            self._check_counts(counts, done.lengths)  # (the stamps compared them by checksum)
            return
        if done is not None and done.lengths.count(input.numel()) == self._size:
            # Equal parts (the common call): gathered as they are, no padding.
            stacked = empty_output((self._size, input.numel()), input.dtype)
            shm.all_gather(input.reshape(-1), out=stacked, flat=True)
            self._check_counts(counts, done.lengths)
            with OneTorchThread(stacked.nbytes):  # as the back end's own copies
                for out, part in zip(outputs, stacked.unbind(0)):
                    out.view(-1).copy_(part)
            return
        # Every rank pads to the same longest part: the true one where it is known.
        longest = max(counts if done is None else done.lengths)
        padded, stacked = self._padded_parts(input, longest)
        shm.all_gather(padded, out=stacked, flat=True)
        self._unpad_into(outputs, input.dtype, stacked, longest)

    def _padded_parts(self, input: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's input padded to ``longest`` (its count in front), and the bytes
        every rank's such part is gathered into."""
        padded = pad_with_length(input.reshape(-1), longest)
        return padded, torch.empty(self._size, padded.numel(), dtype=torch.uint8)

    def _unpad_into(
        self,
        outputs: list[torch.Tensor],
        dtype: torch.dtype,
        stacked: torch.Tensor,
        longest: int,
    ) -> None:
        parts, lengths = unpad_with_lengths(stacked, longest, torch.Size(), dtype)
        self._check_counts([t.numel() for t in outputs], lengths)
        with OneTorchThread(stacked.nbytes):  # as the back end's own copies
            for out, part, n in zip(outputs, parts, lengths):
                out.view(-1).copy_(part[:n])

    def _check_gather_v(self, rows: list[list[int]]) -> None:
        """Every rank's output_list holds the parts the ranks bring (``rows``: each
        rank's part, then what its output_list expects by rank; the same table on
        every rank, so every rank raises)."""
        lengths = [row[0] for row in rows]
        for r, row in enumerate(rows):
            if row[1:] != lengths:
                raise DesyncError(
                    f"communicator {self._name!r}: all_gather_v: rank {r}'s output_list "
                    f"holds {row[1:]} elements by rank, the ranks' parts have {lengths}"
                )

    @staticmethod
    def _check_counts(counts: list[int], lengths: list[int]) -> None:
        check_lengths("output_list holds {} elements by rank", counts, lengths)

    def _alltoall_base(
        self,
        name: str,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | datetime.timedelta | None,
        finish: Callable[[], None] | None = None,
        fast: Callable[[ShmAllReduce], None] | None = None,
    ) -> Work:
        """An all-to-all; with splits (the ``_v`` forms) the ranks first agree on
        every pair's counts (:meth:`_agree`), else on the call when debugging."""

        def launch(td: datetime.timedelta) -> list[Any]:
            if output_splits:  # sizes that are data: Gloo aborts on a pair that disagrees
                row = input.shape[1:].numel()
                counts = [n * row for n in (*input_splits, *output_splits)]
                call = ("all_to_all_v", input.dtype, None, 0, sum(counts))
                what = f"communicator {self._name!r}"
                self._agree(call, td, counts, functools.partial(check_all_to_all_counts, what))
            return [c10d_calls.all_to_all(self._pg, output, input, output_splits, input_splits, td)]

        call = None if output_splits else ("all_to_all", input.dtype, None, 0, input.numel())
        return self._run(
            name, self._others(), timeout, async_op, hints, launch, finish, fast=fast, call=call
        )

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Send ``input_tensor_list[i]`` to rank ``i``; receive rank ``i``'s into ``output_tensor_list[i]``.

        Sizes may differ per peer; each ``output_tensor_list[i]`` must match what rank
        ``i`` sends. Runs as one alltoall over flat staging buffers.
        """
        inputs = self._tensors(input_tensor_list, "input_tensor_list", self._size)
        outputs = self._tensors(output_tensor_list, "output_tensor_list", self._size)
        checks.same_dtype(inputs[0], inputs[1:], "input_tensor_list")
        checks.same_dtype(inputs[0], outputs, "output_tensor_list")
        # The staging copies on one torch thread, as the back end's own.
        with OneTorchThread(sum(t.nbytes for t in inputs)):
            staged_in = torch.cat([t.view(-1) for t in inputs])
        staged_out = torch.empty(sum(t.numel() for t in outputs), dtype=inputs[0].dtype)

        def finish() -> None:
            offset = 0
            with OneTorchThread(staged_out.nbytes):
                for t in outputs:
                    t.view(-1).copy_(staged_out[offset : offset + t.numel()])
                    offset += t.numel()

        out_counts, in_counts = [t.numel() for t in outputs], [t.numel() for t in inputs]

        def fast(shm: ShmAllReduce) -> None:
            shm.all_to_all_v(staged_in, staged_out, in_counts, out_counts)
            finish()

        taken = fast if self._shm_takes(staged_in, "all_gather") else None
        done = self._shm_now("all_to_all", taken, async_op, hints, timeout, staged_in, staged_out)
        if done is not None:
            return done
        return self._alltoall_base(
            "all_to_all",
            staged_out,
            staged_in,
            out_counts,
            in_counts,
            async_op,
            hints,
            timeout,
            finish,
            fast=taken,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Equal split along dim 0: block ``i`` of ``input`` goes to rank ``i``."""
        input = self._tensor(input, "input")
        output = self._tensor(output, "output")
        checks.dtype_match(output, input, "output", "input")
        for tensor, argument in ((input, "input"), (output, "output")):
            if tensor.dim() == 0 or tensor.shape[0] % self._size:
                raise GroupcoordValueError(
                    f"{argument} dim 0 ({tuple(tensor.shape)}) must divide evenly "
                    f"among {self._size} ranks"
                )
        if output.shape != input.shape:
            raise GroupcoordValueError(
                f"output shape {tuple(output.shape)} must equal input shape {tuple(input.shape)}"
            )
        if checks.overlap(output, input):
            input = input.clone()  # written while the peers still read it

        def fast(shm: ShmAllReduce) -> None:
            shm.all_to_all(input, output)

        # Checked, then on the caller's thread (4 KiB at world 2: 80 -> 52 us).
        taken = fast if self._shm_takes(input, "all_gather") else None
        done = self._shm_now("all_to_all_single", taken, async_op, hints, timeout, input, output)
        if done is not None:
            return done
        return self._alltoall_base(
            "all_to_all_single",
            output,
            input,
            [],
            [],
            async_op,
            hints,
            timeout,
            fast=taken,
        )

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Uneven all-to-all along dim 0: ``input_split_sizes[i]`` rows go to rank ``i``."""
        input = self._tensor(input, "input")
        output = self._tensor(output, "output")
        checks.dtype_match(output, input, "output", "input")
        if input.dim() == 0 or output.dim() == 0:
            raise GroupcoordValueError("input and output need at least one dimension")
        if input.shape[1:] != output.shape[1:]:
            raise GroupcoordValueError(
                f"input rows {tuple(input.shape[1:])} and output rows "
                f"{tuple(output.shape[1:])} must have the same shape"
            )
        out_splits = checks.split_sizes(
            output_split_sizes, "output_split_sizes", self._size, output.shape[0], "output's dim 0"
        )
        in_splits = checks.split_sizes(
            input_split_sizes, "input_split_sizes", self._size, input.shape[0], "input's dim 0"
        )
        if checks.overlap(output, input):
            input = input.clone()  # written while the peers still read it
        row = input.shape[1:].numel()  # elements per row (input and output rows match)
        in_counts, out_counts = [n * row for n in in_splits], [n * row for n in out_splits]

        def fast(shm: ShmAllReduce) -> None:
            shm.all_to_all_v(input, output, in_counts, out_counts)

        # On the caller's thread when it can (4 KiB at world 2: 191 -> 88-94 us).
        taken = fast if self._shm_takes(input, "all_gather") else None
        done = self._shm_now("all_to_all_v_single", taken, async_op, hints, timeout, input, output)
        if done is not None:
            return done
        return self._alltoall_base(
            "all_to_all_v_single",
            output,
            input,
            out_splits,
            in_splits,
            async_op,
            hints,
            timeout,
            fast=taken,
        )

    def gather(
        self,
        output_tensor_list: list[torch.Tensor] | None,
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Gather every rank's ``input_tensor`` into ``output_tensor_list`` on ``root`` (ignored elsewhere)."""
        into = output_tensor_list if self._rank == root else None
        if async_op is False and hints is None and timeout is None and type(root) is int:
            if self._rank != root or type(into) is list:
                done = self._lean(
                    "gather",
                    lambda small: self._lean_parts(
                        into,
                        input_tensor,
                        lambda: small.gather(input_tensor.view(-1), root, flat=True),
                    ),
                    input_tensor,
                    *(into or ()),
                )
                if done is not None:
                    return done
        input_tensor = self._tensor(input_tensor, "input_tensor")
        root = checks.rank(root, "root", self._size)
        outputs: list[torch.Tensor] = []
        if self._rank == root:
            outputs = self._per_rank(output_tensor_list, "output_tensor_list", input_tensor)
        return self._gather(outputs, input_tensor, root, async_op, hints, timeout)

    def _gather(
        self,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: Mapping[str, str] | None,
        timeout: float | datetime.timedelta | None,
        stacked: torch.Tensor | None = None,
    ) -> Work:
        """``outputs[i]`` on ``root`` gets rank ``i``'s ``tensor``; ``stacked`` (the
        root's, when given) holds every output in rank order, for the shm path."""

        def launch(td: datetime.timedelta) -> list[Any]:
            return [c10d_calls.gather(self._pg, outputs, tensor, root, td)]

        def fast(shm: ShmAllReduce) -> None:
            if stacked is not None:
                shm.gather(tensor, root, out=stacked, flat=True)
                return
            got = shm.gather(tensor, root, flat=True)
            if got is not None:
                with OneTorchThread(got.nbytes):  # as the back end's own copies
                    for output, part in zip(outputs, got.unbind(0)):
                        output.copy_(part)

        return self._run(
            "gather",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            fast=fast if self._shm_takes(tensor, "all_gather") else None,
            call=("gather", tensor.dtype, None, root, tensor.numel()),
        )

    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Gather every rank's ``input`` into ``output`` (``size * input.numel()``
        elements, rank-major) on ``root``; ``output`` is ignored elsewhere."""
        if async_op is False and hints is None and timeout is None:
            into = output if self._rank == root else None
            done = self._lean(
                "gather", lambda small: small.gather(input, root, into, flat=True), input
            )
            if done is not None:
                return done
        input = self._tensor(input, "input")
        root = checks.rank(root, "root", self._size)
        if self._rank != root:
            return self._gather([], input, root, async_op, hints, timeout)
        output = self._tensor(output, "output")
        checks.dtype_match(output, input, "output", "input")
        checks.numel(output, self._size * input.numel(), "output", "size * input.numel()")
        parts = list(output.view(self._size, *input.shape).unbind(0))
        return self._gather(parts, input, root, async_op, hints, timeout, stacked=output)

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor] | None,
        root: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Send ``input_tensor_list[i]`` from ``root`` into rank ``i``'s ``output_tensor``."""
        output_tensor = self._tensor(output_tensor, "output_tensor")
        root = checks.rank(root, "root", self._size)
        inputs: list[torch.Tensor] = []
        if self._rank == root:
            inputs = self._per_rank(input_tensor_list, "input_tensor_list", output_tensor)

        def launch(td: datetime.timedelta) -> list[Any]:
            return [c10d_calls.scatter(self._pg, output_tensor, inputs, root, td)]

        def fast(shm: ShmAllReduce) -> None:
            shm.scatter(output_tensor, inputs if self._rank == root else None, root)

        taken = fast if self._shm_takes(output_tensor, "broadcast") else None
        done = self._shm_now("scatter", taken, async_op, hints, timeout, output_tensor)
        if done is not None:
            return done
        return self._run(
            "scatter",
            self._others(),
            timeout,
            async_op,
            hints,
            launch,
            fast=taken,
            call=("scatter", output_tensor.dtype, None, root, output_tensor.numel()),
        )

    # -- point to point ----------------------------------------------------
    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Send ``tensor`` to rank ``dst`` (through shared memory when both share a node)."""
        tensor = self._tensor(tensor, "tensor")
        dst = checks.rank(dst, "dst", self._size, self_rank=self._rank)
        return self._point_to_point("send", tensor, dst, async_op, hints, timeout)

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        async_op: bool = False,
        hints: Mapping[str, str] | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> Work:
        """Receive into ``tensor`` what rank ``src`` sent; a send of another dtype or
        size is a ``DesyncError`` naming both sides (on the shared-memory path)."""
        tensor = self._tensor(tensor, "tensor")
        src = checks.rank(src, "src", self._size, self_rank=self._rank)
        return self._point_to_point("recv", tensor, src, async_op, hints, timeout)
