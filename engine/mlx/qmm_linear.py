"""mlx-lm's quantized layers through ``engine.mlx.qmm_kernel`` on MLX's CPU backend.

mlx-lm's models call ``nn.QuantizedLinear`` (and, for a tied head,
``nn.QuantizedEmbedding.as_linear``), which call ``mx.quantized_matmul``:
on x86 MLX's scalar, one-thread loop. ``install`` gives each such layer of one
model a subclass whose call evaluates its input, runs the C kernel on the
buffers (numpy views, no copy) on all cores, and hands the result back as an
array: the same bits as ``mx.quantized_matmul`` (the kernel keeps MLX's order
of operations), so a hooked model's greedy tokens are mlx-lm's.

What the kernel does not take (another mode or dtype, bits 3/5/6, another
device) goes to the layer's own ``__call__``. Decode calls are nodes of MLX's
graph (``engine.mlx.mlx_ops``, the kernels as MLX primitives) where that
extension builds; elsewhere (or ``EMBER_QMM_GRAPH=0``) the call evaluates its
input first (the graph is cut there, ~0.05-0.1 ms each, ~200 calls a step).
Only the layers of the model passed in change class, so an mlx-lm
oracle model in the same process stays mlx-lm's; ``uninstall`` puts them back.

Prefill-sized calls (``PREFILL_ROWS`` rows of x or more) take another path:
the weight dequantized by the C kernel (bit for bit ``mx.dequantize``) into a
reusable scratch buffer, then MLX's float32 GEMM (OpenBLAS) on it. Its sums run
in BLAS's order, not MLX's quantized_matmul's, so prefill logits differ from
mlx-lm's by float rounding (~1e-5 relative; tests/engine/test_qmm_kernel.py);
decode (few rows) stays on the bit-exact kernel. ``EMBER_QMM_PREFILL=0`` or
``install(..., prefill=False)`` (``ember serve --no-qmm-prefill``) turns it off.

Calls of 8-bit layers take the kernel's integer dot path where the CPU has it
(``qmm_kernel.qmm_t_dot``: x rounded to int16 a group, VNNI sums): not
mlx-lm's bits but a ~1e-5 error a product, for decode ~1.4x faster than the
exact kernel at one row and ~2x at eight, and for prefill faster than
dequantize + GEMM at every size measured (``python -m bench.cpu.qmm
--only-prefill-table --prefill-table 64,128,512``, its dot column). A row's
result does not depend on the others in the call. Its quality against
float32 is measured and stated in
docs/bench/weight-format.md (``q8dot``); ``EMBER_QMM_DOT=0`` or
``install(..., dot=False)`` (``ember serve --no-qmm-dot``) keeps every call
on the exact kernel, so greedy tokens are mlx-lm's again.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.mlx import layer_swap, mlx_ops, qmm_kernel

MAX_THREADS = 16
THREAD_MIN_MACS = 1 << 20  # below this a second thread costs more than it saves (~0.1 ms of work)
# Rows of x from which dequantize + float32 GEMM beats the kernel. The kernel
# streams the packed weight once a call but does its multiply-adds without
# BLAS's register blocking (~0.4x float32 GEMM from ~32 rows on); the GEMM path
# pays a fixed ~10 ms to write a 8960x1536 float32 matrix (memory bound: one
# thread or two, the same), then runs at float32 speed. Measured by
# ``python -m bench.cpu.qmm --only-prefill-table --prefill-table
# 16,32,64,128,256`` (docs/bench/cpu-qmm.md, "The prefill path"; load ~3.9 on
# 2 cores): kernel/GEMM-path time at 32 rows 0.37-0.92x (the kernel wins), at
# 64 rows 1.07-1.59x on q/o, gate/up and down, at 128 1.8-2.2x, at 256
# 2.1-2.7x. The small k/v (256x1536) only wins from ~256 rows, but it is ~2%
# of a layer's weights, so one threshold: 64.
PREFILL_ROWS = 64
# The scratch buffer's size in floats (64 MB): a matrix larger than this
# (a 151936-row head) is dequantized and multiplied in slabs of rows.
SCRATCH_FLOATS = 1 << 24
PREFILL_SWITCH = "EMBER_QMM_PREFILL"
DOT_SWITCH = "EMBER_QMM_DOT"
GRAPH_SWITCH = "EMBER_QMM_GRAPH"  # 0: decode calls from Python, as before the primitives

calls = {"kernel": 0, "dot": 0, "dequant_gemm": 0, "mlx": 0}  # quantized matmuls by path (read by tests and benches)
_state: dict[str, Any] = {
    "lib": None,
    "threads": 1,
    "prefill_rows": PREFILL_ROWS,
    "scratch": None,
    "dot": False,
    "dot_rows": 0,  # calls of this many rows or more take dequantize + GEMM, not the dot path (0: none; engine.mlx.dot_crossover)
    "ops": None,  # engine.mlx.mlx_ops: the kernels as MLX primitives, where built
}


def _threads() -> int:
    return max(1, min(os.cpu_count() or 1, MAX_THREADS))


class _Weights:
    """A quantized weight's arrays checked once and kept as numpy views (no
    copy): a decode step makes ~200 calls, and evaluating and viewing the
    three arrays again each time cost ~30-60 us a call."""

    __slots__ = ("w", "scales", "biases", "wn", "sn", "bn", "N", "K", "group_size", "bits", "ptrs")

    def __init__(self, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int):
        mx.eval(w, scales, biases)
        self.w, self.scales, self.biases = w, scales, biases  # the views below keep their buffers: so do these
        self.wn, self.sn, self.bn = np.asarray(w), np.asarray(scales), np.asarray(biases)
        self.N, self.K = int(w.shape[0]), int(w.shape[1]) * 32 // bits
        self.group_size, self.bits = group_size, bits
        qmm_kernel.check(self.wn, self.sn, self.bn, bits, group_size)  # once: the calls below skip it
        self.ptrs = (self.wn.ctypes.data, self.sn.ctypes.data, self.bn.ctypes.data)

    def holds(self, w: mx.array, scales: mx.array, biases: mx.array) -> bool:
        return self.w is w and self.scales is scales and self.biases is biases


def _weights(
    w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int, mode: str
) -> _Weights | None:
    """The checked weight for the kernel; None where the kernel does not apply."""
    if _state["lib"] is None or mode != "affine" or biases is None or bits not in qmm_kernel.BITS:
        return None
    if scales.dtype != mx.float32 or biases.dtype != mx.float32 or w.dtype != mx.uint32 or w.ndim != 2:
        return None
    K = w.shape[1] * 32 // bits
    if K % group_size or scales.shape != (w.shape[0], K // group_size) or biases.shape != scales.shape:
        return None
    try:
        return _Weights(w, scales, biases, group_size, bits)
    except ValueError:  # e.g. a strided view of another array: not the kernel's
        return None


def quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int, mode: str
) -> mx.array | None:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)`` by the
    kernel; None where the kernel does not apply (then the caller runs MLX's)."""
    q = _weights(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return None if q is None else _matmul(q, x)


def _matmul(q: _Weights, x: mx.array) -> mx.array | None:
    """``x`` times the checked weight ``q`` (transposed) by the kernel; None
    where this ``x`` is not the kernel's (another dtype or device, K)."""
    lib: ctypes.CDLL | None = _state["lib"]
    K, N = q.K, q.N
    if lib is None or x.dtype != mx.float32 or x.ndim < 1 or x.size == 0 or x.shape[-1] != K:
        return None
    if mx.default_device() != mx.cpu:
        return None
    rows = x.size // K
    threads = _state["threads"] if rows * N * K >= THREAD_MIN_MACS else 1
    dot = _state["dot"] and q.bits == 8
    ops = _state["ops"]
    if ops is not None and not 0 < _state["prefill_rows"] <= rows:
        # a node of MLX's graph (engine.mlx.mlx_ops): no evaluation here; the
        # dot path declines what it does not take, as below, in the primitive
        dot = dot and q.group_size % 32 == 0 and q.group_size <= 128
        calls["dot" if dot else "kernel"] += 1
        return ops.qmm(x, q.w, q.scales, q.biases, q.bits, q.group_size, dot, threads)
    mx.eval(x)
    xs = np.ascontiguousarray(np.asarray(x).reshape(-1, K))
    y = np.empty((rows, N), np.float32)
    # the library directly: the weight was checked once (_Weights), x here (~10 us a call saved, ~200 calls a step)
    # the dot path or dequantize + GEMM, whichever this CPU runs faster at this size (engine.mlx.dot_crossover)
    gemm = 0 < _state["prefill_rows"] <= rows and 0 < _state["dot_rows"] <= rows
    if (
        dot
        and not gemm
        and lib.qmm_t_dot(y.ctypes.data, xs.ctypes.data, *q.ptrs, rows, N, K, 8, q.group_size, threads) == 0
    ):
        calls["dot"] += 1
        return mx.array(y).reshape(*x.shape[:-1], N)
    if 0 < _state["prefill_rows"] <= rows:
        y2 = _dequant_gemm(lib, x.reshape(rows, K), q)
        calls["dequant_gemm"] += 1
        return y2.reshape(*x.shape[:-1], N)
    if lib.qmm_t(y.ctypes.data, xs.ctypes.data, *q.ptrs, rows, N, K, q.bits, q.group_size, threads) != 0:
        raise ValueError(f"qmm_t refused bits={q.bits} group_size={q.group_size} K={K}")  # checked: not seen
    calls["kernel"] += 1
    return mx.array(y).reshape(*x.shape[:-1], N)


def _scratch() -> tuple[mx.array, np.ndarray]:
    """The scratch buffer as an MLX array and a numpy view of the same memory
    (the kernel writes through the view, MLX's GEMM reads the array: no copy)."""
    if _state["scratch"] is None:
        buf = mx.array(np.zeros(SCRATCH_FLOATS, np.float32))  # a copy: MLX owns the (contiguous) memory
        mx.eval(buf)
        view = np.asarray(buf)
        if not (view.flags.c_contiguous and view.flags.writeable and view.size == SCRATCH_FLOATS):
            raise RuntimeError("MLX's buffer is not a writable contiguous view")  # not seen at MLX 0.32
        _state["scratch"] = (buf, view)
    return _state["scratch"]


def _dequant_gemm(lib: ctypes.CDLL, x: mx.array, q: _Weights) -> mx.array:
    """``x @ dequantize(w)^T`` for x (M, K): the weight dequantized into the
    scratch buffer (in slabs of rows where it is larger), MLX's float32 GEMM on
    it. Each slab's product is evaluated before the buffer is written again:
    the GEMM reads the buffer when it runs, not when it is built."""
    buf, view = _scratch()
    N, K = q.N, q.K
    wn, sn, bn, bits, group_size = q.wn, q.sn, q.bn, q.bits, q.group_size
    step = max(1, min(N, SCRATCH_FLOATS // K))
    parts = []
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        size = (n1 - n0) * K
        qmm_kernel.dequantize(
            lib,
            wn[n0:n1],
            sn[n0:n1],
            bn[n0:n1],
            bits=bits,
            group_size=group_size,
            threads=_state["threads"],
            out=view[:size].reshape(n1 - n0, K),
        )
        y = mx.matmul(x, buf[:size].reshape(n1 - n0, K).T)
        mx.eval(y)
        parts.append(y)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _layer_matmul(layer: nn.QuantizedLinear | nn.QuantizedEmbedding, x: mx.array) -> mx.array | None:
    """``x`` times a quantized layer's weight (transposed) by the kernel; None
    where it does not apply. The checked weight is kept on the layer (outside
    its parameters) until the layer's arrays change (``load_weights``, a
    ``freeze``/update that swaps them)."""
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    q = layer.__dict__.get("_ember_qmm")
    if q is None or not q.holds(w, scales, biases):
        q = _weights(w, scales, biases, group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        if q is None:
            return None
        object.__setattr__(layer, "_ember_qmm", q)  # an attribute, not a parameter (nn.Module is a dict)
    return _matmul(q, x)


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` with its matmul in the kernel where it applies."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _layer_matmul(self, x)
        if y is None:
            calls["mlx"] += 1
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied head) takes the kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _layer_matmul(self, x)
        if y is None:
            calls["mlx"] += 1
            return super().as_linear(x)
        return y


_SWAP: dict[type, type] = {nn.QuantizedLinear: KernelQuantizedLinear, nn.QuantizedEmbedding: KernelQuantizedEmbedding}


def use(
    lib: ctypes.CDLL | None, *, threads: int | None = None, prefill: bool | None = None, dot: bool | None = None
) -> None:
    """The kernel ``quantized_matmul`` calls (None: none, MLX's everywhere), on
    ``threads`` (default: every core); ``prefill``: whether calls of
    ``PREFILL_ROWS`` rows or more take dequantize + GEMM; ``dot``: whether
    8-bit decode calls take the integer dot path where the CPU has it (None: as
    it was; ``EMBER_QMM_PREFILL=0`` / ``EMBER_QMM_DOT=0`` turn them off
    whatever is passed)."""
    _state["lib"] = lib
    _state["ops"] = mlx_ops.load() if lib is not None and os.environ.get(GRAPH_SWITCH, "1") != "0" else None
    _state["threads"] = threads or _threads()
    if prefill is not None:
        _state["prefill_rows"] = PREFILL_ROWS if prefill else 0
    if os.environ.get(PREFILL_SWITCH, "1") == "0":
        _state["prefill_rows"] = 0
    if dot is not None:
        _state["dot"] = dot and lib is not None and qmm_kernel.dot_available(lib)
    if os.environ.get(DOT_SWITCH, "1") == "0":
        _state["dot"] = False


def in_graph() -> bool:
    """Whether decode calls are nodes of MLX's graph (no ``mx.eval`` a layer)."""
    return _state["ops"] is not None


def dot() -> bool:
    """Whether 8-bit decode calls take the integer dot path."""
    return bool(_state["dot"])


def set_dot_rows(rows: int) -> None:
    """Calls of ``rows`` rows or more take dequantize + GEMM rather than the
    dot path (0: the dot path at every size); measured by ``engine.mlx.dot_crossover``."""
    _state["dot_rows"] = max(0, int(rows))


def dot_rows() -> int:
    return int(_state["dot_rows"])


def prefill_rows() -> int:
    """Rows of x from which a call takes dequantize + GEMM (0: never)."""
    return int(_state["prefill_rows"])


def install(
    model: Any,
    lib: ctypes.CDLL | None = None,
    *,
    threads: int | None = None,
    prefill: bool | None = None,
    dot: bool | None = None,
) -> int:
    """Route ``model``'s quantized layers through the kernel (``lib``, else
    ``qmm_kernel.load()``); returns how many layers now take it (0 where the
    kernel is unavailable, off MLX's CPU backend, or nothing is quantized).
    ``prefill`` and ``dot`` as ``use`` (None: leave the setting, e.g. a
    drafter's install after the target's)."""
    lib = lib if lib is not None else qmm_kernel.load()
    if lib is None or mx.default_device() != mx.cpu:
        return 0
    use(lib, threads=threads, prefill=prefill, dot=dot)
    return layer_swap.swap(model, _SWAP)


def uninstall(model: Any) -> int:
    """Give ``model``'s hooked layers back their own class; returns how many."""
    return layer_swap.unswap(model, _SWAP, forget=("_ember_qmm",))
