"""``python -m coordinator bench``: runs benchmark scripts, survives failures, sums up ratios."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from coordinator.cli import bench

GOOD_SCRIPT = """
import json, sys
args = sys.argv[1:]
assert "--quick" in args, args
path = args[args.index("--json") + 1]
rows = [
    {"op": "all_reduce", "bytes": 4096, "world": 2, "ours_us": 20.0, "torch_ms": 0.3},
    {"op": "all_reduce", "bytes": 16777216, "world": 2, "note": "no comparison here"},
    {"op": "overlap", "world": 2, "overlap_ratio": 1.5},
    {"op": "overlap", "world": 2, "rank": 1, "overlap_ratio": 1.7},
    {"case": "tensor 4 KiB", "readers": 3, "msgs/s": 50000.0, "gloo msgs/s": 2000.0, "ratio": 25.0},
]
json.dump({"command": "x", "results": rows}, open(path, "w"))
print("table")
"""

SKIP_SCRIPT = """
print("no CUDA GPU on this machine: nothing to measure")
"""

BAD_SCRIPT = """
import sys
print("boom: no shared memory", file=sys.stderr)
sys.exit(3)
"""


def test_bench_runs_scripts_and_summarises(tmp_path, monkeypatch, capsys):
    (tmp_path / "bench_good.py").write_text(GOOD_SCRIPT)
    (tmp_path / "bench_bad.py").write_text(BAD_SCRIPT)
    (tmp_path / "bench_skip.py").write_text(SKIP_SCRIPT)
    monkeypatch.setattr(bench, "BENCH_DIR", str(tmp_path))
    monkeypatch.setattr(
        bench,
        "BENCHMARKS",
        (
            bench.Benchmark("good", "bench_good.py", "a good one"),
            bench.Benchmark("bad", "bench_bad.py", "a failing one"),
            bench.Benchmark("gone", "bench_gone.py", "a missing one"),
            bench.Benchmark("skip", "bench_skip.py", "one that cannot run here"),
        ),
    )
    out_dir = tmp_path / "out"
    code = bench.main(["--out", str(out_dir), "--timeout", "60"])
    text = capsys.readouterr().out
    assert code == 1  # not every benchmark ran
    assert json.loads((out_dir / "good.json").read_text())["results"][0]["world"] == 2
    assert "good             ok" in text
    assert "bad              failed" in text and "exit code 3: boom: no shared memory" in text
    assert "gone             missing" in text
    assert "skip             skipped" in text and "no CUDA GPU" in text
    summary = [line for line in text.splitlines() if line.startswith("good ")]
    assert len(summary) == 3, text  # the rows that compare, not the note
    assert "op=all_reduce world=2 size=4 KiB" in summary[0]
    assert "20.0 us" in summary[0] and "300.0 us" in summary[0]
    assert "15x" in summary[0]
    assert "op=overlap world=2" in summary[1] and "1.5 (overlap_ratio)" in summary[1]
    assert "case=tensor 4 KiB readers=3" in summary[2]
    assert "50,000 msgs/s" in summary[2] and "2,000 msgs/s" in summary[2] and "25x" in summary[2]


def test_bench_only_and_list(tmp_path, monkeypatch, capsys):
    (tmp_path / "bench_good.py").write_text(GOOD_SCRIPT)
    monkeypatch.setattr(bench, "BENCH_DIR", str(tmp_path))
    monkeypatch.setattr(
        bench,
        "BENCHMARKS",
        (
            bench.Benchmark("good", "bench_good.py", "a good one"),
            bench.Benchmark("gone", "bench_gone.py", "a missing one"),
        ),
    )
    assert bench.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert "good" in listing and "gone" in listing and "(missing)" in listing
    assert bench.main(["--only", "good"]) == 0
    assert "gone" not in capsys.readouterr().out


def _threads_after_preamble(rank: int, world: int, port: int) -> int:
    import torch

    from benchmarks._common import init_gloo_rank

    init_gloo_rank(rank, world, port, timeout_s=60)
    return torch.get_num_threads()


def test_benchmark_ranks_run_on_torchs_default_threads_not_the_parents() -> None:
    """A rank forked from a parent held at one thread (conftest, and every benchmark's
    parent) gets the thread count a fresh process gets, as a user's rank does: until
    this test the preamble forced one thread, whatever ``--threads`` asked for."""
    import subprocess
    import sys

    import torch

    from benchmarks._common import prepare_parent
    from coordinator.launch import free_port, run_ranks

    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert prepare_parent() == int(fresh.stdout.split()[-1])
    assert torch.get_num_threads() == 1  # the forking parent stays single-threaded
    got = run_ranks(_threads_after_preamble, 2, free_port(), timeout=60)
    assert got == [int(fresh.stdout.split()[-1])] * 2


def test_the_peer_reads_benchmark_times_both_ways_and_says_which_path_the_rule_took(
    tmp_path, capsys
) -> None:
    import pytest

    from benchmarks.bench_peer_reads import main

    out = tmp_path / "peer_reads.json"
    args = ["--worlds", "2", "--sizes", "262144,393216", "--rounds", "2", "--json", str(out)]
    assert main([*args, "--ops", "broadcast,reduce_scatter"]) == 0
    printed = capsys.readouterr().out
    if "no direct reads here" in printed:
        pytest.skip(printed.strip().splitlines()[1])
    rows = json.loads(out.read_text())["rows"]
    paths = {(r["op"], r["bytes"]): r["path"] for r in rows}
    # 256 KiB is the lean path's; a world-2 broadcast over it reads the root
    # directly when each rank has a core; a reduce-scatter needs a 512 KiB share.
    assert paths == {
        ("broadcast", 262144): "slots",
        ("broadcast", 393216): "direct" if (os.cpu_count() or 1) >= 2 else "slots",
        ("reduce_scatter", 262144): "slots",
        ("reduce_scatter", 393216): "slots",
    }, paths
    assert all(
        r["rule_us"] > 0 and r["slots_us"] > 0 and r["rule_won"].endswith("/2") for r in rows
    )


def test_the_collectives_benchmark_times_point_to_point_through_comm_too(tmp_path) -> None:
    from benchmarks.bench_collectives import main

    out = tmp_path / "collectives.json"
    args = ["--worlds", "2", "--sizes", "4096", "--quick", "--no-mpi", "--json", str(out)]
    assert main([*args, "--ops", "send_recv,ring_exchange"]) == 0
    rows = {r["op"]: r for r in json.loads(out.read_text())["rows"]}
    # send_recv: GroupCoordinator, Gloo and Comm, one way each; ring_exchange: a
    # Comm batch against dist.batch_isend_irecv.
    assert rows["send_recv"]["comm_us"] > 0 and rows["send_recv"]["torch_us"] > 0
    assert rows["ring_exchange"]["ours_us"] > 0 and rows["ring_exchange"]["torch_us"] > 0


def test_the_collectives_benchmark_gives_mpi_and_ours_the_same_pages(tmp_path, monkeypatch) -> None:
    """MPI's numpy arrays stay on ordinary pages (as torch's tensors) unless
    ``--huge-pages``, which puts every side's inputs on huge pages."""
    import subprocess

    from benchmarks import bench_collectives

    out = tmp_path / "collectives.json"
    args = ["--worlds", "2", "--sizes", "4194304", "--ops", "all_gather", "--quick"]
    assert bench_collectives.main([*args, "--no-mpi", "--huge-pages", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["ours_us"] > 0

    seen = []

    def run(command, **kwargs):
        seen.append(kwargs["env"]["NUMPY_MADVISE_HUGEPAGE"])
        return subprocess.CompletedProcess(command, 0, stdout="[]\n", stderr="")

    monkeypatch.setattr(bench_collectives.subprocess, "run", run)
    got = [
        bench_collectives.mpi_rows(2, [4194304], ["all_gather"], True, huge_pages)
        for huge_pages in (False, True)
    ]
    if got != [[], []]:  # MPI is not installed here: each says why
        assert all(isinstance(why, str) for why in got) and not seen, got
        return
    assert seen == ["0", "1"]


def test_the_desync_benchmark_measures_the_check_it_names() -> None:
    """Its in-process timing drives the control lines' stamp and barrier directly: a
    change of the check's signature once broke the benchmark (the twenty-ninth
    session) with the suite green. One short round of two of its measurements."""
    from benchmarks.bench_desync import _comm_all_reduce_us, _per_call_ns
    from coordinator.launch import run_ranks

    assert _per_call_ns(2, 2000) > 0
    assert min(run_ranks(_comm_all_reduce_us, 2, True, timeout=120)) > 0


def test_the_codec_benchmark_counts_each_payloads_own_read(monkeypatch, capsys) -> None:
    import torch

    from benchmarks import bench_codec

    phases = bench_codec._phases(10)
    assert [name for name, _, _ in phases][:3] == [
        "nothing",
        "small object: encode",
        "small object: read",
    ]
    read = {name[: -len(": read")]: fn() for name, fn, _ in phases if name.endswith(": read")}
    assert read["small object"]["request"] == 12345
    assert type(read["engine step"]).__name__ == "EngineStep"
    assert read["engine step"].input_ids is not None
    assert read["engine step, no tensors"].input_ids is None
    assert torch.equal(read["tensor 4 KiB"], torch.arange(1024, dtype=torch.float32))
    assert read["token ids 16 x 256"][3][:2] == [3, 4]
    # Without valgrind the instruction count says why, and nothing else runs.
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert bench_codec.main(["--instructions"]) == 2
    assert "valgrind" in capsys.readouterr().out


def test_the_codec_benchmark_times_whole_queue_calls_each_read() -> None:
    from benchmarks import bench_codec

    writer, reader = bench_codec._local_queue()
    try:
        enqueue_us, dequeue_us = bench_codec._queue_calls_us(writer, reader, {"a": 1}, 16)
        assert 0 < enqueue_us < 10_000 and 0 < dequeue_us < 10_000
        # Every timed message was read: the next one read is the next one sent.
        writer.enqueue("last", timeout=5)
        assert reader.dequeue(timeout=5) == "last"
    finally:
        reader.close()
        writer.close()


def test_the_collectives_instruction_count_runs_both_ranks_phases_in_step(
    tmp_path, monkeypatch, capsys
) -> None:
    """``bench_collectives.py --instructions``' ranks, natively (no valgrind here):
    rank 0 lists the phases and hands over before and after each while rank 1 runs
    the same calls, so both finish; this test plays the counting parent's part."""
    import subprocess
    import sys
    import time

    from benchmarks import bench_collectives
    from benchmarks._callgrind import DONE, READY
    from coordinator.launch import free_port

    at = f"{free_port()}:{tmp_path}"
    argv = ["--instructions-at", at, "--ops", "all_reduce,broadcast,barrier", "--sizes", "4096,64"]
    ranks = [
        subprocess.Popen(
            [sys.executable, bench_collectives.__file__, "--instructions-rank", str(rank), *argv]
        )
        for rank in (0, 1)
    ]

    def handover(name: str) -> None:
        path = tmp_path / name
        deadline = time.monotonic() + 90
        while not path.exists():
            assert all(r.poll() is None for r in ranks), [r.returncode for r in ranks]
            assert time.monotonic() < deadline, f"no {name} hand-over"
            time.sleep(0.01)
        path.unlink()

    try:
        handover(READY)
        phases = (tmp_path / "phases").read_text().splitlines()
        # barrier is not an op it counts: left out, not an error.
        assert [line.split(" ", 1)[1] for line in phases] == [
            "nothing", "all_reduce 4 KiB", "all_reduce 64 B", "broadcast 4 KiB", "broadcast 64 B",
        ]  # fmt: skip
        for _ in phases:
            handover(DONE)
        assert [r.wait(timeout=60) for r in ranks] == [0, 0]
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
    # Without valgrind the count says why; --ops naming nothing it counts is refused.
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert bench_collectives.main(["--instructions"]) == 2
    assert "valgrind" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_collectives.main(["--instructions", "--ops", "barrier"])
    assert "--ops names none" in capsys.readouterr().err
