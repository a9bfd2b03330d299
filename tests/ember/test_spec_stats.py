"""Speculation statistics, and the output distribution at temperature > 0.

Distribution test (fake GPU, many seeded samples): with temperature 1.0 and
top-k 3 every position has at most 3 candidates, so a 4-token completion has
at most 81 outcomes. We draw N = 1500 completions with speculation (fake
drafter agreeing with the target's argmax 80% of the time, γ = 3, so tokens
2-4 come from one verify round) and N without, seeds disjoint, and compare the
two outcome histograms with a chi-square test of homogeneity (cells with
fewer than 10 samples in both arms together are pooled). Tolerance: the test
fails when p < 0.001. The statistic is Pearson's, its p-value the chi-square
survival function in closed form (checked below against tabulated critical
values), so the test needs numpy only. The same statistic on a broken acceptance rule (accept
every draft), on 600 samples, gives p < 1e-6, so the test can tell the
difference.
"""

from __future__ import annotations

import math
from collections import Counter

import anyio
import numpy as np
import pytest

import actors.verifier as verifier_mod
from ember import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.anyio

N = 1500
N_BROKEN = 600
PROMPT = list(b"sample me")


async def sample(cfg: EngineConfig, seeds: range) -> Counter:
    out: Counter = Counter()
    in_flight = anyio.Semaphore(256)  # below the Gateway's inbox bound
    async with Engine.open(cfg) as engine:

        async def one(seed: int) -> None:
            sp = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)
            async with in_flight:
                c = await engine.acomplete(PROMPT, sp)
            out[tuple(c.token_ids)] += 1

        async with anyio.create_task_group() as tg:
            for s in seeds:
                tg.start_soon(one, s)
    return out


def homogeneity_p(a: Counter, b: Counter) -> float:
    keys = sorted(set(a) | set(b))
    big = [k for k in keys if a[k] + b[k] >= 10]
    rows = [[a[k] for k in big], [b[k] for k in big]]
    rest_a = sum(a.values()) - sum(rows[0])
    rest_b = sum(b.values()) - sum(rows[1])
    if rest_a + rest_b:
        rows[0].append(rest_a)
        rows[1].append(rest_b)
    return chi2_homogeneity_p(np.array(rows, dtype=float))


def chi2_homogeneity_p(table: np.ndarray) -> float:
    """Pearson's chi-square test of homogeneity of a 2-D contingency table
    (what ``scipy.stats.chi2_contingency`` computes for more than one degree of
    freedom, where it applies no continuity correction)."""
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = (table.shape[0] - 1) * (table.shape[1] - 1)
    return chi2_sf(stat, dof)


