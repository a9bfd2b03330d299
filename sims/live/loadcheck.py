"""Load check: many concurrent streaming clients against a live ``ember serve``.

    python -m sims.live.loadcheck                          # 32 clients, 60 s, bundled tiny model
    python -m sims.live.loadcheck --record docs/bench/loadcheck.md
    python -m sims.live.loadcheck --fake-gpu --duration 10 # the harness itself, no model

Starts ``ember serve`` on 127.0.0.1 (a free port), warms it up with one
request, then runs ``--clients`` streaming chat clients in a closed loop for
``--duration`` seconds (and at most ``--max-requests`` requests). The server's
resident memory is sampled from /proc twice a second, with the prompt cache's
own byte count from /stats: each finished request leaves a cache entry, so
the cache grows by design up to its cap, and the leak check is on RSS less
the cache: its peak in the last third of the run may be at most
``--rss-growth`` above the middle third. It also fails on any error: a
non-200, an error event, a stream without ``data: [DONE]``, or usage that
disagrees with the tokens asked for. Reports p50/p99 time to first token and
inter-token latency as the clients saw them. Exit status 0 only if it passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sims.live.server import read_url, serve_command

HOST = "127.0.0.1"  # only ever the local machine
TOPICS = [
    "the tides",
    "a lighthouse",
    "bread",
    "compilers",
    "rivers",
    "a chess opening",
    "bees",
    "glaciers",
    "the moon",
    "trains",
    "a violin",
    "old maps",
    "volcanoes",
    "tea",
    "owls",
    "the printing press",
]
SYSTEM = "You are a concise assistant. Answer in plain prose."


@dataclass
class Results:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    requests: int = 0
    tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    flags = ["--host", HOST, *(["--fake-gpu"] if args.fake_gpu else ["--model", args.model])]
    if args.batch is not None:
        flags += ["--batch", str(args.batch)]
    proc = subprocess.Popen(serve_command(*flags), stdout=subprocess.PIPE, text=True)
    url = read_url(proc, 300)
    if url is not None:
        return proc, url
    proc.kill()
    raise SystemExit(f"loadcheck: ember serve did not start (rc={proc.wait()})")


async def one_request(client: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace, res: Results) -> None:
    topic = rng.choice(TOPICS)
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {topic}."}],
        "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
        "temperature": 0.7,
        "seed": rng.randrange(2**32),
        "ignore_eos": True,  # fixed-length answers: the load stays what the flags say
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    chunks = 0
    usage = None
    done = False
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            res.errors.append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue  # blank separators and ": keepalive" comments
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                res.errors.append(f"error event: {event['error']}")
                return
            if event.get("usage"):
                usage = event["usage"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now
                    res.ttft_s.append(now - t0)
                else:
                    res.itl_s.append(now - last)
                last = now
                chunks += 1
    if not done:
        res.errors.append("stream ended without data: [DONE]")
    elif usage is None:
        res.errors.append("no usage chunk")
    elif usage["completion_tokens"] != body["max_tokens"]:
        res.errors.append(f"usage says {usage['completion_tokens']} tokens, asked for {body['max_tokens']}")
    else:
        res.requests += 1
        res.tokens += usage["completion_tokens"]
        res.prompt_tokens += usage["prompt_tokens"]
        res.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]


async def client_loop(
    i: int, client: httpx.AsyncClient, args: argparse.Namespace, res: Results, stop_at: float, budget: list[int]
) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while time.perf_counter() < stop_at and budget[0] > 0:
        budget[0] -= 1
        try:
            await asyncio.wait_for(one_request(client, rng, args, res), timeout=args.request_timeout)
        except (TimeoutError, httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
            res.errors.append(f"{type(exc).__name__}: {exc}")


async def sample_memory(
    client: httpx.AsyncClient, pid: int, samples: list[tuple[float, float, float]], stop: asyncio.Event, t0: float
) -> None:
    """(seconds, RSS MiB, prompt-cache MiB) twice a second. The prompt cache
    grows by design up to its cap (each finished request leaves an entry), so
    the leak check is on RSS minus what the cache says it holds."""
    while not stop.is_set():
        mib = rss_mib(pid)
        try:
            stats = (await client.get("/stats")).json()
            cache = sum(stats.get(tier, {}).get("bytes", 0) for tier in ("prompt_cache",)) / (1 << 20)
        except (httpx.HTTPError, ValueError):
            cache = float("nan")
        if mib is not None:
            samples.append((time.perf_counter() - t0, mib, cache))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def run(
    args: argparse.Namespace, url: str, pid: int
) -> tuple[Results, list[tuple[float, float, float]], dict, float]:
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=args.request_timeout) as client:
        warm = Results()
        await one_request(client, random.Random(-1), args, warm)  # loads and compiles; not measured
        if warm.errors:
            raise SystemExit(f"loadcheck: the warm-up request failed: {warm.errors}")
        res = Results()
        samples: list[tuple[float, float, float]] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_memory(client, pid, samples, stop, t0))
        budget = [args.max_requests]
        await asyncio.gather(
            *(client_loop(i, client, args, res, t0 + args.duration, budget) for i in range(args.clients))
        )
        elapsed = time.perf_counter() - t0
        stop.set()
        await sampler
        stats = (await client.get("/stats")).json()
    return res, samples, stats, elapsed


def rss_verdict(samples: list[tuple[float, float, float]], growth: float) -> tuple[bool, dict[str, float]]:
    """Bounded = RSS less the prompt cache peaks in the last third of the run
    at most ``growth`` above its peak in the middle third."""
    end = samples[-1][0] if samples else 0.0
    base = [(t, rss - cache) for t, rss, cache in samples if cache == cache]  # skip NaN
    middle = [m for t, m in base if end / 3 <= t < 2 * end / 3]
    last = [m for t, m in base if t >= 2 * end / 3]
    nan = float("nan")
    info = {
        "start": samples[0][1] if samples else nan,
        "peak": max((m for _, m, _ in samples), default=nan),
        "cache_end": samples[-1][2] if samples else nan,
        "middle_peak": max(middle, default=nan),
        "last_peak": max(last, default=nan),
    }
    ok = bool(middle and last) and info["last_peak"] <= info["middle_peak"] * (1 + growth)
    return ok, info


def report(
    args: argparse.Namespace, res: Results, rss: dict[str, float], rss_ok: bool, stats: dict, elapsed: float, rc: int
) -> str:
    passed = not res.errors and rss_ok and rc == 0
    cmd = "python -m sims.live.loadcheck " + " ".join(sys.argv[1:])
    ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
    sched = stats.get("scheduler", {})
    lines = [
        "## Result" if passed else "## Result: FAILED",
        "",
        f"Command: `{cmd.strip()}`  ",
        f"Model: {'fake GPU' if args.fake_gpu else args.model}; {args.clients} streaming chat clients, "
        f"{args.duration:.0f} s closed loop, max_tokens {args.min_tokens}-{args.max_tokens}, "
        f"server batch {sched.get('max_batch')}; "
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "| | |",
        "|---|---|",
        f"| requests completed | {res.requests} in {elapsed:.1f} s |",
        f"| errors | {len(res.errors)} |",
        f"| generated tokens | {res.tokens} ({res.tokens / elapsed:.1f} tok/s aggregate) |",
        f"| TTFT p50 / p99 | {ms(percentile(res.ttft_s, 0.5))} / {ms(percentile(res.ttft_s, 0.99))} |",
        f"| inter-token latency p50 / p99 | {ms(percentile(res.itl_s, 0.5))} / {ms(percentile(res.itl_s, 0.99))} |",
        f"| prompt tokens served from cache | {res.cached_tokens} of {res.prompt_tokens} |",
        f"| server RSS start / peak (MiB) | {rss['start']:.0f} / {rss['peak']:.0f} |",
        f"| prompt cache at the end (MiB, grows to its cap by design) | {rss['cache_end']:.0f} |",
        f"| RSS less prompt cache, peak in middle vs last third (MiB) | {rss['middle_peak']:.0f} vs {rss['last_peak']:.0f} "
        f"({'bounded' if rss_ok else 'GREW'}, limit +{args.rss_growth:.0%}) |",
        f"| server steps / aborted / failed | {sched.get('steps')} / {sched.get('aborted')} / {sched.get('failed')} |",
        f"| server exit status after SIGTERM | {rc} |",
    ]
    if res.errors:
        lines += ["", "First errors:", ""] + [f"- `{e}`" for e in res.errors[:10]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sims.live.loadcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, default=20_000, help="stop after this many requests in all")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--rss-growth", type=float, default=0.10, help="allowed RSS growth, last third vs middle third")
    p.add_argument("--model", default="tiny")
    p.add_argument("--fake-gpu", action="store_true")
    p.add_argument("--batch", type=int, help="ember serve --batch (default: the server's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", metavar="PATH", help="also write the report (markdown) here; appends to an earlier one")
    args = p.parse_args(argv)
    if not (1 <= args.clients <= 256 and 0 < args.duration <= 3600):
        p.error("--clients must be in [1, 256] and --duration in (0, 3600]")

    proc, url = start_server(args)
    try:
        res, samples, stats, elapsed = asyncio.run(run(args, url, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    rss_ok, rss = rss_verdict(samples, args.rss_growth)
    text = report(args, res, rss, rss_ok, stats, elapsed, rc)
    print(text)
    if args.record:
        # append a run to an existing report, or start one
        fresh = not os.path.exists(args.record) or not Path(args.record).read_text().startswith(HEADER[:12])
        with open(args.record, "w" if fresh else "a") as f:
            f.write((HEADER if fresh else "\n") + text)
    return 0 if not res.errors and rss_ok and rc == 0 else 1


HEADER = """# Load check

`python -m sims.live.loadcheck` starts `ember serve` on 127.0.0.1, then runs
concurrent streaming chat clients (OpenAI SSE, `stream_options.include_usage`)
in a closed loop for a fixed time. It passes only with zero errors (every
stream 200, ending in `data: [DONE]`, with usage matching the tokens asked
for), the server's resident memory bounded (sampled from `/proc/<pid>/status`
twice a second; the prompt cache grows by design up to its cap, so the check
is on RSS less the cache's own byte count from `/stats`: its peak in the last
third of the run may be at most 10% above the middle third), and a clean exit
0 on SIGTERM. Latencies are what the clients measured: time to
first token from sending the request, inter-token latency between content
chunks (one token each on the MLX backend). Absolute numbers on a shared
2-core CPU machine are noisy; rerun to compare.

"""


if __name__ == "__main__":
    sys.exit(main())
