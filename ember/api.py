"""The embedded API: ``Engine.open`` (async) and ``Engine.start`` (sync facade).

    async with Engine.open(EngineConfig(backend="fake")) as engine:
        async for delta in engine.agenerate("hello", SamplingParams(max_tokens=8)):
            print(delta.text, end="")

    engine = Engine.start(EngineConfig())
    for delta in engine.generate("def main():"):
        ...
    engine.stop()

``ember.assemble`` builds the parts (every actor and hook, once, from the
config and the ports); this facade runs them. The actors start in one task
group in dependency order; shutdown is the nesting order. An actor that crashes takes the engine down: every waiter gets
``EngineDead`` and the engine refuses new work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from actors.durability import Flush, FlushReport
from actors.gateway import Drain, Submit
from actors.runtime import Actor, Failure
from ember.assemble import Parts, assemble, load_ports, preload_mlx
from ember.spec_build import check_request
from ember.ssd_tier import resolve_ssd
from ember.stream import Completion, RequestStream
from engine.config import EngineConfig
from engine.errors import EngineDead, InvalidRequest
from engine.eventlog import EventLog
from engine.ports import Backend, Clock, Device, InlineDevice, Ports
from engine.types import Constraint, Delta, SamplingParams

log = logging.getLogger("ember.engine")


class Engine:
    """The public face of one engine: it runs the parts ``ember.assemble``
    built (``self.scheduler``, ``self.gateway``, ``self.cold_tier``…) and
    answers requests, flushes and stats. Make one with ``Engine.open`` or
    ``Engine.start``."""

    def __init__(self, parts: Parts):
        ports = parts.ports
        assert ports.backend is not None and ports.device is not None and ports.clock is not None
        assert ports.events is not None  # assemble takes complete ports (load_ports)
        self.parts = parts
        self.config = parts.config
        self.backend = ports.backend
        self.device = ports.device
        self.clock = ports.clock
        self.events = ports.events
        self.tokenizer = self.backend.tokenizer
        self.info = self.backend.info
        self.prefix_cache = parts.prefix_cache
        self.speculation = parts.speculation  # None: off
        self.core = parts.core
        self.scheduler = parts.scheduler
        self.gateway = parts.gateway
        self.cold_tier = parts.cold_tier
        self.durability = parts.durability
        self.actors: list[Actor[Any]] = parts.actors
        self.shutdown_timeout_s = parts.settings.shutdown_timeout_s
        self.dead: BaseException | None = None
        self.ready = False
        self.shutdown_timed_out = False
        self.last_flush: FlushReport | None = None
        self._portal: BlockingPortal | None = None
        self._portal_cm: Any = None
        self._open_cm: Any = None
        self._drained: anyio.Event | None = None
        self._actor_scope: anyio.CancelScope | None = None
        self._token_bytes: dict[int, bytes] = {}

    # ---- lifecycle -------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: EngineConfig | None = None,
        *,
        ports: Ports | None = None,
        backend: Backend | None = None,
        device: Device | None = None,
        clock: Clock | None = None,
        events: EventLog | None = None,
    ) -> AsyncIterator[Engine]:
        """Build the engine (``ember.assemble``), start its actors, and stop
        them gracefully (drain, flush) on exit. ``ports`` (or the single ports
        as keywords) replace what the config would choose: a backend, a clock,
        a disk… (``engine.ports.Ports``)."""
        # "auto": serve's folder and cap (ember.ssd_tier, the one rule)
        config, _ = resolve_ssd((config or EngineConfig()).validate())
        ports = _with(ports, backend=backend, device=device, clock=clock, events=events)
        ports = load_ports(config, ports)
        assert ports.clock is not None and ports.events is not None and ports.device is not None
        ports.events.start(ports.clock.now())
        try:
            engine = cls(assemble(config, ports))
        except BaseException:  # e.g. a drafter refused: the loaded model's thread must not outlive it
            ports.device.close()
            raise
        backend = engine.backend
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
        actor.cause = lambda: self.dead  # what its waiters are told if it is cancelled by a crash
        try:
            await actor.run(task_status=task_status)
        except Exception as exc:  # an actor crashed: the engine is dead, waiters get EngineDead
            if self.dead is None:
                self.dead = exc
                log.error("[engine] actor %s crashed: %r", actor.name, exc, exc_info=exc)
            self.ready = False
            if self._actor_scope is not None:
                self._actor_scope.cancel()

    def kill(self, cause: BaseException) -> None:
        """Stop every actor now, with no drain and no flush: the process is as
        good as gone (a lost rank of a distributed engine, a simulated power
        loss). The engine is dead (``status``), its waiters get ``EngineDead``,
        and ``cause`` is what it reports, unless it had already died."""
        if self.dead is None:
            self.dead = cause
            log.error("[engine] killed: %r", cause)
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

    def in_flight(self) -> int:
        """Requests admitted and not finished (ember.served.Served)."""
        return int(self.gateway.stats()["in_flight"])

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

    @property
    def runs_inline(self) -> bool:
        """True when backend calls run inline on the event loop (the fake GPU
        in virtual time): then nothing may go to a worker thread either."""
        return isinstance(self.device, InlineDevice)

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
            grammars = self.backend.grammars
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
        grammars = self.backend.grammars
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
            grammars = self.backend.grammars
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
            **({"fallbacks": dict(fb)} if (fb := self.backend.fallbacks) is not None else {}),
        }

    def _ssd_stats(self) -> dict[str, Any]:
        assert self.cold_tier is not None  # asked only with the SSD tier
        out = dict(self.cold_tier.stats())
        if self.durability is not None:  # its queue is the one spills wait in
            out.update(self.durability.core.stats())
        return out

    # ---- sync facade -------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig | None = None, **kw: Any) -> Engine:
        """Start an engine on a background event-loop thread (blocking portal)."""
        if (config or EngineConfig()).backend == "mlx" and kw.get("backend") is None:
            ports = kw.get("ports")
            if ports is None or ports.backend is None:
                preload_mlx()  # on this thread, not the portal's
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


def _with(ports: Ports | None, **given: Any) -> Ports:
    """``ports`` with the ports given as keywords (``Engine.open(backend=…)``) set."""
    ports = dataclasses.replace(ports) if ports is not None else Ports()
    for name, value in given.items():
        if value is not None:
            setattr(ports, name, value)
    return ports
