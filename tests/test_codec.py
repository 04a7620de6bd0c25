"""The msgspec codec: exact round trips, zero-copy frames, refusals."""

from __future__ import annotations

import collections
import datetime
import decimal
import json
import os
import pickle
import struct
import subprocess
import sys
import uuid
import warnings

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shm_broadcast import framing as wire
from shm_broadcast.codec import Codec, dumps, loads, message_bytes, read_message, write_message
from shm_broadcast.errors import GroupcoordTypeError, ProtocolError


class Point(msgspec.Struct):
    x: int
    y: float
    tag: tuple = ()


class Meta(msgspec.Struct, kw_only=True):
    name: str
    tensor: object = None
    inner: Point | None = None


def _same(a, b):
    """Exact equality that also compares types (tuple vs list, tensor bits)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, msgspec.Struct):
        for f in a.__struct_fields__:
            _same(getattr(a, f), getattr(b, f))
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


# Any str Python holds, lone surrogates included (JSON's "\ud800" decodes to one).
any_text = st.text(st.characters(exclude_categories=()), max_size=20)
big_ints = st.integers(min_value=-(2**100), max_value=2**100)

plain = st.recursive(
    st.none()
    | st.booleans()
    | big_ints
    | st.floats(allow_nan=True)
    | any_text
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=5)
        | st.lists(children, max_size=5).map(tuple)
        | st.dictionaries(any_text | st.integers(-5, 5) | big_ints, children, max_size=5)
        | st.dictionaries(st.tuples(st.integers(0, 3), st.text(max_size=3)), children, max_size=3)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(plain)
def test_plain_data_round_trips_exactly(obj):
    _same(obj, loads(dumps(obj)))


def test_strings_with_lone_surrogates_and_big_int_keys_round_trip():
    # msgpack's str is UTF-8, which cannot hold a lone surrogate: encoding a prompt
    # that JSON decoded from "\ud800" raised UnicodeEncodeError, and a dict keyed by
    # an int beyond 64 bits raised TypeError (unhashable type), where pickle sends both.
    prompt = json.loads('"a\\ud800b"')
    for obj in (
        prompt,
        {prompt: [prompt, 1], "k": (prompt,), "s": {prompt}},
        {"a": 1, 2**70: prompt, -(2**65): 2},
        {(prompt, 2**70): 2},
    ):
        out = loads(dumps(obj))
        assert out == obj and repr(out) == repr(obj)
    with pytest.raises(ProtocolError, match="UnicodeDecodeError"):  # crafted bytes
        Codec().decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(wire.EXT_SURROGATE_STR, b"\xff")))


def test_tuples_stay_tuples_and_lists_stay_lists():
    obj = {"t": (1, (2, [3, (4,)])), "l": [(), []]}
    out = loads(dumps(obj))
    assert out == obj
    assert type(out["t"]) is tuple and type(out["t"][1]) is tuple
    assert type(out["t"][1][1]) is list and type(out["t"][1][1][1]) is tuple
    assert type(out["l"][0]) is tuple and type(out["l"][1]) is list


def test_lists_of_lists_are_scanned_all_the_way_down():
    # Lists of lists of scalars (token ids per request) skip the rewrite; one
    # tuple, set or tensor anywhere below still comes back as itself.
    for obj in (
        [[1, 2], [3, "a"], []],
        [[1, 2], [3, (4, 5)]],
        [[1], [[2, (3,)]]],
        [[1, {2}], [3]],
        [[torch.arange(3)], [1]],
    ):
        out = loads(dumps(obj))
        _same(out, obj)
    assert type(loads(dumps([[1, 2], [3, (4, 5)]]))[1][1]) is tuple


ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.bool,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_tensor_every_dtype_and_layout(dtype):
    base = (torch.randn(5, 6, 4) * 7).to(dtype)
    views = [
        base,
        base.transpose(0, 2),
        base[:, ::2, 1:],
        base[0, 0, 0],
        base[:0],
        base.expand(2, 5, 6, 4),
    ]
    for view in views:
        out = loads(dumps({"x": view}))["x"]
        _same(out, view)
        assert out.is_contiguous()


def test_every_torch_dtype_has_a_wire_code():
    """The wire table spells real dtypes, and holds every dtype torch can send as bytes."""
    from shm_broadcast.array_frames import WIRE_DTYPES

    assert len(set(WIRE_DTYPES)) == len(WIRE_DTYPES)
    names = {str(v)[6:] for v in vars(torch).values() if isinstance(v, torch.dtype)}
    quantized = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
    assert names - quantized <= set(WIRE_DTYPES)
    assert set(WIRE_DTYPES) <= names  # this torch knows every name in the table
    for name in ("float8_e5m2fnuz", "uint3", "complex32", "bits16"):  # beyond ALL_DTYPES
        t = torch.arange(8, dtype=torch.uint8).view(getattr(torch, name))
        out = loads(dumps(t))
        assert out.dtype == t.dtype and out.shape == t.shape
        assert bytes(out.view(torch.uint8).numpy()) == bytes(range(8))


def test_write_message_refuses_a_destination_too_small():
    msg = Codec().encode([torch.arange(100, dtype=torch.int64)])
    dest = memoryview(bytearray(msg.nbytes + 8))
    with pytest.raises(ValueError, match="does not fit"):
        write_message(msg, dest, 16)
    assert write_message(msg, dest, 8) == msg.nbytes
    _same(read_message(Codec(), dest, 8)[0], torch.arange(100, dtype=torch.int64))


def test_tensor_scalar_and_empty_shapes():
    for t in [torch.tensor(3.5), torch.empty(0, 3), torch.zeros(2, 0, 5, dtype=torch.int64)]:
        _same(loads(dumps(t)), t)


def test_tensor_frames_are_zero_copy_views_of_the_source():
    t = torch.arange(1000, dtype=torch.float32)
    msg = Codec().encode({"a": t})
    (frame,) = msg.frames
    assert frame == t.data_ptr()  # the frame is t's own memory, not a copy
    t[0] = 42.0  # so a change before the write travels with the message
    assert loads(message_bytes(msg))["a"][0] == 42.0


def test_sub_byte_integer_tensors_travel_contiguous_and_are_refused_strided():
    """torch copies no int1-int7 / uint1-uint7 tensor element by element: a contiguous
    one travels as its bytes; a strided one is refused at encode, naming the dtype
    and what to do, instead of torch's NotImplementedError mid-write."""
    raw = torch.arange(24, dtype=torch.uint8)
    for name in ("int4", "uint1", "int7"):
        dtype = getattr(torch, name)
        t = raw.view(dtype).reshape(4, 6)
        got = loads(dumps({"t": t}))["t"]
        assert got.dtype == dtype and got.shape == (4, 6)
        assert torch.equal(got.view(torch.uint8), raw.view(4, 6))
        with pytest.raises(GroupcoordTypeError, match=f"non-contiguous torch.{name} tensor"):
            Codec().encode({"t": t.t()})


