"""Engine overhead on MLX: Ember's Engine vs a bare mlx-lm loop, same model, same run.

    python -m bench.serve.engine                  # bundled tiny, writes docs/bench/engine.md
    python -m bench.serve.engine --rounds 7 --tokens 512 --model path/to/mlx-model

Legs (all greedy, EOS ignored, OpenBLAS preloaded via ``engine.mlx.blas``):

* single-stream decode tok/s: ``mlx_lm.stream_generate`` (A) and
  ``Engine.agenerate`` (B) alternate A B A B for ``--rounds`` rounds; decode
  rate is counted from the first token to the last, so prefill is excluded
  from both; the report gives the medians and B/A;
* aggregate decode tok/s through the Engine at 1, 4, 8, 16 concurrent
  requests (all tokens / wall time), next to ``mlx_lm.batch_generate``
  (mlx-lm's own BatchGenerator) on the same prompts;
* BLAS: the single-stream leg and a 1k-token prefill again in a subprocess
  without OpenBLAS (``EMBER_NO_OPENBLAS=1``), for the speedup it buys.

``--profile`` adds a cProfile of the engine's single-stream leg (event-loop
thread and MLX thread). The results table is written between the markers in
``--out`` (the surrounding text in that file is kept).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

from bench.serve.engine_report import table, write_report
from engine.mlx.blas import OPT_OUT, maybe_reexec_with_openblas

PROMPT = "import os\nimport sys\n\n\ndef main():\n"
PROMPTS = [
    "import os\nimport sys\n",
    "def add(a, b):\n    return",
    "class Point:\n    def __init__(self, x, y):\n",
    "# Utilities for parsing\n",
    "for i in range(10):\n",
    "from collections import",
    "    def __repr__(self):\n",
    "try:\n    import json\n",
]


def machine() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "?"
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,  # type: ignore[attr-defined]  # set at runtime, absent from mlx's stubs
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "blas": os.environ.get("LD_PRELOAD", "") or "reference (no preload)",
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


# ---------------------------------------------------------------------------
# legs


def bare_decode(model: Any, tok: Any, n: int, threads: int = 0) -> tuple[float, float, float]:
    """(decode tok/s, process CPU ms per token, median ms between tokens) of one
    mlx_lm.stream_generate run, on ``threads`` OpenBLAS threads (0: its default)."""
    from mlx_lm import stream_generate

    from engine.mlx.blas import blas_threads

    blas_threads().use(threads)
    stamps, cpu = [], 0.0
    for _ in stream_generate(model, tok, PROMPT, max_tokens=n):
        stamps.append(time.perf_counter())
        if len(stamps) == 1:
            cpu = time.process_time()
    count = len(stamps) - 1
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return count / (stamps[-1] - stamps[0]), 1e3 * (time.process_time() - cpu) / count, 1e3 * med(gaps)


async def engine_decode(engine: Any, n: int) -> tuple[float, float, float]:
    """(decode tok/s, process CPU ms per token, median ms between tokens) of one
    Engine request (one delta per token)."""
    from engine.types import SamplingParams

    stamps, cpu, count = [], 0.0, 0
    async for d in engine.agenerate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True)):
        if not d.token_ids:
            continue
        stamps.append(time.perf_counter())
        if len(stamps) == 1:
            cpu = time.process_time()
        else:
            count += len(d.token_ids)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return count / (stamps[-1] - stamps[0]), 1e3 * (time.process_time() - cpu) / count, 1e3 * med(gaps)


def backend_decode(engine: Any, n: int, rid: int) -> float:
    """Decode tok/s of the Engine's own backend driven in a plain loop on its
    MLX thread — step, then ``run_ahead`` as ``MLXThread.after_each`` does —
    with no Scheduler and no event loop in between: what the per-token
    hand-off between the two threads costs, next to ``engine_decode``. Runs
    while the Engine is idle, on a row id the Scheduler never uses."""
    from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan
    from engine.types import SamplingParams

    backend, prompt = engine.backend, engine.tokenizer.encode(PROMPT)

    def loop() -> float:
        backend.step(
            StepPlan(
                open=[OpenRow(rid, SamplingParams(max_tokens=n + 1, ignore_eos=True))],
                prefill=[PrefillChunk(rid, prompt[:-1])],
            )
        )
        token, first = prompt[-1], 0.0
        for i in range(n):
            token = backend.step(StepPlan(decode=[DecodeRow(rid, token)])).tokens[rid]
            backend.run_ahead()
            if i == 0:
                first = time.perf_counter()
        last = time.perf_counter()
        backend.step(StepPlan(close=[rid]))
        return (n - 1) / (last - first)

    return engine.device.call(loop)


async def engine_aggregate(engine: Any, conc: int, n: int) -> float:
    from engine.types import SamplingParams

    params = SamplingParams(max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    outs = await asyncio.gather(*(engine.acomplete(PROMPTS[i % len(PROMPTS)], params) for i in range(conc)))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def bare_aggregate(model: Any, tok: Any, conc: int, n: int) -> float:
    from mlx_lm import batch_generate

    from engine.mlx.blas import blas_threads

    blas_threads().use(0)  # as users run it; the engine's last step may have left 1
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(conc)]
    t = time.perf_counter()
    res = batch_generate(model, tok, prompts, max_tokens=n, return_token_ids=True)
    tokens = getattr(res, "token_ids", None)
    total = sum(len(x) for x in tokens) if tokens else conc * n
    return total / (time.perf_counter() - t)


def bare_prefill(model: Any, tok: Any, n_prompt: int) -> float:
    """mlx-lm's own prompt tok/s for an ``n_prompt``-token prompt."""
    from mlx_lm import stream_generate

    ids = (tok.encode(PROMPT * 200))[:n_prompt]
    out = next(iter(stream_generate(model, tok, ids, max_tokens=1)))
    return out.prompt_tps


