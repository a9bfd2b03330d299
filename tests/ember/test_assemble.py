"""The roof (issue 18): the public imports, ``ember.assemble`` building the
engine once from its ports, and the ports a simulation or a benchmark swaps in
(a disk, a phase observer, an ungated writer) instead of patching actors."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest

from actors.events import EngineBusy, EngineIdle
from ember import Engine, EngineConfig, EngineDead, Ports, SamplingParams, settings_from
from engine.fake.disk import FaultyDisk
from engine.kv.kvfile import read_header
from engine.units import GIB

pytestmark = pytest.mark.anyio


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_public_api_imports_from_ember_and_engine_loads_no_actor():
    """What the README promises, in a fresh interpreter: this process has
    imported every package already."""
    r = _python("from ember import Engine, EngineConfig, SamplingParams; print(Engine.__module__)")
    assert r.returncode == 0 and r.stdout.strip() == "ember.api", r.stderr
    r = _python(
        "import sys, engine, engine.ports, engine.config, engine.kv.prompt_cache; "
        "print(sorted(m for m in sys.modules if m == 'actors' or m.startswith('actors.')))"
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_settings_from_config_and_environment():
    cfg = EngineConfig(backend="fake")
    s = settings_from(cfg, {})
    assert (s.writebehind, s.spill_queue_bytes, s.shutdown_timeout_s) == (True, 2 * GIB, 120.0)
    s = settings_from(
        cfg, {"EMBER_SSD_WRITEBEHIND": "0", "EMBER_SPILL_QUEUE_GB": "0.5", "EMBER_SHUTDOWN_TIMEOUT_S": "7"}
    )
    assert (s.writebehind, s.spill_queue_bytes, s.shutdown_timeout_s) == (False, GIB // 2, 7.0)
    for bad in ("abc", "0", "-5", "inf", "nan"):
        assert settings_from(cfg, {"EMBER_SHUTDOWN_TIMEOUT_S": bad}).shutdown_timeout_s == 120.0
    assert settings_from(cfg, {"EMBER_SPILL_QUEUE_GB": "-1"}).spill_queue_bytes == 2 * GIB
    assert settings_from(cfg, {"EMBER_SPILL_QUEUE_GB": "0"}).spill_queue_bytes == 0


def _fake(**kw) -> EngineConfig:
    return EngineConfig(backend="fake", max_batch=4, max_queue=64, prefill_chunk=64, **kw)


async def test_the_ram_tier_hooks_are_given_once_at_construction():
    async with Engine.open(_fake()) as plain:
        assert plain.cold_tier is None and plain.durability is None
        assert plain.prefix_cache.on_spill is None and plain.prefix_cache.on_put is None
    async with Engine.open(_fake(ssd_cache_dir="/cache"), ports=Ports(disk=FaultyDisk(1))) as tiered:
        assert tiered.durability is not None and tiered.actors[-1] is tiered.durability
        assert tiered.prefix_cache.on_spill is not None and tiered.prefix_cache.on_put is not None
    async with Engine.open(_fake(ssd_cache_dir="/cache", writebehind=False), ports=Ports(disk=FaultyDisk(1))) as e:
        assert e.prefix_cache.on_spill is not None and e.prefix_cache.on_put is None  # evictions still spill


async def test_the_disk_port_carries_the_ssd_tier_and_the_wall_clock_its_headers():
    disk = FaultyDisk(7)
    ports = Ports(disk=disk, wall=lambda: 1234.5)
    async with Engine.open(_fake(ssd_cache_dir="/cache"), ports=ports) as engine:
        await engine.acomplete(list(range(3, 200)), SamplingParams(max_tokens=4))
        report = await engine.aflush()
        assert report.durable and report.flushed == 1
    kv = [p for p in disk.files() if p.endswith(".kv")]
    assert len(kv) == 1 and kv[0].startswith("/cache/")  # written to the port's disk, nowhere else
    header, _ = read_header(disk, kv[0])
    assert header.created_at == 1234.5
    async with Engine.open(_fake(ssd_cache_dir="/cache"), ports=Ports(disk=disk)) as again:
        assert len(again.cold_tier.store) == 1  # the next engine finds it there


class Phases:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def phase(self, name: str, start: float, seconds: float) -> None:
        assert seconds >= 0
        self.seen.append(name)


async def test_a_phase_observer_times_the_steps_and_the_speculation_asks():
    obs = Phases()
    params = SamplingParams(max_tokens=24, speculate=True, ignore_eos=True)
    async with Engine.open(_fake(draft_model="fake-draft:0.9"), ports=Ports(observer=obs)) as engine:
        out = await engine.acomplete(list(range(3, 40)), params)
        steps = engine.core.steps
    assert len(out.token_ids) == 24
    assert obs.seen.count("step") == steps  # every GPU step, and nothing else on the device
    assert obs.seen.count("draft") > 0 and obs.seen.count("verify") > 0
    async with Engine.open(_fake(draft_model="fake-draft:0.9")) as untimed:
        assert type(untimed.scheduler.device) is type(untimed.device)  # no observer: no wrapper


async def test_ungated_writes_skip_the_idle_gate_and_gated_ones_wait():
    config = _fake(ssd_cache_dir="/cache")
    for gated in (True, False):
        async with Engine.open(config, ports=Ports(disk=FaultyDisk(1), gated_writes=gated)) as engine:
            gate = engine.durability.gate
            gate.tell_nowait(EngineBusy(at=0.0))
            with anyio.move_on_after(5.0) as waited:
                await gate.wait_turn()
            assert waited.cancelled_caught is gated and gate.busy
            gate.tell_nowait(EngineIdle(at=0.0))  # let the shutdown flush write


async def test_kill_stops_the_engine_with_no_drain_and_keeps_the_first_cause():
    async with Engine.open(_fake()) as engine:
        engine.kill(RuntimeError("a rank was lost"))
        assert engine.status == "dead"
        engine.kill(RuntimeError("later"))
        with pytest.raises(EngineDead, match="a rank was lost"):
            await engine.acomplete("hi", SamplingParams(max_tokens=2))
