"""Hostile bytes on the wire: forged, malformed, truncated, oversized and replayed TCP
frames, and pickles sent where objects are expected.

* The writer's TCP socket is flooded by an attacker (hypothesis-generated
  frames) while it streams to a real remote reader: every attack frame is
  dropped and counted, every good message arrives, in order.
* A fake writer (it knows the key) sends a real reader good messages mixed
  with hostile frames and pickles: hostile frames are dropped and counted,
  pickles refused, good messages delivered in order.
* A pickle that would create a file is sent through the ring (one chunk, spanned,
  streamed), TCP, GroupCoordinator and StatelessProcessGroup object paths: the file
  never appears and each receiver raises a clear error, then keeps working.
"""

from __future__ import annotations

import os
import random

from coordinator.launch import free_port, run_ranks

from . import _wire_ranks as ranks
from ._common import LONG, report

WRITER_ATTACKS = 10_000 if LONG else 300
READER_EVENTS = 10_000 if LONG else 200


def test_attack_frames_at_the_writer_are_dropped_and_counted() -> None:
    writer, reader = run_ranks(
        ranks.attack_writer, 2, WRITER_ATTACKS, timeout=110 if not LONG else 1800
    )
    report(
        "hostile bytes: attacker frames at the TCP writer",
        attacks=writer["attacks"],
        counted=writer["writer_bad_frames"],
        good_delivered=reader["delivered"],
    )
    assert writer["writer_bad_frames"] == writer["attacks"], writer
    assert reader["delivered"] == writer["good"], (writer, reader)


def test_hostile_frames_at_a_reader_are_dropped_and_counted(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "pwned")
    seed = random.randrange(2**31)
    writer, reader = run_ranks(
        ranks.fake_writer_to_reader, 2, READER_EVENTS, seed, path, timeout=110 if not LONG else 1800
    )
    results = reader["results"]
    report(
        "hostile bytes: hostile frames at a TCP reader",
        seed=seed,
        hostile=writer["hostile"],
        counted=reader["bad_frames"],
        bombs=writer["bombs"],
        good=writer["good"],
    )
    assert not os.path.exists(path) and not reader["bomb_file"], "a pickle from the wire ran"
    wrong = [r for r in results if not (r == "g:ok" or r.startswith("b:ProtocolError"))]
    assert not wrong, f"seed {seed}: {wrong[:5]}"
    assert results.count("g:ok") == writer["good"]
    assert len(results) == writer["good"] + writer["bombs"], "every pickle refused, once"
    assert reader["bad_frames"] == writer["hostile"], (seed, reader["bad_frames"], writer)


def test_pickle_through_the_queue_never_runs(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "pwned")
    results = run_ranks(ranks.pickle_through_queue, 4, path, timeout=90)
    assert not os.path.exists(path)
    for reader in results[1:]:
        assert not reader["file"], reader
        *refused, after = reader["outcomes"]
        assert len(refused) == 3, reader
        for outcome in refused:
            assert outcome.startswith("ProtocolError") and "allow_pickle" in outcome, reader
        assert after == "{'after': 'bombs'}", reader
    report(
        "hostile bytes: pickle via ring (one chunk, spanned, streamed), TCP",
        readers=3,
        file_created=False,
    )


def test_pickle_through_group_object_paths_never_runs(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "pwned")
    _, receiver = run_ranks(ranks.pickle_through_groups, 2, path, free_port(), timeout=90)
    assert not os.path.exists(path) and receiver.pop("file") == "False"
    for label, outcome in receiver.items():
        assert outcome.startswith("ProtocolError") and "allow_pickle" in outcome, (label, outcome)
    report("hostile bytes: pickle via group object paths", paths=len(receiver), file_created=False)
