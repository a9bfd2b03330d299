"""Side-by-side benchmark: Ember vs ``mlx_lm.server`` on the same model and machine.

    python -m sims.bench                       # 5 rounds, writes docs/bench-vs-mlx-lm.{md,png}
    python -m sims.bench --rounds 7 --legs decode1,agg8

Both servers run on 127.0.0.1 with the same model directory, the same BLAS
(OpenBLAS preloaded for both when present) and the same prompts. Each round
runs every leg on both servers, alternating which goes first (A B, B A, …),
and the report gives per-leg medians and the Ember/mlx-lm ratio. Absolute
numbers on a shared 2-core machine are noisy; the ratios are what to quote.

Legs: single-stream decode, aggregate decode at 4 and 8 streams, cold TTFT at
~1k tokens, warm TTFT (the same prompt again), ~8k-token prefill TTFT, a
restart leg (flush, SIGTERM, respawn, the same long prompt: cached tokens and
TTFT; mlx_lm.server keeps nothing across a restart, so its restart TTFT is its
cold TTFT), Ember decode with the SSD tier on vs off, speculation speedup at the
best γ, and a bare ``mlx_lm.stream_generate`` loop as the single-stream ceiling,
in its own process and behind the thinnest streaming server
(``sims/bare_server.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
MODEL_NAME = "default"  # set to the model directory: both servers serve it under that name
LEGS = ["decode1", "agg4", "agg8", "ttft1k_cold", "ttft1k_warm", "ttft8k", "restart", "tier", "spec", "bare"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if Path(OPENBLAS).exists() and OPENBLAS not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = (OPENBLAS + " " + env.get("LD_PRELOAD", "")).strip()
    return env


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of server_env()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> float:
        t0 = time.perf_counter()
        self.log = open(self.log_path, "ab")  # noqa: SIM115 -- the server's stdout for its lifetime; stop() closes it
        self.proc = subprocess.Popen(
            self.argv, env={**server_env(), **self.env}, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s}s; see {self.log_path}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 180.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc, self.proc = self.proc.returncode, None
        self.log.close()
        return rc


@dataclass
class Sample:
    ttft_s: float
    decode_tps: float | None
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    wall_s: float


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, **extra) -> Sample:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    t0 = time.perf_counter()
    first = last = None
    n_chunks = 0
    usage: dict = {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
                n_chunks += 1
    end = time.perf_counter()
    n = int(usage.get("completion_tokens", n_chunks))
    details = usage.get("prompt_tokens_details") or {}
    tps = (n - 1) / (last - first) if first and last and last > first and n > 1 else None
    return Sample(
        ttft_s=(first or end) - t0,
        decode_tps=tps,
        completion_tokens=n,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        wall_s=end - t0,
    )


class Prompts:
    """Prompts of a given token length, cut from the standard library's source."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        import sysconfig

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("[a-m]*.py"))[:60])
        self.ids = self.tok.encode(text).ids

    def of(self, n_tokens: int, offset: int = 0, nonce: str = "") -> str:
        body = self.tok.decode(self.ids[offset : offset + n_tokens])
        return (f"# {nonce}\n" if nonce else "") + body


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


@dataclass
class Results:
    rows: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    load: list[float] = field(default_factory=list)  # 1-minute load average at the start of each round, and at the end

    def add(self, leg: str, who: str, value: float | None) -> None:
        if value is not None:
            self.rows.setdefault(leg, {}).setdefault(who, []).append(value)

    def med(self, leg: str, who: str) -> float | None:
        return median(self.rows.get(leg, {}).get(who, []))


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


async def leg_decode1(client, srv, prompts, rnd):
    s = await stream_completion(client, srv.url, prompts.of(64, offset=5000 + rnd), 128)
    return s.decode_tps


async def leg_agg(client, srv, prompts, rnd, n):
    t0 = time.perf_counter()
    samples = await asyncio.gather(
        *[stream_completion(client, srv.url, prompts.of(48, offset=9000 + 300 * i + rnd), 64) for i in range(n)]
    )
    return sum(s.completion_tokens for s in samples) / (time.perf_counter() - t0)