def test_decoded_tensors_survive_reuse_of_the_source_buffer():
    buf = bytearray(1 << 16)
    view = memoryview(buf)
    t = torch.arange(100, dtype=torch.int32).reshape(10, 10).t()  # non-contiguous: strided write
    msg = Codec().encode([t, b"y" * 40000, np.arange(7.0)])
    n = write_message(msg, view)
    assert n == msg.nbytes
    out = read_message(Codec(), view)
    buf[:] = bytes(len(buf))  # reuse the "chunk"
    _same(out[0], t)
    assert out[1] == b"y" * 40000
    _same(out[2], np.arange(7.0))


def test_small_tensors_of_one_message_share_one_copy_but_never_overlap():
    buf = bytearray(1 << 16)
    view = memoryview(buf)
    sent = [torch.arange(i * 10, i * 10 + 5, dtype=torch.int64) for i in range(4)]
    write_message(Codec().encode(sent), view)
    out = read_message(Codec(), view)
    buf[:] = bytes(len(buf))  # reuse the "chunk"
    for got, want in zip(out, sent):
        _same(got, want)
    out[0].fill_(-1)  # writing one decoded tensor leaves the others alone
    for got, want in zip(out[1:], sent[1:]):
        _same(got, want)


def test_frames_are_aligned_for_every_dtype():
    buf = bytearray(1 << 14)
    msg = Codec().encode([torch.ones(3, dtype=torch.complex128), torch.ones(5, dtype=torch.int8)])
    write_message(msg, memoryview(buf))
    out = read_message(Codec(), memoryview(buf))
    _same(out[0], torch.ones(3, dtype=torch.complex128))


