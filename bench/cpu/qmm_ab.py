"""Two builds of the quantized-matmul kernel (``engine/mlx/csrc/qmm_t.c``) side
by side in one process: per matrix of Qwen2.5-Coder-1.5B and M rows, the old
build's time over the new one's (a ratio > 1: the new is faster), and whether
the two give the same bits.

    python -m bench.cpu.qmm_ab [--old main] [--new engine/mlx/csrc/qmm_t.c] [--rows 1,2,4,8] [--bits 8]
    python -m bench.cpu.qmm_ab --old HEAD --dot     # the exact kernel against the integer dot path

``--old`` / ``--new``: a source file, or a git revision (its
``engine/mlx/csrc/qmm_t.c``). The calls alternate old / new (which goes first
swaps every round; round 0 warms up and is dropped), each arm cycling
through copies of the weight that together exceed the last-level cache, so a
call reads its weight from memory as a decode step does; medians. ``--dot``:
the new arm is the new build's integer dot path (``qmm_t_dot``, 8-bit only), and
the last column is its relative error against the old arm (the norm of the
difference over the norm), not a bit comparison. On a
machine shared with other work the absolute times are noise; the ratios of
alternated calls much less so. The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

import numpy as np

from engine.mlx import cc_build, qmm_kernel

SHAPES = {"q/o": (1536, 1536), "gate/up": (8960, 1536), "down": (1536, 8960), "lm_head": (151936, 1536)}
SOURCE = "engine/mlx/csrc/qmm_t.c"
STREAM_BYTES = 256 << 20  # the weight copies an arm cycles through: well past any L3


def _source(spec: str, tmp: pathlib.Path, name: str) -> pathlib.Path:
    """A file as given, or ``SOURCE`` at a git revision (written under ``tmp``)."""
    if pathlib.Path(spec).is_file():
        return pathlib.Path(spec)
    text = subprocess.run(["git", "show", f"{spec}:{SOURCE}"], capture_output=True, text=True, check=True).stdout
    path = tmp / f"{name}.c"
    path.write_text(text)
    return path


def _lib(source: pathlib.Path, tmp: pathlib.Path, name: str) -> ctypes.CDLL:
    target = tmp / f"{name}.so"
    cc_build.build(source, target)
    return qmm_kernel._open(target)


def _weights(N: int, K: int, bits: int, gs: int, rng: np.random.Generator) -> list[tuple[np.ndarray, ...]]:
    nbytes = N * K * bits // 8
    copies = max(1, -(-STREAM_BYTES // nbytes)) if nbytes < STREAM_BYTES else 1
    out: list[tuple[np.ndarray, ...]] = []
    for _ in range(copies):
        w = rng.integers(0, 1 << 32, (N, K * bits // 32), dtype=np.uint32)
        s = rng.uniform(0.001, 0.02, (N, K // gs)).astype(np.float32)
        b = rng.uniform(-0.3, 0.3, (N, K // gs)).astype(np.float32)
        out.append((w, s, b))
    return out


def _time(
    lib: ctypes.CDLL,
    x: np.ndarray,
    ws: list,
    y: np.ndarray,
    bits: int,
    gs: int,
    threads: int,
    n: int,
    dot: bool = False,
) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        w, s, b = ws[i % len(ws)]
        if dot:
            got = qmm_kernel.qmm_t_dot(lib, x, w, s, b, bits=bits, group_size=gs, threads=threads)
            if got is None:
                raise SystemExit("the dot path declined (bits other than 8, or no AVX-512 VNNI)")
            y[...] = got
        else:
            qmm_kernel.qmm_t(lib, x, w, s, b, bits=bits, group_size=gs, threads=threads, out=y)
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--old", default="main", help="source file or git revision (default: main)")
    ap.add_argument("--new", default=SOURCE, help=f"source file or git revision (default: {SOURCE})")
    ap.add_argument("--rows", default="1,2,4,8", help="M values")
    ap.add_argument("--bits", default="8", help="bits values, e.g. 8,4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ms", type=float, default=30.0, help="about this long per arm a round")
    ap.add_argument("--dot", action="store_true", help="the new arm: the integer dot path (8-bit)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        libs = {
            name: _lib(_source(spec, tmp, name), tmp, name) for name, spec in (("old", args.old), ("new", args.new))
        }
        print(f"old={args.old} new={args.new} threads={args.threads} group={args.group} load={os.getloadavg()}")
        print(f"| bits | matrix | M | old ms | new ms | old/new | {'relative error' if args.dot else 'same bits'} |")
        print("|---:|---|---:|---:|---:|---:|---|")
        worst = True
        for bits in (int(b) for b in args.bits.split(",")):
            for shape in args.shapes.split(","):
                N, K = SHAPES[shape]
                ws = _weights(N, K, bits, args.group, rng)
                for M in (int(m) for m in args.rows.split(",")):
                    x = rng.standard_normal((M, K)).astype(np.float32)
                    ys = {k: np.empty((M, N), np.float32) for k in libs}
                    one = _time(libs["new"], x, ws, ys["new"], bits, args.group, args.threads, 1, args.dot)
                    n = max(1, int(args.ms / 1e3 / max(one, 1e-6)))
                    times: dict[str, list[float]] = {"old": [], "new": []}
                    for r in range(args.rounds + 1):
                        order = ("old", "new") if r % 2 else ("new", "old")
                        for k in order:
                            t = _time(libs[k], x, ws, ys[k], bits, args.group, args.threads, n, args.dot and k == "new")
                            if r:
                                times[k].append(t)
                    if args.dot:  # an approximation: its error, not its bits
                        err = float(np.linalg.norm(ys["new"] - ys["old"]) / np.linalg.norm(ys["old"]))
                        last = f"{err:.2e}"
                    else:
                        same = np.array_equal(ys["old"].view(np.uint32), ys["new"].view(np.uint32))
                        worst &= same
                        last = str(same)
                    ratios = [o / w for o, w in zip(times["old"], times["new"], strict=True)]
                    print(
                        f"| {bits} | {shape} | {M} | {statistics.median(times['old']) * 1e3:.3f} | "
                        f"{statistics.median(times['new']) * 1e3:.3f} | {statistics.median(ratios):.2f} | {last} |",
                        flush=True,
                    )
        print(f"load after: {os.getloadavg()}")
    return 0 if worst else 1


if __name__ == "__main__":
    raise SystemExit(main())
