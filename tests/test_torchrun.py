"""The coordinator under a real ``torchrun --nproc-per-node 2`` launch (env://)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from coordinator.launch import free_port

WORKER = textwrap.dedent(
    """
    import json, os
    import torch
    from coordinator import (
        destroy_distributed_environment, get_tp_group, init_distributed_environment,
        initialize_model_parallel,
    )

    torch.set_num_threads(1)
    # Twice: the elastic agent's store keeps the first round's keys, which
    # torch's own env:// rendezvous would read again in the second.
    for round_ in (1, 2):
        init_distributed_environment(backend="gloo")  # RANK, WORLD_SIZE, MASTER_* from torchrun
        initialize_model_parallel(tensor_model_parallel_size=2)
        tp = get_tp_group()
        x = torch.arange(4.0) * (tp.rank_in_group + 1)
        out = {
            "rank": tp.rank,
            "local_rank": tp.local_rank,
            "sum": tp.all_reduce(x).tolist(),
            "gathered": tp.all_gather(x, dim=0).tolist(),
            "step": tp.broadcast_object({"step": round_} if tp.rank_in_group == 0 else None),
        }
        destroy_distributed_environment()
    # One file per rank: two ranks printing to one pipe can interleave lines.
    out_dir = os.environ["GROUPCOORD_TEST_OUT"]
    with open(os.path.join(out_dir, f"rank{out['rank']}.json"), "w") as fh:
        json.dump(out, fh)
    """
)


def test_two_ranks_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.getcwd(),
        "GROUPCOORD_TEST_OUT": str(tmp_path),
    }
    proc = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["local_rank"] for r in results] == [0, 1]
    for r in results:
        assert r["sum"] == [0.0, 3.0, 6.0, 9.0]
        assert r["gathered"] == [0.0, 1.0, 2.0, 3.0, 0.0, 2.0, 4.0, 6.0]
        assert r["step"] == {"step": 2}  # the second round's
