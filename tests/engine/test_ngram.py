"""Prompt lookup (engine.speculation.ngram) and the n-gram Drafter core."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.drafter_cores import Draft, NgramDrafterCore
from engine.speculation.ngram import NgramIndex


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by scanning: longest n first, most recent earlier
    occurrence of the last n tokens, continued periodically."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n :]
        for j in range(L - 1, n - 1, -1):  # j = the position right after the occurrence
            if tokens[j - n : j] == suffix:
                return [tokens[j + i % (L - j)] for i in range(k)]
    return []


def build(tokens: list[int], *, min_n: int = 2, max_n: int = 4) -> NgramIndex:
    idx = NgramIndex(min_n=min_n, max_n=max_n)
    idx.extend(tokens)
    return idx


def test_proposes_what_followed_the_most_recent_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    # "1 2" occurred ending at 3 (then 3) and at 7 (then 4): the most recent wins.
    assert build(tokens).propose(3) == [4, 8, 1]


def test_prefers_the_longer_match_over_the_more_recent():
    tokens = [5, 1, 2, 3, 6, 0, 2, 3, 4, 5, 1, 2, 3]
    # "2 3" most recently continued with 4, but "1 2 3" (longer) continued with 6.
    assert build(tokens).propose(2) == [6, 0]


def test_no_match_below_the_minimum_length():
    tokens = [1, 2, 3, 4, 5, 3]  # only the single token 3 repeats
    assert build(tokens, min_n=2).propose(4) == []
    assert build(tokens, min_n=1).propose(2) == [4, 5]


def test_a_match_near_the_end_continues_the_repetition():
    tokens = [9, 1, 2, 3, 1, 2, 3, 1, 2]  # period 3
    assert build(tokens).propose(5) == [3, 1, 2, 3, 1]


def test_zero_and_empty():
    assert build([1, 2, 1, 2]).propose(0) == []
    assert build([]).propose(3) == []
    assert build([1]).propose(3) == []


def test_bad_sizes_raise():
    with pytest.raises(ValueError):
        NgramIndex(min_n=0, max_n=3)
    with pytest.raises(ValueError):
        NgramIndex(min_n=4, max_n=2)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    k=st.integers(0, 6),
    sizes=st.sampled_from([(1, 1), (1, 3), (2, 4), (3, 5)]),
)
def test_incremental_index_matches_the_brute_force_definition(tokens, cuts, k, sizes):
    min_n, max_n = sizes
    idx = NgramIndex(min_n=min_n, max_n=max_n)
    start = 0
    for cut in sorted(c for c in cuts if c <= len(tokens)) + [len(tokens)]:
        idx.extend(tokens[start:cut])
        start = max(start, cut)
        assert idx.lookup(k) == brute_force(idx.tokens, k, min_n, max_n)
    assert idx.tokens == tokens


def test_drafter_core_follows_the_context_tail_and_forgets():
    core = NgramDrafterCore(min_n=2, max_n=3)
    core.extend([Draft(rid=1, start=0, tail=[4, 5, 6, 7, 4, 5], gamma=2)])
    assert core.draft([Draft(rid=1, start=0, tail=[], gamma=2)])[0].tokens == [6, 7]
    core.extend([Draft(rid=1, start=6, tail=[6, 9], gamma=2)])
    assert core.draft([Draft(rid=1, start=8, tail=[], gamma=3)])[0].tokens == []  # "6 9" never seen
    with pytest.raises(ValueError, match="tail from 3"):
        core.extend([Draft(rid=1, start=3, tail=[1], gamma=1)])
    core.forget([1])
    assert core.rows == {}


def test_bad_drafter_sizes_fail_at_construction():
    with pytest.raises(ValueError):
        NgramDrafterCore(min_n=5, max_n=4)


def test_replay_counts_target_calls_of_greedy_prompt_lookup():
    from bench.spec.replay import tokens_per_call

    # The continuation repeats the prompt. Calls 1 and 2 have no 2-token
    # match to copy from (suffixes "7 8" and "8 1" are new) and yield one
    # token each; then "1 2" matches, so call 3 accepts 3, 4, 5 and adds the
    # bonus 6, and call 4 accepts the last two: 8 tokens in 4 calls.
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    assert tokens_per_call(prompt, [1, 2, 3, 4, 5, 6, 7, 8], 3) == 2.0
    assert tokens_per_call(prompt, [1, 2, 3, 4, 5, 6, 7, 8], 1) == 8 / 5  # 1, 1, then 2 + 2 + 2
    # nothing to copy: one token per call
    assert tokens_per_call([1, 2, 3], [9, 10, 11, 12], 4) == 1.0


def test_agreement_counts_the_context_tokens_the_source_agrees_with():
    idx = NgramIndex()
    idx.extend([1, 2, 3, 4, 5, 6, 9, 9, 3, 4, 5])  # the suffix 3 4 5 agrees with positions 2..4
    assert idx.propose(2) == [6, 9]
    assert idx.agreement(5) == 3
    idx.extend([6])  # the copy goes on: four tokens of agreement now
    assert idx.agreement(6) == 4


def test_min_match_gates_a_short_match_and_keeps_tracking_the_copy():
    idx = NgramIndex()
    idx.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4])
    assert idx.propose(3, min_match=4) == []  # a 2-token match: nothing proposed
    assert idx.propose(3) == [5, 6, 7]  # ungated, the same match proposes
    idx.extend([5, 6])  # the text copied on: 3 4 5 6 agrees with the source now
    assert idx.propose(3, min_match=4) == [7, 8, 9]
