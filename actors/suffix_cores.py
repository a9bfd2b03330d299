"""The suffix-decoding Drafter core (``SuffixDrafterCore``, ``--draft-model
suffix``), alone or composed with prompt lookup (``suffix+ngram``).

Per row it keeps the request's own text (``engine.speculation.suffix.SuffixIndex``);
per cache namespace a store of the namespace's finished requests
(``SuffixStore``), fed by ``learn`` when the Scheduler's ``Forget`` brings a
finished request's text. A row's draft is the better-scored of its own text's
and its namespace's store's, so a request never reads another namespace's text.

Composed with prompt lookup, both propose every round (both cost a few dict
lookups, no device time) and the better proposal wins: prompt lookup's scored
as the tokens it proposes up to ``alpha ×`` its agreement with the context
(what suffix decoding would allow a match that long), suffix decoding's as the
sum of its tokens' estimated probabilities; a tie goes to suffix decoding.
Prompt lookup keeps its copy pointer either way (it tracks a copy while it
loses), and its agreement gate applies to it; suffix decoding is gated on its
match length.

With ``priced`` (``suffix:cut``), a lone row's draft (``Draft.price`` set)
is cut to the length with the most expected tokens per unit of the window's
measured cost, its tokens' chances calibrated by what drafts of the same
support were really accepted at in the namespace
(``engine.speculation.draft_length``). The answer comes with the
next context tail, so every proposal is judged to its first wrong token,
whatever part of it the window fed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

from actors.drafter_cores import Draft, Drafted, Finished, NgramDrafterCore, check_start
from engine.speculation.draft_length import LOCAL, STORE, AcceptCalibration, best_length
from engine.speculation.suffix import NO_DRAFT, SuffixIndex, SuffixParams, SuffixStore

# A namespace's store holds at most this many tokens (oldest documents
# dropped first), and the drafter at most this many namespaces (least
# recently used dropped): ~100 bytes a stored token in CPython (the token, its
# index entry, a share of the gram keys), so ~6.5 MB a namespace and ~105 MB
# at the cap of 16.
CAP_TOKENS = 65536
MAX_NAMESPACES = 16
# The most a lone row's draft may reach when its match earns it (``Draft.reach``).
REACH = 24
# Proposals per row still waiting for the tokens that judge them (the oldest dropped).
PENDING = 8


@dataclass(slots=True)
class _Proposal:
    """A suffix draft made when the row's context was ``at`` tokens long,
    judged token by token as the context grows (``judged``: tokens so far)."""

    at: int
    source: str
    tokens: list[int]
    support: tuple[tuple[int, int], ...]
    judged: int = 0


@dataclass(slots=True)
class _Row:
    ns: str
    index: SuffixIndex
    pending: list[_Proposal] = field(default_factory=list)


class SuffixDrafterCore:
    """Suffix decoding over each row's own text and its namespace's store."""

    kind = "suffix"
    on_device = False

    def __init__(
        self,
        params: SuffixParams | None = None,
        *,
        cap_tokens: int = CAP_TOKENS,
        max_namespaces: int = MAX_NAMESPACES,
        ngram: NgramDrafterCore | None = None,
        priced: bool = False,
    ):
        if cap_tokens < 1 or max_namespaces < 1:
            raise ValueError(f"need cap_tokens >= 1 and max_namespaces >= 1, got {cap_tokens}, {max_namespaces}")
        self.params = params or SuffixParams()
        self.cap_tokens = cap_tokens
        self.max_namespaces = max_namespaces
        self.ngram = ngram  # composed with prompt lookup (``suffix+ngram``)
        # Cut a priced draft to the length that pays best (``suffix:cut``):
        # measured even with drafting to the match's end, so not the default.
        self.priced = priced
        self.rows: dict[int, _Row] = {}
        self.stores: OrderedDict[str, SuffixStore] = OrderedDict()
        self.gated = 0  # proposals withheld: a match shorter than the Verifier's min_match
        self.learned_docs = 0  # finished requests stored
        self.namespaces_evicted = 0
        self.wins: dict[str, int] = {}  # proposals made, by where they came from (local, store, ngram)
        self.calibrations: OrderedDict[str, AcceptCalibration] = OrderedDict()
        self.cut_tokens = 0  # draft tokens left out because they cost more than they promised

    # ---- the DrafterCore protocol -------------------------------------------
    def extend(self, drafts: list[Draft]) -> None:
        for d in drafts:
            row = self.rows.get(d.rid)
            if row is None:
                row = self.rows[d.rid] = _Row(ns=d.ns, index=SuffixIndex(self.params))
            check_start(d.rid, len(row.index), d.start)
            row.index.extend(d.tail)
            if row.pending:
                self._judge(row)
        if self.ngram is not None:
            self.ngram.extend(drafts)

    def lagging(self, drafts: list[Draft]) -> list[int]:
        return []

    def catch_up(self, rids: list[int]) -> int:
        return 0

    def catch_up_cost_s(self, rids: list[int]) -> float:
        return 0.0

    def cost_s(self, drafts: list[Draft]) -> float:
        return 0.0

    def draft(self, drafts: list[Draft]) -> list[Drafted]:
        looked = self.ngram.draft(drafts) if self.ngram is not None else []
        by_rid = {x.rid: x.tokens for x in looked}
        return [self._one(d, by_rid.get(d.rid)) for d in drafts]

    def forget(self, rids: list[int]) -> None:
        for rid in rids:
            self.rows.pop(rid, None)
        if self.ngram is not None:
            self.ngram.forget(rids)

    def learn(self, finished: list[Finished]) -> None:
        """Store each finished request's prompt and response in its namespace's store."""
        for f in finished:
            row = self.rows.get(f.rid)
            if f.start == 0:
                context = list(f.tail)
            elif row is not None and len(row.index) == f.start:
                context = row.index.tokens + list(f.tail)
            else:
                continue  # the Drafter's copy is not what the Scheduler thinks: store nothing rather than wrong text
            self.store(f.ns).learn(context[: f.prompt_len], context[f.prompt_len :])
            self.learned_docs += 1

    # ---- the rest -------------------------------------------------------------
    def calibration(self, ns: str) -> AcceptCalibration:
        """The namespace's acceptance calibration, made on first use (the least
        recently used dropped beyond ``max_namespaces``, as the stores are)."""
        cal = self.calibrations.get(ns)
        if cal is None:
            cal = self.calibrations[ns] = AcceptCalibration()
            while len(self.calibrations) > self.max_namespaces:
                self.calibrations.popitem(last=False)
        else:
            self.calibrations.move_to_end(ns)
        return cal

    def _judge(self, row: _Row) -> None:
        """Score each pending proposal's tokens against the tokens that came,
        up to its first wrong one."""
        toks, cal, keep = row.index.tokens, self.calibration(row.ns), []
        for p in row.pending:
            while p.judged < len(p.tokens) and p.at + p.judged < len(toks):
                follow, alive = p.support[p.judged]
                hit = toks[p.at + p.judged] == p.tokens[p.judged]
                cal.observe(p.source, p.judged + 1, follow, alive, hit)
                p.judged = p.judged + 1 if hit else len(p.tokens)
            if p.judged < len(p.tokens):
                keep.append(p)
        row.pending = keep

    def store(self, ns: str) -> SuffixStore:
        """The namespace's store, made on first use; the least recently used
        namespace's is dropped beyond ``max_namespaces``."""
        st = self.stores.get(ns)
        if st is None:
            st = self.stores[ns] = SuffixStore(self.params, cap_tokens=self.cap_tokens)
            while len(self.stores) > self.max_namespaces:
                self.stores.popitem(last=False)
                self.namespaces_evicted += 1
        else:
            self.stores.move_to_end(ns)
        return st

    def _one(self, d: Draft, looked: list[int] | None) -> Drafted:
        row = self.rows[d.rid]
        limit = max(d.gamma, d.reach)
        ctx = row.index.tokens
        best, source = row.index.propose(ctx, limit), LOCAL
        st = self.stores.get(row.ns)
        if st is not None:
            shared = st.propose(ctx, limit)
            if shared.score > best.score:
                best, source = shared, STORE
        if best.tokens and d.min_match and best.match_len < d.min_match:
            self.gated += 1
            best = NO_DRAFT
        if best.support and self.priced:
            row.pending = [*row.pending, _Proposal(len(ctx), source, best.tokens, best.support)][-PENDING:]
            if len(d.price) == 2:
                keep = best_length(self.calibration(row.ns).rates(source, best.support), *d.price)
                self.cut_tokens += len(best.tokens) - keep
                best = replace(best, tokens=best.tokens[:keep], support=best.support[:keep])
        if looked and self.ngram is not None:
            idx = self.ngram.rows[d.rid]
            agreed = idx.agreement(idx.source) if idx.source is not None else 0
            if min(len(looked), self.params.alpha * agreed) > best.score:
                self.wins["ngram"] = self.wins.get("ngram", 0) + 1
                return Drafted(rid=d.rid, tokens=looked[: d.gamma], proposer="ngram")
        if not best.tokens:
            return Drafted(rid=d.rid, tokens=[], proposer="suffix")
        self.wins[source] = self.wins.get(source, 0) + 1
        return Drafted(rid=d.rid, tokens=best.tokens, proposer="suffix")

    def stats(self) -> dict[str, object]:
        return {
            "suffix_gated_proposals": self.gated,
            "suffix_learned_requests": self.learned_docs,
            "suffix_namespaces": len(self.stores),
            "suffix_namespaces_evicted": self.namespaces_evicted,
            "suffix_stored_tokens": sum(len(s) for s in self.stores.values()),
            "suffix_cap_tokens": self.cap_tokens,
            "suffix_proposals": dict(self.wins),
            "suffix_cut_tokens": self.cut_tokens,
            "suffix_judged_tokens": sum(c.observed for c in self.calibrations.values()),
        }
