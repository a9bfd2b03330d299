"""Where a quantized model's decode step goes: the kernel's calls against the rest (issue #45).

    python -m bench.cpu.qmm_share --model qwen2.5-coder-1.5b --steps 12

Loads the model as ``ember serve`` does (``engine.mlx.loading.read_model``: its
weight format, the quantized-matmul kernel, the CPU layout), prefills a short
code prompt, then times one-token decode steps and, inside them, the time spent
in the kernel's calls (``engine.mlx.qmm_kernel.qmm_t``) and in the evaluation
of each call's input (``mx.eval`` in ``engine.mlx.qmm_linear``: MLX's own ops
between two matmuls, norms, RoPE, attention, residual adds). What is left is the
model's Python and the hand-offs. Medians over the steps after two warm-ups.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def measure(model_name: str, steps: int) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.config import EngineConfig
    from engine.mlx import qmm_kernel, qmm_linear
    from engine.mlx.loading import read_model
    from engine.models import resolve_model

    loaded = read_model(resolve_model(model_name), EngineConfig(model=model_name))
    model = loaded.model
    ids = loaded.tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 3)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([ids]), cache=cache))
    spent = {"kernel": 0.0, "inputs": 0.0, "calls": 0.0}
    kernel, evaluate = qmm_kernel.qmm_t, qmm_linear.mx.eval

    def timed_kernel(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return kernel(*a, **k)
        finally:
            spent["kernel"] += time.perf_counter() - t0
            spent["calls"] += 1

    def timed_eval(*a: Any) -> None:
        t0 = time.perf_counter()
        evaluate(*a)
        spent["inputs"] += time.perf_counter() - t0

    rows: list[dict[str, float]] = []
    qmm_kernel.qmm_t = timed_kernel
    qmm_linear.mx.eval = timed_eval  # mlx.core.eval itself: the step's own final eval is counted below
    try:
        token = mx.array([[ids[-1]]])
        for _ in range(steps + 2):
            spent.update(kernel=0.0, inputs=0.0, calls=0.0)
            t0 = time.perf_counter()
            out = model(token, cache=cache)
            evaluate(out)
            rows.append({"step": time.perf_counter() - t0, **spent})
    finally:
        qmm_kernel.qmm_t, qmm_linear.mx.eval = kernel, evaluate
    rows = rows[2:]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.qmm_share", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    m = measure(args.model, args.steps)
    step = m["step"] * 1e3
    print(f"`python -m bench.cpu.qmm_share --model {args.model} --steps {args.steps}`; load (1/5/15 min) before {load}")
    print()
    print("| part of a decode step (median) | ms | share |")
    print("|---|---|---|")
    rest = step - 1e3 * (m["kernel"] + m["inputs"])
    for name, ms in (
        (f"quantized-matmul kernel ({m['calls']:.0f} calls)", 1e3 * m["kernel"]),
        ("MLX's ops between the matmuls (each call's input evaluated)", 1e3 * m["inputs"]),
        ("the model's Python and the hand-offs (the rest)", rest),
        ("the whole step", step),
    ):
        print(f"| {name} | {ms:.1f} | {ms / step:.0%} |")


if __name__ == "__main__":
    main()
