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

from collections.abc import Callable
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

# Rows of a decode step (the batch width; a γ = 3 verify window is 4 rows of one
# sequence, the same matmuls). A step of w rows uses the thread count measured
# for the smallest of these ≥ w; wider steps and prefill keep every thread.
CALIBRATION_ROWS = (1, 2, 4, 8)
SMALL_FORWARD_ROWS = 5  # the rule before measurement: at most 5 rows on one thread (the toy's)
# The shapes that choose the layout (fixed for the whole model): a single-stream
# decode and a full 8-stream batch, each as its slowdown against the best layout
# for that shape, so neither dominates because its forward is longer. The sum of
# the 1-row and 4-row times used before picked W.T on Gemma-3-270M, which made
# its 1-row decode 13% slower (issue 24).
LAYOUT_ROWS = (1, 8)
# At most this long at the first load (the result is cached on disk: engine.mlx.calibration_cache).
# Gemma-3-270M (a 262k-token head) needs ~50 s on the shared 2-core machine.
CALIBRATION_BUDGET_S = 60.0
# The stored-as-W.T layout must beat mlx-lm's own by this much (its summed slowdown
# over LAYOUT_ROWS) to be chosen. A 1.5B float32 model, timed in two rounds at load,
# came out 6% faster transposed; served, it decoded 0.86x mlx_lm.server, and 1.01x in
# mlx-lm's layout (docs/bench/vs-mlx-lm-smollm2.md): a large model's matrix-vector
# products read their weights row by row faster than column by column.
LAYOUT_MARGIN = 0.10


class CpuChoice:
    """What ``calibrate`` measured and chose: the layout, and the OpenBLAS
    thread count per row bucket (``threads[r]`` for steps of at most ``r`` rows)."""

    def __init__(
        self,
        pretranspose: bool,
        threads: dict[int, int],
        ms: dict[str, float],
        skipped: str = "",
        source: str = "measured",
    ):
        self.pretranspose, self.threads, self.ms, self.skipped = pretranspose, dict(threads), ms, skipped
        self.source = source

    @property
    def small_threads(self) -> int:
        """The count for a 1-row decode (0 = every thread)."""
        return self.threads_for(1)

    def threads_for(self, rows: int) -> int:
        """OpenBLAS threads for a forward of ``rows`` token rows (0 = every thread)."""
        for r in sorted(self.threads):
            if rows <= r:
                return self.threads[r]
        return 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "pretranspose": self.pretranspose,
            "small_forward_threads": self.small_threads,
            "threads_by_rows": {str(r): n for r, n in sorted(self.threads.items())},
            "ms": self.ms,
            "skipped": self.skipped,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CpuChoice:
        """The inverse of ``as_dict``; raises ValueError on anything malformed."""
        pre, threads, ms = d.get("pretranspose"), d.get("threads_by_rows"), d.get("ms", {})
        if not isinstance(pre, bool) or not isinstance(threads, dict) or not isinstance(ms, dict):
            raise ValueError("not a CPU choice")
        parsed = {int(r): int(n) for r, n in threads.items()}
        skipped = str(d.get("skipped", ""))
        if (not parsed and not skipped) or any(r < 1 or n < 0 for r, n in parsed.items()):
            raise ValueError("bad thread buckets")  # only a skipped calibration has none (every thread)
        return cls(pre, parsed, {str(k): float(v) for k, v in ms.items()}, skipped, "cache")


# (model, rows) -> a closure timing one forward of ``rows`` decode rows, in seconds
TimerFactory = Callable[[nn.Module, int], Callable[[], float]]


def _timer(model: nn.Module, rows: int) -> Callable[[], float]:
    """A closure timing one decode step of ``rows`` batch rows (one token each)
    on a cache of 16 tokens per row, trimmed back after each."""
    import time

    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 16] * rows), cache=cache))
    x = mx.array([[2]] * rows)

    def once() -> float:
        t = time.perf_counter()
        mx.eval(model(x, cache=cache))
        dt = time.perf_counter() - t
        trim_prompt_cache(cache, 1)
        return dt

    return once


def _key(pre: bool, n: int, rows: int) -> str:
    return f"{'wt' if pre else 'w'}/threads={n or 'default'}/rows={rows}"


