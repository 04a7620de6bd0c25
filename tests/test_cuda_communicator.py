"""CudaCommunicator and CustomAllreduce on a machine without a GPU.

What can be real here: construction in forked ranks over Gloo, every back end
refusing with the runtime's/NCCL's own reason (agreed across ranks), the
back-end order, argument checks at the call site, and capture mode being a
no-op when custom all-reduce is disabled. Device results are in tests/gpu/.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.launch import init_gloo, run_ranks
from shm_broadcast.config import override

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() > 0, reason="a GPU is present: tests/gpu/ covers this machine"
)
pytest.importorskip("cupy_backends.cuda.api.runtime", reason="CuPy not installed (cuda extra)")


def _communicator_without_gpu(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from device_communicators.cuda_communicator import CudaCommunicator
    from device_communicators.errors import GroupcoordValueError

    init_gloo(rank, world_size)
    try:
        comm = CudaCommunicator(dist.group.WORLD, torch.device("cuda", rank), unique_name="tp:0")
        out = {
            "describe": comm.describe(),
            "chain": comm.all_reduce_chain.names(),
            "explain": comm.all_reduce_chain.explain(torch.zeros(64, dtype=torch.float16)),
            # vLLM's member names: None where the fast path is off.
            "vllm_names": (comm.ca_comm, comm.pynccl_comm),
        }
        with pytest.raises(GroupcoordValueError, match="input_ is on cpu"):
            comm.all_reduce(torch.ones(4))
        with pytest.raises(GroupcoordValueError, match=f"src={rank} is this rank itself"):
            comm.recv((4,), torch.float32, src=rank)
        with comm.capture():
            out["captured"] = True
        # The group is still usable after the refused calls.
        token = torch.tensor([rank + 1])
        dist.all_reduce(token)
        out["sum"] = int(token.item())
        comm.destroy()
        comm.destroy()
        return out
    finally:
        dist.destroy_process_group()


def test_communicator_without_gpu_disables_fast_paths_with_reasons():
    results = run_ranks(_communicator_without_gpu, 2, timeout=90)
    for rank, out in enumerate(results):
        assert out["chain"] == ["custom_all_reduce", "pynccl", "torch.distributed(gloo)"]
        reasons = dict(out["describe"])
        assert "CUDA" in reasons["custom_all_reduce"] and "driver" in reasons["custom_all_reduce"]
        assert f"ncclCommInitRank on cuda:{rank} failed" in reasons["pynccl"]
        assert reasons["torch.distributed"].startswith("enabled")
        explained = dict(out["explain"])
        assert explained["custom_all_reduce"] == reasons["custom_all_reduce"]
        assert explained["pynccl"] == reasons["pynccl"]
        assert explained["torch.distributed(gloo)"] is None
        assert out["captured"] and out["sum"] == 3
        assert list(out["vllm_names"]) == [None, None]


def _custom_ar_refusals(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    from device_communicators.custom_all_reduce import CustomAllreduce
    from device_communicators.errors import (
        BackendUnavailableError,
        GroupcoordValueError,
        NotSupportedError,
    )

    init_gloo(rank, world_size)
    try:
        reasons = []
        with override(disable_custom_all_reduce=True):
            reasons.append(CustomAllreduce(dist.group.WORLD, rank).reason)
        reasons.append(CustomAllreduce(dist.group.WORLD, rank).reason)
        with override(custom_all_reduce_algo="fastest"):
            with pytest.raises(GroupcoordValueError, match="custom_all_reduce_algo"):
                CustomAllreduce(dist.group.WORLD, rank)
        with pytest.raises(GroupcoordValueError, match="max_size"):
            CustomAllreduce(dist.group.WORLD, rank, max_size=1000)
        ca = CustomAllreduce(dist.group.WORLD, rank)
        assert ca.disabled and not ca.should_custom_ar(torch.zeros(8))
        with pytest.raises(GroupcoordValueError, match="cannot take this tensor"):
            ca.all_reduce(torch.zeros(8), out=torch.zeros(8))
        # vLLM's entry points: None / False send the caller to NCCL.
        assert ca.custom_all_reduce(torch.zeros(8)) is None
        assert not ca.should_custom_all_gather(torch.zeros(8))
        assert ca.custom_all_gather(torch.zeros(8)) is None
        assert not ca.should_custom_reduce_scatter(torch.zeros(8))
        assert ca.custom_reduce_scatter(torch.zeros(8)) is None
        ca.close()
        with pytest.raises(NotSupportedError, match="symmetric-memory"):
            CustomAllreduce(dist.group.WORLD, rank, symm_mem_enabled=True)
        # Collective, and refused alike on every rank without a GPU.
        with pytest.raises(BackendUnavailableError, match="create_shared_buffer.*rank 0"):
            CustomAllreduce.create_shared_buffer(1 << 20)
        with pytest.raises(NotSupportedError, match="uncached"):
            CustomAllreduce.create_shared_buffer(1 << 20, uncached=True)
        return reasons
    finally:
        dist.destroy_process_group()


def test_custom_all_reduce_refusals():
    for disabled, no_gpu in run_ranks(_custom_ar_refusals, 2, timeout=90):
        assert disabled == "disabled by GROUPCOORD_DISABLE_CUSTOM_ALL_REDUCE"
        assert no_gpu.startswith("CUDA runtime: ") or no_gpu == "no CUDA device"


def _custom_ar_world(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from device_communicators.custom_all_reduce import CustomAllreduce

    init_gloo(rank, world_size)
    try:
        return CustomAllreduce(dist.group.WORLD, 0).reason
    finally:
        dist.destroy_process_group()


def test_custom_all_reduce_refuses_unsupported_world_size():
    assert run_ranks(_custom_ar_world, 3, timeout=90) == ["world size 3 not in (2, 4, 6, 8)"] * 3


def test_coordinator_picks_the_cuda_communicator_for_cuda_groups():
    from coordinator.group_coordinator import get_device_communicator_cls
    from device_communicators.cuda_communicator import CudaCommunicator

    assert get_device_communicator_cls(torch.device("cuda", 0)) is CudaCommunicator


def test_cuda_info_describes_this_machine():
    from device_communicators.cuda_info import describe
    from device_communicators.nvrtc_compile import nvrtc_version
    from device_communicators.pynccl_wrapper import load_nccl_library

    rows = describe()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in rows)
    info = dict(rows)
    assert info["CUDA devices"].startswith("0 (")
    nccl = load_nccl_library()
    assert info["NCCL library"] == nccl.path and info["NCCL version"] == nccl.version
    assert info["NVRTC version"] == "{}.{}".format(*nvrtc_version())
    assert info["pynccl"] == "no: no CUDA device"
    assert info["custom all-reduce"] == "no: no CUDA device"
    with override(disable_pynccl=True, nccl_so_path="/nonexistent/libnccl.so.2"):
        info = dict(describe())
    assert info["NCCL library"].startswith("not loaded from /nonexistent/libnccl.so.2: cannot load")


def _registration_failure(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from device_communicators.custom_all_reduce import CustomAllreduce
    from device_communicators.errors import BackendUnavailableError

    init_gloo(rank, world_size)
    try:
        ca = CustomAllreduce(dist.group.WORLD, rank)
        # Only rank 0 "captured" a call; exporting it needs libcuda, absent here.
        if rank == 0:
            ca._graph_inputs.append(0x7F0000000000)
        with pytest.raises(BackendUnavailableError) as info:
            ca.register_graph_buffers()
        assert ca._registered == 0
        return str(info.value)
    finally:
        dist.destroy_process_group()


def test_graph_registration_failure_is_raised_on_every_rank():
    for message in run_ranks(_registration_failure, 2, timeout=90):
        assert "rank 0: exporting captured buffers failed" in message
        assert "do not replay the captured graphs" in message


def test_cuda_and_cpu_communicators_only_supply_back_ends():
    """Arguments are checked once, in the base class, and every operation runs the
    first back end of its chain that takes it: the CUDA and CPU communicators
    override no operation, public or private; they only supply their back ends."""
    from device_communicators.base_device_communicator import DeviceCommunicatorBase
    from device_communicators.cpu_communicator import CpuCommunicator
    from device_communicators.cuda_communicator import CudaCommunicator

    public = ("all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "broadcast")
    private = ("_all_gather_stacked", "_all_gather_control", "_reduce_scatter_sizes")
    for cls in (CudaCommunicator, CpuCommunicator):
        for name in (*public, *private, "send", "recv", "gather", "all_reduce"):
            assert name in DeviceCommunicatorBase.__dict__, name
            assert name not in cls.__dict__, (cls.__name__, name)
        assert "_fast_transports" in cls.__dict__ and "_fast_all_reduce_backends" in cls.__dict__
