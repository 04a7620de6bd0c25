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
process group on the way out; its shared memory is groupcoord's own business
(unlinked once attached, on shutdown, at exit: the launcher does not clean up
for a rank), except that the segments of ranks the launcher had to kill are
swept with ``cleanup_stale_segments``.

Ranks are forked by default (about 50 ms each; spawn re-imports torch, about
2 s). The forking parent must stay single-threaded: a rank forked after the
parent started torch's OpenMP pool can hang in its first parallel op.
``start_ranks`` returns the handle instead, to kill a rank mid-run, or to read
each rank's :class:`RankOutcome` (``Ranks.outcomes``) and report failures
your own way, as ``groupcoord demo`` does.

When a rank fails (raises, or dies without a word), the launcher waits
``FAILURE_GRACE_S`` for the others' reports (a peer of the failed rank often
fails a moment later: the cause must be told from its echoes), then ends the
ranks still running. The report puts the likeliest cause first: a rank that
died silently, else the earliest to raise; when every rank that spoke timed
out waiting, the ranks that never spoke are named as the ones that stopped
responding. A rank can call :func:`report_failure` to tell the launcher at
once, before a teardown that may wait on dead peers. Ranks are also ended by
the kernel (``PR_SET_PDEATHSIG``) if the launcher itself dies.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import math
import multiprocessing as mp
import os
import random
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
    "RankOutcome",
    "Ranks",
    "failure_report",
    "free_port",
    "init_gloo",
    "report_failure",
    "run_ranks",
    "start_ranks",
    "started_pids",
]

# After a rank answered, how long it gets to tear down (destroy groups, unlink
# shared memory) before it is killed.
END_GRACE_S = 5.0
# After the first failure, how long to wait for the other ranks' reports.
FAILURE_GRACE_S = 1.0

# Pids of every rank this process has started (a leak check can look only at
# the segments these created).
started_pids: set[int] = set()


class RankError(GroupcoordError, AssertionError):
    """Ranks failed, died or hung; the message names each with what it did.

    An ``AssertionError`` too, so a test that runs ranks fails like any assert.
    """


@dataclasses.dataclass
class RankOutcome:
    """How one rank ended, as its launcher saw it."""

    rank: int
    # "ok"; "raised"; "died" (ended without a word); "hung" (past the deadline);
    # "stopped" (still running when the launcher ended it after another failed).
    kind: str
    value: Any = None  # what the rank's function returned ("ok")
    error: str = ""  # "Type: message" ("raised"), how the process ended ("died")
    traceback: str = ""
    when: float = math.inf  # time.time() of the failure: the earliest is the cause
    timed_out: bool = False  # it raised because a deadline of its own passed


def failure_report(
    outcomes: Sequence[RankOutcome], timeout: float, excused: Sequence[int] = ()
) -> tuple[str, RankOutcome | None, list[str]]:
    """What went wrong, the likeliest cause first: (headline, the rank it blames or
    None, one line for each other failure). ``excused`` ranks were ended on purpose."""
    bad = [o for o in outcomes if o.kind != "ok" and o.rank not in excused]
    deaths = sorted((o for o in bad if o.kind == "died"), key=lambda o: o.when)
    raised = sorted((o for o in bad if o.kind == "raised"), key=lambda o: o.when)
    silent = [o.rank for o in bad if o.kind in ("hung", "stopped")]
    lines: list[str] = []
    cause: RankOutcome | None = None
    if not deaths and silent and raised and all(o.timed_out for o in raised):
        # Everyone who spoke timed out waiting: the ranks that never spoke are stuck.
        headline = f"rank(s) {silent} stopped responding; their peers' deadlines passed"
    elif not deaths and not raised and silent:
        names = ", ".join(f"rank {r}" for r in silent)
        headline = f"{names} did not finish within {timeout:g} s"
    elif deaths or raised:
        cause = (deaths + raised)[0]
        headline = f"rank {cause.rank} {_what_happened(cause)}"
    else:
        headline = "every rank finished"
    for o in deaths + raised:
        if o is not cause:
            lines.append(f"{'then ' if cause else ''}rank {o.rank} {_what_happened(o, 200)}")
    stopped = [o.rank for o in bad if o.kind == "stopped"]
    if stopped:
        lines.append(f"ending the ranks still running: {stopped}")
    return headline, cause, lines


