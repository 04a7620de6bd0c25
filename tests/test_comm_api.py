"""coordinator.comm public names, construction paths and refusals that need no peers."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

import coordinator.comm as comm_api
from coordinator.comm import RedOpType, ReduceOp, new_comm
from coordinator.errors import (
    BackendUnavailableError,
    GroupcoordTypeError,
    GroupcoordValueError,
    NotSupportedError,
)
from coordinator.launch import free_port, init_gloo, run_ranks


def test_public_names_import() -> None:
    for name in comm_api.__all__:
        assert getattr(comm_api, name) is not None, name


def test_reduce_op_names_and_dtype_rules() -> None:
    assert repr(ReduceOp.PREMUL_SUM(0.5)) == "ReduceOp.PREMUL_SUM(0.5)"
    assert ReduceOp.PREMUL_SUM(2).factor == 2.0
    # torchcomms: a one-element tensor factor, RedOpType and ReduceOp.type.
    assert ReduceOp.PREMUL_SUM(torch.tensor(2.0)).factor == 2.0
    with pytest.raises(GroupcoordTypeError, match="factor"):
        ReduceOp.PREMUL_SUM(torch.tensor([2.0, 3.0]))
    with pytest.raises(GroupcoordTypeError, match="factor"):
        ReduceOp.PREMUL_SUM("2")  # type: ignore[arg-type]
    assert ReduceOp(RedOpType.MAX) == ReduceOp.MAX and ReduceOp.MAX.type is RedOpType.MAX
    assert ReduceOp.PREMUL_SUM(0.5).type is RedOpType.PREMUL_SUM
    with pytest.raises(GroupcoordTypeError, match="PREMUL_SUM needs a factor"):
        ReduceOp(RedOpType.PREMUL_SUM)
    with pytest.raises(GroupcoordTypeError, match="floating"):
        ReduceOp.AVG.check_dtype(torch.int32, "tensor")
    with pytest.raises(GroupcoordTypeError, match="integer or bool"):
        ReduceOp.BAND.check_dtype(torch.float16, "tensor")
    ReduceOp.BOR.check_dtype(torch.bool, "tensor")
    ReduceOp.MAX.check_dtype(torch.int8, "tensor")


def test_refusals_before_any_connection() -> None:
    with pytest.raises(BackendUnavailableError, match="nccl"):
        new_comm("nccl", "cuda", "x", rank=0, size=1)
    with pytest.raises(GroupcoordValueError, match="device"):
        new_comm("gloo", "cuda", "x", rank=0, size=1)
    with pytest.raises(GroupcoordValueError, match="not a torch device"):
        new_comm("gloo", "tpu-ish", "x", rank=0, size=1)
    with pytest.raises(GroupcoordTypeError, match="hints"):
        new_comm("gloo", "cpu", "x", hints={"k": 1}, rank=0, size=1)  # type: ignore[dict-item]
    with pytest.raises(GroupcoordValueError, match="name"):
        new_comm("gloo", "cpu", "", rank=0, size=1)
    with pytest.raises(GroupcoordValueError, match="rank=2 size=2"):
        new_comm("gloo", "cpu", "x", rank=2, size=2)


def test_torchcomms_creation_options_are_checked_before_any_connection() -> None:
    with pytest.raises(NotSupportedError, match="abort_process_on_timeout_or_error"):
        new_comm("gloo", "cpu", "x", True, rank=0, size=1)
    with pytest.raises(GroupcoordTypeError, match="high_priority_stream"):
        new_comm("gloo", "cpu", "x", None, None, "yes", rank=0, size=1)  # type: ignore[arg-type]


def _torchcomms_positional(rank: int, world_size: int) -> dict:
    """new_comm, issue and the window called positionally as torchcomms documents them."""
    from coordinator.comm import BatchP2POptions

    init_gloo(rank, world_size)
    comm = new_comm(
        "gloo", torch.device("cpu"), "pos", None, datetime.timedelta(seconds=30), False, None, None
    )
    backend = type(comm.unsafe_get_backend()).__name__
    peer = 1 - rank
    got = torch.zeros(4)
    batch = comm.batch_op_create()
    batch.send(torch.full((4,), float(rank)), peer)
    batch.recv(got, peer)
    batch.issue(False, BatchP2POptions(timeout=30.0)).wait()
    gathered = torch.zeros(2 * 3)
    comm.gather_single(gathered, torch.full((3,), float(rank)), 1, True).wait_blocking()
    summed = torch.ones(2)
    comm.all_reduce(summed, ReduceOp.PREMUL_SUM(torch.tensor(0.5)), False)
    win = comm.window_allocate(64)
    win.signal(0, 7 + rank, peer, False)  # value slot 0 of the peer
    win.wait_signal(0, 7 + peer, "eq", False).wait()
    comm.barrier(False)
    win.tensor_deregister()
    comm.finalize()
    return {
        "backend": backend,
        "got": got.tolist(),
        "gathered": gathered.tolist(),
        "summed": summed.tolist(),
    }


def test_torchcomms_positional_calls_bind_as_documented() -> None:
    results = run_ranks(_torchcomms_positional, 2, timeout=60)
    assert [r["got"] for r in results] == [[1.0] * 4, [0.0] * 4]
    assert results[1]["gathered"] == [0.0] * 3 + [1.0] * 3  # on the root
    assert results[0]["gathered"] == [0.0] * 6  # elsewhere untouched
    assert all(r["summed"] == [1.0, 1.0] for r in results)  # 0.5 * 1 from each of 2 ranks
    assert {r["backend"] for r in results} == {"ProcessGroupGloo"}


def _construction_paths(rank: int, world_size: int, store_port: int) -> str:
    # An explicit store, rank and size (and a device spelled with an index).
    store = torch.distributed.TCPStore(
        "127.0.0.1",
        store_port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=30),
    )
    explicit = new_comm(
        "gloo", "cpu:0", "explicit", timeout=30, store=store, rank=rank, size=world_size
    )
    t = torch.ones(1)
    explicit.all_reduce(t)
    assert t.item() == world_size
    # With torch.distributed initialised, the default store is reused and
    # torch's default group is left alone.
    init_gloo(rank, world_size)
    first = new_comm("gloo", "cpu", "same-name", timeout=30)
    second = new_comm("gloo", "cpu", "same-name", timeout=30)  # its own keys, no clash
    assert first.get_options().store_prefix != second.get_options().store_prefix
    for comm in (first, second):
        t = torch.full((1,), 2.0)
        comm.all_reduce(t, ReduceOp.PRODUCT)
        assert t.item() == 2.0**world_size
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world_size
    for comm in (explicit, first, second):
        comm.finalize()
    return "ok"


def test_explicit_store_and_default_store_paths() -> None:
    assert run_ranks(_construction_paths, 2, free_port(), timeout=60) == ["ok", "ok"]


def _doc_example(rank: int, world_size: int, code: str) -> str:
    exec(compile(code, "docs/comm.md", "exec"), {})
    return "ok"


def test_the_docs_example_runs() -> None:
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "comm.md")
    with open(path) as f:
        text = f.read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert run_ranks(_doc_example, 2, code, timeout=60) == ["ok", "ok"]


REFERENCE = os.path.join(os.path.dirname(__file__), "data", "torchcomms_api_reference.txt")
# torchcomms' classes and modules -> ours.
OURS = {
    "torchcomms.TorchComm": comm_api.Comm,
    "torchcomms.TorchCommWindow": comm_api.Window,
    "torchcomms.BatchSendRecv": comm_api.P2PBatch,
    "torchcomms.TorchWork": comm_api.Work,
}


def _reference_signatures() -> list[tuple[str, object, list[str]]]:
    """(name, our callable or None, the reference's parameter names in order) for
    every method and function of torchcomms' API reference that has a counterpart."""
    import re

    found = []
    owner = None
    with open(REFERENCE, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^- class (torchcomms\.[\w.]+)", line)
            if m:
                owner = m.group(1)
                continue
            m = re.match(r"^- ([\w.]+)\((.*)\)", line)
            if not m:
                continue
            name, params = m.groups()
            if name.startswith("torchcomms.objcol.") or name == "torchcomms.new_comm":
                ours = getattr(comm_api, name.rsplit(".", 1)[-1], None)
            elif "." in name or owner not in OURS or name == "__init__":
                continue
            else:
                ours = getattr(OURS[owner], name, None)
                name = f"{owner}.{name}"
            depth, parts, cur = 0, [], ""
            for ch in params:
                depth += 1 if ch in "[(" else -1 if ch in "])" else 0
                if ch == "," and depth == 0:
                    parts.append(cur)
                    cur = ""
                else:
                    cur += ch
            parts.append(cur)
            names = [p.split(":")[0].split("=")[0].strip() for p in parts if p.strip()]
            skip = {"self", "*args", "**kwargs", "comm"}
            found.append((name, ours, [n for n in names if n not in skip]))
    return found


def test_signatures_match_the_torchcomms_reference() -> None:
    """Every reference method and function exists here, and a positional call binds
    the same parameters (ours may add keyword-only ones, or defaults)."""
    import inspect

    checked = 0
    problems = []
    for name, ours, wanted in _reference_signatures():
        if ours is None:
            problems.append(f"{name}: missing")
            continue
        params = [
            p.name
            for p in inspect.signature(ours).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
        ]
        if name.startswith("torchcomms.objcol."):
            params = params[1:]  # the comm
        if params[: len(wanted)] != wanted:
            problems.append(f"{name}: reference {wanted}, ours {params}")
        checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= 35  # the parse found the reference's API, not a handful of lines
