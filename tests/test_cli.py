"""The command line: `python -m coordinator` usage and `info`."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_usage_lists_the_commands_and_fails_on_unknown() -> None:
    result = _run("frobnicate")
    assert result.returncode == 2
    for name in ("demo", "bench", "info"):
        assert name in result.stdout


def test_info_prints_effective_settings_and_cuda_facts() -> None:
    result = _run("info", env_extra={"GROUPCOORD_TIMEOUT_S": "12.5"})
    assert result.returncode == 0, result.stderr
    assert "GROUPCOORD_TIMEOUT_S" in result.stdout
    assert "12.5" in result.stdout
    assert "CUDA devices" in result.stdout
    assert "custom all-reduce" in result.stdout
    assert "ranks read each other's memory (process_vm_readv)" in result.stdout
