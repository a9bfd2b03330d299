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
Measured with ``python -m bench.forward --legs layout`` (docs/mlx-backend.md).
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


def restore_linears(model: nn.Module) -> int:
    """Undo ``pretranspose_linears``: every ``PretransposedLinear`` back to an
    ``nn.Linear`` holding ``weight_t.T``; returns how many."""
    restored = 0
    for _, parent in model.named_modules():
        for name, child in list(parent.children().items()):
            items = list(enumerate(parent[name])) if isinstance(child, list) else [(None, child)]
            for i, item in items:
                if type(item) is not PretransposedLinear:
                    continue
                w = item["weight_t"]
                lin = nn.Linear(w.shape[0], w.shape[1], bias="bias" in item)
                lin.weight = mx.contiguous(w.T)
                if "bias" in item:
                    lin.bias = item["bias"]
                if i is None:
                    setattr(parent, name, lin)
                else:
                    parent[name][i] = lin
                restored += 1
    mx.eval(model.parameters())
    return restored


# ---------------------------------------------------------------------------
# Chosen per model at load, by measurement.
#
# Both CPU choices above were measured on the bundled 5M toy, where they pay.
# On SmolLM2-135M both cost time (issue 24: the 210 weight matmuls of a decode
# token took 42 ms in mlx-lm's layout on 2 OpenBLAS threads, 60 ms stored as
# W.T, 62-71 ms on one thread). What wins depends on the shapes and the
# machine, so the backend times this model's own few-row forwards under each
# (layout, thread count) pair at load and keeps the fastest (docs/gguf.md).
# The minimum of the samples decides, not the median: on a shared machine the
# other processes only ever add time, and the least-disturbed sample is the
# closest to what the configuration itself costs.

CALIBRATION_ROWS = (1, 4)  # a decode step, and a batch-1 verify window (γ = 3)
CALIBRATION_BUDGET_S = 20.0  # at most this long at load; a model too slow for 2 rounds in it keeps the defaults


class CpuChoice:
    """What ``calibrate`` measured and chose."""

    def __init__(self, pretranspose: bool, small_threads: int, ms: dict[str, float], skipped: str = ""):
        self.pretranspose, self.small_threads, self.ms, self.skipped = pretranspose, small_threads, ms, skipped

    def as_dict(self) -> dict[str, Any]:
        return {
            "pretranspose": self.pretranspose,
            "small_forward_threads": self.small_threads,
            "ms": self.ms,
            "skipped": self.skipped,
        }


def _timer(model: nn.Module, rows: int) -> Any:
    """A closure timing one ``rows``-token forward on a cache of 16 tokens, trimmed back after each."""
    import time

    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 16]), cache=cache))
    x = mx.array([[2] * rows])

    def once() -> float:
        t = time.perf_counter()
        mx.eval(model(x, cache=cache))
        dt = time.perf_counter() - t
        trim_prompt_cache(cache, rows)
        return dt

    return once


def calibrate(model: nn.Module, blas: Any, *, allow_pretranspose: bool = True, reps: int = 5) -> CpuChoice:
    """Time this model's 1- and 4-row forwards in mlx-lm's layout and stored as
    W.T, each on one OpenBLAS thread and on all, rounds interleaved, minima;
    leave ``model`` in the fastest layout and return the choice. The sum of
    the 1-row and the 4-row time decides (decode, and a verify window)."""
    threads = [1, blas.default] if blas.active else [0]
    layouts = [False, True] if allow_pretranspose else [False]
    # One probe: a model too slow to time a few dozen forwards keeps the defaults
    # (its matmuls are large, where neither choice was measured to matter).
    probe = _timer(model, 1)
    probe()
    cost = probe()
    per_round = len(threads) * len(layouts) * len(CALIBRATION_ROWS) * cost * 2  # 4-row ~ up to 3x a 1-row
    reps = min(reps, int(CALIBRATION_BUDGET_S / per_round) - 1)
    if reps < 2:
        if allow_pretranspose:
            pretranspose_linears(model)
        return CpuChoice(allow_pretranspose, 1, {}, skipped=f"a 1-row forward takes {cost * 1000:.0f} ms")
    ms: dict[str, float] = {}
    for pre in layouts:
        if pre:
            pretranspose_linears(model)
        timers = {rows: _timer(model, rows) for rows in CALIBRATION_ROWS}
        samples: dict[tuple[int, int], list[float]] = {}
        for _ in range(reps + 1):  # the first round warms up and is dropped
            for n in threads:
                blas.use(n)
                for rows, once in timers.items():
                    samples.setdefault((n, rows), []).append(once())
        for (n, rows), ts in samples.items():
            ms[f"{'wt' if pre else 'w'}/threads={n or 'default'}/rows={rows}"] = 1000 * min(ts[1:])
    blas.use(0)

    def total(pre: bool, n: int) -> float:
        return sum(ms[f"{'wt' if pre else 'w'}/threads={n or 'default'}/rows={rows}"] for rows in CALIBRATION_ROWS)

    best_pre, best_n = min(((p, n) for p in layouts for n in threads), key=lambda c: total(*c))
    if allow_pretranspose and not best_pre:
        restore_linears(model)
    return CpuChoice(best_pre, best_n if best_n else 1, {k: round(v, 3) for k, v in ms.items()})
