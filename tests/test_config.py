"""The one config object: environment parsing, overrides, timeouts."""

from __future__ import annotations

import pytest

from shm_broadcast import get_config, override
from shm_broadcast.config import from_env, resolve_timeout
from shm_broadcast.errors import GroupcoordValueError


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
