"""Two agent-session cache figures on a real ``ember serve`` (SmolLM2 by default).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python -m bench.cache.recovery --model smollm2-135m --markdown

1. **Restart** (``--part restart``): a session (a ~1.5k-token system prompt of
   code, then short user turns) runs ``--turns`` turns against
   ``ember serve --ssd-cache DIR``, ``--gap`` seconds apart (the agent's tool
   time); the next turn is sent and, ``--kill-after`` seconds later (mid
   request), the server is killed with SIGKILL — or, for the baseline, stopped
   with SIGTERM (which flushes). A new server on the same DIR gets the
   interrupted turn again: *recovered* is its ``cached_tokens`` over its
   ``prompt_tokens``, and where the prompt left what the SSD held is the
   turn's ``cache_miss`` report (docs/agent-api.md).
2. **Burst** (``--part burst``): ``--burst`` concurrent requests (subagents)
   share a cold ``--prefix-tokens`` prefix and differ after it. Does the
   prefix prefill once or once per request? The figure is the Scheduler's
   ``prefilled_tokens`` counter (``/stats``) over the burst, and its wall time;
   the answers (greedy) are printed as a digest, so two runs (e.g. with and
   without ``--no-shared-prefill``) can be checked for identical outputs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from sims.live.server import read_url, serve_command, stop

ROOT = Path(__file__).resolve().parents[2]


def _code(chars: int, skip: int = 0) -> str:
    """Deterministic text of about ``chars`` characters: this repository's own code."""
    text = ""
    for p in sorted((ROOT / "engine").rglob("*.py")):
        text += p.read_text()
        if len(text) > skip + chars:
            break
    return text[skip : skip + chars]


class Server:
    def __init__(self, model: str, ssd: str | None, extra: list[str], log: Path):
        flags = ["--model", model, "--host", "127.0.0.1"]
        flags += ["--ssd-cache", ssd] if ssd else ["--no-ssd-cache"]
        self.err = log.open("a")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        argv = serve_command(*flags, *extra, log_level="info")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env, cwd=ROOT)
        url = read_url(self.proc, 600)
        if url is None:
            self.proc.kill()
            raise RuntimeError(f"ember serve did not start; see {log}")
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=600)
        self.model = model

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        r = self.http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()

    def stats(self) -> dict[str, Any]:
        return self.http.get("/stats").json()

    def end(self, how: str) -> None:
        self.http.close()
        if how == "kill":
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        else:
            stop(self.proc, grace_s=300)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.err.close()


def _session(system_chars: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a coding agent. The repository:\n" + _code(system_chars)}]


def restart_once(args: argparse.Namespace, how: str, gap: float, work: Path) -> dict[str, Any]:
    """One session, one SIGKILL (or SIGTERM) mid-turn, one restart; the
    restarted turn's usage."""
    ssd = tempfile.mkdtemp(dir=work, prefix=f"ssd-{how}-")
    log = work / "serve.log"
    srv = Server(args.model, ssd, [], log)
    messages = _session(args.system_chars)
    for i in range(args.turns):
        messages.append({"role": "user", "content": f"Turn {i}: what does the function on line {10 * i + 3} do?"})
        out = srv.chat(messages, args.max_tokens)
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""})
        time.sleep(gap)
    messages.append({"role": "user", "content": f"Turn {args.turns}: and the one after it?"})
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pending = pool.submit(srv.chat, messages, args.max_tokens)  # interrupted: its answer never comes
    time.sleep(args.kill_after)
    srv.end(how)
    try:
        pending.result(timeout=30)
    except Exception:  # the connection died with the server, as it should
        pass
    pool.shutdown()
    srv = Server(args.model, ssd, [], log)
    out = srv.chat(messages, args.max_tokens)
    srv.end("term")
    usage = out["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {
        "stop": "SIGKILL" if how == "kill" else "SIGTERM",
        "gap_s": gap,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens", 0),
        "miss": details.get("cache_miss"),
    }


def burst(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    extra = ["--no-shared-prefill"] if args.no_shared_prefill else []
    srv = Server(args.model, None, extra, work / "serve.log")
    # the prefix: about prefix_tokens (SmolLM2: ~3.3 characters of code a token)
    head = _session(int(args.prefix_tokens * 3.3))
    asks = [head + [{"role": "user", "content": f"Subagent {i}: find the bug in part {i}."}] for i in range(args.burst)]
    before = srv.stats()["scheduler"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.burst) as pool:
        outs = list(pool.map(lambda m: srv.chat(m, args.max_tokens), asks))
    wall = time.perf_counter() - t0
    after = srv.stats()["scheduler"]
    srv.end("term")
    texts = [o["choices"][0]["message"]["content"] for o in outs]
    prompts = [o["usage"]["prompt_tokens"] for o in outs]
    return {
        "burst": args.burst,
        "prompt_tokens": prompts,
        "cached_tokens": [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs],
        "prefilled_tokens": after["prefilled_tokens"] - before["prefilled_tokens"],
        "wall_s": round(wall, 2),
        "shared_prefill": not args.no_shared_prefill,
        "answers_sha256": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--part", choices=["restart", "burst", "both"], default="both")
    ap.add_argument("--turns", type=int, default=3, help="turns finished before the kill")
    ap.add_argument("--gaps", default="0.2,3", help="seconds between turns (tool time), one session each")
    ap.add_argument("--kill-after", type=float, default=0.5, help="seconds into the next turn")
    ap.add_argument("--system-chars", type=int, default=5000)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--burst", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--no-shared-prefill", action="store_true", help="burst: every request prefills on its own")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ember-recovery-") as tmp:
        work = Path(tmp)
        rows: list[dict[str, Any]] = []
        if args.part in ("restart", "both"):
            for gap in (float(g) for g in args.gaps.split(",")):
                rows.append(restart_once(args, "kill", gap, work))
            rows.append(restart_once(args, "term", float(args.gaps.split(",")[0]), work))
        b = burst(args, work) if args.part in ("burst", "both") else None
        if args.markdown:
            _markdown(args, rows, b)
        else:
            for r in rows:
                print(json.dumps(r))
            if b is not None:
                print(json.dumps(b))
    return 0


def _markdown(args: argparse.Namespace, rows: list[dict[str, Any]], b: dict[str, Any] | None) -> None:
    if rows:
        print(f"`{args.model}`, {args.turns} turns, stopped {args.kill_after} s into turn {args.turns + 1}\n")
        print("| stop | gap between turns | recovered / prompt | where the restarted turn left the SSD |")
        print("|---|---|---|---|")
        for r in rows:
            m = r["miss"]
            where = f"token {m['diverged_at']}, message {m['message_index']} ({m['message_role']})" if m else "—"
            share = r["cached_tokens"] / r["prompt_tokens"]
            print(
                f"| {r['stop']} | {r['gap_s']} s | {r['cached_tokens']} / {r['prompt_tokens']} ({share:.0%}) | {where} |"
            )
    if b is not None:
        print(f"\n`{args.model}`, {b['burst']} concurrent requests sharing a cold ~{args.prefix_tokens}-token prefix\n")
        print("| shared prefill | prompt tokens (each) | prefilled tokens (all) | cached (each) | wall | answers |")
        print("|---|---|---|---|---|---|")
        print(
            f"| {'on' if b['shared_prefill'] else 'off'} | {b['prompt_tokens'][0]} | {b['prefilled_tokens']} "
            f"| {', '.join(map(str, b['cached_tokens']))} | {b['wall_s']} s | `{b['answers_sha256']}` |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
