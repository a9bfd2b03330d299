"""Attention split across MLX CPU streams, bit for bit the unsplit call.

On MLX's CPU backend ``mx.fast.scaled_dot_product_attention`` falls back to
matmul, softmax, matmul on the calling stream, and the softmax's ``exp`` (~20
ns an element, one thread) is most of a long-context turn's prefill (issue
#32). One stream runs on one core; a second stream runs on another. So the
call is cut into parts that each compute whole softmax rows, one stream each:

* windows of at least ``2 * MIN_ROWS`` queries: along the batch, or at
  batch 1 along the KV heads (with their query heads);
* decode-sized calls over at least ``DECODE_MIN_KEYS`` keys, along the batch
  only: at batch 1 a decode token's heads split measured 0.87x the whole
  call (below), so it is not run there (issue #45).

Every part runs exactly the GEMMs the whole call would (one per batch row and
KV head, the same shapes), so the result is identical
(tests/engine/test_split_attention.py compares bit for bit). Query rows are
not split: a part's QK^T with fewer rows takes another OpenBLAS tile path on
some CPUs (Zen: every rows split of 128-201 queries landed ~1e-7 away), where
a heads split leaves each GEMM as it was.

Measured here (2 cores, SmolLM2-135M, OpenBLAS; docs/bench/cpu-attention.md):
300 new tokens at 4k context 1.38x faster than the whole call, at 2k 1.16x; a
decode token at 4k keys 1.05x at batch 4 and 0.87x at batch 1.

Where the softmax kernel is built (``engine.mlx.softmax_kernel``, the default
on Linux), calls big enough for it go there instead
(``engine.mlx.kernel_attention``: the softmax ~7x faster a core, on threads of its
own, the same bits); the split is what is left for the others.

mlx-lm's models call ``scaled_dot_product_attention`` from their own module's
namespace; ``install`` rebinds it there to ``split_sdpa``, which splits only
on a thread inside ``parts(n)`` (the MLX backend's step) and is mlx-lm's own
function everywhere else: an mlx-lm oracle in the same process stays mlx-lm.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from engine.mlx import kernel_attention

MIN_ROWS = 64
DECODE_MIN_KEYS = 2048
MAX_DEFAULT_PARTS = 4  # measured only on 2 cores; more parts than this is unmeasured

_original = base.scaled_dot_product_attention
_local = threading.local()
_lock = threading.Lock()
calls = {"batch": 0, "heads": 0}  # graph constructions split, by axis (read by /stats)


def default_parts() -> int:
    """One part per core, at most ``MAX_DEFAULT_PARTS``; 1 (no split) off MLX's CPU backend."""
    if mx.default_device() != mx.cpu:
        return 1
    return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_PARTS))


def install(model: Any) -> int:
    """Rebind ``scaled_dot_product_attention`` in the modules of ``model``'s
    layers (where mlx-lm's ``base`` version is bound); returns how many."""
    names = {type(m).__module__ for m in model.modules()} | {type(model).__module__}
    done = 0
    with _lock:
        for name in sorted(names):
            mod = sys.modules.get(name)
            fn = getattr(mod, "scaled_dot_product_attention", None)
            if fn is _original:
                mod.scaled_dot_product_attention = split_sdpa  # type: ignore[union-attr]
            if getattr(mod, "scaled_dot_product_attention", None) is split_sdpa:
                done += 1
    return done


@contextlib.contextmanager
def parts(n: int, kernel: ctypes.CDLL | None = None) -> Iterator[None]:
    """Split attention into ``n`` parts on this thread while inside; with
    ``kernel`` (``engine.mlx.softmax_kernel``), calls big enough for it take
    ``engine.mlx.kernel_attention`` first, its softmax on ``n`` threads."""
    before = getattr(_local, "parts", 1), getattr(_local, "kernel", None)
    _local.parts, _local.kernel = n, kernel
    try:
        yield
    finally:
        _local.parts, _local.kernel = before


def _streams(n: int) -> list[mx.Stream]:
    # MLX streams belong to the thread that made them; the MLX thread releases
    # its streams when it ends (engine.mlx.device.release_thread_streams).
    have: list[mx.Stream] = getattr(_local, "streams", [])
    while len(have) < n:
        have.append(mx.new_stream(mx.cpu))
    _local.streams = have
    return have[:n]


def make_streams(n: int) -> None:
    """Make this thread's ``n`` split streams now (at load: ``engine.mlx.warm_up``)."""
    if n > 1:
        _streams(n)


def _bounds(total: int, n: int) -> list[tuple[int, int]]:
    cuts = [total * i // n for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


def split_sdpa(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, in the softmax kernel or
    split where ``parts`` asks."""
    n = getattr(_local, "parts", 1)
    lib = getattr(_local, "kernel", None)
    out = None
    if not hasattr(cache, "bits") and mx.default_device() == mx.cpu:  # quantized KV: mlx-lm's own path
        if lib is not None and sinks is None:
            out = kernel_attention.attention(lib, queries, keys, values, scale=scale, mask=mask, threads=n)
        if out is None and n > 1:
            out = split_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks, n=n)
    if out is None:
        out = _original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    return out


def split_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any, sinks: mx.array | None, n: int
) -> mx.array | None:
    """``mx.fast.scaled_dot_product_attention`` in up to ``n`` parts on
    streams of their own, concatenated; None where no split applies."""
    B, H, L, _ = q.shape
    KV, S = k.shape[1], k.shape[2]
    sdpa = mx.fast.scaled_dot_product_attention
    arr = isinstance(mask, mx.array)
    if L < 2 * MIN_ROWS and (S < DECODE_MIN_KEYS or B < 2):
        return None  # a short window over few keys, or a decode call at batch 1: the split loses
    if B >= 2:
        pieces = _bounds(B, min(n, B))
        outs = []
        for (b0, b1), s in zip(pieces, _streams(len(pieces))):
            m = mask[b0:b1] if arr and mask.ndim == 4 and mask.shape[0] == B else mask
            outs.append(sdpa(q[b0:b1], k[b0:b1], v[b0:b1], scale=scale, mask=m, sinks=sinks, stream=s))
        calls["batch"] += 1
        return mx.concatenate(outs, axis=0)
    if KV >= 2 and sinks is None and not (arr and mask.ndim == 4 and mask.shape[1] != 1):
        rep = H // KV
        pieces = _bounds(KV, min(n, KV))
        outs = []
        for (h0, h1), s in zip(pieces, _streams(len(pieces))):
            qp = q[:, h0 * rep : h1 * rep]
            outs.append(sdpa(qp, k[:, h0:h1], v[:, h0:h1], scale=scale, mask=mask, stream=s))
        calls["heads"] += 1
        return mx.concatenate(outs, axis=1)
    return None
