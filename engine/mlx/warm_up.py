"""First use of the MLX CPU step's path, paid at load rather than by the first request.

A fresh process meets several things for the first time in its first
forward: OpenBLAS starts its threads at its first multi-threaded GEMM, the
split's streams are made on the MLX thread at its first split
(``engine.mlx.split_attention``), the softmax kernel's pages and ctypes call
are touched at its first call (``engine.mlx.kernel_attention``), and MLX's
buffer cache is empty, so every buffer of that forward is a fresh page. In
a server that first forward is the first request's, and after a restart that
request is the restored turn (issue #45: the turn after a restart paid it,
where a warm process's turns did not). ``warm_up`` runs one short prefill on
a throwaway cache through the same path (``split_attention.parts``) at load,
on the MLX thread, before the engine reports ready. It changes no state a
request sees: the cache is dropped, no row exists yet.
"""

from __future__ import annotations

import time
from ctypes import CDLL
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from engine.mlx import split_attention

# tokens of the warm-up prefill: a 9-head model's 48 x 48 scores (20.7k) pass the
# kernel's MIN_SCORES, so its first call is here, not in a request
WARM_TOKENS = 48


def warm_up(model: Any, parts: int, kernel: CDLL | None) -> float:
    """One ``WARM_TOKENS`` prefill through the step's attention path; its seconds."""
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    with mx.stream(generation_stream), split_attention.parts(parts, kernel):
        split_attention.make_streams(parts)
        mx.eval(model(mx.zeros((1, WARM_TOKENS), dtype=mx.int32), cache=cache))
    del cache
    return time.perf_counter() - t0


def decode_step_s(model: Any, parts: int, kernel: CDLL | None, context: int = 16, tries: int = 3) -> float:
    """Seconds of one one-token forward after a ``context``-token prefill on a
    throwaway cache, the fastest of ``tries``: the target's step that adaptive
    γ prices a draft model's step against before any round was measured
    (``ember.spec_build``). Like ``warm_up``, it changes no state a request sees."""
    cache = make_prompt_cache(model)
    best = float("inf")
    with mx.stream(generation_stream), split_attention.parts(parts, kernel):
        mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache=cache))
        for _ in range(tries):
            t0 = time.perf_counter()
            mx.eval(model(mx.zeros((1, 1), dtype=mx.int32), cache=cache))
            best = min(best, time.perf_counter() - t0)
    del cache
    return best