async def cpu_breakdown(engine: Any, model: Any, tok: Any, n: int, rounds: int = 3) -> dict[str, float]:
    """Median CPU ms per decoded token, per thread: bare mlx-lm (caller thread
    vs MLX/BLAS workers) and the Engine (event loop, the MLX thread in
    ``backend.step`` and the run-ahead hook, MLX/BLAS workers)."""
    from mlx_lm import stream_generate

    from engine.types import SamplingParams

    backend, device = engine.backend, engine.device
    step, ahead, dev = backend.step, getattr(device, "after_each", None), [0.0]

    def timed(fn: Any) -> Any:
        def run(*args: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args)
            finally:
                dev[0] += time.thread_time() - t

        return run

    backend.step = timed(step)
    if ahead is not None:
        device.after_each = timed(ahead)  # the next step's forward runs here (MLXThread)
    rows: dict[str, list[float]] = {k: [] for k in ("bare_caller", "bare_workers", "loop", "mlx_thread", "workers")}
    try:
        for _ in range(rounds):
            p0, t0 = time.process_time(), time.thread_time()
            for _ in stream_generate(model, tok, PROMPT, max_tokens=n):
                pass
            caller = time.thread_time() - t0
            rows["bare_caller"].append(caller)
            rows["bare_workers"].append(time.process_time() - p0 - caller)
            dev[0] = 0.0
            p0, t0 = time.process_time(), time.thread_time()
            await engine.acomplete(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))
            loop = time.thread_time() - t0
            rows["loop"].append(loop)
            rows["mlx_thread"].append(dev[0])
            rows["workers"].append(time.process_time() - p0 - loop - dev[0])
    finally:
        del backend.step
        if ahead is not None:
            device.after_each = ahead
    return {k: 1e3 * med(v) / n for k, v in rows.items()}


