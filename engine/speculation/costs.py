"""What a speculative round costs, measured against plain decode under the same load.

The adaptive γ policy (``engine.speculation.policy.GammaPolicy``) compares rounds
with different verify windows: it needs ``cost(rows, drafts)``, the seconds
of a round in which ``rows`` rows feed ``drafts`` draft tokens in all.

Why ratios, and why to the plain rounds of the same time: on a shared
machine the absolute cost of a round swings by 2× or more with what else
runs. The earlier model took a low percentile of each shape's samples, which
is biased: a shape seen often (plain rounds, hundreds) reaches further into
the lucky tail than one seen rarely (a verify shape, a handful), so a 1-row
verify was priced at ~2× a plain round where the round anatomy measured
1.12–1.28× (docs/bench/spec.md), and the policy spoke against speculating
exactly when the machine was busy. Here every verify round is divided by the
median of the plain rounds at the same batch size nearest to it — measured
under the same load — and a shape's price is the median of those
ratios times the current plain round. Load scales both sides of a ratio, so
it cancels; a lone slow round moves a median by one rank.

Same time means within ``near`` (8) rounds, before or after: a verify
round waits (``_pending``) until the plain rounds after it have had their
chance, and one with no plain round near it is not used at all. A lone row
that speculates every round has no plain rounds to compare with, so the
policy decodes a few rounds plainly (``GammaPolicy.ref_rounds``) whenever
no plain round was seen within the latest ``fresh_rounds`` (192) rounds
(``fresh``): about 1% of its rounds.

Before a verify round is measured the price is a prior: ``slope_prior`` of a
plain round per draft token per row (the target's verify of a longer window:
right for prompt lookup and suffix decoding, whose drafts cost nothing), plus,
for a draft model, ``draft_prior`` one-row plain rounds per draft token (its
one-token step over the target's, measured at engine start:
``ember.spec_build``). A draft model's step is ~0.4–1.1 of the target's, and
without it a cold engine priced a batch of four drafting γ = 3 at 1.3 plain
rounds where it cost ~7: its first batch ran at 0.61–0.72× plain on the fake
GPU (tests/ember/test_spec_cold_prior.py).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


def nonneg_lstsq(cols: dict[str, np.ndarray], y: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    """Least squares of ``y`` on an intercept ``a`` and the named columns; a
    column that never varied is left out (its effect lands in ``a``) and a
    negative slope is noise: that column is dropped and the fit redone.
    ``weights``: how many samples stand behind each point."""
    names = ["a"] + [n for n, c in cols.items() if len(set(c.tolist())) > 1]
    w = np.sqrt(weights) if weights is not None else np.ones(len(y))
    while True:
        x = np.stack([np.ones(len(y))] + [cols[n] for n in names[1:]], axis=1)
        coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        got = dict(zip(names, (float(c) for c in coef)))
        bad = [i for i, n in enumerate(names) if n != "a" and got[n] < 0]
        if not bad:
            return {n: got.get(n, 0.0) for n in ["a", *cols]}
        del names[bad[0]]


class RoundCosts:
    def __init__(
        self,
        *,
        window: int = 32,
        ref_rounds: int = 8,
        near: int = 8,
        fresh_rounds: int = 192,
        slope_prior: float = 0.1,
        draft_prior: float = 0.0,
    ):
        self.window = window  # ratios kept per (rows, drafts)
        self.ref_rounds = ref_rounds  # plain rounds in a reference median, at most
        self.near = near  # a plain round this many rounds before or after a verify round is "the same time"
        self.fresh_rounds = fresh_rounds
        self.slope_prior = slope_prior  # a draft token's cost in plain rounds, per row, before any is measured
        self.draft_prior = draft_prior  # a draft model's step in one-row plain rounds, per draft token (0: none)
        self.seq = 0  # rounds observed
        self._plain: dict[int, deque[tuple[int, float]]] = {}  # rows -> (seq, seconds)
        self._ratio: dict[tuple[int, int], deque[float]] = {}  # (rows, drafts) -> verify ÷ plain reference
        self._last: dict[tuple[int, int], int] = {}  # (rows, drafts) -> the round its latest ratio was measured in
        self._pending: deque[tuple[int, int, int, float]] = deque(maxlen=256)  # (seq, rows, drafts, s) unpaired
        self._cache: dict[tuple[int, int], float] = {}

    # ---- measurements ----------------------------------------------------
    def observe_many(self, rounds: list[tuple[int, int, float]]) -> None:
        """``(rows, drafts, seconds)`` measured since the last call, in order."""
        for rows, drafts, s in rounds:
            self.observe(rows, drafts, s)

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rows = max(1, rows)
        self.seq += 1
        self._cache.clear()
        if drafts <= 0:
            self._plain.setdefault(rows, deque(maxlen=256)).append((self.seq, seconds))
        else:
            self._pending.append((self.seq, rows, drafts, seconds))
        self._pair(final=False)

    def _pair(self, final: bool) -> None:
        """Price each verify round against the plain rounds at its batch size
        within ``near`` rounds of it, before and after. A verify round waits
        until ``near`` rounds have passed (or, when ``final``, until pricing
        needs it and it has a reference); one with no plain round near it is
        dropped: there was nothing measured under the same load to compare it with."""
        while self._pending and (final or self.seq - self._pending[0][0] >= self.near):
            seq, rows, drafts, s = self._pending[0]
            ref = self._reference(rows, seq)
            if ref is None and self.seq - seq < self.near:
                break  # still young, no reference yet: the plain rounds after it may come
            self._pending.popleft()
            if ref is not None:
                q = self._ratio.setdefault((rows, drafts), deque(maxlen=self.window))
                if self.stale(rows, drafts, at=seq):
                    q.clear()  # measured again after a long gap: the old ratios say what it cost then
                q.append(s / ref)
                self._last[(rows, drafts)] = seq

    def _reference(self, rows: int, seq: int) -> float | None:
        """Median of the plain rounds at ``rows`` nearest to round ``seq``
        (at most ``ref_rounds``, all within ``near`` rounds of it)."""
        q = self._plain.get(rows)
        if not q:
            return None
        near = []
        for t, s in reversed(q):
            if t < seq - self.near:
                break
            if t <= seq + self.near:
                near.append((abs(t - seq), s))
        near.sort()
        return float(np.median([s for _, s in near[: self.ref_rounds]])) if near else None

    # ---- what was measured ------------------------------------------------
    def plain_ref(self, rows: int) -> float | None:
        """Median of the latest plain rounds at exactly this batch size."""
        q = self._plain.get(rows)
        if not q:
            return None
        return float(np.median([s for _, s in list(q)[-self.ref_rounds :]]))

    def fresh(self, rows: int) -> bool:
        q = self._plain.get(rows)
        return q is not None and len(q) > 0 and self.seq - q[-1][0] < self.fresh_rounds

    def stale(self, rows: int, drafts: int, at: int | None = None) -> bool:
        """Whether the latest ratio of this verify shape is older than
        ``fresh_rounds`` rounds. A shape priced high by a few rounds that met a
        slow moment is never chosen again, so nothing would replace its price:
        on the 1.5B's agent session suffix decoding priced a draft at 0.82 plain
        rounds from its first few two- and three-draft rounds (prompt lookup's:
        0.02) and drafted one token a round for the rest of the run
        (docs/bench/spec-real.md). A stale shape counts as unmeasured
        (``GammaPolicy.measured``): the policy tries it for a few rounds, and
        those replace its old ratios."""
        last = self._last.get((rows, drafts))
        return last is not None and (self.seq if at is None else at) - last > self.fresh_rounds

    def samples(self, rows: int, drafts: int) -> int:
        if drafts <= 0:
            return len(self._plain.get(rows, ()))
        waiting = sum(1 for _, r, d, _ in self._pending if (r, d) == (rows, drafts))
        return len(self._ratio.get((rows, drafts), ())) + waiting

    def ratios(self) -> dict[tuple[int, int], float]:
        if self._pending:
            self._pair(final=True)
        return {k: float(np.median(v)) for k, v in self._ratio.items() if v}

    # ---- prices -------------------------------------------------------------
    def plain(self, rows: int) -> float:
        """Seconds of a plain round at ``rows``: measured there, else a line
        through the sizes measured, else 1 (units: only ratios matter then)."""
        ref = self.plain_ref(rows)
        if ref is not None:
            return ref
        refs = {r: self.plain_ref(r) for r in self._plain}
        pts = {r: s for r, s in refs.items() if s is not None}
        if not pts:
            return 1.0
        fit = nonneg_lstsq({"r": np.array(list(pts), float)}, np.array(list(pts.values())))
        return max(min(pts.values()) * 0.5, fit["a"] + fit["r"] * rows)

    def ratio(self, rows: int, drafts: float) -> float:
        """A round with ``drafts`` draft tokens over a plain round, same rows:
        from the ratios measured at this batch size (a line through them, or
        the prior's slope through one), else a fit over every size measured
        (in drafts per row), else the prior ``1 + slope_prior·drafts/rows``."""
        if drafts <= 0:
            return 1.0
        key = (rows, round(drafts * 1000))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = max(1.0, self._ratio_uncached(rows, drafts))
        return hit

    def _ratio_uncached(self, rows: int, drafts: float) -> float:
        pts = self.ratios()
        here = sorted((d, r) for (b, d), r in pts.items() if b == rows)
        if len(here) >= 2:
            a, slope = self._line(rows)
            return a + slope * drafts
        plain = self.plain(rows)
        extra = self._extra_s()  # seconds a round's drafts add, fitted over the other sizes
        if len(here) == 1:
            d0, r0 = here[0]
            slope = extra["d"] if extra is not None and extra["d"] > 0 else self._prior_token_s(rows)
            return r0 + slope * (drafts - d0) / plain
        if extra is not None:
            return 1.0 + (extra["a"] + extra["d"] * drafts) / plain
        return 1.0 + self._prior_token_s(rows) * drafts / plain

    def _prior_token_s(self, rows: int) -> float:
        """Seconds a draft token adds to a round at ``rows`` before any was
        measured: the verify share (``slope_prior``) and the draft model's
        step, which runs once per draft token whatever the batch."""
        return self.slope_prior * self.plain(rows) / rows + self.draft_prior * self.plain(1)

    def _line(self, rows: int) -> tuple[float, float]:
        """A robust line through every ratio sample at ``rows`` (Theil–Sen:
        the median of the slopes between samples of different draft counts,
        floored at 0, and the median intercept), so that one round that met
        a spike in the machine's load cannot bend it the way it bends a
        least-squares line through per-shape medians of one or two samples."""
        pts = [(d, r) for (b, d), q in self._ratio.items() if b == rows for r in q]
        slopes = [(r2 - r1) / (d2 - d1) for i, (d1, r1) in enumerate(pts) for d2, r2 in pts[i + 1 :] if d2 != d1]
        slope = max(0.0, float(np.median(slopes))) if slopes else 0.0
        return float(np.median([r - slope * d for d, r in pts])), slope

    def _extra_s(self) -> dict[str, float] | None:
        """Seconds that ``d`` draft tokens add to a round, ``a + d·slope``,
        over every size measured: a draft token is one more token in the
        forward whatever the batch, so it extrapolates in seconds (a ratio
        would scale it with the plain round of the size it was measured at)."""
        pts = self.ratios()
        if not pts:
            return None
        d_ = np.array([d for _, d in pts], float)
        extra = np.array([(r - 1.0) * self.plain(b) for (b, _), r in pts.items()])
        return nonneg_lstsq({"d": d_}, extra)

    def cost(self, rows: int, drafts: float) -> float:
        return self.plain(rows) * self.ratio(rows, drafts)

    def snapshot(self) -> dict[str, Any]:
        return {
            "plain_s_by_rows": {str(r): round(self.plain_ref(r) or 0.0, 6) for r in sorted(self._plain)},
            "ratio_by_rows_drafts": {f"{r}x{d}": round(v, 4) for (r, d), v in sorted(self.ratios().items())},
        }
