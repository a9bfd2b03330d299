"""The two kinds of message an actor accepts, named apart.

``Wire``: data only — ints, strings, lists, other structs of data. A wire
message can be encoded, recorded and replayed, and a test proves it for every
one (tests/actors/test_messages.py builds each from its type annotations and
round-trips it through msgpack and JSON; a field typed ``Any``, a callable or
a live object fails that test).

``Handoff``: a local hand-off between two actors of one engine, in one
process: it carries a live object (an MLX cache, a callable) or is an ask
whose answer is one (a cache, a stream). A hand-off is never encoded: every
one holds a marker msgspec cannot encode, so ``msgspec.msgpack.encode`` of a
hand-off raises ``TypeError`` instead of producing bytes that look like a
message — even when its live fields happen to be ``None``.

Both are frozen, keyword-only msgspec structs; an actor's ``Inbox`` union may
mix them (each message class subclasses exactly one of the two). A subclass
repeats ``frozen=True`` (``class Admit(Wire, frozen=True)``): msgspec inherits
the setting at run time, but mypy's dataclass model does not see that.
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = ["Wire", "Handoff"]


class Wire(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A message of data only: encodable, recordable, replayable (tagged with
    its class name, so a module's messages decode from one union)."""


class _LocalOnly:
    """The marker every hand-off holds: not a type msgspec can encode."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LOCAL_ONLY"


LOCAL_ONLY: Final = _LocalOnly()


class Handoff(msgspec.Struct, frozen=True, kw_only=True, repr_omit_defaults=True):
    """A local hand-off carrying (or answered with) a live object; encoding one
    raises ``TypeError`` (the ``_local_only`` marker)."""

    _local_only: _LocalOnly = LOCAL_ONLY
