"""A step's row phases on the MLX backend, before any forward: close (caches
kept), open (from a prefix cache, or empty and refilled where it faulted),
trim, checkpoint, and each row's work (a decode token or a verify window, cut
to one token where the cache could not give it back). Part of ``MLXBackend``
(``engine.mlx.backend``'s ``_step``)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from engine.mlx.cache_ops import CacheOps
from engine.mlx.cache_views import snapshot_cache
from engine.mlx.logits import RowLogits, needs_processing
from engine.mlx.rows import _Ahead, _is_oom, _Row
from engine.mlx.sampling import RowSampler, row_seed
from engine.ports import StepPlan, StepResult


class RowPhases(CacheOps):
    """Step phases 2, 3 and 5 (close, open and trim, checkpoint) and the work of phase 6."""

    def _checkpoint(self, plan: StepPlan, res: StepResult) -> None:
        for rid in plan.checkpoint:
            row = self._rows.get(rid)
            if row is not None and row.cache is not None and rid not in res.errors:
                try:
                    res.checkpoints[rid] = snapshot_cache(row.cache)
                except Exception as exc:  # noqa: BLE001 - no checkpoint is a later miss, never a failed row
                    if isinstance(exc, MemoryError) or _is_oom(exc):
                        raise
                    self.fallbacks["checkpoint_failed"] += 1

    def _work(self, plan: StepPlan, res: StepResult) -> dict[int, list[int]]:
        work: dict[int, list[int]] = {}
        for d in plan.decode:
            work[d.rid] = [d.token]
        for v in plan.verify:
            if v.rid in work or not v.tokens:
                res.errors[v.rid] = "a row can decode or verify once per step, with a non-empty window"
                work.pop(v.rid, None)
                continue
            if self._window_fits(v.rid, len(v.tokens)):
                work[v.rid] = list(v.tokens)
            else:
                work[v.rid] = v.tokens[:1]
                self.fallbacks["spec_untrimmable"] += 1
        for rid in list(work):
            if rid not in self._rows:
                res.errors.setdefault(rid, f"row {rid} is not open on the device")
                del work[rid]
        return work

    def _close(self, plan: StepPlan, res: StepResult, queued: list[_Ahead]) -> list[mx.array]:
        """Close rows; return each queued step's tokens for the rows that stay."""
        leaving: list[int] = []
        for rid in plan.close:
            row = self._rows.pop(rid, None)
            if row is None:
                continue
            if row.cache is None:
                leaving.append(rid)
            elif rid in plan.keep_cache:
                res.closed[rid] = row.cache
        tokens = [q.tokens for q in queued]
        if not leaving:
            return tokens
        gone = set(leaving)
        stay = [i for i, rid in enumerate(self._batch.rids) if rid not in gone]
        try:
            kept = self._batch.remove(leaving, plan.keep_cache)
        except Exception:  # noqa: BLE001 - a cache kind that cannot be extracted: a later miss, not an error
            self.fallbacks["keep_cache_failed"] += len(gone & plan.keep_cache)
            kept = self._batch.remove(leaving, set())
        if queued:  # only all-KVCache batches run ahead; SSM state has no trim
            for cache in kept.values():
                for c in cache:
                    c.trim(len(queued))  # tokens fed by steps run ahead were never confirmed
        res.closed.update(kept)
        index = mx.array(stay) if stay else None
        return [t[index] if index is not None else t[:0] for t in tokens]

    def _open(self, plan: StepPlan, res: StepResult) -> None:
        self._refill = {}
        for o in plan.open:
            if o.rid in self._rows:
                res.errors[o.rid] = f"row {o.rid} is already open"
                continue
            adapter = self.adapters.index.get(o.adapter, 0) if o.adapter else 0
            if o.adapter and not adapter:
                res.errors[o.rid] = f"adapter {o.adapter!r} is not loaded in this model"
                continue
            if o.cache is None:
                cache, fed = self.make_cache(), 0
            else:
                try:
                    cache, fed = self._open_cache(o.cache, o.cached), o.cached
                except Exception as exc:  # noqa: BLE001 - a cache fault is a miss, not an error
                    if isinstance(exc, MemoryError) or _is_oom(exc):
                        raise
                    if len(o.prefix) != o.cached:  # nothing to prefill instead: this row fails, not the step
                        res.errors[o.rid] = f"prefix cache: {exc}"
                        continue
                    # open it empty and prefill the whole prompt (``_prefill``); the Scheduler logs it
                    self.counters["cache_faults"] += 1
                    res.cache_faults[o.rid] = str(exc)
                    self._refill[o.rid] = list(o.prefix)
                    cache, fed = self.make_cache(), 0
            seed = row_seed(o.sampling, self.engine_seed, o.rid)
            sampler = RowSampler(o.sampling, seed, self.info.vocab_size)
            logits = None
            if needs_processing(o.sampling):
                try:
                    matcher = self.grammars.matcher(o.sampling.constraint) if o.sampling.constraint else None
                except Exception as exc:  # noqa: BLE001 - normally refused at admission (Engine.asubmit)
                    res.errors[o.rid] = f"constraint: {exc}"
                    continue
                logits = RowLogits(o.sampling, matcher, self.info.vocab_size, sorted(self.tokenizer.eos_token_ids))
            self._rows[o.rid] = _Row(o.rid, sampler, o.sampling.max_tokens, cache, fed, logits=logits, adapter=adapter)

    def _trim(self, plan: StepPlan, res: StepResult) -> None:
        batch_trim: dict[int, int] = {}
        for rid, n in plan.trim:
            row = self._rows.get(rid)
            if row is None:
                res.errors.setdefault(rid, f"row {rid} is not open on the device")
                continue
            n = min(n, row.fed)
            if row.cache is not None:
                if n and trim_prompt_cache(row.cache, n) != n:
                    res.errors[rid] = "this model's cache cannot be trimmed"
                    continue
                row.fed -= n
                if row.logits is not None:
                    row.logits.trim(n)
            elif n:
                batch_trim[rid] = batch_trim.get(rid, 0) + n
        if batch_trim:
            if not can_trim_prompt_cache(self._batch.cache):
                for rid in batch_trim:
                    res.errors[rid] = "this model's cache cannot be trimmed"
                return
            self._batch.trim([batch_trim.get(rid, 0) for rid in self._batch.rids])
            for rid, n in batch_trim.items():
                row = self._rows[rid]
                row.fed -= n
                if row.logits is not None:
                    row.logits.trim(n)

    def _window_fits(self, rid: int, n: int) -> bool:
        """Speculation's guard: can the row's cache take an ``n``-token verify
        window and be trimmed back afterwards? Not for SSM/recurrent state, nor
        for a rotating window the tokens would wrap. A window that does not fit
        is cut to its first token (a plain decode, answered with one token), so
        the Verifier falls back instead of a trim failing or corrupting."""
        row = self._rows.get(rid)
        if row is None:
            return True  # reported as "not open" by the step
        cache = row.cache if row.cache is not None else self._batch.cache
        for c in cache:
            if not c.is_trimmable():
                return False
            max_size = getattr(c, "max_size", None)
            if max_size is not None and max(row.fed, int(getattr(c, "_offset", 0) or 0)) + n >= max_size:
                return False
        return True
