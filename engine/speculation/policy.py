"""Speculation policy and bookkeeping: how many tokens to draft, and what it paid.

The Verifier owns these. ``GammaPolicy`` picks γ (the number of draft tokens)
for each row's next round; ``SpecCounters`` keeps the engine-wide counters
under the names the ecosystem shares (vLLM, llama.cpp):
``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens``,
``spec_decode_num_accepted_tokens`` and the accepted count per draft position.

Adaptive γ
----------
A round with γ drafts yields ``E(γ) = 1 + Σ_{i≤γ} Π_{j≤i} a_j`` tokens on
average, where ``a_j`` is the probability that draft ``j`` is accepted given
that drafts ``1..j-1`` were (sample-and-match stops at the first mismatch, so
that conditional is exactly what each round observes). A round's cost is
measured from the start of its step to the start of the next — drafting, the
device step, the Verifier's answer and the emission included, and a plain
decode the backend ran ahead of time counted at its real per-token cost —
and modelled as ``C = base + per_row·rows + per_draft·drafts`` (drafts = all
the draft tokens the step fed). The policy picks the γ in ``0..gamma_max``
with the most tokens per second, ``E(γ) / C(γ)`` with every row of the
current batch assumed to draft γ: in a batch the windows share one forward,
so drafting deeper costs ``per_draft·rows`` per extra token — a full batch
already uses the device, and there speculation turns itself off. γ = 0 is
plain decode, ``E = 1``.

* ``a_j`` is a decayed count per request with the engine-wide estimate as
  one pseudo-observation (``observe_round``); a position the request never
  reached borrows the one before it. Alone, a row drafts at most twice as
  deep as it has had judged (a probe's single accepted draft says little
  about positions 2..6), or as deep as the engine's latest judged round
  reached, and before any of its own drafts were judged as deep as the
  engine-wide acceptance pays for; in a batch, any depth (there the jump, not
  the width, is the cost). "Engine-wide" here means the requests of the same
  cache namespace (``Learned``): one tenant's seeds never shape another's γ.
* The cost model (``engine.speculation.costs.RoundCosts``) prices each verify shape
  as a ratio to the plain rounds at the same batch size measured within a
  few rounds of it — the same load on both sides of the ratio — times the
  current plain round. A lone row that speculates every round decodes
  ``explore_rounds`` plainly when no plain round is recent enough to compare
  with. Before any round with drafts was measured, a draft token is priced
  at ``slope_prior`` of a plain round, plus, for a draft model, its step
  over the target's (``draft_prior``, measured when the engine is built:
  ``ember.spec_build``); the γ just above the current choice is tried until
  it has a few samples, so the prices cover the γ it is choosing between.
* When γ = 0 wins, the request decodes plainly for ``hold`` rounds — without
  asking the Drafter or the Verifier anything — and then probes γ = 1 once to
  find out whether drafts started paying (the text may have become
  repetitive). Each probe that does not turn speculation back on doubles the
  hold, up to ``probe_max`` (a new request starts from the spacing the
  engine's latest probe verdict left, as its acceptance starts from the
  engine's); and the hold is never shorter than what keeps
  probing under ``probe_budget`` (2%) of the time, given what a verify round
  costs over a plain one at this batch size and that every row of the batch
  probes. A held row's draft model skips the tokens of its hold and feeds
  them all before the probe (the catch-up); that is priced too, per token as
  measured, so the hold grows with it, and where even the longest hold
  cannot keep probing within budget the row stops speculating for good
  (``retired``). The catch-up also decides whether a row starts drafting:
  a row not drafting starts (or probes) only when what its draft model must
  feed first (``Window.behind`` tokens: at a request's first draft the whole
  prompt) costs less than drafting could save over the tokens the request
  may still generate (``Window.left``); otherwise it is retired
  (``_catch_up_pays``). A lone row none of whose own drafts were judged yet holds
  only the engine's probe spacing before its first probe: its choice rests on
  other requests' prices and acceptance, and the budget's hold can outlast
  the request. A lone row that was drafting and stops (not a failed probe)
  decodes one round plainly and probes: on copied text rejections come in
  bursts, and the budget's hold after one departure took most of an edited
  file's request. A hold chosen alone is checked again when it runs out: in
  a batch (the first of four requests decodes before the others are
  admitted) the probe waits for the budget's spacing at that batch
  (``after_hold``). A row drafts only when the model promises ``margin`` (5%)
  more than plain decode.
* In a batch a row must also pay for the others: its γ is chosen for the
  most tokens per second of the whole batch, the other rows drafting as they
  do now (their acceptance, and how often their drafter proposes anything),
  and it decodes plainly when the batch as a whole would be faster with
  nobody drafting — otherwise every row, seeing the verify round already paid
  for by the others, keeps drafting and all are worse off.

* With prompt lookup (``watch_match``), a row the budget would hold in a
  batch watches instead (``_watch``): it asks for ``gamma_max`` drafts every
  step, proposed only on a match that agrees with its context for
  ``watch_match`` tokens, and a step verifies only when as many rows propose
  as their quorum asks (``quorum``: the verify round's jump is paid by all
  rows); in a batch the agreement gate stays after a row's first acceptance.

Under batching the choice is a heuristic: rows differ in acceptance, and each
row chooses as if the others drafted like it. A fixed γ (``EngineConfig.num_draft_tokens`` or the request's
``num_draft_tokens``) bypasses all of this.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.limits import MAX_DRAFT_TOKENS
from engine.speculation.costs import RoundCosts

ADAPTIVE_GAMMA_MAX = 6
# Agreement (NgramIndex.agreement) on which a watching row drafts: SmolLM2's
# prompt-lookup matches of 8+ tokens accepted their first draft 97–98% of the
# time, those of 2–4 tokens 0–8% (bench.spec.agreement).
WATCH_MATCH = 8


# Namespaces whose learned seeds are kept (least recently seen dropped first): a
# namespace dropped starts again from the priors, as a fresh engine does.
MAX_NAMESPACES = 256
# Acceptance per draft position before any round is judged, where nothing was
# measured (a draft model's own agreement replaces it: ember.spec_build.accept_prior).
ACCEPT_PRIOR = 0.5


@dataclass(slots=True)
class Learned:
    """What the policy learns across requests and seeds new rows with, kept per
    cache namespace (``ns``: the request's key scope, docs/http.md "Keys that
    isolate"): a request's first windows are shaped by the acceptance of earlier
    requests' text, so a tenant's γ (and so its decode speed) must not say
    whether another tenant's text copied. The round costs stay engine-wide: they
    measure the device, not anyone's text."""

    accept: list[float]  # acceptance per position, seeds new rows
    watch_accept: list[float]  # of drafts proposed by watching rows (GammaPolicy.quorum)
    probe_seed: int  # the probe spacing the latest probe verdict left
    depth_seed: int = 0  # positions the latest judged round reached


@dataclass(slots=True)
class RowPolicy:
    """One request's speculation state inside the Verifier."""

    fixed: int | None
    accept: list[float]  # conditional acceptance per draft position (estimate, see observe_round)
    seen: list[int] = field(default_factory=list)  # rounds that judged each position
    judged: list[float] = field(default_factory=list)  # decayed count of rounds that judged each position
    hits: list[float] = field(default_factory=list)  # decayed count of those that accepted it
    gamma: int = 0
    consulted: bool = False  # has the Verifier chosen a γ for it yet?
    probe_every: int = 4
    probing: bool = False
    exploring: bool = False  # decoding one round plainly to measure its cost
    hit: float = 1.0  # how often its drafter had something to propose (prompt lookup may not)
    off: bool = False  # the row's cache cannot be trimmed: plain decode from now on
    retired: bool = False  # probing cannot pay for itself here: plain decode from now on
    depth_seed: int = 0  # positions the engine's latest judged round reached when this row began
    woken: bool = False  # another row chose to draft on condition that all do: choose, do not probe
    accepted_any: bool = False  # has any of its own drafts been accepted?
    watching: bool = False  # held in a batch: drafts γ_max only on a strong prompt-lookup match (watch_match)
    learned: Learned | None = None  # its namespace's seeds, which its rounds teach (GammaPolicy.new_row)
    left: int | None = None  # tokens the request may still generate (None: not told, no catch-up gate)
    behind: int = 0  # context tokens its drafter was not sent: a draft model catches up on them first
    held: int = 0  # plain rounds of its current hold (choose): after_hold checks them against the batch now
    # Its latest round fed no drafts (a plain step, or a window stopped at its
    # first draft): the backend ran the next step ahead, and a window there is
    # fed past its first draft only if the target accepts that (GammaPolicy.stops).
    after_plain: bool = False


class GammaPolicy:
    def __init__(
        self,
        *,
        fixed: int | None = None,
        gamma_max: int = ADAPTIVE_GAMMA_MAX,
        accept_prior: float = ACCEPT_PRIOR,
        accept_alpha: float = 0.15,
        cost_window: int = 32,
        min_samples: int = 4,
        slope_prior: float = 0.1,
        probe_first: int = 4,
        probe_max: int = 64,
        probe_budget: float = 0.02,
        probe_cap: int = 512,
        margin: float = 0.05,
        explore_rounds: int = 3,
        first_match: int = 4,
        watch_match: int | None = None,
        draft_prior: float = 0.0,
        catch_up_prior: float = 0.0,
        free_drafts: bool = False,
    ):
        if fixed is not None and not 0 <= fixed <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {fixed}")
        self.fixed = fixed
        self.gamma_max = gamma_max
        self.accept_alpha = accept_alpha
        self.cost_window = cost_window  # rounds kept per (rows, drafts) shape
        self.min_samples = min_samples
        self.slope_prior = slope_prior
        self.probe_first = probe_first
        self.probe_max = probe_max
        self.probe_budget = probe_budget
        self.probe_cap = probe_cap
        self.margin = margin  # drafting must promise this much more than plain decode
        # Plain rounds decoded in a row when no recent plain round anchors the
        # verify rounds' prices (engine.speculation.costs): a median of three is not
        # thrown by one slow round.
        self.explore_rounds = explore_rounds
        # Until one of its own drafts is accepted, a request drafts only on a
        # prompt-lookup match that agrees with its context for this many tokens
        # (min_match): see there.
        self.first_match = first_match
        # A drafter that costs nothing per step (prompt lookup) can watch a
        # held row in a batch instead of probing it: see ``_watch``.
        self.watch_match = watch_match
        # The prior acceptance per position of the drafts watching rows propose
        # (on matches of watch_match tokens): 97–98% for the first draft
        # measured on SmolLM2, so 0.9 a position.
        self.watch_prior = 0.9
        self.accept_prior = accept_prior
        # What the requests so far taught, per cache namespace (``Learned``):
        # acceptance per position (seeds new rows); the probe spacing the latest
        # probe verdict left, so a new request starts with it instead of
        # re-learning it (on a drafter the target rejects, 5 probes per
        # 160-token request instead of 2); and the positions the latest judged
        # round reached (all of them when it accepted everything, else up to
        # the first rejection): a new request may draft that deep from its
        # first round (a 64-token request that deepened one position per round
        # from γ = 1 spent a third of its rounds ramping up on text that
        # accepted six drafts a round).
        self.learned_by_ns: OrderedDict[str, Learned] = OrderedDict()
        # Per shape, not one window over all rounds: in a batch a verify round is
        # rare (a probe every ~100 plain rounds), and a shared window of recent
        # rounds let the plain ones push it out before it could be used, so a
        # 4-row verify was priced from 1-row rounds for good (docs/bench/adaptive.md).
        self.costs = RoundCosts(window=cost_window, slope_prior=slope_prior, draft_prior=draft_prior)
        # A draft model's catch-up per token, in one-row plain rounds, until one
        # is measured (``catch_up_token_s``); 0 for drafters that run no model.
        self.catch_up_prior = catch_up_prior
        self._draft_s: deque[float] = deque(maxlen=64)  # per drafted token, for the stats
        # Seconds per token of a draft model's catch-up (feeding a lagging cache):
        # a held row skips its drafter for ``hold`` tokens and pays them all
        # before its probe, so a probe costs its verify round plus hold × this.
        self._catch_up: deque[float] = deque(maxlen=16)
        self.retired = 0  # rows switched off because probing (or catching up) could not pay
        self.gain = 1.0  # the latest best(): its γ's tokens per second over plain decode's
        self.rows_now = 1  # rows in the latest step
        self.together = False  # the latest choice counts on every row of the batch drafting
        self.live: dict[int, RowPolicy] = {}  # every speculating row (the Verifier's table)
        # The backend stops a window at its rejected first draft where a step
        # it ran ahead is the window's first position (StepResult.stopped; the
        # MLX backend): seen once, a lone row's window after a plain round is
        # priced as a plain round unless its first draft is accepted.
        self.stops = False
        # Drafting costs nothing a round (prompt lookup, suffix decoding): a
        # stopped window's round is then a plain one. A draft model has run its
        # γ steps whether or not the first draft is accepted, so for it a
        # window is priced whole.
        self.free_drafts = free_drafts

    # ---- what requests taught, per namespace --------------------------------
    def learned(self, ns: str = "") -> Learned:
        """The seeds of namespace ``ns`` (made from the priors on first use)."""
        got = self.learned_by_ns.get(ns)
        if got is None:
            got = self.learned_by_ns[ns] = Learned(
                accept=[self.accept_prior] * self.gamma_max,
                watch_accept=[self.watch_prior] * self.gamma_max,
                probe_seed=self.probe_first,
            )
            while len(self.learned_by_ns) > MAX_NAMESPACES:
                self.learned_by_ns.popitem(last=False)
        else:
            self.learned_by_ns.move_to_end(ns)
        return got

    # The empty namespace's seeds under their old names (a server without keys
    # has only that one; tests and stats read them).
    @property
    def accept(self) -> list[float]:
        return self.learned().accept

    @accept.setter
    def accept(self, value: list[float]) -> None:
        self.learned().accept = value

    @property
    def watch_accept(self) -> list[float]:
        return self.learned().watch_accept

    @property
    def probe_seed(self) -> int:
        return self.learned().probe_seed

    @property
    def depth_seed(self) -> int:
        return self.learned().depth_seed

    @depth_seed.setter
    def depth_seed(self, value: int) -> None:
        self.learned().depth_seed = value

    # ---- rows ------------------------------------------------------------
    def new_row(self, fixed: int | None, ns: str = "") -> RowPolicy:
        """A row of cache namespace ``ns``: seeded from, and teaching, that namespace only."""
        if fixed is not None and not 0 <= fixed <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {fixed}")
        fixed = fixed if fixed is not None else self.fixed
        seeds = self.learned(ns)
        return RowPolicy(
            fixed=fixed,
            accept=list(seeds.accept),
            seen=[0] * self.gamma_max,
            probe_every=seeds.probe_seed,
            depth_seed=seeds.depth_seed,
            learned=seeds,
        )

    def _seeds(self, row: RowPolicy) -> Learned:
        return row.learned if row.learned is not None else self.learned()

    def observe_round(self, row: RowPolicy, drafted: int, accepted: int) -> None:
        """A round drafted ``drafted`` tokens and the first ``accepted`` matched.

        Acceptance per position is a decayed count with the engine's estimate
        as one pseudo-observation, ``(hits + g) / (judged + 1)``: one judged
        round already moves it most of the way (a moving average from the prior
        needed ~10 rounds, and a batch row that probes once per ~100 rounds
        never learned that its text accepts six in a row), and it forgets at
        ``accept_alpha`` per round like the moving average it replaces."""
        evaluated = min(drafted, accepted + 1)  # positions past the first mismatch were never judged
        seeds = self._seeds(row)
        if row.watching:
            w = seeds.watch_accept
            for j in range(min(evaluated, self.gamma_max)):
                w[j] += self.accept_alpha * ((1.0 if j < accepted else 0.0) - w[j])
        row.accepted_any = row.accepted_any or accepted > 0
        if accepted < drafted:  # a rejection says how deep the text goes now
            seeds.depth_seed = evaluated
        else:  # all accepted: at least this deep (a request's last rounds draft fewer, cut by max_tokens)
            seeds.depth_seed = max(seeds.depth_seed, drafted)
        a, g = self.accept_alpha, seeds.accept
        if not row.judged:
            row.judged, row.hits = [0.0] * self.gamma_max, [0.0] * self.gamma_max
        for j in range(min(evaluated, self.gamma_max)):
            hit = 1.0 if j < accepted else 0.0
            row.seen[j] += 1
            row.judged[j] = (1 - a) * row.judged[j] + 1.0
            row.hits[j] = (1 - a) * row.hits[j] + hit
            g[j] += a * 0.2 * (hit - g[j])  # slower: it summarises many requests
            row.accept[j] = (row.hits[j] + g[j]) / (row.judged[j] + 1.0)
        for j in range(drafted, self.gamma_max):
            # Not drafted this round: what was learned there ages toward the
            # engine's estimate, or two early rejections at position 4 would
            # keep a row at γ = 3 for good (it never drafts there again).
            row.judged[j] *= 1 - a
            row.hits[j] *= 1 - a
            row.accept[j] = (row.hits[j] + g[j]) / (row.judged[j] + 1.0)

    # ---- costs -----------------------------------------------------------
    def observe_cost(self, gamma: int, step_s: float, rows: int, drafted_tokens: int, draft_s: float) -> None:
        """A round of ``rows`` rows that fed ``drafted_tokens`` drafts in all
        (its longest window had ``gamma``) took ``step_s`` start to start, of
        which drafting took ``draft_s``."""
        self.observe_costs([(gamma, step_s, rows, drafted_tokens, draft_s)])

    def observe_costs(self, rounds: list[tuple[int, float, int, int, float]]) -> None:
        """Rounds ``(gamma, step_s, rows, drafted_tokens, draft_s)`` measured in
        one stretch of time: verify rounds are priced against the plain rounds
        among them (``engine.speculation.costs``)."""
        if not rounds:
            return
        self.rows_now = max(1, rounds[-1][2])
        self.costs.observe_many([(r, d, s) for _, s, r, d, _ in rounds])
        for _, _, _, d, d_s in rounds:
            if d > 0 and d_s >= 0:
                self._draft_s.append(d_s / d)

    def observe_catch_up(self, seconds: float, tokens: int) -> None:
        """A draft model fed ``tokens`` context tokens it had skipped, in ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self._catch_up.append(seconds / tokens)

    @property
    def catch_up_token_s(self) -> float:
        """Median seconds per caught-up token (0: nothing to catch up, as prompt
        lookup); before one is measured, the prior in one-row plain rounds
        (``catch_up_prior``, measured at engine start for a draft model): a
        fresh engine's first request otherwise started drafting behind a
        catch-up of its whole prompt priced at nothing."""
        if self._catch_up:
            return float(np.median(self._catch_up))
        return self.catch_up_prior * self.costs.plain(1) if self.catch_up_prior > 0 else 0.0

    @property
    def draft_token_s(self) -> float | None:
        return float(np.median(self._draft_s)) if self._draft_s else None

    def round_cost(self, gamma: int, rows: int | None = None) -> float:
        """Seconds of a round in which each of ``rows`` rows drafts γ tokens.

        Rows of a batch are assumed alike: in a batch the verify windows of
        all rows share one forward, so the cost of drafting deeper grows with
        the batch — a batch already fills the device, and speculation there
        can only lose (the per-row choice would not see that if each row
        priced its window alone)."""
        b = self.rows_now if rows is None else rows
        return self._cost(b, b * gamma)

    def window_price(self) -> list[float]:
        """A lone row's verify window over a plain round: one draft, and each
        draft after it (the measured line at one row; the prior before it)."""
        first = self.costs.ratio(1, 1)
        return [round(first, 4), round(max(0.0, self.costs.ratio(1, 2) - first), 4)]

    def measured(self, drafts: int) -> bool:
        """Enough rounds at this batch size with this many draft tokens in all
        that one unlucky round cannot rule it out for good; for plain rounds
        (``drafts`` 0), recent enough to be a fair reference for the verify
        rounds measured against them."""
        b = self.rows_now
        if drafts <= 0:
            return self.costs.fresh(b) and self.costs.samples(b, 0) >= min(self.min_samples, self.explore_rounds)
        return self.costs.samples(b, drafts) >= self.min_samples and not self.costs.stale(b, drafts)

    # ---- choice ----------------------------------------------------------
    @staticmethod
    def expected_tokens(accept: list[float], gamma: int) -> float:
        total, run = 1.0, 1.0
        for j in range(gamma):
            run *= accept[j]
            total += run
        return total

    @staticmethod
    def effective_accept(row: RowPolicy) -> list[float]:
        """Acceptance per position; a position this request never reached
        borrows the one before it, so a request that accepts everything at
        γ = 1 is expected to keep accepting deeper, and gets to find out."""
        out = list(row.accept)
        for j in range(1, len(out)):
            if not row.seen[j] and row.seen[j - 1]:
                out[j] = out[j - 1]
            elif not row.seen[j]:
                out[j] = min(out[j], out[j - 1])
        return out

    def _cost(self, rows: int, drafts: float) -> float:
        """A round of ``rows`` rows feeding ``drafts`` draft tokens in all:
        the plain round measured now at this size times what such a round
        was measured to cost over the plain rounds next to it."""
        return self.costs.cost(rows, drafts)

    def observe_hits(self, row: RowPolicy, empty: int, hit: bool) -> None:
        """``empty`` rounds at γ > 0 in which the drafter had nothing to propose
        (prompt lookup without a match), then one with drafts if ``hit``."""
        a = self.accept_alpha
        for _ in range(min(empty, 64)):
            row.hit -= a * row.hit
        if hit:
            row.hit += a * (1.0 - row.hit)

    def best(self, row: RowPolicy) -> int:
        """The γ with the most tokens per second for the whole batch, the other
        rows drafting as they do now: in a batch the verify round's jump in
        cost is paid by every row, so one row's drafts must pay for all of them."""
        b = self.rows_now
        others = [r for r in self.live.values() if r is not row and not r.off][: max(0, b - 1)]
        tokens = float(max(0, b - 1 - len(others)))  # rows that do not speculate: one token each
        drafts, p_none = 0.0, 1.0
        for o in others:
            if o.gamma <= 0 or o.watching:  # a watching row drafts only on a strong match: rarely
                tokens += 1.0
                continue
            tokens += o.hit * self.expected_tokens(self.effective_accept(o), o.gamma) + (1.0 - o.hit)
            drafts += o.hit * o.gamma
            p_none *= 1.0 - o.hit
        base = p_none * self._cost(b, 0) + (1.0 - p_none) * self._cost(b, drafts)
        accept = self.effective_accept(row)
        rates = [(tokens + 1.0) / base]
        self.gain = 1.0
        # One position past the deepest this request has had judged: a probe's
        # single accepted draft says nothing about positions 2..6, and jumping
        # to γ = 6 on it (6 draft-model steps and a 7-token verify, in a batch
        # for every row) was most of what adaptive γ lost where drafting does
        # not pay (docs/bench/adaptive.md). A row that keeps accepting doubles
        # the depth it has had judged per round (1, 2, 4, 6), and a new row may
        # start as deep as the engine's latest judged round reached.
        reach = next((j for j, n in enumerate(row.seen) if n == 0), self.gamma_max)
        # Nothing of this request judged yet: its first window may go as deep
        # as the engine-wide acceptance pays for. The latest judged round
        # (depth_seed) is another request's text: after a chat answer it
        # started a 48-token copy at γ = 1, and the ramp 1, 2, 4, 6 took a
        # fifth of its rounds (0.80 of fixed γ = 6 on the mixed-workload
        # fake machine, 0.96 with this). A deep first window on text that
        # does not copy costs one verify round's few extra draft tokens.
        # In a batch the jump, not the width, is what a verify round costs (probe_gamma).
        if reach == 0 or b > 1:
            deepest = self.gamma_max
        else:
            deepest = max(reach + 1, 2 * reach, row.depth_seed)
        # Rows that do not speculate at all (other engines' settings) give one token each.
        idle = float(max(0, b - 1 - len(others)))
        shape = [0]  # draft tokens in all, per γ, of the option that won
        jointly = [False]  # whether that option was every row drafting
        self.together = False
        # A lone row's window after a plain round costs its drafts' forward only
        # when its first draft is accepted (``stops``): on text the drafter
        # does not predict, the round is the plain step the backend ran ahead.
        # Deeper windows then pay from the second draft on (γ = 1 gives at best
        # two tokens for two forwards, as plain decode does).
        first = accept[0] if b == 1 and self.stops and self.free_drafts and row.after_plain else 1.0
        for g in range(1, min(self.gamma_max, deepest) + 1):
            mine = row.hit * self.expected_tokens(accept, g) + (1.0 - row.hit)
            window = first * self._cost(b, drafts + g) + (1.0 - first) * base
            cost = row.hit * window + (1.0 - row.hit) * base
            alone = (tokens + mine) / cost
            # Together: every speculating row drafts g. In a batch the verify
            # round's jump is paid once for all rows, so no row alone may pay
            # for it while all of them drafting would (a batch of four that
            # accepts 90%: 0.9× alone at γ = 1, 1.9× all at γ = 6); each row
            # sees the same numbers and makes the same choice.
            all_tokens = (
                idle
                + mine
                + sum(o.hit * self.expected_tokens(self.effective_accept(o), g) + (1.0 - o.hit) for o in others)
            )
            all_drafts = row.hit * g + sum(o.hit * g for o in others)
            together = all_tokens / self._cost(b, all_drafts) if others else 0.0
            rates.append(max(alone, together))
            shape.append(round(drafts) + g if alone >= together else round(all_drafts))
            jointly.append(together > alone)
        # Within the model's error of plain decode a verify round is not worth
        # starting; a row already drafting keeps on until drafting is clearly
        # worse (the same margin the other way), so that a few unlucky rounds
        # do not send it into a hold whose probes then cost more than the gain.
        keep = 1 + (-self.margin if row.gamma > 0 and not row.watching else self.margin)
        if max(rates[1:]) < rates[0] * keep:
            return 0
        if max(rates[1:]) < keep * b / self._cost(b, 0):
            # The batch would do better with nobody drafting. Each row alone can
            # still gain once the others' drafts have paid for the verify round,
            # so without this every row keeps drafting, all worse off together.
            return 0
        best = max(range(1, len(rates)), key=lambda g: (rates[g], -g))
        self.gain = rates[best] / rates[0]
        self.together = jointly[best]  # the Verifier wakes the held rows: they pay only if all draft
        nxt = best + 1
        if best > 0 and nxt < len(rates) and not self.measured(shape[nxt]):
            return nxt  # measure the next γ; it may be cheaper than estimated
        return best

    def min_match(self, row: RowPolicy) -> int:
        """The agreement prompt lookup's match must have before this row drafts.

        A request none of whose own drafts was accepted yet chooses γ on other
        requests' acceptance and prices: after a copy, a chat answer's first
        window went 6 deep and was rejected, and its probe after that was a
        second isolated verify round (each ~2.4 plain rounds on CPU, where the
        backend ran the plain step ahead): 0.935× plain decode on chat. Only
        its own text can say whether it copies, and prompt lookup's agreement
        says it before any draft is judged: a chance 2-gram in free text
        agrees for 2–3 tokens, a quoted line or a returned file for as long as
        the copy has run. So until a draft of its own is accepted a row drafts
        only on ``first_match`` tokens of agreement; a copy then starts a few
        tokens later, and chat rarely verifies at all. A fixed γ is the
        request's or the operator's choice and is not gated; a draft model
        ignores the gate (its drafts do not come from the context).

        In a batch (with a watching drafter) the gate stays after acceptance:
        there a window the text has already left (a copy's run ended, the
        pointer still on its source) costs every row the verify round's jump,
        and on the agent workload at batch 4 a quarter of the windows were
        such, rejected at their first draft (tests/ember/test_spec_watch.py).
        A watching row drafts only on ``watch_match`` (``_watch``)."""
        if row.fixed is not None:
            return 0
        if row.watching and self.watch_match is not None:
            return max(self.watch_match, self.first_match)
        if row.accepted_any and (self.rows_now <= 1 or self.watch_match is None):
            return 0
        return self.first_match

    def _explore_plain(self, row: RowPolicy) -> bool:
        """Rows that speculate from their first round never show what a plain
        round costs at this batch size, and the fit then has no anchor: every
        row of the batch sees the same gap and decodes one round plainly."""
        if self.measured(0) or row.exploring:
            return False
        row.exploring = True
        return True

    def choose(self, row: RowPolicy) -> tuple[int, int]:
        """``(γ, hold)`` for the row's next round: γ = 0 is plain decode, and
        ``hold`` is how many rounds to stay plain before asking again."""
        gamma, hold = self._choose(row)
        row.held = hold if gamma == 0 else 0
        return gamma, hold

    def _choose(self, row: RowPolicy) -> tuple[int, int]:
        self.together = False
        if row.off or row.retired:
            return 0, 1 << 30
        if row.fixed is not None:
            return row.fixed, (1 << 30 if row.fixed == 0 else 0)
        g = self.best(row)
        leaving = row.gamma > 0 and not (row.probing or row.watching)  # was drafting (see below)
        row.watching = False
        if row.probing:  # the probe round just ran: keep its verdict
            row.probing = False
            row.probe_every = self.probe_first if g > 0 else min(self.probe_max, row.probe_every * 2)
            self._seeds(row).probe_seed = row.probe_every
        if g > 0 and row.gamma == 0 and not self._catch_up_pays(row, self.gain):
            return self._retire(row)
        if g > 0:
            return (0, self.explore_rounds) if self._explore_plain(row) else (g, 0)
        spacing = self._probe_spacing()
        if spacing is None:
            # Every probe would cost more than the budget however far apart:
            # the drafter's catch-up over the skipped tokens alone exceeds it.
            return self._retire(row)
        if self.rows_now <= 1 and not row.seen[0]:
            # A lone row none of whose own drafts were judged yet chose on the
            # engine's past alone: prices and acceptance that other requests
            # (other text) measured. Its first probe comes after the engine's
            # probe spacing, not after the budget's: priced from a few slow
            # verify rounds, the budget held a 48-token copy request for 95
            # rounds, so it never drafted (tests/ember/test_spec_first_hold.py).
            # Alone a probe costs less than one extra plain round; in a batch
            # every new row probing early would cost the whole batch, so there
            # the budget rules.
            return 0, row.probe_every
        if leaving and self.rows_now <= 1:
            # A lone row stopped drafting on its own recent acceptance, which
            # paid until now: on copied text a rejection comes in bursts (the
            # text departs from its source for a token or two, then copies
            # again), so it decodes one round plainly and probes, instead of
            # holding for the budget's spacing (~30 rounds for a lone row whose
            # verify round costs ~1.6× a plain one). On an edited file that
            # hold took most of a 48-token request: 1.55 tokens per target call
            # against 2.67 at fixed γ = 4 (tests/ember/test_spec_bursty.py).
            # If the probe fails the spacing doubles and the budget rules; in
            # a batch the budget always rules (every row's probe costs the batch).
            return 0, 1
        if self._watch():
            row.watching = True
            return self.gamma_max, 0
        return 0, max(row.probe_every, spacing)

    def _retire(self, row: RowPolicy) -> tuple[int, int]:
        """Plain decode for the rest of the request, the Drafter asked nothing more."""
        row.retired = True
        self.retired += 1
        return 0, 1 << 30

    def _catch_up_pays(self, row: RowPolicy, gain: float) -> bool:
        """Whether drafting at ``gain`` (tokens per second over plain decode)
        can win back, over the tokens the request may still generate, what its
        draft model must first feed: every context token it was not sent
        (``row.behind``: at a request's first draft the whole prompt, after a
        hold the tokens held), at ``catch_up_token_s`` each, while the batch
        waits. Drafting saves at most ``left · plain · (1 − 1/gain)``. The
        round prices leave the catch-up out (it is not a cost of every round:
        ``SpecRounds.note_step``), so without this a 48-token answer after a
        1000-token prompt started drafting on a round price that paid, and the
        0.5B drafter's prefill of the prompt cost more than its drafts could
        save: 0.47–0.70× plain on the 1.5B (docs/bench/spec-real.md). If it
        cannot pay now it never will: the budget only shrinks and the lag only
        grows. A drafter that needs no catch-up (prompt lookup, suffix
        decoding: 0 s per token) always passes."""
        catch_up = row.behind * self.catch_up_token_s
        if catch_up <= 0 or row.left is None:
            return True
        return catch_up < row.left * self._cost(self.rows_now, 0) * (1.0 - 1.0 / max(gain, 1.0))

    def _gain_bound(self) -> float:
        """The most any γ could gain over plain decode at this batch size, every
        draft accepted: what a probe could at best find."""
        b = self.rows_now
        plain = self._cost(b, 0)
        return max((g + 1) * plain / self._cost(b, g) for g in range(1, self.gamma_max + 1))

    def quorum(self, row: RowPolicy, gamma: int) -> int:
        """Rows of this batch, drafting like this one, that must propose in the
        same step for its verify round to pay when no fixed-γ row drafts in it:
        ``n`` windows of γ at this row's acceptance (a watching row's: the
        watched acceptance) and one token from each other row, against the
        verify round's price over a plain one, the margin included. In a batch
        the jump is paid by every row: a lone window of a short copy cost the
        others more than it gained (0.72× plain on the agent workload at batch 8,
        tests/ember/test_spec_watch.py), and rows drafting on their own clocks
        paid the jump in many steps that all of them drafting would have paid
        once. A step verifies only when its drafting rows meet the largest
        quorum among them (``SpecRounds._quorum``). 0 (no quorum): alone, a
        fixed γ, or a drafter that does not watch; ``rows + 1``: no number pays."""
        b = self.rows_now
        if b <= 1 or gamma <= 0 or row.fixed is not None or self.watch_match is None:
            return 0  # a draft model's probes must reach the Verifier to be judged at all
        plain = self._cost(b, 0)
        e = self.expected_tokens(self._seeds(row).watch_accept if row.watching else self.effective_accept(row), gamma)
        for n in range(1, b + 1):
            if n * e + (b - n) >= (1 + self.margin) * b * self._cost(b, n * gamma) / plain:
                return n
        return b + 1

    def _watch(self) -> bool:
        """Watch a held row of a batch instead of holding it for a probe.

        In a batch every probe turns a round of all rows into a verify round
        (four rows on CPU: ~2.5 plain rounds), so the budget spaces a row's
        probes ~300 rounds apart, and a 48-token request never learns that its
        text copies: on copy at batch 4 and 8 adaptive γ drafted in about one
        round a request and measured 0.92–0.96× plain decode (three rounds,
        docs/bench/spec-default.md). Where the drafter costs nothing per step,
        a held row keeps asking it for ``gamma_max`` drafts but proposes only on
        a match that agrees with its context for ``watch_match`` tokens; a
        chance match in free text agrees for 2–4 and a copy for as long as it
        has run, and SmolLM2's matches of 8+ tokens accepted their first draft
        97–98% of the time (bench.spec.agreement). A round with no such match
        is a plain round at no cost beyond the lookup; one with a match is the
        probe, paid only where the text copies, and its verdict chooses as any
        round's does (all rows together, waking the others, when together
        pays). A lone row keeps its probes: one costs it ~1.3 plain rounds."""
        return self.watch_match is not None and self.rows_now > 1

    def _probe_spacing(self) -> int | None:
        """Plain rounds between a row's probes so that probing costs at most
        ``probe_budget`` of the time, or None when no spacing can. A probe
        turns one round of the whole batch into a verify round (a batch of
        four on CPU: ~2.5 plain rounds; one row alone: ~1.3), each of the
        batch's rows probes, and before its probe a row's draft model catches
        up on the ``H`` tokens it skipped (``catch_up_token_s`` each, while the
        batch waits). Over ``H`` plain rounds that is
        ``b·(jump + c·H) ≤ budget·H·plain``, so ``H ≥ b·jump / (budget·plain − b·c)``:
        the catch-up grows with the hold as fast as the budget does, and when
        ``b·c ≥ budget·plain`` no hold is long enough."""
        b = self.rows_now
        plain = self._cost(b, 0)
        jump = max(0.0, self._cost(b, self.probe_gamma()) - plain)
        room = self.probe_budget * plain - b * self.catch_up_token_s
        if room <= 0:
            return None
        return min(self.probe_cap, max(1, math.ceil(b * jump / room - 1e-9)))

    def after_hold(self, row: RowPolicy) -> tuple[int, int]:
        """A held row's hold ran out: choose again after a plain exploration
        round, else draft once (γ = 1) to refresh its acceptance."""
        if row.exploring or row.woken:
            row.exploring = row.woken = False
            return self.choose(row)
        if row.off or row.retired or row.fixed is not None:
            return self.choose(row)
        if not self._catch_up_pays(row, self._gain_bound()):
            # The probe would make the draft model catch up first (for a row
            # that never drafted: the whole prompt), and not even drafts all
            # accepted could win that back over what the request has left.
            return self._retire(row)
        if self.rows_now > 1 and not self._watch():
            # In a batch the budget rules, at the batch the probe would run
            # in: a hold chosen while the row was alone (the first of four
            # requests arriving together decodes its first token before the
            # others are admitted) is a lone row's (the engine's probe
            # spacing, 4 rounds), and its probe then turned a round of all
            # four into a verify round behind γ_max draft-model steps and the
            # prompt's catch-up: 0.93x plain decode at batch 4 on the fake
            # GPU (tests/ember/test_spec_batch_draft.py). Hold the rest of
            # the budget's spacing here, or stop where no spacing can pay.
            spacing = self._probe_spacing()
            if spacing is None:
                return self._retire(row)
            if row.held < spacing:
                more, row.held = spacing - row.held, spacing
                return 0, more
        row.probing = True
        return self.probe_gamma(), 0

    def probe_gamma(self) -> int:
        """A probe drafts one token alone; in a batch it drafts ``gamma_max``:
        there the verify round's jump, not its width, is what a probe costs
        (a 4-row round with 4 drafts 2.1× a plain one, with 24 drafts 2.3×),
        and a probe of one position never shows the batch that the text
        accepts six in a row — the rows then never learn that drafting
        together would pay."""
        return 1 if self.rows_now <= 1 else self.gamma_max

    def snapshot(self) -> dict[str, Any]:
        return {
            "mode": "fixed" if self.fixed is not None else "adaptive",
            "fixed_gamma": self.fixed,
            "gamma_max": self.gamma_max if self.fixed is None else self.fixed,
            "acceptance_prior_per_pos": [round(a, 4) for a in self.accept],
            **self.costs.snapshot(),
            "round_s_fit": {
                "plain_1": round(self.costs.plain(1), 6),
                "verify_1x1": round(self.costs.ratio(1, 1), 4),
                "per_draft_1": round(self.costs.ratio(1, 2) - self.costs.ratio(1, 1), 4),
            },
            "draft_token_s": None if self.draft_token_s is None else round(self.draft_token_s, 6),
            "catch_up_token_s": round(self.catch_up_token_s, 7),
            # a draft model's step and caught-up token over the target's step, measured at start
            "draft_step_prior": round(self.costs.draft_prior, 4),
            "catch_up_prior": round(self.catch_up_prior, 5),
            "rows_retired": self.retired,
        }


@dataclass(slots=True)
class SpecCounters:
    """Engine-wide counters, named as vLLM / llama.cpp name them."""

    num_drafts: int = 0  # verify rounds that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    plain_rounds: int = 0  # speculating rows that decoded without drafts this round
    fallbacks: int = 0  # rows switched to plain decode because their cache cannot be trimmed
    stopped: int = 0  # windows the backend stopped at a rejected first draft: their drafts cost no forward
    gamma_chosen: dict[int, int] = field(default_factory=dict)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self.plain_rounds += 1
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.drafted_per_pos) < drafted:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for j in range(drafted):
            self.drafted_per_pos[j] += 1
            if j < accepted:
                self.accepted_per_pos[j] += 1

    def spec_decode(self) -> dict[str, Any]:
        """The vLLM-named counters alone (``/metrics`` labels them by proposer)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_num_draft_tokens_per_pos": list(self.drafted_per_pos),
        }

    def as_dict(self) -> dict[str, Any]:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        mean_len = 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_num_draft_tokens_per_pos": list(self.drafted_per_pos),
            "acceptance_rate": round(rate, 6),
            "mean_accept_len": round(mean_len, 6),
            "plain_rounds": self.plain_rounds,
            "fallbacks": self.fallbacks,
            "windows_stopped": self.stopped,
            "gamma_chosen": {str(g): n for g, n in sorted(self.gamma_chosen.items())},
        }
