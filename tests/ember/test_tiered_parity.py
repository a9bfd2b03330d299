"""A restored prefix yields exactly the tokens a never-persisted one does.

* Real llama model (the bundled ``tiny``), mlx-lm's ``generate_step``: greedy
  tokens continued from a cache that went through the SSD tier equal those
  continued from the same cache kept in memory — plain (fp32 and bf16),
  quantized, rotating (wrapped) — and a partial-prefix restore that trims a
  divergent tail equals the in-memory cache trimmed the same way (and matches
  a fresh prefill's logits).
* The Scheduler's tiered take (RAM vs SSD: strictly longer wins, ties to RAM).
* The engine on the fake GPU in virtual time: shared prefixes hit, and after
  a restart with the same ``ssd_cache_dir`` the prefix comes back from disk;
  every output equals ``expected_tokens``, the cache-free oracle.
"""

from __future__ import annotations

import copy
import os

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, can_trim_prompt_cache, trim_prompt_cache

from actors.cold_tier import ColdTier, Store
from actors.scheduler_core import RowState, SchedulerConfig, SchedulerCore
from ember.api import Engine
from engine.config import EngineConfig
from engine.eventlog import EventLog
from engine.fake.gpu import FakeBackend, FakeGPUConfig, expected_tokens
from engine.kv import kvfile
from engine.kv.cold_io import ungated
from engine.kv.cold_store import ColdStore
from engine.kv.disk import RealDisk
from engine.kv.prompt_cache import PromptCache
from engine.ports import InlineDevice, LoopClock, ModelInfo, run_inline
from engine.types import SamplingParams

# ---------------------------------------------------------------------------
# Real model parity (mlx-lm directly, no engine).


@pytest.fixture(scope="module")
def model():
    from mlx_lm import load

    from engine.models import resolve_model

    path = resolve_model("tiny")
    m, _ = load(str(path))
    return m


class MlxCacheBackend:
    info = ModelInfo(
        model_id="tiny",
        vocab_size=2048,
        context_length=16384,
        config_fingerprint="fp",
        tokenizer_hash="tok",
        num_layers=6,
    )

    def cache_nbytes(self, cache):
        return kvfile.cache_bytes(cache)

    def trim_cache(self, cache, n):
        return trim_prompt_cache(cache, n)

    def cache_trimmable(self, cache):
        return can_trim_prompt_cache(cache)


@pytest.fixture
async def tier(tmp_path):
    be = MlxCacheBackend()
    store = ColdStore(
        RealDisk(), str(tmp_path), model_id="tiny", config_fingerprint="fp", tokenizer_hash="tok", max_bytes=1 << 30
    )
    clock = LoopClock()
    t = ColdTier(store, be, InlineDevice(clock), clock, io=run_inline)
    async with anyio.create_task_group() as tg:
        await tg.start(t.run)
        yield t
        t.stop()


def prompt_tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 2000, size=n).tolist()


def prefill(model, cache, tokens: list[int]) -> None:
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])


def continue_greedy(model, cache, last: list[int], n: int = 16, **kw) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(last), model, max_tokens=n, prompt_cache=cache, **kw)]


async def through_ssd(tier: ColdTier, tokens: list[int], cache, lookup: list[int]):
    """Store ``cache`` (an in-memory copy) as the entry for ``tokens``, then restore for ``lookup``."""
    assert await tier.ref.ask(Store(tokens=tokens, ns="", cache=copy.deepcopy(cache), wait_turn=ungated))
    restored, n = await tier.restore(lookup, "")
    assert restored is not None
    return restored, n


def _cast(model, dtype):
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p.astype(dtype) if isinstance(p, mx.array) else p, model.parameters()))


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("variant", ["plain_f32", "plain_bf16", "quantized", "rotating_wrapped"])
async def test_continuation_from_a_restored_cache_is_identical(model, tier, variant):
    P = prompt_tokens(120)
    kw = {}
    if variant == "plain_bf16":
        model = copy.deepcopy(model)
        _cast(model, mx.bfloat16)
    if variant == "rotating_wrapped":
        cache = [RotatingKVCache(max_size=64, keep=4) for _ in model.layers]
    else:
        cache = [KVCache() for _ in model.layers]
    prefill(model, cache, P[:-1])
    if variant == "quantized":
        cache = [c.to_quantized(group_size=64, bits=8) for c in cache]
        kw = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0)
    if variant == "plain_bf16":
        assert cache[0].keys.dtype == mx.bfloat16
    restored, n = await through_ssd(tier, P[:-1], cache, P[:-1] + [P[-1]])
    assert n == len(P) - 1
    assert type(restored[0]) is type(cache[0])
    want = continue_greedy(model, cache, P[-1:], **kw)
    got = continue_greedy(model, restored, P[-1:], **kw)
    assert got == want and len(want) == 16


