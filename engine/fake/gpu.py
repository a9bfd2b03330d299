"""A deterministic fake GPU that implements the same ``Backend`` port as MLX.

The next token is a pure function of the context tokens: each layer's cache
stores, per position, the token and a running hash of the whole prefix, and
the logits are drawn from a generator whose state is a hash of (model seed,
running hash at the last position). So any test knows the exact expected output
(``expected_tokens``) without running the engine, and a cache that was
restored, trimmed or reused wrongly yields different tokens.

Its parts: the byte tokenizer (``engine.fake.tokenizer``), caches that are
real arrays with the shape and trim semantics of mlx-lm's ``KVCache``
(``engine.fake.kv_cache``, so the cold tier persists and restores them like
MLX caches), the hashed logits (``engine.fake.logits``) and the sampler
(``engine.fake.sampling``); this module is the backend that steps them.
Time is a cost model (prefill ``a + b·tokens``, decode ``c + d·rows``, verify
per window token) slept in virtual time by ``InlineDevice``; faults (slow
step, hung step, out-of-memory) are seeded knobs.
"""

from __future__ import annotations

import hashlib
import math

import msgspec
import numpy as np

from engine.config import FakeGPUConfig
from engine.fake.kv_cache import FakeKVCache
from engine.fake.logits import _advance, _initial_hash, advance_all, fake_logits, greedy_token, running_hashes
from engine.fake.sampling import sample_token
from engine.fake.tokenizer import ByteTokenizer
from engine.ports import BackendDefaults, ModelInfo, StepPlan, StepResult
from engine.types import GREEDY_TEMPERATURE, SamplingParams


def expected_tokens(
    prompt: list[int],
    n: int,
    cfg: FakeGPUConfig = FakeGPUConfig(),
    *,
    stop_at_eos: bool = True,
) -> list[int]:
    """The reference greedy continuation, computed without any cache."""
    h = advance_all(_initial_hash(cfg.seed), prompt)
    out: list[int] = []
    for _ in range(n):
        tok = int(fake_logits(cfg.seed, h, ByteTokenizer.vocab_size, cfg.eos_bias).argmax())
        out.append(tok)
        if stop_at_eos and tok == ByteTokenizer.EOS:
            break
        h = _advance(h, tok)
    return out


class _Row:
    __slots__ = ("cache", "sampling", "seed", "_rng")

    def __init__(self, cache: list[FakeKVCache], sampling: SamplingParams, seed: int):
        self.cache = cache
        self.sampling = sampling
        self.seed = seed
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        """The row's sampler, made at its first draw: a greedy row never draws,
        and a ``PCG64(seed)`` (its SeedSequence) costs ~20 us per request."""
        if self._rng is None:
            self._rng = np.random.Generator(np.random.PCG64(self.seed))
        return self._rng


