"""Tensor-dict metadata Structs: round trips, inline tensors, refusals, bad bytes."""

from __future__ import annotations

import pytest
import torch

from coordinator.errors import GroupcoordTypeError, ProtocolError
from coordinator.metadata import (
    TensorDictMeta,
    TensorMeta,
    ValueMeta,
    decode_meta,
    describe,
    encode_meta,
    rebuild,
)


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
    meta, separate = describe(original, inline_max_bytes=1024)
    assert [t.shape for t in separate] == [torch.Size([100, 100])]
    wire = encode_meta(meta)
    assert b"\x80\x04" not in wire[:2]  # msgpack, not a pickle header
    again = decode_meta(wire)
    assert again == meta
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


def test_slicing_choice_is_recorded_and_keeps_tensors_out_of_line() -> None:
    meta, separate = describe(
        {"x": torch.ones(4), "y": torch.ones(3)},
        inline_max_bytes=1 << 20,
        slices=lambda key, t: 2 if key == "x" else 0,
    )
    x, y = meta.items
    assert isinstance(x, TensorMeta) and x.slices == 2 and x.inline is None
    assert isinstance(y, TensorMeta) and y.slices == 0 and y.inline is not None
    assert len(separate) == 1


def test_refusals_name_the_key() -> None:
    with pytest.raises(GroupcoordTypeError, match="keys must be str"):
        describe({1: torch.ones(1)}, 0)  # type: ignore[dict-item]
    with pytest.raises(GroupcoordTypeError, match=r"tensor_dict\['fn'\]"):
        describe({"fn": object()}, 0)
    with pytest.raises(GroupcoordTypeError, match="must be a dict"):
        describe([("a", 1)], 0)  # type: ignore[arg-type]


def test_bad_bytes_raise_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode_meta(b"\x93garbage")
    lopsided = encode_meta(TensorDictMeta(["a", "b"], [ValueMeta(b"\xc0")]))
    with pytest.raises(ProtocolError, match="2 keys but 1 items"):
        decode_meta(lopsided)
    unknown = encode_meta(TensorDictMeta(["a"], [TensorMeta("float99", (1,), "cpu", b"")]))
    with pytest.raises(ProtocolError, match="unknown dtype 'float99'"):
        rebuild(decode_meta(unknown), lambda item: torch.empty(0))
