"""The one place the engine is built: ``assemble(config, ports) -> Parts``.

Every actor and every hook is made here, once, in dependency order: the RAM
prompt cache (its put and spill hooks given at construction), speculation
(``ember.spec_build``), the Scheduler, the Gateway, the SSD cold tier and the
durability coordinator. Nothing outside this module builds an actor or
patches one after construction; ``ember.api.Engine`` runs what it returns.

What comes from outside the engine arrives as ``engine.ports.Ports``: the
clock, the backend and the device its calls run on, the event log, the disk,
the I/O runner, the wall clock and a phase observer. ``load_ports`` fills in
what the caller left out from the config, and is the only code that chooses
between the MLX and the fake backend. A simulation hands in its faulty disk and
virtual clock; a benchmark its observer; neither subclasses nor patches.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from actors.cold_tier import ColdTier, ColdTierPort
from actors.durability import Completed, DurabilityCoordinator, Spill
from actors.durability_core import DurabilityCore, DurabilitySettings
from actors.gateway import Gateway, GatewayConfig, StepOutput
from actors.idle_gate import IdleGate
from actors.runtime import Actor
from actors.scheduler import Scheduler
from actors.scheduler_core import RowDelta, SchedulerConfig, SchedulerCore
from ember.spec_build import Speculation, build_speculation
from ember.ssd_tier import demote_idle_s, ssd_on
from engine.config import EngineConfig, FakeGPUConfig
from engine.eventlog import EventLog
from engine.kv.cold_store import ColdStore
from engine.ports import (
    Backend,
    Clock,
    Device,
    InlineDevice,
    LoopClock,
    PhaseObserver,
    Ports,
    run_in_thread,
    run_inline,
)
from engine.units import GIB

log = logging.getLogger("ember.engine")


# ---------------------------------------------------------------------------
# Ports: what the caller left out, chosen from the config.


def load_ports(config: EngineConfig, ports: Ports | None = None, *, keep_events: bool | None = None) -> Ports:
    """``ports`` with every port left None filled in from ``config``: the loop's
    clock; the backend named by ``config.backend`` and the device its calls
    run on (loading a model blocks for seconds: a server runs this off its
    loop); an event log that keeps its records (``keep_events``, by default
    only on the fake GPU: a serving engine keeps the running digest, so the log
    cannot grow without bound); the real disk; file I/O inline beside an inline
    device (virtual time runs no threads), on a worker thread otherwise."""
    ports = ports or Ports()
    clock = ports.clock or LoopClock()
    backend, device = ports.backend, ports.device
    if backend is None:
        backend, device = _load_backend(config, clock)
    device = device or InlineDevice(clock)
    if ports.events is not None:
        events = ports.events
    else:
        events = EventLog(keep=config.backend == "fake" if keep_events is None else keep_events)
    disk = ports.disk
    if disk is None:
        from engine.kv.disk import RealDisk

        disk = RealDisk()
    io = ports.io or (run_inline if isinstance(device, InlineDevice) else run_in_thread)
    return dataclasses.replace(ports, clock=clock, backend=backend, device=device, events=events, disk=disk, io=io)


def _load_backend(config: EngineConfig, clock: Clock) -> tuple[Backend, Device]:
    """The backend named by the config and the device its calls run on."""
    if config.backend == "fake":
        return fake_backend(config.fake), InlineDevice(clock)
    if config.backend == "scripted":  # the fake GPU replying from a script (agent-client tests)
        from engine.fake.scripted import ScriptedBackend

        return ScriptedBackend(config.model, config.fake), InlineDevice(clock)
    if config.distributed:
        from engine.mlx.distributed import load_distributed_backend

        return load_distributed_backend(config)
    from engine.mlx.backend import load_mlx_backend

    return load_mlx_backend(config)


def fake_backend(cfg: FakeGPUConfig) -> Backend:
    """The deterministic fake GPU (``engine.fake.gpu``) with ``cfg``: a
    simulation makes one per engine generation, each with its own fault seed,
    and hands it in as ``Ports.backend``."""
    from engine.fake.gpu import FakeBackend

    return FakeBackend(cfg)


def preload_mlx() -> None:
    """Import mlx-lm on the calling thread. It must first be imported on a
    thread that outlives the process's use of it (imported on a portal's or a
    worker's thread, the process aborts at exit): ``Engine.start`` and the CLI
    call this on the main thread."""
    from engine.mlx import backend  # noqa: F401


# ---------------------------------------------------------------------------
# Settings read once from the config and the environment.


def settings_from(config: Any, environ: Mapping[str, str] | None = None) -> DurabilitySettings:
    """``EngineConfig`` durability fields, overridden by ``EMBER_SSD_WRITEBEHIND=0``,
    ``EMBER_SPILL_QUEUE_GB`` (finite >= 0) and ``EMBER_SHUTDOWN_TIMEOUT_S``
    (finite > 0); an unusable value keeps the configured one, with a warning."""
    env = os.environ if environ is None else environ
    writebehind = bool(config.writebehind) and env.get("EMBER_SSD_WRITEBEHIND", "1").strip() != "0"
    queue_gib = _env_float(env, "EMBER_SPILL_QUEUE_GB", config.spill_queue_gib, lambda v: v >= 0)
    timeout_s = _env_float(env, "EMBER_SHUTDOWN_TIMEOUT_S", config.shutdown_timeout_s, lambda v: v > 0)
    return DurabilitySettings(
        writebehind=writebehind,
        debounce_s=config.writebehind_debounce_s,
        busy_retry_s=config.writebehind_busy_retry_s,
        spill_queue_bytes=int(queue_gib * GIB),
        shutdown_timeout_s=timeout_s,
    )


def _env_float(env: Mapping[str, str], name: str, default: float, ok: Callable[[float], bool]) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not ok(value):
        log.warning("[durability] ignoring %s=%r (unusable); using %s", name, raw, default)
        return default
    return value


# ---------------------------------------------------------------------------
# The built engine.


@dataclass(slots=True)
class Parts:
    """Every built part of one engine; ``actors`` in start (dependency) order."""

    config: EngineConfig
    ports: Ports
    settings: DurabilitySettings
    prefix_cache: Any  # engine.kv.prompt_cache.PromptCache, None when disabled
    speculation: Speculation | None
    core: SchedulerCore
    scheduler: Scheduler
    gateway: Gateway
    cold_tier: ColdTier | None
    durability: DurabilityCoordinator | None
    actors: list[Actor[Any]]


def assemble(config: EngineConfig, ports: Ports) -> Parts:
    """Build every actor and hook of one engine, once. ``ports`` must be complete
    (``load_ports``)."""
    clock, backend, device, events = ports.clock, ports.backend, ports.device, ports.events
    assert clock is not None and backend is not None and device is not None and events is not None, "load_ports first"
    settings = settings_from(config)
    durable = ssd_on(config)  # a folder, and the RAM tier it spills from
    coord: DurabilityCoordinator | None = None  # made below; the RAM tier's hooks reach it once it runs

    def on_put(tokens: list[int], ns: str) -> None:
        assert coord is not None
        coord.ref.tell_nowait(Completed(ns=ns, tokens=tokens))

    def on_spill(tokens: list[int], ns: str, cache: Any) -> None:
        assert coord is not None
        coord.ref.tell_nowait(Spill(ns=ns, tokens=tokens, cache=cache, nbytes=int(backend.cache_nbytes(cache))))

    # 1. the RAM prompt-cache tier: a finished prefix is announced to the
    # coordinator (write-behind) and an evicted one handed to it (``tell_nowait``
    # both: a full inbox loses one write-behind, never blocks the Scheduler)
    prefix_cache = None
    if config.prompt_cache_gib > 0:
        from engine.kv.prompt_cache import PromptCache

        prefix_cache = PromptCache(
            backend,
            int(config.prompt_cache_gib * GIB),
            now=clock.now,
            on_spill=on_spill if durable else None,
            on_put=on_put if durable and settings.writebehind else None,
        )

    # 2. speculation (None: off), then the Scheduler and the Gateway
    spec = build_speculation(config, backend, device, clock)
    core = SchedulerCore(
        backend,
        SchedulerConfig(
            max_batch=config.max_batch,
            prefill_chunk=config.prefill_chunk,
            prefill_share=config.prefill_share,
            min_cached_prefix=config.min_cached_prefix,
            # off across ranks: the followers' RAM tiers mirror rank 0's puts
            # by plan, and this is not a path their lock-step was checked on
            shared_prefill_min=0 if config.distributed else config.shared_prefill_min,
        ),
        clock,
        events,
        prefix_cache,
        spec=spec.rounds if spec else None,
    )
    gateway: Gateway | None = None

    async def deliver(deltas: list[RowDelta]) -> None:
        assert gateway is not None
        await gateway.ref.tell(StepOutput(deltas=deltas))

    observer = ports.observer
    scheduler = Scheduler(
        core,
        device if observer is None else _TimedDevice(device, observer),
        deliver,
        step_timeout_s=config.step_timeout_s,
        drafter=_timed_ref(spec.drafter.ref, "draft", observer) if spec else None,
        verifier=_timed_ref(spec.verifier.ref, "verify", observer) if spec else None,
    )
    gateway = Gateway(
        GatewayConfig(max_batch=config.max_batch, max_queue=config.max_queue),
        backend.info,
        scheduler.ref,
    )
    actors: list[Actor[Any]] = [scheduler, gateway]
    if spec is not None:
        actors[:0] = [spec.drafter, spec.verifier]  # the Scheduler asks them

    # 3. the SSD tier and its durability coordinator
    cold = None
    if durable:
        cold = _cold_tier(config, ports, scheduler)
        core.cold = cold.link()  # admission lookups and restores (the tier needs the Scheduler's ref first)
        actors.insert(0, cold)  # its index is scanned before the first admission
        coord = _coordinator(settings, ports, scheduler, cold)
        actors.append(coord)  # it asks the Scheduler and the ColdTier
    return Parts(
        config=config,
        ports=ports,
        settings=settings,
        prefix_cache=prefix_cache,
        speculation=spec,
        core=core,
        scheduler=scheduler,
        gateway=gateway,
        cold_tier=cold,
        durability=coord,
        actors=actors,
    )


def _cold_tier(config: EngineConfig, ports: Ports, scheduler: Scheduler) -> ColdTier:
    """The SSD cold tier actor over ``ports.disk``, told the Scheduler's
    idle/busy edges (its demotions and reads wait for idle)."""
    backend, device, clock = ports.backend, ports.device, ports.clock
    assert backend is not None and device is not None and clock is not None and ports.disk is not None
    info = backend.info
    assert config.ssd_cache_dir is not None  # durable
    root = os.path.abspath(os.path.expanduser(config.ssd_cache_dir))
    tier_class: Any = ColdTier
    if config.distributed:  # every rank its own shard's files (actors.distributed_tier)
        from actors.distributed_tier import DistributedColdTier, rank_root

        grp = backend.link.group  # type: ignore[attr-defined]  # the LeaderBackend (engine.mlx.distributed)
        root, tier_class = rank_root(root, grp.rank(), grp.size()), DistributedColdTier
    store = ColdStore(
        ports.disk,
        root,
        model_id=info.model_id,
        config_fingerprint=info.config_fingerprint,
        tokenizer_hash=info.tokenizer_hash,
        max_bytes=int(config.ssd_cache_max_gib * GIB),
        verify=config.ssd_cache_verify,
        max_tokens=info.context_length,
        budget=None if config.distributed else ports.ssd_budget,  # a rank's shard keeps its own cap
    )
    cold = tier_class(
        store,
        backend,
        device,
        clock,
        io=ports.io or run_in_thread,
        scheduler=scheduler.ref,
        demote_idle_s=demote_idle_s(config),
        wall=ports.wall,
    )
    scheduler.subscribe(cold.ref)
    return cold


def run_follower(config: EngineConfig) -> int:
    """A follower rank of ``--distributed`` (no HTTP): it executes rank 0's
    step plans, and its side of the SSD tier (actors.distributed_tier)."""
    from actors.distributed_tier import follower_tier
    from engine.mlx.distributed import run_follower as follow

    return follow(config, make_tier=follower_tier)


class _OpenGate(IdleGate):
    """An ``IdleGate`` whose turn never waits (``Ports.gated_writes=False``):
    SSD tensor writes go on during GPU steps. It still tracks busy, so
    snapshots are taken as in a gated engine."""

    async def wait_turn(self) -> None:
        return None


def _coordinator(
    settings: DurabilitySettings, ports: Ports, scheduler: Scheduler, cold: ColdTier
) -> DurabilityCoordinator:
    """Write-behind and the flush: the idle gate on the Scheduler's idle/busy
    edges (subscribed directly, so it flips before the next GPU step), the cold
    tier as its writer, and the Scheduler's own snapshot while the engine is idle."""
    assert ports.clock is not None and ports.events is not None
    gate = IdleGate() if ports.gated_writes else _OpenGate()
    scheduler.subscribe(gate)  # type: ignore[arg-type]  # it takes only the tell_nowait of an ActorRef
    port = ColdTierPort(cold)
    core = DurabilityCore(settings, ports.clock, port, lambda: gate.busy, ports.events)
    sched_core = scheduler.core
    coord = DurabilityCoordinator(
        core,
        scheduler.ref,
        port,
        gate,
        snapshot_now=lambda ns, tokens: sched_core.snapshot(tokens, ns),
    )
    log.info(
        "[durability] on writebehind=%s debounce_s=%s spill_queue_bytes=%d",
        settings.writebehind,
        settings.debounce_s,
        settings.spill_queue_bytes,
    )
    return coord


