"""A chat model, its drafter and an embedding model loaded together under
``--max-memory`` (issue #41), measured.

    python -m bench.memory [--model qwen2.5-coder-1.5b] [--draft-model qwen2.5-coder-0.5b|none]
        [--embed all-minilm-l6-v2] [--max-memory 6] [--tokens 8] [--out FILE]

One ``ember serve --model M [--draft-model D] --max-memory G --no-ssd-cache`` (a
subprocess on a free port), which loads M and its drafter as it starts (step 0),
then, one request at a time: a streamed greedy chat completion to M, one
``/v1/embeddings`` request to E (which loads E on demand), one more chat
completion to M. After each step:
the server's RSS and peak RSS (``/proc/PID/status`` VmRSS and VmHWM, its child
processes added), the registry's own accounting from ``/stats`` (its
``max_memory_bytes``, the bytes it counts per loaded model, its evictions) and
which models are loaded.

Met when every model is still loaded at the end, M with its drafter (none was
unloaded to make room: no memory eviction, M and E loaded once each) and the
peak RSS is within the budget. A Markdown table and the verdict on stdout
(and in ``--out``); exit status 1 when not met. A step whose request or
``/stats`` fails is a row with the error: once the registry has unloaded
--model itself to make room, the server answers 503 to both
(``transport/server/http.py``'s ``require_engine`` wants the default loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.serve.vs_mlx_lm import Server, free_port

GIB = 1 << 30


@dataclass
class Step:
    name: str
    error: str | None = None
    loaded: dict[str, int | None] = field(default_factory=dict)  # model -> bytes the registry counts for it
    loads: dict[str, int] = field(default_factory=dict)  # model -> times loaded so far
    drafter: str | None = None  # M's drafter, as its engine reports it
    registry_bytes: int | None = None
    rss: int = 0
    peak_rss: int = 0
    evictions: int = 0  # the registry's unloads to make room


def _status_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of one process, in bytes; {} once it is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from each process's parent in /proc/*/stat)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def process_memory(pid: int) -> tuple[int, int]:
    """(RSS, peak RSS) of ``pid`` and its children. The peak is the sum of each
    one's own peak: an upper bound, since their peaks need not coincide."""
    rss = peak = 0
    for p in [pid, *_children(pid)]:
        st = _status_kb(p)
        rss += st.get("VmRSS", 0)
        peak += st.get("VmHWM", 0)
    return rss, peak


async def _nothing() -> None:
    return None


async def chat(client: httpx.AsyncClient, model: str, prompt: str, tokens: int) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for _ in r.aiter_lines():
            pass


async def embed(client: httpx.AsyncClient, model: str, text: str) -> None:
    r = await client.post("/v1/embeddings", json={"model": model, "input": [text]}, timeout=900)
    if r.status_code != 200:
        raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")


def observe(step: Step, stats: dict[str, Any], pid: int, model: str) -> Step:
    reg = stats.get("registry") or {}
    step.registry_bytes = reg.get("memory_bytes")
    step.evictions = int((reg.get("evictions") or {}).get("memory", 0))
    for name, m in (stats.get("models") or {}).items():
        card = m.get("registry") or {}
        step.loads[name] = int(card.get("loads") or 0)
        if card.get("state") == "loaded":
            step.loaded[name] = card.get("memory_bytes")
    step.drafter = ((stats.get("models") or {}).get(model, {}).get("speculation") or {}).get("drafter")
    step.rss, step.peak_rss = process_memory(pid)
    return step


