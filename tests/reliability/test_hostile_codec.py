"""Hostile bytes against the message decoder: rejected with ProtocolError, never a crash.

``shm_broadcast.codec.loads`` decodes every message that arrives over shared
memory, ZeroMQ or a process group. Whatever the bytes, it must either return a
value or raise ``ProtocolError`` (which callers count and survive); any other
exception type escaping it is a bug, since callers only expect that one.
Hypothesis drives random bytes, mutated valid messages and hand-built
extension values; fast mode runs a few hundred examples each, long mode
enough that the three together pass 100,000.
"""

from __future__ import annotations

import os
import struct

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shm_broadcast.codec import dumps, loads
from shm_broadcast.errors import GroupcoordTypeError, ProtocolError

from ._common import LONG, report
from ._wire import CreatesFile, ext, pickle_bomb, tensor_header, wire

EXAMPLES = 34_000 if LONG else 300
# Long mode's 34,000 examples of one fuzz test took over the suite's 120 s on the
# 2-core EPYC VM (2026-11-25): the whole module gets longer there.
pytestmark = pytest.mark.timeout(900 if LONG else 120)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the shared working tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_counts = {"decoded": 0, "rejected": 0}


def _decode_or_reject(data: bytes) -> None:
    """The one rule: a value or ProtocolError (counted), nothing else."""
    try:
        loads(data)
    except ProtocolError:
        _counts["rejected"] += 1
        return
    _counts["decoded"] += 1


def _valid_messages() -> list[bytes]:
    return [
        dumps({"ids": [1, 2, 3], "text": "hello", "blob": b"\x00" * 40_000}),
        dumps((torch.arange(12, dtype=torch.float16).reshape(3, 4), np.ones((2, 2)), 2**70)),
        dumps({(1, 2): torch.Size([4]), "dtype": torch.bfloat16, "dev": torch.device("cpu")}),
        dumps([np.float32(1.5), None, True, 3.25, [[], {}]]),
    ]


VALID = _valid_messages()


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _decode_or_reject(data)


@FUZZ
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6),
    st.one_of(st.none(), st.integers(0, 1 << 20)),
    st.one_of(st.none(), st.integers(0, 2**32 - 1)),
)
def test_mutated_valid_messages(
    message: bytes, flips: list[tuple[int, int]], cut: int | None, length: int | None
) -> None:
    data = bytearray(message)
    for at, value in flips:
        data[at % len(data)] = value
    if length is not None:  # an oversized (or undersized) header length or frame count
        struct.pack_into("<I", data, 0 if length % 2 else 4, length)
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    _decode_or_reject(bytes(data))


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
_dtype_names = st.sampled_from(
    ["float32", "bfloat16", "int8", "bool", "float8_e4m3fn", "Tensor", "nope", "|O", "<f8", "V8"]
)
# Bodies shaped like the real ones ([dtype, shape, frame index] ...) with hostile values.
_tensor_like = st.tuples(
    _dtype_names,
    st.lists(st.integers(-(2**40), 2**40), max_size=4),
    st.integers(-2, 3),
).map(list)
# A tensor's binary header (dtype code, frame index, dims) with hostile values.
_tensor_header = st.builds(
    lambda code, frame, dims: tensor_header(code, frame, *dims),
    st.integers(0, 255),
    st.integers(0, 5),
    st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 8), max_size=4),
)
_ext_body = st.one_of(
    _plain,
    _tensor_like,
    _tensor_header,
    st.tuples(_dtype_names, st.binary(max_size=16)).map(list),
    # A standard-library value's [tag, parts] (std_values.py), with hostile parts.
    st.tuples(st.integers(-1, 13), _plain | st.lists(_plain, max_size=8)).map(list),
)


@FUZZ
@given(
    st.integers(0, 20),
    _ext_body,
    st.lists(st.binary(max_size=64), max_size=3),
    st.booleans(),
)
def test_crafted_extension_values(code: int, body: object, frames: list[bytes], nest: bool) -> None:
    header = ext(code, body)
    if nest:  # the same value inside a list and a dict, as real messages hold them
        header = msgspec.msgpack.encode([{"k": msgspec.msgpack.Ext(code, header[2:])}])
    _decode_or_reject(wire(header, frames))


