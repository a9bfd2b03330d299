"""DurabilityCoordinator: the per-key state machine by hand, then the actor in
virtual time against a fake Scheduler and a fake cold tier."""

from __future__ import annotations

import anyio
import pytest

from actors.durability import Completed, DurabilityCoordinator, Flush, Spill
from actors.durability_core import (
    DurabilityCore,
    DurabilitySettings,
    FlushFinished,
    FlushReport,
    TakeSnapshot,
    WriteItem,
)
from actors.durability_record import Record, RecState
from actors.events import EngineBusy, EngineIdle
from actors.idle_gate import IdleGate
from actors.runtime import Actor
from actors.scheduler import Settle, Snapshot
from engine.kv.spill_queue import SpillItem
from engine.transitions import IllegalTransition

DEBOUNCE, RETRY = 1.0, 5.0


class ManualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:  # pragma: no cover - the core never sleeps
        raise AssertionError("the core must not sleep")


class FakeCold:
    """The cold tier's index: exact keys that are durable."""

    def __init__(self) -> None:
        self.durable: set[tuple[str, tuple[int, ...]]] = set()

    def holds(self, tokens: list[int], ns: str) -> bool:
        n = len(tokens)  # equal, or longer (every fake entry can be trimmed)
        return any(k_ns == ns and k[:n] == tuple(tokens) for k_ns, k in self.durable)

    def summary(self) -> tuple[int, int]:
        return len(self.durable), max((len(t) for _, t in self.durable), default=0)


def make_core(**kw) -> tuple[DurabilityCore, ManualClock, FakeCold]:
    clock, cold = ManualClock(), FakeCold()
    settings = DurabilitySettings(debounce_s=DEBOUNCE, busy_retry_s=RETRY, **kw)
    return DurabilityCore(settings, clock, cold, is_busy=lambda: False), clock, cold


def clones(tokens: list[int], ns: str = "", nbytes: int = 10) -> SpillItem:
    return SpillItem(ns, tokens, object(), nbytes)


def run_write(core: DurabilityCore, cold: FakeCold, ok: bool = True) -> FlushReport | None:
    """Play the shell for one write: the WriteItem effect → store_done."""
    effects = core.take_effects()
    writes = [e for e in effects if isinstance(e, WriteItem)]
    assert len(writes) == 1, effects
    item = writes[0].item
    if ok:
        cold.durable.add(item.key)
    core.store_done(item.seq, ok)
    return finished(core)


def finished(core: DurabilityCore) -> FlushReport | None:
    """The flush report among the pending effects (the others stay pending)."""
    effects = core.take_effects()
    done = [e for e in effects if isinstance(e, FlushFinished)]
    core.effects.extend(e for e in effects if not isinstance(e, FlushFinished))
    return done[0].report if done else None


def answer_snapshot(core: DurabilityCore, present: bool = True) -> None:
    effects = core.take_effects()
    snaps = [e for e in effects if isinstance(e, TakeSnapshot)]
    assert len(snaps) == 1, effects
    s = snaps[0]
    item = clones(s.tokens, s.ns) if present else None
    core.snapshot_taken(s.ns, s.tokens, item)


# ---------------------------------------------------------------------------
# The core, by hand.


def test_debounce_then_snapshot_then_store_makes_the_key_durable():
    core, clock, cold = make_core()
    core.completed("", [1, 2, 3])
    assert core.records[("", (1, 2, 3))].state is RecState.ARMED
    assert core.next_due() == DEBOUNCE
    clock.t = 0.5
    core.tick()
    assert core.take_effects() == []  # not yet
    clock.t = 1.0
    core.tick()
    answer_snapshot(core)
    assert core.records[("", (1, 2, 3))].state is RecState.STORING
    assert run_write(core, cold) is None
    assert core.records == {} and core.counters["durable"] == 1
    assert core.stats()["pending_snapshots"] == 0


def test_a_busy_timer_rearms_instead_of_waiting_and_flush_makes_it_an_immediate_attempt():
    core, clock, cold = make_core()
    core.is_busy = lambda: True
    core.completed("", [7, 7])
    clock.t = 1.0
    core.tick()
    rec = core.records[("", (7, 7))]
    assert rec.state is RecState.BUSY_REARMED and rec.due == 1.0 + RETRY
    assert core.take_effects() == []  # nothing asked of the Scheduler while busy
    clock.t = 2.0
    core.flush()
    assert core.next_due() is None  # flush cancels the timers
    answer_snapshot(core)  # forced: asked at once although the engine is busy
    report = run_write(core, cold)
    assert report is not None and report.durable and report.flushed == 1 and report.pending_snapshots == 0