@pytest.mark.slow
@pytest.mark.anyio
async def test_partial_prefix_restore_trims_the_divergent_tail(model, tier):
    P1 = prompt_tokens(100, seed=1)
    cache = [KVCache() for _ in model.layers]
    prefill(model, cache, P1)
    k = 70
    P2 = P1[:k] + prompt_tokens(30, seed=2)
    restored, n = await through_ssd(tier, P1, cache, P2)
    assert n == k and restored[0].offset == k
    reference = copy.deepcopy(cache)
    trim_prompt_cache(reference, len(P1) - k)  # the never-persisted cache, trimmed the same way
    for c in (restored, reference):
        prefill(model, c, P2[k:-1])
    got = continue_greedy(model, restored, P2[-1:])
    want = continue_greedy(model, reference, P2[-1:])
    assert got == want
    # and the trimmed prefix really is P2's: logits match a fresh full prefill
    fresh = [KVCache() for _ in model.layers]
    a = model(mx.array(P2)[None], cache=fresh)[0, -1]
    c2, _ = await tier.restore(P2, "")
    b = model(mx.array(P2[k:])[None], cache=c2)[0, -1]
    assert np.allclose(np.array(a), np.array(b), atol=1e-4)


# ---------------------------------------------------------------------------
# The Scheduler's tiered take.


class FakeCold:
    def __init__(self, longest: int = 0, fail: bool = False):
        self.n = longest
        self.fail = fail
        self.requests: list[tuple[int, list[int], str, int]] = []
        self.demotions: list[tuple[int, float | None]] = []

    def longest(self, tokens, ns):
        return self.n if len(tokens) > self.n else 0  # SSD holds a prefix of the long prompts only

    def closest(self, tokens, ns):
        return None, 0  # explains no miss

    def request_restore(self, rid, tokens, ns, min_len):
        if self.fail:
            raise RuntimeError("cold tier inbox full")
        self.requests.append((rid, tokens, ns, min_len))

    def demoted(self, n, next_due):
        self.demotions.append((n, next_due))


BE = FakeBackend()
P = list(range(30, 70))


def core_with(cold: FakeCold, ram_tokens: list[int] | None = None) -> SchedulerCore:
    clock = LoopClock()
    pc = PromptCache(BE, 1 << 30, now=lambda: 0.0)
    if ram_tokens:
        c = BE.make_cache()
        BE._feed(c, ram_tokens)
        pc.put(ram_tokens, "", c)
    return SchedulerCore(BE, SchedulerConfig(max_batch=4), clock, EventLog(), pc, cold)


def feed(tokens):
    c = BE.make_cache()
    BE._feed(c, tokens)
    return c


@pytest.mark.anyio
async def test_a_strictly_longer_ssd_prefix_parks_the_row_and_the_batch_goes_on():
    cold = FakeCold(longest=30)
    core = core_with(cold, ram_tokens=P[:10])
    core.admit(1, P, SamplingParams(max_tokens=4))
    core.admit(2, [1, 2, 3], SamplingParams(max_tokens=4))
    plan = core.plan()
    assert [o.rid for o in plan.open] == [2]  # row 1 waits for SSD; row 2 steps
    assert core.rows[1].state is RowState.RESTORING and cold.requests == [(1, P, "", 10)]
    assert core.has_work() and core.restoring == {1}
    core.restored(1, feed(P[:30]), 30)
    plan = core.plan()
    (o,) = plan.open
    assert (o.rid, o.cached) == (1, 30) and core.rows[1].cached == 30
    assert plan.prefill[0].tokens == P[30:39]