# Found by the fuzzers above (kept so they are checked on every run).
KNOWN_HOSTILE = {
    "ndarray with an absurd shape": (ext(4, ["<f8", [2**31, 2**31], 0]), [b"\0" * 8]),
    "ndarray with a negative dim": (ext(4, ["<f8", [-1], 0]), [b"\0" * 8]),
    "numpy scalar of dtype object": (ext(5, ["|O", b"\0" * 8]), []),
    "numpy dtype numpy parses as Python (',f4')": (ext(5, [",f4", b"\0" * 4]), []),
    "tensor with a negative shape": (ext(3, ["float32", [-1, -4], 0]), [b"\0" * 16]),
    "tensor body of the wrong arity": (ext(3, ["float32"]), []),
    "tensor with an absurd shape": (ext(3, tensor_header(0, 0, 2**63, 2**63)), [b"\0" * 16]),
    "tensor header cut short": (ext(3, tensor_header(0, 0, 4)[:-1]), [b"\0" * 16]),
    "tensor of a dtype code no torch has": (ext(3, tensor_header(250, 0, 4)), [b"\0" * 16]),
    "tensor of the wrong byte count": (ext(3, tensor_header(0, 0, 5)), [b"\0" * 16]),
    "tensor in a frame that is not there": (ext(3, tensor_header(0, 3, 4)), [b"\0" * 16]),
    "tuple body that is an int": (ext(1, 5), []),
    "dict pairs with an unhashable key": (ext(7, [[1], 2]), []),
    "torch device that does not exist": (ext(10, b"bogus:99"), []),
    "torch.Size of strings": (ext(11, ["a"]), []),
    "big int that is not a number": (ext(6, b"12x"), []),
    "nesting 100,000 deep": (b"\x91" * 100_000 + b"\xc0", []),
    "bytearray made from an int (10**12 zeros)": (ext(18, [3, 10**12]), []),
    "UUID made from an int": (ext(18, [8, 10**12]), []),
    "Decimal that is not a number": (ext(18, [9, "abc"]), []),
    "datetime in month 13": (ext(18, [4, [[2020, 13, 1, 0, 0, 0, 0], 0, None]]), []),
    "deque with a negative maxlen": (ext(18, [11, [[1], -1]]), []),
    "standard-library tag out of range": (ext(18, [12, 0]), []),
}


@pytest.mark.parametrize("name", sorted(KNOWN_HOSTILE))
def test_known_hostile_messages_are_protocol_errors(name: str) -> None:
    header, frames = KNOWN_HOSTILE[name]
    with pytest.raises(ProtocolError):
        loads(wire(header, frames))


def test_decoder_still_decodes_after_hostile_input() -> None:
    """The per-thread decoder keeps no state from a rejected message."""
    for header, frames in KNOWN_HOSTILE.values():
        try:
            loads(wire(header, frames))
        except Exception:  # noqa: BLE001 - only the recovery is under test here
            _counts["rejected"] += 1
    assert loads(VALID[0])["text"] == "hello"
    report("hostile bytes: codec loads fuzz", examples_per_strategy=EXAMPLES, **_counts)


def test_pickle_payload_is_refused_without_opt_in(tmp_path: object) -> None:
    target = os.path.join(str(tmp_path), "pwned")
    bomb = pickle_bomb(target)
    with pytest.raises(ProtocolError, match="allow_pickle=False"):
        loads(bomb)
    assert not os.path.exists(target)
    # The payload is live: with the explicit opt-in it does create the file.
    loads(bomb, allow_pickle=True)
    assert os.path.exists(target)


def test_unsupported_objects_are_refused_at_encode() -> None:
    with pytest.raises(GroupcoordTypeError, match="CreatesFile"):
        dumps(CreatesFile("/nonexistent"))
    with pytest.raises(GroupcoordTypeError):
        dumps({"fn": print})
