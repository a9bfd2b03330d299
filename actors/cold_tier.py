"""ColdTier: the SSD tier of the prompt cache, as an actor.

The index and its files are ``engine.kv.cold_store.ColdStore`` (a sync core);
moving one entry between a cache and its file is ``engine.kv.cold_io.ColdIO``.
This actor is the thin shell around them:

* ``Restore`` (from the Scheduler, for a row parked in RESTORING) → one
  restorer task restores the longest usable prefix and answers ``Restored``
  (a miss on any failure: never an error for the request).
* ``Store`` (an ask that answers after rename + folder fsync) → one writer task
  writes entries one at a time, each tensor step behind the asker's
  ``wait_turn`` (the durability coordinator's idle gate). ``store_now`` is the
  same write on the caller's task when the writer has nothing to do.
* Idle demotion: on ``EngineIdle`` the tier asks the Scheduler to ``Demote``;
  the Scheduler answers how many entries it spilled and when the next falls
  due, and a timer message (``DemoteDue``) repeats the sweep then — only while
  the engine stays idle. The spilled entries go from the RAM tier's spill hook
  to the durability coordinator, which writes them here with ``Store``.

``ColdLink`` (the Scheduler's handle) and ``ColdTierPort`` (the durability
coordinator's) are the two ways other actors reach the tier.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, assert_never

import anyio

from actors.events import EngineBusy, EngineIdle
from actors.messages import Handoff, Wire
from actors.runtime import DEFER, Actor, ActorRef, Envelope, Failure
from actors.scheduler import Demote, Restored
from engine.errors import EngineDead
from engine.kv.cold_io import ColdIO, WaitTurn
from engine.kv.cold_store import ColdStore
from engine.kv.prompt_cache import token_bytes
from engine.ports import Backend, Clock, Device, IoRunner, run_in_thread

log = logging.getLogger("ember.cold_tier")

# Restores in flight at once (each holds at most one group of file buffers,
# engine.kv.cold_io.RESTORE_HOP_BYTES): a batch's worth of warm prompts.
MAX_RESTORES = 8


# ---------------------------------------------------------------------------
# Messages the ColdTier accepts.


class Restore(Wire, frozen=True):
    """Scheduler → ColdTier: row ``rid`` waits in RESTORING; restore the longest
    usable prefix of ``tokens`` if it is longer than ``min_len`` (the RAM
    candidate). Always answered with ``Restored`` to the Scheduler."""

    rid: int
    tokens: list[int]
    ns: str = ""
    min_len: int = 0


class Store(Handoff, frozen=True):
    """Durability (``store_now``, when the tier's writer is busy) → ColdTier
    (ask): persist ``cache`` — the RAM entry's own cache, read and never
    written; the reply is True once the file is renamed and its folder
    fsynced, False if the write was refused or failed. ``wait_turn`` is
    awaited before every tensor step (``ungated``: never wait). A hand-off:
    it carries a live cache and a callable."""

    tokens: list[int]
    ns: str
    cache: Any
    wait_turn: WaitTurn


class Demoted(Wire, frozen=True):
    """Scheduler → ColdTier: a demotion sweep spilled ``n`` entries; the next
    entry falls due at ``next_due`` (engine clock; None: none left)."""

    n: int
    next_due: float | None = None


class DemoteDue(Wire, frozen=True):
    """ColdTier's timer → ColdTier: a RAM entry falls due for demotion now."""

    at: float


Inbox = Restore | Store | Demoted | DemoteDue | EngineIdle | EngineBusy


# ---------------------------------------------------------------------------
# Handles on the tier.


class ColdLink:
    """The Scheduler's handle on the cold tier (``actors.scheduler.ColdLookup``)."""

    def __init__(self, store: ColdStore, ref: ActorRef[Inbox]):
        self.store = store
        self.ref = ref

    def longest(self, tokens: Any, ns: str) -> int:  # a list or the Scheduler's int64 array
        return self.store.longest(tokens, ns)

    def closest(self, tokens: Any, ns: str) -> tuple[Any, int]:
        return self.store.closest(tokens, ns)

    def request_restore(self, rid: int, tokens: list[int], ns: str, min_len: int) -> None:
        self.ref.tell_nowait(Restore(rid=rid, tokens=tokens, ns=ns, min_len=min_len))

    def demoted(self, n: int, next_due: float | None) -> None:
        try:
            self.ref.tell_nowait(Demoted(n=n, next_due=next_due))
        except Exception:  # a lost timer edge: the next EngineIdle re-arms it
            log.warning("[cold_tier] missed a Demoted report")


class ColdTierPort:
    """The durability coordinator's handle on the cold tier: its in-memory
    index (``actors.durability_core.ColdIndex``, read synchronously on the loop
    like the Scheduler's own lookups) and its ``store_now`` (a ``Store`` ask, or
    the same write on the caller's task when the tier's writer is idle:
    ``actors.durability.SpillWriter``)."""

    def __init__(self, tier: ColdTier):
        self.tier = tier
        self._keys: dict[int, list[Any]] = {}  # id(tokens) -> [tokens, key, ns, store.adds when last not held]

    def holds(self, tokens: list[int], ns: str) -> bool:
        # The core asks many times per request about the same few records, and
        # their token lists never change (it copies them at creation): their
        # index keys are kept by list identity (the list is held, so its id
        # cannot be reused) instead of being rebuilt from thousands of ints.
        # (Measured in docs/sims.md, "ColdTierPort.holds".)
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

    async def store(self, ns: str, tokens: list[int], cache: Any, wait_turn: WaitTurn) -> bool:
        return bool(await self.tier.store_now(list(tokens), ns, cache, wait_turn))


# ---------------------------------------------------------------------------
# The actor.


@dataclass(slots=True, eq=False)
class _Job:
    tokens: list[int]
    ns: str
    cache: Any
    wait_turn: WaitTurn
    env: Envelope[Any]  # the Store ask, answered when durable


class ColdTier(Actor[Inbox]):
    name = "cold_tier"
    inbox_size = 1024

    def __init__(
        self,
        store: ColdStore,
        backend: Backend,
        device: Device,
        clock: Clock,
        *,
        io: IoRunner = run_in_thread,
        scheduler: ActorRef[Any] | None = None,
        demote_idle_s: float | None = None,
        wall: Callable[[], float] = time.time,
    ):
        super().__init__()
        self.store = store
        self.clock = clock
        self.io = io
        self.files = ColdIO(store, backend, device, clock, io=io, wall=wall)
        self.scheduler = scheduler
        self.demote_idle_s = demote_idle_s or None
        self.idle = True  # the Scheduler announces edges only; it starts idle
        self._jobs: deque[_Job] = deque()
        self._jobs_wake = anyio.Event()
        self._in_flight: _Job | None = None
        self._direct = False  # a ``store_now`` is writing on its caller's task
        self._stopped = False
        self._restores: deque[Restore] = deque()
        self._restores_wake = anyio.Event()
        self._timer: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def link(self) -> ColdLink:
        return ColdLink(self.store, self.ref)

    # ---- lifecycle -----------------------------------------------------------
    async def started(self) -> None:
        scan = await self.io(self.store.scan_files)
        over = self.store.load_index(scan)
        if over:
            await self.io(self.store.delete_files, [v.path for v in over])
        log.info(
            "[cold_tier] scan dir=%s entries=%d bytes=%d reaped_tmp=%d deleted=%d",
            self.store.dir,
            len(self.store),
            self.store.bytes,
            scan.reaped_tmp,
            scan.corrupt_deleted + scan.mismatch_deleted,
        )

    async def main(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._writer)
            tg.start_soon(self._restorer)
            await super().main()
            tg.cancel_scope.cancel()

    async def stopping(self, reason: BaseException | None) -> None:
        """Fail the Store asks still queued (their writes will not happen)."""
        self._stopped = True
        dead = Failure(EngineDead("cold tier stopped"))
        for job in self._jobs:
            job.env.answer(dead)
        self._jobs.clear()

    # ---- messages --------------------------------------------------------------
    async def receive(self, msg: Inbox) -> Any:
        match msg:
            case Restore():
                self._restores.append(msg)
                self._restores_wake.set()
            case Store():
                assert self.current is not None  # inside receive(): the ask's envelope
                self._jobs.append(_Job(msg.tokens, msg.ns, msg.cache, msg.wait_turn, self.current))
                self._jobs_wake.set()
                return DEFER
            case EngineIdle():
                self.idle = True
                self._ask_demote()
            case EngineBusy():
                self.idle = False
                self._cancel_timer()
            case Demoted():
                self.store.counters["demotions"] += msg.n
                if msg.next_due is not None and self.idle:
                    self._arm_timer(msg.next_due)
            case DemoteDue():
                self._timer = None
                if self.idle:
                    self._ask_demote()
            case _:
                assert_never(msg)
        return None

    # ---- demotion timer -------------------------------------------
    def _ask_demote(self) -> None:
        if self.demote_idle_s is None or self.scheduler is None:
            return
        try:
            self.scheduler.tell_nowait(Demote(idle_s=self.demote_idle_s))
        except EngineDead:
            pass  # shutting down
        except Exception as exc:
            log.warning("[cold_tier] demotion request lost: %r", exc)

    def _arm_timer(self, due: float) -> None:
        self._cancel_timer()
        if self._tg is None:
            return
        scope = anyio.CancelScope()
        self._timer = scope

        async def fire() -> None:
            with scope:
                await self.clock.sleep(max(0.0, due - self.clock.now()))
                try:
                    self.ref.tell_nowait(DemoteDue(at=self.clock.now()))
                except Exception:
                    pass

        self._tg.start_soon(fire)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---- writes --------------------------------------------------------------------
    async def store_now(self, tokens: list[int], ns: str, cache: Any, wait_turn: WaitTurn) -> bool:
        """What a ``Store`` ask answers, for a caller that would only await the
        answer (the durability coordinator's single writer). When the tier's
        own writer has nothing queued or in flight, the same ``store_entry``
        runs on the caller's task, without the ask's reply stream, two inbox
        hops and the writer's wake-up (the event-loop turns this saves are in
        docs/sims.md, "store_now"). Otherwise it queues behind them as a ``Store``.
        One write at a time either way: the writer waits while this runs."""
        if self._stopped:
            raise EngineDead("cold tier stopped")
        if self._jobs or self._in_flight is not None or self._direct:
            return bool(await self.ref.ask(Store(tokens=tokens, ns=ns, cache=cache, wait_turn=wait_turn)))
        self._direct = True
        try:
            return await self.store_entry(tokens, ns, cache, wait_turn=wait_turn)
        finally:
            self._direct = False
            if self._jobs:
                self._jobs_wake.set()

    async def _writer(self) -> None:
        while True:
            while not self._jobs or self._direct:
                self._jobs_wake = anyio.Event()
                await self._jobs_wake.wait()
            job = self._in_flight = self._jobs[0]
            try:
                ok = await self.store_entry(job.tokens, job.ns, job.cache, wait_turn=job.wait_turn)
            except BaseException:  # stopped mid-write: the asker must not wait forever
                job.env.answer(Failure(EngineDead("cold tier stopped before the write was durable")))
                raise
            finally:
                self._jobs.popleft()
                self._in_flight = None
                job.cache = None
            job.env.answer(ok)

    async def store_entry(self, tokens: list[int], ns: str, cache: Any, *, wait_turn: WaitTurn) -> bool:
        """Write one entry now (``ColdIO.write``); True once it is durable."""
        return await self.files.write(tokens, ns, cache, wait_turn)

    # ---- restores ------------------------------------------------------------------
    async def _restorer(self) -> None:
        """Start each queued restore as its own task, ``MAX_RESTORES`` at a time.
        One at a time, eight warm prompts arriving together restored one after
        another, each waiting for a decode step on the device thread, and the
        batch grew a row per restore (8 streams at ~0.65 of the cold rate);
        together their device hops queue behind the same step."""
        limit = anyio.Semaphore(MAX_RESTORES)
        async with anyio.create_task_group() as tg:
            while True:
                while not self._restores:
                    self._restores_wake = anyio.Event()
                    await self._restores_wake.wait()
                await limit.acquire()
                tg.start_soon(self._restore_one, self._restores.popleft(), limit)

    async def _restore_one(self, req: Restore, limit: anyio.Semaphore) -> None:
        try:
            cache, cached = await self.restore(req.tokens, req.ns, min_len=req.min_len)
        finally:
            limit.release()
        if self.scheduler is not None:
            try:
                await self.scheduler.tell(Restored(rid=req.rid, cache=cache, cached=cached))
            except Exception as exc:
                log.warning("[cold_tier] cannot answer restore of row %d: %r", req.rid, exc)

    async def restore(self, tokens: list[int], ns: str, *, min_len: int = 0) -> tuple[Any, int]:
        """A fresh cache trimmed to the longest usable prefix longer than
        ``min_len``, and its length; ``(None, 0)`` on a miss or any failure."""
        return await self.files.restore(tokens, ns, min_len=min_len)

    # ---- stats -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {**self.store.stats(), "idle": self.idle}
