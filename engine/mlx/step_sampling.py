"""Sampling a step's logits on the MLX backend: a pure decode group as one
``[B]`` array (greedy rows by one ``argmax``, rows with logits processing
masked together), verify windows per row; then the tokens and logprobs read
into the ``StepResult``. Part of ``MLXBackend`` (``engine.mlx.backend``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from engine.mlx.logits import apply_words, to_token_logprobs
from engine.mlx.rows import _Row, _row_logits
from engine.mlx.state import BackendState
from engine.ports import StepResult


class StepSampling(BackendState):
    """Rows' tokens from a forward's logits (``engine.mlx.sampling`` samples one row)."""

    def _sample(
        self, rids: list[int], inputs: list[list[int]], logits: mx.array, step_tokens: list[mx.array]
    ) -> tuple[list[int], list[int] | None, Any, dict[int, tuple[mx.array, ...]]]:
        """Sample each row's tokens. A pure decode group gives one ``[B]`` array
        (also appended to ``step_tokens``); otherwise a list of per-row arrays.
        The last item: the lazy logprob arrays of the rows that asked for them."""
        rows = [self._rows[rid] for rid in rids]
        lps: dict[int, tuple[mx.array, ...]] = {}
        if logits.shape[1] == 1 and all(len(x) == 1 for x in inputs):
            toks = self._sample_last(logits, rows, inputs, lps)
            step_tokens.append(toks)
            return list(rids), None, toks, lps
        per_row = []
        widths = [len(x) for x in inputs]
        for i, (row, n) in enumerate(zip(rows, widths)):
            if n == 0:
                per_row.append(mx.zeros((0,), mx.uint32))
                continue
            raw = logits[i, :n, :]
            lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
            if row.logits is None:
                per_row.append(row.sampler(lp))
                continue
            toks = row.sampler(row.logits.window(inputs[i], raw))
            if row.logits.logprobs is not None:
                lps[row.rid] = row.logits.logprob_arrays(lp, toks)
            per_row.append(toks)
        return list(rids), widths, per_row, lps

    def _sample_last(
        self,
        logits: mx.array,
        rows: list[_Row],
        inputs: list[list[int]] | None = None,
        lps: dict[int, tuple[mx.array, ...]] | None = None,
    ) -> mx.array:
        raw = logits[:, -1, :]
        lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        procs = [i for i, r in enumerate(rows) if r.logits is not None]
        if not procs:
            if all(r.sampler.greedy for r in rows):
                return mx.argmax(lp, axis=-1)
            return mx.concatenate([r.sampler(lp[i : i + 1]) for i, r in enumerate(rows)])
        # Rows with logits processing (engine.mlx.logits), batched: processors per
        # row, then every row's grammar mask in one [B, V] op.
        assert inputs is not None  # given whenever a row has processing
        for i in procs:
            _row_logits(rows[i]).feed(inputs[i][0])
        x = raw
        if any(_row_logits(rows[i]).processors for i in procs):
            x = mx.concatenate(
                [r.logits.apply_processors(x[i : i + 1]) if r.logits else x[i : i + 1] for i, r in enumerate(rows)]
            )
        masked = [i for i in procs if _row_logits(rows[i]).matcher is not None]
        if masked:
            words = np.full((len(rows), (self.info.vocab_size + 31) // 32), -1, np.int32)
            for i in masked:
                _row_logits(rows[i]).mask_words(words[i])
            x = apply_words(x, words, self.info.vocab_size)
        plp = x - mx.logsumexp(x, axis=-1, keepdims=True)  # == lp for the rows without processing
        if all(r.sampler.greedy for r in rows):
            toks = mx.argmax(plp, axis=-1)
        else:
            toks = mx.concatenate([r.sampler(plp[i : i + 1]) for i, r in enumerate(rows)])
        for i in procs:
            row_logits = _row_logits(rows[i])
            if row_logits.logprobs is not None:
                assert lps is not None  # given whenever a row wants logprobs
                lps[rows[i].rid] = row_logits.logprob_arrays(lp[i : i + 1], toks[i : i + 1])
        return toks

    def _has_logits(self) -> bool:
        """A batch row with processing: its next mask or penalty needs the token
        just sampled on the host, so its next step is built only after this
        one's tokens are read (in ``run_ahead``, not inside ``step``)."""
        return any(self._rows[rid].logits is not None for rid in self._batch.rids)

    def _collect(
        self,
        rids: list[int],
        widths: list[int] | None,
        toks: Any,
        lps: dict[int, tuple[mx.array, ...]],
        verify_rids: set[int],
        res: StepResult,
    ) -> None:
        if widths is None:
            for rid, t in zip(rids, toks.tolist()):
                res.tokens[rid] = t
                self._rows[rid].emitted += 1
                if rid in lps:
                    res.logprobs[rid] = to_token_logprobs([t], lps[rid])
            return
        for rid, n, arr in zip(rids, widths, toks):
            if n == 0:
                continue
            if rid in verify_rids:
                res.verified[rid] = arr.tolist()
            else:
                res.tokens[rid] = arr.item()
                self._rows[rid].emitted += 1
                if rid in lps:
                    res.logprobs[rid] = to_token_logprobs([res.tokens[rid]], lps[rid])
