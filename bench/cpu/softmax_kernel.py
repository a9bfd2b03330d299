"""MLX's CPU softmax against the C kernel (engine.mlx.softmax_kernel), per
element, in one process, alternating:

    python -m bench.cpu.softmax_kernel --rounds 5

Legs: score matrices of a warm agent turn's attention (``heads × new`` rows
over ``context`` keys; ``--shapes``), each softmaxed by ``mx.softmax(...,
precise=True)`` (what MLX's attention fallback calls), by the kernel on one
thread and by the kernel on ``--threads`` threads; and ``mx.exp`` alone, the
op the kernel replaces. Prints ns per element (median over rounds), the
ratios MLX / kernel, and whether every kernel result is MLX's bit for bit
(the script exits 1 otherwise). Results: docs/bench/cpu-attention.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    import mlx.core as mx
    import numpy as np

    from engine.mlx import buffer_cache, softmax_kernel
    from engine.mlx.split_attention import default_parts

    ap = argparse.ArgumentParser(prog="python -m bench.cpu.softmax_kernel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2700x4300,4500x6400,9x6000", help="ROWSxCOLS,... (rows: heads x new tokens)")
    ap.add_argument("--threads", type=int, default=default_parts())
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    buffer_cache.raise_limit()  # as ember serve runs: MLX's outputs from its cache, not fresh pages
    lib = softmax_kernel.load()
    assert lib is not None, f"no softmax kernel: {softmax_kernel.unavailable}"
    rng = np.random.default_rng(0)
    threads = {"kernel 1 thread": 1, f"kernel {args.threads} threads": args.threads}
    arms = ["mx.exp", "mx.softmax", *threads]
    results: dict[str, dict[str, list[float]]] = {}
    same = True
    for shape in args.shapes.split(","):
        rows, cols = (int(x) for x in shape.split("x"))
        x = (rng.standard_normal((rows, cols)) * 4).astype(np.float32)
        xm = mx.array(x)
        mx.eval(xm)
        want = mx.softmax(xm, axis=-1, precise=True)
        mx.eval(want)
        buf = np.empty_like(x)
        times: dict[str, list[float]] = {a: [] for a in arms}

        for r in range(args.rounds + 1):  # round 0 warms up
            order = arms if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                if arm in threads:
                    np.copyto(buf, x)  # outside the timing: the kernel works in place
                    t0 = time.perf_counter()
                    softmax_kernel.softmax_rows(lib, buf, threads=threads[arm])
                    dt = time.perf_counter() - t0
                    same = same and np.array_equal(buf.view(np.uint32), np.asarray(want).view(np.uint32))
                else:
                    t0 = time.perf_counter()
                    mx.eval(mx.exp(xm) if arm == "mx.exp" else mx.softmax(xm, axis=-1, precise=True))
                    dt = time.perf_counter() - t0
                if r:
                    times[arm].append(dt)
        results[f"{rows}x{cols}"] = times
        print(f"{shape} done, load {os.getloadavg()[0]:.1f}", flush=True)

    print(f"\nns per element (median of {args.rounds} rounds):\n")
    print("| rows x keys | " + " | ".join(arms) + " | mx.softmax / kernel 1 | mx.softmax / kernel N |")
    print("|---|" + "---|" * (len(arms) + 2))
    for shape, t in results.items():
        n = int(np.prod([int(v) for v in shape.split("x")]))
        med = {a: statistics.median(t[a]) / n * 1e9 for a in arms}
        cells = " | ".join(f"{med[a]:.2f}" for a in arms)
        print(
            f"| {shape} | {cells} | {med['mx.softmax'] / med[arms[2]]:.1f}x | {med['mx.softmax'] / med[arms[-1]]:.1f}x |"
        )
    print(f"\nkernel bit for bit mx.softmax: {same}; load {os.getloadavg()[0]:.1f}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
