"""``coordinator.comm``: a communicator API with work handles, split, batched P2P,
shared-memory windows and object collectives that never unpickle by default.

    comm = new_comm("gloo", "cpu", "world")
    work = comm.all_reduce(t, ReduceOp.SUM, async_op=True)
    ...  # compute overlaps the reduction
    work.wait()
"""

from __future__ import annotations

from .adapters import comm_from_group, comm_from_process_group
from .batch import BatchP2POptions, P2PBatch, P2POp
from .comm import Comm, CommOptions, new_comm
from .monitored_barrier import monitored_barrier
from .objcol import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .reduce_ops import RedOpType, ReduceOp
from .window import SignalCmpOp, Window
from .work import Work, WorkStatus

__all__ = [
    "BatchP2POptions",
    "Comm",
    "CommOptions",
    "P2PBatch",
    "P2POp",
    "RedOpType",
    "SignalCmpOp",
    "ReduceOp",
    "Window",
    "Work",
    "WorkStatus",
    "all_gather_object",
    "comm_from_group",
    "comm_from_process_group",
    "broadcast_object_list",
    "gather_object",
    "monitored_barrier",
    "new_comm",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]
