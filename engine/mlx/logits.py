"""Per-row logits processing in the MLX backend: mlx-lm's logits processors
(``logit_bias``, repetition / presence / frequency penalties), a grammar
matcher's allowed-token mask, and the logprobs a request asked for.

A ``RowLogits`` mirrors the row's KV cache: ``history`` is every generated
token fed into the cache so far (the prompt is not in it), and the matcher
has consumed the same tokens. Feeding a token consumes it; trimming the cache
(a rejected speculation window) rolls the matcher back by as many tokens.
So in a verify window ``[last, d1..dk]`` the mask at position ``i`` is the
grammar's after ``d1..di``, and a draft the grammar forbids can never equal
the target's token sampled before it: sample-and-match rejects it there, and
the trim that follows rolls the matcher back with the cache.

Order, per position (as mlx-lm's ``generate_step``): processors on the raw
logits, then the grammar mask, then log-softmax, then the row's sampler
(temperature, top-p, min-p, top-k). Masking before the sampler's filters
keeps the distribution over the allowed tokens the model's own, renormalised.

Logprobs are taken from the raw model distribution: the log-softmax of the
logits before any processor, mask, temperature or filter (vLLM's default).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from engine.types import SamplingParams, TokenLogprob


def needs_processing(sp: SamplingParams) -> bool:
    return bool(
        sp.constraint is not None
        or sp.logprobs is not None
        or sp.logit_bias
        or sp.presence_penalty
        or sp.frequency_penalty
        or sp.repetition_penalty != 1.0
    )


class RowLogits:
    __slots__ = ("matcher", "processors", "logprobs", "history", "consumed", "started", "_words", "_vocab", "_eos")

    def __init__(self, sp: SamplingParams, matcher: Any, vocab_size: int, eos_ids: list[int]):
        self.matcher = matcher
        # Penalties count the row's generated tokens (OpenAI's semantics), all of them.
        window = sp.max_tokens
        self.processors = make_logits_processors(
            logit_bias=sp.logit_bias or None,
            repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 1.0 else None,
            repetition_context_size=window,
            presence_penalty=sp.presence_penalty or None,
            presence_context_size=window,
            frequency_penalty=sp.frequency_penalty or None,
            frequency_context_size=window,
        )
        self.logprobs = sp.logprobs
        self.history: list[int] = []
        self.consumed = 0  # history tokens the matcher accepted (== len(history) unless a draft was forbidden)
        self.started = False  # the first decode input is the prompt's last token, not generated
        self._vocab = vocab_size
        self._eos = eos_ids
        self._words = np.zeros((1, (vocab_size + 31) // 32), np.int32) if matcher is not None else None

    # ---- the cache mirror ---------------------------------------------------
    def feed(self, token: int) -> None:
        if not self.started:
            self.started = True  # the prompt's last token
            return
        self.history.append(token)
        if self.matcher is not None and self.consumed == len(self.history) - 1:
            # try_consume never puts the matcher in its error state; a forbidden
            # draft is simply not consumed, and every position after it is dead.
            self.consumed += self.matcher.try_consume_tokens([token])

    def trim(self, n: int) -> None:
        """The cache dropped its last ``n`` tokens."""
        n = min(n, len(self.history))
        if n <= 0:
            return
        del self.history[len(self.history) - n :]
        if self.matcher is not None and self.consumed > len(self.history):
            self.matcher.rollback(self.consumed - len(self.history))
            self.consumed = len(self.history)

    # ---- one position ----------------------------------------------------------
    def mask_words(self, out: np.ndarray) -> None:
        """Write the allowed tokens now into ``out`` (``[ceil(V/32)]`` int32, bit
        ``t % 32`` of word ``t // 32``). A dead position (after a forbidden
        draft) or a matcher in error allows only EOS: nothing sampled there is
        emitted, and a broken grammar ends the row instead of looping."""
        if self.consumed == len(self.history) and not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            if out.any():
                return
        out[:] = 0
        bits = out.view(np.uint32)
        for t in self._eos:
            bits[t // 32] |= np.uint32(1 << (t % 32))

    def apply_processors(self, logits: mx.array) -> mx.array:
        if self.processors:
            tokens = mx.array(self.history, mx.int32)
            for p in self.processors:
                logits = p(tokens, logits)
        return logits

    def process(self, logits: mx.array) -> mx.array:
        """``[1, V]`` raw logits at the current position -> the logprobs to sample from."""
        logits = self.apply_processors(logits)
        if self.matcher is not None:
            self.mask_words(self._words[0])
            logits = apply_words(logits, self._words, self._vocab)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def window(self, inputs: list[int], logits: mx.array) -> mx.array:
        """Feed a step's inputs one by one; ``[n, V]`` raw logits -> ``[n, V]``
        processed logprobs, position ``i`` seeing the tokens fed up to ``inputs[i]``."""
        out = []
        for i, tok in enumerate(inputs):
            self.feed(tok)
            out.append(self.process(logits[i : i + 1]))
        return out[0] if len(out) == 1 else mx.concatenate(out)

    # ---- logprobs ----------------------------------------------------------------
    def logprob_arrays(self, raw_lp: mx.array, tokens: mx.array) -> tuple[mx.array, ...]:
        """Lazy arrays for the sampled tokens' logprobs and the top ``k`` (``[n, V]``
        raw log-softmax, ``[n]`` tokens)."""
        picked = mx.take_along_axis(raw_lp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
        k = self.logprobs or 0
        if k <= 0:
            return (picked,)
        top = mx.argpartition(-raw_lp, k - 1, axis=-1)[:, :k]
        return picked, top, mx.take_along_axis(raw_lp, top, axis=-1)


def apply_words(logits: mx.array, words: np.ndarray, vocab: int) -> mx.array:
    """``[B, V]`` logits with the tokens whose bit is clear in ``words``
    (``[B, ceil(V/32)]`` int32, llguidance's bitmask layout) set to -inf. The
    bits are unpacked inside the MLX graph: one small op for the whole batch."""
    w = mx.array(words.view(np.uint32))
    allowed = ((w[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1).reshape(w.shape[0], -1)[:, :vocab]
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-mx.inf, logits.dtype))


def to_token_logprobs(tokens: list[int], arrays: tuple[mx.array, ...]) -> list[TokenLogprob]:
    """Evaluated ``logprob_arrays`` -> one ``TokenLogprob`` per token, rivals best first."""
    picked = arrays[0].tolist()
    if len(arrays) == 1:
        return [TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(tokens, picked)]
    ids, lps = arrays[1].tolist(), arrays[2].tolist()
    out = []
    for t, lp, row_ids, row_lps in zip(tokens, picked, ids, lps):
        top = sorted(zip(row_ids, row_lps), key=lambda x: -x[1])
        out.append(TokenLogprob(token_id=t, logprob=lp, top=top))
    return out
