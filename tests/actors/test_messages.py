"""Every actor message is exactly one of two kinds (``actors.messages``).

* ``Wire``: data only. Each wire message is built from its own type
  annotations — values of the declared types drawn by a seeded generator,
  nested structs recursively, several seeds — and must round-trip through
  msgpack and JSON, alone and through its module's union of wire messages
  (so the tags are distinct). A field typed ``Any``, ``object``, a callable or
  any class msgspec cannot encode has no value to draw: the test fails, so a
  wire message cannot hold a live object.
* ``Handoff``: carries (or is answered with) a live object. Encoding one
  raises ``TypeError``, even when its live fields are ``None``.

And what actually travels: every message a running engine sends through an
``ActorRef`` is recorded, and each wire one must round-trip as it was sent.

The message types are enumerated from each actor module's ``Inbox`` union and
from every ``Wire``/``Handoff`` subclass the actors package defines (replies
such as ``DraftedRound`` included), so a new message is covered the moment it
exists.
"""

from __future__ import annotations

import enum
import importlib
import pkgutil
import random
import types
import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

import actors
from actors.messages import Handoff, Wire

SEEDS = range(5)


def _modules() -> list[types.ModuleType]:
    return [importlib.import_module(f"actors.{m.name}") for m in pkgutil.iter_modules(actors.__path__)]


def _union_members(union: Any) -> tuple[Any, ...]:
    if isinstance(union, types.UnionType) or typing.get_origin(union) is typing.Union:
        return typing.get_args(union)
    return (union,)


def _inboxes() -> dict[str, tuple[type, ...]]:
    """Module name -> the members of its ``Inbox`` union."""
    out = {}
    for module in _modules():
        inbox = getattr(module, "Inbox", None)
        if inbox is not None:
            out[module.__name__] = _union_members(inbox)
    return out


def _subclasses(base: type) -> set[type]:
    found, todo = set(), [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return {c for c in found if c.__module__.startswith("actors.")}


def _named(classes: typing.Iterable[type]) -> list[type]:
    return sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}")


INBOXES = _inboxes()
MEMBERS = _named({t for members in INBOXES.values() for t in members})
WIRE = _named(_subclasses(Wire) | {t for t in MEMBERS if isinstance(t, type) and issubclass(t, Wire)})
HANDOFF = _named(_subclasses(Handoff))


def _id(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------
# Values drawn from a type's annotations.


class NotData(TypeError):
    """A type with no data values: ``Any``, a callable, a live object's class."""


_CHARS = 'aZ09 _-é€中\n\t"\\/😀'


def _draw(t: mi.Type, rng: random.Random, path: str, *, live: Any = NotData) -> Any:
    """A value of type ``t`` (msgspec's view of an annotation), respecting its
    constraints. A type that is not data raises ``NotData``, unless ``live``
    is given: then that stands in for it (a hand-off's live fields)."""
    match t:
        case mi.NoneType():
            return None
        case mi.BoolType():
            return rng.random() < 0.5
        case mi.IntType():
            lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**40))
            hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**40)
            return rng.randint(lo, hi) // (t.multiple_of or 1) * (t.multiple_of or 1)
        case mi.FloatType():
            lo = t.ge if t.ge is not None else (t.gt if t.gt is not None else -1e6)
            hi = t.le if t.le is not None else (t.lt if t.lt is not None else 1e6)
            return rng.uniform(lo, hi)
        case mi.StrType():
            if t.pattern is not None:
                raise NotImplementedError(f"{path}: a str pattern needs a generator of its own")
            n = rng.randint(t.min_length or 0, min(t.max_length if t.max_length is not None else 8, 8))
            return "".join(rng.choice(_CHARS) for _ in range(max(n, t.min_length or 0)))
        case mi.BytesType() | mi.ByteArrayType():
            return bytes(rng.randrange(256) for _ in range(rng.randint(t.min_length or 0, 6)))
        case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            n = rng.randint(t.min_length or 0, min(t.max_length if t.max_length is not None else 3, 3))
            items = [_draw(t.item_type, rng, f"{path}[]", live=live) for _ in range(n)]
            kind = {mi.ListType: list, mi.VarTupleType: tuple, mi.SetType: set, mi.FrozenSetType: frozenset}
            return kind[type(t)](items)
        case mi.TupleType():
            return tuple(_draw(x, rng, f"{path}[{i}]", live=live) for i, x in enumerate(t.item_types))
        case mi.DictType():
            n = rng.randint(t.min_length or 0, 2)
            return {
                _draw(t.key_type, rng, f"{path}{{key}}", live=live): _draw(t.value_type, rng, f"{path}{{}}", live=live)
                for _ in range(n)
            }
        case mi.UnionType():
            return _draw(rng.choice(t.types), rng, path, live=live)
        case mi.LiteralType():
            return rng.choice(t.values)
        case mi.EnumType():
            return rng.choice(list(t.cls))
        case mi.StructType():
            kwargs = {}
            for f in t.fields:
                if f.name == "_local_only":
                    continue  # a hand-off's marker keeps its default
                kwargs[f.name] = _draw(f.type, rng, f"{path}.{f.name}", live=live)
            return t.cls(**kwargs)
    if live is not NotData:
        return live
    raise NotData(f"{path} is typed {t!r}: a wire message holds data only (pass a handle, or make it a Handoff)")


