"""Objects engines send, without pickle: dataclasses (frozen, slots, nested, with
defaults), enums, sets, NamedTuples and msgspec Structs, with tensors inside; a
class is rebuilt only if the receiver declared it with add_safe_types."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import msgspec
import pytest
import torch

from shm_broadcast import add_safe_types, dumps, loads
from shm_broadcast.errors import GroupcoordTypeError


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Priority(enum.IntEnum):
    LOW = 0
    HIGH = 5


class Flags(enum.Flag):
    A = 1
    B = 2


class Span(NamedTuple):
    start: int
    stop: int


class Meta(msgspec.Struct):
    name: str
    ids: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    req_id: str
    prompt: list[int]
    phase: Phase = Phase.PREFILL
    span: Span = Span(0, 0)


@dataclasses.dataclass
class SchedulerOutput:
    step: int
    requests: list[Request]
    finished: set[str]
    done: frozenset[int]
    priority: Priority
    flags: Flags
    meta: Meta
    block_table: torch.Tensor
    extra: dict[str, object] = dataclasses.field(default_factory=dict)
    computed: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self.computed = len(self.requests)


def sample() -> SchedulerOutput:
    return SchedulerOutput(
        step=7,
        requests=[Request("a", [1, 2, 3]), Request("b", [4], Phase.DECODE, Span(2, 9))],
        finished={"x", "y"},
        done=frozenset({1, 2}),
        priority=Priority.HIGH,
        flags=Flags.A | Flags.B,
        meta=Meta("m", [1]),
        block_table=torch.arange(12, dtype=torch.int32).reshape(3, 4),
        extra={"spec": (1, 2)},
    )


SAFE = [SchedulerOutput, Request, Phase, Priority, Flags, Span]


def test_an_engine_step_round_trips_once_its_classes_are_declared():
    add_safe_types(SAFE)
    out = loads(dumps(sample()))
    want = sample()
    assert torch.equal(out.block_table, want.block_table)
    out.block_table = want.block_table = None
    assert out == want
    assert out.computed == 2
    assert isinstance(out.requests[1].span, Span) and out.flags == Flags.A | Flags.B


@dataclasses.dataclass
class Progress:
    ids: list[int]
    computed: int = dataclasses.field(init=False, default=0)  # the scheduler advances it


@dataclasses.dataclass
class Scaled:
    base: int
    scale: dataclasses.InitVar[int] = 1
    value: int = dataclasses.field(init=False)

    def __post_init__(self, scale: int) -> None:
        self.value = self.base * scale
        self._memo: dict[int, int] = {}  # not a field: only the constructor makes it


@dataclasses.dataclass(frozen=True, slots=True)
class Shifted:
    start: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", self.start + 1)  # not idempotent


@dataclasses.dataclass
class NeedsScale:
    base: int
    scale: dataclasses.InitVar[int]


def test_dataclasses_arrive_with_the_senders_field_values():
    # Rebuilt by the constructor alone, each of these arrived different, silently:
    # computed 0, value 2 (the InitVar's default), start 3.
    add_safe_types([Progress, Scaled, Shifted])
    progress = Progress([1, 2])
    progress.computed = 7
    out = loads(dumps([progress, Scaled(2, scale=5), Shifted(1)]))
    assert out == [progress, Scaled(2, scale=5), Shifted(1)]
    assert [out[0].computed, out[1].value, out[2].start] == [7, 10, 2]
    assert out[1]._memo == {}  # the constructor ran


@dataclasses.dataclass
class Plain:  # what an engine's step looks like: its dict is set without the constructor
    ids: list[int]
    n: int = 0


@dataclasses.dataclass(frozen=True)
class FrozenPlain:
    name: str


_CONSTRUCTED: list[str] = []


@dataclasses.dataclass
class Watched:  # assignments are observed: the constructor must run
    n: int

    def __setattr__(self, name: str, value: object) -> None:
        _CONSTRUCTED.append(f"Watched.{name}")
        object.__setattr__(self, name, value)


class _Counted:
    def __new__(cls, *args: object, **kwargs: object) -> _Counted:
        _CONSTRUCTED.append(cls.__name__)
        return super().__new__(cls)


@dataclasses.dataclass
class OwnNew(_Counted):
    n: int


class _Scaling:
    """A descriptor-typed field that stores ``factor`` times what it is given (1: a
    descriptor that stores values as they are, as a validating one does)."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: object, owner: type | None = None) -> object:
        return 1 if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: object, value: int) -> None:
        setattr(obj, self.slot, self.factor * value)


@dataclasses.dataclass
class Described:
    n: _Scaling = _Scaling(1)


@dataclasses.dataclass
class Doubling:
    n: _Scaling = _Scaling(2)


