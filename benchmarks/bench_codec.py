"""What one message costs the codec, in one process: encode, write into a chunk,
read and decode, against pickle (protocol 5, out-of-band buffers: what vLLM's
queue does with an object) on the same object in the same run; and one whole
``MessageQueue.enqueue`` and ``dequeue`` of it (the writer and one local reader
in this process, timed apart), what the codec's steps cost inside the queue's
calls.

The payloads are the queue's (``bench_mq.py``): a small dict, an engine's
per-step scheduler output (a dataclass of 10 fields plus 4 small tensors,
declared with ``add_safe_types``), the same without its tensors, one 4 KiB
tensor, and 256 token ids per request for 16 requests. Times are the best of
7 rounds (the machine's noise only ever adds), in microseconds.

    python benchmarks/bench_codec.py            # full run
    python benchmarks/bench_codec.py --quick    # a few seconds
    python benchmarks/bench_codec.py --instructions   # under valgrind, about 1 minute

``--instructions`` counts the CPU instructions of one encode and of one
read + decode (callgrind, instrumenting only the measured loops): a count
that does not move with the machine's load, for changes too small to see
through the noise of a shared 2-core host.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _callgrind import count_instructions, missing_tools, run_phases  # noqa: E402
from _common import environment, print_table, reproduce_command, write_json  # noqa: E402
from bench_mq import EngineStep, _engine_step  # noqa: E402

COLUMNS = [
    "case",
    "encode_us",
    "write_us",
    "read_us",
    "ours_us",
    "pickle_dumps_us",
    "pickle_loads_us",
    "pickle_us",
    "ratio_vs_pickle",
    "enqueue_us",
    "dequeue_us",
]
ROUNDS = 7


def _payloads() -> dict[str, Any]:
    import torch

    step = _engine_step()
    return {
        "small object": {"request": 12345, "step": 7, "tokens": 512, "flags": 3, "name": "r"},
        "engine step": step,
        "engine step, no tensors": dataclasses.replace(
            step, input_ids=None, positions=None, slot_mapping=None, seq_lens=None
        ),
        "tensor 4 KiB": torch.arange(1024, dtype=torch.float32),
        "token ids 16 x 256": [list(range(i, i + 256)) for i in range(16)],
    }


def _best_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(max(calls // 10, 10)):  # warm-up
        fn()
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _pickle_round(obj: Any) -> tuple[Callable[[], object], Callable[[], object]]:
    buffers: list[pickle.PickleBuffer] = []

    def dumps() -> bytes:
        buffers.clear()
        return pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)

    data = dumps()
    kept = list(buffers)
    return dumps, lambda: pickle.loads(data, buffers=kept)  # noqa: S301 - our own bytes


def measure(calls: int) -> list[dict[str, Any]]:
    from shm_broadcast import add_safe_types
    from shm_broadcast.codec import _codec

    add_safe_types([EngineStep])
    codec = _codec(False)
    chunk = bytearray(1 << 20)
    view = memoryview(chunk)
    address = ctypes.addressof(ctypes.c_char.from_buffer(chunk))
    rows = []
    writer, reader = _local_queue()
    try:
        for name, obj in _payloads().items():
            row = _measure_one(name, obj, calls, codec, view, address)
            row["enqueue_us"], row["dequeue_us"] = _queue_calls_us(writer, reader, obj, calls)
            rows.append(row)
    finally:
        reader.close()
        writer.close()
    return rows


def _local_queue() -> tuple[Any, Any]:
    """A queue's writer and its one local reader, both ends in this process."""
    from shm_broadcast import MessageQueue

    writer = MessageQueue(1, 1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready()
    reader.wait_until_ready()
    return writer, reader


def _queue_calls_us(writer: Any, reader: Any, obj: Any, calls: int) -> tuple[float, float]:
    """Best-round microseconds of one ``enqueue`` and of one ``dequeue`` of ``obj``
    (every codec and ring step of the real calls), timed apart in batches of 8 (no
    wait: the ring has 10 chunks)."""
    batch = 8
    best = [float("inf"), float("inf")]
    for round_ in range(ROUNDS + 1):  # the first warms up
        spent = [0.0, 0.0]
        for _ in range(max(calls // batch, 1)):
            start = time.perf_counter()
            for _ in range(batch):
                writer.enqueue(obj)
            middle = time.perf_counter()
            for _ in range(batch):
                reader.dequeue()
            spent[0] += middle - start
            spent[1] += time.perf_counter() - middle
        if round_:
            n = max(calls // batch, 1) * batch
            best = [min(b, s / n) for b, s in zip(best, spent)]
    return best[0] * 1e6, best[1] * 1e6


def _measure_one(
    name: str, obj: Any, calls: int, codec: Any, view: Any, address: int
) -> dict[str, Any]:
    from shm_broadcast.codec import encode_message, read_message, write_message

    msg = encode_message(obj)
    write_message(msg, view, 64, address)
    row: dict[str, Any] = {"case": name}
    row["encode_us"] = _best_us(lambda: encode_message(obj), calls)
    row["write_us"] = _best_us(lambda: write_message(msg, view, 64, address), calls)
    row["read_us"] = _best_us(lambda: read_message(codec, view, 64), calls)
    row["ours_us"] = row["encode_us"] + row["write_us"] + row["read_us"]
    dumps, loads = _pickle_round(obj)
    row["pickle_dumps_us"] = _best_us(dumps, max(calls // 10, 100))
    row["pickle_loads_us"] = _best_us(loads, max(calls // 10, 100))
    row["pickle_us"] = row["pickle_dumps_us"] + row["pickle_loads_us"]
    row["ratio_vs_pickle"] = row["pickle_us"] / row["ours_us"]
    return row


INSTRUCTION_CALLS = 2_000


def _phases(calls: int) -> list[tuple[str, Callable[[], object], int]]:
    """(name, one call, how many) for the instruction count: nothing (the loop
    and the hand-over's own cost, subtracted from the others), then each
    payload's encode and its read + decode."""
    from shm_broadcast import add_safe_types
    from shm_broadcast.codec import _codec, encode_message, read_message, write_message

    add_safe_types([EngineStep])
    codec = _codec(False)
    phases: list[tuple[str, Callable[[], object], int]] = [("nothing", lambda: None, calls)]
    for name, obj in _payloads().items():
        n = calls // 10 if name.startswith("token ids") else calls
        view = memoryview(bytearray(1 << 20))  # a chunk of the payload's own
        write_message(encode_message(obj), view, 64)
        phases.append((f"{name}: encode", lambda obj=obj: encode_message(obj), n))
        phases.append((f"{name}: read", lambda view=view: read_message(codec, view, 64), n))
    return phases


def count_codec_instructions(calls: int) -> list[dict[str, Any]] | str:
    """Instructions per call of each phase (the loop's own cost taken off), or why
    they cannot be counted here."""
    missing = missing_tools()
    if missing is not None:
        return missing
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable, os.path.abspath(__file__),
            "--instructions-child", folder, "--calls", str(calls),
        ]  # fmt: skip
        counted = count_instructions(command, folder)
    return [{"phase": name, "instructions": n} for name, n in counted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls: a few seconds")
    parser.add_argument(
        "--json", default="bench_results/codec.json", help="where to write the results"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per call under valgrind instead of timing",
    )
    parser.add_argument("--instructions-child", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=INSTRUCTION_CALLS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.instructions_child:
        run_phases(args.instructions_child, _phases(args.calls))
        return 0
    command = reproduce_command(
        ["benchmarks/bench_codec.py", *(argv if argv is not None else sys.argv[1:])]
    )
    if args.instructions:
        counted = count_codec_instructions(args.calls)
        if isinstance(counted, str):
            print(f"cannot count instructions: {counted}")
            return 2
        print_table(counted, ["phase", "instructions"])
        print("\nCPU instructions per call (callgrind), the measuring loop's own taken off.")
        print(f"reproduce: {command}")
        return 0
    rows = measure(2_000 if args.quick else 20_000)
    print_table(rows, COLUMNS)
    print(
        "\nus per message, best of 7 rounds; ours = encode + write into a chunk + read and "
        "decode; pickle = dumps + loads (protocol 5, out-of-band buffers); ratio_vs_pickle = pickle / ours;\n"
        "enqueue / dequeue = one whole MessageQueue call (writer and its one local reader in this "
        "process, timed apart: the ceiling of a queue's rate is 1 / the larger)."
    )
    data = {"benchmark": "codec", "command": command, "environment": environment(), "rows": rows}
    print(f"JSON: {write_json(args.json, data)}")
    print(f"reproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
