"""How long a suffix draft should be: what its tokens were really accepted at,
against what one more verify-window row costs.

Suffix decoding estimates a token's probability as the share of the matched
suffixes that go on with it (``engine.speculation.suffix``). On one matching
occurrence that share is 1 to the occurrence's end, so a unique long match
drafts up to ``REACH`` (24) tokens "at certainty", while each row of a verify
window costs ~0.14 of a plain round on the 1.5B (docs/bench/spec-real.md):
a long window's rejected tail is paid for. ``suffix:cut`` corrects for it
in two steps (measured even with drafting to the match's end on the 1.5B and
SmolLM2, so it is an option, not the default: docs/bench/spec-real.md):

* ``AcceptCalibration`` learns, per namespace, how often a draft token of a
  given support was the token the request went on to produce, given that the
  ones before it were. The support is its depth in the draft, how many
  suffixes backed it and their share, and whether it came from the store or
  the request's own text. The drafter sees the answer itself: the context it
  is sent next holds the tokens that came, whether or not the window was fed
  whole, so it learns the tail it cut too. A cell with no data borrows its
  (source, share) pool's rate, and a pool with none the raw share: a cold
  engine drafts as before.
* ``best_length`` keeps the prefix with the most expected tokens per unit of
  cost, a window priced as the policy measured it (``Verified.price``: a
  one-draft window over a plain round, and each further row).
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL, STORE = "local", "store"  # where a suffix draft came from: the request's own text, its namespace's store


def _bucket(value: int, edges: tuple[int, ...]) -> int:
    """The first edge ``value`` is at most (len(edges) past the last)."""
    for i, e in enumerate(edges):
        if value <= e:
            return i
    return len(edges)


def _share_bucket(follow: int, alive: int) -> int:
    if follow >= alive:
        return 0  # every suffix alive agrees: the estimate says "certain"
    return 1 if 2 * follow >= alive else 2


@dataclass(slots=True)
class _Tally:
    hits: float = 0.0
    seen: float = 0.0

    def add(self, hit: bool, cap: float) -> None:
        self.hits += 1.0 if hit else 0.0
        self.seen += 1.0
        if self.seen > cap:  # forget slowly: the text of a session drifts
            self.hits *= 0.5
            self.seen *= 0.5

    def rate(self, prior: float, weight: float) -> float:
        return (self.hits + weight * prior) / (self.seen + weight)


class AcceptCalibration:
    """Acceptance of suffix draft tokens by their support (one per namespace)."""

    DEPTHS = (1, 2, 4, 8)  # a token's position in its draft: 1, 2, 3-4, 5-8, 9+
    ALIVE = (1, 2, 5)  # suffixes behind it: 1, 2, 3-5, 6+

    def __init__(self, *, weight: float = 4.0, cap: float = 512.0):
        self.weight = weight  # pseudo-observations of the level above
        self.cap = cap  # observations a cell keeps at full weight
        self._cells: dict[tuple[str, int, int, int], _Tally] = {}
        self._pools: dict[tuple[str, int], _Tally] = {}
        self.observed = 0

    def _keys(
        self, source: str, depth: int, follow: int, alive: int
    ) -> tuple[tuple[str, int, int, int], tuple[str, int]]:
        share = _share_bucket(follow, alive)
        cell = (source, _bucket(depth, self.DEPTHS), _bucket(alive, self.ALIVE), share)
        return cell, (source, share)

    def rate(self, source: str, depth: int, follow: int, alive: int) -> float:
        """The probability that a token of this support is accepted, the ones before it having been."""
        cell, pool = self._keys(source, depth, follow, alive)
        raw = follow / alive if alive > 0 else 0.0
        p = self._pools.get(pool)
        prior = p.rate(raw, self.weight) if p is not None else raw
        c = self._cells.get(cell)
        return c.rate(prior, self.weight) if c is not None else prior

    def rates(self, source: str, support: tuple[tuple[int, int], ...]) -> list[float]:
        return [self.rate(source, i + 1, f, a) for i, (f, a) in enumerate(support)]

    def observe(self, source: str, depth: int, follow: int, alive: int, hit: bool) -> None:
        cell, pool = self._keys(source, depth, follow, alive)
        self._cells.setdefault(cell, _Tally()).add(hit, self.cap)
        self._pools.setdefault(pool, _Tally()).add(hit, self.cap)
        self.observed += 1


def best_length(rates: list[float], first: float, per_row: float) -> int:
    """The draft prefix (at least one token) with the most expected tokens per
    unit of cost: a window of ``k`` drafts yields ``1 + S_1 + … + S_k`` tokens,
    ``S_j`` the chance that the first ``j`` are all accepted, and costs
    ``first + per_row·(k − 1)`` plain rounds. Ties go to the shorter window."""
    if not rates:
        return 0
    best_k, best_rate = 1, -1.0
    expected, survive = 1.0, 1.0
    for k, r in enumerate(rates, start=1):
        survive *= r
        expected += survive
        value = expected / max(first + per_row * (k - 1), 1e-9)
        if value > best_rate * (1 + 1e-9):
            best_k, best_rate = k, value
    return best_k
