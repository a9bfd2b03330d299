"""Replay a trace against a live OpenAI-compatible server, in wall time.

    python -m sims.live.replay --url http://127.0.0.1:8000 --trace sims/traces/agent-small.ndjson
    python -m sims.live.replay --server-cmd "ember serve --fake-gpu --port {port}" --trace restart-small --time-scale 0.2

Requests go to ``/v1/completions`` with ``stream: true`` (text or token-id
prompts), honoring each request's arrival time (``--time-scale 0.1`` runs ten
times faster); a continuation waits for the turn it continues and sends that
turn's prompt and output plus its own text. With ``--server-cmd`` the replayer
starts the server itself and carries out the trace's restarts (SIGKILL for a
crash, SIGTERM for a graceful one) and flushes (``POST /admin/cache/flush``);
without it they are only marked on the plot.

Writes a Markdown report (``sims.live.replay_report``: TTFT p50/p95/p99,
inter-token latency, throughput, cached-token ratio, errors) and a PNG of TTFT over the run with restarts
marked, to ``--out`` (default ``replay-out/``), and prints the report. The PNG
needs matplotlib (``pip install -e ".[bench]"``; the test extra has it too);
without it the report is written without the plot and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import anyio
import httpx

from sims import trace as tr
from sims.live.replay_report import Mark, Sample, plot, report_markdown
from sims.trace import Flush, Request, Restart, Sessions, Trace

RETRY_STATUS = {429, 502, 503, 504}


# ---------------------------------------------------------------------------
# The server, when the replayer runs it.


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts ``cmd`` (``{port}`` substituted), waits for ``/health``, kills
    and restarts it for the trace's restart records."""

    def __init__(self, cmd: str, url: str, *, start_timeout_s: float = 120.0, log_path: str | None = None):
        self.cmd = shlex.split(cmd)
        self.url = url
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    async def start(self) -> None:
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 -- closed below
        try:
            out = log if log is not None else subprocess.DEVNULL
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            if log is not None:
                log.close()
        self.starts += 1
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with status {self.proc.returncode} while starting: {' '.join(self.cmd)}"
                    )
                try:
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not answer /health within {self.start_timeout_s} s")
                await anyio.sleep(0.1)

    async def stop(self, crash: bool, grace_s: float = 120.0) -> int | None:
        """SIGKILL (a crash) or SIGTERM (drain, flush, exit); the exit status."""
        p = self.proc
        if p is None or p.poll() is not None:
            return p.returncode if p else None
        p.send_signal(signal.SIGKILL if crash else signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while p.poll() is None:
            if time.monotonic() > deadline:
                p.kill()
            await anyio.sleep(0.05)
        return p.returncode


# ---------------------------------------------------------------------------


class Replayer:
    def __init__(
        self,
        url: str,
        trace: Trace,
        *,
        time_scale: float = 1.0,
        model: str | None = None,
        encode: Callable[[str], list[int]] | None = None,
        retry_window_s: float = 60.0,
        request_timeout_s: float = 600.0,
        server: ServerProcess | None = None,
        progress: bool = False,
    ):
        self.url = url.rstrip("/")
        self.trace = trace
        self.scale = time_scale
        self.model = model
        self.retry_window_s = retry_window_s
        self.request_timeout_s = request_timeout_s
        self.server = server
        self.progress = progress
        self.encode = encode
        self.sessions = Sessions(trace)
        self.parents = trace.parents()
        self.samples: dict[int, Sample] = {}
        self.marks: list[Mark] = []
        self.done: dict[int, anyio.Event] = {}
        self.t0 = 0.0
        self._bar: Any = None
        self._restarting = anyio.Lock()
        needs = [r.id for r in trace.requests if r.continues is not None and not r.is_text]
        if needs and encode is None:
            raise SystemExit(
                f"the trace continues token-id prompts (request {needs[0]} and {len(needs) - 1} more), and the stream "
                "carries text only: pass --tokenizer (bytes for the fake GPU, or a tokenizer.json)"
            )

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        if self.server is not None:
            await self.server.start()
        for r in self.trace.requests:
            self.done[r.id] = anyio.Event()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        if self.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=len(self.trace.requests), unit="req", desc="replay", leave=False)
        try:
            async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
                if self.model is None:
                    self.model = await self._model_name(client)
                self.t0 = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for ev in self.trace.events:
                        await self._sleep_until(ev.t * self.scale)
                        match ev:
                            case Request():
                                tg.start_soon(self._request, client, ev)
                            case Restart():
                                tg.start_soon(self._restart, ev)
                            case Flush():
                                tg.start_soon(self._flush, client)
        finally:
            if self._bar is not None:
                self._bar.close()
            if self.server is not None:
                await self.server.stop(crash=False)

    async def _sleep_until(self, t: float) -> None:
        dt = t - self.now()
        if dt > 0:
            await anyio.sleep(dt)

    async def _model_name(self, client: httpx.AsyncClient) -> str:
        try:
            r = await client.get(self.url + "/v1/models")
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            return "default"

    # ---- requests ----------------------------------------------------------
    async def _request(self, client: httpx.AsyncClient, req: Request) -> None:
        parent = self.parents.get(req.id)
        if parent is not None:
            await self.done[parent].wait()
        prompt = self.sessions.prompt(req)
        s = Sample(id=req.id, session=req.session, start=self.now())
        self.samples[req.id] = s
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": req.max_tokens,
            "temperature": req.sampling.temperature,
            "top_p": req.sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.sampling.seed is not None:
            body["seed"] = req.sampling.seed
        if req.sampling.top_k:
            body["top_k"] = req.sampling.top_k
        text = ""
        while True:
            s.attempts += 1
            try:
                text = await self._stream(client, body, s)
                s.ok = True
                break
            except _Retryable as exc:
                s.errors.append(str(exc))
                if self.now() - s.start > self.retry_window_s:
                    break
                # retry promptly (a restarting server is back within seconds), so
                # TTFT measures the server's downtime rather than the client's backoff
                await anyio.sleep(min(1.0, 0.1 * s.attempts))
            except _Fatal as exc:
                s.errors.append(str(exc))
                break
        s.end = self.now()
        out: str | list[int] = text
        if not isinstance(prompt, str):
            out = self.encode(text) if self.encode is not None else []
        self.sessions.done(req, prompt, out)
        self.done[req.id].set()
        if self._bar is not None:
            self._bar.update(1)

    async def _stream(self, client: httpx.AsyncClient, body: dict[str, Any], s: Sample) -> str:
        sent = self.t0 + s.start  # TTFT as the client sees it: from arrival, failed attempts included
        last: float | None = None
        parts: list[str] = []
        finished = False
        ttft: float | None = None
        itl: list[float] = []
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:200]
                    err = f"HTTP {resp.status_code}: {detail}"
                    raise _Retryable(err) if resp.status_code in RETRY_STATUS else _Fatal(err)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise _Retryable(f"error in stream: {str(chunk['error'])[:200]}")
                    usage = chunk.get("usage")
                    if usage:
                        s.completion_tokens = usage.get("completion_tokens", 0)
                        s.prompt_tokens = usage.get("prompt_tokens", 0)
                        s.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    for choice in chunk.get("choices") or []:
                        piece = choice.get("text") or ""
                        now = time.monotonic()
                        if piece:
                            if ttft is None:
                                ttft = now - sent
                            elif last is not None:
                                itl.append(now - last)
                            last = now
                            parts.append(piece)
                        if choice.get("finish_reason"):
                            finished = True
        except httpx.HTTPError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        if not finished:
            raise _Retryable("the stream ended without a finish_reason")
        s.ttft_s, s.itl_s = ttft, itl
        return "".join(parts)

    # ---- controls ------------------------------------------------------------
    async def _restart(self, ev: Restart) -> None:
        kind = "crash" if ev.crash else "graceful"
        if self.server is None:
            self.marks.append(Mark(self.now(), kind, "skipped (no --server-cmd)"))
            return
        async with self._restarting:  # one at a time: a restart never kills a server still starting
            t = self.now()
            status = await self.server.stop(crash=ev.crash)
            await anyio.sleep(ev.down_s * self.scale)
            await self.server.start()
            self.marks.append(Mark(t, kind, f"exit status {status}, back after {self.now() - t:.1f} s"))

    async def _flush(self, client: httpx.AsyncClient) -> None:
        t = self.now()
        note = ""
        for attempt in range(3):  # a pooled connection may be stale after a restart
            try:
                r = await client.post(self.url + "/admin/cache/flush", json={})
            except httpx.HTTPError as exc:
                note = f"{type(exc).__name__}"
                await anyio.sleep(0.5 * (attempt + 1))
                continue
            note = f"HTTP {r.status_code}"
            if r.status_code == 200:
                try:
                    note += f", durable={r.json().get('durable')}"
                except ValueError:
                    pass
            break
        self.marks.append(Mark(t, "flush", note))


