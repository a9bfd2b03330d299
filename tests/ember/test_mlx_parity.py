"""The Engine on MLX against mlx-lm itself, on the bundled ``tiny`` model.

References come from ``mlx_lm.stream_generate`` on a separately loaded copy
of the same model, computed before the engine starts (never recorded
outputs). These tests run a real event loop: the MLX thread is real.
``EMBER_TEST_MODEL`` may point at another mlx-lm model directory.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from ember.api import Engine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.models import resolve_model  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = os.environ.get("EMBER_TEST_MODEL", "tiny")
CHUNK = 64
PROMPTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "# Utilities for parsing\n",
]
N = 32


def long_text(tok: Any, n_tokens: int) -> str:
    """Python-looking text of more than ``n_tokens`` tokens (distinct lines, so
    the tokenizer cannot fold it into a few long tokens)."""
    lines: list[str] = []
    while len(tok.encode("".join(lines))) <= n_tokens:
        i = len(lines)
        lines.append(f"value_{i} = compute({i * 7 % 13}, name='item{i}', scale={i / 4})\n")
    return "".join(lines)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the MLX thread is a real thread: no virtual time here


@pytest.fixture(scope="module")
def path():
    return str(resolve_model(MODEL))


@pytest.fixture(scope="module")
def ref(path):
    """mlx-lm's own model and tokenizer (EOS off, like ignore_eos)."""
    model, tok = load(path)
    tok.eos_token_ids = set()
    return model, tok


def mlx_run(ref, prompt: str | list[int], n: int = N, **kw: Any) -> tuple[list[int], list[str]]:
    """mlx-lm's tokens and streamed text pieces (one per token)."""
    model, tok = ref
    out = list(stream_generate(model, tok, prompt, max_tokens=n, prefill_step_size=CHUNK, **kw))
    return [r.token for r in out], [r.text for r in out]


def mlx_tokens(ref, prompt: str | list[int], n: int = N, **kw: Any) -> list[int]:
    return mlx_run(ref, prompt, n, **kw)[0]


def cfg(path: str, **kw: Any) -> EngineConfig:
    return EngineConfig(**{"backend": "mlx", "model": path, "prefill_chunk": CHUNK, "prompt_cache_gib": 0, **kw})


GREEDY = SamplingParams(max_tokens=N, ignore_eos=True)


async def test_greedy_matches_mlx_lm(path, ref):
    messages = [{"role": "user", "content": "Write a function."}]
    chat_ids = ref[1].apply_chat_template(messages, add_generation_prompt=True)
    prompts = PROMPTS + [long_text(ref[1], 3 * CHUNK)]  # the last one takes several prefill chunks
    expected = [mlx_run(ref, p) for p in prompts]
    chat_expected = mlx_tokens(ref, chat_ids)
    async with Engine.open(cfg(path)) as engine:
        got = [await engine.acomplete(p, GREEDY) for p in prompts]
        chat_tokens: list[int] = []
        async for d in engine.achat(messages, GREEDY):
            chat_tokens += d.token_ids
    assert [c.token_ids for c in got] == [toks for toks, _ in expected]
    assert [c.text for c in got] == ["".join(text) for _, text in expected]
    assert all(c.finish_reason == "length" for c in got)
    assert chat_tokens == chat_expected


async def test_concurrent_requests_match_each_alone(path):
    async with Engine.open(cfg(path, max_batch=8)) as engine:
        alone = [(await engine.acomplete(p, GREEDY)).token_ids for p in PROMPTS[:4]]
        together = await asyncio.gather(*(engine.acomplete(p, GREEDY) for p in PROMPTS[:4]))
        assert engine.backend.counters["pipelined"] > 0
    assert [c.token_ids for c in together] == alone


