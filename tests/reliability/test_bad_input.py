"""Bad input raises ValueError/TypeError naming the argument, before anything is sent.

Rank 0 alone makes each bad call; then every rank makes good calls whose
results are checked, so a bad call that had sent anything would show up as a
wrong result or a hang on the partner rank (see ``_bad_input_ranks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

from coordinator.launch import free_port, run_ranks

from . import _bad_input_ranks as ranks
from ._common import report


class Bad(NamedTuple):
    component: str
    label: str
    kind: type[Exception]  # ValueError or TypeError
    names: str  # what the message must mention (the argument, or the refused type)


BAD_INPUT_TABLE: list[Bad] = [
    Bad("GroupCoordinator", "all_reduce: not a tensor", TypeError, "input_"),
    Bad("GroupCoordinator", "all_reduce: wrong device", ValueError, "input_"),
    Bad("GroupCoordinator", "all_gather: dim out of range", ValueError, "dim"),
    Bad("GroupCoordinator", "all_gather: dim not an int", TypeError, "dim"),
    Bad("GroupCoordinator", "all_gatherv: sizes of wrong length", ValueError, "sizes"),
    Bad("GroupCoordinator", "all_gatherv: sizes not matching the tensor", ValueError, "sizes"),
    Bad("GroupCoordinator", "all_gatherv: empty list", ValueError, "input_"),
    Bad("GroupCoordinator", "reduce_scatter: dim not divisible", ValueError, "dim"),
    Bad("GroupCoordinator", "reduce_scatterv: sizes of wrong sum", ValueError, "sizes"),
    Bad("GroupCoordinator", "gather: dst out of range", ValueError, "dst"),
    Bad("GroupCoordinator", "gather: dst negative", ValueError, "dst"),
    Bad("GroupCoordinator", "broadcast: src out of range", ValueError, "src"),
    Bad("GroupCoordinator", "broadcast: src a bool", TypeError, "src"),
    Bad("GroupCoordinator", "send: dst is self", ValueError, "dst"),
    Bad("GroupCoordinator", "send: dst out of range", ValueError, "dst"),
    Bad("GroupCoordinator", "recv: src is self", ValueError, "src"),
    Bad("GroupCoordinator", "recv: dtype not a dtype", TypeError, "dtype"),
    Bad("GroupCoordinator", "recv: negative size", ValueError, "size"),
    Bad("GroupCoordinator", "send_object: dst is self", ValueError, "dst"),
    Bad("GroupCoordinator", "send_object: unsupported object", TypeError, "object"),
    Bad(
        "GroupCoordinator",
        "broadcast_object: unsupported object (queue)",
        TypeError,
        "builtin_function",
    ),
    Bad("GroupCoordinator", "broadcast_object_list: not a list", TypeError, "obj_list"),
    Bad("GroupCoordinator", "broadcast_tensor_dict: unsupported value", TypeError, "object"),
    Bad("GroupCoordinator", "send_tensor_dict: dst is self", ValueError, "dst"),
    Bad(
        "GroupCoordinator",
        "send_tensor_dict: all_gather_group not a group",
        TypeError,
        "all_gather_group",
    ),
    Bad("GroupCoordinator", "all_reduce: a wrapper subclass", TypeError, "TwoTensor"),
    Bad("GroupCoordinator", "all_gather: a wrapper subclass", TypeError, "input_"),
    Bad("GroupCoordinator", "broadcast: a wrapper subclass", TypeError, "__torch_dispatch__"),
    Bad("GroupCoordinator", "send: a wrapper subclass", TypeError, "TwoTensor"),
    Bad("GroupCoordinator", "all_reduce: a nested tensor", TypeError, "nested"),
    Bad("GroupCoordinator", "broadcast_tensor_dict: a wrapper subclass", TypeError, "TwoTensor"),
    Bad("GroupCoordinator", "send_tensor_dict: a wrapper subclass", TypeError, "TwoTensor"),
    Bad("GroupCoordinator", "broadcast_object: a nested tensor", TypeError, "nested"),
    Bad("GroupCoordinator", "queue enqueue: unsupported object", TypeError, "set"),
    Bad("GroupCoordinator", "queue enqueue: non-positive timeout", ValueError, "timeout"),
    Bad("CpuCommunicator", "all_reduce: not a tensor", TypeError, "input_"),
    Bad("CpuCommunicator", "all_reduce: wrong device", ValueError, "input_"),
    Bad("CpuCommunicator", "all_gather: dim out of range", ValueError, "dim"),
    Bad("CpuCommunicator", "all_gatherv: sizes of wrong length", ValueError, "sizes"),
    Bad("CpuCommunicator", "reduce_scatterv: negative size", ValueError, "sizes"),
    Bad("CpuCommunicator", "gather: dst out of range", ValueError, "dst"),
    Bad("CpuCommunicator", "broadcast: src out of range", ValueError, "src"),
    Bad("CpuCommunicator", "send: dst is self", ValueError, "dst"),
    Bad("CpuCommunicator", "recv: size not a sequence", TypeError, "size"),
    Bad("StatelessProcessGroup", "send_obj: dst is self", ValueError, "dst"),
    Bad("StatelessProcessGroup", "send_obj: unsupported object", TypeError, "object"),
    Bad("StatelessProcessGroup", "recv_obj: src out of range", ValueError, "src"),
    Bad("StatelessProcessGroup", "broadcast_obj: src negative", ValueError, "src"),
    Bad("StatelessProcessGroup", "broadcast_obj: unsupported object", TypeError, "function"),
    Bad("StatelessProcessGroup", "all_gather_obj: non-positive timeout", ValueError, "timeout"),
    Bad("StatelessProcessGroup", "create: rank out of range", ValueError, "rank"),
    Bad("coordinator.comm", "all_reduce: not a tensor", TypeError, "tensor"),
    Bad("coordinator.comm", "all_reduce: op not a ReduceOp", TypeError, "op"),
    Bad("coordinator.comm", "broadcast: root out of range", ValueError, "root"),
    Bad("coordinator.comm", "send: dst is self", ValueError, "dst"),
    Bad("coordinator.comm", "all_reduce: a wrapper subclass", TypeError, "TwoTensor"),
    Bad("coordinator.comm", "broadcast: a wrapper subclass", TypeError, "TwoTensor"),
    Bad("coordinator.comm", "send: a wrapper subclass", TypeError, "TwoTensor"),
    Bad("coordinator.comm", "all_gather_single: output of wrong size", ValueError, "output"),
    Bad(
        "coordinator.comm",
        "all_to_all_v_single: split sizes of wrong sum",
        ValueError,
        "split_sizes",
    ),
    Bad("coordinator.comm", "split: ranks without the caller", ValueError, "ranks"),
    Bad("MessageQueue", "MessageQueue: negative n_reader", ValueError, "n_reader"),
    Bad("MessageQueue", "MessageQueue: more local than readers", ValueError, "n_local_reader"),
    Bad("MessageQueue", "MessageQueue: connect_ip any-interface", ValueError, "connect_ip"),
    Bad("MessageQueue", "MessageQueue: tiny max_chunk_bytes", ValueError, "max_chunk_bytes"),
    Bad(
        "MessageQueue",
        "MessageQueue: local_reader_ranks repeated",
        ValueError,
        "local_reader_ranks",
    ),
    Bad("MessageQueue", "MessageQueue: reader_pids of 0", ValueError, "reader_pids"),
    Bad("MessageQueue", "create_from_handle: not a handle", ValueError, "handle"),
    Bad("MessageQueue", "enqueue: unsupported object", TypeError, "object"),
    Bad("MessageQueue", "enqueue: non-positive timeout", ValueError, "timeout"),
    Bad("MessageQueue", "enqueue: a wrapper subclass", TypeError, "TwoTensor"),
    Bad("MessageQueue", "enqueue: on a reader", ValueError, "enqueue"),
    Bad("MessageQueue", "dequeue: non-positive timeout", ValueError, "timeout"),
]

_RUNNERS: dict[str, Callable[..., Any]] = {
    "GroupCoordinator": lambda: run_ranks(ranks.coordinator_case, 2, timeout=90),
    "CpuCommunicator": lambda: run_ranks(ranks.communicator_case, 2, timeout=90),
    "StatelessProcessGroup": lambda: run_ranks(ranks.stateless_case, 2, free_port(), timeout=90),
    "coordinator.comm": lambda: run_ranks(ranks.comm_case, 2, timeout=90),
    "MessageQueue": lambda: run_ranks(ranks.mq_case, 4, timeout=90),
}
_results: dict[str, dict[str, Any]] = {}


def _outcomes(component: str) -> dict[str, Any]:
    """Every bad call of ``component`` then the good calls, in one set of ranks (cached)."""
    if component not in _results:
        merged: dict[str, Any] = {}
        for outcome in _RUNNERS[component]():
            merged.update(outcome)
        _results[component] = merged
    return _results[component]


@pytest.mark.parametrize("bad", BAD_INPUT_TABLE, ids=lambda b: f"{b.component}.{b.label}")
def test_bad_input_is_refused_at_the_call_site(bad: Bad) -> None:
    kind, message, is_value, is_type = _outcomes(bad.component)[bad.label]
    report(f"bad input: {bad.component}.{bad.label}", raised=kind)
    right_kind = is_value if bad.kind is ValueError else is_type
    assert right_kind, f"{bad.label}: raised {kind}, want a {bad.kind.__name__}: {message}"
    assert bad.names in message, f"{bad.label}: message does not name {bad.names!r}: {message}"