def bare_loop_tps(model_dir: Path, prompt: str, max_tokens: int, blas_threads: int | None = None) -> float:
    """Single-stream ceiling: mlx_lm.stream_generate in a fresh process (same BLAS;
    ``blas_threads`` pins OpenBLAS's thread count, None leaves its default)."""
    code = (
        "import sys,time,mlx_lm\n"
        "m,t=mlx_lm.load(sys.argv[1])\n"
        "p=sys.stdin.read()\n"
        "list(mlx_lm.stream_generate(m,t,p,max_tokens=8))\n"
        "r=None\n"
        "for r in mlx_lm.stream_generate(m,t,p,max_tokens=int(sys.argv[2])): pass\n"
        "print(r.generation_tps)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(model_dir), str(max_tokens)],
        input=prompt,
        capture_output=True,
        text=True,
        check=True,
        env={**server_env(), **({"OPENBLAS_NUM_THREADS": str(blas_threads)} if blas_threads else {})},
    )
    return float(out.stdout.strip().splitlines()[-1])


def machine_line() -> str:
    import importlib.metadata as md

    vers = {p: md.version(p) for p in ("mlx", "mlx-lm", "ember-mlx")}
    blas = "OpenBLAS preloaded" if Path(OPENBLAS).exists() else "reference BLAS"
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in vers.items())
        + f", {blas}"
    )