def test_numpy_arrays_and_scalars():
    structured = np.zeros(3, dtype=[("x", "<f4"), ("y", "<i8", (2,))])
    structured["x"] = [1, 2, 3]
    values = [
        np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],
        structured,
        np.array("abc"),
        np.float32(2.5),
        np.int64(-7),
        np.zeros((0, 4)),
    ]
    out = loads(dumps(values))
    for a, b in zip(values, out):
        if isinstance(a, np.ndarray):
            _same(b, a)
        else:
            assert type(a) is type(b) and a == b


def test_structs_round_trip_with_nested_tensors_and_tuples():
    obj = Meta(
        name="m", tensor=torch.ones(2, 2, dtype=torch.bfloat16), inner=Point(1, 2.0, ("a", 1))
    )
    out = loads(dumps(obj))
    assert type(out) is Meta and type(out.inner) is Point
    _same(out, obj)
    assert out.inner.tag == ("a", 1)


def test_torch_dtype_device_size_values():
    obj = {"dtype": torch.bfloat16, "device": torch.device("cpu"), "shape": torch.Size([2, 3])}
    out = loads(dumps(obj))
    assert out == obj
    assert type(out["shape"]) is torch.Size


@pytest.mark.parametrize(
    "bad",
    [
        collections.defaultdict(list),
        object(),
        collections.Counter("ab"),
        memoryview(b"x"),
        [1, {"k": collections.ChainMap()}],
    ],
    ids=["defaultdict", "object", "counter", "memoryview", "nested-chainmap"],
)
def test_unknown_types_are_refused_naming_the_type(bad):
    with pytest.raises(TypeError) as info:
        dumps(bad)
    assert isinstance(info.value, GroupcoordTypeError)
    inner = bad[1]["k"] if isinstance(bad, list) else bad
    assert type(inner).__qualname__ in str(info.value)
    assert "allow_pickle" in str(info.value)


STD_VALUES = [
    slice(1, None, 2),
    slice("a", (1, 2)),
    range(0, 2**70, 3),
    complex(float("inf"), -0.0),
    bytearray(b"ab"),
    bytearray(100_000),
    datetime.datetime(2020, 1, 2, 3, 4, 5, 6),
    datetime.datetime(2021, 11, 7, 1, 30, fold=1),
    datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc),
    datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone(-datetime.timedelta(hours=5), "EST")),
    datetime.date(1999, 12, 31),
    datetime.time(23, 59, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
    datetime.timedelta(days=-3, microseconds=5),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    decimal.Decimal("-0.00"),
    decimal.Decimal("sNaN"),
    collections.OrderedDict([((1, 2), "a"), ("b", torch.ones(2))]),
    collections.deque([1, "x", {3}], maxlen=5),
    {datetime.date(2020, 1, 1): [slice(None), uuid.UUID(int=7)]},
]


@pytest.mark.parametrize("value", STD_VALUES, ids=lambda v: type(v).__name__)
def test_standard_library_values_round_trip_as_their_own_type(value):
    # What pickle would carry for an engine: multimodal slices, arrival times, ids.
    out = loads(dumps(value))
    assert type(out) is type(value)
    assert repr(out) == repr(value)  # repr shows a zone's name, a deque's maxlen, -0
    if isinstance(value, datetime.datetime | datetime.time):
        assert out.fold == value.fold


def test_a_zone_that_is_not_a_fixed_offset_is_refused_by_name():
    import zoneinfo

    try:
        paris = zoneinfo.ZoneInfo("Europe/Paris")
    except zoneinfo.ZoneInfoNotFoundError:
        pytest.skip("no time-zone database here")
    with pytest.raises(GroupcoordTypeError, match="ZoneInfo"):
        dumps(datetime.datetime(2020, 1, 1, tzinfo=paris))


