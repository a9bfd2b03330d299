"""Prefill on the MLX backend: each row into its own B=1 cache, chunk by chunk,
as ``mlx_lm.generate_step`` does; chunks of rows at the same cache offset
share one right-padded forward (plain KV through slices, other kinds through
mlx-lm's batch caches), or go alone where their kind rules that out (counted
in ``fallbacks``). Part of ``MLXBackend`` (``engine.mlx.backend``'s docstring)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.mlx.batch import merge_caches
from engine.mlx.cache_ops import CacheOps
from engine.mlx.rows import _is_oom, _own_cache, _Row
from engine.ports import StepPlan, StepResult


class Prefill(CacheOps):
    """Step phase 4: the plan's prefill chunks (and the prompts of rows whose
    prefix cache faulted at open)."""

    def _prefill(self, plan: StepPlan, res: StepResult) -> None:
        vocab = self.info.vocab_size
        ready: list[tuple[_Row, list[int]]] = []
        refill, self._refill = self._refill, {}  # rows whose prefix cache faulted this step: their prefix first
        chunks = [(c.rid, refill.pop(c.rid, []) + c.tokens) for c in plan.prefill]
        chunks += list(refill.items())  # a faulted row with no chunk this step (it decodes next)
        for rid, tokens in chunks:
            row = self._rows.get(rid)
            if row is None or row.cache is None:
                res.errors.setdefault(rid, f"row {rid} cannot prefill (not open, or decoding)")
                continue
            if not tokens:
                continue
            if min(tokens) < 0 or max(tokens) >= vocab:
                res.errors[rid] = "a token id is outside the vocabulary"
                continue
            ready.append((row, tokens))
        # Chunks of rows whose caches hold the same number of tokens go through
        # one forward (mlx_lm.BatchGenerator prefills its prompts together too).
        groups: dict[int, list[tuple[_Row, list[int]]]] = {}
        for row, tokens in ready:
            key = row.fed if self.prefill_together else -1 - row.rid
            groups.setdefault(key, []).append((row, tokens))
        if not self.prefill_together and self._prefill_kind_off:
            shared: dict[int, int] = {}
            for row, _ in ready:
                shared[row.fed] = shared.get(row.fed, 0) + 1
            self.fallbacks["prefill_alone"] += sum(n for n in shared.values() if n > 1)
        for group in groups.values():
            if len(group) == 1:
                row, tokens = group[0]
                cache = _own_cache(row)
                with self._lora([row]):
                    self.model(mx.array(tokens)[None], cache=cache)
                self._quantize(cache)
                mx.eval([c.state for c in cache])
                row.fed += len(tokens)
            elif self._plain_kv:
                self._prefill_together(group)
            else:
                try:
                    self._prefill_merged(group)
                except Exception as exc:  # noqa: BLE001 - a kind whose batch cache fails: prefill alone
                    if isinstance(exc, MemoryError) or _is_oom(exc):
                        raise
                    self.fallbacks["prefill_alone"] += len(group)
                    for row, tokens in group:  # untouched: the merged copy was never handed back
                        own = _own_cache(row)
                        with self._lora([row]):
                            self.model(mx.array(tokens)[None], cache=own)
                        self._quantize(own)
                        mx.eval([c.state for c in own])
                        row.fed += len(tokens)

    def _prefill_merged(self, group: list[tuple[_Row, list[int]]]) -> None:
        """``_prefill_together`` for caches that are not all plain KV (rotating
        windows, SSM state, lists of them), through mlx-lm's batch caches as
        its ``BatchGenerator`` prefills: merge the rows' caches, right-pad the
        shorter chunks (``prepare(lengths=)`` keeps padding out of windows and
        recurrent state), ``finalize``, and ``extract`` each row's cache back."""
        lengths = [len(t) for _, t in group]
        width = max(lengths)
        pad = [width - n for n in lengths]
        cache = merge_caches([_own_cache(row) for row, _ in group])
        if any(pad):
            for c in cache:
                c.prepare(right_padding=pad, lengths=lengths)
        x = mx.array([t + [t[-1]] * (width - len(t)) for _, t in group])
        self.counters["prefill_together"] += len(group)
        with self._lora(row for row, _ in group):
            self.model(x, cache=cache)
        for c in cache:
            c.finalize()
        mx.eval([c.state for c in cache])
        rows = [[c.extract(i) for c in cache] for i in range(len(group))]  # all, before any row changes
        for (row, tokens), own in zip(group, rows):
            row.cache = own
            self._quantize(row.cache)
            row.fed += len(tokens)

    def _prefill_together(self, group: list[tuple[_Row, list[int]]]) -> None:
        """One ``(B, L)`` forward for B rows at the same cache offset, shorter
        chunks right-padded; causal attention keeps the padding out of every
        real position, whose keys and values are cut back into each row's own
        cache. 8 prompts of 48 tokens: 1.5x (quiet machine) to 4x (loaded)
        faster than eight B=1 forwards (``python -m bench.forward``).
        Not bit for bit the B=1 forward: a GEMM over more rows, and attention
        over a padded length, may take another kernel path, ~1e-6 apart in
        fp32 (the same class as a batched decode or verify step; greedy tokens
        are compared with mlx-lm's in tests/engine/test_mlx_backend.py).
        ``EngineConfig(batch_prefill=False)`` prefills every row alone, bit
        for bit as mlx_lm.generate_step."""
        offset = group[0][0].fed
        width = max(len(t) for _, t in group)
        caches = [_own_cache(r) for r, _ in group]
        batch = [KVCache() for _ in caches[0]]
        if offset:
            for layer, c in enumerate(batch):
                c.state = (
                    mx.concatenate([rc[layer].keys[..., :offset, :] for rc in caches]),
                    mx.concatenate([rc[layer].values[..., :offset, :] for rc in caches]),
                    offset,
                )
        x = mx.array([t + [t[-1]] * (width - len(t)) for _, t in group])
        self.counters["prefill_together"] += len(group)
        with self._lora(row for row, _ in group):
            self.model(x, cache=batch)
        mx.eval([c.state for c in batch])
        for i, ((row, tokens), own) in enumerate(zip(group, caches)):
            end = offset + len(tokens)
            for layer, c in enumerate(own):
                c.state = (batch[layer].keys[i : i + 1, :, :end, :], batch[layer].values[i : i + 1, :, :end, :], end)
            row.fed = end