def test_a_dataclass_is_rebuilt_without_its_constructor_only_where_that_is_the_same():
    from shm_broadcast.safe_types import DataclassPlan

    add_safe_types([Plain, FrozenPlain, Watched, OwnNew, Described])
    assert [DataclassPlan(c).direct for c in (Plain, FrozenPlain, Request, Watched)] == [
        True,
        True,
        False,  # slots: no __dict__
        False,
    ]
    # A descriptor on a field (which a sender refuses) keeps a crafted message's
    # values going through the constructor too.
    assert [DataclassPlan(c).direct for c in (OwnNew, Described, Progress)] == [False] * 3
    sent = [Plain([1, 2], 3), FrozenPlain("a"), Watched(4), OwnNew(5)]
    _CONSTRUCTED.clear()
    out = loads(dumps(sent))
    assert out == sent and [type(x) for x in out] == [type(x) for x in sent]
    # The constructor ran for the two whose constructors do more than store.
    assert _CONSTRUCTED == ["Watched.n", "OwnNew"]
    assert vars(out[0]) == {"ids": [1, 2], "n": 3} and out[2].n == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        out[1].name = "b"  # type: ignore[misc]


def test_a_crafted_message_for_a_directly_rebuilt_dataclass_goes_through_its_constructor():
    from shm_broadcast import framing as wire
    from shm_broadcast.codec import Codec
    from shm_broadcast.errors import ProtocolError
    from shm_broadcast.safe_types import type_key

    add_safe_types([Plain])

    def decode(values: object) -> object:
        body = msgspec.msgpack.encode([type_key(Plain), values])
        return Codec().decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(wire.EXT_DATACLASS, body)))

    # Fields in another order or some missing: the constructor takes them (defaults too).
    assert decode({"n": 1, "ids": [2]}) == Plain([2], 1)
    assert decode({"ids": [2]}) == Plain([2], 0)
    # An unknown field, or no dict at all: refused, as before.
    for values in ({"ids": [1], "n": 1, "__class__": "int"}, ["ids", "n"], {}):
        with pytest.raises(ProtocolError):
            decode(values)


@dataclasses.dataclass
class Lazy:
    name: str
    cached: int = dataclasses.field(init=False)  # set on first use, if ever


def test_an_init_false_field_never_set_travels_unset():
    add_safe_types([Lazy])
    unset, used = Lazy("a"), Lazy("b")
    used.cached = 3
    out = loads(dumps([unset, used]))
    assert not hasattr(out[0], "cached") and out[1].cached == 3


@dataclasses.dataclass
class WithProperty:
    n: int

    @property
    def half(self) -> float:  # a property that is not a field is no concern
        return self.n / 2


def test_a_dataclass_that_cannot_travel_by_its_fields_is_refused_when_sent_or_pickled():
    # The constructor needs an argument that is not a field: a receiver cannot call it.
    with pytest.raises(GroupcoordTypeError, match=r"NeedsScale.*\['scale'\].*allow_pickle"):
        dumps({"x": NeedsScale(1, 2)})
    # A descriptor serves a field: Doubling(3) reads 6, and a receiver's constructor
    # storing 6 kept 12 (arrived as Doubling(n=12), silently), as did an identity
    # descriptor's class, which cannot be told apart from it.
    add_safe_types([NeedsScale, Doubling, Described, WithProperty])
    for sent in (Doubling(3), Described(6)):
        with pytest.raises(GroupcoordTypeError, match=rf"{type(sent).__name__}.*\['n'\]"):
            dumps([sent])
        # Both sides allowing pickle (what the message says to do) sends it as pickle.
        out = loads(dumps([sent], allow_pickle=True), allow_pickle=True)
        assert out == [sent] and vars(out[0]) == vars(sent)
    assert loads(dumps(WithProperty(3))).half == 1.5
    scaled = loads(dumps(NeedsScale(1, 2), allow_pickle=True), allow_pickle=True)
    assert type(scaled) is NeedsScale and scaled.base == 1


def test_a_crafted_dataclass_message_sets_only_declared_fields():
    from shm_broadcast import framing as wire
    from shm_broadcast.codec import Codec
    from shm_broadcast.errors import ProtocolError
    from shm_broadcast.safe_types import type_key

    add_safe_types([Progress])
    for values in ({"ids": [1], "computed": 1, "__class__": "int"}, {"computed": 1}):
        body = msgspec.msgpack.encode([type_key(Progress), values])
        header = msgspec.msgpack.encode(msgspec.msgpack.Ext(wire.EXT_DATACLASS, body))
        with pytest.raises(ProtocolError, match="__class__|ids"):
            Codec().decode(header)


def test_an_enum_or_bool_among_many_plain_ints_keeps_its_type():
    # Long lists of one plain type skip the rewrite after one type count; an
    # int-like value of another type (IntEnum, bool) anywhere must still be seen.
    add_safe_types(SAFE)
    ids = list(range(100))
    for obj in (
        ids[:50] + [Priority.HIGH] + ids[50:],
        ids + [True],
        [ids, ids[:10] + [Priority.LOW]],
        [ids, [], [Priority.HIGH]],
    ):
        out = loads(dumps(obj))
        assert out == obj
        flat = out if type(out[0]) is int else [x for inner in out for x in inner]
        want = obj if type(obj[0]) is int else [x for inner in obj for x in inner]
        assert [type(x) for x in flat] == [type(x) for x in want]


