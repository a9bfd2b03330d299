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
that conditional is exactly what each round observes). It costs
``C(γ)``: the measured time of a round whose longest verify window had γ
drafts, from the start of its step to the start of the next — drafting, the
device step, the Verifier's answer and the emission included, and a plain
decode the backend ran ahead of time counted at its real per-token cost.
The policy picks the γ in ``0..gamma_max`` with the
most tokens per second, ``E(γ) / C(γ)``; γ = 0 is plain decode, ``E = 1``.

* ``a_j`` is a moving average per request (requests differ: a file being
  edited accepts far more than free text), seeded from an engine-wide moving
  average for the same drafter so a new request starts from experience.
* Costs are engine-wide (the device is shared): a low quantile (the 25th
  percentile) of the last few measured steps per (batch size bucket, γ) —
  not a mean, because a step slowed by another process on the machine, or
  by a late thread wakeup, must not swing the choice. A γ
  not measured yet is interpolated from its measured neighbours, or
  extrapolated with a per-token slope; the γ just above the current choice is
  tried until it has a few samples, so that every useful γ gets measured.
* When γ = 0 wins, the request decodes plainly for ``hold`` rounds — without
  asking the Drafter or the Verifier anything — and then probes γ = 1 once to
  find out whether drafts started paying (the text may have become
  repetitive). Each probe that does not turn speculation back on doubles the
  hold, up to ``probe_max``, so a request where it never pays spends at most
  ~1/``probe_max`` of its rounds probing.

The cost of a batched step is shared by its rows, so the per-row choice is a
heuristic under batching: each row maximises its own tokens per step time.
A fixed γ (``EngineConfig.num_draft_tokens`` or the request's
``num_draft_tokens``) bypasses all of this.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

ADAPTIVE_GAMMA_MAX = 6
FIXED_GAMMA_MAX = 16


def low_quantile(samples: Iterable[float], q: float = 0.25) -> float:
    """A low quantile of recent timings. Interference only ever adds time
    (another process, a thread wakeup that came late), so the low end of the
    samples is the device's own cost; a median still moves when the machine
    is loaded for half the window."""
    xs = sorted(samples)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def batch_bucket(rows: int) -> int:
    """Steps are costed per batch size bucket: 1, 2, 4, 8, 16, ..."""
    b = 1
    while b < rows:
        b *= 2
    return b


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
    off: bool = False  # the row's cache cannot be trimmed: plain decode from now on


