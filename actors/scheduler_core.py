"""The Scheduler's logic, with no awaits: ``SchedulerCore`` plans a step and
applies its result (continuous batching with chunked prefill; the rows'
lifecycle, the prompt-cache tiers, checkpoints, the emission of tokens and
the rows' ends), and the types it works on (a row and its lifecycle, the
``RowDelta`` it emits, the tiers as it uses them). It takes fields, not
messages: ``actors.scheduler`` is the actor that imports it, unpacks its
messages into calls, runs its plans on the device and sends what it returns.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from actors.prefill_budget import PrefillBudget
from actors.spec_rounds import SpecRounds
from engine.eventlog import EventLog
from engine.kv.cache_miss import closest_miss
from engine.kv.namespace import namespace_adapter
from engine.kv.prompt_cache import as_tokens, common_prefix
from engine.ports import Backend, Clock, DecodeRow, OpenRow, PrefillChunk, StepPlan, StepResult, VerifyRow
from engine.textstream import StopMatcher
from engine.transitions import IllegalTransition
from engine.types import CacheMiss, SamplingParams, TokenLogprob, Usage

log = logging.getLogger("ember.scheduler")


# ---------------------------------------------------------------------------
# Row lifecycle: an enum plus a transition table; an illegal move raises.
# What the core emits (RowDelta) and the tiers as it uses them.


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

    def take(self, tokens: Any, ns: str, min_len: int = 1, session: str | None = None) -> tuple[Any, int]: ...

    def put(self, tokens: list[int], ns: str, cache: Any, session: str | None = None) -> None: ...

    def demote_idle(self, idle_s: float) -> tuple[int, float | None]: ...

    def snapshot(self, tokens: list[int], ns: str) -> Any: ...

    def peek(self, tokens: Any, ns: str) -> int:
        """The prefix ``take`` would serve now, without taking it."""
        ...

    def closest(self, tokens: Any, ns: str) -> tuple[Any, int]:
        """The entry sharing the longest common prefix with ``tokens`` (its
        tokens, or None) and that length: explains a miss (engine.kv.cache_miss)."""
        ...


class ColdLookup(Protocol):
    """The SSD cold tier as the Scheduler uses it (see actors.cold_tier.ColdLink)."""

    def longest(self, tokens: Any, ns: str) -> int:
        """Usable prefix the SSD index holds for ``tokens`` (a sync index lookup)."""
        ...

    def request_restore(self, rid: int, tokens: list[int], ns: str, min_len: int) -> None:
        """Ask for a restore longer than ``min_len``; answered by ``Restored``. Never blocks."""
        ...

    def demoted(self, n: int, next_due: float | None) -> None: ...

    def closest(self, tokens: Any, ns: str) -> tuple[Any, int]:
        """``PrefixCache.closest`` over the SSD index."""
        ...


@dataclass(slots=True)
class Row:
    rid: int
    prompt: list[int]
    params: SamplingParams
    ns: str
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
    from_ssd: bool = False  # ``prepared`` (then ``cached``) is an SSD restore, not the RAM candidate
    checkpointed: int = 0  # earlier-position checkpoints taken (the prompt's end not counted)
    last_checkpoint: int = 0  # the position of the latest one (or the cached prefix)
    miss: CacheMiss | None = None  # where the prompt left the closest cached sequence, if it did
    waited: bool = False  # held in the queue for another row's prefill of their shared prefix
    _lookup: Any = None  # the prompt as the tiers' int64 array, made once for every lookup

    def lookup_tokens(self) -> Any:
        """The prompt as an int64 array: the tiers' lookups take it as it is,
        where a list costs a conversion each (most of a lookup's time)."""
        if self._lookup is None:
            self._lookup = as_tokens(self.prompt)
        return self._lookup

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
    # While rows decode, a step's prefill takes at most this share of a decode
    # step's time (actors.prefill_budget); None: always the full chunk.
    prefill_share: float | None = None
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
    # Shared prefill: a queued request whose prompt shares at least this many
    # tokens the cache does not hold with a row prefilling now waits for that
    # row's checkpoint of them (``SchedulerCore._producer_for``); 0: off.
    shared_prefill_min: int = 0


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
        self.prefill_budget = PrefillBudget(cfg.prefill_chunk, cfg.prefill_share)
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
            "ssd_cached_tokens": 0,  # the part of cached_tokens restored from SSD
            "prefilled_tokens": 0,  # prompt tokens run through prefill (not cached)
            "cache_faults": 0,  # prefix caches the backend could not open: prefilled whole instead (a miss)
            "cache_diverged": 0,  # prompts that left a longer cached sequence (engine.kv.cache_miss)
            "prefill_waits": 0,  # requests held for another row's prefill of their shared prefix
            "shared_prefix_checkpoints": 0,  # checkpoints taken for those requests
        }
        self.checkpointing = prefix_cache is not None and backend.needs_checkpoints
        self._checkpoint_at: dict[int, int] = {}  # rid -> position, for the step planned last
        # shared prefill needs a backend that checkpoints any row and a tier to put the checkpoint in
        self.shares_prefill = prefix_cache is not None and cfg.shared_prefill_min > 0 and backend.can_checkpoint
        self._wanted: dict[int, int] = {}  # producer rid -> the position its waiters need, this plan
        if self.checkpointing:
            self.counters["checkpoints"] = 0

    # ---- messages ----------------------------------------------------------
    def admit(self, rid: int, tokens: list[int], params: SamplingParams, ns: str = "") -> None:
        now = self.clock.now()
        row = Row(rid, list(tokens), params, ns)
        row.stop = StopMatcher(params.stop)
        self.rows[rid] = row
        self.queue.append(rid)
        if self.spec is not None:
            self.spec.admit(rid, params, ns)
        self.counters["admitted"] += 1
        self.counters["prompt_tokens"] += len(row.prompt)
        self.events.record("admit", now, rid=rid, prompt=len(row.prompt), max_tokens=params.max_tokens)

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

    def batch_ahead(self, stepped: int) -> int:
        """The rows the next decode steps will batch: those decoding or
        prefilling now and those queued for a free slot (``stepped``, this
        step's decoding rows, when none). Adaptive γ chooses for this batch,
        not the step's: the first of four requests that arrive together
        decodes its first token while the others still prefill, and its
        choice made for a lone row (where a probe or a draft costs nobody
        else) then ran in the batch of four (docs/speculation.md)."""
        live = sum(1 for rid in self.active if self.rows[rid].state in (RowState.PREFILL, RowState.DECODE))
        ahead = min(self.cfg.max_batch, live + len(self.queue))
        return ahead if ahead > 0 else stepped

    def closes_pending(self) -> bool:
        """Rows finished but not yet closed (their caches are put by the next step)."""
        return bool(self._closing)

    def _finish(self, row: Row, reason: str, *, keep_cache: bool, error: str | None = None) -> None:
        was_queued = row.state in (RowState.QUEUED, RowState.RESTORING)
        row.move(RowState.FINISHED)
        row.finish_reason = reason
        tail = ""
        if row.detok is not None and error is None:
            assert row.stop is not None  # set with detok
            row.detok.finalize()
            tail = row.stop.feed(row.detok.last_segment) + row.stop.flush()
        usage = Usage(
            prompt_tokens=len(row.prompt),
            completion_tokens=len(row.generated),
            cached_tokens=row.cached,
            ssd_cached_tokens=row.cached if row.from_ssd else 0,
            cache_miss=row.miss,
        )
        if self.spec is not None:
            learn = error is None and self.spec.learns
            usage.speculation = self.spec.finish(
                row.rid,
                ns=row.ns,
                prompt=row.prompt if learn else None,
                generated=row.generated if learn else None,
            )
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
            cache, cached = self.prefix_cache.take(
                row.lookup_tokens(), row.ns, min_len=self.cfg.min_cached_prefix, session=row.params.cache_session
            )
            cached = min(cached, len(row.prompt) - 1) if cache is not None else 0
            if cached < row.prefill_total:  # some of the prompt is prefilled: say why
                row.miss = self._divergence(row)
            if self._wait_for_cold(row, cache, cached):
                return
        row.cached = row.in_cache = row.last_checkpoint = cached
        self.counters["cached_tokens"] += cached
        if row.from_ssd:
            self.counters["ssd_cached_tokens"] += cached
        row.detok = self.backend.tokenizer.detokenizer()
        row.next_input = row.prompt[-1]
        row.opened = True
        prefix = row.prompt[:cached] if cache is not None else []
        plan.open.append(OpenRow(row.rid, row.params, cache, cached, prefix, namespace_adapter(row.ns)))
        row.move(RowState.PREFILL if cached < row.prefill_total else RowState.DECODE)
        self.active.append(row.rid)
        self.events.record("open", self.clock.now(), rid=row.rid, cached=cached)

    def _divergence(self, row: Row) -> CacheMiss | None:
        """Where ``row``'s prompt left the closest cached sequence of its
        namespace, RAM or SSD (None: it left none). Two bisects, only for a
        prompt the cache does not serve whole; a fault is no report."""
        found = []
        try:
            if self.prefix_cache is not None:
                found.append(("ram", *self.prefix_cache.closest(row.lookup_tokens(), row.ns)))
            if self.cold is not None:
                found.append(("ssd", *self.cold.closest(row.lookup_tokens(), row.ns)))
            miss = closest_miss(row.prompt, found)
        except Exception as exc:  # an explanation must never fail a request
            log.warning("[scheduler] cache-miss lookup for row %d failed: %r", row.rid, exc)
            return None
        if miss is not None:
            self.counters["cache_diverged"] += 1
        return miss

    def _wait_for_cold(self, row: Row, cache: Any, cached: int) -> bool:
        """Park the row in RESTORING when SSD holds a strictly longer prefix
        (ties go to RAM); the batch keeps stepping without it."""
        floor = max(cached, self.cfg.min_cached_prefix - 1)  # restore only what is worth a disk read
        if self.cold is None or self.cold.longest(row.lookup_tokens(), row.ns) <= floor:
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

    def restored(self, rid: int, cache: Any, cached: int) -> None:
        """An SSD restore finished (``cache`` None on a miss): requeue the row at
        the front with the longer of the restored and the RAM candidate."""
        row = self.rows.get(rid)
        if row is None or row.state is not RowState.RESTORING:
            return  # aborted meanwhile: the restored copy is simply dropped
        self.restoring.discard(row.rid)
        if cache is not None and row.prepared is not None and cached > row.prepared[1]:
            row.prepared = (cache, cached)
            row.from_ssd = True
        row.move(RowState.QUEUED)
        self.queue.appendleft(row.rid)
        self.events.record("restored", self.clock.now(), rid=row.rid, cached=row.prepared[1] if row.prepared else 0)

    def snapshot(self, tokens: list[int], ns: str) -> tuple[Any, int] | None:
        """The exact RAM entry holding ``tokens`` in ``ns`` (its cache, shared:
        entries are never written after ``put``), and its bytes."""
        if self.prefix_cache is None:
            return None
        clone = self.prefix_cache.snapshot(tokens, ns)
        return None if clone is None else (clone, self.backend.cache_nbytes(clone))

    def demote(self, idle_s: float) -> tuple[int, float | None]:
        """Idle demotion sweep: only while nothing runs, queues or restores."""
        if self.prefix_cache is None or self.has_work() or self.restoring:
            return 0, None
        return self.prefix_cache.demote_idle(idle_s)

    def note_step_time(self, plan: StepPlan, seconds: float) -> None:
        """The device time of a step: prices the prefill budget (actors.prefill_budget)."""
        tokens = sum(len(c.tokens) for c in plan.prefill)
        self.prefill_budget.observe(tokens, bool(plan.decode or plan.verify), seconds)

    def plan(self) -> StepPlan:
        plan = StepPlan(close=self._closing, keep_cache=self._keep)
        self._closing, self._keep = [], set()
        if self.spec is not None:
            self.spec.defer_closing(plan, self._closing, self._keep)
        self._wanted = {}
        held: list[int] = []
        while self.queue and len(self.active) < self.cfg.max_batch:
            row = self.rows[self.queue.popleft()]
            if self.shares_prefill and self._producer_for(row):
                held.append(row.rid)  # back to its place once the loop is done: later rows may open
                continue
            self._open(row, plan)
        self.queue.extendleft(reversed(held))
        decoding = any(self.rows[rid].state is RowState.DECODE for rid in self.active)
        budget = self.prefill_budget.budget(decoding)
        whole = self.prefill_budget.whole(decoding)  # short prompts prefill whole, beside the budget
        self._checkpoint_at = {}
        for rid in self.active:
            row = self.rows[rid]
            if row.state is not RowState.PREFILL:
                continue
            left = row.prefill_total - row.in_cache
            short = 0 < left <= whole
            if not short and budget <= 0:
                continue
            n = left if short else min(budget, left)
            want = self._wanted.get(rid, 0)
            if row.in_cache < want:  # the chunk ends where its waiters' shared prefix does
                n = min(n, want - row.in_cache)
            plan.prefill.append(PrefillChunk(rid, row.prompt[row.in_cache : row.in_cache + n]))
            row.in_cache += n
            if short:
                whole -= n
            else:
                budget -= n
            self.counters["prefilled_tokens"] += n
            if self.checkpointing:
                self._plan_checkpoint(row, plan)
            if row.in_cache == want:
                plan.checkpoint.add(rid)
                self._checkpoint_at[rid] = want
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

    def _producer_for(self, row: Row) -> bool:
        """Whether ``row`` waits for a row prefilling now (its producer): one
        whose prompt shares at least ``shared_prefill_min`` more tokens with
        ``row``'s than the cache tiers hold and that has not prefilled them
        yet. The producer's chunk then ends at the shared prefix and a
        checkpoint there goes into the RAM tier (``_wanted``), where ``row``
        finds it on a later plan: N requests on one cold prefix (subagents on
        a system prompt) prefill it once, not N times. Asked anew at every
        plan, so nothing is left waiting when the producer ends or aborts, or
        when no checkpoint comes (it then goes past the prefix: no wait)."""
        if row.prepared is not None or row.prefill_total < self.cfg.shared_prefill_min:
            return False
        prompt = row.lookup_tokens()
        producer, shared = None, 0
        for rid in self.active:
            p = self.rows[rid]
            if p.state is not RowState.PREFILL or p.ns != row.ns:
                continue  # another namespace's (key's, adapter's) checkpoint is never this row's to read
            n = min(common_prefix(p.lookup_tokens(), prompt), p.prefill_total, row.prefill_total)
            if n > p.in_cache and n > shared:
                producer, shared = p, n
        if producer is None:
            return False
        assert self.prefix_cache is not None  # shares_prefill needs the RAM tier
        have = self.prefix_cache.peek(prompt, row.ns)
        if self.cold is not None:
            have = max(have, self.cold.longest(prompt, row.ns))
        if shared - have < self.cfg.shared_prefill_min:
            return False
        self._wanted[producer.rid] = min(self._wanted.get(producer.rid, shared), shared)
        if not row.waited:
            row.waited = True
            self.counters["prefill_waits"] += 1
            self.events.record("wait_prefill", self.clock.now(), rid=row.rid, on=producer.rid, shared=shared)
        return True

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
                self.prefix_cache.put(row.prompt[:at], row.ns, cache, session=row.params.cache_session)
                self.counters["checkpoints" if self.checkpointing else "shared_prefix_checkpoints"] += 1
        for rid, cache in result.closed.items():
            row = self.rows.pop(rid, None)
            if row is not None and self.prefix_cache is not None:
                self.prefix_cache.put(row.cached_tokens(), row.ns, cache, session=row.params.cache_session)
        for rid in plan.close:
            self.rows.pop(rid, None)
        for rid, why in result.cache_faults.items():
            self._cache_fault(rid, why)
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
                self.spec.collect(row, targets, stopped=rid in result.stopped)

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

    def _cache_fault(self, rid: int, why: str) -> None:
        """The backend could not open a row's prefix cache and prefilled its
        prefix instead (a cache fault is a miss): the row holds no cached token."""
        self.counters["cache_faults"] += 1
        row = self.rows.get(rid)
        self.events.record("cache_fault", self.clock.now(), rid=rid)
        if row is None:
            return
        log.warning(
            "request %d: its prefix cache of %d tokens could not open (%s); prefilled instead", rid, row.cached, why
        )
        self.counters["cached_tokens"] -= row.cached
        if row.from_ssd:
            self.counters["ssd_cached_tokens"] -= row.cached
        self.counters["prefilled_tokens"] += row.cached
        row.cached = 0
        row.from_ssd = False

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
