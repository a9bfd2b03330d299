"""Where a quantized decode step's time goes on MLX's CPU backend: the kernel,
the hook around it, the rest (issue #45).

    python -m bench.cpu.qmm_step --model qwen2.5-coder-1.5b --format q8dot --steps 20

The model is made as ``bench.cpu.weight_format`` makes a format (its float32
conversion re-quantized, group 64, the kernel installed: ``q8dot`` on the
int8 dot path, ``q8``/``q4`` on the exact kernel), then ``--steps`` greedy
decode steps of ``model(token)`` after a short prompt (mlx-lm's forward, no
server). Per step: the whole step; the time inside the hooked quantized
layers' matmul (``qmm_linear._matmul``: it evaluates the graph up to its input
first, so this includes the MLX ops between matmuls: norms, RoPE, attention);
the time inside the C kernel calls alone; of the rest, the time evaluating
the graph up to each call's input (MLX's own ops); and the time outside the
matmuls (after the last one, the argmax, Python). That split is of the
kernels called from Python (``EMBER_QMM_GRAPH=0``'s path); then the same
steps again with the kernels as MLX primitives (``engine.mlx.mlx_ops``, the
default where it builds), whole steps only: nothing is called per layer
from Python there; and once more with every quantized matmul replaced by a
zero of its shape, which leaves what MLX's other ops cost (norms, RoPE,
attention, the cache, the embedding, argmax); and with the k/v projections
replaced by zeros (the smallest calls: what fusing q/k/v could save at most).
Means over the steps; the load is printed.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.qmm_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--format", default="q8dot", help="q8dot, q8 or q4 (as bench.cpu.weight_format)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    os.environ["EMBER_WEIGHTS"] = "float32"
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from bench.cpu import weight_format
    from engine.mlx import qmm_linear
    from engine.models import resolve_model

    model = weight_format._make(str(resolve_model(args.model)), args.format, True)
    lib = qmm_linear._state["lib"]
    spent = {"hook": 0.0, "kernel": 0.0, "eval": 0.0, "calls": 0.0}
    matmul = qmm_linear._matmul

    def timed_matmul(q: Any, x: Any) -> Any:
        t = time.perf_counter()
        try:
            return matmul(q, x)
        finally:
            spent["hook"] += time.perf_counter() - t
            spent["calls"] += 1

    class TimedLib:  # the C calls alone
        def __getattr__(self, name: str) -> Any:
            fn = getattr(lib, name)

            def call(*a: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    spent["kernel"] += time.perf_counter() - t

            return call

    class TimedMx:  # mlx.core with its eval timed: the graph up to a hooked call's input
        def __getattr__(self, name: str) -> Any:
            return getattr(mx, name)

        def eval(self, *a: Any) -> Any:
            t = time.perf_counter()
            try:
                return mx.eval(*a)
            finally:
                spent["eval"] += time.perf_counter() - t

    ops = qmm_linear._state["ops"]
    qmm_linear._state["ops"] = None  # the split is of the kernels called from Python
    qmm_linear._matmul = timed_matmul
    qmm_linear._state["lib"] = TimedLib()
    qmm_linear.mx = TimedMx()  # type: ignore[assignment]
    cache = make_prompt_cache(model)
    tok = [mx.array([[5]])]  # the latest token: each timed stretch continues the greedy decode

    def steps() -> float:
        """Seconds a step over ``--steps`` greedy decode steps."""
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok[0] = mx.argmax(model(tok[0], cache=cache)[:, -1:], axis=-1)
            mx.eval(tok[0])
        return (time.perf_counter() - t0) / args.steps

    try:
        mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
        for _ in range(3):
            mx.eval(model(tok[0], cache=cache))
        for k in spent:
            spent[k] = 0.0
        step = steps()
    finally:
        qmm_linear._matmul = matmul
        qmm_linear._state["lib"] = lib
        qmm_linear.mx = mx
        qmm_linear._state["ops"] = ops
    graph_step = None
    if ops is not None:  # the same steps with the kernels as MLX primitives (engine.mlx.mlx_ops)
        graph_step = steps()
    bare_step = None
    if ops is not None:  # and with every quantized matmul a zero of its shape: what MLX's other ops cost

        class NoMatmul:
            @staticmethod
            def qmm(x: Any, w: Any, *_: Any) -> Any:
                return mx.zeros((*x.shape[:-1], w.shape[0]), dtype=x.dtype) + 0 * x[..., :1]

        qmm_linear._state["ops"] = NoMatmul()
        try:
            bare_step = steps()
        finally:
            qmm_linear._state["ops"] = ops
    kv_step = None
    if ops is not None:  # and with the k/v projections zeros (matmul and bias): what their small calls cost

        class ZeroProj:
            def __init__(self, proj: Any) -> None:
                self.proj = proj

            def __call__(self, x: Any) -> Any:
                return mx.zeros((*x.shape[:-1], self.proj.weight.shape[0]), dtype=x.dtype) + 0 * x[..., :1]

        attns = [layer.self_attn for layer in model.model.layers]
        kept = [(a.k_proj, a.v_proj) for a in attns]
        for a in attns:
            a.k_proj, a.v_proj = ZeroProj(a.k_proj), ZeroProj(a.v_proj)
        try:
            kv_step = steps()
        finally:
            for a, (k, v) in zip(attns, kept):
                a.k_proj, a.v_proj = k, v
    n = args.steps
    hook, kernel, ev = spent["hook"] / n, spent["kernel"] / n, spent["eval"] / n
    print(f"python -m bench.cpu.qmm_step --model {args.model} --format {args.format} --steps {n}")
    print(f"load (1/5/15 min) {os.getloadavg()}")
    print("| step ms | in the hooked matmuls ms | of which the C kernel ms | of which evaluating the graph up to "
          "the input (MLX ops) ms | the hook's rest (views, copies, Python) ms | outside the matmuls ms "
          "| matmul calls a step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {step * 1e3:.1f} | {hook * 1e3:.1f} | {kernel * 1e3:.1f} | {ev * 1e3:.1f} | {(hook - kernel - ev) * 1e3:.1f} "
        f"| {(step - hook) * 1e3:.1f} | {spent['calls'] / n:.0f} |"
    )
    if graph_step is not None:
        print(f"\nthe same step with the kernels as MLX primitives (engine.mlx.mlx_ops, no evaluation a call): "
              f"{graph_step * 1e3:.1f} ms ({step / graph_step:.2f}x the step above)")  # fmt: skip
    else:
        print(f"\nthe kernels as MLX primitives: unavailable ({qmm_linear.mlx_ops.unavailable})")
    if graph_step is not None and bare_step is not None:
        print(f"\nthe same step with every quantized matmul replaced by a zero of its shape (MLX's other ops: "
              f"norms, RoPE, attention, the cache, the embedding, argmax): {bare_step * 1e3:.1f} ms, "
              f"{bare_step / graph_step:.0%} of the primitives' step; the matmuls' share "
              f"{(graph_step - bare_step) * 1e3:.1f} ms")  # fmt: skip
    if graph_step is not None and kv_step is not None:
        print(f"\nthe same step with the k/v projections replaced by zeros (the smallest "
              f"calls, {2 * len(model.model.layers)} a step): {kv_step * 1e3:.1f} ms; their share "
              f"{(graph_step - kv_step) * 1e3:.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
