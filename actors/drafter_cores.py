"""The Drafter's sync cores behind one protocol (``DrafterCore``): prompt
lookup (``NgramDrafterCore``) and a draft model with one cache per row
(``ModelDrafterCore``) here, suffix decoding across a namespace's requests in
``actors.suffix_cores``; ``actors.drafter`` is the actor that runs them.

A draft model's cache is rolled back to the longest common prefix of what it
holds and the committed context — after a round with k of γ drafts accepted
that is ``trim(γ-1-k)`` (it never fed ``d_γ``), the same rollback as the
target's, and when all γ were accepted it feeds ``[d_γ, emit]`` as mlx-lm
does. A cache that cannot be trimmed is rebuilt from the context instead
(slow, never wrong).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from engine.speculation.draft_model import DraftModel
from engine.speculation.ngram import NgramIndex

# A draft model that lags the context by more than this many tokens (a row
# that paused speculation, or its first round) catches up in a separate
# device call, timed apart from drafting: adaptive γ prices it per token (what
# a hold's catch-up will cost before the row's next probe), not as part of
# every round.
CATCH_UP_AFTER = 4


class Draft(msgspec.Struct, frozen=True, kw_only=True):
    """One row's request: its context is what the Drafter holds for ``rid``,
    cut to ``start`` tokens, plus ``tail``; propose up to ``gamma`` tokens."""

    rid: int
    start: int
    tail: list[int]
    gamma: int
    # Prompt lookup proposes only on a match agreeing with the context for this
    # many tokens (the Verifier's ``Verdict.min_match``); a draft model ignores it.
    min_match: int = 0
    ns: str = ""  # the request's cache namespace: suffix decoding reads only this namespace's store
    # A proposer that scores its own matches (suffix decoding) may draft up to
    # this many tokens when its match earns it (0: at most ``gamma``); set only
    # for a lone row the policy already drafts at its deepest.
    reach: int = 0
    # With ``reach``: what the row's verify window costs, in plain rounds (a
    # one-draft window, and each further row: ``Verified.price``), so a proposer
    # that knows its tokens' chances drafts the length that pays most (empty: unpriced).
    price: list[float] = []


class Drafted(msgspec.Struct, frozen=True, kw_only=True):
    rid: int
    tokens: list[int]  # at most max(gamma, reach); empty when there is nothing to propose
    proposer: str = ""  # which proposer drafted them: the per-proposer counters' label


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    """A request that ended: the part of its context the Drafter has not
    seen (from ``start``), how much of the whole is prompt, its namespace.
    A drafter that learns across requests (suffix decoding) stores it."""

    rid: int
    ns: str
    start: int
    tail: list[int]
    prompt_len: int


class DrafterCore(Protocol):
    kind: str
    on_device: bool  # must its calls run on the device thread?

    def extend(self, drafts: list[Draft]) -> None: ...

    def lagging(self, drafts: list[Draft]) -> list[int]: ...

    def catch_up(self, rids: list[int]) -> int: ...

    def catch_up_cost_s(self, rids: list[int]) -> float: ...

    def draft(self, drafts: list[Draft]) -> list[Drafted]: ...

    def cost_s(self, drafts: list[Draft]) -> float: ...

    def forget(self, rids: list[int]) -> None: ...

    def learn(self, finished: list[Finished]) -> None: ...


def check_start(rid: int, have: int, start: int) -> None:
    if start != have:
        raise ValueError(f"drafter: row {rid} context is {have} tokens but the Scheduler sent a tail from {start}")


class NgramDrafterCore:
    """Prompt lookup over each row's prompt + output so far."""

    kind = "ngram"
    on_device = False

    def __init__(self, *, min_n: int = 2, max_n: int = 4):
        NgramIndex(min_n=min_n, max_n=max_n)  # validates the sizes now, not at the first request
        self.min_n = min_n
        self.max_n = max_n
        self.rows: dict[int, NgramIndex] = {}
        self.gated = 0  # proposals the Verifier's min_match withheld, over all rows

    def extend(self, drafts: list[Draft]) -> None:
        for d in drafts:
            idx = self.rows.get(d.rid)
            if idx is None:
                idx = self.rows[d.rid] = NgramIndex(min_n=self.min_n, max_n=self.max_n)
            check_start(d.rid, len(idx), d.start)
            idx.extend(d.tail)

    def lagging(self, drafts: list[Draft]) -> list[int]:
        return []

    def catch_up(self, rids: list[int]) -> int:
        return 0

    def catch_up_cost_s(self, rids: list[int]) -> float:
        return 0.0

    def draft(self, drafts: list[Draft]) -> list[Drafted]:
        out = []
        for d in drafts:
            idx = self.rows[d.rid]
            before = idx.gated
            out.append(Drafted(rid=d.rid, tokens=idx.propose(d.gamma, d.min_match), proposer="ngram"))
            self.gated += idx.gated - before
        return out

    def cost_s(self, drafts: list[Draft]) -> float:
        return 0.0

    def forget(self, rids: list[int]) -> None:
        for rid in rids:
            self.rows.pop(rid, None)

    def learn(self, finished: list[Finished]) -> None:
        return None  # one request's own text only


