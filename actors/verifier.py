"""Verifier: the acceptance rule, acceptance statistics and adaptive γ.

Pure on target tokens: the backend runs one forward over each verify window
``[last, d1 … dγ]`` with ONE lm-head pass over the whole window (a
``(B, γ+1)`` forward; per-position lm-head passes were the reference's
γ-scaling tax) and returns the target's token at each of the γ+1 positions —
the argmax when greedy, else a sample from the row's own sampler
(temperature, top-p, top-k, min-p applied to the target's logits at that
position). The Verifier never sees an array.

Acceptance rule: sample-and-match, as mlx-lm's ``speculative_generate_step``.
Accept draft ``d_i`` while it equals the target's token ``t_{i-1}`` at its
position; at the first mismatch emit the target's token there (the
correction); when all γ match emit ``t_γ`` (the bonus).

Why sample-and-match and not Leviathan rejection sampling: every emitted
token is the target's own sample, drawn from the target's distribution given
exactly the tokens emitted before it (a position is only used when all the
drafts before it matched, i.e. when its context is the real one), so the
output is distributed exactly as the target's at any temperature, with no
drafter probabilities. Both our drafters propose deterministically (the draft
model's argmax, or the n-gram continuation): the draft is a point mass, and
rejection sampling's acceptance probability ``min(1, p(d)/q(d))`` is then
``p(d)`` — the same probability with which the target's sample equals ``d``.
So rejection sampling would buy no acceptance here and would need the
drafter's distribution on the wire; it only wins for drafters that sample.
Greedy is the temperature-0 case: token-identical to decoding without
speculation (up to batched-vs-single forward numerics, see docs/speculation.md).

A window the backend answered with fewer than γ+1 tokens means it refused to
feed the drafts because the row's cache could not be trimmed back (a rotating
window about to wrap, SSM state): only ``last`` was decoded, and the row falls
back to plain decode for good — never a silent corruption.
"""

from __future__ import annotations

import logging
from typing import Any, assert_never

import msgspec

from actors.messages import Wire
from actors.runtime import Actor
from engine.speculation.policy import GammaPolicy, RowPolicy, SpecCounters

log = logging.getLogger("ember.verifier")


# ---------------------------------------------------------------------------
# Messages the Verifier accepts.


class Window(msgspec.Struct, frozen=True, kw_only=True):
    """One speculating row's round: the drafts it fed and the target's tokens.
    A row that decoded plainly this round has no drafts and one target token."""

    rid: int
    drafts: list[int]
    targets: list[int]
    fixed_gamma: int | None = None  # the request's own num_draft_tokens
    empty: int = 0  # rounds since the last window in which the drafter proposed nothing
    ns: str = ""  # the request's cache namespace: whose learned seeds it reads and teaches (policy.Learned)
    proposer: str = ""  # who drafted ``drafts`` (prompt lookup, suffix decoding, a draft model)
    # What starting to draft would cost and could save (GammaPolicy._catch_up_pays):
    # tokens the request may still generate (None: not told), and context tokens
    # its drafter was not sent (a draft model feeds them all before drafting).
    left: int | None = None
    behind: int = 0
    # The backend stopped the window at its first draft, which the target
    # rejected (StepResult.stopped): ``targets`` is the one token after ``last``.
    stopped: bool = False


class StepCost(msgspec.Struct, frozen=True, kw_only=True):
    """A measured decode/verify step (no prefill in it): its device seconds, its
    rows, its longest verify window (γ) and the drafting that preceded it."""

    gamma: int
    step_s: float
    rows: int
    drafted: int = 0
    draft_s: float = 0.0


class Verify(Wire, frozen=True):
    """Scheduler → Verifier (ask), after a step in which a row fed drafts or a
    row's hold ran out: judge each window, and take the step costs measured
    since the last Verify (adaptive γ weighs them)."""

    windows: list[Window]
    costs: list[StepCost] = []
    rows: int = 1  # the batch the choice is for: rows decoding, prefilling or queued (SchedulerCore.batch_ahead)
    catch_up_s: float = 0.0  # draft caches fed since the last Verify (a held row's skipped tokens)
    catch_up_tokens: int = 0


class Forget(Wire, frozen=True):
    """Scheduler → Verifier: these rows finished; drop their policy state."""

    rids: list[int]


Inbox = Verify | Forget


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    rid: int
    accepted: int  # drafts accepted
    tokens: list[int]  # accepted drafts + the correction or bonus token
    gamma_next: int  # drafts to propose next round (0 = plain decode)
    hold: int = 0  # with gamma_next 0: rounds to decode plainly before the next Verify
    # Draft only on a prompt-lookup match agreeing with the context for this many
    # tokens: the request's own evidence that it copies (GammaPolicy.min_match).
    min_match: int = 0
    # In a batch: this row's drafts are fed only in a step where this many rows
    # with a quorum propose, or where a fixed-γ row drafts anyway (GammaPolicy.quorum).
    quorum: int = 0
    fallback: bool = False  # the backend refused the window: plain decode from now on


class Verified(Wire, frozen=True):
    """Verifier → Scheduler: the answer to ``Verify``, one verdict per window."""

    verdicts: list[Verdict]
    # Rows on a plain hold to send to the Verifier next round: another row chose
    # a γ that pays only if every row of the batch drafts (GammaPolicy.best).
    wake: list[int] = []
    # A lone row's verify window in plain rounds as the policy prices it now:
    # [one-draft window, each further row] (GammaPolicy.window_price); empty
    # when no row drafts next round. One price for every row: it is the policy's.
    price: list[float] = []


