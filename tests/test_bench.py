"""``python -m coordinator bench``: runs benchmark scripts, survives failures, sums up ratios."""

from __future__ import annotations

import json

from coordinator import bench

GOOD_SCRIPT = """
import json, sys
args = sys.argv[1:]
assert "--quick" in args, args
path = args[args.index("--json") + 1]
rows = [
    {"op": "all_reduce", "size": 4096, "world": 2, "ours_us": 20.0, "torch_us": 300.0,
     "ratio_torch_over_ours": 15.0},
    {"op": "all_reduce", "size": 16777216, "world": 2, "note": "no comparison here"},
]
json.dump({"command": "x", "results": rows}, open(path, "w"))
print("table")
"""

BAD_SCRIPT = """
import sys
print("boom: no shared memory", file=sys.stderr)
sys.exit(3)
"""


def test_bench_runs_scripts_and_summarises(tmp_path, monkeypatch, capsys):
    (tmp_path / "bench_good.py").write_text(GOOD_SCRIPT)
    (tmp_path / "bench_bad.py").write_text(BAD_SCRIPT)
    monkeypatch.setattr(bench, "BENCH_DIR", str(tmp_path))
    monkeypatch.setattr(
        bench,
        "BENCHMARKS",
        (
            bench.Benchmark("good", "bench_good.py", "a good one"),
            bench.Benchmark("bad", "bench_bad.py", "a failing one"),
            bench.Benchmark("gone", "bench_gone.py", "a missing one"),
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
    summary = [line for line in text.splitlines() if line.startswith("good ")]
    assert len(summary) == 1, text  # only the row with a ratio
    assert "op=all_reduce size=4 KiB world=2" in summary[0]
    assert "20 (ours_us)" in summary[0] and "300 (torch_us)" in summary[0]
    assert "15x" in summary[0] and "ratio_torch_over_ours" in summary[0]


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
