"""The one config object: environment parsing, overrides, timeouts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shm_broadcast import get_config, override
from shm_broadcast.config import from_env, resolve_timeout, set_config
from shm_broadcast.errors import GroupcoordValueError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_environment_sets_typed_fields() -> None:
    cfg = from_env(
        {
            "GROUPCOORD_TIMEOUT_S": "2.5",
            "GROUPCOORD_MQ_MAX_CHUNKS": "7",
            "GROUPCOORD_DISABLE_CUSTOM_ALL_REDUCE": "yes",
            "GROUPCOORD_NCCL_SO_PATH": "/x/libnccl.so.2",
        }
    )
    assert cfg.timeout_s == 2.5
    assert cfg.mq_max_chunks == 7
    assert cfg.disable_custom_all_reduce is True
    assert cfg.nccl_so_path == "/x/libnccl.so.2"


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(GroupcoordValueError, match="GROUPCOORD_MQ_MAX_CHUNKS='many'"):
        from_env({"GROUPCOORD_MQ_MAX_CHUNKS": "many"})


def test_override_is_scoped() -> None:
    before = get_config().timeout_s
    with override(timeout_s=1.0):
        assert get_config().timeout_s == 1.0
        assert resolve_timeout(None) == 1.0
    assert get_config().timeout_s == before


def test_non_positive_timeout_is_refused() -> None:
    # groupcoord's own ValueError, so callers can catch every groupcoord error at once.
    for bad in (0, -1.5, float("nan")):
        with pytest.raises(GroupcoordValueError, match="timeout must be a positive"):
            resolve_timeout(bad)


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("timeout_s", "0"),
        ("timeout_s", "nan"),
        ("peer_check_interval_s", "-1"),
        ("heartbeat_timeout_s", "0"),
        ("mq_max_chunk_bytes", "100"),
        ("mq_max_chunks", "0"),
        ("shm_all_reduce_max_bytes", "0"),
        ("shm_dir", ""),
        ("log_level", "LOUD"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_the_setting(field: str, raw: str) -> None:
    env = "GROUPCOORD_" + field.upper()
    with pytest.raises(GroupcoordValueError, match=f"{field}=.*\\({env}\\): expected"):
        from_env({env: raw})
    # set_config refuses it the same way and leaves the config as it was.
    before = get_config()
    kind = {"str": str, "int": int, "float": float}[
        str(from_env({}).__dataclass_fields__[field].type)
    ]
    bad = kind(raw)
    with pytest.raises(GroupcoordValueError, match=f"{field}="):
        set_config(**{field: bad})
    assert get_config() is before


def test_the_log_level_reaches_the_loggers() -> None:
    """GROUPCOORD_LOG_LEVEL sets the ``groupcoord`` loggers' level; below WARNING, in
    a program that set up no logging, their messages reach stderr."""
    code = (
        "import logging; from shm_broadcast.config import get_config; get_config(); "
        "logging.getLogger('groupcoord.x').info('seen at info')"
    )

    def stderr(level: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "GROUPCOORD_LOG_LEVEL"}
        if level is not None:
            env["GROUPCOORD_LOG_LEVEL"] = level
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "groupcoord.x INFO seen at info" in stderr("info")
    assert "seen at info" not in stderr(None)
