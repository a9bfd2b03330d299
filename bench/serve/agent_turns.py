"""Prompt-cache hits across the turns of a tool-using agent session, through
each of Ember's three chat APIs, streaming and not.

    python -m bench.serve.agent_turns [--model tiny] [--turns 20] [--json out.json]

Starts ``ember serve`` on 127.0.0.1 (a free port), then replays one session per
(API, mode): odd turns force a tool call (``tool_choice`` required, one call),
the client appends the call and its result; even turns let the model answer in
text, and the client appends the answer and a new question — what an agent
loop sends. Each session opens with its own system prompt, so sessions do not
share a prefix beyond the template's first tokens.

Per turn it reports ``cached_tokens / prompt_tokens`` and the tokens the cache
missed of what the previous turn sent and received
(``prev_prompt + prev_completion - cached``): the target is a small constant
(the template's turn-boundary tokens). Needs the grammar engine (forced calls).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ANSWER_TOKENS = 12
CALL_TOKENS = 60


# ---------------------------------------------------------------------------
# The session, API-neutral: ("user", text) ("call", id, name, args) ("result", id, text) ("assistant", text)


def question(k: int) -> str:
    return f"What is the weather in city number {k} this week?"


def to_chat(system: str, history: list[tuple]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for h in history:
        if h[0] == "user":
            out.append({"role": "user", "content": h[1]})
        elif h[0] == "call":
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": h[1], "type": "function", "function": {"name": h[2], "arguments": h[3]}}],
                }
            )
        elif h[0] == "result":
            out.append({"role": "tool", "tool_call_id": h[1], "content": h[2]})
        else:
            out.append({"role": "assistant", "content": h[1]})
    return out


def to_anthropic(history: list[tuple]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for h in history:
        if h[0] == "user":
            out.append({"role": "user", "content": h[1]})
        elif h[0] == "call":
            out.append(
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": h[1], "name": h[2], "input": json.loads(h[3])}],
                }
            )
        elif h[0] == "result":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": h[1], "content": h[2]}]})
        else:
            out.append({"role": "assistant", "content": [{"type": "text", "text": h[1]}]})
    return out


def to_responses(history: list[tuple]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for h in history:
        if h[0] == "user":
            out.append({"role": "user", "content": h[1]})
        elif h[0] == "call":
            out.append({"type": "function_call", "call_id": h[1], "name": h[2], "arguments": h[3]})
        elif h[0] == "result":
            out.append({"type": "function_call_output", "call_id": h[1], "output": h[2]})
        else:
            out.append({"role": "assistant", "content": [{"type": "output_text", "text": h[1]}]})
    return out


# ---------------------------------------------------------------------------
# One request per API: (text, [(id, name, args)], prompt_tokens, cached_tokens, completion_tokens)


def sse(r: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def chat_turn(client: httpx.Client, system: str, history: list[tuple], force: bool, stream: bool) -> tuple:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    body = {
        "messages": to_chat(system, history),
        "tools": tools,
        "parallel_tool_calls": False,
        "tool_choice": "required" if force else "auto",
        "max_tokens": CALL_TOKENS if force else ANSWER_TOKENS,
    }
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        j = r.json()
        m, u = j["choices"][0]["message"], j["usage"]
        calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        return (
            m["content"] or "",
            calls,
            u["prompt_tokens"],
            u["prompt_tokens_details"]["cached_tokens"],
            u["completion_tokens"],
        )
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, calls, u = "", {}, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for chunk in sse(r):
            if chunk.get("usage"):
                u = chunk["usage"]
            for ch in chunk["choices"]:
                text += ch["delta"].get("content") or ""
                for tc in ch["delta"].get("tool_calls") or []:
                    c = calls.setdefault(tc["index"], ["", "", ""])
                    c[0] = tc.get("id") or c[0]
                    c[1] = tc["function"].get("name") or c[1]
                    c[2] += tc["function"].get("arguments") or ""
    return (
        text,
        [tuple(c) for c in calls.values()],
        u["prompt_tokens"],
        u["prompt_tokens_details"]["cached_tokens"],
        u["completion_tokens"],
    )


def anthropic_turn(client: httpx.Client, system: str, history: list[tuple], force: bool, stream: bool) -> tuple:
    body = {
        "model": "tiny",
        "system": system,
        "messages": to_anthropic(history),
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True} if force else {"type": "auto"},
        "max_tokens": CALL_TOKENS if force else ANSWER_TOKENS,
    }
    if not stream:
        r = client.post("/v1/messages", json=body)
        r.raise_for_status()
        j = r.json()
        blocks, u = j["content"], j["usage"]
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        calls = [(b["id"], b["name"], json.dumps(b["input"])) for b in blocks if b["type"] == "tool_use"]
    else:
        text, calls, u = "", [], {}
        with client.stream("POST", "/v1/messages", json=body | {"stream": True}) as r:
            for e in sse(r):
                if e["type"] == "message_start":
                    u = e["message"]["usage"]
                elif e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
                    calls.append([e["content_block"]["id"], e["content_block"]["name"], ""])
                elif e["type"] == "content_block_delta":
                    d = e["delta"]
                    if d["type"] == "text_delta":
                        text += d["text"]
                    else:
                        calls[-1][2] += d["partial_json"]
                elif e["type"] == "message_delta":
                    u = {**u, **e["usage"]}
        # what the SDK does: partial_json is parsed into the block's input object
        calls = [(c[0], c[1], json.dumps(json.loads(c[2]))) for c in calls]
    prompt = u["input_tokens"] + u["cache_read_input_tokens"]
    return text, calls, prompt, u["cache_read_input_tokens"], u["output_tokens"]


def responses_turn(client: httpx.Client, system: str, history: list[tuple], force: bool, stream: bool) -> tuple:
    body = {
        "model": "tiny",
        "instructions": system,
        "input": to_responses(history),
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "parallel_tool_calls": False,
        "tool_choice": "required" if force else "auto",
        "max_output_tokens": CALL_TOKENS if force else ANSWER_TOKENS,
    }
    if not stream:
        r = client.post("/v1/responses", json=body)
        r.raise_for_status()
        resp = r.json()
    else:
        resp = None
        with client.stream("POST", "/v1/responses", json=body | {"stream": True}) as r:
            for e in sse(r):
                if e["type"] in ("response.completed", "response.incomplete"):
                    resp = e["response"]
    text = "".join(p["text"] for o in resp["output"] if o["type"] == "message" for p in o["content"])
    calls = [(o["call_id"], o["name"], o["arguments"]) for o in resp["output"] if o["type"] == "function_call"]
    u = resp["usage"]
    return text, calls, u["input_tokens"], u["input_tokens_details"]["cached_tokens"], u["output_tokens"]


APIS = {"chat": chat_turn, "anthropic": anthropic_turn, "responses": responses_turn}


def session(client: httpx.Client, api: str, stream: bool, turns: int) -> list[dict[str, Any]]:
    system = f"Session {api}-{'stream' if stream else 'plain'}: you are a weather agent."
    history: list[tuple] = [("user", question(1))]
    rows, prev = [], None
    for turn in range(1, turns + 1):
        force = turn % 2 == 1
        text, calls, prompt, cached, completion = APIS[api](client, system, history, force, stream)
        if force:
            if len(calls) != 1:
                raise RuntimeError(f"{api} turn {turn}: a forced turn returned {len(calls)} calls")
            cid, name, args = calls[0]
            history += [("call", cid, name, args), ("result", cid, f"sunny, {15 + turn} C")]
        else:
            history += [("assistant", text), ("user", question(turn // 2 + 1))]
        reusable = None if prev is None else prev[0] + prev[1]
        rows.append(
            {
                "turn": turn,
                "kind": "call" if force else "text",
                "prompt": prompt,
                "cached": cached,
                "completion": completion,
                "missed": None if reusable is None else reusable - cached,
            }
        )
        prev = (prompt, completion)
    return rows


# ---------------------------------------------------------------------------


def start_server(model: str, output_memory: bool = True) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EMBER_OUTPUT_MEMORY": "1" if output_memory else "0"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transport.cli",
            "serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sel.select(timeout=deadline - time.monotonic()):
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("ember: serving"):
            return proc, line.split(" at ", 1)[1].split()[0]
    proc.kill()
    raise SystemExit(f"ember serve did not start: {proc.stderr.read()}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument(
        "--no-output-memory",
        action="store_true",
        help="re-tokenize earlier answers instead of reusing their sampled ids (transport/turn/output_memory.py)",
    )
    ap.add_argument("--apis", default=",".join(APIS), help="comma-separated subset of " + ",".join(APIS))
    args = ap.parse_args(argv)
    proc, url = start_server(args.model, output_memory=not args.no_output_memory)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            for api in args.apis.split(","):
                for stream in (False, True):
                    results[f"{api}/{'stream' if stream else 'plain'}"] = session(client, api, stream, args.turns)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    names = list(results)
    print("| turn | kind | " + " | ".join(f"{n} cached/prompt (missed)" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for i in range(args.turns):
        cells = []
        for n in names:
            r = results[n][i]
            missed = "" if r["missed"] is None else f" ({r['missed']})"
            cells.append(f"{r['cached']}/{r['prompt']}{missed}")
        print(f"| {i + 1} | {results[names[0]][i]['kind']} | " + " | ".join(cells) + " |")
    for n in names:
        missed = [r["missed"] for r in results[n][1:]]
        print(f"{n}: missed from turn 2 on: max {max(missed)}, median {sorted(missed)[len(missed) // 2]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