def build(cls: type, seed: int, *, live: Any = NotData) -> Any:
    return _draw(mi.type_info(cls), random.Random(f"{_id(cls)}/{seed}"), cls.__qualname__, live=live)


def _not_data(t: mi.Type, path: str) -> list[str]:
    """Every place in ``t`` whose type is not data (``Any``, a callable, a class)."""
    match t:
        case mi.AnyType() | mi.CustomType():
            return [f"{path}: {t!r}"]
        case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            return _not_data(t.item_type, f"{path}[]")
        case mi.TupleType():
            return [p for i, x in enumerate(t.item_types) for p in _not_data(x, f"{path}[{i}]")]
        case mi.DictType():
            return _not_data(t.key_type, f"{path}{{key}}") + _not_data(t.value_type, f"{path}{{}}")
        case mi.UnionType():
            return [p for x in t.types for p in _not_data(x, path)]
        case mi.StructType():
            return [p for f in t.fields for p in _not_data(f.type, f"{path}.{f.name}")]
    return []


# ---------------------------------------------------------------------------
# The kinds.


def test_the_message_sets_are_found():
    names = {c.__name__ for c in WIRE}
    assert {"Admit", "Abort", "StepOutput", "EngineIdle", "EngineBusy", "Completed", "Flush", "Restore"} <= names
    assert {"DraftedRound", "Verified"} <= names  # replies, in no inbox
    assert {"Restored", "Snapshot", "Store", "Spill", "SnapshotTaken", "Submit"} <= {c.__name__ for c in HANDOFF}


@pytest.mark.parametrize("cls", MEMBERS, ids=_id)
def test_every_inbox_message_is_exactly_one_kind(cls):
    assert isinstance(cls, type) and issubclass(cls, msgspec.Struct)
    assert issubclass(cls, Wire) != issubclass(cls, Handoff), f"{_id(cls)} must subclass exactly one of Wire, Handoff"


@pytest.mark.parametrize("cls", WIRE, ids=_id)
def test_a_wire_message_holds_data_only(cls):
    assert _not_data(mi.type_info(cls), cls.__qualname__) == []
    config = cls.__struct_config__
    assert config.frozen and config.tag == cls.__name__, f"{_id(cls)}: frozen and tagged with its name"


@pytest.mark.parametrize("cls", WIRE, ids=_id)
def test_a_wire_message_round_trips_from_its_annotations(cls):
    union_of = [m for m in INBOXES.get(cls.__module__, ()) if isinstance(m, type) and issubclass(m, Wire)]
    union = typing.Union[tuple(union_of)] if cls in union_of else cls  # noqa: UP007 - built at run time
    for seed in SEEDS:
        msg = build(cls, seed)
        for enc, dec in ((msgspec.msgpack.encode, msgspec.msgpack.decode), (msgspec.json.encode, msgspec.json.decode)):
            assert dec(enc(msg), type=cls) == msg
            assert dec(enc(msg), type=union) == msg  # the tag picks the right type in its module's union


