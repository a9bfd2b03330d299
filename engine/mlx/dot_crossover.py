"""Where the integer dot path stops paying for prefill on this CPU: measured once, kept on disk.

An 8-bit call of many rows (a prefill chunk) can take the integer dot path
(``qmm_t_dot``: x rounded to int16, VNNI sums) or dequantize + float32 GEMM
(``qmm_linear._dequant_gemm``: OpenBLAS). Which is faster depends on the CPU:
on the AMD EPYC (Zen 4) the dot path was built on, it won at every prefill
size measured (0.71-0.98x of the GEMM's time at 512 rows, docs/bench/cpu-qmm.md);
on an Intel Xeon with AMX (two 512-bit FMA units a core, where OpenBLAS's
float32 GEMM runs about twice as fast) the GEMM wins from ~256-384 rows, by
1.2-1.3x at 512 on the 1.5B's MLP matrices, and the 1.5B's agent turns
prefilled slower than mlx_lm.server's float32 (docs/bench/agent-session.md).

So it is measured where the model loads: the model's largest 8-bit matrix
(at most ``MAX_WEIGHTS`` weights: a vocabulary head stands in for nothing
else), x of each of ``ROWS`` rows, both paths alternated, minima. The
crossover is the fewest rows from which the GEMM takes at most ``MARGIN`` of
the dot path's time at that size and every larger one; calls of that many
rows or more take the GEMM (``qmm_linear.set_dot_rows``); 0 keeps the dot
path at every size. Kept in ``<cache>/cpu/dot-rows-<key>.json``, keyed by the
CPU, core count, MLX version, kernel source and the shape; measured again at
a quiet start where it was measured busy. ``EMBER_QMM_DOT_ROWS=N`` sets it
(0: the dot path at every size). A model with no 8-bit matrix of at least
``MIN_WEIGHTS`` weights (a toy) measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from engine.mlx import calibration_cache, qmm_kernel, qmm_linear

log = logging.getLogger("ember.mlx")

ROWS = (128, 256, 384, 512)  # a prefill chunk is at most 512 rows (EngineConfig.prefill_chunk)
MARGIN = 0.95
MIN_WEIGHTS = 1 << 20
MAX_WEIGHTS = 1 << 24
REPS = 3
SWITCH = "EMBER_QMM_DOT_ROWS"

Timer = Callable[[str, int], float]  # (path, rows) -> seconds of one call


def crossover(times: dict[tuple[str, int], float], rows: tuple[int, ...] = ROWS) -> int:
    """The fewest rows from which ``gemm`` is at most ``MARGIN`` of ``dot``'s
    time at that size and every larger one measured; 0 where there is none."""
    best = 0
    for m in sorted(rows, reverse=True):
        if times[("gemm", m)] <= MARGIN * times[("dot", m)]:
            best = m
        else:
            break
    return best


def measure(timer: Timer, rows: tuple[int, ...] = ROWS, reps: int = REPS) -> dict[tuple[str, int], float]:
    """Each path at each size, alternated, ``reps`` rounds, minima."""
    out: dict[tuple[str, int], float] = {}
    for _ in range(reps):
        for m in rows:
            for path in ("dot", "gemm"):
                t = timer(path, m)
                out[(path, m)] = min(t, out.get((path, m), t))
    return out


def shape_timer(lib: Any, N: int, K: int, group_size: int, threads: int) -> Timer:
    """Times one call of either path on a random 8-bit weight of ``(N, K)``."""
    w = mx.random.normal((N, K)) * 0.02
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=8)
    q = qmm_linear._Weights(wq, scales, biases, group_size, 8)
    xs = {m: np.random.default_rng(m).standard_normal((m, K)).astype(np.float32) for m in ROWS}
    y = np.empty((max(ROWS), N), np.float32)

    def timer(path: str, m: int) -> float:
        x = xs[m]
        t0 = time.perf_counter()
        if path == "dot":
            lib.qmm_t_dot(y.ctypes.data, x.ctypes.data, *q.ptrs, m, N, K, 8, group_size, threads)
        else:
            mx.eval(qmm_linear._dequant_gemm(lib, mx.array(x), q))
        return time.perf_counter() - t0

    return timer


def largest_8bit(model: Any) -> tuple[int, int, int] | None:
    """(N, K, group_size) of the model's largest 8-bit matrix within the bounds."""
    best: tuple[int, int, int] | None = None
    for _, m in model.named_modules():
        if getattr(m, "bits", None) != 8 or "weight" not in m or "scales" not in m:
            continue
        N, K = int(m["weight"].shape[0]), int(m["weight"].shape[1]) * 4
        if MIN_WEIGHTS <= N * K <= MAX_WEIGHTS and (best is None or best[0] * best[1] < N * K):
            best = (N, K, int(m.group_size))
    return best


def _key(N: int, K: int, group_size: int, threads: int) -> str:
    blob = json.dumps(
        {
            "cpu": calibration_cache._cpu_model(),
            "cores": os.cpu_count(),
            "mlx": getattr(mx, "__version__", "?"),
            "kernel": hashlib.sha256(qmm_kernel.SOURCE.read_bytes()).hexdigest()[:16],
            "shape": [N, K, group_size, threads],
            "rows": ROWS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def apply(model: Any, environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """Set the crossover for ``model``'s calls (measured or read back); returns it."""
    if SWITCH in environ:
        try:
            rows = max(0, int(environ[SWITCH]))
        except ValueError:
            log.warning("[mlx] %s=%r is not a row count; the dot path stays at every size", SWITCH, environ[SWITCH])
            rows = 0
        qmm_linear.set_dot_rows(rows)
        return rows
    lib = qmm_linear._state["lib"]
    shape = largest_8bit(model) if lib is not None and qmm_linear.dot() and qmm_linear.prefill_rows() else None
    if shape is None:
        qmm_linear.set_dot_rows(0)
        return 0
    N, K, gs = shape
    threads = int(qmm_linear._state["threads"])
    path = calibration_cache.cache_dir() / f"dot-rows-{_key(N, K, gs, threads)}.json"
    kept = _read(path)
    if kept is not None:
        rows = kept
    else:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        times = measure(shape_timer(lib, N, K, gs, threads))
        rows = crossover(times)
        log.info(
            "[mlx] the integer dot path against dequantize + GEMM on %dx%d: GEMM from %s rows (%.1f s)",
            N,
            K,
            rows or "no size measured",
            time.perf_counter() - t0,
        )
        _write(path, rows, load, times)
    qmm_linear.set_dot_rows(rows)
    return rows


def _read(path: Any) -> int | None:
    try:
        data = json.loads(path.read_text())
        rows, load = int(data["rows"]), data.get("load")
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or malformed: measure again, never a failed start
    cores = os.cpu_count() or 1
    if calibration_cache.measured_busy(load, cores) and calibration_cache.quiet_now(os.getloadavg()[0], cores):
        return None
    return rows


def _write(path: Any, rows: int, load: float, times: dict[tuple[str, int], float]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {"rows": rows, "load": load, "ms": {f"{p}@{m}": round(t * 1e3, 3) for (p, m), t in times.items()}}
            )
        )
        os.replace(tmp, path)
    except OSError as exc:
        log.info("[mlx] the dot crossover was not kept (%s): it is measured again at the next start", exc)
