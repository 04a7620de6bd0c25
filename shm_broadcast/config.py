"""groupcoord's one configuration object.

Every setting is read once from a ``GROUPCOORD_*`` environment variable and can
be replaced in code with :func:`set_config` or, for a block, :func:`override`.
No other module reads ``os.environ`` for our settings. It lives in the lowest
package (``shm_broadcast``) so every layer above can import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .errors import GroupcoordValueError

ENV_PREFIX = "GROUPCOORD_"


@dataclasses.dataclass(frozen=True)
class GroupcoordConfig:
    """Effective settings; field ``x`` is read from ``GROUPCOORD_X``."""

    # Default deadline of every blocking wait (queue, collective, barrier), seconds.
    timeout_s: float = 300.0
    # How often a waiting side checks that its peers are still alive, seconds.
    peer_check_interval_s: float = 0.5
    # A remote peer whose heartbeat is older than this is taken as dead, seconds.
    heartbeat_timeout_s: float = 5.0
    # Message queue ring geometry.
    mq_max_chunk_bytes: int = 4 * 1024 * 1024
    mq_max_chunks: int = 10
    # Where POSIX shared memory lives (Linux: a tmpfs at /dev/shm).
    shm_dir: str = "/dev/shm"
    # CPU shared-memory collectives. The max caps the size of one piece a
    # tensor is cut into (the piece is min(this, 1 MiB)); any size is taken.
    disable_shm_all_reduce: bool = False
    shm_all_reduce_max_bytes: int = 16 * 1024 * 1024
    # Large CPU all-gathers read each peer's input straight into the result
    # (Linux process_vm_readv, one copy instead of two through the slots) where
    # the kernel allows it, probed at set-up; this keeps them on the slots.
    disable_peer_reads: bool = False
    # Point-to-point tensor dicts between ranks on one node go through a
    # shared-memory queue per (sender, receiver) pair; this sends them over
    # Gloo instead. Set it the same on every rank.
    disable_shm_p2p: bool = False
    # CUDA path.
    disable_custom_all_reduce: bool = False
    custom_all_reduce_max_bytes: int = 8 * 1024 * 1024
    custom_all_reduce_algo: str = "auto"  # auto | oneshot | twoshot
    disable_pynccl: bool = False
    nccl_so_path: str = ""
    kernel_cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "groupcoord")
    # Debug: before every tensor collective of a GroupCoordinator, the ranks
    # compare what they are about to call (one small Gloo all-gather), so a
    # desync on the Gloo or NCCL path raises DesyncError instead of hanging or
    # returning wrong data. The shared-memory path always checks. Off by default:
    # it adds one small all-gather (~0.1 ms on CPU) to each collective.
    debug_desync: bool = False
    # Expert-parallel all2all manager: naive | allgather_reducescatter.
    all2all_backend: str = "allgather_reducescatter"
    # Level of the ``groupcoord`` loggers (their messages go to stderr; below
    # WARNING through a handler of their own unless the program set up logging).
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        for name, (valid, expected) in _RULES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not valid(value):
                raise GroupcoordValueError(
                    f"{name}={value!r} ({ENV_PREFIX}{name.upper()}): expected {expected}"
                )

    def env_names(self) -> dict[str, str]:
        """Map each field to the environment variable that sets it."""
        return {f.name: ENV_PREFIX + f.name.upper() for f in dataclasses.fields(self)}


# A message queue chunk holds at least this many bytes (config and MessageQueue).
MIN_CHUNK_BYTES = 256
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def _number(low: float, *, above: bool = False, kind: type = float) -> Callable[[Any], bool]:
    """A test that a value is a ``kind`` (an int passes for a float) of at least
    ``low``, or above it."""
    kinds = (int, float) if kind is float else (int,)

    def valid(value: Any) -> bool:
        return isinstance(value, kinds) and (value > low if above else value >= low)

    return valid


# Field -> (test, what it expects): checked whenever a config is made (from the
# environment or by set_config), so a bad value is refused where it is given.
# A value a component checks against what it knows (an all2all back end's name,
# the custom all-reduce's algorithm) is checked there.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "timeout_s": (_number(0, above=True), "seconds > 0"),
    "peer_check_interval_s": (_number(0), "seconds >= 0"),
    "heartbeat_timeout_s": (_number(0, above=True), "seconds > 0"),
    "mq_max_chunk_bytes": (_number(MIN_CHUNK_BYTES, kind=int), f"an int >= {MIN_CHUNK_BYTES}"),
    "mq_max_chunks": (_number(1, kind=int), "an int >= 1"),
    "shm_all_reduce_max_bytes": (_number(1, kind=int), "an int >= 1"),
    "custom_all_reduce_max_bytes": (_number(1, kind=int), "an int >= 1"),
    "shm_dir": (lambda v: isinstance(v, str) and v != "", "a directory"),
    "log_level": (lambda v: isinstance(v, str) and v.upper() in LOG_LEVELS, f"one of {LOG_LEVELS}"),
}


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse(name: str, kind: type, raw: str) -> Any:
    if kind is bool:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise GroupcoordValueError(f"{name}={raw!r}: expected one of {sorted(_TRUE | _FALSE)}")
    try:
        return kind(raw)
    except ValueError as exc:
        raise GroupcoordValueError(f"{name}={raw!r}: expected a {kind.__name__}") from exc


_FIELD_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


def from_env(environ: Mapping[str, str] | None = None) -> GroupcoordConfig:
    """Build a config from ``GROUPCOORD_*`` variables (defaults for the rest)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(GroupcoordConfig):
        env_name = ENV_PREFIX + field.name.upper()
        if env_name in environ:
            kind = _FIELD_TYPES[str(field.type)]
            values[field.name] = _parse(env_name, kind, environ[env_name])
    return GroupcoordConfig(**values)


