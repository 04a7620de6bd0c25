"""The ``groupcoord`` command (also ``python -m coordinator``): demo, bench, info.

Each sub-command is a module with ``main(argv) -> int``, imported only when
it runs, so ``groupcoord info`` never pays for the demo's model code.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main"]

COMMANDS = {
    "demo": ("coordinator.cli.demo", "run a TP x PP (x EP) model across CPU ranks and check it"),
    "bench": ("coordinator.cli.bench", "run the benchmarks and print one summary table"),
    "info": ("coordinator.cli.info", "print settings and what this machine offers"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: groupcoord {demo,bench,info} [options]\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<6} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
