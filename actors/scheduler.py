"""Scheduler: continuous batching with chunked prefill.

Owns the running batch, the step loop and the idle/busy state. A request that
arrives while a batch runs joins at the next step; finished or aborted rows
leave at the next step. Prefill is chunked (``prefill_chunk`` tokens per step
across all prefilling rows) so a long prompt cannot starve the decode of the
others. The logic is the sync ``SchedulerCore``; the actor is a thin loop that
feeds it messages, runs its plans on the device and sends what it returns.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, assert_never

import anyio
import msgspec

from actors.drafter import DraftRound
from actors.drafter import Forget as DrafterForget
from actors.events import EngineBusy, EngineIdle
from actors.messages import Handoff, Wire
from actors.runtime import Actor, ActorRef, Envelope, Failure
from actors.spec_rounds import SpecRounds
from actors.verifier import Forget as VerifierForget
from engine.errors import EngineDead
from engine.eventlog import EventLog
from engine.ports import Backend, Clock, DecodeRow, Device, OpenRow, PrefillChunk, StepPlan, StepResult, VerifyRow
from engine.textstream import StopMatcher
from engine.transitions import IllegalTransition
from engine.types import SamplingParams, TokenLogprob, Usage

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


class Shutdown(Wire, frozen=True):
    """Engine → Scheduler: stop after the current step."""


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


Inbox = Admit | Abort | Shutdown | Restored | Demote | Snapshot | Settle


# ---------------------------------------------------------------------------
# Row lifecycle: an enum plus a transition table; an illegal move raises.


class RowState(enum.Enum):
    QUEUED = "queued"
    RESTORING = "restoring"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


ROW_TRANSITIONS: dict[RowState, frozenset[RowState]] = {
    RowState.QUEUED: frozenset({RowState.RESTORING, RowState.PREFILL, RowState.DECODE, RowState.FINISHED}),
    RowState.RESTORING: frozenset({RowState.QUEUED, RowState.FINISHED}),
    RowState.PREFILL: frozenset({RowState.DECODE, RowState.FINISHED}),
    RowState.DECODE: frozenset({RowState.FINISHED}),
    RowState.FINISHED: frozenset(),
}


class RowDelta(msgspec.Struct, frozen=True, kw_only=True):
    rid: int
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None


class PrefixCache(Protocol):
    """The RAM prompt-cache tier as the Scheduler uses it (see engine.kv.prompt_cache)."""

    def take(self, tokens: list[int], ns: str, min_len: int = 1) -> tuple[Any, int]: ...

    def put(self, tokens: list[int], ns: str, cache: Any) -> None: ...

    def demote_idle(self, idle_s: float) -> tuple[int, float | None]: ...

    def snapshot(self, tokens: list[int], ns: str) -> Any: ...


class ColdLookup(Protocol):
    """The SSD cold tier as the Scheduler uses it (see actors.cold_tier.ColdLink)."""

    def longest(self, tokens: list[int], ns: str) -> int:
        """Usable prefix the SSD index holds for ``tokens`` (a sync index lookup)."""
        ...

    def request_restore(self, rid: int, tokens: list[int], ns: str, min_len: int) -> None:
        """Ask for a restore longer than ``min_len``; answered by ``Restored``. Never blocks."""
        ...

    def demoted(self, n: int, next_due: float | None) -> None: ...


@dataclass(slots=True)
class Row:
    rid: int
    prompt: list[int]
    params: SamplingParams
    ns: str
    admitted_at: float
    state: RowState = RowState.QUEUED
    generated: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens served from the prompt cache
    in_cache: int = 0  # tokens fed into the row's KV cache so far
    next_input: int = -1  # token to feed at the next decode
    detok: Any = None
    stop: StopMatcher | None = None
    finish_reason: str | None = None
    opened: bool = False
    prepared: tuple[Any, int] | None = None  # (cache, cached) chosen while RESTORING
    checkpointed: int = 0  # earlier-position checkpoints taken (the prompt's end not counted)
    last_checkpoint: int = 0  # the position of the latest one (or the cached prefix)

    def move(self, to: RowState) -> None:
        if to not in ROW_TRANSITIONS[self.state]:
            raise IllegalTransition(f"row {self.rid}: {self.state.value} -> {to.value}")
        self.state = to

    @property
    def prefill_total(self) -> int:
        return len(self.prompt) - 1  # the last prompt token is the first decode input

    def cached_tokens(self) -> list[int]:
        return (self.prompt + self.generated)[: self.in_cache]


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_batch: int = 8
    prefill_chunk: int = 512
    min_cached_prefix: int = 1  # shorter cached prefixes (RAM or SSD) are not reused
    # Checkpoints, for caches that cannot be trimmed back to a prefix later (SSM
    # state, a wrapped sliding window; the backend says ``needs_checkpoints``):
    # a copy of the row's cache at the end of its prompt, so the same prompt
    # again and the conversation's next turn hit, plus up to
    # ``max_checkpoints`` earlier ones at prefill-chunk ends at least
    # ``checkpoint_interval`` tokens apart (a long shared head: system prompt,
    # tools, a document). Each is an ordinary prompt-cache entry (RAM, SSD).
    checkpoint_interval: int = 1024
    max_checkpoints: int = 2


class SchedulerCore:
    """The scheduling logic, with no awaits: plan a step, apply its result."""

    def __init__(
        self,
        backend: Backend,
        cfg: SchedulerConfig,
        clock: Clock,
        events: EventLog,
        prefix_cache: PrefixCache | None = None,
        cold: ColdLookup | None = None,
        spec: SpecRounds | None = None,
    ):
        self.backend = backend
        self.spec = spec  # speculative rounds, when the engine has a drafter
        self.cfg = cfg
        self.clock = clock
        self.events = events
        self.prefix_cache = prefix_cache
        self.cold = cold
        self.restoring: set[int] = set()  # rows waiting for an SSD restore
        self.rows: dict[int, Row] = {}
        self.queue: deque[int] = deque()
        self.active: list[int] = []  # admission order
        self._closing: list[int] = []
        self._keep: set[int] = set()
        self.outbox: list[RowDelta] = []
        self.steps = 0
        self.counters = {
            "admitted": 0,
            "finished": 0,
            "aborted": 0,
            "failed": 0,
            "generated_tokens": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
        }
        self.checkpointing = prefix_cache is not None and bool(getattr(backend, "needs_checkpoints", False))
        self._checkpoint_at: dict[int, int] = {}  # rid -> position, for the step planned last
        if self.checkpointing:
            self.counters["checkpoints"] = 0

    # ---- messages ----------------------------------------------------------
    def admit(self, msg: Admit) -> None:
        now = self.clock.now()
        row = Row(msg.rid, list(msg.tokens), msg.params, msg.ns, now)
        row.stop = StopMatcher(msg.params.stop)
        self.rows[msg.rid] = row
        self.queue.append(msg.rid)
        if self.spec is not None:
            self.spec.admit(msg.rid, msg.params)
        self.counters["admitted"] += 1
        self.counters["prompt_tokens"] += len(row.prompt)
        self.events.record("admit", now, rid=msg.rid, prompt=len(row.prompt), max_tokens=msg.params.max_tokens)

    def abort(self, rid: int, reason: str = "abort") -> None:
        row = self.rows.get(rid)
        if row is None or row.state is RowState.FINISHED:
            return
        self.counters["aborted"] += 1
        self._finish(row, reason, keep_cache=row.opened)
        self.events.record("abort", self.clock.now(), rid=rid)

    # ---- state -------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.queue or self.active or self._closing)

    def _finish(self, row: Row, reason: str, *, keep_cache: bool, error: str | None = None) -> None:
        was_queued = row.state in (RowState.QUEUED, RowState.RESTORING)
        row.move(RowState.FINISHED)
        row.finish_reason = reason
        tail = ""
        if row.detok is not None and error is None:
            assert row.stop is not None  # set with detok
            row.detok.finalize()
            tail = row.stop.feed(row.detok.last_segment) + row.stop.flush()
        usage = Usage(prompt_tokens=len(row.prompt), completion_tokens=len(row.generated), cached_tokens=row.cached)
        if self.spec is not None:
            usage.speculation = self.spec.finish(row.rid)
        self.outbox.append(RowDelta(rid=row.rid, text=tail, finish_reason=reason, usage=usage, error=error))
        if was_queued:
            self.restoring.discard(row.rid)
            row.prepared = None
            try:
                self.queue.remove(row.rid)
            except ValueError:
                pass
            del self.rows[row.rid]
            return
        self.active.remove(row.rid)
        self._closing.append(row.rid)
        if keep_cache and self.prefix_cache is not None and error is None:
            self._keep.add(row.rid)

    # ---- planning ----------------------------------------------------------
    def _open(self, row: Row, plan: StepPlan) -> None:
        cache, cached = None, 0
        if row.prepared is not None:
            (cache, cached), row.prepared = row.prepared, None
        elif self.prefix_cache is not None:
            cache, cached = self.prefix_cache.take(row.prompt, row.ns, min_len=self.cfg.min_cached_prefix)
            cached = min(cached, len(row.prompt) - 1) if cache is not None else 0
            if self._wait_for_cold(row, cache, cached):
                return
        row.cached = row.in_cache = row.last_checkpoint = cached
        self.counters["cached_tokens"] += cached
        row.detok = self.backend.tokenizer.detokenizer()
        row.next_input = row.prompt[-1]
        row.opened = True
        plan.open.append(OpenRow(row.rid, row.params, cache, cached))
        row.move(RowState.PREFILL if cached < row.prefill_total else RowState.DECODE)
        self.active.append(row.rid)
        self.events.record("open", self.clock.now(), rid=row.rid, cached=cached)

    def _wait_for_cold(self, row: Row, cache: Any, cached: int) -> bool:
        """Park the row in RESTORING when SSD holds a strictly longer prefix
        (ties go to RAM); the batch keeps stepping without it."""
        floor = max(cached, self.cfg.min_cached_prefix - 1)  # restore only what is worth a disk read
        if self.cold is None or self.cold.longest(row.prompt, row.ns) <= floor:
            return False
        try:
            self.cold.request_restore(row.rid, row.prompt, row.ns, floor)
        except Exception as exc:  # the cold tier is gone or full: serve from RAM or cold
            log.warning("[scheduler] restore request for row %d failed: %r", row.rid, exc)
            return False
        row.prepared = (cache, cached)
        row.move(RowState.RESTORING)
        self.restoring.add(row.rid)
        self.events.record("restoring", self.clock.now(), rid=row.rid, ram=cached)
        return True

    def restored(self, msg: Restored) -> None:
        """An SSD restore finished: requeue the row at the front with the longer
        of the restored and the RAM candidate."""
        row = self.rows.get(msg.rid)
        if row is None or row.state is not RowState.RESTORING:
            return  # aborted meanwhile: the restored copy is simply dropped
        self.restoring.discard(row.rid)
        if msg.cache is not None and row.prepared is not None and msg.cached > row.prepared[1]:
            row.prepared = (msg.cache, msg.cached)
        row.move(RowState.QUEUED)
        self.queue.appendleft(row.rid)
        self.events.record("restored", self.clock.now(), rid=row.rid, cached=row.prepared[1] if row.prepared else 0)

    def snapshot(self, msg: Snapshot) -> tuple[Any, int] | None:
        """The exact RAM entry ``msg`` names (its cache, shared: entries are
        never written after ``put``), and its bytes."""
        if self.prefix_cache is None:
            return None
        clone = self.prefix_cache.snapshot(msg.tokens, msg.ns)
        return None if clone is None else (clone, self.backend.cache_nbytes(clone))

    def demote(self, idle_s: float) -> tuple[int, float | None]:
        """Idle demotion sweep: only while nothing runs, queues or restores."""
        if self.prefix_cache is None or self.has_work() or self.restoring:
            return 0, None
        return self.prefix_cache.demote_idle(idle_s)

    def plan(self) -> StepPlan:
        plan = StepPlan(close=self._closing, keep_cache=self._keep)
        self._closing, self._keep = [], set()
        if self.spec is not None:
            self.spec.defer_closing(plan, self._closing, self._keep)
        while self.queue and len(self.active) < self.cfg.max_batch:
            self._open(self.rows[self.queue.popleft()], plan)
        budget = self.cfg.prefill_chunk
        self._checkpoint_at = {}
        for rid in self.active:
            row = self.rows[rid]
            if row.state is not RowState.PREFILL or budget <= 0:
                continue
            n = min(budget, row.prefill_total - row.in_cache)
            plan.prefill.append(PrefillChunk(rid, row.prompt[row.in_cache : row.in_cache + n]))
            row.in_cache += n
            budget -= n
            if self.checkpointing:
                self._plan_checkpoint(row, plan)
            if row.in_cache == row.prefill_total:
                row.move(RowState.DECODE)  # its last prompt token decodes in this same step
        for rid in self.active:
            row = self.rows[rid]
            if row.state is RowState.DECODE:
                window = self.spec.window(row) if self.spec is not None else None
                if window:
                    plan.verify.append(VerifyRow(rid, window))
                else:
                    plan.decode.append(DecodeRow(rid, row.next_input))
        self.steps += 1
        self.events.record(
            "step",
            self.clock.now(),
            n=self.steps,
            open=[o.rid for o in plan.open],
            close=list(plan.close),
            prefill=[(c.rid, len(c.tokens)) for c in plan.prefill],
            decode=[d.rid for d in plan.decode],
            **({"verify": [(v.rid, len(v.tokens) - 1) for v in plan.verify]} if plan.verify else {}),
        )
        return plan

    def _plan_checkpoint(self, row: Row, plan: StepPlan) -> None:
        """Ask for a copy of the row's cache after this chunk: always at the
        prompt's end, and at a bounded number of earlier chunk ends."""
        at = row.in_cache
        if at < row.prefill_total:
            cfg = self.cfg
            if row.checkpointed >= cfg.max_checkpoints or at - row.last_checkpoint < cfg.checkpoint_interval:
                return
            row.checkpointed += 1
        row.last_checkpoint = at
        plan.checkpoint.add(row.rid)
        self._checkpoint_at[row.rid] = at

    # ---- applying ----------------------------------------------------------
    def apply(self, plan: StepPlan, result: StepResult) -> None:
        for rid, cache in result.checkpoints.items():
            at = self._checkpoint_at.pop(rid, None)
            row = self.rows.get(rid)
            if at is not None and row is not None and self.prefix_cache is not None:
                self.prefix_cache.put(row.prompt[:at], row.ns, cache)
                self.counters["checkpoints"] += 1
        for rid, cache in result.closed.items():
            row = self.rows.pop(rid, None)
            if row is not None and self.prefix_cache is not None:
                self.prefix_cache.put(row.cached_tokens(), row.ns, cache)
        for rid in plan.close:
            self.rows.pop(rid, None)
        for rid, err in result.errors.items():
            self._fail(rid, err)
        for rid, token in result.tokens.items():
            row = self.rows.get(rid)
            if row is None or row.state is not RowState.DECODE:
                continue  # aborted while the step ran
            if self.spec is not None and self.spec.collect(row, [token]):
                continue  # a speculating row: emitted with the Verifier's verdict
            row.in_cache += 1
            self._emit(row, [token], result.logprobs.get(rid))
        for rid, targets in result.verified.items():
            row = self.rows.get(rid)
            if row is not None and row.state is RowState.DECODE and self.spec is not None:
                self.spec.collect(row, targets)

    # ---- speculative rounds (actors.spec_rounds) ------------------------------
    def draft_requests(self) -> list[Any]:
        """``Draft`` requests for the decoding rows that speculate this step."""
        if self.spec is None:
            return []
        rows = [self.rows[rid] for rid in self.active]
        return self.spec.draft_requests([r for r in rows if r.state is RowState.DECODE])

    def apply_verified(self, verified: Any) -> None:
        """Emit the Verifier's verdicts; their trims go into the next plan."""
        live = {rid: r for rid, r in self.rows.items() if r.state is RowState.DECODE}
        assert self.spec is not None  # verdicts come only with speculation
        self.spec.apply(verified, live, self._emit)
        rounds = [(v.rid, v.accepted, len(v.tokens)) for v in verified.verdicts]
        self.events.record("verified", self.clock.now(), n=self.steps, rounds=rounds)

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """A step raised a per-request error: fail every row it touched."""
        touched = {o.rid for o in plan.open} | {c.rid for c in plan.prefill} | {d.rid for d in plan.decode}
        touched |= {v.rid for v in plan.verify}
        for rid in plan.close:
            self.rows.pop(rid, None)
        for rid in sorted(touched):
            self._fail(rid, error)

    def _fail(self, rid: int, error: str) -> None:
        row = self.rows.get(rid)
        if row is None or row.state is RowState.FINISHED:
            return
        self.counters["failed"] += 1
        self.events.record("fail", self.clock.now(), rid=rid)
        self._finish(row, "error", keep_cache=False, error=error)

    def _emit(self, row: Row, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append sampled tokens to a row; finish it on EOS, a stop string or length.
        ``logprobs``: one per token, when the request asked for them."""
        eos = self.backend.tokenizer.eos_token_ids
        params, detok, stop, generated = row.params, row.detok, row.stop, row.generated
        assert stop is not None  # a decoding row has its detokenizer and stop matcher
        reason = None
        text_parts: list[str] = []
        out_ids: list[int] = []
        for tok in tokens:
            if tok in eos and not params.ignore_eos:
                reason = "stop"
                break
            generated.append(tok)
            out_ids.append(tok)
            self.counters["generated_tokens"] += 1
            detok.add_token(tok)
            text_parts.append(stop.feed(detok.last_segment))
            if stop.stopped:
                reason = "stop"
                break
            if len(generated) >= params.max_tokens:
                reason = "length"
                break
        text = "".join(text_parts)
        if generated:
            row.next_input = generated[-1]
        lps = logprobs[: len(out_ids)] if logprobs is not None and params.logprobs is not None else None
        if reason is None:
            self.outbox.append(RowDelta(rid=row.rid, text=text, token_ids=out_ids, logprobs=lps))
            return
        if out_ids:  # a token went through the detokenizer (and so a text part, maybe empty)
            self.outbox.append(RowDelta(rid=row.rid, text=text, token_ids=out_ids, logprobs=lps))
        self.counters["finished"] += 1
        self.events.record("finish", self.clock.now(), rid=row.rid, reason=reason, n=len(generated))
        self._finish(row, reason, keep_cache=True)

    def take_outbox(self) -> list[RowDelta]:
        out, self.outbox = self.outbox, []
        return out

    # ---- stats -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        prefill = [
            {"rid": r.rid, "done": r.in_cache, "total": r.prefill_total}
            for r in (self.rows[rid] for rid in self.active)
            if r.state is RowState.PREFILL
        ]
        return {
            "steps": self.steps,
            "queued": len(self.queue),
            "active_rows": len(self.active),
            "max_batch": self.cfg.max_batch,
            "prefill": prefill,
            **self.counters,
        }


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
        self.step_timeout_s = step_timeout_s
        self.drafter = drafter  # speculation: both set with core.spec, or neither
        self.verifier = verifier
        self.is_busy = False
        self._settle_waiters: list[Envelope[Inbox]] = []  # Settle asks held until the closes are put
        # the step watchdog (``main``): the step in flight and its loop timer
        self._step_n = 0
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self._watch_timer: asyncio.TimerHandle | None = None
        self._hang_scope: anyio.CancelScope | None = None
        self._hung: int | None = None  # the step the watchdog gave up on
        self._exact_cost = False  # the device's runs take exactly their cost (``main``)

    async def stopping(self, reason: BaseException | None) -> None:
        for env in self._settle_waiters:  # their closes will never be put
            env.answer(Failure(EngineDead("scheduler stopped")))
        self._settle_waiters = []

    def subscribe(self, ref: ActorRef[Any]) -> None:
        self.subscribers.append(ref)

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

    def _handle(self, env: Envelope[Inbox]) -> bool:
        msg = env.msg
        match msg:
            case Admit():
                self.core.admit(msg)
            case Abort():
                self.core.abort(msg.rid, msg.reason)
            case Shutdown():
                env.answer(None)
                return False
            case Restored():
                self.core.restored(msg)
            case Settle():
                if self.core._closing:  # closed (and put) by the next step
                    self._settle_waiters.append(env)
                    return True
            case Snapshot():
                try:
                    reply: Any = self.core.snapshot(msg)
                except Exception as exc:  # a cache fault fails one write-behind attempt, never a request
                    reply = Failure(exc)
                env.answer(reply)
                return True
            case Demote():
                n, due = self.core.demote(msg.idle_s)
                if self.core.cold is not None:
                    self.core.cold.demoted(n, due)
            case _:
                assert_never(msg)
        env.answer(None)
        return True

    async def main(self) -> None:
        if not self.step_timeout_s:
            return await self._loop()
        loop = asyncio._get_running_loop()
        if loop is None:  # not asyncio: a ``fail_after`` per step (``_step``)
            return await self._loop()
        # The step watchdog: one cancel scope for the actor's life and, per
        # GPU step, a bare loop timer at its deadline, cancelled when the step
        # ends (a ``fail_after`` per step cost a scope, a generator context and
        # the same timer: ~4% of a run). It fires at the instant the step's
        # ``fail_after`` did. (A timer that outlived its step would stop the
        # virtual clock at an instant of its own and move every later float time.)
        self._watch_loop = loop
        self._exact_cost = bool(getattr(self.device, "exact_cost", False))
        try:
            with anyio.CancelScope() as self._hang_scope:
                await self._loop()
        finally:
            if self._watch_timer is not None:
                self._watch_timer.cancel()
                self._watch_timer = None
        if self._hung is not None:
            raise EngineDead(f"GPU step {self._hung} hung past {self.step_timeout_s}s")

    def _watch(self) -> None:
        """The watchdog timer: the step in flight reached its deadline."""
        self._watch_timer = None
        self._hung = self._step_n
        assert self._hang_scope is not None  # the timer is set only inside main's scope
        self._hang_scope.cancel()

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
                if not self._handle(env):
                    return
            if not self.core.has_work():
                if not self.core.restoring:  # a row waiting on SSD is work in flight
                    self._publish(False)
                try:
                    env = await self._inbox_recv.receive()
                except anyio.EndOfStream:
                    return
                if not self._handle(env):
                    return
                continue
            self._publish(True)
            await self._step()

    async def _step(self) -> None:
        core = self.core
        started = core.clock.now()
        draft_s, catch_up_s = await self._draft()
        plan = core.plan()
        cost = core.backend.step_cost_s(plan)
        try:
            if self._watch_loop is not None:  # the watchdog timer (``main``)
                loop, now = self._watch_loop, core.clock.now()
                assert self.step_timeout_s is not None  # main() sets _watch_loop only with a timeout
                deadline = now + self.step_timeout_s
                # A device whose run takes exactly its cost (the fake GPU's
                # InlineDevice) finishes a step that ends a clock tick before
                # the deadline: the timer could never fire, and is not set.
                # asyncio's private _clock_resolution: the granularity its timers fire at
                if not (self._exact_cost and now + cost + loop._clock_resolution < deadline):  # type: ignore[attr-defined]
                    self._step_n = core.steps
                    self._watch_timer = loop.call_at(deadline, self._watch)
                result = await self.device.run(core.backend.step, plan, cost_s=cost)
            else:
                with anyio.fail_after(self.step_timeout_s) if self.step_timeout_s else _nullcontext():
                    result = await self.device.run(core.backend.step, plan, cost_s=cost)
        except TimeoutError:
            raise EngineDead(f"GPU step {core.steps} hung past {self.step_timeout_s}s") from None
        except MemoryError as exc:
            log.warning("[scheduler] step %d failed: %r", core.steps, exc)
            core.fail_step(plan, f"{type(exc).__name__}: {exc}")
            result = None
        finally:
            if self._watch_timer is not None:
                self._watch_timer.cancel()
                self._watch_timer = None
        if result is not None:
            core.apply(plan, result)
            if core.spec is not None:
                await self._verify(len(plan.decode) + len(plan.verify))
        core.events.record("step_end", core.clock.now(), n=core.steps)
        if self._settle_waiters and not core._closing:
            waiters, self._settle_waiters = self._settle_waiters, []
            for env in waiters:
                env.answer(None)
        if core.spec is not None:  # the time from this step's start to the next one's is its cost
            core.spec.note_step(
                plan, started, draft_s, catch_up_s=catch_up_s, ok=result is not None, more=core.has_work()
            )
        self._forget()
        deltas = core.take_outbox()
        if deltas:
            await self.output(deltas)

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

    async def _verify(self, rows: int) -> None:
        assert self.core.spec is not None and self.verifier is not None  # called only with speculation
        msg = self.core.spec.take_verify(rows)
        if msg is None:
            return
        self.core.apply_verified(await self.verifier.ask(msg))

    def _forget(self) -> None:
        if self.core.spec is None:
            return
        rids = self.core.spec.take_forgotten()
        if not rids:
            return
        for ref, msg in ((self.drafter, DrafterForget(rids=rids)), (self.verifier, VerifierForget(rids=rids))):
            assert ref is not None  # set with core.spec
            try:
                ref.tell_nowait(msg)
            except Exception:  # a full inbox only delays freeing a finished row's state
                log.warning("[scheduler] %s missed Forget rids=%s", ref.name, rids)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
