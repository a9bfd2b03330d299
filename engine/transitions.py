"""The one error every state machine raises on a move its table forbids.

The Scheduler's row lifecycle, the durability record and the spill-queue item
are each an enum plus a transition table (h11's ``_state.py`` style); an
illegal (state, next state) pair is a bug, and all three raise this one
``IllegalTransition``. It lives in ``engine`` so the floor (``engine.kv``) and
the actors share it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from typing import TypeVar

__all__ = ["IllegalTransition", "check_transition"]


class IllegalTransition(RuntimeError):
    """A state machine was asked for a move its transition table does not allow."""


S = TypeVar("S", bound=enum.Enum)


def check_transition(table: Mapping[S, Set[S]], at: S, to: S, what: str) -> None:
    """Raise ``IllegalTransition`` unless ``table`` allows ``at -> to``; ``what``
    names the machine in the message (e.g. ``"row 7"``)."""
    if to not in table[at]:
        raise IllegalTransition(f"{what}: {at.value} -> {to.value}")