def logprob_drift(model: Any, tok: Any, batch: int, n: int) -> float:
    """Max |log-prob difference| over ``n`` greedy decode steps between each
    prompt alone (B=1 ``KVCache``, as generate_step) and all ``batch`` prompts
    in one left-padded ``BatchKVCache`` (as the engine's decode batch)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]

    def prefill(ids: list[int]) -> list[Any]:
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def decode(cache: list[Any], first: mx.array) -> list[mx.array]:
        y, out = first, []
        for _ in range(n):
            logits = model(y[:, None], cache=cache)[:, -1, :]
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            out.append(lp)
            y = mx.argmax(lp, axis=-1)
        return out

    alone = [decode(prefill(p), mx.array(p[-1:])) for p in prompts]
    caches = [prefill(p) for p in prompts]
    merged = [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    together = decode(merged, mx.array([p[-1] for p in prompts]))
    return max(
        cast(float, mx.abs(alone[r][t][0] - together[t][r]).max().item()) for r in range(batch) for t in range(n)
    )


async def batch_agreement(engine: Any, conc: int, n: int) -> int:
    """How many of ``conc`` greedy requests give the same tokens in a batch as alone."""
    from engine.types import SamplingParams

    params = SamplingParams(max_tokens=n, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(conc)]
    alone = [(await engine.acomplete(p, params)).token_ids for p in prompts]
    together = await asyncio.gather(*(engine.acomplete(p, params) for p in prompts))
    return sum(a == t.token_ids for a, t in zip(alone, together))


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from mlx_lm import load

    from ember.api import Engine
    from engine.config import EngineConfig
    from engine.eventlog import EventLog
    from engine.mlx.blas import blas_threads
    from engine.models import resolve_model

    path = str(resolve_model(args.model))
    model, tok = load(path)
    tok.eos_token_ids = set()
    out: dict[str, Any] = {"model": args.model, "machine": machine()}
    config = EngineConfig(backend="mlx", model=path, max_batch=max(args.concurrency), prompt_cache_gib=0)
    # As the HTTP server runs it: the event log hashes but keeps no records.
    async with Engine.open(config, events=EventLog(keep=False)) as engine:
        bare_decode(model, tok, 32)  # warm both
        await engine_decode(engine, 32)
        a, a1, b, alone = [], [], [], []
        for r in range(args.rounds):
            a.append(bare_decode(model, tok, args.tokens))
            b.append(await engine_decode(engine, args.tokens))
            if blas_threads().active:  # the bare loop's other setting: the faster one is the ceiling
                a1.append(bare_decode(model, tok, args.tokens, threads=1))
            alone.append(backend_decode(engine, args.tokens, rid=10**9 + r))
        ra, rb, ra1 = [x[0] for x in a], [x[0] for x in b], [x[0] for x in a1]
        out["single"] = {
            "bare": ra,
            "engine": rb,
            "bare_med": med(ra),
            "engine_med": med(rb),
            "ratio": med(rb) / med(ra),
            "bare1": ra1,
            "bare1_med": med(ra1),
            "ratio1": med(rb) / med(ra1) if ra1 else None,
            "blas_default_threads": blas_threads().default,
            "bare_cpu_ms": med([x[1] for x in a]),
            "engine_cpu_ms": med([x[1] for x in b]),
            "bare_gap_ms": med([x[2] for x in a]),
            "engine_gap_ms": med([x[2] for x in b]),
            "backend_alone": alone,
            "backend_alone_med": med(alone),
        }
        out["cpu"] = await cpu_breakdown(engine, model, tok, args.tokens)
        if args.profile:
            out["timeline"] = await timeline(engine, args.tokens)
            out["profile"] = await profile_engine(engine, args.tokens)
        if not args.single_only:
            agg: dict[int, dict[str, float]] = {}
            for conc in args.concurrency:
                e, m = [], []
                for _ in range(args.agg_rounds):
                    m.append(bare_aggregate(model, tok, conc, args.agg_tokens))
                    e.append(await engine_aggregate(engine, conc, args.agg_tokens))
                agg[conc] = {"engine": med(e), "mlx_lm_batch": med(m)}
            out["aggregate"] = agg
            top = max(args.concurrency)
            out["agreement"] = {
                "requests": top,
                "tokens": args.agg_tokens,
                "same": await batch_agreement(engine, top, args.agg_tokens),
            }
        out["backend"] = engine.backend.stats()  # type: ignore[attr-defined]  # MLXBackend's, not the port's
    out["prefill_tps"] = med([bare_prefill(model, tok, 1024) for _ in range(3)])
    if not args.single_only:
        out["drift"] = {b: logprob_drift(model, tok, b, 64) for b in (4, 16)}
    out["machine"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return out


async def profile_engine(engine: Any, n: int) -> str:
    """cProfile of one single-stream request: the loop thread and the MLX thread."""
    loop_prof, dev_prof = cProfile.Profile(), cProfile.Profile()
    backend = engine.backend
    step = backend.step

    def profiled_step(plan: Any) -> Any:
        dev_prof.enable()
        try:
            return step(plan)
        finally:
            dev_prof.disable()

    backend.step = profiled_step
    engine.core.backend = backend
    try:
        loop_prof.enable()
        await engine_decode(engine, n)
        loop_prof.disable()
    finally:
        del backend.step
    text = []
    for name, prof in (("event-loop thread", loop_prof), ("MLX thread (backend.step)", dev_prof)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        text.append(f"--- {name} ---\n{s.getvalue()}")
    return "\n".join(text)


async def timeline(engine: Any, n: int) -> dict[str, float]:
    """Median ms per step of one single-stream request: the loop's hop to the
    MLX thread, the step itself, the hop back, the loop's own work between
    steps, and the run-ahead forward after each step."""
    from engine.types import SamplingParams

    device = engine.device
    run, ahead = device.run, getattr(device, "after_each", None)
    spans: dict[str, list[float]] = {k: [] for k in ("to_device", "step", "to_loop", "loop", "run_ahead")}
    last = [0.0]

    async def traced(fn: Any, *args: Any, cost_s: float = 0.0) -> Any:
        t0 = time.perf_counter()
        if last[0]:
            spans["loop"].append(t0 - last[0])
        box: list[float] = []

        def timed(*a: Any) -> Any:
            box.append(time.perf_counter())
            try:
                return fn(*a)
            finally:
                box.append(time.perf_counter())

        out = await run(timed, *args, cost_s=cost_s)
        last[0] = time.perf_counter()
        spans["to_device"].append(box[0] - t0)
        spans["step"].append(box[1] - box[0])
        spans["to_loop"].append(last[0] - box[1])
        return out

    def traced_ahead() -> None:
        t = time.perf_counter()
        assert ahead is not None  # installed only then
        ahead()
        spans["run_ahead"].append(time.perf_counter() - t)

    device.run = traced
    if ahead is not None:
        device.after_each = traced_ahead
    try:
        await engine.acomplete(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))
    finally:
        del device.run
        if ahead is not None:
            device.after_each = ahead
    return {k: 1e3 * med(v) for k, v in spans.items() if v}


def reference_blas(args: argparse.Namespace) -> dict[str, Any] | None:
    """The single-stream leg again in a subprocess on MLX's reference BLAS."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env[OPT_OUT] = "1"
    cmd = [
        sys.executable,
        "-m",
        "bench.serve.engine",
        "--single-only",
        "--json",
        "--model",
        args.model,
        "--rounds",
        str(max(3, args.rounds // 2)),
        "--tokens",
        str(args.tokens),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per single-stream request")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    ap.add_argument("--agg-rounds", type=int, default=3)
    ap.add_argument("--agg-tokens", type=int, default=128, help="tokens per request in the aggregate leg")
    ap.add_argument("--single-only", action="store_true", help="only the single-stream leg (and prefill)")
    ap.add_argument("--no-blas", action="store_true", help="skip the reference-BLAS subprocess")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine's single-stream leg")
    ap.add_argument("--json", action="store_true", help="print the raw results as one JSON line")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/engine.md"))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    res = asyncio.run(run(args))
    if args.json:
        print(json.dumps(res))
        return
    ref = None if args.no_blas or os.environ.get(OPT_OUT) else reference_blas(args)
    command = "python -m bench.serve.engine " + " ".join(sys.argv[1:] if argv is None else argv)
    body = table(res, ref, command.strip())
    print(body)
    if "profile" in res:
        print("step timeline, median ms:", {k: round(v, 3) for k, v in res["timeline"].items()})
        print(res["profile"])
    write_report(args.out, body)
    print(f"\n[bench_engine] wrote {args.out}")


if __name__ == "__main__":
    main()
