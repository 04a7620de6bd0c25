"""``groupcoord bench``: run the benchmarks in quick mode, print one summary.

Each benchmark in ``benchmarks/`` is its own script (installed with the
package as ``groupcoord_benchmarks``, so the command works from a wheel in
any directory) (its own table, JSON and
plot). This command runs the registered ones one after another with
``--quick``, each writing its JSON to a temporary folder, then reads every
JSON back and prints one table of the rows that compare groupcoord with
``torch.distributed`` (the rows that carry a ratio). Benchmarks that are
missing, fail or time out are listed with the reason; the command still
prints what the others measured. A benchmark that exits 0 without writing
JSON (e.g. no GPU here) counts as skipped. Exit status: 0 when every benchmark
ran or skipped itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any


def _find_benchmarks() -> str:
    """The benchmark scripts: the installed ``groupcoord_benchmarks`` package (a wheel
    or an editable install), else the ``benchmarks/`` folder of this checkout."""
    spec = importlib.util.find_spec("groupcoord_benchmarks")
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(checkout, "benchmarks")


BENCH_DIR = _find_benchmarks()


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark script and how to run it quickly."""

    name: str
    script: str  # file name inside benchmarks/
    what: str
    args: tuple[str, ...] = ("--quick",)
    json_flag: str = "--json"


BENCHMARKS = (
    Benchmark("all_reduce", "bench_all_reduce.py", "shared-memory all-reduce vs Gloo"),
    Benchmark("collectives", "bench_collectives.py", "GroupCoordinator collectives vs Gloo"),
    Benchmark("mq", "bench_mq.py", "message queue vs broadcast_object_list"),
    Benchmark("codec", "bench_codec.py", "codec encode + decode vs pickle, one process"),
    Benchmark("comm_overlap", "bench_comm_overlap.py", "async all-reduce overlapped with compute"),
    Benchmark("cuda_all_reduce", "bench_cuda_allreduce.py", "custom all-reduce vs NCCL (GPU)"),
)


@dataclasses.dataclass
class Outcome:
    bench: Benchmark
    status: str  # "ok", "skipped", "missing", "failed", "timeout"
    seconds: float = 0.0
    detail: str = ""
    data: Any = None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="groupcoord bench",
        description="Run groupcoord's benchmarks in quick mode and print one summary table "
        "with ratios vs torch.distributed.",
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=[b.name for b in BENCHMARKS],
        help="run only these benchmarks",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help="each benchmark's quick mode (the default)"
    )
    mode.add_argument(
        "--full", action="store_true", help="run the full (not --quick) benchmarks: slow"
    )
    p.add_argument("--out", metavar="DIR", help="keep each benchmark's JSON in DIR")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="per benchmark, seconds (default 300)"
    )
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    return p


