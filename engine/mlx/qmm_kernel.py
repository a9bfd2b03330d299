"""MLX's CPU quantized matmul, bit for bit, vectorized and threaded: a C kernel built at run time.

``mx.quantized_matmul`` (what mlx-lm's ``nn.QuantizedLinear`` calls) runs on
x86 MLX's scalar ``_qmm_t``: its SIMD path needs more than the one lane MLX's
CPU SIMD layer has there (``simd/base_simd.h``), so every weight is
dequantized and multiplied one at a time, on the CPU stream's one thread. A
Qwen2.5-Coder-1.5B token in 4-bit takes seconds where float32 takes ~0.4 s
(issues #41, #45). ``csrc/qmm_t.c`` is that loop's arithmetic statement for
statement (each row's sum in k order, no fused multiply-add), vectorized
across output rows and split across cores by output rows: the same bits
(tests/engine/test_qmm_kernel.py compares with ``array_equal``), several
times faster (``python -m bench.cpu.qmm``). 16 rows a vector where the CPU
has AVX-512 (Zen 4 runs it as two halves: it pays in instructions a weight,
not width), and threads made once and kept: a decode step makes ~200 calls,
and a thread made and joined per call cost more than a small matrix's work
(``python -m bench.cpu.qmm_ab`` times two sources of the kernel side by side).

Built like ``engine.mlx.softmax_kernel`` (``engine.mlx.cc_build``: once, into
the user's cache, keyed by source, flags and CPU); without a compiler, or
where the build or load fails, ``load()`` returns None and the model keeps
MLX's quantized matmul; the reason is logged once and kept in
``unavailable``. ``EMBER_QMM_KERNEL=0`` turns it off. Affine mode only, bits
2, 4 and 8 (a word holds whole values), float32 activations and scales.

The same library has ``dequantize``: the weight as float32, bit for bit
``mx.dequantize`` (scale * q + bias, two roundings), vectorized and threaded,
for prefill-sized calls that ``engine.mlx.qmm_linear`` hands to a float32
GEMM instead (MLX's own dequantize is scalar: ~110 ms for a 8960x1536 matrix).

And ``qmm_t_dot``, the one path that is not MLX's arithmetic: 8-bit weights
against x rounded to int16 a group, summed by AVX-512 VNNI (two int16
products a lane an instruction; a packed word's bytes are two int16 pairs
after a mask and a shift). The exact loop is bound by its multiply-adds, not
by the bytes it reads; this one reads the same bytes in ~0.7x the time at one
row of x and ~0.5x at eight (``python -m bench.cpu.qmm_ab --dot``), for a
~1e-5 relative error a product whose cost in a real model's quality
``python -m bench.cpu.weight_format`` measures (format ``q8dot``).
"""

from __future__ import annotations

import ctypes
import logging
import pathlib
import threading

import numpy as np

from engine.mlx import cc_build

log = logging.getLogger("ember.mlx")

SOURCE = pathlib.Path(__file__).with_name("csrc") / "qmm_t.c"
BITS = (2, 4, 8)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
unavailable: str | None = None  # why load() returned None, once it has


def library_path(directory: pathlib.Path | None = None) -> pathlib.Path:
    """Where the built kernel for this source, these flags and this CPU lives."""
    return cc_build.library_path(SOURCE, directory)


def build(target: pathlib.Path, compiler: str | None = None) -> None:
    """Compile the kernel into ``target`` (atomically: two processes may build at once)."""
    cc_build.build(SOURCE, target, compiler)


