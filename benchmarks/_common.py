"""Small helpers shared by the benchmarks: the rank preamble, statistics, a text table,
JSON and PNG output.

Every benchmark starts its ranks with the project's launcher
(``coordinator.launch.run_ranks``; each rank joins Gloo with ``init_gloo_rank``),
prints a table to stdout, writes its rows as JSON and, with ``--plot``, a PNG.
Keeping that here makes all benchmarks read the same way.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.launch import init_gloo

_default_threads: int | None = None


def torch_default_threads() -> int:
    """The intra-op thread count torch gives a fresh process here, as a rank that
    torchrun or an engine starts gets (``OMP_NUM_THREADS`` included): asked of a
    fresh interpreter once. A benchmark's parent keeps its own pool at one thread
    (a rank forked after the pool started can hang), and its forked ranks inherit
    that: they set this instead. Call it in the parent before forking, so the
    ranks inherit the answer."""
    global _default_threads
    if _default_threads is None:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        _default_threads = int(done.stdout.split()[-1])
    return _default_threads


def prepare_parent() -> int:
    """Before forking ranks: learn torch's default thread count (the ranks inherit
    the answer), then keep this process's own pool at one thread. Returns the
    default, for the table's header."""
    import torch

    threads = torch_default_threads()
    torch.set_num_threads(1)
    return threads


def init_gloo_rank(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Rank preamble: torch's default intra-op threads, as a user's rank has them
    (``torch_default_threads``), then join Gloo at 127.0.0.1:``port``."""
    import torch

    torch.set_num_threads(torch_default_threads())
    init_gloo(rank, world, timeout_s, port=port)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return percentile(values, 50.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be within [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = math.ceil(pos)
    if low == high:
        return float(ordered[low])
    return float(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; sizes in benchmark tables."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} GiB"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or math.isnan(value):
            return f"{value:g}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Right-aligned text table of ``rows`` (dicts) limited to ``columns``."""
    cells = [[_cell(row.get(col, "")) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)
    return "\n".join(lines)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Print ``format_table(rows, columns)`` to stdout."""
    print(format_table(rows, columns), flush=True)


def environment() -> dict[str, Any]:
    """Facts about the machine a result came from (stored next to the numbers)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None:
        info["torch"] = getattr(torch_mod, "__version__", "?")
    return info


def reproduce_command(argv: Sequence[str] | None = None) -> str:
    """The shell command that reruns this benchmark with the same arguments."""
    args = list(sys.argv if argv is None else argv)
    script = args[0] if args else ""
    if script.endswith(".py"):
        script = os.path.relpath(os.path.abspath(script))
    return " ".join(shlex.quote(a) for a in ["python", script, *args[1:]])


def write_json(path: str, data: Any) -> str:
    """Write ``data`` as indented JSON to ``path`` (creating folders); return the path."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=False)
        fh.write("\n")
    return path


def plot_lines(
    path: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = True,
    logy: bool = True,
) -> str:
    """Plot named (x, y) series to a PNG at ``path``; needs matplotlib (extra ``bench``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``; perf_counter based."""

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
