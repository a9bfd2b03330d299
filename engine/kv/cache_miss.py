"""Why a turn missed the prompt cache: the point where its prompt left the
closest cached sequence.

An agent's next turn should extend the previous turn's whole prompt; when it
does not, the prefill it pays for starts where the prompt diverged. The
closest sequence is the entry of the request's namespace (RAM or SSD tier)
sharing the longest common prefix with the prompt (``PrefixIndex.closest``:
a bisect, no scan). If that entry ends where the common prefix ends, the
prompt merely extends it: no divergence. If it goes on, the cache held a
conversation the prompt turned away from, and the report says where, with a
short window of both sides (the transport decodes it and names the message:
transport/turn/cache_miss.py). Anthropic's API reports the same idea as
``cache_miss_reason``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.types import CacheMiss

WINDOW = 12  # tokens kept on each side of the divergence


def divergence(
    prompt: Sequence[int], cached: np.ndarray | None, common: int, tier: str, window: int = WINDOW
) -> CacheMiss | None:
    """The miss of ``prompt`` against ``cached`` (which shares its first
    ``common`` tokens); None when there is no divergence: no cached sequence,
    the prompt extends it, or the prompt ends inside it."""
    if cached is None or common >= cached.size or common >= len(prompt):
        return None
    start = max(0, common - window)
    return CacheMiss(
        diverged_at=common,
        cached_tokens_available=int(cached.size),
        tier=tier,
        window_start=start,
        prompt_window=[int(t) for t in prompt[start : common + window]],
        cached_window=[int(t) for t in cached[start : common + window]],
    )


def closest_miss(
    prompt: Sequence[int], found: list[tuple[str, np.ndarray | None, int]], window: int = WINDOW
) -> CacheMiss | None:
    """``divergence`` against the closest of the tiers' candidates
    (``(tier, tokens, common)``): the longest common prefix wins; at a tie, a
    sequence the prompt extends wins (no miss)."""
    best: tuple[str, np.ndarray | None, int] | None = None
    for tier, tokens, common in found:
        if tokens is None or common <= 0:
            continue
        ends = tokens.size <= common
        if best is None or common > best[2] or (common == best[2] and ends):
            best = (tier, tokens, common)
    if best is None:
        return None
    return divergence(prompt, best[1], best[2], best[0], window)