def _open(path: pathlib.Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.qmm_t
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    fn.restype = ctypes.c_int
    dq = lib.dequantize
    dq.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
    dq.restype = ctypes.c_int
    dot = lib.qmm_t_dot
    dot.argtypes = fn.argtypes
    dot.restype = ctypes.c_int
    lib.qmm_t_dot_available.restype = ctypes.c_int
    lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.stream_read.restype = ctypes.c_uint64
    return lib


def dot_available(lib: ctypes.CDLL) -> bool:
    """Whether this build has the integer dot path (AVX-512 VNNI)."""
    return bool(lib.qmm_t_dot_available())


def stream_read(lib: ctypes.CDLL, a: np.ndarray) -> int:
    """Read all of ``a``'s bytes (C-contiguous) as fast as loads go; an xor of
    them, so the reads cannot be elided. The GIL is released: one call a
    thread reads slices on every core at once."""
    if not a.flags.c_contiguous:
        raise ValueError("stream_read needs a C-contiguous array")
    return int(lib.stream_read(a.ctypes.data, a.nbytes))


def load(directory: pathlib.Path | None = None) -> ctypes.CDLL | None:
    """The kernel, built on first use; None (and ``unavailable`` says why) where it can't be."""
    global _lib, _tried, unavailable
    with _lock:
        if _tried and directory is None:
            return _lib
        lib, reason = cc_build.open_or_build("EMBER_QMM_KERNEL", lambda: library_path(directory), build, _open)
        if directory is None:
            _lib, _tried, unavailable = lib, True, reason
        if reason:
            log.warning("quantized matmul kernel unavailable (%s): quantized models keep MLX's own", reason)
        return lib


def qmm_t(
    lib: ctypes.CDLL,
    x: np.ndarray,
    w: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    *,
    bits: int,
    group_size: int,
    threads: int = 1,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``x @ dequantize(w, scales, biases)^T`` as ``mx.quantized_matmul(...,
    transpose=True)`` computes it: x (M, K) float32, w (N, K*bits/32) uint32,
    scales and biases (N, K/group_size) float32, all C-contiguous; (M, N) float32."""
    M, N, K = _shapes("qmm_t", x, w, scales, biases, bits, group_size)
    if out is None:
        out = np.empty((M, N), np.float32)
    elif out.shape != (M, N) or out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be a writable C-contiguous float32 (M, N) array")
    rc = lib.qmm_t(
        out.ctypes.data, x.ctypes.data, w.ctypes.data, scales.ctypes.data, biases.ctypes.data,
        M, N, K, bits, group_size, threads,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"qmm_t refused bits={bits} group_size={group_size} K={K}")
    return out


def qmm_t_dot(
    lib: ctypes.CDLL,
    x: np.ndarray,
    w: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    *,
    bits: int,
    group_size: int,
    threads: int = 1,
) -> np.ndarray | None:
    """``x @ dequantize(w)^T`` by the integer dot path (``csrc/qmm_t.c``): x
    rounded to int16 a group, an approximation of ``qmm_t`` (~1e-5 relative
    error a product), not its bits. None where the path does not apply (bits
    other than 8, groups not a multiple of 32 or over 128, a CPU without
    AVX-512 VNNI): the caller runs ``qmm_t``."""
    M, N, K = _shapes("qmm_t_dot", x, w, scales, biases, bits, group_size)
    out = np.empty((M, N), np.float32)
    rc = lib.qmm_t_dot(
        out.ctypes.data, x.ctypes.data, w.ctypes.data, scales.ctypes.data, biases.ctypes.data,
        M, N, K, bits, group_size, threads,
    )  # fmt: skip
    return out if rc == 0 else None


def _shapes(
    name: str, x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int
) -> tuple[int, int, int]:
    """M, N and K of a valid call of ``name``, or ValueError."""
    if x.ndim != 2 or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"{name} needs a 2-D C-contiguous float32 x, got {x.dtype} {x.shape}")
    N, K = check(w, scales, biases, bits, group_size)
    if x.shape[1] != K:
        raise ValueError(f"shapes do not match: x {x.shape}, w {w.shape} holds K={K}")
    return x.shape[0], N, K


def check(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> tuple[int, int]:
    """N and K of a valid (w, scales, biases) triple, or ValueError."""
    if bits not in BITS:
        raise ValueError(f"the kernel handles bits {BITS}, not {bits}")
    if w.ndim != 2 or scales.ndim != 2 or biases.ndim != 2:
        raise ValueError("the kernel takes 2-D w, scales and biases")
    N, K = w.shape[0], w.shape[1] * 32 // bits
    if group_size <= 0 or K % group_size or group_size % (32 // bits):
        raise ValueError(f"K={K} is not whole groups of {group_size} whole words")
    if scales.shape != (N, K // group_size) or biases.shape != scales.shape:
        raise ValueError(f"shapes do not match: w {w.shape}, scales {scales.shape}, biases {biases.shape}")
    for name, a, dt in (("w", w, np.uint32), ("scales", scales, np.float32), ("biases", biases, np.float32)):
        if a.dtype != dt or not a.flags.c_contiguous:
            raise ValueError(f"the kernel needs a C-contiguous {np.dtype(dt).name} {name}, got {a.dtype}")
    return N, K


def dequantize(
    lib: ctypes.CDLL,
    w: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    *,
    bits: int,
    group_size: int,
    threads: int = 1,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``mx.dequantize(w, scales, biases, ...)`` (affine) bit for bit: w (N,
    K*bits/32) uint32, scales and biases (N, K/group_size) float32, all
    C-contiguous; (N, K) float32, into ``out`` where given (a reusable buffer)."""
    N, K = check(w, scales, biases, bits, group_size)
    if out is None:
        out = np.empty((N, K), np.float32)
    elif out.shape != (N, K) or out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be a writable C-contiguous float32 (N, K) array")
    rc = lib.dequantize(
        out.ctypes.data, w.ctypes.data, scales.ctypes.data, biases.ctypes.data, N, K, bits, group_size, threads
    )
    if rc != 0:
        raise ValueError(f"dequantize refused bits={bits} group_size={group_size} K={K}")
    return out
