"""The registry's model lifecycle table (ember.model_state): every legal pair
moves where the table says, every other pair raises."""

from __future__ import annotations

import itertools

import pytest

from ember.model_state import TRANSITIONS, IllegalTransition, ModelEvent, ModelState, next_state
from ember.registry import ModelEntry


def test_the_table_is_the_lifecycle():
    assert next_state(ModelState.AVAILABLE, ModelEvent.LOAD) is ModelState.LOADING
    assert next_state(ModelState.LOADING, ModelEvent.OPENED) is ModelState.LOADED
    assert next_state(ModelState.LOADED, ModelEvent.STOP) is ModelState.UNLOADING
    for s in (ModelState.LOADING, ModelState.LOADED, ModelState.UNLOADING):
        assert next_state(s, ModelEvent.CLOSED) is ModelState.AVAILABLE


@pytest.mark.parametrize(("state", "event"), list(itertools.product(ModelState, ModelEvent)))
def test_every_other_pair_raises(state, event):
    if (state, event) in TRANSITIONS:
        assert next_state(state, event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(IllegalTransition, match=state.value):
            next_state(state, event)


def test_an_entry_changes_state_only_by_the_table():
    e = ModelEntry(name="m", kind="chat", source="fake", target="m")
    assert e.state == "available" and e.card()["state"] == "available"  # still reads as a string
    e.fire(ModelEvent.LOAD)
    with pytest.raises(IllegalTransition):
        e.fire(ModelEvent.LOAD)  # a second load of a loading model is a registry bug
    e.fire(ModelEvent.OPENED)
    e.fire(ModelEvent.STOP)
    e.fire(ModelEvent.CLOSED)
    assert e.state is ModelState.AVAILABLE
