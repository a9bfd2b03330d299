"""What every route does with a request's bytes and a generation's output,
shared by the OpenAI routes (transport/server/http.py), Anthropic Messages
(transport/anthropic/api.py) and Responses (transport/responses/api.py):
the body read under its byte cap, the strings a byte bound counts, a
non-streaming request's whole output (aborted if the client leaves), and the
OpenAI-shaped error mapping around a handler. It imports no route module, so
each route module imports it and none imports ``transport.server.http``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from engine.errors import EngineError
from engine.kv.namespace import cache_namespace
from transport.wire.api_keys import key_name
from transport.wire.errors import ApiError, from_engine_error
from transport.wire.metrics import TokenTimer
from transport.wire.sse import EventStream, Renderer

Handler = Callable[[Request, Any], Awaitable[Response]]


def endpoint(route: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Maps errors to OpenAI's shape and counts every answer by status."""

    async def answer(request: Request) -> Response:
        host = request.app.state.ember
        try:
            response = await handler(request, host)
        except ApiError as exc:
            response = exc.response()
        except EngineError as exc:
            response = from_engine_error(exc).response()
        except ClientDisconnect:
            response = Response(status_code=400)  # nobody is left to read it
        count_answer(request, host, route, response)
        return response

    return answer


def count_answer(request: Request, host: Any, route: str, response: Response) -> None:
    """One answer in /metrics: by route and status, and under named keys
    (``--api-keys``) by the key's name too (never its secret)."""
    status = str(response.status_code)
    host.metrics.http_requests.labels(route, status).inc()
    name = key_name(request)
    if name:
        host.metrics.key_requests.labels(name, route, status).inc()


def request_namespace(request: Request, adapter: str = "") -> str:
    """The cache namespace a request runs in (engine.kv.namespace): its API
    key's name under ``--api-keys``, else the empty one, and the LoRA adapter
    it runs with (``NAME@HASH``: ``ServerState.adapter_id``). Every cache a
    request can hit or fill — the prompt cache's tiers, the speculation seeds,
    the output memory, stored responses — is scoped by it; the backend reads
    the row's adapter from it too (``OpenRow.adapter``)."""
    return cache_namespace(key_scope=key_name(request), adapter=adapter)


def event_stream(
    host: Any,
    stream: Any,
    renderer: Renderer,
    timer: TokenTimer,
    on_usage: Callable[[Any], Awaitable[None]] | None = None,
) -> EventStream:
    """A streaming answer with the server's per-stream rules: the keep-alive
    interval and the send deadline (``--send-timeout``: a client that stops
    reading is aborted, or it would hold its batch slot until max_tokens).
    Every streaming route (completions, chat, Messages, Responses) builds its
    stream here, so a rule added to one reaches all four."""
    return EventStream(
        stream,
        renderer,
        keepalive_s=host.keepalive_s,
        send_timeout_s=host.send_timeout_s,
        on_tokens=timer.tokens,
        on_end=timer.done,
        on_usage=on_usage,
    )


def message_texts(messages: list[Any]) -> list[str]:
    """Every string in chat messages (contents, names, tool arguments…), for
    the byte bound checked before templating."""
    out: list[str] = []
    stack: list[Any] = list(messages)
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


async def read_body(request: Request, cap: int) -> bytes:
    too_large = ApiError(413, f"the request body is larger than {cap} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > cap:
            raise too_large
    return bytes(body)