@pytest.mark.parametrize("cls", HANDOFF, ids=_id)
def test_a_handoff_is_never_encoded(cls):
    msg = build(cls, 0, live=None)  # its live fields None: still a hand-off
    for enc in (msgspec.msgpack.encode, msgspec.json.encode):
        with pytest.raises(TypeError, match="unsupported"):
            enc(msg)


# ---------------------------------------------------------------------------
# The checks can fail.


class _Leaky(Wire):
    rid: int
    cache: Any = None


class _Hook(Wire):
    callback: typing.Callable[[], None] | None = None


class _Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class _Fine(Wire):
    color: _Color
    rows: list[int] = []
    note: str | None = None


def test_a_wire_message_with_a_live_field_fails_the_checks():
    for bad in (_Leaky, _Hook):
        assert _not_data(mi.type_info(bad), bad.__qualname__) != []
        with pytest.raises(NotData):
            build(bad, 0)
    assert _not_data(mi.type_info(_Fine), "_Fine") == []
    for seed in SEEDS:
        m = build(_Fine, seed)
        assert msgspec.json.decode(msgspec.json.encode(m), type=_Fine) == m
    # and a hand-off with nothing live in it still refuses to encode
    from actors.scheduler import Restored

    with pytest.raises(TypeError):
        msgspec.msgpack.encode(Restored(rid=1))


# ---------------------------------------------------------------------------
# What actually travels: a running engine's messages.


@pytest.mark.slow  # two engine lifetimes, ~3 s
@pytest.mark.anyio
async def test_every_wire_message_a_running_engine_sends_round_trips(tmp_path, monkeypatch):
    """The annotations say what a wire message may hold; this checks what the
    actors really put in them. Every message sent through an ``ActorRef`` by an
    engine (fake GPU, draft-model speculation, the SSD tier with write-behind,
    a flush, an abort, a restart that restores from SSD) is recorded; each
    wire message must encode and decode back equal to itself — a live object,
    or a value of another type than its field's (a numpy int in a
    ``list[int]``), fails here even where the annotation is right."""
    import anyio

    from actors.runtime import ActorRef
    from ember import Engine, EngineConfig, SamplingParams

    sent: list[Any] = []
    for name in ("tell_nowait", "tell", "ask"):
        original = getattr(ActorRef, name)

        def recording(self, msg, *args, _original=original, **kw):
            sent.append(msg)
            return _original(self, msg, *args, **kw)

        monkeypatch.setattr(ActorRef, name, recording)

    cfg = EngineConfig(
        backend="fake",
        max_batch=4,
        prefill_chunk=32,
        ssd_cache_dir=str(tmp_path),
        draft_model="fake-draft:0.8",
        num_draft_tokens=3,
    )
    prompt = list(b"a conversation worth keeping on disk " * 3)
    async with Engine.open(cfg) as engine:
        await engine.acomplete(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        with anyio.move_on_after(0.01):  # a caller that goes away: an Abort
            async for _ in engine.agenerate(list(b"abandoned " * 20), SamplingParams(max_tokens=500)):
                pass
        assert (await engine.aflush()).durable
    async with Engine.open(cfg) as engine:  # a restart: the prefix comes back from SSD
        await engine.acomplete(prompt + [7], SamplingParams(max_tokens=3, ignore_eos=True))

    kinds = {type(m).__name__ for m in sent}
    assert {"Admit", "StepOutput", "Completed", "Settle", "Flush", "Restore", "Restored", "EngineIdle"} <= kinds, kinds
    assert {"DraftRound", "Verify", "Abort"} <= kinds, kinds
    for msg in sent:
        assert isinstance(msg, Wire | Handoff), f"{type(msg).__qualname__} is neither Wire nor Handoff"
        if isinstance(msg, Wire):
            for enc, dec in (
                (msgspec.msgpack.encode, msgspec.msgpack.decode),
                (msgspec.json.encode, msgspec.json.decode),
            ):
                assert dec(enc(msg), type=type(msg)) == msg, msg
