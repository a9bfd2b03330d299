"""Quantized matmul on MLX's CPU backend: float32, MLX's quantized_matmul and
the C kernel (engine.mlx.qmm_kernel), side by side in one process:

    python -m bench.cpu.qmm [--rounds 3] [--out docs/bench/cpu-qmm.md]

(a) Per matrix, at Qwen2.5-Coder-1.5B's shapes (q/o 1536x1536, k/v 256x1536,
gate/up 8960x1536, down 1536x8960, lm_head 151936x1536) and M rows (1 and 8; gate/up also at 128, a prefill chunk):
``x @ W.T`` in float32, ``mx.quantized_matmul`` and the kernel (through
``engine.mlx.qmm_linear``, as a model calls it: the sync, the views, the copy
back) at 4 and 8 bits, group 64; ms, GB/s of weights and whether the kernel's
result is MLX's bit for bit (the script exits 1 otherwise).

(b) A whole decode step of a random-weight qwen2 with the 1.5B's config
(untied head): float32, MLX 8-bit, kernel 8-bit, MLX 4-bit, kernel 4-bit at
batch 1 (and the float32 and kernel arms at batch 8: MLX's arms there cost
~8x batch 1, see (a)); tok/s and the fraction of the memory floor (weight
bytes a token / the bandwidth this script measures: a threaded numpy sum over
a 1 GiB array).

(c) The prefill path (``--prefill-table``): per matrix at M = 1, 8, 32, 128,
512 rows, float32 GEMM against the kernel and dequantize + float32 GEMM
(``engine.mlx.qmm_linear._dequant_gemm``: the C dequantize into the scratch
buffer, MLX's GEMM on it) at 8 and 4 bits; where the GEMM path starts to win
is ``qmm_linear.PREFILL_ROWS``. Also: the C dequantize equal to
``mx.dequantize`` bit for bit, and the GEMM path's largest relative
difference from ``mx.quantized_matmul`` (not bit for bit: BLAS's order of sums).

Arms alternate order every round (round 0 warms up and is dropped); medians.
The float32 model (7.1 GB) is timed in a phase of its own before the
quantized ones (the machine may be shared: the script waits for memory, and
skips what does not fit, saying so).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SHAPES = {"q/o": (1536, 1536), "k/v": (256, 1536), "gate/up": (8960, 1536), "down": (1536, 8960), "lm_head": (151936, 1536)}  # fmt: skip
CONFIG = dict(
    model_type="qwen2",
    hidden_size=1536,
    num_hidden_layers=28,
    intermediate_size=8960,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    rope_theta=1e6,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
GROUP = 64


def _load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bandwidth_gbs(rounds: int = 3) -> float:
    """Read bandwidth of all cores: a numpy sum over 1 GiB, a slice a thread (numpy frees the GIL)."""
    import numpy as np

    a = np.ones(1 << 28, np.float32)
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)
    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _alternate(arms: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds per arm over ``rounds`` (after one warm-up), order reversed every other round."""
    times: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(rounds + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            arms[name]()
            dt = time.perf_counter() - t0
            if r:
                times[name].append(dt)
    return {a: statistics.median(t) for a, t in times.items()}


def _matrix_arms(x: Any, w: Any, q: dict[int, Any]) -> dict[str, Callable[[], Any]]:
    import mlx.core as mx

    from engine.mlx import qmm_linear

    def mlx(bits: int) -> Callable[[], Any]:
        wq, s, b = q[bits]
        return lambda: mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=GROUP, bits=bits))

    def kernel(bits: int) -> Callable[[], Any]:
        return lambda: mx.eval(qmm_linear.quantized_matmul(x, *q[bits], group_size=GROUP, bits=bits, mode="affine"))

    return {"f32": lambda: mx.eval(mx.matmul(x, w.T)), "mlx8": mlx(8), "k8": kernel(8), "mlx4": mlx(4), "k4": kernel(4)}