def verdict(steps: list[Step], model: str, draft: str | None, embed_model: str, budget: int) -> tuple[bool, str]:
    """Met: no step failed, M (with its drafter) and E loaded at the end, each
    loaded once (nothing unloaded to make room), and peak RSS within the budget."""
    why = [f"step {s.name!r} failed: {s.error}" for s in steps if s.error]
    last = steps[-1]
    for m in (model, embed_model):
        if m not in last.loaded:
            why.append(f"{m} is not loaded at the end")
        elif last.loads.get(m, 0) > 1:
            why.append(f"{m} was loaded {last.loads[m]} times (unloaded in between)")
    if draft and last.drafter is None:
        why.append(f"{model} has no drafter at the end (asked for {draft})")
    if last.evictions:
        why.append(f"the registry unloaded {last.evictions} model(s) to make room")
    peak = max(s.peak_rss for s in steps)
    if peak > budget:
        why.append(f"peak RSS {peak / GIB:.3f} GiB > budget {budget / GIB:.3f} GiB")
    if why:
        return False, "NOT MET: " + "; ".join(why)
    return (
        True,
        f"MET: every model loaded at the end, none unloaded; peak RSS {peak / GIB:.3f} GiB <= {budget / GIB:.3f} GiB",
    )


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def table(steps: list[Step], model: str, budget: int) -> str:
    rows = [
        "| step | models loaded (registry's bytes, GiB) | registry's used GiB | RSS GiB | peak RSS GiB | budget GiB |",
        "|---|---|---|---|---|---|",
    ]
    for s in steps:
        models = ", ".join(
            f"`{n}`{f' + draft `{s.drafter}`' if n == model and s.drafter else ''} ({gib(b)})"
            for n, b in s.loaded.items()
        )
        if s.error:
            models += f" **error**: {s.error[:120]}"
        rows.append(
            f"| {s.name} | {models or '-'} | {gib(s.registry_bytes)} | {gib(s.rss)} | {gib(s.peak_rss)} | {gib(budget)} |"
        )
    return "\n".join(rows)


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


async def run(args: argparse.Namespace) -> tuple[bool, str]:
    draft = None if args.draft_model in ("", "none") else args.draft_model
    budget = int(args.max_memory * GIB)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "transport.cli", "serve", "--model", args.model, "--port", str(port)]
        argv += ["--host", "127.0.0.1", "--max-memory", f"{args.max_memory:g}", "--no-ssd-cache"]
        argv += ["--draft-model", draft] if draft else []
        log = Path(tmp) / "ember.log"
        server = Server("ember", argv, port, log)
        load0 = os.getloadavg()[0]
        start_s = server.start(timeout_s=args.start_timeout)
        assert server.proc is not None
        pid = server.proc.pid
        steps: list[Step] = []
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=900) as client:
                plan = [
                    ("0. started, no request yet", _nothing),  # the server loads --model (and its drafter) at start
                    (f"1. chat `{args.model}`", lambda: chat(client, args.model, "Say hello.", args.tokens)),
                    (f"2. embed `{args.embed}`", lambda: embed(client, args.embed, "a short note about rivers")),
                    (f"3. chat `{args.model}`", lambda: chat(client, args.model, "Name a color.", args.tokens)),
                ]
                for name, call in plan:
                    step = Step(name)
                    t0 = time.perf_counter()
                    try:
                        await call()
                    except (RuntimeError, httpx.HTTPError) as exc:
                        step.error = str(exc) or type(exc).__name__
                    step.name += f" ({time.perf_counter() - t0:.1f} s)"
                    r = await client.get("/stats")
                    if r.status_code != 200:  # (it answers 503 once --model itself was unloaded)
                        why = f"/stats: HTTP {r.status_code}: {r.text[:200]}"
                        step.error = f"{step.error}; {why}" if step.error else why
                    steps.append(observe(step, r.json() if r.status_code == 200 else {}, pid, args.model))
        finally:
            rc = server.stop()
            if rc not in (0, None):
                print(f"ember serve exited {rc}: {log.read_text()[-2000:]}", file=sys.stderr)
    ok, why = verdict(steps, args.model, draft, args.embed, budget)
    cmd = " ".join(argv[4:]).replace(f"--port {port}", "--port P")
    report = (
        f"`ember serve {cmd}` at commit `{commit()}` (started in {start_s:.1f} s); {os.cpu_count()} CPUs, "
        f"load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end. One request at a time; RSS and "
        "peak RSS from /proc/PID/status (VmRSS, VmHWM, children added); the registry's bytes from /stats "
        f"(weights, a drafter's included, KV, RAM tier).{f' Drafter: `{draft}`.' if draft else ''}\n\n"
        f"{table(steps, args.model, budget)}\n\n**Verdict:** {why}\n"
    )
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return ok, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="the chat model (the server's --model)")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b", help="its draft model; 'none' for no drafter")
    ap.add_argument("--embed", default="all-minilm-l6-v2", help="the embedding model, loaded on demand")
    ap.add_argument("--max-memory", type=float, default=6.0, metavar="GIB", help="the server's --max-memory")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per chat completion")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args(argv)
    if not args.max_memory > 0:
        ap.error("--max-memory must be a positive number of GiB")
    ok, _ = asyncio.run(run(args))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
