"""Side-by-side benchmark: Ember vs ``mlx_lm.server`` on the same model and machine.

    python -m bench.serve.vs_mlx_lm                       # 5 rounds, writes docs/bench/vs-mlx-lm.{md,png}
    python -m bench.serve.vs_mlx_lm --rounds 7 --legs decode1,agg8

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
(``bench/serve/bare_server.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.serve.vs_mlx_lm_report import OPENBLAS, Results, chart, report

MODEL_NAME = "default"  # set to the model directory: both servers serve it under that name
SERVED: dict[str, str] = {}  # a server's URL -> the model name its requests carry, where not MODEL_NAME
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
        "model": SERVED.get(url, MODEL_NAME),  # mlx_lm.server loads whatever model a request names
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


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


DECODE_TOKENS = 128  # new tokens of the single-stream leg (--decode-tokens)
AGG_TOKENS = 64  # new tokens of each stream of the aggregate legs (--agg-tokens)


async def leg_decode1(client, srv, prompts, rnd, tokens=DECODE_TOKENS):
    s = await stream_completion(client, srv.url, prompts.of(64, offset=5000 + rnd), tokens)
    return s.decode_tps


async def leg_agg(client, srv, prompts, rnd, n, tokens=AGG_TOKENS):
    t0 = time.perf_counter()
    samples = await asyncio.gather(
        *[stream_completion(client, srv.url, prompts.of(48, offset=9000 + 300 * i + rnd), tokens) for i in range(n)]
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


def model_dir_in(name: str, weights: str | None) -> Path:
    """``name``'s directory as ``resolve_model`` gives it, in ``weights``
    (``EMBER_WEIGHTS``'s values) where given: a packaged model converted to that format."""
    from engine.models import resolve_model

    if not weights:
        return resolve_model(name)
    before = os.environ.get("EMBER_WEIGHTS")
    os.environ["EMBER_WEIGHTS"] = weights
    try:
        return resolve_model(name)
    finally:  # the servers' environment is this one: Ember must still choose its own format
        if before is None:
            del os.environ["EMBER_WEIGHTS"]
        else:
            os.environ["EMBER_WEIGHTS"] = before


async def run(args: argparse.Namespace) -> Results:
    from engine.models import resolve_model

    global MODEL_NAME
    model_dir = resolve_model(args.model)
    MODEL_NAME = str(model_dir)
    # --peer-weights: mlx_lm.server on another conversion of the model (the
    # 1.5B's default q8 goes through MLX's one-thread quantized matmul there:
    # seconds a token), Ember on its own default
    peer_dir = model_dir_in(args.model, args.peer_weights) if args.peer_weights else model_dir
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
        str(peer_dir),
        "--port",
        str(port),
        *extra,
    ]
    flags = args.ember_flags.split() if args.ember_flags else []
    ember = Server("ember", ember_cmd(p := free_port(), "--ssd-cache", str(ssd), *flags), p, work / "ember.log")
    mlxlm = Server("mlx-lm", mlx_cmd(p := free_port()), p, work / "mlx-lm.log")
    if peer_dir != model_dir:
        SERVED[mlxlm.url] = str(peer_dir)
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
        # the SSD tier is on by default for `ember serve` (#32): the no-tier server says so
        extra.append(
            Server("ember-notier", ember_cmd(p := free_port(), "--no-ssd-cache"), p, work / "ember-notier.log")
        )
    if "spec" in legs:
        extra.append(
            Server(
                "ember-spec",
                ember_cmd(
                    p := free_port(),
                    "--no-ssd-cache",
                    "--draft-model",
                    "tiny-draft",
                    "--num-draft-tokens",
                    str(args.gamma),
                ),
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
            return [sys.executable, "-m", "bench.serve.bare_server", "--model", str(model_dir), "--port", str(port)]

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
                        res.add("decode1", who, await leg_decode1(client, srv, prompts, rnd, args.decode_tokens))
                    for n in (4, 8):
                        if f"agg{n}" in legs:
                            progress(f"{tag}: agg{n}")
                            res.add(f"agg{n}", who, await leg_agg(client, srv, prompts, rnd, n, args.agg_tokens))
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
                    # Ember runs a 1-row decode on one OpenBLAS thread (engine.mlx.blas); the
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve.vs_mlx_lm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--legs", default="", help=f"comma-separated subset of {','.join(LEGS)}")
    ap.add_argument("--gamma", type=int, default=2, help="γ for the speculation leg")
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--long-rounds", type=int, default=3, help="rounds that run the long-prompt legs (ttft8k, restart)")
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=DECODE_TOKENS,
        help="new tokens of the single-stream leg (a slow model: fewer)",
    )
    ap.add_argument("--agg-tokens", type=int, default=AGG_TOKENS, help="new tokens of each stream of agg4/agg8")
    ap.add_argument(
        "--ember-flags",
        default="",
        help="extra `ember serve` flags for the main Ember server, e.g. '--draft-model none'",
    )
    ap.add_argument(
        "--peer-weights",
        help="mlx_lm.server on the model in this format (EMBER_WEIGHTS's values, e.g. float32), Ember on its default",
    )
    ap.add_argument("--out", default="docs/bench/vs-mlx-lm.md")
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
