"""What crossed the wire between an agent client and Ember: a recording reverse proxy.

``ember serve`` keeps no request log, so the harness puts this proxy (Starlette
and httpx on 127.0.0.1) between the client and the server: ``ember launch
--port PROXY`` finds a server answering there (the proxy forwards
``/v1/models``) and reuses it. Every request is forwarded byte for byte; the
answer is streamed back unchanged while a parser reads it, so the record says
what the client was actually sent:

- the status code, and for an error its body's start;
- for a stream, whether it ended as its API ends one (Anthropic
  ``message_stop``, Chat Completions ``data: [DONE]``, Responses
  ``response.completed`` / ``response.incomplete``), ended early (the server
  closed it: a truncated stream), carried an error event, or was left by the
  client (it hung up, or was killed at the task's time cap: nobody's fault
  on the wire);
- every tool call in the answer (name and arguments, as the client will parse
  them), the answer's text, its stop reason and its usage (prompt and cached
  tokens);
- from the request: the tool names offered and the output limit asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

# the model-calling routes; anything else (/v1/models, count_tokens) is recorded but is not a turn
GENERATION_PATHS = {"/v1/messages": "anthropic", "/v1/chat/completions": "chat", "/v1/responses": "responses"}
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding", "upgrade"}
_RESPONSES_CALLS = {"function_call", "custom_tool_call", "local_shell_call"}


@dataclass
class ToolCall:
    name: str
    arguments: str  # as sent: a JSON object for a function call, free text for a custom tool
    custom: bool = False  # a freeform (custom) tool: its input is not JSON

    def well_formed(self) -> bool:
        """The client can parse it: a name, and JSON-object arguments unless the tool is freeform."""
        if not self.name:
            return False
        if self.custom:
            return True
        try:
            return isinstance(json.loads(self.arguments or "{}"), dict)
        except ValueError:
            return False


@dataclass
class Exchange:
    """One request through the proxy and what came back."""

    method: str
    path: str
    t_start: float
    api: str | None = None  # anthropic | chat | responses for a generation route
    stream: bool = False
    tools_offered: list[str] = field(default_factory=list)
    max_output: int | None = None
    lineage: str = ""  # what a continuation of the same conversation shares (system, tools, first message)
    status: int | None = None
    error_body: str = ""
    ended: str = "open"  # complete | truncated | error_event | client_gone | upstream_error | body
    tool_calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    stop_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    t_end: float | None = None

    @property
    def is_turn(self) -> bool:
        return self.api is not None and self.method == "POST"


def _request_facts(ex: Exchange, body: bytes) -> None:
    """Fill what the request says: streamed or not, the tools offered, the output limit, the lineage."""
    try:
        req = json.loads(body) if body else {}
    except ValueError:
        return
    if not isinstance(req, dict):
        return
    ex.stream = bool(req.get("stream"))
    names = []
    for t in req.get("tools") or []:
        if isinstance(t, dict):
            fn = t.get("function") if isinstance(t.get("function"), dict) else None
            names.append(str((fn or t).get("name") or t.get("type") or ""))
    ex.tools_offered = [n for n in names if n]
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(req.get(key), int):
            ex.max_output = req[key]
    first = (req.get("messages") or req.get("input") or [None])[:2]
    if isinstance(req.get("input"), str):
        first = [req["input"]]
    ex.lineage = json.dumps([req.get("system"), req.get("instructions"), ex.tools_offered, first], sort_keys=True)


class StreamReader:
    """Reads one answer's server-sent events (or its JSON body) into its ``Exchange``."""

    def __init__(self, ex: Exchange):
        self.ex = ex
        self._buf = ""
        self._body = b""
        self._blocks: dict[int, dict[str, Any]] = {}  # anthropic: open tool_use blocks by index
        self._chat_calls: dict[int, dict[str, str]] = {}

    def feed(self, chunk: bytes) -> None:
        if not self.ex.stream:
            self._body += chunk
            return
        self._buf += chunk.decode("utf-8", "replace").replace("\r\n", "\n")
        while "\n\n" in self._buf:
            raw, self._buf = self._buf.split("\n\n", 1)
            data = "\n".join(line[5:].lstrip() for line in raw.split("\n") if line.startswith("data:"))
            if data:
                self._event(data)

    def close(self) -> None:
        """The upstream ended: settle what the answer was."""
        if self._buf.strip():
            self.feed(b"\n\n")
        if not self.ex.stream:
            self._whole_body()
        elif self.ex.api == "chat":
            self._flush_chat_calls()

    # ---- streams ---------------------------------------------------------------------------------------------
    def _event(self, data: str) -> None:
        ex = self.ex
        if data == "[DONE]":
            self._flush_chat_calls()
            ex.ended = "complete"
            return
        try:
            ev = json.loads(data)
        except ValueError:
            return
        if not isinstance(ev, dict):
            return
        kind = ev.get("type")
        if kind == "error" or (ex.api == "chat" and "error" in ev):
            ex.ended = "error_event"
            ex.error_body = data[:300]
        elif ex.api == "anthropic":
            self._anthropic(kind, ev)
        elif ex.api == "responses":
            self._responses(kind, ev)
        elif ex.api == "chat":
            self._chat(ev)

    def _anthropic(self, kind: Any, ev: dict[str, Any]) -> None:
        ex = self.ex
        if kind == "message_start":
            self._usage_anthropic(ev.get("message", {}).get("usage"))
        elif kind == "content_block_start":
            block = ev.get("content_block") or {}
            if block.get("type") == "tool_use":
                self._blocks[ev.get("index", 0)] = {"name": block.get("name", ""), "json": ""}
        elif kind == "content_block_delta":
            d = ev.get("delta") or {}
            if d.get("type") == "text_delta":
                ex.text += d.get("text", "")
            elif d.get("type") == "input_json_delta" and ev.get("index", 0) in self._blocks:
                self._blocks[ev.get("index", 0)]["json"] += d.get("partial_json", "")
        elif kind == "content_block_stop" and ev.get("index", 0) in self._blocks:
            b = self._blocks.pop(ev.get("index", 0))
            ex.tool_calls.append(ToolCall(b["name"], b["json"] or "{}"))
        elif kind == "message_delta":
            ex.stop_reason = (ev.get("delta") or {}).get("stop_reason") or ex.stop_reason
            self._usage_anthropic(ev.get("usage"))
        elif kind == "message_stop":
            ex.ended = "complete"

    def _usage_anthropic(self, u: Any) -> None:
        if not isinstance(u, dict) or "input_tokens" not in u:
            if isinstance(u, dict) and "output_tokens" in u:
                self.ex.output_tokens = u["output_tokens"]
            return
        read, made = u.get("cache_read_input_tokens") or 0, u.get("cache_creation_input_tokens") or 0
        self.ex.prompt_tokens = u["input_tokens"] + read + made  # Anthropic counts the cached part apart
        self.ex.cached_tokens = read
        self.ex.output_tokens = u.get("output_tokens", self.ex.output_tokens)

    def _responses(self, kind: Any, ev: dict[str, Any]) -> None:
        ex = self.ex
        if kind == "response.output_text.delta":
            ex.text += ev.get("delta", "")
        elif kind == "response.output_item.done":
            item = ev.get("item") or {}
            if item.get("type") in _RESPONSES_CALLS:
                self._responses_call(item)
        elif kind in ("response.completed", "response.incomplete"):
            resp = ev.get("response") or {}
            self._usage_responses(resp.get("usage"))
            ex.stop_reason = kind.split(".")[1]
            ex.ended = "complete"
        elif kind == "response.failed":
            ex.ended = "error_event"
            ex.error_body = json.dumps(ev.get("response", {}).get("error"))[:300]

    def _responses_call(self, item: dict[str, Any]) -> None:
        t = item.get("type")
        if t == "custom_tool_call":
            self.ex.tool_calls.append(ToolCall(item.get("name", ""), item.get("input", ""), custom=True))
        elif t == "local_shell_call":
            self.ex.tool_calls.append(ToolCall("local_shell", json.dumps(item.get("action") or {})))
        else:
            self.ex.tool_calls.append(ToolCall(item.get("name", ""), item.get("arguments", "")))

    def _usage_responses(self, u: Any) -> None:
        if isinstance(u, dict):
            self.ex.prompt_tokens = u.get("input_tokens")
            self.ex.cached_tokens = (u.get("input_tokens_details") or {}).get("cached_tokens")
            self.ex.output_tokens = u.get("output_tokens")

    def _chat(self, ev: dict[str, Any]) -> None:
        ex = self.ex
        for ch in ev.get("choices") or []:
            d = ch.get("delta") or ch.get("message") or {}
            ex.text += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                slot = self._chat_calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            ex.stop_reason = ch.get("finish_reason") or ex.stop_reason
        self._usage_chat(ev.get("usage"))

    def _usage_chat(self, u: Any) -> None:
        if isinstance(u, dict):
            self.ex.prompt_tokens = u.get("prompt_tokens")
            self.ex.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            self.ex.output_tokens = u.get("completion_tokens")

    def _flush_chat_calls(self) -> None:
        for _, c in sorted(self._chat_calls.items()):
            self.ex.tool_calls.append(ToolCall(c["name"], c["arguments"]))
        self._chat_calls.clear()

    # ---- whole bodies ----------------------------------------------------------------------------------------
    def _whole_body(self) -> None:
        ex = self.ex
        ex.ended = "body"
        if ex.status is not None and ex.status >= 400:
            ex.error_body = self._body[:300].decode("utf-8", "replace")
            return
        try:
            body = json.loads(self._body)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        if ex.api == "anthropic":
            for block in body.get("content") or []:
                if block.get("type") == "text":
                    ex.text += block.get("text", "")
                elif block.get("type") == "tool_use":
                    ex.tool_calls.append(ToolCall(block.get("name", ""), json.dumps(block.get("input"))))
            ex.stop_reason = body.get("stop_reason")
            self._usage_anthropic(body.get("usage"))
        elif ex.api == "responses":
            for item in body.get("output") or []:
                if item.get("type") in _RESPONSES_CALLS:
                    self._responses_call(item)
                for part in item.get("content") or []:
                    ex.text += part.get("text", "") if part.get("type") == "output_text" else ""
            self._usage_responses(body.get("usage"))
        elif ex.api == "chat":
            self._chat(body)
            self._flush_chat_calls()


