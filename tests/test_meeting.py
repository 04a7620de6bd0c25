"""A group being made tells a member that died before it joined from a slow one.

c10d's connect waited out the whole timeout for a dead member and then raised
torch's DistStoreError naming a store key (``GroupCoordinator``: 20 of 20 s here,
``new_comm`` likewise); the members now meet through the store first
(``coordinator/meeting.py``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from coordinator.launch import init_gloo, start_ranks

TIMEOUT_S = 20.0


def _make(kind: str, rank: int) -> Any:
    if kind == "GroupCoordinator":
        from coordinator.group_coordinator import GroupCoordinator

        return GroupCoordinator([[0, 1, 2]], rank, "gloo", True, group_name="meet")
    from coordinator.comm import new_comm

    return new_comm("gloo", "cpu", "meet", timeout=TIMEOUT_S)


def _close(kind: str, made: Any) -> None:
    if kind == "GroupCoordinator":
        made.destroy()
    else:
        made.finalize()


def _timed(build: Callable[[], str | None]) -> tuple[str, float, str]:
    """What ``build()`` (making a group, maybe using it) did on this rank: the class
    of what it raised, or "made"; the seconds it took; the message, or what it said."""
    start = time.monotonic()
    try:
        said = build()
    except Exception as exc:  # noqa: BLE001 - the test judges it
        return type(exc).__name__, time.monotonic() - start, str(exc)
    return "made", time.monotonic() - start, said or ""


def _one_dies_before_the_group(rank: int, world: int, kind: str) -> tuple[str, float, str]:
    os.environ["GROUPCOORD_TIMEOUT_S"] = str(TIMEOUT_S)
    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # after init, before the group
    time.sleep(0.3)
    return _timed(lambda: _close(kind, _make(kind, rank)))


@pytest.mark.parametrize("kind", ["GroupCoordinator", "new_comm"])
def test_a_member_that_died_before_the_group_is_named_at_once(kind: str) -> None:
    outcomes = start_ranks(_one_dies_before_the_group, 3, kind, timeout=60).outcomes(killed=[2])
    for outcome in outcomes[:2]:
        assert outcome.kind == "ok", outcome
        raised, took, message = outcome.value
        assert raised == "PeerDiedError", message
        assert took < 5.0, f"rank {outcome.rank} took {took:.1f} s of {TIMEOUT_S}"
        assert "connect" in message and "[2]" in message and "before it joined" in message


def _one_is_late(rank: int, world: int, kind: str, late_s: float) -> tuple[str, float]:
    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    if rank == 2:
        time.sleep(late_s)  # alive, busy: waiting for it is not an error
    start = time.monotonic()
    made = _make(kind, rank)
    took = time.monotonic() - start
    if kind == "GroupCoordinator":
        assert made.all_reduce(__import__("torch").ones(2)).tolist() == [3.0, 3.0]
    _close(kind, made)
    return "made", took


@pytest.mark.parametrize("kind", ["GroupCoordinator", "new_comm"])
def test_a_late_member_is_waited_for(kind: str) -> None:
    results = start_ranks(_one_is_late, 3, kind, 1.5, timeout=60).collect()
    assert [r[0] for r in results] == ["made"] * 3
    assert results[0][1] >= 1.0  # rank 0 waited for the late rank


def _one_never_comes(rank: int, world: int) -> tuple[str, str]:
    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.errors import GroupcoordTimeoutError

    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    if rank == 1:
        time.sleep(4.0)  # alive, never makes the group; gone before the test ends
        return "absent", ""
    try:
        GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="late", timeout=1.0)
    except GroupcoordTimeoutError as exc:
        return "timeout", str(exc)
    return "made", ""


def test_a_member_that_never_comes_is_named_in_the_timeout() -> None:
    # Before: torch's "DistStoreError: wait timeout after 1000ms, keys: /default_pg/...".
    (kind, message), _ = start_ranks(_one_never_comes, 2, timeout=60).collect()
    assert kind == "timeout"
    assert "late:0" in message and "connect" in message and "[1]" in message


def _layouts_disagree(rank: int, world: int, theirs: list[list[int]]) -> str:
    from coordinator.errors import DesyncError
    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    layout = [[0, 1], [2, 3]] if rank < 2 else theirs
    try:
        GroupCoordinator(layout, rank, "gloo", True, group_name="tp").destroy()
    except DesyncError as exc:
        return str(exc)
    return "made"


@pytest.mark.parametrize(
    "theirs", [[[0, 2], [1, 3]], [[2, 3], [0, 1]]], ids=["other groups", "another order"]
)
def test_ranks_whose_group_ranks_differ_all_raise_naming_both(theirs: list[list[int]]) -> None:
    # c10d joins the members of each new_group call by its place in the sequence.
    # Until 2026-11-28, with ranks 2 and 3 building [[0, 2], [1, 3]], rank 0's
    # all_reduce in what it took for [0, 1] summed rank 2's input (101 for inputs
    # 1, 10, 100, 1000; 11 was right) with no error, and rank 1 got Gloo's "Connection
    # reset by peer"; with [[2, 3], [0, 1]], ranks 0 and 1 waited out the timeout.
    got = start_ranks(_layouts_disagree, 4, theirs, timeout=60).collect()
    for rank, message in enumerate(got):
        mine, other = ([[0, 1], [2, 3]], theirs) if rank < 2 else (theirs, [[0, 1], [2, 3]])
        assert f"rank {rank} builds the groups from group_ranks={mine} on gloo" in message
        assert f"from {other} on gloo" in message


def _halves_disagree(rank: int, world: int) -> tuple[str, float, str]:
    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    # Each half agrees within itself, and groups [1, 2] and [5, 6] are each the
    # second group of their half's layout: c10d gives both the same name.
    layout = [[0, 3], [1, 2], [4, 5], [6, 7]] if rank < 4 else [[4, 7], [5, 6], [0, 1], [2, 3]]

    def build() -> str:
        group = GroupCoordinator(layout, rank, "gloo", True, group_name="tp")
        total = group.all_reduce(__import__("torch").tensor([10.0**rank])).item()
        group.destroy()
        return f"{group.ranks} summed {total}"

    return _timed(build)


def test_halves_whose_layouts_differ_far_apart_all_raise_and_none_connects() -> None:
    # Until 2026-11-29 only the ranks whose members or layout neighbours differed
    # raised (0, 3, 4 and 7); ranks 1, 2, 5 and 6 connected groups [1, 2] and
    # [5, 6] under one c10d name: in one run of four rank 1 summed 1000010 (its
    # input and rank 6's; 110 was right), in another two ranks hung in c10d's
    # connect past the 20 s timeout.
    results = start_ranks(_halves_disagree, 8, timeout=90).collect()
    for rank, (kind, took, message) in enumerate(results):
        assert kind == "DesyncError", (rank, message)
        assert took < 10.0, f"rank {rank} took {took:.1f} s"
        other = 4 if rank < 4 else 0  # the lowest rank whose layout differs
        assert f"rank {rank} builds the groups from" in message and f"rank {other} from" in message


def _one_built_another_group_first(rank: int, world: int) -> tuple[str, float, str]:
    import torch.distributed as dist

    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    if rank == 0:
        dist.new_group([0])  # c10d names groups in order: rank 0's next group is #2
    return _timed(lambda: GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="tp").destroy())


def test_ranks_whose_c10d_groups_are_out_of_order_raise_naming_both() -> None:
    # Before, rank 0 connected c10d group "2" and rank 1 group "1", each waiting
    # for the other until the timeout.
    results = start_ranks(_one_built_another_group_first, 2, timeout=60).collect()
    for rank, (kind, took, message) in enumerate(results):
        assert kind == "DesyncError", (rank, message)
        assert took < 10.0, f"rank {rank} took {took:.1f} s"
    options = (
        "use_device_communicator=True, use_message_queue_broadcaster=False, use_all2all=False; "
        "GROUPCOORD_DEBUG_DESYNC=False, GROUPCOORD_DISABLE_SHM_P2P=False"
    )
    assert (
        f"rank 0 builds the groups from group_ranks=[[0, 1]] on gloo with {options} (c10d's "
        f"groups #2-#2), rank 1 from [[0, 1]] on gloo with {options} (c10d's groups #1-#1)"
    ) in results[0][2]


def _options_differ(rank: int, world: int, option: str) -> tuple[str, float, str]:
    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    flags = {"use_device_communicator": True, "use_message_queue_broadcaster": False}
    if rank == 1:
        flags[option] = not flags[option]
    return _timed(
        lambda: GroupCoordinator([[0, 1, 2]], rank, "gloo", group_name="tp", **flags).destroy()  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("option", ["use_device_communicator", "use_message_queue_broadcaster"])
def test_ranks_whose_options_differ_raise_naming_both(option: str) -> None:
    # Until 2026-11-29 the ranks met at another set-up step each: the ranks with
    # a queue waited out the timeout in its creation, those without it in their
    # first collective; without a device communicator on one rank, its peers
    # timed out making theirs and the rank itself got PeerDiedError naming a
    # living peer in its first call.
    results = start_ranks(_options_differ, 3, option, timeout=60).collect()
    for rank, (kind, took, message) in enumerate(results):
        assert kind == "DesyncError" and took < 10.0, (rank, took, message)
        base = option == "use_device_communicator"  # every rank's value but rank 1's
        mine, theirs = (base, not base) if rank != 1 else (not base, base)
        assert f"{option}={mine}" in message and f"{option}={theirs}" in message, message


def _settings_differ(rank: int, world: int, setting: str) -> tuple[str, float, str]:
    import torch

    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import set_config

    if rank == 1:
        set_config(**{setting: "naive" if setting == "all2all_backend" else True})
    init_gloo(rank, world, timeout_s=TIMEOUT_S)

    def build() -> None:
        group = GroupCoordinator([[0, 1, 2]], rank, "gloo", True, group_name="tp", use_all2all=True)
        # The group works: rank 0 sends rank 1 a tensor dict, then all reduce.
        if rank == 0:
            group.send_tensor_dict({"x": torch.ones(4)}, 1)
        elif rank == 1:
            group.recv_tensor_dict(0)
        group.all_reduce(torch.ones(4))
        group.destroy()

    return _timed(build)


@pytest.mark.parametrize("setting", ["debug_desync", "disable_shm_p2p", "all2all_backend"])
def test_ranks_whose_settings_differ_raise_naming_both(setting: str) -> None:
    # Until 2026-11-29 the groups were made and the ranks parted at the first call
    # the setting changes: debug_desync's all-gather against a shared-memory
    # all_reduce, and a tensor dict sent through shared memory to a rank listening
    # on Gloo, waited out the timeout (the first naming a living peer dead); EP
    # managers of two kinds raised DesyncError at the first dispatch.
    results = start_ranks(_settings_differ, 3, setting, timeout=60).collect()
    name = f"GROUPCOORD_{setting.upper()}"
    default, changed = (
        ("'allgather_reducescatter'", "'naive'")
        if setting == "all2all_backend"
        else ("False", "True")
    )
    for rank, (kind, took, message) in enumerate(results):
        assert kind == "DesyncError" and took < 10.0, (rank, took, message)
        assert f"{name}={default}" in message and f"{name}={changed}" in message, message


def _comm_settings_differ(rank: int, world: int, setting: str) -> tuple[str, float, str]:
    import torch

    from coordinator.comm import new_comm
    from shm_broadcast.config import set_config

    if rank == 1:
        set_config(**{setting: True})

    def build() -> None:
        comm = new_comm("gloo", "cpu", "cc", timeout=TIMEOUT_S)
        if rank == 0:
            comm.send(torch.ones(4), 1)
        elif rank == 1:
            comm.recv(torch.empty(4), 0)
        comm.finalize()

    return _timed(build)


@pytest.mark.parametrize("setting", ["debug_desync", "disable_shm_p2p"])
def test_comm_ranks_whose_settings_differ_raise_naming_both(setting: str) -> None:
    # Until 2026-11-29 a send through the pair's channel to a rank receiving over
    # Gloo (disable_shm_p2p on one rank) waited out the timeout.
    results = start_ranks(_comm_settings_differ, 3, setting, timeout=60).collect()
    name = f"GROUPCOORD_{setting.upper()}"
    for rank, (kind, took, message) in enumerate(results):
        assert kind == "DesyncError" and took < 10.0, (rank, took, message)
        assert f"{name}=False" in message and f"{name}=True" in message, message


def _cuda_settings_differ(rank: int, world: int, setting: str) -> dict[str, object]:
    import torch

    from coordinator.group_coordinator import GroupCoordinator
    from shm_broadcast.config import override

    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    with override(**{setting: rank == 1}):
        # The meeting comes before any NCCL group, which this CPU build could
        # not make: the ranks' disagreement is all that can stop them here.
        refused = _timed(
            lambda: GroupCoordinator([[0, 1, 2]], rank, "nccl", True, group_name="tp").destroy()
        )
    group = GroupCoordinator([[0, 1, 2]], rank, "gloo", True, group_name="tp")
    total = group.all_reduce(torch.full((4,), float(rank + 1)))
    group.destroy()
    return {"refused": refused, "total": total.tolist()}


@pytest.mark.parametrize("setting", ["disable_custom_all_reduce", "disable_pynccl"])
def test_ranks_whose_cuda_settings_differ_raise_naming_both(setting: str) -> None:
    # A CUDA group's meeting carries the custom all-reduce's and PyNCCL's settings
    # (RELIABILITY row 66); tests/gpu has the same case on a GPU.
    name = f"GROUPCOORD_{setting.upper()}"
    for rank, out in enumerate(
        start_ranks(_cuda_settings_differ, 3, setting, timeout=60).collect()
    ):
        kind, took, message = out["refused"]
        assert kind == "DesyncError" and took < 10.0, (rank, took, message)
        assert f"{name}=False" in message and f"{name}=True" in message, message
        assert out["total"] == [6.0] * 4, out


def _two_threads_build(rank: int, world: int) -> dict[str, tuple[str, float, str]]:
    import threading

    from coordinator.group_coordinator import GroupCoordinator

    init_gloo(rank, world, timeout_s=TIMEOUT_S)
    results: dict[str, tuple[str, float, str]] = {}
    # Even ranks start building tp, odd ranks pp, and each starts the other 0.3 s later.
    first = "tp" if rank % 2 == 0 else "pp"

    def build(name: str, layout: list[list[int]]) -> None:
        time.sleep(0.0 if name == first else 0.3)
        results[name] = _timed(
            lambda: GroupCoordinator(layout, rank, "gloo", True, group_name=name).destroy()
        )

    threads = [
        threading.Thread(target=build, args=("tp", [[0, 1], [2, 3]])),
        threading.Thread(target=build, args=("pp", [[0, 2], [1, 3]])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_groups_built_from_two_threads_at_once_fail_at_once_on_every_rank() -> None:
    # Before, every rank hung in c10d's connect past the timeout: the two threads'
    # groups got c10d names in different orders on different ranks.
    for rank, results in enumerate(start_ranks(_two_threads_build, 4, timeout=60).collect()):
        first, second = ("tp", "pp") if rank % 2 == 0 else ("pp", "tp")
        kind, took, message = results[second]
        assert kind == "NotSupportedError", (rank, message)
        assert (
            f"group {second}:0: another thread of this process is building group {first}:0"
            in message
        )
        kind, took, message = results[first]
        assert kind == "DesyncError" and took < 10.0, (rank, took, message)
        assert "from nothing (group" in message and "another thread" in message


def test_a_build_interrupted_as_it_took_the_lock_does_not_refuse_every_later_build() -> None:
    # An exception from a signal handler just after the lock was taken left it held:
    # every later build of the process raised NotSupportedError ("another thread of
    # this process is building  now").
    from coordinator import group_base

    real = group_base._BUILDING

    class TakenThenInterrupted:
        def acquire(self, *args: Any, **kwargs: Any) -> bool:
            real.acquire(*args, **kwargs)
            raise KeyboardInterrupt

        def _is_owned(self) -> bool:
            return real._is_owned()

        def release(self) -> None:
            real.release()

    group_base._BUILDING = TakenThenInterrupted()
    try:
        with pytest.raises(KeyboardInterrupt):
            with group_base.building("group a"):
                pass
    finally:
        group_base._BUILDING = real
    with group_base.building("group b") as refused:
        assert refused is None
    with group_base.building("group c") as refused:  # and it was released again
        assert refused is None
