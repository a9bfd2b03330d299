"""The RAM tier of the prompt cache: a byte-capped LRU of prefix entries.

An entry is a finished row's KV cache keyed by (namespace, the exact tokens it
encodes). ``take`` hands out a private copy trimmed to the longest usable
prefix of a new prompt and leaves the stored entry intact; ``put`` stores a
finished row's cache; entries evicted for room (or demoted after sitting idle)
go to the spill hook — the SSD cold tier when it is on — instead of vanishing.
Everything here is synchronous: the Scheduler owns this object and calls it
between steps.

The usable-prefix rule (shared with the cold tier's index, ``usable_prefix``):
the common prefix with the prompt, capped at ``len(prompt) - 1`` so at least
one token is left to feed (mlx-lm 0.32's server crashes on an exact hit with
nothing left), and an entry longer than that prefix is usable only if its
cache can be trimmed (a wrapped ring or SSM state cannot run backwards).

Why not mlx-lm's ``LRUPromptCache``/``PromptTrie``: their fetch deep-copies
(MLX objects only; the fake GPU's numpy caches and a backend's own clone are
out of reach), counts ``nbytes`` of the 256-step buffer rather than the tokens
in use, does not refresh recency on a fetch, has no spill hook, returns an
empty remainder on an exact hit, and ``PromptTrie.search`` reports only the
shortest extension past the divergence point, ignoring trimmability, so it can
miss a usable entry. The cache operations come from the backend port
(``cache_nbytes``/``clone_cache``/``trim_cache``/``cache_trimmable``, which on
MLX are mlx-lm's ``trim_prompt_cache``/``can_trim_prompt_cache``); the lookup
is a vectorized common-prefix scan, cheap for the tens of entries RAM holds.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from engine.errors import EngineDead

log = logging.getLogger("ember.prompt_cache")


class CacheOps(Protocol):
    """The slice of ``engine.ports.Backend`` the tiers need."""

    def cache_nbytes(self, cache: Any) -> int: ...

    def clone_cache(self, cache: Any) -> Any: ...

    def trim_cache(self, cache: Any, n: int) -> int: ...

    def cache_trimmable(self, cache: Any) -> bool: ...


SpillHook = Callable[[list[int], str, Any], None]
"""``(tokens, ns, cache)``: takes ownership of an evicted entry; must not block."""


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def usable_prefix(entry: np.ndarray, trimmable: bool, prompt: np.ndarray) -> int:
    """How many leading prompt tokens an entry can serve (0: none)."""
    p = min(common_prefix(entry, prompt), prompt.size - 1)
    if p <= 0 or (entry.size > p and not trimmable):
        return 0
    return p


def _log_hook_failure(what: str, exc: Exception) -> None:
    # A hook into an actor that has already stopped (engine shutdown) is expected noise.
    level = logging.DEBUG if isinstance(exc, EngineDead) else logging.WARNING
    log.log(level, "[prompt_cache] %s: %r", what, exc)


@dataclass(slots=True, eq=False)
class _Entry:
    ns: str
    tokens: np.ndarray
    cache: Any
    nbytes: int
    trimmable: bool
    last_used: float


class PromptCache:
    def __init__(
        self,
        ops: CacheOps,
        max_bytes: int,
        *,
        now: Callable[[], float] = lambda: 0.0,
        on_spill: SpillHook | None = None,
        on_put: Callable[[list[int], str], None] | None = None,
    ):
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0 (a disabled tier is no PromptCache at all)")
        self.ops = ops
        self.max_bytes = int(max_bytes)
        self.now = now
        self.on_spill = on_spill
        self.on_put = on_put
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "evictions": 0, "spills": 0, "demotions": 0, "superseded": 0}

    def __len__(self) -> int:
        return len(self._entries)

    # ---- lookup ------------------------------------------------------------
    def best(self, tokens: Sequence[int], ns: str) -> tuple[_Entry | None, int]:
        """The entry serving the longest usable prefix (a pure lookup)."""
        prompt = as_tokens(tokens)
        best, best_p, best_trim = None, 0, 0
        for e in self._entries.values():  # later = more recent: ties go to it
            if e.ns != ns:
                continue
            p = usable_prefix(e.tokens, e.trimmable, prompt)
            if p > best_p or (p == best_p and p > 0 and e.tokens.size - p <= best_trim):
                best, best_p, best_trim = e, p, e.tokens.size - p
        return best, best_p

    def peek(self, tokens: Sequence[int], ns: str) -> int:
        """Length ``take`` would serve now, without copying or touching recency."""
        return self.best(tokens, ns)[1]

    def take(self, tokens: Sequence[int], ns: str) -> tuple[Any, int]:
        """A private copy trimmed to the longest usable prefix, and its length;
        ``(None, 0)`` on a miss. The stored entry stays and becomes most recent."""
        entry, p = self.best(tokens, ns)
        if entry is None:
            self.counters["misses"] += 1
            return None, 0
        try:
            clone = self.ops.clone_cache(entry.cache)
            excess = entry.tokens.size - p
            if excess and self.ops.trim_cache(clone, excess) != excess:
                raise RuntimeError(f"trim of {excess} tokens fell short")
        except Exception as exc:  # a cache fault is a miss, never a wrong token
            log.warning("[prompt_cache] take failed, serving a miss: %r", exc)
            self.counters["misses"] += 1
            return None, 0
        self._entries.move_to_end((entry.ns, entry.tokens.tobytes()))
        entry.last_used = self.now()
        self.counters["hits"] += 1
        return clone, p

    def snapshot(self, tokens: Sequence[int], ns: str) -> Any:
        """A private copy of the exact entry ``tokens`` (None if not held)."""
        e = self._entries.get((ns, as_tokens(tokens).tobytes()))
        return None if e is None else self.ops.clone_cache(e.cache)

    # ---- insertion and eviction -------------------------------------------
    def put(self, tokens: Sequence[int], ns: str, cache: Any) -> None:
        """Store a finished row's cache (ownership passes to the tier)."""
        toks = as_tokens(tokens)
        if toks.size == 0 or cache is None:
            return
        try:
            nbytes = int(self.ops.cache_nbytes(cache))
            trimmable = bool(self.ops.cache_trimmable(cache))
        except Exception as exc:
            log.warning("[prompt_cache] put dropped: %r", exc)
            return
        self.counters["puts"] += 1
        key = (ns, toks.tobytes())
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        if trimmable:  # a trimmable entry serves every prefix of itself: ancestors are redundant
            for k, e in list(self._entries.items()):
                if e.ns == ns and e.tokens.size < toks.size and np.array_equal(e.tokens, toks[: e.tokens.size]):
                    del self._entries[k]
                    self.bytes -= e.nbytes
                    self.counters["superseded"] += 1
        entry = _Entry(ns, toks, cache, nbytes, trimmable, self.now())
        if nbytes > self.max_bytes:
            self._evict(entry, "evictions")
        else:
            self._entries[key] = entry
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, victim = self._entries.popitem(last=False)  # never the fresh insert: it fits alone
                self.bytes -= victim.nbytes
                self._evict(victim, "evictions")
        if self.on_put is not None:
            try:
                self.on_put(toks.tolist(), ns)
            except Exception as exc:  # a durability hook must not break serving
                _log_hook_failure("on_put hook failed", exc)

    def _evict(self, entry: _Entry, counter: str) -> None:
        self.counters[counter] += 1
        if self.on_spill is None:
            return
        try:
            self.on_spill(entry.tokens.tolist(), entry.ns, entry.cache)
            self.counters["spills"] += 1
        except Exception as exc:  # the cold tier could not take it: the entry is just dropped
            _log_hook_failure("spill dropped", exc)

    def demote_idle(self, idle_s: float) -> tuple[int, float | None]:
        """Spill entries unused for ``idle_s`` and free them. Returns how many
        were demoted and when the next one falls due (None: nothing left).
        A no-op without a cold tier."""
        if self.on_spill is None or not self._entries:
            return 0, None
        now = self.now()
        n = 0
        for key, e in list(self._entries.items()):
            if now - e.last_used >= idle_s:
                del self._entries[key]
                self.bytes -= e.nbytes
                self._evict(e, "demotions")
                n += 1
        due = min((e.last_used + idle_s for e in self._entries.values()), default=None)
        return n, due

    def clear(self) -> None:
        """Drop everything. Never spills: shutdown must not rewrite the cold tier."""
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes, **self.counters}
