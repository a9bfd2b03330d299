"""A suffix draft's length against its cost (engine.speculation.draft_length
and the suffix Drafter core): calibrated acceptance learned from the tokens
that came, the prefix with the most expected tokens per unit of the priced
window, a cold engine drafting as before, namespaces kept apart."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.drafter_cores import Draft
from actors.suffix_cores import SuffixDrafterCore
from engine.speculation.draft_length import STORE, AcceptCalibration, best_length
from engine.speculation.policy import GammaPolicy
from tests.engine.test_suffix import RESPONSE, finished

PRICE_15B = [1.43, 0.145]  # the policy's fit on the 1.5B, Xeon host (docs/bench/spec-real.md)


def _value(rates: list[float], k: int, first: float, per: float) -> float:
    """Expected tokens per plain round of a window of the first ``k`` drafts."""
    expected, survive = 1.0, 1.0
    for r in rates[:k]:
        survive *= r
        expected += survive
    return expected / (first + per * (k - 1))


@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=24),
    st.floats(1.0, 3.0),
    st.floats(0.0, 1.0),
)
def test_the_length_chosen_pays_best_per_unit_of_cost(rates, first, per):
    k = best_length(rates, first, per)
    assert 1 <= k <= len(rates)
    assert all(
        _value(rates, k, first, per) >= _value(rates, j, first, per) * (1 - 1e-9) for j in range(1, len(rates) + 1)
    )


def test_rows_that_cost_more_or_are_accepted_less_make_shorter_drafts():
    sure = [0.9] * 24
    assert best_length(sure, 1.43, 0.145) < best_length(sure, 1.1, 0.02) < 24
    assert best_length([0.7] * 24, *PRICE_15B) < best_length(sure, *PRICE_15B)
    assert best_length([1.0] * 24, *PRICE_15B) == 24  # certain tokens: any row pays
    assert best_length([0.9] * 24, 1.2, 0.0) == 24  # free rows: every accepted chance pays
    assert best_length([], 1.2, 0.1) == 0


def test_a_cold_calibration_is_the_raw_share_and_learning_moves_it():
    cal = AcceptCalibration()
    assert cal.rate(STORE, 3, 1, 1) == 1.0 and cal.rate(STORE, 1, 2, 4) == 0.5
    for _ in range(200):  # unique matches in the store that held for 1 token in 2
        cal.observe(STORE, 3, 1, 1, hit=False)
        cal.observe(STORE, 3, 1, 1, hit=True)
    assert cal.rate(STORE, 3, 1, 1) == pytest.approx(0.5, abs=0.02)
    # a cell with no data borrows its pool (same source and share): unique matches elsewhere in the draft
    assert cal.rate(STORE, 9, 1, 1) == pytest.approx(0.5, abs=0.02)
    # another source's or share's tokens are untouched
    assert cal.rate("local", 3, 1, 1) == 1.0 and cal.rate(STORE, 3, 2, 4) == 0.5


def _lone(rid: int, ctx: list[int], ns: str, price: list[float]) -> Draft:
    return Draft(rid=rid, start=0, tail=ctx, gamma=6, ns=ns, reach=24, price=price)


def test_the_core_cuts_a_unique_match_its_namespace_showed_to_be_wrong():
    """The store holds one response; requests of namespace "a" repeat its
    first tokens and then say something else. The core judges its own drafts
    by the tokens that came (sent with the next tail), so its drafts from
    that store shrink in "a" once priced, and not unpriced, nor in "b"."""
    core = SuffixDrafterCore(priced=True)  # ``suffix:cut``
    for ns in ("a", "b"):
        core.learn([finished(1, [1, 2, 3], RESPONSE, ns=ns)])
    ctx = [9] + RESPONSE[:20]  # a 20-token match: up to 20 tokens drafted
    first = _lone(10, ctx, "a", PRICE_15B)
    core.extend([first])
    assert core.draft([first])[0].tokens == RESPONSE[20:40]  # raw share 1.0: nothing to cut yet
    for rid in range(11, 31):  # each request diverges two tokens into the draft
        core.forget([rid - 1])
        d = _lone(rid, ctx, "a", PRICE_15B)
        core.extend([d])
        core.draft([d])
        core.extend([Draft(rid=rid, start=len(ctx), tail=[*RESPONSE[20:22], 7, 7], gamma=6, ns="a")])
    assert core.calibration("a").observed > 0 and core.calibration("b").observed == 0
    judged = core.stats()["suffix_judged_tokens"]
    assert judged == core.calibration("a").observed

    def draft(rid: int, ns: str, price: list[float]) -> list[int]:
        d = _lone(rid, ctx, ns, price)
        core.extend([d])
        return core.draft([d])[0].tokens

    cut = draft(100, "a", PRICE_15B)
    assert 1 <= len(cut) <= 4 and cut == RESPONSE[20 : 20 + len(cut)]
    assert core.stats()["suffix_cut_tokens"] >= 20 - len(cut)
    assert draft(101, "a", []) == RESPONSE[20:40]  # unpriced (a batch): as before
    assert draft(102, "b", PRICE_15B) == RESPONSE[20:40]  # another namespace learned nothing of "a"
    core.priced = False  # plain ``suffix``: drafts to the match's end
    assert draft(103, "a", PRICE_15B) == RESPONSE[20:40]


def test_the_policy_prices_a_lone_window_from_its_measured_line():
    policy = GammaPolicy(slope_prior=0.1)
    assert policy.window_price() == [pytest.approx(1.1), pytest.approx(0.1)]  # the prior before any round
    # measured: plain rounds of 0.1 s beside one-draft windows of 0.14 s and four-draft ones of 0.17 s
    rounds = []
    for _ in range(8):
        rounds += [(0, 0.1, 1, 0, 0.0), (1, 0.14, 1, 1, 0.0), (0, 0.1, 1, 0, 0.0), (4, 0.17, 1, 4, 0.0)]
    policy.observe_costs(rounds + [(0, 0.1, 1, 0, 0.0)] * 8)
    assert policy.window_price() == [pytest.approx(1.4, abs=0.01), pytest.approx(0.1, abs=0.01)]


def test_a_verified_round_carries_the_price_and_a_plain_one_none():
    from actors.verifier import VerifierCore, Verify, Window

    core = VerifierCore(GammaPolicy(fixed=3))
    got = core.verify(Verify(windows=[Window(rid=1, drafts=[5, 6, 7], targets=[5, 6, 7, 8], fixed_gamma=3)]))
    assert got.verdicts[0].gamma_next == 3 and got.price == core.policy.window_price()
    off = VerifierCore(GammaPolicy(fixed=0))
    plain = off.verify(Verify(windows=[Window(rid=1, drafts=[], targets=[8], fixed_gamma=0)]))
    assert plain.verdicts[0].gamma_next == 0 and plain.price == []


def test_the_drafter_names_pick_the_length_rule():
    from ember.errors import InvalidRequest
    from ember.spec_build import _suffix_core

    assert _suffix_core("suffix:cut").priced and not _suffix_core("suffix").priced
    with pytest.raises(InvalidRequest, match="suffix:cut"):
        _suffix_core("suffix:uncut")
