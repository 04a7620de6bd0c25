"""The demo: its model shards, the whole ``python -m coordinator demo`` run, its failure path."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from coordinator.cli.demo.model import (
    LocalOps,
    ModelConfig,
    Stage,
    reference_logits,
    stage_layers,
    step_input_ids,
)
from coordinator.launch import init_gloo, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, ffn_size=32, num_layers=4)


class _CommunicatorOps:
    """ParallelOps over bare device communicators: TP and EP both span the world group."""

    def __init__(self, use_ep: bool, backend: str) -> None:
        import torch.distributed as dist

        from device_communicators.all2all import create_all2all_manager
        from device_communicators.base_device_communicator import DeviceCommunicatorBase

        self.comm = DeviceCommunicatorBase(dist.group.WORLD, unique_name="tp")
        self.comm.set_all2all_manager(create_all2all_manager(backend, self.comm))
        self.use_ep = use_ep
        self.tp_size = self.ep_size = self.comm.world_size
        self.tp_rank = self.ep_rank = self.comm.rank_in_group

    def tp_all_reduce(self, x):
        return self.comm.all_reduce(x)

    def tp_all_gather(self, x, dim):
        return self.comm.all_gather(x, dim=dim)

    def tp_all_gatherv(self, x, sizes):
        return self.comm.all_gatherv(x, dim=0, sizes=sizes)

    def ep_dispatch(self, hidden, logits):
        return self.comm.dispatch_router_logits(hidden, logits, True)

    def ep_combine(self, hidden):
        return self.comm.combine(hidden, True)


def _sharded_rank(rank: int, world_size: int, use_ep: bool, backend: str, tokens: int):
    init_gloo(rank, world_size)
    ops = _CommunicatorOps(use_ep, backend)
    stage = Stage(CFG, ops)
    if use_ep:
        ops.comm.prepare_communication_buffer_for_model(stage)
    ids = step_input_ids(CFG, 0, 0, tokens)
    with torch.inference_mode():
        out = stage(ids, ops)
    ops.comm.destroy()
    return out.tolist()


@pytest.mark.parametrize(
    "use_ep,backend,tokens",
    [(False, "naive", 7), (True, "naive", 7), (True, "allgather_reducescatter", 1)],
)
def test_tp_and_ep_shards_match_single_process(use_ep, backend, tokens):
    """TP=2 (and EP=2) shards of the demo model give the one-process logits."""
    results = run_ranks(_sharded_rank, 2, use_ep, backend, tokens, timeout=90)
    want = reference_logits(CFG, step_input_ids(CFG, 0, 0, tokens), use_ep)
    for got in results:
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4)


def test_pipeline_stages_cover_layers_and_compose():
    for layers, pp in [(4, 2), (5, 2), (7, 3), (3, 3)]:
        covered = [i for s in range(pp) for i in stage_layers(layers, pp, s)]
        assert covered == list(range(layers))
    ops = LocalOps()
    ids = step_input_ids(CFG, 3, 1, 9)
    stages = [Stage(CFG, ops, s, 3) for s in range(3)]
    x = ids
    for stage in stages:
        x = stage(x, ops)
    torch.testing.assert_close(x, reference_logits(CFG, ids, False), rtol=0, atol=0)


def test_model_config_refuses_unsplittable_sizes():
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by tp=3"):
        ModelConfig().check(3, 1, 1)
    with pytest.raises(ValueError, match="num_experts=4 must be divisible by the EP size 8"):
        ModelConfig().check(2, 1, 8)


# ---- the whole command ------------------------------------------------------------


def _run_demo(
    *args: str, timeout: float = 150.0, deadline_s: str = "60"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GROUPCOORD_TIMEOUT_S": deadline_s, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-m", "coordinator", "demo", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _processes_with(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # the process ended while we looked
        if marker in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def test_demo_tp2_pp2_passes_its_check():
    result = _run_demo("--steps", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "starting 4 CPU ranks (tp=2 pp=2 dp=1 ep=off)" in out
    assert "[demo] step 3/3" in out
    for column in ("all-reduce ms", "tensor-dict P2P ms", "MQ broadcast ms", "bytes"):
        assert column in out
    assert "demo check passed: 3 step outputs match" in out


def test_demo_with_expert_parallel_over_dp_and_tp(tmp_path):
    png = tmp_path / "demo.png"
    result = _run_demo(
        "--tp", "2", "--pp", "1", "--dp", "2", "--ep", "--all2all", "naive",
        "--steps", "2", "--tokens", "5", "--backend-report", "--plot", str(png),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ep: ranks [0, 1, 2, 3]" in result.stdout
    assert "all2all: naive" in result.stdout
    assert "demo check passed: 4 step outputs match" in result.stdout
    assert png.stat().st_size > 1000


def test_demo_rank_failure_names_rank_and_ends_every_process():
    marker = "--timeout=97.25"  # unique in this test's command lines
    result = _run_demo("--fail-rank", "2", "--fail-step", "1", "--steps", "3", marker)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "demo FAILED: rank 2 raised RuntimeError: injected failure" in result.stderr
    assert "--- rank 2 traceback ---" in result.stderr
    assert _processes_with(marker) == []


def test_demo_refuses_bad_sizes_before_starting_ranks(capsys):
    from coordinator.cli.demo import main

    assert main(["--tp", "3"]) == 2
    assert "num_heads=4 must be divisible by tp=3" in capsys.readouterr().err


def test_check_logits_detects_a_mismatch():
    from coordinator.cli.demo.rank import check_logits
    from coordinator.cli.demo.report import RankReport, logits_record

    ids = step_input_ids(CFG, 0, 0, 5)
    good = reference_logits(CFG, ids, False)
    report = RankReport(rank=0, tp_rank=0, pp_rank=1, dp_rank=0, logits=[logits_record(0, 0, good)])
    ok, verdict = check_logits(CFG, [report], False, expected=1)
    assert ok, verdict
    bad = good.clone()
    bad[2, 3] += 1e-2
    report.logits = [logits_record(0, 0, bad)]
    ok, verdict = check_logits(CFG, [report], False, expected=1)
    assert not ok and "step 0 replica 0" in verdict
    ok, verdict = check_logits(CFG, [report], False, expected=2)
    assert not ok


def _torchrun_demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GROUPCOORD_TIMEOUT_S": "60", "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*cmd, "-m", "coordinator", "demo", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_demo_runs_as_one_rank_under_torchrun():
    result = _torchrun_demo("--tp", "2", "--pp", "1", "--ep", "--steps", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "starting" not in result.stdout  # torchrun started the ranks, not the demo
    assert "demo check passed: 2 step outputs match" in result.stdout


def test_demo_failure_under_torchrun_names_the_rank():
    result = _torchrun_demo("--tp", "2", "--pp", "1", "--steps", "2", "--fail-rank", "1")
    assert result.returncode != 0
    assert "demo: rank 1 failed: RuntimeError: injected failure" in result.stderr


def test_demo_rank_killed_is_named_and_its_shared_memory_removed():
    marker = "--timeout=97.5"
    result = _run_demo("--fail-rank", "1", "--fail-mode", "kill", "--steps", "3", marker)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "demo FAILED: rank 1 was killed by SIGKILL without reporting an error" in result.stderr
    assert _processes_with(marker) == []


def test_demo_hung_rank_is_named_by_its_peers_deadlines():
    marker = "--timeout=97.75"
    result = _run_demo(
        "--fail-rank", "1", "--fail-mode", "hang", "--steps", "3", marker, deadline_s="3"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "demo FAILED: rank(s) [1] stopped responding" in result.stderr
    # Each peer's own report says what it waited for, and for how long.
    assert "raised GroupcoordTimeoutError" in result.stderr
    assert "timed out after 3 s" in result.stderr and "waiting for ranks [1]" in result.stderr
    assert "ending the ranks still running: [1]" in result.stderr
    assert _processes_with(marker) == []


def test_demo_ranks_end_when_the_launcher_is_killed():
    marker = "--timeout=98.25"
    env = {**os.environ, "GROUPCOORD_TIMEOUT_S": "60", "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "coordinator", "demo", "--fail-rank", "1", "--fail-mode"]
    launcher = subprocess.Popen(
        [*cmd, "hang", "--steps", "3", marker],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # ranks are up once the first step is done
            if line.startswith("[demo] step 1/3"):
                break
        assert len(_processes_with(marker)) == 5  # the launcher and its 4 ranks
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 20
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_with(marker) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
