"""The CPU communicator: shared memory first for every collective it can take.

``CpuCommunicator`` is ``DeviceCommunicatorBase`` on a Gloo device group with
:class:`~device_communicators.shm_all_reduce.ShmAllReduce` in front of the
``torch.distributed`` all-reduce; all-gather (hence all_gatherv and the size
exchange of gather), reduce-scatter(v) and broadcast use its slots too.
When the ranks do not share a node (or the shm path is disabled) the shm
back end is built disabled and says why, and Gloo takes everything.

``send_tensor_dict``/``recv_tensor_dict`` (vLLM's CPU pipeline hand-off) move
a whole dict as one codec message, and ``send``/``recv`` one tensor: through a
shared-memory channel to a peer on this node (``shm_broadcast.p2p_channels``,
as ``GroupCoordinator`` does), else over Gloo.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed import ProcessGroup, Store

from shm_broadcast.codec import encode_message, loads
from shm_broadcast.config import get_config, resolve_timeout
from shm_broadcast.p2p_channels import P2PChannels

from . import checks, object_bytes
from .all_reduce_backends import AllReduceBackend
from .base_device_communicator import DeviceCommunicatorBase
from .errors import GroupcoordTypeError
from .shm_all_reduce import ShmAllReduce
from .shm_phases import layout_code, split_code
from .transports import NOT_OFFERED, Transport


class CpuCommunicator(DeviceCommunicatorBase):
    """Collectives of one group of CPU ranks (Gloo plus shared-memory all-reduce)."""

    p2p_channels: P2PChannels

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        use_all2all: bool = False,
        *,
        timeout_s: float | None = None,
        global_ranks: list[int] | None = None,
        p2p_store: Store | None = None,
    ) -> None:
        """``p2p_store`` carries the channels' ring handles (default: torch's default
        store; a ``Comm`` gives its own, as it may run without one)."""
        cfg = get_config()
        # Before the base constructor, whose failure path calls destroy(); the
        # rank is known once the base has read the group.
        self.p2p_channels = P2PChannels(
            unique_name or "CpuCommunicator",
            -1,
            {},
            resolve_timeout(timeout_s),
            store=p2p_store,
        )
        super().__init__(
            cpu_group,
            device,
            device_group,
            unique_name,
            global_ranks,
            use_all2all=use_all2all,
            timeout_s=timeout_s,
        )
        self.p2p_channels.rank = self.rank
        if not cfg.disable_shm_p2p:
            self.p2p_channels.peers = dict(self.peer_pids)
            # A receive or send waiting on global ranks ``peers``: ShmBase.check_queue_wait.
            # It holds the back end and the ranks, not self (no cycle through the channels).
            shm, ranks = self.shm_all_reduce, self.ranks
            self.p2p_channels.stall_check = lambda operation, peers, writing, ready: (
                shm.check_queue_wait(operation, writing, [ranks.index(p) for p in peers], ready)
            )

    def _fast_all_reduce_backends(self) -> list[AllReduceBackend]:
        self.shm_all_reduce = ShmAllReduce(
            self.cpu_group, unique_name=self.unique_name, timeout_s=self.timeout_s, ranks=self.ranks
        )
        self.small_calls = self.shm_all_reduce.small
        self.call_lock = self.shm_all_reduce.call_lock
        return [self.shm_all_reduce]

    def _fast_transports(self) -> list[Transport]:
        return [ShmTransport(self.shm_all_reduce), *super()._fast_transports()]

    def _local_peer_pids(self) -> dict[int, int]:
        # The shm set-up exchanged pids; a failed Gloo call can then name the dead peer.
        if self.shm_all_reduce.disabled_reason is None:
            return self.shm_all_reduce.peer_pids()
        return super()._local_peer_pids()

    def barrier(self) -> None:
        """Through the shared-memory back end when it is up (about 20 us against
        Gloo's 240 us at world 2 here; checked as a barrier against what each peer
        called), else Gloo's."""
        if self.shm_all_reduce.disabled_reason is None:
            self.shm_all_reduce.barrier()
        else:
            super().barrier()

    # ---- tensor dicts (vLLM's CpuCommunicator) --------------------------------------

    def send_tensor_dict(self, tensor_dict: dict[str, torch.Tensor | Any], dst: int) -> None:
        """Send ``tensor_dict`` (tensors and codec-encodable values) to in-group rank ``dst``."""
        operation = "send_tensor_dict"
        checks.rank(dst, "dst", self.world_size, self.rank_in_group, self.what)
        if not isinstance(tensor_dict, dict):
            raise GroupcoordTypeError(
                f"tensor_dict must be a dict, got {type(tensor_dict).__name__}"
            )
        msg = encode_message(tensor_dict)  # refuses what it cannot carry, before sending
        peer = self.ranks[dst]
        if self.p2p_channels.open_to(peer, operation):
            self.p2p_channels.send_message(peer, msg, operation)
            return
        self.send(object_bytes.lengths([msg.nbytes]), dst)
        self.send(object_bytes.message_buffer(msg.nbytes, msg)[0], dst)

    def recv_tensor_dict(self, src: int) -> dict[str, torch.Tensor | Any]:
        """The next dict in-group rank ``src`` sent with :meth:`send_tensor_dict`."""
        operation = "recv_tensor_dict"
        checks.rank(src, "src", self.world_size, self.rank_in_group, self.what)
        peer = self.ranks[src]
        if self.p2p_channels.open_from(peer, operation):
            got = self.p2p_channels.recv_message(peer, operation)
        else:
            dtype = object_bytes.OBJECT_DTYPE
            length = self.recv(torch.Size([object_bytes.LENGTH_BYTES]), dtype, src)
            n = object_bytes.read_lengths(length)[0]
            got = loads(object_bytes.message_view(self.recv(torch.Size([n]), dtype, src)))
        if not isinstance(got, dict):
            raise GroupcoordTypeError(
                f"{self.what}: recv_tensor_dict from rank {peer} got a "
                f"{type(got).__name__}, not a dict"
            )
        return got

    def abandon(self, reason: str) -> None:
        self.shm_all_reduce.abandon(reason)  # its peers' waits on it end too (they see it leave)

    def destroy(self) -> None:
        self.p2p_channels.close()
        super().destroy()