@pytest.mark.parametrize("extra", [0, 1], ids=["cache-is-whole-prompt", "cache-is-prompt-minus-one"])
async def test_prompt_cache_hit_gives_the_cold_tokens(path, ref, extra):
    """Request A leaves prompt+output in the RAM prompt cache; B's prompt is that
    (plus ``extra`` tokens), so B opens from a cache of ``len(B) - 1`` tokens
    (the Scheduler keeps one to feed; with extra=0 the backend trims the cache)."""
    tok = ref[1]
    a_prompt = tok.encode(PROMPTS[2])
    async with Engine.open(cfg(path, prompt_cache_gib=0.5)) as engine:
        a = await engine.acomplete(a_prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        stored = a_prompt + a.token_ids[:-1]  # the last sampled token was never fed
        b_prompt = stored + a.token_ids[-1:] * extra
        b = await engine.acomplete(b_prompt, GREEDY)
    assert b.usage.cached_tokens == len(b_prompt) - 1
    assert b.token_ids == mlx_tokens(ref, b_prompt)


async def test_event_loop_runs_during_a_long_prefill(path, ref):
    prompt = ref[1].encode(long_text(ref[1], 1200))
    ticks_in_prefill = 0
    done = False
    async with Engine.open(cfg(path, prefill_chunk=4096)) as engine:
        probe = StepProbe(engine)

        async def ticker() -> None:
            nonlocal ticks_in_prefill
            while not done:
                await asyncio.sleep(0.001)
                plan = probe.in_flight
                if plan is not None and sum(len(c.tokens) for c in plan.prefill) > 1000:
                    ticks_in_prefill += 1

        task = asyncio.create_task(ticker())
        await engine.acomplete(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        done = True
        await task
    assert probe.max_prefill > 1000  # the whole prompt went in one step ...
    assert ticks_in_prefill >= 3  # ... and the loop kept running meanwhile


async def test_chunked_prefill_progress_is_in_stats(path, ref):
    prompt = ref[1].encode(long_text(ref[1], 8 * CHUNK))
    total = len(prompt) - 1
    async with Engine.open(cfg(path)) as engine:
        probe = StepProbe(engine)
        await engine.acomplete(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    seen = [(p["done"], p["total"]) for snap in probe.prefill_stats for p in snap]
    assert {t for _, t in seen} == {total}
    done = [d for d, _ in seen]
    assert done == sorted(done) and len(done) >= total // CHUNK - 1
    assert all(0 < d < total for d in done)


async def test_defaults_are_mlx_and_the_bundled_tiny():
    config = EngineConfig()
    assert (config.backend, config.model) == ("mlx", "tiny")
    resolve_model("tiny")
    async with Engine.open(EngineConfig(prompt_cache_gib=0)) as engine:
        assert engine.info.model_id == "tiny"
        out = await engine.acomplete("def ", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


async def test_seeded_sampling_is_reproducible_and_matches_mlx_lm(path, ref):
    params = SamplingParams(max_tokens=N, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True)
    mx.random.seed(1234)
    expected = mlx_tokens(ref, PROMPTS[0], sampler=make_sampler(0.9, top_p=0.95, top_k=40))
    async with Engine.open(cfg(path)) as engine:
        first = await engine.acomplete(PROMPTS[0], params)
        # Again, now sharing the batch with other sampled requests.
        others = [SamplingParams(max_tokens=N, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
        second, *rest = await asyncio.gather(
            engine.acomplete(PROMPTS[0], params), *(engine.acomplete(PROMPTS[1], o) for o in others)
        )
    assert first.token_ids == second.token_ids == expected
    assert rest[0].token_ids != rest[1].token_ids  # different seeds, different draws


async def test_stop_string_spanning_tokens_and_max_tokens(path, ref):
    greedy, pieces = mlx_run(ref, PROMPTS[0], 48)
    text = "".join(pieces)
    # A 2-character stop string made of the last character of one token's text
    # and the first of the next, at its first occurrence in the output.
    ends = [len("".join(pieces[: k + 1])) for k in range(len(pieces))]
    stop = next(
        text[e - 1 : e + 1]
        for k, e in enumerate(ends[:-1])
        if pieces[k] and pieces[k + 1] and text.find(text[e - 1 : e + 1]) == e - 1
    )
    async with Engine.open(cfg(path)) as engine:
        stopped = await engine.acomplete(PROMPTS[0], SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop]))
        short = await engine.acomplete(PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.find(stop)]
    assert short.finish_reason == "length"
    assert short.token_ids == greedy[:5]


class StepProbe:
    """Wraps the Scheduler's device to see each step's plan while it runs and
    the prefill progress the engine reports at that moment."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.inner = engine.scheduler.device
        self.in_flight: Any = None
        self.max_prefill = 0
        self.prefill_stats: list[list[dict[str, int]]] = []
        engine.scheduler.device = self

    async def run(self, fn: Any, *args: Any, cost_s: float = 0.0) -> Any:
        plan = args[0] if args else None
        if plan is not None and hasattr(plan, "prefill"):
            self.max_prefill = max(self.max_prefill, sum(len(c.tokens) for c in plan.prefill))
            snap = self.engine.stats()["scheduler"]["prefill"]
            if snap:
                self.prefill_stats.append(snap)
        self.in_flight = plan
        try:
            return await self.inner.run(fn, *args, cost_s=cost_s)
        finally:
            self.in_flight = None

    def close(self) -> None:
        self.inner.close()
