"""Weights laid out for OpenBLAS on MLX's CPU backend.

``nn.Linear`` computes ``x @ W.T`` with ``W`` stored ``(out, in)``; MLX hands
OpenBLAS the transposed operand as is. For the few-row products of decode and
speculative verify (a window of γ + 1 tokens) OpenBLAS's GEMM is slow on that
operand: on the bundled target a 4-row ``(4, 256) @ (256, 704)`` took ~1.4x
longer through ``W.T`` than through a contiguous ``(in, out)`` copy, while one
row and a 256-row prefill cost the same either way. So on the CPU the backend
stores every plain float ``Linear`` as ``W.T`` once, at load, in place of
``W`` (no extra memory), and multiplies by it directly. Numerics: prefill is
bit-identical; few-row products go through another OpenBLAS kernel and differ
by ~1e-5 in the logits (fp32), the same order as batched vs single decode.

Metal and CUDA have their own kernels tuned for ``W.T``: this is CPU-only.
Measured with ``python -m sims.bench_forward --legs layout`` (docs/mlx-backend.md).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class PretransposedLinear(nn.Module):
    """``nn.Linear`` with its weight stored ``(in, out)``: ``x @ weight_t (+ bias)``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight_t"])
        return x @ self["weight_t"]


def _plain_float_linear(m: Any) -> bool:
    # Exactly nn.Linear: QuantizedLinear and LoRA wrappers compute differently.
    return type(m) is nn.Linear and mx.issubdtype(m.weight.dtype, mx.floating)


def pretranspose_linears(model: nn.Module) -> int:
    """Swap every plain float ``nn.Linear`` in ``model`` for a
    ``PretransposedLinear`` holding the same weights; returns how many."""
    swapped = 0
    for _, parent in model.named_modules():
        for name, child in list(parent.children().items()):
            if isinstance(child, list):
                child = parent[name]  # children() hands out a copy of the list
                for i, item in enumerate(child):
                    if _plain_float_linear(item):
                        child[i] = PretransposedLinear(item)
                        swapped += 1
            elif _plain_float_linear(child):
                setattr(parent, name, PretransposedLinear(child))
                swapped += 1
    mx.eval(model.parameters())
    return swapped


def wants_pretranspose() -> bool:
    """On MLX's CPU backend only (Metal and CUDA kernels are tuned for ``W.T``)."""
    return mx.default_device() == mx.cpu
