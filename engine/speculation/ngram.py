"""Prompt lookup (n-gram) drafting: propose what followed the last n tokens before.

On input-grounded work (editing a file, answering from a document, code that
repeats its own identifiers) the continuation often already appears in the
context.

Copy pointer: where the last proposal came from, the next one continues —
when the tokens emitted since are exactly what followed there — before any
index lookup. A long copy (a file returned with one change) then follows its
source line by line instead of jumping to the most recent occurrence of the
suffix, which after a few lines is often the model's own earlier output or a
different line with the same tokens. After a mismatch (the change: a renamed
identifier) the pointer re-aligns on the latest token within a few tokens
ahead of where it was, so the copy resumes one round after the change
instead of waiting for ``min_n`` tokens that match somewhere. Re-aligning on
one token is a guess, made only inside a long copy (``realign_after`` tokens
copied in a row): after a chance match in free text it would draft, and
fail, every round. When the copy lost its place and the text continues
with something the source has further on (the target skipped a stretch: a
135M model asked to return an edited file wrote the def lines and skipped
the bodies), the lookup prefers the occurrence of the suffix after where the
source had got to — the one agreeing with the context furthest back, the
nearest on a tie — over the most recent one, which after a few lines is
often the copy's own output (``_forward``).

Prompt lookup finds the most recent earlier occurrence of the
context's last ``n`` tokens and proposes the tokens that followed it. No model,
no device time: a dict lookup per round.

The index is incremental: for every ``n`` in ``[min_n, max_n]`` it maps an
n-gram to the position right after its most recent occurrence, so each new
context token costs ``max_n - min_n + 1`` dict writes, and a lookup is
``max_n - min_n + 1`` dict reads however long the context is. Longer matches
are tried first (a longer match is a better predictor); below ``min_n`` it
proposes nothing, so it never guesses from one shared token. A match that
ends near the context's end is read as a repetition with that period (the
loops small models fall into), so it can still propose ``k`` tokens.

Agreement: how many of the context's last tokens equal the tokens before the
source position (``agreement``; the ``n`` of the match, and more where the
text goes on agreeing). It is the request's own evidence that it is copying:
a chance 2-gram in free text agrees for 2–3 tokens, a line being quoted or a
file being returned for as long as the copy has run. ``propose(k, min_match=m)``
proposes only on an agreement of at least ``m`` (adaptive γ asks for it while
none of a request's drafts was accepted: docs/speculation.md, "Isolated verify
rounds").
"""

from __future__ import annotations

import bisect


