"""``Usage.cache_miss`` from the Scheduler on the fake GPU: absent on a first
turn and on a turn that extends the last one, set where a prompt left a longer
cached sequence, from the RAM tier or (after a restart) the SSD tier; counted
in the Scheduler's ``cache_diverged``."""

from __future__ import annotations

import pytest

from ember import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
TURN1 = list(b"<|system|>you are terse\n<|user|>read the file main.py please\n<|assistant|>")


async def test_an_edited_turn_reports_where_it_diverged():
    async with Engine.open(EngineConfig(backend="fake")) as engine:
        first = await engine.acomplete(TURN1, PARAMS)
        turn2 = TURN1 + first.token_ids + list(b"\n<|user|>now the tests\n<|assistant|>")
        second = await engine.acomplete(turn2, PARAMS)
        at = bytes(TURN1).index(b"main.py")  # "main.py" becomes "util.py"
        edited = turn2[:at] + list(b"util") + turn2[at + 4 :]
        third = await engine.acomplete(edited, PARAMS)
        sched = engine.stats()["scheduler"]
    assert first.usage.cache_miss is None  # nothing cached: no sequence to leave
    assert second.usage.cache_miss is None and second.usage.cached_tokens >= len(TURN1)
    miss = third.usage.cache_miss
    assert miss is not None and miss.tier == "ram"
    assert miss.diverged_at == at == third.usage.cached_tokens
    assert miss.cached_tokens_available == len(turn2) + len(second.token_ids) - 1
    assert miss.window_start == at - 12
    assert miss.prompt_window == edited[at - 12 : at + 12] and b"the file util.py" in bytes(miss.prompt_window)
    assert miss.cached_window == turn2[at - 12 : at + 12] and b"the file main.py" in bytes(miss.cached_window)
    assert sched["cache_diverged"] == 1


async def test_a_miss_against_the_ssd_tier(tmp_path):
    cfg = EngineConfig(backend="fake", ssd_cache_dir=str(tmp_path))
    async with Engine.open(cfg) as engine:
        await engine.acomplete(TURN1, PARAMS)
    async with Engine.open(cfg) as engine:  # RAM empty; the SSD holds turn 1
        at = bytes(TURN1).index(b"terse")  # "terse" becomes "verbose"
        edited = TURN1[:at] + list(b"verbose") + TURN1[at + 5 :]
        got = await engine.acomplete(edited, PARAMS)
    miss = got.usage.cache_miss
    assert miss is not None and (miss.tier, miss.diverged_at) == ("ssd", at)