async def run(args: argparse.Namespace) -> Results:
    from engine.models import resolve_model

    global MODEL_NAME
    model_dir = resolve_model(args.model)
    MODEL_NAME = str(model_dir)
    prompts = Prompts(model_dir)
    work = Path(tempfile.mkdtemp(prefix="ember-bench-"))
    legs = set(args.legs.split(",")) if args.legs else set(LEGS)
    res = Results()
    ssd = work / "ssd"
    ember_cmd = lambda port, *extra: [  # noqa: E731
        sys.executable,
        "-m",
        "transport.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        *extra,
    ]
    mlx_cmd = lambda port, *extra: [  # noqa: E731
        sys.executable,
        "-m",
        "mlx_lm.server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        *extra,
    ]
    ember = Server("ember", ember_cmd(p := free_port(), "--ssd-cache", str(ssd)), p, work / "ember.log")
    mlxlm = Server("mlx-lm", mlx_cmd(p := free_port()), p, work / "mlx-lm.log")
    extra: list[Server] = []
    if "tier" in legs:
        # Two fresh servers that see only the tier leg, so their histories match
        # (the main Ember server carries every other leg's cache entries).
        extra.append(
            Server(
                "ember-tier",
                ember_cmd(p := free_port(), "--ssd-cache", str(work / "ssd-tier")),
                p,
                work / "ember-tier.log",
            )
        )
        extra.append(Server("ember-notier", ember_cmd(p := free_port()), p, work / "ember-notier.log"))
    if "spec" in legs:
        extra.append(
            Server(
                "ember-spec",
                ember_cmd(p := free_port(), "--draft-model", "tiny-draft", "--num-draft-tokens", str(args.gamma)),
                p,
                work / "ember-spec.log",
            )
        )
        extra.append(
            Server(
                "mlx-lm-spec",
                mlx_cmd(
                    p := free_port(),
                    "--draft-model",
                    str(resolve_model("tiny-draft")),
                    "--num-draft-tokens",
                    str(args.gamma),
                ),
                p,
                work / "mlx-lm-spec.log",
            )
        )
    if "bare" in legs:
        # The bare loop behind the thinnest streaming server, measured with the same
        # client: what the HTTP hop and a client on the same cores cost any server.
        def bare_cmd(port: int) -> list[str]:
            return [sys.executable, "-m", "sims.bare_server", "--model", str(model_dir), "--port", str(port)]

        extra.append(Server("bare-http", bare_cmd(p := free_port()), p, work / "bare-http.log"))
        extra.append(
            Server(
                "bare-http-1",
                bare_cmd(p := free_port()),
                p,
                work / "bare-http-1.log",
                env={"OPENBLAS_NUM_THREADS": "1"},
            )
        )
    servers = [ember, mlxlm, *extra]
    for s in servers:
        progress(f"starting {s.name}")
        s.start()
    try:
        async with httpx.AsyncClient() as client:
            for s in servers:  # warm both (first-call compilation, allocator)
                await stream_completion(client, s.url, prompts.of(32), 16)
            for rnd in range(args.rounds):
                res.load.append(os.getloadavg()[0])
                order = [ember, mlxlm] if rnd % 2 == 0 else [mlxlm, ember]
                for srv in order:
                    who = "ember" if srv is ember else "mlx-lm"
                    tag = f"round {rnd + 1}/{args.rounds} {who}"
                    if "decode1" in legs:
                        progress(f"{tag}: decode1")
                        res.add("decode1", who, await leg_decode1(client, srv, prompts, rnd))
                    for n in (4, 8):
                        if f"agg{n}" in legs:
                            progress(f"{tag}: agg{n}")
                            res.add(f"agg{n}", who, await leg_agg(client, srv, prompts, rnd, n))
                    if "ttft1k_cold" in legs or "ttft1k_warm" in legs:
                        progress(f"{tag}: ttft1k cold/warm")
                        p1k = prompts.of(1000, offset=20000 + 50 * rnd, nonce=uuid.uuid4().hex)
                        cold = await stream_completion(client, srv.url, p1k, 1)
                        warm = await stream_completion(client, srv.url, p1k, 1)
                        res.add("ttft1k_cold", who, cold.ttft_s * 1000)
                        res.add("ttft1k_warm", who, warm.ttft_s * 1000)
                        res.add("ttft1k_warm_cached_tokens", who, warm.cached_tokens)
                    if ("ttft8k" in legs or "restart" in legs) and rnd < args.long_rounds:
                        progress(f"{tag}: ttft8k")
                        p8k = prompts.of(args.long_tokens, offset=40000 + 50 * rnd, nonce=uuid.uuid4().hex)
                        cold = await stream_completion(client, srv.url, p8k, 1)
                        res.add("ttft8k", who, cold.ttft_s * 1000)
                        if "restart" in legs:
                            progress(f"{tag}: restart")
                            if srv is ember:
                                flush = httpx.post(srv.url + "/admin/cache/flush", json={}, timeout=600)
                                evidence = (
                                    flush.json()
                                    if flush.headers.get("content-type", "").startswith("application/json")
                                    else {}
                                )
                                res.add(
                                    "restart_flush_durable",
                                    who,
                                    1.0 if flush.status_code == 200 and evidence.get("durable") else 0.0,
                                )
                                rc = srv.stop(signal.SIGTERM)
                                res.add("restart_exit_code", who, rc)
                                res.add("restart_ready_s", who, srv.start())
                                again = await stream_completion(client, srv.url, p8k, 1)
                                res.add("restart", who, again.ttft_s * 1000)
                                res.add("restart_cached_tokens", who, again.cached_tokens)
                                res.add("restart_prompt_tokens", who, again.prompt_tokens)
                                res.add("restart_vs_cold", who, again.ttft_s / cold.ttft_s)
                            else:
                                srv.stop(signal.SIGTERM)
                                res.add("restart_ready_s", who, srv.start())
                                again = await stream_completion(client, srv.url, p8k, 1)
                                res.add("restart", who, again.ttft_s * 1000)
                                res.add("restart_cached_tokens", who, again.cached_tokens)
                                res.add("restart_vs_cold", who, again.ttft_s / cold.ttft_s)
                if "tier" in legs:
                    tier_on = next(s for s in extra if s.name == "ember-tier")
                    tier_off = next(s for s in extra if s.name == "ember-notier")
                    pair = [tier_on, tier_off] if rnd % 2 == 0 else [tier_off, tier_on]
                    for srv in pair:
                        who = "on" if srv is tier_on else "off"
                        progress(f"round {rnd + 1}: tier {who}")
                        # a long request first, so the tier-on server has a write-behind
                        # snapshot pending while the decode below runs
                        await stream_completion(
                            client, srv.url, prompts.of(2000, offset=70000 + 100 * rnd, nonce=uuid.uuid4().hex), 1
                        )
                        res.add("tier_decode", who, await leg_decode1(client, srv, prompts, rnd))
                if "spec" in legs:
                    spec_e = next(s for s in extra if s.name == "ember-spec")
                    spec_m = next(s for s in extra if s.name == "mlx-lm-spec")
                    for srv, who in (
                        (ember, "ember-plain"),
                        (spec_e, "ember-spec"),
                        (mlxlm, "mlx-lm-plain"),
                        (spec_m, "mlx-lm-spec"),
                    ):
                        progress(f"round {rnd + 1}: spec {who}")
                        sample = await stream_completion(client, srv.url, prompts.of(200, offset=60000 + rnd), 128)
                        res.add("spec_decode", who, sample.decode_tps)
                if "bare" in legs:
                    progress(f"round {rnd + 1}: bare mlx_lm loop")
                    res.add(
                        "bare",
                        "mlx_lm.stream_generate",
                        bare_loop_tps(model_dir, prompts.of(64, offset=5000 + rnd), 128),
                    )
                    # Ember runs a 1-row decode on one OpenBLAS thread (engine.blas); the
                    # bare loop gets the same setting too, and the faster one is the ceiling.
                    res.add(
                        "bare",
                        "1 thread",
                        bare_loop_tps(model_dir, prompts.of(64, offset=5000 + rnd), 128, blas_threads=1),
                    )
                    for srv in (s for s in extra if s.name.startswith("bare-http")):
                        progress(f"round {rnd + 1}: {srv.name} (bare loop behind HTTP)")
                        res.add("bare_http", srv.name, await leg_decode1(client, srv, prompts, rnd))
    finally:
        res.load.append(os.getloadavg()[0])
        for s in servers:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    return res


