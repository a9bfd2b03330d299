"""Attention on MLX's CPU backend with the softmax in ``engine.mlx.softmax_kernel``.

``mx.fast.scaled_dot_product_attention`` has no CPU kernel: it falls back to
scale, QK^T, mask, ``softmax(precise=True)``, PV (``mlx/fast.cpp``,
``fallback``). ``attention`` is that fallback op for op, except that the
scores are evaluated, their buffer (which nothing else holds) goes through
the C kernel in place, and PV reads it back: the same bits as the fused call
(tests/engine/test_softmax_kernel.py compares with ``array_equal``), with
the softmax ~7x faster on one core and the causal mask folded into it (no ``where``
pass over the scores).

The price is an ``mx.eval`` inside the forward, so it applies only where the
scores are big enough for the kernel to pay for the sync: at least
``MIN_SCORES`` elements for a prefill window. A decode-sized call (at most
``DECODE_MAX_QUERIES`` query rows: a decode step or a verify window) pays
more than the sync: the MLX backend builds the next decode step's graph
while the current one computes (``engine.mlx.run_ahead``), and an
``mx.eval`` inside that graph computes both steps there and then, layer by
layer, so neither the graph's Python nor the event loop's work overlaps the
forward any more (issue #45: 8 streams at 0.77x mlx-lm's aggregate). Such a
call takes the kernel only from ``DECODE_MIN_SCORES`` elements, where the
exp it saves (~15 ns an element) is several times that price: a 9-head
model's decode token over ~7k keys at batch 1, over ~900 keys at batch 8.
"""

from __future__ import annotations

import ctypes
from typing import Any

import mlx.core as mx
import numpy as np

from engine.mlx import softmax_kernel

MIN_SCORES = 8192  # below this MLX's own softmax costs less than a sync (~0.15 ms at ~17 ns an element)
DECODE_MAX_QUERIES = 32  # query rows of a decode step or a verify window (γ <= 16) and below
DECODE_MIN_SCORES = 1 << 16  # ~1 ms of MLX's exp a call: well above a sync and the lost overlap
THREAD_MIN_SCORES = 1 << 17  # below this a second thread costs more than it saves
_FLOAT_MIN = float(np.finfo(np.float32).min)

calls = {"kernel": 0}  # attention calls whose softmax ran in the kernel (read by tests and bench)


def applies(B: int, H: int, L: int, S: int) -> bool:
    """Are the scores of a ``(B, H, L, S)`` call big enough to pay for the
    kernel's sync (and, for a decode-sized call, the lost run-ahead overlap)?"""
    scores = B * H * L * S
    return scores >= (DECODE_MIN_SCORES if L <= DECODE_MAX_QUERIES else MIN_SCORES)


def attention(
    lib: ctypes.CDLL,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any,
    threads: int = 1,
) -> mx.array | None:
    """MLX's fallback attention with the kernel's softmax; None where it does not apply
    (another dtype, a mask it does not know, or scores too small to pay)."""
    if not (q.dtype == k.dtype == v.dtype == mx.float32):
        return None
    B, H, L, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    if not applies(B, H, L, S) or H % KV:
        return None
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        return None
    if not causal and mask is not None and not isinstance(mask, mx.array):
        return None
    rep = H // KV
    qs = mx.multiply(mx.array(scale, q.dtype), q)
    if rep > 1:  # the fallback's GQA layout: (B, KV, rep, L, D) against (B, KV, 1, S, D)
        qs = qs.reshape(B, KV, rep, L, D)
        k = mx.expand_dims(k, 2)
        v = mx.expand_dims(v, 2)
    scores = mx.matmul(qs, mx.swapaxes(k, -1, -2))
    if isinstance(mask, mx.array):
        m = mask if mask.dtype == mx.bool_ else mask.astype(q.dtype)
        m = mx.broadcast_to(m, (B, H, L, S))
        if rep > 1:
            m = m.reshape(B, KV, rep, L, S)
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.array(_FLOAT_MIN, mx.float32))
        else:
            scores = scores + m
    mx.eval(scores)  # a fresh, row-contiguous buffer no other array holds: softmaxed in place
    n = threads if scores.size >= THREAD_MIN_SCORES else 1
    softmax_kernel.softmax_rows(lib, np.asarray(scores), causal_len=L if causal else 0, offset=S - L, threads=n)
    calls["kernel"] += 1
    out = mx.matmul(scores, v)
    if rep > 1:
        out = out.reshape(B, H, L, v.shape[-1])
    return out
