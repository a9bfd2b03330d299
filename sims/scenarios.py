"""Named simulations: a workload, an engine configuration and faults, from one seed.

Every scenario runs a safety phase (faults on) over the first ``heal_at`` of
the trace, then a liveness phase (faults off) that must drain: every request
is eventually answered with exactly the tokens a cold prefill gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember import FakeGPUConfig
from engine.config import EngineConfig
from engine.units import GIB, MIB
from sims import gen
from sims.trace import Trace


@dataclass(frozen=True)
class GpuFaults:
    """Fake-GPU knobs (``FakeGPUConfig``), each step drawn from the fault seed."""

    slow_step_prob: float = 0.0
    slow_step_factor: float = 20.0
    hang_step_prob: float = 0.0
    oom_step_prob: float = 0.0

    @property
    def any(self) -> bool:
        return bool(self.slow_step_prob or self.hang_step_prob or self.oom_step_prob)


@dataclass(frozen=True)
class DiskFaults:
    """``engine.fake.disk.FaultyDisk`` knobs plus what the simulator does to it.

    ``power_loss_rate_per_s``: random crashes (unsynced writes dropped or torn)
    besides the trace's own restarts; ``rot_per_crash``: how many stored bytes
    the simulator flips at rest at each crash (bit rot found on restore).
    """

    enospc_prob: float = 0.0
    capacity_bytes: int | None = None
    eio_prob: float = 0.0
    bitflip_prob: float = 0.0
    power_loss_rate_per_s: float = 0.0
    rot_per_crash: int = 0
    slow_io_prob: float = 0.0  # each cold-tier I/O call waits slow_io_s first (turmoil-fs style latency)
    slow_io_s: float = 0.02

    @property
    def any(self) -> bool:
        return bool(
            self.enospc_prob
            or self.capacity_bytes
            or self.eio_prob
            or self.bitflip_prob
            or self.power_loss_rate_per_s
            or self.rot_per_crash
            or self.slow_io_prob
        )


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    trace: Callable[[int], Trace]
    config: EngineConfig
    gpu: GpuFaults = GpuFaults()
    disk: DiskFaults = DiskFaults()
    ssd: bool = True  # put the SSD tier on a FaultyDisk (when the engine has one)
    heal_at: float = 0.7  # fraction of the trace after which faults stop
    drain_deadline_s: float = 3600.0  # virtual seconds the liveness phase may take
    twin: bool = False  # also run with write-behind off and compare admission times
    tags: tuple[str, ...] = field(default=())

    @property
    def faulty(self) -> bool:
        return self.gpu.any or self.disk.any


def _config(**kw) -> EngineConfig:
    base: dict[str, Any] = dict(
        backend="fake",
        fake=FakeGPUConfig(),
        max_batch=8,
        max_queue=64,
        prefill_chunk=512,
        step_timeout_s=30.0,
        prompt_cache_gib=24 * MIB / GIB,  # ~20 agent contexts: evictions happen
        ssd_cache_dir="/ssd",
        ssd_cache_max_gib=64 * MIB / GIB,
        writebehind_debounce_s=0.5,
        writebehind_busy_retry_s=2.0,
        spill_queue_gib=4 * MIB / GIB,
        shutdown_timeout_s=60.0,
    )
    base.update(kw)
    return EngineConfig(**base)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="agent",
            description="coding-agent sessions (shared system prompt, growing context, pauses), no faults",
            trace=lambda seed: gen.agent(seed, requests=60),
            config=_config(),
            tags=("ci",),
        ),
        Scenario(
            name="chat",
            description="bursty chat over a small admission queue (overload and retries), slow and OOM GPU steps",
            trace=lambda seed: gen.chat(seed, requests=150),
            config=_config(max_batch=6, max_queue=12),
            gpu=GpuFaults(slow_step_prob=0.02, oom_step_prob=0.01),
            tags=("ci",),
        ),
        Scenario(
            name="crash",
            description="agent traffic with restarts and power loss (torn/dropped writes), disk full, EIO, bit flips, hung GPU steps",
            trace=lambda seed: gen.restart(seed, requests=60, restarts=3),
            config=_config(step_timeout_s=5.0),
            gpu=GpuFaults(slow_step_prob=0.01, hang_step_prob=0.0005, oom_step_prob=0.005),
            disk=DiskFaults(
                enospc_prob=0.02,
                capacity_bytes=48 * MIB,
                eio_prob=0.01,
                bitflip_prob=0.01,
                power_loss_rate_per_s=0.01,
                rot_per_crash=2,
            ),
            heal_at=0.85,  # after the third restart (at about 3/4 of the trace)
            tags=("ci",),
        ),
        Scenario(
            name="gpu",
            description="agent traffic on a misbehaving GPU: slow steps, hung steps (step timeout, restart), OOM",
            trace=lambda seed: gen.agent(seed, requests=60),
            config=_config(step_timeout_s=5.0),
            gpu=GpuFaults(slow_step_prob=0.05, hang_step_prob=0.005, oom_step_prob=0.02),
        ),
        Scenario(
            name="slow-disk",
            description="agent traffic on a slow SSD (50 ms per I/O call): a tensor write in flight when a request arrives",
            trace=lambda seed: gen.agent(seed, requests=60),
            config=_config(),
            disk=DiskFaults(slow_io_prob=1.0, slow_io_s=0.05),
            tags=("ci",),
        ),
        Scenario(
            name="admission",
            description="agent traffic twice, write-behind on and off: every request is admitted at the same time",
            trace=lambda seed: gen.agent(seed, requests=40, session_rate=0.5),
            config=_config(),
            twin=True,
        ),
        Scenario(
            name="chat-10k",
            description="10,000 bursty chat requests, no faults: the speed run (virtual/wall time ratio)",
            trace=lambda seed: gen.chat(seed, requests=10_000),
            config=_config(max_batch=16, max_queue=256),
            tags=("speed",),
        ),
        Scenario(
            name="chat-10k-ram",
            description="chat-10k with the RAM tier only (no SSD tier, no write-behind): what the SSD tier costs",
            trace=lambda seed: gen.chat(seed, requests=10_000),
            config=_config(max_batch=16, max_queue=256, ssd_cache_dir=None),
            ssd=False,
            tags=("speed",),
        ),
        Scenario(
            name="chat-10k-core",
            description="chat-10k with no prompt cache: the engine core and the simulator alone",
            trace=lambda seed: gen.chat(seed, requests=10_000),
            config=_config(max_batch=16, max_queue=256, ssd_cache_dir=None, prompt_cache_gib=0.0),
            ssd=False,
            tags=("speed",),
        ),
    )
}
