"""A temperature below ``GREEDY_TEMPERATURE`` (1e-5) is greedy (issue #23
item 8): 1/T overflowed near 1e-39 and such requests produced random text."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ember.api import Engine
from engine.config import EngineConfig
from engine.fake.gpu import expected_tokens
from engine.mlx.sampling import RowSampler
from engine.types import GREEDY_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("t", [1e-39, 1e-30, 1e-8, GREEDY_TEMPERATURE / 2])
def test_tiny_temperatures_sample_the_argmax_on_mlx(t):
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((8, 512)).astype(np.float32))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for seed in range(3):
        got = RowSampler(SamplingParams(temperature=t, top_p=0.9), seed, 512)(logprobs)
        assert np.array_equal(np.array(got).ravel(), np.array(mx.argmax(logprobs, axis=-1)).ravel())


@pytest.mark.anyio
async def test_tiny_temperatures_are_greedy_on_the_fake_gpu():
    prompt = list(b"the same text as greedy")
    async with Engine.open(EngineConfig(backend="fake")) as engine:
        for t in (1e-39, 1e-6):
            out = await engine.acomplete(prompt, SamplingParams(max_tokens=12, temperature=t, seed=3, ignore_eos=True))
            assert out.token_ids == expected_tokens(prompt, 12, engine.backend.cfg, stop_at_eos=False)
