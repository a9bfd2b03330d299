"""The embedded API: ``Engine.open`` (async) and ``Engine.start`` (sync facade).

    async with Engine.open(EngineConfig(backend="fake")) as engine:
        async for delta in engine.agenerate("hello", SamplingParams(max_tokens=8)):
            print(delta.text, end="")

    engine = Engine.start(EngineConfig())
    for delta in engine.generate("def main():"):
        ...
    engine.stop()

The actors start in one task group in dependency order; shutdown is the
nesting order. An actor that crashes takes the engine down: every waiter gets
``EngineDead`` and the engine refuses new work.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from actors.durability import DurabilityCoordinator, Flush, FlushReport, build_coordinator, settings_from
from actors.gateway import Cancel, Drain, Gateway, GatewayConfig, StepOutput, Submit
from actors.runtime import Actor, Failure
from actors.scheduler import RowDelta, Scheduler, SchedulerConfig, SchedulerCore
from ember.spec_build import build_speculation, check_request
from engine.config import EngineConfig
from engine.errors import EngineDead, EngineError, InvalidRequest
from engine.eventlog import EventLog
from engine.ports import Backend, Clock, Device, InlineDevice, LoopClock
from engine.types import Constraint, Delta, SamplingParams, TokenLogprob, Usage

log = logging.getLogger("ember.engine")


def build_backend(config: EngineConfig, clock: Clock) -> tuple[Backend, Device]:
    """Make the backend named by the config and the device its calls run on."""
    if config.backend == "fake":
        from engine.fake.gpu import FakeBackend

        return FakeBackend(config.fake), InlineDevice(clock)
    if config.distributed:
        from engine.mlx.distributed import load_distributed_backend

        return load_distributed_backend(config)
    from engine.mlx.backend import load_mlx_backend

    return load_mlx_backend(config)


class Completion:
    """The collected result of one request."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.logprobs: list[TokenLogprob] | None = None  # when the request asked for them

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.usage = d.usage