class ShmTransport(Transport):
    """The shared-memory back end's slots as a transport: all-gather (hence
    all-gatherv's padded parts and the lengths exchange), gather, reduce-scatter(v)
    and broadcast. Its refusals depend on the group and dtype only (any dtype's bytes
    are copied; reductions take its dtypes), never on a tensor's layout."""

    name = "shared memory"
    control = True  # its slots are cpu_group's

    def __init__(self, shm: ShmAllReduce) -> None:
        self.shm = shm

    def refusal(self, op: str, tensor: torch.Tensor) -> str | None:
        if op in ("all_gather", "gather", "broadcast"):
            return self.shm.copy_refusal(tensor)
        if op == "reduce_scatter":
            return self.shm.refusal(tensor)
        return NOT_OFFERED

    # A small call takes the lean path (its result joined along dim 0, a view away
    # from stacked): the size exchanges of all_gatherv and gather are such calls.

    def all_gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        joined = self.shm.small.all_gather(tensor, 0)
        if joined is None:
            return self.shm.all_gather(tensor)
        return joined.view(self.shm.world_size, *tensor.shape)

    def gather_stacked(self, tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
        # The other ranks copy nothing out, on either path.
        joined = self.shm.small.gather(tensor, dst)
        if joined is None:
            return self.shm.gather(tensor, dst)
        if self.shm.rank_in_group != dst:
            return None
        return joined.view(self.shm.world_size, *tensor.shape)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.shm.broadcast_(tensor, src)

    def reduce_scatter_sizes(
        self, input_: torch.Tensor, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        # Each rank reduces only its own rows, in shared memory.
        rank = self.shm.rank_in_group
        start, length = sum(sizes[:rank]), sizes[rank]
        split = split_code(sizes)
        if dim == 0 and input_.dim() == 1 and input_.is_contiguous():
            return self.shm.reduce_range(input_, start, start + length, split=split)
        moved = input_.movedim(dim, 0) if dim else input_
        inner = math.prod(moved.shape[1:])
        flat = moved.contiguous().view(-1)
        # The ranks' shapes and dims must agree: the elements are summed by place.
        layout = layout_code(input_.shape, dim)
        part = self.shm.reduce_range(
            flat, start * inner, (start + length) * inner, split=split, layout=layout
        )
        part = part.view(length, *moved.shape[1:])
        return part.movedim(0, dim).contiguous() if dim else part