def _what_happened(o: RankOutcome, limit: int | None = None) -> str:
    if o.kind == "raised":
        return f"raised {o.error.splitlines()[0][:limit] if limit else o.error}"
    return o.error


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous), from
    below the kernel's ephemeral range: a port of that range can be taken, before
    the rendezvous binds it, as the local end of any outgoing connection (Gloo and
    the stores open many), which failed a test run with EADDRINUSE."""
    low = _ephemeral_ports_start()
    for _ in range(64 if low > 2048 else 0):
        port = random.randrange(max(1024, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # someone listens there: another
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))  # no luck below the range: the kernel's pick
        return int(s.getsockname()[1])


def _ephemeral_ports_start() -> int:
    """The first port of the range the kernel gives outgoing connections (Linux's
    default 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
    from .meeting import publish_pid

    # So that a group made later tells a rank that died since from a slow one.
    publish_pid(dist.distributed_c10d._get_default_store(), rank)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _die_with_parent() -> None:
    """Linux: have the kernel SIGTERM this rank if its launcher dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        print(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}", file=sys.stderr)


def _stack_dump_stream() -> Any:
    """Where a hung rank's stacks go. faulthandler needs a real file descriptor,
    which ``sys.stderr`` lacks in a notebook or under a captured stream (the
    call raised there, before the rank could report anything, and every rank
    "exited with code 1 without reporting an error"): then the process's own
    stderr, else nowhere."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None and stream.fileno() >= 0:
                return stream
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
            continue
    return None


# In a rank: the pipe to its launcher, until the rank has answered.
_to_launcher: Connection | None = None


def report_failure(exc: BaseException) -> None:
    """In a rank: tell the launcher of ``exc`` now, before a teardown that may wait
    on dead peers; the rank's later answer is dropped. Outside a rank, or after
    the rank answered, it does nothing."""
    global _to_launcher
    conn, _to_launcher = _to_launcher, None
    if conn is None:
        return
    failure = {
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc)),
        "when": time.time(),
        "timed_out": isinstance(exc, TimeoutError),
    }
    conn.send_bytes(dumps(("err", failure)))


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
    global _to_launcher
    _to_launcher = conn
    _die_with_parent()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # teardown still runs
    dump_to = _stack_dump_stream()
    if dump_to is not None:
        faulthandler.dump_traceback_later(max(timeout - 1.0, 0.5), exit=False, file=dump_to)
    try:
        try:
            payload = dumps(("ok", fn(rank, world_size, *args)))
            if _to_launcher is not None:
                _to_launcher.send_bytes(payload)
                _to_launcher = None
        except BaseException as exc:  # noqa: BLE001 - report anything, even SystemExit
            report_failure(exc)
    finally:
        faulthandler.cancel_dump_traceback_later()
        _release_rank_resources()
        conn.close()


def _release_rank_resources() -> None:
    import torch.distributed as dist

    from shm_broadcast.p2p_channels import deliver_pending_sends

    deliver_pending_sends()  # what the process's exit would do, before the store goes
    if dist.is_initialized():
        dist.destroy_process_group()


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

    def outcomes(self, killed: Sequence[int] = ()) -> list[RankOutcome]:
        """Wait for the ranks (see the module doc: a failure ends the wait early) and
        end them all; how each ended, in rank order. ``killed`` ranks were ended on
        purpose: their deaths start no early end."""
        deadline = time.monotonic() + self.timeout
        stop_at = deadline
        got: dict[int, RankOutcome] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        try:
            while pending:
                left = stop_at - time.monotonic()
                if left <= 0:
                    break
                for ready in wait(list(pending), timeout=left):
                    conn = cast(Connection, ready)
                    rank = pending.pop(conn)
                    got[rank] = _read_outcome(rank, conn)
                    if got[rank].kind != "ok" and rank not in killed and stop_at == deadline:
                        stop_at = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        finally:
            answered = {r for r, o in got.items() if o.kind != "died"}
            self.terminate(grace_s=END_GRACE_S, finishing=answered)
        left_over = "stopped" if stop_at != deadline else "hung"
        for rank, proc in enumerate(self.procs):
            outcome = got.setdefault(rank, RankOutcome(rank, left_over))
            code = proc.exitcode
            if outcome.kind == "died":
                outcome.error = _describe_exit(code)
            elif outcome.kind == "hung":
                outcome.error = f"did not finish within {self.timeout:g} s"
            elif outcome.kind == "ok" and code not in (0, None):
                if rank not in self._killed_by_us:
                    outcome.kind = "died"
                    outcome.error = f"answered, then exited with code {code}"
        return [got[rank] for rank in range(self.world_size)]

    def collect(self, killed: Sequence[int] = ()) -> list[Any]:
        """Every rank's result (None for ``killed`` ranks), or :class:`RankError`
        naming every rank that failed, died or hung, the likeliest cause first."""
        outcomes = self.outcomes(killed)
        if any(o.kind != "ok" and o.rank not in killed for o in outcomes):
            headline, cause, lines = failure_report(outcomes, self.timeout, killed)
            text = [headline]
            for o in outcomes:
                if o.kind == "raised" and o.rank not in killed:
                    text.append(f"--- rank {o.rank} traceback ---\n{o.traceback.rstrip()}")
            raise RankError("\n".join(text + lines))
        return [None if o.rank in killed else o.value for o in outcomes]

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
        if self._killed_by_us:
            from shm_broadcast.segments import cleanup_stale_segments

            cleanup_stale_segments()  # what the killed ranks could not unlink


def _read_outcome(rank: int, conn: Connection) -> RankOutcome:
    try:
        kind, value = loads(conn.recv_bytes())
    except EOFError:  # it ended without answering
        return RankOutcome(rank, "died", when=time.time())
    if kind == "ok":
        return RankOutcome(rank, "ok", value)
    return RankOutcome(
        rank,
        "raised",
        error=value["error"],
        traceback=value["traceback"],
        when=value["when"],
        timed_out=value["timed_out"],
    )


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} without reporting an error"
    return f"exited with code {code} without reporting an error"


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