@pytest.mark.parametrize(
    "parts",
    [[3, 10**12], [8, 10**12], [9, 5], [99, 0], [0, [1, 2, 3, 4]], [4, [[2020, 13, 1], 0, None]]],
    ids=["bytearray-of-an-int", "uuid-of-an-int", "decimal-of-an-int", "tag", "slice", "month"],
)
def test_crafted_standard_library_values_raise_protocol_error(parts):
    # An int where bytes belong must not become bytearray(10**12).

    codec = Codec()
    header = msgspec.msgpack.encode(
        msgspec.msgpack.Ext(wire.EXT_STD, msgspec.msgpack.encode(parts))
    )
    with pytest.raises(ProtocolError):
        codec.decode(header)


def test_codec_still_works_after_a_refusal():
    with pytest.raises(TypeError):
        dumps([1, collections.defaultdict(list)])
    assert loads(dumps([1, (2, 3)])) == [1, (2, 3)]


def test_allow_pickle_is_an_explicit_opt_in_on_both_sides():
    obj = {"s": collections.defaultdict(list, a=[1, 2, 3])}
    data = dumps(obj, allow_pickle=True)
    assert loads(data, allow_pickle=True) == obj
    with pytest.raises(ProtocolError, match="allow_pickle"):
        loads(data)


def test_no_pickle_on_the_wire_for_supported_types():
    data = dumps({"a": [1, 2.0, "x", (1,), torch.ones(2)], "b": Point(1, 2.0)})
    assert b"\x80\x04" not in data and b"\x80\x05" not in data
    assert pickle.PickleError  # the module is only used with allow_pickle=True


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x01\x00",
        b"\x05\x00\x00\x00\x00\x00\x00\x00\xc1",
        b"\x01\x00\x00\x00\x05\x00\x00\x00\x00",
    ],
)
def test_malformed_input_raises_protocol_error(data):
    with pytest.raises(ProtocolError):
        loads(data)


def test_forged_frame_reference_is_rejected():
    good = dumps(torch.ones(4))
    codec = Codec()
    header = codec.encode(torch.ones(4)).header
    with pytest.raises(ProtocolError):
        codec.decode(header, [])  # the tensor's frame is missing
    assert loads(good).sum().item() == 4.0


@pytest.mark.parametrize(
    ("layout", "values", "frame", "said"),
    [
        ("<BIQ", (11, 0, 5), bytes(32), r"torch.int64\[5\] needs 40 bytes, got 32"),
        ("<BIQQ", (0, 0, 2, 3), bytes(20), r"torch.float32\[2, 3\] needs 24 bytes, got 20"),
        ("<BIQ", (250, 0, 1), bytes(8), "dtype code 250"),
        ("<BIQ", (11, 3, 1), bytes(8), "frame 3 of 1"),
        ("<BIQx", (11, 0, 1), bytes(8), "tensor header of 14 bytes"),
    ],
    ids=["1-D", "2-D", "dtype", "frame", "header"],
)
def test_crafted_tensor_headers_raise_protocol_error(layout, values, frame, said):
    # The 1-D header has a path of its own (no tuple of dims): both are checked alike.

    meta = struct.pack(layout, *values)
    header = msgspec.msgpack.encode(msgspec.msgpack.Ext(wire.EXT_TENSOR, meta))
    with pytest.raises(ProtocolError, match=said):
        Codec().decode(header, [memoryview(frame)], owned=True)


def test_unimported_struct_module_is_not_imported_by_decode():
    enc = msgspec.msgpack.Encoder()
    payload = enc.encode(["os_not_imported_mod", "Evil", []])
    header = enc.encode(msgspec.msgpack.Ext(2, payload))
    with pytest.raises(ProtocolError, match="not imported"):
        Codec().decode(header)
    assert "os_not_imported_mod" not in sys.modules


