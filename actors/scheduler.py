"""Scheduler: continuous batching with chunked prefill.

Owns the running batch, the step loop and the idle/busy state. A request that
arrives while a batch runs joins at the next step; finished or aborted rows
leave at the next step. Prefill is chunked (``prefill_chunk`` tokens per step
across all prefilling rows) so a long prompt cannot starve the decode of the
others. The logic is the sync ``SchedulerCore`` (``actors.scheduler_core``);
this module holds the Scheduler's messages and the actor: a thin loop that
unpacks each message into a call of the core (which takes fields, not
messages), runs its plans on the device under the step watchdog
(``actors.timers``) and sends what they return.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, assert_never

import anyio

from actors.drafter import DraftRound
from actors.drafter import Forget as DrafterForget
from actors.events import EngineBusy, EngineIdle
from actors.messages import Handoff, Wire
from actors.runtime import Actor, ActorRef, Envelope, Failure
from actors.scheduler_core import RowDelta, SchedulerCore
from actors.timers import Watchdog
from actors.verifier import Forget as VerifierForget
from engine.errors import EngineDead
from engine.ports import Device, StepPlan, StepResult
from engine.types import SamplingParams

log = logging.getLogger("ember.scheduler")


# ---------------------------------------------------------------------------
# Messages the Scheduler accepts.


class Admit(Wire, frozen=True):
    """Gateway → Scheduler: a validated request joins the queue (sent with
    ``tell_nowait``; the Gateway has already applied the queue bound)."""

    rid: int
    tokens: list[int]
    params: SamplingParams
    ns: str = ""


class Abort(Wire, frozen=True):
    """Gateway → Scheduler: the caller went away; the row leaves at the next step."""

    rid: int
    reason: str = "abort"


class Restored(Handoff, frozen=True):
    """ColdTier → Scheduler: the SSD restore asked for row ``rid`` is done.
    ``cache`` is a private cache trimmed to ``cached`` tokens, or None on a miss
    (the row then opens with its RAM candidate, or cold). A hand-off: ``cache``
    is a live GPU object."""

    rid: int
    cache: Any = None
    cached: int = 0


class Demote(Wire, frozen=True):
    """ColdTier → Scheduler: the engine is idle; spill RAM entries unused for
    ``idle_s`` to the cold tier. Ignored if work arrived meanwhile."""

    idle_s: float


class Snapshot(Handoff, frozen=True):
    """Durability → Scheduler (ask, sent nowait): the RAM entry holding exactly
    ``tokens`` in ``ns``, between steps, in O(1). The reply is ``(cache,
    nbytes)`` — the entry's cache itself, which nothing writes after it was
    stored, for the SSD writer to read — or None when the entry is gone. It
    never holds admission: nothing is copied and nothing waits for idle. A
    hand-off: its answer is a live cache."""

    ns: str
    tokens: list[int]


class Settle(Wire, frozen=True):
    """Durability → Scheduler (ask, sent nowait): answered once every row that
    has finished so far has had its cache put in the RAM tier — so its
    ``Completed`` is already in the coordinator's inbox. A flush starts with
    it: the put happens at the step that closes a row, after the caller has
    seen the row's last token, and a flush asked at that moment must not miss it."""


Inbox = Admit | Abort | Restored | Demote | Snapshot | Settle


