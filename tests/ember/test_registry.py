"""ember.registry on the fake GPU: load on demand, aliases, unknown names, keep-alive, LRU under a budget."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from ember import EngineConfig, FakeGPUConfig
from ember.registry import ModelNotFound, Registry
from engine.types import SamplingParams


def _registry(**kw):
    base = EngineConfig(backend="fake")
    reg = Registry(base, default="a", short_names=False, **kw)
    for name, seed in (("b", 1), ("c", 2)):
        reg.add_chat(name, msgspec.structs.replace(base, fake=FakeGPUConfig(seed=seed)), size_bytes=100)
    reg.entries["a"].size_bytes = 100
    return reg


async def _run(reg, body):
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        try:
            await body()
        finally:
            await reg.shutdown()
            tg.cancel_scope.cancel()


def test_load_on_demand_alias_and_unknown():
    reg = _registry(aliases={"claude-haiku-*": "b"})

    async def body():
        eb = await reg.engine_for("claude-haiku-4-5")
        ea = await reg.engine_for(None)
        assert eb is not ea and reg.entries["b"].state == "loaded"
        out_b = await eb.acomplete([1, 2, 3], SamplingParams(max_tokens=8))
        out_a = await ea.acomplete([1, 2, 3], SamplingParams(max_tokens=8))
        assert out_a.token_ids != out_b.token_ids  # two different fake models
        with pytest.raises(ModelNotFound, match="'a', 'b', 'c'|a, b, c"):
            await reg.engine_for("nope")

    anyio.run(_run, reg, body, backend="asyncio")


def test_keep_alive_and_lru_budget_in_virtual_time():
    import async_solipsism

    reg = _registry(keep_alive_s=60.0, max_memory=250)

    async def body():
        await reg.engine_for("b")
        await reg.engine_for("c")
        assert {e.name for e in reg.loaded()} == {"b", "c"}
        await anyio.sleep(61)  # virtual: b and c idle past their keep-alive; a (--model) stays
        assert {e.name for e in reg.loaded()} == set()
        await reg.engine_for("a")
        await reg.engine_for("b")
        await reg.engine_for("c")  # 3 x 100 > 250: the least recently used (a) goes
        assert {e.name for e in reg.loaded()} == {"b", "c"} and reg.evictions["memory"] == 1

    anyio.run(_run, reg, body, backend="asyncio", backend_options={"loop_factory": async_solipsism.EventLoop})


def test_a_drafter_counts_in_its_models_memory_estimate():
    """--draft-model loads inside --model's engine: the estimate before a load adds its weights on disk."""
    from engine.models import BUNDLED

    def disk(name):
        return sum(p.stat().st_size for p in BUNDLED[name].glob("*.safetensors"))

    def estimate(draft):
        base = EngineConfig(backend="mlx", model="tiny", draft_model=draft)
        return Registry(base, default="tiny", short_names=False).entries["tiny"].size_bytes

    assert estimate(None) == estimate("ngram") == disk("tiny")  # prompt lookup holds no model
    assert estimate("tiny-draft") == disk("tiny") + disk("tiny-draft")


def test_a_drafter_counts_in_its_models_measured_memory():
    from types import SimpleNamespace

    from actors.drafter_cores import ModelDrafterCore, NgramDrafterCore
    from ember.registry import measure

    def engine(core):
        spec = SimpleNamespace(drafter=SimpleNamespace(core=core)) if core is not None else None
        return SimpleNamespace(backend=SimpleNamespace(weight_bytes=100), speculation=spec, stats=dict)

    drafted = measure(engine(ModelDrafterCore(SimpleNamespace(weight_bytes=7))))
    assert drafted["draft_weights_bytes"] == 7 and sum(drafted.values()) == 107
    for core in (None, NgramDrafterCore()):
        assert "draft_weights_bytes" not in measure(engine(core)) and sum(measure(engine(core)).values()) == 100
