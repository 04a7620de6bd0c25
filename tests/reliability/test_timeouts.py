"""Every public blocking call, in one table, raises its timeout error when its peer never comes.

Each row names the component, the call and which in-group rank stays away
(alive, so this is the timeout path, not the dead-peer path). The caller must
raise ``GroupcoordTimeoutError`` within its 0.5 s deadline plus slack, and the
message must name the object, the operation and the missing rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

from coordinator.launch import free_port, run_ranks

from . import _timeout_ranks as ranks
from ._common import report


class Row(NamedTuple):
    component: str
    call: str
    absent: int  # in-group rank that never makes the call (world 2: the caller is the other)
    what: str  # must appear in the message: the object's name
    # Rows with the same (component, batch) share one set of processes; a row
    # that has crashed its process runs in a batch of its own so the others still report.
    batch: int = 0


# Sends and enqueue-with-room return without a peer by design (buffered), so
# they are not blocking calls; enqueue is listed with its reader not reading.
TIMEOUT_TABLE: list[Row] = [
    *(
        Row("GroupCoordinator", call, 1, "tmo")
        for call in (
            "all_reduce",
            "all_reduce (shared memory off)",
            "all_gather",
            "all_gatherv",
            "reduce_scatter",
            "reduce_scatterv",
            "gather",
            "broadcast",
            "broadcast_object",
            "broadcast_object_list",
            "broadcast_tensor_dict",
            "recv_object",
            "recv_tensor_dict",
            "recv",
            "barrier",
        )
    ),
    # broadcast_object over the TP message queue and MessageQueue.broadcast_object wait
    # without a deadline while the peer lives (an engine's idle wait, vLLM's semantics);
    # tests/test_vllm_dropin.py checks that they end at once when the peer dies.
    *(
        Row("CpuCommunicator", call, 1, "tmo")
        for call in (
            "all_reduce",
            "all_reduce (shared memory off)",
            "all_gather",
            "all_gatherv",
            "reduce_scatter",
            "reduce_scatterv",
            "gather",
            "broadcast",
            "recv",
        )
    ),
    Row("StatelessProcessGroup", "create", 0, "StatelessProcessGroup"),
    *(
        Row("StatelessProcessGroup", call, 1, "StatelessProcessGroup")
        for call in ("recv_obj", "broadcast_obj", "all_gather_obj", "barrier")
    ),
    Row("StatelessProcessGroup", "close", 1, "StatelessProcessGroup"),
    *(
        Row("coordinator.comm", call, 1, "tmo")
        for call in (
            "all_reduce",
            "broadcast",
            "all_gather_single",
            "recv",
            "barrier",
            "monitored_barrier",
            "wait_signal",
            "all_gather_object",
        )
    ),
    # Seen to abort the process (SIGABRT "Resource deadlock avoided") on abort() after the timeout.
    Row("coordinator.comm", "async all_reduce + wait", 1, "tmo", batch=1),
    Row("MessageQueue", "wait_until_ready as writer", 1, "MessageQueue"),
    Row("MessageQueue", "wait_until_ready as local reader", 0, "MessageQueue"),
    Row("MessageQueue", "wait_until_ready as remote reader", 0, "MessageQueue"),
    Row("MessageQueue", "enqueue, local reader not reading", 1, "MessageQueue"),
    Row("MessageQueue", "enqueue, remote reader not reading", 1, "MessageQueue"),
    Row("MessageQueue", "dequeue as local reader", 0, "MessageQueue"),
    Row("MessageQueue", "dequeue as remote reader", 0, "MessageQueue"),
    Row("MessageQueue", "create_from_process_group", 1, "MessageQueue"),
]

# The close() row must run last among its component's rows: it leaves the group.
_RUNNERS: dict[str, Callable[..., Any]] = {
    "GroupCoordinator": ranks.coordinator_rows,
    "CpuCommunicator": ranks.communicator_rows,
    "StatelessProcessGroup": ranks.stateless_rows,
    "coordinator.comm": ranks.comm_rows,
    "MessageQueue": ranks.mq_rows,
}
_results: dict[tuple[str, int], dict[str, Any]] = {}


def _outcomes(component: str, batch: int) -> dict[str, Any]:
    """Run every row of a batch once (one set of processes), cached for its rows."""
    key = (component, batch)
    if key not in _results:
        rows = [
            (r.call, r.absent)
            for r in TIMEOUT_TABLE
            if r.component == component and r.batch == batch
        ]
        extra: tuple[Any, ...] = ()
        if component == "StatelessProcessGroup":
            extra = ([free_port() for _ in rows],)
        per_rank = run_ranks(_RUNNERS[component], 2, rows, *extra, timeout=110)
        merged: dict[str, Any] = {}
        for outcome in per_rank:
            merged.update(outcome)
        _results[key] = merged
    return _results[key]


@pytest.mark.parametrize("row", TIMEOUT_TABLE, ids=lambda r: f"{r.component}.{r.call}")
def test_blocking_call_times_out_naming_the_absent_rank(row: Row) -> None:
    kind, message, named, took = _outcomes(row.component, row.batch)[row.call]
    report(f"timeout: {row.component}.{row.call}", raised=kind, seconds=round(took, 3))
    assert kind == "GroupcoordTimeoutError", f"{row.call} raised {kind}: {message}"
    assert row.absent in named, f"{row.call} does not name rank {row.absent}: {message}"
    assert f"waiting for ranks [{row.absent}]" in message or f"{row.absent}" in message
    assert row.what in message, f"{row.call}: message does not name the object: {message}"
    assert f"timed out after {ranks.TIMEOUT_S:g} s" in message, message
    assert took < ranks.TIMEOUT_S + 4.0, f"{row.call} took {took:.2f} s"