class Scheduler(Actor[Inbox]):
    name = "scheduler"
    inbox_size = 4096  # Admit/Abort arrive with send_nowait; the Gateway bounds in-flight work

    def __init__(
        self,
        core: SchedulerCore,
        device: Device,
        output: Callable[[list[RowDelta]], Any],
        subscribers: list[ActorRef[Any]] | None = None,
        step_timeout_s: float | None = None,
        drafter: ActorRef[Any] | None = None,
        verifier: ActorRef[Any] | None = None,
    ):
        super().__init__()
        self.core = core
        self.device = device
        self.output = output
        self.subscribers = list(subscribers or [])
        self.drafter = drafter  # speculation: both set with core.spec, or neither
        self.verifier = verifier
        self.is_busy = False
        self._settle_waiters: list[Envelope[Inbox]] = []  # Settle asks held until the closes are put
        # the fake GPU's runs take exactly their cost
        self.watchdog = Watchdog(step_timeout_s, core.clock, what="GPU step", exact_cost=device.exact_cost)

    async def stopping(self, reason: BaseException | None) -> None:
        for env in self._settle_waiters:  # their closes will never be put
            env.answer(Failure(EngineDead("scheduler stopped")))
        self._settle_waiters = []

    def subscribe(self, ref: ActorRef[Any]) -> None:
        self.subscribers.append(ref)

    # ---- the loop: messages between steps, a step while there is work ---------
    async def main(self) -> None:
        await self.watchdog.run(self._loop)

    async def _loop(self) -> None:
        # The inbox is closed by Actor._fail_queued, which answers what is left.
        while True:
            # Everything already queued is handled between steps, in O(1) each.
            while True:
                try:
                    env = self._inbox_recv.receive_nowait()
                except anyio.WouldBlock:
                    break
                except anyio.EndOfStream:
                    return
                self._handle(env)
            if not self.core.has_work():
                if not self.core.restoring:  # a row waiting on SSD is work in flight
                    self._publish(False)
                try:
                    env = await self._inbox_recv.receive()
                except anyio.EndOfStream:
                    return
                self._handle(env)
                continue
            self._publish(True)
            await self._step()

    def _handle(self, env: Envelope[Inbox]) -> None:
        msg = env.msg
        match msg:
            case Admit():
                self.core.admit(msg.rid, msg.tokens, msg.params, msg.ns)
            case Abort():
                self.core.abort(msg.rid, msg.reason)
            case Restored():
                self.core.restored(msg.rid, msg.cache, msg.cached)
            case Settle():
                if self.core.closes_pending():  # closed (and put) by the next step
                    self._settle_waiters.append(env)
                    return
            case Snapshot():
                try:
                    reply: Any = self.core.snapshot(msg.tokens, msg.ns)
                except Exception as exc:  # a cache fault fails one write-behind attempt, never a request
                    reply = Failure(exc)
                env.answer(reply)
                return
            case Demote():
                n, due = self.core.demote(msg.idle_s)
                if self.core.cold is not None:
                    self.core.cold.demoted(n, due)
            case _:
                assert_never(msg)
        env.answer(None)

    def _publish(self, busy: bool) -> None:
        if busy == self.is_busy:
            return
        self.is_busy = busy
        now = self.core.clock.now()
        event = EngineBusy(at=now) if busy else EngineIdle(at=now)
        self.core.events.record("busy" if busy else "idle", now)
        for ref in self.subscribers:
            try:
                ref.tell_nowait(event)
            except Exception:  # a subscriber that cannot keep up loses an edge, never blocks us
                log.warning("[scheduler] subscriber %s missed %s", ref.name, type(event).__name__)

    # ---- one step ----------------------------------------------------------
    async def _step(self) -> None:
        """One step: plan, run, apply. Each side concern is one call, in the
        order of its effects (the simulation digests pin that order down)."""
        core = self.core
        started = core.clock.now()
        # 1. drafts for the speculating rows (the plan feeds them as verify windows)
        draft_s, catch_up_s = await self._draft()
        # 2. plan: closes, opens, prefill chunks, decode rows, verify windows
        plan = core.plan()
        # 3. run it on the device, under the watchdog; an OOM fails only its rows
        t_run = core.clock.now()
        result = await self._run(plan)
        if result is not None:
            core.note_step_time(plan, core.clock.now() - t_run)
        # 4. apply: emit tokens and put closed caches; speculating rows wait for verdicts
        if result is not None:
            core.apply(plan, result)
            await self._verify(plan)
        core.events.record("step_end", core.clock.now(), n=core.steps)
        # 5. answer the Settle asks whose closes this step put
        self._answer_settled()
        # 6. speculation bookkeeping: cost the step for adaptive γ, Forget finished rows
        self._spec_after_step(plan, started, draft_s, catch_up_s, ok=result is not None)
        # 7. the step's deltas to the Gateway
        deltas = core.take_outbox()
        if deltas:
            await self.output(deltas)

    async def _run(self, plan: StepPlan) -> StepResult | None:
        """Run ``plan`` on the device under the step watchdog (a hung step kills
        the engine). A ``MemoryError`` fails the rows it touched; None then."""
        core = self.core
        cost = core.backend.step_cost_s(plan)
        try:
            with self.watchdog.armed(core.steps, cost):
                return await self.device.run(core.backend.step, plan, cost_s=cost)
        except MemoryError as exc:
            log.warning("[scheduler] step %d failed: %r", core.steps, exc)
            core.fail_step(plan, f"{type(exc).__name__}: {exc}")
            return None

    def _answer_settled(self) -> None:
        if self._settle_waiters and not self.core.closes_pending():
            waiters, self._settle_waiters = self._settle_waiters, []
            for env in waiters:
                env.answer(None)

    # ---- speculative rounds: Draft before the step, Verify after it ------------
    async def _draft(self) -> tuple[float, float]:
        """Get drafts for this step's speculating rows; the seconds drafting and
        catching lagging draft caches up took."""
        drafts = self.core.draft_requests()
        if not drafts or self.drafter is None:
            return 0.0, 0.0
        answer = await self.drafter.ask(DraftRound(drafts=drafts))
        assert self.core.spec is not None  # set with the drafter
        self.core.spec.set_drafts(answer, drafts)
        return answer.draft_s, answer.catch_up_s

    async def _verify(self, plan: StepPlan) -> None:
        """The Verifier's verdicts on the windows this step collected."""
        spec = self.core.spec
        if spec is None:
            return
        assert self.verifier is not None  # set with core.spec
        msg = spec.take_verify(self.core.batch_ahead(len(plan.decode) + len(plan.verify)))
        if msg is None:
            return
        self.core.apply_verified(await self.verifier.ask(msg))

    def _spec_after_step(self, plan: StepPlan, started: float, draft_s: float, catch_up_s: float, *, ok: bool) -> None:
        """Cost the step (from its start to the next one's) and tell the
        Drafter and Verifier which rows finished."""
        core = self.core
        if core.spec is None:
            return
        core.spec.note_step(plan, started, draft_s, catch_up_s=catch_up_s, ok=ok, more=core.has_work())
        rids = core.spec.take_forgotten()
        finished = core.spec.take_finished()
        if not rids and not finished:
            return
        msgs = ((self.drafter, DrafterForget(rids=rids, finished=finished)), (self.verifier, VerifierForget(rids=rids)))
        for ref, msg in msgs:
            assert ref is not None  # set with core.spec
            try:
                ref.tell_nowait(msg)
            except Exception:  # a full inbox only delays freeing a finished row's state
                log.warning("[scheduler] %s missed Forget rids=%s", ref.name, rids)