class Recorder:
    """The proxy's log: every exchange in arrival order (the harness runs one session at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exchanges: list[Exchange] = []

    def add(self, ex: Exchange) -> None:
        with self._lock:
            self.exchanges.append(ex)

    def since(self, mark: int) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges[mark:])

    def mark(self) -> int:
        with self._lock:
            return len(self.exchanges)


def proxy_app(upstream: str, recorder: Recorder, transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The proxy to ``upstream``; ``transport``: httpx's, for a test that puts an app there."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=10.0), transport=transport)

    async def forward(request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        ex = Exchange(request.method, path, time.monotonic(), api=GENERATION_PATHS.get(path))
        _request_facts(ex, body)
        recorder.add(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        req = client.build_request(
            request.method, path, params=request.url.query or None, headers=headers, content=body
        )
        try:
            up = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            ex.status, ex.ended, ex.error_body, ex.t_end = 502, "upstream_error", repr(e)[:300], time.monotonic()
            return Response(f"proxy: upstream unreachable: {e!r}", status_code=502)
        ex.status = up.status_code
        ex.stream = ex.stream and "text/event-stream" in up.headers.get("content-type", "")
        reader = StreamReader(ex)

        async def relay() -> AsyncIterator[bytes]:
            done = False
            try:
                async for chunk in up.aiter_raw():
                    reader.feed(chunk)
                    yield chunk
                done = True
            except httpx.HTTPError as e:
                ex.ended, ex.error_body = "upstream_error", repr(e)[:300]
            finally:
                if done:
                    reader.close()
                    if ex.stream and ex.ended == "open":
                        ex.ended = "truncated"  # the server closed the stream before its end event
                elif ex.ended == "open":
                    ex.ended = "client_gone"  # the client hung up (or was killed at the time cap)
                ex.t_end = time.monotonic()
                await up.aclose()

        out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP | {"content-encoding"}}
        return StreamingResponse(relay(), status_code=up.status_code, headers=out_headers)

    routes = [Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"])]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proxy:
    """The recording proxy in a thread of its own: ``with Proxy(upstream) as p: p.url``."""

    def __init__(self, upstream: str, port: int | None = None):
        self.recorder = Recorder()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            proxy_app(upstream, self.recorder), host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="agent-tasks-proxy", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve())

    def __enter__(self) -> Proxy:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
