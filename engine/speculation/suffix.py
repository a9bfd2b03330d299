"""Suffix decoding across a session: drafts from every earlier prompt and
response of the same cache namespace, scored by frequency (SuffixDecoding,
arXiv 2411.04975; the ``suffix`` method of vLLM and Arctic Inference).

Prompt lookup (``engine.speculation.ngram``) drafts from one request's own
text. An agent session repeats across requests — the same tool calls, file
paths, diffs, earlier answers — so this proposer matches the context's
suffix in two corpora and takes the better-scored draft:

* the request's own text (prompt + output so far, ``SuffixIndex``), as
  prompt lookup does;
* the namespace's store (``SuffixStore``): the responses, and the prompts'
  new parts, of the requests of that namespace that finished before. One
  store per namespace string, and a request reads only its own namespace's:
  one tenant's text never steers another tenant's drafts.

Why positions and not a suffix tree: a suffix tree of depth ``D`` built in
Python costs ``D`` dict writes and up to ``D`` nodes per token (an 8k-token
prompt: ~200k nodes); Arctic Inference builds one in C++. Here each corpus is
a flat token list with an index from each ``anchor``-gram to the positions
right after its occurrences (one list append per token), and a match is
walked over positions instead of nodes: the occurrences of the context's last
``anchor`` tokens (the most recent ``candidates`` of them) are extended
backwards to their match length with the context (at most ``max_depth``);
the occurrences matching at least ``ℓ`` tokens are exactly the suffixes under
the depth-``ℓ`` node of the suffix tree, so the draft is the tree's: from
them, follow the most frequent next token while its estimated probability
(count / suffixes still alive, multiplied along the path) stays at least
``min_token_prob``. A draft's score is the sum of those probabilities, and
its length is at most ``alpha · ℓ`` (the paper's ``max_spec = α · match_len``:
a longer match earns a longer draft). The few distinct match lengths are all
tried and the best score wins, as in Arctic Inference's ``speculate``.

Documents end with a sentinel (-1), so a match never spans two responses. Memory is bounded: a store holds at most ``cap_tokens`` tokens,
dropping its oldest documents first (their index entries with them), and the
drafter keeps at most ``max_namespaces`` stores, dropping the least recently
used (``SuffixDrafterCore``).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

SEP = -1  # between documents: no context token equals it, so no match crosses it


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    """A proposal: its tokens, its score (the sum of the estimated
    probabilities of its tokens) and the match length it came from.
    ``support[i]``: (suffixes that continue with ``tokens[i]``, suffixes
    alive before it), what token i's estimate was made of
    (``engine.speculation.draft_length`` learns what it is really worth)."""

    tokens: list[int]
    score: float
    match_len: int
    support: tuple[tuple[int, int], ...] = ()


NO_DRAFT = SuffixDraft(tokens=[], score=0.0, match_len=0)


@dataclass(frozen=True, slots=True)
class DraftTree:
    """A draft tree: node i holds ``tokens[i]`` and follows node
    ``parents[i]`` (-1: the context's last token, the root). Parents come
    before their children, so the nodes are already a verify window's order."""

    tokens: list[int]
    parents: list[int]
    score: float  # the sum of the nodes' estimated probabilities: expected accepted tokens
    match_len: int

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each node's depth (the root's children: 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def accept(self, greedy: list[int]) -> tuple[list[int], list[int]]:
        """Walk the target's greedy tokens down the tree. ``greedy[0]`` is the
        target's token after the root, ``greedy[i + 1]`` after node i.
        Returns the accepted nodes (root to leaf) and the tokens emitted:
        theirs and the target's own next token."""
        children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}
        path: list[int] = []
        out = [greedy[0]]
        at = -1
        while (nxt := children.get((at, out[-1]))) is not None:
            path.append(nxt)
            at = nxt
            out.append(greedy[nxt + 1])
        return path, out

    @staticmethod
    def of_path(tokens: list[int], match_len: int = 0) -> DraftTree:
        """A path as a tree (each node the previous one's child)."""
        return DraftTree(tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)), score=0.0, match_len=match_len)


NO_TREE = DraftTree(tokens=[], parents=[], score=0.0, match_len=0)
_D = TypeVar("_D", SuffixDraft, DraftTree)


@dataclass(frozen=True, slots=True)
class SuffixParams:
    """How a match becomes a draft (Arctic Inference's defaults, bar the anchor)."""

    anchor: int = 2  # the shortest match that proposes (prompt lookup's min_n)
    max_depth: int = 32  # longest match counted (the suffix tree's depth)
    alpha: float = 1.0  # a draft is at most alpha * match_len tokens (max_spec_factor)
    min_token_prob: float = 0.1  # stop where the path's estimated probability falls below
    candidates: int = 64  # occurrences of the anchor weighed, the most recent first

    def __post_init__(self) -> None:
        if self.anchor < 1 or self.max_depth < self.anchor:
            raise ValueError(f"need 1 <= anchor <= max_depth, got {self.anchor} and {self.max_depth}")
        if self.alpha <= 0 or not 0 < self.min_token_prob <= 1 or self.candidates < 1:
            raise ValueError("need alpha > 0, 0 < min_token_prob <= 1 and candidates >= 1")


