"""Small helpers shared by the benchmarks: rank launching, statistics, a text table, JSON and PNG output.

Every benchmark runs its ranks through ``run_ranks`` (each rank joins Gloo with
``init_gloo_rank``), prints a table to stdout, writes its rows as JSON and,
with ``--plot``, a PNG. Keeping that here makes all benchmarks read the same way.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import shlex
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

# After the last result (or the first failure), how long ranks get to tear down
# (destroy groups, unlink shared memory) before SIGTERM, then SIGKILL.
END_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the Gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo_rank(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Rank preamble: one torch thread, then join Gloo at 127.0.0.1:``port``."""
    import torch
    import torch.distributed as dist

    # Ranks share the machine's cores: one intra-op thread each, as the parent.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _rank_entry(
    conn: Connection, target: Callable[..., Any], rank: int, world: int, args: tuple[Any, ...]
) -> None:
    # SIGTERM from the launcher becomes SystemExit so teardown still runs.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        try:
            reply = {"ok": target(rank, world, *args)}
        except BaseException:  # noqa: BLE001 - every failure goes to the launcher
            reply = {"error": traceback.format_exc()}
        # JSON, never pickle, on the wire (even between our own processes).
        conn.send_bytes(json.dumps(reply).encode())
    finally:
        from shm_broadcast.segments import cleanup_owned_segments

        cleanup_owned_segments()
        conn.close()


def run_ranks(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float,
    start_method: str = "fork",
) -> list[Any]:
    """Run ``target(rank, world, *args)`` in ``world`` processes; return each rank's result.

    ``target`` is a module-level function whose result is JSON-able; it travels
    back as JSON. Raises RuntimeError naming the rank (with its traceback) when
    a rank fails, exits without a result or exits non-zero after answering, TimeoutError naming the ranks that
    gave no result within ``timeout`` seconds. Every process is ended on every path.
    """
    ctx = mp.get_context(start_method)
    procs = []
    conns: dict[Connection, int] = {}
    try:
        for rank in range(world):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_entry, args=(child_end, target, rank, world, args), daemon=True
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns[parent_end] = rank
        results = _collect(conns, world, timeout)
        _end_all(procs)
        # A rank that answered but then crashed in teardown still failed the run.
        codes = {rank: proc.exitcode for rank, proc in enumerate(procs) if proc.exitcode != 0}
        if codes:
            raise RuntimeError(f"world {world}: ranks exited with codes {codes} after answering")
        return results
    finally:
        # Ends close after the ranks are gone: a rank still sending sees no broken pipe.
        _end_all(procs)
        for conn in conns:
            conn.close()


def _collect(conns: dict[Connection, int], world: int, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    while pending:
        left = deadline - time.monotonic()
        ready = wait(list(pending), timeout=max(left, 0.0)) if left > 0 else []
        if not ready:
            missing = ", ".join(str(r) for r in sorted(pending.values()))
            raise TimeoutError(
                f"world {world}: rank(s) {missing} gave no result within {timeout:g} s"
            )
        for conn in ready:
            rank = pending.pop(conn)
            try:
                reply = json.loads(conn.recv_bytes())
            except EOFError:
                raise RuntimeError(f"world {world}: rank {rank} exited without a result") from None
            if "error" in reply:
                raise RuntimeError(f"world {world}: rank {rank} failed:\n{reply['error']}")
            results[rank] = reply["ok"]
    return [results[rank] for rank in range(world)]


def _end_all(procs: Sequence[Any]) -> None:
    """Join every rank within END_GRACE_S, then SIGTERM, then SIGKILL the rest."""
    deadline = time.monotonic() + END_GRACE_S
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


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
