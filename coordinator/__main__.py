"""``python -m coordinator {demo,bench,info}``."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("coordinator.demo", "run a TP x PP (x EP) model across CPU ranks and check it"),
    "bench": ("coordinator.bench", "run the benchmarks and print one summary table"),
    "info": ("coordinator.info", "print settings and what this machine offers"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m coordinator {demo,bench,info} [options]\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<6} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