def test_a_failed_store_stays_dirty_and_a_later_flush_retries_it():
    core, clock, cold = make_core()
    core.completed("", [1, 2])
    core.flush()
    answer_snapshot(core)
    report = run_write(core, cold, ok=False)
    assert report is not None and not report.durable
    assert report.pending_snapshots == 1 and report.failed_spills == 1
    rec = core.records[("", (1, 2))]
    assert rec.state is RecState.FAILED and rec.due == clock.t + RETRY  # retried in the background too
    core.flush()
    answer_snapshot(core)
    report = run_write(core, cold)
    assert report is not None and report.durable and report.flushed == 1
    assert rec.attempts == 2


def test_equal_length_conversations_keep_separate_records():
    core, clock, cold = make_core()
    core.completed("", [1, 2])
    core.completed("", [3, 4])
    core.completed("other", [1, 2])
    assert len(core.records) == 3
    core.flush()
    for _ in range(3):
        answer_snapshot(core)
        report = run_write(core, cold)
    assert report is not None and report.durable and report.flushed == 3
    assert cold.durable == {("", (1, 2)), ("", (3, 4)), ("other", (1, 2))}


def test_flush_forces_one_key_at_a_time():
    core, clock, cold = make_core()
    core.completed("", [1])
    core.completed("", [2])
    core.flush()
    first = core.take_effects()
    assert [type(e) for e in first] == [TakeSnapshot]  # the second waits for the first to be durable
    core.snapshot_taken("", [1], clones([1]))
    effects = core.take_effects()
    assert [type(e) for e in effects] == [WriteItem]
    core.store_done(effects[0].item.seq, True)
    assert [type(e) for e in core.take_effects()] == [TakeSnapshot]


def test_an_entry_gone_from_ram_is_missing_unless_the_cold_tier_holds_it():
    core, clock, cold = make_core()
    core.completed("", [1, 2, 3])
    core.flush()
    answer_snapshot(core, present=False)
    report = finished(core)
    assert report is not None and report.missing == 1 and not report.durable and report.pending_snapshots == 0

    core2, _, cold2 = make_core()
    core2.completed("", [1, 2, 3])
    core2.flush()
    cold2.durable.add(("", (1, 2, 3)))  # stored meanwhile (an eviction spill, another write)
    answer_snapshot(core2, present=False)
    report2 = finished(core2)
    assert report2 is not None and report2.durable and report2.missing == 0 and report2.flushed == 1


def test_a_key_already_on_ssd_is_durable_without_a_snapshot():
    core, clock, cold = make_core()
    cold.durable.add(("", (4, 5)))
    core.completed("", [4, 5])
    clock.t = DEBOUNCE
    core.tick()
    assert core.take_effects() == [] and core.records == {}


def test_an_eviction_spill_carries_a_dirty_key_and_a_vanished_snapshot_finds_it_queued():
    core, clock, cold = make_core()
    core.completed("", [1, 2])
    core.spill(clones([1, 2]))  # evicted before its debounce fired
    rec = core.records[("", (1, 2))]
    assert rec.state is RecState.STORING and rec.item is not None
    assert run_write(core, cold) is None
    assert core.records == {}

    # Snapshot asked first, entry evicted before the Scheduler handled it.
    core.completed("", [3, 4])
    core.completed("", [5, 6])
    clock.t = 10.0
    core.tick()
    snaps = [e for e in core.take_effects() if isinstance(e, TakeSnapshot)]
    assert len(snaps) == 2
    core.snapshot_taken("", [3, 4], clones([3, 4]))  # in flight now
    core.spill(clones([5, 6]))  # the evicted entry's own clones queue behind it
    core.snapshot_taken("", [5, 6], None)
    assert core.records[("", (5, 6))].state is RecState.QUEUED
    run_write(core, cold)
    run_write(core, cold)
    assert core.records == {} and core.counters["missing"] == 0