# ---------------------------------------------------------------------------


def accept_window(drafts: list[int], targets: list[int]) -> tuple[int, list[int]]:
    """Sample-and-match on one window: ``(accepted, tokens to emit)``.

    ``targets[i]`` is the target's token after feeding ``[last, d1..di]``. A
    window the backend stopped early holds targets up to the first rejected
    draft only (``StepResult.stopped``); anything else short is an error.
    """
    k = 0
    while k < min(len(drafts), len(targets)) and drafts[k] == targets[k]:
        k += 1
    whole = len(targets) == len(drafts) + 1
    stopped = 0 < len(targets) <= len(drafts) and k == len(targets) - 1  # its last target rejects a draft
    if not (whole or stopped):
        raise ValueError(f"a window of {len(drafts)} drafts needs {len(drafts) + 1} target tokens, got {len(targets)}")
    return k, drafts[:k] + [targets[k]]


class VerifierCore:
    """The Verifier's logic, with no awaits."""

    def __init__(self, policy: GammaPolicy):
        self.policy = policy
        self.rows: dict[int, RowPolicy] = {}
        policy.live = self.rows  # the policy weighs a row's choice against the rest of the batch
        self.counters = SpecCounters()
        self.by_proposer: dict[str, SpecCounters] = {}  # the same counters per proposer (suffix+ngram: both)

    def verify(self, msg: Verify) -> Verified:
        self.policy.observe_costs([(c.gamma, c.step_s, c.rows, c.drafted, c.draft_s) for c in msg.costs])
        if msg.catch_up_tokens:
            self.policy.observe_catch_up(msg.catch_up_s, msg.catch_up_tokens)
        self.policy.rows_now = max(1, msg.rows)  # the batch now, not the one last costed
        verdicts, wake = [], False
        for w in msg.windows:
            verdicts.append(self._judge(w))
            wake = wake or (verdicts[-1].gamma_next > 0 and self.policy.together)
        judged = {w.rid for w in msg.windows}
        woken = []
        if wake:
            for rid, row in self.rows.items():
                held = row.gamma == 0 or row.watching
                if rid not in judged and held and row.fixed is None and not (row.off or row.retired):
                    row.woken = True
                    woken.append(rid)
        drafting = any(v.gamma_next > 0 for v in verdicts)
        return Verified(verdicts=verdicts, wake=woken, price=self.policy.window_price() if drafting else [])

    def _judge(self, w: Window) -> Verdict:
        row = self.rows.get(w.rid)
        if row is None:
            row = self.rows[w.rid] = self.policy.new_row(w.fixed_gamma, w.ns)
        row.left, row.behind = w.left, w.behind
        row.after_plain = len(w.targets) <= 1  # the step fed no drafts: the backend ran the next one ahead
        self.policy.stops = self.policy.stops or w.stopped
        self.counters.stopped += w.stopped
        if w.drafts and len(w.targets) == 1 and not w.stopped:
            # The backend decoded only `last`: this row's cache cannot take a window.
            row.off = True
            self.counters.fallbacks += 1
            log.info("[verifier] fallback rid=%d reason=untrimmable-cache", w.rid)
            return Verdict(rid=w.rid, accepted=0, tokens=list(w.targets), gamma_next=0, hold=1 << 30, fallback=True)
        k, tokens = accept_window(w.drafts, w.targets)
        self.counters.record(len(w.drafts), k)
        if w.drafts:
            self.by_proposer.setdefault(w.proposer or "unknown", SpecCounters()).record(len(w.drafts), k)
        if not row.watching:  # a watching row's empty rounds say nothing of its plain matches
            self.policy.observe_hits(row, w.empty, bool(w.drafts))
        if w.drafts:
            self.policy.observe_round(row, len(w.drafts), k)
            gamma, hold = self.policy.choose(row)
        elif row.gamma == 0 and row.consulted:
            gamma, hold = self.policy.after_hold(row)  # a plain row whose hold ran out
        else:
            gamma, hold = self.policy.choose(row)  # the row's first round
        row.gamma, row.consulted = gamma, True
        self.counters.gamma_chosen[gamma] = self.counters.gamma_chosen.get(gamma, 0) + 1
        return Verdict(
            rid=w.rid,
            accepted=k,
            tokens=tokens,
            gamma_next=gamma,
            hold=hold,
            min_match=self.policy.min_match(row),
            quorum=self.policy.quorum(row, gamma),
        )

    def forget(self, rids: list[int]) -> None:
        for rid in rids:
            self.rows.pop(rid, None)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters.as_dict(),
            "by_proposer": {name: c.spec_decode() for name, c in sorted(self.by_proposer.items())},
            "policy": self.policy.snapshot(),
            "rows": len(self.rows),
        }


class Verifier(Actor[Inbox]):
    name = "verifier"
    inbox_size = 256

    def __init__(self, core: VerifierCore):
        super().__init__()
        self.core = core

    async def receive(self, msg: Inbox) -> Any:
        match msg:
            case Verify():
                return self.core.verify(msg)
            case Forget():
                self.core.forget(msg.rids)
                return None
            case _:
                assert_never(msg)
