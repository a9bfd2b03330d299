"""The divergence finder (engine.kv.cache_miss, ``PrefixIndex.closest``) on the
RAM tier directly: where a prompt left the closest cached sequence, and no
report when it merely extends one. The oracle is a brute-force pass over every
entry."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.cache_miss import closest_miss, divergence
from engine.kv.prompt_cache import PromptCache, common_prefix
from tests.engine.test_prompt_cache import BE, feed, frozen


def cache(*entries: list[int], ns: str = "") -> PromptCache:
    pc = PromptCache(BE, 1 << 30)
    for e in entries:
        pc.put(e, ns, feed(e))
    return pc


def miss_of(pc: PromptCache, prompt: list[int], ns: str = ""):
    tokens, n = pc.closest(prompt, ns)
    return divergence(prompt, tokens, n, "ram", window=4)


def test_edited_message_diverges_with_both_sides():
    turn = list(range(1, 41))
    edited = turn[:17] + [99, 98] + turn[19:] + [50, 51]
    m = miss_of(cache(turn), edited)
    assert m is not None
    assert (m.diverged_at, m.cached_tokens_available, m.tier) == (17, 40, "ram")
    assert m.window_start == 13
    assert m.prompt_window == [14, 15, 16, 17, 99, 98, 20, 21]
    assert m.cached_window == [14, 15, 16, 17, 18, 19, 20, 21]


def test_an_extension_or_a_shorter_prompt_is_no_miss():
    turn = list(range(1, 31))
    pc = cache(turn)
    assert miss_of(pc, turn + [7, 8, 9]) is None  # the next turn
    assert miss_of(pc, turn) is None  # the same prompt again
    assert miss_of(pc, turn[:12]) is None  # ends inside the cached sequence: served whole
    assert miss_of(pc, [500, 501]) is None  # shares nothing
    assert miss_of(pc, turn[:5] + [77], ns="other") is None  # another namespace holds nothing


def test_an_entry_the_prompt_extends_wins_a_tie():
    head = list(range(1, 11))
    pc = PromptCache(BE, 1 << 30)
    pc.put(head + [20, 21], "", feed(head + [20, 21]))  # a sibling that went on
    pc.put(head, "", feed(head))  # the prompt's own last turn (a later put keeps the longer sibling)
    assert len(pc) == 2
    assert miss_of(pc, head + [30]) is None
    m = miss_of(cache(head + [20, 21]), head + [30])  # without it: a miss where the sibling went on
    assert m is not None and m.diverged_at == 10


def test_rigid_entries_count():
    turn = list(range(1, 21))
    pc = PromptCache(BE, 1 << 30)
    pc.put(turn, "", frozen(turn))
    m = miss_of(pc, turn[:9] + [0])
    assert m is not None and (m.diverged_at, m.cached_tokens_available) == (9, 20)


def test_closest_tier_wins():
    prompt = list(range(1, 21))
    ram = np.array(prompt[:8] + [0, 0, 0], np.int64)  # diverges at 8
    ssd = np.array(prompt[:12], np.int64)  # the prompt extends it
    assert closest_miss(prompt, [("ram", ram, 8), ("ssd", ssd, 12)]) is None
    got = closest_miss(prompt, [("ram", ram, 8), ("ssd", None, 0)])
    assert got is not None and (got.tier, got.diverged_at) == ("ram", 8)


seqs = st.lists(st.integers(0, 3), min_size=1, max_size=9)


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(st.tuples(seqs, st.booleans()), min_size=0, max_size=8), prompt=seqs)
def test_closest_matches_brute_force(entries, prompt):
    pc = PromptCache(BE, 1 << 30)
    for toks, rigid in entries:
        pc.put(toks, "", frozen(toks) if rigid else feed(toks))
    held = [e.tokens for e in pc._entries.values()]
    p = np.array(prompt, np.int64)
    best = max((common_prefix(t, p) for t in held), default=0)
    tokens, n = pc.closest(prompt, "")
    assert n == best
    if best == 0:
        assert tokens is None
        return
    assert common_prefix(tokens, p) == best
    extends = any(common_prefix(t, p) == best == t.size for t in held)
    expect_miss = not extends and best < len(prompt)
    assert (divergence(prompt, tokens, n, "ram") is not None) == expect_miss
