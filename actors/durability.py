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

The logic is ``DurabilityCore`` (no awaits; tests drive it by hand); the
actor is a thin loop that feeds it messages, runs its effects (snapshot asks,
the writer, one timer) and answers flushes.
"""

from __future__ import annotations

import enum
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol

import anyio
import msgspec
import numpy as np
from anyio.abc import TaskGroup

from actors.cold_tier import ColdTier, Store
from actors.events import EngineBusy, EngineIdle
from actors.runtime import DEFER, Actor, ActorRef, Envelope, Failure
from actors.scheduler import Scheduler, Settle, Snapshot
from engine.errors import EngineDead
from engine.eventlog import EventLog
from engine.ports import Clock
from engine.spill_queue import GIB, ItemState, SpillItem, SpillQueue

log = logging.getLogger("ember.durability")


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


class FlushReport(msgspec.Struct, frozen=True, kw_only=True):
    """The evidence a flush returns (``POST /admin/cache/flush`` sends it as JSON)."""

    durable: bool
    flushed: int = 0
    missing: int = 0
    pending_snapshots: int = 0
    pending_spills: int = 0
    pending_spill_bytes: int = 0
    dropped_spills: int = 0
    failed_spills: int = 0
    elapsed_ms: float = 0.0
    entries: int = 0
    longest_durable_prefix_tokens: int = 0


# ---------------------------------------------------------------------------
# Settings (config + environment, read once when the engine is built).


class DurabilitySettings(msgspec.Struct, frozen=True, kw_only=True):
    writebehind: bool = True
    debounce_s: float = 1.0
    busy_retry_s: float = 5.0
    spill_queue_bytes: int = 2 * GIB
    shutdown_timeout_s: float = 120.0


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
# Per-key record: an enum plus a transition table; an illegal move raises.


class RecState(enum.Enum):
    ARMED = "armed"  # debounce timer running
    BUSY_REARMED = "busy_rearmed"  # the timer fired while busy; retry timer running
    SNAPSHOTTING = "snapshotting"  # Snapshot asked of the Scheduler
    QUEUED = "queued"  # clones on the spill queue
    STORING = "storing"  # the cold tier is writing it
    FAILED = "failed"  # dropped or store failed: dirty, retryable
    COVERED = "covered"  # superseded in RAM by a longer entry whose record is still dirty
    DURABLE = "durable"  # on SSD (renamed + dir fsynced): the record retires
    MISSING = "missing"  # gone from RAM and not on SSD: the record retires


_ATTEMPTABLE = frozenset({RecState.ARMED, RecState.BUSY_REARMED, RecState.FAILED})
_IN_FLIGHT = frozenset({RecState.SNAPSHOTTING, RecState.QUEUED, RecState.STORING})

REC_TRANSITIONS: dict[RecState, frozenset[RecState]] = {
    # a spill of the same entry (eviction) can carry a dirty key straight to the queue
    RecState.ARMED: frozenset({RecState.ARMED, RecState.BUSY_REARMED, RecState.SNAPSHOTTING, RecState.QUEUED, RecState.DURABLE}),
    RecState.BUSY_REARMED: frozenset({RecState.ARMED, RecState.BUSY_REARMED, RecState.SNAPSHOTTING, RecState.QUEUED, RecState.DURABLE}),
    RecState.FAILED: frozenset({RecState.ARMED, RecState.BUSY_REARMED, RecState.SNAPSHOTTING, RecState.QUEUED, RecState.DURABLE}),
    RecState.SNAPSHOTTING: frozenset({RecState.QUEUED, RecState.STORING, RecState.DURABLE, RecState.MISSING, RecState.FAILED, RecState.COVERED}),
    # the longer entry, once durable, serves this prefix by trimming (RAM only supersedes for trimmable ones)
    RecState.COVERED: frozenset({RecState.ARMED, RecState.DURABLE, RecState.MISSING}),
    RecState.QUEUED: frozenset({RecState.STORING, RecState.FAILED}),
    RecState.STORING: frozenset({RecState.DURABLE, RecState.FAILED}),
    RecState.DURABLE: frozenset(),
    RecState.MISSING: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


Key = tuple[str, tuple[int, ...]]

_EPSILON_S = 1e-9  # deadlines this close count as reached (float sums of the clock)


@dataclass(eq=False, slots=True)
class Record:
    ns: str
    tokens: list[int]
    seq: int
    state: RecState = RecState.ARMED
    due: float | None = None
    item: SpillItem | None = None
    attempts: int = 0

    @property
    def key(self) -> Key:
        return (self.ns, tuple(self.tokens))

    def move(self, to: RecState) -> None:
        if to not in REC_TRANSITIONS[self.state]:
            raise IllegalTransition(f"durability record {self.seq} ({len(self.tokens)} tokens): {self.state.value} -> {to.value}")
        self.state = to


# ---------------------------------------------------------------------------
# Effects the core asks its shell to carry out.


@dataclass(frozen=True, slots=True)
class TakeSnapshot:
    ns: str
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class WriteItem:
    item: SpillItem


@dataclass(frozen=True, slots=True)
class FlushFinished:
    report: FlushReport


Effect = TakeSnapshot | WriteItem | FlushFinished


class ColdIndex(Protocol):
    """What the core reads of the cold tier (its in-memory index, no I/O)."""

    def holds(self, tokens: list[int], ns: str) -> bool:
        """True if a durable file covers exactly ``tokens`` (equal, or longer and trimmable)."""
        ...

    def summary(self) -> tuple[int, int]:
        """(entries, longest durable prefix in tokens)."""
        ...


@dataclass(slots=True)
class _FlushRun:
    started: float
    dropped0: int
    failed0: int
    flushed: int = 0
    missing: int = 0
    attempted: set[Key] = field(default_factory=set)
    progress: bool = False


class DurabilityCore:
    """The coordinator's logic: records, timers (as deadlines), the spill queue, flush."""

    def __init__(
        self,
        settings: DurabilitySettings,
        clock: Clock,
        cold: ColdIndex,
        is_busy: Callable[[], bool],
        events: EventLog | None = None,
    ):
        self.settings = settings
        self.clock = clock
        self.cold = cold
        self.is_busy = is_busy  # the IdleGate's view: exact, not an inbox behind
        self.events = events
        self.queue = SpillQueue(settings.spill_queue_bytes)
        self.records: dict[Key, Record] = {}  # insertion order = the order flush forces them
        self.effects: list[Effect] = []
        self._flush: _FlushRun | None = None
        self._seq = 0
        self.counters = {"scheduled": 0, "durable": 0, "missing": 0, "busy_rearms": 0, "snapshots": 0}

    # ---- facts ---------------------------------------------------------------
    def completed(self, ns: str, tokens: list[int]) -> None:
        """A prefix entry was put in RAM: arm (or re-arm) its debounce."""
        if not self.settings.writebehind or not tokens:
            return
        key = (ns, tuple(tokens))
        rec = self.records.get(key)
        if rec is not None and rec.state in _IN_FLIGHT:
            return  # the same key holds the same KV: the write in progress covers it
        if rec is None:
            self._seq += 1
            rec = Record(ns, list(tokens), self._seq)
            self.records[key] = rec
            self.counters["scheduled"] += 1
        else:
            rec.move(RecState.ARMED)
        # under a flush the timer is moot: the flush forces this key too
        rec.due = None if self._flush else self.clock.now() + self.settings.debounce_s
        self._advance_flush()

    def spill(self, item: SpillItem) -> None:
        """An entry left RAM with owned clones: queue them (and let a dirty record
        of the same key ride on them instead of snapshotting a vanished entry)."""
        dropped = self.queue.push(item)
        rec = self.records.get(item.key)
        if rec is not None and rec.state in _ATTEMPTABLE and item.state is ItemState.QUEUED:
            rec.move(RecState.QUEUED)
            rec.due, rec.item = None, item
        self._dropped(dropped)
        self._pump()
        self._advance_flush()

    def tick(self) -> None:
        """Fire every deadline that has passed, oldest first."""
        now = self.clock.now() + _EPSILON_S
        due = sorted((r for r in self.records.values() if r.due is not None and r.due <= now), key=lambda r: (r.due, r.seq))
        for rec in due:
            rec.due = None
            self._attempt(rec, force=False)
        self._advance_flush()

    def snapshot_taken(self, msg: SnapshotTaken, item: SpillItem | None) -> None:
        """The Scheduler answered a Snapshot: ``item`` holds the clones, if any."""
        rec = self.records.get((msg.ns, tuple(msg.tokens)))
        if rec is None or rec.state is not RecState.SNAPSHOTTING:
            if item is not None:  # nobody wants it any more
                item.free()
            return
        if item is not None:
            self.counters["snapshots"] += 1
            dropped = self.queue.push(item)
            if item.state is ItemState.QUEUED:
                rec.move(RecState.QUEUED)
                rec.item = item
            else:  # the queue was closed
                self._fail(rec, "spill queue closed")
            self._dropped(dropped)
            self._pump()
        elif self.cold.holds(rec.tokens, rec.ns):
            self._retire(rec, RecState.DURABLE)
        elif (pending := self.queue.find(rec.key)) is not None:
            # evicted meanwhile: its spill on the queue carries this key
            rec.move(RecState.STORING if pending is self.queue.in_flight else RecState.QUEUED)
            rec.item = pending
        elif msg.error is not None:
            self._fail(rec, msg.error)
        elif self._descendant(rec) is not None:
            rec.move(RecState.COVERED)
        else:
            log.warning("[durability] snapshot missing tokens=%d ns=%r (gone from RAM, not on SSD)", len(rec.tokens), rec.ns)
            self._retire(rec, RecState.MISSING)
        self._advance_flush()

    def store_done(self, msg: StoreDone) -> None:
        item = self.queue.in_flight
        if item is None or item.seq != msg.seq:
            return  # the queue was closed while it was being written
        self.queue.settle(item, msg.ok)
        self._record("write_done", seq=item.seq, ok=msg.ok)
        if not msg.ok:
            log.warning("[durability] store failed tokens=%d kind=%s error=%s", len(item.tokens), item.kind, msg.error)
        rec = self.records.get(item.key)
        if rec is not None and rec.item is item:
            rec.item = None
            if msg.ok:
                self._retire(rec, RecState.DURABLE)
            else:
                self._fail(rec, msg.error or "store failed")
        self._pump()
        self._advance_flush()

    # ---- flush ---------------------------------------------------------------
    def flush(self) -> None:
        """Begin a flush (or join the one running); ``FlushFinished`` ends it."""
        if self._flush is None:
            self._flush = _FlushRun(self.clock.now(), self.queue.dropped, self.queue.failed)
            for rec in self.records.values():
                rec.due = None
            log.info("[durability] flush start dirty=%d pending_spills=%d", len(self.records), self.queue.pending)
            self._record("flush_start", dirty=len(self.records), pending_spills=self.queue.pending)
        self._advance_flush()

    @property
    def flushing(self) -> bool:
        return self._flush is not None

    def _advance_flush(self) -> None:
        run = self._flush
        while run is not None:
            if not self.queue.drained or any(r.state in _IN_FLIGHT for r in self.records.values()):
                return  # wait for what is in flight: one key at a time
            nxt = next((r for r in self.records.values() if r.state in _ATTEMPTABLE and r.key not in run.attempted), None)
            if nxt is not None:
                run.attempted.add(nxt.key)
                self._attempt(nxt, force=True)
                continue
            if run.progress and self.records:
                run.attempted.clear()  # another pass for keys that failed while others progressed
                run.progress = False
                continue
            self._finish_flush(run)
            return

    def _finish_flush(self, run: _FlushRun) -> None:
        self._flush = None
        now = self.clock.now()
        for rec in self.records.values():  # still dirty: back to retrying in the background
            if rec.state in _ATTEMPTABLE:
                rec.due = now + self.settings.busy_retry_s
        q = self.queue
        entries, longest = self.cold.summary()
        durable = (
            not self.records
            and q.drained
            and q.dropped == run.dropped0
            and q.failed == run.failed0
            and run.missing == 0
        )
        report = FlushReport(
            durable=durable,
            flushed=run.flushed,
            missing=run.missing,
            pending_snapshots=len(self.records),
            pending_spills=q.pending,
            pending_spill_bytes=q.pending_bytes,
            dropped_spills=q.dropped,
            failed_spills=q.failed,
            elapsed_ms=round((now - run.started) * 1000.0, 3),
            entries=entries,
            longest_durable_prefix_tokens=longest,
        )
        log.info(
            "[durability] flush done durable=%s flushed=%d missing=%d pending=%d elapsed_ms=%.1f",
            durable, run.flushed, run.missing, len(self.records), report.elapsed_ms,
        )
        self._record("flush_end", durable=durable, flushed=run.flushed, missing=run.missing)
        self.effects.append(FlushFinished(report))

    # ---- internals -----------------------------------------------------------
    def _attempt(self, rec: Record, *, force: bool) -> None:
        if not force and self.is_busy():
            rec.move(RecState.BUSY_REARMED)
            rec.due = self.clock.now() + self.settings.busy_retry_s
            self.counters["busy_rearms"] += 1
            return
        rec.attempts += 1
        if self.cold.holds(rec.tokens, rec.ns):
            rec.move(RecState.SNAPSHOTTING)  # nothing to write: the SSD already covers it
            self._retire(rec, RecState.DURABLE)
            return
        rec.move(RecState.SNAPSHOTTING)
        rec.due = None
        self.effects.append(TakeSnapshot(rec.ns, list(rec.tokens)))

    def _fail(self, rec: Record, why: str) -> None:
        rec.move(RecState.FAILED)
        rec.item = None
        # a flush decides itself when to retry; otherwise the busy-retry timer does
        rec.due = None if self._flush else self.clock.now() + self.settings.busy_retry_s

    def _retire(self, rec: Record, to: RecState) -> None:
        rec.move(to)
        del self.records[rec.key]
        self.counters["durable" if to is RecState.DURABLE else "missing"] += 1
        if self._flush is not None:
            self._flush.progress = True
            if to is RecState.DURABLE:
                self._flush.flushed += 1
            else:
                self._flush.missing += 1
        self._settle(rec.ns)

    def _settle(self, ns: str) -> None:
        """After a key of ``ns`` retires: waiting keys the SSD now covers are
        durable without a write of their own, and covered keys left with no
        dirty longer record are missing."""
        for other in [r for r in self.records.values() if r.ns == ns and (r.state in _ATTEMPTABLE or r.state is RecState.COVERED)]:
            if self.records.get(other.key) is not other:
                continue  # retired by a nested settle
            if self.cold.holds(other.tokens, ns):
                self._retire(other, RecState.DURABLE)
            elif other.state is RecState.COVERED and self._descendant(other) is None:
                log.warning("[durability] snapshot missing tokens=%d ns=%r (its longer entry was lost)", len(other.tokens), ns)
                self._retire(other, RecState.MISSING)

    def _descendant(self, rec: Record) -> Record | None:
        """A dirty record of the same conversation that extends ``rec``'s tokens."""
        n = len(rec.tokens)
        for r in self.records.values():
            if r is not rec and r.ns == rec.ns and len(r.tokens) > n and r.tokens[:n] == rec.tokens:
                return r
        return None

    def _dropped(self, dropped: list[SpillItem]) -> None:
        for item in dropped:
            self._record("spill_dropped", seq=item.seq, bytes=item.nbytes)
            rec = self.records.get(item.key)
            if rec is not None and rec.item is item:
                self._fail(rec, "dropped from the spill queue")

    def _pump(self) -> None:
        item = self.queue.pop_next()
        if item is None:
            return
        rec = self.records.get(item.key)
        if rec is not None and rec.item is item:
            rec.move(RecState.STORING)
        self.effects.append(WriteItem(item))

    def _record(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.record(event, self.clock.now(), **fields)

    def take_effects(self) -> list[Effect]:
        out, self.effects = self.effects, []
        return out

    def next_due(self) -> float | None:
        dues = [r.due for r in self.records.values() if r.due is not None]
        return min(dues) if dues else None

    def stats(self) -> dict[str, Any]:
        return {
            "pending_snapshots": len(self.records),  # armed, busy re-armed, failed and in flight
            **self.queue.stats(),
            "longest_durable_prefix_tokens": self.cold.summary()[1],
            "writebehind": self.settings.writebehind,
            **self.counters,
        }


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
        self._idle = anyio.Event()
        self._idle.set()

    def tell_nowait(self, msg: EngineIdle | EngineBusy) -> None:
        match msg:
            case EngineBusy():
                if not self.busy:
                    self.busy = True
                    self._idle = anyio.Event()
            case EngineIdle():
                self.busy = False
                self._idle.set()

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
    ):
        super().__init__()
        self.core = core
        self.scheduler = scheduler
        self.writer = writer
        self.gate = gate
        self._tg: TaskGroup | None = None
        self._flush_waiters: list[Envelope[Any]] = []
        self._settling = False
        self._timer_due: float | None = None
        self._timer_scope: anyio.CancelScope | None = None

    async def main(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            async for env in self._inbox_recv:
                await self._dispatch(env)
                self._run_effects()
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
                core.snapshot_taken(msg, item)
            case StoreDone():
                core.store_done(msg)
            case Tick():
                self._timer_due = None
                core.tick()
            case Flush():
                # First settle with the Scheduler: a row whose last token the
                # caller has seen may not have been put (and announced) yet.
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
        return None

    def _run_effects(self) -> None:
        tg = self._tg
        assert tg is not None
        for eff in self.core.take_effects():
            match eff:
                case TakeSnapshot():
                    tg.start_soon(self._snapshot, eff.ns, eff.tokens)
                case WriteItem():
                    tg.start_soon(self._write, eff.item)
                case FlushFinished():
                    waiters, self._flush_waiters = self._flush_waiters, []
                    for env in waiters:
                        env.answer(eff.report)
        due = self.core.next_due()
        if due != self._timer_due:
            if self._timer_scope is not None:
                self._timer_scope.cancel()
                self._timer_scope = None
            self._timer_due = due
            if due is not None:
                self._timer_scope = anyio.CancelScope()
                tg.start_soon(self._timer, due, self._timer_scope)

    async def _timer(self, due: float, scope: anyio.CancelScope) -> None:
        with scope:
            delay = due - self.core.clock.now()
            if delay > _EPSILON_S:
                await self.core.clock.sleep(delay)
            await self._tell_self(Tick())

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

    async def _write(self, item: SpillItem) -> None:
        """The single writer: one item, each tensor step behind the idle gate.

        ``write_start``/``write_end`` bracket every step (the gate hands out a
        turn, the next gate call or the end of the store closes it) so a test
        can check on the event log that no write step overlaps a GPU step.
        """
        record = self.core._record
        stepping = False

        async def turn() -> None:
            nonlocal stepping
            if stepping:
                record("write_end", seq=item.seq)
                stepping = False
            await self.gate.wait_turn()
            record("write_start", seq=item.seq)
            stepping = True

        record("write_item", seq=item.seq, source=item.kind, tokens=len(item.tokens), bytes=item.nbytes)
        try:
            ok, error = await self.writer.store(item.ns, item.tokens, item.cache, turn), None
        except Exception as exc:  # noqa: BLE001 - a write fault is a failed store, never a crash
            ok, error = False, repr(exc)
        finally:
            if stepping:
                record("write_end", seq=item.seq)
        await self._tell_self(StoreDone(seq=item.seq, ok=bool(ok), error=error))

    async def _tell_self(self, msg: Inbox) -> None:
        # helper tasks may wait for inbox space; only the Scheduler's paths must not
        try:
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


# ---------------------------------------------------------------------------
# Wiring into the engine.


class ColdTierPort:
    """The ColdTier actor as the coordinator uses it: its in-memory index
    (``ColdIndex``, read synchronously on the loop like the Scheduler's own
    lookups) and its ``Store`` ask (``SpillWriter``)."""

    def __init__(self, tier: ColdTier):
        self.tier = tier

    def holds(self, tokens: list[int], ns: str) -> bool:
        want = np.asarray(tokens, dtype=np.int64)
        for e in self.tier.store.entries():
            n = want.size
            if e.ns == ns and e.tokens.size >= n and (e.tokens.size == n or e.trimmable) and np.array_equal(e.tokens[:n], want):
                return True
        return False

    def summary(self) -> tuple[int, int]:
        entries = self.tier.store.entries()
        return len(entries), max((int(e.tokens.size) for e in entries), default=0)

    async def store(self, ns: str, tokens: list[int], cache: Any, wait_turn: Callable[[], Awaitable[None]]) -> bool:
        return bool(await self.tier.ref.ask(Store(tokens=list(tokens), ns=ns, cache=cache, wait_turn=wait_turn)))


def build_coordinator(
    config: Any,
    clock: Clock,
    events: EventLog,
    backend: Any,
    scheduler: Scheduler,
    cold_tier: ColdTier,
    prefix_cache: Any,
    environ: Mapping[str, str] | None = None,
) -> DurabilityCoordinator:
    """Make the coordinator and hook it in: the idle gate on the Scheduler's
    idle/busy edges, ``Completed`` from the RAM tier's put hook and ``Spill``
    from its eviction/demotion hook (both ``tell_nowait``: a full inbox loses
    one write-behind, never blocks the Scheduler)."""
    settings = settings_from(config, environ)
    gate = IdleGate()
    scheduler.subscribe(gate)  # type: ignore[arg-type] - it takes the tell_nowait of an ActorRef
    port = ColdTierPort(cold_tier)
    core = DurabilityCore(settings, clock, port, lambda: gate.busy, events)
    coord = DurabilityCoordinator(core, scheduler.ref, port, gate)
    ref = coord.ref

    def on_put(tokens: list[int], ns: str) -> None:
        ref.tell_nowait(Completed(ns=ns, tokens=tokens))

    def on_spill(tokens: list[int], ns: str, cache: Any) -> None:
        ref.tell_nowait(Spill(ns=ns, tokens=tokens, cache=cache, nbytes=int(backend.cache_nbytes(cache))))

    if settings.writebehind:
        prefix_cache.on_put = on_put
    prefix_cache.on_spill = on_spill
    log.info(
        "[durability] on writebehind=%s debounce_s=%s spill_queue_bytes=%d",
        settings.writebehind, settings.debounce_s, settings.spill_queue_bytes,
    )
    return coord
