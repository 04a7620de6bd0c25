"""Start N real ranks for a test, fast, and never leave one behind.

Ranks are forked (about 50 ms each here; spawn re-imports torch, about 2 s).
The forking parent must stay single-threaded: conftest pins torch to one
thread before any test runs, so no OpenMP pool exists to be inherited.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
each rank with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set and
returns the ranks' return values in rank order. A rank that raises, exits
abnormally or outlives ``timeout`` fails the test with its traceback (a hung
rank's stack is dumped by faulthandler just before the deadline).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

_CTX = mp.get_context("fork")

# Pids of every rank this process has started; the leak check in conftest
# looks only at segments these (or this process) created.
started_pids: set[int] = set()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, timeout_s: float = 30.0) -> None:
    """Join torch.distributed's default group over Gloo on 127.0.0.1."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _child_main(
    conn: Connection,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    env: dict[str, str],
    timeout: float,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            **env,
        }
    )
    faulthandler.dump_traceback_later(max(timeout - 1.0, 0.5), exit=False, file=sys.stderr)
    try:
        result = fn(rank, world_size, *args)
        conn.send(("ok", result))
    except BaseException:  # noqa: BLE001 - report anything, even SystemExit, to the parent
        conn.send(("err", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        _release_rank_resources()
        conn.close()


def _release_rank_resources() -> None:
    import torch.distributed as dist

    from shm_broadcast.segments import cleanup_owned_segments

    if dist.is_initialized():
        dist.destroy_process_group()
    cleanup_owned_segments()


class RankGroup:
    """Handle on started ranks: kill one, then collect what the rest did."""

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: Sequence[Any],
        timeout: float,
        env: dict[str, str] | None,
    ) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.port = free_port()
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(world_size):
            parent_end, child_end = _CTX.Pipe(duplex=False)
            proc = _CTX.Process(
                target=_child_main,
                args=(child_end, fn, rank, world_size, self.port, args, env or {}, timeout),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            assert proc.pid is not None
            started_pids.add(proc.pid)
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)

    def pid(self, rank: int) -> int:
        pid = self.procs[rank].pid
        assert pid is not None
        return pid

    def kill(self, rank: int) -> None:
        os.kill(self.pid(rank), signal.SIGKILL)

    def collect(self, killed: Sequence[int] = ()) -> list[Any]:
        """Wait for every rank; return results (None for killed ranks) or fail."""
        deadline = time.monotonic() + self.timeout
        outcome: dict[int, tuple[str, Any]] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for conn in wait(list(pending), timeout=left):
                    rank = pending.pop(conn)  # type: ignore[call-overload]
                    try:
                        outcome[rank] = conn.recv()
                    except EOFError:
                        outcome[rank] = ("died", None)
        finally:
            # A rank that answered is still releasing its resources (process
            # group, shared memory): give it a moment before killing it.
            self.terminate(grace_s=5.0, finishing=set(outcome))
        errors = []
        for rank in range(self.world_size):
            if rank in killed:
                continue
            kind, value = outcome.get(rank, ("hung", None))
            if kind == "err":
                errors.append(f"rank {rank} raised:\n{value}")
            elif kind == "died":
                errors.append(f"rank {rank} died with exit code {self.procs[rank].exitcode}")
            elif kind == "hung":
                errors.append(f"rank {rank} did not finish within {self.timeout:g} s")
        if errors:
            raise AssertionError("\n".join(errors))
        return [None if r in killed else outcome[r][1] for r in range(self.world_size)]

    def terminate(self, grace_s: float = 0.0, finishing: set[int] | None = None) -> None:
        """Kill every rank still running; ranks in ``finishing`` get ``grace_s`` first."""
        deadline = time.monotonic() + grace_s
        for rank in sorted(finishing or ()):
            self.procs[rank].join(max(deadline - time.monotonic(), 0.0))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        for conn in self.conns:
            conn.close()


def start_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> RankGroup:
    return RankGroup(fn, world_size, args, timeout, env)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    return start_ranks(fn, world_size, *args, timeout=timeout, env=env).collect()
