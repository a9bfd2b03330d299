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

* ``a_j`` is a moving average per request (requests differ: a file being
  edited accepts far more than free text), seeded from an engine-wide moving
  average for the same drafter so a new request starts from experience; a
  position the request never reached borrows the one before it, and a row
  drafts at most one position past the deepest it has had judged, so it
  deepens one position per round instead of jumping to γ = 6 on one
  accepted probe draft.
* The cost model is fitted engine-wide (the device is shared) by least
  squares over the 25th percentile of the latest 32 rounds seen at each
  (rows, drafts) — not means, because a round slowed by another process on
  the machine, or by a late thread wakeup, must not swing the choice; and
  per shape, so a rare verify round in a batch is not pushed out by the
  plain rounds around it. Before any round with
  drafts was measured, a draft token is priced at ``slope_prior`` of a plain
  round; the γ just above the current choice is tried until it has a few
  samples, so the fit sees the γ it is choosing between.
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
  (``retired``). A row drafts only when the model promises ``margin`` (5%)
  more than plain decode.
* In a batch a row must also pay for the others: its γ is chosen for the
  most tokens per second of the whole batch, the other rows drafting as they
  do now (their acceptance, and how often their drafter proposes anything),
  and it decodes plainly when the batch as a whole would be faster with
  nobody drafting — otherwise every row, seeing the verify round already paid
  for by the others, keeps drafting and all are worse off.

Under batching the choice is a heuristic: rows differ in acceptance, and each
row chooses as if the others drafted like it. A fixed γ (``EngineConfig.num_draft_tokens`` or the request's
``num_draft_tokens``) bypasses all of this.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.limits import MAX_DRAFT_TOKENS

ADAPTIVE_GAMMA_MAX = 6


def low_quantile(samples: Iterable[float], q: float = 0.25) -> float:
    """A low quantile of recent timings. Interference only ever adds time
    (another process, a thread wakeup that came late), so the low end of the
    samples is the device's own cost; a median still moves when the machine
    is loaded for half the window."""
    xs = sorted(samples)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass(slots=True)
class RowPolicy:
    """One request's speculation state inside the Verifier."""

    fixed: int | None
    accept: list[float]  # conditional acceptance per draft position (moving average)
    seen: list[int] = field(default_factory=list)  # rounds that judged each position
    gamma: int = 0
    consulted: bool = False  # has the Verifier chosen a γ for it yet?
    probe_every: int = 4
    probing: bool = False
    exploring: bool = False  # decoding one round plainly to measure its cost
    hit: float = 1.0  # how often its drafter had something to propose (prompt lookup may not)
    off: bool = False  # the row's cache cannot be trimmed: plain decode from now on
    retired: bool = False  # probing cannot pay for itself here: plain decode from now on


