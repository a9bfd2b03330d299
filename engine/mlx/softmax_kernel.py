"""MLX's CPU softmax, bit for bit, vectorized: a C kernel built at run time.

On Linux MLX's CPU backend runs its ``exp`` one element at a time (its SIMD
layer has no x86 type, ``simd/base_simd.h``), ~17 ns an element here, and a
long-context prefill is mostly that softmax (issue #32;
``python -m bench.cpu.softmax_kernel``). ``csrc/softmax_rows.c`` is MLX's
softmax statement for statement (the Cephes polynomial through ``fmaf``, the
row's sum in MLX's order) with the vectorizer on: ~7x faster on one core and
the same bits (tests/engine/test_softmax_kernel.py compares with
``array_equal``).

It is compiled like MLX compiles its own CPU kernels for ``mx.compile``: by
the system's C compiler, once, into the user's cache
(``~/.cache/ember/cpu/kernels``, keyed by the source, the flags and the CPU), so a
later start only loads it. Without a compiler, or where the build or load
fails, ``load()`` returns None and attention stays MLX's own
(``engine.mlx.split_attention``); the reason is logged once and kept in
``unavailable``. ``EMBER_SOFTMAX_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import pathlib
import threading

import numpy as np

from engine.mlx import cc_build

log = logging.getLogger("ember.mlx")

SOURCE = pathlib.Path(__file__).with_name("csrc") / "softmax_rows.c"
FLAGS = cc_build.FLAGS  # -ffp-contract=off, no -ffast-math: see engine.mlx.cc_build
LIBS = cc_build.LIBS

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
    fn = lib.softmax_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    fn.restype = None
    return lib


def load(directory: pathlib.Path | None = None) -> ctypes.CDLL | None:
    """The kernel, built on first use; None (and ``unavailable`` says why) where it can't be."""
    global _lib, _tried, unavailable
    with _lock:
        if _tried and directory is None:
            return _lib
        lib, reason = cc_build.open_or_build("EMBER_SOFTMAX_KERNEL", lambda: library_path(directory), build, _open)
        if directory is None:
            _lib, _tried, unavailable = lib, True, reason
        if reason:
            log.warning("softmax kernel unavailable (%s): attention keeps MLX's own softmax", reason)
        return lib


def softmax_rows(lib: ctypes.CDLL, rows: np.ndarray, *, causal_len: int = 0, offset: int = 0, threads: int = 1) -> None:
    """Softmax along the last axis of the C-contiguous float32 ``rows``, in
    place. ``causal_len`` L > 0 first masks each block of L rows causally
    (row i sees keys up to ``offset + i``), as MLX's ``"causal"`` mask does."""
    if rows.dtype != np.float32 or not rows.flags.c_contiguous or not rows.flags.writeable:
        raise ValueError("softmax_rows needs a writable C-contiguous float32 array")
    cols = rows.shape[-1] if rows.ndim else 1
    if rows.size == 0:
        return
    lib.softmax_rows(rows.ctypes.data, rows.size // cols, cols, causal_len, offset, threads)
