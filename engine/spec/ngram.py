"""Prompt lookup (n-gram) drafting: propose what followed the last n tokens before.

On input-grounded work (editing a file, answering from a document, code that
repeats its own identifiers) the continuation often already appears in the
context. Prompt lookup finds the most recent earlier occurrence of the
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
"""

from __future__ import annotations


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

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest recent match of the suffix."""
        if k <= 0:
            return []
        toks = self.tokens
        L = len(toks)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            j = self._index[n].get(tuple(toks[L - n :]))
            if j is not None:
                # A match close to the end means the text repeats with period
                # L - j; continue that repetition instead of stopping short.
                period = L - j
                return [toks[j + i % period] for i in range(k)]
        return []
