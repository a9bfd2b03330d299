"""The RAM tier (engine.kv.prompt_cache.PromptCache), on the fake GPU's caches and
on mlx-lm's, with the cache operations taken from a backend.

The oracle for a hit is the backend itself: a trimmed copy must hold exactly
the KV a fresh prefill of the served prefix produces.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fake.gpu import FakeBackend
from engine.fake.kv_cache import FakeKVCache
from engine.kv.prompt_cache import PromptCache, usable_prefix

BE = FakeBackend()


def feed(tokens: list[int]) -> list[FakeKVCache]:
    cache = BE.make_cache()
    BE._feed(cache, tokens)
    return cache


def same_kv(a: list[FakeKVCache], b: list[FakeKVCache]) -> bool:
    return all(
        x.offset == y.offset
        and np.array_equal(x.keys[..., : x.offset, :], y.keys[..., : y.offset, :])
        and np.array_equal(x.values[..., : x.offset, :], y.values[..., : y.offset, :])
        for x, y in zip(a, b)
    )


class FrozenKV(FakeKVCache):
    """A cache that cannot be trimmed (a wrapped ring, SSM state)."""

    def is_trimmable(self) -> bool:
        return False

    def copy(self) -> FrozenKV:
        c = FrozenKV()
        c.keys, c.values, c.offset = self.keys.copy(), self.values.copy(), self.offset
        return c


def frozen(tokens: list[int]) -> list[FakeKVCache]:
    out = []
    for layer in feed(tokens):
        f = FrozenKV()
        f.keys, f.values, f.offset = layer.keys, layer.values, layer.offset
        out.append(f)
    return out


def per_token_bytes() -> int:
    return BE.cache_nbytes(feed([1]))


class Spills:
    def __init__(self) -> None:
        self.got: list[tuple[list[int], str, object]] = []

    def __call__(self, tokens, ns, cache) -> None:
        self.got.append((tokens, ns, cache))


def make(cap_tokens: int = 1000, **kw) -> PromptCache:
    return PromptCache(BE, cap_tokens * per_token_bytes(), **kw)


A = list(range(10, 30))  # 20 tokens


def test_longest_usable_prefix_wins_and_the_donor_stays():
    pc = make()
    pc.put(A[:8], "", feed(A[:8]))
    pc.put(A, "", feed(A))  # supersedes A[:8] (trimmable)
    prompt = A[:15] + [999, 998]
    cache, n = pc.take(prompt, "")
    assert n == 15 and same_kv(cache, feed(A[:15]))
    cache2, n2 = pc.take(prompt, "")
    assert n2 == 15 and same_kv(cache2, feed(A[:15]))  # the stored entry was not trimmed
    assert pc.stats()["entries"] == 1 and pc.stats()["hits"] == 2


def test_exact_hit_leaves_one_token_to_feed():
    pc = make()
    pc.put(A, "", feed(A))
    cache, n = pc.take(A, "")
    assert n == len(A) - 1 and same_kv(cache, feed(A[:-1]))


def test_continuing_a_copy_never_touches_the_entry():
    pc = make()
    pc.put(A, "", feed(A))
    cache, n = pc.take(A[:10] + [5, 6, 7], "")
    BE._feed(cache, [5, 6, 7, 8])
    again, _ = pc.take(A + [1], "")
    assert same_kv(again, feed(A))


def test_untrimmable_entry_serves_only_as_a_whole_prefix():
    pc = make()
    pc.put(A, "", frozen(A))
    assert pc.take(A[:10] + [1], "") == (None, 0)  # would need a trim
    assert pc.take(A, "") == (None, 0)  # exact: would need a trim of one
    cache, n = pc.take(A + [1, 2], "")
    assert n == len(A) and same_kv(cache, feed(A))
    assert pc.stats()["misses"] == 2


def test_byte_cap_evicts_least_recently_used_and_spills_it():
    spills = Spills()
    pc = make(cap_tokens=50, on_spill=spills)
    x, y, z = [1] + A, [2] + A, [3] + A  # 21 tokens each
    pc.put(x, "", feed(x))
    pc.put(y, "", feed(y))
    assert pc.take(x + [0], "")[1] == 21  # x becomes most recent
    pc.put(z, "", feed(z))
    assert [s[0] for s in spills.got] == [y]
    assert same_kv(spills.got[0][2], feed(y))  # the evictee's own cache, handed over
    assert pc.bytes == 42 * per_token_bytes() <= pc.max_bytes
    assert pc.peek(x + [0], "") == 21 and pc.peek(z + [0], "") == 21 and pc.peek(y + [0], "") == 0


def test_bytes_count_tokens_in_use_not_the_buffer():
    pc = make()
    cache = feed(A)
    assert cache[0].keys.shape[2] == 256  # the buffer is step-sized
    pc.put(A, "", cache)
    assert pc.bytes == len(A) * per_token_bytes()


def test_supersede_only_for_trimmable_entries_and_never_across_namespaces():
    pc = make()
    pc.put(A[:5], "", feed(A[:5]))
    pc.put(A[:5], "other", feed(A[:5]))
    pc.put(A[:10], "", frozen(A[:10]))  # untrimmable: cannot serve A[:5] + x, so A[:5] stays
    assert pc.stats()["entries"] == 3
    pc.put(A, "", feed(A))  # trimmable: both ancestors in "" go, "other" stays
    assert pc.stats()["entries"] == 2 and pc.stats()["superseded"] == 2
    assert pc.peek(A[:5] + [1], "other") == 5


def test_exact_duplicate_replaces():
    pc = make()
    pc.put(A, "", feed(A))
    pc.put(A, "", feed(A))
    assert pc.stats()["entries"] == 1 and pc.bytes == len(A) * per_token_bytes()


def test_namespaces_are_isolated():
    pc = make()
    pc.put(A, "alice", feed(A))
    assert pc.take(A + [1], "bob") == (None, 0)
    assert pc.take(A + [1], "alice")[1] == len(A)


def test_oversized_entry_is_spilled_not_stored():
    spills = Spills()
    pc = make(cap_tokens=10, on_spill=spills)
    pc.put(A, "", feed(A))
    assert pc.stats()["entries"] == 0 and pc.bytes == 0
    assert [s[0] for s in spills.got] == [A]


def test_clear_never_spills():
    spills = Spills()
    pc = make(on_spill=spills)
    pc.put(A, "", feed(A))
    pc.clear()
    assert spills.got == [] and pc.stats()["entries"] == 0 and pc.bytes == 0


def test_a_failing_spill_hook_drops_the_entry_and_keeps_serving():
    def boom(tokens, ns, cache):
        raise RuntimeError("cold tier inbox full")

    pc = make(cap_tokens=25, on_spill=boom)
    pc.put([1] + A, "", feed([1] + A))
    pc.put([2] + A, "", feed([2] + A))
    assert pc.stats()["entries"] == 1 and pc.stats()["evictions"] == 1 and pc.stats()["spills"] == 0
    assert pc.take([2] + A + [0], "")[1] == 21


def test_demote_idle_spills_idle_entries_and_reports_the_next_due():
    now = [0.0]
    spills = Spills()
    pc = make(now=lambda: now[0], on_spill=spills)
    pc.put([1] + A, "", feed([1] + A))
    now[0] = 100.0
    pc.put([2] + A, "", feed([2] + A))
    now[0] = 250.0
    assert pc.demote_idle(300.0) == (0, 300.0)
    now[0] = 320.0
    assert pc.demote_idle(300.0) == (1, 400.0)
    assert [s[0] for s in spills.got] == [[1] + A]
    now[0] = 390.0
    pc.take([2] + A + [0], "")  # a use pushes the due time out
    assert pc.demote_idle(300.0) == (0, 690.0)
    assert pc.stats()["demotions"] == 1 and pc.stats()["entries"] == 1


def test_demote_idle_without_a_cold_tier_is_a_no_op():
    now = [0.0]
    pc = make(now=lambda: now[0])
    pc.put(A, "", feed(A))
    now[0] = 1e6
    assert pc.demote_idle(1.0) == (0, None)
    assert pc.stats()["entries"] == 1


def test_on_put_fires_and_its_errors_are_contained():
    seen = []

    def hook(tokens, ns):
        seen.append((tokens, ns))
        raise RuntimeError("durability hiccup")

    pc = make(on_put=hook)
    pc.put(A, "n", feed(A))
    assert seen == [(A, "n")] and pc.stats()["entries"] == 1


def test_snapshot_is_the_exact_entry_which_a_take_never_writes():
    """A snapshot shares the stored entry (the SSD writer only reads it): no
    copy on the event loop. That is safe because nothing writes an entry after
    put: a row continues in what take() handed it, never in the entry."""
    pc = make()
    stored = feed(A)
    pc.put(A, "", stored)
    snap = pc.snapshot(A, "")
    assert snap is stored and pc.snapshot(A[:-1], "") is None
    taken, n = pc.take(A[:-2] + [9, 9], "")
    BE._feed(taken, [1, 2, 3])  # the row that took a prefix decodes on
    assert n == len(A) - 2 and same_kv(pc.snapshot(A, ""), feed(A))


@settings(max_examples=60, deadline=None)
@given(
    entries=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14),
)
def test_take_serves_the_brute_force_best_prefix_with_exact_kv(entries, prompt):
    pc = make(cap_tokens=10_000)
    for e in entries:
        pc.put(e, "", feed(e))
    kept = [e for e in entries if not any(len(o) > len(e) and o[: len(e)] == e for o in entries)]

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    want = max((min(lcp(e, prompt), len(prompt) - 1) for e in kept), default=0)
    cache, n = pc.take(prompt, "")
    assert n == max(want, 0)
    if n:
        assert same_kv(cache, feed(prompt[:n]))
    else:
        assert cache is None


def test_usable_prefix_rule():
    e = np.array([1, 2, 3, 4])
    assert usable_prefix(e, True, np.array([1, 2, 3, 4])) == 3
    assert usable_prefix(e, False, np.array([1, 2, 3, 4])) == 0
    assert usable_prefix(e, False, np.array([1, 2, 3, 4, 5])) == 4
    assert usable_prefix(e, True, np.array([1, 2, 9])) == 2
    assert usable_prefix(e, True, np.array([1])) == 0


# ---------------------------------------------------------------------------
# The same tier on mlx-lm caches, with mlx-lm's own cache operations.


class MlxOps:
    """Backend cache ops for lists of mlx-lm caches (what an MLX backend provides)."""

    def cache_nbytes(self, cache):
        from engine.kv.kvfile import cache_bytes

        return cache_bytes(cache)

    def prefix_view(self, cache, n):
        from engine.mlx.cache_views import prefix_view

        return prefix_view(cache, n)

    def trim_cache(self, cache, n):
        from mlx_lm.models.cache import trim_prompt_cache

        return trim_prompt_cache(cache, n)

    def cache_trimmable(self, cache):
        from mlx_lm.models.cache import can_trim_prompt_cache

        return can_trim_prompt_cache(cache)


def test_mlx_caches_through_backend_ops():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    def kv(n):
        mx.random.seed(n)
        c = KVCache()
        k = mx.random.normal((1, 2, n, 8))
        c.update_and_fetch(k, k + 1)
        return [c]

    ops = MlxOps()
    stored = kv(40)
    pc = PromptCache(ops, 10 * ops.cache_nbytes(stored))
    assert ops.cache_nbytes(stored) == 2 * 2 * 40 * 8 * 4 < stored[0].nbytes  # tokens in use, not the buffer
    tokens = list(range(40))
    pc.put(tokens, "", stored)
    cache, n = pc.take(tokens[:25] + [7], "")
    assert n == 25 and cache[0].offset == 25 and stored[0].offset == 40
    k_before = np.array(stored[0].keys[..., :40, :])
    cache[0].update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    assert np.array_equal(np.array(stored[0].keys[..., :40, :]), k_before)  # the donor is untouched

    ring = RotatingKVCache(max_size=8, keep=2)
    ring.update_and_fetch(mx.zeros((1, 2, 12, 8)), mx.zeros((1, 2, 12, 8)))  # wrapped: untrimmable
    pc.put(list(range(100, 112)), "", [ring])
    assert pc.take(list(range(100, 106)) + [0], "") == (None, 0)
    assert pc.take(list(range(100, 113)), "")[1] == 12


def _old_best(pc: PromptCache, tokens: list[int], ns: str) -> tuple[object, int]:
    """The linear scan ``best`` replaced (oldest to newest, ties to the later)."""
    prompt = np.asarray(tokens, dtype=np.int64)
    best, best_p, best_trim = None, 0, 0
    for e in pc._entries.values():
        if e.ns != ns:
            continue
        p = usable_prefix(e.tokens, e.trimmable, prompt)
        if p > best_p or (p == best_p and p > 0 and e.tokens.size - p <= best_trim):
            best, best_p, best_trim = e, p, e.tokens.size - p
    return best, best_p


def test_indexed_lookup_picks_what_the_linear_scan_picked():
    """The prefix index (bisect over sorted token bytes) against the scan it
    replaced: a 3-token alphabet makes shared prefixes, ties at the
    ``len(prompt) - 1`` cap and equal candidates common; rigid entries,
    two namespaces, recency shuffles, supersedes and evictions included."""
    import random

    from engine.kv.prompt_cache import PrefixIndex

    rng = random.Random(7)
    pc = PromptCache(BE, 40 * per_token_bytes())
    seqs = lambda: [rng.randrange(3) for _ in range(rng.randrange(1, 10))]  # noqa: E731
    for _ in range(3000):
        toks, ns = seqs(), rng.choice(["", "x"])
        r = rng.random()
        if r < 0.3:
            pc.put(toks, ns, frozen(toks) if rng.random() < 0.2 else feed(toks))
        elif r < 0.5:
            pc.take(toks, ns)
        got, want = pc.best(toks, ns), _old_best(pc, toks, ns)
        assert got[1] == want[1] and got[0] is want[0], (toks, ns)
    # holds-style queries: some trimmable entry starts with the key
    idx, entries = PrefixIndex(), []
    for _ in range(200):
        toks = np.asarray(seqs() if rng.random() < 0.95 else [], dtype=np.int64)
        entries.append(toks)
        idx.add("", toks.tobytes(), toks, True)
    for _ in range(500):
        q = np.asarray(seqs(), dtype=np.int64)
        brute = any(e.size >= q.size and np.array_equal(e[: q.size], q) for e in entries)
        assert idx.extending("", q.tobytes()) == brute
        got = sorted(e.tobytes() for e in idx.prefixes_of("", q.tobytes()))
        want = sorted(e.tobytes() for e in entries if e.size < q.size and np.array_equal(e, q[: e.size]))
        assert got == want


def test_demote_idle_stops_at_the_first_entry_in_use_and_scans_after_a_clock_went_back():
    """The idle entries are the oldest used while the clock never goes back:
    demote_idle stops at the first entry in use. Against a scan of every
    entry, over random puts, takes and sweeps, with a clock that only moves
    forward and with one that sometimes goes back (then it scans)."""
    import random

    for back in (False, True):
        rng = random.Random(3 if back else 4)
        now = [0.0]
        got, want = Spills(), Spills()
        pc, ref = make(now=lambda: now[0], on_spill=got), make(now=lambda: now[0], on_spill=want)

        def scan(idle_s):  # the full scan demote_idle does
            n = 0
            for key, e in list(ref._entries.items()):
                if now[0] - e.last_used >= idle_s:
                    ref._drop(key)
                    ref.bytes -= e.nbytes
                    ref._evict(e, "demotions")
                    n += 1
            return n, min((e.last_used + idle_s for e in ref._entries.values()), default=None)

        for _ in range(400):
            now[0] += rng.choice([0.0, 1.0, 7.5, 30.0]) - (rng.choice([0.0, 0.0, 0.0, 20.0]) if back else 0.0)
            toks = [rng.randrange(4) for _ in range(rng.randrange(2, 12))]
            op = rng.random()
            if op < 0.45:
                pc.put(toks, "", feed(toks))
                ref.put(toks, "", feed(toks))
            elif op < 0.8:
                assert pc.take(toks, "")[1] == ref.take(toks, "")[1]
            else:
                idle = rng.choice([5.0, 20.0, 60.0])
                assert pc.demote_idle(idle) == scan(idle)
            assert [(k, e.last_used) for k, e in pc._entries.items()] == [
                (k, e.last_used) for k, e in ref._entries.items()
            ]
        assert [s[0] for s in got.got] == [s[0] for s in want.got] and len(got.got) > 10
        assert pc._use_ordered is not back