class _Retryable(Exception):
    pass


class _Fatal(Exception):
    pass


def _tokenizer(spec: str | None) -> Callable[[str], list[int]] | None:
    if spec is None:
        return None
    if spec == "bytes":
        return lambda text: list(text.encode())
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(spec)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sims.live.replay", description="Replay a trace against a live OpenAI-compatible server."
    )
    ap.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000 (default with --server-cmd: a free port)")
    ap.add_argument("--trace", required=True, help="an NDJSON trace file, or a bundled trace name (agent-small, ...)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (0.1: ten times faster)")
    ap.add_argument("--max-requests", type=int, help="replay only the first N requests")
    ap.add_argument("--model", help="the model name to send (default: the server's first /v1/models entry)")
    ap.add_argument(
        "--tokenizer", help="'bytes' (fake GPU) or a tokenizer.json: needed when token-id prompts continue a session"
    )
    ap.add_argument(
        "--retry-window-s",
        type=float,
        default=60.0,
        help="keep retrying a request after a connection error, 429 or 503 this long",
    )
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--server-cmd", help="start the server with this command ({port} is substituted) and carry out restarts"
    )
    ap.add_argument("--out", default="replay-out", help="folder for report.md, ttft.png and samples.ndjson")
    args = ap.parse_args(argv)
    if args.time_scale <= 0:
        ap.error("--time-scale must be > 0")
    trace = tr.read(args.trace) if os.path.exists(args.trace) else tr.bundled(args.trace)
    if args.max_requests is not None:
        trace = _truncate(trace, args.max_requests)
    url = args.url
    server = None
    if args.server_cmd:
        port = free_port()
        url = url or f"http://127.0.0.1:{port}"
        os.makedirs(args.out, exist_ok=True)
        server = ServerProcess(
            args.server_cmd.replace("{port}", str(port)), url, log_path=os.path.join(args.out, "server.log")
        )
    if not url:
        ap.error("--url is required without --server-cmd")
    replayer = Replayer(
        url,
        trace,
        time_scale=args.time_scale,
        model=args.model,
        encode=_tokenizer(args.tokenizer),
        retry_window_s=args.retry_window_s,
        request_timeout_s=args.request_timeout_s,
        server=server,
        progress=True,
    )
    anyio.run(replayer.run)
    samples = sorted(replayer.samples.values(), key=lambda s: s.id)
    os.makedirs(args.out, exist_ok=True)
    png = (
        "ttft.png"
        if plot(samples, replayer.marks, os.path.join(args.out, "ttft.png"), f"TTFT, {trace.header.kind} trace, {url}")
        else None
    )
    text = report_markdown(url, trace, args.time_scale, samples, replayer.marks, png)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "samples.ndjson"), "w") as f:
        for s in samples:
            f.write(json.dumps(asdict(s)) + "\n")
    print(text, end="")
    print(f"(written to {args.out}/report.md, {png + ', ' if png else ''}samples.ndjson)")
    return 0 if all(s.ok for s in samples) else 1


def _truncate(trace: Trace, n: int) -> Trace:
    keep = {r.id for r in trace.requests[:n]}
    last_t = max((r.t for r in trace.requests if r.id in keep), default=0.0)
    events = [e for e in trace.events if (e.id in keep if isinstance(e, Request) else e.t <= last_t)]
    return tr.validate(trace.header, events)


if __name__ == "__main__":
    raise SystemExit(main())
