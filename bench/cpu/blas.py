"""What OpenBLAS changes on Linux, side by side (README, "OpenBLAS"):

    python -m bench.cpu.blas                 # 5 rounds
    python -m bench.cpu.blas --rounds 9

MLX's Linux CPU wheel links a reference BLAS; ``ember`` and ``pytest`` re-exec
themselves with Debian's OpenBLAS in ``LD_PRELOAD`` when it is installed
(``engine.mlx.blas``). This runs the same measurements in two child processes,
one with OpenBLAS preloaded and one without (``EMBER_NO_OPENBLAS=1``),
alternating round by round, and prints the medians, the ratios and the load:

* ``matmul``: a 1024 x 1024 float32 matmul;
* ``prefill``: one forward of the bundled ``tiny`` model over a 256-token prompt;
* ``decode``: a 1-token forward on a warm KV cache (32 steps, per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from engine.mlx.blas import openblas_path

CHILD = "--child"


def _measure() -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.models import resolve_model

    def timed(fn) -> float:
        fn()  # warm
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    a = mx.random.normal((1024, 1024))
    b = mx.random.normal((1024, 1024))
    out = {"matmul": timed(lambda: mx.eval(a @ b))}
    model, _ = load(str(resolve_model("tiny")))
    prompt = mx.array([list(range(1, 257))])
    out["prefill"] = timed(lambda: mx.eval(model(prompt)))

    def decode() -> None:
        cache = make_prompt_cache(model)
        mx.eval(model(prompt[:, :32], cache=cache))
        tok = mx.array([[5]])
        for _ in range(32):
            mx.eval(model(tok, cache=cache))

    out["decode"] = timed(decode) / 32
    return out


def _child(openblas: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_NO_OPENBLAS")}
    lib = openblas_path()
    if openblas:
        assert lib is not None
        env["LD_PRELOAD"] = lib
    env["EMBER_NO_OPENBLAS"] = "1"  # no re-exec in the child: LD_PRELOAD is set (or not) here
    run = subprocess.run([sys.executable, "-m", "bench.cpu.blas", CHILD], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"bench.cpu.blas child failed:\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_measure()))
        return
    if not sys.platform.startswith("linux") or openblas_path() is None:
        raise SystemExit("bench.cpu.blas: no system OpenBLAS here (apt-get install libopenblas0-pthread)")
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    load0 = os.getloadavg()
    for _ in range(args.rounds):
        for openblas in (True, False):
            runs[openblas].append(_child(openblas))
    load1 = os.getloadavg()
    print(f"bench.cpu.blas: {args.rounds} rounds, alternating; load {load0[0]:.2f} -> {load1[0]:.2f} (1-min)")
    print()
    print("| measure | reference BLAS (median) | OpenBLAS (median) | speed-up |")
    print("|---|---|---|---|")
    for key in runs[True][0]:
        ref = statistics.median(r[key] for r in runs[False])
        ob = statistics.median(r[key] for r in runs[True])
        print(f"| {key} | {ref * 1e3:.2f} ms | {ob * 1e3:.2f} ms | {ref / ob:.1f}x |")


if __name__ == "__main__":
    main()