# ---------------------------------------------------------------------------
# The phase observer's taps: the Scheduler's device and its asks of the
# Drafter and the Verifier, timed (only when ``Ports.observer`` is set).


class _TimedDevice:
    """The Scheduler's device, telling the observer how long each GPU step ran."""

    def __init__(self, inner: Device, observer: PhaseObserver):
        self._inner = inner
        self._observer = observer

    async def run(self, fn: Callable[..., Any], *args: Any, cost_s: float = 0.0) -> Any:
        t = time.perf_counter()
        try:
            return await self._inner.run(fn, *args, cost_s=cost_s)
        finally:
            self._observer.phase("step", t, time.perf_counter() - t)

    @property
    def exact_cost(self) -> bool:
        return self._inner.exact_cost

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:  # call…: the device's own
        return getattr(self._inner, name)


class _TimedRef:
    """An actor's ref whose asks the observer times as one phase."""

    def __init__(self, inner: Any, phase: str, observer: PhaseObserver):
        self._inner = inner
        self._phase = phase
        self._observer = observer

    async def ask(self, msg: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return await self._inner.ask(msg, **kw)
        finally:
            self._observer.phase(self._phase, t, time.perf_counter() - t)

    def __getattr__(self, name: str) -> Any:  # tell_nowait, name…
        return getattr(self._inner, name)


def _timed_ref(ref: Any, phase: str, observer: PhaseObserver | None) -> Any:
    return ref if observer is None else _TimedRef(ref, phase, observer)
