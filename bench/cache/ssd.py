"""Benchmark the SSD cold tier on the MLX backend; baselines measured in the same run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python -m bench.cache.ssd

1. Restart TTFT: for each repeat, a fresh engine with an empty SSD folder
   serves an N-token prompt (a cold full prefill: the baseline), flushes it
   to disk (``Engine.aflush``), stops; a second fresh engine on the same
   folder ("after a restart") serves the same prompt again, restoring the
   prefix from SSD. TTFT is submit → first token. Target: restored ≤ 10% of
   cold.
2. Steady-state decode: engines with the tier on and off (RAM tier only),
   one at a time, alternating order each repeat; each serves a long request
   and then, at once, a decode run of M tokens. With the tier on the first
   request's write-behind snapshot is pending during the decode run, which
   is the case a tier could tax. Target: overhead < 2%. The paired median
   (on/off of the same repeat) cancels slow drift on a shared machine.

3. A batch after a restart (``--batch N``): N requests at once whose prompts
   a first engine served and flushed, against the same N on that first engine
   with nothing on SSD (cold). Aggregate decode tok/s and median TTFT. A
   restore must not slow the batch: restores that each waited for many decode
   steps once ran 8 warm SmolLM2 streams at a third of the cold rate.

Prints a table and ratios; ``--markdown`` prints the docs/bench/ssd.md rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import anyio
import numpy as np

from ember.api import Engine
from engine.config import EngineConfig
from engine.types import SamplingParams


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, min(vocab, 2000), size=n).tolist()


async def _ttft(engine: Engine, tokens: list[int]) -> tuple[float, int]:
    """Seconds from submit to the first token, and the cached tokens reported."""
    t0 = time.perf_counter()
    first = None
    usage = None
    async for d in engine.agenerate(tokens, SamplingParams(max_tokens=2, ignore_eos=True)):
        if first is None and d.token_ids:
            first = time.perf_counter() - t0
        if d.usage is not None:
            usage = d.usage
    return first or float("nan"), usage.cached_tokens if usage else -1


async def _decode_rate(engine: Engine, tokens: list[int], n: int) -> tuple[float, float]:
    """Decode tokens per second after the first token, and process CPU
    milliseconds per token over the same span (all threads: the loop, the MLX
    thread, BLAS). CPU time barely moves with other processes' load on a
    shared machine, where wall-clock tok/s swings by tens of percent."""
    stamps: list[tuple[float, float, int]] = []
    count = 0
    async for d in engine.agenerate(tokens, SamplingParams(max_tokens=n, ignore_eos=True)):
        if d.token_ids:
            count += len(d.token_ids)
            stamps.append((time.perf_counter(), time.process_time(), count))
    (t0, cpu0, c0), (t1, cpu1, c1) = stamps[0], stamps[-1]
    return (c1 - c0) / (t1 - t0), (cpu1 - cpu0) * 1000.0 / (c1 - c0)


async def _wait_for_puts(engine: Engine, puts: int = 1) -> None:
    """Wait until the finished row's cache is in the RAM tier. The put happens
    at the step that closes the row, after its last delta reached us, so a
    flush issued at once can miss it (reported to the durability owner)."""
    while engine.stats()["prompt_cache"]["puts"] < puts:
        await anyio.sleep(0.005)


def _config(args: argparse.Namespace, ssd_dir: str | None, max_batch: int = 4) -> EngineConfig:
    return EngineConfig(
        backend="mlx",
        model=args.model,
        ssd_cache_dir=ssd_dir,
        prefill_chunk=args.prefill_chunk,
        max_batch=max_batch,
    )


async def restart_ttft(args: argparse.Namespace) -> dict[str, Any]:
    cold, warm, cached, restore_ms = [], [], [], []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="ember-bench-ssd-") as d:
            async with Engine.open(_config(args, d)) as engine:
                prompt = _prompt(args.prompt_tokens, engine.info.vocab_size, seed=r)
                t, c = await _ttft(engine, prompt)
                assert c == 0, f"cold run hit a cache ({c} tokens)"
                cold.append(t)
                await _wait_for_puts(engine)
                report = await engine.aflush()
                assert report.durable, f"flush not durable: {report}"
            async with Engine.open(_config(args, d)) as engine:  # the restart
                t, c = await _ttft(engine, prompt)
                warm.append(t)
                cached.append(c)
                restore_ms.append(engine.stats()["ssd_cache"]["restore_ms_last"])
        print(
            f"  repeat {r}: cold {cold[-1] * 1000:.0f} ms, restored {warm[-1] * 1000:.0f} ms "
            f"(cached {cached[-1]}, restore {restore_ms[-1]} ms)",
            file=sys.stderr,
        )
    return {"cold_s": cold, "restored_s": warm, "cached": cached, "restore_ms": restore_ms}


async def _decode_arm(args: argparse.Namespace, tier_on: bool, r: int) -> tuple[float, float, int]:
    """One engine lifetime: warm up, serve a long request (with the tier on its
    write-behind snapshot is then pending), then measure a decode run at once.
    Returns tok/s and the entries the tier wrote while the decode ran."""
    with tempfile.TemporaryDirectory(prefix="ember-bench-ssd-") as d:
        async with Engine.open(_config(args, d if tier_on else None)) as engine:
            vocab = engine.info.vocab_size
            await _decode_rate(engine, _prompt(16, vocab, seed=3000 + r), 16)  # warm-up
            await _ttft(engine, _prompt(args.writebehind_tokens, vocab, seed=1000 + r))
            await _wait_for_puts(engine, 2)
            before = engine.stats()["ssd_cache"]["spills"] if tier_on else 0
            tps, cpu_ms = await _decode_rate(engine, _prompt(32, vocab, seed=2000 + r), args.decode_tokens)
            during = (engine.stats()["ssd_cache"]["spills"] - before) if tier_on else 0
    return tps, cpu_ms, during


async def decode_overhead(args: argparse.Namespace) -> dict[str, Any]:
    on: list[float] = []
    off: list[float] = []
    on_cpu: list[float] = []
    off_cpu: list[float] = []
    writes = []
    for r in range(args.decode_repeats):
        for tier_on in (True, False) if r % 2 == 0 else (False, True):  # alternate to cancel drift
            tps, cpu_ms, during = await _decode_arm(args, tier_on, r)
            (on if tier_on else off).append(tps)
            (on_cpu if tier_on else off_cpu).append(cpu_ms)
            if tier_on:
                writes.append(during)
            print(
                f"  decode {'on ' if tier_on else 'off'} repeat {r}: {tps:.1f} tok/s, {cpu_ms:.2f} CPU ms/token"
                + (f" (entries written during the run: {during})" if tier_on else ""),
                file=sys.stderr,
            )
    return {"on_tps": on, "off_tps": off, "on_cpu_ms": on_cpu, "off_cpu_ms": off_cpu, "writes_during_decode": writes}


async def _batch_run(engine: Engine, prompts: list[list[int]], n: int) -> tuple[float, float, int]:
    """All ``prompts`` at once, ``n`` new tokens each: aggregate tok/s from the
    first submit to the last token, the median TTFT, and the cached tokens."""
    t0 = time.perf_counter()
    ttft: list[float] = []
    out = {"tokens": 0, "cached": 0}

    async def one(p: list[int]) -> None:
        first = True
        async for d in engine.agenerate(p, SamplingParams(max_tokens=n, ignore_eos=True)):
            if d.token_ids:
                if first:
                    ttft.append(time.perf_counter() - t0)
                    first = False
                out["tokens"] += len(d.token_ids)
            if d.usage is not None:
                out["cached"] += d.usage.cached_tokens

    async with anyio.create_task_group() as tg:
        for p in prompts:
            tg.start_soon(one, p)
    return out["tokens"] / (time.perf_counter() - t0), statistics.median(ttft), out["cached"]


async def restart_batch(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, list[float]] = {"cold_tps": [], "warm_tps": [], "cold_ttft": [], "warm_ttft": [], "cached": []}
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="ember-bench-ssd-") as d:
            cfg = _config(args, d, max_batch=args.batch)
            async with Engine.open(cfg) as engine:
                vocab = engine.info.vocab_size
                prompts = [_prompt(args.batch_prompt_tokens, vocab, seed=5000 + 100 * r + i) for i in range(args.batch)]
                await _decode_rate(
                    engine, _prompt(16, vocab, seed=4000 + r), 8
                )  # warm-up, as the restarted engine gets
                tps, ttft, cached = await _batch_run(engine, prompts, args.batch_tokens)
                assert cached == 0, f"cold batch hit a cache ({cached} tokens)"
                await _wait_for_puts(engine, 1 + args.batch)
                report = await engine.aflush()
                assert report.durable, f"flush not durable: {report}"
            res["cold_tps"].append(tps)
            res["cold_ttft"].append(ttft)
            async with Engine.open(cfg) as engine:  # the restart
                await _decode_rate(engine, _prompt(16, vocab, seed=4000 + r), 8)
                tps, ttft, cached = await _batch_run(engine, prompts, args.batch_tokens)
            res["warm_tps"].append(tps)
            res["warm_ttft"].append(ttft)
            res["cached"].append(cached)
        print(
            f"  batch repeat {r}: cold {res['cold_tps'][-1]:.1f} tok/s, TTFT {res['cold_ttft'][-1] * 1000:.0f} ms; "
            f"after restart {tps:.1f} tok/s, TTFT {ttft * 1000:.0f} ms, cached {cached}",
            file=sys.stderr,
        )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=1024)
    ap.add_argument("--decode-repeats", type=int, default=10)
    ap.add_argument("--writebehind-tokens", type=int, default=2048)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--batch", type=int, default=0, help="requests of the batch-after-restart part (0: skip it)")
    ap.add_argument("--batch-prompt-tokens", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=64, help="new tokens of each request of the batch part")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)

    from engine.mlx.blas import maybe_reexec_with_openblas  # OpenBLAS on Linux, once

    maybe_reexec_with_openblas()
    print(f"model={args.model} prompt={args.prompt_tokens} repeats={args.repeats} pid={os.getpid()}", file=sys.stderr)
    res = anyio.run(restart_ttft, args)
    cold, warm = statistics.median(res["cold_s"]), statistics.median(res["restored_s"])
    rows = [
        ("cold full prefill TTFT (median)", f"{cold * 1000:.0f} ms"),
        ("restored after restart TTFT (median)", f"{warm * 1000:.0f} ms"),
        ("restored / cold", f"{warm / cold:.1%} (target <= 10%)"),
        ("cached tokens after restart", f"{min(res['cached'])}..{max(res['cached'])} of {args.prompt_tokens}"),
        ("restore_ms_last (median)", f"{statistics.median(res['restore_ms']):.1f} ms"),
    ]
    if not args.skip_decode:
        dec = anyio.run(decode_overhead, args)
        t_on, t_off = statistics.median(dec["on_tps"]), statistics.median(dec["off_tps"])
        rows += [
            ("decode tok/s, tier off (median)", f"{t_off:.1f}"),
            ("decode tok/s, tier on (median)", f"{t_on:.1f}"),
            ("decode overhead (1 - on/off)", f"{1 - t_on / t_off:+.1%} (target < 2%)"),
            (
                "decode overhead, median of paired runs",
                f"{1 - statistics.median(a / b for a, b in zip(dec['on_tps'], dec['off_tps'])):+.1%}",
            ),
            (
                "decode tok/s spread off / on",
                f"{min(dec['off_tps']):.0f}-{max(dec['off_tps']):.0f} / {min(dec['on_tps']):.0f}-{max(dec['on_tps']):.0f}",
            ),
            (
                "decode CPU ms/token, tier off / on (median)",
                f"{statistics.median(dec['off_cpu_ms']):.3f} / {statistics.median(dec['on_cpu_ms']):.3f}",
            ),
            (
                "decode CPU overhead (on/off - 1)",
                f"{statistics.median(dec['on_cpu_ms']) / statistics.median(dec['off_cpu_ms']) - 1:+.1%} (target < 2%)",
            ),
            ("SSD entries written during decode runs", f"{sum(dec['writes_during_decode'])}"),
        ]
    if args.batch:
        b = anyio.run(restart_batch, args)
        paired = statistics.median(w / c for w, c in zip(b["warm_tps"], b["cold_tps"]))
        rows += [
            (f"{args.batch} at once, cold: aggregate tok/s (median)", f"{statistics.median(b['cold_tps']):.1f}"),
            (f"{args.batch} at once after restart: aggregate tok/s", f"{statistics.median(b['warm_tps']):.1f}"),
            ("after restart / cold, aggregate (median of paired)", f"{paired:.2f}x (target >= 0.95x)"),
            (
                "median TTFT cold / after restart",
                f"{statistics.median(b['cold_ttft']) * 1000:.0f} / {statistics.median(b['warm_ttft']) * 1000:.0f} ms",
            ),
            (
                "cached tokens after restart",
                f"{min(b['cached']):.0f}..{max(b['cached']):.0f} of {args.batch * args.batch_prompt_tokens}",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    if args.markdown:
        print(f"`{args.model}`, {args.prompt_tokens}-token prompt, {args.repeats} repeats (medians over all of them)")
        print()
        print("| measure | value |")
        print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |" if args.markdown else f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
