"""What went wrong in a failed collective: which ranks never arrived, timeout or death.

Only a failing collective pays for this: each rank that reached it posts its
arrival to torch's default TCPStore under the collective's sequence number
(every rank of a group counts the same calls), then waits a short grace for
the others' posts. Those that never post did not arrive (absent, slow, or
dead). The success path costs nothing.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from .errors import GroupcoordError, GroupcoordTimeoutError, PeerDiedError


def absent_ranks(
    group_name: str, seq: int, rank_in_group: int, ranks: list[int], timeout_s: float
) -> list[int]:
    """Global ranks of ``ranks`` that did not post an arrival for collective ``seq``.

    Empty when the store itself cannot be reached (its host died): then
    nothing is known about the others.
    """
    try:
        store = dist.PrefixStore(
            f"groupcoord/{group_name}/arrived/{seq}/",
            dist.distributed_c10d._get_default_store(),
        )
        store.set(str(rank_in_group), "1")
        # Ranks that arrived within the grace of this one time out within it
        # too; a rank later than that did not arrive within the deadline.
        deadline = time.monotonic() + min(5.0, max(0.5, timeout_s / 2))
        while True:
            missing = [r for i, r in enumerate(ranks) if not store.check([str(i)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)
    except RuntimeError:
        return []


def classify(
    what: str, operation: str, timeout_s: float, missing: list[int], exc: BaseException
) -> GroupcoordError:
    """A timeout or a dead peer, from the transport's message (its first line is kept)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        return GroupcoordTimeoutError(what, operation, timeout_s, missing, detail=text)
    if not missing:
        text += "; which ranks is unknown (the store did not answer)"
    return PeerDiedError(what, operation, missing, detail=text)
