"""Adaptive γ and a draft model's catch-up, in virtual time on the fake GPU.

The real run this reproduces (docs/bench/spec-real.md, issue #42): the 0.5B
drafting for the 1.5B accepted 84–100% of its drafts, yet adaptive γ ran at
0.47–0.70× plain decode on prompts of ~600–1000 tokens with 48-token answers.
Before its first draft a draft model feeds the whole prompt (the catch-up),
and the round prices leave that out, so the policy started drafting on a
round price that paid: the prompt's catch-up alone cost more than 47 tokens
of drafting could save. Here the fake drafter's step costs ~0.57× the fake
target's, its catch-up 0.0002 s a token (a 1000-token prompt: ~19 plain
rounds), and it agrees with the target 90% of the time.

On main's policy the long-prompt case measured 0.80× plain; with the catch-up
priced (``GammaPolicy._catch_up_pays``) 1.0×, and the case where drafting
pays (a short prompt, a long answer, a cheap drafter) stays a win.
"""

from __future__ import annotations

import anyio
import pytest

from ember import Engine, EngineConfig, SamplingParams
from engine.fake.draft_model import FakeDraftModel

AGREE = 0.9


def prompt(i: int, n: int) -> list[int]:
    """``n`` byte tokens of code-like text, different per request."""
    text = "".join(f"def f{i}_{k}(x):\n    return x * {k} + {i}\n" for k in range(n // 20 + 1))
    return list(text.encode()[:n])


async def decode_s(draft: FakeDraftModel | None, prompts: list[list[int]], tokens: int, warm: bool) -> float:
    """Virtual seconds the ``prompts`` took one after another on one engine
    (after a short warm-up request, when ``warm``, as any running engine has
    served: it measures the drafter's catch-up and round costs)."""
    cfg = EngineConfig(backend="fake", prompt_cache_gib=0, draft_model="fake-draft" if draft else None)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    async with Engine.open(cfg) as engine:
        if draft is not None:
            engine.speculation.drafter.core.model = draft
        if warm:
            await engine.acomplete(prompt(99, 30), SamplingParams(max_tokens=96, ignore_eos=True))
        t0 = anyio.current_time()
        for p in prompts:
            c = await engine.acomplete(p, params)
            assert len(c.token_ids) == tokens
        return anyio.current_time() - t0


@pytest.mark.anyio
async def test_adaptive_does_not_draft_where_the_prompts_catch_up_cannot_pay():
    """~1000-token prompts, 48-token answers, a drafter at ~0.57× the target's
    step: drafting would gain ~1.2× per round, ~0.08 s over an answer, and its
    catch-up of the prompt costs ~0.2 s. Adaptive must keep to plain decode."""
    fake = EngineConfig(backend="fake").fake
    prompts = [prompt(i, 1000) for i in range(3)]
    plain = await decode_s(None, prompts, 48, warm=True)
    slow = FakeDraftModel(fake, agree=AGREE, token_cost_s=0.006, feed_cost_s=0.0002)
    adaptive = await decode_s(slow, prompts, 48, warm=True)
    assert plain / adaptive >= 0.97, round(plain / adaptive, 3)


@pytest.mark.anyio
async def test_adaptive_still_drafts_where_drafting_pays():
    """A short prompt, a long answer, a cheap drafter (~0.19× the target's
    step) at the same acceptance: the catch-up is a few tokens, and drafting wins."""
    fake = EngineConfig(backend="fake").fake
    prompts = [prompt(i, 40) for i in range(2)]
    plain = await decode_s(None, prompts, 400, warm=False)
    cheap = FakeDraftModel(fake, agree=AGREE, token_cost_s=0.002, feed_cost_s=0.0002)
    adaptive = await decode_s(cheap, prompts, 400, warm=False)
    assert plain / adaptive > 1.1, round(plain / adaptive, 3)


def test_a_probe_that_would_catch_up_a_prompt_it_cannot_repay_is_not_run():
    """A lone row held before its first probe (its drafts not yet judged): the
    probe would make the draft model feed the whole prompt first. Even with
    every draft accepted, 40 tokens left cannot win back 1000 tokens of
    catch-up at a fifth of a plain round each, so the row decodes plainly for
    good; 4000 tokens left can, and a drafter with nothing to catch up (prompt
    lookup: no catch-up measured) probes as before."""
    from engine.speculation.policy import GammaPolicy

    def held(p: GammaPolicy, left: int, behind: int):
        p.observe_costs([(0, 0.010, 1, 0, 0.0)] * 8 + [(1, 0.016, 1, 1, 0.005)] * 4 + [(0, 0.010, 1, 0, 0.0)] * 8)
        row = p.new_row(None)
        row.consulted, row.left, row.behind = True, left, behind
        return row

    p = GammaPolicy()
    p.observe_catch_up(0.2, 100)  # 2 ms a token: a fifth of a plain round
    row = held(p, 40, 1000)
    assert p.after_hold(row) == (0, 1 << 30) and row.retired
    assert p.snapshot()["rows_retired"] == 1
    assert p.after_hold(held(p, 4000, 1000)) == (1, 0)
    free = GammaPolicy()
    assert free.after_hold(held(free, 40, 1000)) == (1, 0)
