"""The training script's repeated windows (engine.models.train.repeat_window)
and copy metric inputs: shapes, and that the repeat is really there."""

from __future__ import annotations

import numpy as np
import pytest

from engine.models.train import copy_windows, repeat_window


@pytest.mark.parametrize("style", ["jump", "cycle"])
def test_repeat_window_keeps_the_length_and_repeats_earlier_text(style):
    rng = np.random.default_rng(0)
    window = np.arange(10_000, 10_513)  # all distinct: any repeat comes from the function
    for _ in range(200):
        out = repeat_window(window, rng, style)
        assert out.shape == window.shape
        assert set(out.tolist()) <= set(window.tolist())
        # some position holds a token seen earlier, and from there on at least
        # 32 tokens copy an earlier span
        seen = {}
        first = next(i for i, t in enumerate(out.tolist()) if seen.setdefault(t, i) != i)
        src = seen[out[first]]
        run = 0
        while first + run < len(out) and out[first + run] == out[src + run]:
            run += 1
        assert run >= 32


def test_jump_repeats_once():
    rng = np.random.default_rng(1)
    window = np.arange(513)
    for _ in range(200):
        counts = np.bincount(repeat_window(window, rng, "jump"))
        assert counts.max() <= 2


def test_copy_windows_are_an_excerpt_twice():
    tokens = np.arange(5000)
    w = copy_windows(tokens, 100, 8)
    assert w.shape == (8, 201)
    assert (w[:, :100] == w[:, 100:200]).all()