class GammaPolicy:
    def __init__(
        self,
        *,
        fixed: int | None = None,
        gamma_max: int = ADAPTIVE_GAMMA_MAX,
        accept_prior: float = 0.5,
        accept_alpha: float = 0.15,
        cost_window: int = 32,
        min_samples: int = 4,
        slope_prior: float = 0.1,
        probe_first: int = 4,
        probe_max: int = 64,
        probe_budget: float = 0.02,
        probe_cap: int = 512,
        margin: float = 0.05,
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
        self.accept = [accept_prior] * gamma_max  # engine-wide, seeds new rows
        # Engine-wide too: the probe spacing the latest probe verdict left, so a
        # new request starts with it instead of re-learning it (on a drafter the
        # target rejects, 5 probes per 160-token request instead of 2).
        self.probe_seed = probe_first
        # Per shape, not one window over all rounds: in a batch a verify round is
        # rare (a probe every ~100 plain rounds), and a shared window of recent
        # rounds let the plain ones push it out before it could be used, so a
        # 4-row verify was priced from 1-row rounds for good (docs/bench/adaptive.md).
        self._samples: dict[tuple[int, int], deque[float]] = {}  # (rows, drafts) -> seconds
        self._draft_s: deque[float] = deque(maxlen=64)  # per drafted token, for the stats
        # Seconds per token of a draft model's catch-up (feeding a lagging cache):
        # a held row skips its drafter for ``hold`` tokens and pays them all
        # before its probe, so a probe costs its verify round plus hold × this.
        self._catch_up: deque[float] = deque(maxlen=16)
        self.retired = 0  # rows switched off because probing could not pay
        self._coef: tuple[tuple[float, float], tuple[float, float, float] | None] = ((1.0, 0.0), None)
        self._floor = 1e-9
        self._fit_due = False
        self._local: dict[int, tuple[float | None, Any]] = {}  # rows -> what was measured at that size
        self.rows_now = 1  # rows in the latest step
        self.live: dict[int, RowPolicy] = {}  # every speculating row (the Verifier's table)

    # ---- rows ------------------------------------------------------------
    def new_row(self, fixed: int | None) -> RowPolicy:
        if fixed is not None and not 0 <= fixed <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {fixed}")
        fixed = fixed if fixed is not None else self.fixed
        return RowPolicy(fixed=fixed, accept=list(self.accept), seen=[0] * self.gamma_max, probe_every=self.probe_seed)

    def observe_round(self, row: RowPolicy, drafted: int, accepted: int) -> None:
        """A round drafted ``drafted`` tokens and the first ``accepted`` matched."""
        evaluated = min(drafted, accepted + 1)  # positions past the first mismatch were never judged
        a, g = self.accept_alpha, self.accept
        for j in range(min(evaluated, self.gamma_max)):
            hit = 1.0 if j < accepted else 0.0
            row.seen[j] += 1
            row.accept[j] += a * (hit - row.accept[j])
            g[j] += a * 0.2 * (hit - g[j])  # slower: it summarises many requests

    # ---- costs -----------------------------------------------------------
    def observe_cost(self, gamma: int, step_s: float, rows: int, drafted_tokens: int, draft_s: float) -> None:
        """A round of ``rows`` rows that fed ``drafted_tokens`` drafts in all
        (its longest window had ``gamma``) took ``step_s`` start to start, of
        which drafting took ``draft_s``."""
        self.rows_now = max(1, rows)
        if step_s > 0:
            key = (max(1, rows), drafted_tokens)
            if key not in self._samples:
                self._samples[key] = deque(maxlen=self.cost_window)
            self._samples[key].append(step_s)
            self._fit_due = True
            self._local.clear()
        if drafted_tokens > 0 and draft_s >= 0:
            self._draft_s.append(draft_s / drafted_tokens)

    def observe_catch_up(self, seconds: float, tokens: int) -> None:
        """A draft model fed ``tokens`` context tokens it had skipped, in ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self._catch_up.append(seconds / tokens)

    @property
    def catch_up_token_s(self) -> float:
        """Median seconds per caught-up token (0: nothing to catch up, as prompt lookup)."""
        return float(np.median(self._catch_up)) if self._catch_up else 0.0

    @property
    def draft_token_s(self) -> float | None:
        return low_quantile(self._draft_s) if self._draft_s else None

    def _points(self) -> dict[tuple[int, int], float]:
        return {k: low_quantile(v) for k, v in self._samples.items() if v}

    @staticmethod
    def _lstsq(rows: np.ndarray, drafts: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
        """``(a, per_row, per_draft)``; a column that never varied is left out
        (its coefficient 0, its effect in ``a``). Negative slopes are noise: 0."""
        cols, names = [np.ones(len(y))], ["a"]
        if len(set(rows.tolist())) > 1:
            cols.append(rows)
            names.append("r")
        if len(set(drafts.tolist())) > 1:
            cols.append(drafts)
            names.append("d")
        while True:
            coef, *_ = np.linalg.lstsq(np.stack(cols, axis=1), y, rcond=None)
            got = dict(zip(names, (float(c) for c in coef)))
            bad = [i for i, n in enumerate(names) if n != "a" and got[n] < 0]
            if not bad:  # a negative slope is noise: drop that column and fit again
                return got["a"], got.get("r", 0.0), got.get("d", 0.0)
            del cols[bad[0]], names[bad[0]]

    def _fit(self) -> tuple[tuple[float, float], tuple[float, float, float] | None]:
        """Two linear models over the 25th percentile of the rounds seen at each
        (rows, drafts): plain rounds ``p0 + p1·rows``, and rounds with verify
        windows ``v0 + v1·rows + v2·drafts``. Two, because the first draft
        costs a jump, not a slope: a round with a verify window is never
        computed ahead (the backend pipelines plain decode only) and a batch
        with windows of different widths pays for the padding."""
        if not self._fit_due:
            return self._coef
        self._fit_due = False
        pts = self._points()
        plain = [(r, s) for (r, d), s in pts.items() if d == 0]
        spec = [(r, d, s) for (r, d), s in pts.items() if d > 0]
        if plain:
            a, per_row, _ = self._lstsq(
                np.array([r for r, _ in plain], float), np.zeros(len(plain)), np.array([s for _, s in plain])
            )
            p = (a, per_row)
        elif spec:  # no plain round measured yet: a prior below the cheapest verify round
            p = (min(s / (1 + self.slope_prior * d / r) for r, d, s in spec), 0.0)
        else:
            p = (1.0, 0.0)
        v = None
        if spec:
            r_, d_, s_ = (np.array(col, float) for col in zip(*spec))
            v = self._lstsq(r_, d_, s_)
            if len(set(d_.tolist())) == 1:  # one draft count seen: the prior's slope through it
                slope = self.slope_prior * p[0] / float(r_.mean())
                v = (v[0] - slope * float(d_[0]), v[1], slope)
        ys = list(pts.values())
        self._floor = 0.5 * min(ys) if ys else 1e-9  # a fit through noisy points must not promise free rounds
        self._coef = (p, v)
        return self._coef

    def round_cost(self, gamma: int, rows: int | None = None) -> float:
        """Seconds of a round in which each of ``rows`` rows drafts γ tokens.

        Rows of a batch are assumed alike: in a batch the verify windows of
        all rows share one forward, so the cost of drafting deeper grows with
        the batch — a batch already fills the device, and speculation there
        can only lose (the per-row choice would not see that if each row
        priced its window alone)."""
        b = self.rows_now if rows is None else rows
        return self._cost(b, b * gamma)

    def measured(self, drafts: int) -> bool:
        """Enough rounds at this batch size with this many draft tokens in all
        that one unlucky round cannot rule it out for good."""
        b = self.rows_now
        return len(self._samples.get((b, drafts), ())) >= self.min_samples

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
        from the rounds measured at this batch size when there are any (a plain
        round, and a line through the verify rounds), else from the fit across
        all sizes."""
        (p0, p1), v = self._fit()
        local = self._local.get(rows)
        if local is None:
            local = self._local[rows] = self._fit_at(rows)
        plain, line = local
        if plain is None:
            plain = p0 + p1 * rows
        if drafts <= 0:
            return max(self._floor, plain)
        if line is not None:
            v0, v2 = line
            if v2 is None:  # one draft count measured here: the global slope, or the prior's
                d0, s0 = v0
                v2 = v[2] if v is not None and v[2] > 0 else self.slope_prior * plain / rows
                v0 = s0 - v2 * d0
            return max(self._floor, v0 + v2 * drafts)
        if v is None:
            return max(self._floor, plain * (1 + self.slope_prior * drafts / rows))
        v0, v1, v2 = v
        return max(self._floor, v0 + v1 * rows + v2 * drafts)

    def _fit_at(self, rows: int) -> tuple[float | None, Any]:
        """``(plain, line)`` from the rounds measured with exactly ``rows`` rows:
        ``line`` is ``(v0, v2)``, or ``((d, s), None)`` with one draft count."""
        pts = {d: s for (r, d), s in self._points().items() if r == rows}
        plain = pts.get(0)
        spec = sorted((d, s) for d, s in pts.items() if d > 0)
        if not spec:
            return plain, None
        if len(spec) == 1:
            return plain, (spec[0], None)
        a, _, slope = self._lstsq(
            np.ones(len(spec)), np.array([d for d, _ in spec], float), np.array([s for _, s in spec])
        )
        return plain, (a, slope)

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
            if o.gamma <= 0:
                tokens += 1.0
                continue
            tokens += o.hit * self.expected_tokens(self.effective_accept(o), o.gamma) + (1.0 - o.hit)
            drafts += o.hit * o.gamma
            p_none *= 1.0 - o.hit
        base = p_none * self._cost(b, 0) + (1.0 - p_none) * self._cost(b, drafts)
        accept = self.effective_accept(row)
        rates = [(tokens + 1.0) / base]
        # One position past the deepest this request has had judged: a probe's
        # single accepted draft says nothing about positions 2..6, and jumping
        # to γ = 6 on it (6 draft-model steps and a 7-token verify, in a batch
        # for every row) was most of what adaptive γ lost where drafting does
        # not pay (docs/bench/adaptive.md). A row that keeps accepting deepens
        # one position per round.
        reach = next((j for j, n in enumerate(row.seen) if n == 0), self.gamma_max)
        for g in range(1, min(self.gamma_max, reach + 1) + 1):
            mine = row.hit * self.expected_tokens(accept, g) + (1.0 - row.hit)
            cost = row.hit * self._cost(b, drafts + g) + (1.0 - row.hit) * base
            rates.append((tokens + mine) / cost)
        if max(rates[1:]) < rates[0] * (1 + self.margin):
            return 0  # within the model's error of plain decode: not worth a verify round
        if max(rates) < b / self._cost(b, 0):
            # The batch would do better with nobody drafting. Each row alone can
            # still gain once the others' drafts have paid for the verify round,
            # so without this every row keeps drafting, all worse off together.
            return 0
        best = max(range(len(rates)), key=lambda g: (rates[g], -g))
        nxt = best + 1
        if best > 0 and nxt < len(rates) and not self.measured(round(drafts) + nxt):
            return nxt  # measure the next γ; it may be cheaper than estimated
        return best

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
        if row.off or row.retired:
            return 0, 1 << 30
        if row.fixed is not None:
            return row.fixed, (1 << 30 if row.fixed == 0 else 0)
        g = self.best(row)
        if row.probing:  # the probe round just ran: keep its verdict
            row.probing = False
            row.probe_every = self.probe_first if g > 0 else min(self.probe_max, row.probe_every * 2)
            self.probe_seed = row.probe_every
        if g > 0:
            return (0, 1) if self._explore_plain(row) else (g, 0)
        spacing = self._probe_spacing()
        if spacing is None:
            # Every probe would cost more than the budget however far apart:
            # the drafter's catch-up over the skipped tokens alone exceeds it.
            row.retired = True
            self.retired += 1
            return 0, 1 << 30
        return 0, max(row.probe_every, spacing)

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
        jump = max(0.0, self._cost(b, 1) - plain)
        room = self.probe_budget * plain - b * self.catch_up_token_s
        if room <= 0:
            return None
        return min(self.probe_cap, max(1, math.ceil(b * jump / room - 1e-9)))

    def after_hold(self, row: RowPolicy) -> tuple[int, int]:
        """A held row's hold ran out: choose again after a plain exploration
        round, else draft once (γ = 1) to refresh its acceptance."""
        if row.exploring:
            row.exploring = False
            return self.choose(row)
        if row.off or row.retired or row.fixed is not None:
            return self.choose(row)
        row.probing = True
        return 1, 0

    def _fit_snapshot(self) -> dict[str, Any]:
        (p0, p1), v = self._fit()
        out: dict[str, Any] = {"plain": {"base": round(p0, 6), "per_row": round(p1, 6)}}
        if v is not None:
            out["verify"] = dict(zip(("base", "per_row", "per_draft"), (round(c, 6) for c in v)))
        return out

    def snapshot(self) -> dict[str, Any]:
        return {
            "mode": "fixed" if self.fixed is not None else "adaptive",
            "fixed_gamma": self.fixed,
            "gamma_max": self.gamma_max if self.fixed is None else self.fixed,
            "acceptance_prior_per_pos": [round(a, 4) for a in self.accept],
            "round_s_by_rows_drafts": {f"{r}x{d}": round(v, 6) for (r, d), v in sorted(self._points().items())},
            "round_s_fit": self._fit_snapshot(),
            "draft_token_s": None if self.draft_token_s is None else round(self.draft_token_s, 6),
            "catch_up_token_s": round(self.catch_up_token_s, 7),
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
            "gamma_chosen": {str(g): n for g, n in sorted(self.gamma_chosen.items())},
        }