def per_matrix(rounds: int, rows: list[int], prefill: int = 0) -> tuple[str, bool]:
    import mlx.core as mx
    import numpy as np

    from engine.mlx import qmm_linear

    same = True
    out = ["| matrix (N x K) | M | float32 ms | MLX 8-bit ms | kernel 8-bit ms | MLX 4-bit ms | kernel 4-bit ms "
           "| kernel 8-bit GB/s | kernel 4-bit GB/s | MLX/kernel 8 | MLX/kernel 4 | float32/kernel 4 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, (N, K) in SHAPES.items():
        _room(N * K * 6, name)
        w = mx.random.normal((N, K)) * 0.02
        mx.eval(w)
        q = {bits: mx.quantize(w, group_size=GROUP, bits=bits) for bits in (8, 4)}
        mx.eval(q)
        nbytes = {bits: sum(a.nbytes for a in q[bits]) for bits in q}
        for M in rows + ([prefill] if name == "gate/up" and prefill else []):
            x = mx.random.normal((M, K))
            mx.eval(x)

            for bits in (8, 4):
                wq, s, b = q[bits]
                want = np.asarray(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=GROUP, bits=bits))
                got = np.asarray(qmm_linear.quantized_matmul(x, *q[bits], group_size=GROUP, bits=bits, mode="affine"))
                same = same and np.array_equal(want.view(np.uint32), got.view(np.uint32))
            arms = _matrix_arms(x, w, q)
            t = _alternate(arms, rounds)
            ms = {a: v * 1e3 for a, v in t.items()}
            out.append(
                f"| {name} ({N} x {K}) | {M} | {ms['f32']:.2f} | {ms['mlx8']:.1f} | {ms['k8']:.2f} | {ms['mlx4']:.1f} "
                f"| {ms['k4']:.2f} | {nbytes[8] / t['k8'] / 1e9:.1f} | {nbytes[4] / t['k4'] / 1e9:.1f} "
                f"| {t['mlx8'] / t['k8']:.1f}x | {t['mlx4'] / t['k4']:.1f}x | {t['f32'] / t['k4']:.2f}x |"
            )
            print(f"  {name} M={M} done, load {_load()}", file=sys.stderr, flush=True)
        del w, q
        gc.collect()
        mx.clear_cache()
    return "\n".join(out), same


PREFILL_SHAPES = ("q/o", "k/v", "gate/up", "down")


def _prefill_arms(lib: Any, x: Any, w: Any, q: dict[int, Any]) -> dict[str, Callable[[], Any]]:
    import mlx.core as mx
    import numpy as np

    from engine.mlx import qmm_kernel, qmm_linear

    def kernel(bits: int) -> Callable[[], Any]:
        wq, s, b = (np.asarray(a) for a in q[bits])
        threads = qmm_linear._state["threads"]
        # the kernel path as quantized_matmul runs it below PREFILL_ROWS: the sync, the view, the copy back
        return lambda: mx.eval(
            mx.array(qmm_kernel.qmm_t(lib, np.asarray(x), wq, s, b, bits=bits, group_size=GROUP, threads=threads))
        )

    def dequant_gemm(bits: int) -> Callable[[], Any]:
        return lambda: qmm_linear._dequant_gemm(lib, x, _checked(q[bits], bits))

    def dot() -> Callable[[], Any]:  # the integer dot path (8-bit) as quantized_matmul runs it
        wq, s, b = (np.asarray(a) for a in q[8])
        threads = qmm_linear._state["threads"]

        def once() -> None:
            y = qmm_kernel.qmm_t_dot(lib, np.asarray(x), wq, s, b, bits=8, group_size=GROUP, threads=threads)
            assert y is not None  # the arm is only made where the path is available
            mx.eval(mx.array(y))

        return once

    arms = {"f32": lambda: mx.eval(mx.matmul(x, w.T))}
    for bits in (8, 4):
        arms[f"k{bits}"] = kernel(bits)
        arms[f"dg{bits}"] = dequant_gemm(bits)
    if qmm_kernel.dot_available(lib):
        arms["dot8"] = dot()
    return arms


