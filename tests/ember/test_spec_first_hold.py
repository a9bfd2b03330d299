"""A new request's first verdict, on prices only the engine's past requests set.

The real run this reproduces (docs/bench/spec.md, "Issue #21, third pass"):
``python -m bench.spec.sweep --paired`` on SmolLM2-135M with prompt lookup runs,
on one engine, plain decode of the ``copy`` request, then the same request
at γ = 4 and γ = 6 (every draft accepted), then adaptive γ. The fixed-γ
requests never decode a costed plain round (their first token comes with
the prefill), so only their verify rounds within ``near`` (8) rounds of the
plain request's are priced: the first rounds at a new verify width, slow
under load. The γ = 6 rounds are never priced at all. The adaptive request's
first choice then saw one shape priced at ~3× plain and the engine-wide
acceptance (~0.7, still rising from the 0.5 prior), chose plain decode and,
pricing a γ = 1 probe at ~2.9× plain, held for the probe-budget spacing of
~95 rounds: longer than its 48 tokens, so it never drafted at all.
"""

from __future__ import annotations

from actors.verifier import StepCost, VerifierCore, Verify, Window
from engine.speculation.policy import GammaPolicy

PLAIN_S = 0.094  # a plain SmolLM2 round, as measured


def verify_s(drafts: int, cold: bool = False) -> float:
    """What a verify round costs: ~1.6× plain plus a little per draft; the
    first rounds after plain decode, at a new width and under load, ~3.2×."""
    return PLAIN_S * (3.2 if cold else 1.6 + 0.05 * drafts)


def fixed_request(
    core: VerifierCore, rid: int, gamma: int, rounds: int, cold: int, costs: list[StepCost]
) -> list[StepCost]:
    """A request at fixed γ whose drafts are all accepted; its round costs
    reach the Verifier with a later Verify, as the Scheduler sends them."""
    lag: list[StepCost] = []
    core.verify(Verify(windows=[Window(rid=rid, drafts=[], targets=[5], fixed_gamma=gamma)], costs=costs))
    for i in range(rounds):
        lag.append(StepCost(gamma=gamma, step_s=verify_s(gamma, cold=i < cold), rows=1, drafted=gamma))
        sent, lag = lag[:-1], lag[-1:]
        core.verify(
            Verify(
                windows=[Window(rid=rid, drafts=[7] * gamma, targets=[7] * gamma + [8], fixed_gamma=gamma)], costs=sent
            )
        )
    core.forget([rid])
    return lag


def adaptive_drafts(core: VerifierCore, rid: int, tokens: int, costs: list[StepCost]) -> int:
    """Run an adaptive request of ``tokens`` tokens whose drafts are all
    accepted; the draft tokens it fed."""
    made, drafted, gamma, hold = 0, 0, 0, 0
    pending = list(costs)
    v = core.verify(Verify(windows=[Window(rid=rid, drafts=[], targets=[5])], costs=pending)).verdicts[0]
    pending, made, gamma, hold = [], 1, v.gamma_next, v.hold
    while made < tokens:
        if gamma == 0 and hold > 0:  # a plain round the Scheduler emits itself
            pending.append(StepCost(gamma=0, step_s=PLAIN_S, rows=1))
            made, hold = made + 1, hold - 1
            continue
        g = min(gamma, tokens - made - 1)
        pending.append(StepCost(gamma=g, step_s=verify_s(g) if g else PLAIN_S, rows=1, drafted=g))
        w = Window(rid=rid, drafts=[7] * g, targets=[7] * g + [8])
        v = core.verify(Verify(windows=[w], costs=pending)).verdicts[0]
        pending, drafted, made = [], drafted + g, made + len(v.tokens)
        gamma, hold = v.gamma_next, v.hold
    return drafted


def test_a_new_request_probes_within_its_length_when_past_prices_say_hold():
    core = VerifierCore(GammaPolicy())
    plain_request = [StepCost(gamma=0, step_s=PLAIN_S, rows=1) for _ in range(16)]
    left = fixed_request(core, 3, 4, rounds=10, cold=8, costs=plain_request)
    left = fixed_request(core, 4, 6, rounds=7, cold=0, costs=left)
    assert adaptive_drafts(core, 5, 48, costs=left) > 0