def test_an_eviction_spill_of_an_entry_already_on_ssd_is_released_without_a_write():
    core, clock, cold = make_core()
    cold.durable.add(("", (1, 2, 3)))
    freed: list[object] = []
    same, covered, fresh = (
        SpillItem("", t, object(), 10, kind="evict", release=freed.append) for t in ([1, 2, 3], [1, 2], [7])
    )
    core.completed("", [1, 2])  # a dirty key the SSD covers (a longer trimmable file)
    core.spill(same)
    core.spill(covered)
    assert len(freed) == 2 and same.released and covered.released
    assert core.records == {} and core.counters["durable"] == 1 and core.counters["spills_on_ssd"] == 2
    assert core.queue.pending == 0 and not any(isinstance(e, WriteItem) for e in core.take_effects())
    core.spill(fresh)  # not on SSD: written as before
    assert core.queue.in_flight is fresh
    run_write(core, cold)
    assert fresh.released and ("", (7,)) in cold.durable


def test_completed_while_the_key_is_in_flight_adds_no_second_write():
    core, clock, cold = make_core()
    core.completed("", [1])
    core.flush()
    answer_snapshot(core)
    core.completed("", [1])  # the same exact tokens again (an exact repeat finished)
    assert core.records[("", (1,))].state is RecState.STORING
    report = run_write(core, cold)
    assert report is not None and report.durable


def test_illegal_transitions_raise():
    rec = Record("", [1], 1)
    with pytest.raises(IllegalTransition):
        rec.move(RecState.STORING)  # armed -> storing skips the snapshot and the queue
    rec.move(RecState.SNAPSHOTTING)
    rec.move(RecState.MISSING)
    with pytest.raises(IllegalTransition):
        rec.move(RecState.ARMED)  # a retired record never comes back


def test_writebehind_off_ignores_completed_and_flush_only_drains_spills():
    core, clock, cold = make_core(writebehind=False)
    core.completed("", [1, 2])
    assert core.records == {}
    core.spill(clones([9]))
    core.flush()
    report = run_write(core, cold)
    assert report is not None and report.durable and report.pending_spills == 0 and report.flushed == 0


def test_flush_with_nothing_dirty_is_durable_at_once():
    core, clock, cold = make_core()
    core.flush()
    report = finished(core)
    assert report is not None and report.durable and report.elapsed_ms == 0.0


def test_a_drop_from_the_queue_leaves_the_key_dirty():
    core, clock, cold = make_core(spill_queue_bytes=15)
    core.completed("", [1])
    core.completed("", [2])
    core.completed("", [3])
    clock.t = DEBOUNCE
    core.tick()
    for s in [e for e in core.take_effects() if isinstance(e, TakeSnapshot)]:
        core.snapshot_taken(s.ns, s.tokens, clones(s.tokens))
    # [1] in flight, [2] dropped when [3] came (cap 15 < 20 queued bytes)
    assert core.records[("", (2,))].state is RecState.FAILED
    assert core.queue.dropped == 1


# ---------------------------------------------------------------------------
# The actor, in virtual time.

pytest_anyio = pytest.mark.anyio


class FakeScheduler(Actor):
    """Answers Snapshot from a dict of RAM entries; records when it was asked."""

    name = "fake-scheduler"

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[tuple[str, tuple[int, ...]], object] = {}
        self.asked: list[tuple[float, list[int]]] = []

    async def receive(self, msg):
        if isinstance(msg, Settle):
            return None  # nothing waits to be put here
        assert isinstance(msg, Snapshot)
        self.asked.append((anyio.current_time(), msg.tokens))
        cache = self.entries.get((msg.ns, tuple(msg.tokens)))
        return None if cache is None else (cache, 100)


class HeldWriter:
    """A cold tier whose store writes ``tensors`` steps, each behind the gate,
    and can be held before its atomic rename."""

    def __init__(self, cold: FakeCold, tensors: int = 3) -> None:
        self.cold = cold
        self.tensors = tensors
        self.hold: anyio.Event | None = None
        self.fail_next = 0
        self.log: list[tuple[str, float]] = []

    async def store(self, ns: str, tokens: list[int], cache: object, wait_turn) -> bool:
        for _ in range(self.tensors):
            await wait_turn()
            self.log.append(("tensor", anyio.current_time()))
            await anyio.sleep(0.01)
        await wait_turn()
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_next:
            self.fail_next -= 1
            return False
        self.cold.durable.add((ns, tuple(tokens)))
        self.log.append(("renamed", anyio.current_time()))
        return True