@pytest.mark.anyio
async def test_a_tie_goes_to_ram_and_a_miss_falls_back_to_the_ram_candidate():
    cold = FakeCold(longest=10)
    core = core_with(cold, ram_tokens=P[:10])
    core.admit(1, P, SamplingParams(max_tokens=4))
    (o,) = core.plan().open
    assert (o.rid, o.cached) == (1, 10) and cold.requests == []

    cold.n = 25
    core.admit(2, P, SamplingParams(max_tokens=4))
    assert core.plan().open == [] and core.rows[2].state is RowState.RESTORING
    core.restored(2, None, 0)  # the file was bad: a miss
    (o,) = core.plan().open
    assert (o.rid, o.cached) == (2, 10)


@pytest.mark.anyio
async def test_abort_while_restoring_and_a_broken_cold_tier():
    cold = FakeCold(longest=25)
    core = core_with(cold)
    core.admit(1, P, SamplingParams(max_tokens=4))
    core.plan()
    core.abort(1)
    assert 1 not in core.rows and core.restoring == set()
    core.restored(1, feed(P[:25]), 25)  # late answer: dropped
    assert not core.has_work() or core.plan().open == []
    cold.fail = True
    core.admit(2, P, SamplingParams(max_tokens=4))
    (o,) = core.plan().open
    assert (o.rid, o.cached) == (2, 0)  # the request itself is served cold


# ---------------------------------------------------------------------------
# The engine on the fake GPU, in virtual time.

FAKE = FakeGPUConfig(seed=3)


def cfg(tmp_path, **kw) -> EngineConfig:
    base = dict(backend="fake", fake=FAKE, ssd_cache_dir=str(tmp_path / "ssd"), ssd_demote_idle_s=30.0)
    base.update(kw)
    return EngineConfig(**base)


async def run(engine, prompt: list[int], n: int = 12, ns: str = ""):
    out = await engine.acomplete(prompt, SamplingParams(max_tokens=n, ignore_eos=True), ns=ns)
    return out.token_ids, out.usage.cached_tokens


def expect(prompt: list[int], n: int = 12) -> list[int]:
    return expected_tokens(prompt, n, FAKE, stop_at_eos=False)


SYS = list(b"You are a careful assistant. Answer briefly.\n")


@pytest.mark.anyio
async def test_shared_prefix_hits_ram_with_exact_tokens(tmp_path):
    async with Engine.open(cfg(tmp_path, ssd_cache_dir=None)) as engine:
        a, b = SYS + list(b"Q: 2+2?"), SYS + list(b"Q: capital of France?")
        toks, cached = await run(engine, a)
        assert (toks, cached) == (expect(a), 0)
        toks, cached = await run(engine, b)
        assert toks == expect(b) and cached == len(SYS) + 3
        toks, cached = await run(engine, a)
        assert toks == expect(a) and cached == len(a) - 1
        assert engine.stats()["prompt_cache"]["hits"] == 2 and "ssd_cache" not in engine.stats()


@pytest.mark.anyio
async def test_restart_restores_a_demoted_prefix_from_ssd(tmp_path):
    a = SYS + list(b"Summarize the design of the cold tier.")
    async with Engine.open(cfg(tmp_path, writebehind=False)) as engine:  # only demotion writes
        assert await run(engine, a) == (expect(a), 0)
        assert engine.stats()["ssd_cache"]["entries"] == 0
        assert engine.stats()["prompt_cache"]["entries"] == 1
        await anyio.sleep(31)  # idle past ssd_demote_idle_s: the entry moves to disk
        s = engine.stats()
        assert s["ssd_cache"]["demotions"] == 1 and s["ssd_cache"]["spills"] == 1 and s["ssd_cache"]["entries"] == 1
        assert s["prompt_cache"]["entries"] == 0
    async with Engine.open(cfg(tmp_path)) as engine:  # a restart: RAM is empty
        toks, cached = await run(engine, a)
        assert toks == expect(a) and cached == len(a) - 1
        b = a[:20] + list(b" -- something else entirely")
        toks, cached = await run(engine, b)
        assert toks == expect(b) and cached >= 20
        s = engine.stats()["ssd_cache"]
        assert s["restores"] >= 1 and s["corrupt_deleted"] == 0
        for key in (
            "dir",
            "entries",
            "bytes",
            "max_bytes",
            "restores",
            "spills",
            "restore_ms_last",
            "demotions",
            "corrupt_deleted",
        ):
            assert key in s