class FakeBackend(BackendDefaults):
    """Implements ``engine.ports.Backend`` on numpy."""

    def __init__(self, cfg: FakeGPUConfig = FakeGPUConfig()):
        self.cfg = cfg
        self.tokenizer = ByteTokenizer()
        # The model's identity only: the cost model and fault knobs change how a
        # step behaves, not what it computes, so a restart with other fault
        # settings (a simulation's next run) still finds its own SSD entries.
        model = (cfg.seed, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.context_length, cfg.eos_bias)
        fp = hashlib.blake2b(msgspec.json.encode(model), digest_size=8).hexdigest()
        self.info = ModelInfo(
            model_id=f"fake-gpu-{cfg.seed}",
            vocab_size=ByteTokenizer.vocab_size,
            context_length=cfg.context_length,
            config_fingerprint=fp,
            tokenizer_hash="bytes-v1",
            num_layers=cfg.num_layers,
        )
        self._h0 = _initial_hash(cfg.seed)
        self._row_shape = (cfg.head_dim,)
        # one decode position's key and value rows, reused: only [0] and [1] are
        # ever set, the rest stay zero (the rows are copied into the caches)
        self._row_k = np.zeros(self._row_shape, np.float32)
        self._row_v = np.zeros(self._row_shape, np.float32)
        self._rows: dict[int, _Row] = {}
        self._fault_rng = np.random.Generator(np.random.PCG64(cfg.fault_seed))
        self.steps = 0

    # ---- caches --------------------------------------------------------
    def make_cache(self) -> list[FakeKVCache]:
        return [FakeKVCache() for _ in range(self.cfg.num_layers)]

    def cache_nbytes(self, cache: list[FakeKVCache]) -> int:
        return sum(c.nbytes for c in cache)

    def prefix_view(self, cache: list[FakeKVCache], n: int) -> list[FakeKVCache]:
        """A private copy of the first ``n`` positions (the MLX backend's is lazy)."""
        out = [c.copy() for c in cache]
        excess = min((c.offset for c in out), default=n) - n
        if excess < 0 or (excess and self.trim_cache(out, excess) != excess):
            raise ValueError(f"the cache cannot serve {n} tokens")
        return out

    def trim_cache(self, cache: list[FakeKVCache], n: int) -> int:
        return min(c.trim(n) for c in cache) if cache else 0

    def cache_trimmable(self, cache: list[FakeKVCache]) -> bool:
        return all(c.is_trimmable() for c in cache)

    def _feed(self, cache: list[FakeKVCache], tokens: list[int]) -> int:
        """Append tokens to every layer; return the running hash after them."""
        n = len(tokens)
        if n == 1:
            h = self._feed_one(cache, tokens[0])
            if h is not None:
                return h
        last = cache[-1]
        if last.offset:
            h = int(last.values[0, 0, last.offset - 1, 0])
        else:
            h = self._h0
        H, D = self.cfg.num_kv_heads, self.cfg.head_dim
        # the tokens as an array once (for the hashes and the cache rows; ids
        # below 2**24 are exact in float32 from int64 as from a Python int)
        toks = np.fromiter(tokens, np.int64, n) if isinstance(tokens, list) else np.asarray(tokens, np.int64)
        hashes = running_hashes(h, toks)
        h = int(hashes[-1]) if n else h
        pos = np.arange(last.offset, last.offset + n, dtype=np.float32)
        keys = np.zeros((1, H, n, D), np.float32)
        keys[..., 0] = toks
        keys[..., 1] = pos
        values = np.zeros((1, H, n, D), np.float32)
        values[..., 0] = hashes
        values[..., 1] = toks
        for c in cache:
            c.update(keys, values)
        return h

    def _feed_one(self, cache: list[FakeKVCache], t: int) -> int | None:
        """A decode step's one token written in place (no temporaries) when
        every layer has room for it; returns the running hash after it, or
        None (nothing written) when a layer must grow: ``_feed`` then."""
        for c in cache:
            if c.keys is None or c.offset >= c.keys.shape[2]:
                return None
        last = cache[-1]
        off = last.offset
        # the hash is stored as a float32 holding an integer below 2**24 (exact)
        h = _advance(int(last.values.item(0, 0, off - 1, 0)) if off else self._h0, t)
        k, v = self._row_k, self._row_v  # one position, every head (broadcast)
        k[0], k[1], v[0], v[1] = t, off, h, t
        for c in cache:
            o = c.offset
            c.keys[0, :, o] = k
            c.values[0, :, o] = v
            c.offset = o + 1
        return h

    def _next(self, row: _Row, h: int) -> int:
        sp = row.sampling
        if sp.temperature < GREEDY_TEMPERATURE:  # greedy (``sample_token``'s first case): the sampler is not needed
            return greedy_token(self.cfg.seed, h, ByteTokenizer.vocab_size, self.cfg.eos_bias)
        logits = fake_logits(self.cfg.seed, h, ByteTokenizer.vocab_size, self.cfg.eos_bias)
        return sample_token(logits, sp, row.rng)

    # ---- the port --------------------------------------------------------
    def decode_step_s(self) -> float:
        """A one-row decode step's virtual seconds (the cost model, no fault
        draw): what adaptive γ prices a draft model's step against at start."""
        return self.cfg.decode_c + self.cfg.decode_d

    def step_cost_s(self, plan: StepPlan) -> float:
        cfg = self.cfg
        cost = 0.0
        if plan.prefill:
            cost += cfg.prefill_a + cfg.prefill_b * sum(len(c.tokens) for c in plan.prefill)
        if plan.decode or plan.verify:  # decode and verify rows share one batched forward
            cost += cfg.decode_c + cfg.decode_d * len(plan.decode)
            cost += cfg.verify_b * sum(len(v.tokens) for v in plan.verify)
        if cost and cfg.slow_step_prob and self._fault_rng.random() < cfg.slow_step_prob:
            cost *= cfg.slow_step_factor
        if cost and cfg.hang_step_prob and self._fault_rng.random() < cfg.hang_step_prob:
            cost = math.inf
        return cost

    def step(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        res = StepResult()
        for rid in plan.close:
            row = self._rows.pop(rid, None)
            if row is not None and rid in plan.keep_cache:
                res.closed[rid] = row.cache
        for o in plan.open:
            seed = o.sampling.seed if o.sampling.seed is not None else (self.cfg.seed << 20) + o.rid
            cache = o.cache if o.cache is not None else self.make_cache()
            self._rows[o.rid] = _Row(cache, o.sampling, seed)
        for rid, n in plan.trim:
            self.trim_cache(self._rows[rid].cache, n)
        busy = plan.prefill or plan.decode or plan.verify
        if self.cfg.oom_step_prob and busy and self._fault_rng.random() < self.cfg.oom_step_prob:
            raise MemoryError("fake GPU: out of memory")
        for c in plan.prefill:
            self._feed(self._rows[c.rid].cache, c.tokens)
        for rid in plan.checkpoint:  # the row's cache as it stands after prefill (``can_checkpoint``)
            if rid in self._rows:
                res.checkpoints[rid] = [c.copy() for c in self._rows[rid].cache]
        rows, feed = self._rows, self._feed_one
        for d in plan.decode:
            row = rows[d.rid]
            h = feed(row.cache, d.token)
            if h is None:  # a layer grows
                h = self._feed(row.cache, [d.token])
            res.tokens[d.rid] = self._next(row, h)
        for v in plan.verify:
            row = self._rows[v.rid]
            # A window is only fed where it can be trimmed back; otherwise decode
            # just `last` and answer one token (the Verifier falls back).
            window = v.tokens if self.cache_trimmable(row.cache) else v.tokens[:1]
            out = []
            for t in window:
                out.append(self._next(row, self._feed(row.cache, [t])))
            res.verified[v.rid] = out
        return res

    def row_cache(self, rid: int) -> list[FakeKVCache]:
        return self._rows[rid].cache
