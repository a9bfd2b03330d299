"""Does prefix-aware routing pay? Agent sessions against 1 replica, N replicas
round-robin and N replicas cache-aware, all behind the SGLang Model Gateway.

    python -m bench.serve.affinity                                  # 24 sessions x 8 turns, fake GPU, N=2
    python -m bench.serve.affinity --sessions 8 --turns 4 --prefix-bytes 1500 -- --model tiny --batch 4

Each session opens with its own long prefix (``--prefix-bytes`` of distinct
text: a repository's files, say) and then appends a tool result per turn, so a
turn's prompt is the previous turn's prompt and output plus a few hundred
bytes: exactly what a replica's prompt cache serves if the turn lands where
the previous one ran. The same seeded trace is replayed (``sims.live.replay``,
streaming /v1/completions, arrival times honoured, a turn waits for the one it
continues) against each setup in turn, in one run; the table gives aggregate
output tokens/s, TTFT p50/p99 and the fraction of prompt tokens served from
cache, and how the requests spread over the replicas. Replicas run
``ember serve --fake-gpu`` (its cost model sleeps the modelled GPU time, so
two cores measure routing rather than matmuls) unless replica flags follow
``--``. Results go to docs/distributed.md with the command.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import anyio
import httpx

from sims.gen import Text, _finish
from sims.live.replay import Replayer
from sims.live.replay_report import summarize
from sims.live.replicas import Cluster
from sims.trace import Header, Request, Trace


def sessions_trace(
    seed: int,
    *,
    sessions: int = 24,
    turns: int = 8,
    prefix_bytes: int = 6000,
    tool_bytes: int = 300,
    max_tokens: int = 32,
    session_gap_s: float = 0.4,
    think_s: float = 0.5,
) -> Trace:
    """``sessions`` agent sessions of ``turns`` turns, each with a distinct
    ``prefix_bytes`` opening; sessions start ``session_gap_s`` apart on average,
    turns ``think_s`` after the previous one finished (on average)."""
    rng = random.Random(seed)
    text = Text(rng)
    out: list[Request] = []
    t = 0.0
    for s in range(sessions):
        t += rng.expovariate(1.0 / session_gap_s)
        sid = f"s{s}"
        opening = (
            f"<|system|>Session {s}. Repository:\n"
            + text.code(prefix_bytes)
            + "\n<|user|>"
            + text.prose(200)
            + "\n<|assistant|>"
        )
        out.append(Request(id=-1, t=round(t, 3), session=sid, text=opening, max_tokens=max_tokens))
        tt = t
        for _ in range(turns - 1):
            tt += max_tokens * 0.012 + rng.expovariate(1.0 / think_s)
            tool = "<|tool|>" + text.tool_output(tool_bytes) + "\n<|assistant|>"
            out.append(Request(id=-1, t=round(tt, 3), session=sid, continues=sid, text=tool, max_tokens=max_tokens))
    desc = f"{sessions} agent sessions x {turns} turns, {prefix_bytes}-byte distinct prefixes"
    return _finish(Header(kind="agent-affinity", seed=seed, description=desc), out, [])


def _spread(cluster: Cluster) -> list[int]:
    """Requests each replica admitted (its /stats)."""
    out = []
    for url in cluster.replica_urls:
        try:
            out.append(int(httpx.get(url + "/stats", timeout=5).json()["scheduler"]["admitted"]))
        except (httpx.HTTPError, KeyError, ValueError):
            out.append(-1)
    return out


def run_setup(
    name: str, n: int, policy: str, trace: Trace, replica_args: list[str], time_scale: float
) -> dict[str, Any]:
    with Cluster(n, policy, replica_args) as cluster:
        replayer = Replayer(cluster.url, trace, time_scale=time_scale, retry_window_s=30.0)
        t0 = time.monotonic()
        anyio.run(replayer.run)
        wall = time.monotonic() - t0
        m = summarize(list(replayer.samples.values()))
        m["spread"] = _spread(cluster)
    m["setup"] = name
    m["wall_s"] = wall
    return m


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = [
        "| setup | ok/requests | output tok/s | TTFT p50 ms | TTFT p99 ms | prompt tokens from cache | requests per replica |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in rows:
        ratio = m["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
        cached = "–" if m["cached_ratio"] is None else f"{m['cached_ratio']:.1%}"
        lines.append(
            f"| {m['setup']} | {m['ok']}/{m['requests']} | {m['tokens_per_s']:.1f} ({ratio:.2f}x) | "
            f"{_ms(m['ttft'][50])} | {_ms(m['ttft'][99])} | {cached} | {' / '.join(map(str, m['spread']))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve.affinity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--prefix-bytes", type=int, default=6000)
    ap.add_argument("--tool-bytes", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--session-gap-s", type=float, default=0.4)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setups", default="one,round_robin,cache_aware", help="comma-separated subset, run in this order")
    ap.add_argument("--json", help="also write the raw summaries here")
    ap.add_argument("replica_args", nargs="*", help="after --: flags for every `ember serve` (default --fake-gpu)")
    args = ap.parse_args(argv)
    trace = sessions_trace(
        args.seed,
        sessions=args.sessions,
        turns=args.turns,
        prefix_bytes=args.prefix_bytes,
        tool_bytes=args.tool_bytes,
        max_tokens=args.max_tokens,
        session_gap_s=args.session_gap_s,
        think_s=args.think_s,
    )
    replica_args = args.replica_args or ["--fake-gpu"]
    setups = {
        "one": ("1 replica", 1, "round_robin"),
        "round_robin": (f"{args.replicas} replicas, round_robin", args.replicas, "round_robin"),
        "cache_aware": (f"{args.replicas} replicas, cache_aware", args.replicas, "cache_aware"),
    }
    rows = []
    for key in args.setups.split(","):
        name, n, policy = setups[key]
        print(f"[bench_affinity] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_setup(name, n, policy, trace, replica_args, args.time_scale))
    print(f"{trace.header.description}; {len(trace.requests)} requests; replicas: ember serve {' '.join(replica_args)}")
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
