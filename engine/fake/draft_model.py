"""The fake GPU's drafter (``engine.speculation.draft_model.DraftModel``): it
proposes the fake target's greedy token with probability ``agree`` (decided by
a hash of the context, so it is deterministic) and the runner-up otherwise. Its
cache is a list of running hashes with real trim semantics, so rollback bugs
show as wrong drafts — which cost acceptance, never output, exactly as on MLX."""

from __future__ import annotations

import hashlib

import numpy as np

from engine.config import FakeGPUConfig
from engine.fake.logits import _advance, _initial_hash, fake_logits
from engine.fake.tokenizer import ByteTokenizer


class FakeDraftModel:
    def __init__(
        self,
        cfg: FakeGPUConfig = FakeGPUConfig(),
        *,
        agree: float = 0.7,
        seed: int = 1,
        trimmable: bool = True,
        token_cost_s: float = 0.002,
        feed_cost_s: float = 0.00002,
    ):
        self.cfg = cfg
        self.agree = agree
        self.seed = seed
        self.trimmable = trimmable
        self.token_cost_s = token_cost_s
        self.feed_cost_s = feed_cost_s
        self._h0 = _initial_hash(cfg.seed)

    def new_cache(self) -> list[int]:
        return []

    def can_trim(self, cache: list[int]) -> bool:
        return self.trimmable

    def trim(self, cache: list[int], n: int) -> int:
        if not self.trimmable:
            raise ValueError("this draft cache cannot be trimmed")
        n = min(n, len(cache))
        del cache[len(cache) - n :]
        return n

    def feed(self, cache: list[int], tokens: list[int]) -> None:
        h = cache[-1] if cache else self._h0
        for t in tokens:
            h = _advance(h, t)
            cache.append(h)

    def _propose(self, h: int) -> int:
        logits = fake_logits(self.cfg.seed, h, ByteTokenizer.vocab_size, self.cfg.eos_bias)
        if _uniform(self.seed, h) < self.agree:
            return int(logits.argmax())  # the first of the largest: argsort's stable first
        return int(np.argsort(-logits, kind="stable")[1])

    def generate(self, cache: list[int], feed: list[int], k: int) -> list[int]:
        self.feed(cache, feed)
        out: list[int] = []
        for i in range(k):
            tok = self._propose(cache[-1])
            out.append(tok)
            if i < k - 1:
                self.feed(cache, [tok])
        return out

    def generate_many(self, items: list[tuple[list[int], list[int], int]]) -> list[list[int]]:
        return [self.generate(cache, feed, k) for cache, feed, k in items]

    def cost_s(self, fed: int, drafted: int) -> float:
        return self.token_cost_s * drafted + self.feed_cost_s * fed

    def step_costs_s(self) -> tuple[float, float]:
        """``(one draft step, one caught-up token)``: the configured virtual costs."""
        return self.token_cost_s, self.feed_cost_s


def _uniform(seed: int, h: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, context hash): 53 bits of
    blake2b("draft", seed, h). ``PCG64([seed, h]).random()`` did this through
    SeedSequence, ~15 us per draft token; the label keeps it apart from the
    stream ``fake_logits`` draws for the same hash."""
    d = hashlib.blake2b(b"draft:%d:%d" % (seed, h), digest_size=8).digest()
    return (int.from_bytes(d, "little") >> 11) * (1.0 / (1 << 53))
