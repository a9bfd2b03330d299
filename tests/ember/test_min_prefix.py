"""A cached prefix shorter than ``EngineConfig.min_cached_prefix`` is not
worth reusing: it saves a few tokens of prefill, and costs a cache copy, an
SSD read when the cold tier holds it, and the row's place in a batched prefill
(rows prefill together only from the same cache offset). Such a hit is a miss;
a longer one is served as before, from either tier, with the same tokens."""

from __future__ import annotations

import pytest

from ember import Engine, EngineConfig, SamplingParams
from engine.fake.gpu import expected_tokens

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
SHARED = list(b"<|im_start|>user\n")  # 17 bytes every chat prompt of this test starts with


def cfg(tmp_path=None, **kw) -> EngineConfig:
    return EngineConfig(backend="fake", ssd_cache_dir=str(tmp_path) if tmp_path else None, **kw)


async def test_a_prefix_shorter_than_the_minimum_is_a_miss_and_a_longer_one_a_hit():
    first = SHARED + list(b"tell me about caches, please")
    short = SHARED[:10] + list(b"XYZ something else entirely")  # 10 tokens in common
    long = SHARED + list(b"tell me about other things")  # 30 in common
    async with Engine.open(cfg(min_cached_prefix=16)) as engine:
        await engine.acomplete(first, PARAMS)
        a = await engine.acomplete(short, PARAMS)
        b = await engine.acomplete(long, PARAMS)
    assert a.usage.cached_tokens == 0
    assert b.usage.cached_tokens == len(SHARED) + len(b"tell me about ")
    assert a.token_ids == expected_tokens(short, 6, stop_at_eos=False)
    assert b.token_ids == expected_tokens(long, 6, stop_at_eos=False)


async def test_the_minimum_can_be_lowered_to_reuse_any_prefix():
    first = SHARED + list(b"tell me about caches, please")
    short = SHARED[:10] + list(b"XYZ something else entirely")
    async with Engine.open(cfg(min_cached_prefix=1)) as engine:
        await engine.acomplete(first, PARAMS)
        a = await engine.acomplete(short, PARAMS)
    assert a.usage.cached_tokens == 10
    assert a.token_ids == expected_tokens(short, 6, stop_at_eos=False)


async def test_no_ssd_restore_for_a_prefix_below_the_minimum(tmp_path):
    first = SHARED + list(b"a long conversation that went to disk " * 3)
    async with Engine.open(cfg(tmp_path, min_cached_prefix=16)) as engine:
        await engine.acomplete(first, PARAMS)
    short = SHARED[:10] + list(b"QQ a new conversation")
    async with Engine.open(cfg(tmp_path, min_cached_prefix=16)) as engine:  # RAM empty, the SSD holds `first`
        a = await engine.acomplete(short, PARAMS)
        restores = engine.stats()["ssd_cache"]["restores"]
        b = await engine.acomplete(first[:40] + list(b" and more"), PARAMS)
        restores_after = engine.stats()["ssd_cache"]["restores"]
    assert a.usage.cached_tokens == 0 and restores == 0
    assert b.usage.cached_tokens >= 39 and restores_after == 1


def test_the_minimum_is_validated():
    from engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="min_cached_prefix"):
        EngineConfig(backend="fake", min_cached_prefix=0).validate()