def test_an_undeclared_class_is_refused_by_name_with_the_fix():
    @dataclasses.dataclass
    class Unknown:
        x: int

    with pytest.raises(GroupcoordTypeError, match=r"Unknown.*add_safe_types\(\[.*Unknown\]\)"):
        loads(dumps(Unknown(1)))


def test_sets_need_no_declaration_and_bad_declarations_are_refused():
    assert loads(dumps({"s": {1, 2}, "f": frozenset({"a"})})) == {
        "s": {1, 2},
        "f": frozenset({"a"}),
    }
    with pytest.raises(GroupcoordTypeError, match="not a dataclass, enum or NamedTuple"):
        add_safe_types([dict])


def _engine_objects(rank: int, world: int, port: int) -> dict:
    import os

    from coordinator.group_coordinator import GroupCoordinator
    from coordinator.launch import init_gloo
    from coordinator.stateless_group import StatelessProcessGroup

    add_safe_types(SAFE)  # each receiving process declares what it accepts
    init_gloo(rank, world)
    g = GroupCoordinator([[0, 1]], rank, "gloo", True, True, group_name="eng")
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world, timeout=30)
    try:
        mine = sample() if rank == 0 else None
        via_queue = g.broadcast_object(mine)
        if rank == 0:
            g.send_object(sample(), dst=1)
            g.broadcast_tensor_dict({"out": sample(), "phase": Phase.DECODE, "t": torch.ones(3)})
            via_store = pg.broadcast_obj(sample(), src=0)
            return {"pid": os.getpid()}
        got = g.recv_object(src=0)
        d = g.broadcast_tensor_dict(None)
        via_store = pg.broadcast_obj(None, src=0)
        checks = []
        for obj in (via_queue, got, d["out"], via_store):
            checks.append(
                type(obj) is SchedulerOutput
                and obj.requests == sample().requests
                and obj.finished == {"x", "y"}
                and torch.equal(obj.block_table, sample().block_table)
            )
        return {"checks": checks, "phase": d["phase"] is Phase.DECODE}
    finally:
        pg.barrier()
        g.destroy()


def test_broadcast_send_tensor_dict_and_store_carry_engine_objects():
    from coordinator.launch import free_port, run_ranks

    results = run_ranks(_engine_objects, 2, free_port(), timeout=60)
    assert results[1] == {"checks": [True] * 4, "phase": True}


class Stage(enum.Enum):  # declared by rank 0 only, and by no other test
    ONE = 1


def _one_rank_has_not_declared(rank: int, world: int, how: str) -> list[str]:
    from coordinator.group_coordinator import GroupCoordinator
    from coordinator.launch import init_gloo
    from shm_broadcast.config import set_config
    from shm_broadcast.errors import UndeclaredTypeError

    set_config(disable_shm_p2p=how == "p2p gloo", timeout_s=20.0)
    if rank == 0:
        add_safe_types([Stage])  # the other ranks have not
    init_gloo(rank, world)
    g = GroupCoordinator(
        [list(range(world))],
        rank,
        "gloo",
        how != "broadcast gloo",
        how == "broadcast queue",
        group_name="eng",
    )
    sent = [
        {"stage": Stage.ONE, "t": torch.full((100_000,), 1.0)},  # t travels on its own
        {"x": 2, "t": torch.full((100_000,), 2.0)},
        {"x": 3, "t": torch.full((100_000,), 3.0)},
    ]
    got = []
    for d in sent:
        try:
            if how.startswith("broadcast"):
                out = g.broadcast_tensor_dict(d if rank == 0 else None)
            elif rank == 0:
                g.send_tensor_dict(d, dst=1)
                out = d
            else:
                out = g.recv_tensor_dict(src=0)
        except UndeclaredTypeError:
            got.append("undeclared")
            continue
        assert out is not None
        right = out.keys() == d.keys() and torch.equal(out["t"], d["t"])
        got.append("right" if right and out.get("x") == d.get("x") else f"wrong: {out}")
    g.barrier()
    g.destroy()
    return got


@pytest.mark.parametrize(
    "how", ["broadcast shm", "broadcast gloo", "broadcast queue", "p2p shm", "p2p gloo"]
)
def test_a_rank_that_has_not_declared_a_class_raises_and_stays_in_step(how: str) -> None:
    # Until 2026-11-29 the dict's tensors stayed in flight when its message did not
    # decode: over Gloo the receiver's next call met them and Gloo aborted the
    # process (SIGABRT, "Received data size doesn't match expected size"); through
    # shared memory the receiver's next broadcast raised DesyncError and the one
    # after returned the dict before it (x=2 for x=3) with no error, as did every
    # later recv_tensor_dict. The queue took every tensor with the message already.
    from coordinator.launch import run_ranks

    results = run_ranks(_one_rank_has_not_declared, 2, how, timeout=60)
    assert results == [["right"] * 3, ["undeclared", "right", "right"]]
