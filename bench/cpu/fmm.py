"""The float32 kernel (engine.mlx.fmm_linear, an MLX primitive) against MLX's
matmul (OpenBLAS), at decode shapes and in a model's decode step (issue #45).

    python -m bench.cpu.fmm --model smollm2-135m --rounds 3

Part 1, the matmuls alone: the model's own linear shapes, one distinct
random weight per layer (so each is read from memory, as in a step), for
1-32 rows of x: MLX's ``x @ W.T`` (mlx-lm's layout), ``x @ W_t`` (Ember's
pretransposed layout), and the kernel; milliseconds for all layers' matmuls,
the bytes read per second, and the kernel's ratio to the faster MLX layout.

Part 2, the model: mlx-lm's forward of the model (``--model``, float32) for
one decode token at batch 1 and 8 after a 64-token prompt, with the kernel
installed and without, alternated round by round; the median step and the
ratio. Greedy tokens of the two over ``--tokens`` tokens are compared too.
OpenBLAS is preloaded (the bench re-execs as ``ember`` does); the load is printed.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any


def _median_ms(fn: Callable[[], Any], n: int) -> float:
    fn()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


def _run(product: Callable[[Any], Any], weights: list[Any]) -> None:
    import mlx.core as mx

    mx.eval([product(w) for w in weights])


def _by_w_t(xs: dict[int, Any], w: Any) -> Any:  # mlx-lm's layout
    return xs[w.shape[1]] @ w.T


def _by_wt(xs: dict[int, Any], w: Any) -> Any:  # Ember's pretransposed layout
    return xs[w.shape[0]] @ w


def _by_kernel(ops: Any, threads: int, xs: dict[int, Any], w: Any) -> Any:
    return ops.fmm(xs[w.shape[1]], w, threads)


def _shapes(model: Any) -> list[tuple[int, int]]:
    import mlx.nn as nn

    layer = model.layers[0]
    return [(int(m.weight.shape[1]), int(m.weight.shape[0])) for m in layer.modules() if type(m) is nn.Linear]


def matmuls(ops: Any, shapes: list[tuple[int, int]], layers: int, rows: list[int], n: int) -> list[str]:
    import mlx.core as mx

    ws = [mx.random.normal((N, K)) for _ in range(layers) for K, N in shapes]
    wts = [mx.contiguous(w.T) for w in ws]
    mx.eval(ws, wts)
    nbytes = sum(w.nbytes for w in ws)
    out = [
        f"{layers} layers x {len(shapes)} matmuls, {nbytes / 1e6:.0f} MB of float32 weights",
        "",
        "| rows | MLX x @ W.T (ms) | MLX x @ W_t (ms) | kernel (ms) | kernel GB/s | kernel ÷ faster MLX |",
        "|---|---|---|---|---|---|",
    ]
    threads = os.cpu_count() or 1
    for m in rows:
        xs = {K: mx.random.normal((m, K)) for K in {k for k, _ in shapes}}
        mx.eval(list(xs.values()))
        a = _median_ms(functools.partial(_run, functools.partial(_by_w_t, xs), ws), n)
        b = _median_ms(functools.partial(_run, functools.partial(_by_wt, xs), wts), n)
        c = _median_ms(functools.partial(_run, functools.partial(_by_kernel, ops, threads, xs), ws), n)
        out.append(f"| {m} | {a:.1f} | {b:.1f} | {c:.1f} | {nbytes / c / 1e6:.1f} | {min(a, b) / c:.2f}x |")
    return out


def model_steps(model: Any, prompt: list[int], rounds: int, n: int, tokens: int) -> list[str]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from engine.mlx import fmm_linear

    def step_fn(batch: int) -> Callable[[], None]:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt] * batch), cache=cache))
        y = mx.array([[prompt[-1]]] * batch)

        def step() -> None:
            mx.eval(model(y, cache=cache))
            for c in cache:  # the same context length every step
                c.offset -= 1

        return step

    res: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for arm in ("mlx", "kernel") if r % 2 == 0 else ("kernel", "mlx"):
            if arm == "kernel":
                assert fmm_linear.install(model) > 0, "the kernel did not install"
            for b in (1, 8):
                res.setdefault((arm, b), []).append(_median_ms(step_fn(b), n))
            fmm_linear.uninstall(model)

    def greedy() -> list[int]:
        gen = generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=make_sampler(0.0))
        return [int(t) for t, _ in gen]

    want = greedy()
    fmm_linear.install(model)
    got = greedy()
    fmm_linear.uninstall(model)
    same = sum(a == b for a, b in zip(want, got, strict=True))
    out = [
        "| batch | MLX step (ms, median) | kernel step (ms, median) | MLX ÷ kernel |",
        "|---|---|---|---|",
    ]
    for b in (1, 8):
        a, k = statistics.median(res[("mlx", b)]), statistics.median(res[("kernel", b)])
        out.append(f"| {b} | {a:.1f} | {k:.1f} | {a / k:.2f}x |")
    out += ["", f"greedy tokens equal to MLX's matmul: {same} of {tokens} (first difference at "
            f"{next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)})"]  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.fmm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of the model's step")
    ap.add_argument("--steps", type=int, default=15, help="timed calls per measurement (median)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens compared")
    args = ap.parse_args(argv)

    import mlx_lm

    from engine.mlx import mlx_ops
    from engine.models import resolve_model

    ops = mlx_ops.load()
    if ops is None or not ops.fmm_available():
        print(f"the float32 kernel is unavailable here: {mlx_ops.unavailable or 'no AVX-512'}")
        return 1
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    loads = [os.getloadavg()[0]]
    model, tok = mlx_lm.load(str(resolve_model(args.model)))
    inner = getattr(model, "model", model)
    lines = [f"`python -m bench.cpu.fmm --model {args.model} --rounds {args.rounds}` at {commit or '?'}", ""]
    lines += matmuls(ops, _shapes(inner), len(inner.layers), [int(r) for r in args.rows.split(",")], args.steps)
    loads.append(os.getloadavg()[0])
    prompt = tok.encode("import os\nimport sys\n\ndef main(argv):\n    " + "x = 1\n    " * 24)[:64]
    lines += ["", *model_steps(model, prompt, args.rounds, args.steps, args.tokens)]
    loads.append(os.getloadavg()[0])
    lines += ["", "1-minute load average (2-core machine) at the start, between the parts, at the end: "
              + ", ".join(f"{x:.1f}" for x in loads)]  # fmt: skip
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