class RequestStream:
    """One admitted request's deltas, from ``Engine.asubmit``.

    Receiving is cancel-safe (a timeout around ``__anext__`` loses no delta),
    so a server can wait for a token with a deadline and send a keep-alive
    instead. Closing the stream before the last delta cancels the request: the
    Gateway aborts its row at the next step.
    """

    def __init__(self, gateway: Any, rid: int, recv: Any):
        self.rid = rid
        self._gateway = gateway
        self._recv = recv
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.finished = True
            raise EngineDead("the request stream ended without a finish") from None
        return self._take(item)

    def next_nowait(self) -> Delta | None:
        """The next delta if one is already queued, else None; never waits.
        A writer that fell behind (a busy loop, many streams) drains what has
        piled up and sends it in one write instead of one per token."""
        if self.finished:
            return None
        try:
            item = self._recv.receive_nowait()
        except anyio.WouldBlock:
            return None
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.finished = True
            raise EngineDead("the request stream ended without a finish") from None
        return self._take(item)

    async def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the next delta (or the end) to be
        queued, without taking it: True if ``next_nowait``/``__anext__`` now
        answers at once. The keep-alive of a streaming server, without a cancel
        scope per token."""
        if self.finished:
            return True
        return await self._recv.wait(timeout)

    def _take(self, item: Any) -> Delta:
        if isinstance(item, Failure):
            self.finished = True
            raise item.exc
        if item.finish_reason is not None:
            self.finished = True
        return item

    async def aclose(self) -> None:
        self._recv.close()
        if not self.finished:
            self.finished = True
            try:
                self._gateway.tell_nowait(Cancel(rid=self.rid))
            except EngineError:
                pass

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        backend: Backend,
        device: Device,
        clock: Clock,
        events: EventLog,
    ):
        self.config = config
        self.backend = backend
        self.device = device
        self.clock = clock
        self.events = events
        self.tokenizer = backend.tokenizer
        self.info = backend.info
        self.dead: BaseException | None = None
        self.ready = False
        self._portal: BlockingPortal | None = None
        self._portal_cm: Any = None
        self._open_cm: Any = None
        self.prefix_cache = self._make_prefix_cache()
        self.speculation = build_speculation(config, backend, device, clock)  # None: off
        spec = self.speculation
        self.core = SchedulerCore(
            backend,
            SchedulerConfig(
                max_batch=config.max_batch,
                prefill_chunk=config.prefill_chunk,
                min_cached_prefix=config.min_cached_prefix,
            ),
            clock,
            events,
            self.prefix_cache,
            spec=spec.rounds if spec else None,
        )
        self.scheduler = Scheduler(
            self.core,
            device,
            self._deliver,
            step_timeout_s=config.step_timeout_s,
            drafter=spec.drafter.ref if spec else None,
            verifier=spec.verifier.ref if spec else None,
        )
        self.gateway = Gateway(
            GatewayConfig(max_batch=config.max_batch, max_queue=config.max_queue),
            backend.info,
            self.scheduler.ref,
        )
        self.actors: list[Actor[Any]] = [self.scheduler, self.gateway]
        if spec is not None:
            self.actors[:0] = [spec.drafter, spec.verifier]  # the Scheduler asks them
        self.cold_tier = self._make_cold_tier()
        if self.cold_tier is not None:
            self.actors.insert(0, self.cold_tier)  # its index is scanned before the first admission
        self.shutdown_timeout_s = settings_from(config).shutdown_timeout_s
        self.shutdown_timed_out = False
        self._drained: anyio.Event | None = None
        self.last_flush: FlushReport | None = None
        self.durability = self._make_durability()
        if self.durability is not None:
            self.actors.append(self.durability)  # it asks the Scheduler and the ColdTier
        self._actor_scope: anyio.CancelScope | None = None
        self._token_bytes: dict[int, bytes] = {}

    def _make_prefix_cache(self) -> Any:
        """The RAM prompt-cache tier (None when disabled)."""
        if self.config.prompt_cache_gib <= 0:
            return None
        from engine.kv.prompt_cache import PromptCache

        return PromptCache(self.backend, int(self.config.prompt_cache_gib * (1 << 30)), now=self.clock.now)

    def _make_cold_tier(self) -> Any:
        """The SSD cold tier actor (None unless ``ssd_cache_dir`` is set), wired
        to the Scheduler: its index for admission lookups, its inbox for
        restores, and the idle/busy edges for its demotion sweeps. The RAM
        tier's spill hook is the durability coordinator's (``_make_durability``)."""
        cfg = self.config
        if not cfg.ssd_cache_dir or self.prefix_cache is None:
            return None
        import os

        from actors.cold_tier import ColdTier
        from engine.kv.cold_io import run_in_thread, run_inline
        from engine.kv.cold_store import ColdStore
        from engine.kv.disk import RealDisk

        store = ColdStore(
            RealDisk(),
            os.path.abspath(os.path.expanduser(cfg.ssd_cache_dir)),
            model_id=self.info.model_id,
            config_fingerprint=self.info.config_fingerprint,
            tokenizer_hash=self.info.tokenizer_hash,
            max_bytes=int(cfg.ssd_cache_max_gib * (1 << 30)),
            verify=cfg.ssd_cache_verify,
            max_tokens=self.info.context_length,
        )
        cold = ColdTier(
            store,
            self.backend,
            self.device,
            self.clock,
            io=run_inline if isinstance(self.device, InlineDevice) else run_in_thread,  # virtual time runs no threads
            scheduler=self.scheduler.ref,
            demote_idle_s=300.0 if cfg.ssd_demote_idle_s is None else cfg.ssd_demote_idle_s,
        )
        link = cold.link()
        self.core.cold = link
        self.scheduler.subscribe(cold.ref)
        return cold

    def _make_durability(self) -> DurabilityCoordinator | None:
        """Write-behind and the flush (None without the SSD tier). It takes over
        the RAM tier's spill hook, so evictions share its bounded queue."""
        if self.cold_tier is None:
            return None
        return build_coordinator(
            self.config, self.clock, self.events, self.backend, self.scheduler, self.cold_tier, self.prefix_cache
        )

    async def _deliver(self, deltas: list[RowDelta]) -> None:
        await self.gateway.ref.tell(StepOutput(deltas=deltas))

    # ---- lifecycle -------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: EngineConfig | None = None,
        *,
        backend: Backend | None = None,
        device: Device | None = None,
        clock: Clock | None = None,
        events: EventLog | None = None,
    ) -> AsyncIterator[Engine]:
        config = (config or EngineConfig()).validate()
        clock = clock or LoopClock()
        if backend is None:
            backend, device = build_backend(config, clock)
        # Records are kept for tests and sims (the fake GPU); a serving engine keeps
        # only the running digest so the log cannot grow without bound.
        events = events if events is not None else EventLog(keep=config.backend == "fake")
        events.start(clock.now())
        engine = cls(config, backend, device or InlineDevice(clock), clock, events)
        if hasattr(backend, "attach_engine"):  # rank 0 of a distributed engine (engine.mlx.distributed)
            backend.attach_engine(engine, asyncio.get_running_loop())
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(engine._run_actors)
                engine.ready = True
                try:
                    yield engine
                finally:
                    with anyio.CancelScope(shield=True):
                        await engine._shutdown()
                    tg.cancel_scope.cancel()
        finally:
            engine.device.close()

    async def _run_actors(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._actor_scope = tg.cancel_scope
            for actor in self.actors:  # dependency order
                await tg.start(self._supervise, actor)
            task_status.started()

    async def _supervise(self, actor: Actor[Any], *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await actor.run(task_status=task_status)
        except Exception as exc:  # an actor crashed: the engine is dead, waiters get EngineDead
            if self.dead is None:
                self.dead = exc
                log.error("[engine] actor %s crashed: %r", actor.name, exc, exc_info=exc)
            self.ready = False
            if self._actor_scope is not None:
                self._actor_scope.cancel()

    async def _shutdown(self) -> None:
        """Graceful stop: no new admissions, let active requests finish, flush, stop actors."""
        self.ready = False
        if self.dead is None:
            await self.drain()
        for actor in reversed(self.actors):
            actor.stop()
        if self._actor_scope is not None:
            with anyio.move_on_after(5):
                for actor in self.actors:
                    await actor.stopped.wait()
            self._actor_scope.cancel()

    async def drain(self) -> bool:
        """The first half of a graceful stop, for a server to run before it stops
        listening: admit nothing new (``status`` says draining, so /health and new
        requests answer 503), let active requests finish, then ``before_stop``
        (the durability flush) — all bounded by ``shutdown_timeout_s``
        (``EMBER_SHUTDOWN_TIMEOUT_S``). On the deadline it logs the pending
        counters and returns False. Runs once; later calls wait for that outcome."""
        if self._drained is not None:
            await self._drained.wait()
            return not self.shutdown_timed_out
        self._drained = anyio.Event()
        try:
            with anyio.move_on_after(self.shutdown_timeout_s) as scope:
                try:
                    await self.gateway.ref.ask(Drain())
                    await self.before_stop()
                except EngineDead:
                    pass
            if scope.cancelled_caught:
                self.shutdown_timed_out = True
                pending = self.durability.core.stats() if self.durability is not None else {}
                log.error(
                    "[engine] shutdown deadline of %ss passed with work pending in_flight=%s pending_snapshots=%s "
                    "pending_spills=%s pending_spill_bytes=%s dropped_spills=%s failed_spills=%s",
                    self.shutdown_timeout_s,
                    self.gateway.stats()["in_flight"],
                    pending.get("pending_snapshots", 0),
                    pending.get("pending_spills", 0),
                    pending.get("pending_spill_bytes", 0),
                    pending.get("dropped_spills", 0),
                    pending.get("failed_spills", 0),
                )
        finally:
            self._drained.set()
        return not self.shutdown_timed_out

    async def before_stop(self) -> None:
        """Hook between draining and stopping the actors: the durability flush."""
        if self.durability is None:
            return
        self.last_flush = report = await self.aflush()
        level = logging.INFO if report.durable else logging.WARNING
        log.log(
            level,
            "[engine] shutdown flush durable=%s flushed=%d missing=%d pending_snapshots=%d failed_spills=%d",
            report.durable,
            report.flushed,
            report.missing,
            report.pending_snapshots,
            report.failed_spills,
        )

    async def aflush(self) -> FlushReport:
        """The durability boundary: every finished prefix and queued spill is on
        SSD (renamed, folder fsynced) when the report says ``durable``. Waits for
        the engine to be idle for the tensor writes. No SSD tier: an empty durable report."""
        self._check_alive()
        if self.durability is None:
            return FlushReport(durable=True)
        return await self.durability.ref.ask(Flush())

    def flush(self) -> FlushReport:
        """Sync twin of ``aflush`` (engines made by ``Engine.start``)."""
        return self.call(self.aflush)

    @property
    def status(self) -> str:
        """ "ready", "draining" (admits nothing new) or "dead": what /health reports."""
        if self.dead is not None:
            return "dead"
        if not self.ready or self.gateway.draining:
            return "draining"
        return "ready"

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine died: {self.dead!r}")

    # ---- requests --------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    async def asubmit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        ns: str = "",
    ) -> RequestStream:
        """Admit a request now and return its stream of deltas.

        Admission errors (``InvalidRequest``, ``EngineOverloaded``,
        ``EngineDraining``) raise here, before any token: an HTTP server must
        pick its status code before it can start a stream, and must not wait
        for the first token (a long prefill) to learn it.
        """
        self._check_alive()
        check_request(params or SamplingParams(), self.speculation)
        if params is not None and params.constraint is not None:
            await self.compile_constraint(params.constraint)
        if params is not None and params.logprobs is not None and not self._token_bytes:
            grammars = getattr(self.backend, "grammars", None)
            if grammars is not None:  # token_bytes' tokenizer (~1 s for a large vocabulary): built off the loop
                await anyio.to_thread.run_sync(grammars.tokenizer)
        tokens = self.encode(prompt)
        rid, stream = await self.gateway.ref.ask(
            Submit(tokens=tokens, params=params or SamplingParams(), ns=ns), nowait=True
        )
        return RequestStream(self.gateway.ref, rid, stream)

    async def compile_constraint(self, constraint: Constraint) -> None:
        """Compile (or find cached) a request's grammar on a worker thread, so the
        event loop never waits for it; an invalid or unsupported grammar raises
        ``InvalidRequest`` (param ``constraint``) before the request is admitted."""
        grammars = getattr(self.backend, "grammars", None)
        if grammars is None:
            raise InvalidRequest(
                "constrained decoding is not supported by this backend (the fake GPU has no logits processing)",
                "constraint",
            )
        await anyio.to_thread.run_sync(grammars.compile, constraint)

    async def agenerate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        ns: str = "",
    ) -> AsyncIterator[Delta]:
        """Stream a request's deltas; the last carries ``finish_reason`` and ``usage``."""
        async with await self.asubmit(prompt, params, ns=ns) as stream:
            async for d in stream:
                yield d

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes (a byte-level BPE token may be part of a UTF-8
        character, which ``decode`` would turn into U+FFFD): for logprobs."""
        cache = self._token_bytes
        missing = [i for i in ids if i not in cache]
        if missing:
            grammars = getattr(self.backend, "grammars", None)
            lltok = grammars.tokenizer() if grammars is not None else None
            for i in missing:
                cache[i] = lltok.decode_bytes([i]) if lltok is not None else self.tokenizer.decode([i]).encode()
        return [cache[i] for i in ids]

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt tokens of a chat: the tokenizer's chat template (offering
        ``tools``, in OpenAI's function shape, when given)."""
        if tools:
            return self.tokenizer.apply_chat_template(messages, tools=tools)
        return self.tokenizer.apply_chat_template(messages)

    async def achat(
        self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *, ns: str = ""
    ) -> AsyncIterator[Delta]:
        async for d in self.agenerate(self.chat_prompt(messages), params, ns=ns):
            yield d

    async def acomplete(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, ns: str = ""
    ) -> Completion:
        out = Completion()
        async for d in self.agenerate(prompt, params, ns=ns):
            out.add(d)
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "model": self.info.model_id,
            "ready": self.ready,
            "dead": repr(self.dead) if self.dead else None,
            "scheduler": self.core.stats(),
            "gateway": self.gateway.stats(),
            **({"prompt_cache": self.prefix_cache.stats()} if self.prefix_cache is not None else {}),
            **({"ssd_cache": self._ssd_stats()} if self.cold_tier is not None else {}),
            **({"speculation": self.speculation.stats()} if self.speculation is not None else {}),
            **({"distributed": self.backend.stats()} if self.config.distributed else {}),  # type: ignore[attr-defined]  # the distributed backend wraps MLXBackend and adds stats()
            # paths a cache kind ruled out, and how often (engine.mlx.backend)
            **({"fallbacks": dict(fb)} if (fb := getattr(self.backend, "fallbacks", None)) is not None else {}),
        }

    def _ssd_stats(self) -> dict[str, Any]:
        out = dict(self.cold_tier.stats())
        if self.durability is not None:  # its queue is the one spills wait in
            out.update(self.durability.core.stats())
        return out

    # ---- sync facade -------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig | None = None, **kw: Any) -> Engine:
        """Start an engine on a background event-loop thread (blocking portal)."""
        if (config or EngineConfig()).backend == "mlx" and kw.get("backend") is None:
            # mlx_lm must be first imported on a thread that outlives the process's
            # use of it: imported on the portal's thread, the process aborts at exit.
            from engine.mlx import backend as mlx_backend  # noqa: F401
        portal_cm = start_blocking_portal()
        portal = portal_cm.__enter__()
        try:
            open_cm = portal.wrap_async_context_manager(cls.open(config, **kw))
            engine = open_cm.__enter__()
        except BaseException:
            portal_cm.__exit__(None, None, None)
            raise
        engine._portal, engine._portal_cm, engine._open_cm = portal, portal_cm, open_cm
        return engine

    def stop(self) -> None:
        if self._portal is None:
            raise RuntimeError("stop() is for engines made by Engine.start(); use `async with Engine.open()`")
        open_cm, portal_cm = self._open_cm, self._portal_cm
        self._portal = self._open_cm = self._portal_cm = None
        try:
            open_cm.__exit__(None, None, None)
        finally:
            portal_cm.__exit__(None, None, None)

    def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, ns: str = ""
    ) -> Iterator[Delta]:
        """Sync twin of ``agenerate`` (engines made by ``Engine.start``)."""
        portal = self._portal
        if portal is None:
            raise RuntimeError("generate() is the sync facade; use agenerate() inside the event loop")
        q: queue.Queue[Any] = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for d in self.agenerate(prompt, params, ns=ns):
                    q.put(d)
            except BaseException as exc:  # noqa: BLE001 - handed to the sync caller
                q.put(Failure(exc))
            finally:
                q.put(done)

        fut = portal.start_task_soon(pump)
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, Failure):
                    raise item.exc
                yield item
        finally:
            if not fut.done():
                fut.cancel()
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 - cancellation of the pump
                    pass

    def complete(self, prompt: str | list[int], params: SamplingParams | None = None, *, ns: str = "") -> Completion:
        out = Completion()
        for d in self.generate(prompt, params, ns=ns):
            out.add(d)
        return out

    def call(self, fn: Any, *args: Any) -> Any:
        """Run an async engine method from the sync facade's caller thread."""
        if self._portal is None:
            raise RuntimeError("call() is for engines made by Engine.start()")
        return self._portal.call(fn, *args)