def thread_candidates(blas: Any) -> list[int]:
    """1, 2 and every thread (0 = OpenBLAS's default count); just [0] without OpenBLAS."""
    if not blas.active:
        return [0]
    return sorted({1, min(2, blas.default)} - {blas.default}) + [0]


def choose(ms: dict[str, float], layouts: list[bool], threads: list[int]) -> tuple[bool, dict[int, int]]:
    """The layout with the smallest summed relative slowdown over ``LAYOUT_ROWS``
    (each shape on its best thread count), then, in that layout, the fastest
    thread count for every row bucket. ``ms`` holds ``_key`` → milliseconds."""

    def best(pre: bool, rows: int) -> float:
        return min(ms[_key(pre, n, rows)] for n in threads)

    def slowdown(pre: bool) -> float:
        return sum(best(pre, r) / min(best(p, r) for p in layouts) for r in LAYOUT_ROWS)

    pre = min(layouts, key=lambda p: (slowdown(p), p))  # a tie keeps mlx-lm's own layout
    if pre and slowdown(pre) > (1.0 - LAYOUT_MARGIN) * slowdown(False):
        pre = False  # within the noise of a few rounds' minima: mlx-lm's own layout
    per_rows = {r: min(threads, key=lambda n: ms[_key(pre, n, r)]) for r in CALIBRATION_ROWS}
    return pre, per_rows


def calibrate(
    model: nn.Module,
    blas: Any,
    *,
    allow_pretranspose: bool = True,
    reps: int = 4,
    timer: TimerFactory = _timer,
) -> CpuChoice:
    """Time this model's decode steps of 1, 2, 4 and 8 rows in mlx-lm's layout
    and stored as W.T, each on 1, 2 and all OpenBLAS threads, all of them in
    every round, minima; leave ``model`` in the chosen layout (``choose``) and
    return the choice. ``timer`` is injectable for tests."""
    threads = thread_candidates(blas)
    layouts = [False, True] if allow_pretranspose else [False]
    # One probe: a model too slow to time a few dozen forwards keeps the defaults
    # (its matmuls are large, where neither choice was measured to matter).
    probe = timer(model, 1)
    probe()
    cost = probe()
    per_round = len(threads) * len(layouts) * len(CALIBRATION_ROWS) * cost * 2  # 8 rows ~ up to 3x a 1-row
    reps = min(reps, int(CALIBRATION_BUDGET_S / max(per_round, 1e-9)) - 1)
    if reps < 2:
        # mlx-lm's own layout on every thread: what the toy-made rules cost on
        # real models (issue 24), and large matmuls are what threads are for
        return CpuChoice(False, {}, {}, skipped=f"a 1-row forward takes {cost * 1000:.0f} ms")
    timers = {rows: timer(model, rows) for rows in CALIBRATION_ROWS}
    samples: dict[tuple[bool, int, int], list[float]] = {}
    current = False
    for rnd in range(reps + 1):  # the first round warms up and is dropped
        # Both layouts in every round, in alternating order (a switch costs one
        # copy of the weights): a change in the machine's load halfway through
        # then hits both alike instead of deciding between them.
        for pre in layouts if rnd % 2 == 0 else layouts[::-1]:
            if pre != current:
                (pretranspose_linears if pre else restore_linears)(model)
                current = pre
            for n in threads:
                blas.use(n)
                for rows, once in timers.items():
                    samples.setdefault((pre, n, rows), []).append(once())
    ms = {_key(pre, n, rows): 1000 * min(ts[1:]) for (pre, n, rows), ts in samples.items()}
    blas.use(0)
    best_pre, per_rows = choose(ms, layouts, threads)
    if best_pre != current:
        (pretranspose_linears if best_pre else restore_linears)(model)
    return CpuChoice(best_pre, per_rows, {k: round(v, 3) for k, v in ms.items()})


def apply_choice(model: nn.Module, choice: CpuChoice, *, allow_pretranspose: bool = True) -> None:
    """Put a freshly loaded ``model`` in a cached choice's layout."""
    if choice.pretranspose and allow_pretranspose:
        pretranspose_linears(model)