def test_importing_the_codec_does_not_import_torch():
    code = (
        "import sys; from shm_broadcast.codec import dumps, loads; "
        "assert loads(dumps({'a': (1, 2)})) == {'a': (1, 2)}; "
        "assert 'torch' not in sys.modules, 'torch was imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_decoded_arrays_and_tensors_are_writable_and_own_their_memory():
    arr, ten = loads(dumps([np.arange(6.0).reshape(2, 3), torch.arange(6).reshape(2, 3)]))
    arr[0, 0] = 42.0
    ten[0, 0] = 42
    assert arr[0, 0] == 42.0 and ten[0, 0].item() == 42


def test_tensors_in_every_container_keep_their_own_frames():
    # The walk leaves tensors to the encoder's callback, which numbers frames in
    # the order msgpack meets them: nested in tuples, sets' neighbours, pairs, Structs.
    ts = [torch.full((i + 1,), float(i)) for i in range(7)]
    obj = {
        "t": (ts[0], [ts[1], (ts[2],)]),
        (1, "k"): ts[3],
        "s": Point(1, 2.0, (ts[4],)),
        "m": Meta(name="m", tensor=ts[5], inner=Point(2, 3.0, (ts[6], 2**70))),
        "set": {1, 2},
    }
    _same(loads(dumps(obj)), obj)


class _Tagged(torch.Tensor):
    """A subclass that keeps torch's ops as they are: its memory holds its values."""


def test_tensor_subclasses_and_autograd_tensors_travel_as_plain_tensors():
    param = torch.nn.Parameter(torch.arange(4.0))
    grad = torch.arange(3.0, requires_grad=True) * 2
    tagged = torch.arange(2.0).as_subclass(_Tagged)
    back = loads(dumps([param, grad, param, tagged]))
    assert [type(t) for t in back] == [torch.Tensor] * 4
    assert back[0].tolist() == [0.0, 1.0, 2.0, 3.0] and back[1].tolist() == [0.0, 2.0, 4.0]
    assert back[3].tolist() == [0.0, 1.0]
    assert not any(t.requires_grad for t in back)


def test_a_subclass_that_runs_torch_ops_in_python_is_refused_or_pickled():
    # A wrapper subclass (DTensor, a quantized weight, torch's TwoTensor) has no
    # memory of its own: data_ptr() is 0, and encoding it crashed the process.
    from torch.testing._internal.two_tensor import TwoTensor

    two = TwoTensor(torch.arange(3.0), torch.arange(3.0) * 2)
    assert two.data_ptr() == 0
    with pytest.raises(GroupcoordTypeError, match=r"TwoTensor.*__torch_dispatch__.*to_local"):
        dumps({"x": two})
    back = loads(dumps({"x": two}, allow_pickle=True), allow_pickle=True)["x"]
    assert type(back) is TwoTensor and back.b.tolist() == [0.0, 2.0, 4.0]


def test_meta_and_nested_tensors_are_refused_by_name():
    with pytest.raises(GroupcoordTypeError, match="meta tensor: it has no data"):
        dumps([torch.empty(3, device="meta")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested API's "prototype stage" warning
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(GroupcoordTypeError, match="nested tensor.*unbind"):
        dumps({"n": nested})


def test_conjugate_and_negative_views_are_resolved_before_sending():
    z = torch.tensor([1 + 2j, 3 - 4j])
    conj, imag_of_conj = z.conj(), z.conj().imag
    assert conj.is_conj() and imag_of_conj.is_neg()
    back = loads(dumps([conj, imag_of_conj]))
    assert back[0].tolist() == [1 - 2j, 3 + 4j] and back[1].tolist() == [-2.0, 4.0]


@pytest.mark.parametrize(
    "bad, words",
    [
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.ones(2, 2).to_sparse(), "layout"),
        (lambda: np.array([object()], dtype=object), "object"),
    ],
    ids=["quantized", "sparse", "numpy-object"],
)
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_tensors_that_are_not_plain_bytes_are_refused(bad, words):
    bad = bad()
    codec = Codec()
    for _ in range(2):  # the class is remembered; the refusal is not
        with pytest.raises(GroupcoordTypeError, match=words):
            codec.encode({"x": [bad]})
    assert loads(dumps([torch.ones(1)]))[0].item() == 1.0


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="this kernel has no transparent huge pages",
)
def test_large_decoded_tensors_land_on_memory_advised_for_huge_pages():
    # A fresh 64 MiB block faulted in 4 KiB pages costs ~3x the copy itself.
    from shm_broadcast.host_memory import empty_output

    big = torch.arange(2 << 20, dtype=torch.float32)  # 8 MiB
    back = loads(dumps(big))
    assert torch.equal(back, big)
    assert "hg" in _vma_flags(back.data_ptr() + (4 << 20))
    buffer = empty_output((8 << 20,), torch.uint8)
    assert "hg" in _vma_flags(buffer.data_ptr() + (4 << 20))