def _checked(q: Any, bits: int) -> Any:
    from engine.mlx import qmm_linear

    got = qmm_linear._weights(*q, group_size=GROUP, bits=bits, mode="affine")
    assert got is not None
    return got


def prefill_path(rounds: int, rows: list[int]) -> tuple[str, bool, float]:
    """Table (c): float32 GEMM, the kernel and dequantize + GEMM per matrix and M."""
    import mlx.core as mx
    import numpy as np

    from engine.mlx import qmm_kernel, qmm_linear

    lib = qmm_linear._state["lib"]
    exact, worst = True, 0.0
    out = ["| matrix (N x K) | M | float32 ms | kernel 8-bit ms | dequant+GEMM 8-bit ms | kernel 4-bit ms "
           "| dequant+GEMM 4-bit ms | kernel/dequant+GEMM 8 | kernel/dequant+GEMM 4 | integer dot 8-bit ms "
           "| dot/dequant+GEMM 8 |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in PREFILL_SHAPES:
        N, K = SHAPES[name]
        w = mx.random.normal((N, K)) * 0.02
        q = {bits: mx.quantize(w, group_size=GROUP, bits=bits) for bits in (8, 4)}
        mx.eval(w, q)
        for bits in (8, 4):
            want = np.asarray(mx.dequantize(*q[bits], group_size=GROUP, bits=bits))
            got = qmm_kernel.dequantize(lib, *(np.asarray(a) for a in q[bits]), bits=bits, group_size=GROUP, threads=2)
            exact = exact and np.array_equal(want.view(np.uint32), got.view(np.uint32))
        for M in rows:
            x = mx.random.normal((M, K))
            mx.eval(x)
            for bits in (8, 4):
                ref = np.asarray(mx.quantized_matmul(x, *q[bits], transpose=True, group_size=GROUP, bits=bits))
                dg = np.asarray(qmm_linear._dequant_gemm(lib, x, _checked(q[bits], bits)))
                worst = max(worst, float(np.abs(dg - ref).max() / np.abs(ref).max()))
            arms = _prefill_arms(lib, x, w, q)
            ms = {a: v * 1e3 for a, v in _alternate(arms, rounds).items()}
            out.append(
                f"| {name} ({N} x {K}) | {M} | {ms['f32']:.2f} | {ms['k8']:.2f} | {ms['dg8']:.2f} | {ms['k4']:.2f} "
                f"| {ms['dg4']:.2f} | {ms['k8'] / ms['dg8']:.2f}x | {ms['k4'] / ms['dg4']:.2f}x "
                + (f"| {ms['dot8']:.2f} | {ms['dot8'] / ms['dg8']:.2f}x |" if "dot8" in ms else "| – | – |")
            )
            print(f"  prefill path {name} M={M} done, load {_load()}", file=sys.stderr, flush=True)
        del w, q
        gc.collect()
        mx.clear_cache()
    return "\n".join(out), exact, worst


def _model(bits: int | None) -> Any:
    """The random qwen2 (the same seed every time: the same float weights);
    quantized ones are built lazily, so the float32 weights never all exist."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import qwen2

    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs(**CONFIG))
    if bits is not None:
        nn.quantize(model, group_size=GROUP, bits=bits)
    for layer in model.model.layers:  # layer by layer: the peak is one layer's floats
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def _weight_bytes(model: Any) -> int:
    """Bytes a decode token reads: every matmul's weights (the embedding gives one row)."""
    import mlx.nn as nn

    total = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            total += sum(v.nbytes for k, v in m.items() if k in ("weight", "scales", "biases"))
    return total


def _step(model: Any, batch: int, kernel: bool, quantized: bool = True) -> Callable[[], Any]:
    """One decode step at ``batch`` rows over a 16-token cache (prefilled by the kernel where it can)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.mlx import qmm_linear

    cache = make_prompt_cache(model)
    prompt = mx.array([[(7 * i + r) % 1000 for i in range(16)] for r in range(batch)])
    if quantized:
        qmm_linear.install(model)
    mx.eval(model(prompt, cache=cache))
    tok = mx.array([[1]] * batch)

    def once() -> None:
        if quantized and not kernel:
            qmm_linear.uninstall(model)
        try:
            mx.eval(model(tok, cache=cache))
        finally:
            if quantized:
                qmm_linear.install(model)

    return once


def _room(need: float, what: str, wait_s: float = 180.0) -> bool:
    """Whether ``need`` bytes (and 2 GB to spare: the machine may be shared) are
    available, waiting up to ``wait_s`` for other work to give them back."""
    deadline = time.time() + wait_s
    while _mem_available() < need + 2e9:
        if time.time() > deadline:
            return False
        print(
            f"  waiting for memory for {what}: {_mem_available() / 1e9:.1f} GB available", file=sys.stderr, flush=True
        )
        time.sleep(10)
    return True


def decode(rounds: int, batches: list[int], bw: float, with_f32: bool = True) -> tuple[str, list[str]]:
    """Float32 in a phase of its own (7.1 GB), then the quantized models, both
    bit widths together where memory allows, else one at a time; within a
    phase the arms alternate."""
    import mlx.core as mx

    notes = []
    results: dict[tuple[str, int], float] = {}
    wbytes: dict[str, int] = {}
    if not with_f32:
        notes.append("float32 model not timed (--no-float32-model)")
    elif not _room(7.2e9, "the float32 model"):
        notes.append(f"float32 model not timed: {_mem_available() / 1e9:.1f} GB available (the machine is shared)")
    else:
        f32 = _model(None)
        wbytes["float32"] = _weight_bytes(f32)
        for batch in batches:
            f32_arm = {"float32": _step(f32, batch, False, quantized=False)}
            results.update({(k, batch): v for k, v in _alternate(f32_arm, rounds).items()})
        del f32, f32_arm
        gc.collect()
        mx.clear_cache()
        notes.append("float32 timed in a phase of its own (7.1 GB: not held beside the quantized models)")
        print(f"  float32 done, load {_load()}", file=sys.stderr, flush=True)
    phases = [[8, 4]] if _room(3.2e9, "both quantized models", wait_s=0) else [[8], [4]]
    if len(phases) > 1:
        notes.append("8-bit and 4-bit timed in phases of their own (memory)")
    for phase in phases:
        if not _room(2.0e9 * len(phase), "/".join(map(str, phase)) + "-bit models"):
            notes.append(f"{'/'.join(map(str, phase))}-bit not timed: {_mem_available() / 1e9:.1f} GB available")
            continue
        models = {bits: _model(bits) for bits in phase}
        for bits, m in models.items():
            wbytes[f"{bits}-bit"] = _weight_bytes(m)
        for batch in batches:
            arms: dict[str, Callable[[], Any]] = {}
            for bits, m in models.items():
                if batch == 1:  # MLX's arms cost ~8x at batch 8 (the per-matrix table has them)
                    arms[f"MLX {bits}-bit"] = _step(m, batch, False)
                arms[f"kernel {bits}-bit"] = _step(m, batch, True)
            results.update({(k, batch): v for k, v in _alternate(arms, rounds).items()})
            print(
                f"  {'/'.join(map(str, phase))}-bit decode batch {batch} done, load {_load()}",
                file=sys.stderr,
                flush=True,
            )
        del models, arms
        gc.collect()
        mx.clear_cache()
    out = ["| weights | batch | weight GB a step | step ms | tok/s | fraction of the floor | vs float32 |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for batch in batches:
        base = results.get(("float32", batch))
        for arm in ("float32", "MLX 8-bit", "kernel 8-bit", "MLX 4-bit", "kernel 4-bit"):
            if (arm, batch) not in results:
                continue
            t = results[(arm, batch)]
            gb = wbytes[arm.split()[-1]] / 1e9
            floor = gb / bw  # seconds a step if only the weights' bytes counted
            vs = f"{base / t:.2f}x" if base else "-"
            out.append(f"| {arm} | {batch} | {gb:.2f} | {t * 1e3:.0f} | {batch / t:.2f} | {floor / t:.0%} | {vs} |")
    return "\n".join(out), notes


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    import mlx.core as mx

    from bench.docs import commit
    from engine.mlx import buffer_cache, qmm_kernel, qmm_linear

    ap = argparse.ArgumentParser(prog="python -m bench.cpu.qmm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,8", help="M of the per-matrix table")
    ap.add_argument("--prefill-rows", type=int, default=128, help="also gate/up at this M (a prefill chunk; 0: not)")
    ap.add_argument("--batches", default="1,8", help="decode batches of the model table")
    ap.add_argument("--no-float32-model", action="store_true", help="time the quantized models only (7 GB less)")
    ap.add_argument("--skip-model", action="store_true", help="only the per-matrix table")
    ap.add_argument("--prefill-table", default="", help="M of table (c), the prefill path, e.g. 1,8,32,128,512")
    ap.add_argument("--only-prefill-table", action="store_true", help="table (c) alone (needs --prefill-table)")
    ap.add_argument("--out", help="also write the report (markdown) here")
    args = ap.parse_args(argv)

    mx.set_default_device(mx.cpu)
    buffer_cache.raise_limit()  # as ember serve runs
    lib = qmm_kernel.load()
    assert lib is not None, f"no qmm kernel: {qmm_kernel.unavailable}"
    qmm_linear.use(lib)
    load0, started = _load(), time.time()
    bw = bandwidth_gbs()
    print(f"  bandwidth {bw:.1f} GB/s, load {_load()}", file=sys.stderr, flush=True)
    parts = [
        f"Memory read bandwidth measured here: {bw:.1f} GB/s (numpy sum over 1 GiB on {os.cpu_count()} threads).",
    ]
    same = True
    if not args.only_prefill_table:
        table_a, same = per_matrix(args.rounds, [int(r) for r in args.rows.split(",")], args.prefill_rows)
        parts += [
            "",
            f"(a) Per matrix, group size {GROUP}, ms a call (median of {args.rounds} rounds):",
            "",
            table_a,
            "",
            f"kernel bit for bit mx.quantized_matmul: {same}",
        ]
    if args.prefill_table:
        table_c, exact, worst = prefill_path(args.rounds, [int(r) for r in args.prefill_table.split(",")])
        same = same and exact
        parts += [
            "",
            f"(c) The prefill path, group size {GROUP}, ms a call (median of {args.rounds} rounds); "
            f"qmm_linear.PREFILL_ROWS = {qmm_linear.PREFILL_ROWS}:",
            "",
            table_c,
            "",
            f"C dequantize bit for bit mx.dequantize: {exact}; dequant+GEMM vs mx.quantized_matmul: "
            f"largest |difference| / largest |value| {worst:.1e}",
        ]
    if not args.skip_model and not args.only_prefill_table:
        table_b, notes = decode(
            args.rounds, [int(b) for b in args.batches.split(",")], bw, with_f32=not args.no_float32_model
        )
        parts += [
            "",
            f"(b) A decode step of a random qwen2 with Qwen2.5-Coder-1.5B's config, group size {GROUP} "
            f"(median of {args.rounds} rounds; the floor: weight bytes / {bw:.1f} GB/s):",
            "",
            table_b,
            *(["", *notes] if notes else []),
        ]
    minutes = (time.time() - started) / 60
    parts += ["", f"load (1/5/15 min) {load0} before, {_load()} after; {minutes:.1f} min"]
    text = "\n".join(parts)
    print(text)
    if args.out:
        cmd = "python -m bench.cpu.qmm " + " ".join(argv if argv is not None else sys.argv[1:])
        head = (
            "# Quantized matmul on MLX's CPU backend (issues #41, #45)\n\n"
            "What the code does: [../mlx-backend.md](../mlx-backend.md#quantized-matmul-on-the-cpu).\n"
            "Machine: 2 cores of an AMD EPYC (Zen 4, AVX-512), 24 GiB, shared with other jobs (the load says how much).\n\n"
            f"```\n{cmd.strip()}\n```\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, commit `{commit()}`.\n\n"
        )
        with open(args.out, "w") as f:
            f.write(head + text + "\n")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
