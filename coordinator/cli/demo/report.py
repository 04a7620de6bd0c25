"""What the demo measures and prints: per-rank step records, the table, the plot.

Ranks fill a :class:`RankReport` (msgspec Struct, so it travels as msgpack,
never pickle), world rank 0 gathers them all, checks the last stage's logits
against the single-process model and prints one table.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import msgspec
import torch

# Communication kinds timed by the demo, in table order.
KINDS = ("all_reduce", "all_gather", "p2p", "mq", "dispatch_combine")
KIND_TITLES = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "p2p": "tensor-dict P2P",
    "mq": "MQ broadcast",
    "dispatch_combine": "dispatch/combine",
}


class StepRecord(msgspec.Struct):
    step: int
    tokens: int
    total_s: float = 0.0
    comm_s: dict[str, float] = {}
    comm_bytes: dict[str, int] = {}


class LogitsRecord(msgspec.Struct):
    step: int
    replica: int
    tokens: int
    vocab: int
    data: bytes  # float32, row-major


class RankReport(msgspec.Struct):
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    steps: list[StepRecord] = []
    logits: list[LogitsRecord] = []
    backends: list[str] = []


class CommMeter:
    """Accumulates time and payload bytes per communication kind for the current step."""

    def __init__(self) -> None:
        self.current: StepRecord | None = None

    def start_step(self, step: int, tokens: int) -> StepRecord:
        self.current = StepRecord(step=step, tokens=tokens, comm_s={}, comm_bytes={})
        return self.current

    @contextlib.contextmanager
    def measure(self, kind: str, nbytes: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            record = self.current
            if record is not None:
                record.comm_s[kind] = record.comm_s.get(kind, 0.0) + time.perf_counter() - start
                record.comm_bytes[kind] = record.comm_bytes.get(kind, 0) + int(nbytes)


def logits_record(step: int, replica: int, logits: torch.Tensor) -> LogitsRecord:
    flat = logits.detach().to(torch.float32).contiguous()
    return LogitsRecord(
        step=step,
        replica=replica,
        tokens=flat.shape[0],
        vocab=flat.shape[1],
        data=flat.numpy().tobytes(),
    )


def logits_tensor(record: LogitsRecord) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(record.data), dtype=torch.float32)
    return flat.reshape(record.tokens, record.vocab)


def step_rows(reports: list[RankReport]) -> list[dict[str, float | int | str]]:
    """One row per step: wall time (slowest rank), mean time per kind, bytes over all ranks."""
    steps = sorted({s.step for r in reports for s in r.steps})
    rows: list[dict[str, float | int | str]] = []
    for step in steps:
        records = [s for r in reports for s in r.steps if s.step == step]
        total = max(s.total_s for s in records)
        row: dict[str, float | int | str] = {
            "step": step,
            "tokens": max(s.tokens for s in records),
            "total ms": total * 1e3,
        }
        comm_mean = 0.0
        for kind in KINDS:
            mean = sum(s.comm_s.get(kind, 0.0) for s in records) / len(records)
            comm_mean += mean
            row[f"{KIND_TITLES[kind]} ms"] = mean * 1e3
        row["compute+wait ms"] = max(total - comm_mean, 0.0) * 1e3
        row["bytes"] = sum(sum(s.comm_bytes.values()) for s in records)
        rows.append(row)
    return rows


def mean_row(rows: list[dict[str, float | int | str]]) -> dict[str, float | int | str] | None:
    """Mean of every column over the steps after the first (which pays for warm-up)."""
    steady = rows[1:]
    if not steady:
        return None
    out: dict[str, float | int | str] = {"step": f"mean {steady[0]['step']}-{steady[-1]['step']}"}
    for column in TABLE_COLUMNS[1:]:
        values = [float(r[column]) for r in steady]
        mean = sum(values) / len(values)
        out[column] = round(mean) if column in ("tokens", "bytes") else mean
    return out


TABLE_COLUMNS = [
    "step",
    "tokens",
    "total ms",
    *(f"{KIND_TITLES[k]} ms" for k in KINDS),
    "compute+wait ms",
    "bytes",
]

TABLE_NOTE = (
    "total = slowest rank's step time; per-kind ms = mean over ranks of time inside that call "
    "(includes waiting for peers); bytes = payload handed to communication calls, summed over ranks"
)


def format_table(rows: list[dict[str, float | int | str]], columns: list[str]) -> str:
    """Right-aligned text table; floats with two decimals, ints with separators."""

    def cell(value: float | int | str) -> str:
        if isinstance(value, float):
            return f"{value:.2f}"
        if isinstance(value, int):
            return f"{value:,}"
        return value

    cells = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def write_plot(rows: list[dict[str, float | int | str]], path: str, title: str) -> None:
    """Stacked bars: per step, mean time per communication kind and the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(rows)
    columns = [f"{KIND_TITLES[k]} ms" for k in KINDS] + ["compute+wait ms"]
    for column in columns:
        values = [float(r[column]) for r in rows]
        ax.bar(steps, values, bottom=bottom, label=column.removesuffix(" ms"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
