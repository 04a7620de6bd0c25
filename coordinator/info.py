"""``python -m coordinator info``: what groupcoord sees on this machine."""

from __future__ import annotations

import argparse
import dataclasses

from shm_broadcast.config import get_config


def config_rows() -> list[tuple[str, str, str]]:
    """(setting, environment variable, effective value) for every setting."""
    cfg = get_config()
    env = cfg.env_names()
    return [(f.name, env[f.name], repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator info")
    parser.parse_args(argv)
    rows = config_rows()
    width = max(len(r[1]) for r in rows)
    print("groupcoord settings (environment variable = effective value)")
    for _, env_name, value in rows:
        print(f"  {env_name:<{width}} = {value}")
    return 0
