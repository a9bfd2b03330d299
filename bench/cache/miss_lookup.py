"""What explaining a miss costs at admission, on a RAM tier holding many
entries: before, the Scheduler's ``PromptCache.take`` of the prompt as a list;
after, the prompt made an int64 array once (``Row.lookup_tokens``), ``take`` of
it, and the divergence lookup it adds for a prompt the cache does not serve
whole (``SchedulerCore._divergence``: ``closest`` and ``closest_miss``).

    python -m bench.cache.miss_lookup --entries 2000 --tokens 8000

The entries are agent conversations: ``--entries`` sequences of ``--tokens``
tokens sharing a system-prompt head, each its own session after that. The
prompts looked up are each entry's conversation with a message edited half
way (a real miss: the lookup runs). The caches are placeholders: the cost
measured is the lookup's, not a copy of KV (``take``'s ``prefix_view`` is a
no-op here)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from engine.kv.cache_miss import closest_miss
from engine.kv.prompt_cache import PromptCache, as_tokens


class _Ops:
    def cache_nbytes(self, cache: Any) -> int:
        return 1

    def prefix_view(self, cache: Any, n: int) -> Any:
        return cache

    def trim_cache(self, cache: Any, n: int) -> int:
        return n

    def cache_trimmable(self, cache: Any) -> bool:
        return True


def run(entries: int, tokens: int, head: int, lookups: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50_000, head).tolist()
    convs = [shared + rng.integers(0, 50_000, tokens - head).tolist() for _ in range(entries)]
    pc = PromptCache(_Ops(), 1 << 40)
    for c in convs:
        pc.put(c, "", object())
    prompts = []
    for i in range(lookups):
        c = list(convs[i % entries])
        at = head + (tokens - head) // 2
        c[at] = 50_001  # an edited message half way through
        prompts.append(c + [7, 8, 9])
    before, after, lookup = [], [], []
    for p in prompts:
        t0 = time.perf_counter()
        pc.take(p, "")
        t1 = time.perf_counter()
        arr = as_tokens(p)
        pc.take(arr, "")
        t2 = time.perf_counter()
        miss = closest_miss(p, [("ram", *pc.closest(arr, ""))])
        t3 = time.perf_counter()
        assert miss is not None and miss.diverged_at == head + (tokens - head) // 2
        before.append(t1 - t0)
        after.append(t3 - t1)
        lookup.append(t3 - t2)
    med = statistics.median
    return {"before_us": med(before) * 1e6, "after_us": med(after) * 1e6, "lookup_us": med(lookup) * 1e6}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--head", type=int, default=2000, help="tokens every entry shares (a system prompt)")
    ap.add_argument("--lookups", type=int, default=500)
    a = ap.parse_args(argv)
    r = run(a.entries, a.tokens, a.head, a.lookups)
    print(f"{a.entries} entries of {a.tokens} tokens ({a.head} shared), {a.lookups} lookups, medians:")
    print(f"  before: take(list)                       {r['before_us']:8.1f} us")
    print(f"  after:  array once, take, miss lookup    {r['after_us']:8.1f} us")
    print(f"          of which the miss lookup         {r['lookup_us']:8.1f} us")


if __name__ == "__main__":
    main()
