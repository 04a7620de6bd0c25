"""Soak the message queue outside pytest: mixed messages to 2 ring readers and 1 TCP reader.

    python benchmarks/soak_mq.py --messages 1000000

Every reader checks every message (number and content); the table shows each
rank's time and resident memory after a 1,000-message warm-up and at the end.
Exits non-zero if a message was lost, reordered or corrupted. The rank code
(``_mq_soak.py``) is the one the reliability suite's soak test runs.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import print_table, reproduce_command, write_json  # noqa: E402
from _mq_soak import WORLD, soak  # noqa: E402

from coordinator.launch import run_ranks  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", default="bench_results/soak_mq.json")
    args = parser.parse_args(argv)
    seed = random.randrange(2**31) if args.seed is None else args.seed
    torch.set_num_threads(1)  # the forking parent stays single-threaded
    timeout = 120 + args.messages / 500  # generous: at least 500 messages/s
    results = run_ranks(soak, WORLD, args.messages, seed, timeout=timeout)
    rows = [{"rank": rank, **r} for rank, r in enumerate(results)]
    print_table(rows, ["rank", "role", "messages", "seconds", "rss_start_mib", "rss_end_mib"])
    print(f"zero lost, zero reordered (seed {seed}); reproduce: {reproduce_command()}")
    write_json(args.json, {"seed": seed, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