class Rig:
    def __init__(self, direct: bool = False) -> None:
        self.cold = FakeCold()
        self.sched = FakeScheduler()
        self.writer = HeldWriter(self.cold)
        self.gate = IdleGate()
        from engine.ports import LoopClock

        settings = DurabilitySettings(debounce_s=DEBOUNCE, busy_retry_s=60.0)
        self.core = DurabilityCore(settings, LoopClock(), self.cold, lambda: self.gate.busy)
        self.direct: list[tuple[float, list[int]]] = []  # snapshots taken without an ask
        snapshot_now = self._snapshot_now if direct else None
        self.coord = DurabilityCoordinator(self.core, self.sched.ref, self.writer, self.gate, snapshot_now=snapshot_now)

    def _snapshot_now(self, ns: str, tokens: list[int]):
        assert not self.gate.busy, "a direct snapshot while a GPU step may run"
        self.direct.append((anyio.current_time(), list(tokens)))
        cache = self.sched.entries.get((ns, tuple(tokens)))
        return None if cache is None else (cache, 100)

    def busy(self, busy: bool) -> None:
        self.gate.tell_nowait(EngineBusy(at=0.0) if busy else EngineIdle(at=0.0))


async def with_rig(fn, **kw) -> None:
    rig = Rig(**kw)
    async with anyio.create_task_group() as tg:
        await tg.start(rig.sched.run)
        await tg.start(rig.coord.run)
        try:
            await fn(rig)
        finally:
            rig.coord.stop()
            rig.sched.stop()


@pytest_anyio
async def test_flush_overrides_a_busy_retry_and_waits_for_the_held_atomic_store():
    async def body(rig: Rig) -> None:
        rig.sched.entries[("", (1, 2, 3))] = object()
        rig.busy(True)
        rig.coord.ref.tell_nowait(Completed(ns="", tokens=[1, 2, 3]))
        await anyio.sleep(DEBOUNCE + 0.5)
        assert rig.core.records[("", (1, 2, 3))].state is RecState.BUSY_REARMED
        assert rig.sched.asked == []  # busy: the timer re-armed, nothing was asked

        rig.writer.hold = anyio.Event()
        reports: list[FlushReport] = []

        async def flush() -> None:
            reports.append(await rig.coord.ref.ask(Flush()))

        async with anyio.create_task_group() as tg:
            t0 = anyio.current_time()
            tg.start_soon(flush)
            tg.start_soon(flush)  # idempotent: joins the running flush
            await anyio.wait_all_tasks_blocked()
            assert [t for t, _ in rig.sched.asked] == [t0]  # forced at once, though busy
            assert rig.writer.log == []  # the tensor steps wait for idle
            await anyio.sleep(3.0)
            rig.busy(False)
            await anyio.sleep(1.0)
            assert len([k for k, _ in rig.writer.log if k == "tensor"]) == 3
            assert reports == []  # held before the rename: not durable yet
            rig.writer.hold.set()
        assert len(reports) == 2 and reports[0] == reports[1]
        r = reports[0]
        assert r.durable and r.flushed == 1 and r.pending_snapshots == 0 and r.pending_spills == 0
        assert r.entries == 1 and r.longest_durable_prefix_tokens == 3
        assert r.elapsed_ms >= 4000.0

    await with_rig(body)


@pytest_anyio
async def test_the_debounce_writes_in_the_background_while_idle_and_stops_mid_entry_when_busy():
    async def body(rig: Rig) -> None:
        rig.sched.entries[("", (5,))] = object()
        rig.coord.ref.tell_nowait(Completed(ns="", tokens=[5]))
        await anyio.sleep(DEBOUNCE + 0.015)  # the first tensor step is done
        rig.busy(True)  # a request arrives mid-write
        await anyio.sleep(10.0)
        tensors = [t for k, t in rig.writer.log if k == "tensor"]
        assert len(tensors) == 2  # two tensor steps ran before the request came; none since
        rig.busy(False)
        await anyio.sleep(1.0)
        assert ("", (5,)) in rig.cold.durable and rig.core.records == {}

    await with_rig(body)


