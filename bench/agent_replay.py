"""A captured Claude Code session replayed turn by turn against Ember and ``mlx_lm.server``.

    python -m bench.agent_replay --model smollm2-135m [--rounds N] [--tokens 64] [--restart-after K]

The session is ``bench/fixtures/claude_code_read_session.json.xz``: 12 real
request bodies of Claude Code 2.1.332 run headless with ``--tools Read`` (its
system prompt and the one Read tool; ~2.5k to ~5.8k tokens on SmolLM2's
tokenizer, inside its 8k context with room for the answer), reading
``f0.txt`` … ``f10.txt`` one per turn. It was recorded through
``tools/record_proxy.py`` in front of ``ember serve --model scripted:SCRIPT``
(the scripted model issues each Read; the fixture keeps the script, see
bench/fixtures/README.md). Every turn's body is the previous one plus the
previous tool call and its result: what an agent sends.

Ember gets each body as recorded on ``POST /v1/messages`` (only ``model`` set to
the served name, ``max_tokens`` to ``--tokens``, ``temperature`` 0, streamed).
``mlx_lm.server`` has no Anthropic route: each body is converted by
:func:`to_chat` to the equivalent ``/v1/chat/completions`` request (system +
messages + tools in OpenAI's shape), with mlx_lm.server's own prompt cache on
(its default). SmolLM2's chat template has no tool support, so mlx_lm.server
renders that request *without* the tool definitions (it logs a warning and
goes on); Ember renders tools on any model (its generic Hermes format), so its
prompts are longer: the report gives each server's own prompt tokens.

Per turn: prompt tokens, cached tokens (Ember: ``cache_read_input_tokens``;
mlx_lm.server: ``prompt_tokens_details.cached_tokens``, "—" if absent), TTFT
(request sent to first streamed text or tool-call byte, or the end if none),
the cache share (cached / prompt), and the TTFT ratio Ember/mlx-lm. Rounds
alternate which server goes first; each round starts fresh servers.
``--restart-after K`` restarts both servers after turn K (Ember with
``--ssd-cache DIR``, so its first turn after the restart reads the SSD tier;
mlx_lm.server keeps nothing across a restart).
"""

from __future__ import annotations

import argparse
import datetime
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

FIXTURE = Path(__file__).parent / "fixtures" / "claude_code_read_session.json.xz"
WHO = ("ember", "mlx-lm")


def load_session(path: Path = FIXTURE) -> dict[str, Any]:
    return json.loads(lzma.decompress(path.read_bytes()))


# ---------------------------------------------------------------------------
# Anthropic Messages body -> OpenAI chat-completions body


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type") == "text")


def to_chat(body: dict[str, Any], model: str, max_tokens: int) -> dict[str, Any]:
    """The chat-completions request equivalent to a Messages body.

    ``system`` (a string or text blocks) becomes the first system message; a
    ``system`` message mid-conversation stays a system message in place; a user
    turn's ``tool_result`` blocks become ``tool`` messages (in order, before the
    turn's text); an assistant turn's ``tool_use`` blocks become ``tool_calls``
    (``thinking`` blocks are dropped); tools become ``function`` tools with their
    ``input_schema`` as ``parameters``. Cache-control markers and Anthropic-only
    fields (``thinking``, ``metadata``, ``context_management``, …) have no
    counterpart and are left out.
    """
    messages: list[dict[str, Any]] = []
    system = _text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for m in body.get("messages", []):
        role, content = m["role"], m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": _text(blocks)}
            calls = [
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})},
                }
                for b in blocks
                if b.get("type") == "tool_use"
            ]
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
            continue
        for b in blocks:
            if b.get("type") == "tool_result":
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _text(b.get("content"))})
        text = _text([b for b in blocks if b.get("type") == "text"])
        if text:
            messages.append({"role": "system" if role == "system" else "user", "content": text})
    out: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object"},
            },
        }
        for t in body.get("tools") or []
        if "name" in t
    ]
    if tools:
        out["tools"] = tools
    return out


