"""The DurabilityCoordinator's logic, with no awaits: per-key records
(``actors.durability_record``), timers as deadlines, the spill queue, the
flush. ``actors.durability`` is the actor that feeds it messages and carries
out the effects it returns; tests drive this class by hand with a manual clock.

A key stays dirty until the cold tier says its file is durable (renamed,
folder fsynced); a dropped or failed store stays dirty and is retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from actors.durability_record import ATTEMPTABLE, IN_FLIGHT, Key, Record, RecState
from engine.eventlog import EventLog
from engine.kv.spill_queue import ItemState, SpillItem, SpillQueue
from engine.ports import Clock
from engine.units import GIB

log = logging.getLogger("ember.durability")


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


DEADLINE_EPSILON_S = 1e-9  # deadlines this close count as reached (float sums of the clock)


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
        self.counters = {
            "scheduled": 0,
            "durable": 0,
            "missing": 0,
            "busy_rearms": 0,
            "snapshots": 0,
            "spills_on_ssd": 0,
        }

    # ---- facts ---------------------------------------------------------------
    def completed(self, ns: str, tokens: list[int]) -> None:
        """A prefix entry was put in RAM: arm (or re-arm) its debounce."""
        if not self.settings.writebehind or not tokens:
            return
        key = (ns, tuple(tokens))
        rec = self.records.get(key)
        if rec is not None and rec.state in IN_FLIGHT:
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
        """An entry left RAM and handed over its cache: queue it (and let a dirty
        record of the same key ride on it instead of snapshotting a vanished entry).

        An entry the SSD already covers (a durable file of exactly its tokens,
        or a longer trimmable one: the same KV for these tokens) is not written
        again: its reference is released at once and a dirty record of its key
        retires durable. Most RAM evictions are of entries write-behind already
        stored (how many, and the writes this saves: docs/durability.md)."""
        if self.cold.holds(item.tokens, item.ns):
            item.free()
            self.counters["spills_on_ssd"] += 1
            rec = self.records.get(item.key)
            if rec is not None and rec.state in ATTEMPTABLE:
                self._retire(rec, RecState.DURABLE)
            self._advance_flush()
            return
        dropped = self.queue.push(item)
        rec = self.records.get(item.key)
        if rec is not None and rec.state in ATTEMPTABLE and item.state is ItemState.QUEUED:
            rec.move(RecState.QUEUED)
            rec.due, rec.item = None, item
        self._dropped(dropped)
        self._pump()
        self._advance_flush()

    def tick(self) -> None:
        """Fire every deadline that has passed, oldest first."""
        now = self.clock.now() + DEADLINE_EPSILON_S
        due = sorted(
            (r for r in self.records.values() if r.due is not None and r.due <= now), key=lambda r: (r.due, r.seq)
        )
        for rec in due:
            rec.due = None
            self._attempt(rec, force=False)
        self._advance_flush()

    def snapshot_taken(self, ns: str, tokens: list[int], item: SpillItem | None, error: str | None = None) -> None:
        """The Scheduler answered a Snapshot: ``item`` holds the entry's cache
        (the RAM entry's own object, not a copy), if any (``error``: it could
        not be asked)."""
        rec = self.records.get((ns, tuple(tokens)))
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
        elif error is not None:
            self._fail(rec, error)
        elif self._descendant(rec) is not None:
            rec.move(RecState.COVERED)
        else:
            log.warning(
                "[durability] snapshot missing tokens=%d ns=%r (gone from RAM, not on SSD)", len(rec.tokens), rec.ns
            )
            self._retire(rec, RecState.MISSING)
        self._advance_flush()

    def store_done(self, seq: int, ok: bool, error: str | None = None) -> None:
        """The writer finished spill item ``seq``: durable (``ok``) or failed."""
        item = self.queue.in_flight
        if item is None or item.seq != seq:
            return  # the queue was closed while it was being written
        self.queue.finish(item, ok)
        self.record("write_done", seq=item.seq, ok=ok)
        if not ok:
            log.warning("[durability] store failed tokens=%d kind=%s error=%s", len(item.tokens), item.kind, error)
        rec = self.records.get(item.key)
        if rec is not None and rec.item is item:
            rec.item = None
            if ok:
                self._retire(rec, RecState.DURABLE)
            else:
                self._fail(rec, error or "store failed")
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
            self.record("flush_start", dirty=len(self.records), pending_spills=self.queue.pending)
        self._advance_flush()

    @property
    def flushing(self) -> bool:
        return self._flush is not None

    def _advance_flush(self) -> None:
        run = self._flush
        while run is not None:
            if not self.queue.drained or any(r.state in IN_FLIGHT for r in self.records.values()):
                return  # wait for what is in flight: one key at a time
            nxt = next(
                (r for r in self.records.values() if r.state in ATTEMPTABLE and r.key not in run.attempted), None
            )
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
            if rec.state in ATTEMPTABLE:
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
            durable,
            run.flushed,
            run.missing,
            len(self.records),
            report.elapsed_ms,
        )
        self.record("flush_end", durable=durable, flushed=run.flushed, missing=run.missing)
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
        self._sweep_after_retire(rec.ns)

    def _sweep_after_retire(self, ns: str) -> None:
        """After a key of ``ns`` retires: waiting keys the SSD now covers are
        durable without a write of their own, and covered keys left with no
        dirty longer record are missing."""
        for other in [
            r for r in self.records.values() if r.ns == ns and (r.state in ATTEMPTABLE or r.state is RecState.COVERED)
        ]:
            if other.state is RecState.DURABLE or other.state is RecState.MISSING:
                continue  # retired by a nested sweep (``_retire`` is the only way out of ``records``;
                # a state test, not a lookup that hashes a tuple of every token)
            if self.cold.holds(other.tokens, ns):
                self._retire(other, RecState.DURABLE)
            elif other.state is RecState.COVERED and self._descendant(other) is None:
                log.warning(
                    "[durability] snapshot missing tokens=%d ns=%r (its longer entry was lost)", len(other.tokens), ns
                )
                self._retire(other, RecState.MISSING)

    def _descendant(self, rec: Record) -> Record | None:
        """A dirty record of the same conversation that extends ``rec``'s tokens."""
        n, kb = len(rec.tokens), rec.token_bytes
        for r in self.records.values():
            if r is not rec and r.ns == rec.ns and len(r.tokens) > n and r.token_bytes.startswith(kb):
                return r
        return None

    def _dropped(self, dropped: list[SpillItem]) -> None:
        for item in dropped:
            self.record("spill_dropped", seq=item.seq, bytes=item.nbytes)
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

    def record(self, event: str, **fields: Any) -> None:
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
