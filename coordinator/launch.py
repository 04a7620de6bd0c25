"""Start N ranks on this machine, collect what each returns, never leave one behind.

The one launcher of the project: tests, benchmarks and scripts start their
ranks here. (Real deployments start ranks with ``torchrun`` or their own
engine; this is for single-node tests and measurements.)

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
each rank with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set and
returns the ranks' return values in rank order. Results travel back through
groupcoord's codec (never pickle). A rank that raises, dies, or gives no
result within ``timeout`` makes :class:`RankError` name it (with its
traceback; a hung rank's stack is dumped by faulthandler just before the
deadline). Every process is ended on every path: ranks that answered get a
grace to tear down, the rest are killed. Each rank destroys its default
process group and unlinks the shared memory it created on the way out.

Ranks are forked by default (about 50 ms each; spawn re-imports torch, about
2 s). The forking parent must stay single-threaded: a rank forked after the
parent started torch's OpenMP pool can hang in its first parallel op.
``start_ranks`` returns the handle instead, to kill a rank mid-run.
"""

from __future__ import annotations

import datetime
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
from typing import Any, cast

from shm_broadcast.codec import dumps, loads

from .errors import GroupcoordError

__all__ = [
    "RankError",
    "Ranks",
    "free_port",
    "init_gloo",
    "run_ranks",
    "start_ranks",
    "started_pids",
]

# After a rank answered, how long it gets to tear down (destroy groups, unlink
# shared memory) before it is killed.
END_GRACE_S = 5.0

# Pids of every rank this process has started (a leak check can look only at
# the segments these created).
started_pids: set[int] = set()


class RankError(GroupcoordError, AssertionError):
    """Ranks failed, died or hung; the message names each with what it did.

    An ``AssertionError`` too, so a test that runs ranks fails like any assert.
    """


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(
    rank: int, world_size: int, timeout_s: float = 30.0, *, port: int | None = None
) -> None:
    """Join torch.distributed's default group over Gloo on 127.0.0.1
    (``port``: default the MASTER_PORT the launcher set)."""
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"]) if port is None else port
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _rank_main(
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
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # teardown still runs
    faulthandler.dump_traceback_later(max(timeout - 1.0, 0.5), exit=False, file=sys.stderr)
    try:
        try:
            reply: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
            payload = dumps(reply)
        except BaseException:  # noqa: BLE001 - report anything, even SystemExit, to the parent
            payload = dumps(("err", traceback.format_exc()))
        conn.send_bytes(payload)
    finally:
        faulthandler.cancel_dump_traceback_later()
        _release_rank_resources()
        conn.close()


def _release_rank_resources() -> None:
    import torch.distributed as dist

    from shm_broadcast.segments import cleanup_owned_segments

    from .p2p_channels import deliver_pending_sends

    deliver_pending_sends()  # what the process's exit would do, before the store goes
    if dist.is_initialized():
        dist.destroy_process_group()
    cleanup_owned_segments()


class Ranks:
    """Handle on started ranks: kill one, then collect what the rest did."""

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: Sequence[Any],
        timeout: float,
        env: dict[str, str] | None,
        start_method: str,
    ) -> None:
        context: Any = mp.get_context(start_method)  # the stubs lack Process on BaseContext
        self.world_size = world_size
        self.timeout = timeout
        self.port = free_port()
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._killed_by_us: set[int] = set()
        try:
            for rank in range(world_size):
                parent_end, child_end = context.Pipe(duplex=False)
                proc = context.Process(
                    target=_rank_main,
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
        except BaseException:
            self.terminate()
            raise

    def pid(self, rank: int) -> int:
        pid = self.procs[rank].pid
        assert pid is not None
        return pid

    def kill(self, rank: int) -> None:
        os.kill(self.pid(rank), signal.SIGKILL)

    def collect(self, killed: Sequence[int] = ()) -> list[Any]:
        """Wait for every rank; return results (None for ``killed`` ranks) or raise
        :class:`RankError` naming every rank that failed, died, hung or exited
        non-zero after answering."""
        deadline = time.monotonic() + self.timeout
        outcome: dict[int, tuple[str, Any]] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for ready in wait(list(pending), timeout=left):
                    conn = cast(Connection, ready)
                    rank = pending.pop(conn)
                    try:
                        kind, value = loads(conn.recv_bytes())
                        outcome[rank] = (kind, value)
                    except EOFError:
                        outcome[rank] = ("died", None)
        finally:
            self.terminate(grace_s=END_GRACE_S, finishing=set(outcome))
        errors = []
        for rank in range(self.world_size):
            if rank in killed:
                continue
            kind, value = outcome.get(rank, ("hung", None))
            code = self.procs[rank].exitcode
            if kind == "err":
                errors.append(f"rank {rank} raised:\n{value}")
            elif kind == "died":
                errors.append(f"rank {rank} died with exit code {code}")
            elif kind == "hung":
                errors.append(f"rank {rank} did not finish within {self.timeout:g} s")
            elif code not in (0, None) and rank not in self._killed_by_us:
                errors.append(f"rank {rank} answered, then exited with code {code}")
        if errors:
            raise RankError("\n".join(errors))
        return [None if r in killed else outcome[r][1] for r in range(self.world_size)]

    def terminate(self, grace_s: float = 0.0, finishing: set[int] | None = None) -> None:
        """End every rank still running. Ranks in ``finishing`` (they answered) get
        ``grace_s`` to exit, then SIGTERM (their teardown runs) and a second; the
        others, and whatever is left after that, get SIGKILL."""
        finishing = finishing or set()
        deadline = time.monotonic() + grace_s
        for rank in sorted(finishing):
            self.procs[rank].join(max(deadline - time.monotonic(), 0.0))
        for rank, proc in enumerate(self.procs):
            if proc.is_alive():
                self._killed_by_us.add(rank)
                if rank in finishing:
                    proc.terminate()
                else:
                    proc.kill()
        deadline = time.monotonic() + 1.0
        for rank in sorted(self._killed_by_us & finishing):
            self.procs[rank].join(max(deadline - time.monotonic(), 0.0))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        for conn in self.conns:
            conn.close()


def start_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    start_method: str = "fork",
) -> Ranks:
    """Start ``world_size`` ranks running ``fn(rank, world_size, *args)``."""
    return Ranks(fn, world_size, args, timeout, env, start_method)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    start_method: str = "fork",
) -> list[Any]:
    """Start the ranks and return their results in rank order (see the module doc)."""
    return start_ranks(
        fn, world_size, *args, timeout=timeout, env=env, start_method=start_method
    ).collect()
