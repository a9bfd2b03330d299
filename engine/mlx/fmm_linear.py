"""mlx-lm's float32 layers through the float32 kernel (``csrc/qmm_t.c`` ``fmm_t``) on MLX's CPU backend.

At decode a float32 layer reads its whole weight for a few rows of x, and
MLX hands that to OpenBLAS's GEMM, whose packing and blocking are built for
large matrices: on SmolLM2-135M's decode weights it reads ~12 GB/s at one
row and ~8 GB/s at eight against the ~25 GB/s two cores stream. The kernel
streams each weight row once against the rows of x held in L1 (measured by
``python -m bench.cpu.fmm``: ~1.5x at one row, ~1.7-2.4x at 2-12, 1.5x at
16, 1.2x at 32, even from 48 to 64, so calls of up to ``MAX_ROWS`` rows take it).

It runs as an MLX primitive (``engine.mlx.mlx_ops``): without the extension
nothing is installed (a kernel called from Python pays an ``mx.eval`` a
layer, which on this model costs what the kernel saves). Its sums are not
OpenBLAS's order: logits differ from mlx-lm's by float rounding (~1e-7
relative a product; tests/engine/test_fmm_kernel.py), as the pretransposed
layout's did (``engine.mlx.cpu_layout``). ``EMBER_FMM=0`` or ``ember serve
--no-fmm-kernel`` keeps MLX's matmul.

Only the model passed in changes class (``engine.mlx.layer_swap``);
``uninstall`` puts the layers back.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.mlx import layer_swap, mlx_ops

SWITCH = "EMBER_FMM"
# rows of x up to which the kernel beats OpenBLAS with a margin (bench.cpu.fmm, 2026-12-05,
# once its accumulators lived in registers: 1.50x at 16, 1.33x at 24, 1.21x at 32, 1.06x at
# 48, 0.99x at 64; 12 before, when it was even at 16): a batch of 8 verifying windows of 2-4
# takes it too
MAX_ROWS = 32
# below this a second thread costs more than it saves. Lower than the quantized
# kernel's (a float32 weight's bytes are the cost, not its arithmetic): SmolLM2's
# batch-1 step at 2^14-2^18 MACs 53.9-54.9 ms, at 2^20 63.7 ms (its 576x1536
# matrices on one thread)
THREAD_MIN_MACS = 1 << 16

calls = {"kernel": 0, "mlx": 0}  # float32 matmuls of hooked layers by path, counted at graph build
_state: dict[str, Any] = {"ops": None, "threads": 1}


def _matmul(x: mx.array, w: mx.array) -> mx.array | None:
    """``x @ w.T`` by the kernel; None where it does not apply."""
    ops = _state["ops"]
    if ops is None or x.dtype != mx.float32 or w.dtype != mx.float32 or w.ndim != 2 or x.ndim < 1:
        return None
    N, K = w.shape
    if x.shape[-1] != K or x.size == 0:
        return None
    rows = x.size // K
    if rows > MAX_ROWS or mx.default_device() != mx.cpu:
        return None
    calls["kernel"] += 1
    return ops.fmm(x, w, _state["threads"] if rows * N * K >= THREAD_MIN_MACS else 1)


class KernelLinear(nn.Linear):
    """``nn.Linear`` with its few-row matmuls in the float32 kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(x, self["weight"])
        if y is None:
            calls["mlx"] += 1
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied head) takes the kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _matmul(x, self["weight"])
        if y is None:
            calls["mlx"] += 1
            return super().as_linear(x)
        return y


_SWAP: dict[type, type] = {nn.Linear: KernelLinear, nn.Embedding: KernelEmbedding}


def install(model: Any, *, threads: int | None = None) -> int:
    """Route ``model``'s float32 ``nn.Linear`` layers and tied head through the
    kernel; returns how many layers now take it (0 where the extension or the
    kernel is unavailable, off MLX's CPU backend, ``EMBER_FMM=0``, or nothing
    is float32)."""
    if os.environ.get(SWITCH, "1") == "0" or mx.default_device() != mx.cpu:
        return 0
    ops = mlx_ops.load()
    if ops is None or not ops.fmm_available():
        return 0
    _state["ops"] = ops
    _state["threads"] = threads or max(1, min(os.cpu_count() or 1, 16))
    return layer_swap.swap(model, _SWAP, accept=lambda m: m["weight"].dtype == mx.float32)


def uninstall(model: Any) -> int:
    """Give ``model``'s hooked layers back their own class; returns how many."""
    return layer_swap.unswap(model, _SWAP)