def chi2_sf(x: float, k: int) -> float:
    """P(X > x) for X ~ chi-square with k degrees of freedom: the regularized
    upper incomplete gamma Q(k/2, x/2), in closed form for integer k."""
    h = x / 2
    if k % 2 == 0:  # Q(n, h) = e^-h * sum_{i<n} h^i / i!
        term, total = 1.0, 1.0
        for i in range(1, k // 2):
            term *= h / i
            total += term
        return math.exp(-h) * total
    # Q(n + 1/2, h) = erfc(sqrt(h)) + e^-h * sum_{i<n} h^(i+1/2) / Gamma(i + 3/2)
    term, total = math.sqrt(h) / math.gamma(1.5), 0.0
    for i in range(k // 2):
        total += term
        term *= h / (i + 1.5)
    return math.erfc(math.sqrt(h)) + math.exp(-h) * total


@pytest.mark.parametrize(
    "x, k, p",  # critical values from a printed chi-square table
    [
        (3.841, 1, 0.05),
        (6.635, 1, 0.01),
        (5.991, 2, 0.05),
        (11.070, 5, 0.05),
        (23.209, 10, 0.01),
        (31.410, 20, 0.05),
        (59.703, 30, 1e-3),
        (124.342, 100, 0.05),
        (10.828, 1, 1e-3),
    ],
)
def test_chi2_sf_matches_the_table(x, k, p):
    assert chi2_sf(x, k) == pytest.approx(p, rel=2e-3)


def test_homogeneity_p_separates_equal_from_different_arms():
    same = np.array([[100, 200, 300], [105, 195, 300]], dtype=float)
    skew = np.array([[100, 200, 300], [300, 200, 100]], dtype=float)
    assert chi2_homogeneity_p(same) > 0.5
    assert chi2_homogeneity_p(skew) < 1e-6


BASE = EngineConfig(backend="fake", max_batch=64, max_queue=N, prompt_cache_gib=0)
SPEC = EngineConfig(
    backend="fake", max_batch=64, max_queue=N, prompt_cache_gib=0, draft_model="fake-draft:0.8", num_draft_tokens=3
)


@pytest.mark.slow  # 3600 sampled completions
async def test_sampled_output_distribution_is_the_targets(monkeypatch):
    plain = await sample(BASE, range(N))
    spec = await sample(SPEC, range(N, 2 * N))
    assert len(plain) > 20  # a real distribution, not a few outcomes
    assert homogeneity_p(plain, spec) > 1e-3

    # Negative control: accepting every draft skews toward the drafter.
    def accept_all(drafts, targets):
        return len(drafts), list(drafts) + [targets[len(drafts)]]

    monkeypatch.setattr(verifier_mod, "accept_window", accept_all)
    broken = await sample(SPEC, range(N, N + N_BROKEN))
    assert homogeneity_p(plain, broken) < 1e-6


async def test_engine_counters_add_up_to_the_requests():
    cfg = EngineConfig(backend="fake", draft_model="fake-draft:0.7", num_draft_tokens=4, max_batch=4)
    usages = []
    async with Engine.open(cfg) as engine:

        async def one(i: int) -> None:
            c = await engine.acomplete([i, i + 1, i + 2], SamplingParams(max_tokens=60, ignore_eos=True))
            usages.append(c.usage.speculation)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        stats = engine.stats()["speculation"]

    for name in (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    ):
        assert name in stats
    assert stats["spec_decode_num_draft_tokens"] == sum(u.drafted for u in usages)
    assert stats["spec_decode_num_accepted_tokens"] == sum(u.accepted for u in usages)
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # position j needs 1..j-1 accepted
    drafts = stats["spec_decode_num_drafts"]
    assert stats["mean_accept_len"] == pytest.approx(1 + stats["spec_decode_num_accepted_tokens"] / drafts, abs=1e-6)
    assert stats["acceptance_rate"] == pytest.approx(
        stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"], abs=1e-6
    )
    assert stats["drafter"] == "fake-draft:0.7" and stats["policy"]["mode"] == "fixed"
    for u in usages:
        assert 0 < u.accepted <= u.drafted
        # every token came from a target forward: accepted drafts ride along
        assert u.target_calls + u.accepted == 60
        assert u.acceptance_rate == pytest.approx(u.accepted / u.drafted)
        assert 1.0 < u.mean_accept_len <= 5.0


async def test_adaptive_policy_reports_measured_costs():
    cfg = EngineConfig(backend="fake", draft_model="fake-draft:0.9")
    async with Engine.open(cfg) as engine:
        await engine.acomplete([1, 2, 3], SamplingParams(max_tokens=80, ignore_eos=True))
        policy = engine.stats()["speculation"]["policy"]
    assert policy["mode"] == "adaptive"
    ratios = {int(k.split("x")[1]): v for k, v in policy["ratio_by_rows_drafts"].items() if k.startswith("1x")}
    assert len(ratios) >= 2
    fake = cfg.fake
    plain = fake.decode_c + fake.decode_d
    assert policy["plain_s_by_rows"]["1"] == pytest.approx(plain)  # a plain round, explored once
    for d, r in ratios.items():
        # start to start over the plain round: one forward (decode_c + verify_b per
        # window token) plus the fake drafter's 2 ms per token and 20 us per token fed
        assert r == pytest.approx((fake.decode_c + fake.verify_b * (d + 1) + 0.002 * d) / plain, abs=5e-3)
    assert policy["round_s_fit"]["per_draft_1"] == pytest.approx((fake.verify_b + 0.002) / plain, rel=0.05)
    assert policy["draft_token_s"] == pytest.approx(0.002, rel=0.05)


# ---------------------------------------------------------------------------
# The adaptive γ policy by hand.

from engine.speculation.policy import GammaPolicy  # noqa: E402


def test_policy_cost_model_plain_and_verify_rounds_linear_in_rows_and_drafts():
    p = GammaPolicy()
    assert p.round_cost(3) == pytest.approx(1.0 + 0.1 * 3)  # nothing measured: the prior, in units
    p.observe_cost(0, 0.010, rows=1, drafted_tokens=0, draft_s=0)
    assert p.round_cost(4) == pytest.approx(0.010 * (1 + 0.1 * 4))  # no drafts measured yet: the prior slope
    p.observe_cost(4, 0.018, rows=1, drafted_tokens=4, draft_s=0)
    assert p.round_cost(2) == pytest.approx(0.016)  # one draft count seen: the prior slope through it
    p.observe_cost(2, 0.014, rows=1, drafted_tokens=2, draft_s=0)
    assert p.round_cost(3) == pytest.approx(0.016)
    assert p.round_cost(6) == pytest.approx(0.022)
    # one batch size seen: rows cost nothing extra, but every row's drafts do
    assert p.round_cost(2, rows=2) == pytest.approx(0.010 + 0.002 * 2 * 2)
    p.observe_cost(0, 0.012, rows=2, drafted_tokens=0, draft_s=0)
    assert p.round_cost(0, rows=3) == pytest.approx(0.014)


def test_policy_turns_speculation_off_in_a_full_batch():
    p = GammaPolicy(gamma_max=4)
    for rows, drafts, s in ((1, 0, 0.005), (1, 1, 0.006), (1, 2, 0.007), (4, 0, 0.008), (4, 4, 0.014), (4, 8, 0.020)):
        for _ in range(4):
            p.observe_cost(0, s, rows=rows, drafted_tokens=drafts, draft_s=0)
    row = p.new_row(None)
    for i in range(40):
        p.observe_round(row, 1, i % 2)  # every other draft accepted
    p.rows_now = 1
    assert p.best(row) > 0  # alone, a row gains from drafting
    p.rows_now = 4
    assert p.best(row) == 0  # four rows already fill the forward


def test_policy_pauses_when_nothing_is_accepted_and_backs_off_its_probes():
    p = GammaPolicy(probe_first=4, probe_max=32, probe_budget=0.02)
    for g in range(7):
        p.observe_cost(g, 0.010 + 0.002 * g, rows=1, drafted_tokens=g, draft_s=0.001 * g)
    row = p.new_row(None)
    for _ in range(10):
        p.observe_round(row, 1, 0)
    holds = []
    # a probe round costs 20% more than a plain one: at least 10 rounds apart for a 2% budget
    assert p.choose(row) == (0, 10)
    for _ in range(4):
        assert p.after_hold(row) == (1, 0)
        p.observe_round(row, 1, 0)
        g, hold = p.choose(row)
        assert g == 0
        holds.append(hold)
    assert holds == [10, 16, 32, 32]  # then doubling, up to probe_max


def test_probes_are_sparser_where_a_verify_round_costs_more():
    p = GammaPolicy(probe_first=4, probe_budget=0.02)
    for rows, drafts, s in ((1, 0, 0.005), (1, 1, 0.006), (1, 2, 0.007), (4, 0, 0.008), (4, 4, 0.020), (4, 8, 0.022)):
        for _ in range(4):
            p.observe_cost(0, s, rows=rows, drafted_tokens=drafts, draft_s=0)
    row = p.new_row(None)
    for _ in range(10):
        p.observe_round(row, 1, 0)
    p.rows_now = 1
    alone = p.choose(row)[1]
    p.rows_now = 4
    batch = p.choose(row)[1]
    assert batch > 3 * alone


def test_a_rare_verify_round_is_not_forgotten_behind_many_plain_ones():
    """In a batch a probe's verify round comes once per ~100 plain rounds. The
    policy must still price the next one from it, not from 1-row rounds."""
    p = GammaPolicy()
    for g in range(3):
        for _ in range(4):
            p.observe_cost(g, 0.005 + 0.0003 * g, rows=1, drafted_tokens=g, draft_s=0)
    p.observe_cost(1, 0.021, rows=4, drafted_tokens=4, draft_s=0)  # one probe of all four rows
    for _ in range(1000):
        p.observe_cost(0, 0.008, rows=4, drafted_tokens=0, draft_s=0)
    p.rows_now = 4
    assert p.round_cost(1) == pytest.approx(0.021)
    assert p.round_cost(0) == pytest.approx(0.008)


def test_step_costs_of_a_verify_round_survive_a_long_plain_hold():
    """The Scheduler sends step costs with the next Verify; rows on hold send
    none for ~100 rounds, and the verify round's cost must still arrive."""
    from actors.spec_rounds import RowSpec, SpecRounds
    from engine.ports import DecodeRow, StepPlan, VerifyRow

    spec = SpecRounds(context_length=4096)
    t = 0.0
    verify = StepPlan(verify=[VerifyRow(i, [1, 2]) for i in range(4)])
    plain = StepPlan(decode=[DecodeRow(i, 1) for i in range(4)])
    for plan, dt in [(verify, 0.02)] + [(plain, 0.008)] * 200:
        spec.note_step(plan, t, 0.0, ok=True, more=True)
        t += dt
    spec.note_step(plain, t, 0.0, ok=True, more=True)
    spec.rows[0] = RowSpec(fixed=None, targets=[1])
    costs = spec.take_verify(4).costs
    shapes = {(c.rows, c.drafted) for c in costs}
    assert shapes == {(4, 4), (4, 0)}
    assert [c.step_s for c in costs if c.drafted] == [pytest.approx(0.02)]
    assert len(costs) == 1 + spec.costs_kept  # plain rounds: the latest few


def test_policy_goes_deep_when_everything_is_accepted_and_resumes_after_a_probe():
    p = GammaPolicy(gamma_max=4)
    for g in range(5):
        for _ in range(4):
            p.observe_cost(g, 0.010 + 0.001 * g, rows=1, drafted_tokens=g, draft_s=0)
    row = p.new_row(None)
    for _ in range(20):
        p.observe_round(row, 4, 4)
    assert p.choose(row) == (4, 0)
    for _ in range(40):
        p.observe_round(row, 1, 0)
    assert p.choose(row)[0] == 0
    p.after_hold(row)
    for _ in range(40):
        p.observe_round(row, 4, 4)  # the text turned repetitive
    assert p.choose(row)[0] == 4 and row.probe_every == p.probe_first


def test_fixed_gamma_is_fixed():
    p = GammaPolicy(fixed=3)
    row = p.new_row(None)
    p.observe_round(row, 3, 0)
    assert p.choose(row) == (3, 0)
    assert p.choose(p.new_row(1)) == (1, 0)  # the request's own override
    with pytest.raises(ValueError):
        GammaPolicy(fixed=99)


def test_policy_explores_a_plain_round_when_it_never_saw_one():
    p = GammaPolicy(gamma_max=4)
    for _ in range(4):
        p.observe_cost(2, 0.012, rows=1, drafted_tokens=2, draft_s=0)
    row = p.new_row(None)
    for _ in range(20):
        p.observe_round(row, 2, 2)
    assert p.choose(row) == (0, 3)  # three plain rounds, to anchor the cost of γ = 0
    for _ in range(4):
        p.observe_cost(0, 0.010, rows=1, drafted_tokens=0, draft_s=0)
    assert p.after_hold(row)[0] > 0  # then back to drafting, not a probe from γ = 1
    assert not row.probing
    for _ in range(p.costs.fresh_rounds):  # long after: the plain reference is stale
        p.observe_cost(2, 0.012, rows=1, drafted_tokens=2, draft_s=0)
    assert p.choose(row) == (0, 3)


def test_a_new_request_starts_from_the_engines_probe_spacing():
    """Probing is learned engine-wide, like acceptance: after one request's
    probes failed, the next starts with its longer hold; after a probe that
    turned drafting back on, new requests probe early again."""
    p = GammaPolicy(probe_first=4, probe_max=32, probe_budget=1.0)  # spacing: the schedule alone
    for g in range(7):
        for _ in range(4):
            p.observe_cost(g, 0.010 + 0.002 * g, rows=1, drafted_tokens=g, draft_s=0)
    first = p.new_row(None)
    assert first.probe_every == 4
    for _ in range(60):  # long enough for the engine-wide acceptance to learn it too
        p.observe_round(first, 1, 0)
    for _ in range(3):  # three failed probes: 4 -> 8 -> 16 -> 32
        p.choose(first)
        p.after_hold(first)
        p.observe_round(first, 1, 0)
    p.choose(first)
    assert first.probe_every == 32
    second = p.new_row(None)
    assert second.probe_every == 32
    assert p.choose(second) == (0, 32)
    # the second request's text repeats: its probe turns drafting on again
    p.after_hold(second)
    for _ in range(30):
        p.observe_round(second, 1, 1)
    assert p.choose(second)[0] > 0
    assert p.new_row(None).probe_every == 4


def test_a_row_deepens_by_doubling_what_it_has_seen_judged():
    """One accepted probe draft says nothing about deeper positions: the next
    window at most doubles the depth judged so far, however good the prior looks."""
    p = GammaPolicy(gamma_max=6, accept_prior=0.9)
    for g in range(7):
        for _ in range(4):
            p.observe_cost(g, 0.010 + 0.0005 * g, rows=1, drafted_tokens=g, draft_s=0)
    row = p.new_row(None)
    p.observe_round(row, 1, 1)  # the probe: one draft, accepted
    assert p.choose(row)[0] == 2
    p.observe_round(row, 2, 2)
    assert p.choose(row)[0] == 4
    for _ in range(4):
        p.observe_round(row, 6, 6)  # every position judged and accepted: as deep as it goes
    assert p.choose(row)[0] == 6


def test_a_new_row_starts_as_deep_as_the_engines_latest_round_reached():
    """Ramping 1, 2, 4, 6 costs a short request a third of its rounds on text
    that accepts everything; the next request starts where the last round was."""
    p = GammaPolicy(gamma_max=6, accept_prior=0.9)
    for g in range(7):
        for _ in range(4):
            p.observe_cost(g, 0.010 + 0.0005 * g, rows=1, drafted_tokens=g, draft_s=0)
    first = p.new_row(None)
    for _ in range(6):
        p.observe_round(first, 6, 6)
    p.observe_round(first, 1, 1)  # its last round, cut to one draft by max_tokens: still all accepted
    second = p.new_row(None)
    assert p.choose(second)[0] == 6
    p.observe_round(second, 6, 0)  # rejected at the first position: the seed falls back
    assert p.new_row(None).depth_seed == 1


def _held_row(p: GammaPolicy):
    """A lone row whose drafts are never accepted, with 1-row costs measured:
    a plain round 10 ms, a verify round with one draft 13 ms."""
    for _ in range(4):
        p.observe_cost(0, 0.010, rows=1, drafted_tokens=0, draft_s=0)
        p.observe_cost(1, 0.013, rows=1, drafted_tokens=1, draft_s=0)
    p.rows_now = 1
    row = p.new_row(None)
    for _ in range(10):
        p.observe_round(row, 1, 0)
    return row


def test_probe_spacing_charges_the_drafters_catch_up_over_the_hold():
    """Before its probe a held row's draft model feeds every token it skipped.
    With a 3 ms jump and a 2% budget the verify round alone asks for 15 rounds
    apart; a catch-up of 0.1 ms per token (1% of a plain round) takes half the
    budget at any spacing, so the probes must be twice as far apart."""
    free = GammaPolicy(probe_first=4, probe_budget=0.02)
    assert free.choose(_held_row(free)) == (0, 15)
    p = GammaPolicy(probe_first=4, probe_budget=0.02)
    row = _held_row(p)
    p.observe_catch_up(0.0064, 64)
    assert p.choose(row) == (0, 30)


def test_a_row_stops_speculating_when_its_catch_up_alone_exceeds_the_budget():
    """A catch-up of 0.3 ms per skipped token is 3% of a plain round: no hold
    keeps probing under 2%, so the row decodes plainly for good and asks the
    Drafter nothing more."""
    p = GammaPolicy(probe_first=4, probe_budget=0.02)
    row = _held_row(p)
    p.observe_catch_up(0.0192, 64)
    g, hold = p.choose(row)
    assert (g, hold) == (0, 1 << 30) and row.retired
    assert p.after_hold(row) == (0, 1 << 30)  # no probe either
    assert p.snapshot()["rows_retired"] == 1


def test_catch_up_reaches_the_policy_with_the_next_verify():
    """The Drafter's catch-up (seconds and tokens) travels Scheduler → Verifier."""
    from actors.drafter import DraftedRound
    from actors.drafter_cores import Draft, Drafted
    from actors.spec_rounds import SpecRounds
    from actors.verifier import VerifierCore

    spec = SpecRounds(context_length=4096)
    spec.admit(7, SamplingParams())
    asked = [Draft(rid=7, start=0, tail=[1, 2, 3], gamma=1)]
    spec.set_drafts(DraftedRound(drafted=[Drafted(rid=7, tokens=[5])], catch_up_s=0.004, catch_up_tokens=40), asked)
    spec.rows[7].targets = [5, 6]
    core = VerifierCore(GammaPolicy())
    core.verify(spec.take_verify(1))
    assert core.policy.catch_up_token_s == pytest.approx(0.0001)
    assert spec.catch_up_tokens == 0  # sent once


def test_a_step_in_which_a_row_finished_is_not_costed():
    """A fixed-γ row's last token is a plain step that costs more than a steady
    one; as the only plain rounds near its verify rounds they priced every
    verify round at about one plain round (docs/bench/spec-real.md)."""
    from actors.spec_rounds import RowSpec, SpecRounds
    from engine.ports import DecodeRow, StepPlan, VerifyRow
    from engine.types import SamplingParams

    spec = SpecRounds(context_length=4096)
    spec.admit(0, SamplingParams(max_tokens=8, num_draft_tokens=1))
    verify = StepPlan(verify=[VerifyRow(0, [1, 2])])
    last = StepPlan(decode=[DecodeRow(0, 1)])
    plain = StepPlan(decode=[DecodeRow(1, 1)])
    t = 0.0
    for plan, dt, finishes in [(verify, 0.25, False), (last, 0.28, True), (plain, 0.15, False), (plain, 0.15, False)]:
        if finishes:
            spec.finish(0)
        spec.note_step(plan, t, 0.0, ok=True, more=True)
        t += dt
    spec.note_step(plain, t, 0.0, ok=True, more=True)
    spec.rows[1] = RowSpec(fixed=None, targets=[1])
    costs = spec.take_verify(1).costs
    assert sorted((c.drafted, round(c.step_s, 2)) for c in costs) == [(0, 0.15), (0, 0.15), (1, 0.25)]


def test_a_verify_shape_not_measured_for_long_is_tried_again_and_repriced():
    """A shape priced high by a few early rounds would never be chosen again,
    so its price would never change (suffix decoding on the 1.5B stayed at
    γ = 1 for a run): once stale it counts as unmeasured, and the rounds that
    measure it again replace the old ratios."""
    p = GammaPolicy()
    for _ in range(4):
        p.observe_cost(0, 0.10, rows=1, drafted_tokens=0, draft_s=0)
        p.observe_cost(2, 0.40, rows=1, drafted_tokens=2, draft_s=0)  # a slow moment: 4x plain
    for _ in range(8):
        p.observe_cost(0, 0.10, rows=1, drafted_tokens=0, draft_s=0)
    assert p.measured(2) and p.costs.ratios()[(1, 2)] == pytest.approx(4.0)
    for _ in range(p.costs.fresh_rounds + 1):
        p.observe_cost(1, 0.12, rows=1, drafted_tokens=1, draft_s=0)
        p.observe_cost(0, 0.10, rows=1, drafted_tokens=0, draft_s=0)
    assert not p.measured(2)  # stale: the policy tries γ = 2 again (GammaPolicy.best)
    for _ in range(4):
        p.observe_cost(2, 0.13, rows=1, drafted_tokens=2, draft_s=0)
        p.observe_cost(0, 0.10, rows=1, drafted_tokens=0, draft_s=0)
    for _ in range(8):
        p.observe_cost(0, 0.10, rows=1, drafted_tokens=0, draft_s=0)
    assert p.measured(2) and p.costs.ratios()[(1, 2)] == pytest.approx(1.3)
