"""The training script's repeated windows (tools.train_tiny.repeat_window)
and copy metric inputs: shapes, and that the repeat is really there."""

from __future__ import annotations

import numpy as np
import pytest

from tools.train_tiny import copy_windows, repeat_window


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


def test_loop_mask_marks_every_token_of_a_repeated_ngram_and_nothing_else():
    from tools.train_tiny import loop_mask

    cont = np.array([[5, 6, 7, 8, 9, 5, 6, 7, 8, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    m = loop_mask(cont, 4)
    # row 0: "5 6 7 8" comes back at positions 5..8; position 9 (1) is new
    assert m[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 0]
    assert not m[1].any()  # no repeat, no penalty
    # a loop of one token: everything from the second full n-gram on
    assert loop_mask(np.array([[3] * 6]), 2)[0].tolist() == [0, 1, 1, 1, 1, 1]


def test_unlikelihood_loss_is_minus_log_one_minus_p_on_the_marked_tokens():
    import mlx.core as mx

    from tools.train_tiny import unlikelihood_loss

    logits = mx.log(mx.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))
    targets = mx.array([[0, 1]])
    mask = mx.array([[1.0, 0.0]])
    got = unlikelihood_loss(logits, targets, mask).item()
    assert got == pytest.approx(-np.log(1 - 0.5) / 2, rel=1e-5)  # averaged over both positions
    both = unlikelihood_loss(logits, targets, mx.ones((1, 2))).item()
    assert both == pytest.approx((-np.log(0.5) - np.log(0.2)) / 2, rel=1e-5)
