"""DurabilityCoordinator: write-behind of finished prefixes to SSD, and the flush.

After a request completes and its prefix entry is in RAM, the Scheduler says
``Completed``; the coordinator arms a debounce timer for that exact key
(namespace + token sequence). When it fires while the engine is busy it
re-arms (busy retry) instead of waiting: a background timer must never become
a waiter that holds admission. When it fires while idle it asks the Scheduler
to ``Snapshot`` the entry (a cheap clone, between steps), puts the clones on
the bounded ``SpillQueue`` and its single writer hands them to the cold tier,
whose tensor steps each wait for the engine to be idle. A key stays dirty
until the cold tier reports the atomic rename + directory fsync done; a
dropped or failed store stays dirty and is retried.

``Flush`` is the durability boundary: cancel timers, force every dirty key one
at a time (ignoring busy), wait for the queue to drain and every store to be
durable, and reply with evidence. Keys go one at a time so the queue cap
cannot drop one boundary snapshot while a large one is being written.

The logic is ``actors.durability_core.DurabilityCore`` (no awaits; tests
drive it by hand); this actor is a thin loop that feeds it messages, runs its
effects (snapshots, the writer, one timer) and answers flushes. The timer and
the writer feed their facts to the core directly (``_feed``), and while the
engine is idle a snapshot is the Scheduler's own ``snapshot`` called here
(``snapshot_now``) rather than an ask: see docs/durability.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, assert_never

import anyio
import msgspec
from anyio.abc import TaskGroup

from actors.cold_tier import ColdTier
from actors.durability_core import (
    DEADLINE_EPSILON_S,
    DurabilityCore,
    DurabilitySettings,
    FlushFinished,
    FlushReport,
    RecState,
    TakeSnapshot,
    WriteItem,
)
from actors.events import EngineBusy, EngineIdle
from actors.runtime import DEFER, Actor, ActorRef, Envelope, Failure, InboxFull
from actors.scheduler import Settle, Snapshot
from engine.errors import EngineDead
from engine.kv.prompt_cache import token_bytes
from engine.kv.spill_queue import SpillItem
from engine.ports import LoopClock

log = logging.getLogger("ember.durability")

__all__ = [
    "Completed",
    "Spill",
    "SnapshotTaken",
    "StoreDone",
    "Tick",
    "Settled",
    "Flush",
    "DurabilityStats",
    "Inbox",
    "DurabilityCoordinator",
    "IdleGate",
    "ColdTierPort",
    "DurabilityCore",
    "DurabilitySettings",
    "FlushReport",
    "RecState",
]


# ---------------------------------------------------------------------------
# Messages the DurabilityCoordinator accepts.


class Completed(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Scheduler → Durability: a finished row's prefix entry (exactly these
    tokens, in namespace ``ns``) was put in the RAM tier."""

    ns: str
    tokens: list[int]