class GammaPolicy:
    def __init__(
        self,
        *,
        fixed: int | None = None,
        gamma_max: int = ADAPTIVE_GAMMA_MAX,
        accept_prior: float = 0.5,
        accept_alpha: float = 0.15,
        cost_window: int = 16,
        min_samples: int = 4,
        slope_prior: float = 0.1,
        probe_first: int = 4,
        probe_max: int = 64,
    ):
        if fixed is not None and not 0 <= fixed <= FIXED_GAMMA_MAX:
            raise ValueError(f"num_draft_tokens must be in 0..{FIXED_GAMMA_MAX}, got {fixed}")
        self.fixed = fixed
        self.gamma_max = gamma_max
        self.accept_alpha = accept_alpha
        self.cost_window = cost_window
        self.min_samples = min_samples
        self.slope_prior = slope_prior
        self.probe_first = probe_first
        self.probe_max = probe_max
        self.accept = [accept_prior] * gamma_max  # engine-wide, seeds new rows
        self._steps: dict[int, dict[int, deque[float]]] = {}  # bucket -> γ -> recent step seconds
        self._draft_s: deque[float] = deque(maxlen=cost_window * 4)  # per drafted token
        self.bucket = 1  # batch size bucket of the latest step

    # ---- rows ------------------------------------------------------------
    def new_row(self, fixed: int | None) -> RowPolicy:
        if fixed is not None and not 0 <= fixed <= FIXED_GAMMA_MAX:
            raise ValueError(f"num_draft_tokens must be in 0..{FIXED_GAMMA_MAX}, got {fixed}")
        fixed = fixed if fixed is not None else self.fixed
        return RowPolicy(
            fixed=fixed, accept=list(self.accept), seen=[0] * self.gamma_max, probe_every=self.probe_first
        )

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
        """A step of ``rows`` rows whose longest verify window had ``gamma``
        drafts took ``step_s``; drafting its ``drafted_tokens`` took ``draft_s``."""
        self.bucket = batch_bucket(rows)
        if step_s > 0:
            table = self._steps.setdefault(self.bucket, {})
            table.setdefault(gamma, deque(maxlen=self.cost_window)).append(step_s)
        if drafted_tokens > 0 and draft_s >= 0:
            self._draft_s.append(draft_s / drafted_tokens)

    @property
    def draft_token_s(self) -> float | None:
        return low_quantile(self._draft_s) if self._draft_s else None

    def _known(self, bucket: int) -> dict[int, float]:
        table = self._steps.get(bucket)
        if not table:  # nothing at this batch size yet: borrow the nearest measured one
            near = min(self._steps, key=lambda b: abs(b.bit_length() - bucket.bit_length()), default=None)
            table = self._steps.get(near, {}) if near is not None else {}
        return {g: low_quantile(v) for g, v in table.items()}

    def step_cost(self, gamma: int, bucket: int | None = None) -> float:
        """Measured step seconds for γ, or an estimate from the measured ones."""
        known = self._known(self.bucket if bucket is None else bucket)
        if gamma in known:
            return known[gamma]
        if not known:
            return 1.0 + self.slope_prior * gamma  # arbitrary unit: only ratios matter
        lo = max((g for g in known if g < gamma), default=None)
        hi = min((g for g in known if g > gamma), default=None)
        if lo is not None and hi is not None:
            w = (gamma - lo) / (hi - lo)
            return known[lo] + w * (known[hi] - known[lo])
        if lo is not None:
            below = sorted(g for g in known if g >= 1)
            if len(below) >= 2:
                g1, g2 = below[-2], below[-1]
                slope = max(0.0, (known[g2] - known[g1]) / (g2 - g1))
            else:
                slope = self.slope_prior * known[lo]
            return known[lo] + slope * (gamma - lo)
        # Only larger γ measured (a request that speculated from its first
        # round): extrapolate down along the measured slope, else the prior's.
        above = sorted(known)
        if len(above) >= 2:
            g1, g2 = above[0], above[1]
            slope = max(0.0, (known[g2] - known[g1]) / (g2 - g1))
            est = known[hi] - slope * (hi - gamma)
        else:
            est = 0.0
        return max(est, known[hi] / (1.0 + self.slope_prior * (hi - gamma)))

    def measured(self, gamma: int) -> bool:
        """Enough samples of this γ at this batch size that one unlucky step
        cannot rule it out for good."""
        return len(self._steps.get(self.bucket, {}).get(gamma, ())) >= self.min_samples

    def round_cost(self, gamma: int) -> float:
        """Seconds per round at γ; the measured step time is start to start,
        so it already holds the drafting."""
        if gamma in self._known(self.bucket):
            return self.step_cost(gamma)
        return self.step_cost(gamma) + self._draft_extra(gamma)

    def _draft_extra(self, gamma: int) -> float:
        """For an estimated γ: drafting time the estimate's measured neighbours
        do not already hold (their step times include their own drafting)."""
        known = self._known(self.bucket)
        below = max((g for g in known if g < gamma), default=0)
        return (gamma - below) * (self.draft_token_s or 0.0) if known else 0.0

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

    def best(self, row: RowPolicy) -> int:
        accept = self.effective_accept(row)
        rates = [self.expected_tokens(accept, g) / self.round_cost(g) for g in range(self.gamma_max + 1)]
        best = max(range(len(rates)), key=lambda g: (rates[g], -g))
        nxt = best + 1
        if 0 < best and nxt <= self.gamma_max and not self.measured(nxt):
            return nxt  # measure the next γ; it may be cheaper than estimated
        return best

    def choose(self, row: RowPolicy) -> tuple[int, int]:
        """``(γ, hold)`` for the row's next round: γ = 0 is plain decode, and
        ``hold`` is how many rounds to stay plain before asking again."""
        if row.off:
            return 0, 1 << 30
        if row.fixed is not None:
            return row.fixed, (1 << 30 if row.fixed == 0 else 0)
        g = self.best(row)
        if row.probing:  # the probe round just ran: keep its verdict
            row.probing = False
            row.probe_every = self.probe_first if g > 0 else min(self.probe_max, row.probe_every * 2)
        if g > 0:
            return g, 0
        return 0, row.probe_every

    def probe(self, row: RowPolicy) -> int:
        """A held row's hold ran out: draft once to refresh its acceptance."""
        if row.off or row.fixed is not None:
            return self.choose(row)[0]
        row.probing = True
        return 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "mode": "fixed" if self.fixed is not None else "adaptive",
            "fixed_gamma": self.fixed,
            "gamma_max": self.gamma_max if self.fixed is None else self.fixed,
            "acceptance_prior_per_pos": [round(a, 4) for a in self.accept],
            "step_s_by_gamma": {
                f"b{b}": {str(g): round(low_quantile(v), 6) for g, v in sorted(t.items())}
                for b, t in sorted(self._steps.items())
            },
            "draft_token_s": None if self.draft_token_s is None else round(self.draft_token_s, 6),
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
