"""One SSD byte cap across models (issue #30; engine/kv/budget.py): two fake-GPU
engines on one in-memory disk draw on one ``SsdBudget``. One model's writes evict
the other's least recently used entries; an evicted entry is a miss, never a
wrong token; files an earlier run left count and go first; the registry gives
each model its own folder under the one cap. Virtual time, fake GPU."""

from __future__ import annotations

import os

import msgspec
import pytest

from ember import Engine, EngineConfig, FakeGPUConfig, Ports, SamplingParams
from ember.registry import Registry
from ember.ssd_folders import config_key, model_ssd_dir
from engine.fake.disk import FaultyDisk
from engine.fake.gpu import expected_tokens
from engine.kv.budget import SsdBudget, scan_offline

pytestmark = pytest.mark.anyio

GIB = 1 << 30
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def cfg(folder: str, seed: int = 0) -> EngineConfig:
    return EngineConfig(backend="fake", fake=FakeGPUConfig(seed=seed), ssd_cache_dir=folder, writebehind=True)


def prompt(tag: str) -> list[int]:
    return list(f"{tag}: the same length for every prompt here. ".encode() * 3)


def kv_files(disk: FaultyDisk, under: str) -> list[str]:
    return [p for p in disk.files() if p.endswith(".kv") and p.startswith(under + "/")]


async def entry_bytes() -> int:
    """One entry's file size for a ``prompt()`` + 4 tokens (all are alike), measured."""
    disk = FaultyDisk(0)
    async with Engine.open(cfg("/probe"), ports=Ports(disk=disk)) as engine:
        await engine.acomplete(prompt("p-0"), PARAMS)
        assert (await engine.aflush()).flushed == 1
        return int(engine.stats()["ssd_cache"]["bytes"])


async def written(engine: Engine, tag: str) -> None:
    done = await engine.acomplete(prompt(tag), PARAMS)
    assert done.token_ids == expected_tokens(prompt(tag), 4, engine.config.fake, stop_at_eos=False)
    assert (await engine.aflush()).durable


async def test_one_models_writes_evict_the_others_oldest_entries_and_the_cap_holds():
    size = await entry_bytes()
    disk = FaultyDisk(1)
    budget = SsdBudget(int(2.5 * size))  # room for two entries, whichever model wrote them
    ports = Ports(disk=disk, ssd_budget=budget)
    async with (
        Engine.open(cfg("/kv/a"), ports=ports) as a,
        Engine.open(cfg("/kv/b", seed=7), ports=ports) as b,
    ):
        await written(b, "b-0")
        await written(a, "a-1")
        assert len(kv_files(disk, "/kv/b")) == 1 and budget.bytes == 2 * size  # both fit
        await written(a, "a-2")  # a third entry: the globally oldest goes, and it is b's
        assert kv_files(disk, "/kv/b") == [] and len(kv_files(disk, "/kv/a")) == 2
        assert budget.bytes <= budget.max_bytes
        assert sum(int(f.endswith(".kv")) for f in disk.files()) * size == budget.bytes  # the count is the disk's
        b_ssd, a_ssd = b.stats()["ssd_cache"], a.stats()["ssd_cache"]
        assert b_ssd["evicted_by_others"] == 1 and b_ssd["entries"] == 0
        assert a_ssd["evicted_by_others"] == 0 and a_ssd["shared"]["evicted_across"] == 1
        assert a_ssd["max_bytes"] == budget.max_bytes
        # b's tier restores nothing for the evicted prefix: a miss, not an error
        assert await b.cold_tier.restore(prompt("b-0") + [1], "") == (None, 0)
        # b writes again: now a's least recently used entry goes, not a's newest
        await written(b, "b-9")
        assert [len(kv_files(disk, d)) for d in ("/kv/a", "/kv/b")] == [1, 1]
        assert a.stats()["ssd_cache"]["evicted_by_others"] == 1
        assert await a.cold_tier.restore(prompt("a-2") + [1], "") != (None, 0)  # the newer one stayed
        # a-1's own entry went: what restores for it is only what it shares with a-2 ("a-")
        shared = len(os.path.commonprefix([prompt("a-1"), prompt("a-2")]))
        assert (await a.cold_tier.restore(prompt("a-1") + [1], ""))[1] == shared == 2


async def test_an_unloaded_models_files_count_and_its_reload_serves_the_evicted_prefix_cold():
    size = await entry_bytes()
    disk = FaultyDisk(2)
    budget = SsdBudget(int(2.5 * size))
    ports = Ports(disk=disk, ssd_budget=budget)
    b_cfg = cfg("/kv/b", seed=7)
    async with Engine.open(b_cfg, ports=ports) as b:  # loaded, written, unloaded
        await written(b, "b-1")
        await written(b, "b-2")
    assert budget.bytes == 2 * size  # its files stay on disk and in the count
    async with Engine.open(cfg("/kv/a"), ports=ports) as a:
        await written(a, "a-1")  # over the cap: b's oldest goes though b is not loaded
    assert len(kv_files(disk, "/kv/b")) == 1 and budget.bytes <= budget.max_bytes
    async with Engine.open(b_cfg, ports=ports) as b:  # reloaded: its RAM tier is empty
        evicted = await b.acomplete(prompt("b-1"), PARAMS)
        kept = await b.acomplete(prompt("b-2"), PARAMS)
        assert b.stats()["ssd_cache"]["restores"] == 1
    assert evicted.usage is not None and evicted.usage.cached_tokens == 0  # a miss ...
    assert evicted.token_ids == expected_tokens(prompt("b-1"), 4, b_cfg.fake, stop_at_eos=False)  # ... served right
    assert kept.usage is not None and kept.usage.cached_tokens >= len(prompt("b-2")) - 1
    assert kept.token_ids == expected_tokens(prompt("b-2"), 4, b_cfg.fake, stop_at_eos=False)


