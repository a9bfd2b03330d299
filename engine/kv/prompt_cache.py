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
(MLX objects only; the fake GPU's numpy caches and a backend's own copy are
out of reach), counts ``nbytes`` of the 256-step buffer rather than the tokens
in use, does not refresh recency on a fetch, has no spill hook, returns an
empty remainder on an exact hit, and ``PromptTrie.search`` reports only the
shortest extension past the divergence point, ignoring trimmability, so it can
miss a usable entry. The cache operations come from the backend port
(``cache_nbytes``/``prefix_view``/``trim_cache``/``cache_trimmable``, which on
MLX are mlx-lm's ``trim_prompt_cache``/``can_trim_prompt_cache``); the lookup
goes through ``PrefixIndex`` (a bisect over the entries' sorted token bytes,
shared with the cold tier's index), not a scan of every entry: a 10,000-request
simulation holds hundreds of entries per tier.

Sessions (``session``: a client's ``prompt_cache_key``, docs/agent-api.md): an
agent's next turn extends the prompt of its last one, but between the two the
agent runs a tool, and meanwhile other traffic can push the session's entry
out of a plain LRU. An entry a live session used last (one of its ``keep``
most recent, a session being live until ``idle_s`` after its last request) is
therefore evicted only after every other entry: entries of idle sessions and
of requests without a key go first, oldest first; when only live sessions'
entries are left, plain LRU again. The key never changes what a lookup finds
(entries are shared across sessions, a system prompt serves everyone): only
the order of eviction.
"""

from __future__ import annotations

import logging
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.errors import EngineDead

log = logging.getLogger("ember.prompt_cache")


class CacheOps(Protocol):
    """The slice of ``engine.ports.Backend`` the tiers need."""

    def cache_nbytes(self, cache: Any) -> int: ...

    def prefix_view(self, cache: Any, n: int) -> Any: ...

    def trim_cache(self, cache: Any, n: int) -> int: ...

    def cache_trimmable(self, cache: Any) -> bool: ...


SpillHook = Callable[[list[int], str, Any], None]
"""``(tokens, ns, cache)``: takes ownership of an evicted entry; must not block."""


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(tokens, list):  # the same array, faster than asarray for a list of ints (docs/sims.md)
        return np.fromiter(tokens, np.int64, len(tokens))
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def session_key(ns: str, session: str) -> str:
    """A session's name within namespace ``ns``: two tenants that send the same
    ``prompt_cache_key`` are two sessions (one cannot push the other's recent
    entries out of its keep). The empty namespace keeps the bare name."""
    return f"{ns}\0{session}" if ns else session


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """``as_tokens(tokens).tobytes()`` (native int64), the index key; a list
    goes through ``array('q')``, several times faster than numpy for a list."""
    if isinstance(tokens, list):
        return array("q", tokens).tobytes()
    return as_tokens(tokens).tobytes()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    if m == 0:
        return 0
    # the first difference by argmax, which stops at the first True of a bool
    # array: no index array of every difference, no np.* wrappers
    diff = a[:m] != b[:m]
    i = int(diff.argmax())
    return i if diff[i] else m


def usable_prefix(entry: np.ndarray, trimmable: bool, prompt: np.ndarray) -> int:
    """How many leading prompt tokens an entry can serve (0: none)."""
    p = min(common_prefix(entry, prompt), prompt.size - 1)
    if p <= 0 or (entry.size > p and not trimmable):
        return 0
    return p


class PrefixIndex:
    """Entries by namespace, for the longest-usable-prefix lookup without a scan.

    Trimmable entries sit in one list per namespace, sorted by their tokens'
    bytes (any fixed-width encoding: ``tokens.tobytes()``). For strings in
    lexicographic order, the common prefix with a query can only shrink moving
    away from the query's insertion point, so the longest common prefix is at
    one of its two neighbours and the entries sharing at least ``t`` tokens
    form one run around it: a lookup is a bisect plus that run. Entries that
    cannot be trimmed serve only as exact prefixes of a prompt and are kept
    apart, scanned every time (no such cache on the fake GPU or plain KV
    caches; an SSM or a wrapped ring would be one). ``rigid`` and ``run``
    return every entry that may win; the owner applies its own rule to them.
    """

    __slots__ = ("_keys", "_vals", "_rigid")

    def __init__(self) -> None:
        self._keys: dict[str, list[bytes]] = {}
        self._vals: dict[str, list[Any]] = {}
        self._rigid: dict[str, dict[int, Any]] = {}  # ns -> id(entry) -> entry

    def clear(self) -> None:
        self._keys.clear()
        self._vals.clear()
        self._rigid.clear()

    def add(self, ns: str, key: bytes, entry: Any, trimmable: bool) -> None:
        if not trimmable:
            self._rigid.setdefault(ns, {})[id(entry)] = entry
            return
        keys, vals = self._keys.setdefault(ns, []), self._vals.setdefault(ns, [])
        i = bisect_left(keys, key)
        keys.insert(i, key)
        vals.insert(i, entry)

    def remove(self, ns: str, key: bytes, entry: Any, trimmable: bool) -> None:
        if not trimmable:
            del self._rigid[ns][id(entry)]
            return
        keys, vals = self._keys[ns], self._vals[ns]
        i = bisect_left(keys, key)
        while vals[i] is not entry:  # equal keys (a duplicate file) sit side by side
            i += 1
        del keys[i], vals[i]

    def run(self, ns: str, prompt: np.ndarray) -> tuple[list[Any], int]:
        """The trimmable entries that may serve the longest usable prefix of
        ``prompt`` (int64 tokens, keyed like the entries: those sharing the
        most tokens with it, capped at ``len(prompt) - 1``, the usable limit,
        so every entry tied at the cap is in) and the usable prefix ``t``
        every one of them serves: the longest common prefix with any entry is
        at a neighbour of the prompt's place, so each entry of the run shares
        at least ``t`` = min(that, the cap) tokens and none shares more than the
        cap allows, i.e. ``usable_prefix`` is ``t`` for all of them, without a
        comparison each. ``([], 0)`` when no trimmable entry serves any token."""
        keys = self._keys.get(ns)
        cap = prompt.size - 1
        if not keys or cap <= 0:
            return [], 0
        vals = self._vals[ns]
        i = bisect_left(keys, prompt.tobytes())
        best = 0
        for j in (i - 1, i):
            if 0 <= j < len(keys):
                best = max(best, common_prefix(vals[j].tokens, prompt))
        t = min(best, cap)
        if t <= 0:
            return [], 0
        head = prompt[:t].tobytes()
        lo, hi = i, i
        while lo > 0 and keys[lo - 1].startswith(head):
            lo -= 1
        while hi < len(keys) and keys[hi].startswith(head):
            hi += 1
        return vals[lo:hi], t

    def closest(self, ns: str, prompt: np.ndarray) -> tuple[Any, int]:
        """The entry sharing the most leading tokens with ``prompt`` and how
        many (``(None, 0)``: none shares any), for explaining a miss
        (engine.kv.cache_miss), not for serving: no usable-prefix cap, no
        trimmability rule. Among entries tied at that length, one that ends
        there (the prompt extends it: no divergence) wins. The same bisect as
        ``run``: the longest common prefix is at a neighbour of the prompt's
        place, and an entry that ends there is found by one more bisect."""
        best, n = None, 0
        for e in self._rigid.get(ns, {}).values():  # kept apart, scanned (see the class)
            m = common_prefix(e.tokens, prompt)
            if m > n or (m == n and m > 0 and e.tokens.size == m):
                best, n = e, m
        keys = self._keys.get(ns)
        if keys:
            vals = self._vals[ns]
            i = bisect_left(keys, prompt.tobytes())
            for j in (i - 1, i):
                if 0 <= j < len(keys) and (m := common_prefix(vals[j].tokens, prompt)) > n:
                    best, n = vals[j], m
            if best is not None and best.tokens.size > n:
                head = prompt[:n].tobytes()
                k = bisect_left(keys, head)
                if k < len(keys) and keys[k] == head:
                    best = vals[k]
        return (best, n) if n > 0 else (None, 0)

    def extending(self, ns: str, key: bytes) -> bool:
        """True if some trimmable entry's tokens start with ``key``'s (equal or longer)."""
        keys = self._keys.get(ns)
        if not keys:
            return False
        i = bisect_left(keys, key)
        return i < len(keys) and keys[i].startswith(key)

    def prefixes_of(self, ns: str, key: bytes) -> list[Any]:
        """Entries whose tokens are a strict prefix of ``key``'s (rigid ones
        included: ``tokens`` is read for those)."""
        out = [
            e for e in self._rigid.get(ns, {}).values() if len(k := e.tokens.tobytes()) < len(key) and key.startswith(k)
        ]
        keys = self._keys.get(ns)
        if not keys:
            return out
        vals = self._vals[ns]
        # Walk down from ``key``'s place. Every key between a prefix p of
        # ``probe`` and ``probe`` starts with p, so the nearest smaller key k
        # either is such a prefix, or bounds them by its common prefix with
        # ``probe``: jump to that (strictly shorter) probe. A few bisects,
        # not a pass over every key.
        probe, hi = key, bisect_left(keys, key)
        while hi > 0:
            k = keys[hi - 1]
            if probe.startswith(k):
                j = hi - 1
                while j >= 0 and keys[j] == k:  # every entry with that key
                    out.append(vals[j])
                    j -= 1
                probe, hi = k, j + 1
                continue
            m = common_prefix(np.frombuffer(k, np.int64), np.frombuffer(probe, np.int64))
            probe = probe[: 8 * m]
            hi = bisect_right(keys, probe)
        return out

    def rigid(self, ns: str) -> list[Any]:
        return list(self._rigid.get(ns, {}).values())


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
    order: int = 0  # position in recency (higher: more recent); ties in ``best`` go to it
    session: str | None = None  # the live session this entry is one of the recent entries of (``Sessions``)


class Sessions:
    """The entries each session used last: at most ``keep`` per session, and
    when it last sent a request. Sync, owned by the ``PromptCache``; its size
    is bounded by the entries (a session with none left is forgotten)."""

    __slots__ = ("keep", "idle_s", "_recent", "_seen")

    def __init__(self, keep: int, idle_s: float):
        self.keep = keep
        self.idle_s = idle_s
        self._recent: dict[str, OrderedDict[int, _Entry]] = {}  # session -> id(entry) -> entry, oldest first
        self._seen: dict[str, float] = {}  # session -> its last take or put

    def __len__(self) -> int:
        return len(self._recent)

    def touch(self, session: str, entry: _Entry, now: float) -> None:
        """``session`` used ``entry`` at ``now`` (it becomes that session's most recent)."""
        if entry.session != session:
            self.forget(entry)
        recent = self._recent.setdefault(session, OrderedDict())
        recent[id(entry)] = entry
        recent.move_to_end(id(entry))
        entry.session = session
        self._seen[session] = now
        while len(recent) > self.keep:
            _, old = recent.popitem(last=False)
            old.session = None

    def forget(self, entry: _Entry) -> None:
        """``entry`` left the tier (or another session took it over)."""
        s, entry.session = entry.session, None
        if s is None or (recent := self._recent.get(s)) is None:
            return
        recent.pop(id(entry), None)
        if not recent:
            del self._recent[s], self._seen[s]

    def live(self, entry: _Entry, now: float) -> bool:
        """True if ``entry`` is a recent entry of a session seen within ``idle_s``."""
        s = entry.session
        return s is not None and now - self._seen[s] < self.idle_s

    def clear(self) -> None:
        self._recent.clear()
        self._seen.clear()


class PromptCache:
    def __init__(
        self,
        ops: CacheOps,
        max_bytes: int,
        *,
        now: Callable[[], float] = lambda: 0.0,
        on_spill: SpillHook | None = None,
        on_put: Callable[[list[int], str], None] | None = None,
        session_idle_s: float = 300.0,
        session_keep: int = 4,
    ):
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0 (a disabled tier is no PromptCache at all)")
        self.ops = ops
        self.max_bytes = int(max_bytes)
        self.now = now
        self.on_spill = on_spill
        self.on_put = on_put
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()  # oldest use first
        self._index = PrefixIndex()
        # 300 s: the prompt-cache lifetime OpenAI and Anthropic give a session
        # between requests; 4 entries: an agent's main turn plus the side and
        # subagent requests that carry the same key (Claude Code's session id)
        self.sessions = Sessions(session_keep, session_idle_s)
        self._order = 0
        # ``_entries`` is in order of last use and ``last_used`` is the clock at
        # that use, so while the clock never went back (the loop's never does)
        # last_used never decreases along ``_entries`` and the idle entries are
        # a prefix of it (``demote_idle``)
        self._latest = float("-inf")
        self._use_ordered = True
        self.bytes = 0
        self.counters = {
            "hits": 0,
            "misses": 0,
            "puts": 0,
            "evictions": 0,
            "spills": 0,
            "demotions": 0,
            "superseded": 0,
            "session_kept": 0,  # evictions that passed over a live session's entry for another one
        }

    def __len__(self) -> int:
        return len(self._entries)

    # ---- lookup ------------------------------------------------------------
    def best(self, tokens: Sequence[int] | np.ndarray, ns: str) -> tuple[_Entry | None, int]:
        """The entry serving the longest usable prefix (a pure lookup)."""
        prompt = as_tokens(tokens)
        best, best_rank = None, (0, 0, 0)
        for e in self._index.rigid(ns):
            p = usable_prefix(e.tokens, e.trimmable, prompt)
            rank = (p, p - e.tokens.size, e.order)  # longest, least to trim, most recent
            if p > 0 and rank > best_rank:
                best, best_rank = e, rank
        run, p = self._index.run(ns, prompt)  # every one of them serves p (> 0) tokens
        for e in run:
            rank = (p, p - e.tokens.size, e.order)
            if rank > best_rank:
                best, best_rank = e, rank
        return best, best_rank[0]

    def closest(self, tokens: Sequence[int] | np.ndarray, ns: str) -> tuple[np.ndarray | None, int]:
        """The tokens of the entry sharing the longest common prefix with
        ``tokens``, and its length (``PrefixIndex.closest``; a pure lookup)."""
        e, n = self._index.closest(ns, as_tokens(tokens))
        return (None, 0) if e is None else (e.tokens, n)

    def _insert(self, key: tuple[str, bytes], entry: _Entry) -> None:
        self._order += 1
        entry.order = self._order
        self._entries[key] = entry
        self._index.add(entry.ns, key[1], entry, entry.trimmable)

    def _drop(self, key: tuple[str, bytes]) -> _Entry | None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._index.remove(e.ns, key[1], e, e.trimmable)
            self.sessions.forget(e)
        return e

    def peek(self, tokens: Sequence[int] | np.ndarray, ns: str) -> int:
        """Length ``take`` would serve now, without copying or touching recency."""
        return self.best(tokens, ns)[1]

    def take(
        self, tokens: Sequence[int] | np.ndarray, ns: str, min_len: int = 1, session: str | None = None
    ) -> tuple[Any, int]:
        """A private cache of the longest usable prefix, and its length;
        ``(None, 0)`` on a miss or a prefix shorter than ``min_len``. The
        stored entry stays and becomes most recent (and ``session``'s). The private cache is the
        backend's ``prefix_view``: on MLX lazy slices that the row's first
        forward copies on the MLX thread, not a copy made here on the loop."""
        entry, p = self.best(tokens, ns)
        if entry is None or p < min_len:
            self.counters["misses"] += 1
            return None, 0
        try:
            view = self.ops.prefix_view(entry.cache, p)
        except Exception as exc:  # a cache fault is a miss, never a wrong token
            log.warning("[prompt_cache] take failed, serving a miss: %r", exc)
            self.counters["misses"] += 1
            return None, 0
        self._entries.move_to_end((entry.ns, entry.tokens.tobytes()))
        self._order += 1
        entry.order = self._order
        entry.last_used = self._stamp()
        if session is not None:
            self.sessions.touch(session_key(ns, session), entry, entry.last_used)
        self.counters["hits"] += 1
        return view, p

    def snapshot(self, tokens: Sequence[int], ns: str) -> Any:
        """The cache of the exact entry ``tokens`` (None if not held), for the
        SSD writer to read on the device. Not a copy: an entry is never written
        after ``put`` (``take`` hands out views cut into new cache objects, or
        copies; eviction hands the entry over), so the writer may read it
        while it stays here. A copy made here would run on the event loop and
        stall every stream (measured in docs/durability.md, "Results")."""
        e = self._entries.get((ns, token_bytes(tokens)))
        return None if e is None else e.cache

    # ---- insertion and eviction -------------------------------------------
    def put(self, tokens: Sequence[int], ns: str, cache: Any, session: str | None = None) -> None:
        """Store a finished row's cache (ownership passes to the tier); with
        ``session``, it becomes that session's most recent entry."""
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
        old = self._drop(key)
        if old is not None:
            self.bytes -= old.nbytes
        if trimmable:  # a trimmable entry serves every prefix of itself: ancestors are redundant
            for e in self._index.prefixes_of(ns, key[1]):
                self.bytes -= self._drop((ns, e.tokens.tobytes())).nbytes  # type: ignore[union-attr]
                self.counters["superseded"] += 1
        entry = _Entry(ns, toks, cache, nbytes, trimmable, self._stamp())
        if nbytes > self.max_bytes:
            self._evict(entry, "evictions")
        else:
            self._insert(key, entry)
            if session is not None:
                self.sessions.touch(session_key(ns, session), entry, entry.last_used)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                victim = self._drop(self._victim())  # the fresh insert only if all the rest is kept for sessions
                self.bytes -= victim.nbytes  # type: ignore[union-attr]
                self._evict(victim, "evictions")  # type: ignore[arg-type]
        if self.on_put is not None:
            try:
                self.on_put(toks.tolist(), ns)
            except Exception as exc:  # a durability hook must not break serving
                _log_hook_failure("on_put hook failed", exc)

    def _victim(self) -> tuple[str, bytes]:
        """The key to evict: the least recently used entry no live session
        holds; the least recently used of all when every entry is so held."""
        oldest = next(iter(self._entries))
        if not len(self.sessions):  # no session anywhere: plain LRU, no scan
            return oldest
        now = self.now()
        for key, e in self._entries.items():
            if not self.sessions.live(e, now):
                if key != oldest:
                    self.counters["session_kept"] += 1
                return key
        return oldest

    def _evict(self, entry: _Entry, counter: str) -> None:
        self.counters[counter] += 1
        if self.on_spill is None:
            return
        try:
            self.on_spill(entry.tokens.tolist(), entry.ns, entry.cache)
            self.counters["spills"] += 1
        except Exception as exc:  # the cold tier could not take it: the entry is just dropped
            _log_hook_failure("spill dropped", exc)

    def _stamp(self) -> float:
        """``now()`` for a use; notes a clock that went back."""
        t = self.now()
        if t < self._latest:
            self._use_ordered = False
        else:
            self._latest = t
        return t

    def demote_idle(self, idle_s: float) -> tuple[int, float | None]:
        """Spill entries unused for ``idle_s`` and free them. Returns how many
        were demoted and when the next one falls due (None: nothing left).
        A no-op without a cold tier."""
        if self.on_spill is None or not self._entries:
            return 0, None
        now = self.now()
        n = 0
        if self._use_ordered:
            # The idle entries are the oldest used (see ``__init__``): stop at
            # the first one used since, which is also the next one due (the
            # scan below, without a pass over every entry at each idle sweep).
            entries = self._entries
            while entries:
                key, e = next(iter(entries.items()))
                if not now - e.last_used >= idle_s:
                    return n, e.last_used + idle_s
                self._drop(key)
                self.bytes -= e.nbytes
                self._evict(e, "demotions")
                n += 1
            return n, None
        for key, e in list(self._entries.items()):
            if now - e.last_used >= idle_s:
                self._drop(key)
                self.bytes -= e.nbytes
                self._evict(e, "demotions")
                n += 1
        due = min((e.last_used + idle_s for e in self._entries.values()), default=None)
        return n, due

    def clear(self) -> None:
        """Drop everything. Never spills: shutdown must not rewrite the cold tier."""
        self._entries.clear()
        self._index.clear()
        self.sessions.clear()
        self.bytes = 0

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "sessions": len(self.sessions),
            **self.counters,
        }
