"""A cache fault is a miss: a RAM-tier entry whose cache cannot open for a row
(``prefix_view`` raising, or a view holding another length than the Scheduler
asked for) makes the MLX backend open the row empty and prefill the whole
prompt, counted in /stats (``scheduler.cache_faults``), never a failed request.
The fault is injected on the real backend with the bundled ``tiny``; the
oracle is the same engine's answer with no prompt cache at all."""

from __future__ import annotations

from typing import Any

import pytest

import engine.mlx.cache_ops as cache_ops
from ember.api import Engine
from engine.config import EngineConfig
from engine.mlx.cache_views import prefix_view
from engine.models import resolve_model
from engine.types import SamplingParams

pytestmark = [pytest.mark.anyio]

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = "class Point:\n    def __init__(self, x, y):\n"


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the MLX thread is a real thread


def cfg(**kw: Any) -> EngineConfig:
    return EngineConfig(**{"backend": "mlx", "model": str(resolve_model("tiny")), "prefill_chunk": 16, **kw})


def _raises(cache: list[Any], n: int) -> list[Any]:
    raise RuntimeError("injected: the entry's arrays are gone")


def _short(cache: list[Any], n: int) -> list[Any]:
    return prefix_view(cache, n - 1)  # a view one token short of what the row was promised


@pytest.mark.parametrize("fault", [_raises, _short], ids=["prefix_view-raises", "length-disagrees"])
@pytest.mark.parametrize("extra", [0, 5], ids=["cache-is-whole-prompt", "prompt-goes-on"])
async def test_a_ram_tier_fault_prefills_the_whole_prompt(monkeypatch, fault, extra):
    async with Engine.open(cfg(prompt_cache_gib=0)) as engine:
        tokens = engine.backend.tokenizer.encode(PROMPT)
        a = await engine.acomplete(tokens, SamplingParams(max_tokens=8, ignore_eos=True))
        b_prompt = tokens + a.token_ids[:-1] + a.token_ids[-1:] * extra
        never_cached = await engine.acomplete(b_prompt, GREEDY)
    async with Engine.open(cfg(prompt_cache_gib=0.5)) as engine:
        a2 = await engine.acomplete(tokens, SamplingParams(max_tokens=8, ignore_eos=True))
        assert a2.token_ids == a.token_ids
        monkeypatch.setattr(cache_ops, "prefix_view", fault)  # where _open_cache calls it
        b = await engine.acomplete(b_prompt, GREEDY)
        stats = engine.stats()
    assert b.finish_reason == "length"
    assert b.token_ids == never_cached.token_ids
    assert b.usage.cached_tokens == 0  # it was a miss, and says so
    assert stats["scheduler"]["cache_faults"] == 1
    assert stats["scheduler"]["cached_tokens"] == 0
