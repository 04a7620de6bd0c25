"""coordinator.comm public names, construction paths and refusals that need no peers."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

import coordinator.comm as comm_api
from coordinator.comm import ReduceOp, new_comm
from coordinator.errors import BackendUnavailableError, GroupcoordTypeError, GroupcoordValueError
from coordinator.launch import free_port, init_gloo, run_ranks


def test_public_names_import() -> None:
    for name in comm_api.__all__:
        assert getattr(comm_api, name) is not None, name


def test_reduce_op_names_and_dtype_rules() -> None:
    assert repr(ReduceOp.PREMUL_SUM(0.5)) == "ReduceOp.PREMUL_SUM(0.5)"
    assert ReduceOp.PREMUL_SUM(2).factor == 2.0
    with pytest.raises(GroupcoordTypeError, match="factor"):
        ReduceOp.PREMUL_SUM(torch.tensor(2.0))  # type: ignore[arg-type]
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