class SuffixIndex:
    """A corpus of token documents and its anchor-gram -> positions index.

    Positions are absolute (they keep counting after the oldest documents are
    dropped); ``tokens[p - base]`` is the token at position ``p``."""

    def __init__(self, params: SuffixParams):
        self.params = params
        self.tokens: list[int] = []
        self.base = 0  # absolute position of tokens[0]
        # gram -> ascending positions right after its occurrences. A gram is
        # indexed once the token after it exists, so a request's own suffix
        # never matches itself.
        self._occ: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # absolute position up to which grams are indexed
        self.lengths_tried = 4  # distinct match lengths walked per proposal, the longest first

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append to the last document (a request's context as it grows)."""
        self.tokens.extend(tokens)
        n, toks, base, occ = self.params.anchor, self.tokens, self.base, self._occ
        for p in range(max(self._indexed, base + n), self.end):
            gram = tuple(toks[p - base - n : p - base])
            if SEP not in gram:
                occ.setdefault(gram, []).append(p)
        self._indexed = max(self._indexed, self.end)

    def add_document(self, tokens: list[int]) -> None:
        """Append a separate document (a finished response), closed by a
        separator: a suffix that ends with its document counts against the
        continuations, the last document's as much as the others'."""
        self.extend([*tokens, SEP])

    def drop_before(self, position: int) -> None:
        """Forget every token before absolute ``position`` and its index entries."""
        cut = min(position, self.end) - self.base
        if cut <= 0:
            return
        n, toks = self.params.anchor, self.tokens
        new_base = self.base + cut
        seen = set()
        for i in range(n, min(cut + n, len(toks) + 1)):  # grams with a token before the cut
            gram = tuple(toks[i - n : i])
            if gram in seen or SEP in gram:
                continue
            seen.add(gram)
            occ = self._occ.get(gram)
            if occ is not None:
                del occ[: bisect.bisect_left(occ, new_base + n)]
                if not occ:
                    del self._occ[gram]
        del toks[:cut]
        self.base = new_base

    def propose(self, context: list[int], limit: int, upto: int | None = None) -> SuffixDraft:
        """The best-scored draft of at most ``limit`` tokens continuing
        ``context`` from this corpus; ``upto``: ignore positions from there on
        (a request's own index stops at its context's end)."""
        return self._best(context, limit, upto, self._walk, NO_DRAFT)

    def propose_tree(self, context: list[int], budget: int, upto: int | None = None) -> DraftTree:
        """The best-scored draft *tree* of at most ``budget`` nodes: the
        suffix tree's most probable continuations, not only its most frequent
        path (SuffixDecoding's tree: nodes added best first by estimated
        probability). With ``budget`` at least the path's length it scores at
        least what ``propose`` does."""
        return self._best(context, budget, upto, self._grow, NO_TREE)

    def _best(self, context: list[int], limit: int, upto: int | None, build: Callable[..., _D], none: _D) -> _D:
        """``build``'s best-scored proposal over the few longest distinct match
        lengths, each capped at ``alpha`` times its length."""
        found = self._matches(context, limit, upto)
        if found is None:
            return none
        matched, end = found
        best = none
        for ell in sorted({m for m, _ in matched}, reverse=True)[: self.lengths_tried]:
            cap = min(limit, int(self.params.alpha * ell))
            if best.score >= cap:
                break  # a shorter match cannot score more than its cap
            got = build([p for m, p in matched if m >= ell], cap, end, ell)  # alive: most recent first
            if got.score > best.score:
                best = got
        return best

    def _matches(self, context: list[int], limit: int, upto: int | None) -> tuple[list[tuple[int, int]], int] | None:
        """The most recent occurrences of the context's last ``anchor``
        tokens, each with how far back it agrees with the context, and where
        the corpus ends for this lookup; None where nothing can be proposed."""
        prm = self.params
        n = prm.anchor
        if limit <= 0 or len(context) < n:
            return None
        occ = self._occ.get(tuple(context[-n:]))
        if not occ:
            return None
        base, toks = self.base, self.tokens
        end = self.end if upto is None else min(upto, self.end)
        lo = bisect.bisect_left(occ, base + n)
        hi = bisect.bisect_left(occ, end, lo)  # a position at the end has nothing after it
        if hi <= lo:
            return None
        depth = min(prm.max_depth, len(context))
        matched: list[tuple[int, int]] = []
        for p in reversed(occ[max(lo, hi - prm.candidates) : hi]):
            m, i = n, p - base - n - 1
            while m < depth and i >= 0 and toks[i] == context[-1 - m]:
                m += 1
                i -= 1
            matched.append((m, p))
        return matched, end

    def _next_tokens(self, alive: list[int], end: int) -> list[tuple[int, list[int]]]:
        """The tokens after the ``alive`` positions, most frequent first (a
        tie: the most recent occurrence's first), each with the positions
        after it."""
        base, toks = self.base, self.tokens
        by_tok: dict[int, list[int]] = {}  # insertion order = recency (alive is most recent first)
        for p in alive:
            if p < end:
                t = toks[p - base]
                if t != SEP:
                    by_tok.setdefault(t, []).append(p + 1)
        return sorted(by_tok.items(), key=lambda kv: -len(kv[1]))  # stable: recency breaks ties

    def _grow(self, alive: list[int], cap: int, end: int, ell: int) -> DraftTree:
        """Best-first growth: the most probable candidate node joins next, its
        probability the parent's times its share of the parent's suffixes
        (the path's estimate, so a tree's first nodes are the path's while
        the path is the likeliest)."""
        min_prob = self.params.min_token_prob
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        heap: list[tuple[float, int, int, int, list[int]]] = []  # (-prob, order, parent, token, positions)
        order = 0

        def offer(parent: int, prob: float, positions: list[int]) -> None:
            nonlocal order
            for tok, after in self._next_tokens(positions, end):
                q = prob * len(after) / len(positions)
                if q >= min_prob:
                    heapq.heappush(heap, (-q, order, parent, tok, after))
                    order += 1

        offer(-1, 1.0, alive)
        while heap and len(tokens) < cap:
            neg, _, parent, tok, after = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            score -= neg
            offer(len(tokens) - 1, -neg, after)
        if not tokens:
            return NO_TREE
        return DraftTree(tokens=tokens, parents=parents, score=score, match_len=ell)

    def _walk(self, alive: list[int], cap: int, end: int, ell: int) -> SuffixDraft:
        """Follow the most frequent next token among the ``alive`` suffixes
        (a tie goes to the most recent occurrence's token)."""
        out: list[int] = []
        support: list[tuple[int, int]] = []
        prob, score = 1.0, 0.0
        while len(out) < cap and alive:
            nxt = self._next_tokens(alive, end)
            if not nxt:
                break
            tok, after = nxt[0]
            prob *= len(after) / len(alive)  # suffixes that ended here count against it
            if prob < self.params.min_token_prob:
                break
            out.append(tok)
            support.append((len(after), len(alive)))
            score += prob
            alive = after
        return SuffixDraft(tokens=out, score=score, match_len=ell, support=tuple(support)) if out else NO_DRAFT


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SuffixStore:
    """One namespace's finished text, at most ``cap_tokens`` tokens.

    A response goes in whole. A prompt goes in from where it departs from
    the most similar of the last ``recent_prompts`` prompts learned (an agent
    resends its whole history each turn: storing every prompt whole would
    store the first turn once per turn), with ``params.max_depth`` tokens
    before that point so the new part can still be matched into."""

    def __init__(self, params: SuffixParams, *, cap_tokens: int = 65536, recent_prompts: int = 4):
        if cap_tokens < 1:
            raise ValueError(f"cap_tokens must be positive, got {cap_tokens}")
        self.index = SuffixIndex(params)
        self.cap_tokens = cap_tokens
        self.recent_prompts = recent_prompts
        self._docs: list[int] = []  # absolute start of each document, oldest first
        self._prompts: list[list[int]] = []
        self.evicted_docs = 0

    def __len__(self) -> int:
        return len(self.index)

    def learn(self, prompt: list[int], response: list[int]) -> None:
        keep = max((_common_prefix(prompt, p) for p in self._prompts), default=0)
        new = prompt[max(0, keep - self.index.params.max_depth) :] if keep < len(prompt) else []
        if new:
            self._add(new)
        if response:
            # the response's match context is the prompt's end: keep a little of it
            self._add(prompt[-self.index.params.max_depth :] + response)
        self._prompts = (self._prompts + [list(prompt)])[-self.recent_prompts :]

    def _add(self, tokens: list[int]) -> None:
        tokens = tokens[-self.cap_tokens :]
        self._docs.append(self.index.end)
        self.index.add_document(tokens)
        while len(self.index) > self.cap_tokens and len(self._docs) > 1:
            self._docs.pop(0)
            self.evicted_docs += 1
            self.index.drop_before(self._docs[0])

    def propose(self, context: list[int], limit: int) -> SuffixDraft:
        return self.index.propose(context, limit)

    def propose_tree(self, context: list[int], budget: int) -> DraftTree:
        return self.index.propose_tree(context, budget)
