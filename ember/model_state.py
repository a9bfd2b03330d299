"""A served model's lifecycle: an enum plus a transition table (h11's ``_state.py``).

    available --load--> loading --opened--> loaded --stop--> unloading
        ^                  |                                     |
        +------closed------+---------------closed----------------+

``closed`` is the one way back, whether the engine failed to open, was
unloaded, or died: ``Registry._hold``'s ``finally``. Any other pair raises
``IllegalTransition``: a registry that tried it has a bug, and saying so beats
a model stuck in a state nothing leaves. The states are strings, so a card's
``"state"`` and a comparison with ``"loaded"`` read as before.
"""

from __future__ import annotations

from enum import StrEnum


class ModelState(StrEnum):
    AVAILABLE = "available"  # known, not in memory (a failed load comes back here with its error)
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"  # draining its requests and flushing before it closes


class ModelEvent(StrEnum):
    LOAD = "load"  # a request (or an admin) asked for it
    OPENED = "opened"  # its engine opened
    STOP = "stop"  # unload: keep-alive ran out, memory was needed, an admin asked, shutdown
    CLOSED = "closed"  # its engine closed or never opened


TRANSITIONS: dict[tuple[ModelState, ModelEvent], ModelState] = {
    (ModelState.AVAILABLE, ModelEvent.LOAD): ModelState.LOADING,
    (ModelState.LOADING, ModelEvent.OPENED): ModelState.LOADED,
    (ModelState.LOADING, ModelEvent.CLOSED): ModelState.AVAILABLE,
    (ModelState.LOADED, ModelEvent.STOP): ModelState.UNLOADING,
    (ModelState.LOADED, ModelEvent.CLOSED): ModelState.AVAILABLE,
    (ModelState.UNLOADING, ModelEvent.CLOSED): ModelState.AVAILABLE,
}


class IllegalTransition(RuntimeError):
    """A model was told something its state cannot follow."""


def next_state(state: ModelState, event: ModelEvent) -> ModelState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"a model in state {state.value!r} cannot take {event.value!r}") from None
