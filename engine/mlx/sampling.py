"""Per-request token sampling with a per-request PRNG key.

mlx-lm's ``make_sampler`` draws from MLX's *global* random state. In a batch
the draws of all requests would interleave, so a request's tokens would
depend on who else is running, and ``mx.random.state`` cannot be set back to a
saved key (needed to undo a pre-launched step, see ``engine.mlx.backend``).
So each row keeps its own key and we draw with ``mx.random.categorical(...,
key=)``, while the filters (top-p, min-p, top-k) are mlx-lm's own functions,
applied in ``make_sampler``'s order.

The key is split exactly as MLX splits its global key for one draw, so a
request with ``seed=s`` gives the same tokens as ``mx.random.seed(s)``
followed by ``mlx_lm.stream_generate(..., sampler=make_sampler(...))``
(tested in tests/ember/test_mlx_parity.py).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.types import GREEDY_TEMPERATURE, SamplingParams

U64 = (1 << 64) - 1


def row_seed(sp: SamplingParams, engine_seed: int, rid: int) -> int:
    """The request's seed, or one derived from the engine seed and the row id
    (so an engine run is reproducible even without per-request seeds)."""
    if sp.seed is not None:
        return sp.seed
    return ((engine_seed << 20) + rid) & U64


class RowSampler:
    """Turns a row's log-probabilities ``[n, V]`` into ``n`` tokens."""

    __slots__ = ("greedy", "key", "_inv_temp", "_filters")

    def __init__(self, sp: SamplingParams, seed: int, vocab_size: int):
        self.greedy = sp.temperature < GREEDY_TEMPERATURE
        self.key: mx.array | None = None
        self._inv_temp = 0.0
        self._filters: list[Callable[[mx.array], mx.array]] = []
        if self.greedy:
            return
        self._inv_temp = 1.0 / sp.temperature
        self.key = mx.random.key(seed)
        top_p, min_p, top_k = sp.top_p, sp.min_p, sp.top_k
        if 0 < top_p < 1.0:
            self._filters.append(lambda x: apply_top_p(x, top_p))
        if min_p != 0.0:
            self._filters.append(lambda x: apply_min_p(x, min_p, 1))
        if 0 < top_k < vocab_size:  # apply_top_k refuses k >= V, which keeps everything anyway
            self._filters.append(lambda x: apply_top_k(x, top_k))

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        for f in self._filters:
            logprobs = f(logprobs)
        assert self.key is not None  # set whenever not greedy
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * self._inv_temp, key=sub)
