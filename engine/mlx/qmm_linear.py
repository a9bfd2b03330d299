"""mlx-lm's quantized layers through ``engine.mlx.qmm_kernel`` on MLX's CPU backend.

mlx-lm's models call ``nn.QuantizedLinear`` (and, for a tied head,
``nn.QuantizedEmbedding.as_linear``), which call ``mx.quantized_matmul``:
on x86 MLX's scalar, one-thread loop. ``install`` gives each such layer of one
model a subclass whose call evaluates its input, runs the C kernel on the
buffers (numpy views, no copy) on all cores, and hands the result back as an
array: the same bits as ``mx.quantized_matmul`` (the kernel keeps MLX's order
of operations), so a hooked model's greedy tokens are mlx-lm's.

What the kernel does not take (another mode or dtype, bits 3/5/6, another
device) goes to the layer's own ``__call__``. The price is an ``mx.eval`` per
layer (the graph is cut there, ~0.05-0.1 ms each), small against a layer's
weights. Only the layers of the model passed in change class, so an mlx-lm
oracle model in the same process stays mlx-lm's; ``uninstall`` puts them back.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.mlx import qmm_kernel

MAX_THREADS = 16
THREAD_MIN_MACS = 1 << 20  # below this a second thread costs more than it saves (~0.1 ms of work)

calls = {"kernel": 0, "mlx": 0}  # quantized matmuls by path (read by tests, bench and /stats)
_state: dict[str, Any] = {"lib": None, "threads": 1}


def _threads() -> int:
    return max(1, min(os.cpu_count() or 1, MAX_THREADS))


def quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int, mode: str
) -> mx.array | None:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)`` by the
    kernel; None where the kernel does not apply (then the caller runs MLX's)."""
    lib: ctypes.CDLL | None = _state["lib"]
    if lib is None or mode != "affine" or biases is None or bits not in qmm_kernel.BITS:
        return None
    if x.dtype != mx.float32 or scales.dtype != mx.float32 or biases.dtype != mx.float32 or w.dtype != mx.uint32:
        return None
    if w.ndim != 2 or x.ndim < 1 or x.size == 0 or mx.default_device() != mx.cpu:
        return None
    K = x.shape[-1]
    N = w.shape[0]
    if K % group_size or w.shape[1] * 32 != K * bits or scales.shape != (N, K // group_size):
        return None
    mx.eval(x, w, scales, biases)
    xs = np.ascontiguousarray(np.asarray(x).reshape(-1, K))
    macs = xs.shape[0] * N * K
    threads = _state["threads"] if macs >= THREAD_MIN_MACS else 1
    y = qmm_kernel.qmm_t(
        lib,
        xs,
        np.asarray(w),
        np.asarray(scales),
        np.asarray(biases),
        bits=bits,
        group_size=group_size,
        threads=threads,
    )
    calls["kernel"] += 1
    return mx.array(y).reshape(*x.shape[:-1], N)


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` with its matmul in the kernel where it applies."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        if y is None:
            calls["mlx"] += 1
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied head) takes the kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        if y is None:
            calls["mlx"] += 1
            return super().as_linear(x)
        return y


_SWAP: dict[type, type] = {nn.QuantizedLinear: KernelQuantizedLinear, nn.QuantizedEmbedding: KernelQuantizedEmbedding}
_BACK = {v: k for k, v in _SWAP.items()}


def use(lib: ctypes.CDLL | None, *, threads: int | None = None) -> None:
    """The kernel ``quantized_matmul`` calls (None: none, MLX's everywhere), on ``threads`` (default: every core)."""
    _state["lib"] = lib
    _state["threads"] = threads or _threads()


def install(model: Any, lib: ctypes.CDLL | None = None, *, threads: int | None = None) -> int:
    """Route ``model``'s quantized layers through the kernel (``lib``, else
    ``qmm_kernel.load()``); returns how many layers now take it (0 where the
    kernel is unavailable, off MLX's CPU backend, or nothing is quantized)."""
    lib = lib if lib is not None else qmm_kernel.load()
    if lib is None or mx.default_device() != mx.cpu:
        return 0
    use(lib, threads=threads)
    done = 0
    for m in model.modules():
        cls = _SWAP.get(type(m))
        if cls is not None:
            m.__class__ = cls
        done += type(m) in _BACK
    return done


def uninstall(model: Any) -> int:
    """Give ``model``'s hooked layers back their own class; returns how many."""
    done = 0
    for m in model.modules():
        cls = _BACK.get(type(m))
        if cls is not None:
            m.__class__ = cls
            done += 1
    return done
