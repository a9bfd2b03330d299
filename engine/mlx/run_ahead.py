"""Running ahead on the MLX backend: the batch's next decode step computed
while the event loop works on the last result, kept when the next plan is what
it computed, served as the first position of verify windows, or undone (see
``engine.mlx.backend``'s docstring and docs/mlx-backend.md). Part of
``MLXBackend``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchRotatingKVCache

from engine.mlx import split_attention
from engine.mlx.rows import _Ahead, _row_logits
from engine.mlx.step_sampling import StepSampling
from engine.ports import StepPlan, StepResult


class RunAhead(StepSampling):
    """The queue of decode steps computed ahead of the Scheduler (``_queued``)."""

    def run_ahead(self, idle: Callable[[], bool] = lambda: False) -> None:
        """Compute the batch's next decode step(s) while nobody waits for the device.

        ``MLXThread`` calls this right after it has handed a step's result to the
        event loop, so the forward runs while the loop works on that result (on
        MLX's CPU backend ``async_eval`` computes most of a decode graph before
        it returns, so queueing inside ``step`` would delay the result instead).
        Up to ``max_ahead`` steps: the first whenever one is due, more only
        while ``idle()`` says no call is waiting. On a device that never calls
        this, nothing runs ahead.
        """
        with mx.stream(generation_stream), split_attention.parts(self.attention_parts, self.softmax_kernel):
            try:
                if self._built is not None:
                    built, self._built = self._built, None
                    mx.async_eval(built)
                while idle() and self._due is not None and len(self._queued) < self.max_ahead:
                    self._build_ahead()
                    if self._built is not None:
                        built, self._built = self._built, None
                        mx.async_eval(built)
            except Exception as exc:  # noqa: BLE001 - the next step raises it
                self._due = self._built = None
                self._ahead_error = exc

    def _build_ahead(self, pending: int = 0) -> None:
        """Queue the graph of the batch's next decode step (computed later by
        ``run_ahead``, or when a step reads it). ``pending``: tokens each row has
        sampled but not yet counted in ``emitted`` (the step being finished)."""
        batch, tokens = self._batch, self._due
        assert tokens is not None  # called only with a step due
        rows = [self._rows[rid] for rid in batch.rids]
        depth = len(self._queued) + pending
        if not self._ahead_fits():
            self._due = None  # a window that would wrap could not give the step back
            return
        if all(r.emitted + depth >= r.max_tokens for r in rows):
            self._due = None  # every row has all its tokens by then
            return
        keys = [(r, r.sampler.key) for r in rows if r.sampler.key is not None]  # the sampled (not greedy) rows
        inputs: list[list[int]] | None = None
        lps: dict[int, tuple[mx.array, ...]] = {}
        fed = [r for r in rows if r.logits is not None]
        if fed:  # masks and penalties need the inputs on the host
            inputs = [[t] for t in cast(list[int], tokens.tolist())]
        with self._lora(rows):
            logits = batch.decode(self.model, tokens)
        nxt = self._sample_last(logits, rows, inputs, lps)
        self._queued.append(_Ahead(nxt, keys, fed, lps))
        self._due = self._built = nxt

    def _ahead_fits(self) -> bool:
        """Can the batch take one more decode step and give it back (``trim``)?
        A sliding window can while its ring has not wrapped: up to then mlx-lm's
        ``BatchRotatingKVCache`` is laid out, and trims, like a plain one."""
        for c in self._batch.cache:
            if type(c) is BatchRotatingKVCache and (c.rotated or c._idx >= c.max_size):
                return False
        return True

    def _queue_fits(self, plan: StepPlan) -> bool:
        """Does the plan decode exactly the batch's rows with the tokens the
        oldest step run ahead fed?"""
        closed = set(plan.close)
        batch = self._batch
        if any(v.rid in batch for v in plan.verify) or any(rid in batch and rid not in closed for rid, _ in plan.trim):
            return False
        fed = {d.rid: d.token for d in plan.decode if d.rid in batch}
        stay = [rid for rid in batch.rids if rid not in closed]
        want = self._queued_inputs
        return len(fed) == len(stay) and all(fed.get(rid) == want.get(rid) for rid in stay)

    def _queue_heads_windows(self, plan: StepPlan, queued: list[_Ahead]) -> bool:
        """Can the one decode step run ahead serve as the first position of this
        plan's verify windows? It fed each row exactly the token a window starts
        with (``last``), so its sampled token is the target's token at position
        0; the window's drafts are then fed on top instead of undoing it (a
        whole wasted decode every time a row turns from plain decode to
        speculation). Only with one step ahead, no trims and no other inputs."""
        batch = self._batch
        closed = set(plan.close)
        if len(queued) != 1 or any(rid in batch and rid not in closed for rid, _ in plan.trim) or self._has_logits():
            return False
        first = {d.rid: d.token for d in plan.decode if d.rid in batch}
        windows = {v.rid: v.tokens[0] for v in plan.verify if v.rid in batch and v.tokens}
        if not windows or set(first) & set(windows):
            return False
        first.update(windows)
        stay = [rid for rid in batch.rids if rid not in closed]
        want = self._queued_inputs
        return len(first) == len(stay) and all(first.get(rid) == want.get(rid) for rid in stay)

    def _verify_rest(
        self, work: dict[int, list[int]], verify_rids: set[int], heads: list[int]
    ) -> tuple[tuple[list[int], Any] | None, set[int]]:
        """Feed the verify rows' drafts (their windows past the first token, which
        the step run ahead fed) in one batched forward; the other rows feed nothing.

        ``heads``: the run-ahead step's token per batch row, the target's token
        after ``last``. A row whose first draft is not that token is rejected
        there whatever its drafts would give, so its drafts are not fed (it is
        ``stopped``): on text the drafter does not predict, a window costs
        what a plain decode step costs, and where no row feeds anything there
        is no second forward at all. Returns the forward's rows and tokens (or
        None) and the stopped rows."""
        batch = self._batch
        inputs, stopped = [], set()
        for rid, head in zip(batch.rids, heads):
            window = work.get(rid, []) if rid in verify_rids else []
            if len(window) > 1 and window[1] != head:
                stopped.add(rid)
                window = []
            inputs.append(window[1:])
        if not any(inputs):
            return None, stopped
        with self._lora(self._rows[rid] for rid in batch.rids):
            logits = batch.forward(self.model, inputs)
        rids = list(batch.rids)
        _, widths, toks, _ = self._sample(rids, inputs, logits, [])
        for rid, x in zip(rids, inputs):
            self._rows[rid].fed += len(x)
        mx.eval(toks)
        return (rids, (widths, toks)), stopped

    @staticmethod
    def _join_heads(rest: tuple[list[int], Any] | None, verify_rids: set[int], res: StepResult) -> None:
        """Verify rows: the head token from the step run ahead, then their drafts'."""
        per_row: dict[int, list[int]] = {}
        if rest is not None:
            rids, (widths, toks) = rest
            if widths is None:  # every row fed exactly one draft: one [B] array
                per_row = {rid: [t] for rid, t in zip(rids, toks.tolist())}
            else:
                per_row = {rid: arr.tolist() for rid, n, arr in zip(rids, widths, toks) if n}
        for rid in verify_rids:
            if rid in res.tokens:
                res.verified[rid] = [res.tokens.pop(rid), *per_row.get(rid, [])]

    def _undo(self, queued: list[_Ahead]) -> None:
        """Take back steps run ahead: their tokens leave the cache, keys go back."""
        for c in self._batch.cache:
            c.trim(len(queued))
        for row, key in queued[0].keys:
            row.sampler.key = key
        for q in queued:
            for row in q.fed:
                _row_logits(row).trim(1)
        self.counters["undone"] += len(queued)