# Issue 24's targets (Ember / mlx_lm.server unless noted).
TARGETS = {
    "decode1": (">=", 1.0),
    "agg8": (">=", 1.3),
    "ttft1k_warm": ("<=", 0.7),
}
BARE_TARGET = 0.97  # single stream vs the bare mlx-lm decode loop (prefill excluded)
RESTART_TARGET = 0.02  # restart TTFT as a fraction of Ember's own cold TTFT


def command_line(args: argparse.Namespace) -> str:
    """The full command that reproduces this run."""
    parts = ["python -m sims.bench", f"--model {args.model}", f"--rounds {args.rounds}"]
    if args.legs:
        parts.append(f"--legs {args.legs}")
    parts += [
        f"--gamma {args.gamma}",
        f"--long-tokens {args.long_tokens}",
        f"--long-rounds {args.long_rounds}",
        f"--out {args.out}",
    ]
    return " ".join(parts)


def _verdict(values: list[float | None], op: str, bound: float) -> str:
    ok = [(v >= bound if op == ">=" else v <= bound) for v in values if v is not None]
    if not ok:
        return "not measured"
    # Both statistics must agree; on a noisy box they sometimes do not.
    return "MET" if all(ok) else ("NOT MET" if not any(ok) else "inconclusive")


def target_table(res: Results, args: argparse.Namespace) -> list[str]:
    """The issue-24 targets, each with the ratio of medians and the paired ratio."""

    def fmt(x, unit="×"):
        return "–" if x is None else f"{x:.3g}{unit}"

    def paired(leg: str, a: str, b: str) -> float | None:
        rows = res.rows.get(leg, {})
        return median([x / y for x, y in zip(rows.get(a, []), rows.get(b, [])) if y])

    lines = [
        "| issue 24 target | Ember | reference | ratio of medians | paired (median of per-round ratios) | verdict |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "decode1": "single stream vs mlx_lm.server",
        "agg8": "8-stream aggregate vs mlx_lm.server",
        "ttft1k_warm": "warm TTFT (~1k tokens) vs mlx_lm.server",
    }
    for leg, (op, bound) in TARGETS.items():
        e, m = res.med(leg, "ember"), res.med(leg, "mlx-lm")
        ratio, pair = (e / m if e and m else None), paired(leg, "ember", "mlx-lm")
        unit = " ms" if leg.startswith("ttft") else " tok/s"
        lines.append(
            f"| {names[leg]} {op} {bound}× | {fmt(e, unit)} | {fmt(m, unit)} | {fmt(ratio)} | {fmt(pair)} "
            f"| {_verdict([ratio, pair], op, bound)} |"
        )
    bare = res.rows.get("bare", {})
    per_round = [max(a, b) for a, b in zip(bare.get("mlx_lm.stream_generate", []), bare.get("1 thread", []))]
    if per_round:
        e, b = res.med("decode1", "ember"), median(per_round)
        pair = median([x / y for x, y in zip(res.rows.get("decode1", {}).get("ember", []), per_round) if y])
        ratio = e / b if e and b else None
        lines.append(
            f"| single stream vs the bare `mlx_lm.stream_generate` loop (faster of default / 1 thread, per round) "
            f">= {BARE_TARGET}× | {fmt(e, ' tok/s')} | {fmt(b, ' tok/s')} | {fmt(ratio)} | {fmt(pair)} "
            f"| {_verdict([ratio, pair], '>=', BARE_TARGET)} |"
        )
    if res.rows.get("restart", {}).get("ember"):
        rc = res.med("restart_vs_cold", "ember")
        lines.append(
            f"| restart TTFT vs Ember's own cold TTFT ({args.long_tokens:,}-token prompt, "
            f"{int(res.med('restart_cached_tokens', 'ember') or 0):,} cached) <= {RESTART_TARGET:.0%} "
            f"| {fmt(res.med('restart', 'ember'), ' ms')} | {fmt(res.med('ttft8k', 'ember'), ' ms')} "
            f"| {fmt(rc and rc * 100, '%')} | – | {_verdict([rc], '<=', RESTART_TARGET)} |"
        )
    load = res.load
    if load:
        lines += [
            "",
            f"1-minute load average on the 2-core machine at each round's start and at the end: "
            f"{', '.join(f'{x:.1f}' for x in load)} (median {statistics.median(load):.1f}).",
        ]
    return lines