class Spill(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """PromptCache (via the Scheduler) → Durability: an entry leaving RAM
    (``kind`` = ``evict`` or ``demote``) hands over owned clones of its KV to be
    written; the coordinator releases them on every path."""

    ns: str
    tokens: list[int]
    cache: Any
    nbytes: int
    kind: str = "evict"


class SnapshotTaken(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Scheduler → Durability (the reply to ``Snapshot``): owned clones of the
    RAM entry, or ``cache=None`` when the entry is gone (``error`` set when the
    Scheduler could not be asked)."""

    ns: str
    tokens: list[int]
    cache: Any = None
    nbytes: int = 0
    error: str | None = None


class StoreDone(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """ColdTier (via the writer) → Durability: spill item ``seq`` is durable on
    SSD (``ok``: renamed and the directory fsynced) or its store failed."""

    seq: int
    ok: bool
    error: str | None = None


class Tick(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Durability's timer → Durability: a debounce or retry deadline passed."""


class Settled(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Durability's ``Settle`` ask → Durability: every row finished before the
    flush was asked has had its cache put (its ``Completed`` came first)."""


class Flush(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Caller → Durability (ask): make every dirty key durable now; the reply is
    a ``FlushReport`` (``durable`` says whether it worked). Idempotent: a flush
    asked while one runs joins it."""


class DurabilityStats(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Caller → Durability (ask): the pending/dropped/failed counters."""


Inbox = Completed | Spill | SnapshotTaken | StoreDone | Tick | Settled | Flush | DurabilityStats


# ---------------------------------------------------------------------------
# The shell.


class IdleGate:
    """The per-tensor write gate: open only between ``EngineIdle`` and ``EngineBusy``.

    Subscribed to the Scheduler directly (it quacks like an ``ActorRef``), so
    it flips in the same instant the Scheduler publishes, before the
    Scheduler's next GPU step starts; an event that first queued in an inbox
    could let one tensor write slip into that step.
    """

    name = "idle-gate"

    def __init__(self) -> None:
        self.busy = False
        self.busy_edges = 0  # idle → busy edges so far: unchanged and not busy = idle all along
        self._idle = anyio.Event()
        self._idle.set()

    def tell_nowait(self, msg: EngineIdle | EngineBusy) -> None:
        match msg:
            case EngineBusy():
                if not self.busy:
                    self.busy = True
                    self.busy_edges += 1
                    self._idle = anyio.Event()
            case EngineIdle():
                self.busy = False
                self._idle.set()
            case _:
                assert_never(msg)

    async def wait_turn(self) -> None:
        while self.busy:
            await self._idle.wait()


class SpillWriter(Protocol):
    """The cold tier as the writer uses it: write one entry atomically, with
    ``wait_turn`` awaited before every tensor step; True once renamed and the
    directory fsynced."""

    async def store(self, ns: str, tokens: list[int], cache: Any, wait_turn: Callable[[], Awaitable[None]]) -> bool: ...


class DurabilityCoordinator(Actor[Inbox]):
    name = "durability"
    inbox_size = 1024  # Completed/Spill arrive with tell_nowait from the Scheduler

    def __init__(
        self,
        core: DurabilityCore,
        scheduler: ActorRef[Any],
        writer: SpillWriter,
        gate: IdleGate,
        snapshot_now: Callable[[str, list[int]], tuple[Any, int] | None] | None = None,
    ):
        super().__init__()
        self.core = core
        self.scheduler = scheduler
        self.writer = writer
        self.gate = gate
        # The Scheduler's own snapshot (``SchedulerCore.snapshot``), called
        # here while the gate says idle: the Scheduler then waits on its
        # inbox, between steps, which is where it would answer the ask.
        self.snapshot_now = snapshot_now
        self._running = True  # False once the inbox loop has ended
        self._tg: TaskGroup | None = None
        self._flush_waiters: list[Envelope[Any]] = []
        self._settling = False
        # One timer task for the actor's life, working toward ``_timer_due``
        # (the core's next deadline). A deadline that moves later is picked
        # up when the sleep toward the earlier one ends; only an earlier one
        # interrupts it: most re-arms (~3 per request) cost nothing, where a
        # cancelled task and a new one each were most of the timer's cost.
        self._timer_due: float | None = None
        self._timer_scope: anyio.CancelScope | None = None  # the loop's sleep, while it sleeps
        self._timer_wake: anyio.Event | None = None  # set to wake it while it waits for a deadline
        # on an asyncio loop with the loop's clock: one future the timer waits
        # on (a loop timer toward the deadline, or none), resolved to re-aim it
        self._timer_fut: asyncio.Future[None] | None = None
        # the single writer: one task for the actor's life, fed ``WriteItem``s
        # (the core has one in flight at a time) instead of a task per item
        self._writes: deque[SpillItem] = deque()
        self._writer_fut: asyncio.Future[None] | None = None

    async def main(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._timer)
            tg.start_soon(self._writer)
            async for env in self._inbox_recv:
                await self._dispatch(env)
                self._run_effects()
            self._running = False
            tg.cancel_scope.cancel()

    async def receive(self, msg: Inbox) -> Any:
        core = self.core
        match msg:
            case Completed():
                core.completed(msg.ns, msg.tokens)
            case Spill():
                core.spill(SpillItem(msg.ns, list(msg.tokens), msg.cache, msg.nbytes, kind=msg.kind))
            case SnapshotTaken():
                item = None
                if msg.cache is not None:
                    item = SpillItem(msg.ns, list(msg.tokens), msg.cache, msg.nbytes, kind="snapshot")
                core.snapshot_taken(msg.ns, msg.tokens, item, msg.error)
            case StoreDone():
                core.store_done(msg.seq, msg.ok, msg.error)
            case Tick():
                self._timer_due = None
                core.tick()
            case Flush():
                # First settle with the Scheduler: a row whose last token the
                # caller has seen may not have been put (and announced) yet.
                assert self.current is not None and self._tg is not None  # inside receive(), inside main()
                self._flush_waiters.append(self.current)
                if core.flushing:
                    core.flush()  # joins the running flush
                elif not self._settling:
                    self._settling = True
                    self._tg.start_soon(self._settle)
                return DEFER
            case Settled():
                self._settling = False
                core.flush()
            case DurabilityStats():
                return core.stats()
            case _:
                assert_never(msg)
        return None

    def _feed(self, fact: Callable[[], None]) -> None:
        """A helper task's fact (a tick, a store's end) goes to the core at
        once instead of through the inbox: the core has no awaits, so it runs
        between two messages just as a message would, one event-loop turn
        and an inbox hop sooner. Dropped once the inbox loop has ended (a
        message would have found the inbox closed)."""
        if self._running:
            fact()
            self._run_effects()

    def _run_effects(self) -> None:
        tg = self._tg
        assert tg is not None
        while effects := self.core.take_effects():
            for eff in effects:
                self._effect(tg, eff)
        due = self.core.next_due()
        if due != self._timer_due:
            old, self._timer_due = self._timer_due, due
            if due is not None and (old is None or due < old):
                fut = self._timer_fut
                if fut is not None:
                    if not fut.done():
                        fut.set_result(None)  # waiting, or sleeping toward a later deadline: re-aim
                elif self._timer_scope is not None:
                    self._timer_scope.cancel()  # sleeping toward a later deadline: re-aim
                elif self._timer_wake is not None:
                    self._timer_wake.set()

    def _effect(self, tg: TaskGroup, eff: Any) -> None:
        match eff:
            case TakeSnapshot():
                if self.snapshot_now is not None and not self.gate.busy:
                    self._snapshot_idle(eff.ns, eff.tokens)  # its effects run in the next round
                else:
                    tg.start_soon(self._snapshot, eff.ns, eff.tokens)
            case WriteItem():
                self._writes.append(eff.item)
                fut = self._writer_fut
                if fut is not None and not fut.done():
                    fut.set_result(None)
            case FlushFinished():
                waiters, self._flush_waiters = self._flush_waiters, []
                for env in waiters:
                    env.answer(eff.report)
            case _:
                assert_never(eff)

    def _snapshot_idle(self, ns: str, tokens: list[int]) -> None:
        """``_snapshot`` without the ask, while the engine is idle: what the
        Scheduler would answer between steps, taken now (no task, no reply
        stream, no ``SnapshotTaken`` through the inbox)."""
        assert self.snapshot_now is not None  # _snapshot_idle is chosen only with it
        try:
            got = self.snapshot_now(ns, tokens)
        except Exception as exc:  # noqa: BLE001 - as the ask's Failure: the key stays dirty
            self.core.snapshot_taken(ns, tokens, None, repr(exc))
            return
        item = None
        if got is not None:
            cache, nbytes = got
            item = SpillItem(ns, list(tokens), cache, nbytes, kind="snapshot")
        self.core.snapshot_taken(ns, tokens, item)

    async def _timer(self) -> None:
        """Tick once ``_timer_due`` passes; re-reads it after every wake-up."""
        clock = self.core.clock
        loop = asyncio._get_running_loop()
        if loop is not None and type(clock) is LoopClock:
            return await self._loop_timer(loop, clock)
        while self._running:
            due = self._timer_due
            if due is None:
                self._timer_wake = anyio.Event()
                await self._timer_wake.wait()
                self._timer_wake = None
                continue
            delay = due - clock.now()
            if delay > DEADLINE_EPSILON_S:
                with anyio.CancelScope() as scope:
                    self._timer_scope = scope
                    await clock.sleep(delay)
                self._timer_scope = None
                continue
            self._feed(self._tick)

    async def _loop_timer(self, loop: asyncio.AbstractEventLoop, clock: LoopClock) -> None:
        """``_timer`` on the asyncio loop it reads the time of: a bare loop
        timer at the instant ``clock.sleep`` would end (``call_later`` with the
        same delay) and one future, instead of a cancel scope and a sleep per
        wait (an anyio scope's enter and exit were most of the timer's cost)."""
        while self._running:
            due = self._timer_due
            handle = None
            if due is not None:
                delay = due - clock.now()
                if delay <= DEADLINE_EPSILON_S:
                    self._feed(self._tick)
                    continue
            self._timer_fut = fut = loop.create_future()
            if due is not None:
                handle = loop.call_later(delay, _resolve, fut)
            try:
                await fut
            finally:
                self._timer_fut = None
                if handle is not None:
                    handle.cancel()

    def _tick(self) -> None:
        self._timer_due = None
        self.core.tick()

    async def _settle(self) -> None:
        try:
            await self.scheduler.ask(Settle(), nowait=True)
        except Exception as exc:  # noqa: BLE001 - a stopped Scheduler has nothing left to put
            log.warning("[durability] flush could not settle with the scheduler: %r", exc)
        await self._tell_self(Settled())

    async def _snapshot(self, ns: str, tokens: list[int]) -> None:
        # nowait: a snapshot request never waits on the Scheduler's inbox
        try:
            got = await self.scheduler.ask(Snapshot(ns=ns, tokens=tokens), nowait=True)
        except Exception as exc:  # noqa: BLE001 - a failed ask leaves the key dirty
            msg = SnapshotTaken(ns=ns, tokens=tokens, error=repr(exc))
        else:
            cache, nbytes = got if got is not None else (None, 0)
            msg = SnapshotTaken(ns=ns, tokens=tokens, cache=cache, nbytes=nbytes)
        await self._tell_self(msg)

    async def _writer(self) -> None:
        """Write the items ``WriteItem`` hands over, one at a time, in order:
        a task spawned per item through the task group cost more than the
        write's own bookkeeping. An item handed over while the one before is
        finishing (the core pumps the next at its ``store_done``) starts at
        once; otherwise the writer waits on a bare future."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._writes:
                self._writer_fut = fut = loop.create_future()
                try:
                    await fut
                finally:
                    self._writer_fut = None
            await self._write(self._writes.popleft())

    async def _write(self, item: SpillItem) -> None:
        """The single writer: one item, each tensor step behind the idle gate.

        ``write_start``/``write_end`` bracket every write step so a test can
        check on the event log that no write step begins during a GPU step.
        A step starts only while the engine is idle (the gate hands out a
        turn) and is one gated unit: the following tensor steps (and the
        commit) join it as long as the engine has stayed idle since it began
        (no busy edge in between), which is what a fresh turn would find
        anyway; once the engine has been busy, the next gate call closes the
        step and waits for a new turn. Two records per entry instead of two
        per tensor.
        """
        record = self.core.record
        gate = self.gate
        stepping = False
        edges = -1

        async def turn() -> None:
            nonlocal stepping, edges
            if stepping:
                if not gate.busy and gate.busy_edges == edges:
                    return  # idle since this step began: the same gated unit goes on
                record("write_end", seq=item.seq)
                stepping = False
            await gate.wait_turn()
            record("write_start", seq=item.seq)
            stepping = True
            edges = gate.busy_edges

        record("write_item", seq=item.seq, source=item.kind, tokens=len(item.tokens), bytes=item.nbytes)
        try:
            ok, error = await self.writer.store(item.ns, item.tokens, item.cache, turn), None
        except Exception as exc:  # noqa: BLE001 - a write fault is a failed store, never a crash
            ok, error = False, repr(exc)
        finally:
            if stepping:
                record("write_end", seq=item.seq)
        self._feed(lambda: self.core.store_done(item.seq, bool(ok), error))

    async def _tell_self(self, msg: Inbox) -> None:
        # helper tasks may wait for inbox space; only the Scheduler's paths must not.
        # With room (nearly always: 1,024 slots) the message goes in at once,
        # without the extra event-loop turn ``tell`` takes before sending.
        try:
            try:
                self.ref.tell_nowait(msg)
            except InboxFull:
                await self.ref.tell(msg)
        except EngineDead:
            pass  # stopping: what is in flight is discarded in ``stopping``

    async def stopping(self, reason: BaseException | None) -> None:
        left = self.core.queue.close()
        if left:
            log.warning("[durability] stopped with %d spill(s) not durable", len(left))
        report = Failure(EngineDead("durability coordinator stopped"))
        for env in self._flush_waiters:
            env.answer(report)
        self._flush_waiters = []


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# ---------------------------------------------------------------------------
# The cold tier as the coordinator sees it (ember.assemble wires them).


class ColdTierPort:
    """The ColdTier actor as the coordinator uses it: its in-memory index
    (``ColdIndex``, read synchronously on the loop like the Scheduler's own
    lookups) and its ``store_now`` (a ``Store`` ask, or the same write on
    the caller's task when the tier's writer is idle: ``SpillWriter``)."""

    def __init__(self, tier: ColdTier):
        self.tier = tier
        self._keys: dict[int, list[Any]] = {}  # id(tokens) -> [tokens, key, ns, store.adds when last not held]

    def holds(self, tokens: list[int], ns: str) -> bool:
        # The core asks ~30 times per request about the same few records, and
        # their token lists never change (it copies them at creation): their
        # index keys are kept by list identity (the list is held, so its id
        # cannot be reused) instead of being rebuilt from thousands of ints.
        # Only a newly indexed entry can make a key held (evictions only take
        # away), so a "no" stands until the store has indexed another entry.
        hit = self._keys.get(id(tokens))
        if hit is None or hit[0] is not tokens:
            if len(self._keys) >= 4096:
                del self._keys[next(iter(self._keys))]
            hit = self._keys[id(tokens)] = [tokens, token_bytes(tokens), None, -1]
        store = self.tier.store
        if hit[2] == ns and hit[3] >= 0:
            if hit[3] == store.adds:
                return False
            # Only an entry indexed since the "no" can cover the key now: if none
            # of those does (an entry that is gone covers nothing either), the
            # "no" stands without a lookup in the index.
            new = store.added_since(hit[3])
            if new is not None:
                key = hit[1]
                if not any(n == ns and (k.startswith(key) if trim else k == key) for n, k, trim in new):
                    hit[3] = store.adds
                    return False
        if store.holds_key(hit[1], ns):
            return True
        hit[2], hit[3] = ns, store.adds
        return False

    def summary(self) -> tuple[int, int]:
        store = self.tier.store
        return len(store), store.longest_entry()

    async def store(self, ns: str, tokens: list[int], cache: Any, wait_turn: Callable[[], Awaitable[None]]) -> bool:
        return bool(await self.tier.store_now(list(tokens), ns, cache, wait_turn))