def run_benchmark(bench: Benchmark, out_dir: str, full: bool, timeout: float) -> Outcome:
    script = os.path.join(BENCH_DIR, bench.script)
    if not os.path.exists(script):
        return Outcome(bench, "missing", detail=f"{script} not found")
    json_path = os.path.join(out_dir, f"{bench.name}.json")
    args = [a for a in bench.args if not (full and a == "--quick")]
    cmd = [sys.executable, script, *args, bench.json_flag, json_path]
    print(f"$ {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Outcome(bench, "timeout", timeout, f"did not finish within {timeout:g} s")
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        return Outcome(bench, "failed", seconds, f"exit code {proc.returncode}: {last}")
    if not os.path.exists(json_path):
        # A benchmark that cannot run here (e.g. no GPU) says why and writes nothing.
        said = [ln for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
        return Outcome(bench, "skipped", seconds, said[0] if said else "wrote no results")
    try:
        with open(json_path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        return Outcome(bench, "failed", seconds, f"no readable JSON at {json_path}: {exc}")
    return Outcome(bench, "ok", seconds, data=data)


def _row_dicts(data: Any) -> Iterator[dict[str, Any]]:
    """Every dict in the JSON that looks like a result row (rows may nest under any key)."""
    if isinstance(data, dict):
        # A row with a "rank" field is one rank's detail behind a summary row: skip it.
        if "rank" not in data and (_times(data) or _rates(data) or _ratio_key(data)):
            yield data
        for value in data.values():
            if isinstance(value, (dict, list)):
                yield from _row_dicts(value)
    elif isinstance(data, list):
        for item in data:
            yield from _row_dicts(item)


# A time column is "<who>_<unit>"; ours and torch.distributed's are told apart by <who>.
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_OURS = ("ours", "groupcoord", "shm", "mq", "custom")
_TORCH = ("torch", "gloo")


def _time_key(row: dict[str, Any], who: tuple[str, ...]) -> tuple[str, float] | None:
    for key, value in row.items():
        prefix, _, unit = str(key).rpartition("_")
        if unit in _UNITS and prefix.lower() in who and isinstance(value, (int, float)):
            return str(key), float(value) * _UNITS[unit]
    return None


def _times(row: dict[str, Any]) -> tuple[tuple[str, float], tuple[str, float]] | None:
    ours, torch_time = _time_key(row, _OURS), _time_key(row, _TORCH)
    return (ours, torch_time) if ours is not None and torch_time is not None else None


def _rates(row: dict[str, Any]) -> tuple[str, float, float] | None:
    """A throughput pair: ``"<x>/s"`` (ours) next to ``"gloo <x>/s"`` or ``"torch <x>/s"``."""
    for key, value in row.items():
        key = str(key)
        if not key.endswith("/s") or " " in key or not isinstance(value, (int, float)):
            continue
        for who in _TORCH:
            theirs = row.get(f"{who} {key}")
            if isinstance(theirs, (int, float)):
                return key, float(value), float(theirs)
    return None


def _ratio_key(row: dict[str, Any]) -> str | None:
    for key, value in row.items():
        low = str(key).lower()
        if ("ratio" in low or low == "gain") and isinstance(value, (int, float)):
            return str(key)
    return None


# Fields that say which case a row measures, in the order they are shown.
CASE_KEYS = (
    "op",
    "case",
    "name",
    "kind",
    "payload",
    "dtype",
    "size",
    "MiB",
    "compute",
    "world",
    "world_size",
    "readers",
)


def _case(row: dict[str, Any]) -> str:
    parts = []
    for key in CASE_KEYS:
        if key in row and not isinstance(row[key], (dict, list)):
            parts.append(f"{key}={row[key]}")
    if "size" not in row and isinstance(row.get("bytes"), int):
        parts.append(f"size={_human_bytes(row['bytes'])}")
    return " ".join(parts) or "-"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:g} GiB"


def summary_rows(outcomes: list[Outcome]) -> list[dict[str, str]]:
    """One line per compared case: both times (or rates) and groupcoord's speedup."""
    rows = []
    for outcome in outcomes:
        if outcome.status != "ok":
            continue
        for row in _row_dicts(outcome.data):
            times = _times(row)
            line = {"benchmark": outcome.bench.name, "case": _case(row)}
            if times is not None:
                (_, ours), (_, theirs) = times
                line["groupcoord"] = f"{ours * 1e6:,.1f} us"
                line["torch.distributed"] = f"{theirs * 1e6:,.1f} us"
                line["speedup"] = f"{theirs / ours:.3g}x" if ours > 0 else "-"
            elif (rates := _rates(row)) is not None:
                unit, ours, theirs = rates
                line["groupcoord"] = f"{ours:,.0f} {unit}"
                line["torch.distributed"] = f"{theirs:,.0f} {unit}"
                line["speedup"] = f"{ours / theirs:.3g}x" if theirs > 0 else "-"
            else:
                key = _ratio_key(row)
                assert key is not None  # _row_dicts yields rows with times or a ratio
                line["speedup"] = f"{row[key]:.3g} ({key})"
            rows.append(line)
    return rows


def format_table(rows: list[dict[str, str]], columns: list[str]) -> str:
    widths = [max([len(c)] + [len(r.get(c, "")) for r in rows]) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(r.get(c, "").ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    selected = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    if args.list:
        for b in selected:
            there = "" if os.path.exists(os.path.join(BENCH_DIR, b.script)) else "  (missing)"
            print(f"{b.name:<16} benchmarks/{b.script:<26} {b.what}{there}")
        return 0
    if args.timeout <= 0:
        print(f"bench: --timeout must be positive, got {args.timeout}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="groupcoord_bench_") as tmp:
        out_dir = args.out or tmp
        os.makedirs(out_dir, exist_ok=True)
        outcomes = [run_benchmark(b, out_dir, args.full, args.timeout) for b in selected]
    print("\nbenchmarks run:")
    for o in outcomes:
        print(f"  {o.bench.name:<16} {o.status:<8} {o.seconds:6.1f} s  {o.bench.what}. {o.detail}")
    rows = summary_rows(outcomes)
    print()
    if rows:
        columns = ["benchmark", "case", "groupcoord", "torch.distributed", "speedup"]
        print(format_table(rows, columns))
        print(
            "(speedup = torch.distributed time / groupcoord time: above 1 means groupcoord is faster)"
        )
    else:
        print("no comparison rows: no benchmark produced results")
    print(
        "\n(measured on this machine now; on a shared or loaded machine the numbers are noisy. "
        "Each benchmark's own table has medians and percentiles: run it alone.)"
    )
    return 0 if all(o.status in ("ok", "skipped") for o in outcomes) else 1