def report(res: Results, args: argparse.Namespace) -> str:
    def fmt(x, unit=""):
        return "–" if x is None else (f"{x:.3g}{unit}" if abs(x) < 1000 else f"{x:,.0f}{unit}")

    lines = [
        "# Ember vs mlx_lm.server, side by side",
        "",
        f"Command: `{command_line(args)}`",
        "",
        f"Machine: {machine_line()}. Model: `{args.model}`. {args.rounds} rounds, alternating which server goes first; medians.",
        "Absolute numbers on this shared machine are noisy: quote the ratios.",
        "",
        *target_table(res, args),
        "",
        f"The long-prompt legs (`ttft8k`, `restart`) used a {args.long_tokens:,}-token prompt in "
        f"{min(args.long_rounds, args.rounds)} round(s).",
        "",
        "| leg | unit | Ember | mlx_lm.server | Ember / mlx-lm (of medians) | paired (median of per-round ratios) | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    units = {
        "decode1": "tok/s",
        "agg4": "tok/s",
        "agg8": "tok/s",
        "ttft1k_cold": "ms",
        "ttft1k_warm": "ms",
        "ttft8k": "ms",
        "restart": "ms",
    }
    ratios: dict[str, float] = {}
    for leg, unit in units.items():
        e, m = res.med(leg, "ember"), res.med(leg, "mlx-lm")
        ratio = e / m if e and m else None
        pairs = [
            a / b for a, b in zip(res.rows.get(leg, {}).get("ember", []), res.rows.get(leg, {}).get("mlx-lm", [])) if b
        ]
        paired = median(pairs)
        if ratio is not None:
            ratios[leg] = ratio
        target = TARGETS.get(leg)
        met = _verdict([ratio, paired], *target) if target and ratio is not None else ""
        lines.append(
            f"| {leg} | {unit} | {fmt(e)} | {fmt(m)} | {fmt(ratio, '×')} | {fmt(paired, '×')} | {target[0] + ' ' + str(target[1]) + '×' if target else ''} | {met} |"
        )
    lines += ["", "## Restart leg", ""]
    if res.rows.get("restart"):
        rc = res.med("restart_vs_cold", "ember")
        lines += [
            f"- Ember: restart TTFT {fmt(res.med('restart', 'ember'), ' ms')} vs its cold TTFT {fmt(res.med('ttft8k', 'ember'), ' ms')} "
            f"= {fmt(rc and rc * 100, '%')} of cold (target ≤ 2%); cached tokens after restart {fmt(res.med('restart_cached_tokens', 'ember'))} "
            f"of {fmt(res.med('restart_prompt_tokens', 'ember'))}; flush durable in {fmt((res.med('restart_flush_durable', 'ember') or 0) * 100, '%')} of rounds; "
            f"exit code on SIGTERM {fmt(res.med('restart_exit_code', 'ember'))}; ready after respawn {fmt(res.med('restart_ready_s', 'ember'), ' s')}.",
            f"- mlx_lm.server: restart TTFT {fmt(res.med('restart', 'mlx-lm'), ' ms')} = {fmt((res.med('restart_vs_cold', 'mlx-lm') or 0) * 100, '%')} of its cold TTFT; "
            f"cached tokens after restart {fmt(res.med('restart_cached_tokens', 'mlx-lm'))}.",
        ]
        restart_e, restart_m = res.med("restart", "ember"), res.med("restart", "mlx-lm")
        if restart_e and restart_m:
            ratios["restart"] = restart_e / restart_m
    if res.rows.get("tier_decode"):
        on, off = res.med("tier_decode", "on"), res.med("tier_decode", "off")
        pairs = [
            a / b for a, b in zip(res.rows["tier_decode"].get("on", []), res.rows["tier_decode"].get("off", [])) if b
        ]
        lines += [
            "",
            "## SSD tier on vs off (Ember)",
            "",
            "Two fresh Ember servers that serve only this leg (a 2000-token request, then the decode run, so the tier-on server has a write-behind snapshot pending during the decode).",
            "",
            f"Decode {fmt(on, ' tok/s')} with the tier vs {fmt(off, ' tok/s')} without: **{fmt(on / off if on and off else None, '×')}**, paired {fmt(median(pairs), '×')} (target ≥ 0.98×).",
        ]
        if on and off:
            ratios["tier on/off"] = on / off
    if res.rows.get("spec_decode"):
        ep, es = res.med("spec_decode", "ember-plain"), res.med("spec_decode", "ember-spec")
        mp, ms = res.med("spec_decode", "mlx-lm-plain"), res.med("spec_decode", "mlx-lm-spec")
        lines += [
            "",
            f"## Speculation (draft model tiny-draft, γ={args.gamma})",
            "",
            f"- Ember: {fmt(es, ' tok/s')} with vs {fmt(ep, ' tok/s')} without = **{fmt(es / ep if es and ep else None, '×')}**",
            f"- mlx_lm.server: {fmt(ms, ' tok/s')} with vs {fmt(mp, ' tok/s')} without = **{fmt(ms / mp if ms and mp else None, '×')}**",
        ]
        if es and ep:
            ratios["spec speedup"] = es / ep
    if res.rows.get("bare"):
        b2 = res.med("bare", "mlx_lm.stream_generate")
        b1 = res.med("bare", "1 thread")
        b = max(x for x in (b1, b2, 0.0) if x is not None) or None
        e = res.med("decode1", "ember")
        lines += [
            "",
            "## Single-stream ceiling",
            "",
            f"Bare `mlx_lm.stream_generate` loop in its own process: {fmt(b2, ' tok/s')} with OpenBLAS's default threads, "
            f"{fmt(b1, ' tok/s')} with `OPENBLAS_NUM_THREADS=1`; the faster is the ceiling. "
            f"Ember single-stream over HTTP {fmt(e, ' tok/s')} = **{fmt(e / b if e and b else None, '×')}** of it (target ≥ 0.97×).",
        ]
        if e and b:
            ratios["vs bare loop"] = e / b
        h2, h1 = res.med("bare_http", "bare-http"), res.med("bare_http", "bare-http-1")
        h = max(x for x in (h1, h2, 0.0) if x is not None) or None
        if h:
            lines += [
                "",
                f"The same loop behind the thinnest streaming server (`sims/bare_server.py`: "
                f"`stream_generate` on a thread, one SSE event per token), measured with the same client as "
                f"the two servers: {fmt(h2, ' tok/s')} with default threads, {fmt(h1, ' tok/s')} with one. "
                f"Ember = **{fmt(e / h if e else None, '×')}** of the faster; mlx_lm.server "
                f"{fmt((res.med('decode1', 'mlx-lm') or 0) / h, '×')}. The in-process loop pays no HTTP hop "
                "and has no client beside it on the two cores; this one does, like the servers.",
            ]
            if e:
                ratios["vs bare loop behind HTTP"] = e / h
    lines += ["", "## Raw samples", "", "```json", json.dumps(res.rows, indent=1, default=float), "```", ""]
    lines += res.notes
    res.notes = [json.dumps(ratios)]
    return "\n".join(lines)


