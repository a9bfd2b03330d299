"""Suffix decoding's structure (engine.speculation.suffix) and its Drafter core
(actors.suffix_cores): proposals against a scan, frequency order, the draft
length that follows the match, the memory cap, namespace isolation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.drafter_cores import Draft, Finished, NgramDrafterCore
from actors.suffix_cores import SuffixDrafterCore
from engine.speculation.suffix import DraftTree, SuffixIndex, SuffixParams, SuffixStore

P = SuffixParams()


def index(tokens: list[int], params: SuffixParams = P) -> SuffixIndex:
    idx = SuffixIndex(params)
    idx.extend(tokens)
    return idx


def scan(docs: list[list[int]], context: list[int], limit: int, prm: SuffixParams, tried: int = 4):
    """The definition, by scanning every occurrence: for each of the ``tried``
    longest distinct match lengths ℓ (at least ``anchor``, at most
    ``max_depth``), the suffixes of the corpus matching the context's last ℓ
    tokens; follow their most frequent next token (ties: the latest
    occurrence's) while the product of count / alive stays >= min_token_prob,
    at most alpha·ℓ tokens; the best sum of probabilities (ties: longer ℓ)."""
    occ = []  # (doc, position after the match, match length), latest first
    for d in range(len(docs) - 1, -1, -1):
        doc = docs[d]
        for p in range(len(doc), prm.anchor - 1, -1):  # p == len(doc): the suffix ends with its document
            m = 0
            while m < min(prm.max_depth, len(context)) and p - 1 - m >= 0 and doc[p - 1 - m] == context[-1 - m]:
                m += 1
            if m >= prm.anchor:
                occ.append((d, p, m))
    occ = occ[: prm.candidates]
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    for ell in sorted({m for _, _, m in occ}, reverse=True)[:tried]:
        cap = min(limit, int(prm.alpha * ell))
        alive = [(d, p) for d, p, m in occ if m >= ell]
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < cap and alive:
            nxt = [docs[d][p] if p < len(docs[d]) else None for d, p in alive]
            counts: dict[int, int] = {}
            for t in nxt:
                if t is not None:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            top = max(counts.values())
            tok = next(t for t in nxt if t is not None and counts[t] == top)
            prob *= top / len(alive)
            if prob < prm.min_token_prob:
                break
            out.append(tok)
            score += prob
            alive = [(d, p + 1) for (d, p), t in zip(alive, nxt) if t == tok]
        if score > best[1]:
            best = (out, score, ell)
    return best


def test_proposes_what_followed_the_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 4, 5, 9, 6, 1, 2, 3]
    got = index(tokens).propose(tokens, 6)
    assert got.tokens == [4, 5, 9] and got.match_len == 3  # at most alpha * 3 tokens
    assert got.score == pytest.approx(3.0)


def test_the_more_frequent_continuation_wins_over_the_more_recent():
    # "1 2" went on with 3 twice, then once with 8 (the latest): frequency wins.
    tokens = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 8, 0, 1, 2]
    got = index(tokens).propose(tokens, 2)
    assert got.tokens == [3, 0]
    assert got.score == pytest.approx(2 / 3 + 2 / 3)
    # without the frequency (one occurrence each), the latest wins a tie
    tokens = [1, 2, 3, 0, 1, 2, 8, 0, 1, 2]
    assert index(tokens).propose(tokens, 1).tokens == [8]


def test_a_longer_match_earns_a_longer_draft():
    body = list(range(100, 140))
    short = [5, 6] + body + [0, 0, 5, 6]  # the context ends in a 2-token match
    long = [5, 6, 7, 8, 9, 10, 11, 12] + body + [0, 0, 5, 6, 7, 8, 9, 10, 11, 12]  # an 8-token one
    assert len(index(short).propose(short, 24).tokens) == 2
    got = index(long).propose(long, 24)
    assert got.match_len == 8 and got.tokens == body[:8]
    wide = SuffixParams(alpha=2.0)
    assert index(long, wide).propose(long, 24).tokens == body[:16]
    assert index(long, wide).propose(long, 5).tokens == body[:5]  # the limit still rules


def test_an_unlikely_path_stops_at_min_token_prob():
    # After "1 2": 3 four times, 4 and 5 once each. Then each 3 goes on differently.
    tokens = []
    for nxt in (30, 31, 32, 33):
        tokens += [1, 2, 3, nxt, 0]
    tokens += [1, 2, 4, 0, 1, 2, 5, 0, 1, 2]
    got = index(tokens, SuffixParams(min_token_prob=0.5)).propose(tokens, 2)
    assert got.tokens == [3]  # 4/6 >= 0.5, then 4/6 * 1/4 < 0.5


def test_nothing_below_the_anchor_and_no_self_match():
    assert index([1, 2, 3]).propose([1, 2, 3], 4).tokens == []  # "2 3" only occurs at the end
    assert index([1, 2, 1]).propose([1, 2, 1], 4).tokens == []  # one shared token is no match


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=4),
    st.lists(st.integers(0, 3), min_size=2, max_size=12),
    st.integers(1, 8),
    st.sampled_from([SuffixParams(), SuffixParams(anchor=1, max_depth=4, alpha=1.5, candidates=5)]),
)
def test_the_store_proposes_what_a_scan_finds(docs, context, limit, prm):
    store = SuffixStore(prm, cap_tokens=10_000)
    kept = [d for d in docs if d]
    for d in kept:
        store._add(d)
    got = store.propose(context, limit)
    want = scan(kept, context, limit, prm)
    assert (got.tokens, got.match_len) == (want[0], want[2] if want[0] else 0)
    assert got.score == pytest.approx(want[1])


def test_a_tree_holds_both_continuations_the_path_chooses_between():
    # "1 2" went on with 3 4 twice and with 8 9 once: the path takes 3 4 only
    store = SuffixStore(SuffixParams(alpha=2.0))  # a 2-token match may draft 4
    for doc in ([5, 1, 2, 3, 4], [6, 1, 2, 3, 4], [7, 1, 2, 8, 9]):
        store._add(doc)
    context = [0, 1, 2]
    assert store.propose(context, 4).tokens == [3, 4]
    tree = store.propose_tree(context, 4)
    assert tree.tokens == [3, 4, 8, 9] and tree.parents == [-1, 0, -1, 2]
    assert tree.score == pytest.approx(2 / 3 + 2 / 3 + 1 / 3 + 1 / 3)
    assert store.propose_tree(context, 3).tokens == [3, 4, 8]  # the budget takes the likeliest nodes
    assert tree.depths() == [1, 2, 1, 2]


def test_a_tree_without_branches_is_the_path():
    tokens = [7, 1, 2, 3, 4, 5, 9, 6, 1, 2, 3]
    tree = index(tokens).propose_tree(tokens, 6)
    path = index(tokens).propose(tokens, 6)
    assert tree.tokens == path.tokens and tree.parents == [-1, 0, 1]
    assert tree.score == pytest.approx(path.score)


def test_accept_walks_the_targets_tokens_down_the_tree():
    tree = DraftTree(tokens=[3, 4, 8, 9], parents=[-1, 0, -1, 2], score=0.0, match_len=2)
    # greedy[0]: after the root; greedy[i + 1]: after node i
    assert tree.accept([8, 5, 6, 9, 7]) == ([2, 3], [8, 9, 7])
    assert tree.accept([3, 4, 0, 0, 0]) == ([0, 1], [3, 4, 0])
    assert tree.accept([3, 5, 0, 0, 0]) == ([0], [3, 5])
    assert tree.accept([6, 0, 0, 0, 0]) == ([], [6])
    assert DraftTree.of_path([1, 2]).accept([1, 2, 3]) == ([0, 1], [1, 2, 3])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=4),
    st.lists(st.integers(0, 3), min_size=2, max_size=12),
    st.integers(1, 8),
)
def test_a_tree_is_well_formed_and_scores_at_least_the_path(docs, context, budget):
    store = SuffixStore(P, cap_tokens=10_000)
    for d in docs:
        if d:
            store._add(d)
    path = store.propose(context, budget)
    tree = store.propose_tree(context, budget)
    assert len(tree) <= budget
    assert all(p < i for i, p in enumerate(tree.parents))  # a verify window's order
    assert len({(p, t) for p, t in zip(tree.parents, tree.tokens)}) == len(tree)  # no twin siblings
    # best first takes the likeliest nodes, and a node is never likelier than its parent
    assert tree.score >= path.score - 1e-9
    assert bool(tree.tokens) == bool(path.tokens)


def test_the_store_keeps_its_cap_dropping_the_oldest():
    store = SuffixStore(P, cap_tokens=100)
    for i in range(30):
        store._add([1000 + i, 1, 2, 3, 4, 5, 6, 7, 8, 9])
        assert len(store) <= 100
    assert store.evicted_docs > 0
    # the oldest documents are gone from the index too: their first tokens match nothing
    assert store.propose([5, 1000, 1], 4).tokens == []
    assert store.propose([5, 1029, 1], 4).tokens == [2, 3]
    # and the index holds only positions still stored
    idx = store.index
    assert all(p >= idx.base for occ in idx._occ.values() for p in occ)
    assert sum(len(o) for o in idx._occ.values()) <= len(idx)


def test_learning_an_agent_history_stores_each_turn_once():
    store = SuffixStore(P, cap_tokens=100_000)
    history = list(range(1000, 1400))
    store.learn(history, [7] * 20)
    stored = len(store)
    store.learn(history + [7] * 20 + list(range(2000, 2050)), [8] * 20)
    # the second prompt repeats the first: only its new part (and some context before it) is stored
    assert len(store) - stored < 20 + 50 + P.max_depth + 20 + P.max_depth + 4


def drafts(rid: int, tail: list[int], *, ns: str, gamma: int = 4, start: int = 0, reach: int = 0) -> Draft:
    return Draft(rid=rid, start=start, tail=tail, gamma=gamma, ns=ns, reach=reach)


def finished(rid: int, prompt: list[int], response: list[int], ns: str, start: int = 0) -> Finished:
    ctx = prompt + response
    return Finished(rid=rid, ns=ns, start=start, tail=ctx[start:], prompt_len=len(prompt))


RESPONSE = [500 + i for i in range(40)]


def test_a_namespace_never_reads_another_namespaces_text():
    core = SuffixDrafterCore()
    core.learn([finished(1, [1, 2, 3], RESPONSE, ns="alice")])
    for rid, ns in ((2, "alice"), (3, "bob"), (4, "")):
        d = drafts(rid, [9, 9, 8] + RESPONSE[:10], ns=ns)
        core.extend([d])
        (got,) = core.draft([d])
        assert got.tokens == (RESPONSE[10:14] if ns == "alice" else []), ns
    assert set(core.stores) == {"alice"}


def test_learn_takes_the_tail_the_drafter_had_not_seen():
    core = SuffixDrafterCore()
    prompt = [1, 2, 3, 4]
    d = drafts(7, prompt + RESPONSE[:5], ns="a")
    core.extend([d])
    core.learn([finished(7, prompt, RESPONSE, ns="a", start=len(d.tail))])
    core.forget([7])
    d2 = drafts(8, [0, 0] + RESPONSE[:30], ns="a", gamma=6)
    core.extend([d2])
    assert core.draft([d2])[0].tokens == RESPONSE[30:36]
    # a start the Drafter does not hold is not learned (no wrong text)
    core.learn([finished(9, prompt, RESPONSE, ns="b", start=3)])
    assert "b" not in core.stores


def test_reach_lets_a_long_match_draft_past_gamma():
    core = SuffixDrafterCore()
    core.learn([finished(1, [1, 2, 3], RESPONSE, ns="")])
    ctx = [9] + RESPONSE[:20]
    for reach, want in ((0, 4), (24, 20)):  # alpha * match_len: the 20 tokens matched
        core.forget([2])
        d = drafts(2, ctx, ns="", gamma=4, reach=reach)
        core.extend([d])
        assert core.draft([d])[0].tokens == RESPONSE[20 : 20 + want]


def test_the_gate_withholds_short_matches():
    core = SuffixDrafterCore()
    core.learn([finished(1, [1, 2, 3], RESPONSE, ns="")])
    d = Draft(rid=2, start=0, tail=[9, 9, 9, RESPONSE[0], RESPONSE[1]], gamma=4, min_match=4)
    core.extend([d])
    assert core.draft([d])[0].tokens == [] and core.gated == 1


def test_namespaces_beyond_the_cap_drop_the_least_recently_used():
    core = SuffixDrafterCore(max_namespaces=2)
    for ns in ("a", "b"):
        core.learn([finished(1, [1], RESPONSE, ns=ns)])
    core.store("a")  # used: b is now the oldest
    core.learn([finished(1, [1], RESPONSE, ns="c")])
    assert list(core.stores) == ["a", "c"] and core.namespaces_evicted == 1


def test_with_prompt_lookup_the_better_proposal_wins():
    core = SuffixDrafterCore(ngram=NgramDrafterCore())
    # the request copies its own text: prompt lookup follows the copy (8+ agreeing)
    own = list(range(300, 330))
    d = drafts(1, own + [0] + own[:12], ns="", gamma=6)
    core.extend([d])
    (got,) = core.draft([d])
    assert got.tokens == own[12:18]
    # the namespace's store has a longer, surer continuation of a response: suffix wins
    core.learn([finished(2, [1, 2], RESPONSE, ns="")])
    d2 = drafts(3, [77, 78] + RESPONSE[:16], ns="", gamma=6, reach=24)
    core.extend([d2])
    (got2,) = core.draft([d2])
    assert (got2.proposer, got2.tokens) == ("suffix", RESPONSE[16:32])


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        SuffixParams(anchor=0)
    with pytest.raises(ValueError):
        SuffixParams(alpha=0)
    with pytest.raises(ValueError):
        SuffixStore(P, cap_tokens=0)
    with pytest.raises(ValueError):
        SuffixDrafterCore(max_namespaces=0)
