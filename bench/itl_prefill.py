"""What a sub-agent's long prompt does to the streams already running (issue #32).

    python -m bench.itl_prefill --model smollm2-135m [--rounds 3] [--streams 2]
        [--max-tokens 160] [--long-tokens 7000] [--out docs/bench/itl-prefill.md] [--quick]

Per server (Ember with its defaults and ``--no-ssd-cache``, then
mlx_lm.server; one after the other, never both at once), per round:

1. alone: N streaming greedy chat requests decode ``--max-tokens`` tokens each;
   every content chunk's arrival time is recorded.
2. under prefill: the same N streams again, and once each has had
   ``--after`` chunks, one more request with a ~``--long-tokens`` prompt (this
   repository's source, cut with the model's tokenizer, a fresh nonce at its
   head so no prompt cache holds it) and ``max_tokens`` 1. The streams' ITLs
   that overlap its send → first token (its prefill) are the "under" sample.

EOS is kept out of the streams by ``logit_bias`` -100 on the model's EOS ids,
the same body for both servers (mlx_lm.server has no ``ignore_eos``), so they
decode across the whole prefill. Numbers, tables and the verdict (p99 under ≤
2.0× p99 alone, median of rounds) are ``bench.itl_prefill_report``.

How Ember interleaves a long prefill with decode (read from the code, at the
commit this was written at):

- ``actors/scheduler_core.py:318-332`` (``SchedulerCore.plan``): each step gets
  a prefill budget of ``prefill_chunk`` tokens (``engine/config.py:40``, 512,
  passed on at ``ember/assemble.py:215``) shared by all PREFILL rows; then
  ``:333-340`` add a decode row for every DECODE row in the same plan. A 7k
  prompt therefore prefills over ⌈7000/512⌉ = 14 steps, and each of those
  steps also decodes one token of every running stream: the streams are never
  stalled for the whole prefill, only slowed to one token per chunk-step.
- ``engine/mlx/backend.py:256-380`` (``MLXBackend._step``) runs that plan in
  order: the prefill chunk first (``engine/mlx/prefill.py:50-57``, its own
  B=1 forward, evaluated), then the decode batch's forward, then the eval
  of the tokens. The two are sequential in one step, so a step with a chunk
  costs prefill(512 tokens at its offset) + decode, and the running streams'
  ITL under prefill is that step's time. Also per prefill step:
  ``backend.py:264`` switches BLAS to its prefill threading
  (``blas.use(0 …)``) and ``backend.py:377`` calls ``mx.clear_cache()``.

So the interleaving is there; what bounds the ratio is the chunk's cost
against one decode step. Measured on a shared 2-core CPU (docs/bench/itl-prefill.md):
a 512-token chunk costs ~25–180× a decode step of two streams, so the ratio is
far above 2× (54.7× over two 7k rounds); mlx_lm.server prefills in 2048-token
steps and stalls them longer (392×). The proposed change (a prefill budget from
measured step costs while rows decode, in ``SchedulerCore.plan`` at
``scheduler_core.py:318``) is in that doc. There a 7k prefill takes 3–5 min per
round per server: ``--rounds 1`` fits ~12 min.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.itl_prefill_report import REFERENCE, SUBJECT, RoundResult, report, summarize
from bench.serve.vs_mlx_lm import Server, free_port

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["engine", "actors", "transport", "ember", "bench"]  # the long prompt: this repo's Python
TOPICS = ["a lighthouse keeper and a storm", "a city built under the sea", "a robot learning to paint", "a long train"]


def progress(msg: str) -> None:
    print(f"[itl] {msg}", file=sys.stderr, flush=True)


class LongText:
    """Prompts of a given token count cut from this repository's source."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        files = sorted(p for d in SOURCES for p in (ROOT / d).rglob("*.py"))
        text = "".join(f"# file: {p.relative_to(ROOT)}\n{p.read_text(errors='replace')}\n" for p in files)
        self.ids = self.tok.encode(text).ids

    def of(self, n_tokens: int, offset: int) -> str:
        offset %= max(1, len(self.ids) - n_tokens)
        return f"# {uuid.uuid4().hex}\n" + self.tok.decode(self.ids[offset : offset + n_tokens])

    def eos_ids(self, model_dir: Path) -> list[int]:
        """The ids that end a reply: config.json's ``eos_token_id`` and the tokenizer's EOS."""
        ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            p = model_dir / name
            if p.exists():
                e = json.loads(p.read_text()).get("eos_token_id")
                ids.update(e if isinstance(e, list) else [] if e is None else [e])
        p = model_dir / "tokenizer_config.json"
        if p.exists():
            eos = json.loads(p.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos and (i := self.tok.token_to_id(eos)) is not None:
                ids.add(i)
        return sorted(ids)


@dataclass
class Stream:
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0  # completion_tokens from usage, else the chunks
    prompt_tokens: int = 0
    finish: str | None = None
    end: float = 0.0


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict, on_chunk=None, out: Stream | None = None
) -> Stream:
    s = out or Stream()
    body = {**body, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    s.sent = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                s.tokens = int(chunk["usage"].get("completion_tokens") or 0)
                s.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    s.arrivals.append(time.perf_counter())
                    if on_chunk is not None:
                        on_chunk()
                s.finish = c.get("finish_reason") or s.finish
    s.end = time.perf_counter()
    s.tokens = s.tokens or len(s.arrivals)
    return s


def stream_body(model: str, k: int, nonce: str, max_tokens: int, eos: list[int]) -> dict:
    msgs = [{"role": "user", "content": f"({nonce}) Write a long, detailed story about {TOPICS[k % len(TOPICS)]}."}]
    return {"model": model, "messages": msgs, "max_tokens": max_tokens, "logit_bias": {str(i): -100 for i in eos}}


async def one_round(client, srv: Server, name: str, rnd: int, args, text: LongText, model: str, eos) -> RoundResult:
    load = os.getloadavg()[0]

    def bodies() -> list[dict]:
        """Fresh nonces per phase: no prompt-cache hit in either."""
        return [stream_body(model, k, uuid.uuid4().hex[:8], args.max_tokens, eos) for k in range(args.streams)]

    alone = await asyncio.gather(*[stream_chat(client, srv.url, b) for b in bodies()])

    streams = [Stream() for _ in range(args.streams)]
    ready = asyncio.Event()

    def check() -> None:
        if all(len(s.arrivals) >= args.after for s in streams):
            ready.set()

    async def long_request() -> tuple[float, float, int]:
        await ready.wait()
        prompt = text.of(args.long_tokens, offset=1777 * rnd)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt + "\n\nSummarize the code above in one sentence."}],
            "max_tokens": 1,
        }
        s = await stream_chat(client, srv.url, body)
        first = s.arrivals[0] if s.arrivals else s.end  # a first token with no text: the stream's end
        return s.sent, first, s.prompt_tokens

    tasks = [stream_chat(client, srv.url, b, on_chunk=check, out=st) for b, st in zip(bodies(), streams)]
    long_task = asyncio.ensure_future(long_request())
    under = list(await asyncio.gather(*tasks))
    t_send, t_first, long_tokens = await long_task
    chunks = sum(len(s.arrivals) for s in under)
    res = summarize(
        name,
        rnd + 1,
        [s.arrivals for s in alone],
        [s.arrivals for s in under],
        (t_send, t_first),
        long_prompt_tokens=long_tokens,
        load=load,
        tokens_per_chunk=sum(s.tokens for s in under) / chunks if chunks else None,
    )
    progress(
        f"{name} round {rnd + 1}: alone p50/p99 {1000 * (res.p50_alone or 0):.1f}/{1000 * (res.p99_alone or 0):.1f} ms, "
        f"under p50/p99 {1000 * (res.p50_under or 0):.1f}/{1000 * (res.p99_under or 0):.1f} ms "
        f"({len(res.under)} ITLs), ratio {res.ratio or 0:.2f}, "
        f"window {res.window_s:.2f} s ({long_tokens} tokens), covering {res.covering}/{res.streams}, "
        f"finish {[s.finish for s in under]}, load {load:.2f}"
    )
    return res