def chart(ratios: dict[str, float], path: Path) -> bool:
    """Write the ratio chart to ``path``; False (and a line on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('[bench] no chart: matplotlib is not installed (pip install -e ".[bench]")', file=sys.stderr)
        return False

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(ratios)
    ax.barh(names, [ratios[n] for n in names], color="#d9642b")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("ratio (Ember / mlx_lm.server, or as labelled)")
    ax.set_title("Ember vs mlx_lm.server, medians (lower is better for TTFT/restart)")
    for i, n in enumerate(names):
        ax.text(ratios[n], i, f" {ratios[n]:.2f}×", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sims.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--legs", default="", help=f"comma-separated subset of {','.join(LEGS)}")
    ap.add_argument("--gamma", type=int, default=2, help="γ for the speculation leg")
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--long-rounds", type=int, default=3, help="rounds that run the long-prompt legs (ttft8k, restart)")
    ap.add_argument("--out", default="docs/bench-vs-mlx-lm.md")
    args = ap.parse_args(argv)
    res = asyncio.run(run(args))
    text = report(res, args)
    ratios = json.loads(res.notes[0])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    charted = chart(ratios, png)
    out.write_text(text + (f"\n![ratios]({png.name})\n" if charted else ""))
    print(text)
    print(f"[bench] wrote {out}" + (f" and {png}" if charted else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
