"""``groupcoord info``: settings and what groupcoord finds on this machine."""

from __future__ import annotations

import argparse
import dataclasses
import os

from shm_broadcast.config import get_config
from shm_broadcast.segments import list_segments, shm_free_bytes


def config_rows() -> list[tuple[str, str]]:
    """(environment variable, effective value) for every setting."""
    cfg = get_config()
    env = cfg.env_names()
    return [(env[f.name], repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)]


def host_rows() -> list[tuple[str, str]]:
    """CPU-side facts: cores, shared memory, our segments present now, peer reads."""
    from device_communicators.peer_reads import probe_this_machine

    cfg = get_config()
    why_not = probe_this_machine()
    return [
        ("CPU cores", str(os.cpu_count())),
        (f"free in {cfg.shm_dir}", f"{shm_free_bytes() / 2**20:.0f} MiB"),
        ("groupcoord segments present", str(len(list_segments()))),
        (
            "ranks read each other's memory (process_vm_readv)",
            "yes" if why_not is None else f"no, large CPU calls use the slots: {why_not}",
        ),
    ]


def _print_section(title: str, rows: list[tuple[str, str]]) -> None:
    print(title)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="groupcoord info",
        description="Print groupcoord's effective settings and what this machine offers.",
    )
    parser.parse_args(argv)
    from device_communicators.cuda_info import describe

    _print_section("Settings (environment variable, effective value)", config_rows())
    _print_section("Host", host_rows())
    _print_section("CUDA path", describe())
    return 0