def to_ember(body: dict[str, Any], model: str, max_tokens: int) -> dict[str, Any]:
    """The recorded body with only the served model name, ``max_tokens``, temperature 0 and streaming set."""
    return {**body, "model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}


# ---------------------------------------------------------------------------
# One turn on each server


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int | None  # None: the server did not report it
    ttft_s: float


def ember_turn(client: httpx.Client, url: str, body: dict[str, Any], beta: str = "") -> Turn:
    headers = {"x-api-key": "dummy", "anthropic-version": "2023-06-01"}
    if beta:
        headers["anthropic-beta"] = beta
    usage: dict[str, int] = {}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/messages", json=body, headers=headers, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"ember: HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "message_start":
                usage.update(event["message"].get("usage") or {})
            elif kind == "content_block_delta" and first is None:
                first = time.perf_counter()
            elif kind == "message_delta":
                usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
    end = time.perf_counter()
    cached = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
    return Turn(prompt, cached, (first or end) - t0)


def chat_turn(client: httpx.Client, url: str, body: dict[str, Any]) -> Turn:
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"mlx-lm: HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line[6:] == "[DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if first is None and (delta.get("content") or delta.get("tool_calls")):
                first = time.perf_counter()
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Turn(int(usage.get("prompt_tokens") or 0), None if cached is None else int(cached), (first or end) - t0)


# ---------------------------------------------------------------------------
# The report


def _median(xs: list[float]) -> float | None:
    s = sorted(xs)
    if not s:
        return None
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _share(t: Turn) -> str:
    if t.cached_tokens is None:
        return "—"
    return f"{100 * t.cached_tokens / t.prompt_tokens:.1f}%" if t.prompt_tokens else "0.0%"


def _cached(t: Turn) -> str:
    return "—" if t.cached_tokens is None else str(t.cached_tokens)


def report(rounds: list[dict[str, list[Turn]]], header: list[str], restart_after: int | None = None) -> str:
    """Markdown: per turn (medians over rounds for TTFT; the last round's token counts), totals and medians."""
    n = min(len(r[w]) for r in rounds for w in WHO)
    lines = [*header, ""]
    lines.append(
        "| turn | Ember prompt | Ember cached | Ember share | Ember TTFT ms "
        "| mlx-lm prompt | mlx-lm cached | mlx-lm share | mlx-lm TTFT ms | TTFT Ember/mlx-lm |"
    )
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ttft: dict[str, list[float]] = {w: [] for w in WHO}
    ratios: list[float] = []
    for i in range(n):
        last = {w: rounds[-1][w][i] for w in WHO}
        med = {w: _median([r[w][i].ttft_s * 1000 for r in rounds]) or 0.0 for w in WHO}
        for w in WHO:
            ttft[w].append(med[w])
        ratio = med["ember"] / med["mlx-lm"] if med["mlx-lm"] else None
        if ratio is not None:
            ratios.append(ratio)
        mark = " (after restart)" if restart_after is not None and i == restart_after else ""
        e, m = last["ember"], last["mlx-lm"]
        lines.append(
            f"| {i + 1}{mark} | {e.prompt_tokens} | {_cached(e)} | {_share(e)} | {med['ember']:.0f} "
            f"| {m.prompt_tokens} | {_cached(m)} | {_share(m)} | {med['mlx-lm']:.0f} "
            f"| {'—' if ratio is None else f'{ratio:.2f}'} |"
        )
    tot = {w: [rounds[-1][w][i] for i in range(n)] for w in WHO}

    def total_share(w: str) -> str:
        ts = tot[w]
        if any(t.cached_tokens is None for t in ts):
            return "—"
        p = sum(t.prompt_tokens for t in ts)
        return f"{100 * sum(t.cached_tokens or 0 for t in ts) / p:.1f}%" if p else "0.0%"

    def total_cached(w: str) -> str:
        ts = tot[w]
        return "—" if any(t.cached_tokens is None for t in ts) else str(sum(t.cached_tokens or 0 for t in ts))

    sums = {w: sum(ttft[w]) for w in WHO}
    lines.append(
        f"| **total** | {sum(t.prompt_tokens for t in tot['ember'])} | {total_cached('ember')} "
        f"| {total_share('ember')} | {sums['ember']:.0f} "
        f"| {sum(t.prompt_tokens for t in tot['mlx-lm'])} | {total_cached('mlx-lm')} "
        f"| {total_share('mlx-lm')} | {sums['mlx-lm']:.0f} "
        f"| {sums['ember'] / sums['mlx-lm']:.2f} |"
        if sums["mlx-lm"]
        else "| **total** | | | | | | | | | — |"
    )
    later = {w: ttft[w][1:] for w in WHO}
    med_later = {w: _median(later[w]) for w in WHO}
    lines.append("")
    lines.append(
        f"Median TTFT over turns 2–{n}: Ember {med_later['ember'] or 0:.0f} ms, "
        f"mlx-lm {med_later['mlx-lm'] or 0:.0f} ms; median per-turn ratio Ember/mlx-lm "
        f"{_median(ratios) or 0:.2f} (below 1: Ember faster)."
    )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# The run


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> tuple[list[dict[str, list[Turn]]], list[float]]:
    from bench.serve.vs_mlx_lm import Server, free_port
    from engine.models import resolve_model

    model_dir = resolve_model(args.model)
    name = str(model_dir)
    turns = load_session()["turns"]
    if args.turns:
        turns = turns[: args.turns]
    work = Path(tempfile.mkdtemp(prefix="ember-agent-replay-"))
    loads = [os.getloadavg()[0]]
    rounds: list[dict[str, list[Turn]]] = []
    try:
        for rnd in range(args.rounds):
            ssd = work / f"ssd-{rnd}"
            ember = Server(
                "ember",
                [sys.executable, "-m", "transport.cli", "serve", "--model", name, "--port", str(p := free_port())]
                + ["--ssd-cache", str(ssd)],
                p,
                work / "ember.log",
            )
            mlxlm = Server(
                "mlx-lm",
                [sys.executable, "-m", "mlx_lm.server", "--model", name, "--port", str(p := free_port())],
                p,
                work / "mlx-lm.log",
            )
            servers = {"ember": ember, "mlx-lm": mlxlm}
            order = list(WHO) if rnd % 2 == 0 else list(reversed(WHO))
            for w in order:
                progress(f"round {rnd + 1}: starting {w}")
                servers[w].start()
            got: dict[str, list[Turn]] = {w: [] for w in WHO}
            try:
                with httpx.Client() as client:
                    for i, turn in enumerate(turns):
                        if args.restart_after is not None and i == args.restart_after:
                            for w in order:
                                progress(f"round {rnd + 1}: restarting {w}")
                                servers[w].stop()
                                servers[w].start()
                        for w in order:
                            if w == "ember":
                                t = ember_turn(
                                    client,
                                    ember.url,
                                    to_ember(turn["body"], name, args.tokens),
                                    turn.get("anthropic-beta", ""),
                                )
                            else:
                                t = chat_turn(client, mlxlm.url, to_chat(turn["body"], name, args.tokens))
                            got[w].append(t)
                            progress(
                                f"round {rnd + 1} turn {i + 1} {w}: prompt {t.prompt_tokens} "
                                f"cached {_cached(t)} ttft {t.ttft_s * 1000:.0f} ms"
                            )
            finally:
                for s in servers.values():
                    s.stop()
            rounds.append(got)
            loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rounds, loads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of every turn")
    ap.add_argument("--turns", type=int, default=0, help="replay only the first N turns (0: all)")
    ap.add_argument("--restart-after", type=int, default=None, help="restart both servers after turn K")
    ap.add_argument("--out", default="", help="also write the report there (markdown)")
    args = ap.parse_args(argv)
    cmd = "python -m bench.agent_replay " + " ".join(argv if argv is not None else sys.argv[1:])
    rounds, loads = run(args)
    header = [
        f"Command: `{cmd.strip()}`",
        f"Commit: {_commit()}; date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}; "
        f"host: {os.cpu_count()} CPUs; 1-minute load at the start of each round and at the end: "
        + ", ".join(f"{x:.2f}" for x in loads),
        f"Session: {FIXTURE.name} (Claude Code 2.1.332, --tools Read), {len(rounds[0]['ember'])} turns, "
        f"max_tokens {args.tokens}, temperature 0, {args.rounds} round(s); TTFT is the median over rounds, "
        "token counts are the last round's.",
        "mlx_lm.server gets the chat-completions equivalent of each body (bench/agent_replay.py:to_chat); "
        "SmolLM2's template has no tool support, so it renders without the tool definitions; Ember renders "
        "them (generic Hermes format): each server's own prompt tokens are shown.",
    ]
    text = report(rounds, header, args.restart_after)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
