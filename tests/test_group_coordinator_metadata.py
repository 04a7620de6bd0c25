"""Tensor dicts on the wire: one codec encoding, inline tensors, stand-ins, refusals, bad bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.errors import DesyncError, GroupcoordTypeError, GroupcoordValueError, ProtocolError
from coordinator.metadata import TENSOR_DICT, SeparateTensor, describe, encode, rebuild
from coordinator.metadata import decode as decode_from
from shm_broadcast.codec import dumps, encode_message, message_bytes

CPU = torch.device("cpu")


def decode(data: bytes) -> object:
    return decode_from(data, "tp:0: rank 1 called recv_tensor_dict from rank 0", 0)


def _dict() -> dict:
    return {
        "ints": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(7.25),
        "view": torch.arange(12.0).reshape(3, 4).t(),
        "big": torch.ones(100, 100),
        "plain": {"a": (1, 2), "b": [None, 1.5, "s", b"\x01"]},
    }


def test_round_trip_with_small_tensors_inline_and_large_ones_separate() -> None:
    original = _dict()
    described, separate = describe(original, CPU, inline_max_bytes=1024)
    assert [t.shape for t in separate] == [torch.Size([100, 100])]
    assert described.separate == {"big": SeparateTensor(torch.float32, (100, 100), "cpu")}
    wire = message_bytes(encode(described))
    assert b"\x80\x04" not in wire[:2]  # msgpack, not a pickle header
    # One encoding: the message is the codec's encoding of the dict plus the
    # separate tensor's description, with no nested per-value encodings inside it.
    plain_part = len(encode_message({k: v for k, v in original.items() if k != "big"}).header)
    # (The kind's mark, TENSOR_DICT, is 23 bytes of it.)
    assert plain_part < len(encode(described).header) < plain_part + 64
    again = decode(wire)
    assert list(again.values) == list(original)
    assert again.separate == described.separate
    pending = iter(separate)
    out = rebuild(again, lambda item: next(pending).clone())
    assert list(out) == list(original)
    for key, value in original.items():
        if isinstance(value, torch.Tensor):
            assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
        else:
            assert out[key] == value
    # Rebuilt inline tensors own their memory (writable, independent of the message).
    out["ints"][0, 0] = 99
    assert original["ints"][0, 0] == 0


def test_every_cpu_tensor_rides_inside_without_a_limit() -> None:
    described, separate = describe(_dict(), CPU, inline_max_bytes=None)
    assert separate == [] and described.separate == {}


def test_slicing_choice_is_recorded_and_keeps_tensors_out_of_line() -> None:
    described, separate = describe(
        {"x": torch.ones(4), "y": torch.ones(3)},
        CPU,
        inline_max_bytes=1 << 20,
        slices=lambda key, t: 2 if key == "x" else 0,
    )
    assert described.separate == {"x": SeparateTensor(torch.float32, (4,), "cpu", 2)}
    assert described.values["x"] is None and isinstance(described.values["y"], torch.Tensor)
    assert len(separate) == 1
    assert decode(message_bytes(encode(described))).separate == described.separate


def test_refusals_name_the_key() -> None:
    with pytest.raises(GroupcoordTypeError, match="keys must be str"):
        describe({1: torch.ones(1)}, CPU, 0)  # type: ignore[dict-item]
    with pytest.raises(GroupcoordTypeError, match=r"tensor_dict\['fn'\]"):
        encode(describe({"ok": 1, "fn": object()}, CPU, 0)[0])
    with pytest.raises(GroupcoordTypeError, match="must be a dict"):
        describe([("a", 1)], CPU, 0)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize(
    "kind, tensor, error",
    [
        ("sparse", lambda: torch.eye(4).to_sparse(), "dense"),
        ("sparse_csr", lambda: torch.eye(4).to_sparse_csr(), "dense"),
        ("mkldnn", lambda: torch.ones(4).to_mkldnn(), "dense"),
        ("nested", lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        ("meta", lambda: torch.empty(4, device="meta"), "is on meta, but this group moves CPU"),
    ],
)
def test_a_tensor_no_transfer_can_carry_is_refused_before_anything_is_sent(
    kind: str, tensor: Any, error: str
) -> None:
    # Until 2026-11-29 a meta, sparse CSR or mkldnn tensor large enough to travel
    # on its own failed only when its turn came, after the dict's message had
    # gone (a sparse or nested one with torch's own words).
    with pytest.raises((GroupcoordTypeError, GroupcoordValueError), match=error) as raised:
        describe({"ok": torch.ones(3), kind: tensor()}, CPU, 1024)
    assert f"tensor_dict[{kind!r}]" in str(raised.value)


def test_bad_bytes_raise_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode(b"\x93garbage")
    with pytest.raises(ProtocolError, match="not a str"):
        decode(dumps([TENSOR_DICT, {1: "a"}, []]))
    with pytest.raises(ProtocolError, match="malformed tensor dict message"):
        decode(dumps([TENSOR_DICT, {"a": 1}]))
    with pytest.raises(ProtocolError, match="unknown torch dtype 'float99'"):
        decode(dumps([TENSOR_DICT, {"a": None}, ["a", "float99", "cpu", 0, 1, 1]]))
    for bad in (
        ["a", "float32", "cpu", 0, 1, -1],  # negative size
        ["a", "float32", "cpu", -2, 1, 1],  # negative slices
        ["b", "float32", "cpu", 0, 1, 1],  # no such key
        ["a", "float32"],  # too short
        ["a", "float32", "cpu", 0, 2, 1],  # fewer sizes than ndim
        ["a", 7, "cpu", 0, 1, 1],  # dtype name not a str
    ):
        with pytest.raises(ProtocolError, match="malformed tensor description"):
            decode(dumps([TENSOR_DICT, {"a": None}, bad]))
    with pytest.raises(ProtocolError, match="malformed"):  # a value where a tensor goes
        decode(dumps([TENSOR_DICT, {"a": 5}, ["a", "float32", "cpu", 0, 1, 1]]))


def test_another_kind_of_message_is_a_desync_naming_both_calls() -> None:
    """A plain object (or an object list) where a tensor dict was expected: the
    ranks called different things, which the message says."""
    with pytest.raises(
        DesyncError,
        match=r"called recv_tensor_dict from rank 0, and rank 0 "
        r"sent an object \(send_object or broadcast_object\)",
    ):
        decode(dumps({"a": 1}))
    with pytest.raises(DesyncError, match="sent an object list"):
        decode(dumps(["groupcoord:object_list", 1, 2]))
