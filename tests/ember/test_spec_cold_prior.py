"""Adaptive γ on a cold engine with a draft model, in virtual time on the fake GPU.

Issue #42: before a round has been measured the policy prices a draft token at
``slope_prior`` (0.1 of a plain round, right for prompt lookup) and a draft
model's catch-up per token at nothing. A draft model's step costs ~0.4–1.1×
the target's, so on a FRESH engine four requests arriving together chose to
draft together at γ = 3, and the first batch of a server ran at 0.61–0.72×
plain decode. Now ``ember.spec_build.draft_prior`` measures the drafter's step
and catch-up against the target's step when the engine is built and seeds the
policy with them (``GammaPolicy(draft_prior=, catch_up_prior=)``).

Every engine here is fresh: nothing measured before the cell. Run with ``-s``
to see the ratios (plain decode's seconds over adaptive γ's).
"""

from __future__ import annotations

import anyio
import msgspec
import pytest

from ember import Engine, EngineConfig, SamplingParams
from engine.config import FakeGPUConfig

TOKENS = 48
FEED_S = 0.00005  # a caught-up context token of the drafter (the target's prefill: 0.00005 s a token)


def prompt(i: int, n: int) -> list[int]:
    """``n`` byte tokens of chat-like text, different per request."""
    words = ["the", "user", "asks", "how", "to", "sort", "a", "list", "in", "python", "with", "key", "and", "lambda"]
    text = " ".join(words[(i * 7 + k * 3) % len(words)] + str(k % 10) for k in range(n))
    return list(text.encode()[:n])


def config(token_s: float, agree: float) -> EngineConfig:
    fake = FakeGPUConfig(draft_token_s=token_s, draft_feed_s=FEED_S)
    return EngineConfig(backend="fake", fake=fake, prompt_cache_gib=0, max_batch=8, draft_model=f"fake-draft:{agree}")


async def cold_s(cfg: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> float:
    """Virtual seconds of the prompts sent together to a fresh engine, from
    the first request to the last token of all (prefill included)."""
    async with Engine.open(cfg) as engine:
        t0 = anyio.current_time()

        async def one(p: list[int]) -> None:
            c = await engine.acomplete(p, params)
            assert len(c.token_ids) == TOKENS

        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(one, p)
        return anyio.current_time() - t0


async def cold_ratio(rows: int, token_s: float, agree: float) -> float:
    """Plain decode's seconds over adaptive γ's, each on a fresh engine."""
    cfg = config(token_s, agree)
    spec = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    plain = msgspec.structs.replace(spec, speculate=False)
    prompts = [prompt(i, 100 + (53 * i) % 100) for i in range(rows)]
    return await cold_s(cfg, prompts, plain) / await cold_s(cfg, prompts, spec)


@pytest.mark.anyio
@pytest.mark.parametrize(("token_s", "agree"), [(0.006, 0.8), (0.010, 0.8), (0.006, 0.95)])
async def test_a_cold_engines_first_batch_does_not_lose_to_an_expensive_drafter(token_s, agree):
    """Four rows at once, the drafter's step 0.57× or 0.95× the target's (0.0105 s)."""
    ratio = await cold_ratio(4, token_s, agree)
    print(f"cold, batch 4, drafter {token_s / 0.0105:.2f}x the target's step, {agree:.0%} agreement: {ratio:.3f}")
    assert ratio >= 0.97, round(ratio, 3)


@pytest.mark.anyio
async def test_a_cold_engine_still_drafts_alone_with_a_cheap_drafter():
    ratio = await cold_ratio(1, 0.002, 0.95)
    print(f"cold, batch 1, drafter 0.19x the target's step, 95% agreement: {ratio:.3f}")
    assert ratio > 1.0, round(ratio, 3)


@pytest.mark.anyio
async def test_the_policy_is_seeded_with_the_drafters_measured_costs():
    """The fake drafter reports its configured costs; the policy's priors are
    them over the target's one-row step (decode_c + decode_d), and the
    model-free drafters keep the old priors (0.1 a draft token, no catch-up)."""
    fake = FakeGPUConfig()
    target = fake.decode_c + fake.decode_d
    async with Engine.open(config(0.006, 0.8)) as engine:
        assert engine.speculation is not None
        policy = engine.speculation.verifier.core.policy
        assert policy.costs.draft_prior == pytest.approx(0.006 / target)
        assert policy.catch_up_prior == pytest.approx(FEED_S / target)
        assert policy.catch_up_token_s == pytest.approx(FEED_S / target)  # nothing measured: plain rounds priced at 1
    for name in ("ngram", "suffix"):
        cfg = EngineConfig(backend="fake", prompt_cache_gib=0, draft_model=name)
        async with Engine.open(cfg) as engine:
            assert engine.speculation is not None
            policy = engine.speculation.verifier.core.policy
            assert policy.costs.draft_prior == 0.0 and policy.catch_up_token_s == 0.0
            assert policy.costs.ratio(1, 2) == pytest.approx(1.2)
    fixed = msgspec.structs.replace(config(0.006, 0.8), num_draft_tokens=3)
    async with Engine.open(fixed) as engine:
        assert engine.speculation is not None
        assert engine.speculation.verifier.core.policy.costs.draft_prior == 0.0  # a fixed γ prices nothing


def test_a_draft_token_is_priced_at_the_drafters_step_until_rounds_are_measured():
    """The prior in plain rounds: the verify share per row (0.1 a draft token)
    plus the draft model's step per draft token, whatever the batch; once plain
    rounds are measured, the step is in one-row plain rounds (a line through
    the sizes measured). A verify round measured at a size replaces it there."""
    from engine.speculation.costs import RoundCosts

    free, model = RoundCosts(), RoundCosts(draft_prior=0.6)
    assert free.ratio(4, 12) == pytest.approx(1 + 0.1 * 3)  # prompt lookup: as before
    assert model.ratio(4, 12) == pytest.approx(1 + 0.1 * 3 + 0.6 * 12)
    assert model.ratio(1, 2) == pytest.approx(1 + 0.1 * 2 + 0.6 * 2)
    for c in (free, model):
        c.observe_many([(1, 0, 0.010)] * 4 + [(4, 0, 0.012)] * 4)
    assert model.ratio(4, 12) == pytest.approx(1 + 0.1 * 3 + 0.6 * 0.010 * 12 / 0.012)
    model.observe_many([(4, 12, 0.030)] * 2 + [(4, 24, 0.048)] * 2 + [(4, 0, 0.012)] * 8)
    assert model.ratio(4, 12) == pytest.approx(0.030 / 0.012)  # measured: the prior is gone
