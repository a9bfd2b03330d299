"""bench/spec/sweep.py's round anatomy times a round through the engine's phase
observer port (``Ports.observer``), not by patching the Scheduler."""

from __future__ import annotations

import argparse

import pytest

from bench.spec.sweep import RoundTimes, anatomy, timing_ports
from ember import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.anyio


async def test_the_anatomy_reads_the_observer_the_engine_was_opened_with():
    assert timing_ports(argparse.Namespace(anatomy=False)).observer is None
    ports = timing_ports(argparse.Namespace(anatomy=True))
    config = EngineConfig(backend="fake", max_batch=4, draft_model="fake-draft:0.9")
    async with Engine.open(config, ports=ports) as engine:
        times = ports.observer
        assert isinstance(times, RoundTimes)
        await engine.acomplete(list(range(3, 30)), SamplingParams(max_tokens=4))
        assert times.rec["step"] == []  # recording only inside an anatomy
        steps = engine.core.steps
        a = await anatomy(engine, list(range(3, 40)), SamplingParams(max_tokens=32, speculate=True, ignore_eos=True))
        assert len(times.rec["step"]) == engine.core.steps - steps  # every GPU step of that request
        assert len(times.rec["draft"]) > 0 and len(times.rec["verify"]) > 0
        assert len(times.starts) == len(times.rec["step"])
        assert a["tokens_per_round"] > 1.0  # the fake drafter agrees 90% of the time
        assert set(a) == {"draft", "step", "verify", "round", "tokens_per_round"}