@pytest_anyio
async def test_a_failed_background_store_is_retried_by_the_timer_and_by_flush():
    async def body(rig: Rig) -> None:
        rig.sched.entries[("", (8, 9))] = object()
        rig.writer.fail_next = 2
        rig.coord.ref.tell_nowait(Completed(ns="", tokens=[8, 9]))
        await anyio.sleep(DEBOUNCE + 1.0)
        assert rig.core.records[("", (8, 9))].state is RecState.FAILED
        r1 = await rig.coord.ref.ask(Flush())
        assert not r1.durable and r1.pending_snapshots == 1 and r1.failed_spills == 2
        r2 = await rig.coord.ref.ask(Flush())
        assert r2.durable and r2.flushed == 1

    await with_rig(body)


@pytest_anyio
async def test_spills_are_queued_and_released_when_stored():
    async def body(rig: Rig) -> None:
        rig.coord.ref.tell_nowait(Spill(ns="", tokens=[1], cache=object(), nbytes=10))
        r = await rig.coord.ref.ask(Flush())
        assert r.durable and r.pending_spills == 0 and ("", (1,)) in rig.cold.durable
        assert rig.core.queue.stored == 1

    await with_rig(body)


@pytest_anyio
async def test_while_idle_the_snapshot_is_taken_without_an_ask_and_a_flush_during_busy_still_asks():
    async def body(rig: Rig) -> None:
        rig.sched.entries[("", (1, 2))] = object()
        rig.sched.entries[("", (3, 4))] = object()
        t0 = anyio.current_time()
        rig.coord.ref.tell_nowait(Completed(ns="", tokens=[1, 2]))
        await anyio.sleep(DEBOUNCE + 1.0)
        assert rig.direct == [(pytest.approx(t0 + DEBOUNCE), [1, 2])] and rig.sched.asked == []
        assert ("", (1, 2)) in rig.cold.durable and rig.core.records == {}
        # busy: the debounce re-arms; a flush forces the key and must ask (between steps)
        rig.busy(True)
        rig.coord.ref.tell_nowait(Completed(ns="", tokens=[3, 4]))
        await anyio.sleep(DEBOUNCE + 0.5)
        assert rig.core.records[("", (3, 4))].state is RecState.BUSY_REARMED

        async def release() -> None:
            await anyio.sleep(1.0)
            rig.busy(False)

        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            report = await rig.coord.ref.ask(Flush())
        assert report.durable and report.flushed == 1
        assert [tokens for _, tokens in rig.sched.asked] == [[3, 4]] and len(rig.direct) == 1

    await with_rig(body, direct=True)


def test_an_ancestor_superseded_in_ram_is_covered_by_its_dirty_descendant():
    """A 1-token answer leaves an entry equal to its prompt; the next turn's
    entry extends it and the RAM tier drops the ancestor (no spill: the longer
    trimmable entry serves it). That is not a lost snapshot."""
    core, clock, cold = make_core()
    core.completed("", [1, 2, 3])
    core.completed("", [1, 2, 3, 4, 5])
    core.flush()
    answer_snapshot(core, present=False)  # the ancestor is gone from RAM
    assert core.records[("", (1, 2, 3))].state is RecState.COVERED
    answer_snapshot(core)  # the flush moves on to the descendant
    report = run_write(core, cold)
    assert report is not None and report.durable and report.flushed == 2 and report.missing == 0

    # ... but if the descendant is lost too, both are honestly missing
    core, clock, cold = make_core()
    core.completed("", [1, 2, 3])
    core.completed("", [1, 2, 3, 4, 5])
    core.flush()
    answer_snapshot(core, present=False)
    answer_snapshot(core, present=False)
    report = finished(core)
    assert report is not None and not report.durable and report.missing == 2 and core.records == {}


def test_a_waiting_key_the_ssd_already_covers_retires_without_a_write():
    core, clock, cold = make_core()
    core.completed("", [1, 2, 9])
    core.completed("", [1, 2])  # a shorter prefix of the same conversation, finished later
    core.flush()
    answer_snapshot(core)  # the longer one is forced first
    report = run_write(core, cold)
    # its file serves [1, 2] by trimming: no second snapshot, no second write
    assert report is not None and report.durable and report.flushed == 2
    assert core.queue.stored == 1 and core.take_effects() == []
