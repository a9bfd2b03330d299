"""Every message an actor accepts round-trips through msgpack and JSON.

The message types are enumerated from each actor module's ``Inbox`` union, so
a new message is covered the moment it joins an inbox.
"""

from __future__ import annotations

import importlib
import pkgutil
import types
import typing

import msgspec
import msgspec.inspect as mi
import pytest

import actors


def _inbox_types() -> list[type]:
    found: dict[str, type] = {}
    for mod in pkgutil.iter_modules(actors.__path__):
        module = importlib.import_module(f"actors.{mod.name}")
        inbox = getattr(module, "Inbox", None) or getattr(module, "IdleBusy", None)
        if inbox is None:
            continue
        members = typing.get_args(inbox) if isinstance(inbox, types.UnionType) or typing.get_origin(inbox) else (inbox,)
        for t in members:
            if isinstance(t, type) and issubclass(t, msgspec.Struct):
                found[f"{t.__module__}.{t.__qualname__}"] = t
    return [found[k] for k in sorted(found)]


def _sample(t: mi.Type) -> object:
    match t:
        case mi.IntType():
            return 7
        case mi.FloatType():
            return 0.5
        case mi.StrType():
            return "héllo"
        case mi.BoolType():
            return True
        case mi.NoneType():
            return None
        case mi.BytesType():
            return b"\x00\xff"
        case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            item = _sample(t.item_type)
            return {mi.ListType: list, mi.VarTupleType: tuple, mi.SetType: set, mi.FrozenSetType: frozenset}[type(t)](
                [item]
            )
        case mi.TupleType():
            return tuple(_sample(x) for x in t.item_types)
        case mi.DictType():
            return {_sample(t.key_type): _sample(t.value_type)}
        case mi.UnionType():
            non_none = [x for x in t.types if not isinstance(x, mi.NoneType)]
            return _sample(non_none[0]) if non_none else None
        case mi.LiteralType():
            return t.values[0]
        case mi.StructType():
            return t.cls(**{f.name: _sample(f.type) for f in t.fields})
        case mi.AnyType():
            return [1, "a"]
    raise TypeError(f"no sample for {t!r}")


def build(cls: type) -> msgspec.Struct:
    return _sample(mi.type_info(cls))  # type: ignore[return-value]


MESSAGES = _inbox_types()


def test_inboxes_are_found():
    names = {c.__name__ for c in MESSAGES}
    assert {"Admit", "Abort", "Submit", "StepOutput", "EngineIdle", "EngineBusy"} <= names


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_round_trips(cls):
    msg = build(cls)
    for enc, dec in ((msgspec.msgpack.encode, msgspec.msgpack.decode), (msgspec.json.encode, msgspec.json.decode)):
        assert dec(enc(msg), type=cls) == msg
    # Tagged: a union of the module's messages decodes to the right type.
    assert cls.__struct_config__.tag is not None, f"{cls.__name__} must be a tagged struct"
    assert cls.__struct_config__.frozen, f"{cls.__name__} must be frozen"
