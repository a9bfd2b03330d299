"""The Scheduler's side of speculative rounds (sync, no awaits).

``SchedulerCore`` owns one ``SpecRounds`` when the engine has a drafter. Per
speculating row it keeps the γ the Verifier chose, how much context the
Drafter already has, the drafts for the next step, the trim still owed to the
backend, and the per-request counters behind ``Usage.speculation``. A round:

1. ``draft_requests`` — rows in DECODE with γ > 0 ask the Drafter for drafts,
   sending only the context tail the Drafter has not seen;
2. ``window`` — the row's next batched step feeds ``[last, d1..dγ]`` as a
   ``VerifyRow`` (a row with no drafts decodes plainly, in the same step);
3. ``collect`` — a row that fed drafts (or whose plain-decode ``hold`` ran
   out, or that has not been given a γ yet) waits for the Verifier
   (``take_verify``), whose verdicts ``apply`` emits through the Scheduler's
   ``_emit`` and turns into trims for the next step. Any other row is emitted
   by the Scheduler at once, as if it did not speculate: a row the Verifier put
   on hold, or whose drafter had nothing to propose, costs no message.

Trims are owed, not applied at once: a ``StepPlan`` applies close before trim,
so a finishing row whose cache is kept for the prompt cache closes one step
later, after its trim (``defer_closing``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.drafter import DraftedRound
from actors.drafter_cores import Draft, Finished
from actors.verifier import StepCost, Verified, Verify, Window
from engine.ports import StepPlan
from engine.speculation.policy import ADAPTIVE_GAMMA_MAX
from engine.types import SamplingParams, SpecUsage


@dataclass(slots=True)
class RowSpec:
    fixed: int | None  # the request's num_draft_tokens (None = the engine's policy)
    ns: str = ""  # the request's cache namespace (the Verifier's seeds are kept per namespace)
    gamma: int = 0  # drafts to ask for next round
    hold: int = 0  # with gamma 0: plain rounds left before the Verifier is asked again
    min_match: int = 0  # the Verifier's gate on prompt lookup's agreement (Verdict.min_match)
    quorum: int = 0  # in a batch: feed drafts only beside this many rows' (Verdict.quorum)
    consult: bool = True  # send the next round to the Verifier even without drafts
    synced: int = 0  # context tokens the Drafter has
    drafts: list[int] = field(default_factory=list)
    proposer: str = ""  # who drafted ``drafts`` (Drafted.proposer)
    empty: int = 0  # rounds at γ > 0 whose drafter proposed nothing, since the last verdict
    off: bool = False  # the backend refused a window: plain decode from now on
    stopped: bool = False  # this step's window stopped at its rejected first draft (StepResult.stopped)
    targets: list[int] | None = None  # this step's target tokens, until the verdict
    fed: int = 0  # tokens this step fed into the row's cache
    left: int = 0  # tokens the request may still generate, as of this step (Window.left)
    behind: int = 0  # context tokens not yet sent to the Drafter, as of this step (Window.behind)
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_rounds: int = 0


class SpecRounds:
    def __init__(
        self,
        *,
        context_length: int,
        gamma_cap: int = 16,
        costs_kept: int = 16,
        reach: int = 0,
        learns: bool = False,
        free_drafts: bool = False,
    ):
        self.context_length = context_length
        self.gamma_cap = gamma_cap
        # A lone row drafting at the policy's deepest may let a proposer that
        # scores its matches draft up to this many tokens (``Draft.reach``; 0: never).
        self.reach = reach
        # Send finished requests' text to the Drafter (a drafter that learns
        # across requests: suffix decoding); prompt lookup and a draft model need none.
        self.learns = learns
        # Drafting costs nothing (prompt lookup, suffix decoding): a round whose
        # windows the backend stopped at their first draft is costed as the
        # plain round it was. A draft model ran its steps for those drafts.
        self.free_drafts = free_drafts
        self.price: list[float] = []  # a lone row's window in plain rounds, the latest Verified.price
        self._finished: list[Finished] = []
        self.rows: dict[int, RowSpec] = {}
        self.owed: dict[int, int] = {}  # rid -> tokens the backend must still trim
        # Measured since the last Verify, the latest ``costs_kept`` per (rows,
        # drafts): a verify round followed by a long plain hold (no Verify sent)
        # must still reach the policy, not be pushed out by the plain rounds.
        self.costs_kept = costs_kept
        self.costs: dict[tuple[int, int], deque[StepCost]] = {}
        self._open_step: tuple[int, int, int, float, float] | None = None  # costed at the next start
        self._ended = False  # a row finished since the last note_step: that step is not costed
        self._unfed = 0  # draft tokens of the step being applied that the backend did not feed (note_step)
        # Draft-cache catch-up since the last Verify (seconds, tokens): priced by
        # the policy per token, since a held row pays it before its next probe.
        self.catch_up_s = 0.0
        self.catch_up_tokens = 0
        self._forgotten: list[int] = []
        self.quorum_dropped = 0  # steps whose drafts fell short of their quorum (dropped: a plain step)

    # ---- rows ------------------------------------------------------------
    def admit(self, rid: int, params: SamplingParams, ns: str = "") -> None:
        if params.speculate is False or params.num_draft_tokens == 0 or params.logprobs is not None:
            return  # logprobs ride on plain decode steps only (ember.spec_build.check_request)
        self.rows[rid] = RowSpec(fixed=params.num_draft_tokens, ns=ns)

    def finish(
        self, rid: int, *, ns: str = "", prompt: list[int] | None = None, generated: list[int] | None = None
    ) -> SpecUsage | None:
        """The row ended: its usage, and Forget for the Drafter and Verifier
        (with its text, ``prompt`` + ``generated``, when the Drafter learns;
        a request that did not speculate is learned from too)."""
        self._ended = True
        spec = self.rows.get(rid)
        if self.learns and prompt is not None:
            start = spec.synced if spec is not None else 0
            context = prompt + (generated or [])
            self._finished.append(Finished(rid=rid, ns=ns, start=start, tail=context[start:], prompt_len=len(prompt)))
        if spec is None:
            return None
        self._forgotten.append(rid)
        rate = spec.accepted / spec.drafted if spec.drafted else 0.0
        mean = 1.0 + spec.accepted / spec.draft_rounds if spec.draft_rounds else 0.0
        return SpecUsage(
            drafted=spec.drafted,
            accepted=spec.accepted,
            target_calls=spec.target_calls,
            acceptance_rate=rate,
            mean_accept_len=mean,
        )

    def take_forgotten(self) -> list[int]:
        out, self._forgotten = self._forgotten, []
        for rid in out:
            self.rows.pop(rid, None)
        return out

    def take_finished(self) -> list[Finished]:
        """Finished requests' text for the Drafter (``learns``), since the last call."""
        out, self._finished = self._finished, []
        return out

    # ---- drafting ----------------------------------------------------------
    def draft_requests(self, rows: list[Any]) -> list[Draft]:
        """Draft requests for decoding rows whose γ is > 0 (``rows``: Scheduler rows)."""
        out = []
        for row in rows:
            spec = self.rows.get(row.rid)
            if spec is None or spec.off or spec.gamma <= 0:
                continue
            room_tokens = row.params.max_tokens - len(row.generated) - 1
            room_context = self.context_length - row.in_cache - 2
            gamma = min(spec.gamma, self.gamma_cap, room_tokens, room_context)
            if gamma <= 0:
                continue
            context = row.prompt + row.generated if row.generated else row.prompt
            reach = 0
            if self.reach and spec.fixed is None and spec.gamma >= ADAPTIVE_GAMMA_MAX and len(rows) == 1:
                # Alone: a long window costs no other row its padding.
                reach = max(0, min(self.reach, room_tokens, room_context))
            out.append(
                Draft(
                    rid=row.rid,
                    start=spec.synced,
                    tail=context[spec.synced :],
                    gamma=gamma,
                    min_match=spec.min_match,
                    ns=row.ns,
                    reach=reach,
                    price=self.price if reach else [],
                )
            )
            spec.synced = len(context)
        return out

    def set_drafts(self, answer: DraftedRound, asked: list[Draft]) -> None:
        if answer.catch_up_tokens > 0:
            self.catch_up_s += answer.catch_up_s
            self.catch_up_tokens += answer.catch_up_tokens
        for rid in answer.reset:
            if rid in self.rows:
                self.rows[rid].synced = 0
        limits = {d.rid: max(d.gamma, d.reach) for d in asked}
        for d in answer.drafted:
            spec = self.rows.get(d.rid)
            if spec is not None and d.rid in limits:
                spec.drafts = list(d.tokens[: limits[d.rid]])
                spec.proposer = d.proposer
        self._quorum()

    def _quorum(self) -> None:
        """Drop the drafts of a step in which fewer rows proposed than the
        largest of their quorums (``Verdict.quorum``): its verify round's jump
        would be paid by every row of the batch for too few windows. A fixed-γ row's drafts
        (no quorum) pay for the round, and the others' ride along."""
        drafting = [s for s in self.rows.values() if s.drafts]
        if not drafting or any(not s.quorum for s in drafting):
            return
        if len(drafting) < max(s.quorum for s in drafting):
            self.quorum_dropped += 1
            for s in drafting:
                s.drafts = []

    # ---- the step ----------------------------------------------------------
    def defer_closing(self, plan: StepPlan, closing: list[int], keep: set[int]) -> None:
        """Owed trims go into the plan; kept rows that owe one close a step later."""
        for rid in list(plan.close):
            n = self.owed.pop(rid, 0)
            if n and rid in plan.keep_cache:
                plan.close.remove(rid)
                plan.keep_cache.discard(rid)
                closing.append(rid)
                keep.add(rid)
                plan.trim.append((rid, n))
        for rid, n in self.owed.items():
            plan.trim.append((rid, n))
        self.owed.clear()

    def window(self, row: Any) -> list[int] | None:
        """The verify window of a decoding row, or None to decode it plainly."""
        spec = self.rows.get(row.rid)
        if spec is None or not spec.drafts:
            return None
        return [row.next_input, *spec.drafts]

    def collect(self, row: Any, targets: list[int], stopped: bool = False) -> bool:
        """Hold a row's target tokens for the Verifier (True), or leave a row
        that needs no verdict this round to the Scheduler (False). ``stopped``:
        the backend stopped the row's window at its rejected first draft."""
        spec = self.rows.get(row.rid)
        if spec is None:
            return False
        if not spec.drafts and not spec.consult:
            spec.target_calls += 1
            if spec.gamma > 0:
                spec.empty += 1
            if spec.gamma == 0:
                spec.hold -= 1
                spec.consult = spec.hold <= 0
            return False
        spec.targets = list(targets)
        spec.fed = len(targets)  # the window, or 1 if the backend decoded only `last`
        spec.stopped = stopped
        if spec.drafts:
            self._unfed += len(spec.drafts) + 1 - len(targets)  # drafts the backend did not feed
        spec.left = max(0, row.params.max_tokens - len(row.generated))
        spec.behind = max(0, len(row.prompt) + len(row.generated) - spec.synced)
        return True

    def note_step(
        self, plan: StepPlan, started: float, draft_s: float, *, catch_up_s: float = 0.0, ok: bool, more: bool
    ) -> None:
        """Cost a step for adaptive γ (sent with the next Verify): the time from
        its start to the next step's start — drafting, the device step, the
        Verifier and the emission all included, and a decode the backend ran
        ahead (pipelined) counted at what it really costs per token. A step
        that also prefilled, failed, or was followed by an idle wait is not
        costed. Its catch-up of lagging draft caches is left out of the round:
        it is not a cost of every round, and reaches the policy per token with
        the next Verify (``set_drafts``), priced into the probe spacing.

        A step in which a row finished is not costed either: a fixed-γ row's
        last token is a plain step (no room left for drafts) that cost ~1.7×
        a steady plain step on the 1.5B (its window's trim and the stream's
        end), and those steps were almost the only plain rounds near a
        fixed-γ row's verify rounds: every verify round was priced against
        them, at or under one plain round, and adaptive γ then drafted two
        and three deep at 0.93× plain (docs/bench/spec-real.md)."""
        prev, self._open_step = self._open_step, None
        ended, self._ended = self._ended, False
        if prev is not None:
            gamma, rows, drafted, d_s, t = prev
            shape = self.costs.get((rows, drafted))
            if shape is None:
                shape = self.costs[(rows, drafted)] = deque(maxlen=self.costs_kept)
            shape.append(StepCost(gamma=gamma, step_s=started - t, rows=rows, drafted=drafted, draft_s=d_s))
        unfed, self._unfed = (self._unfed if self.free_drafts else 0), 0
        if not ok or not more or ended or plan.prefill or not (plan.decode or plan.verify):
            return
        # The drafts the forward carried, not the plan's: a window stopped at its
        # first draft (or cut for a cache that cannot take it) cost a plain step.
        drafted = max(0, sum(len(v.tokens) - 1 for v in plan.verify) - unfed)
        gamma = max((len(v.tokens) - 1 for v in plan.verify), default=0)
        self._open_step = (gamma, len(plan.decode) + len(plan.verify), drafted, draft_s, started + catch_up_s)

    def take_verify(self, rows: int = 1) -> Verify | None:
        """The Verify for this step's windows (``rows``: the step's decoding rows)."""
        windows = [
            Window(
                rid=rid,
                drafts=list(spec.drafts),
                targets=spec.targets,
                fixed_gamma=spec.fixed,
                empty=spec.empty,
                ns=spec.ns,
                proposer=spec.proposer if spec.drafts else "",
                left=spec.left,
                behind=spec.behind,
                stopped=spec.stopped,
            )
            for rid, spec in self.rows.items()
            if spec.targets is not None
        ]
        if not windows:
            return None
        costs = [c for shape in self.costs.values() for c in shape]
        self.costs = {}
        caught = (self.catch_up_s, self.catch_up_tokens)
        self.catch_up_s, self.catch_up_tokens = 0.0, 0
        return Verify(windows=windows, costs=costs, rows=rows, catch_up_s=caught[0], catch_up_tokens=caught[1])

    def apply(self, verified: Verified, rows: dict[int, Any], emit: Callable[[Any, list[int]], None]) -> None:
        """Emit each verdict's tokens and owe the trim of what the cache holds
        beyond the row's new length (the rejected drafts, and any tokens past
        an EOS, stop string or max_tokens inside the accepted run)."""
        for rid in verified.wake:  # held rows consult the Verifier next round
            held = self.rows.get(rid)
            if held is not None and not held.off:  # on a plain hold, or watching (GammaPolicy._watch)
                held.hold, held.consult = 0, True
        if verified.price:
            self.price = verified.price
        for v in verified.verdicts:
            spec = self.rows.get(v.rid)
            row = rows.get(v.rid)
            if spec is None or spec.targets is None:
                continue
            drafted = len(spec.drafts) if not v.fallback else 0
            fed, spec.targets, spec.drafts = spec.fed, None, []
            spec.target_calls += 1
            spec.drafted += drafted
            spec.accepted += v.accepted
            spec.draft_rounds += 1 if drafted else 0
            spec.gamma, spec.hold, spec.min_match, spec.quorum = v.gamma_next, v.hold, v.min_match, v.quorum
            spec.consult, spec.empty = False, 0
            spec.off = spec.off or v.fallback
            if row is None:
                continue
            before = row.in_cache
            emit(row, v.tokens)
            row.in_cache = min(before + 1 + v.accepted, len(row.prompt) + len(row.generated))
            if before + fed > row.in_cache:
                self.owed[v.rid] = before + fed - row.in_cache