_config: GroupcoordConfig | None = None


# Settings every rank of a group must share (a group's ranks compare them when it
# is built): with another value a rank takes other steps than its peers (the
# debug all-gather, another transport for tensor dicts, another EP manager,
# another CUDA all-reduce).
GROUP_SETTINGS = ("debug_desync", "disable_shm_p2p")
ALL2ALL_SETTINGS = ("all2all_backend",)
CUDA_SETTINGS = (
    "disable_custom_all_reduce",
    "custom_all_reduce_algo",
    "custom_all_reduce_max_bytes",
    "disable_pynccl",
)


def describe_settings(names: tuple[str, ...]) -> str:
    """``name=value, ...`` of the effective settings ``names``, as
    ``GROUPCOORD_NAME`` would set them (for a group's ranks to compare)."""
    config = get_config()
    return ", ".join(f"{ENV_PREFIX}{name.upper()}={getattr(config, name)!r}" for name in names)


def get_config() -> GroupcoordConfig:
    """The effective config, read from the environment on first use."""
    global _config
    if _config is None:
        _config = _applied(from_env())
    return _config


def set_config(config: GroupcoordConfig | None = None, **changes: Any) -> GroupcoordConfig:
    """Replace the effective config (or change some fields of it) in code."""
    global _config
    base = config if config is not None else get_config()
    _config = _applied(dataclasses.replace(base, **changes))
    return _config


def _applied(config: GroupcoordConfig) -> GroupcoordConfig:
    """Set the ``groupcoord`` loggers' level from ``config``. Below WARNING, where
    neither they nor the root logger has a handler (the program configured no
    logging), one to stderr is added, since Python's last-resort handler shows
    warnings and errors only."""
    logger = logging.getLogger("groupcoord")
    level = getattr(logging, config.log_level.upper())
    logger.setLevel(level)
    if level < logging.WARNING and not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
    return config


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[GroupcoordConfig]:
    """Change some settings for the duration of a ``with`` block."""
    global _config
    previous = get_config()
    try:
        yield set_config(previous, **changes)
    finally:
        _config = previous


def resolve_timeout(timeout: float | datetime.timedelta | None) -> float:
    """Seconds from a caller's timeout (a number of seconds, a ``datetime.timedelta``,
    or None for the configured default); refuses non-positive values and other types."""
    if timeout is None:
        return get_config().timeout_s
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise GroupcoordValueError(
            f"timeout must be seconds (a number), a datetime.timedelta or None, got {timeout!r}"
        )
    if not timeout > 0:
        raise GroupcoordValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)