@pytest.mark.anyio
async def test_restart_after_a_direct_store_and_a_corrupt_file_is_a_miss(tmp_path):
    a = SYS + list(b"Write a haiku about disks.")
    async with Engine.open(cfg(tmp_path)) as engine:
        await run(engine, a)
        entry_tokens = a + expect(a)[:-1]
        snap = engine.prefix_cache.snapshot(entry_tokens, "")
        gate = engine.durability.gate.wait_turn  # the engine's idle gate, as the coordinator writes
        assert await engine.cold_tier.ref.ask(Store(tokens=entry_tokens, ns="", cache=snap, wait_turn=gate))
    async with Engine.open(cfg(tmp_path)) as engine:
        toks, cached = await run(engine, a + expect(a)[:5])
        assert toks == expect(a + expect(a)[:5]) and cached == len(a) + 4
    # flip a byte inside a tensor region's header hash: the next start deletes the file
    fp_dir = os.path.join(tmp_path, "ssd", FakeBackend(FAKE).info.config_fingerprint, "base")
    (name,) = os.listdir(fp_dir)
    with open(os.path.join(fp_dir, name), "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 0xFF]))
    async with Engine.open(cfg(tmp_path)) as engine:
        assert engine.stats()["ssd_cache"]["corrupt_deleted"] == 1
        assert await run(engine, a) == (expect(a), 0)


@pytest.mark.anyio
async def test_ram_evictions_spill_and_come_back_from_ssd(tmp_path):
    per_token = BE.cache_nbytes(feed([1]))
    prompts = [[k] + SYS for k in range(3)]
    gib = 70 * per_token / (1 << 30)  # RAM holds one entry of ~60 tokens
    async with Engine.open(cfg(tmp_path, prompt_cache_gib=gib, ssd_demote_idle_s=0)) as engine:
        for p in prompts:
            assert (await run(engine, p))[0] == expect(p)
        await anyio.sleep(1)
        s = engine.stats()
        assert s["prompt_cache"]["evictions"] == 2 and s["ssd_cache"]["spills"] >= 2
        toks, cached = await run(engine, prompts[0] + [1, 2])
        assert toks == expect(prompts[0] + [1, 2]) and cached == len(
            prompts[0]
        )  # diverges at the first generated token
        assert engine.stats()["ssd_cache"]["restores"] == 1


# ---------------------------------------------------------------------------
# The engine on MLX (bundled model, real threads): restart → restored prefix.


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the MLX thread needs a real loop
async def test_mlx_engine_restart_restores_the_prefix_and_matches_the_cold_run(tmp_path):
    from engine.models import resolve_model

    resolve_model("tiny")
    cfg = EngineConfig(backend="mlx", model="tiny", ssd_cache_dir=str(tmp_path / "ssd"), prefill_chunk=64)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    async with Engine.open(cfg) as engine:
        prompt = engine.encode("def restore(cache, tokens):\n    " * 20)[:300]
        cold = await engine.acomplete(prompt, sp)
        assert cold.usage.cached_tokens == 0
        await engine.acomplete(
            engine.encode("x = 1"), SamplingParams(max_tokens=2)
        )  # its first step closes the row above into RAM
        assert engine.stats()["prompt_cache"]["puts"] >= 1
        # A row that continues from a view of the stored entry, before the
        # entry is written to SSD: the snapshot shares the entry, so the row
        # must not have written into it (checked by the restored run below).
        branch = await engine.acomplete(prompt[:200] + engine.encode(" branch"), sp)
        assert branch.usage.cached_tokens == 200
        assert (await engine.aflush()).durable
    async with Engine.open(cfg) as engine:  # a restart: only the SSD tier knows the prefix
        warm = await engine.acomplete(prompt, sp)
        assert warm.usage.cached_tokens == len(prompt) - 1
        assert warm.token_ids == cold.token_ids
        s = engine.stats()["ssd_cache"]
        assert s["restores"] == 1 and s["corrupt_deleted"] == 0