async def run_server(
    srv: Server, name: str, args, text: LongText, model: str, eos: list[int], out: list[RoundResult]
) -> None:
    """Every round on one server, appended to ``out`` as each ends (an interrupted run keeps them)."""
    progress(f"starting {name}: {shlex.join(srv.argv)}")
    progress(f"{name} ready in {srv.start(timeout_s=300):.1f} s")
    try:
        async with httpx.AsyncClient(timeout=900) as client:
            # warm-up: first-call compilation, the allocator, a prefill of a few chunks
            await stream_chat(client, srv.url, stream_body(model, 0, "warm", 16, eos))
            await stream_chat(
                client,
                srv.url,
                {"model": model, "messages": [{"role": "user", "content": text.of(600, 0)}], "max_tokens": 1},
            )
            for rnd in range(args.rounds):
                out.append(await one_round(client, srv, name, rnd, args, text, model, eos))
    finally:
        srv.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (a `timeout`): stop the server, print what was measured


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def loadavg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.itl_prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=2, help="decoding streams whose ITL is measured")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens each stream decodes")
    ap.add_argument("--long-tokens", type=int, default=7000, help="the long prompt's tokens (fits an 8k context)")
    ap.add_argument("--after", type=int, default=8, help="chunks every stream has had before the long request")
    ap.add_argument("--servers", default=f"{SUBJECT},{REFERENCE}", help="comma-separated subset")
    ap.add_argument("--quick", action="store_true", help="1 round, 64 tokens, a 2k prompt: a smoke run")
    ap.add_argument("--out", help="also write the report (markdown) here")
    ap.add_argument("--note", default="", help="a line for the report's header (e.g. the machine was shared)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens, args.long_tokens, args.after = 1, 64, 2000, 4
    command = shlex.join(["python", "-m", "bench.itl_prefill", *(sys.argv[1:] if argv is None else argv)])

    from engine.models import resolve_model

    model_dir = resolve_model(args.model)
    text = LongText(model_dir)
    eos = text.eos_ids(model_dir)
    work = Path(tempfile.mkdtemp(prefix="ember-itl-"))
    base = ["--model", str(model_dir), "--port"]
    names = args.servers.split(",")
    load_before = loadavg()
    rounds: list[RoundResult] = []
    signal.signal(signal.SIGTERM, _interrupt)
    partial = ""
    for name in names:
        port = free_port()
        if name == SUBJECT:
            argv_ = [sys.executable, "-m", "transport.cli", "serve", *base, str(port), "--no-ssd-cache"]
        elif name == REFERENCE:
            argv_ = [sys.executable, "-m", "mlx_lm.server", *base, str(port)]
        else:
            raise SystemExit(f"unknown server {name!r}: {SUBJECT} or {REFERENCE}")
        srv = Server(name, argv_, port, work / f"{name}.log")
        try:
            asyncio.run(run_server(srv, name, args, text, str(model_dir), eos, rounds))
        except KeyboardInterrupt:
            srv.stop()
            partial = f"PARTIAL: interrupted during {name} after {len(rounds)} rounds in all"
            progress(partial)
            break
    text_out = report(
        rounds,
        command=command,
        commit=commit(),
        load_before=load_before,
        load_after=loadavg(),
        notes="; ".join(n for n in (partial, args.note) if n),
    )
    print(text_out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text_out)
        progress(f"wrote {args.out}; server logs in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