class NgramIndex:
    """The context of one request and its n-gram → next-position index."""

    def __init__(self, *, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # _index[n][gram] = j: the gram tokens[j-n:j] occurred most recently
        # ending at j, and tokens[j] followed it. Only grams with j < len(tokens)
        # are indexed, so the context's own suffix never matches itself.
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        # Every occurrence of each min_n-gram (ending positions, ascending): a
        # copy that lost its place looks forward from where its source was.
        self._all: dict[tuple[int, ...], list[int]] = {}
        self.forward = True  # off: the most recent occurrence only (as before; for comparisons)
        self.forward_candidates = 8  # occurrences after the source position weighed, at most
        self.forward_window = 1024  # how far past the source position a candidate may lie
        self.forward_match = 8  # tokens of agreement with the context counted, at most
        # Copy pointer: (position the latest proposal was read from, context length then).
        self._ptr: tuple[int, int] | None = None
        self.realign_window = 16
        # Tokens copied in a row from the pointer's source: re-aligning on one
        # token is a guess worth making only inside a long copy (an edited
        # file), not after a chance 2-gram match in free text, where it would
        # draft (and fail) every round.
        self._run = 0
        self.realign_after = 8
        self.agreement_cap = 32  # tokens of agreement counted, at most (the gate needs a handful)
        self.gated = 0  # proposals withheld: a match that agreed for fewer than min_match tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append context tokens (prompt, then each round's accepted output)."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        toks = self.tokens
        # A gram ending at j becomes indexable once tokens[j] exists: j < len.
        for j in range(max(start, 1), len(toks)):
            for n, idx in self._index.items():
                if j >= n:
                    idx[tuple(toks[j - n : j])] = j
            if j >= self.min_n:
                self._all.setdefault(tuple(toks[j - self.min_n : j]), []).append(j)

    def propose(self, k: int, min_match: int = 0) -> list[int]:
        """Up to ``k`` tokens: the copy pointer's continuation, else what
        followed the longest recent match of the suffix; none when the
        source agrees with the context for fewer than ``min_match`` tokens
        (the pointer still moves: the copy is tracked while it is gated)."""
        if k <= 0:
            return []
        toks = self.tokens
        L = len(toks)
        if self._ptr is not None and L - self._ptr[1] > self.realign_window:
            self._ptr, self._run = None, 0  # the copy did not resume: back to the index
        j = self._follow(L)
        if j is None:
            j = self._forward(L) if self.forward else None
            if j is None:
                j = self._lookup(L)
            if j is not None:
                self._run = 0
        if j is None:  # keep the pointer: the copy may resume after the change
            return []
        self._ptr = (j, L)
        if min_match > 0 and self.agreement(j) < min_match:
            self.gated += 1
            return []
        # A match close to the end means the text repeats with period L - j;
        # continue that repetition instead of stopping short.
        period = L - j
        return [toks[j + i % period] for i in range(k)]

    @property
    def source(self) -> int | None:
        """Where the latest proposal's continuation starts in the context
        (the copy pointer's source position); None before any match."""
        return None if self._ptr is None else self._ptr[0]

    def agreement(self, j: int) -> int:
        """Context tokens, counted back from the end, equal to those before
        source position ``j`` (at most ``agreement_cap``)."""
        toks, L = self.tokens, len(self.tokens)
        m, cap = 0, min(self.agreement_cap, j)
        while m < cap and toks[j - 1 - m] == toks[L - 1 - m]:
            m += 1
        return m

    def lookup(self, k: int) -> list[int]:
        """The index alone, no copy pointer: what followed the longest recent
        match of the suffix (``k`` tokens, continuing a repetition)."""
        toks, L = self.tokens, len(self.tokens)
        j = self._lookup(L) if k > 0 else None
        return [] if j is None else [toks[j + i % (L - j)] for i in range(k)]

    def _lookup(self, L: int) -> int | None:
        toks = self.tokens
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            j = self._index[n].get(tuple(toks[L - n :]))
            if j is not None:
                return j
        return None

    def _forward(self, L: int) -> int | None:
        """Where a copy that lost its place resumes: the occurrence of the
        context's suffix after where the copy's source had got to that
        agrees with the context furthest back (the nearest on a tie)."""
        if self._ptr is None or self.min_n > L:
            return None
        occ = self._all.get(tuple(self.tokens[L - self.min_n :]))
        if not occ:
            return None
        toks, j0 = self.tokens, self._ptr[0]
        i = bisect.bisect_right(occ, j0)
        best, best_m = None, 0
        for p in occ[i : i + self.forward_candidates]:
            if p >= L or p - j0 > self.forward_window:
                break
            m = self.min_n
            while m < self.forward_match and p - m - 1 >= 0 and toks[p - m - 1] == toks[L - m - 1]:
                m += 1
            if m > best_m:
                best, best_m = p, m
        return best

    def _follow(self, L: int) -> int | None:
        """Where the copy pointer continues: the tokens emitted since the last
        proposal followed its source exactly, or the latest token re-appears
        within ``realign_window`` tokens after where the source had got to."""
        if self._ptr is None:
            return None
        j0, L0 = self._ptr
        toks, n = self.tokens, L - L0
        if n <= 0 or j0 + n >= L:
            return None
        if toks[j0 : j0 + n] == toks[L0:L]:
            self._run += n
            return j0 + n
        # The text departed from its source (an edit). Re-align on the latest
        # token, near where the source had got to: the first match after the
        # longest run that did agree.
        agreed = 0
        while agreed < n and toks[j0 + agreed] == toks[L0 + agreed]:
            agreed += 1
        if self._run + agreed < self.realign_after:
            return None
        start, last = j0 + agreed, toks[L - 1]
        for q in range(start, min(start + self.realign_window, L - 1)):
            if toks[q] == last:
                self._run = 0  # a guess: it must copy again before it may guess again
                return q + 1
        return None
