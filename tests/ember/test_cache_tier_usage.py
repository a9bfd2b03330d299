"""Which tier a request's cached prefix came from: ``Usage.ssd_cached_tokens``
(the part of ``cached_tokens`` an SSD restore brought) and the Scheduler's
``ssd_cached_tokens`` / ``prefilled_tokens`` counters, which the dashboard's
cache-share and prefill-speed figures are made of."""

from __future__ import annotations

import pytest

from ember import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


async def test_a_restore_counts_as_ssd_and_a_ram_hit_as_ram(tmp_path):
    prompt = list(b"<|im_start|>user\na long conversation that went to disk " * 3)
    cfg = EngineConfig(backend="fake", ssd_cache_dir=str(tmp_path))
    async with Engine.open(cfg) as engine:
        cold = await engine.acomplete(prompt, PARAMS)
        ram = await engine.acomplete(prompt, PARAMS)
        sched = engine.stats()["scheduler"]
    assert cold.usage.cached_tokens == 0 and cold.usage.ssd_cached_tokens == 0
    assert ram.usage.cached_tokens > 0 and ram.usage.ssd_cached_tokens == 0
    assert sched["ssd_cached_tokens"] == 0
    # each prompt's last token is not prefilled: it is the first decode step's input
    assert sched["prefilled_tokens"] == sched["prompt_tokens"] - sched["cached_tokens"] - 2

    async with Engine.open(cfg) as engine:  # RAM empty; the SSD holds the prompt
        ssd = await engine.acomplete(prompt, PARAMS)
        stats = engine.stats()
    assert stats["ssd_cache"]["restores"] == 1
    assert ssd.usage.cached_tokens > 0 and ssd.usage.ssd_cached_tokens == ssd.usage.cached_tokens
    assert stats["scheduler"]["ssd_cached_tokens"] == ssd.usage.cached_tokens
    assert stats["scheduler"]["prefilled_tokens"] == len(prompt) - 1 - ssd.usage.cached_tokens