@dataclass(slots=True)
class _ModelRow:
    cache: Any
    context: list[int] = field(default_factory=list)  # committed tokens
    cached: list[int] = field(default_factory=list)  # tokens in the draft cache


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafterCore:
    """A draft model with one cache per row. ``catch_up``/``draft`` run on the device."""

    kind = "model"
    on_device = True

    def __init__(self, model: DraftModel, name: str = "model"):
        self.model = model
        self.name = name
        self.rows: dict[int, _ModelRow] = {}
        self.rebuilds = 0  # caches rebuilt because they could not be trimmed

    def extend(self, drafts: list[Draft]) -> None:
        for d in drafts:
            row = self.rows.get(d.rid)
            if row is None:
                row = self.rows[d.rid] = _ModelRow(cache=None)
            check_start(d.rid, len(row.context), d.start)
            row.context.extend(d.tail)

    def lagging(self, drafts: list[Draft]) -> list[int]:
        out = []
        for d in drafts:
            row = self.rows[d.rid]
            if len(row.context) - _common_prefix(row.cached, row.context) > CATCH_UP_AFTER:
                out.append(d.rid)
        return out

    def _rollback(self, row: _ModelRow) -> None:
        """Cut the cache back to the longest prefix it shares with the context."""
        if row.cache is None:
            row.cache, row.cached = self.model.new_cache(), []
            return
        keep = _common_prefix(row.cached, row.context)
        extra = len(row.cached) - keep
        if extra == 0:
            return
        if self.model.can_trim(row.cache):
            self.model.trim(row.cache, extra)
            del row.cached[keep:]
        else:
            self.rebuilds += 1
            row.cache, row.cached = self.model.new_cache(), []

    def catch_up(self, rids: list[int]) -> int:
        """Feed lagging caches up to the context's last token; the tokens fed."""
        fed = 0
        for rid in rids:
            row = self.rows[rid]
            self._rollback(row)
            feed = row.context[len(row.cached) : -1]
            if feed:
                self.model.feed(row.cache, feed)
                row.cached.extend(feed)
                fed += len(feed)
        return fed

    def catch_up_cost_s(self, rids: list[int]) -> float:
        rows = [self.rows[rid] for rid in rids]
        return sum(self.model.cost_s(len(r.context) - _common_prefix(r.cached, r.context), 0) for r in rows)

    def draft(self, drafts: list[Draft]) -> list[Drafted]:
        work: list[tuple[Draft, _ModelRow, list[int]]] = []
        for d in drafts:
            row = self.rows[d.rid]
            if d.gamma <= 0 or not row.context:
                continue
            self._rollback(row)
            feed = row.context[len(row.cached) :]
            if not feed:
                # The whole context is cached (not after a verify round: the
                # emitted token is always new); re-feed the last token.
                if self.model.can_trim(row.cache):
                    self.model.trim(row.cache, 1)
                    row.cached.pop()
                else:
                    self.rebuilds += 1
                    row.cache, row.cached = self.model.new_cache(), []
                feed = row.context[len(row.cached) :]
            work.append((d, row, feed))
        results = self.model.generate_many([(row.cache, feed, d.gamma) for d, row, feed in work])
        got: dict[int, list[int]] = {}
        for (d, row, _), tokens in zip(work, results):
            row.cached = row.context + tokens[:-1]
            got[d.rid] = tokens
        return [Drafted(rid=d.rid, tokens=got.get(d.rid, []), proposer="draft_model") for d in drafts]

    def cost_s(self, drafts: list[Draft]) -> float:
        cost = 0.0
        for d in drafts:
            row = self.rows[d.rid]
            fed = len(row.context) - _common_prefix(row.cached, row.context)
            cost += self.model.cost_s(fed, d.gamma)
        return cost

    def forget(self, rids: list[int]) -> None:
        for rid in rids:
            self.rows.pop(rid, None)

    def learn(self, finished: list[Finished]) -> None:
        return None  # the draft model's own weights are what it knows
