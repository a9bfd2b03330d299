"""DurabilityCoordinator: write-behind of finished prefixes to SSD, and the flush.

After a request completes and its prefix entry is in RAM, the Scheduler says
``Completed``; the coordinator arms a debounce timer for that exact key
(namespace + token sequence). When it fires while the engine is busy it
re-arms (busy retry) instead of waiting: a background timer must never become
a waiter that holds admission. When it fires while idle it asks the Scheduler
to ``Snapshot`` the entry (between steps, in O(1): the answer is the entry's
own cache object, not a copy, since nothing writes a stored entry), puts it on
the bounded ``SpillQueue`` and its single writer hands it to the cold tier,
whose tensor steps each wait for the engine to be idle (``IdleGate``). A key stays dirty
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
from anyio.abc import TaskGroup

from actors.durability_core import (
    DEADLINE_EPSILON_S,
    DurabilityCore,
    DurabilitySettings,
    FlushFinished,
    FlushReport,
    TakeSnapshot,
    WriteItem,
)
from actors.idle_gate import IdleGate
from actors.messages import Handoff, Wire
from actors.runtime import DEFER, Actor, ActorRef, Envelope, Failure, InboxFull
from actors.scheduler import Settle, Snapshot
from engine.errors import EngineDead
from engine.kv.spill_queue import SpillItem
from engine.ports import LoopClock

log = logging.getLogger("ember.durability")

__all__ = [
    "Completed",
    "Spill",
    "SnapshotTaken",
    "Settled",
    "Flush",
    "Inbox",
    "DurabilityCoordinator",
    "SpillWriter",
    "DurabilityCore",
    "DurabilitySettings",
    "FlushReport",
]


# ---------------------------------------------------------------------------
# Messages the DurabilityCoordinator accepts.


class Completed(Wire, frozen=True):
    """Scheduler → Durability: a finished row's prefix entry (exactly these
    tokens, in namespace ``ns``) was put in the RAM tier."""

    ns: str
    tokens: list[int]


class Spill(Handoff, frozen=True):
    """PromptCache (its spill hook, inside the Scheduler) → Durability: an entry
    left RAM (``kind`` = ``evict`` or ``demote``) and hands over its cache —
    the entry's own cache object, not a copy — to be written; the coordinator
    releases it on every path. A hand-off: it carries a live cache."""

    ns: str
    tokens: list[int]
    cache: Any
    nbytes: int
    kind: str = "evict"


class SnapshotTaken(Handoff, frozen=True):
    """Durability's ``Snapshot`` ask → Durability (the answer, through the
    inbox): the RAM entry's cache (the Scheduler's own object, not a copy:
    nothing writes a stored entry), or ``cache=None`` when the entry is gone
    (``error`` set when the Scheduler could not be asked). A hand-off: it
    carries a live cache."""

    ns: str
    tokens: list[int]
    cache: Any = None
    nbytes: int = 0
    error: str | None = None


class Settled(Wire, frozen=True):
    """Durability's ``Settle`` ask → Durability: every row finished before the
    flush was asked has had its cache put (its ``Completed`` came first)."""


class Flush(Wire, frozen=True):
    """Caller → Durability (ask): make every dirty key durable now; the reply is
    a ``FlushReport`` (``durable`` says whether it worked). Idempotent: a flush
    asked while one runs joins it."""


Inbox = Completed | Spill | SnapshotTaken | Settled | Flush


# ---------------------------------------------------------------------------
# The shell.


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
        # interrupts it: most re-arms cost nothing, where a cancelled task and
        # a new one each would cost a task (docs/sims.md, "One timer task").
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
            case Flush():
                # First settle with the Scheduler: a row whose last token the
                # caller has seen may not have been put (and announced) yet.
                assert self.current is not None and self._tg is not None  # inside receive(), inside main()
                self._flush_waiters.append(self.current)
                if core.flushing:
                    core.flush()  # joins the running flush
                elif not self._settling:
                    self._settling = True
                    self._tg.start_soon(self._settle_with_scheduler)
                return DEFER
            case Settled():
                self._settling = False
                core.flush()
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
        wait (docs/sims.md, "its timer is a bare ``call_later``")."""
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

    async def _settle_with_scheduler(self) -> None:
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
        """Write the items ``WriteItem`` hands over, one at a time, in order,
        on one task for the actor's life rather than a task per item
        (docs/sims.md, "one writer task"). An item handed over while the one before is
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