async def test_files_from_an_earlier_run_count_and_go_first_oldest_first():
    size = await entry_bytes()
    disk = FaultyDisk(3)
    async with Engine.open(cfg("/kv/old", seed=5), ports=Ports(disk=disk)) as old:  # its own cap: an earlier run
        await written(old, "o-1")
        await written(old, "o-2")
    budget = SsdBudget(int(3.5 * size))
    budget.add_offline(scan_offline(disk, ["/kv/old", "/kv/missing"]))
    assert budget.bytes == 2 * size and budget.stats()["offline_files"] == 2
    async with Engine.open(cfg("/kv/a"), ports=Ports(disk=disk, ssd_budget=budget)) as a:
        await written(a, "a-1")
        await written(a, "a-2")  # four files > 3.5: the older offline file goes, a's own stay
        assert [len(kv_files(disk, d)) for d in ("/kv/old", "/kv/a")] == [1, 2]
        assert budget.stats()["offline_evicted"] == 1 and budget.bytes == 3 * size
    async with Engine.open(cfg("/kv/old", seed=5), ports=Ports(disk=disk, ssd_budget=budget)) as old:
        # its store adopts the offline file it indexes: counted once, not twice
        assert budget.stats()["offline_files"] == 0 and budget.bytes == 3 * size
        again = await old.acomplete(prompt("o-2"), PARAMS)
    assert again.usage is not None and again.usage.cached_tokens > 0  # the survivor is the newer one


async def test_an_entry_larger_than_the_shared_cap_is_refused_and_nothing_is_evicted():
    size = await entry_bytes()
    disk = FaultyDisk(4)
    budget = SsdBudget(int(1.2 * size))
    ports = Ports(disk=disk, ssd_budget=budget)
    async with Engine.open(cfg("/kv/b", seed=7), ports=ports) as b, Engine.open(cfg("/kv/a"), ports=ports) as a:
        await written(b, "b-1")
        long = prompt("a-long") * 8  # 8x the tokens: over the whole cap
        await a.acomplete(long, PARAMS)
        await a.aflush()
        assert a.stats()["ssd_cache"]["refused"] >= 1 and kv_files(disk, "/kv/a") == []
        assert len(kv_files(disk, "/kv/b")) == 1 and b.stats()["ssd_cache"]["evicted_by_others"] == 0


async def test_the_registry_gives_each_model_its_own_folder_under_one_cap(tmp_path):
    root = str(tmp_path / "kv")
    base = EngineConfig(backend="fake", ssd_cache_dir=f"{root}/tiny-x", ssd_cache_max_gib=0.5)
    reg = Registry(base, default="tiny", short_names=False)
    other = msgspec.structs.replace(base, model="/models/other", fake=FakeGPUConfig(seed=3))
    entry = reg.add_chat("other", other)
    assert entry.config is not None and entry.config.ssd_cache_dir == f"{root}/tiny-x/{config_key(other)}"
    assert reg.ssd_budget is not None and reg.ssd_budget.max_bytes == GIB // 2
    assert reg.base_ports.ssd_budget is reg.ssd_budget
    # the default layout <kv root>/<model-key>: the others are its siblings
    default_layout = msgspec.structs.replace(base, ssd_cache_dir=f"{root}/{config_key(base)}")
    assert model_ssd_dir(default_layout, other) == f"{root}/{config_key(other)}"
    assert model_ssd_dir(msgspec.structs.replace(base, ssd_cache_dir=None), other) is None
    kv8 = msgspec.structs.replace(other, kv_bits=8)
    assert config_key(kv8) != config_key(other)  # another KV layout, another folder
    # no SSD tier, or no RAM tier under it: no budget
    assert Registry(msgspec.structs.replace(base, ssd_cache_dir=None), default="tiny").ssd_budget is None


async def test_a_server_of_two_models_holds_one_cap_and_reports_it():
    from tests.transport.test_http import serving

    size = await entry_bytes()
    disk = FaultyDisk(5)
    a = msgspec.structs.replace(cfg("/kv/tiny-x"), ssd_cache_max_gib=2.5 * size / GIB)
    b = msgspec.structs.replace(a, fake=FakeGPUConfig(seed=7))
    async with serving(a, more_models={"b": b}, disk=disk) as (app, client):
        reg = app.state.ember.registry
        for model, tag in (("b", "b-0"), ("fake-gpu-0", "a-1"), ("fake-gpu-0", "a-2")):
            r = await client.post("/v1/completions", json={"model": model, "prompt": prompt(tag), "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert (await reg.entries[model].engine.aflush()).durable
        stats = (await client.get("/stats")).json()
        ssd = stats["registry"]["ssd"]
        assert ssd["stores"] == 2 and ssd["evicted_across"] == 1 and ssd["bytes"] <= ssd["max_bytes"]
        assert stats["models"]["b"]["ssd_cache"]["evicted_by_others"] == 1
        b_dir = reg.entries["b"].config.ssd_cache_dir
        assert b_dir == f"/kv/tiny-x/{config_key(b)}"  # its own folder
        assert kv_files(disk, b_dir) == [] and len(kv_files(disk, "/kv/tiny-x")) == 2
